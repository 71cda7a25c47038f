"""``lmcache-p2p bench transfer``: peer pulls over each transport against raw baselines, same run.

Two processes on loopback: an owner (``peer_process``, a filled CpuPool behind a transfer
server) and this requester. Per workload (default 64 x 2 MiB and 256 x 256 KiB):

- ``tcp``: :class:`TcpTransport` pulls (handshake done, protocol, verify, commit)
- ``tcp_mac``: the same with ``transfer.payload_mac`` (a GMAC per chunk, computed by the
  owner and checked by the requester): ``tcp_mac_vs_tcp`` is its cost
- ``tcp_tls``: the same with TLS (``transfer.tls_*``: a mutual TLS 1.3 handshake, then every frame sealed
  with AES-256-GCM, ``transfer/seal.py``; a second owner process holding the same chunks, certificates from
  a throw-away CA): ``tcp_tls_vs_tcp`` is its cost
- ``raw_socket``: the same bytes from the same owner process over one plain socket,
  blocking ``recv_into`` into a preallocated buffer (no protocol, no checks)
- ``nixl``: :class:`NixlTransport` pulls (pin round trip, one READ, verify, commit, release)
- ``raw_nixl``: one NIXL READ of the same slots, addresses known, posted and waited for on the agent thread
  (no protocol, no checks, no groups)
- ``nixl_mac``: NIXL pulls with ``transfer.payload_mac`` (the owner MACs each pinned slot, the
  requester checks the MAC over what it READ), against an owner process that requires it:
  ``nixl_mac_vs_nixl`` is its cost
- ``nixl_loop_lag_ms``: the longest the agent's loop was kept from anything else during a ``nixl`` pull
  (a ticker's worst lateness; one more pull a round, apart from the timed ones)
- ``{path}_requester_cpu_s_per_gb``, ``{path}_owner_cpu_s_per_gb``, ``{path}_requester_cores``,
  ``{path}_owner_cores``: the CPU each end spent on the path's timed pulls (every thread of each process), per
  GB and as cores kept busy. Both processes share this host: where the two ends together keep every core
  busy the path is bound by the host's CPU, and its cost is the CPU seconds a GB takes at each end
- ``tls_pipeline``: where a TLS pull's time goes, in one process (``tls_pipeline.py``): each step of a
  2 MiB chunk through Python's ``ssl`` on each side, beside one AES-256-GCM operation a chunk and one copy

Ratios are medians of ``--repeat`` rounds. ``tcp``, ``tcp_mac``, ``tcp_tls`` and the raw socket run in turn,
one pull each a round, as do ``nixl``, ``raw_nixl`` and ``nixl_mac``; each ratio is the median of the rounds'
ratios (paired: this shared host's speed drifts between rounds, 2.0-4.4 GB/s for plain TCP in one minute).
The last line of ``--json`` output is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import os
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Coroutine
from typing import Any

import psutil

from ..certs import make_certs
from ..config import TransferConfig, parse_size
from ..ids import PeerAddress
from ..keys import ChunkKey, FingerprintDigest
from ..testing.peer_process import OwnerProcess
from ..tiers.cpu_pool import CpuPool
from ..transfer.base import Transport
from ..transfer.client import TcpTransport
from ..transfer.nixl import NixlTransport
from ..transfer.nixl_engine import NixlEngine, nixl_available
from ..transfer.tls import client_context
from .common import bench_parser, progress
from .tls_pipeline import describe, tls_pipeline

SECRET = "bench-secret-7f3a9c1e5b2d80461c9e4a7b"
FP = FingerprintDigest(b"bench-fingerprnt")


def _raw_socket_gbps(owner: OwnerProcess, n: int, size: int, dst: CpuPool) -> float:
    """The owner sends the same slot bytes over one plain socket; we recv_into our pool buffer."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(30)
    view = dst.buffer.numpy().data.cast("B")
    done: dict[str, float] = {}

    def receive() -> None:
        conn, _ = listener.accept()
        conn.settimeout(30)
        for i in range(n):  # into each slot, as the protocol does
            pos, end = i * dst.slot_bytes, i * dst.slot_bytes + size
            while pos < end:
                got = conn.recv_into(view[pos:end])
                if got == 0:
                    raise ConnectionError("raw sender closed early")
                pos += got
        done["t"] = time.perf_counter()
        conn.close()

    thread = threading.Thread(target=receive)
    thread.start()
    start = time.perf_counter()
    owner.command({"cmd": "rawsend", "port": listener.getsockname()[1], "n": n, "length": size})
    thread.join(30)
    listener.close()
    return n * size / (done["t"] - start) / 1e9


async def _pull_gbps(transport: Transport, peer: PeerAddress, keys: list[ChunkKey], dst: CpuPool,
                     size: int) -> float:
    for key in keys:
        dst.remove(key)
    start = time.perf_counter()
    result = await transport.pull(peer, FP, keys, dst, time.monotonic() + 30.0)
    elapsed = time.perf_counter() - start
    if len(result.loaded) != len(keys):
        raise RuntimeError(f"{transport.name}: {len(result.missed)} misses: {set(result.missed.values())}")
    return len(keys) * size / elapsed / 1e9


async def _raw_nixl_gbps(engine: NixlEngine, remote: str, owner: OwnerProcess, n: int, size: int,
                         dst: CpuPool) -> float:
    base, slot = owner.info["base"], owner.info["slot_bytes"]
    local = [dst.slot_address(i) for i in range(n)]
    far = [base + i * slot for i in range(n)]
    start = time.perf_counter()
    await engine.read_once(remote, local, far, [size] * n)
    return n * size / (time.perf_counter() - start) / 1e9


async def _loop_lag_ms(pull: Coroutine[Any, Any, float]) -> float:
    """Run ``pull`` beside a ticker on the same loop (a 0.5 ms sleep, again and again); the ticker's worst
    lateness in ms: how long the pull kept the agent's loop from everything else it serves."""
    pulling = asyncio.ensure_future(pull)
    worst = 0.0
    while not pulling.done():
        t0 = time.perf_counter()
        await asyncio.sleep(0.0005)
        worst = max(worst, time.perf_counter() - t0 - 0.0005)
    await pulling
    return 1e3 * worst


@dataclasses.dataclass(slots=True)
class _CpuUse:
    """The CPU both ends spent on one path's timed pulls: this process (the requester, every thread: its loop,
    NIXL's agent thread, the verifiers) and the owner process (every thread). Two processes on one host share
    its cores: a path whose two ends together keep every core busy is bound by the host, and what it costs a
    byte is its CPU seconds per GB, not its GB/s."""

    wall_s: float = 0.0
    requester_s: float = 0.0
    owner_s: float = 0.0
    nbytes: int = 0

    @staticmethod
    def begin(owner: OwnerProcess) -> tuple[float, float, float]:
        theirs = owner.cpu_s()  # asked before the clocks start: the round trip is not the pull's
        return theirs, time.process_time(), time.perf_counter()

    def end(self, began: tuple[float, float, float], owner: OwnerProcess, nbytes: int) -> None:
        wall, mine = time.perf_counter(), time.process_time()
        theirs = owner.cpu_s()
        self.wall_s += wall - began[2]
        self.requester_s += mine - began[1]
        self.owner_s += theirs - began[0]
        self.nbytes += nbytes

    def report(self, name: str) -> dict[str, float]:
        gb = self.nbytes / 1e9
        return {f"{name}_requester_cpu_s_per_gb": self.requester_s / gb,
                f"{name}_owner_cpu_s_per_gb": self.owner_s / gb,
                f"{name}_requester_cores": self.requester_s / self.wall_s,
                f"{name}_owner_cores": self.owner_s / self.wall_s}


def _cpu_pct(pid: int, seconds: float) -> float:
    proc = psutil.Process(pid)
    before = proc.cpu_times()
    time.sleep(seconds)
    after = proc.cpu_times()
    return 100.0 * ((after.user + after.system) - (before.user + before.system)) / seconds


async def _workload(n: int, size: int, repeat: int, use_nixl: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"chunks": n, "chunk_bytes": size}
    transports = "tcp,nixl" if use_nixl else "tcp"
    with OwnerProcess(SECRET, FP, n, size, transports=transports, timeout_s=5.0) as owner:
        keys = [owner.key(i) for i in range(n)]
        dst = CpuPool(size * (n + 2), size)
        out.update(await _tcp_paired(owner, n, size, repeat, keys, dst))
        if use_nixl:
            engine = NixlEngine(f"bench-{os.getpid()}", dst)
            with OwnerProcess(SECRET, FP, n, size, transports=transports, timeout_s=5.0, payload_mac=True) as mac_owner:
                out.update(await _nixl_paired(engine, owner, mac_owner, n, size, repeat, keys, dst))
            out["nixl_requester_idle_cpu_pct"] = _cpu_pct(os.getpid(), 2.0)
            await engine.close()
    return out


async def _nixl_paired(engine: NixlEngine, owner: OwnerProcess, mac_owner: OwnerProcess, n: int, size: int,
                       repeat: int, keys: list[ChunkKey], dst: CpuPool) -> dict[str, float]:
    """NIXL pulls, the raw READ and NIXL pulls with the payload MAC, one each a round (as ``_tcp_paired``)."""
    plain = NixlTransport(engine, SECRET.encode(), 10.0)
    mac = NixlTransport(engine, SECRET.encode(), 10.0, payload_mac=True)
    rounds: dict[str, list[float]] = {"nixl": [], "raw_nixl": [], "nixl_mac": []}
    cpu = {name: _CpuUse() for name in rounds}
    lags: list[float] = []
    remote = ""
    for r in range(repeat + 1):  # round 0 warms up (handshakes, the owners' NIXL metadata, page faults)
        got: dict[str, float] = {}
        began = _CpuUse.begin(owner)
        got["nixl"] = await _pull_gbps(plain, owner.peer, keys, dst, size)
        if r:
            cpu["nixl"].end(began, owner, n * size)
        remote = remote or next(iter(engine._remotes))  # loaded by the NIXL handshake above
        began = _CpuUse.begin(owner)
        got["raw_nixl"] = await _raw_nixl_gbps(engine, remote, owner, n, size, dst)
        if r:
            cpu["raw_nixl"].end(began, owner, n * size)
        began = _CpuUse.begin(mac_owner)
        got["nixl_mac"] = await _pull_gbps(mac, mac_owner.peer, keys, dst, size)
        if r:
            cpu["nixl_mac"].end(began, mac_owner, n * size)
        lag = await _loop_lag_ms(_pull_gbps(plain, owner.peer, keys, dst, size))  # apart: the ticker costs CPU
        if r:
            for name, gbps in got.items():
                rounds[name].append(gbps)
            lags.append(lag)
    for transport in (plain, mac):
        await transport.close()
    out = {f"{name}_gbps": statistics.median(values) for name, values in rounds.items()}
    for name, use in cpu.items():
        out.update(use.report(name))
    out["nixl_loop_lag_ms"] = statistics.median(lags)
    for ratio, name, base in (("nixl_vs_raw", "nixl", "raw_nixl"), ("nixl_mac_vs_nixl", "nixl_mac", "nixl")):
        out[ratio] = statistics.median(x / y for x, y in zip(rounds[name], rounds[base], strict=True))
    return out


async def _tcp_paired(owner: OwnerProcess, n: int, size: int, repeat: int, keys: list[ChunkKey],
                      dst: CpuPool) -> dict[str, float]:
    """Plain TCP, the raw socket, TCP with the payload MAC and TCP with TLS, one pull each a round."""
    with tempfile.TemporaryDirectory() as pki:
        made = make_certs(pki, ["owner", "requester"], days=1)
        ca = f"{pki}/ca.crt"
        tc = TransferConfig(tls_ca_cert=ca, tls_cert=str(made["requester"][0]), tls_key=str(made["requester"][1]))
        tls_owner = (ca, str(made["owner"][0]), str(made["owner"][1]))
        with OwnerProcess(SECRET, FP, n, size, timeout_s=5.0, tls=tls_owner) as secure:
            clients = {"tcp": (TcpTransport(SECRET.encode(), 10.0, payload_mac=False), owner.peer),
                       "tcp_mac": (TcpTransport(SECRET.encode(), 10.0, payload_mac=True), owner.peer),
                       "tcp_tls": (TcpTransport(SECRET.encode(), 10.0, tls=client_context(tc)), secure.peer)}
            serving = {"tcp": owner, "tcp_mac": owner, "tcp_tls": secure}
            rounds: dict[str, list[float]] = {name: [] for name in (*clients, "raw_socket")}
            cpu = {name: _CpuUse() for name in rounds}
            for r in range(repeat + 1):  # round 0 warms up (connections, handshakes, page faults)
                for name, (client, peer) in clients.items():
                    began = _CpuUse.begin(serving[name])
                    gbps = await _pull_gbps(client, peer, keys, dst, size)
                    if r:
                        cpu[name].end(began, serving[name], n * size)
                        rounds[name].append(gbps)
                began = _CpuUse.begin(owner)
                raw = _raw_socket_gbps(owner, n, size, dst)
                if r:
                    cpu["raw_socket"].end(began, owner, n * size)
                    rounds["raw_socket"].append(raw)
            for client, _ in clients.values():
                await client.close()
    out = {f"{name}_gbps": statistics.median(values) for name, values in rounds.items()}
    for name, use in cpu.items():
        out.update(use.report(name))
    for name, base in (("tcp", "raw"), ("tcp_mac", "tcp"), ("tcp_tls", "tcp")):
        baseline = rounds["raw_socket" if base == "raw" else base]
        out[f"{name}_vs_{base}"] = statistics.median(x / y for x, y in zip(rounds[name], baseline, strict=True))
    return out


async def _latency(repeat: int, use_nixl: bool) -> dict[str, Any]:
    size, n = 2 << 20, 8
    out: dict[str, Any] = {}
    transports = "tcp,nixl" if use_nixl else "tcp"
    with OwnerProcess(SECRET, FP, n, size, transports=transports, timeout_s=5.0) as owner:
        peer = owner.peer
        dst = CpuPool(size * (n + 2), size)
        engine = NixlEngine(f"bench-lat-{os.getpid()}", dst) if use_nixl else None
        clients: list[Transport] = [TcpTransport(SECRET.encode(), 10.0, payload_mac=False)]
        if engine is not None:
            clients.append(NixlTransport(engine, SECRET.encode(), 10.0))
        for transport in clients:
            samples = []
            for i in range(repeat + 5):
                key = owner.key(i % n)
                dst.remove(key)
                start = time.perf_counter()
                result = await transport.pull(peer, FP, [key], dst, time.monotonic() + 10.0)
                samples.append((time.perf_counter() - start) * 1e3)
                if key not in result.loaded:
                    raise RuntimeError(f"{transport.name}: single pull missed: {result.missed}")
            samples = sorted(samples[5:])
            prefix = "" if transport.name == "tcp" else "nixl_"
            out[f"{prefix}pull_p50_ms"] = samples[len(samples) // 2]
            out[f"{prefix}pull_p99_ms"] = samples[min(len(samples) - 1, int(len(samples) * 0.99))]
            await transport.close()
        if engine is not None:
            # The owner served NIXL above; once its wire-up progress window closes it must sit idle.
            time.sleep(11.0)
            out["nixl_idle_cpu_pct"] = _cpu_pct(owner.pid, 3.0)
            await engine.close()
    return out


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    # A full collection over torch's objects stalls 20-80 ms; long-lived objects are frozen out of it.
    gc.collect()
    gc.freeze()
    use_nixl = nixl_available() and not args.no_nixl
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    workloads = []
    for spec in args.workload:
        n, _, size = spec.partition("x")
        progress("transfer", f"workload {spec}: {args.repeat} repeats per transport")
        workloads.append(await _workload(int(n), parse_size(size, "workload"), args.repeat, use_nixl))
    summary: dict[str, Any] = dict(workloads[0])
    progress("transfer", f"latency: {args.latency_samples} samples")
    summary.update(await _latency(args.latency_samples, use_nixl))
    summary["workloads"] = workloads
    summary["nixl"] = use_nixl
    progress("transfer", "where TLS's time goes (one process)")
    summary["tls_pipeline"] = tls_pipeline()
    return summary


def _table(summary: dict[str, Any]) -> str:
    lines = [f"{'workload':<16}{'tcp':>8}{'raw sock':>10}{'ratio':>7}{'nixl':>8}{'raw nixl':>10}{'ratio':>7}"
             f"{'tcp+mac':>9}{'ratio':>7}{'tcp+tls':>9}{'ratio':>7}  GB/s"]
    for w in summary["workloads"]:
        name = f"{w['chunks']} x {w['chunk_bytes'] >> 10} KiB"
        nixl = (f"{w['nixl_gbps']:>8.2f}{w['raw_nixl_gbps']:>10.2f}{w['nixl_vs_raw']:>7.2f}" if "nixl_gbps" in w
                else f"{'-':>8}{'-':>10}{'-':>7}")
        lines.append(f"{name:<16}{w['tcp_gbps']:>8.2f}{w['raw_socket_gbps']:>10.2f}{w['tcp_vs_raw']:>7.2f}{nixl}"
                     f"{w['tcp_mac_gbps']:>9.2f}{w['tcp_mac_vs_tcp']:>7.2f}{w['tcp_tls_gbps']:>9.2f}"
                     f"{w['tcp_tls_vs_tcp']:>7.2f}")
    for w in summary["workloads"]:
        if "nixl_mac_gbps" in w:
            lines.append(f"nixl with payload MAC, {w['chunks']} x {w['chunk_bytes'] >> 10} KiB: "
                         f"{w['nixl_mac_gbps']:.2f} GB/s, nixl_mac_vs_nixl {w['nixl_mac_vs_nixl']:.2f}; "
                         f"the loop's longest stall in a nixl pull {w['nixl_loop_lag_ms']:.1f} ms")
    for w in summary["workloads"]:
        paths = [p for p in ("tcp", "raw_socket", "tcp_mac", "tcp_tls", "nixl", "raw_nixl", "nixl_mac")
                 if f"{p}_requester_cores" in w]
        lines.append(f"CPU, {w['chunks']} x {w['chunk_bytes'] >> 10} KiB (s per GB requester/owner, cores busy): "
                     + ", ".join(f"{p} {w[f'{p}_requester_cpu_s_per_gb']:.2f}/{w[f'{p}_owner_cpu_s_per_gb']:.2f} "
                                 f"({w[f'{p}_requester_cores']:.2f}/{w[f'{p}_owner_cores']:.2f})" for p in paths))
    lines.append(f"single 2 MiB pull over tcp: p50 {summary['pull_p50_ms']:.2f} ms, "
                 f"p99 {summary['pull_p99_ms']:.2f} ms")
    if "nixl_pull_p50_ms" in summary:
        lines.append(f"single 2 MiB pull over nixl: p50 {summary['nixl_pull_p50_ms']:.2f} ms, "
                     f"p99 {summary['nixl_pull_p99_ms']:.2f} ms")
        lines.append(f"idle owner with NIXL: {summary['nixl_idle_cpu_pct']:.1f}% of a core")
    lines.append(describe(summary["tls_pipeline"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("transfer", __doc__.splitlines()[0], keeps=None)
    p.add_argument("--workload", action="append", help="NxSIZE, e.g. 64x2MiB (repeatable)")
    p.add_argument("--repeat", type=int, default=9)
    p.add_argument("--latency-samples", type=int, default=100)
    p.add_argument("--no-nixl", action="store_true")
    args = p.parse_args(argv)
    args.workload = args.workload or ["64x2MiB", "256x256KiB"]
    summary = asyncio.run(_run(args))
    print(json.dumps(summary) if args.json else _table(summary))
    return 0
