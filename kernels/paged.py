"""Gather/scatter whole engine blocks of every layer to/from one contiguous chunk payload.

    kv = PagedKV(layers)             validate the engine's layer tensors once
    kv.gather(block_ids, out)        paged KV cache -> payload   (store a chunk)
    kv.scatter(buf, block_ids)       payload -> paged KV cache   (load a chunk)
    gather(layers, block_ids, out) / scatter(buf, layers, block_ids): one-shot forms

The payload order and the accepted layouts are drawn in ``layout.py``. A prompt's partial
tail chunk still occupies whole engine blocks, so whole blocks are always copied. Arguments
are validated before any copy (layers: shapes, strides, dtypes, devices; per call: id
dtype/range/uniqueness, buffer dtype/contiguity/device/size) and a bad one raises
``ValueError`` naming it; the backends then trust them. ``block_ids`` is a CPU int64 tensor.

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


class PagedKV:
    """One engine's per-layer KV tensors, validated once; then cheap gathers and scatters.

    Build it where the engine hands over its caches (vLLM: ``register_kv_caches``): the
    layer checks and the backend choice (which may build the C++ extension) happen here.
    """

    def __init__(self, layers: Sequence[torch.Tensor], *, block_dim: int = 0, heads: int = 1,
                 backend: Backend = "auto") -> None:
        self.geometry = describe(layers, block_dim, heads)
        self.layers = tuple(layers)
        self.block_dim = block_dim
        self.backend = resolve_backend(self.geometry.device, backend)

    def payload_nbytes(self, num_blocks: int) -> int:
        return self.geometry.payload_nbytes(num_blocks)

    def gather(self, block_ids: torch.Tensor, out: torch.Tensor) -> None:
        """Copy blocks ``block_ids`` of every layer, in payload order, into the uint8 tensor ``out``."""
        n = check_block_ids(block_ids, self.geometry, unique=False)
        check_buffer("out", out, self.geometry, n)
        if n:
            _run(self.backend, self.layers, block_ids, out, self.geometry, to_buf=True)

    def scatter(self, buf: torch.Tensor, block_ids: torch.Tensor) -> None:
        """Copy the uint8 payload ``buf`` into blocks ``block_ids`` (distinct) of every layer."""
        n = check_block_ids(block_ids, self.geometry, unique=True)
        check_buffer("buf", buf, self.geometry, n)
        if n:
            _run(self.backend, self.layers, block_ids, buf, self.geometry, to_buf=False)


def payload_nbytes(layers: Sequence[torch.Tensor], num_blocks: int, *, block_dim: int = 0) -> int:
    """Bytes of the payload that ``num_blocks`` blocks of ``layers`` gather into."""
    return describe(layers, block_dim).payload_nbytes(num_blocks)


def gather(
    layers: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    out: torch.Tensor,
    *,
    block_dim: int = 0,
    heads: int = 1,
    backend: Backend = "auto",
) -> None:
    """One-shot :meth:`PagedKV.gather` (validates ``layers`` on every call)."""
    PagedKV(layers, block_dim=block_dim, heads=heads, backend=backend).gather(block_ids, out)


def scatter(
    buf: torch.Tensor,
    layers: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    *,
    block_dim: int = 0,
    heads: int = 1,
    backend: Backend = "auto",
) -> None:
    """One-shot :meth:`PagedKV.scatter` (validates ``layers`` on every call)."""
    PagedKV(layers, block_dim=block_dim, heads=heads, backend=backend).scatter(buf, block_ids)


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
    """The payload as ``(layer, block, outer, head, piece)`` (strided: heads are outermost in memory)."""
    heads = buf.view(geom.heads, geom.num_layers, n, geom.outer, geom.piece_bytes)
    return heads.permute(1, 2, 3, 0, 4)


def _pieces(layer: torch.Tensor, geom: PagedGeometry) -> torch.Tensor:
    return geom.byte_view(layer).view(geom.num_blocks, geom.outer, geom.heads, geom.piece_bytes)


def _torch_gather(layers: Sequence[torch.Tensor], ids: torch.Tensor, out: torch.Tensor, geom: PagedGeometry) -> None:
    dst = _payload_views(out, geom, ids.numel())
    ids = ids.to(geom.device)
    for i, layer in enumerate(layers):
        if geom.heads == 1:
            torch.index_select(_pieces(layer, geom), 0, ids, out=dst[i])
        else:
            dst[i].copy_(torch.index_select(_pieces(layer, geom), 0, ids))


def _torch_scatter(buf: torch.Tensor, layers: Sequence[torch.Tensor], ids: torch.Tensor, geom: PagedGeometry) -> None:
    src = _payload_views(buf, geom, ids.numel())
    if geom.device.type == "cpu":  # numpy fancy assignment is ~3x faster than index_copy_ here
        idx = ids.numpy()
        for i, layer in enumerate(layers):
            _pieces(layer, geom).numpy()[idx] = src[i].numpy()
        return
    ids = ids.to(geom.device)
    for i, layer in enumerate(layers):
        _pieces(layer, geom).index_copy_(0, ids, src[i].contiguous())


def gather_reference(layers: Sequence[torch.Tensor], block_ids: torch.Tensor, *, block_dim: int = 0,
                     heads: int = 1) -> torch.Tensor:
    """Plain-torch definition of the payload (allocates; for tests and checks only)."""
    parts = []
    for h in range(heads):
        for layer in layers:
            blocks = layer.movedim(block_dim, 0)[block_ids.to(layer.device)]  # (n, *outer dims, *run dims)
            if heads > 1:
                blocks = blocks.narrow(block_dim + 1, h, 1)  # the head dim follows the outer dims
            parts.append(blocks.contiguous().view(torch.uint8).reshape(-1))
    return torch.cat(parts)


def scatter_reference(
    buf: torch.Tensor, layers: Sequence[torch.Tensor], block_ids: torch.Tensor, *, block_dim: int = 0,
    heads: int = 1,
) -> None:
    """Plain-torch inverse of :func:`gather_reference` (for tests only)."""
    per_part = buf.numel() // (len(layers) * heads)
    for h in range(heads):
        for i, layer in enumerate(layers):
            moved = layer.movedim(block_dim, 0)
            if heads > 1:
                moved = moved.narrow(block_dim + 1, h, 1)
            shape = (block_ids.numel(), *moved.shape[1:])
            part = h * len(layers) + i
            src = buf[part * per_part : (part + 1) * per_part]
            moved[block_ids.to(layer.device)] = src.view(layer.dtype).view(shape)
