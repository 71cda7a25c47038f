"""etcd over TLS with client-certificate auth: three real members whose certificates each name only
their own endpoint, so the client must verify every endpoint's own name and fail over between them."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_helpers import AgentProcess, agent_yaml, wait_until

from lmcache_p2p.config import EtcdConfig
from lmcache_p2p.errors import IndexError_
from lmcache_p2p.index.client import EtcdClient
from lmcache_p2p.index.etcd_server import EtcdCluster
from lmcache_p2p.index.schema import Schema


@pytest.fixture(scope="module")
def tls_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    with EtcdCluster(3, unsafe_no_fsync=True, tls_dir=tmp_path_factory.mktemp("etcd-pki")) as cluster:
        yield cluster


def client_config(cluster: EtcdCluster, **changes: object) -> EtcdConfig:
    assert cluster.client_tls is not None
    ca, cert, key = cluster.client_tls
    cfg = EtcdConfig(endpoints=cluster.endpoints, ca_cert=ca, cert_cert=cert, cert_key=key, timeout_s=2.0)
    return dataclasses.replace(cfg, **changes)  # type: ignore[arg-type]


async def roundtrip(cfg: EtcdConfig, key: bytes) -> bytes | None:
    async with EtcdClient(cfg) as client:
        await client.put(key, b"v")
        kv, _ = await client.get(key)
        return kv.value if kv is not None else None


def test_every_endpoint_is_verified_by_its_own_name_and_fails_over(tls_etcd: EtcdCluster) -> None:
    assert tls_etcd.endpoints[0].startswith("https://localhost:")
    assert tls_etcd.endpoints[1].startswith("https://127.0.0.2:")

    async def run() -> None:
        async with EtcdClient(client_config(tls_etcd)) as client:
            await client.put(b"tls/a", b"1")
            assert client.endpoint.name.startswith("localhost:")
            tls_etcd.kill_member(0)  # the endpoint in use: the next one carries another name
            try:
                for attempt in range(5):  # a call or two may fail while the member is noticed gone
                    try:
                        await client.put(b"tls/b", b"2")
                        break
                    except IndexError_:
                        assert attempt < 4
                assert client.endpoint.name.startswith("127.0.0.")
                kv, _ = await client.get(b"tls/a")
                assert kv is not None and kv.value == b"1"
            finally:
                tls_etcd.restart_member(0)

    asyncio.run(run())


def test_a_member_whose_certificate_lacks_the_endpoint_name_is_refused(tls_etcd: EtcdCluster) -> None:
    # Member 0's certificate names "localhost" only: reached as 127.0.0.1 it must not be trusted.
    wrong_name = tls_etcd.endpoints[0].replace("localhost", "127.0.0.1")
    with pytest.raises(IndexError_):
        asyncio.run(roundtrip(client_config(tls_etcd, endpoints=(wrong_name,)), b"tls/wrong-name"))
    assert asyncio.run(roundtrip(client_config(tls_etcd, endpoints=(tls_etcd.endpoints[0],)), b"tls/ok")) == b"v"


def test_clients_without_a_certificate_are_refused(tls_etcd: EtcdCluster) -> None:
    with pytest.raises(IndexError_):
        asyncio.run(roundtrip(client_config(tls_etcd, cert_cert=None, cert_key=None), b"tls/anonymous"))


def test_an_agent_joins_the_mesh_through_tls_etcd(tls_etcd: EtcdCluster, cluster_name: str, tmp_path: Path) -> None:
    assert tls_etcd.client_tls is not None
    ca, cert, key = tls_etcd.client_tls
    cfg = agent_yaml(tmp_path / "a.yaml", node="a", cluster=cluster_name, endpoints=tls_etcd.endpoints)
    text = cfg.read_text().replace("etcd:\n", f"etcd:\n  ca_cert: {ca}\n  cert_cert: {cert}\n  cert_key: {key}\n", 1)
    cfg.write_text(text)
    agent = AgentProcess(cfg, seeds=(1,), tokens=512, log=tmp_path / "a.log").wait_ready()
    try:
        async def entries() -> int:
            async with EtcdClient(client_config(tls_etcd)) as client:
                return await client.count_prefix(Schema(cluster_name).root)

        assert wait_until(lambda: asyncio.run(entries()) >= 3, 15)  # its node record and two chunks
    finally:
        assert agent.stop() == 0
