"""Geometry of a paged KV cache, and the checks every gather/scatter wrapper runs.

A layer's KV tensor has one dimension, ``block_dim``, that indexes engine blocks. Everything
after it is one contiguous byte run; everything before it collapses to a single strided
"outer" dimension. Seen as bytes, every layer is therefore a ``(num_blocks, outer, run)``
view, and one engine block is ``outer`` runs of ``run_bytes`` bytes::

    vLLM CPU   (num_blocks, kv_heads, block_size, 2*head)   block_dim=0  outer=1
    CUDA flash (2, num_blocks, block_size, kv_heads, head)  block_dim=1  outer=2 (K run, V run)

With ``heads`` > 1 the KV heads are the first dimension after ``block_dim`` (vLLM CPU's
block-interior layout; HND layouts on CUDA), so each run is ``heads`` equal *pieces*, one per
head. The chunk payload is head-major, then layer, then block, then outer order::

    | head 0: layer 0: b0[o0 o1..] b1[..] .. | layer 1: .. | .. | head 1: layer 0: .. | .. |
      <-------------------- L * n * outer * piece_bytes ---------> (one head's segment)

so the heads ``[a, b)`` of a chunk are one contiguous byte range: a tensor-parallel rank that
holds some of the heads stores, and pulls, exactly its range, and ranges from several owners
concatenate. With ``heads`` = 1 (a layout whose heads are not outermost in a block) it is
simply layer-major, then block, then outer order.

All layers must share shape, strides, dtype and device (vLLM allocates them alike).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch


@dataclasses.dataclass(frozen=True, slots=True)
class PagedGeometry:
    """Byte geometry shared by every layer; derived and checked by :func:`describe`."""

    num_layers: int
    num_blocks: int
    outer: int
    run_bytes: int
    block_stride: int  # bytes between consecutive blocks
    outer_stride: int  # bytes between the outer runs of one block
    elem_size: int
    dtype: torch.dtype
    device: torch.device
    heads: int = 1  # KV heads split out of each run (head-major payload)

    @property
    def block_bytes(self) -> int:
        return self.outer * self.run_bytes

    @property
    def piece_bytes(self) -> int:
        """Bytes of one head in one run."""
        return self.run_bytes // self.heads

    def payload_nbytes(self, num_blocks: int) -> int:
        return self.num_layers * num_blocks * self.block_bytes

    def byte_view(self, layer: torch.Tensor) -> torch.Tensor:
        """``layer`` as a ``(num_blocks, outer, run_bytes)`` uint8 view sharing its storage."""
        raw = torch.empty(0, dtype=torch.uint8, device=layer.device).set_(layer.untyped_storage())
        return raw.as_strided(
            (self.num_blocks, self.outer, self.run_bytes),
            (self.block_stride, self.outer_stride, 1),
            layer.storage_offset() * self.elem_size,
        )


def describe(layers: Sequence[torch.Tensor], block_dim: int = 0, heads: int = 1) -> PagedGeometry:
    """Check ``layers`` and return their geometry; raise ``ValueError`` naming what is wrong.

    ``heads`` > 1 splits each run by KV head: the dimension right after ``block_dim`` must be
    the heads and have that size."""
    if len(layers) == 0:
        raise ValueError("layers: need at least one KV tensor")
    first = layers[0]
    if not isinstance(first, torch.Tensor):
        raise ValueError(f"layers[0]: expected a torch.Tensor, got {type(first).__name__}")
    if not 0 <= block_dim < first.dim():
        raise ValueError(f"block_dim={block_dim} out of range for a {first.dim()}-d KV tensor")
    for i, t in enumerate(layers):
        _check_like(i, t, first)
    elem = first.element_size()
    shape, strides = first.shape, first.stride()
    run_elems = _contiguous_run(shape, strides, block_dim)
    outer, outer_stride = _collapse_outer(shape, strides, block_dim)
    if heads < 1:
        raise ValueError(f"heads must be >= 1, got {heads}")
    if heads > 1 and (first.dim() <= block_dim + 1 or shape[block_dim + 1] != heads):
        raise ValueError(f"heads={heads}: the dim after block_dim={block_dim} must be the KV heads "
                         f"(shape {tuple(shape)})")
    return PagedGeometry(
        num_layers=len(layers),
        num_blocks=shape[block_dim],
        outer=outer,
        run_bytes=run_elems * elem,
        block_stride=strides[block_dim] * elem,
        outer_stride=outer_stride * elem,
        elem_size=elem,
        dtype=first.dtype,
        device=first.device,
        heads=heads,
    )


def memory_order(layer: torch.Tensor) -> tuple[int, ...]:
    """``layer``'s dims from the largest stride to the smallest (ties keep their order): the order its
    elements lie in memory, whatever order its shape names them in."""
    strides = layer.stride()
    return tuple(sorted(range(layer.dim()), key=lambda d: (-strides[d], d)))


def physical_view(layer: torch.Tensor, block_dim: int = 0) -> tuple[torch.Tensor, int]:
    """``layer`` with its dims permuted into memory order, and where ``block_dim`` went. A KV tensor
    whose shape is logical (vLLM >= 0.32: ``(blocks, heads, tokens, content)`` under a stride
    permutation, the KV cache layout) becomes one :func:`describe` can read."""
    order = memory_order(layer)
    return layer.permute(*order), order.index(block_dim)


def _check_like(i: int, t: torch.Tensor, first: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"layers[{i}]: expected a torch.Tensor, got {type(t).__name__}")
    for what, got, want in (
        ("shape", tuple(t.shape), tuple(first.shape)),
        ("strides", t.stride(), first.stride()),
        ("dtype", t.dtype, first.dtype),
        ("device", t.device, first.device),
    ):
        if got != want:
            raise ValueError(f"layers[{i}]: {what} {got} differs from layers[0] {what} {want}")
    if t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"layers[{i}]: unsupported KV dtype {t.dtype}")


def _contiguous_run(shape: torch.Size, strides: tuple[int, ...], block_dim: int) -> int:
    """Elements per run: the dims after ``block_dim`` must be densely packed (row-major)."""
    expected = 1
    for d in range(len(shape) - 1, block_dim, -1):
        if shape[d] != 1 and strides[d] != expected:
            raise ValueError(
                f"KV tensor is not contiguous within a block: dim {d} has stride {strides[d]}, "
                f"expected {expected} (shape {tuple(shape)}, strides {strides})"
            )
        expected *= shape[d]
    if expected == 0:
        raise ValueError(f"KV tensor has an empty block (shape {tuple(shape)})")
    return expected


def _collapse_outer(shape: torch.Size, strides: tuple[int, ...], block_dim: int) -> tuple[int, int]:
    """Collapse the dims before ``block_dim`` to one ``(size, stride)``; they must nest evenly."""
    dims = [(shape[d], strides[d]) for d in range(block_dim) if shape[d] != 1]
    if not dims:
        return 1, 0
    for (_, s_hi), (n_lo, s_lo) in zip(dims, dims[1:], strict=False):
        if s_hi != s_lo * n_lo:
            raise ValueError(
                f"dims before block_dim={block_dim} do not collapse to one stride "
                f"(shape {tuple(shape)}, strides {strides})"
            )
    return math.prod(n for n, _ in dims), dims[-1][1]


def check_block_ids(block_ids: torch.Tensor, geom: PagedGeometry, *, unique: bool) -> int:
    """Check a CPU int64 1-d id tensor against ``geom``; return its length."""
    if not isinstance(block_ids, torch.Tensor):
        raise ValueError(f"block_ids: expected a torch.Tensor, got {type(block_ids).__name__}")
    if block_ids.dtype != torch.int64 or block_ids.dim() != 1:
        raise ValueError(f"block_ids: expected a 1-d int64 tensor, got {block_ids.dim()}-d {block_ids.dtype}")
    if block_ids.device.type != "cpu":
        raise ValueError(f"block_ids: must be on the CPU (checked before launch), got {block_ids.device}")
    ids = block_ids.tolist()  # cheaper than torch reductions for the few ids of a chunk
    if not ids:
        return 0
    lo, hi = min(ids), max(ids)
    if lo < 0 or hi >= geom.num_blocks:
        raise ValueError(f"block_ids: ids must lie in [0, {geom.num_blocks}), got min {lo} max {hi}")
    if unique and len(set(ids)) != len(ids):
        raise ValueError("block_ids: scatter needs distinct block ids (duplicates would race)")
    return len(ids)


def check_buffer(name: str, buf: torch.Tensor, geom: PagedGeometry, num_blocks: int) -> None:
    """``buf`` must be a contiguous uint8 tensor on the KV device holding exactly the payload."""
    if not isinstance(buf, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(buf).__name__}")
    if buf.dtype != torch.uint8:
        raise ValueError(f"{name}: expected dtype torch.uint8, got {buf.dtype}")
    if not buf.is_contiguous():
        raise ValueError(f"{name}: must be contiguous (strides {buf.stride()})")
    if buf.device != geom.device:
        raise ValueError(f"{name}: on {buf.device}, but the KV cache is on {geom.device}")
    want = geom.payload_nbytes(num_blocks)
    if buf.numel() != want:
        raise ValueError(
            f"{name}: holds {buf.numel()} bytes, payload is {want} "
            f"({geom.num_layers} layers x {num_blocks} blocks x {geom.block_bytes} bytes); slice it to fit"
        )
