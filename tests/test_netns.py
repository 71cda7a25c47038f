"""Many hosts, real faults: every node in its own network namespace (its own address, never
loopback), etcd members on three of them, real agents, and links that are cut, partitioned and
throttled underneath them (:mod:`lmcache_p2p.testing.netlab`)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from netns_helpers import MeshNode, node_yaml, until

from lmcache_p2p.index.etcd_server import EtcdCluster
from lmcache_p2p.plan import LOCAL
from lmcache_p2p.testing import netlab
from lmcache_p2p.testing.netlab import NetLab

pytestmark = pytest.mark.skipif(netlab.available() is not None, reason=f"netns: {netlab.available()}")
ETCD_HOSTS = (0, 1, 2)
A, B = 3, 4  # the hosts of the two nodes


@pytest.fixture(scope="module")
def lab() -> Iterator[NetLab]:
    with NetLab(5) as lab:
        yield lab
    assert not [n for n in netlab.leftovers() if lab.run_id in n], "the lab left namespaces or links behind"


@pytest.fixture(scope="module")
def etcd(lab: NetLab) -> Iterator[EtcdCluster]:
    cluster = lab.etcd(ETCD_HOSTS, unsafe_no_fsync=True).start()
    yield cluster
    cluster.stop()


def start(lab: NetLab, host: int, name: str, cluster: str, etcd: EtcdCluster, tmp_path: Path,
          seeds: tuple[int, ...] = (), ttl: int = 3, disk: bool = False) -> MeshNode:
    cfg = node_yaml(lab, host, tmp_path / f"{name}.yaml", node=name, cluster=cluster, endpoints=etcd.endpoints,
                    ttl=ttl, disk=tmp_path / f"{name}-disk" if disk else None)
    return MeshNode(lab, host, cfg, seeds, log=tmp_path / f"{name}.log")


def listening_addresses(lab: NetLab, host: int) -> set[str]:
    """Addresses of the TCP sockets listening inside ``host`` (from its /proc/net/tcp)."""
    out = set()
    for line in lab.exec(host, "cat", "/proc/net/tcp").stdout.splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        if state == "0A":  # LISTEN
            raw = bytes.fromhex(local.split(":")[0])[::-1]
            out.add(".".join(str(b) for b in raw))
    return out


def pulled_from(node: MeshNode, seed: int, owner: str) -> bool:
    r = node.cmd("load", seed=seed)
    return r["sources"] == [owner] * r["chunks"] and all(r["loaded"]) and r["exact"]


def test_agents_bind_and_advertise_their_namespace_address(lab, etcd, cluster_name, tmp_path):
    a = start(lab, A, "a", cluster_name, etcd, tmp_path, seeds=(1,))
    b = start(lab, B, "b", cluster_name, etcd, tmp_path)
    try:
        assert until(lambda: pulled_from(b, 1, "a"), 15) is not None
        listening = listening_addresses(lab, A)
        assert listening and listening <= {lab.ip(A)}, listening  # transfer and metrics ports
    finally:
        a.stop()
        b.stop()


def test_a_node_partitioned_from_etcd_keeps_local_hits_and_rejoins(lab, etcd, cluster_name, tmp_path):
    ttl = 3
    a = start(lab, A, "a", cluster_name, etcd, tmp_path, seeds=(1,), ttl=ttl)
    b = start(lab, B, "b", cluster_name, etcd, tmp_path, ttl=ttl)
    try:
        assert until(lambda: pulled_from(b, 1, "a"), 15) is not None
        lab.partition(A, ETCD_HOSTS)  # a still reaches b, and b reaches a
        # a's lease expires in etcd: peers stop planning pulls from it
        assert until(lambda: "a" not in b.nodes(), 3 * ttl + 5) is not None
        r = b.cmd("load", seed=1)
        assert r["sources"] == [] and r["loaded"] == []
        # a keeps serving its own engine from its tiers
        r = a.cmd("load", seed=1, forget=False)
        assert r["sources"] == [LOCAL] * r["chunks"] and all(r["loaded"]) and r["exact"]
        assert until(lambda: a.cmd("nodes")["index"].get("lease_up") == 0.0, 3 * ttl) is not None

        lab.unpartition(A)
        rejoined = until(lambda: pulled_from(b, 1, "a"), 4 * ttl)
        assert rejoined is not None and rejoined <= 2 * ttl, f"back in the mesh after {rejoined}s"
        assert a.cmd("nodes")["index"]["lease_up"] == 1.0
    finally:
        lab.unpartition(A)
        a.stop()
        b.stop()


def test_the_etcd_leader_cut_off_mirrors_keep_serving_and_publishing_resumes(lab, etcd, cluster_name, tmp_path):
    a = start(lab, A, "a", cluster_name, etcd, tmp_path, seeds=(1,), ttl=6)
    b = start(lab, B, "b", cluster_name, etcd, tmp_path, ttl=6)
    leader = etcd.leader_index()
    try:
        assert until(lambda: pulled_from(b, 1, "a"), 15) is not None
        lab.cut(ETCD_HOSTS[leader])
        assert pulled_from(b, 1, "a")  # lookups and pulls from the mirror, without etcd's leader
        assert a.cmd("store", seed=2)["stored"] == 5
        resumed = until(lambda: pulled_from(b, 2, "a"), 30)  # published once a new leader is elected
        assert resumed is not None
        assert pulled_from(b, 1, "a")
    finally:
        lab.heal(ETCD_HOSTS[leader])
        a.stop()
        b.stop()
        etcd.wait_healthy()


def test_a_node_killed_and_restarted_on_its_disk_serves_only_valid_chunks(lab, etcd, cluster_name, tmp_path):
    a = start(lab, A, "a", cluster_name, etcd, tmp_path, seeds=(1,), disk=True)
    b = start(lab, B, "b", cluster_name, etcd, tmp_path)
    try:
        assert until(lambda: pulled_from(b, 1, "a"), 15) is not None
        a.stop()  # written back to disk
        a = start(lab, A, "a", cluster_name, etcd, tmp_path, disk=True)
        a.kill()  # SIGKILL: no goodbye
        a = start(lab, A, "a", cluster_name, etcd, tmp_path, disk=True)
        assert a.cmd("held", seed=1)["held"] == 5
        assert until(lambda: pulled_from(b, 1, "a"), 15) is not None  # served again from disk

        a.kill()
        r = subprocess.run([sys.executable, "-m", "lmcache_p2p", "invalidate", "--etcd", ",".join(etcd.endpoints),
                            "--cluster", cluster_name, "--node", "a"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        a = start(lab, A, "a", cluster_name, etcd, tmp_path, disk=True)
        assert a.cmd("held", seed=1)["held"] == 0  # dropped at start, before publishing anything

        def offered_by_a() -> bool:
            r = b.cmd("load", seed=1)
            assert not any(ok for ok, src in zip(r["loaded"], r["sources"], strict=True) if src == "a")
            return "a" in r["sources"]

        # the killed process's entries go with its lease (3 s); the new one publishes none of them
        assert until(lambda: not offered_by_a(), 3 + 5) is not None
    finally:
        a.stop()
        b.stop()


def test_peers_back_off_a_node_they_cannot_reach_and_load_within_their_deadline(lab, etcd, cluster_name, tmp_path):
    """A's host drops every packet between it and B (both still reach etcd: A's lease stays alive). B's
    connection to A is open, so A would acknowledge B's request at once: hearing nothing, B gives up on it
    once silent for its round trip and a third of the pull's allowance (``unanswered``), not at its 3 s
    deadline, and recomputes."""
    a = start(lab, A, "a", cluster_name, etcd, tmp_path, seeds=(1, 2))
    b = start(lab, B, "b", cluster_name, etcd, tmp_path)
    try:
        assert until(lambda: pulled_from(b, 1, "a"), 15) is not None
        lab.partition(A, [B])  # both still reach etcd: a's lease stays alive
        r = b.cmd("load", seed=2)
        assert r["sources"] == ["a"] * 5 and not any(r["loaded"])  # planned, not loaded: recomputed
        assert r["elapsed_s"] < 1.5  # A's silence, not transfer.timeout_s (3 s); never a hang
        r = b.cmd("load", seed=2)  # still unreachable: again bounded, nothing wrong loaded
        assert not any(r["loaded"]) and r["elapsed_s"] < 3.0 + 1.0
        assert "a" in b.nodes()  # its lease is alive: only this pair is cut
        lab.unpartition(A)
        assert until(lambda: pulled_from(b, 2, "a"), 15) is not None
    finally:
        lab.unpartition(A)
        a.stop()
        b.stop()


def test_a_throttled_link_to_the_only_owner_is_pulled_from_only_while_that_beats_recompute(
        lab, etcd, cluster_name, tmp_path):
    a = start(lab, A, "a", cluster_name, etcd, tmp_path, seeds=(1, 2, 3))
    b = start(lab, B, "b", cluster_name, etcd, tmp_path)
    try:
        assert until(lambda: "a" in b.nodes(), 15) is not None
        lab.slow(A, rate="24mbit")  # ~3 MB/s: the prompt's ~2.5 MiB takes ~1 s
        # A slow engine (100 tokens/s: ~11 s to recompute the prompt): the slow pull wins and is made.
        r = b.cmd("budgeted", seed=1, prefill_tokens_per_s=100)
        assert (r["planned"], r["loaded"], r["exact"]) == (5, 5, True) and r["elapsed_s"] > 0.4
        # A fast engine (1M tokens/s): pulling would be slower than computing: nothing is asked for.
        r = b.cmd("budgeted", seed=2, prefill_tokens_per_s=1_000_000)
        assert (r["planned"], r["loaded"]) == (0, 0) and r["elapsed_s"] < 0.1
        lab.unslow(A)
    finally:
        lab.unslow(A)
        a.stop()
        b.stop()


CONNECT_SCRIPT = """
import asyncio, sys, time
from lmcache_p2p.transfer.netio import connect_tcp
print(time.monotonic(), flush=True)
sock = asyncio.run(connect_tcp(sys.argv[1], int(sys.argv[2]), 8.0))
print(time.monotonic(), flush=True)
sock.close()
"""
LISTEN_SCRIPT = """
import socket, sys, time
s = socket.socket()
s.bind((sys.argv[1], 0))
s.listen()
print(s.getsockname()[1], flush=True)
time.sleep(60)
"""


def test_a_connect_started_during_a_partition_completes_soon_after_it_heals(lab, tmp_path):
    """The SYNs of a connect begun while the path drops everything are lost; the kernel resends one a
    second (Linux >= 6.5, ``tcp_syn_linear_timeouts``; doubling from 1 s before). A fresh attempt every
    quarter-second connects within about that once the path is back (a load right after a partition
    healed waited its full 3 s deadline)."""
    listener = lab.popen(A, [sys.executable, "-c", LISTEN_SCRIPT, lab.ip(A)], stdout=subprocess.PIPE, text=True)
    client = None
    try:
        port = int(listener.stdout.readline())
        lab.partition(A, [B])
        client = lab.popen(B, [sys.executable, "-c", CONNECT_SCRIPT, lab.ip(A), str(port)], stdout=subprocess.PIPE,
                           text=True)
        started = float(client.stdout.readline())
        while time.monotonic() < started + 1.05:  # just past the kernel's first retransmission (1 s)
            time.sleep(0.01)
        lab.unpartition(A, [B])
        healed = time.monotonic()  # one monotonic clock across namespaces
        connected = float(client.stdout.readline())
        assert connected > started + 1.0  # the path really was cut
        # A single attempt: its next SYN leaves at started + 2 s (3 s on older kernels), >= 0.95 s after the
        # heal (measured: 0.66 s after a heal at 1.3 s). Now: within a stagger (0.25 s) plus scheduling on a
        # busy host (measured: 0.20 s).
        assert connected - healed < 0.6, f"connected {connected - healed:.2f}s after the partition healed"
    finally:
        lab.unpartition(A, [B])
        for proc in (listener, client):
            if proc is not None:
                proc.kill()
                proc.wait()
                proc.stdout.close()
