"""What a node announces of itself: its :class:`~lmcache_p2p.index.schema.NodeRecord` (where peers dial it,
what it serves, its tiers' capacities, the cluster config it runs) and the proof of the engine it announces.

The agent (``agent.py``) gathers what is live (its transfer stack's ports, its /metrics server, the hand-off's
free bytes, the config revision applied) and :meth:`Advert.record` makes the record from it; the index
publishes it under the node's lease and republishes it when it changes. Routers use an announced engine
only with a valid proof (``router/proof.py``): signed with the node's transfer TLS key where it has one (a
router given the transfer CA accepts no other), else keyed by the router key of the cluster secret.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from . import __version__
from .config import AdvertisedHosts, AgentConfig, advertised_hosts, cluster_secret, is_wildcard
from .ids import WIRE_VERSION, NodeId
from .index.schema import NodeRecord, Served, tenant_digest
from .keys import Fingerprint, HeadRange
from .router.proof import engine_proof, router_key, signed_engine_proof

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Live:
    """What changes while the node runs, read by the agent each time its record is made."""

    transfer: Mapping[str, Any]  # the transfer stack's part (``Transfers.node_record``): host, port, transports
    metrics_port: int | None  # of the running /metrics server (None: none)
    capacities: Mapping[str, int]  # bytes per tier
    free: Mapping[str, int]  # what the hand-off may still send here (``Handoff.free``)
    config: AgentConfig  # the config applied now (live fields of the cluster config included)
    config_revision: int
    config_deviations: Mapping[str, str]


class Advert:
    """The record of one node: its identity fixed at start, the rest from :class:`Live`."""

    def __init__(self, node_id: NodeId, fingerprint: Fingerprint, heads: HeadRange, role: str,
                 secret: bytes | None) -> None:
        self.node_id = node_id
        self.fingerprint = fingerprint
        self.heads = heads
        self.role = role
        self._secret = secret
        self._proof: tuple[tuple[str, str, str | None], str | None] | None = None  # (what it proves, the proof)
        self._config: AgentConfig | None = None  # the config the hosts are resolved from (the first one seen)

    def record(self, live: Live) -> NodeRecord:
        c = live.config
        if self._config is None:
            self._config = c
        metrics_url = None
        if live.metrics_port is not None:  # the host its server binds (or ours, when it binds every one)
            host = self.hosts.metrics
            metrics_url = f"http://{f'[{host}]' if ':' in host else host}:{live.metrics_port}/metrics"
        host = str(live.transfer.get("host"))
        address = f"{self.hosts.transfer if is_wildcard(host) else host}:{live.transfer.get('port')}"
        fp = self.fingerprint
        return NodeRecord(
            node_id=self.node_id,
            addresses={t: address for t in live.transfer.get("transports", ())},
            transports=tuple(live.transfer.get("transports", ())),
            served={fp.digest.hex(): Served(
                model=fp.model_id,
                tenant=tenant_digest(fp.tenant_salt) if fp.tenant_salt else "",
                heads=(*self.heads, fp.num_kv_heads),
                layout=dataclasses.asdict(fp))},  # a layout's salt is published as its digest
            capacities=dict(live.capacities),
            software_version=__version__,
            wire_version=WIRE_VERSION,
            metrics_url=metrics_url,
            tls=c.transfer.tls,
            role=self.role,
            free=dict(live.free),
            config_revision=live.config_revision,
            config_deviations=dict(live.config_deviations),
            engine_url=c.engine_url,
            engine_pool=c.engine_pool,
            engine_proof=self.engine_proof(c, metrics_url),  # routers use the engine announced only with it
        )

    @functools.cached_property
    def hosts(self) -> AdvertisedHosts:
        """Where peers reach this node and its /metrics (``config.advertised_hosts``), resolved once, from the
        first config a record was made with: a wildcard listen host without an advertise host is detected or
        refused (ConfigError)."""
        assert self._config is not None, "a record is made before the hosts are read"
        hosts = advertised_hosts(self._config)
        if hosts.detected:
            log.info("transfer.listen_host is %s: advertising %s, this host's outward address (set "
                     "transfer.advertise_host to choose another)", self._config.transfer.listen_host, hosts.transfer)
        for warning in hosts.warnings:
            log.warning("%s", warning)
        return hosts

    def engine_proof(self, c: AgentConfig, metrics_url: str | None) -> str | None:
        """The proof of the engine ``c`` announces (None: it announces none, or nothing to prove it with).
        Made once per announced engine."""
        if not c.engine_url:
            return None
        what = (c.engine_url, c.engine_pool, metrics_url)
        if self._proof is not None and self._proof[0] == what:
            return self._proof[1]
        proof: str | None = None
        if c.transfer.tls_cert is not None and c.transfer.tls_key is not None:
            proof = signed_engine_proof(Path(c.transfer.tls_cert).read_bytes(), Path(c.transfer.tls_key).read_bytes(),
                                        cluster=c.cluster, node_id=self.node_id, engine_url=c.engine_url,
                                        engine_pool=c.engine_pool, metrics_url=metrics_url)
        else:
            secret = self._secret if self._secret is not None else cluster_secret(c)
            if secret:
                proof = engine_proof(router_key(secret), cluster=c.cluster, node_id=self.node_id,
                                     engine_url=c.engine_url, engine_pool=c.engine_pool, metrics_url=metrics_url)
        self._proof = (what, proof)
        return proof
