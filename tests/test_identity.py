"""A model's identity comes from its files: the same weights under two paths are one model, one
changed field or weight is another (real model directories written by the tiny-model builder)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from lmcache_p2p.cli.identity import main
from lmcache_p2p.config import LayoutConfig
from lmcache_p2p.identity import model_identity
from lmcache_p2p.keys import Fingerprint
from lmcache_p2p.testing.tiny_model import create_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(create_tiny_model(tmp_path_factory.mktemp("m") / "tiny-llama"))


def test_the_same_weights_under_another_path_are_the_same_model(model: Path, tmp_path: Path) -> None:
    copy = tmp_path / "elsewhere" / "renamed"
    shutil.copytree(model, copy)
    cfg = json.loads((copy / "config.json").read_text())
    cfg["_name_or_path"] = "/somewhere/else"  # where it was loaded from is not what it is
    (copy / "config.json").write_text(json.dumps(cfg, indent=4))  # and formatting is not either
    assert model_identity(copy) == model_identity(model)
    assert model_identity(model).startswith("sha:")


def test_one_config_field_or_changed_weights_make_another_model(model: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    shutil.copytree(model, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["rope_theta"] = float(cfg.get("rope_theta", 10000.0)) * 2
    (other / "config.json").write_text(json.dumps(cfg))
    assert model_identity(other) != model_identity(model)

    tuned = tmp_path / "tuned"
    shutil.copytree(model, tuned)
    weights = next(p for p in sorted(tuned.iterdir()) if p.suffix == ".safetensors")
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit of one weight, same shapes and sizes
    weights.write_bytes(bytes(data))
    assert model_identity(tuned) != model_identity(model)


def test_hub_names_are_identified_by_name_and_revision(capsys: pytest.CaptureFixture[str]) -> None:
    assert model_identity("org/model") == "hf:org/model@main"
    assert model_identity("org/model", "abc123") == "hf:org/model@abc123"
    assert main(["org/model", "--revision", "abc123"]) == 0
    assert capsys.readouterr().out.strip() == "hf:org/model@abc123"


def test_one_fingerprint_constructor_for_agents_and_engines() -> None:
    layout = LayoutConfig(model_id="hf:org/model@main")
    fp = Fingerprint.of(layout)
    assert (fp.model_id, fp.num_layers, fp.kv_layout, fp.tp_size) == ("hf:org/model@main", 4, "vllm-cpu", 1)
    # vLLM CPU chunks are head-major: every TP layout shares them (each rank holds a head range)
    assert Fingerprint.of(layout, 2, 1).digest == fp.digest
    cuda = LayoutConfig(model_id="hf:org/model@main", kv_layout="vllm-cuda")  # heads not outermost in a block
    assert Fingerprint.of(cuda, 2, 1).digest != Fingerprint.of(cuda).digest


def test_large_weight_files_are_sampled_and_a_fine_tune_still_differs(model: Path, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import lmcache_p2p.identity as identity

    monkeypatch.setattr(identity, "_FULL_BYTES", 1 << 20)  # the tiny model's 12 MB weights count as large
    monkeypatch.setattr(identity, "_SAMPLE_BYTES", 16 << 10)
    identity._local_identity.cache_clear()  # identities computed with the real limits
    base = model_identity(model)
    tuned = tmp_path / "tuned"
    shutil.copytree(model, tuned)
    weights = next(p for p in sorted(tuned.iterdir()) if p.suffix == ".safetensors")
    data = bytearray(weights.read_bytes())
    for i in range(4096, len(data), 4096):  # a fine-tune changes (nearly) every weight
        data[i] ^= 0x01
    weights.write_bytes(bytes(data))
    assert model_identity(tuned) != base
    assert model_identity(shutil.copytree(model, tmp_path / "copy")) == base
    identity._local_identity.cache_clear()
