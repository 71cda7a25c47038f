"""``lmcache-p2p etcd [--members N] [--unsafe-no-fsync]``: a private etcd on loopback, until interrupted.

Prints the client endpoints on one line. The launcher itself: ``lmcache_p2p/index/etcd_server.py``.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time

from ..index.etcd_server import EtcdCluster
from ..usage import HelpFormatter


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="lmcache-p2p etcd", description=(__doc__ or "").split("\n")[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--members", type=int, default=1, help="cluster size (default 1)")
    parser.add_argument("--unsafe-no-fsync", action="store_true", help="faster, loses data on power loss")
    args = parser.parse_args(argv)
    cluster = EtcdCluster(args.members, unsafe_no_fsync=args.unsafe_no_fsync).start()
    try:
        print(",".join(cluster.endpoints), flush=True)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        while all(m.alive() for m in cluster.members):
            time.sleep(0.5)
        print("an etcd member exited", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        cluster.stop()
