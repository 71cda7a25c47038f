"""The cluster config in effect: what ``lmcache-p2p config set`` changes in every agent.

Precedence, lowest to highest::

    defaults  <  cluster config in etcd  <  node config file  <  environment  <  explicit overrides

A field the node's file, environment or overrides set (``AgentConfig.set_by_node``) is the node's
own and the cluster config never changes it. Agents and connectors read the stored cluster config
once at start (:func:`read_at_start`, bounded by ``etcd.start_wait_s``: with etcd down they start on
their own config), then follow it (``CacheAgent``): the fields marked ``live`` below take effect at
once; the others are logged as needing a restart, and take effect at the next start. Every node
publishes the config revision it runs (``config_revision`` in its record; ``lmcache-p2p status``).

    cluster config field          agent config field             live
    chunk_size                    chunk_size                     restart (every engine must agree)
    cpu_capacity                  tiers.cpu_capacity             restart (the pool is allocated once)
    disk_capacity                 tiers.disk_capacity            restart
    lease_ttl_s                   etcd.lease_ttl_s               restart (the lease is granted with it)
    eviction                      tiers.eviction                 live (recency order carries over; LFU counts restart)
    chunk_ttl_s                   tiers.chunk_ttl_s              live (the TTL sweeper restarts with it)
    handoff_budget_bytes_per_s    handoff.budget_bytes_per_s     live
    replicate_after               handoff.replicate_after        live
    peer_backoff_s                transfer.backoff_s             live (peers backed off now keep their deadline)
    log_level                     log_level                      live (the ``lmcache_p2p`` loggers)
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

from lmcache_p2p.aio import LoopThread
from lmcache_p2p.config import AgentConfig
from lmcache_p2p.errors import ConfigError, LMCacheP2PError

log = logging.getLogger(__name__)

# cluster config field -> (agent config dotted field, applied while running)
FIELDS: dict[str, tuple[str, bool]] = {
    "chunk_size": ("chunk_size", False),
    "cpu_capacity": ("tiers.cpu_capacity", False),
    "disk_capacity": ("tiers.disk_capacity", False),
    "lease_ttl_s": ("etcd.lease_ttl_s", False),
    "eviction": ("tiers.eviction", True),
    "chunk_ttl_s": ("tiers.chunk_ttl_s", True),
    "handoff_budget_bytes_per_s": ("handoff.budget_bytes_per_s", True),
    "replicate_after": ("handoff.replicate_after", True),
    "peer_backoff_s": ("transfer.backoff_s", True),
    "log_level": ("log_level", True),
}


def field_value(config: AgentConfig, dotted: str) -> Any:
    """The value of a dotted agent config field (``tiers.chunk_ttl_s``)."""
    obj: Any = config
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _replace(config: AgentConfig, dotted: str, value: Any) -> AgentConfig:
    head, _, rest = dotted.partition(".")
    if not rest:
        return dataclasses.replace(config, **{head: value})
    section = getattr(config, head)
    return dataclasses.replace(config, **{head: dataclasses.replace(section, **{rest: value})})


def apply(config: AgentConfig, cluster: Any, stored: set[str], *, live_only: bool = False) -> tuple[AgentConfig,
                                                                                                     list[str]]:
    """``config`` with the cluster config's ``stored`` fields applied (those the node did not set itself;
    with ``live_only``, only the fields that apply while running). Returns it and the dotted agent
    fields that differ but need a restart (``live_only``) — for the log."""
    pending: list[str] = []
    for field, (dotted, live) in FIELDS.items():
        if field not in stored or dotted in config.set_by_node:
            continue
        value = getattr(cluster, field)
        if field_value(config, dotted) == value:
            continue
        if live_only and not live:
            pending.append(dotted)
            continue
        try:
            config = _replace(config, dotted, value)
        except ConfigError as exc:  # valid for the cluster, not for this node (e.g. chunk vs block size)
            log.warning("cluster config %s=%r not applied here: %s", field, value, exc)
    return config, pending


def deviations(config: AgentConfig, cluster: Any, stored: set[str]) -> dict[str, str]:
    """Agent config fields (dotted) whose value is not the stored cluster config's: ``"node"`` where the
    node set the field itself, ``"restart"`` where the cluster's value waits for the next start."""
    out = {}
    for field, (dotted, _) in FIELDS.items():
        if field in stored and field_value(config, dotted) != getattr(cluster, field):
            out[dotted] = "node" if dotted in config.set_by_node else "restart"
    return out


def read_at_start(config: AgentConfig) -> tuple[AgentConfig, int]:
    """``config`` with the stored cluster config applied, and the config's revision (0: none stored,
    or etcd did not answer within ``etcd.start_wait_s``: the node starts on its own config)."""
    if not config.etcd.endpoints:
        return config, 0
    from lmcache_p2p.index.client import EtcdClient

    from .store import ConfigStore

    async def read() -> tuple[Any, set[str], int]:
        client = EtcdClient(config.etcd)
        try:
            await client.connect(lazy=True)
            store = ConfigStore(client, config.cluster)
            return await store.read_stored()
        finally:
            await client.close()

    wait = max(config.etcd.start_wait_s, 0.5)  # never holds a start up longer than the agent's own wait
    try:
        with LoopThread("lmcache-p2p-cluster-config") as loop:
            cluster, stored, revision = loop.run(read(), wait)
    except (LMCacheP2PError, OSError, TimeoutError, ConfigError) as exc:  # a malformed record: skipped
        log.warning("cluster config not read (%s): starting on this node's own config", exc)
        return config, 0
    applied, _ = apply(config, cluster, stored)
    return applied, revision


def set_log_level(level: str | None) -> None:
    """The level of every ``lmcache_p2p`` logger (None: inherit the process's root level again). Inside
    an engine that set up no logging of its own, a handler is added so the level shows."""
    logger = logging.getLogger("lmcache_p2p")
    logger.setLevel(level or logging.NOTSET)
    if level and not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s [pid %(process)d]: %(message)s"))
        logger.addHandler(handler)


Setter = Callable[[AgentConfig], None]


class LiveConfig:
    """A running node's config: its own, with the cluster config's live fields applied as they change, each
    through the node's setter for it (``setters()``: field -> setter, None: read at every use; a test holds
    them to :data:`FIELDS`); the revision applied, and where the node differs from the cluster config
    (``config_deviations`` in its record). Fields that wait for a restart are logged when that list changes."""

    def __init__(self, config: AgentConfig, setters: Callable[[], Mapping[str, Setter | None]]) -> None:
        self.config = config
        self.revision = 0  # of the cluster config applied
        self.deviations: dict[str, str] = {}  # field -> "restart" | "node"
        self._pending: list[str] = []  # fields that wait for a restart
        self._setters = setters

    def apply(self, cluster: Any, stored: set[str], revision: int) -> None:
        """Apply the cluster config at ``revision`` (``stored``: the fields it sets)."""
        new, pending = apply(self.config, cluster, stored, live_only=True)
        if pending and pending != self._pending:
            log.warning("cluster config (rev %d) changes %s: takes effect when this node restarts", revision,
                        ", ".join(pending))
        self._pending = pending
        old, self.config = self.config, new
        for dotted, setter in self._setters().items():
            if setter is not None and field_value(new, dotted) != field_value(old, dotted):
                setter(new)
        if new != old:
            log.info("cluster config rev %d applied", revision)
        self.revision = revision
        self.deviations = deviations(new, cluster, stored)
