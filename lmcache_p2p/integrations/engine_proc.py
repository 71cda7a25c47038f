"""A vLLM-on-CPU engine in its own process, driven over stdin/stdout (tests, bench, demo).

    python -m lmcache_p2p.integrations.engine_proc --model DIR [--agent-config FILE | --kv-transfer-json JSON]

Reads JSON requests, one per line, on stdin::

    {"op": "generate", "prompts": [[1, 2, ...], ...], "max_tokens": 16}
    {"op": "ttft", "prompts": [[...], ...]}          # one request per prompt, max_tokens=1, timed
    {"op": "quit"}

and answers each with one line ``@@lmcache-p2p {...}`` on stdout (vLLM logs go to stderr/stdout
too; the marker separates them). With ``--agent-config`` the engine runs with the
``LMCacheP2PConnector`` and ``kv_load_failure_policy: recompute``; with ``--kv-transfer-json`` it
uses that full ``kv_transfer_config`` dict instead (e.g. LMCache's ``LMCacheMPConnector``); without
either, plain vLLM. This module imports only vLLM and the stdlib, so it also runs under another venv
(``.venv-lmcache``) with this repository on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

MARKER = "@@lmcache-p2p "


def engine_env() -> dict[str, str]:
    """Environment for comparable CPU runs (facts: reserve one core whether or not a connector is set)."""
    return {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "TOKENIZERS_PARALLELISM": "false"}


def _reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(MARKER + json.dumps(obj) + "\n")
    sys.stdout.flush()


def _build(model: str, agent_config: str | None, kv_bytes: int, dtype: str,
           kv_transfer_json: dict[str, Any] | None = None) -> Any:
    from vllm import LLM

    kv_transfer = kv_transfer_json
    if agent_config is not None:
        kv_transfer = {"kv_connector": "LMCacheP2PConnector",
                       "kv_connector_module_path": "lmcache_p2p.integrations.vllm",
                       "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                       "kv_connector_extra_config": {"config": agent_config}}
    # dtype: argparse limits the choices to what vLLM accepts.
    return LLM(model=model, dtype=dtype, max_model_len=8192, enforce_eager=True,  # type: ignore[arg-type]
               enable_prefix_caching=False, kv_cache_memory_bytes=kv_bytes, kv_transfer_config=kv_transfer,
               disable_log_stats=False, seed=0)


def _serve(llm: Any) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "quit":
            break
        prompts = [TokensPrompt(prompt_token_ids=p) for p in req["prompts"]]
        if req["op"] == "generate":
            # One prompt at a time: batch composition changes floating-point results, and greedy
            # comparisons between engines must only differ in where the KV came from.
            params = SamplingParams(temperature=0.0, max_tokens=int(req.get("max_tokens", 16)), ignore_eos=True)
            outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
            _reply({"results": [{"tokens": list(o.outputs[0].token_ids),
                                 "num_cached_tokens": int(o.num_cached_tokens or 0)} for o in outs]})
        elif req["op"] == "ttft":
            params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
            results = []
            for p in prompts:
                t0 = time.perf_counter()
                out = llm.generate([p], params, use_tqdm=False)[0]
                results.append({"ttft_s": time.perf_counter() - t0,
                                "num_cached_tokens": int(out.num_cached_tokens or 0),
                                "tokens": list(out.outputs[0].token_ids)})
            _reply({"results": results})
        else:
            _reply({"error": f"unknown op {req['op']!r}"})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--agent-config", default=None)
    parser.add_argument("--kv-transfer-json", default=None,
                        help="a full kv_transfer_config dict as JSON, used instead of the lmcache-p2p connector")
    parser.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = parser.parse_args(argv)
    if args.agent_config is not None and args.kv_transfer_json is not None:
        parser.error("--agent-config and --kv-transfer-json are exclusive")
    kv_transfer_json = json.loads(args.kv_transfer_json) if args.kv_transfer_json is not None else None
    for k, v in engine_env().items():
        os.environ.setdefault(k, v)
    t0 = time.perf_counter()
    llm = _build(args.model, args.agent_config, args.kv_cache_bytes, args.dtype, kv_transfer_json)
    _reply({"ready": True, "startup_s": time.perf_counter() - t0, "pid": os.getpid()})
    _serve(llm)
    del llm
    return 0


if __name__ == "__main__":
    sys.exit(main())
