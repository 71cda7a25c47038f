"""``lmcache-p2p router``: an OpenAI-compatible front for a fleet of vLLM engines (``router/app.py``).

    lmcache-p2p router --etcd http://etcd:2379 [--cluster C] [--config agent.yaml]   # engines from node records
    lmcache-p2p router --engine http://10.0.0.5:8000 --engine ... [--score-url http://agent:9100/v1/score]
    lmcache-p2p router --prefill-engine URL ... --decode-engine URL ... --disaggregated

With etcd, every engine whose agent sets ``engine_url`` (and ``engine_pool``: mixed, prefill or decode)
is found and scored through its own agent; engines come and go with their node records. Static
engines may be named ``NODE=URL`` so the score (which names engines by their agent's node id) applies
to them. Listens on ``--host``/``--port`` (default 127.0.0.1:8080).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Iterator
from typing import Any

from ..config import valid_engine_url
from .common import add_etcd_arguments, tool_config

PROG = "lmcache-p2p router"


def _engine(spec: str, pool: str) -> tuple[str, str, str | None]:
    node, sep, url = spec.partition("=")
    if not sep:
        node, url = "", spec
    if not valid_engine_url(url):
        raise argparse.ArgumentTypeError(f"not an http(s) engine URL: {spec!r}")
    return url.rstrip("/"), pool, node or None


def parser() -> argparse.ArgumentParser:
    from ..router.policy import POLICIES

    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_etcd_arguments(p, default_help="none: static engines only")
    p.add_argument("--engine", action="append", default=[], metavar="[NODE=]URL", help="a mixed-pool engine")
    p.add_argument("--prefill-engine", action="append", default=[], metavar="[NODE=]URL")
    p.add_argument("--decode-engine", action="append", default=[], metavar="[NODE=]URL")
    p.add_argument("--score-url", help="static engines: an agent's /v1/score")
    p.add_argument("--chunk-size", type=int, help="tokens per chunk (default: the config's chunk_size, else 256)")
    p.add_argument("--policy", default="score_load", choices=POLICIES)
    p.add_argument("--disaggregated", action="store_true", help="prefill on the prefill pool, decode on the decode "
                   "pool, the KV through the mesh")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--attempts", type=int, default=3, help="engines tried per request (default 3)")
    p.add_argument("--first-byte-timeout", type=float, default=60.0, help="seconds an engine may stay silent "
                   "before its first byte; then the next engine (default 60)")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--route-timeout", type=float, default=0.5, help="tokenize and score, each (default 0.5 s)")
    p.add_argument("--documents-timeout", type=float, default=2.0, help="placing a chat request's documents: "
                   "its /tokenize calls together; past it, forwarded without spans (default 2 s)")
    p.add_argument("--health-interval", type=float, default=1.0)
    p.add_argument("--health-timeout", type=float, default=1.0)
    p.add_argument("--log-level", default="INFO")
    return p


@contextlib.contextmanager
def _records(args: argparse.Namespace) -> Iterator[Any]:
    """A function returning the cluster's node records (a watch-fed mirror), or None without etcd."""
    if not (args.etcd or args.config):
        yield None
        return
    import dataclasses

    from ..aio import LoopThread
    from ..index.reader import IndexReader
    from ..keys import FingerprintDigest

    config = tool_config(args, PROG)
    config = dataclasses.replace(config, etcd=dataclasses.replace(config.etcd, index="lookup"))  # nodes only
    with LoopThread() as loop:
        reader = IndexReader.open(loop, config, FingerprintDigest(b"\0" * 16))
        try:
            yield lambda: list(reader.nodes().values())
        finally:
            reader.close()


async def serve(args: argparse.Namespace, config: Any, static: tuple[tuple[str, str, str | None], ...],
                records: Any) -> None:
    from aiohttp import web

    from ..router.app import Router, client_session
    from ..router.engines import Fleet, FleetSource

    async with client_session() as session:
        fleet = Fleet(FleetSource(static=static, records=records, score_url=args.score_url), session,
                      interval_s=args.health_interval, timeout_s=args.health_timeout)
        router = Router(fleet, config, session)
        await fleet.start()
        runner = router.runner()
        await runner.setup()
        site = web.TCPSite(runner, args.host, args.port)
        await site.start()
        port = runner.addresses[0][1] if runner.addresses else args.port
        logging.getLogger(__name__).info("router listening on http://%s:%d: %d engines (%s), policy %s%s", args.host,
                                         port, len(fleet.engines), fleet.healthy_counts(), args.policy,
                                         ", disaggregated" if args.disaggregated else "")
        print(f"router listening on http://{args.host}:{port}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            await runner.cleanup()
            await fleet.stop()


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        static = [_engine(s, "mixed") for s in args.engine]
        static += [_engine(s, "prefill") for s in args.prefill_engine]
        static += [_engine(s, "decode") for s in args.decode_engine]
    except argparse.ArgumentTypeError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    if not static and not (args.etcd or args.config):
        print(f"{PROG}: no engines: give --etcd (node records with engine_url) or --engine URL", file=sys.stderr)
        return 2
    if args.disaggregated and args.engine:
        print(f"{PROG}: --disaggregated takes --prefill-engine and --decode-engine, not --engine", file=sys.stderr)
        return 2
    from ..router.app import CHUNK_TOKENS, RouterConfig

    try:
        chunk = args.chunk_size or (tool_config(args, PROG, require_endpoints=False).chunk_size if args.config
                                    else CHUNK_TOKENS)
        config = RouterConfig(policy=args.policy, disaggregated=args.disaggregated, attempts=args.attempts,
                              first_byte_timeout_s=args.first_byte_timeout, request_timeout_s=args.request_timeout,
                              route_timeout_s=args.route_timeout, documents_timeout_s=args.documents_timeout,
                              chunk_tokens=chunk)
    except ValueError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    with _records(args) as records:
        asyncio.run(serve(args, config, tuple(static), records))
    return 0
