"""``lmcache-p2p bench step``: what the connector's scheduler side adds to each engine step, by batch size.

vLLM calls ``build_connector_meta`` once per step, on its scheduler's thread, with every request of the
batch: whatever it costs, every request pays it on every step. This bench drives the real
``P2PScheduler`` (on a private etcd, as an engine's scheduler process runs it) the way vLLM does: ``N``
requests of ``--prompt`` tokens are offered, allocated and prefilled in one step, then decode together,
one token a request a step, with a new block every ``block_size`` tokens and a generated chunk saved
each time a request's tokens fill one (``chunks_saved``); each decode step's ``SchedulerOutput`` is
vLLM's own class. It reports the median time of ``build_connector_meta`` over ``--steps`` steps for
each batch size, the time per request, and the per-request time at the largest batch over that at the
smallest (``per_request_ratio``: 1.0 when the step's work grows linearly with the batch; 4.0 at 256 vs
64 would mean it grows with the batch's square). The baseline in the same run is the same call on a
step that scheduled nothing (what the hook costs with no request).

No engine runs: what is timed is the connector's scheduler side alone (vLLM's own scheduling is not in it).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path
from typing import Any

from ..config import AgentConfig, EtcdConfig
from ..index.etcd_server import EtcdServer
from ..keys import Fingerprint
from ..testing.vllm_requests import empty_step, fake_blocks, fake_request, prefill_step
from .common import bench_parser, emit, progress, run_in_workdir

BLOCK = 16


def decode_step(requests: list[Any], block_ids: dict[str, list[int]], next_block: list[int],
                rng: random.Random) -> Any:
    """vLLM's ``SchedulerOutput`` of a step in which every request of ``requests`` decodes one token (each
    request's token appended to it first, as vLLM's output processing does before the next schedule)."""
    from vllm.v1.core.sched.output import CachedRequestData

    out = empty_step()
    ids: list[str] = []
    computed: list[int] = []
    new_blocks: list[tuple[list[int], ...] | None] = []
    new_tokens: list[list[int]] = []
    outputs: list[int] = []
    for request in requests:
        request.all_token_ids.append(rng.randrange(3, 4000))
        done = len(request.all_token_ids) - 1  # computed before this step: all but the token just sampled
        request.num_computed_tokens = done
        grows = done % BLOCK == 0
        if grows:
            block_ids[request.request_id].append(next_block[0])
            next_block[0] += 1
        ids.append(request.request_id)
        computed.append(done)
        new_blocks.append(([block_ids[request.request_id][-1]],) if grows else None)
        new_tokens.append([])
        outputs.append(len(request.all_token_ids) - len(request.prompt_token_ids))
        out.num_scheduled_tokens[request.request_id] = 1
    out.total_num_scheduled_tokens = len(requests)
    out.scheduled_cached_reqs = CachedRequestData(
        req_ids=ids, resumed_req_ids=set(), new_token_ids=new_tokens, all_token_ids={}, new_block_ids=new_blocks,
        num_computed_tokens=computed, num_output_tokens=outputs)
    return out


def batch(scheduler: Any, n: int, prompt_tokens: int, steps: int, tag: str) -> dict[str, float]:
    """``n`` requests prefilled in one step, then ``steps`` decode steps timed; the requests finished after."""
    rng = random.Random(n)
    requests = [fake_request(f"{tag}-{i}", [rng.randrange(3, 4000) for _ in range(prompt_tokens)])
                for i in range(n)]
    block_ids: dict[str, list[int]] = {}
    next_block = [0]
    for request in requests:
        scheduler.get_num_new_matched_tokens(request, 0)
        blocks = list(range(next_block[0], next_block[0] + -(-(prompt_tokens + 1) // BLOCK)))
        next_block[0] += len(blocks)
        block_ids[request.request_id] = blocks
        scheduler.update_state_after_alloc(request, fake_blocks(blocks), 0)
    scheduler.build_connector_meta(prefill_step(*((r, block_ids[r.request_id], prompt_tokens) for r in requests)))
    times, saves = [], 0
    for _ in range(steps):
        out = decode_step(requests, block_ids, next_block, rng)
        t0 = time.perf_counter()
        meta = scheduler.build_connector_meta(out)
        times.append(time.perf_counter() - t0)
        saves += sum(len(save.num_tokens) for save in meta.saves)
    for request in requests:
        scheduler.request_finished(request, block_ids[request.request_id])
    median = statistics.median(times)
    return {"step_us": round(median * 1e6, 1), "per_request_us": round(median * 1e6 / n, 3),
            "p90_step_us": round(statistics.quantiles(times, n=10)[-1] * 1e6, 1), "chunks_saved": saves}


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from ..integrations.vllm.scheduler import P2PScheduler

    sizes = sorted(args.batch)
    out: dict[str, Any] = {"engine": "none (the connector's scheduler side alone)", "prompt_tokens": args.prompt,
                           "steps": args.steps, "block_size": BLOCK}
    with EtcdServer(base_dir=str(work)) as etcd:
        config = AgentConfig(node_id="bench-step", cluster="bench-step", etcd=EtcdConfig(endpoints=etcd.endpoints))
        scheduler = P2PScheduler(config, Fingerprint.of(config.layout), BLOCK, blend_refusal=None)
        try:
            empty = []
            for _ in range(args.steps):
                step = empty_step()
                t0 = time.perf_counter()
                scheduler.build_connector_meta(step)
                empty.append(time.perf_counter() - t0)
            out["empty_step_us"] = round(statistics.median(empty) * 1e6, 1)
            batch(scheduler, sizes[0], args.prompt, 20, "warm-up")
            for n in sizes:
                progress("step", f"{n} requests decoding, {args.steps} steps")
                for key, value in batch(scheduler, n, args.prompt, args.steps, f"b{n}").items():
                    out[f"{key}_{n}"] = value
        finally:
            scheduler.shutdown()
    low, high = out[f"per_request_us_{sizes[0]}"], out[f"per_request_us_{sizes[-1]}"]
    out["per_request_ratio"] = round(high / low, 2) if low else None
    return out


def main(argv: list[str]) -> int:
    parser = bench_parser("step", __doc__, keeps="etcd's data")
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 128, 256], help="requests decoding together")
    parser.add_argument("--prompt", type=int, default=600, help="prompt tokens of each request")
    parser.add_argument("--steps", type=int, default=300, help="decode steps timed per batch size")
    args = parser.parse_args(argv)
    if min(args.batch) < 1 or args.steps < 10 or args.prompt < 1:
        parser.error("--batch >= 1, --steps >= 10, --prompt >= 1")
    emit(run_in_workdir(run, args, "lmcache-p2p-bench-step-"), args.json,
         "bench step (the connector's scheduler side per engine step; no engine)")
    return 0
