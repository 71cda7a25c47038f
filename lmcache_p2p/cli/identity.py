"""``lmcache-p2p identity MODEL [--revision R]``: a model's identity (``layout.model_id``) from its files.

How it is computed, and why: ``lmcache_p2p/identity.py``.
"""

from __future__ import annotations

import argparse
import sys

from .. import identity
from ..identity import model_identity
from ..usage import HelpFormatter


def main(argv: list[str] | None = None) -> int:
    doc = identity.__doc__ or ""
    p = argparse.ArgumentParser(prog="lmcache-p2p identity", description=doc.splitlines()[0],
                                formatter_class=HelpFormatter,
                                epilog="\n".join(doc.splitlines()[2:]))
    p.add_argument("model", help="a local model directory, or a hub name")
    p.add_argument("--revision", help="the hub revision the engines serve")
    args = p.parse_args(argv)
    try:
        print(model_identity(args.model, args.revision))
    except (OSError, ValueError) as exc:
        print(f"lmcache-p2p identity: {exc}", file=sys.stderr)
        return 2
    return 0
