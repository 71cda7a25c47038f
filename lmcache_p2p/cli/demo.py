"""``lmcache-p2p demo``: two vLLM nodes sharing KV cache through the mesh, on a private etcd.

Creates the tiny model, starts a private etcd and two vLLM-on-CPU engines (node A and node B),
each with the LMCacheP2PConnector and its own cache agent. Node A reads a long document; node B
is asked about the same document and pulls A's KV chunks instead of recomputing them. Prints
both TTFTs, the speedup and the ``status`` table, and stops everything it started.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import sys
import tempfile
import threading
import time
from pathlib import Path

from ..bench.vllm import agent_config
from ..config import load_config
from ..index.etcd_server import EtcdServer
from ..testing.engine_client import EngineProcess
from ..testing.tiny_model import create_tiny_model
from .status import collect, render


def say(step: int, total: int, text: str) -> None:
    print(f"[{step}/{total}] {text}", flush=True)


def wait_with_progress(engines: list[EngineProcess], label: str) -> float:
    t0 = time.monotonic()
    done = threading.Event()

    def ticker() -> None:
        while not done.wait(5.0):
            print(f"      ... {label}: {time.monotonic() - t0:.0f}s", flush=True)

    thread = threading.Thread(target=ticker, daemon=True)
    thread.start()
    try:
        for engine in engines:
            engine.wait_ready(timeout=600)
    finally:
        done.set()
        thread.join()
    return time.monotonic() - t0


def document_tokens(model: Path, n: int) -> list[int]:
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # the whole file is longer than the model's context; we cut it
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    text = Path(inspect.__file__).read_text()
    ids = list(tokenizer(text)["input_ids"])
    if len(ids) < n:
        raise RuntimeError(f"document has only {len(ids)} tokens, need {n}")
    return ids[:n]


def run(work: Path, tokens: int, dtype: str) -> int:
    total = 6
    t0 = time.monotonic()
    say(1, total, "creating the tiny test model (random-weight Llama + BPE tokenizer, offline)")
    model = create_tiny_model(work / "tiny-llama")
    doc = document_tokens(model, tokens)
    print(f"      model ready in {time.monotonic() - t0:.1f}s: {model}")
    with EtcdServer(base_dir=str(work)) as etcd:
        say(2, total, f"private etcd at {etcd.endpoint} (the embedded default)")
        cfg_a = agent_config(work / "node-a.yaml", "node-a", etcd.endpoints, "tcp", "demo")
        cfg_b = agent_config(work / "node-b.yaml", "node-b", etcd.endpoints, "tcp", "demo")
        say(3, total, "starting vLLM node A and node B, each with LMCacheP2PConnector and its cache agent")
        a = EngineProcess(model, cfg_a, name="node-a", log_path=work / "node-a.log", dtype=dtype)
        b = EngineProcess(model, cfg_b, name="node-b", log_path=work / "node-b.log", dtype=dtype)
        try:
            elapsed = wait_with_progress([a, b], "engines starting")
            print(f"      both engines ready in {elapsed:.0f}s (logs in {work})")
            a.ttft([doc[::-1]])  # warm-up request on each engine: the first one is always slow
            b.ttft([[t + 1 for t in doc[: tokens // 2]]])
            say(4, total, f"node A reads a {len(doc):,}-token document (nothing cached anywhere)")
            on_a = a.ttft([doc])[0]
            print(f"      node A: TTFT {1000 * on_a['ttft_s']:.1f} ms, {on_a['num_cached_tokens']} tokens from cache;"
                  f" its chunks are now registered in etcd")
            # vLLM-CPU's OpenMP threads keep spinning for a while after a step; on a small machine they
            # would share node B's cores, so let node A settle before timing node B.
            time.sleep(1.5)
            say(5, total, "node B is asked about the same document")
            on_b = b.ttft([doc])[0]
            speedup = on_a["ttft_s"] / on_b["ttft_s"]
            print(f"      node B: TTFT {1000 * on_b['ttft_s']:.1f} ms, {on_b['num_cached_tokens']:,} of {len(doc):,} "
                  f"tokens pulled from node A's memory -> {speedup:.1f}x faster than computing them")
            print(f"      same first token on both nodes: {on_a['tokens'] == on_b['tokens']}")
            say(6, total, "lmcache-p2p status")
            report = asyncio.run(collect(load_config(cfg_b)))
            print(render(report))
            ok = on_b["num_cached_tokens"] > 0 and on_a["tokens"] == on_b["tokens"]
        finally:
            print("cleaning up: stopping both engines and etcd", flush=True)
            a.stop()
            b.stop()
    print(f"demo {'succeeded' if ok else 'FAILED'} in {time.monotonic() - t0:.0f}s")
    return 0 if ok else 1


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="lmcache-p2p demo", description=__doc__)
    parser.add_argument("--tokens", type=int, default=2048, help="document length in tokens")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--workdir", help="keep model, configs and logs here (default: a temp dir)")
    args = parser.parse_args(argv)
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
        return run(Path(args.workdir), args.tokens, args.dtype)
    with tempfile.TemporaryDirectory(prefix="lmcache-p2p-demo-") as tmp:
        return run(Path(tmp), args.tokens, args.dtype)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
