"""Triton kernel for :func:`kernels.rope.rerotate_triton_`: keys seen as (rows, head_size, cols), every
pair of dimensions turned by one angle per pair (one delta for all tokens); rows may be strided (K
halves of a cache whose V follows). Program ``(r, c)`` turns
columns ``[c*BLOCK_C, (c+1)*BLOCK_C)`` of row ``r``, all pairs at once, in float32. Runs on CPU
tensors under ``TRITON_INTERPRET=1`` (the tests)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rerotate_kernel(keys, cos, sin, row_stride, cols, half, neox: tl.constexpr, block_i: tl.constexpr,
                     block_c: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)  # rows * row_stride may pass 2**31 in a large cache
    c0 = tl.program_id(1) * block_c
    i = tl.arange(0, block_i)[:, None]
    c = c0 + tl.arange(0, block_c)[None, :]
    mask = (i < half) & (c < cols)
    if neox:
        ia = i
        ib = i + half
    else:
        ia = 2 * i
        ib = 2 * i + 1
    base = keys + r * row_stride
    a = tl.load(base + ia * cols + c, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(base + ib * cols + c, mask=mask, other=0.0).to(tl.float32)
    co = tl.load(cos + i, mask=i < half, other=1.0)
    si = tl.load(sin + i, mask=i < half, other=0.0)
    tl.store(base + ia * cols + c, (a * co - b * si).to(keys.dtype.element_ty), mask=mask)
    tl.store(base + ib * cols + c, (b * co + a * si).to(keys.dtype.element_ty), mask=mask)


def rerotate_kernel_launch(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int,
                           neox: bool) -> None:
    rows, _, cols = keys.shape
    if keys.stride(2) != 1 or keys.stride(1) != cols:
        raise ValueError(f"keys: each row must be a contiguous (head_size, cols) matrix, strides {keys.stride()}")
    half = rotary_dim // 2
    block_c = min(64, triton.next_power_of_2(cols))
    grid = (rows, triton.cdiv(cols, block_c))
    _rerotate_kernel[grid](keys, cos, sin, keys.stride(0), cols, half, neox=neox,
                           block_i=triton.next_power_of_2(half), block_c=block_c)
