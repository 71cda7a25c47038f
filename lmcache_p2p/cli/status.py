"""``lmcache-p2p status``: one table of the mesh, from etcd and each agent's metrics endpoint.

Flags what operators trip over; the exit code is 0 when healthy, 1 when anything is flagged,
2 when etcd cannot be reached at all (usable by scripts and probes):

    fingerprint-mismatch   nodes serving the same model under different fingerprints (keys never match)
    incomplete-engine      the ranks of a tensor-parallel engine up do not hold every KV head (its
                           chunks are no hit anywhere until the missing rank is back)
    unresponsive           lease alive, but the agent's metrics endpoint does not answer (hung?)
    version-skew           nodes on different software or wire-protocol versions
    quarantined            an owner the canary found serving KV that is not this model's (``verify``)
    etcd-member-down       an etcd endpoint in the list does not answer

Notes (not problems: the exit code ignores them) say where a node does not run the stored cluster
config's value, and why; the CONFIG column marks such a node with ``*``:

    config-restart         the value applies at the node's next start (chunk size, capacities, lease TTL)
    config-own             the node sets the field itself (its file, environment or overrides win)
"""

from __future__ import annotations

import asyncio
import dataclasses
import http.client
import json
import sys
import time
from collections import Counter, defaultdict
from typing import Any

from ..config import AgentConfig, EtcdConfig
from ..errors import LMCacheP2PError, MalformedRecord
from ..ids import engine_of
from ..index.client import EtcdClient, translate
from ..index.quarantine import read_all as read_quarantine
from ..index.records import decode_object_meta
from ..index.schema import NodeRecord, Schema, covers, decode_node_key, decode_node_record
from ..metrics import RECENT_S
from ..metrics_http import SCRAPE_TIMEOUT_S, scrape
from .common import etcd_tool_parser, tool_config


@dataclasses.dataclass(slots=True)
class NodeStatus:
    node_id: str
    address: str
    transports: list[str]
    fingerprints: list[str]
    lease_ttl_left_s: float | None
    chunks_registered: int
    software_version: str
    wire_version: int
    responsive: bool | None = None
    tier_used_bytes: dict[str, float] = dataclasses.field(default_factory=dict)
    tier_capacity_bytes: dict[str, float] = dataclasses.field(default_factory=dict)
    hit_rate: float | None = None  # over the last metrics.RECENT_S seconds
    hit_rate_lifetime: float | None = None  # since the node started
    misses: dict[str, float] = dataclasses.field(default_factory=dict)  # miss tokens by reason, since start
    degraded: bool | None = None  # outside the mesh by its own account (no live lease / mirror not synced)
    index_rejected: float = 0.0  # malformed etcd records it skipped
    engine: str = ""  # the engine a TP rank's agent belongs to (node id less "-r<rank>"); itself otherwise
    role: str = "engine"  # "cache": a cache-only agent
    free_bytes: dict[str, int] = dataclasses.field(default_factory=dict)  # per tier, as last published
    handoff: dict[str, float] = dataclasses.field(default_factory=dict)  # hand-off events (accepted, received, ...)
    config_revision: int = 0  # the cluster config revision the node runs
    config_deviations: dict[str, str] = dataclasses.field(default_factory=dict)  # field -> "restart" | "node"
    heads: str = ""  # KV heads held, "first-end/total" ("" when all)
    layouts: list[str] = dataclasses.field(default_factory=list)  # kv_layout per fingerprint (vllm-cpu+<probe digest>)
    objects_pending: float | None = None  # object tier: uploads queued or in flight (None: no object tier)
    objects_errors: float = 0.0  # object store calls that failed (put, get, delete)


def _apply_metrics(node: NodeStatus, url: str | None) -> None:
    if not url:
        return
    try:
        m = scrape(url)
    except (OSError, http.client.HTTPException, ValueError):  # refused, timed out, garbled: not answering
        node.responsive = False
        return
    node.responsive = True
    for name, value in m.items():
        for prefix, target in (("lmcache_p2p_tier_used_bytes{", node.tier_used_bytes),
                               ("lmcache_p2p_tier_capacity_bytes{", node.tier_capacity_bytes)):
            if name.startswith(prefix):
                target[name.split('"')[1]] = value
    hits = sum(v for k, v in m.items() if k.startswith("lmcache_p2p_hit_tokens_total"))
    misses = sum(v for k, v in m.items() if k.startswith("lmcache_p2p_miss_tokens_total"))
    node.hit_rate_lifetime = hits / (hits + misses) if hits + misses else None
    recent = m.get("lmcache_p2p_hit_ratio_recent")  # the last RECENT_S (-1: nothing looked up then)
    node.hit_rate = recent if recent is not None and recent >= 0 else None
    node.misses = {k.split('"')[1]: v for k, v in m.items()
                   if k.startswith("lmcache_p2p_miss_tokens_total{") and v > 0}
    if "lmcache_p2p_degraded" in m:
        node.degraded = m["lmcache_p2p_degraded"] > 0
    node.index_rejected = sum(v for k, v in m.items() if k.startswith("lmcache_p2p_index_rejected_total"))
    for name, value in m.items():
        if name.startswith("lmcache_p2p_handoff_chunks_total{"):
            node.handoff[name.split('"')[1]] = value
    if m.get("lmcache_p2p_object_tier", 0) > 0:
        node.objects_pending = m["lmcache_p2p_object_uploads_pending"]
        node.objects_errors = sum(v for k, v in m.items()
                                  if k.startswith("lmcache_p2p_object_ops_total{") and 'result="error"' in k)


async def collect(config: AgentConfig) -> dict[str, Any]:
    schema = Schema(config.cluster)
    client = EtcdClient(config.etcd)
    await client.connect()
    try:
        kvs, revision = await client.get_prefix(schema.nodes)
        blocks, _ = await client.get_prefix(schema.blocks, revision)
        per_node: Counter[str] = Counter(kv.key.rsplit(b"/", 1)[1].decode() for kv in blocks)
        nodes: list[tuple[NodeStatus, NodeRecord]] = []
        rejected = 0
        for kv in kvs:
            try:
                record = decode_node_record(kv.value, decode_node_key(len(schema.nodes), kv.key))
            except MalformedRecord:
                rejected += 1
                continue
            nodes.append((NodeStatus(
                node_id=record.node_id, address=next(iter(record.addresses.values()), ""),
                transports=list(record.transports), fingerprints=[f[:12] for f in record.fingerprints],
                lease_ttl_left_s=await _ttl_left(client, kv.lease),
                chunks_registered=per_node[record.node_id], software_version=record.software_version,
                wire_version=record.wire_version, engine=engine_of(record.node_id), role=record.role,
                free_bytes=dict(record.free), config_revision=record.config_revision,
                config_deviations=dict(record.config_deviations),
                heads=",".join(f"{h[0]}-{h[1]}/{h[2]}" for s in record.served.values()
                               if (h := s.partial_heads) is not None),
                layouts=[str(s.layout.get("kv_layout", "?")) for s in record.served.values()]), record))
        nodes.sort(key=lambda n: (n[0].engine, n[0].node_id))  # the ranks of one engine together
        quarantined = await read_quarantine(client, schema)
        objects = await _objects(client, schema)
    finally:
        await client.close()
    members = await asyncio.gather(*(_member_up(config.etcd, ep) for ep in config.etcd.endpoints))
    await asyncio.gather(*(asyncio.to_thread(_apply_metrics, n, r.metrics_url) for n, r in nodes))
    report = _report(config, [n for n, _ in nodes], [r for _, r in nodes],
                     dict(zip(config.etcd.endpoints, members, strict=True)), revision)
    report["objects"] = objects
    for q in quarantined:
        report["flags"].append(f"quarantined: {q.node}: its chunk {q.key[:16]} differs from what {q.by} computed "
                               f"(distance {q.distance:.3g}); no planner uses it (lmcache-p2p verify --release "
                               f"{q.node} lifts it)")
        report["healthy"] = False
    if rejected:
        report["flags"].append(f"malformed-records: {rejected} node records under {schema.nodes.decode()} do "
                               "not decode (agents skip and count them)")
        report["healthy"] = False
    return report


async def _objects(client: EtcdClient, schema: Schema) -> dict[str, int]:
    """What the object store holds by the uploaders' records (``objects/``): objects, bytes, malformed records."""
    kvs, _ = await client.get_prefix(schema.objects)
    count = size = malformed = 0
    for kv in kvs:
        try:
            size += decode_object_meta(kv.key, kv.value, prefix_len=len(schema.objects)).size
            count += 1
        except MalformedRecord:
            malformed += 1
    return {"objects": count, "bytes": size, "malformed": malformed}


async def _ttl_left(client: EtcdClient, lease: int) -> float | None:
    if not lease:
        return None
    with translate("Lease.TimeToLive"):
        resp = await client.lease.time_to_live(lease, timeout=client.timeout)
    return float(resp.TTL) if resp.TTL >= 0 else None  # -1: expired between the two reads


async def _member_up(etcd: EtcdConfig, endpoint: str) -> bool:
    client = EtcdClient(dataclasses.replace(etcd, endpoints=(endpoint,), timeout_s=2.0))
    try:
        await client.connect()
        await client.status()
        return True
    except LMCacheP2PError:
        return False
    finally:
        await client.close()


def _report(config: AgentConfig, nodes: list[NodeStatus], records: list[NodeRecord], members: dict[str, bool],
            revision: int) -> dict[str, Any]:
    flags: list[str] = []
    by_model: dict[tuple[str, str], set[str]] = defaultdict(set)  # tenants' salts differ on purpose
    for record in records:
        for fp, served in record.served.items():
            if served.model:
                by_model[(served.model, served.tenant)].add(fp)
    for (model, tenant), fps in sorted(by_model.items()):
        if len(fps) > 1:
            flags.append(f"fingerprint-mismatch: model {model!r}{f' (tenant {tenant!r})' if tenant else ''} is "
                         f"served under {len(fps)} fingerprints ({', '.join(sorted(f[:12] for f in fps))}): "
                         "their chunks never match")
    engines: dict[tuple[str, str], list[tuple[int, int, int]]] = defaultdict(list)  # (engine, fingerprint) -> heads
    for node, record in zip(nodes, records, strict=True):
        for fp, served in record.served.items():
            if served.heads is not None:
                engines[(node.engine, fp)].append(served.heads)
    for (engine, fp), ranges in sorted(engines.items()):
        total = ranges[0][2]
        if not covers([(h[0], h[1]) for h in ranges], (0, total)):
            have = ", ".join(f"{h[0]}-{h[1]}" for h in sorted(ranges))
            flags.append(f"incomplete-engine: {engine} ({fp[:12]}) holds KV heads {have} of {total}: a rank is "
                         "down or missing, and its chunks are no hit until it is back")
    for node in nodes:
        if node.degraded:
            flags.append(f"degraded: {node.node_id} reports it is outside the mesh (lease not confirmed or index "
                         "not synced): it serves local hits only")
        if node.responsive is False:
            flags.append(f"unresponsive: {node.node_id} holds a live lease but its metrics endpoint does not "
                         f"answer within {SCRAPE_TIMEOUT_S:.0f}s (hung or partitioned?)")
    versions = {(n.software_version, n.wire_version) for n in nodes}
    if len(versions) > 1:
        flags.append("version-skew: " + ", ".join(f"{n.node_id}={n.software_version}/wire{n.wire_version}"
                                                  for n in nodes))
    for endpoint, up in members.items():
        if not up:
            flags.append(f"etcd-member-down: {endpoint}")
    notes = []  # not problems: what an operator may want to know after `lmcache-p2p config set`
    for node in nodes:
        restart = sorted(f for f, why in node.config_deviations.items() if why == "restart")
        own = sorted(f for f, why in node.config_deviations.items() if why == "node")
        if restart:
            notes.append(f"config-restart: {node.node_id} applies {', '.join(restart)} of the cluster config at its "
                         "next start")
        if own:
            notes.append(f"config-own: {node.node_id} keeps its own {', '.join(own)} (set in its file, environment "
                         "or overrides)")
    return {"cluster": config.cluster, "revision": revision, "time": time.time(), "healthy": not flags,
            "flags": flags, "notes": notes, "etcd_members": members, "nodes": [dataclasses.asdict(n) for n in nodes]}


def _gib(x: float) -> str:
    return f"{x / 2**30:.2f}"


def render(report: dict[str, Any]) -> str:
    head = ["ENGINE", "NODE", "ROLE", "HEADS", "ADDRESS", "TRANSPORTS", "FINGERPRINT", "LAYOUT", "LEASE", "CHUNKS",
            "CPU GiB", "DISK GiB", "HIT%", "HANDOFF out/in/drop", "OBJECTS pend/err", "CONFIG", "VERSION"]
    rows = [head]
    for n in report["nodes"]:
        used, cap = n["tier_used_bytes"], n["tier_capacity_bytes"]
        rows.append([
            n["engine"], n["node_id"], n["role"], n["heads"] or "all", n["address"], ",".join(n["transports"]),
            ",".join(n["fingerprints"]), ",".join(n.get("layouts") or ["-"]),
            "-" if n["lease_ttl_left_s"] is None else f"{n['lease_ttl_left_s']:.0f}s", str(n["chunks_registered"]),
            f"{_gib(used.get('cpu', 0))}/{_gib(cap.get('cpu', 0))}" if "cpu" in cap else "?",
            f"{_gib(used.get('disk', 0))}/{_gib(cap.get('disk', 0))}" if "disk" in cap else "-",
            "-" if n["hit_rate"] is None else f"{100 * n['hit_rate']:.1f}",
            "/".join(f"{n['handoff'].get(e, 0):.0f}" for e in ("accepted", "received", "dropped")),
            "-" if n.get("objects_pending") is None else f"{n['objects_pending']:.0f}/{n['objects_errors']:.0f}",
            (str(n["config_revision"]) if n["config_revision"] else "-") + ("*" if n["config_deviations"] else ""),
            f"{n['software_version']}/w{n['wire_version']}" + ("" if n["responsive"] is not False else " HUNG?")
            + (" DEGRADED" if n["degraded"] else ""),
        ])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = [f"cluster {report['cluster']}  revision {report['revision']}  nodes {len(report['nodes'])}  "
             f"etcd {sum(report['etcd_members'].values())}/{len(report['etcd_members'])} up"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.append(f"HIT%: tokens from cache over tokens looked up, last {RECENT_S // 60} minutes (- : none looked up)")
    missed = [f"{n['node_id']} " + ", ".join(f"{why} {v:.0f}" for why, v in sorted(n["misses"].items(),
                                                                                   key=lambda x: -x[1]))
              for n in report["nodes"] if n.get("misses")]
    if missed:
        lines.append("miss tokens since start, by reason: " + "; ".join(missed))
    objects = report.get("objects")
    if objects and (objects["objects"] or objects["malformed"]):
        lines.append(f"object store: {objects['objects']} objects, {_gib(objects['bytes'])} GiB"
                     + (f" ({objects['malformed']} malformed records)" if objects["malformed"] else ""))
    lines += [f"! {f}" for f in report["flags"]] or ["healthy"]
    lines += [f"  {note}" for note in report.get("notes", ())]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = etcd_tool_parser("lmcache-p2p status", __doc__)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--watch", type=float, nargs="?", const=2.0, metavar="SECONDS")
    args = parser.parse_args(argv)
    config = tool_config(args, "lmcache-p2p status")
    while True:
        try:
            report = asyncio.run(collect(config))
        except LMCacheP2PError as exc:
            print(f"lmcache-p2p status: cannot read etcd: {exc}", file=sys.stderr)
            return 2
        print(json.dumps(report) if args.json else render(report), flush=True)
        if args.watch is None:
            return 0 if report["healthy"] else 1
        time.sleep(args.watch)
