"""``python -m lmcache_p2p.testing.preloaded_agent --config FILE --preload-seed S --preload-tokens N``.

The cache-only agent of ``lmcache-p2p agent`` (the same config, the cluster config read at start,
the same ready line and signals), which stores the chunks of synthetic prompts ``S`` (repeatable)
of ``N`` tokens before it says it is ready. Their payloads are deterministic
(:mod:`lmcache_p2p.testing.synthetic`), so any other process can check that what it pulls is
byte-exact. The ready line adds ``stored``: how many chunks were new.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import signal
import sys
import threading

from ..agent import CacheAgent
from ..config import cluster_secret, load_config
from ..coordinator.apply import read_at_start
from .synthetic import preload


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m lmcache_p2p.testing.preloaded_agent", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="agent config file (.yaml, .toml, .json)")
    parser.add_argument("--preload-seed", type=int, action="append", default=[],
                        help="store the chunks of synthetic prompt SEED (repeatable)")
    parser.add_argument("--preload-tokens", type=int, default=0)
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config, _ = read_at_start(load_config(args.config))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    agent = CacheAgent.of(config, secret=cluster_secret(config), role="cache").start()
    try:
        stored = sum(preload(agent, seed, args.preload_tokens) for seed in args.preload_seed)
        gc.freeze()
        print(json.dumps({"ready": True, "node_id": agent.node_id, "metrics_port": agent.metrics_port,
                          "stored": stored, "held": len(agent.tiers.inventory())}), flush=True)
        stop.wait()
    finally:
        agent.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
