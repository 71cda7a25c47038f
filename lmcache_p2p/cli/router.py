"""``lmcache-p2p router``: an OpenAI-compatible front for a fleet of vLLM engines (``router/app.py``).

    lmcache-p2p router --etcd http://etcd:2379 [--cluster C] [--config agent.yaml]   # engines from node records
    lmcache-p2p router --engine http://10.0.0.5:8000 --engine ... [--score-url http://agent:9100/v1/score]
    lmcache-p2p router --prefill-engine URL ... --decode-engine URL ... --disaggregated
    lmcache-p2p router key --config agent.yaml    # print the router key of a node's cluster secret

With etcd, every engine whose agent sets ``engine_url`` (and ``engine_pool``: mixed, prefill or decode)
and proves it (``engine_proof`` in its node record, ``router/proof.py``) is found and scored through its
own agent; engines come and go with their node records. With ``--transfer-ca`` (the transfer CA's
certificate) only proofs signed by the node's own transfer certificate hold: no agent can announce
another node's engine. Else the router key (``--router-key-file`` or LMCACHE_P2P_ROUTER_KEY, hex) is
derived from the cluster secret for this one purpose (the router never holds the secret itself; every
agent can make such proofs for any node). Without either, or for a record whose proof does not hold,
announced engines are ignored (logged, counted in lmcache_p2p_router_engines_refused_total) and never
contacted; static engines (``--engine`` ...) are the operator's and always used. Static engines may be
named ``NODE=URL`` so the score (which names engines by their agent's node id) applies to them. Listens on
``--host``/``--port`` (default 127.0.0.1:8080).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..config import cluster_secret, parse_size
from ..router.proof import load_transfer_ca, parse_router_key, plain_url, router_key
from ..usage import HelpFormatter
from .common import etcd_tool_parser, tool_config

PROG = "lmcache-p2p router"
ROUTER_KEY_ENV = "LMCACHE_P2P_ROUTER_KEY"
API_KEY_ENV = "LMCACHE_P2P_ROUTER_API_KEY"
SCORE_KEY_ENV = "LMCACHE_P2P_SCORE_API_KEY"  # the agents' score_api_key (the same variable sets theirs)


def _engine(spec: str, pool: str) -> tuple[str, str, str | None]:
    node, sep, url = spec.partition("=")
    if not sep:
        node, url = "", spec
    if not plain_url(url):
        raise argparse.ArgumentTypeError(f"not an http(s) engine URL: {spec!r}")
    return url.rstrip("/"), pool, node or None


def parser() -> argparse.ArgumentParser:
    from ..router.engines import FORWARD_AUTHORIZATION
    from ..router.policy import POLICIES

    p = etcd_tool_parser(PROG, __doc__, default_help="none: static engines only")
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
    p.add_argument("--router-key-file", metavar="PATH", help="the router key (hex; `lmcache-p2p router key` "
                   f"prints it), else ${ROUTER_KEY_ENV}; without it engines announced in etcd are ignored")
    p.add_argument("--transfer-ca", metavar="PATH", help="the transfer CA's certificate (PEM; k8s: ca.crt of the "
                   "Secret lmcache-p2p-transfer-tls): an announced engine is used only with a proof signed by its "
                   "node's own transfer certificate, which names the node (agents with transfer.tls_* make them); "
                   "keyed proofs, which any holder of the cluster secret can make, are refused")
    p.add_argument("--forward-authorization", default="all-trusted", choices=FORWARD_AUTHORIZATION,
                   help="which engines get the client's Authorization header: all-trusted (static and proven "
                   "engines; the default), static (--engine ... only), none")
    p.add_argument("--api-key-file", metavar="PATH", help=f"clients must send Authorization: Bearer <this key> "
                   f"(else ${API_KEY_ENV}; none: no check) on every route but /health and /metrics")
    p.add_argument("--score-key-file", metavar="PATH", help=f"the agents' score_api_key, sent to their /v1/score as "
                   f"Authorization: Bearer (else ${SCORE_KEY_ENV}; none: sent without)")
    p.add_argument("--max-body", default="8MiB", help="largest request body (default 8MiB; larger: 413)")
    p.add_argument("--read-timeout", type=float, default=30.0, help="seconds for a request's headers, and for "
                   "its body (default 30; then the connection is closed, a body: 408)")
    p.add_argument("--max-concurrent", type=int, default=512, help="requests in flight; past it: 503 with "
                   "Retry-After (default 512)")
    p.add_argument("--max-memory", default="1GiB", help="what requests in flight may hold: each reserves 10 times "
                   "its body's length before it is read; past it: 503 with Retry-After (default 1GiB; at least 10 "
                   "times --max-body)")
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


def _read_key(path: str | None, env: str) -> str | None:
    """A key from ``path`` (its first line) or the environment variable ``env``; None: neither."""
    if path:
        return Path(path).read_text().strip()
    return os.environ.get(env) or None


async def serve(args: argparse.Namespace, config: Any, static: tuple[tuple[str, str, str | None], ...],
                records: Any, key: bytes | None, cluster: str, cas: tuple[Any, ...] = ()) -> None:
    from aiohttp import web

    from ..router.app import Router, client_session
    from ..router.engines import Fleet, FleetSource
    from ..router.metrics import Metrics

    async with client_session() as session:
        metrics = Metrics()
        source = FleetSource(static=static, records=records, score_url=args.score_url, router_key=key,
                             transfer_ca=cas, cluster=cluster, forward_authorization=args.forward_authorization)
        fleet = Fleet(source, session, interval_s=args.health_interval, timeout_s=args.health_timeout,
                      refused=metrics.engines_refused)
        router = Router(fleet, config, session, metrics)
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


def key_main(argv: list[str]) -> int:
    """``lmcache-p2p router key``: the router key of the cluster secret a node's config holds, as hex."""
    p = argparse.ArgumentParser(prog=f"{PROG} key", description="Print the router key (hex) derived from the "
                                "cluster secret (transfer.secret in --config, or LMCACHE_P2P_SECRET): give it to "
                                "routers (--router-key-file), never the secret itself.", formatter_class=HelpFormatter)
    p.add_argument("--config", help="a node's agent config file")
    args = p.parse_args(argv)
    args.etcd = args.cluster = None
    try:
        secret = cluster_secret(tool_config(args, f"{PROG} key", require_endpoints=False))
    except ValueError as exc:
        print(f"{PROG} key: {exc}", file=sys.stderr)
        return 2
    if secret is None:
        print(f"{PROG} key: no cluster secret (transfer.secret or LMCACHE_P2P_SECRET)", file=sys.stderr)
        return 2
    print(router_key(secret).hex())
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["key"]:
        return key_main(argv[1:])
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
    from ..router.config import CHUNK_TOKENS, RouterConfig

    try:
        node_config = tool_config(args, PROG, require_endpoints=False) if args.config or args.etcd else None
        chunk = args.chunk_size or (node_config.chunk_size if args.config and node_config else CHUNK_TOKENS)
        key_text = _read_key(args.router_key_file, ROUTER_KEY_ENV)
        key = parse_router_key(key_text, args.router_key_file or ROUTER_KEY_ENV) if key_text is not None else None
        cas = tuple(load_transfer_ca(Path(args.transfer_ca).read_bytes(), "--transfer-ca")) if args.transfer_ca else ()
        config = RouterConfig(policy=args.policy, disaggregated=args.disaggregated, attempts=args.attempts,
                              first_byte_timeout_s=args.first_byte_timeout, request_timeout_s=args.request_timeout,
                              route_timeout_s=args.route_timeout, documents_timeout_s=args.documents_timeout,
                              chunk_tokens=chunk, max_body_bytes=parse_size(args.max_body, "--max-body"),
                              read_timeout_s=args.read_timeout, max_concurrent=args.max_concurrent,
                              max_memory_bytes=parse_size(args.max_memory, "--max-memory"),
                              api_key=_read_key(args.api_key_file, API_KEY_ENV),
                              score_key=_read_key(args.score_key_file, SCORE_KEY_ENV))
    except (ValueError, OSError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    cluster = node_config.cluster if node_config is not None else "default"
    if node_config is not None and key is None and not cas:
        logging.getLogger(__name__).warning(
            "no transfer CA (--transfer-ca) and no router key (--router-key-file or $%s): engines announced in "
            "etcd are ignored, only static engines are used; `lmcache-p2p router key --config agent.yaml` prints "
            "the key", ROUTER_KEY_ENV)
    elif cas and key is not None:
        logging.getLogger(__name__).info("--transfer-ca given: the router key is not used (only signed proofs)")
    with _records(args) as records:
        asyncio.run(serve(args, config, tuple(static), records, key, cluster, cas))
    return 0
