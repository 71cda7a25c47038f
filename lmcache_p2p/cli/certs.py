"""``lmcache-p2p certs DIR NAME[=SAN,...] ...``: a cluster CA and TLS certificates (``lmcache_p2p/certs.py``)."""

from __future__ import annotations

import argparse
import sys

from .. import certs
from ..certs import make_certs
from ..usage import HelpFormatter


def main(argv: list[str] | None = None) -> int:
    doc = certs.__doc__ or ""
    p = argparse.ArgumentParser(prog="lmcache-p2p certs", description=doc.splitlines()[0],
                                formatter_class=HelpFormatter,
                                epilog="\n".join(doc.splitlines()[2:]))
    p.add_argument("directory")
    p.add_argument("names", nargs="+", metavar="NAME[=SAN,...]")
    p.add_argument("--days", type=int, default=825)
    args = p.parse_args(argv)
    try:
        made = make_certs(args.directory, args.names, args.days)
    except (RuntimeError, ValueError, OSError) as exc:
        print(f"lmcache-p2p certs: {exc}", file=sys.stderr)
        return 2
    print(f"{args.directory}: ca.crt " + " ".join(f"{n}.crt" for n in made))
    return 0
