"""The trained tiny Llama: deterministic, idempotent, and actually trained (outputs not flat)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from lmcache_p2p.testing.trained_model import (  # noqa: E402
    MARKER,
    TrainSpec,
    create_trained_model,
    held_out_prompts,
    main,
    read_marker,
)

# A few steps on short sequences: what the build does, in seconds rather than minutes.
QUICK = TrainSpec(steps=2, batch=2, seq_len=64, warmup=1, eval_windows=8)


@pytest.mark.slow
def test_quick_build_is_deterministic_idempotent_and_refuses_foreign_dirs(tmp_path: Path) -> None:
    first = create_trained_model(tmp_path / "m", QUICK)
    before = (first / "model.safetensors").stat().st_mtime_ns
    assert create_trained_model(first, QUICK) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == before
    assert main([str(tmp_path / "again"), "--steps", "2", "--batch", "2", "--seq-len", "64", "--warmup", "1",
                 "--eval-windows", "8"]) == 0
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (tmp_path / "again" / name).read_bytes() == (first / name).read_bytes(), name
    marker = read_marker(first)
    assert marker is not None and marker["spec"] == QUICK.marker()
    assert marker["perplexity"]["trained"] < marker["perplexity"]["random"]
    assert json.loads((first / "config.json").read_text())["dtype"] == "bfloat16"
    assert not (first / "lmcache_p2p_tiny_model.json").exists()  # never mistaken for the random model
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="refusing"):
        create_trained_model(foreign, QUICK)
    assert (foreign / "keep.txt").read_text() == "mine"
    assert not any(p.name.startswith(".m.") and p.is_dir() for p in tmp_path.iterdir())  # no staging left


@pytest.mark.slow
@pytest.mark.timeout(1200)  # the first run on a machine builds the model (minutes)
def test_trained_model_is_trained_and_answers_each_prompt_differently(trained_model: Path) -> None:
    import torch
    from transformers import LlamaForCausalLM

    marker = read_marker(trained_model)
    assert marker is not None and (trained_model / MARKER).exists()
    ppl = marker["perplexity"]
    assert ppl["trained"] < 300 and ppl["random"] > 10 * ppl["trained"], ppl  # measured: 4,306 -> 206
    model = LlamaForCausalLM.from_pretrained(trained_model, dtype=torch.float32).eval()
    continuations = []
    with torch.no_grad():
        for prompt in held_out_prompts(trained_model, 4, 128):
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                                 pad_token_id=2)
            continuations.append(tuple(out[0, len(prompt):].tolist()))
    assert len(set(continuations)) == 4, continuations
    assert all(len(set(c)) > 2 for c in continuations), continuations


@pytest.mark.parametrize(("field", "value"), [("steps", 0), ("warmup", 5), ("lr", 0.0), ("seed", -1)])
def test_spec_rejects_bad_values(field: str, value: float) -> None:
    kwargs = {"steps": 2, field: value} if field == "warmup" else {field: value}
    with pytest.raises(ValueError, match=field):
        TrainSpec(**kwargs)  # type: ignore[arg-type]
