"""Reading, changing and watching the cluster config in etcd.

``ConfigStore.update`` is a compare-and-swap on the key's ``mod_revision``: two operators
changing different fields at once both land, and a config that fails validation is never
written (the stored one stays as it was). ``ConfigWatcher`` calls back with every new valid
config; an invalid value written behind the tools' back is logged and skipped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping

import grpc
import grpc.aio
from etcd3aio._protobuf import Compare, WatchCreateRequest, WatchRequest, WatchStub
from etcd3aio.kv import KVService

from lmcache_p2p.errors import ConfigError, IndexError_
from lmcache_p2p.index.client import EtcdClient
from lmcache_p2p.index.schema import Schema

from ..aio import cancel_and_wait
from .cluster_config import ClusterConfig

log = logging.getLogger(__name__)

CAS_ATTEMPTS = 10


class ConfigStore:
    def __init__(self, client: EtcdClient, cluster: str) -> None:
        self._client = client
        self.key = Schema(cluster).config

    async def get(self) -> tuple[ClusterConfig, int]:
        """The stored config (defaults when none is stored) and the store revision of the read."""
        kv, revision = await self._client.get(self.key)
        return (ClusterConfig.unpack(kv.value) if kv is not None else ClusterConfig()), revision

    async def update(self, assignments: Mapping[str, str]) -> ClusterConfig:
        """Apply ``field -> value`` to the stored config atomically; ConfigError if invalid."""
        for _ in range(CAS_ATTEMPTS):
            kv, _ = await self._client.get(self.key)
            current = ClusterConfig.unpack(kv.value) if kv is not None else ClusterConfig()
            new = current.with_updates(assignments)  # raises ConfigError: nothing written
            mod = kv.mod_revision if kv is not None else 0
            ok, _ = await self._client.txn([_compare_mod(self.key, mod)], [KVService.txn_op_put(self.key, new.pack())])
            if ok:
                return new
            log.info("cluster config changed concurrently; retrying")
        raise IndexError_(f"cluster config kept changing; gave up after {CAS_ATTEMPTS} attempts")

    async def put(self, config: ClusterConfig) -> None:
        await self._client.put(self.key, config.pack())


def _compare_mod(key: bytes, mod_revision: int) -> Compare:
    return Compare(result=Compare.EQUAL, target=Compare.MOD, key=key, mod_revision=mod_revision)


class ConfigWatcher:
    """Calls ``callback(config)`` with the current config, then with every valid change."""

    def __init__(self, client: EtcdClient, cluster: str, callback: Callable[[ClusterConfig], None]) -> None:
        self._client = client
        self._store = ConfigStore(client, cluster)
        self._callback = callback
        self._rev = 0
        self._task: asyncio.Task[None] | None = None
        self.current: ClusterConfig | None = None

    async def start(self) -> ClusterConfig:
        config, self._rev = await self._store.get()
        self._deliver(config)
        self._task = asyncio.create_task(self._run(), name="cluster-config-watch")
        return config

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    def _deliver(self, config: ClusterConfig) -> None:
        if config == self.current:
            return
        self.current = config
        try:
            self._callback(config)
        except Exception:
            log.exception("cluster config callback failed")

    async def _run(self) -> None:
        backoff = 0.05
        while True:
            try:
                await self._watch()
            except (IndexError_, grpc.aio.AioRpcError, OSError) as exc:
                log.info("config watch interrupted (%s); resuming", exc)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    async def _watch(self) -> None:
        call = WatchStub(self._client.channel).Watch(metadata=self._client.metadata(require_leader=True))
        try:
            await call.write(WatchRequest(create_request=WatchCreateRequest(
                key=self._store.key, start_revision=self._rev + 1)))
            while True:
                resp = await call.read()
                if resp is grpc.aio.EOF:
                    return
                if resp.compact_revision > 0 or resp.canceled:
                    config, self._rev = await self._store.get()  # history gone: read the current value
                    self._deliver(config)
                    return
                for ev in resp.events:
                    self._rev = ev.kv.mod_revision
                    self._on_value(ev.kv.value if ev.type == 0 else None)
        finally:
            call.cancel()

    def _on_value(self, value: bytes | None) -> None:
        try:
            self._deliver(ClusterConfig.unpack(value) if value is not None else ClusterConfig())
        except ConfigError as exc:
            log.error("ignoring invalid cluster config in etcd: %s", exc)
