"""Gather/scatter whole engine blocks of every layer to/from one contiguous chunk payload.

    gather(layers, block_ids, out)   paged KV cache -> payload   (store a chunk)
    scatter(buf, layers, block_ids)  payload -> paged KV cache   (load a chunk)

The payload order and the accepted layouts are drawn in ``layout.py``. A prompt's partial
tail chunk still occupies whole engine blocks, so whole blocks are always copied. Every
call validates its arguments first (shapes, strides, dtypes, devices, sizes, id range) and
raises ``ValueError`` naming the bad argument; the backends then trust them.

Backends (``backend=``): ``"cpp"`` one memcpy per block run in a small C++ extension (CPU);
``"torch"`` ``index_select``/numpy fancy assignment on byte views (CPU, or any device
for gather); ``"triton"`` a Triton kernel (CUDA; CPU tensors under ``TRITON_INTERPRET=1``);
``"auto"`` picks triton on CUDA, else cpp when it builds, else torch.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Literal

import torch

from . import cpu_ext
from .layout import PagedGeometry, check_block_ids, check_buffer, describe

Backend = Literal["auto", "cpp", "torch", "triton"]


def payload_nbytes(layers: Sequence[torch.Tensor], num_blocks: int, *, block_dim: int = 0) -> int:
    """Bytes of the payload that ``num_blocks`` blocks of ``layers`` gather into."""
    return describe(layers, block_dim).payload_nbytes(num_blocks)


def gather(
    layers: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    out: torch.Tensor,
    *,
    block_dim: int = 0,
    backend: Backend = "auto",
) -> None:
    """Copy blocks ``block_ids`` of every layer, layer-major, into the uint8 tensor ``out``."""
    geom = describe(layers, block_dim)
    n = check_block_ids(block_ids, geom, unique=False)
    check_buffer("out", out, geom, n)
    if n:
        _run(resolve_backend(geom.device, backend), layers, block_ids, out, geom, to_buf=True)


def scatter(
    buf: torch.Tensor,
    layers: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    *,
    block_dim: int = 0,
    backend: Backend = "auto",
) -> None:
    """Copy the uint8 payload ``buf`` into blocks ``block_ids`` (distinct) of every layer."""
    geom = describe(layers, block_dim)
    n = check_block_ids(block_ids, geom, unique=True)
    check_buffer("buf", buf, geom, n)
    if n:
        _run(resolve_backend(geom.device, backend), layers, block_ids, buf, geom, to_buf=False)


def resolve_backend(device: torch.device, backend: Backend = "auto") -> Backend:
    """The concrete backend for ``device``; builds the C++ extension if that is the pick."""
    if backend == "auto":
        if device.type == "cuda":
            return "triton"
        return "cpp" if device.type == "cpu" and cpu_ext.load() is not None else "torch"
    if backend == "cpp" and (device.type != "cpu" or cpu_ext.load() is None):
        raise ValueError(f"backend='cpp' needs CPU tensors and a buildable extension (device {device})")
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1), got device {device}")
    if backend not in ("cpp", "torch", "triton"):
        raise ValueError(f"backend: expected auto, cpp, torch or triton, got {backend!r}")
    return backend


def _run(
    backend: Backend,
    layers: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    buf: torch.Tensor,
    geom: PagedGeometry,
    *,
    to_buf: bool,
) -> None:
    if backend == "cpp":
        module = cpu_ext.load()
        assert module is not None  # resolve_backend checked
        cpu_ext.copy_blocks(module, layers, block_ids, buf, geom, to_buf=to_buf)
    elif backend == "triton":
        from . import triton_paged

        triton_paged.copy_blocks(layers, block_ids, buf, geom, to_buf=to_buf)
    elif to_buf:
        _torch_gather(layers, block_ids, buf, geom)
    else:
        _torch_scatter(buf, layers, block_ids, geom)


def _payload_views(buf: torch.Tensor, geom: PagedGeometry, n: int) -> torch.Tensor:
    return buf.view(geom.num_layers, n, geom.outer, geom.run_bytes)


def _torch_gather(layers: Sequence[torch.Tensor], ids: torch.Tensor, out: torch.Tensor, geom: PagedGeometry) -> None:
    dst = _payload_views(out, geom, ids.numel())
    ids = ids.to(geom.device)
    for i, layer in enumerate(layers):
        torch.index_select(geom.byte_view(layer), 0, ids, out=dst[i])


def _torch_scatter(buf: torch.Tensor, layers: Sequence[torch.Tensor], ids: torch.Tensor, geom: PagedGeometry) -> None:
    src = _payload_views(buf, geom, ids.numel())
    if geom.device.type == "cpu":  # numpy fancy assignment is ~3x faster than index_copy_ here
        idx = ids.numpy()
        for i, layer in enumerate(layers):
            geom.byte_view(layer).numpy()[idx] = src[i].numpy()
        return
    ids = ids.to(geom.device)
    for i, layer in enumerate(layers):
        geom.byte_view(layer).index_copy_(0, ids, src[i])


def gather_reference(layers: Sequence[torch.Tensor], block_ids: torch.Tensor, *, block_dim: int = 0) -> torch.Tensor:
    """Plain-torch definition of the payload (allocates; for tests and checks only)."""
    parts = []
    for layer in layers:
        blocks = layer.movedim(block_dim, 0)[block_ids.to(layer.device)]  # (n, *outer dims, *run dims)
        parts.append(blocks.contiguous().view(torch.uint8).reshape(-1))
    return torch.cat(parts)


def scatter_reference(
    buf: torch.Tensor, layers: Sequence[torch.Tensor], block_ids: torch.Tensor, *, block_dim: int = 0
) -> None:
    """Plain-torch inverse of :func:`gather_reference` (for tests only)."""
    per_layer = buf.numel() // len(layers)
    for i, layer in enumerate(layers):
        moved = layer.movedim(block_dim, 0)
        shape = (block_ids.numel(), *moved.shape[1:])
        chunk = buf[i * per_layer : (i + 1) * per_layer].view(layer.dtype).view(shape)
        moved[block_ids.to(layer.device)] = chunk
