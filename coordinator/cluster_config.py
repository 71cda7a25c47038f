"""The cluster config: settings every node of a cluster must agree on, stored in etcd at
``/lmcache-p2p/v1/<cluster>/config`` as msgpack and watched by every agent.

A frozen slots dataclass validated in ``__post_init__``: every invalid value raises
:class:`~lmcache_p2p.errors.ConfigError` naming the field. ``with_updates`` parses
``KEY=VALUE`` strings (the CLI) into a new, fully validated config.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from typing import Any

import msgpack

from lmcache_p2p.config import EVICTION_POLICIES, LOG_LEVELS, parse_size
from lmcache_p2p.errors import ConfigError

CLUSTER_CONFIG_VERSION = 1
# Fields of earlier versions that no agent ever read (auth_mode: every connection is authenticated with
# the cluster secret; the others were never wired up): accepted in stored configs, ignored, not written.
RETIRED_FIELDS = frozenset({"auth_mode", "publish_coalesce_ms", "max_chunks_per_node"})


@dataclasses.dataclass(frozen=True, slots=True)
class ClusterConfig:
    chunk_size: int = 256  # tokens per chunk; a multiple of every engine's block size
    cpu_capacity: int = 1 << 30  # default CPU tier bytes for agents that set none
    disk_capacity: int = 10 << 30  # default disk tier bytes
    eviction: str = "lru"
    chunk_ttl_s: float | None = None  # drop chunks older than this (None: only capacity evicts)
    lease_ttl_s: int = 10
    handoff_budget_bytes_per_s: int = 64 << 20  # hand-off of sole copies to peers (0: off)
    replicate_after: int = 4  # pulls of a sole copy before it is copied elsewhere (0: off)
    peer_backoff_s: float = 2.0  # first backoff of a peer that failed a pull (doubling, at least 30 s at most)
    log_level: str | None = None  # of every agent's lmcache_p2p loggers (None: each process's own)
    version: int = CLUSTER_CONFIG_VERSION

    def __post_init__(self) -> None:
        _check(self.chunk_size > 0 and self.chunk_size % 16 == 0, "chunk_size", "must be a positive multiple of 16")
        _check(self.cpu_capacity >= 0, "cpu_capacity", "must be >= 0")
        _check(self.disk_capacity >= 0, "disk_capacity", "must be >= 0")
        _check(self.eviction in EVICTION_POLICIES, "eviction", f"must be one of {EVICTION_POLICIES}")
        _check(self.chunk_ttl_s is None or self.chunk_ttl_s > 0, "chunk_ttl_s", "must be > 0 or none")
        _check(2 <= self.lease_ttl_s <= 3600, "lease_ttl_s", "must be in [2, 3600]")
        _check(self.handoff_budget_bytes_per_s >= 0, "handoff_budget_bytes_per_s", "must be >= 0")
        _check(self.replicate_after >= 0, "replicate_after", "must be >= 0")
        _check(0 <= self.peer_backoff_s <= 3600, "peer_backoff_s", "must be in [0, 3600]")
        if isinstance(self.log_level, str):
            object.__setattr__(self, "log_level", self.log_level.upper())
        _check(self.log_level is None or self.log_level in LOG_LEVELS, "log_level", f"must be one of {LOG_LEVELS}")
        _check(self.version == CLUSTER_CONFIG_VERSION, "version", f"must be {CLUSTER_CONFIG_VERSION}")

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def pack(self) -> bytes:
        return msgpack.packb(self.to_dict(), use_bin_type=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ClusterConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        data = {k: v for k, v in data.items() if k not in RETIRED_FIELDS}
        for name in data:
            _check(name in known, str(name), f"unknown field (known: {', '.join(sorted(known))})")
        hints = typing.get_type_hints(cls)
        return cls(**{name: _coerce(value, hints[name], name) for name, value in data.items()})

    @classmethod
    def unpack(cls, data: bytes) -> ClusterConfig:
        try:
            raw = msgpack.unpackb(data, raw=False)
        except (ValueError, msgpack.UnpackException) as exc:
            raise ConfigError("config", f"not msgpack: {exc}") from exc
        _check(isinstance(raw, dict), "config", "must be a msgpack map")
        return cls.from_dict(raw)

    def with_updates(self, assignments: Mapping[str, str]) -> ClusterConfig:
        """A new config with ``field -> text value`` applied; validates the whole result."""
        for name in assignments:
            _check(name not in RETIRED_FIELDS, name, "retired: no agent ever read it (every connection is "
                                                     "authenticated with the cluster secret)")
        merged = self.to_dict()
        merged.update(assignments)
        return ClusterConfig.from_dict(merged)


def parse_assignments(items: list[str]) -> dict[str, str]:
    """``["chunk_size=512", "eviction=lfu"]`` -> mapping; raises ConfigError on a malformed item."""
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        _check(bool(sep) and bool(name.strip()), item, "expected KEY=VALUE")
        out[name.strip()] = value.strip()
    return out


def _coerce(value: Any, hint: Any, field: str) -> Any:
    args = typing.get_args(hint)
    if type(None) in args:
        if value is None or (isinstance(value, str) and value.lower() in ("", "none", "null")):
            return None
        hint = next(a for a in args if a is not type(None))
    if isinstance(value, bool):
        raise ConfigError(field, f"expected {hint.__name__}, got {value!r}")
    try:
        if hint is int and field.endswith(("capacity", "_bytes_per_s")):
            return parse_size(value, field)
        if hint is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return int(value)
        if hint is float:
            return float(value)
        if hint is str and isinstance(value, str):
            return value
    except (TypeError, ValueError):
        pass
    raise ConfigError(field, f"expected {hint.__name__}, got {value!r}")


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ConfigError(field, message)
