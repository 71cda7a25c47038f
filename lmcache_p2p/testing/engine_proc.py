"""A vLLM-on-CPU engine in its own process, driven over stdin/stdout (tests, bench, demo).

    python -m lmcache_p2p.testing.engine_proc --model DIR [--agent-config FILE | --kv-transfer-json JSON]

Reads JSON requests, one per line, on stdin::

    {"op": "generate", "prompts": [[1, 2, ...], ...], "max_tokens": 16}   # optional "kv_transfer_params": {...}
    {"op": "batch", "prompts": [[1, 2, ...], ...], "max_tokens": 16}   # all at once (they compete for KV)
    {"op": "ttft", "prompts": [[...], ...]}          # one request per prompt, max_tokens=1, timed
    {"op": "serve", "prompts": [[...], ...], "max_tokens": 8}   # greedy tokens and the real TTFT of each
    {"op": "update_weights", "prompts": [], "scale": 1.02}   # every weight times scale in place, then
                                                             # reset_prefix_cache (as after an RL update)
    {"op": "quit"}

``generate``, ``ttft`` and ``serve`` also take ``"cache_salt": "tenant-one"`` (vLLM's per-request
salt) and ``"lora": {"name": "a1", "id": 1, "path": DIR}`` (the adapter the request runs under;
the engine needs ``--enable-lora``), both applying to every prompt of the request.

and answers each with one line ``@@lmcache-p2p {...}`` on stdout (vLLM logs go to stderr/stdout
too; the marker separates them). With ``--agent-config`` the engine runs with the
``LMCacheP2PConnector`` (``kv_load_failure_policy`` left at vLLM's default); with ``--kv-transfer-json`` it
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


def engine_env(tensor_parallel_size: int = 1) -> dict[str, str]:
    """Environment for comparable CPU runs (facts: reserve one core whether or not a connector is set).

    With TP > 1, vLLM-CPU binds each rank's OpenMP threads to cores of its own; on a host with one
    NUMA node it must be told which: rank r gets core ``r mod cores`` (and no core is reserved).
    Its TP workers wait for the next step by spinning on a shared-memory queue in Python, for a second
    after every step, holding the GIL the embedded agent needs to move bytes: pulls then took seconds
    and ran into their deadlines (measured, bench tp). ``VLLM_USE_SPINLOOP_EXT=1`` spins in C instead."""
    env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "TOKENIZERS_PARALLELISM": "false"}
    if tensor_parallel_size > 1:
        cores = os.cpu_count() or 1
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(r % cores) for r in range(tensor_parallel_size))
        env["VLLM_USE_SPINLOOP_EXT"] = "1"
    return env


def _reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(MARKER + json.dumps(obj) + "\n")
    sys.stdout.flush()


def _build(model: str, agent_config: str | None, kv_bytes: int, dtype: str,
           kv_transfer_json: dict[str, Any] | None = None, prefix_caching: bool = False,
           tensor_parallel_size: int = 1, max_lora_rank: int = 0) -> Any:
    from vllm import LLM

    note_engine_start("connector" if agent_config is not None or kv_transfer_json is not None else "reference")
    kv_transfer = kv_transfer_json
    if agent_config is not None:
        kv_transfer = {"kv_connector": "LMCacheP2PConnector",
                       "kv_connector_module_path": "lmcache_p2p.integrations.vllm",
                       "kv_role": "kv_both",  # kv_load_failure_policy left at vLLM's default ("fail"):
                       "kv_connector_extra_config": {"config": agent_config}}  # the connector must cope
    # dtype: argparse limits the choices to what vLLM accepts.
    return LLM(model=model, dtype=dtype, max_model_len=8192, enforce_eager=True,  # type: ignore[arg-type]
               enable_prefix_caching=prefix_caching, kv_cache_memory_bytes=kv_bytes, kv_transfer_config=kv_transfer,
               disable_log_stats=False, seed=0, tensor_parallel_size=tensor_parallel_size,
               distributed_executor_backend="mp" if tensor_parallel_size > 1 else None,
               **_lora_args(max_lora_rank))


def note_engine_start(kind: str) -> None:
    """Count an engine start where ``$SUITE_ENGINE_STARTS`` names a file (how many engines a suite run
    starts: one line each, appended)."""
    path = os.environ.get("SUITE_ENGINE_STARTS")
    if path:
        with open(path, "a") as f:
            f.write(f"{kind} {os.getpid()}\n")


def _lora_args(max_lora_rank: int) -> dict[str, Any]:
    """LoRA engine arguments: none when ``max_lora_rank`` is 0 (LoRA off)."""
    return {} if max_lora_rank == 0 else {"enable_lora": True, "max_lora_rank": max_lora_rank, "max_loras": 2}


def _prompts(req: dict[str, Any]) -> list[Any]:
    from vllm.inputs import TokensPrompt

    salt = req.get("cache_salt")
    if salt is None:
        return [TokensPrompt(prompt_token_ids=p) for p in req["prompts"]]
    return [TokensPrompt(prompt_token_ids=p, cache_salt=str(salt)) for p in req["prompts"]]


def _lora_request(req: dict[str, Any]) -> Any:
    """The request's ``LoRARequest``, or None (the base model)."""
    lora = req.get("lora")
    if lora is None:
        return None
    from vllm.lora.request import LoRARequest

    return LoRARequest(str(lora["name"]), int(lora["id"]), str(lora["path"]))


def _serve(llm: Any) -> None:
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "quit":
            break
        try:
            _handle(llm, req)
        except Exception as exc:  # a bad request is answered, not fatal to the engine
            _reply({"error": f"{type(exc).__name__}: {exc}"})


def _handle(llm: Any, req: dict[str, Any]) -> None:
    from vllm import SamplingParams

    prompts = _prompts(req)
    lora = _lora_request(req)
    if req["op"] == "generate":
        # One prompt at a time: batch composition changes floating-point results, and greedy
        # comparisons between engines must only differ in where the KV came from.
        extra = {"kv_transfer_params": req["kv_transfer_params"]} if req.get("kv_transfer_params") else None
        params = SamplingParams(temperature=0.0, max_tokens=int(req.get("max_tokens", 16)), ignore_eos=True,
                                extra_args=extra)
        outs = [llm.generate([p], params, use_tqdm=False, lora_request=lora)[0] for p in prompts]
        _reply({"results": [{"tokens": list(o.outputs[0].token_ids),
                             "num_cached_tokens": int(o.num_cached_tokens or 0)} for o in outs]})
    elif req["op"] == "batch":  # every prompt at once: they compete for the KV cache (preemption)
        params = SamplingParams(temperature=0.0, max_tokens=int(req.get("max_tokens", 16)), ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
        _reply({"results": [{"tokens": list(o.outputs[0].token_ids),
                             "num_cached_tokens": int(o.num_cached_tokens or 0)} for o in outs]})
    elif req["op"] == "ttft":
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        results = []
        for p in prompts:
            t0 = time.perf_counter()
            out = llm.generate([p], params, use_tqdm=False, lora_request=lora)[0]
            results.append({"ttft_s": time.perf_counter() - t0,
                            "num_cached_tokens": int(out.num_cached_tokens or 0),
                            "tokens": list(out.outputs[0].token_ids)})
        _reply({"results": results})
    elif req["op"] == "score":
        _reply({"results": [_score(llm, p, int(req.get("max_tokens", 8)), req.get("kv_transfer_params"),
                                   int(req.get("scored", 0))) for p in prompts]})
    elif req["op"] == "serve":
        _reply({"results": [_serve_one(llm, p, int(req.get("max_tokens", 8)), lora) for p in prompts]})
    elif req["op"] == "concurrent":
        _reply({"results": [_concurrent(llm, p, req["stream"], int(req.get("stream_tokens", 4000)),
                                        float(req.get("watch_s", 0.0))) for p in req["prompts"]]})
    elif req["op"] == "update_weights":
        # The engine's own control path: a callable on every worker (needs VLLM_ALLOW_INSECURE_SERIALIZATION
        # in the engine's environment), then the reset a trainer makes after a weight update
        llm.collective_rpc(_scale_weights, args=(float(req["scale"]),))
        _reply({"results": [{"reset": _reset_caches(llm)}]})
    else:
        _reply({"error": f"unknown op {req['op']!r}"})


def _reset_caches(llm: Any, tries: int = 50) -> bool:
    """vLLM's reset after a weight update. It fails while blocks are still held (a finished request's tail,
    kept until the worker has copied it: the engine core frees them at its next step): tried again."""
    for _ in range(tries):
        try:
            if llm.reset_prefix_cache(reset_running_requests=True, reset_connector=True):
                return True
        except RuntimeError:  # "Failed to reset KV cache even when all the running requests are preempted"
            pass
        time.sleep(0.1)
    return False


def _scale_weights(worker: Any, scale: float) -> None:
    """Runs on a worker: every parameter of its model times ``scale``, in place (1.0: rewritten unchanged)."""
    import torch

    with torch.no_grad():
        for param in worker.model_runner.model.parameters():
            param.mul_(scale)


def _serve_one(llm: Any, prompt: Any, max_tokens: int, lora: Any = None) -> dict[str, Any]:
    """One request (a ``TokensPrompt``) through the engine's step loop: its tokens (greedy), TTFT and
    cached tokens."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ttft, out = _stepped(llm, "serve", prompt, params, lora)
    return {"tokens": list(out.outputs[0].token_ids), "ttft_s": ttft,
            "num_cached_tokens": int(out.num_cached_tokens or 0)}


def _stepped(llm: Any, name: str, prompt: Any, params: Any, lora: Any = None) -> tuple[float, Any]:
    """Add one request and step the engine until it finishes: its TTFT (seconds to its first token,
    measured in the step loop) and its final output."""
    engine = llm.llm_engine
    rid = f"{name}-{time.monotonic_ns()}"
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, params, lora_request=lora)
    ttft, out = None, None
    while out is None:
        for o in engine.step():
            if o.request_id != rid:
                continue
            if ttft is None and o.outputs and o.outputs[0].token_ids:
                ttft = time.perf_counter() - t0
            if o.finished:
                out = o
    return (ttft if ttft is not None else time.perf_counter() - t0), out


FIRST_TOP = 20  # vLLM's default max_logprobs


def _score(llm: Any, prompt: Any, max_tokens: int, kv_params: dict[str, Any] | None, scored: int) -> dict[str, Any]:
    """One request through the step loop: greedy tokens, TTFT, cached tokens, the logprob of each of the
    prompt's last ``scored`` tokens (the model's view of a continuation; they must be computed, not
    loaded) and of each generated token, and the ``FIRST_TOP`` most likely first tokens' logprobs
    (``first_top``: the first answer token's distribution, to compare with a full prefill's)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=FIRST_TOP,
                            prompt_logprobs=0 if scored else None, skip_reading_prefix_cache=False,
                            detokenize=False,  # prompt logprobs of loaded positions hold no token to decode
                            extra_args={"kv_transfer_params": kv_params} if kv_params else None)
    ttft, out = _stepped(llm, "score", prompt, params)
    ids = prompt["prompt_token_ids"]
    prompt_lp: list[float | None] = []
    if scored:
        entries = list(out.prompt_logprobs or [])[-scored:]
        prompt_lp = [None if e is None or tok not in e else float(e[tok].logprob)
                     for e, tok in zip(entries, ids[-scored:], strict=False)]
    gen = out.outputs[0]
    gen_lp = [float(e[t].logprob) if e and t in e else None for e, t in zip(gen.logprobs or [], gen.token_ids,
                                                                             strict=False)]
    first = (gen.logprobs or [None])[0] or {}
    return {"tokens": list(gen.token_ids), "ttft_s": ttft,
            "num_cached_tokens": int(out.num_cached_tokens or 0), "prompt_logprobs": prompt_lp,
            "logprobs": gen_lp, "first_top": {str(t): float(lp.logprob) for t, lp in first.items()}}


def _concurrent(llm: Any, doc: list[int], stream: list[int], stream_tokens: int, watch_s: float = 0.0
                ) -> dict[str, Any]:
    """Serve ``doc`` (one token) while a decode stream runs on the same engine.

    Returns the document's TTFT, its token and cached-token count, the duration of each engine step
    until it was answered (``steps_s``), and the longest gap between two
    tokens of the stream from just before the document arrived to just after it was answered, or to
    ``watch_s`` after it arrived when that is later (what work the document left behind, an abandoned
    pull among it, cost the stream after its answer): what the document cost every other request.
    Where that gap went: its longest engine step (``gap_step_s``: the engine itself held up) and the longest
    pause between two steps inside it (``gap_pause_s``: this process not scheduled; no engine work waits there).
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    engine.add_request("stream", TokensPrompt(prompt_token_ids=stream),
                       SamplingParams(temperature=0.0, max_tokens=stream_tokens, ignore_eos=True))
    times: list[float] = []
    steps: list[float] = []  # each step's duration while the document was in flight
    spans: list[tuple[float, float]] = []  # (start, end) of every step
    doc_out: Any = None

    def pump() -> float:
        nonlocal doc_out
        began = time.perf_counter()
        outs = engine.step()
        now = time.perf_counter()
        steps.append(now - began)
        spans.append((began, now))
        for o in outs:
            if o.request_id == "stream":
                times.extend([now] * (len(o.outputs[0].token_ids) - len(times)))
            elif o.request_id == "doc" and o.finished:
                doc_out = o
        return now

    while len(times) < 3:
        pump()
    t_doc = time.perf_counter()
    del steps[:]
    engine.add_request("doc", TokensPrompt(prompt_token_ids=doc),
                       SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    t_done = t_doc
    while doc_out is None:
        t_done = pump()
    doc_steps = list(steps)
    while (times[-1] <= t_done or times[-1] < t_doc + watch_s) and len(times) < stream_tokens:
        pump()
    engine.abort_request(["stream"])
    while engine.has_unfinished_requests():
        engine.step()
    before = [t for t in times if t < t_doc][-1:]
    window = before + [t for t in times if t >= t_doc]
    end = max(t_done, t_doc + watch_s)
    after = [t for t in window if t > end][:1]
    window = [t for t in window if t <= end] + after
    gaps = [(b - a, a, b) for a, b in zip(window, window[1:], strict=False)]
    gap, gap_from, gap_to = max(gaps, default=(0.0, 0.0, 0.0))
    inside = [(b0, b1) for b0, b1 in spans if gap_from < b1 <= gap_to]  # the steps that ended within the gap
    pauses = [b[0] - a[1] for a, b in zip(inside, inside[1:], strict=False)]
    return {"ttft_s": t_done - t_doc, "tokens": list(doc_out.outputs[0].token_ids),
            "num_cached_tokens": int(doc_out.num_cached_tokens or 0), "max_gap_s": gap,
            "gap_step_s": max((b1 - b0 for b0, b1 in inside), default=0.0), "gap_pause_s": max(pauses, default=0.0),
            "stream_tokens_during": sum(1 for t in times if t_doc <= t <= t_done), "steps_s": doc_steps}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--agent-config", default=None)
    parser.add_argument("--kv-transfer-json", default=None,
                        help="a full kv_transfer_config dict as JSON, used instead of the lmcache-p2p connector")
    parser.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--prefix-caching", action="store_true", help="turn vLLM's own prefix cache on")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--max-lora-rank", type=int, default=0,
                        help="enable LoRA adapters up to this rank (0: LoRA off); requests name one with 'lora'")
    args = parser.parse_args(argv)
    if args.agent_config is not None and args.kv_transfer_json is not None:
        parser.error("--agent-config and --kv-transfer-json are exclusive")
    kv_transfer_json = json.loads(args.kv_transfer_json) if args.kv_transfer_json is not None else None
    for k, v in engine_env(args.tensor_parallel_size).items():
        os.environ.setdefault(k, v)
    t0 = time.perf_counter()
    llm = _build(args.model, args.agent_config, args.kv_cache_bytes, args.dtype, kv_transfer_json,
                 args.prefix_caching, args.tensor_parallel_size, args.max_lora_rank)
    _reply({"ready": True, "startup_s": time.perf_counter() - t0, "pid": os.getpid()})
    _serve(llm)
    del llm
    return 0


if __name__ == "__main__":
    sys.exit(main())
