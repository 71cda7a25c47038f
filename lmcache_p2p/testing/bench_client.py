"""vLLM's own benchmark client (``vllm bench serve``) driving several engines, requests round-robin.

    python -m lmcache_p2p.testing.bench_client --urls http://h:p1,http://h:p2 [--assign FILE] \\
        <vllm bench serve arguments, --base-url being the first engine>

vLLM's client takes one base URL. This wrapper swaps its completions request function for one that sends
the i-th request the client starts (arrival order: tasks start in the order they are created, and
``--max-concurrency`` releases them first-in first-out) to engine ``i mod N``; the dataset, arrival process,
timing, metrics and result JSON stay vLLM's. ``--assign`` writes one line per request, ``request_id
engine``, for per-engine accounting. vLLM is imported here, in this process only.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
from typing import Any


def main(argv: list[str] | None = None) -> None:
    ours = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    ours.add_argument("--urls", required=True, help="engines' base URLs, comma-separated (completions go to "
                      "URL/v1/completions)")
    ours.add_argument("--assign", help="file: one line per request started: its order, id and engine's index")
    args, rest = ours.parse_known_args(argv)
    urls = [u.rstrip("/") for u in args.urls.split(",") if u]

    from vllm.benchmarks import serve as bench
    from vllm.benchmarks.lib import endpoint_request_func as funcs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    completions = funcs.ASYNC_REQUEST_FUNCS["vllm"]
    endpoint = "/v1/completions"
    order = itertools.count()
    assign = open(args.assign, "w") if args.assign else None  # noqa: SIM115 - closed below

    async def round_robin(request_func_input: Any, session: Any, pbar: Any = None) -> Any:
        k = next(order)
        i = k % len(urls)
        routed = dataclasses.replace(request_func_input, api_url=urls[i] + endpoint)
        if assign is not None:
            assign.write(f"{k} {request_func_input.request_id} {i}\n")
        return await completions(request_func_input=routed, session=session, pbar=pbar)

    for backend in ("vllm", "openai"):
        funcs.ASYNC_REQUEST_FUNCS[backend] = round_robin  # serve.py reads this dict at call time
    parser = FlexibleArgumentParser()
    bench.add_cli_args(parser)
    try:
        bench.main(parser.parse_args(rest))
    finally:
        if assign is not None:
            assign.close()


if __name__ == "__main__":
    main(sys.argv[1:])
