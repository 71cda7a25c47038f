"""What the commands share: prompt files (``read_tokens``) and the one way a command reaches etcd,
with the same config an agent uses and the same errors.

    parser = etcd_tool_parser("lmcache-p2p status", __doc__)    # --etcd, --cluster, --config
    config = tool_config(args, "lmcache-p2p status")          # exits 2 naming what is wrong
    with etcd_endpoints(config, prog, private_ok=True) as c:  # the embedded default when none is set

Endpoints, TLS (``etcd.ca_cert`` / ``cert_cert`` / ``cert_key``), user and password come from the
config file (``--config``, else ``LMCACHE_P2P_CONFIG``), the environment (``LMCACHE_P2P_ETCD_*``) and
the flags, in that order of precedence with the flags last, exactly as for an agent
(``config.load_config``). A tool exists to read etcd, so it waits the full ``etcd.timeout_s`` for it
rather than an agent's short start-up wait.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from ..config import AgentConfig, load_config
from ..usage import HelpFormatter


def add_etcd_arguments(parser: argparse.ArgumentParser, *, default_help: str = "config/env") -> None:
    parser.add_argument("--etcd", help=f"comma-separated etcd endpoints (default: {default_help})")
    parser.add_argument("--cluster", help="cluster name (default: config/env)")
    parser.add_argument("--config", help="agent config file to take etcd settings (TLS, auth) and chunk size from "
                        "(default: $LMCACHE_P2P_CONFIG)")


def etcd_tool_parser(prog: str, description: str | None, *,
                     default_help: str = "config/env") -> argparse.ArgumentParser:
    """The parser of a command that reads etcd: the CLI's help format and :func:`add_etcd_arguments`."""
    parser = argparse.ArgumentParser(prog=prog, description=description, formatter_class=HelpFormatter)
    add_etcd_arguments(parser, default_help=default_help)
    return parser


def tool_config(args: argparse.Namespace, prog: str, *, require_endpoints: bool = True) -> AgentConfig:
    overrides = {k: v for k, v in (("etcd.endpoints", args.etcd), ("cluster", args.cluster)) if v}
    try:
        config = load_config(args.config, overrides=overrides)
    except (ValueError, OSError) as exc:
        print(f"{prog}: invalid configuration: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc
    if require_endpoints and not config.etcd.endpoints:
        print(f"{prog}: no etcd endpoints (use --etcd or LMCACHE_P2P_ETCD_ENDPOINTS)", file=sys.stderr)
        raise SystemExit(2)
    return dataclasses.replace(config, etcd=dataclasses.replace(
        config.etcd, start_wait_s=max(config.etcd.start_wait_s, config.etcd.timeout_s)))


@contextlib.contextmanager
def etcd_endpoints(config: AgentConfig, prog: str, *, private_ok: bool = False) -> Iterator[AgentConfig]:
    """``config`` as it is, or, with no endpoints and ``private_ok``, pointing at a private etcd on
    loopback (a temporary data dir) that stops when the block ends."""
    if config.etcd.endpoints or not private_ok:
        yield config
        return
    from ..index.etcd_server import EtcdServer

    with EtcdServer() as server:
        print(f"# {prog}: no --etcd: started a private etcd at {server.endpoint}", file=sys.stderr, flush=True)
        yield dataclasses.replace(config, etcd=dataclasses.replace(config.etcd, endpoints=server.endpoints))


def read_tokens(args: argparse.Namespace) -> list[int]:
    """A prompt's token ids: ``--tokens FILE`` (a JSON list or whitespace-separated ids) or ``--text FILE``
    tokenized with ``--model``'s tokenizer."""
    if args.tokens:
        text = Path(args.tokens).read_text().strip()
        data = json.loads(text) if text.startswith("[") else [int(t) for t in text.split()]
        return [int(t) for t in data]
    if not args.model:
        raise SystemExit("--text needs --model (the tokenizer to use)")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    return list(tokenizer(Path(args.text).read_text())["input_ids"])


def stop_on_signals() -> threading.Event:
    """An event set by SIGTERM or SIGINT: a long-running command waits on it, then stops cleanly."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return stop
