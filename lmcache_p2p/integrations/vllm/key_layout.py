"""Where vLLM-CPU's attention keeps each token's K and V in its paged cache, found with vLLM's own op,
and whether keys moved there by ``kernels.rope`` equal keys the engine computes at the target position.

A layer's cache is ``(num_blocks, kv_heads, block_size, 2 * head_size)``; each (block, head) run holds
K then V, ``block_size * head_size`` elements each. The order inside a run is the attention kernel's,
chosen per ISA, and nothing documents it: vLLM 0.32's ``vec``/``vec16`` keep K dimension-major and V
token-major; ``amx`` packs K in groups of 16 tokens of dimension pairs (one 32-bit word per pair) and V
in 16-dimension groups of token pairs. So the worker asks, for the ISA the engine runs: it writes
tokens whose every element names its token, then its dimension, through ``cpu_attn_reshape_and_cache``
(what the forward pass calls), and reads where each landed::

    run of one KV head in one block:  [ K: block_size * head_size | V: block_size * head_size ]
    TokenOrder.keys[t, d]   = offset of token t's dimension d in the K half
    TokenOrder.values[t, d] = the same in the V half

An order is used only when every (token, dimension) landed exactly once in its own head's run (a
permutation), and K/V read back through it equal what was written. Then it moves keys written at one
position by a delta and compares them with keys written at the target: segments reused at another
position are enabled only when that self-test passes, never on an order it can't place.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import torch

from ...kernels.rope import RopeSpec, rerotate_, rope_reference

log = logging.getLogger(__name__)

DIGIT = 128  # codes 1..128 are exact in every float cache dtype (bf16 holds the integers up to 256)
PROBE_HEADS = 2


@dataclasses.dataclass(frozen=True, eq=False)
class TokenOrder:
    """Where one ISA's cache-write op puts each (token offset, dimension) of K and of V in a head's run."""

    isa: str
    name: str  # "dims" (K dimension-major), "tokens" (K token-major), else the ISA's own order
    keys: torch.Tensor  # (block_size, head_size) int64 offsets into the K half of a head's run
    values: torch.Tensor  # (block_size, head_size) int64 offsets into the V half

    def read(self, cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor, kind: int) -> torch.Tensor:
        """K (``kind`` 0) or V (1) of the tokens at ``(blocks[i], offsets[i])``, ``(tokens, heads, head_size)``
        (a copy)."""
        nblocks, heads, block_size, twice = cache.shape
        half = block_size * (twice // 2)
        table = self.keys if kind == 0 else self.values
        inner = (torch.arange(heads)[None, :, None] * 2 + kind) * half + table[offsets][:, None, :]
        return cache.view(nblocks, heads * 2 * half)[blocks[:, None, None], inner]


def _write(keys: torch.Tensor, values: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, isa: str) -> None:
    from vllm import _custom_ops as ops

    blocks, heads, block_size, _ = cache.shape
    key_cache, value_cache = cache.view(blocks, heads, 2 * block_size, -1).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, isa)


def _landed(index: torch.Tensor, heads: int, dtype: torch.dtype, block_size: int, isa: str) -> torch.Tensor | None:
    """For every element of one block's runs, ``(heads, 2, block_size * head_size)``, the ``index`` value
    (token or dimension, per element of a ``(block_size, head_size)`` grid) of what the op wrote there;
    None when an element was left unwritten."""
    head_size = index.shape[1]
    found = torch.zeros(heads, 2, block_size * head_size, dtype=torch.int64)
    scale, top = 1, int(index.max()) + 1
    while scale < top:
        codes = ((index // scale) % DIGIT + 1).to(torch.float32)
        grid = codes[:, None, :].expand(block_size, heads, head_size).to(dtype).contiguous()
        cache = torch.zeros(1, heads, block_size, 2 * head_size, dtype=dtype)
        _write(grid, grid, cache, torch.arange(block_size, dtype=torch.int64), isa)
        got = cache[0].reshape(heads, 2, -1).to(torch.int64)
        if bool((got == 0).any()):
            return None
        found += (got - 1) * scale
        scale *= DIGIT
    return found


@functools.lru_cache(maxsize=16)
def find_token_order(dtype: torch.dtype, block_size: int, head_size: int, isa: str) -> TokenOrder | None:
    """How ``isa``'s op orders K and V in a block, or None when it is not a per-head permutation of the
    tokens' elements (or the op refuses the ISA or geometry)."""
    grid = torch.arange(block_size * head_size).view(block_size, head_size)
    try:
        tokens = _landed(grid // head_size, PROBE_HEADS, dtype, block_size, isa)
        dims = _landed(grid % head_size, PROBE_HEADS, dtype, block_size, isa)
    except RuntimeError as exc:  # the op's own checks (an ISA or geometry it does not take)
        log.info("lmcache-p2p: vLLM's %s cache write refused the probe: %s", isa, exc)
        return None
    if tokens is None or dims is None or not all(torch.equal(m[0], m[h]) for m in (tokens, dims)
                                                  for h in range(1, PROBE_HEADS)):
        return None
    tables = []
    for kind in (0, 1):
        flat = tokens[0, kind] * head_size + dims[0, kind]
        if not torch.equal(flat.sort().values, torch.arange(block_size * head_size)):
            return None
        table = torch.empty(block_size * head_size, dtype=torch.int64)
        table[flat] = torch.arange(block_size * head_size)
        tables.append(table.view(block_size, head_size))
    keys, values = tables
    name = isa
    if torch.equal(keys, (grid % head_size) * block_size + grid // head_size):
        name = "dims"
    elif torch.equal(keys, grid):
        name = "tokens"
    return TokenOrder(isa=isa, name=name, keys=keys, values=values)


def self_test(spec: RopeSpec, dtype: torch.dtype, block_size: int, isa: str, delta: int = 1000) -> TokenOrder | None:
    """The token order if K/V written by the op read back exactly through it, and keys written at
    positions ``p`` and moved by ``delta`` equal keys written at ``p + delta`` (within two roundings of
    ``dtype``); else None, with the reason logged."""
    order = find_token_order(dtype, block_size, spec.head_size, isa)
    if order is None:
        log.info("lmcache-p2p: vLLM's %s attention keeps K/V in an order this version can't place", isa)
        return None
    g = torch.Generator().manual_seed(0)
    raw = torch.randn(block_size, PROBE_HEADS, spec.head_size, generator=g)
    values = torch.randn(block_size, PROBE_HEADS, spec.head_size, generator=g).to(dtype)
    pos = torch.arange(block_size)
    moved = torch.zeros(1, PROBE_HEADS, block_size, 2 * spec.head_size, dtype=dtype)
    target = torch.zeros_like(moved)
    slots = torch.arange(block_size, dtype=torch.int64)
    at_p = rope_reference(raw, pos + 7, spec).to(dtype)
    _write(at_p, values, moved, slots, isa)
    _write(rope_reference(raw, pos + 7 + delta, spec).to(dtype), values, target, slots, isa)
    blocks = torch.zeros(block_size, dtype=torch.int64)
    keys = order.read(moved, blocks, slots, 0)
    if not (torch.equal(keys, at_p) and torch.equal(order.read(moved, blocks, slots, 1), values)):
        log.warning("lmcache-p2p: K/V read back through the %s order differ from what vLLM wrote; segments are "
                    "reused only where they were computed", order.name)
        return None
    rerotate_(keys, delta, spec, dims_axis=-1)
    want = order.read(target, blocks, slots, 0).float()
    err = float((keys.float() - want).abs().max())
    tol = 1e-4 if dtype == torch.float32 else 0.05 * float(want.abs().max())
    if err > tol:
        log.warning("lmcache-p2p: moved keys differ from keys computed at the target by %.3g (tolerance %.3g); "
                    "segments are reused only where they were computed", err, tol)
        return None
    return order


def host_orders(dtype: torch.dtype, block_size: int,
                head_sizes: tuple[int, ...] = (64, 128)) -> list[dict[str, object]]:
    """For each head size: the ISA vLLM-CPU's attention picks on this host and the order blending would
    read (None: refused). ``lmcache-p2p doctor --dtype`` prints it."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from ...kernels.rope import rope_spec

    rows: list[dict[str, object]] = []
    for head_size in head_sizes:
        isa = str(_get_attn_isa(dtype, block_size, head_size))
        order = self_test(rope_spec({"rope_theta": 10000.0}, head_size), dtype, block_size, isa)
        rows.append({"head_size": head_size, "isa": isa, "order": order.name if order else None})
    return rows


if __name__ == "__main__":  # python -m ...key_layout <dtype> <block_size>: one JSON line (doctor's blending row)
    import json
    import sys

    print(json.dumps(host_orders(getattr(torch, sys.argv[1]), int(sys.argv[2]))))
