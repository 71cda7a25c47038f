"""``lmcache-p2p events [--bind tcp://*:5557] [--fingerprint HEX]``: the mesh index as vLLM KV events.

Follows the index of one fingerprint (the one served, when only one is) and publishes every change
as a vLLM ``KVEventBatch`` on a ZMQ PUB socket, for KV-aware routers (``lmcache_p2p/events.py``).
"""

from __future__ import annotations

import argparse
import logging
import sys

from ..aio import LoopThread
from ..config import AgentConfig
from ..errors import LMCacheP2PError
from ..events import EventPublisher
from ..index.reader import IndexReader
from ..keys import FingerprintDigest
from ..usage import HelpFormatter
from .common import add_etcd_arguments, stop_on_signals, tool_config


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="lmcache-p2p events", description=__doc__,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--bind", default="tcp://*:5557", help="ZMQ PUB endpoint")
    add_etcd_arguments(parser)
    parser.add_argument("--fingerprint", help="hex fingerprint to follow (default: the one fingerprint served)")
    args = parser.parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = tool_config(args, "lmcache-p2p events")
    try:
        fp = FingerprintDigest(bytes.fromhex(args.fingerprint)) if args.fingerprint else _only_fingerprint(config)
    except (ValueError, LMCacheP2PError) as exc:
        print(f"lmcache-p2p events: {exc}", file=sys.stderr)
        return 2
    stop = stop_on_signals()
    publisher = EventPublisher(config, fp, args.bind).start()
    print(f"publishing KV events of {fp.hex()} on {publisher.endpoint}", flush=True)
    try:
        stop.wait()
    finally:
        publisher.stop()
    return 0


def _only_fingerprint(config: AgentConfig) -> FingerprintDigest:
    with LoopThread("lmcache-p2p-events-probe") as loop:
        probe = IndexReader.open(loop, config, FingerprintDigest(b"\0" * 16))
        try:
            served = sorted({fp for record in probe.nodes().values() for fp in record.fingerprints})
        finally:
            probe.close()
    if len(served) != 1:
        raise ValueError(f"{len(served)} fingerprints served ({', '.join(f[:12] for f in served) or 'none'}): "
                         "pick one with --fingerprint")
    return FingerprintDigest(bytes.fromhex(served[0]))
