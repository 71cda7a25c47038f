"""``lmcache-p2p lookup``: which chunks of a prompt are held where.

    lmcache-p2p lookup --etcd URL --tokens prompt.json            # JSON list or whitespace-separated ids
    lmcache-p2p lookup --etcd URL --text doc.txt --model /models/llama

The first tool to reach for when the hit rate is low. Keys depend on the layout fingerprint; by
default every fingerprint served in the cluster is tried (``--fingerprint PREFIX`` picks one),
so a prompt held under another fingerprint (another dtype, block size, TP rank, tenant salt)
shows up as such. Exit code 0 when at least one chunk is held somewhere, 1 when none is.

``--explain`` says, for every chunk under each chosen fingerprint, why it is or is not available
(held, owner-down, other-identity naming the differing field, invalidated, evicted, no-owner; see
``explain.py``). Evictions are asked of the agents over the authenticated transfer connection:
that needs the cluster secret (``LMCACHE_P2P_SECRET`` or ``--config``).
"""

from __future__ import annotations

import argparse
import json
import sys

from ..aio import LoopThread
from ..config import AgentConfig
from ..errors import LMCacheP2PError
from ..explain import explain, recent_evictions
from ..ids import NodeId
from ..index.client import EtcdClient
from ..index.reader import IndexReader
from ..index.records import decode_invalidation
from ..index.schema import Schema
from ..keys import FingerprintDigest, chunk_keys, chunk_spans
from ..usage import HelpFormatter
from .common import add_etcd_arguments, read_tokens, tool_config


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="lmcache-p2p lookup", description=__doc__,
                                     formatter_class=HelpFormatter)
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--tokens", help="file of token ids")
    src.add_argument("--text", help="file of text, tokenized with --model's tokenizer")
    parser.add_argument("--model", help="model directory (tokenizer) for --text")
    add_etcd_arguments(parser)
    parser.add_argument("--fingerprint", help="hex prefix of the fingerprint to look under (default: all)")
    parser.add_argument("--explain", action="store_true", help="why each chunk is or is not available")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    config = tool_config(args, "lmcache-p2p lookup")
    tokens = read_tokens(args)
    spans = chunk_spans(len(tokens), config.chunk_size)
    report: dict[str, object] = {"tokens": len(tokens), "chunk_size": config.chunk_size, "fingerprints": {}}
    held_any = False
    with LoopThread("lmcache-p2p-lookup") as loop:
        try:
            probe = IndexReader.open(loop, config, FingerprintDigest(b"\0" * 16))
        except LMCacheP2PError as exc:
            print(f"lmcache-p2p lookup: cannot read etcd: {exc}", file=sys.stderr)
            return 2
        if not probe.synced:
            probe.close()
            print(f"lmcache-p2p lookup: cannot read etcd at {','.join(config.etcd.endpoints)} "
                  f"within {config.etcd.start_wait_s:.1f}s", file=sys.stderr)
            return 2
        nodes = probe.nodes()
        probe.close()
        served = sorted({fp for n in nodes.values() for fp in n.fingerprints})
        chosen = [fp for fp in served if fp.startswith(args.fingerprint or "")]
        owners_under: dict[str, list[dict[NodeId, int]]] = {}
        for fp_hex in served if args.explain else chosen:
            fp = FingerprintDigest(bytes.fromhex(fp_hex))
            reader = IndexReader.open(loop, config, fp)
            try:
                owners_under[fp_hex] = reader.owners(chunk_keys(fp, tokens, config.chunk_size))
            finally:
                reader.close()
        invalidations = loop.run(_standing_invalidations(config), config.etcd.timeout_s * 2) if args.explain else []
        for fp_hex in chosen:
            fp = FingerprintDigest(bytes.fromhex(fp_hex))
            keys = chunk_keys(fp, tokens, config.chunk_size)
            owners = owners_under[fp_hex]
            model = next((n.served[fp_hex].model for n in nodes.values()
                          if fp_hex in n.served and n.served[fp_hex].model), "?")
            rows = [{"chunk": i, "tokens": f"{s}-{e}", "key": k.hex()[:16], "owners": sorted(o)}
                    for i, (k, (s, e), o) in enumerate(zip(keys, spans, owners, strict=True))]
            prefix = next((i for i, o in enumerate(owners) if not o), len(owners))
            held_any = held_any or any(owners)
            report["fingerprints"][fp_hex] = {  # type: ignore[index]
                "model": model, "leading_chunks_held": prefix,
                "hit_tokens": spans[prefix - 1][1] if prefix else 0, "chunks": rows}
            if args.explain:
                evicted = loop.run(recent_evictions(config, fp, nodes, keys), 30.0)
                verdicts = explain(config, fp_hex, tokens, nodes, owners_under, invalidations, evicted)
                for row, v in zip(rows, verdicts, strict=True):
                    row.update(reason=v.reason, usable=v.usable, holders=v.holders, detail=v.detail)
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{len(tokens)} tokens, {len(spans)} chunks of {config.chunk_size}; "
              f"{len(served)} fingerprint(s) served in cluster {config.cluster!r}")
        for fp_hex, info in report["fingerprints"].items():  # type: ignore[attr-defined]
            print(f"\nfingerprint {fp_hex[:12]} ({info['model']}): leading hit {info['hit_tokens']} tokens")
            for row in info["chunks"]:
                where = ", ".join(row["owners"]) or "-"
                if "reason" in row:
                    where = f"{row['reason']:<15} " + (", ".join(f"{n} ({t})" for n, t in row["holders"].items())
                                                       or json.dumps(row["detail"]))
                print(f"  chunk {row['chunk']:>4}  tokens {row['tokens']:<12} {row['key']}  {where}")
    return 0 if held_any else 1


async def _standing_invalidations(config: AgentConfig) -> list[tuple[str, str, str]]:
    """(id, kind, value) of every standing invalidation record."""
    schema = Schema(config.cluster)
    client = EtcdClient(config.etcd)
    await client.connect()
    try:
        kvs, _ = await client.get_prefix(schema.invalidations)
    finally:
        await client.close()
    out = []
    for kv in kvs:
        try:
            inv = decode_invalidation(kv.key, kv.value, kv.mod_revision, prefix_len=len(schema.invalidations))
        except (ValueError, LMCacheP2PError):
            continue  # malformed: agents skip it too
        out.append((inv.id, inv.kind, inv.value))
    return out
