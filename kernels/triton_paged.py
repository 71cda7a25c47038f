"""Triton kernel for paged-KV gather/scatter on CUDA, all layers in one launch.

Program ``(t, c)`` copies tile ``c`` of piece ``t``, where ``t`` walks the payload order of
``layout.py`` (head, layer, block, outer; a piece is one head's part of a run). Layer base
addresses come from a small int64 table, so one launch serves every layer. Copies move the
widest word (8/4/2/1 bytes) that divides every size, stride and base address. Runs on CPU
tensors under ``TRITON_INTERPRET=1`` (~1000x slower: correctness tests only). Arguments are validated by ``paged.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .layout import PagedGeometry

_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
_TL_WORDS = {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.uint8}
_TILE_BYTES = 4096


@triton.jit
def _copy_blocks_kernel(
    layer_table,  # int64[L]: base address of every layer
    ids,  # int64[n]
    payload,  # word*[heads * L * n * outer * run]
    n,
    num_layers,
    block_stride,  # in words
    outer_stride,  # in words
    outer: tl.constexpr,
    run: tl.constexpr,  # words per piece
    tile: tl.constexpr,
    word: tl.constexpr,
    to_buf: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1).to(tl.int64) * tile + tl.arange(0, tile)
    mask = offs < run
    o = t % outer
    i = (t // outer) % n
    layer = (t // (outer * n)) % num_layers
    head = t // (outer * n * num_layers)
    base = tl.load(layer_table + layer).to(tl.pointer_type(word))
    kv = base + tl.load(ids + i) * block_stride + o * outer_stride + head * run + offs
    buf = payload + t * run + offs
    if to_buf:
        tl.store(buf, tl.load(kv, mask=mask), mask=mask)
    else:
        tl.store(kv, tl.load(buf, mask=mask), mask=mask)


def word_bytes(geom: PagedGeometry, addresses: Sequence[int]) -> int:
    """Widest word size dividing every run, stride and address involved."""
    for w in (8, 4, 2):
        sizes = (geom.piece_bytes, geom.block_stride, geom.outer_stride, *addresses)
        if all(s % w == 0 for s in sizes):
            return w
    return 1


def copy_blocks(
    layers: Sequence[torch.Tensor], block_ids: torch.Tensor, buf: torch.Tensor, geom: PagedGeometry, *, to_buf: bool
) -> None:
    bases = [layer.data_ptr() for layer in layers]
    w = word_bytes(geom, [*bases, buf.data_ptr()])
    table = torch.tensor(bases, dtype=torch.int64).to(geom.device, non_blocking=True)
    ids = block_ids.to(geom.device, non_blocking=True)
    run = geom.piece_bytes // w
    tile = min(max(_TILE_BYTES // w, 16), triton.next_power_of_2(run))
    grid = (geom.heads * geom.num_layers * ids.numel() * geom.outer, triton.cdiv(run, tile))
    _copy_blocks_kernel[grid](
        table,
        ids,
        buf.view(_WORD_DTYPES[w]),
        ids.numel(),
        geom.num_layers,
        geom.block_stride // w,
        geom.outer_stride // w,
        outer=geom.outer,
        run=run,
        tile=tile,
        word=_TL_WORDS[w],
        to_buf=to_buf,
    )
