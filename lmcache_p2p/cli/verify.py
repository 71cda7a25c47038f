"""``lmcache-p2p verify``: is the KV the mesh serves the KV the model computes? (the canary, ``canary.py``)

    lmcache-p2p verify [--etcd ...]                          # report: quarantined owners, canary counts per node
    lmcache-p2p verify --engine http://e:8000 --tokens F     # and check a prompt now: engine e computes it and
                                                             # holds every owner's copy of its chunks against it
    lmcache-p2p verify --release NODE                        # lift NODE's quarantine (after fixing it)

``--engine`` sends the prompt to an engine running the lmcache-p2p connector as a canary request
(``kv_transfer_params: {"lmcache_p2p_canary": true}``): the engine recomputes it, and its worker
compares what it computed with each owner's copy of every full chunk, quarantining an owner whose
copy is not the same KV. The command waits (``--wait``) until the fleet's canary counters have
moved by the comparisons made, then prints them. Exit code: 0 nothing quarantined, 1 some owner
quarantined (or a mismatch found now), 2 an error (etcd unreachable, the engine refused).
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import sys
import time
import urllib.parse
from typing import Any

from ..config import AgentConfig
from ..errors import LMCacheP2PError, MalformedRecord
from ..index.client import EtcdClient
from ..index.quarantine import QuarantineRecord, read_all, release
from ..index.schema import NodeRecord, Schema, decode_node_record
from ..metrics_http import scrape
from .common import etcd_tool_parser, read_tokens, tool_config

POLL_S = 0.2
SETTLE_S = 1.0  # counters unchanged this long after moving: the engine's comparisons are done
OUTCOMES = ("match", "mismatch", "unconfirmed", "unavailable")
METRIC = "lmcache_p2p_canary_checks_total"


async def _state(config: AgentConfig) -> tuple[list[QuarantineRecord], dict[str, NodeRecord]]:
    schema = Schema(config.cluster)
    async with EtcdClient(config.etcd) as client:
        records = await read_all(client, schema)
        kvs, _ = await client.get_prefix(schema.nodes)
    nodes: dict[str, NodeRecord] = {}
    for kv in kvs:
        try:
            record = decode_node_record(kv.value)
        except MalformedRecord:
            continue
        nodes[record.node_id] = record
    return records, nodes


def canary_counts(nodes: dict[str, NodeRecord]) -> dict[str, dict[str, int]]:
    """Each node's ``canary_checks_total`` by outcome, from its metrics (nodes without metrics left out)."""
    out: dict[str, dict[str, int]] = {}
    for node, record in sorted(nodes.items()):
        if not record.metrics_url:
            continue
        try:
            metrics = scrape(record.metrics_url)
        except (OSError, ValueError):
            continue
        out[node] = {o: int(metrics.get(f'{METRIC}{{outcome="{o}"}}', 0)) for o in OUTCOMES}
    return out


def _total(counts: dict[str, dict[str, int]]) -> dict[str, int]:
    return {o: sum(c[o] for c in counts.values()) for o in OUTCOMES}


def _canary_request(engine: str, tokens: list[int], timeout: float) -> None:
    """One completion of ``tokens`` at ``engine`` as a canary request (vLLM's OpenAI API)."""
    parts = urllib.parse.urlsplit(engine)
    host = parts.hostname
    if parts.scheme not in ("http", "https") or not host:
        raise ValueError(f"--engine must be an http(s) URL, got {engine!r}")
    conn_cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection

    def call(method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        conn = conn_cls(host, parts.port, timeout=timeout)
        try:
            conn.request(method, path, json.dumps(body) if body is not None else None,
                         {"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
            if resp.status != 200:
                raise ValueError(f"{engine}{path}: HTTP {resp.status}: {data[:300]!r}")
            return json.loads(data)
        finally:
            conn.close()

    model = call("GET", "/v1/models")["data"][0]["id"]
    call("POST", "/v1/completions", {"model": model, "prompt": tokens, "max_tokens": 1, "temperature": 0.0,
                                     "kv_transfer_params": {"lmcache_p2p_canary": True}})


def _print(records: list[QuarantineRecord], counts: dict[str, dict[str, int]], checked: dict[str, int] | None) -> None:
    if checked is not None:
        print(f"checked now: {checked['match']} copies match, {checked['mismatch']} differ (owner quarantined), "
              f"{checked['unconfirmed']} differ unconfirmed, {checked['unavailable']} unavailable")
        if not any(checked.values()):
            print("  nothing compared: no other node holds the prompt's full chunks, or the engine's own prefix "
                  "cache held it (a canary is computed only from scratch), or the engine runs without the connector")
    print(f"{'NODE':<28} {'MATCH':>7} {'MISMATCH':>9} {'UNCONFIRMED':>12} {'UNAVAIL':>8}")
    for node, c in counts.items():
        print(f"{node:<28} {c['match']:>7} {c['mismatch']:>9} {c['unconfirmed']:>12} {c['unavailable']:>8}")
    if not records:
        print("quarantined: none")
    for r in records:
        print(f"QUARANTINED {r.node}: chunk {r.key[:16]} differs by {r.distance:.3g} from what {r.by} computed "
              f"({time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(r.at))} UTC); lift with --release {r.node}")


def main(argv: list[str] | None = None) -> int:
    parser = etcd_tool_parser("lmcache-p2p verify", __doc__.split("\n\n")[0])
    parser.add_argument("--engine", help="an engine's OpenAI URL: check a prompt there now (needs --tokens/--text)")
    parser.add_argument("--tokens", help="prompt token ids (a JSON list or whitespace-separated)")
    parser.add_argument("--text", help="prompt text (with --model, whose tokenizer is used)")
    parser.add_argument("--model", help="tokenizer for --text")
    parser.add_argument("--wait", type=float, default=30.0, help="seconds to wait for the comparisons (default 30)")
    parser.add_argument("--release", metavar="NODE", help="lift NODE's quarantine")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    config = tool_config(args, parser.prog)
    try:
        if args.release:
            lifted = asyncio.run(_release(config, args.release))
            print(f"{args.release}: " + ("quarantine lifted" if lifted else "was not quarantined"))
            return 0
        records, nodes = asyncio.run(_state(config))
        counts, checked = canary_counts(nodes), None
        if args.engine:
            if not (args.tokens or args.text):
                parser.error("--engine needs a prompt: --tokens or --text")
            records, counts, checked = _check_now(config, args, counts)
    except (LMCacheP2PError, OSError, ValueError) as exc:
        print(f"{parser.prog}: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"quarantined": [_as_dict(r) for r in records], "canary": counts, "checked": checked}))
    else:
        _print(records, counts, checked)
    return 1 if records or (checked is not None and checked["mismatch"]) else 0


def _check_now(config: AgentConfig, args: argparse.Namespace, counts: dict[str, dict[str, int]]
               ) -> tuple[list[QuarantineRecord], dict[str, dict[str, int]], dict[str, int]]:
    """Send the canary request, then wait (``--wait``) until the fleet's canary counters moved and
    settled: the comparisons run after the answer, off the engine's forward pass."""
    before = _total(counts)
    _canary_request(args.engine, read_tokens(args), max(args.wait, 1.0))
    deadline, last, settled_at = time.monotonic() + args.wait, -1, time.monotonic()
    while True:
        records, nodes = asyncio.run(_state(config))
        counts = canary_counts(nodes)
        now = _total(counts)
        checked = {o: now[o] - before[o] for o in OUTCOMES}
        done = sum(checked.values())
        if done != last:
            last, settled_at = done, time.monotonic()
        if (done > 0 and time.monotonic() - settled_at >= SETTLE_S) or time.monotonic() > deadline:
            return records, counts, checked
        time.sleep(POLL_S)


def _as_dict(record: QuarantineRecord) -> dict[str, Any]:
    return {"node": record.node, "by": record.by, "key": record.key, "distance": record.distance,
            "reason": record.reason, "at": record.at}


async def _release(config: AgentConfig, node: str) -> bool:
    async with EtcdClient(config.etcd) as client:
        return await release(client, Schema(config.cluster), node)
