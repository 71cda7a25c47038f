"""``lmcache-p2p invalidate``: drop chunks across the whole mesh (entries and bytes).

    lmcache-p2p invalidate --etcd URL [--cluster C] --fingerprint HEXPREFIX   # a model upgrade
    lmcache-p2p invalidate --etcd URL [--cluster C] --tenant SALT             # one tenant's chunks
    lmcache-p2p invalidate --etcd URL [--cluster C] --tenant-digest HEX       # the same, by the salt's digest
    lmcache-p2p invalidate --etcd URL [--cluster C] --node NODE_ID            # what one node computed or holds

Writes ``invalidate/<id>``, a standing barrier at the revision of the write: every agent drops
what matches and was computed before it, now and whenever it later pulls, stores or recovers such
a chunk (see ``lmcache_p2p.invalidation``). A tenant is written as the one-way digest of its salt
(the one node records carry under ``tenants``), never the salt. It stands until deleted (``etcdctl
del``), or for ``--ttl`` seconds. With ``--wait`` it then watches the block index until every
entry that matched when it was issued is gone (deleted, or re-stored after the invalidation) and
reports how many were removed. ``--node X`` covers every chunk X computed (the origin in the
chunk's header), wherever it is held, and everything X holds; the entries counted and waited for
are X's own (copies elsewhere go as their holders apply it). The objects in the object store that
match are counted from their etcd metas (each carries its fingerprint, uploader, origin and tenant: a
fingerprint no running node serves too); the object tier's next cleanup, on any node that runs it,
deletes them. ``--json``: one JSON object on stdout once done (``id``, ``kind``, ``value``, ``cluster``,
``revision``, ``matched_entries``, ``matched_objects``, and with ``--wait`` ``wait``: ``done``, ``removed``,
``remaining``, ``seconds``); errors stay on stderr. Exit code 0 when issued (and, with ``--wait``, done),
1 when ``--wait`` timed out, 2 on bad arguments or when etcd cannot be reached.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

from ..config import AgentConfig
from ..errors import LMCacheP2PError, MalformedRecord
from ..ids import OBJECTS, origin_of
from ..index.client import EtcdClient, KeyValue
from ..index.records import ObjectMeta, decode_object_meta
from ..index.schema import Schema, decode_node_record, tenant_digest
from ..invalidation import Invalidation, issue
from .common import etcd_tool_parser, tool_config

POLL_S = 0.2


async def _matching(client: EtcdClient, schema: Schema, kind: str, value: str) -> list[KeyValue]:
    """Block entries an invalidation of ``kind``/``value`` is meant to remove, read now (the object store's
    own, ``@objects``, excepted: they go with the objects at the object tier's next cleanup, and no node loads
    a covered object meanwhile)."""
    return [kv for kv in await _matching_all(client, schema, kind, value) if not kv.key.endswith(_OBJECTS_SUFFIX)]


_OBJECTS_SUFFIX = b"/" + OBJECTS.encode()


async def _matching_all(client: EtcdClient, schema: Schema, kind: str, value: str) -> list[KeyValue]:
    if kind == "fingerprint":
        return (await client.get_prefix(schema.blocks + value.lower().encode()))[0]
    if kind == "node":
        suffix = b"/" + value.encode()
        return [kv for kv in (await client.get_prefix(schema.blocks))[0] if kv.key.endswith(suffix)]
    nodes, rev = await client.get_prefix(schema.nodes)
    fps: set[str] = set()
    for kv in nodes:
        try:
            record = decode_node_record(kv.value)
        except MalformedRecord:
            continue  # agents skip it too
        fps.update(fp for fp, served in record.served.items() if served.tenant == value)
    out: list[KeyValue] = []
    for fp in sorted(fps):
        out += (await client.get_prefix(schema.blocks + fp.encode() + b"/", rev))[0]
    return out


async def _matching_objects(client: EtcdClient, schema: Schema, kind: str, value: str) -> list[ObjectMeta]:
    """The objects an invalidation of ``kind``/``value`` covers, by their metas (as uploaded: before it)."""
    out = []
    for kv in (await client.get_prefix(schema.objects))[0]:
        try:
            meta = decode_object_meta(kv.key, kv.value, prefix_len=len(schema.objects))
        except MalformedRecord:
            continue  # the cleanup skips it too
        if (kind == "fingerprint" and meta.fp.hex().startswith(value)) or (kind == "tenant" and meta.tenant == value) \
                or (kind == "node" and (meta.node == value or meta.origin == origin_of(value))):
            out.append(meta)
    return out


async def _run(config: AgentConfig, kind: str, value: str, wait_s: float | None, ttl_s: int | None,
               as_json: bool) -> int:
    """Issue the invalidation (and wait); its result as text lines as they happen, or (``as_json``) one
    JSON object at the end. The exit code."""
    schema = Schema(config.cluster)
    async with EtcdClient(config.etcd) as client:
        before = await _matching(client, schema, kind, value)
        objects = await _matching_objects(client, schema, kind, value)
        inv, revision = await issue(client, schema, kind, value, ttl_s=ttl_s)
        result: dict[str, Any] = {"id": inv.id, "kind": inv.kind, "value": inv.value, "cluster": config.cluster,
                                  "revision": revision, "matched_entries": len(before),
                                  "matched_objects": len(objects)}
        if not as_json:
            print(f"issued invalidate/{inv.id}: {inv.kind}={inv.value} in cluster {config.cluster!r} "
                  f"(revision {revision}); {len(before)} block entries match, and {len(objects)} objects in the "
                  f"object store", flush=True)
        code = 0
        if wait_s is not None:
            result["wait"] = await _wait(client, schema, inv, {kv.key for kv in before}, revision, wait_s)
            code = 0 if result["wait"]["done"] else 1
            if not as_json:
                print(_wait_text(result["wait"], wait_s), flush=True)
        if as_json:
            print(json.dumps(result), flush=True)
        return code


async def _wait(client: EtcdClient, schema: Schema, inv: Invalidation, keys: set[bytes], revision: int,
                wait_s: float) -> dict[str, Any]:
    """Until the entries ``keys`` are gone (or ``wait_s``): ``done``, ``removed``, ``remaining``, ``seconds``."""
    t0 = time.monotonic()
    left = keys
    while True:
        now = await _matching(client, schema, inv.kind, inv.value)
        left = {kv.key for kv in now if kv.key in keys and kv.mod_revision <= revision}
        if not left or time.monotonic() - t0 >= wait_s:
            break
        await asyncio.sleep(POLL_S)
    return {"done": not left, "removed": len(keys) - len(left), "remaining": len(left),
            "seconds": round(time.monotonic() - t0, 1)}


def _wait_text(wait: dict[str, Any], wait_s: float) -> str:
    if wait["done"]:
        return f"done in {wait['seconds']:.1f}s: removed {wait['removed']} block entries"
    return (f"timeout after {wait_s:.0f}s: removed {wait['removed']} block entries, {wait['remaining']} remain "
            f"(their nodes may be down or hung)")


def main(argv: list[str]) -> int:
    parser = etcd_tool_parser("lmcache-p2p invalidate", __doc__)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--fingerprint", metavar="HEXPREFIX", help="fingerprint digest (prefix of >= 8 hex chars)")
    what.add_argument("--tenant", metavar="SALT", help="tenant salt (only its digest is written)")
    what.add_argument("--tenant-digest", metavar="HEX", help="the tenant salt's digest, as node records carry it")
    what.add_argument("--node", metavar="NODE_ID", help="node id")
    parser.add_argument("--ttl", type=int, metavar="SECONDS",
                        help="let the invalidation lapse after this long (default: it stands until deleted; "
                             "a node restarted from disk after it lapsed would serve what it covered)")
    parser.add_argument("--wait", type=float, nargs="?", const=60.0, metavar="SECONDS",
                        help="wait (default 60 s) until the matching block entries are gone")
    parser.add_argument("--json", action="store_true", help="the result as one JSON object on stdout")
    args = parser.parse_args(argv)
    tenant = tenant_digest(args.tenant) if args.tenant is not None else args.tenant_digest
    kind, value = next((k, v) for k, v in (("fingerprint", args.fingerprint), ("tenant", tenant),
                                           ("node", args.node)) if v is not None)
    try:
        Invalidation("check", kind, value.lower() if kind == "fingerprint" else value, 0.0)
    except ValueError as exc:
        print(f"lmcache-p2p invalidate: {exc}", file=sys.stderr)
        return 2
    config = tool_config(args, "lmcache-p2p invalidate")
    try:
        return asyncio.run(_run(config, kind, value, args.wait, args.ttl, args.json))
    except LMCacheP2PError as exc:
        print(f"lmcache-p2p invalidate: cannot reach etcd: {exc}", file=sys.stderr)
        return 2
