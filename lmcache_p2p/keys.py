"""Chunk identities: the layout fingerprint and prefix-chained BLAKE2b-128 chunk keys.

A prompt's token ids are cut into chunks of ``chunk_size`` tokens::

    tokens:  | chunk 0 (256) | chunk 1 (256) | chunk 2 (<=256, the prompt's tail) |
    keys:    k0 = H(root || t[0:256])
             k1 = H(k0   || t[256:512])
             k2 = H(k1   || t[512:...])        root = H(canonical fingerprint)

``H`` is BLAKE2b-128 (personalised ``lmcp2p-chunk``) over the previous 16-byte key followed by the
chunk's token ids as int32 little-endian. Nothing here depends on Python's ``hash()`` or a per-process
seed: the same tokens under the same fingerprint give the same keys on every host. ``H`` must resist
second preimages: a client that could write a prompt whose chunk has the key of a popular chunk (a
system prompt, a public document) would have its own KV saved under the key every other client loads
(first save wins). XXH3, which keyed the chain before (key format 3), is not built for that; BLAKE2b is,
at about the same cost per prompt (most of it is turning the token list into an array). Format 4 keys
are refused where format 3 chunks are held (the fingerprint carries the format: another fingerprint).

A request's KV depends on more than its tokens; :class:`RequestIdentity` is the rest, and
:func:`request_root` folds it into the chain's root (``root = fingerprint digest`` only for a
request with none of it, so plain prompts keep their keys)::

    root = BLAKE2b-128(fingerprint digest || adapter || cache_salt)   keyed by nothing secret but the salt
    k_i  = H(k_{i-1} || t[i] || mm items overlapping chunk i, each (content hash, offset in the chunk))

The adapter is its name and a digest of its weights (``identity.adapter_identity``); a multimodal
item's placeholder tokens are the same for every image, so its content hash and position enter
the key of every chunk it overlaps (and, chained, of every later chunk). A salt is a tenant's
secret: BLAKE2b makes the root one-way, so knowing a root says nothing of the salt.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, NewType

import msgpack
import numpy as np
import xxhash

from .errors import ConfigError

if TYPE_CHECKING:
    from .config import LayoutConfig

ChunkKey = NewType("ChunkKey", bytes)
"""16-byte BLAKE2b-128 digest identifying one chunk of KV bytes."""

FingerprintDigest = NewType("FingerprintDigest", bytes)
"""16-byte xxh3_128 digest of a canonical fingerprint."""

# 2: head-major payloads; TP size and rank left out where heads are sliceable;
# 3: no model_revision field (never set: model_id is the identity, revision or weights digest included)
# 4: chunk and segment keys chained with BLAKE2b-128, not XXH3-128 (second-preimage resistant)
KEY_FORMAT_VERSION = 4

HeadRange = tuple[int, int]
"""KV heads ``[first, end)`` of a chunk that a payload holds (chunk payloads are head-major)."""

KNOWN_CPU_LAYOUT = "vllm-cpu"
"""vLLM-CPU's block order as this version reads it, proven by the engine's probe
(``integrations/vllm/probe.py``); ``vllm-cpu+<digest>`` names another order the probe measured."""


HEAD_MAJOR_ORDERS = frozenset({"LBHNC", "BLHNC"})
"""vLLM's KV cache layouts (``vllm/v1/kv_cache_layout.py``: a stride permutation of the logical
``[layer, block, head, token, content]``) whose blocks hold each KV head's tokens as one run."""


def is_head_major(kv_layout: str) -> bool:
    """Layouts whose heads lead each block's bytes (see ``kernels/layout.py``; the probe checks each
    head's values stay in its own run): their chunks are stored head-major, so any TP layout can use
    any other's. Elsewhere each TP rank's bytes are its own. GPU layouts are named
    ``vllm-<device>:<backend>:<order>`` (``integrations/vllm/layout.py``)."""
    if kv_layout == KNOWN_CPU_LAYOUT or kv_layout.startswith(KNOWN_CPU_LAYOUT + "+"):
        return True
    return kv_layout.startswith("vllm-") and ":" in kv_layout and kv_layout.rsplit(":", 1)[1] in HEAD_MAJOR_ORDERS


def head_range(num_kv_heads: int, tp_size: int, tp_rank: int) -> HeadRange:
    """The KV heads a tensor-parallel rank holds, as vLLM shards them: ``H / tp`` each, or one
    head replicated over ``tp / H`` ranks when there are more ranks than heads."""
    if tp_size <= 0 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} not in [0, {tp_size})")
    if tp_size <= num_kv_heads:
        if num_kv_heads % tp_size:
            raise ValueError(f"{num_kv_heads} KV heads do not split over {tp_size} ranks")
        per = num_kv_heads // tp_size
        return tp_rank * per, (tp_rank + 1) * per
    if tp_size % num_kv_heads:
        raise ValueError(f"{tp_size} ranks do not share {num_kv_heads} KV heads evenly")
    head = tp_rank // (tp_size // num_kv_heads)
    return head, head + 1


@dataclasses.dataclass(frozen=True, slots=True)
class Fingerprint:
    """Everything that makes KV bytes of one node usable by another.

    Two nodes share chunks only when their fingerprints are byte-identical. ``num_kv_heads`` is
    the model's (every rank's heads together); which of them a node holds is in its node record
    and every chunk header. ``tp_size``/``tp_rank`` are 1/0 for head-major layouts (the bytes do
    not depend on the sharding) and the engine's own otherwise.
    """

    model_id: str
    kv_dtype: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int
    kv_layout: str
    tp_size: int = 1
    tp_rank: int = 0
    tenant_salt: str = ""

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_size", "block_size", "tp_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"fingerprint.{name}", f"must be > 0, got {getattr(self, name)}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError("fingerprint.tp_rank", f"must be in [0, {self.tp_size}), got {self.tp_rank}")
        if not self.model_id:
            raise ConfigError("fingerprint.model_id", "must not be empty")

    def canonical(self) -> bytes:
        """Canonical msgpack: a fixed-order array, format version first."""
        fields = [KEY_FORMAT_VERSION] + [getattr(self, f.name) for f in dataclasses.fields(self)]
        return msgpack.packb(fields, use_bin_type=True)

    @classmethod
    def of(cls, layout: LayoutConfig, tp_size: int = 1, tp_rank: int = 0) -> Fingerprint:
        """The one way to build a fingerprint: from a layout (the engine's, see
        ``integrations/vllm/layout.py``, or a standalone agent's config) and the engine's sharding,
        which counts only where the layout's heads can't be sliced."""
        if is_head_major(layout.kv_layout):
            tp_size, tp_rank = 1, 0
        return cls(model_id=layout.model_id, kv_dtype=layout.kv_dtype, num_layers=layout.num_layers,
                   num_kv_heads=layout.num_kv_heads, head_size=layout.head_size, block_size=layout.block_size,
                   kv_layout=layout.kv_layout, tp_size=tp_size, tp_rank=tp_rank, tenant_salt=layout.tenant_salt)

    @property
    def digest(self) -> FingerprintDigest:
        return FingerprintDigest(xxhash.xxh3_128_digest(self.canonical()))

    @property
    def short(self) -> str:
        return self.digest.hex()[:12]


def piece_key(key: ChunkKey, heads: HeadRange, nonce: bytes = b"") -> ChunkKey:
    """The local pool key of heads ``heads`` of chunk ``key`` while the chunk is assembled from
    pieces (never announced, never served); ``nonce``: one pull's own (a canary's copy of one owner)."""
    return ChunkKey(xxhash.xxh3_128_digest(b"piece" + bytes(key) + heads[0].to_bytes(2, "little")
                                           + heads[1].to_bytes(2, "little") + nonce))


def tokens_to_array(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Convert once per request; hashing then works on slices without copies."""
    arr = np.asarray(token_ids, dtype="<i4")
    if arr.ndim != 1:
        raise ValueError(f"token_ids must be one-dimensional, got shape {arr.shape}")
    return arr


@dataclasses.dataclass(frozen=True, slots=True)
class MultiModalItem:
    """One multimodal input of a prompt: vLLM's content hash and its placeholder tokens' span."""

    content_hash: str
    offset: int
    length: int

    def __post_init__(self) -> None:
        if not self.content_hash or self.offset < 0 or self.length <= 0:
            raise ValueError(f"multimodal item needs a hash and a span, got {self}")


@dataclasses.dataclass(frozen=True, slots=True)
class RequestIdentity:
    """What besides its token ids changes a request's KV (see the module docstring)."""

    adapter: str = ""  # "name@weights digest" of a LoRA adapter; "" for the base model
    cache_salt: str = ""  # vLLM's per-request cache isolation (a tenant's secret)
    mm_items: tuple[MultiModalItem, ...] = ()  # sorted by offset

    @property
    def plain(self) -> bool:
        return not (self.adapter or self.cache_salt or self.mm_items)


def request_root(fp: FingerprintDigest, identity: RequestIdentity | None) -> FingerprintDigest:
    """The key chain's root for a request: the fingerprint digest itself when nothing but the
    tokens distinguishes it, else a one-way digest of the fingerprint, the adapter and the salt."""
    if identity is None or not (identity.adapter or identity.cache_salt):
        return fp
    h = hashlib.blake2b(digest_size=16, person=b"lmcp2p-request")
    h.update(bytes(fp))
    h.update(msgpack.packb([identity.adapter, identity.cache_salt], use_bin_type=True))
    return FingerprintDigest(h.digest())


def chunk_keys(
    root: FingerprintDigest,
    token_ids: Sequence[int] | np.ndarray,
    chunk_size: int,
    *,
    include_partial: bool = True,
    mm_items: Sequence[MultiModalItem] = (),
) -> list[ChunkKey]:
    """Keys of every chunk of ``token_ids``; the tail chunk too when ``include_partial``. Each
    multimodal item enters the key of every chunk its placeholder tokens overlap."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    arr = tokens_to_array(token_ids)
    end = len(arr) if include_partial else len(arr) - len(arr) % chunk_size
    return chunk_keys_from(root, arr[:end], chunk_size, 0, mm_items)


def chunk_keys_from(parent: bytes, token_ids: Sequence[int] | np.ndarray, chunk_size: int, offset: int,
                    mm_items: Sequence[MultiModalItem] = ()) -> list[ChunkKey]:
    """Keys of the chunks of ``token_ids``, which start at position ``offset`` of their prompt (a multiple of
    ``chunk_size``; multimodal items are at prompt positions), chained from ``parent``: the key of the chunk
    before (the root when ``offset`` is 0). What :func:`chunk_keys` of the whole prompt gives from there,
    without hashing what came before (a request's generated chunks, one at a time)."""
    arr = tokens_to_array(token_ids)
    keys: list[ChunkKey] = []
    prev = bytes(parent)
    for start in range(0, len(arr), chunk_size):
        stop = min(start + chunk_size, len(arr))
        prev = bytes(_chunk_key(prev, arr, start, stop, mm_items, offset))
        keys.append(ChunkKey(prev))
    return keys


def partial_chunk_keys(parent: bytes, token_ids: Sequence[int] | np.ndarray, start: int, longest: int,
                       mm_items: Sequence[MultiModalItem] = ()) -> Iterator[tuple[int, ChunkKey]]:
    """``(n, key)`` of the chunk starting at ``start`` cut after ``n`` tokens, for ``n = longest .. 1``:
    the keys a chunk saved shorter than its span in this prompt would have (a conversation's previous
    turn ended inside it). ``parent`` is the previous chunk's key (the root for the first chunk).
    One pass over the tokens (a hash state per length), then the keys lazily, longest first: a probe
    stops at the first one held."""
    arr = tokens_to_array(token_ids)
    h = _chain(parent)
    states = []
    for i in range(start, start + longest):
        h.update(arr[i:i + 1].tobytes())
        states.append(h.copy())
    for n in range(longest, 0, -1):
        state, stop = states[n - 1], start + n
        items = [[m.content_hash, m.offset - start, m.length] for m in mm_items
                 if m.offset < stop and m.offset + m.length > start]
        if items:
            state = state.copy()
            state.update(msgpack.packb(items, use_bin_type=True))
        yield n, ChunkKey(state.digest())


def _chain(prev: bytes) -> Any:
    """``H``'s state after the previous key (the chain's link: see the module docstring)."""
    return hashlib.blake2b(prev, digest_size=16, person=b"lmcp2p-chunk")


def _chunk_key(prev: bytes, arr: np.ndarray, start: int, stop: int, mm_items: Sequence[MultiModalItem],
               offset: int = 0) -> ChunkKey:
    h = _chain(prev)
    h.update(arr[start:stop].tobytes())
    first, last = offset + start, offset + stop  # the chunk's positions in its prompt
    items = [[m.content_hash, m.offset - first, m.length] for m in mm_items
             if m.offset < last and m.offset + m.length > first]
    if items:
        h.update(msgpack.packb(items, use_bin_type=True))
    return ChunkKey(h.digest())


def chunk_spans(num_tokens: int, chunk_size: int) -> list[tuple[int, int]]:
    """``[start, end)`` token ranges of each chunk, the partial tail included."""
    return [(s, min(s + chunk_size, num_tokens)) for s in range(0, num_tokens, chunk_size)]


# What a segment's canonical KV is computed after, besides the base (``blend.lead_in``): "none", the base
# alone; "self", a copy of the segment itself (its tokens are then read as a document after another document,
# as in most prompts that declare it; docs/benchmarks/blend.md measures what it does to answers). Each has its
# own chain personalization ("none": as before lead-ins existed), so KV of one is never found as the other.
_SEGMENT_PERSON = {"none": b"lmcp2p-segment", "self": b"lmcp2p-seg-self"}
LEAD_INS = tuple(_SEGMENT_PERSON)


def segment_root(root: FingerprintDigest, base: Sequence[int] | np.ndarray, lead_in: str = "none") -> FingerprintDigest:
    """The chain root of a request's independent segments (documents reused in any order): the
    request's root and the tokens before its first segment (the system prompt, "the base"), never
    what precedes a segment. A segment's chunks chain from here over its own tokens
    (:func:`chunk_keys`), so the same document after the same base has the same keys at any offset.
    ``lead_in`` (:data:`LEAD_INS`) names what the segment's KV was computed after besides the base: KV
    computed one way is never found under the other's keys."""
    if lead_in not in _SEGMENT_PERSON:
        raise ValueError(f"lead-in {lead_in!r}: one of {', '.join(_SEGMENT_PERSON)}")
    h = hashlib.blake2b(bytes(root), digest_size=16, person=_SEGMENT_PERSON[lead_in])
    h.update(tokens_to_array(base).tobytes())
    return FingerprintDigest(h.digest())
