"""What every chunk that arrives is checked for before it is committed, on the loop or on a checker thread.

A chunk's payload must match its header's checksum (xxh3, ``chunk.verify``), and where the session asks for
it, carry the owner's session MAC over its header and payload (``wire.chunk_mac``). The same check serves a
chunk read off a socket (``connection.py``) and a chunk a NIXL READ brought in (``nixl.py``). xxhash and
OpenSSL's GMAC release the GIL, so a batch of chunks checked on a thread of its own runs beside the loop that
receives the next ones.
"""

from __future__ import annotations

import dataclasses

from ..chunk import ChunkHeader, verify
from ..errors import ChunkError
from . import wire
from .base import MissReason


@dataclasses.dataclass(frozen=True, slots=True)
class PayloadMac:
    """What a chunk's session MAC covers, and the MAC the owner claimed (None: it sent none)."""

    key: bytes
    rid: int
    index: int
    header: bytes
    claimed: object


def verdict(header: ChunkHeader, payload: memoryview, mac: PayloadMac | None) -> MissReason | None:
    """None for a chunk that is intact (and carries its MAC, where one is asked for); else why it is not."""
    if mac is not None and not wire.proof_ok(wire.chunk_mac(mac.key, mac.rid, mac.index, mac.header, payload),
                                             mac.claimed):
        return MissReason.MAC
    try:
        verify(header, payload)
    except ChunkError:
        return MissReason.CHECKSUM
    return None


def verdicts(items: list[tuple[ChunkHeader, memoryview, PayloadMac | None]]) -> list[MissReason | None]:
    """:func:`verdict` of each item (a header, the view its payload landed in, its MAC): for a checker thread."""
    return [verdict(header, view[: header.length], mac) for header, view, mac in items]
