"""``bench scale`` at CI size: a real 3-member etcd, two worker processes of ten simulated agents each (real
sessions, publishers and sampled mirrors). Correctness only, timings live in the bench: every chunk reaches
a newcomer's mirror, every probe is seen, a killed process's chunks leave the mirrors with its leases,
compaction runs, extra watch streams add deliveries, and the extrapolation names a first limit."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_a_ci_sized_control_plane_run_measures_every_phase(tmp_path):
    cmd = [sys.executable, "-m", "lmcache_p2p", "bench", "scale", "--processes", "2", "--agents", "10",
           "--mirrors", "2", "--chunks", "50", "--churn", "10", "--seconds", "5", "--ttl", "3",
           "--extra-watchers", "8", "--lookups-per-s", "20",
           "--workdir", str(tmp_path / "work"), "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=540)
    assert out.returncode == 0, out.stderr[-4000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["nodes"] == 20 and r["publish_chunks_per_s"] > 0
    assert r["new_node_mirror_chunks"] >= 20 * 50 + r["probes"] - 1  # every chunk, every probe announced
    assert r["probes"] > 0 and r["probe_sightings"] > 0 and r["fanout_p50_ms"] is not None
    assert r["etcd_writes_per_s"] > 0 and r["churn_events_per_s"] > 0
    assert r["death_seen_s"] is not None  # the killed process's ten leases ran out, their chunks left
    assert r["mirror_bytes_per_chunk"] > 0 and r["etcd_bytes_per_chunk"] > 0
    assert r["etcd_in_use_after_compaction"] <= r["etcd_in_use_before_compaction"]
    # The second churn phase adds eight bare watch streams: each event reaches more followers than in the first
    # (per event, not per second: how fast the churn runs is the host's business).
    assert r["watch_deliveries_per_s"] > 0 and r["watch_deliveries_per_event"] > 0
    assert r["extra_phase_deliveries_per_event"] > r["watch_deliveries_per_event"]
    assert r["etcd_cpu_cores"] > 0 and r["mirror_cpu_us_per_event"] > 0
    assert r["at"]["first_limit"] in r["at"]["share_of_limit"]
    # The third phase: owner lookups straight from etcd while the agents churn; half the keys are held.
    assert r["lookups_per_s"] > 0 and r["lookups_failed"] == 0 and r["lookup_p50_ms"] is not None
    # Every lookup finds the held half, but for while the probe agent's lease lapses on a busy host (its
    # entries are gone until it republishes under the next one: seen once beside the whole suite, 0.447)
    assert 0.4 <= r["lookup_held_share"] <= 0.5


def test_the_extrapolation_scales_each_cost_by_what_drives_it():
    from lmcache_p2p.bench.scale import extrapolate

    m = {"nodes": 10, "etcd_writes_per_node_s": 2.0, "churn_events_per_s": 100.0, "etcd_bytes_per_chunk": 500.0,
         "mirror_bytes_per_chunk": 100.0, "new_node_sync_s": 1.0, "new_node_mirror_chunks": 1000,
         "mirror_cpu_us_per_event": 50.0, "etcd_cpu_us_per_delivery": 2.0, "etcd_cpu_cores_without_deliveries": 0.1,
         "lookup_etcd_cpu_us": 150.0, "lookup_p50_ms": 2.0}
    at = extrapolate(m, 1000, 1_000_000, member_cores=16.0)["at"]
    assert at["etcd_writes_per_s"] == 2000 and at["chunk_events_per_s"] == 10_000
    assert at["watch_deliveries_per_s"] == 10_000_000  # every node receives every node's events
    assert at["node_cpu_cores_following_index"] == 0.5  # 10,000 events/s x 50 us
    assert at["etcd_cpu_cores_per_member"] == round((0.1 * 100 + 2e-6 * 10_000_000) / 3, 1)  # 10.0
    assert at["etcd_db_bytes"] == 500_000_000 and at["new_node_sync_s"] == 1000.0
    assert at["first_limit"] == "etcd member CPU (16 cores)"  # 0.625 of it, ahead of node CPU (0.5)
    alt = at["lookup_design"]  # no block watch: 10 lookups a second per node instead
    assert alt["lookups_per_s"] == 10_000 and alt["etcd_cpu_cores_per_member"] == round((10 + 1.5) / 3, 1)
    assert alt["first_limit"] == "etcd member CPU (16 cores)" and alt["share_of_limit"]["etcd write rate"] == 0.2
