"""Agent configuration: frozen slots dataclasses, loaded and validated in one place.

Precedence, lowest to highest::

    defaults  <  config file (YAML or TOML)  <  environment (LMCACHE_P2P_*)  <  explicit overrides

The file is ``path``, else the one ``LMCACHE_P2P_CONFIG`` names. It holds sections matching the
dataclasses below::

    node_id: node-a
    cluster: prod
    chunk_size: 256
    metrics_port: 9470
    metrics_host: 0.0.0.0      # default 127.0.0.1: /metrics only on this machine (advertised_hosts)
    tiers:    {cpu_capacity: 20Gi, disk_path: /var/cache/lmcache-p2p, disk_capacity: 200GiB, eviction: lru}
    etcd:     {endpoints: ["http://10.0.0.1:2379"], lease_ttl_s: 10}
    transfer: {transports: [nixl, tcp], listen_host: 0.0.0.0, advertise_host: 10.0.0.5, port: 7470}
    # the secret: LMCACHE_P2P_SECRET in the environment

A wildcard ``transfer.listen_host`` without ``advertise_host`` advertises the address of the interface
that routes outward (:func:`detect_host`), or refuses to start when there is none.

Environment variables name a top-level field or ``SECTION_FIELD`` in upper case, e.g.
``LMCACHE_P2P_CHUNK_SIZE=512``, ``LMCACHE_P2P_TIERS_CPU_CAPACITY=4GiB``,
``LMCACHE_P2P_ETCD_ENDPOINTS=http://a:2379,http://b:2379``. Environment names that match no
field are ignored (Kubernetes injects ``<SERVICE>_PORT``-style variables). Every invalid value raises
:class:`~lmcache_p2p.errors.ConfigError` (a ``ValueError``) naming the dotted field.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import re
import socket
import tomllib
import types
import typing
import urllib.parse
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .keys import LEAD_INS
from .request_params import SELECTIONS

ENV_PREFIX = "LMCACHE_P2P_"
CONFIG_ENV = ENV_PREFIX + "CONFIG"  # the config file every process and tool reads when given none
EVICTION_POLICIES = ("lru", "lfu", "s3fifo")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
TRANSPORTS = ("tcp", "nixl")

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40,  # Kubernetes' binary suffixes
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | str, field: str) -> int:
    """Bytes from ``1048576``, ``"512MiB"``, ``"32Gi"`` (Kubernetes' binary units), ``"20GB"`` (decimal).

    ``KB``/``MB``/``GB``/``TB`` are powers of 1000; ``KiB``/``Ki``, ``MiB``/``Mi``, ``GiB``/``Gi``,
    ``TiB``/``Ti`` and the bare ``K``/``M``/``G``/``T`` are powers of 1024 (``4G`` is 4 GiB, not 4 GB).
    Units are case-insensitive."""
    if isinstance(value, bool):
        raise ConfigError(field, f"expected a size, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(field, f"must be >= 0, got {value}")
        return value
    m = _SIZE_RE.match(str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(field, f"not a size: {value!r} (examples: 1048576, 512MiB, 32Gi, 20GB; "
                                 "GB is 10^9 bytes, G, Gi and GiB are 2^30)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ConfigError(field, message)


@dataclasses.dataclass(frozen=True, slots=True)
class TierConfig:
    # Bytes of the CPU pool, allocated and touched at start and cut into whole chunk slots (a size: 20Gi,
    # 20GiB and 20G are 20 * 2^30 bytes, 20GB is 20 * 10^9). Tensor-parallel ranks get an equal share each.
    cpu_capacity: int = 1 << 30
    # Directory of the disk tier (created if missing; one file per chunk, rescanned and kept across restarts;
    # TP rank k uses ``<path>/r<k>``). None: no disk tier, a chunk evicted from the CPU pool leaves this node.
    disk_path: str | None = None
    disk_capacity: int = 10 << 30  # bytes the disk tier may fill under disk_path (a size, as cpu_capacity)
    # Which chunk each tier (CPU and disk) evicts first when full: "lru" (least recently used), "lfu" (least
    # frequently used) or "s3fifo" (S3-FIFO); the cluster config can change it while running.
    eviction: str = "lru"
    # Seconds a reader's pin (a peer's pull being served, a load into the engine, a canary check) keeps a
    # CPU slot from being evicted or reused; an expired pin is ignored, so a crashed reader frees its slot.
    pin_timeout_s: float = 30.0
    # Seconds a chunk lives, counted from the oldest copy this node has seen of it (swept every
    # min(ttl/4, 5 s); the object tier deletes older objects too). None: chunks never expire by age.
    chunk_ttl_s: float | None = None
    # Admission: a partial chunk (a prompt's or a finished request's tail) shorter than this is not saved;
    # it would take a whole slot and an etcd entry for tokens cheaper to recompute than to look up. 0 (off)
    # until its effect on hit rates is measured (a conversation's next turn then recomputes such a tail).
    min_save_tokens: int = 0
    # Admission: a chunk is saved only once its key was in this many requests' prompts on this node (counted
    # for the newest keys only: a bounded LRU); 1 saves on first sight. Above 1, generated chunks are saved
    # only when their key already was (a one-off request's KV never takes a slot).
    save_after_sightings: int = 1

    def __post_init__(self) -> None:
        _check(self.cpu_capacity >= 0, "tiers.cpu_capacity", "must be >= 0")
        _check(self.min_save_tokens >= 0, "tiers.min_save_tokens", "must be >= 0")
        _check(self.save_after_sightings >= 1, "tiers.save_after_sightings", "must be >= 1")
        _check(self.disk_capacity >= 0, "tiers.disk_capacity", "must be >= 0")
        _check(self.eviction in EVICTION_POLICIES, "tiers.eviction", f"must be one of {EVICTION_POLICIES}")
        _check(self.pin_timeout_s > 0, "tiers.pin_timeout_s", "must be > 0")
        # a floor: a TTL near zero (a cluster-config writer's) would sweep every chunk as it lands, several
        # thousand times a second
        _check(self.chunk_ttl_s is None or self.chunk_ttl_s >= 1, "tiers.chunk_ttl_s", "must be >= 1 (seconds) or null")


@dataclasses.dataclass(frozen=True, slots=True)
class ObjectsConfig:
    """The object tier (``lmcache_p2p/objects/``): an S3-compatible store under disk, shared by the cluster.

    ``url`` is the store's endpoint (``http://10.0.0.9:8333``, ``https://s3.eu-west-1.amazonaws.com``);
    None turns the tier off. Chunks are objects ``<prefix>/<cluster>/<fingerprint>/<key>`` in ``bucket``.
    A chunk leaving this node's last tier is uploaded when no other node (nor the store) holds it and it
    was hit at least ``min_hits`` times (0: every sole copy); at most ``budget_bytes_per_s`` and
    ``max_inflight`` uploads at once; the bytes wait in memory (at most ``spill_bytes``, else the chunk is
    dropped and counted) until the store confirmed them. Uploads, deletes and listings get ``timeout_s``
    each; a load's object reads get what is left of the load's own deadline. The cleanup pass (every
    ``cleanup_interval_s``; 0: off) deletes objects an invalidation covers or older than
    ``tiers.chunk_ttl_s``. Credentials: the AWS environment variables or shared credentials file.
    """

    url: str | None = None
    bucket: str = "lmcache-p2p"
    prefix: str = "chunks"  # what object names start with: ``<prefix>/<cluster>/<fingerprint>/<key>`` (hex)
    region: str = "us-east-1"  # the S3 region requests are signed for (on AWS, the bucket's region)
    min_hits: int = 1
    budget_bytes_per_s: int = 64 << 20
    max_inflight: int = 4
    spill_bytes: int = 256 << 20
    timeout_s: float = 10.0
    cleanup_interval_s: float = 60.0

    def __post_init__(self) -> None:
        _check(self.url is None or re.match(r"^https?://[^/\s]+/?$", self.url) is not None, "objects.url",
               "must be an http(s)://host[:port] endpoint")
        _check(re.match(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$", self.bucket) is not None, "objects.bucket",
               "must be an S3 bucket name (3-63 chars of [a-z0-9.-])")
        _check(re.match(r"^[A-Za-z0-9_.\-]+(/[A-Za-z0-9_.\-]+)*$", self.prefix) is not None, "objects.prefix",
               "must be path segments of [A-Za-z0-9_.-] separated by /")
        _check(self.min_hits >= 0, "objects.min_hits", "must be >= 0")
        _check(self.budget_bytes_per_s >= 0, "objects.budget_bytes_per_s", "must be >= 0")
        _check(self.max_inflight >= 1, "objects.max_inflight", "must be >= 1")
        _check(self.spill_bytes >= 0, "objects.spill_bytes", "must be >= 0")
        _check(self.timeout_s > 0, "objects.timeout_s", "must be > 0")
        _check(self.cleanup_interval_s >= 0, "objects.cleanup_interval_s", "must be >= 0")


@dataclasses.dataclass(frozen=True, slots=True)
class HandoffConfig:
    """The cluster's memory as one cache (``lmcache_p2p/handoff.py``).

    A chunk no other node holds is offered to a peer with room before it would be dropped (a pool
    with fewer than ``free_below`` of its slots free offers its coldest such chunks), at most
    ``budget_bytes_per_s``; 0 turns hand-off off (chunks are dropped as they are evicted). Only
    chunks hit at least ``min_hits`` times are offered (0: all). A chunk pulled from this node
    ``replicate_after`` times while no other node held it gets a copy on another node (0: off).
    With ``evict_copies_first`` a full pool evicts chunks another node also holds before sole copies.
    Free capacity is published in the node record at most every ``capacity_interval_s``.
    """

    budget_bytes_per_s: int = 64 << 20
    min_hits: int = 1
    free_below: float = 0.1
    replicate_after: int = 4
    evict_copies_first: bool = True
    capacity_interval_s: float = 2.0

    def __post_init__(self) -> None:
        _check(self.budget_bytes_per_s >= 0, "handoff.budget_bytes_per_s", "must be >= 0")
        _check(self.min_hits >= 0, "handoff.min_hits", "must be >= 0")
        _check(0.0 <= self.free_below <= 1.0, "handoff.free_below", "must be in [0, 1]")
        _check(self.replicate_after >= 0, "handoff.replicate_after", "must be >= 0")
        _check(self.capacity_interval_s > 0, "handoff.capacity_interval_s", "must be > 0")


@dataclasses.dataclass(frozen=True, slots=True)
class CanaryConfig:
    """The correctness canary (``lmcache_p2p/canary.py``): a fraction ``rate`` of the requests the
    mesh could serve is computed by the engine instead, and every owner's copy of their chunks is
    compared with what it computed (a request can also ask, whatever the rate). A copy further than
    ``tolerance`` (relative L2; default by KV dtype: fp32 1e-3, fp16 0.02, bf16 0.05, fp8 0.15)
    quarantines its owner; ``max_owners`` owners are asked per chunk, each pull within ``timeout_s``.
    A quarantine lapses after ``quarantine_ttl_s`` unless a new mismatch renews it (None: it stands
    until ``lmcache-p2p verify --release``). Clients of the engine's API may ask for checks at most
    ``requested_per_minute`` times a minute per engine (a burst of a sixth of that, at least one);
    beyond, the request is served as any other and the ask counted (``request_params_refused_total``):
    each check copies up to 16 chunks on the forward thread and pulls every owner's copy."""

    rate: float = 0.0
    tolerance: float | None = None
    max_owners: int = 4
    timeout_s: float = 5.0
    quarantine_ttl_s: float | None = 3600.0
    requested_per_minute: float = 30.0

    def __post_init__(self) -> None:
        _check(0.0 <= self.rate <= 1.0, "canary.rate", "must be in [0, 1]")
        _check(self.tolerance is None or self.tolerance > 0, "canary.tolerance", "must be > 0")
        _check(self.max_owners >= 1, "canary.max_owners", "must be >= 1")
        _check(self.timeout_s > 0, "canary.timeout_s", "must be > 0")
        _check(self.requested_per_minute >= 0, "canary.requested_per_minute", "must be >= 0")
        _check(self.quarantine_ttl_s is None or self.quarantine_ttl_s >= 1, "canary.quarantine_ttl_s",
               "must be >= 1 (seconds) or null")


@dataclasses.dataclass(frozen=True, slots=True)
class BlendConfig:
    """Reuse of a request's declared segments (RAG documents) at any position
    (``segments.py``): ``enabled`` lets requests that declare segments blend when they ask
    (``lmcache_p2p_blend``, or a fraction or selection of their own), or all of them (``by_default``):
    on the graded task of ``bench blend`` no setting keeps a full prefill's answers (docs/benchmarks/blend.md);
    ``recompute_fraction`` of each placed segment's tokens is recomputed through the model against the
    blended context (0: plain concatenation; 1: every token, a full prefill's KV), chosen by
    ``selection`` ("first": each segment's first tokens; "deviation": the tokens whose keys move most
    when recomputed in this context, CacheBlend's; "question": the tokens the rest of the prompt reads
    most over the blended cache, ProphetKV's and A³'s; "deviation-gradual", "question-gradual": the same
    in two rounds, the second scored over the cache the first refreshed, CacheBlend's gradual filtering;
    "question-heads": the question's reads per head, a position scored by its largest share of any head's);
    ``lead_in`` is what a segment's KV is computed after besides the base, once, where no one holds it
    ("none": the base alone, and a request computed plainly saves its first segment; "self": a copy of the
    segment, so that its tokens are read as a document after another, as in most prompts that declare it:
    closer answers, and a document's first sight costs a blend computing it twice; each has its own keys);
    ``max_recompute_tokens`` bounds what one blend runs
    through the model (recompute and fresh segments; also never more than vLLM's token budget per
    step): a blend over it is refused and the request is served prefix-only, whatever it asks."""

    enabled: bool = True
    by_default: bool = False
    recompute_fraction: float = 0.3
    selection: str = "question-heads"
    lead_in: str = "none"
    max_recompute_tokens: int = 4096

    def __post_init__(self) -> None:
        _check(0.0 <= self.recompute_fraction <= 1.0, "blend.recompute_fraction", "must be in [0, 1]")
        _check(self.selection in SELECTIONS, "blend.selection", "must be one of " + ", ".join(SELECTIONS))
        _check(self.lead_in in LEAD_INS, "blend.lead_in", "must be one of " + ", ".join(LEAD_INS))
        _check(self.max_recompute_tokens >= 0, "blend.max_recompute_tokens", "must be >= 0")


@dataclasses.dataclass(frozen=True, slots=True)
class EtcdConfig:
    # The etcd members, host:port or http(s):// URLs (comma-separated in the environment); an https:// one
    # turns TLS on. Empty: an agent refuses to start; tools take --etcd instead.
    endpoints: tuple[str, ...] = ()
    # Seconds of this node's etcd lease: its node record and chunk entries vanish this long after it stops
    # refreshing the lease (it died or is cut off); per-peer state is also pruned this often.
    lease_ttl_s: int = 10
    ca_cert: str | None = None  # PEM file of the CA etcd's server certificates are checked against; set: TLS
    cert_cert: str | None = None  # PEM client certificate for etcd's mutual TLS (with cert_key); None: no client cert
    cert_key: str | None = None  # PEM private key of cert_cert
    user: str | None = None  # etcd user (with password; None: no etcd authentication)
    password: str | None = None  # of user
    timeout_s: float = 5.0  # seconds each etcd request may take (a page of a range read: four times this)
    start_wait_s: float = 2.0  # how long start-up waits for etcd before going on degraded
    allow_plaintext_password: bool = False  # a password over plain HTTP is refused unless this is set
    # "watch": every node mirrors every chunk entry of its model (reads are dict probes); "lookup": only
    # node records are followed, a request's owners are read from etcd when it arrives (index/lookup.py).
    index: str = "watch"
    lookup_cache_s: float = 1.0  # lookup: how long an answer is reused
    lookup_timeout_s: float = 0.25  # lookup: a read that takes longer is a miss (the engine computes)

    def __post_init__(self) -> None:
        for ep in self.endpoints:
            _check(re.match(r"^(https?://)?[\w.\-\[\]:]+:\d+$", ep) is not None,
                   "etcd.endpoints", f"not host:port or URL: {ep!r}")
        _check(self.lease_ttl_s >= 2, "etcd.lease_ttl_s", "must be >= 2")
        _check((self.user is None) == (self.password is None), "etcd.password", "user and password go together")
        tls = self.ca_cert is not None or any(ep.startswith("https://") for ep in self.endpoints)
        _check(self.password is None or tls or self.allow_plaintext_password, "etcd.password",
               "would go over plain HTTP: use https:// endpoints or etcd.ca_cert (or set "
               "etcd.allow_plaintext_password on a network you trust)")
        _check((self.cert_cert is None) == (self.cert_key is None), "etcd.cert_key",
               "cert_cert and cert_key go together")
        _check(self.timeout_s > 0, "etcd.timeout_s", "must be > 0")
        _check(self.start_wait_s >= 0, "etcd.start_wait_s", "must be >= 0")
        _check(self.index in ("watch", "lookup"), "etcd.index", f"must be watch or lookup, not {self.index!r}")
        _check(self.lookup_cache_s >= 0, "etcd.lookup_cache_s", "must be >= 0")
        _check(self.lookup_timeout_s > 0, "etcd.lookup_timeout_s", "must be > 0")


@dataclasses.dataclass(frozen=True, slots=True)
class TransferConfig:
    # How this node pulls, most preferred first: "tcp" (the authenticated connection itself) and/or "nixl"
    # (one-sided reads, set up over that connection). A peer is pulled from only if it speaks one of them.
    transports: tuple[str, ...] = ("tcp",)
    # Address the transfer server binds. The default, loopback, reaches only this machine; a wildcard
    # (0.0.0.0, ::) needs advertise_host, else this host's outward address is detected (or start refused).
    listen_host: str = "127.0.0.1"
    # Address peers dial, published in this node's record. None: listen_host, or the detected outward
    # address when that is a wildcard. A wildcard here is refused.
    advertise_host: str | None = None
    # TCP port of the transfer server. 0: a free one, published in the node record; a fixed one is offset
    # by the rank under tensor parallelism (rank k listens on port + k).
    port: int = 0
    # The cluster secret, the same on every node, at least 32 bytes: it authenticates peers, keys the payload
    # MAC and seals objects. None: LMCACHE_P2P_SECRET from the environment; without either an agent won't start.
    secret: str | None = None
    # Seconds: a whole load's deadline (its pulls from peers and the object store); at most as long for a
    # peer to connect and handshake, and for each frame on a connection to cross.
    timeout_s: float = 5.0
    # Largest frame header (a msgpack map; chunk payloads come after it and do not count) a connection
    # accepts: a larger one closes it. Also bounds the keys per request (a size, as tiers.cpu_capacity).
    max_frame_bytes: int = 1 << 20
    # Seconds a failed peer is skipped after its first failure, doubled on each further one up to
    # max(backoff_s, 30 s), jittered; the object store too (at least 0.1 s). 0: retried at once.
    backoff_s: float = 2.0
    # Asynchronous loads run at once in a worker (each mostly waits on its pulls; scatters touch each
    # request's own blocks): with more than one, a slow owner no longer holds every load queued behind it.
    # 1 (one after another, as before) until `bench serve` has measured the others.
    load_threads: int = 1
    # A pull from a peer never measured (it connects and handshakes too) gets at least this long
    # (plan.fetch_budget); a hung peer costs it once, then it is backed off.
    first_contact_s: float = 1.0
    # The planner skips a pull it expects to take longer than this engine would take to compute the
    # tokens (plan.fetch_budget). False: every planned pull is made and may take up to timeout_s (a hung
    # owner too): engine time saved for other requests at the cost of this request's TTFT.
    recompute_when_faster: bool = True
    # A per-session keyed MAC over every chunk, TCP and NIXL (see transfer/wire.py). None (unset): on
    # unless TLS is on. Without TLS it is what stops an etcd writer who points a node's record at a
    # relay from injecting chunks; it costs throughput (measured in docs/operations/security.md).
    payload_mac: bool | None = None
    tls_ca_cert: str | None = None  # all three: mutual TLS under the cluster CA (see transfer/tls.py)
    tls_cert: str | None = None  # PEM certificate of this node under tls_ca_cert (``lmcache-p2p certs``)
    tls_key: str | None = None  # PEM private key of tls_cert
    # Refuse an owner whose certificate names no node (transfer/tls.py). None (unset): on when this
    # node's own certificate names a node (per-node certificates); off with one certificate shared by all.
    tls_require_node_name: bool | None = None

    def __post_init__(self) -> None:
        _check(len(self.transports) > 0, "transfer.transports", "must name at least one transport")
        for t in self.transports:
            _check(t in TRANSPORTS, "transfer.transports", f"unknown transport {t!r}, known: {TRANSPORTS}")
        _check(0 <= self.port < 65536, "transfer.port", "must be in [0, 65535]")
        _check(self.timeout_s > 0, "transfer.timeout_s", "must be > 0")
        _check(self.max_frame_bytes >= 4096, "transfer.max_frame_bytes", "must be >= 4096")
        _check(self.backoff_s >= 0, "transfer.backoff_s", "must be >= 0")
        _check(1 <= self.load_threads <= 64, "transfer.load_threads", "must be in [1, 64]")
        _check(0 < self.first_contact_s <= self.timeout_s, "transfer.first_contact_s", "must be in (0, timeout_s]")
        if self.secret is not None:
            check_secret(self.secret, "transfer.secret")
        tls = (self.tls_ca_cert, self.tls_cert, self.tls_key)
        for name, value in zip(("tls_ca_cert", "tls_cert", "tls_key"), tls, strict=True):
            _check(all(v is None for v in tls) or value is not None, f"transfer.{name}",
                   "TLS needs all three of tls_ca_cert, tls_cert and tls_key")  # files: read at start
        _check(not self.tls_require_node_name or self.tls_cert is not None, "transfer.tls_require_node_name",
               "needs TLS (tls_ca_cert, tls_cert and tls_key)")

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None


MIN_SECRET_BYTES = 32
_PLACEHOLDERS = ("replace-me", "replace_me", "change-me", "changeme", "change_me", "placeholder", "example",
                 "your-secret", "secret-here")


def check_secret(value: str, field: str) -> None:
    """A cluster secret is the trust boundary: refuse short ones and known placeholders."""
    _check(len(value.encode()) >= MIN_SECRET_BYTES, field,
           f"must be at least {MIN_SECRET_BYTES} bytes (e.g. `openssl rand -hex 32`), got {len(value.encode())}")
    lowered = value.lower()
    _check(not any(p in lowered for p in _PLACEHOLDERS) and len(set(value)) > 4, field,
           "looks like a placeholder: generate one, e.g. `openssl rand -hex 32`")


_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1, "float8_e4m3fn": 1}


@dataclasses.dataclass(frozen=True, slots=True)
class LayoutConfig:
    """The KV layout a standalone agent serves (inside vLLM the connector derives it from the engine).

    Defaults describe the tiny test model on vLLM CPU: (blocks, kv_heads, 128, 2*head_size) bf16.
    """

    # The model's identity in the layout fingerprint: nodes share chunks only under the same one
    # (``lmcache-p2p identity MODEL`` prints a model's). Inside vLLM it comes from the model's files; set
    # here, it pins the identity by name.
    model_id: str = "lmcache-p2p/tiny-llama"
    kv_dtype: str = "bfloat16"  # element type of the KV cache (its bytes per element size the chunks)
    num_layers: int = 4  # layers of the model: a chunk holds every layer's KV for its tokens
    num_kv_heads: int = 2  # KV heads of the model, every tensor-parallel rank's together
    head_size: int = 64  # elements per head per token, of K and of V each
    block_size: int = 128  # tokens per engine KV block; chunk_size must be a multiple of it
    # Order of a block's bytes: ``vllm-cpu`` (vLLM on CPU's), ``vllm-cpu+<digest>`` (another order the
    # engine's probe measured) or ``vllm-<device>:<backend>:<order>`` on GPUs. Head-major ones (the CPU
    # layouts, GPU orders LBHNC and BLHNC) share chunks across tensor-parallel sizes.
    kv_layout: str = "vllm-cpu"
    # A tenant's salt in the layout fingerprint: engines with different salts never share chunks; objects are
    # sealed under a key of it, ``invalidate --tenant SALT`` drops its chunks. "": no tenant. Inside vLLM only
    # kv_connector_extra_config sets it (layout.tenant_salt there or under overrides), not a file or the env.
    tenant_salt: str = ""

    def __post_init__(self) -> None:
        _check(self.kv_dtype in _DTYPE_BYTES, "layout.kv_dtype", f"must be one of {sorted(_DTYPE_BYTES)}")
        for name in ("num_layers", "num_kv_heads", "head_size", "block_size"):
            _check(getattr(self, name) > 0, f"layout.{name}", "must be > 0")

    def block_bytes(self) -> int:
        """Bytes of one engine block of one layer (K and V)."""
        return 2 * self.num_kv_heads * self.block_size * self.head_size * _DTYPE_BYTES[self.kv_dtype]

    def chunk_bytes(self, chunk_size: int) -> int:
        """Bytes of one full chunk: every layer's blocks that hold ``chunk_size`` tokens."""
        blocks = -(-chunk_size // self.block_size)
        return self.num_layers * blocks * self.block_bytes()


ENGINE_POOLS = ("mixed", "prefill", "decode")


def valid_engine_url(url: str) -> bool:
    """An engine's base URL as the router accepts it: http(s), a host, no query or fragment, <= 512 chars."""
    if not isinstance(url, str) or len(url) > 512:
        return False
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname) and not parts.query and not parts.fragment


@dataclasses.dataclass(frozen=True, slots=True)
class AgentConfig:
    # This node's name in the cluster (its etcd record is ``nodes/<node_id>``). Default: host name and
    # process id, a new one at each restart. Under tensor parallelism each rank's agent is ``<node_id>-r<rank>``.
    node_id: str = dataclasses.field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    # The mesh this node joins: its etcd keys live under ``/lmcache-p2p/v1/<cluster>/`` and only nodes of the
    # same cluster see each other (object names carry it too).
    cluster: str = "default"
    # Tokens per chunk, the unit keyed, stored and pulled: nodes share chunks only with the same size (keys
    # differ otherwise). A multiple of layout.block_size (inside vLLM, the engine's block size).
    chunk_size: int = 256
    # Port of this node's HTTP server (/metrics and /v1/score) on metrics_host. None: no server and no
    # metrics URL in the node record (status and the router get nothing from this node); 0: a free port.
    # A fixed one is offset by the rank under tensor parallelism.
    metrics_port: int | None = None
    # Where /metrics and /v1/score bind. Loopback by default: nothing unauthenticated is exposed unless
    # asked. The node record advertises this host when it is a specific address, the transfer advertise
    # host when it is a wildcard (advertised_hosts); loopback beside a non-loopback transfer address is
    # warned about at start: `status`, routers and peers on other machines can't reach it.
    metrics_host: str = "127.0.0.1"
    # When set, /v1/score answers only requests carrying `Authorization: Bearer <this key>` (the router's
    # --score-key-file); /metrics stays open to scrapers. None: anyone who reaches metrics_host may score
    # prompts, and so learn whether a guessed prompt is cached. LMCACHE_P2P_SCORE_API_KEY in the environment.
    score_api_key: str | None = dataclasses.field(default=None, repr=False)
    layout: LayoutConfig = LayoutConfig()
    tiers: TierConfig = TierConfig()
    etcd: EtcdConfig = EtcdConfig()
    transfer: TransferConfig = TransferConfig()
    handoff: HandoffConfig = HandoffConfig()
    objects: ObjectsConfig = ObjectsConfig()
    canary: CanaryConfig = CanaryConfig()
    blend: BlendConfig = BlendConfig()
    log_level: str | None = None  # of the ``lmcache_p2p`` loggers (None: as the process set it up)
    # The OpenAI-compatible URL of the engine this agent runs in (e.g. ``http://10.0.0.5:8000``),
    # published in the node record for ``lmcache-p2p router``.
    engine_url: str | None = None
    # Which of the router's pools this engine is in: "mixed" (whole requests), or "prefill" / "decode" for a
    # router run with --disaggregated.
    engine_pool: str = "mixed"
    # Filled by load_config: the dotted fields this node's file, environment or overrides set. The
    # cluster config in etcd never changes them (coordinator/apply.py).
    set_by_node: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check(re.match(r"^[A-Za-z0-9_.\-]{1,128}$", self.node_id) is not None, "node_id",
               "must be 1-128 chars of [A-Za-z0-9_.-]")
        _check(re.match(r"^[A-Za-z0-9_.\-]{1,64}$", self.cluster) is not None, "cluster",
               "must be 1-64 chars of [A-Za-z0-9_.-]")
        _check(0 < self.chunk_size <= 65520 and self.chunk_size % 16 == 0, "chunk_size",
               "must be a positive multiple of 16, at most 65520")
        _check(self.metrics_port is None or 0 <= self.metrics_port < 65536, "metrics_port", "must be in [0, 65535]")
        _check(self.score_api_key is None or len(self.score_api_key.strip()) >= 16, "score_api_key",
               "must be at least 16 characters (e.g. `openssl rand -hex 16`), or unset")
        if isinstance(self.log_level, str):
            object.__setattr__(self, "log_level", self.log_level.upper())
        _check(self.log_level is None or self.log_level in LOG_LEVELS, "log_level", f"must be one of {LOG_LEVELS}")
        _check(self.chunk_size % self.layout.block_size == 0, "chunk_size",
               f"must be a multiple of layout.block_size ({self.layout.block_size})")
        _check(self.engine_url is None or valid_engine_url(self.engine_url), "engine_url",
               "must be an http(s)://host[:port] URL")
        _check(self.engine_pool in ENGINE_POOLS, "engine_pool", f"must be one of {ENGINE_POOLS}")


def rank_config(config: AgentConfig, rank: int, tp_size: int) -> AgentConfig:
    """Each tensor-parallel rank runs its own agent: node id ``<node>-r<rank>``, its own disk
    subdirectory, transfer and metrics ports offset by the rank (when fixed), and an equal share of
    the configured tier capacities (they are the engine's). TP 1 keeps the config as it is."""
    if tp_size <= 1:
        return config
    tiers = dataclasses.replace(
        config.tiers, cpu_capacity=config.tiers.cpu_capacity // tp_size,
        disk_capacity=config.tiers.disk_capacity // tp_size,
        disk_path=str(Path(config.tiers.disk_path) / f"r{rank}") if config.tiers.disk_path else None)
    transfer = dataclasses.replace(config.transfer, port=config.transfer.port + rank if config.transfer.port else 0)
    return dataclasses.replace(
        config, node_id=f"{config.node_id}-r{rank}", tiers=tiers, transfer=transfer,
        metrics_port=config.metrics_port + rank if config.metrics_port else config.metrics_port)


def load_config(
    path: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> AgentConfig:
    """Build an :class:`AgentConfig` from file, environment and overrides (dotted keys). With no
    ``path``, the file named by ``LMCACHE_P2P_CONFIG`` (if set) in ``env``."""
    merged: dict[str, Any] = {}
    if path is None:
        path = (os.environ if env is None else env).get(CONFIG_ENV) or None
    if path is not None:
        _merge(merged, _read_file(Path(path)))
    _merge(merged, _from_env(os.environ if env is None else env))
    for dotted, value in (overrides or {}).items():
        _merge(merged, _nest(dotted, value))
    merged.pop("set_by_node", None)  # not a setting
    config = _build(AgentConfig, merged, "")
    return dataclasses.replace(config, set_by_node=tuple(sorted(_dotted(merged))))


def _sections() -> set[str]:
    """AgentConfig's fields that are config sections (dataclasses)."""
    hints = typing.get_type_hints(AgentConfig)
    return {f.name for f in dataclasses.fields(AgentConfig) if dataclasses.is_dataclass(hints[f.name])}


def _dotted(tree: Mapping[str, Any], prefix: str = "") -> list[str]:
    out: list[str] = []
    for key, value in tree.items():
        if isinstance(value, Mapping) and key in _sections():
            out += _dotted(value, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}")
    return out


def _read_file(path: Path) -> dict[str, Any]:
    text = path.read_text()
    if path.suffix == ".toml":
        data: Any = tomllib.loads(text)
    elif path.suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(text) or {}
    elif path.suffix == ".json":
        data = json.loads(text)
    else:
        raise ConfigError("config", f"unknown config file type {path.suffix!r} (use .yaml, .toml or .json)")
    if not isinstance(data, dict):
        raise ConfigError("config", f"{path} must hold a mapping at top level")
    return data


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    sections = _sections()
    for name, value in env.items():
        if not name.startswith(ENV_PREFIX) or name in (ENV_PREFIX + "SECRET", CONFIG_ENV):
            continue
        rest = name[len(ENV_PREFIX):].lower()
        section, _, field = rest.partition("_")
        if section in sections and field:
            if field in _field_names(section):
                _merge(out, {section: {field: value}})
        elif rest in {f.name for f in dataclasses.fields(AgentConfig)}:
            out[rest] = value
    return out


def _field_names(section: str) -> set[str]:
    hint = typing.get_type_hints(AgentConfig)[section]
    return {f.name for f in dataclasses.fields(hint)}


def _nest(dotted: str, value: Any) -> dict[str, Any]:
    head, _, tail = dotted.partition(".")
    return {head: _nest(tail, value) if tail else value}


def _merge(dst: dict[str, Any], src: Mapping[str, Any]) -> None:
    for k, v in src.items():
        if isinstance(v, Mapping) and isinstance(dst.get(k), dict):
            _merge(dst[k], v)
        else:
            dst[k] = dict(v) if isinstance(v, Mapping) else v


def _build(cls: type, data: Mapping[str, Any], prefix: str) -> Any:
    if not isinstance(data, Mapping):
        raise ConfigError(prefix.rstrip(".") or "config", f"expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    for name in data:
        if name not in known:
            raise ConfigError(f"{prefix}{name}", f"unknown field (known: {', '.join(sorted(known))})")
    kwargs = {}
    for name, value in data.items():
        field = f"{prefix}{name}"
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value, f"{field}.")  # type: ignore[arg-type]
        else:
            kwargs[name] = _coerce(value, hint, field)
    return cls(**kwargs)


def _coerce(value: Any, hint: Any, field: str) -> Any:
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        if value is None or (isinstance(value, str) and value.lower() in ("", "none", "null")):
            if type(None) in args:
                return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], field)
    if field.endswith(("capacity", "_bytes", "_bytes_per_s")) and hint is int:
        return parse_size(value, field)
    if typing.get_origin(hint) is tuple:
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            raise ConfigError(field, f"expected a list, got {value!r}")
        return tuple(_coerce(i.strip() if isinstance(i, str) else i, args[0], field) for i in items)
    try:
        if hint is bool:
            if isinstance(value, str):
                if value.lower() in ("1", "true", "yes", "on"):
                    return True
                if value.lower() in ("0", "false", "no", "off"):
                    return False
                raise ValueError(value)
            if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
                return bool(value)
            raise ValueError(value)  # a 3 or a list is not taken for true
        if hint is int and not isinstance(value, bool):
            return int(value)
        if hint is float and not isinstance(value, bool):
            return float(value)
        if hint is str:
            if not isinstance(value, (str, int)):
                raise ValueError(value)
            return str(value)
    except (TypeError, ValueError):
        pass
    raise ConfigError(field, f"expected {getattr(hint, '__name__', hint)}, got {value!r}")


def cluster_secret(config: AgentConfig, env: Mapping[str, str] | None = None) -> bytes | None:
    """The cluster secret: ``transfer.secret`` or the ``LMCACHE_P2P_SECRET`` environment variable."""
    if config.transfer.secret:
        return config.transfer.secret.encode()
    value = (os.environ if env is None else env).get(ENV_PREFIX + "SECRET")
    if value:
        check_secret(value, ENV_PREFIX + "SECRET")
    return value.encode() if value else None


SECRET_HOWTO = (f"set {ENV_PREFIX}SECRET in the environment of every node (the same value everywhere, e.g. "
                f"`export {ENV_PREFIX}SECRET=$(openssl rand -hex 32)`) or transfer.secret in the config file")


def require_secret(config: AgentConfig, env: Mapping[str, str] | None = None) -> bytes:
    """The cluster secret, or a :class:`ConfigError` saying how to set it."""
    secret = cluster_secret(config, env)
    if not secret:
        raise ConfigError("transfer.secret", f"no cluster secret: {SECRET_HOWTO}")
    return secret


# -- where peers reach this node ------------------------------------------------------------------

WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "", "*", "[::]"})
_PROBE_ADDRESS = ("8.8.8.8", 80)  # never sent to: a UDP connect only picks the outward route


def is_wildcard(host: str) -> bool:
    return host.strip() in WILDCARD_HOSTS


def is_loopback(host: str) -> bool:
    if host.strip().lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def detect_host() -> str | None:
    """This host's outward address, as vLLM finds it: the source address of the route to a public
    address (a UDP ``connect`` sends nothing), else the host name's address unless it is loopback."""
    for family, target in ((socket.AF_INET, _PROBE_ADDRESS), (socket.AF_INET6, ("2001:4860:4860::8888", 80))):
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(target)
                host = str(s.getsockname()[0])
        except OSError:
            continue
        if not is_wildcard(host) and not is_loopback(host):
            return host
    try:
        host = socket.gethostbyname(socket.gethostname())
    except OSError:
        return None
    return None if is_loopback(host) or is_wildcard(host) else host


@dataclasses.dataclass(frozen=True, slots=True)
class AdvertisedHosts:
    """What a node's record says about where it is: ``transfer`` (peers dial it) and ``metrics`` (the
    host of ``metrics_url``); ``detected``: the transfer host was detected, not configured; ``warnings``:
    what to log at start."""

    transfer: str
    metrics: str
    detected: bool = False
    warnings: tuple[str, ...] = ()


def advertised_hosts(config: AgentConfig, detect: Callable[[], str | None] = detect_host) -> AdvertisedHosts:
    """Resolve the hosts a node advertises; :class:`ConfigError` when a wildcard listen host has no
    advertise host and none can be detected (peers would dial 0.0.0.0, themselves)."""
    tc = config.transfer
    transfer, detected = tc.advertise_host or tc.listen_host, False
    if tc.advertise_host is not None and is_wildcard(tc.advertise_host):
        raise ConfigError("transfer.advertise_host", f"{tc.advertise_host!r} is a wildcard, not an address "
                          "peers can dial: set this node's own IP or DNS name")
    if tc.advertise_host is None and is_wildcard(tc.listen_host):
        found = detect()
        if not found:
            raise ConfigError("transfer.advertise_host", f"transfer.listen_host is {tc.listen_host!r} (every "
                              "interface) and no outward address of this host could be detected: set "
                              "transfer.advertise_host (or LMCACHE_P2P_TRANSFER_ADVERTISE_HOST) to the IP "
                              "or name peers reach this node at")
        transfer, detected = found, True
    metrics = transfer if is_wildcard(config.metrics_host) else config.metrics_host
    warnings = []
    if config.metrics_port is not None and is_loopback(metrics) and not is_loopback(transfer):
        warnings.append(f"metrics_host is {config.metrics_host} (loopback) while peers reach this node at "
                        f"{transfer}: lmcache-p2p status, routers and peers on other machines can't reach its "
                        f"/metrics or /v1/score (they call it unresponsive); set metrics_host to 0.0.0.0 or "
                        f"{transfer}")
    return AdvertisedHosts(transfer, metrics, detected, tuple(warnings))


# -- vLLM's kv_connector_extra_config ---------------------------------------------------------------

EXTRA_CONFIG_KEYS = ("config", "overrides", "keep_fail_policy")  # besides dotted config fields


def extra_config_overrides(extra: Mapping[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """``(config file, dotted overrides)`` from vLLM's ``kv_connector_extra_config``: ``"overrides"``
    and flat dotted keys beside it (``{"transfer.listen_host": "0.0.0.0"}``), the flat ones last. A key
    that is neither one of :data:`EXTRA_CONFIG_KEYS` nor a config field is a :class:`ConfigError`."""
    nested = extra.get("overrides") or {}
    if not isinstance(nested, Mapping):
        raise ConfigError("kv_connector_extra_config.overrides", "must be a mapping of dotted config keys")
    overrides = dict(nested)
    for key, value in extra.items():
        if key in EXTRA_CONFIG_KEYS:
            continue
        if not _known_dotted(key):
            raise ConfigError(f"kv_connector_extra_config.{key}",
                              f"unknown key: neither one of {EXTRA_CONFIG_KEYS} nor a config field "
                              "(dotted, e.g. transfer.listen_host)")
        overrides[key] = value
    path = extra.get("config")
    return (str(path) if path else None), overrides


def _known_dotted(key: str) -> bool:
    head, _, tail = key.partition(".")
    if head in _sections():
        return bool(tail) and tail in _field_names(head)
    return not tail and head in {f.name for f in dataclasses.fields(AgentConfig)} and head != "set_by_node"
