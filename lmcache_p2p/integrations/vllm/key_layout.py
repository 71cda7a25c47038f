"""Where vLLM-CPU's attention keeps each key in its paged cache, found with vLLM's own op, and whether
keys moved there by ``kernels.rope`` equal keys the engine computes at the target position.

A layer's cache is ``(num_blocks, kv_heads, block_size, 2 * head_size)``; each (block, head) run
holds K then V. V is token-major; K's order depends on the attention kernel's ISA (vLLM 0.32's
vector kernels store it dimension-major, ``(head_size, block_size)``). Nothing documents this, so
the worker asks: it writes known keys with ``cpu_attn_reshape_and_cache`` (what the forward pass
calls) and looks where they landed. Then it moves keys written at one position by a delta and
compares them with keys written at the target: segments reused at another position are enabled
only when that self-test passes ("dims"/"tokens" layout), never on a layout it can't place.
"""

from __future__ import annotations

import logging

import torch

from ...kernels.rope import RopeSpec, rerotate_, rope_reference

log = logging.getLogger(__name__)


def _write(keys: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, isa: str) -> None:
    from vllm import _custom_ops as ops

    blocks, heads, block_size, _ = cache.shape
    key_cache, value_cache = cache.view(blocks, heads, 2 * block_size, -1).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(keys, torch.zeros_like(keys), key_cache, value_cache, slots, isa)


def key_views(cache: torch.Tensor, layout: str) -> torch.Tensor:
    """The K halves of a layer's cache, ``(blocks, heads, head_size, block_size)`` for "dims" or
    ``(blocks, heads, block_size, head_size)`` for "tokens" (views: writes land in the cache)."""
    blocks, heads, block_size, twice = cache.shape
    head_size = twice // 2
    runs = cache.view(blocks, heads, 2, block_size * head_size)[:, :, 0]
    if layout == "dims":
        return runs.unflatten(-1, (head_size, block_size))
    return runs.unflatten(-1, (block_size, head_size))


def find_key_layout(dtype: torch.dtype, block_size: int, head_size: int, isa: str) -> str | None:
    """"dims" or "tokens": how ``isa``'s kernels store K in a block; None when neither."""
    heads, tokens = 2, min(block_size, 8)
    keys = (torch.arange(tokens * heads * head_size, dtype=torch.float32) % 127 + 1).view(tokens, heads, head_size)
    keys = keys.to(dtype)
    cache = torch.zeros(2, heads, block_size, 2 * head_size, dtype=dtype)
    _write(keys, cache, torch.arange(tokens, dtype=torch.int64) + block_size, isa)  # block 1
    dims = key_views(cache, "dims")[1].permute(2, 0, 1)  # (block_size, heads, head_size)
    if torch.equal(dims[:tokens], keys):
        return "dims"
    if torch.equal(key_views(cache, "tokens")[1].transpose(0, 1)[:tokens], keys):
        return "tokens"
    return None


def self_test(spec: RopeSpec, dtype: torch.dtype, block_size: int, isa: str, delta: int = 1000) -> str | None:
    """The key layout if keys written at positions ``p`` and moved by ``delta`` in the cache equal keys
    written at ``p + delta`` (within two roundings of ``dtype``); else None, with the reason logged."""
    layout = find_key_layout(dtype, block_size, spec.head_size, isa)
    if layout is None:
        log.info("lmcache-p2p: vLLM's %s attention keeps keys in an order this version does not know", isa)
        return None
    g = torch.Generator().manual_seed(0)
    heads = 2
    raw = torch.randn(block_size, heads, spec.head_size, generator=g)
    pos = torch.arange(block_size)
    moved = torch.zeros(1, heads, block_size, 2 * spec.head_size, dtype=dtype)
    target = torch.zeros_like(moved)
    slots = torch.arange(block_size, dtype=torch.int64)
    _write(rope_reference(raw, pos + 7, spec).to(dtype), moved, slots, isa)
    _write(rope_reference(raw, pos + 7 + delta, spec).to(dtype), target, slots, isa)
    rerotate_(key_views(moved, layout), delta, spec, dims_axis=2 if layout == "dims" else 3)
    err = float((moved.float() - target.float()).abs().max())
    tol = 1e-4 if dtype == torch.float32 else 0.05 * float(target.float().abs().max())
    if err > tol:
        log.warning("lmcache-p2p: moved keys differ from keys computed at the target by %.3g (tolerance %.3g); "
                    "segments are reused only where they were computed", err, tol)
        return None
    return layout
