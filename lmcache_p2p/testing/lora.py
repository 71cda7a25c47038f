"""Seeded LoRA adapters for the tiny Llama, written in PEFT's on-disk format (tests only).

    write_lora_adapter(PATH, base_model=MODEL_DIR, seed=1)

An adapter directory holds ``adapter_config.json`` and ``adapter_model.safetensors`` with the
tensors PEFT names ``base_model.model.model.layers.<i>.self_attn.<module>.lora_{A,B}.weight``
(A: ``(rank, in)``, B: ``(out, rank)``). vLLM loads it with ``enable_lora=True`` and a
``LoRARequest(name, id, path)``; the ``peft`` package is not needed to write or to load it.

Unlike a freshly initialised PEFT adapter (B = 0, the identity), both A and B are random here, so
two seeds give two adapters whose K/V projections (``v_proj`` is targeted by default) differ from
each other and from the base model's: KV computed under one must never be served to another.
Writing is deterministic for a given seed and geometry, and idempotent (same files, same bytes).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

DEFAULT_TARGETS = ("q_proj", "v_proj")
_CONFIG = "adapter_config.json"
_WEIGHTS = "adapter_model.safetensors"


def write_lora_adapter(path: str | Path, *, base_model: str | Path, seed: int, rank: int = 8, alpha: int = 16,
                       target_modules: Sequence[str] = DEFAULT_TARGETS, scale: float = 0.1) -> Path:
    """Write a LoRA adapter for the Llama at ``base_model`` to ``path`` and return ``path``.

    ``scale`` is the standard deviation of B's entries; with A's rows of unit expected norm the
    update ``alpha / rank * B @ A`` is of the order of the base projection's own weights."""
    if rank < 1:
        raise ValueError(f"rank: must be positive, got {rank}")
    if not target_modules:
        raise ValueError("target_modules: name at least one projection")
    path = Path(path).resolve()
    config = _adapter_config(Path(base_model).resolve(), rank, alpha, target_modules)
    tensors = _adapter_tensors(Path(base_model), seed, rank, target_modules, scale)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        from safetensors.torch import save_file

        (staging / _CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))
        save_file(tensors, str(staging / _WEIGHTS), metadata={"format": "pt"})
        staging.chmod(0o755)
        if path.exists():
            if not (path / _CONFIG).exists():
                raise ValueError(f"path: {path} exists and holds no LoRA adapter; refusing to replace it")
            shutil.rmtree(path)
        staging.rename(path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return path


def _adapter_config(base_model: Path, rank: int, alpha: int, targets: Sequence[str]) -> dict[str, object]:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base_model),
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
    }


def _projection_shapes(base_model: Path) -> tuple[int, dict[str, tuple[int, int]]]:
    """The number of layers and each attention/MLP projection's ``(in, out)`` from ``config.json``."""
    cfg = json.loads((base_model / "config.json").read_text())
    hidden, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    kv = int(cfg.get("num_key_value_heads") or heads) * head_dim
    shapes = {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
              "o_proj": (heads * head_dim, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
              "down_proj": (inter, hidden)}
    return int(cfg["num_hidden_layers"]), shapes


def _adapter_tensors(base_model: Path, seed: int, rank: int, targets: Sequence[str], scale: float) -> dict:
    import torch

    layers, shapes = _projection_shapes(base_model)
    unknown = sorted(set(targets) - set(shapes))
    if unknown:
        raise ValueError(f"target_modules: unknown projections {unknown}; known: {sorted(shapes)}")
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(layers):
        for module in sorted(targets):
            fan_in, fan_out = shapes[module]
            group = "self_attn" if module.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{group}.{module}"
            a = torch.randn(rank, fan_in, generator=gen) / fan_in**0.5
            b = torch.randn(fan_out, rank, generator=gen) * scale
            tensors[f"{prefix}.lora_A.weight"] = a.to(torch.bfloat16).contiguous()
            tensors[f"{prefix}.lora_B.weight"] = b.to(torch.bfloat16).contiguous()
    return tensors
