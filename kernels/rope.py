"""Re-rotating cached keys to another position (RoPE), for KV reused at an offset other than where it
was computed (a document's chunks reused after another prefix).

RoPE turns each pair of a key's dimensions by an angle proportional to the token's position
``p``: ``angle_i = p * inv_freq_i``. Rotations compose, so a key computed at ``p`` becomes the key
at ``p + delta`` by turning every pair by ``delta * inv_freq_i``; the same ``delta`` for every token
of a segment moved as a whole. This holds while the angle is linear in the position with
frequencies that do not depend on the sequence: plain RoPE, linear position scaling and Llama 3's
frequency scaling (all only change ``inv_freq``). It does not hold for YaRN (its attention factor
scales cos/sin, so a second turn scales twice) or dynamic NTK (the base follows the sequence
length): :func:`rope_spec` refuses those.

Pairs are ``(i, i + rotary_dim/2)`` (``neox``, the Llama layout) or ``(2i, 2i + 1)`` (GPT-J);
dimensions past ``rotary_dim`` are not rotated. The turn is computed in float32 (angles in float64,
so large deltas keep their precision) and rounded back to the cache's dtype: a bfloat16 key moved
twice differs from one computed at the target position by about one unit in the last place.
``delta == 0`` leaves the bytes untouched (a segment reused where it was computed stays bit-exact).

Keys sit in the engine's cache in one of two orders per (block, head): token-major
``(block_size, head_size)`` or dimension-major ``(head_size, block_size)`` (vLLM-CPU's vector
kernels store K this way, V token-major); ``dims_axis`` says which axis holds the dimensions.

Backends: ``rerotate_`` (torch, any device) and ``rerotate_triton_`` (CUDA; CPU tensors under
``TRITON_INTERPRET=1``, for the tests).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

# rope_scaling types whose angles stay ``position * inv_freq`` (see the module docstring)
COMPOSABLE_SCALING = frozenset({"default", "linear", "llama3"})


@dataclasses.dataclass(frozen=True, slots=True)
class RopeSpec:
    """A model's rotary embedding, as far as re-rotation needs it."""

    head_size: int
    rotary_dim: int
    inv_freq: tuple[float, ...]  # rotary_dim / 2 frequencies, scaling applied
    neox: bool = True

    def __post_init__(self) -> None:
        if self.rotary_dim <= 0 or self.rotary_dim % 2 or self.rotary_dim > self.head_size:
            raise ValueError(f"rotary_dim {self.rotary_dim} must be even and in (0, head_size={self.head_size}]")
        if len(self.inv_freq) != self.rotary_dim // 2:
            raise ValueError(f"inv_freq has {len(self.inv_freq)} frequencies, rotary_dim {self.rotary_dim} needs "
                             f"{self.rotary_dim // 2}")

    def cos_sin(self, delta: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos and sin of ``delta`` times each frequency (angles in float64)."""
        angles = torch.tensor(self.inv_freq, dtype=torch.float64) * float(delta)
        return angles.cos().float().to(device), angles.sin().float().to(device)


def rope_spec(config: dict[str, Any], head_size: int, *, neox: bool = True) -> RopeSpec:
    """The re-rotation spec of a Hugging Face model config (``config.json`` as a dict; ``rope_scaling``
    or the newer ``rope_parameters``; ``rotary_dim``, ``partial_rotary_factor`` or ``rotary_pct``);
    ``neox``: the pair layout, which the config does not say (vLLM's rotary module does). Raises
    ``ValueError`` naming the field when keys can't be moved exactly (see the module docstring). One
    spec for every layer: models whose layers differ (other bases per layer, layers without RoPE)
    need one per layer, from the engine's own modules."""
    scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in COMPOSABLE_SCALING:
        raise ValueError(f"rope_scaling: type {kind!r} does not compose (only {sorted(COMPOSABLE_SCALING)} do)")
    base = float(config.get("rope_theta", scaling.get("rope_theta", 10000.0)))
    if "rotary_dim" in config:
        rotary_dim = int(config["rotary_dim"])
    else:
        rotary_dim = int(head_size * float(config.get("partial_rotary_factor", config.get("rotary_pct", 1.0))))
    inv = [base ** (-2.0 * i / rotary_dim) for i in range(rotary_dim // 2)]
    if kind == "linear":
        inv = [f / float(scaling["factor"]) for f in inv]
    elif kind == "llama3":
        inv = _llama3(inv, scaling)
    return RopeSpec(head_size, rotary_dim, tuple(inv), neox=neox)


def _llama3(inv: list[float], s: dict[str, Any]) -> list[float]:
    """Llama 3's frequency scaling (position-independent, so it composes)."""
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old = float(s["original_max_position_embeddings"])
    out = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(f)
        elif wavelen > old / low:
            out.append(f / factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return out


def rope_reference(k: torch.Tensor, positions: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """``k`` (tokens, ..., head_size) rotated to ``positions`` (tokens,), in float32: what the model
    applies, for the tests."""
    angles = positions.to(torch.float64)[:, None] * torch.tensor(spec.inv_freq, dtype=torch.float64)[None, :]
    shape = (k.shape[0],) + (1,) * (k.dim() - 2) + (spec.rotary_dim // 2,)
    return _turn(k.float(), angles.cos().float().view(shape), angles.sin().float().view(shape), spec, k.dim() - 1)


def _pairs(x: torch.Tensor, spec: RopeSpec, axis: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of the two members of every rotated pair along ``axis`` (non-negative)."""
    half = spec.rotary_dim // 2
    if spec.neox:
        return x.narrow(axis, 0, half), x.narrow(axis, half, half)
    pairs = x.narrow(axis, 0, spec.rotary_dim).unflatten(axis, (half, 2))
    return pairs.select(axis + 1, 0), pairs.select(axis + 1, 1)


def _turn(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spec: RopeSpec, axis: int) -> torch.Tensor:
    """A float32 copy of ``x`` with its pairs along ``axis`` turned (``cos``/``sin`` broadcast there)."""
    out = x.clone()
    a, b = _pairs(x, spec, axis)
    oa, ob = _pairs(out, spec, axis)
    oa.copy_(a * cos - b * sin)
    ob.copy_(b * cos + a * sin)
    return out


def _check(keys: torch.Tensor, spec: RopeSpec, dims_axis: int) -> None:
    if not keys.dtype.is_floating_point or keys.element_size() < 2:
        # fp8 caches (stored as bytes, scaled) would be turned as integers: refused, not approximated
        raise ValueError(f"keys: dtype {keys.dtype} can't be re-rotated (a 16- or 32-bit float is needed)")
    if keys.shape[dims_axis] != spec.head_size:
        raise ValueError(f"keys: axis {dims_axis} has {keys.shape[dims_axis]} entries, head_size is {spec.head_size}")


def rerotate_(keys: torch.Tensor, delta: int, spec: RopeSpec, dims_axis: int) -> torch.Tensor:
    """Turn ``keys`` in place from their position to ``position + delta``; ``keys.shape[dims_axis]``
    is ``head_size``. Returns ``keys``."""
    _check(keys, spec, dims_axis)
    if delta == 0:
        return keys
    axis = dims_axis % keys.dim()
    cos, sin = spec.cos_sin(delta, keys.device)
    shape = [1] * keys.dim()
    shape[axis] = spec.rotary_dim // 2
    turned = _turn(keys.float(), cos.view(shape), sin.view(shape), spec, axis)
    keys.copy_(turned)
    return keys


def rerotate_triton_(keys: torch.Tensor, delta: int, spec: RopeSpec, dims_axis: int) -> torch.Tensor:
    """:func:`rerotate_` as one Triton launch over ``keys`` seen as (rows, head_size, cols)."""
    from .triton_rope import rerotate_kernel_launch

    _check(keys, spec, dims_axis)
    if delta == 0:
        return keys
    axis = dims_axis % keys.dim()
    rows = math.prod(keys.shape[:axis])
    cols = math.prod(keys.shape[axis + 1:])
    cos, sin = spec.cos_sin(delta, keys.device)
    # (rows, head_size, cols); view() raises if the leading axes can't be merged into strided rows
    rerotate_kernel_launch(keys.view(rows, spec.head_size, cols), cos, sin, spec.rotary_dim, spec.neox)
    return keys
