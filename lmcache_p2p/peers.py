"""Which owners a node can pull from: one rule for the scheduler's hit count and the worker's plan.

A node record's owner is *compatible* when this node speaks to it at all: the same wire version
and TLS setting (a TLS node and a plain one can't handshake), a transport both speak and an address
to reach it. The scheduler side counts only compatible owners as holding a chunk, so it never
offers vLLM a hit its worker could not pull (a rolling upgrade, a mixed-TLS cluster); the worker
adds what only it knows (a peer it backed off) when it plans.
"""

from __future__ import annotations

from collections.abc import Collection

from .index.schema import WIRE_VERSION, NodeRecord
from .transfer.base import PeerAddress


def peer_address(record: NodeRecord) -> PeerAddress | None:
    """Where ``record``'s transfer server listens (its first address), bound to its node id."""
    address = next(iter(record.addresses.values()), None)
    if address is None:
        return None
    host, _, port = address.rpartition(":")
    return PeerAddress(host, int(port), record.node_id) if port.isdigit() and host else None


def compatible(record: NodeRecord | None, *, tls: bool, transports: Collection[str]) -> bool:
    """This node (TLS on or off, speaking ``transports``) can pull from ``record``'s node."""
    return (record is not None and record.wire_version == WIRE_VERSION and record.tls == tls
            and any(t in record.transports for t in transports) and peer_address(record) is not None)
