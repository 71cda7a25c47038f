"""Invalidation across the mesh and the per-chunk TTL: real etcd, real agent processes, the real CLI.

"Gone everywhere" means: no block entry in etcd, no bytes in any tier (the agents' own metrics
say 0 used, 0 held) and no chunk file left on disk.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from agent_helpers import AgentProcess, agent_yaml, config, stop_process, wait_until
from test_agent_mesh import load_and_check, requester
from vllm_helpers import scrape

from lmcache_p2p.config import EtcdConfig
from lmcache_p2p.index.client import EtcdClient
from lmcache_p2p.index.schema import Schema
from lmcache_p2p.keys import Fingerprint
from lmcache_p2p.testing.synthetic import preload, synthetic_payload, synthetic_tokens

TOKENS = 1024 + 100  # 5 chunks per seed
CPU = "1MiB"  # two 512 KiB slots: of 5 chunks, 3 are written back to disk, so both tiers hold some


def start(tmp_path: Path, node: str, cluster: str, endpoints: tuple[str, ...], seeds: tuple[int, ...] = (1,),
          tiers: dict[str, Any] | None = None, ttl: int = 3, cpu: str = CPU, **layout: str) -> AgentProcess:
    path = agent_yaml(tmp_path / f"{node}.yaml", node=node, cluster=cluster, endpoints=endpoints,
                      disk=tmp_path / f"{node}-disk", cpu=cpu, ttl=ttl)
    data = yaml.safe_load(path.read_text())
    data["layout"] = dict(layout)
    data["tiers"].update(tiers or {})
    path.write_text(yaml.safe_dump(data))
    return AgentProcess(path, seeds=seeds, tokens=TOKENS, log=tmp_path / f"{node}.log")


def fp_hex(tmp_path: Path, node: str) -> str:
    return Fingerprint.of(config(tmp_path / f"{node}.yaml").layout).digest.hex()


def invalidate(etcd, cluster: str, *what: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_P2P_")}
    return subprocess.run([sys.executable, "-m", "lmcache_p2p", "invalidate", "--etcd", ",".join(etcd.endpoints),
                           "--cluster", cluster, *what], capture_output=True, text=True, timeout=60, env=env)


def block_entries(etcd, cluster: str) -> list[tuple[str, str]]:
    """Every block entry of the cluster as ``(fingerprint hex, node)``."""
    schema = Schema(cluster)

    async def read() -> list[bytes]:
        async with EtcdClient(EtcdConfig(endpoints=etcd.endpoints, timeout_s=3.0)) as client:
            return [kv.key for kv in (await client.get_prefix(schema.blocks))[0]]

    out = []
    for key in asyncio.run(read()):
        fp, _, node = key[len(schema.blocks):].decode().split("/")
        out.append((fp, node))
    return out


def held(agent: AgentProcess) -> dict[str, float]:
    m = scrape(f"http://127.0.0.1:{agent.info['metrics_port']}/metrics")
    return {"used": sum(m[f'lmcache_p2p_tier_used_bytes{{tier="{t}"}}'] for t in ("cpu", "disk")),
            "chunks": sum(m[f'lmcache_p2p_chunks_held{{tier="{t}"}}'] for t in ("cpu", "disk")),
            "disk": m['lmcache_p2p_chunks_held{tier="disk"}'],
            **{r: m.get(f'lmcache_p2p_invalidated_chunks_total{{reason="{r}"}}', 0.0)
               for r in ("fingerprint", "tenant", "node", "ttl")}}


def files(tmp_path: Path, node: str) -> list[Path]:
    return sorted((tmp_path / f"{node}-disk").glob("*.chunk"))


def count(entries: list[tuple[str, str]], node: str) -> int:
    return sum(1 for _, n in entries if n == node)


def test_fingerprint_invalidation_removes_entries_and_bytes_everywhere(etcd, cluster_name, tmp_path):
    agents = [start(tmp_path, "a", cluster_name, etcd.endpoints, seeds=(1,)),
              start(tmp_path, "b", cluster_name, etcd.endpoints, seeds=(1, 2))]
    try:
        a, b = (p.wait_ready() for p in agents)
        assert wait_until(lambda: len(block_entries(etcd, cluster_name)) == 15, 10)
        for agent, node, n in ((a, "a", 5), (b, "b", 10)):
            # a chunk on its way from the CPU pool to disk is in neither count for a moment: settled first
            assert wait_until(lambda agent=agent, n=n: held(agent)["chunks"] == n, 10), held(agent)
            before = held(agent)
            assert before["chunks"] == n and before["disk"] > 0 and before["used"] > 0
            assert len(files(tmp_path, node)) > 0
        fp = fp_hex(tmp_path, "a")

        r = invalidate(etcd, cluster_name, "--fingerprint", fp[:12].upper(), "--wait", "20")
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"fingerprint={fp[:12]}" in r.stdout and "15 block entries match" in r.stdout
        assert "removed 15 block entries" in r.stdout

        assert block_entries(etcd, cluster_name) == []
        for agent, node, n in ((a, "a", 5), (b, "b", 10)):
            assert wait_until(lambda agent=agent: held(agent)["chunks"] == 0, 5)
            after = held(agent)
            assert after["used"] == 0 and after["fingerprint"] == n and after["ttl"] == 0
            assert files(tmp_path, node) == []
        # A stop writes CPU chunks back to disk: nothing is left to write, nothing comes back.
        assert agents[1].stop() == 0 and files(tmp_path, "b") == []
    finally:
        for p in agents:
            p.stop()


def test_node_invalidation_and_catch_up_on_restart(etcd, cluster_name, tmp_path):
    """``--node a`` covers what a computed, wherever it is held (the origin in each chunk's header), and
    what a holds: c, which pulled a's chunks and computed its own, loses only the pulled copies."""
    agents = [start(tmp_path, "a", cluster_name, etcd.endpoints),
              start(tmp_path, "b", cluster_name, etcd.endpoints, seeds=(2,)),
              start(tmp_path, "d", cluster_name, etcd.endpoints, seeds=(3,))]
    c = requester(tmp_path, cluster_name, etcd.endpoints)
    try:
        a, b, d = (p.wait_ready() for p in agents)
        assert wait_until(lambda: len(block_entries(etcd, cluster_name)) == 15, 10)
        pulled = sum(load_and_check(c, seed=1, num_tokens=TOKENS)[0])  # a's chunks (those the budget takes)
        assert pulled >= 2
        assert preload(c, 7, TOKENS) == 5
        own = synthetic_tokens(7, TOKENS)
        assert wait_until(lambda: count(block_entries(etcd, cluster_name), "c") == 5 + pulled, 10)
        r = invalidate(etcd, cluster_name, "--node", "a", "--wait", "20")
        assert r.returncode == 0 and "removed 5 block entries" in r.stdout, r.stdout + r.stderr
        assert wait_until(lambda: count(block_entries(etcd, cluster_name), "c") == 5, 10)
        entries = block_entries(etcd, cluster_name)
        assert count(entries, "a") == 0 and count(entries, "b") == 5 and count(entries, "d") == 5
        assert wait_until(lambda: held(a)["chunks"] == 0, 5)
        assert held(a)["used"] == 0 and held(a)["node"] == 5 and files(tmp_path, "a") == []
        assert held(b)["chunks"] == 5 and held(b)["node"] == 0 and files(tmp_path, "b")
        assert len(c.tiers.inventory()) == 5 and c.lookup(own).hit_tokens == TOKENS  # its own, all of them

        # d is down when its invalidation is issued: on restart it reads it and drops its disk.
        assert d.stop() == 0 and len(files(tmp_path, "d")) == 5
        r = invalidate(etcd, cluster_name, "--node", "d")
        assert r.returncode == 0 and "0 block entries match" in r.stdout, r.stdout + r.stderr
        agents[2] = AgentProcess(tmp_path / "d.yaml", log=tmp_path / "d2.log").wait_ready()
        assert agents[2].info["held"] == 0 and files(tmp_path, "d") == []
        assert held(agents[2])["node"] == 5
        assert wait_until(lambda: count(block_entries(etcd, cluster_name), "d") == 0, 5)
        assert count(block_entries(etcd, cluster_name), "b") == 5
    finally:
        c.stop()
        for p in agents:
            p.stop()


def test_tenant_invalidation_spares_other_tenants(etcd, cluster_name, tmp_path):
    agents = [start(tmp_path, "t1", cluster_name, etcd.endpoints, tenant_salt="acme"),
              start(tmp_path, "t2", cluster_name, etcd.endpoints, tenant_salt="globex")]
    try:
        t1, t2 = (p.wait_ready() for p in agents)
        fp1, fp2 = fp_hex(tmp_path, "t1"), fp_hex(tmp_path, "t2")
        assert fp1 != fp2
        assert wait_until(lambda: len(block_entries(etcd, cluster_name)) == 10, 10)
        r = invalidate(etcd, cluster_name, "--tenant", "acme", "--wait", "20")
        assert r.returncode == 0 and "removed 5 block entries" in r.stdout, r.stdout + r.stderr
        assert block_entries(etcd, cluster_name) == [(fp2, "t2")] * 5
        assert wait_until(lambda: held(t1)["chunks"] == 0, 5)
        assert held(t1)["used"] == 0 and held(t1)["tenant"] == 5 and files(tmp_path, "t1") == []
        assert held(t2)["chunks"] == 5 and held(t2)["tenant"] == 0 and len(files(tmp_path, "t2")) == 3
    finally:
        for p in agents:
            p.stop()


def test_chunk_ttl_expires_chunks_in_every_tier(etcd, cluster_name, tmp_path):
    # What x stored is read from its ready line and its disk dir, not from a scrape: on a loaded machine
    # a busy agent's metrics answered after the TTL (CI saw 4 of 5 chunks). Its chunks are still moving
    # to disk when it says it is ready.
    agents = [start(tmp_path, "x", cluster_name, etcd.endpoints, tiers={"chunk_ttl_s": 6})]
    try:
        x = agents[0].wait_ready()
        t_ready = time.monotonic()
        assert x.info["stored"] == 5
        assert wait_until(lambda: len(files(tmp_path, "x")) == 3, 5)
        agents.append(start(tmp_path, "y", cluster_name, etcd.endpoints, seeds=(2,)))  # no TTL: keeps its chunks
        y = agents[1].wait_ready()
        assert wait_until(lambda: count(block_entries(etcd, cluster_name), "x") == 0, 15)
        assert time.monotonic() - t_ready > 2.0  # not before their time
        assert wait_until(lambda: held(x)["chunks"] == 0, 10)
        assert held(x)["used"] == 0 and held(x)["ttl"] == 5 and files(tmp_path, "x") == []
        assert count(block_entries(etcd, cluster_name), "y") == 5 and held(y)["chunks"] == 5
    finally:
        for p in agents:
            p.stop()


def test_invalidate_cli_rejects_bad_input_and_dead_etcd(etcd, cluster_name):
    r = invalidate(etcd, cluster_name, "--fingerprint", "abc")  # too short: would match far too much
    assert r.returncode == 2 and "fingerprint" in r.stderr
    r = invalidate(etcd, cluster_name, "--fingerprint", "xyz12345")
    assert r.returncode == 2
    r = invalidate(etcd, cluster_name, "--node", "a", "--tenant", "t")
    assert r.returncode == 2
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_P2P_")}
    r = subprocess.run([sys.executable, "-m", "lmcache_p2p", "invalidate", "--etcd", "127.0.0.1:1", "--node", "a"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and "cannot reach etcd" in r.stderr


def test_invalidation_is_a_barrier_for_lagging_stopped_and_restarted_nodes(etcd_cluster, cluster_name, tmp_path):
    """A standing invalidation covers every chunk computed before it, wherever it turns up later."""
    eps = etcd_cluster.endpoints
    lag = start(tmp_path, "lag", cluster_name, (eps[2],), ttl=10, cpu="16MiB")  # serves all 5 from memory
    stopped = start(tmp_path, "s", cluster_name, eps)
    restarted = start(tmp_path, "r", cluster_name, eps)
    agents = [lag, stopped, restarted]
    c = None
    try:
        for p in agents:
            p.wait_ready()
        fp = fp_hex(tmp_path, "s")
        assert fp_hex(tmp_path, "lag") == fp
        assert wait_until(lambda: len(block_entries(etcd_cluster, cluster_name)) == 15, 10)
        assert restarted.stop() == 0 and len(files(tmp_path, "r")) == 5  # down, its chunks on disk
        stop_process(stopped.proc.pid)  # hung while the invalidation is issued
        etcd_cluster.kill_member(2)  # `lag` talks to this member only: it keeps serving, but can't hear etcd

        r = invalidate(etcd_cluster, cluster_name, "--fingerprint", fp)
        assert r.returncode == 0, r.stdout + r.stderr

        # A requester that knows the invalidation pulls from the lagging peer: the chunks arrive intact
        # and are refused at the pool's gate, never stored, never served.
        c = requester(tmp_path, cluster_name, (eps[0], eps[1]))
        tokens = synthetic_tokens(1, TOKENS)
        keys = c.keys_for(tokens)[0]
        plan = c.lookup(tokens)
        assert plan.chunks and {ch.source for ch in plan.chunks} <= {"lag", "s"}
        assert c.load(plan, [memoryview(bytearray(c.chunk_bytes)) for _ in plan.chunks]) == [False] * len(plan.chunks)
        m = c.metrics.registry
        assert m.get_sample_value("lmcache_p2p_pull_chunks_total", {"transport": "tcp", "outcome": "invalidated"}) >= 1
        assert m.get_sample_value("lmcache_p2p_invalidated_chunks_total", {"reason": "fingerprint"}) >= 1
        assert all(c.tiers.where(k) is None for k in keys)

        # The stopped node continues: it drops its chunks and does not announce them again.
        os.kill(stopped.proc.pid, signal.SIGCONT)
        assert wait_until(lambda: held(stopped)["chunks"] == 0, 10)
        assert held(stopped)["fingerprint"] == 5 and files(tmp_path, "s") == []
        assert wait_until(lambda: count(block_entries(etcd_cluster, cluster_name), "s") == 0, 10)

        # The lagging node hears etcd again: the same.
        etcd_cluster.restart_member(2)
        assert wait_until(lambda: held(lag)["chunks"] == 0, 15)
        assert wait_until(lambda: count(block_entries(etcd_cluster, cluster_name), "lag") == 0, 10)

        # The node restarted from disk reads the standing record before it publishes anything.
        agents[2] = AgentProcess(tmp_path / "r.yaml", log=tmp_path / "r2.log").wait_ready()
        assert agents[2].info["held"] == 0 and files(tmp_path, "r") == []
        assert held(agents[2])["fingerprint"] == 5
        assert count(block_entries(etcd_cluster, cluster_name), "r") == 0

        # Chunks computed after the barrier are not covered: stored, announced, and loadable.
        c.store(tokens, [memoryview(synthetic_payload(k, c.config.layout.chunk_bytes(e - s)))
                         for k, (s, e) in zip(keys, c.keys_for(tokens)[1], strict=True)]).result(10)
        assert all(c.tiers.where(k) is not None for k in keys)
        assert wait_until(lambda: count(block_entries(etcd_cluster, cluster_name), "c") == 5, 10)
    finally:
        if c is not None:
            c.stop()
        for p in agents:
            p.stop()
