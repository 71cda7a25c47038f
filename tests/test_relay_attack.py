"""An etcd writer without the cluster secret tries to make an engine consume forged chunks.

Real etcd, a real owner agent process, the victim a real agent in this process with the default
config, and the attacker a process of its own (``relay_attack_proc.py``) speaking real sockets: it
forges etcd records that send the victim's pulls to its relay, relays the handshake to the real
owner (which proves the secret for it), then answers ``get`` itself with forged bytes, a matching
xxh3 checksum and epoch 2**64 - 1. Two ways to be planned:

- ``evil``: a record ``nodes/evil`` with the relay's address and GPU-tier entries for the owner's
  chunks (they win the plan, for half the chunks: the planner spreads a prompt over its owners).
  Stopped by the handshake: the owner proves the secret as ``a``, not as ``evil`` (with per-node
  TLS certificates already by the relay's certificate, which names no node; with names not required
  the channel binding would: the relay's certificate is not the owner's, ``test_transfer_tls.py``).
- ``overwrite``: the owner's own record rewritten with the relay's address. The owner's proof is
  right, so only the payload MAC (on by default without TLS) or TLS stops this one.

Either way no forged chunk is loaded, nor announced; a control run with ``payload_mac: false`` and
no TLS shows the attack itself works.
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from agent_helpers import AgentProcess, agent_yaml, config, wait_until
from prometheus_client import CollectorRegistry

from lmcache_p2p.agent import CacheAgent
from lmcache_p2p.certs import make_certs
from lmcache_p2p.config import EtcdConfig
from lmcache_p2p.ids import NodeId
from lmcache_p2p.index.client import EtcdClient
from lmcache_p2p.index.schema import Schema
from lmcache_p2p.metrics import AgentMetrics
from lmcache_p2p.testing.synthetic import synthetic_payload, synthetic_tokens

TOKENS = 4 * 256
SEED = 41
PROC = Path(__file__).with_name("relay_attack_proc.py")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Per-node certificates (each names its node) and the attacker's: issued by the cluster CA,
    naming no node, as an etcd client certificate from the same CA would be."""
    d = tmp_path_factory.mktemp("pki")
    make_certs(d, ["a=node:a", "c=node:c", "mallory"], days=1)
    return d


def tls_section(pki: Path | None, name: str) -> dict[str, Any]:
    if pki is None:
        return {}
    return {"tls_ca_cert": str(pki / "ca.crt"), "tls_cert": str(pki / f"{name}.crt"),
            "tls_key": str(pki / f"{name}.key")}


class Attacker:
    def __init__(self, etcd: Any, cluster: str, mode: str, chunk_bytes: int, pki: Path | None) -> None:
        argv = [sys.executable, str(PROC), "--etcd", ",".join(etcd.endpoints), "--cluster", cluster, "--owner", "a",
                "--mode", mode, "--chunk-bytes", str(chunk_bytes)]
        if pki is not None:
            argv += ["--tls-ca", str(pki / "ca.crt"), "--tls-cert", str(pki / "mallory.crt"),
                     "--tls-key", str(pki / "mallory.key")]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.port: int = self._read()["port"]

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"attacker exited with {self.proc.wait()}")
        result: dict[str, Any] = json.loads(line)
        return result

    def stats(self) -> dict[str, int]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("stats\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.kill()
        self.proc.wait(10)
        self.proc.stdin.close()
        self.proc.stdout.close()


def victim(tmp_path: Path, cluster: str, endpoints: tuple[str, ...], transfer: dict[str, Any]) -> CacheAgent:
    cfg = config(agent_yaml(tmp_path / "c.yaml", node="c", cluster=cluster, endpoints=endpoints, transfer=transfer))
    return CacheAgent.of(cfg, metrics=AgentMetrics(CollectorRegistry())).start()


def address_of(agent: CacheAgent, node: str) -> str | None:
    """``node``'s transfer address in the agent's mirror of etcd."""
    assert agent.index is not None
    record = agent.index.nodes().get(NodeId(node))
    return None if record is None else record.addresses.get("tcp")


def held(predicate: Any, seconds: float) -> bool:
    """``predicate`` stayed true for ``seconds`` (polled)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not predicate():
            return False
        time.sleep(0.05)
    return True


def announced_by(etcd: Any, cluster: str, node: str) -> int:
    """Block entries ``node`` has in etcd, read back raw."""
    async def read() -> int:
        async with EtcdClient(EtcdConfig(endpoints=etcd.endpoints)) as client:
            kvs, _ = await client.get_prefix(Schema(cluster).blocks)
        return sum(1 for kv in kvs if kv.key.endswith(b"/" + node.encode()))

    return asyncio.run(read())


def load(agent: CacheAgent) -> tuple[int, int]:
    """Load the prompt; (genuine chunks loaded, forged chunks loaded), each checked byte for byte."""
    tokens = synthetic_tokens(SEED, TOKENS)
    plan = agent.lookup(tokens)
    bufs = [bytearray(agent.chunk_bytes) for _ in plan.chunks]
    loaded = agent.load(plan, [memoryview(b) for b in bufs])
    genuine = forged = 0
    for ok, chunk, buf in zip(loaded, plan.chunks, bufs, strict=True):
        if ok:
            expected = synthetic_payload(chunk.key, agent.config.layout.chunk_bytes(chunk.end - chunk.start))
            genuine += buf[: len(expected)] == expected
            forged += buf[: len(expected)] != expected
    return genuine, forged


@pytest.fixture
def mesh(etcd: Any, cluster_name: str, tmp_path: Path, pki: Path) -> Iterator[Any]:
    """``start(mode, tls, transfer)`` -> (victim agent, attacker); owner ``a`` holds the prompt."""
    started: list[Any] = []

    def start(mode: str, tls: bool, transfer: dict[str, Any] | None = None) -> tuple[CacheAgent, Attacker]:
        certs = pki if tls else None
        owner = AgentProcess(agent_yaml(tmp_path / "a.yaml", node="a", cluster=cluster_name, endpoints=etcd.endpoints,
                                        transfer={**tls_section(certs, "a"), **(transfer or {})}),
                             seeds=(SEED,), tokens=TOKENS, log=tmp_path / "a.log").wait_ready()
        started.append(owner)
        # the relay's first answer may be slow on a busy machine: the victim waits (a trust test, not a timing one)
        agent = victim(tmp_path, cluster_name, etcd.endpoints,
                       {**tls_section(certs, "c"), "timeout_s": 10.0, "first_contact_s": 10.0, **(transfer or {})})
        started.append(agent)
        tokens = synthetic_tokens(SEED, TOKENS)
        assert wait_until(lambda: agent.lookup(tokens).hit_tokens == TOKENS, 15)
        attacker = Attacker(etcd, cluster_name, mode, agent.chunk_bytes, certs)
        started.append(attacker)
        relay = f"127.0.0.1:{attacker.port}"
        if mode == "evil":  # the forged record wins the plan (for every other chunk: it spreads the load)
            assert wait_until(lambda: "evil" in {ch.source for ch in agent.lookup(tokens).chunks}, 15)
        else:  # the owner republishes its record (config applied, free space) for a while after it starts:
            # the forged address must have held a second in the victim's mirror
            assert wait_until(lambda: address_of(agent, "a") == relay, 15)
            assert wait_until(lambda: held(lambda: address_of(agent, "a") == relay, 1.0), 15)
        return agent, attacker

    yield start
    for thing in reversed(started):
        if isinstance(thing, Attacker):
            thing.close()
        else:
            thing.stop()


def mac_drops(agent: CacheAgent) -> float:
    value = agent.metrics.registry.get_sample_value("lmcache_p2p_pull_chunks_total",
                                                    {"transport": "tcp", "outcome": "mac"})
    return value or 0.0


@pytest.mark.parametrize("tls", [False, True], ids=["tls-off", "tls-on"])
@pytest.mark.parametrize("mode", ["evil", "overwrite"])
def test_an_etcd_writer_without_the_secret_gets_no_forged_chunk_loaded(
        mesh: Any, etcd: Any, cluster_name: str, mode: str, tls: bool, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    agent, attacker = mesh(mode, tls)  # default config: payload_mac unset
    genuine, forged = load(agent)
    stats = attacker.stats()
    assert stats["connections"] >= 1, "the victim never reached the relay: the attack was not tried"
    assert forged == 0
    peer_errors = agent.metrics.registry.get_sample_value("lmcache_p2p_peer_errors_total",
                                                          {"peer": "evil" if mode == "evil" else "a"}) or 0.0
    if mode == "evil":
        # the planned owner "evil" failed its handshake; its chunks came from "a", the real owner
        assert genuine == 4 and stats["handshakes"] == 0 and stats["forged"] == 0 and peer_errors >= 1
        # with TLS the relay's certificate (the CA's, naming no node) is refused before the proofs:
        # the victim's own certificate names it, so it requires owners' to (transfer.tls_require_node_name)
        why = "the owner's certificate names no node" if tls else "answered as node 'a', not the node 'evil'"
        assert why in caplog.text
        assert wait_until(lambda: announced_by(etcd, cluster_name, "c") == 4, 10)  # the genuine copies
        return
    assert genuine == 0
    if tls:  # the relay's certificate names no node: refused before the proofs (which it could not pass either)
        assert stats["handshakes"] == 0 and stats["forged"] == 0 and peer_errors >= 1
        assert "the owner's certificate names no node" in caplog.text
    else:  # the handshake passed (it was the real "a"); every forged chunk failed the session MAC
        assert stats["handshakes"] >= 1 and stats["forged"] >= 1 and mac_drops(agent) == stats["forged"]
    assert not any(agent.tiers.cpu.contains(ch.key) for ch in agent.lookup(synthetic_tokens(SEED, TOKENS)).chunks)
    time_for_a_publish = wait_until(lambda: announced_by(etcd, cluster_name, "c") > 0, 2)
    assert not time_for_a_publish  # nothing forged is re-announced


def test_control_without_mac_or_tls_the_forged_chunks_land(mesh: Any, etcd: Any, cluster_name: str) -> None:
    """What the protections stop is real: with ``payload_mac: false`` and no TLS, the overwrite
    variant gets every forged chunk loaded and re-announced by the victim."""
    agent, attacker = mesh("overwrite", False, {"payload_mac": False})
    genuine, forged = load(agent)
    assert (genuine, forged) == (0, 4) and attacker.stats()["forged"] == 4
    assert wait_until(lambda: announced_by(etcd, cluster_name, "c") == 4, 10)
