"""``lmcache-p2p status`` as operators run it: a real CLI process against real etcd and agent processes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from agent_helpers import AgentProcess, agent_yaml, config, stop_process

TOKENS = 1024 + 100  # 5 chunks per seed


def status(endpoints: tuple[str, ...] | list[str], cluster: str, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_P2P_")}
    return subprocess.run([sys.executable, "-m", "lmcache_p2p", "status", "--etcd", ",".join(endpoints),
                           "--cluster", cluster, *extra], capture_output=True, text=True, timeout=60, env=env)


def status_json(endpoints: tuple[str, ...] | list[str], cluster: str) -> tuple[int, dict[str, Any]]:
    r = status(endpoints, cluster, "--json")
    assert r.returncode in (0, 1), r.stderr
    return r.returncode, json.loads(r.stdout)


def wait_status(endpoints: tuple[str, ...] | list[str], cluster: str, predicate, timeout: float
                ) -> tuple[int, dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        rc, report = status_json(endpoints, cluster)
        if predicate(report) or time.monotonic() > deadline:
            return rc, report
        time.sleep(0.2)


def with_layout(path: Path, **layout: str) -> Path:
    data = yaml.safe_load(path.read_text())
    data.setdefault("layout", {}).update(layout)
    path.write_text(yaml.safe_dump(data))
    return path


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(tmp_path: Path, node: str, cluster: str, endpoints: tuple[str, ...], seeds: tuple[int, ...] = (),
          ttl: int = 3, **layout: str) -> AgentProcess:
    cfg = agent_yaml(tmp_path / f"{node}.yaml", node=node, cluster=cluster, endpoints=endpoints, ttl=ttl)
    if layout:
        with_layout(cfg, **layout)
    return AgentProcess(cfg, seeds=seeds, tokens=TOKENS, log=tmp_path / f"{node}.log")


def chunk_counts(report: dict[str, Any]) -> dict[str, int]:
    return {n["node_id"]: n["chunks_registered"] for n in report["nodes"]}


def test_live_mesh_then_a_hung_agent(etcd, cluster_name, tmp_path):
    # c holds a long lease: stopped (SIGSTOP), its record outlives the test's pause, its endpoint is silent. Two
    # minutes: in a suite run beside a CPU hog the table call after the JSON one found the cluster healthy, most
    # likely because c's 30 s lease had run out while stopped (its record gone); the test took 110 s there.
    agents = [start(tmp_path, "a", cluster_name, etcd.endpoints, seeds=(1,)),
              start(tmp_path, "b", cluster_name, etcd.endpoints, seeds=(2, 3)),
              start(tmp_path, "c", cluster_name, etcd.endpoints, ttl=120)]
    try:
        for a in agents:
            a.wait_ready()
        expected = {"a": 5, "b": 10, "c": 0}
        rc, report = wait_status(etcd.endpoints, cluster_name, lambda r: chunk_counts(r) == expected, 10)
        assert chunk_counts(report) == expected
        assert rc == 0 and report["healthy"] and report["flags"] == []
        assert report["cluster"] == cluster_name and report["etcd_members"] == {etcd.endpoints[0]: True}
        by_node = {n["node_id"]: n for n in report["nodes"]}
        assert all(n["responsive"] for n in by_node.values())
        layout = config(tmp_path / "a.yaml").layout
        assert by_node["a"]["tier_used_bytes"]["cpu"] == 4 * layout.chunk_bytes(256) + layout.chunk_bytes(100)
        assert by_node["c"]["tier_used_bytes"]["cpu"] == 0
        assert 0 < by_node["c"]["lease_ttl_left_s"] <= 120 and by_node["a"]["lease_ttl_left_s"] <= 3
        assert len({fp for n in by_node.values() for fp in n["fingerprints"]}) == 1

        table = status(etcd.endpoints, cluster_name)
        assert table.returncode == 0, table.stderr
        lines = table.stdout.splitlines()
        assert "nodes 3" in lines[0] and "etcd 1/1 up" in lines[0] and lines[-1] == "healthy"
        assert [ln.split()[0] for ln in lines[2:5]] == ["a", "b", "c"]
        assert [ln.split()[9] for ln in lines[2:5]] == ["5", "10", "0"]
        assert [ln.split()[7] for ln in lines[2:5]] == ["vllm-cpu"] * 3  # LAYOUT: each node's kv_layout

        stop_process(agents[2].proc.pid)
        rc, report = status_json(etcd.endpoints, cluster_name)
        assert rc == 1 and not report["healthy"]
        assert [f.split(":")[0] for f in report["flags"]] == ["unresponsive"]
        assert report["flags"][0].startswith("unresponsive: c ")
        assert {n["node_id"]: n["responsive"] for n in report["nodes"]} == {"a": True, "b": True, "c": False}
        table = status(etcd.endpoints, cluster_name)
        assert table.returncode == 1 and "HUNG?" in table.stdout and "! unresponsive: c" in table.stdout

        os.kill(agents[2].proc.pid, signal.SIGCONT)  # it resumes: its lease is still alive, nothing flagged
        rc, report = wait_status(etcd.endpoints, cluster_name, lambda r: r["healthy"], 10)
        assert rc == 0 and chunk_counts(report) == expected
    finally:
        for a in agents:
            a.stop()


def test_fingerprint_mismatch_and_a_dead_etcd_member(etcd, cluster_name, tmp_path):
    agents = [start(tmp_path, "a", cluster_name, etcd.endpoints),
              start(tmp_path, "f16", cluster_name, etcd.endpoints, kv_dtype="float16")]  # same model_id
    dead = f"127.0.0.1:{closed_port()}"
    try:
        for a in agents:
            a.wait_ready()
        rc, report = status_json([*etcd.endpoints, dead], cluster_name)
        assert rc == 1 and not report["healthy"]
        assert report["etcd_members"] == {etcd.endpoints[0]: True, dead: False}
        kinds = sorted(f.split(":")[0] for f in report["flags"])
        assert kinds == ["etcd-member-down", "fingerprint-mismatch"], report["flags"]
        mismatch = next(f for f in report["flags"] if f.startswith("fingerprint-mismatch"))
        fps = {n["node_id"]: n["fingerprints"][0] for n in report["nodes"]}
        assert fps["a"] != fps["f16"] and fps["a"] in mismatch and fps["f16"] in mismatch
        assert "'lmcache-p2p/tiny-llama'" in mismatch
        assert f"etcd-member-down: {dead}" in report["flags"]
        table = status([*etcd.endpoints, dead], cluster_name)
        assert table.returncode == 1 and "etcd 1/2 up" in table.stdout
    finally:
        for a in agents:
            a.stop()


def test_tenants_of_one_model_are_not_a_mismatch(etcd, cluster_name, tmp_path):
    agents = [start(tmp_path, "t1", cluster_name, etcd.endpoints, tenant_salt="acme"),
              start(tmp_path, "t2", cluster_name, etcd.endpoints, tenant_salt="globex")]
    try:
        for a in agents:
            a.wait_ready()
        # Beside a CPU hog a report once held a passing flag (an agent's /metrics slow to answer); a mismatch
        # of tenants would stand in every report.
        rc, report = wait_status(etcd.endpoints, cluster_name, lambda r: r["flags"] == [], 30)
        assert rc == 0 and report["flags"] == [] and len(report["nodes"]) == 2
    finally:
        for a in agents:
            a.stop()


def test_etcd_unreachable_exits_2(cluster_name):
    r = status([f"127.0.0.1:{closed_port()}"], cluster_name)
    assert r.returncode == 2 and "cannot read etcd" in r.stderr and r.stdout == ""
    r = status([f"127.0.0.1:{closed_port()}"], cluster_name, "--json")
    assert r.returncode == 2 and r.stdout == ""
