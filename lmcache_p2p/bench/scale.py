"""``lmcache-p2p bench scale``: the control plane with many agents on a real 3-member etcd.

``--processes`` worker processes each run ``--agents`` simulated agents. Every simulated agent is a real
:class:`~lmcache_p2p.index.etcd_index.EtcdBlockIndex` (its own lease and keep-alive, its publisher, its node
record); ``--mirrors`` of each process's agents also follow the fingerprint's mirror (one mirror per agent
would measure this machine's memory, not the design: the others are sampled). Then:

1. **join**: every agent announces ``--chunks`` chunks; ``publish_chunks_per_s`` over the fleet.
2. **churn** for ``--seconds``: each agent adds new chunks and withdraws its oldest at ``--churn`` chunk
   events per second (the steady state of a node whose pool is full). Measured: etcd's write rate
   (revisions/s, from ``Maintenance.Status``), its DB growth; every 0.5 s the coordinator announces a probe
   chunk and each mirror notes when it sees it: **watch fan-out** latency p50/p99 (from etcd's commit, as the
   coordinator's flush returns, to each mirror; one monotonic clock on this host).
   A second phase adds ``--extra-watchers`` bare watch streams to the same churn: the extra etcd CPU over
   the extra deliveries is its **CPU per watch delivery** (etcd's CPU from ``/proc``); one more mirror on a
   thread of its own gives a node's **CPU per chunk event** it follows. A third phase measures the
   alternative to a mirror on every node: ``--lookups-per-s`` owner lookups (one read-only txn of 8 chunk
   prefixes each) during the churn: **lookup latency** p50/p99 and etcd's **CPU per lookup**.
3. **announced**: every agent's entries in etcd against what it holds, once the churn is flushed:
   ``entries_missing`` (held, not findable), ``entries_stale`` (findable, not held), ``lease_losses``.
   ``mirror_bytes_per_chunk`` (``Mirror.memory_bytes``), ``new_node_sync_s``: a fresh client follows the
   fingerprint until its mirror holds every entry in etcd (at most 120 s; None past it).
4. **death**: one worker process is SIGKILLed; ``death_seen_s``: until the coordinator's mirror holds none of
   its agents' chunks (their leases, ``--ttl`` s, run out).
5. **compaction**: etcd compacted to its current revision: the DB's size in use before and after.

The result extrapolates each per-node or per-chunk cost to ``--target-nodes`` x ``--target-chunks`` and says
which limit is reached first, for the design as built (every node mirrors every chunk event) and for the
lookup alternative (docs/benchmarks/scale.md; ``etcd.index: lookup`` in docs/operations/etcd.md).
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

from .. import cputime
from ..aio import LoopThread
from ..config import EtcdConfig
from ..errors import IndexError_
from ..ids import TIER_CPU
from ..index.client import EtcdClient
from ..index.etcd_index import EtcdBlockIndex
from ..index.etcd_server import EtcdCluster
from ..index.mirror import Mirror
from ..index.schema import Schema
from ..keys import FingerprintDigest
from .common import bench_parser, emit, progress, run_in_workdir
from .scale_fleet import CLUSTER, LOOKUP_KEYS, Lookups, Watchers, Workers, cpu_seconds, open_index, probe_key, worker

PROBE_EVERY_S = 0.5
ETCD_WRITES_PER_S = 10_000  # sustained fsync'd writes of one etcd cluster on good SSDs (etcd's own guidance)
QUOTA_BYTES = 8 << 30


def _status(loop: LoopThread, endpoints: tuple[str, ...]) -> tuple[int, int, int]:
    async def status() -> tuple[int, int, int]:
        async with EtcdClient(EtcdConfig(endpoints=endpoints)) as client:
            return await client.status()
    return loop.run(status(), 30.0)


def _announced(loop: LoopThread, endpoints: tuple[str, ...], fp: FingerprintDigest,
               workers: Workers) -> dict[str, Any]:
    """Each agent's entries in etcd against what it holds, once churn is over and every publisher has
    flushed: entries missing (a chunk held but not findable) or stale (announced, no longer held), and
    the leases lost meanwhile (an overloaded etcd or host lets them expire; every entry is republished
    under the next one)."""
    workers.send(("held",))
    wanted: dict[str, int] = {}
    losses = 0
    for i in range(len(workers.pipes)):
        _, held, lost = workers.expect(i, "held", 120)
        wanted.update(held)
        losses += lost

    async def count() -> Counter[str]:
        async with EtcdClient(EtcdConfig(endpoints=endpoints, timeout_s=60.0)) as client:
            kvs, _ = await client.get_prefix(Schema(CLUSTER).blocks_of(fp))
        return Counter(kv.key.rsplit(b"/", 1)[1].decode() for kv in kvs)

    found = loop.run(count(), 120.0)
    return {"lease_losses": losses, "entries_in_etcd": sum(found.values()),
            "entries_missing": sum(max(0, n - found.get(a, 0)) for a, n in wanted.items()),
            "entries_stale": sum(max(0, found.get(a, 0) - n) for a, n in wanted.items()),
            "agents_with_missing_entries": sum(1 for a, n in wanted.items() if found.get(a, 0) < n)}


def _compact(loop: LoopThread, endpoints: tuple[str, ...], revision: int) -> None:
    async def compact() -> None:
        async with EtcdClient(EtcdConfig(endpoints=endpoints)) as client:
            await client.compact(revision)
    loop.run(compact(), 120.0)


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    fp = os.urandom(16)
    nodes = args.processes * args.agents
    out: dict[str, Any] = {"nodes": nodes, "processes": args.processes, "mirrors": args.processes * args.mirrors,
                           "chunks_per_node": args.chunks, "churn_events_per_node_s": args.churn,
                           "lease_ttl_s": args.ttl, "etcd_members": 3, "fsync": True}
    ctx = mp.get_context("spawn")
    with EtcdCluster(3, base_dir=str(work)) as etcd, LoopThread("scale-coordinator") as loop:
        eps = etcd.endpoints
        pipes, procs = [], []
        for p in range(args.processes):
            ours, theirs = ctx.Pipe()
            names = [f"sim-{p}-{i}" for i in range(args.agents)]
            proc = ctx.Process(target=worker, args=(theirs, eps, names, fp, args.chunks, args.mirrors, args.ttl, p),
                               daemon=True)
            proc.start()
            pipes.append(ours)
            procs.append(proc)
        try:
            etcd_pids = [m.proc.pid for m in etcd.members if m.proc is not None]
            out.update(_measure(args, loop, eps, FingerprintDigest(fp), Workers(pipes), procs, nodes, etcd_pids))
        finally:
            for proc in procs:
                proc.kill()
    out.update(extrapolate(out, args.target_nodes, args.target_chunks, args.member_cores,
                           lookups_per_node_s=args.target_lookups_per_node_s))
    return out


def _measure(args: argparse.Namespace, loop: LoopThread, eps: tuple[str, ...], fp: FingerprintDigest,
             workers: Workers, procs: list[Any], nodes: int, etcd_pids: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    every = range(len(procs))
    progress("scale", f"join: {nodes} agents announce {args.chunks} chunks each")
    t0 = time.monotonic()
    ready = [workers.expect(i, "ready", 1800)[1] for i in every]
    out["join_s"] = round(time.monotonic() - t0, 2)
    out["publish_chunks_per_s"] = round(nodes * args.chunks / max(ready), 1)
    probe = open_index(loop, eps, "scale-probe", args.ttl)
    # One more mirror, on a loop thread of its own, whose CPU time is read: a node's cost per event.
    observer_loop = LoopThread("scale-observer", role="scale-observer")
    observer = open_index(observer_loop, eps, "scale-observer", args.ttl)
    observed = observer.follow(fp)
    size0, _, _ = _status(loop, eps)
    progress("scale", f"churn for {args.seconds:g}s")
    plain = _churn_phase(args, loop, eps, probe, fp, workers, etcd_pids, 0, observed)
    extra = None
    if args.extra_watchers:
        progress("scale", f"churn for {args.seconds:g}s with {args.extra_watchers} more watch streams")
        watchers = Watchers(loop, eps, Schema(CLUSTER).blocks_of(fp), args.extra_watchers)
        try:
            extra = _churn_phase(args, loop, eps, probe, fp, workers, etcd_pids, int(plain["probes"]), observed,
                                 watchers)
        finally:
            watchers.close()
    looked = None
    if args.lookups_per_s:
        first = int(plain["probes"] + (extra["probes"] if extra else 0))
        progress("scale", f"churn for {args.seconds:g}s with {args.lookups_per_s:g} lookups/s")
        lookups = Lookups(loop, eps, Schema(CLUSTER), fp, args.lookups_per_s, lambda: first)
        try:
            looked = _churn_phase(args, loop, eps, probe, fp, workers, etcd_pids, first, observed)
        finally:
            lookups.close()
        looked.update(_lookup_costs(lookups, looked, plain))
    observer.close()
    observer_loop.stop()
    size1, used1, _ = _status(loop, eps)
    events = sum(phase["events"] for phase in (plain, extra, looked) if phase)
    lat = workers.latencies
    out.update({
        "etcd_writes_per_s": round(plain["writes_per_s"], 1),
        "etcd_writes_per_node_s": round(plain["writes_per_s"] / nodes, 3),
        "churn_events_per_s": round(plain["events_per_s"], 1),
        "etcd_db_bytes": size1, "etcd_db_in_use_bytes": used1,
        "etcd_db_growth_bytes_per_event": round((size1 - size0) / max(1, events), 1),
        "probes": sum(phase["probes"] for phase in (plain, extra, looked) if phase), "probe_sightings": len(lat),
        "fanout_p50_ms": round(1e3 * statistics.median(lat), 2) if lat else None,
        "fanout_p99_ms": round(1e3 * _pct(lat, 0.99), 2) if lat else None,
        "etcd_cpu_cores": round(plain["etcd_cpu_per_s"], 3),
        "watch_deliveries_per_s": round(plain["deliveries_per_s"], 1),
        "watch_deliveries_per_event": round(plain["deliveries_per_event"], 2),
        "mirror_cpu_us_per_event": round(1e6 * plain["observer_cpu_s"] / max(1, plain["observer_events"]), 2),
    })
    out.update(_etcd_costs(plain, extra, args.extra_watchers))
    if looked is not None:
        out.update({k: v for k, v in looked.items() if k.startswith("lookup")})
    counts: list[tuple[int, int]] = []
    workers.send(("mirrors",))
    for i in every:
        counts += workers.expect(i, "mirrors", 120)[1]
    held = sum(n for n, _ in counts)
    out["mirror_bytes_per_chunk"] = round(sum(b for _, b in counts) / held, 1) if held else None
    progress("scale", "announced: entries against what each agent holds; a new node syncs")
    out.update(_announced(loop, eps, fp, workers))
    total = out["entries_in_etcd"]
    t0 = time.monotonic()
    fresh = open_index(loop, eps, "scale-newcomer", args.ttl)
    mirror = fresh.follow(fp)
    synced = mirror.wait_for(lambda m: len(m) >= total, 120)
    out["new_node_sync_s"] = round(time.monotonic() - t0, 3) if synced else None
    out["new_node_mirror_chunks"] = len(mirror)
    progress("scale", "death: a worker process killed; then compaction")
    t0 = time.monotonic()
    procs[0].kill()  # its agents' leases run out: their chunks must leave every mirror
    left = len(mirror) - args.agents * args.chunks
    gone = mirror.wait_for(lambda m: len(m) <= left, args.ttl * 3 + 60)
    out["death_seen_s"] = round(time.monotonic() - t0, 2) if gone else None
    _, used2, rev2 = _status(loop, eps)
    try:
        _compact(loop, eps, rev2)
    except (IndexError_, TimeoutError) as exc:  # an overloaded etcd: reported, the rest still measured
        out["compaction_error"] = str(exc)[:200]
    time.sleep(1.0)
    _, used3, _ = _status(loop, eps)
    out["etcd_in_use_before_compaction"], out["etcd_in_use_after_compaction"] = used2, used3
    out["etcd_bytes_per_chunk"] = round(used3 / max(1, len(mirror)), 1)
    fresh.close()
    probe.close()
    with contextlib.suppress(OSError, EOFError, TimeoutError):
        workers.send(("stop",), range(1, len(procs)))
        for i in range(1, len(procs)):
            workers.expect(i, "stopped", 120)
    return out


def _churn_phase(args: argparse.Namespace, loop: LoopThread, eps: tuple[str, ...], probe: EtcdBlockIndex,
                 fp: FingerprintDigest, workers: Workers, etcd_pids: list[int], first_probe: int,
                 observed: Mirror, watchers: Watchers | None = None) -> dict[str, float]:
    """One churn phase of ``args.seconds`` with probes: what etcd wrote, spent and delivered meanwhile."""
    def deliveries() -> int:  # events received by every mirror and bare watcher we can count
        workers.send(("events",))
        return sum(workers.expect(i, "events", 120)[1] for i in range(len(workers.pipes))) + observed.events_total \
            + (watchers.events if watchers else 0)

    d0, obs_events0 = deliveries(), observed.events_total
    obs_cpu0, cpu0, (_, _, rev0) = cputime.seconds().get("scale-observer", 0.0), cpu_seconds(etcd_pids), \
        _status(loop, eps)
    t0 = time.monotonic()
    workers.send(("churn", args.seconds, args.churn))
    probes = _probes(probe, fp, workers, args.seconds, first_probe)
    churned = [workers.expect(i, "churned", args.seconds + 600)[1] for i in range(len(workers.pipes))]
    elapsed = time.monotonic() - t0
    cpu1, (_, _, rev1) = cpu_seconds(etcd_pids), _status(loop, eps)
    obs_cpu1, d1 = cputime.seconds().get("scale-observer", 0.0), deliveries()
    # Per event, every delivery counted once the last events arrived (on a busy host they trail the churn):
    # a ratio the host's speed does not change, unlike deliveries per second.
    # Settled: no new delivery in three reads half a second apart (beside CPU hogs one quiet read came while
    # the bare watchers still trailed by a quarter of the events).
    settled, quiet, deadline = d1, 0, time.monotonic() + 30.0
    while quiet < 3 and time.monotonic() < deadline:
        time.sleep(0.5)  # also the last probes' sightings
        now = deliveries()
        quiet = quiet + 1 if now == settled else 0
        settled = now
    now = settled
    workers.drain()
    return {"seconds": elapsed, "writes_per_s": (rev1 - rev0) / elapsed, "events": sum(churned),
            "events_per_s": sum(churned) / elapsed, "probes": probes, "etcd_cpu_per_s": (cpu1 - cpu0) / elapsed,
            "deliveries_per_s": (d1 - d0) / elapsed, "deliveries_per_event": (now - d0) / max(1, sum(churned)),
            "observer_cpu_s": obs_cpu1 - obs_cpu0, "observer_events": observed.events_total - obs_events0}


def _etcd_costs(plain: dict[str, float], extra: dict[str, float] | None, watchers: int) -> dict[str, Any]:
    """etcd's CPU per watch delivery: the second phase adds ``watchers`` bare watch streams to the same
    churn, so the extra CPU over the extra deliveries is the marginal cost of one delivery. What is left
    of the first phase's CPU (raft, fsync'd writes, leases) is charged per node."""
    if extra is None:
        return {"etcd_cpu_us_per_delivery": None}
    seen = {"extra_watchers": watchers, "extra_phase_deliveries_per_event": round(extra["deliveries_per_event"], 2),
            "extra_phase_deliveries_per_s": round(extra["deliveries_per_s"], 1)}
    if extra["deliveries_per_s"] <= plain["deliveries_per_s"]:  # the host slowed the churn down: no cost to read
        return {**seen, "etcd_cpu_us_per_delivery": None}
    per_delivery = (extra["etcd_cpu_per_s"] - plain["etcd_cpu_per_s"]) / (
        extra["deliveries_per_s"] - plain["deliveries_per_s"])
    return {**seen, "extra_phase_writes_per_s": round(extra["writes_per_s"], 1),
            "extra_phase_etcd_cpu_cores": round(extra["etcd_cpu_per_s"], 3),
            "etcd_cpu_us_per_delivery": round(1e6 * per_delivery, 3) if per_delivery > 0 else None,
            "etcd_cpu_cores_without_deliveries": round(
                max(0.0, plain["etcd_cpu_per_s"] - max(0.0, per_delivery) * plain["deliveries_per_s"]), 3)}


def _lookup_costs(lookups: Lookups, phase: dict[str, float], plain: dict[str, float]) -> dict[str, Any]:
    """What the lookup phase measured: latency, rate, and etcd's CPU per lookup over the plain phase's."""
    lat = lookups.latencies
    rate = len(lat) / phase["seconds"]
    per_lookup = (phase["etcd_cpu_per_s"] - plain["etcd_cpu_per_s"]) / rate if rate else 0.0
    return {"lookups_per_s": round(rate, 1), "lookup_keys": LOOKUP_KEYS, "lookups_failed": lookups.failed,
            "lookup_p50_ms": round(1e3 * statistics.median(lat), 2) if lat else None,
            "lookup_p99_ms": round(1e3 * _pct(lat, 0.99), 2) if lat else None,
            "lookup_held_share": round(lookups.found / max(1, len(lat) * LOOKUP_KEYS), 3),
            "lookup_etcd_cpu_us": round(1e6 * per_lookup, 1) if per_lookup > 0 else None}


def _probes(probe: EtcdBlockIndex, fp: FingerprintDigest, workers: Workers, seconds: float, first: int) -> int:
    """Announce a probe chunk every PROBE_EVERY_S while the workers churn, numbered from ``first``;
    returns how many."""
    start, i = time.monotonic(), first
    while time.monotonic() - start < seconds:
        probe.add(fp, probe_key(i), TIER_CPU)
        probe.flush(timeout=30.0)
        workers.committed[i] = time.monotonic()
        i += 1
        workers.drain()
        time.sleep(PROBE_EVERY_S)
    return i - first


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def extrapolate(m: dict[str, Any], nodes: int, chunks: int, member_cores: float = 16.0,
                node_cores: float = 1.0, lookups_per_node_s: float = 10.0) -> dict[str, Any]:
    """Each measured cost at ``nodes`` nodes holding ``chunks`` chunks in all, and the first limit reached.

    Writes, chunk events and etcd's CPU without deliveries grow with the nodes; deliveries with the events
    times the nodes (every node mirrors every chunk event of its model); a node's mirror CPU with the
    fleet's event rate.
    Limits: ETCD_WRITES_PER_S, the 8 GiB quota, ``member_cores`` per etcd member (the 3 members share the
    watchers; each applies every write), and ``node_cores`` of a node spent following the index.

    ``lookup_design`` (when the lookup phase ran): the same fleet with no block watch, each node asking
    etcd for its requests' owners, ``lookups_per_node_s`` a second."""
    measured_nodes = m["nodes"]
    writes = m["etcd_writes_per_node_s"] * nodes
    events = m["churn_events_per_s"] / measured_nodes * nodes  # one write (a batch) carries several events
    deliveries = events * nodes
    db = m["etcd_bytes_per_chunk"] * chunks
    mirror = (m["mirror_bytes_per_chunk"] or 0) * chunks
    synced = m["new_node_sync_s"]
    sync_s = None if synced is None else round(synced * chunks / max(1, m["new_node_mirror_chunks"]), 1)
    node_cpu = m["mirror_cpu_us_per_event"] * 1e-6 * events
    limits = {"etcd write rate": writes / ETCD_WRITES_PER_S, "etcd quota (8 GiB)": db / QUOTA_BYTES,
              f"node CPU following the index ({node_cores:g} core)": node_cpu / node_cores}
    at: dict[str, Any] = {"nodes": nodes, "chunks": chunks, "etcd_writes_per_s": round(writes),
                          "chunk_events_per_s": round(events),
                          "watch_deliveries_per_s": round(deliveries), "etcd_db_bytes": round(db),
                          "mirror_bytes_per_node": round(mirror), "new_node_sync_s": sync_s,
                          "node_cpu_cores_following_index": round(node_cpu, 3)}
    if m.get("etcd_cpu_us_per_delivery") is not None:
        base = m["etcd_cpu_cores_without_deliveries"] / measured_nodes * nodes
        member = (base + m["etcd_cpu_us_per_delivery"] * 1e-6 * deliveries) / 3
        at["etcd_cpu_cores_per_member"] = round(member, 1)
        limits[f"etcd member CPU ({member_cores:g} cores)"] = member / member_cores
    first = max(limits, key=lambda k: limits[k])
    at["share_of_limit"] = {k: round(v, 3) for k, v in limits.items()}
    at["first_limit"] = first
    if m.get("lookup_etcd_cpu_us") is not None and m.get("etcd_cpu_cores_without_deliveries") is not None:
        # The alternative: no block watch; each request's lookup is one read-only txn to any member.
        lookups = lookups_per_node_s * nodes
        base = m["etcd_cpu_cores_without_deliveries"] / measured_nodes * nodes
        member = (base + m["lookup_etcd_cpu_us"] * 1e-6 * lookups) / 3
        alt = {"etcd write rate": writes / ETCD_WRITES_PER_S, "etcd quota (8 GiB)": db / QUOTA_BYTES,
               f"etcd member CPU ({member_cores:g} cores)": member / member_cores}
        at["lookup_design"] = {
            "lookups_per_s": round(lookups), "lookups_per_node_s": lookups_per_node_s,
            "etcd_cpu_cores_per_member": round(member, 1), "node_cpu_cores_following_index": 0.0,
            "mirror_bytes_per_node": 0, "request_latency_added_ms": m["lookup_p50_ms"],
            "share_of_limit": {k: round(v, 3) for k, v in alt.items()},
            "first_limit": max(alt, key=lambda k: alt[k])}
    return {"at": at}


def main(argv: list[str]) -> int:
    p = bench_parser("scale", __doc__, keeps="etcd's data and logs")
    p.add_argument("--processes", type=int, default=4)
    p.add_argument("--agents", type=int, default=50, help="simulated agents per process")
    p.add_argument("--mirrors", type=int, default=2, help="agents per process that also follow the mirror")
    p.add_argument("--chunks", type=int, default=1000, help="chunks each agent announces at join")
    p.add_argument("--churn", type=float, default=20.0, help="chunk events (adds + withdrawals) per agent per s")
    p.add_argument("--seconds", type=float, default=30.0, help="churn phase length")
    p.add_argument("--ttl", type=int, default=5, help="lease TTL of the simulated agents")
    p.add_argument("--target-nodes", type=int, default=1000)
    p.add_argument("--target-chunks", type=int, default=1_000_000)
    p.add_argument("--extra-watchers", type=int, default=32,
                   help="bare watch streams added in a second churn phase (etcd's CPU per delivery); 0: no phase")
    p.add_argument("--member-cores", type=float, default=16.0, help="CPU cores of one etcd member (extrapolation)")
    p.add_argument("--lookups-per-s", type=float, default=200.0,
                   help="a third churn phase with this many owner lookups a second (the no-watch alternative); 0: none")
    p.add_argument("--target-lookups-per-node-s", type=float, default=10.0,
                   help="requests a node looks up a second, for the alternative's extrapolation")
    args = p.parse_args(argv)
    result = run_in_workdir(run, args, "lmcache-p2p-bench-scale-")
    emit(result, args.json, "bench scale (3-member etcd, simulated agents; extrapolation under 'at')")
    return 0
