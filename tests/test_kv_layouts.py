"""vLLM's KV cache layouts for GPUs, read as vLLM 0.32 allocates them: every layer is a logical
``(block, head, token, K|V content)`` view of one backing tensor whose memory order is a stride
permutation of ``[layer, block, head, token, content]`` (``KVCacheLayout``: ``LBNHC`` = NHD, vLLM's
default, ``LBHNC`` = HND, ``BLHNC``/``BLNHC`` with the layers of a block together, ``LHBNC``, ``BHLNC``).
The attention backends write K and V through those strides, so the tensors below are filled the same
way: by logical index. For each layout: the order read back from the strides is the one named, the
gather and scatter round-trip through the memory-order view, head-major layouts give any TP rank its
head range of the full payload (so they share across TP sizes), and what can't be gathered is refused.
On CPU tensors here; on CUDA too where a GPU is present (the Triton gather kernels)."""

from __future__ import annotations

import types

import pytest
import torch

from lmcache_p2p.config import LayoutConfig
from lmcache_p2p.integrations.kv_order import (
    SUPPORTED_ORDERS,
    kv_cache_order,
    layout_order,
    observed_order,
    orders_agree,
)
from lmcache_p2p.kernels.layout import describe, physical_view
from lmcache_p2p.kernels.paged import PagedKV
from lmcache_p2p.keys import Fingerprint, is_head_major

ORDERS = {  # KVCacheLayout: memory order of the logical [L, B, H, N, C] axes
    "LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4),
}
GATHERABLE = sorted(SUPPORTED_ORDERS)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
L, B, N, D = 3, 6, 16, 8  # layers, blocks, tokens per block, head size (content: K then V, 2 * D)


def allocate(order: str, heads: int, device: str = "cpu", dtype: torch.dtype = torch.float16) -> list[torch.Tensor]:
    """Per-layer ``(B, H, N, 2D)`` views of one backing tensor in ``order``'s memory order, as vLLM allocates."""
    perm = ORDERS[order]
    logical = (L, B, heads, N, 2 * D)
    backing = torch.zeros([logical[i] for i in perm], dtype=dtype, device=device)
    view = backing.permute(*[perm.index(i) for i in range(5)])  # back to logical axis order
    assert tuple(view.shape) == logical
    return [view[layer] for layer in range(L)]


def values(heads: tuple[int, int], device: str = "cpu", dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """A distinct value (exact in fp16) for every (layer, block, head, token, content) of heads ``[h0, h1)``."""
    h0, h1 = heads
    idx = torch.arange(L * B * 8 * N * 2 * D, dtype=torch.int64).view(L, B, 8, N, 2 * D)[:, :, h0:h1]
    return ((idx * 7) % 2039 + 1).to(dtype).to(device)


def fill(layers: list[torch.Tensor], vals: torch.Tensor) -> None:
    for layer, v in zip(layers, vals, strict=True):
        layer.copy_(v)  # by logical index: through the layout's strides, as the cache-write kernels do


def paged(layers: list[torch.Tensor], heads: int) -> PagedKV:
    views = [physical_view(t) for t in layers]
    return PagedKV([v for v, _ in views], block_dim=views[0][1], heads=heads)


@pytest.mark.parametrize("order", sorted(ORDERS))
@pytest.mark.parametrize("heads", [1, 4])
def test_the_order_read_from_the_strides_is_the_one_named(order: str, heads: int) -> None:
    layer = allocate(order, heads)[0]
    assert orders_agree(observed_order(layer), order, heads)
    if heads > 1:
        assert observed_order(layer) == order
        others = [o for o in ORDERS if o != order]
        assert not any(orders_agree(observed_order(layer), o, heads) for o in others)
    five_d = torch.zeros(2, 6, 16, heads, 8)  # an older vLLM's (K|V, block, token, head, dim): named, never read
    assert observed_order(five_d).startswith("other:5-d") and not orders_agree(observed_order(five_d), order, heads)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("order", GATHERABLE)
def test_gather_and_scatter_round_trip_in_every_gatherable_layout(order: str, device: str) -> None:
    src, dst = allocate(order, 4, device), allocate(order, 4, device)
    fill(src, values((0, 4), device))
    payload = torch.empty(paged(src, 1).payload_nbytes(2), dtype=torch.uint8, device=device)
    paged(src, 1).gather(torch.tensor([4, 1]), payload)
    paged(dst, 1).scatter(payload, torch.tensor([0, 5]))
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d[0], s[4]) and torch.equal(d[5], s[1])
        assert not d[1:5].any()  # nothing else written


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tp", [2, 4])
def test_head_major_layouts_give_each_rank_its_head_range_of_the_full_payload(tp: int, device: str) -> None:
    """A TP rank's cache holds only its heads; its payload is the matching segment of the full one, and
    LBHNC and BLHNC (the same block interiors) give the same payload: chunks shared across TP sizes."""
    full_payloads = []
    for order in ("LBHNC", "BLHNC"):
        full = allocate(order, 4, device)
        fill(full, values((0, 4), device))
        kv = paged(full, 4)
        out = torch.empty(kv.payload_nbytes(2), dtype=torch.uint8, device=device)
        kv.gather(torch.tensor([2, 5]), out)
        full_payloads.append(out)
        per = out.numel() // 4
        for rank in range(tp):
            h0, h1 = rank * 4 // tp, (rank + 1) * 4 // tp
            mine = allocate(order, h1 - h0, device)
            fill(mine, values((h0, h1), device))
            part = paged(mine, h1 - h0)
            got = torch.empty(part.payload_nbytes(2), dtype=torch.uint8, device=device)
            part.gather(torch.tensor([2, 5]), got)
            assert torch.equal(got, out[h0 * per : h1 * per])
            # and back: a rank scatters its segment of a full chunk into its own cache
            back = allocate(order, h1 - h0, device)
            paged(back, h1 - h0).scatter(out[h0 * per : h1 * per].contiguous(), torch.tensor([0, 1]))
            assert all(torch.equal(b[0], m[2]) and torch.equal(b[1], m[5]) for b, m in zip(back, mine, strict=True))
    assert torch.equal(full_payloads[0], full_payloads[1])


def test_a_layout_with_a_blocks_heads_among_other_layers_is_refused() -> None:
    layer = allocate("BHLNC", 4)[0]
    view, block_dim = physical_view(layer)
    with pytest.raises(ValueError, match="not contiguous within a block"):
        describe([view], block_dim, heads=4)
    assert "BHLNC" not in SUPPORTED_ORDERS and set(GATHERABLE) == set(ORDERS) - {"BHLNC"}
    # (support.kv_cache_refusal refuses it from vLLM's KV cache config: test_kv_support.py)


def test_names_fingerprints_and_tp() -> None:
    """The GPU layout name carries the order vLLM resolved; head-major orders leave TP out of the
    fingerprint (ranks and TP sizes share), the others keep it (each rank's bytes its own)."""
    cache = types.SimpleNamespace(cache_config=types.SimpleNamespace(kv_cache_layout=None))
    assert kv_cache_order(cache, types.SimpleNamespace(kv_cache_layout="BLHNC")) == "BLHNC"
    assert kv_cache_order(types.SimpleNamespace(cache_config=types.SimpleNamespace(kv_cache_layout="LHBNC"))) == "LHBNC"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_KV_CACHE_LAYOUT", "HND")
        assert kv_cache_order(cache) == "LBHNC"  # the legacy name
        mp.delenv("VLLM_KV_CACHE_LAYOUT")
        assert kv_cache_order(cache) == "LBNHC"  # vLLM's default
    for order in ORDERS:
        name = f"vllm-cuda:FLASH_ATTN:{order}"
        assert layout_order(name) == order
        layout = LayoutConfig(model_id="m", kv_dtype="bfloat16", num_layers=L, num_kv_heads=4, head_size=D,
                              block_size=N, kv_layout=name)
        shared = Fingerprint.of(layout, 2, 1).digest == Fingerprint.of(layout, 1, 0).digest
        assert shared == is_head_major(name) == (order in ("LBHNC", "BLHNC"))
    assert layout_order("vllm-cpu") == layout_order("vllm-cpu+0123abcd") == "LBHNC"
