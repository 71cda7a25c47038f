"""Paged-KV gather/scatter: exact round trips, agreement with the torch reference, wrapper checks."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from lmcache_p2p.kernels import cpu_ext, paged
from lmcache_p2p.kernels.layout import describe
from lmcache_p2p.kernels.paged import PagedKV, gather_reference, scatter_reference

CPU_BACKENDS = ["torch", pytest.param("cpp", marks=pytest.mark.slow)]


def _layers(n_layers: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(dtype) for _ in range(n_layers)]


def _ids(*ids: int) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int64)


@pytest.fixture(scope="module", params=CPU_BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    if request.param == "cpp" and cpu_ext.load() is None:
        pytest.skip("C++ extension does not build here")
    return request.param


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ids", [(5,), (0, 9, 3), (1, 2, 4, 6, 8)])
def test_cpu_layout_round_trip(backend: str, dtype: torch.dtype, ids: tuple[int, ...]) -> None:
    layers = _layers(3, (10, 2, 16, 32), dtype)  # (blocks, kv_heads, block_size, 2*head)
    kv = PagedKV(layers, backend=backend)  # type: ignore[arg-type]
    block_ids = _ids(*ids)
    out = torch.empty(kv.payload_nbytes(len(ids)), dtype=torch.uint8)
    kv.gather(block_ids, out)
    torch.testing.assert_close(out, gather_reference(layers, block_ids), rtol=0, atol=0)

    fresh = [torch.zeros_like(t) for t in layers]
    PagedKV(fresh, backend=backend).scatter(out, block_ids)  # type: ignore[arg-type]
    expected = [torch.zeros_like(t) for t in layers]
    scatter_reference(out, expected, block_ids)
    for got, want, orig in zip(fresh, expected, layers, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(got[block_ids], orig[block_ids], rtol=0, atol=0)


def test_cuda_style_layout_round_trip(backend: str) -> None:
    layers = _layers(2, (2, 7, 4, 2, 8), torch.float16)  # (K/V, blocks, block_size, kv_heads, head)
    block_ids = _ids(6, 0, 3)
    out = torch.empty(paged.payload_nbytes(layers, 3, block_dim=1), dtype=torch.uint8)
    paged.gather(layers, block_ids, out, block_dim=1, backend=backend)  # type: ignore[arg-type]
    torch.testing.assert_close(out, gather_reference(layers, block_ids, block_dim=1), rtol=0, atol=0)
    fresh = [torch.zeros_like(t) for t in layers]
    paged.scatter(out, fresh, block_ids, block_dim=1, backend=backend)  # type: ignore[arg-type]
    for got, orig in zip(fresh, layers, strict=True):
        torch.testing.assert_close(got[:, block_ids], orig[:, block_ids], rtol=0, atol=0)


@pytest.mark.parametrize("heads", [2, 4])
def test_head_split_round_trip(backend: str, heads: int) -> None:
    layers = _layers(3, (10, heads, 16, 32), torch.bfloat16)  # (blocks, kv_heads, block_size, 2*head)
    kv = PagedKV(layers, heads=heads, backend=backend)  # type: ignore[arg-type]
    block_ids = _ids(7, 2, 9)
    out = torch.empty(kv.payload_nbytes(3), dtype=torch.uint8)
    kv.gather(block_ids, out)
    torch.testing.assert_close(out, gather_reference(layers, block_ids, heads=heads), rtol=0, atol=0)
    fresh = [torch.zeros_like(t) for t in layers]
    PagedKV(fresh, heads=heads, backend=backend).scatter(out, block_ids)  # type: ignore[arg-type]
    for got, orig in zip(fresh, layers, strict=True):
        torch.testing.assert_close(got[block_ids], orig[block_ids], rtol=0, atol=0)


@pytest.mark.parametrize("tp", [2, 4])
def test_a_ranks_payload_is_its_head_range_of_the_full_payload(backend: str, tp: int) -> None:
    """vLLM shards KV heads over TP ranks: rank r holds heads [r*H/tp, (r+1)*H/tp). Head-major
    payloads make each rank's payload exactly one contiguous slice of the TP=1 payload."""
    heads = 4
    full = _layers(2, (8, heads, 16, 32), torch.float16)
    ids = _ids(5, 1)
    whole = torch.empty(paged.payload_nbytes(full, 2), dtype=torch.uint8)
    paged.gather(full, ids, whole, heads=heads, backend=backend)  # type: ignore[arg-type]
    per = heads // tp
    seg = whole.numel() // tp
    for rank in range(tp):
        shard = [t[:, rank * per:(rank + 1) * per].contiguous() for t in full]  # as vLLM allocates a rank's
        kv = PagedKV(shard, heads=per, backend=backend)  # type: ignore[arg-type]
        out = torch.empty(kv.payload_nbytes(2), dtype=torch.uint8)
        kv.gather(ids, out)
        torch.testing.assert_close(out, whole[rank * seg:(rank + 1) * seg], rtol=0, atol=0)
        back = [torch.zeros_like(t) for t in shard]  # and a rank loads its slice of a TP=1 chunk
        PagedKV(back, heads=per, backend=backend).scatter(whole[rank * seg:(rank + 1) * seg].clone(), ids)  # type: ignore[arg-type]
        for got, want in zip(back, shard, strict=True):
            torch.testing.assert_close(got[ids], want[ids], rtol=0, atol=0)


def test_heads_must_follow_the_block_dim() -> None:
    with pytest.raises(ValueError, match="must be the KV heads"):
        describe([torch.empty(4, 3, 8, 8)], heads=2)


def test_payload_is_layer_major_whole_blocks() -> None:
    layers = [torch.full((4, 1, 2, 2), float(i), dtype=torch.float16) for i in range(3)]
    for i, t in enumerate(layers):
        t[2] = 10 * i + 2
    out = torch.empty(paged.payload_nbytes(layers, 2), dtype=torch.uint8)
    paged.gather(layers, _ids(2, 0), out, backend="torch")
    values = out.view(torch.float16).view(3, 2, 4)  # layer, block, elements of a block
    assert values[:, 0, 0].tolist() == [2.0, 12.0, 22.0]
    assert values[:, 1, 0].tolist() == [0.0, 1.0, 2.0]


def test_empty_block_list_is_a_no_op() -> None:
    layers = _layers(2, (4, 1, 2, 2), torch.bfloat16)
    paged.gather(layers, _ids(), torch.empty(0, dtype=torch.uint8))
    paged.scatter(torch.empty(0, dtype=torch.uint8), layers, _ids())


def test_geometry_of_vllm_cpu_and_cuda_layouts() -> None:
    cpu = describe([torch.empty(8, 2, 128, 128, dtype=torch.bfloat16)])
    assert (cpu.outer, cpu.run_bytes, cpu.block_bytes, cpu.block_stride) == (1, 65536, 65536, 65536)
    cuda = describe([torch.empty(2, 8, 16, 4, 64, dtype=torch.float16)], block_dim=1)
    assert (cuda.outer, cuda.run_bytes, cuda.outer_stride, cuda.block_stride) == (2, 8192, 8 * 8192, 8192)


# ---- wrapper checks -------------------------------------------------------------------------


def _kv() -> tuple[list[torch.Tensor], torch.Tensor]:
    layers = _layers(2, (6, 2, 4, 8), torch.bfloat16)
    return layers, torch.empty(paged.payload_nbytes(layers, 2), dtype=torch.uint8)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda ls: ls[:1] + [ls[1][:5]], r"layers\[1\]: shape"),
        (lambda ls: ls[:1] + [ls[1].to(torch.float16)], r"layers\[1\]: dtype"),
        (lambda ls: [t.transpose(1, 2) for t in ls], "not contiguous within a block"),
        (lambda ls: [t[:, :, :, ::2] for t in ls], "not contiguous within a block"),
        (lambda ls: [], "at least one KV tensor"),
        (lambda ls: ["x"], "expected a torch.Tensor"),
    ],
)
def test_rejects_bad_layers(mutate, message: str) -> None:  # noqa: ANN001
    layers, out = _kv()
    with pytest.raises(ValueError, match=message):
        paged.gather(mutate(layers), _ids(0, 1), out)


def test_rejects_layers_with_different_strides() -> None:
    layers, out = _kv()
    odd = torch.empty(6, 4, 2, 8, dtype=torch.bfloat16).transpose(1, 2)  # same shape, other strides
    with pytest.raises(ValueError, match=r"layers\[1\]: strides"):
        paged.gather([layers[0], odd], _ids(0, 1), out)


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        (_ids(0, 6), r"\[0, 6\)"),
        (_ids(-1, 2), r"\[0, 6\)"),
        (torch.tensor([0, 1], dtype=torch.int32), "int64"),
        (_ids(0, 1).view(2, 1), "1-d"),
        ([0, 1], "torch.Tensor"),
    ],
)
def test_rejects_bad_block_ids(ids, message: str) -> None:  # noqa: ANN001
    layers, out = _kv()
    with pytest.raises(ValueError, match=message):
        paged.gather(layers, ids, out)


def test_scatter_rejects_duplicate_ids() -> None:
    layers, out = _kv()
    with pytest.raises(ValueError, match="distinct"):
        paged.scatter(out, layers, _ids(3, 3))


@pytest.mark.parametrize(
    ("buf", "message"),
    [
        (torch.empty(10, dtype=torch.uint8), "holds 10 bytes, payload is"),
        (torch.empty(8192, dtype=torch.uint8)[::2], "contiguous"),
        (torch.empty(2048, dtype=torch.bfloat16), "torch.uint8"),
    ],
)
def test_rejects_bad_buffers(buf: torch.Tensor, message: str) -> None:
    layers, _ = _kv()
    with pytest.raises(ValueError, match=message):
        paged.gather(layers, _ids(0, 1), buf)
    with pytest.raises(ValueError, match=message.replace("out", "buf")):
        paged.scatter(buf, layers, _ids(0, 1))


def test_rejects_unknown_or_unavailable_backend() -> None:
    layers, out = _kv()
    with pytest.raises(ValueError, match="backend"):
        paged.gather(layers, _ids(0, 1), out, backend="bogus")  # type: ignore[arg-type]
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(ValueError, match="triton"):
            paged.gather(layers, _ids(0, 1), out, backend="triton")


# ---- Triton, under the interpreter (CPU tensors; ~1000x slower, so tiny shapes) -----------


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_triton_kernel_matches_reference_under_interpreter() -> None:
    # TRITON_INTERPRET is read when triton is imported: run in a fresh interpreter.
    script = """
import torch
from lmcache_p2p.kernels import paged
from lmcache_p2p.kernels.paged import PagedKV, gather_reference, scatter_reference
cases = [((10, 2, 16, 8), 0, 1, torch.bfloat16, [3, 7, 1]), ((2, 5, 4, 2, 8), 1, 1, torch.float16, [4, 0, 2]),
         ((6, 3, 5), 0, 1, torch.float16, [5]), ((9, 3, 3), 0, 1, torch.uint8, [8, 1]),
         ((10, 2, 16, 8), 0, 2, torch.bfloat16, [3, 7, 1]), ((2, 5, 3, 4, 8), 1, 3, torch.float16, [4, 0])]
for shape, block_dim, heads, dtype, ids in cases:
    gen = torch.Generator().manual_seed(0)
    layers = [torch.randint(0, 200, shape, generator=gen).to(dtype) for _ in range(3)]
    ids = torch.tensor(ids, dtype=torch.int64)
    kv = PagedKV(layers, block_dim=block_dim, heads=heads, backend="triton")
    out = torch.empty(kv.payload_nbytes(ids.numel()), dtype=torch.uint8)
    kv.gather(ids, out)
    torch.testing.assert_close(out, gather_reference(layers, ids, block_dim=block_dim, heads=heads), rtol=0, atol=0)
    got = [torch.zeros_like(t) for t in layers]
    want = [torch.zeros_like(t) for t in layers]
    PagedKV(got, block_dim=block_dim, heads=heads, backend="triton").scatter(out, ids)
    scatter_reference(out, want, ids, block_dim=block_dim, heads=heads)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
print("ok")
"""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_kernel_on_cuda() -> None:
    layers = [t.cuda() for t in _layers(4, (64, 16, 8, 128), torch.float16)]
    ids = _ids(63, 0, 17, 5, 9)
    kv = PagedKV(layers)
    assert kv.backend == "triton"
    out = torch.empty(kv.payload_nbytes(5), dtype=torch.uint8, device="cuda")
    kv.gather(ids, out)
    torch.testing.assert_close(out, gather_reference(layers, ids), rtol=0, atol=0)
    fresh = [torch.zeros_like(t) for t in layers]
    PagedKV(fresh).scatter(out, ids)
    for got, orig in zip(fresh, layers, strict=True):
        torch.testing.assert_close(got[ids.cuda()], orig[ids.cuda()], rtol=0, atol=0)
