"""``lmcache-p2p lookup --explain``: for every chunk of a prompt, why it is or is not available.

    reason            meaning
    held              owners announce it (node and tier of each)
    owner-down        owners announce it, but none of them answers (its metrics endpoint is silent:
                      hung, partitioned, or its lease has not run out yet)
    other-identity    nobody holds it under this fingerprint, but the same tokens are held under
                      another one: ``differs`` names the fields (model_id, kv_dtype, block_size, ...)
    invalidated       a standing invalidation covers this fingerprint (or its tenant, matched by the
                      salt's digest): ``lmcache-p2p invalidate`` dropped it and keeps refusing it
                      until the record is removed
    evicted           a node held it and dropped it recently (``ago_s``; asked over the authenticated
                      transfer connection, so it needs the cluster secret; each agent remembers its
                      last RECENT_EVICTIONS drops)
    no-owner          none of the above: nobody ever held it, or too long ago to remember

Reasons are tried in that order; the first that applies is given. Keys chain over the whole prompt,
so a chunk after a missing one is useless even when held: ``usable`` says whether the chunk is in
the leading run a load would take.
"""

from __future__ import annotations

import asyncio
import dataclasses
import http.client
from typing import Any

from .config import AgentConfig, cluster_secret
from .errors import LMCacheP2PError
from .ids import TIER_NAMES, NodeId
from .index.schema import NodeRecord
from .keys import ChunkKey, FingerprintDigest, chunk_keys
from .metrics_http import scrape
from .transfer.client import ConnectionPool

IDENTITY_FIELDS = ("model_id", "kv_dtype", "num_layers", "num_kv_heads", "head_size", "block_size", "kv_layout",
                   "tp_size", "tp_rank", "tenant")  # tenant: the salt's digest (node records never hold the salt)


@dataclasses.dataclass(slots=True)
class ChunkVerdict:
    index: int
    start: int
    end: int
    key: str
    reason: str
    usable: bool = False
    holders: dict[str, str] = dataclasses.field(default_factory=dict)  # node -> tier
    detail: dict[str, Any] = dataclasses.field(default_factory=dict)


def differing_fields(mine: dict[str, Any] | None, theirs: dict[str, Any] | None) -> list[str]:
    if not mine or not theirs:
        return ["unknown (a node does not publish its layout)"]
    return [f"{f}: {mine.get(f)!r} != {theirs.get(f)!r}" for f in IDENTITY_FIELDS if mine.get(f) != theirs.get(f)]


def explain(config: AgentConfig, fp_hex: str, tokens: list[int], nodes: dict[NodeId, NodeRecord],
            owners_under: dict[str, list[dict[NodeId, int]]], invalidations: list[tuple[str, str, str]],
            evicted: dict[ChunkKey, tuple[NodeId, float]] | None = None, *,
            check_alive: bool = True) -> list[ChunkVerdict]:
    """``owners_under[fp]``: per chunk of ``tokens`` keyed under ``fp``, its owners (every fingerprint
    served); ``invalidations``: standing (id, kind, value); ``evicted``: see :func:`recent_evictions`."""
    fp = FingerprintDigest(bytes.fromhex(fp_hex))
    keys = chunk_keys(fp, tokens, config.chunk_size)
    mine = _layout_of(nodes, fp_hex)
    alive: dict[NodeId, bool] = {}
    verdicts: list[ChunkVerdict] = []
    leading = True
    for i, key in enumerate(keys):
        start, end = i * config.chunk_size, min((i + 1) * config.chunk_size, len(tokens))
        v = ChunkVerdict(i, start, end, key.hex(), "no-owner")
        holders = owners_under.get(fp_hex, [{}] * len(keys))[i]
        if holders:
            v.holders = {n: TIER_NAMES.get(t, "?") for n, t in sorted(holders.items())}
            up = [n for n in holders if not check_alive or _alive(nodes.get(n), alive, n)]
            v.reason = "held" if up else "owner-down"
            if not up:
                v.detail["silent"] = sorted(holders)
        else:
            _why_missing(v, fp_hex, i, mine, nodes, owners_under, invalidations)
            if v.reason == "no-owner" and evicted and key in evicted:
                v.reason = "evicted"
                v.detail = {"node": evicted[key][0], "ago_s": round(evicted[key][1], 1)}
        leading = leading and v.reason == "held"
        v.usable = leading
        verdicts.append(v)
    return verdicts


def _why_missing(v: ChunkVerdict, fp_hex: str, i: int, mine: dict[str, Any] | None,
                 nodes: dict[NodeId, NodeRecord], owners_under: dict[str, list[dict[NodeId, int]]],
                 invalidations: list[tuple[str, str, str]]) -> None:
    for other, per_chunk in owners_under.items():
        if other != fp_hex and per_chunk[i]:
            v.reason = "other-identity"
            v.detail = {"fingerprint": other, "holders": sorted(per_chunk[i]),
                        "differs": differing_fields(mine, _layout_of(nodes, other))}
            return
    tenant = (mine or {}).get("tenant", "")
    for inv_id, kind, value in invalidations:
        if (kind == "fingerprint" and fp_hex.startswith(value)) or (kind == "tenant" and tenant and value == tenant):
            v.reason = "invalidated"
            v.detail = {"invalidation": inv_id, "kind": kind, "value": value}
            return


def _layout_of(nodes: dict[NodeId, NodeRecord], fp_hex: str) -> dict[str, Any] | None:
    layouts = (r.served[fp_hex].layout for r in nodes.values() if fp_hex in r.served)
    return next((layout for layout in layouts if layout), None)  # {}: a record that published none


def _alive(record: NodeRecord | None, cache: dict[NodeId, bool], node: NodeId) -> bool:
    if node not in cache:
        ok = False
        if record is not None and record.metrics_url:
            try:
                scrape(record.metrics_url, timeout=2.0)
                ok = True
            except (OSError, http.client.HTTPException, ValueError):
                ok = False
        elif record is not None:
            ok = True  # nothing to ask: trust the lease
        cache[node] = ok
    return cache[node]


async def recent_evictions(config: AgentConfig, fp: FingerprintDigest, nodes: dict[NodeId, NodeRecord],
                           keys: list[ChunkKey]) -> dict[ChunkKey, tuple[NodeId, float]]:
    """Ask every node serving ``fp`` which of ``keys`` it dropped lately; key -> (node, seconds ago)."""
    secret = cluster_secret(config)
    if not secret:
        return {}
    from .transfer import tls

    tc = config.transfer
    pool = ConnectionPool(secret, min(tc.timeout_s, 3.0), tc.max_frame_bytes, payload_mac=tc.payload_mac,
                          tls=tls.client_context(tc) if tc.tls else None)
    found: dict[ChunkKey, tuple[NodeId, float]] = {}

    async def ask(node: NodeId, record: NodeRecord) -> None:
        peer = record.peer()
        if peer is None:
            return
        try:
            conn = await pool.get(peer, fp, 3.0)
            answer = await asyncio.wait_for(conn.start_recent(keys).future, 3.0)
        except (LMCacheP2PError, OSError, TimeoutError):
            return
        ago = answer.get("ago")
        if isinstance(ago, list) and len(ago) == len(keys):
            for key, a in zip(keys, ago, strict=True):
                if isinstance(a, (int, float)) and (key not in found or a < found[key][1]):
                    found[key] = (node, float(a))

    try:
        await asyncio.gather(*(ask(n, r) for n, r in nodes.items() if fp.hex() in r.fingerprints))
    finally:
        await pool.close()
    return found
