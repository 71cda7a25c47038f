"""A read-only view of the index: one mirror of a fingerprint, no lease, nothing published.

The vLLM scheduler-side connector, ``lmcache-p2p lookup`` and ``status`` use it: they need to
know who holds what, but hold nothing themselves. ``open`` waits up to ``etcd.start_wait_s`` for
the first sync and never fails because etcd is down: the mirror stays empty (every lookup a
miss, so the engine computes) until etcd answers. Tools that must read etcd check ``synced``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Container, Sequence

from ..aio import LoopThread
from ..config import AgentConfig
from ..ids import OBJECTS, NodeId
from ..keys import ChunkKey, FingerprintDigest
from .client import EtcdClient
from .etcd_index import make_mirror
from .quarantine import Quarantine
from .schema import NodeRecord, Rejects, Schema, covers


class IndexReader:
    def __init__(self, loop: LoopThread, config: AgentConfig, fp: FingerprintDigest,
                 rejects: Rejects | None = None) -> None:
        self._loop = loop
        self._timeout = config.etcd.timeout_s
        self._wait_s = config.etcd.start_wait_s
        self.client = EtcdClient(config.etcd)
        self.schema = Schema(config.cluster)
        self.mirror = make_mirror(loop, config, self.client, self.schema, fp, rejects or Rejects())
        self.quarantine = Quarantine(self.client, self.schema, rejects=rejects)  # owners never counted
        self._fp_hex = fp.hex()
        self._objects = config.objects.url is not None  # the object store counts as an owner (``@objects``)

    @classmethod
    def open(cls, loop: LoopThread, config: AgentConfig, fp: FingerprintDigest,
             rejects: Rejects | None = None) -> IndexReader:
        reader = cls(loop, config, fp, rejects)
        try:
            loop.run(reader._open(), reader._wait_s * 2 + reader._timeout + 5.0)
        except Exception:
            reader.close()
            raise
        return reader

    async def _open(self) -> None:
        await self.client.connect(lazy=True)
        await self.mirror.start(self._wait_s)
        await self.quarantine.start(0.0)  # followed in the background, like the mirror

    @property
    def synced(self) -> bool:
        """The mirror has read etcd at least once."""
        return self.mirror.synced

    @property
    def connected(self) -> bool:
        """Following etcd right now (False while etcd is down or unreachable)."""
        return self.mirror.connected

    def longest_prefix(self, keys: Sequence[ChunkKey], also_held: Container[ChunkKey] = (),
                       usable: Callable[[NodeRecord], bool] | None = None) -> int:
        """How many leading keys are held, every KV head of them (by one node, or by nodes that hold
        parts: the ranks of a tensor-parallel engine), or are in ``also_held``. With ``usable``, only
        owners whose node record is in the mirror and passes it count (``peers.compatible``), and the
        object store when this node's config has one (``objects.url``)."""
        self.mirror.prefetch([k for k in keys if k not in also_held])
        nodes = self.mirror.nodes()
        partial = {n: h for n, r in nodes.items()  # nodes holding some heads: (h0, h1, total)
                   if (s := r.served.get(self._fp_hex)) is not None and (h := s.partial_heads) is not None}
        refused = None if usable is None else {n for n, r in nodes.items() if not usable(r)}
        if not also_held and not partial and usable is None:
            return self.mirror.longest_prefix(keys)
        mirror = self.mirror
        for i, key in enumerate(keys):
            if key in also_held:
                continue
            owners = mirror.owners(key)
            if refused is not None:
                owners = {n: t for n, t in owners.items()
                          if (n in nodes and n not in refused) or (n == OBJECTS and self._objects)}
            if not owners:
                return i
            if all(n in partial for n in owners):
                held = [partial[n] for n in owners]
                if not covers([(h[0], h[1]) for h in held], (0, max(h[2] for h in held))):
                    return i
        return len(keys)

    def owners(self, keys: Sequence[ChunkKey]) -> list[dict[NodeId, int]]:
        self.mirror.prefetch(keys)
        return [self.mirror.owners(k) for k in keys]

    def nodes(self) -> dict[NodeId, NodeRecord]:
        return self.mirror.nodes()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._loop.run(self._close(), self._timeout * 2)

    async def _close(self) -> None:
        await self.mirror.stop()
        await self.quarantine.stop()
        await self.client.close()
