"""``lmcache-p2p score --url http://AGENT:PORT --tokens FILE | --text FILE --model DIR``: ask an
agent's ``/v1/score`` where a prompt's cache is, per node (the API itself: ``lmcache_p2p/score.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request

from ..usage import HelpFormatter
from .common import read_tokens


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="lmcache-p2p score", description=__doc__,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--url", required=True, help="an agent's HTTP endpoint, e.g. http://10.0.0.5:9470")
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--tokens", help="file of token ids (JSON list or whitespace-separated)")
    src.add_argument("--text", help="file of text, tokenized with --model's tokenizer")
    parser.add_argument("--model", help="model directory (tokenizer) for --text")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    body = json.dumps({"tokens": read_tokens(args)}).encode()
    request = urllib.request.Request(args.url.rstrip("/") + "/v1/score", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:  # noqa: S310 - an operator-given URL
            answer = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        print(f"lmcache-p2p score: {exc.code}: {exc.read().decode(errors='replace')}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:
        print(f"lmcache-p2p score: {args.url}: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(answer))
        return 0
    print(f"{answer['tokens']} tokens, fingerprint {answer['fingerprint'][:12]} ({answer['model']}); "
          f"best: {answer['best']}")
    for row in answer["nodes"]:
        local = sum(row["local_tokens"].values())
        print(f"  {row['node']:<24} matched {row['matched_tokens']:>7}  local {local:>7}  "
              f"peer {row['peer_tokens']:>7}  est. load {row['estimated_load_ms']:.1f} ms  "
              f"est. TTFT {row['estimated_ttft_ms']:.1f} ms")
    return 0
