"""``lmcache-p2p bench transfer`` runs every transport against its baseline in paired rounds."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from lmcache_p2p.bench.transfer import _table
from lmcache_p2p.transfer.nixl_engine import nixl_available


def test_bench_transfer_pairs_every_path_with_its_baseline() -> None:
    """A small workload through the real owner process: every pull loads every chunk (the bench raises on a
    miss) and each ratio is the median of its rounds' ratios."""
    out = subprocess.run([sys.executable, "-m", "lmcache_p2p", "bench", "transfer", "--json", "--workload", "8x256KiB",
                          "--repeat", "3", "--latency-samples", "3"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    (w,) = summary["workloads"]
    assert (w["chunks"], w["chunk_bytes"]) == (8, 256 << 10)
    for ratio in ("tcp_vs_raw", "tcp_mac_vs_tcp", "tcp_tls_vs_tcp"):
        assert w[ratio] > 0
    # the CPU each end spent: every path moved bytes, so each end did some work; the owner of a NIXL pull
    # only pins (its CPU is what the requester's READ does not take), and no end can use more than the host's cores
    paths = ["tcp", "raw_socket", "tcp_mac", "tcp_tls"] + (["nixl", "raw_nixl", "nixl_mac"] if summary["nixl"] else [])
    cores = os.cpu_count() or 1
    for path in paths:
        assert w[f"{path}_requester_cpu_s_per_gb"] > 0 and 0 < w[f"{path}_requester_cores"] <= cores + 0.1, path
        assert w[f"{path}_owner_cpu_s_per_gb"] >= 0 and 0 <= w[f"{path}_owner_cores"] <= cores + 0.1, path
    table = _table(summary)  # what the bench prints without --json
    assert f"CPU, 8 x 256 KiB (s per GB requester/owner, cores busy): tcp {w['tcp_requester_cpu_s_per_gb']:.2f}/" \
        in table
    assert summary["nixl"] is nixl_available()
    if summary["nixl"]:
        assert w["nixl_gbps"] > 0 and w["raw_nixl_gbps"] > 0 and w["nixl_mac_gbps"] > 0
        assert w["nixl_vs_raw"] > 0 and w["nixl_mac_vs_nixl"] > 0 and w["nixl_loop_lag_ms"] >= 0
