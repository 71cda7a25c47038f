"""The object tier as a node runs it (``agent.py`` builds it here): what it keeps is decided by the node's
hand-off counts, what it must not serve by the node's invalidations and quarantine.

A chunk leaving the node is worth an upload when it is this agent's, with every head, was hit
``objects.min_hits`` times, and no other node (nor the store) holds it (:func:`worth_keeping`). A disk
victim's file is moved aside under ``<tiers.disk_path>/.objects-spill`` until its upload is confirmed.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..chunk import ChunkHeader
from ..config import AgentConfig, cluster_secret
from ..ids import NodeId
from ..index.schema import Rejects
from ..keys import ChunkKey, FingerprintDigest
from ..metrics import AgentMetrics
from .store import ObjectStore
from .tier import Covers, CoversTenant, ObjectTier


def worth_keeping(header: ChunkHeader, *, fp: FingerprintDigest, num_kv_heads: int, hits: Callable[[ChunkKey], int],
                  min_hits: int, others_hold: Callable[[ChunkKey], bool]) -> bool:
    """A chunk leaving this node that is worth keeping in the object store. Dict probes only (called under
    tier locks)."""
    return (header.fingerprint == fp and header.heads == (0, num_kv_heads)
            and hits(header.key) >= min_hits and not others_hold(header.key))


def node_object_tier(settings: Callable[[], AgentConfig], *, fp: FingerprintDigest, num_kv_heads: int,
                     node_id: NodeId, metrics: AgentMetrics, secret: bytes | None, rejects: Rejects,
                     hits: Callable[[ChunkKey], int], others_hold: Callable[[ChunkKey], bool], covers: Covers,
                     covers_tenant: CoversTenant) -> ObjectTier:
    """The object tier of a node whose config ``settings()`` reads now (``objects.url`` set); started apart
    (:meth:`ObjectTier.start`, once etcd is there). ``hits(key)``: the chunk's local loads and pulls served
    (``Handoff.hits``)."""
    config = settings()
    spill_dir = None
    if config.tiers.disk_path:  # a disk victim's file is moved aside until its upload is confirmed
        spill_dir = Path(config.tiers.disk_path) / ".objects-spill"
        spill_dir.mkdir(parents=True, exist_ok=True)
    return ObjectTier(
        config, ObjectStore(config.objects), fp=fp, node_id=node_id, metrics=metrics,
        keep=lambda header: worth_keeping(header, fp=fp, num_kv_heads=num_kv_heads, hits=hits,
                                          min_hits=settings().objects.min_hits, others_hold=others_hold),
        covers=covers, ttl_s=lambda: settings().tiers.chunk_ttl_s,
        secret=secret if secret is not None else cluster_secret(config), spill_dir=spill_dir, rejects=rejects,
        covers_tenant=covers_tenant)
