"""Reading, changing and watching the cluster config in etcd.

``ConfigStore.update`` is a compare-and-swap on the key's ``mod_revision``: two operators
changing different fields at once both land, and a config that fails validation is never
written (the stored one stays as it was). ``ConfigWatcher`` (a :class:`ResumableWatch` of the one key)
calls back with every new valid config; an invalid value written behind the tools' back is
counted as a reject (kind ``cluster config``), logged and skipped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

import msgpack

from ..errors import ConfigError, IndexError_, MalformedRecord
from ..index.client import EtcdClient, KeyValue, WatchEvent, compare_mod_revision, op_put
from ..index.schema import Rejects, Schema
from ..index.watch import ResumableWatch
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

    async def read_stored(self) -> tuple[ClusterConfig, set[str], int]:
        """The stored config, the fields the stored record sets, and its mod revision (0: none stored)."""
        kv, _ = await self._client.get(self.key)
        if kv is None:
            return ClusterConfig(), set(), 0
        return ClusterConfig.unpack(kv.value), stored_fields(kv.value), kv.mod_revision

    async def update(self, assignments: Mapping[str, str]) -> ClusterConfig:
        """Apply ``field -> value`` to the stored config atomically; ConfigError if invalid."""
        for _ in range(CAS_ATTEMPTS):
            kv, _ = await self._client.get(self.key)
            current = ClusterConfig.unpack(kv.value) if kv is not None else ClusterConfig()
            new = current.with_updates(assignments)  # raises ConfigError: nothing written
            mod = kv.mod_revision if kv is not None else 0
            ok, _ = await self._client.txn([compare_mod_revision(self.key, mod)], [op_put(self.key, new.pack())])
            if ok:
                return new
            log.info("cluster config changed concurrently; retrying")
        raise IndexError_(f"cluster config kept changing; gave up after {CAS_ATTEMPTS} attempts")

    async def put(self, config: ClusterConfig) -> None:
        await self._client.put(self.key, config.pack())


def stored_fields(value: bytes) -> set[str]:
    """The fields a stored record sets (a valid one: ``unpack`` has accepted it)."""
    raw = msgpack.unpackb(value, raw=False)
    return {k for k in raw if k in ClusterConfig.__dataclass_fields__} - {"version"}


class ConfigWatcher:
    """Calls ``callback(config)`` with the current config, then with every valid change; ``revision``
    and ``stored`` (the fields the stored record sets) describe the config of the latest call."""

    def __init__(self, client: EtcdClient, cluster: str, callback: Callable[[ClusterConfig], None],
                 rejects: Rejects | None = None) -> None:
        self._store = ConfigStore(client, cluster)
        self._callback = callback
        self.rejects = rejects if rejects is not None else Rejects()
        self._watch = ResumableWatch(client, self._store.key, load=self._load, apply=self._apply,
                                     name="cluster-config")
        self.current: ClusterConfig | None = None
        self.revision = 0
        self.stored: set[str] = set()

    async def start(self, wait_s: float = 5.0) -> ClusterConfig | None:
        """Start following; the config read within ``wait_s`` (None if etcd did not answer)."""
        self._watch.start()
        await self._watch.wait_synced(wait_s)
        return self.current

    async def stop(self) -> None:
        await self._watch.stop()

    def _load(self, kvs: list[KeyValue], _revision: int) -> None:
        mine = [kv for kv in kvs if kv.key == self._store.key]  # the watch covers keys starting with it
        self._on_value(mine[0].value if mine else None, mine[0].mod_revision if mine else 0)

    def _apply(self, events: Sequence[WatchEvent]) -> None:
        for ev in events:
            if ev.key == self._store.key:
                self._on_value(None if ev.deleted else ev.value, 0 if ev.deleted else ev.mod_revision)

    def _on_value(self, value: bytes | None, revision: int) -> None:
        try:
            config = ClusterConfig.unpack(value) if value is not None else ClusterConfig()
            stored = stored_fields(value) if value is not None else set()
        except ConfigError as exc:
            self.rejects.add(MalformedRecord("cluster config", str(exc)), self._store.key)
            return
        if config == self.current and stored == self.stored:
            return
        self.current, self.revision, self.stored = config, revision, stored
        try:
            self._callback(config)
        except Exception:
            log.exception("cluster config callback failed")
