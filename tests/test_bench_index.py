"""``lmcache-p2p bench index`` runs end to end and its control-plane fields say what happened.

Correctness only (the numbers are the benchmark's business): every entry came back after the
forced lease loss and after the etcd restart, and the lease loss was counted.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_bench_index_reports_republish_and_recovery() -> None:
    r = subprocess.run([sys.executable, "-m", "lmcache_p2p", "bench", "index", "--json", "--chunks", "2000",
                        "--fault-chunks", "1000", "--unsafe-no-fsync"], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["chunks"] == 2000 and out["fault_chunks"] == 1000
    assert out["lease_losses"] == 1  # the revoke; the etcd restart kept the lease alive
    assert 0 < out["lease_loss_detected_s"] < 2 * out["fault_lease_ttl_s"]
    assert out["republish_chunks_per_s"] > 0
    assert 0 <= out["recovery_s_after_etcd_restart"] < 2 * out["fault_lease_ttl_s"]
