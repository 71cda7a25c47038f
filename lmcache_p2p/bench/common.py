"""Shared helpers for the ``bench`` commands: their parser, timing, medians, output."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..usage import HelpFormatter

DTYPES = ("bfloat16", "float32")


def bench_parser(name: str, description: str | None, keeps: str | None = "logs and configs",
                 **kwargs: Any) -> argparse.ArgumentParser:
    """The parser of ``lmcache-p2p bench <name>``, with what every bench takes: ``--json`` and (``keeps``:
    what the bench writes to its work dir) ``--workdir``."""
    parser = argparse.ArgumentParser(prog=f"lmcache-p2p bench {name}", description=description,
                                     formatter_class=HelpFormatter, **kwargs)
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    if keeps is not None:
        parser.add_argument("--workdir", help=f"keep {keeps} here (default: a temp dir)")
    return parser


def add_prefix_workload(parser: argparse.ArgumentParser, num_prompts: int) -> None:
    """The shared-prefix workload of ``vllm bench serve`` (prefix_repetition) and its TTFT objective."""
    parser.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    parser.add_argument("--num-prompts", type=int, default=num_prompts)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--prefix-len", type=int, default=2048)
    parser.add_argument("--suffix-len", type=int, default=64)
    parser.add_argument("--num-prefixes", type=int, default=8)


def best_of(fn: Callable[[], None], rounds: int) -> float:
    """Median wall time of ``rounds`` calls of ``fn`` (after one warm-up call)."""
    fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3) if seconds > 0 else float("inf")


def ratio(ours: float, base: float) -> float:
    return round(ours / base, 3) if base > 0 else 0.0


def run_in_workdir(run: Callable[[argparse.Namespace, Path], dict[str, Any]], args: argparse.Namespace,
                   prefix: str) -> dict[str, Any]:
    """``run(args, work)`` in ``args.workdir`` (kept: logs, configs) or in a temporary dir."""
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
        return run(args, Path(args.workdir))
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        return run(args, Path(tmp))


def emit(result: dict[str, object], as_json: bool, title: str) -> None:
    """A readable table, or (``--json``) one JSON object on the last line."""
    if as_json:
        print(json.dumps(result))
        return
    print(title)
    width = max(len(k) for k in result)
    for key, value in result.items():
        print(f"  {key:<{width}}  {value}")


def progress(bench: str, message: str) -> None:
    """One line of progress on stderr (``[bench <name>] ...``): stdout stays the results."""
    print(f"[bench {bench}] {message}", file=sys.stderr, flush=True)
