"""Blending on the worker: segment KV into and out of vLLM-CPU's paged cache token by token, keys
turned to where they are used, and the selected tokens recomputed through the engine's own model.

**Where the keys are stored**: K as the model computed it, turned back to position 0 (``rerotate_``
by minus the segment's start, the same delta for all its tokens), so a segment's chunk means the
same wherever it was computed and a load turns it by its new start. Storing K after rotation is
forced: vLLM's attention applies RoPE before writing K into the cache (there is no unrotated K to
keep), and turning it back is exact for the composable RoPE variants (``kernels/rope.py``), within
two roundings of the cache dtype. A segment's payload is ``(layers, 2, tokens, heads, head_size)``
in the cache dtype: the same size as a prefix chunk's, so it fits the agent's slots.

**How tokens are recomputed**: the connector API hands the worker tensors, not the model, so
:func:`find_runner` takes vLLM's model runner from the frame that calls ``register_kv_caches``
(``GPUModelRunner.initialize_kv_cache``, which CPU inherits), checked by type and by the attributes
used. :meth:`Blender.recompute` runs the model itself on the selected tokens in a nested forward
context: each contiguous run of positions is a request of its own whose context is the request's
blocks, so at every layer the runs' K/V are written into the cache (vLLM's own slot-mapping write)
and then attend over the blended cache (vLLM's own CPU attention). The runs see each other in
position order, at every layer, as a prefill would. It runs on the forward thread (the forward
context is a module global): inline for a sync load, in the next ``start_load_kv`` for a pulled one.

Used only where it can be exact about positions and sure of what it recomputes (:func:`blend_refusal`):
vLLM 0.32 (its prefix cache on or off: the scheduler gives blended blocks hashes of their own), no
LoRA, no speculative decoding, one rank, no pipeline, a 16/32-bit float cache, no sliding window,
full attention in one cache group, RoPE whose turns compose, checked against the model's own cos/sin
table and vLLM's cache layout at start.
"""

from __future__ import annotations

import functools
import logging
import sys
from typing import Any

import torch

from ...kernels.rope import RopeSpec, rerotate_, rope_spec
from ...segments import DEVIATION_LAYER, GRADUAL_WIDEN, gradual_layer, merge_runs, reads_question, subtract_runs
from ...selection import question_runs, top_runs
from .key_layout import TokenOrder, find_token_order, self_test
from .probe import engine_isa

log = logging.getLogger(__name__)
VLLM_SERIES = "0.32."  # the model runner and attention internals this module was written against
QUESTION_FIRST_LAYER = 2  # the question's reads counted from this layer (layers 0-1 read mostly by position)
ROTARY_CLASSES = frozenset({"RotaryEmbedding", "LinearScalingRotaryEmbedding", "Llama3RotaryEmbedding"})


def blend_refusal(vllm_config: Any) -> str | None:
    """Why this engine can't blend (None: it can), from its config alone (both processes call it)."""
    import vllm

    if not str(vllm.__version__).startswith(VLLM_SERIES):
        return f"vLLM {vllm.__version__}: blending is written against {VLLM_SERIES}x"
    if vllm_config.lora_config is not None:
        return "LoRA is enabled: the recompute would run under the step's adapter mapping"
    if vllm_config.speculative_config is not None:
        return "speculative decoding: the draft model's cache would not be recomputed"
    par = vllm_config.parallel_config
    if par.tensor_parallel_size != 1 or par.pipeline_parallel_size != 1:
        return "tensor or pipeline parallel: every rank would have to recompute in lockstep (not built)"
    if str(vllm_config.cache_config.cache_dtype) != "auto":
        return f"kv cache dtype {vllm_config.cache_config.cache_dtype}: keys can't be turned exactly"
    model = vllm_config.model_config
    if str(getattr(getattr(vllm_config, "device_config", None), "device_type", "cpu")) == "cpu":
        isa = engine_isa(vllm_config)
        if find_token_order(model.dtype, vllm_config.cache_config.block_size, model.get_head_size(), isa) is None:
            return f"vLLM's {isa} attention keeps K/V in an order this version can't place (key_layout.py)"
    if model.get_sliding_window() is not None:
        return "sliding-window attention"
    if getattr(model, "is_multimodal_model", False):
        return "multimodal model (positions are not token offsets)"
    hf = model.hf_config.to_dict()
    nope = nope_layers(hf)
    if nope:
        return f"layers without rotary position encoding (NoPE: {nope}): their keys can't be moved by rotation"
    try:
        rope_spec(hf, model.get_head_size())
    except (ValueError, KeyError, TypeError) as exc:
        return f"position encoding: {exc}"
    return None


def nope_layers(hf_config: dict[str, Any]) -> str | None:
    """How a model config says some layers have no rotary encoding (SmolLM3, Llama 4: ``no_rope_layers``,
    a 0 per NoPE layer; ``nope_layer_interval``), or None. The self-test sees one layer; this sees them all."""
    flags = hf_config.get("no_rope_layers")
    if isinstance(flags, list | tuple) and any(not f for f in flags):
        return f"no_rope_layers has {sum(1 for f in flags if not f)} of {len(flags)} layers without"
    for key in ("nope_layer_interval", "no_rope_layer_interval"):
        if hf_config.get(key):
            return f"{key}={hf_config[key]}"
    return None


def find_runner() -> Any | None:
    """vLLM's model runner, from the caller of the connector's ``register_kv_caches`` (see the module
    docstring); None when the stack holds none that looks like one."""
    frame: Any = sys._getframe(1)
    for _ in range(8):
        if frame is None:
            return None
        runner = frame.f_locals.get("self")
        if (type(runner).__name__ in ("CPUModelRunner", "GPUModelRunner")
                and all(hasattr(runner, a) for a in ("model", "attn_groups", "vllm_config", "kv_cache_config"))):
            return runner
        frame = frame.f_back
    return None


class Blender:
    """Segment KV in and out of one engine's cache, and recompute through its model."""

    def __init__(self, runner: Any, kv_caches: dict[str, torch.Tensor]) -> None:
        self._runner = runner
        self._names = list(kv_caches)
        self._caches = list(kv_caches.values())
        groups = [g for per_group in runner.attn_groups for g in per_group]
        if len(groups) != 1 or set(groups[0].layer_names) != set(self._names):
            raise ValueError(f"{len(groups)} attention groups: blending needs every layer in one")
        self._group = groups[0]
        blocks, heads, block_size, twice = self._caches[0].shape
        self.block_size, self.heads, self.head_size = block_size, heads, twice // 2
        self.dtype = self._caches[0].dtype
        layers = runner.vllm_config.compilation_config.static_forward_context
        isa = getattr(layers[self._names[0]], "isa", None)
        if not isinstance(isa, str):
            raise ValueError("the attention layers carry no ISA: not vLLM-CPU's attention")
        self._isa = isa
        self.spec = self._rope(runner)
        order = self_test(self.spec, self.dtype, block_size, self._isa)
        if order is None:
            raise ValueError(f"keys moved in vLLM's {isa} cache do not equal keys computed there")
        self._order: TokenOrder = order

    def _rope(self, runner: Any) -> RopeSpec:
        """The re-rotation spec from the model's config, checked against its first layer's own table."""
        rotary = [m for m in runner.model.modules() if type(m).__name__.endswith("RotaryEmbedding")]
        if not rotary or any(type(m).__name__ not in ROTARY_CLASSES for m in rotary):
            names = sorted({type(m).__name__ for m in rotary})
            raise ValueError(f"rotary modules {names or 'none'}: only {sorted(ROTARY_CLASSES)} are known to compose")
        model = runner.vllm_config.model_config
        spec = rope_spec(model.hf_config.to_dict(), self.head_size, neox=bool(rotary[0].is_neox_style))
        for m in rotary:
            table = m.cos_sin_cache.float()
            half = spec.rotary_dim // 2
            pos = torch.tensor([0, 1, 7, min(1000, table.shape[0] - 1)])
            angles = pos.double()[:, None] * torch.tensor(spec.inv_freq, dtype=torch.float64)[None, :]
            err = max(float((table[pos, :half] - angles.cos()).abs().max()),
                      float((table[pos, half:2 * half] - angles.sin()).abs().max()))
            if table.shape[1] != spec.rotary_dim or err > 1e-2:
                raise ValueError(f"the model's cos/sin table differs from its config's RoPE by {err:.3g}")
        return spec

    @property
    def num_layers(self) -> int:
        return len(self._caches)

    @property
    def key_layout(self) -> str:
        """How vLLM's attention orders K in a block: "dims", "tokens" or its ISA's own (``key_layout.py``)."""
        return self._order.name

    # -- token-granular KV ---------------------------------------------------------------------------
    def token_nbytes(self) -> int:
        return len(self._caches) * 2 * self.heads * self.head_size * self.dtype.itemsize

    def _slots(self, block_ids: list[int], positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        table = torch.tensor(block_ids, dtype=torch.int64)
        return table[positions // self.block_size], positions % self.block_size

    def read(self, block_ids: list[int], start: int, end: int, origin: int) -> torch.Tensor:
        """K/V of positions ``[start, end)``, ``(layers, 2, tokens, heads, head_size)``, keys turned
        from their positions to ``position - origin`` (a segment starting at ``origin``: to 0)."""
        blk, off = self._slots(block_ids, torch.arange(start, end))
        out = torch.empty(len(self._caches), 2, end - start, self.heads, self.head_size, dtype=self.dtype)
        for i, cache in enumerate(self._caches):
            out[i, 0] = self._order.read(cache, blk, off, 0)
            out[i, 1] = self._order.read(cache, blk, off, 1)
        rerotate_(out[:, 0], -origin, self.spec, dims_axis=-1)
        return out

    def write(self, kv: torch.Tensor, block_ids: list[int], start: int, turn: int) -> None:
        """Write ``kv`` (as :meth:`read` returns it) at positions ``start ..``, its keys turned by ``turn``
        (a segment read with ``origin`` 0 and written where it now starts: that start)."""
        from vllm import _custom_ops as ops

        rerotate_(kv[:, 0], turn, self.spec, dims_axis=-1)
        blk, off = self._slots(block_ids, torch.arange(start, start + kv.shape[2]))
        slots = blk * self.block_size + off
        for i, cache in enumerate(self._caches):
            key_cache, value_cache = cache.view(cache.shape[0], self.heads, 2 * self.block_size,
                                                self.head_size).chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(kv[i, 0].contiguous(), kv[i, 1].contiguous(), key_cache, value_cache,
                                           slots, self._isa)

    def _keys_at(self, layer: int, block_ids: list[int], positions: torch.Tensor) -> torch.Tensor:
        """Layer ``layer``'s keys at ``positions`` as the cache holds them, ``(tokens, heads, head_size)``."""
        blk, off = self._slots(block_ids, positions)
        return self._order.read(self._caches[layer], blk, off, 0)

    def decode(self, payload: torch.Tensor, tokens: int) -> torch.Tensor:
        """A segment chunk's payload bytes as K/V (a copy: the caller's buffer may be reused)."""
        nbytes = tokens * self.token_nbytes()
        if payload.numel() < nbytes:
            raise ValueError(f"segment chunk of {tokens} tokens needs {nbytes} bytes, has {payload.numel()}")
        kv = payload[:nbytes].view(self.dtype).view(len(self._caches), 2, tokens, self.heads, self.head_size)
        return kv.clone()

    # -- recompute -----------------------------------------------------------------------------------
    def isolated(self, token_ids: list[int], base_end: int, scratch: list[int]) -> torch.Tensor:
        """The KV of ``token_ids[base_end:]`` computed after ``token_ids[:base_end]`` alone (a segment's
        canonical KV, whatever precedes it in the request), in ``scratch`` blocks whose positions
        ``[0, base_end)`` already hold the base's KV; returned as :meth:`read` does, keys at position 0."""
        self.recompute(token_ids, [(base_end, len(token_ids))], scratch)
        return self.read(scratch, base_end, len(token_ids), base_end)

    def deviating(self, token_ids: list[int], block_ids: list[int], passes: list[tuple[int, int]],
                  candidates: list[tuple[int, int]], count: int, layer: int = DEVIATION_LAYER) -> list[tuple[int, int]]:
        """CacheBlend's selection: the ``count`` positions of ``candidates`` whose layer-``layer`` keys move
        most when recomputed over the blended cache. Layers ``0..layer`` of every position in ``passes``
        (sorted runs covering the candidates: the blend's span, or a first round's survivors with the glue)
        are recomputed on the way (layer 0's keys never depend on context: the first that can move is
        layer 1), and keep their new KV. Returns the picked positions as sorted runs."""
        inner = getattr(self._runner.model, "model", None)
        if inner is None or not isinstance(getattr(inner, "end_layer", None), int):
            raise ValueError("the model exposes no end_layer: deviation selection can't stop after a layer")
        if count <= 0 or not candidates:
            return []
        if not 0 < layer < self.num_layers:
            raise ValueError(f"deviation at layer {layer}: the model has {self.num_layers}")
        pos = torch.cat([torch.arange(s, e) for s, e in candidates])
        before = self._keys_at(layer, block_ids, pos).float()
        end_layer = inner.end_layer
        inner.end_layer = inner.start_layer + layer + 1
        try:
            self.recompute(token_ids, passes, block_ids)
        finally:
            inner.end_layer = end_layer
        moved = torch.zeros(max(e for _, e in candidates))
        moved[pos] = (self._keys_at(layer, block_ids, pos).float() - before).pow(2).sum(dim=(1, 2))
        return top_runs(moved, candidates, count)

    def kv_error(self, token_ids: list[int], block_ids: list[int], span: tuple[int, int],
                 recomputed: list[tuple[int, int]]) -> dict[str, list[float]]:
        """How far the blended cache of positions ``span`` is from a full prefill's, per layer: the relative L2
        error ``|blended - full| / |full|`` of K and of V, over all of ``span``, its ``recomputed`` runs and the
        rest (reused). The full prefill is computed here, by the same model and kernels, in the request's own
        blocks, which then get the blended KV back: the request goes on as blended. A diagnostic
        (``bench blend --kv-error``): it costs a full prefill of ``span``'s end."""
        start, end = span
        blended = self.read(block_ids, 0, end, 0)
        try:
            self.recompute(token_ids, [(0, end)], block_ids)
            full = self.read(block_ids, 0, end, 0)
        finally:
            self.write(blended, block_ids, 0, 0)
        picked = torch.zeros(end, dtype=torch.bool)
        for s, e in recomputed:
            picked[s:e] = True
        region = torch.zeros(end, dtype=torch.bool)
        region[start:end] = True
        out: dict[str, list[float]] = {}
        for name, mask in (("all", region), ("recomputed", region & picked), ("reused", region & ~picked)):
            for i, kv in enumerate(("k", "v")):
                b, f = blended[:, i][:, mask].float(), full[:, i][:, mask].float()
                num = (b - f).flatten(1).norm(dim=1)
                den = f.flatten(1).norm(dim=1).clamp_min(1e-12)
                out[f"{kv}_{name}"] = [round(float(x), 6) for x in (num / den)] if mask.any() else []
        return out

    def question_attention(self, question: list[int], start: int, block_ids: list[int],
                           first_layer: int = QUESTION_FIRST_LAYER,
                           heads_from: int | None = None) -> tuple[torch.Tensor, Any]:
        """How much the question (``question``, at positions ``start ..``) reads each position ``[0, start)`` of
        the blended cache: its attention probabilities there, summed over its tokens, its heads and the layers
        from ``first_layer`` on, ``(start,)`` float32. The question runs through the engine's own model over
        the blended cache with each attention layer's call answered here (the cache read, the question's own
        keys and values appended under a causal mask, softmax in float32): nothing is written to the cache,
        and the question needs no blocks of its own. ProphetKV's and A³'s signal for what to recompute.
        With ``heads_from``, each head's reads (summed over the question's tokens) are taken as shares of what
        it reads in ``[heads_from, start)`` and a position scores its largest share in any head of those
        layers: a head that looks things up counts as much as one that reads the nearest words.
        Returns that and the model's output for the question (what :meth:`recompute` of it would return)."""
        from vllm.forward_context import set_forward_context

        layers = self._runner.vllm_config.compilation_config.static_forward_context
        modules = [layers[name] for name in self._names]
        blk, off = self._slots(block_ids, torch.arange(start))
        read = torch.zeros(start, dtype=torch.float32)
        n = len(question)
        causal = torch.ones(n, n, dtype=torch.bool).tril()

        def attend(i: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any,
                   **kwargs: Any) -> torch.Tensor:
            module = modules[i]
            heads, kv_heads, size = module.num_heads, module.num_kv_heads, module.head_size
            scale = float(getattr(module.impl, "scale", size ** -0.5))
            q = query.view(n, heads, size).float()
            cache = self._caches[i]
            keys = torch.cat([self._order.read(cache, blk, off, 0).float(), key.view(n, kv_heads, size).float()])
            values = torch.cat([self._order.read(cache, blk, off, 1).float(), value.view(n, kv_heads, size).float()])
            group = heads // kv_heads
            scores = torch.einsum("thd,shd->hts", q, keys.repeat_interleave(group, dim=1)) * scale
            scores[:, :, start:].masked_fill_(~causal, float("-inf"))
            probs = scores.softmax(dim=-1)
            if i >= first_layer and heads_from is None:
                read.add_(probs[:, :, :start].sum(dim=(0, 1)))
            elif i >= first_layer:
                per_head = probs[:, :, :start].sum(dim=1)
                per_head /= per_head[:, heads_from:].sum(dim=1, keepdim=True).clamp_min(1e-12)
                torch.maximum(read, per_head.max(dim=0).values, out=read)
            out = torch.einsum("hts,shd->thd", probs, values.repeat_interleave(group, dim=1))
            return out.reshape(n, heads * size).to(query.dtype)

        for i, module in enumerate(modules):
            module.forward = functools.partial(attend, i)
        try:
            ids = torch.tensor(question, dtype=torch.int64)
            pos = torch.arange(start, start + n)
            with torch.inference_mode(), set_forward_context(None, self._runner.vllm_config, num_tokens=n,
                                                             skip_compiled=True):
                hidden = self._runner.model(input_ids=ids, positions=pos)
        finally:
            for module in modules:
                del module.forward  # the class's own again
        return read, hidden

    def recompute(self, token_ids: list[int], runs: list[tuple[int, int]], block_ids: list[int]) -> Any:
        """Run the model on positions ``runs`` (sorted, disjoint ``[start, end)``) of a request whose
        tokens are ``token_ids`` and whose KV is in ``block_ids``; their K/V land in the cache. Returns
        the model's output (hidden states of the run tokens; None when there are none)."""
        from vllm.forward_context import set_forward_context
        from vllm.v1.attention.backend import CommonAttentionMetadata

        if not runs:
            return None
        pos = torch.cat([torch.arange(s, e) for s, e in runs])
        ids = torch.tensor([token_ids[p] for p in pos.tolist()], dtype=torch.int64)
        lens = torch.tensor([e - s for s, e in runs], dtype=torch.int32)
        qsl = torch.zeros(len(runs) + 1, dtype=torch.int32)
        torch.cumsum(lens, 0, out=qsl[1:])
        seq_lens = torch.tensor([e for _, e in runs], dtype=torch.int32)
        table = torch.tensor(block_ids, dtype=torch.int32).unsqueeze(0).expand(len(runs), -1).contiguous()
        blk, off = self._slots(block_ids, pos)
        slots = blk * self.block_size + off
        common = CommonAttentionMetadata(
            query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq_lens, num_reqs=len(runs),
            num_actual_tokens=len(pos), max_query_len=int(lens.max()), max_seq_len=int(seq_lens.max()),
            block_table_tensor=table, slot_mapping=slots, causal=True)
        metadata = self._group.get_metadata_builder().build(0, common)
        runner = self._runner
        with torch.inference_mode(), set_forward_context(
                {n: metadata for n in self._names}, runner.vllm_config, num_tokens=len(pos),
                slot_mapping={n: slots for n in self._names}, skip_compiled=True):
            return runner.model(input_ids=ids, positions=pos)


def select(blender: Blender, selection: str, token_ids: list[int], block_ids: list[int], span: tuple[int, int],
           glue: list[tuple[int, int]], candidates: list[tuple[int, int]], count: int,
           question: list[int]) -> list[tuple[int, int]]:
    """``count`` of the ``candidates`` (placed segment tokens of the blend's ``span``), picked by ``selection``
    over the blended cache (``glue``: the runs recomputed anyway; ``question``: the prompt after the span).
    The gradual selections pick in two rounds, the second scored over the cache the first refreshed:
    "question-gradual" recomputes the question's first half of picks and asks the question again;
    "question-heads" scores a position by its largest share of any head's reads over the span;
    "deviation-gradual" (CacheBlend's gradual filtering) keeps ``GRADUAL_WIDEN`` x ``count`` by layer-1
    deviation, runs those (with the glue) through the first :func:`~lmcache_p2p.segments.gradual_layer`
    layers and keeps the ``count`` whose keys moved most there. The worker's blends and ``bench selection``
    both pick here."""
    if reads_question(selection):
        rounds = 2 if selection.endswith("-gradual") else 1
        heads_from = span[0] if selection == "question-heads" else None
        picked: list[tuple[int, int]] = []
        for r in range(rounds):
            # the glue (and earlier picks) in place: the question reads them
            blender.recompute(token_ids, merge_runs(glue + picked), block_ids)
            read, _ = blender.question_attention(question, span[1], block_ids, heads_from=heads_from)
            want = (count - sum(e - s for s, e in picked)) // (rounds - r)
            picked = merge_runs(picked + question_runs(read, subtract_runs(candidates, picked), want))
        return picked
    if selection == "deviation-gradual":
        wide = blender.deviating(token_ids, block_ids, [span], candidates, GRADUAL_WIDEN * count)
        layer = gradual_layer(blender.num_layers)
        return blender.deviating(token_ids, block_ids, merge_runs(glue + wide), wide, count, layer)
    if selection != "deviation":
        raise ValueError(f"selection {selection!r}: the worker picks for deviation and question selections only")
    return blender.deviating(token_ids, block_ids, [span], candidates, count)
