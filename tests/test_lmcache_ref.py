"""Fast checks of the LMCache reference helpers (no engine, no LMCache server started)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmcache_p2p.bench import lmcache_ref
from lmcache_p2p.testing import engine_proc


def test_unavailable_without_venv(tmp_path: Path) -> None:
    assert not lmcache_ref.lmcache_available(tmp_path)
    with pytest.raises(FileNotFoundError):
        lmcache_ref.measure_lmcache_hit(tmp_path / "model", [[3, 4, 5]], "float32", repo_root=tmp_path)


def test_warmup_prompt_shares_no_prefix() -> None:
    prompts = [[t + 3 for t in range(i, i + 64)] for i in range(5)]
    w = lmcache_ref._warmup_prompt(prompts, 7)
    assert len(w) == 64 and min(w) >= 3 and max(w) <= max(max(p) for p in prompts)
    assert all(w[0] != p[0] for p in prompts)


def test_connector_config_and_env() -> None:
    kv = lmcache_ref.mp_connector_config(5555)
    assert kv["kv_connector"] == "LMCacheMPConnector" and kv["kv_role"] == "kv_both"
    assert kv["kv_connector_extra_config"] == {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": 5555}
    json.dumps(kv)
    env = lmcache_ref.lmcache_env("/repo")
    assert env["PYTHONPATH"].split(":")[0] == "/repo" and env["LMCACHE_TRACK_USAGE"] == "false"


def test_engine_proc_options_are_exclusive() -> None:
    with pytest.raises(SystemExit):
        engine_proc.main(["--model", "m", "--agent-config", "a.toml", "--kv-transfer-json", "{}"])
