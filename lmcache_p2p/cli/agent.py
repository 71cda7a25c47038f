"""``lmcache-p2p agent --config FILE``: a standalone cache agent.

A cache-only node that contributes its memory and disk to the mesh. Prints one JSON line when
ready; stops cleanly on SIGTERM/SIGINT (pending stores finish, CPU chunks are written back to disk,
the lease is revoked).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys

from ..agent import CacheAgent
from ..config import cluster_secret, load_config, require_secret
from ..coordinator.apply import read_at_start
from ..errors import LMCacheP2PError
from ..usage import HelpFormatter
from .common import stop_on_signals

log = logging.getLogger(__name__)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="lmcache-p2p agent", description=__doc__,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--config", help="agent config file (.yaml, .toml, .json; default: $LMCACHE_P2P_CONFIG)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field, e.g. --set transfer.port=7470 (repeatable)")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        overrides = dict(item.split("=", 1) for item in args.set)
        config, _ = read_at_start(load_config(args.config, overrides=overrides))  # + the cluster config in etcd
        require_secret(config)
    except (ValueError, OSError) as exc:
        print(f"lmcache-p2p agent: invalid configuration: {exc}", file=sys.stderr)
        return 2
    stop = stop_on_signals()
    agent = CacheAgent.of(config, secret=cluster_secret(config), role="cache")
    try:
        agent.start()
    except LMCacheP2PError as exc:
        print(f"lmcache-p2p agent: failed to start: {exc}", file=sys.stderr)
        return 1
    try:
        gc.freeze()  # long-lived objects out of the collector: no full-GC stalls on the loop (measured)
        print(json.dumps({"ready": True, "node_id": agent.node_id, "metrics_port": agent.metrics_port,
                          "held": len(agent.tiers.inventory())}), flush=True)
        stop.wait()
    finally:
        agent.stop()
        log.info("agent %s stopped", agent.node_id)
    return 0
