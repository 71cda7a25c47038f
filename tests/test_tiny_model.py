"""The offline tiny Llama: loads with transformers, is deterministic and idempotent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from lmcache_p2p.testing.tiny_model import MARKER, TinyModelSpec, create_tiny_model, main  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def test_tokenizer_loads_and_round_trips(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    text = "def main(argv):\n    return 0  # ünïcödé"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id == 1
    assert tok.eos_token_id == 2
    assert max(ids) < 4096
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_config_fits_vllm_tests(model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["dtype"] == "bfloat16"
    assert config["max_position_embeddings"] >= 8192
    assert (config["num_hidden_layers"], config["num_key_value_heads"], config["head_dim"]) == (4, 2, 64)
    assert (model_dir / "model.safetensors").stat().st_size < 20 << 20


def test_idempotent_and_deterministic(model_dir: Path, tmp_path: Path) -> None:
    before = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert create_tiny_model(model_dir) == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == before
    again = create_tiny_model(tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", MARKER):
        assert (again / name).read_bytes() == (model_dir / name).read_bytes(), name


def test_other_params_replace_a_tiny_model_but_not_foreign_dirs(tmp_path: Path) -> None:
    path = create_tiny_model(tmp_path / "m", num_layers=1, hidden=64, heads=2, kv_heads=1, head_dim=32, vocab_size=512)
    assert json.loads((path / MARKER).read_text())["num_layers"] == 1
    args = "--num-layers 2 --hidden 64 --heads 2 --kv-heads 1 --head-dim 32 --vocab-size 512".split()
    assert main([str(path), *args]) == 0
    assert json.loads((path / MARKER).read_text())["num_layers"] == 2
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="refusing"):
        create_tiny_model(foreign)
    assert (foreign / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize(("field", "value"), [("kv_heads", 3), ("num_layers", 0), ("vocab_size", 100)])
def test_spec_rejects_bad_values(field: str, value: int) -> None:
    with pytest.raises(ValueError, match=field):
        TinyModelSpec(**{field: value})
