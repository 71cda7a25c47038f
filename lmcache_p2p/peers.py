"""Which owners a node can pull from: one rule for the scheduler's hit count and the worker's plan.

A node record's owner is *compatible* when this node speaks to it at all: the same wire version
and TLS setting (a TLS node and a plain one can't handshake), a transport both speak and an address
to reach it. The scheduler side counts only compatible owners as holding a chunk, so it never
offers vLLM a hit its worker could not pull (a rolling upgrade, a mixed-TLS cluster); the worker
adds what only it knows (a peer it backed off) when it plans.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Protocol

from .ids import WIRE_VERSION, NodeId, PeerAddress


class PeerRecord(Protocol):
    """What the pull side reads of a node record (``index.schema.NodeRecord`` is the one): the rule
    below, the transports a pull can take and the address it goes to."""

    @property
    def node_id(self) -> NodeId: ...
    @property
    def transports(self) -> tuple[str, ...]: ...
    @property
    def tls(self) -> bool: ...
    @property
    def wire_version(self) -> int: ...
    def peer(self) -> PeerAddress | None: ...


def compatible(record: PeerRecord | None, *, tls: bool, transports: Collection[str]) -> bool:
    """This node (TLS on or off, speaking ``transports``) can pull from ``record``'s node."""
    return (record is not None and record.wire_version == WIRE_VERSION and record.tls == tls
            and any(t in record.transports for t in transports) and record.peer() is not None)
