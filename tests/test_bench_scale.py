"""``bench scale`` at CI size: a real 3-member etcd, two worker processes of ten simulated agents each (real
sessions, publishers and sampled mirrors). Correctness only, timings live in the bench: every chunk reaches
a newcomer's mirror, every probe is seen, a killed process's chunks leave the mirrors with its leases,
compaction runs, and the extrapolation names a first limit."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_a_ci_sized_control_plane_run_measures_every_phase(tmp_path):
    cmd = [sys.executable, "-m", "lmcache_p2p", "bench", "scale", "--processes", "2", "--agents", "10",
           "--mirrors", "2", "--chunks", "50", "--churn", "10", "--seconds", "5", "--ttl", "3",
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
    assert r["at"]["first_limit"] in r["at"]["share_of_limit"]
