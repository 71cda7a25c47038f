"""A read-only view of the index: one mirror of a fingerprint, no lease, nothing published.

The vLLM scheduler-side connector, ``lmcache-p2p lookup`` and ``status`` use it: they need to
know who holds what, but hold nothing themselves.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from ..aio import LoopThread
from ..config import AgentConfig
from ..keys import ChunkKey, FingerprintDigest
from .client import EtcdClient
from .mirror import Mirror
from .schema import NodeId, NodeRecord, Schema


class IndexReader:
    def __init__(self, loop: LoopThread, config: AgentConfig, fp: FingerprintDigest) -> None:
        self._loop = loop
        self._timeout = config.etcd.timeout_s
        self.client = EtcdClient(config.etcd)
        self.schema = Schema(config.cluster)
        self.mirror = Mirror(self.client, self.schema, fp)

    @classmethod
    def open(cls, loop: LoopThread, config: AgentConfig, fp: FingerprintDigest) -> IndexReader:
        reader = cls(loop, config, fp)
        try:
            loop.run(reader._open(), reader._timeout * 5)
        except Exception:
            reader.close()
            raise
        return reader

    async def _open(self) -> None:
        await self.client.connect()
        await self.mirror.start(self._timeout * 4)

    def longest_prefix(self, keys: Sequence[ChunkKey]) -> int:
        return self.mirror.longest_prefix(keys)

    def owners(self, keys: Sequence[ChunkKey]) -> list[dict[NodeId, int]]:
        return [self.mirror.owners(k) for k in keys]

    def nodes(self) -> dict[NodeId, NodeRecord]:
        return self.mirror.nodes()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._loop.run(self._close(), self._timeout * 2)

    async def _close(self) -> None:
        await self.mirror.stop()
        await self.client.close()
