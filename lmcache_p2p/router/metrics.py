"""The router's Prometheus metrics (``/metrics`` of ``lmcache-p2p router``; the reference page is generated
from them)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("lmcache_p2p_router_requests", "requests answered, by engine and outcome",
                                ["engine", "outcome"], registry=r)
        self.retries = Counter("lmcache_p2p_router_retries", "requests sent to another engine after one failed "
                               "before its first byte, by reason", ["reason"], registry=r)
        self.route_seconds = Histogram("lmcache_p2p_router_route_seconds", "tokenize + score + choice, per "
                                       "request", registry=r, buckets=(.001, .0025, .005, .01, .025, .05, .1, .25,
                                                                       .5, 1))
        self.ttft_seconds = Histogram("lmcache_p2p_router_first_byte_seconds", "request in to the engine's first "
                                      "byte out (streaming: first token)", registry=r,
                                      buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60))
        self.prefill_seconds = Histogram("lmcache_p2p_router_disagg_prefill_seconds", "disaggregated: the "
                                         "prefill engine's answer", registry=r,
                                         buckets=(.01, .05, .1, .25, .5, 1, 2.5, 5, 10, 30))
        self.engines = Gauge("lmcache_p2p_router_engines", "engines known, by state", ["state"], registry=r)
        self.score_failures = Counter("lmcache_p2p_router_score_failures", "tokenize or score calls that failed "
                                      "or ran out of time (routed without)", ["call"], registry=r)
        self.documents = Counter("lmcache_p2p_router_documents", "chat requests carrying documents, by outcome: "
                                 "segments (their spans declared), else why not (prefix reuse only)", ["outcome"],
                                 registry=r)
        self.engines_refused = Counter("lmcache_p2p_router_engines_refused", "engines announced in node records "
                                       "and never contacted, by reason (each record as it stands, once)",
                                       ["reason"], registry=r)
        self.refused = Counter("lmcache_p2p_router_refused", "client requests refused by the router's own limits, "
                               "by reason", ["reason"], registry=r)
