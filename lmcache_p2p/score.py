"""Where a prompt's cache is: the score a router asks every agent for, ``POST /v1/score``.

    POST /v1/score  {"tokens": [ids...], "model": "<model id>" (optional),
                     "segments": [[start, end], ...] (optional: the prompt's documents, as a request
                                                     declares them in kv_transfer_params),
                     "blend": true | false (optional: whether the request asks to be blended;
                                            default this agent's blend.by_default)}
    200 {"fingerprint", "model", "tokens", "chunk_size", "segments",
         "nodes": [{"node", "role", "matched_tokens", "segment_tokens", "recompute_tokens",
                    "computed_tokens", "local_tokens": {tier: n}, "peer_tokens", "sources": {peer: tokens},
                    "estimated_load_ms", "estimated_compute_ms", "estimated_ttft_ms"}, ...],  best first
         "best": "<node id>" | null}
    4xx {"error": "..."}  bad JSON, no or non-integer tokens, malformed segments, a model not served
                          here, a body over MAX_BODY_BYTES; never a crash

Every node serving this agent's fingerprint with all of its KV heads (an engine, not one TP rank)
is scored from this agent's mirror of the index with that node's own planner (``plan.make_plan``):
leading chunks it holds itself (by tier), then chunks usable peers hold (the least-loaded holder;
pieces from the ranks of a TP engine), until the first chunk nobody holds. Estimates use this agent's
measurements: its pull-time model per source peer (pulls from several peers overlap), a local
read rate, and its engine's prefill rate for the tokens left to compute (unknown until it
prefilled once: then only the load is estimated).

Segments (RAG documents, ``segments.py``) of a request that asks to be blended: after a
node's exact prefix (``matched_tokens``), its blend is planned as its scheduler side plans it
(``plan_blend``, with this agent's ``blend`` settings): a declared segment is held there when the node
holds or can pull all of its chunks.
``segment_tokens`` are the held segments' tokens the blend places, ``recompute_tokens`` what it runs
through the model (glue, each segment's recompute fraction, segments held nowhere computed fresh),
``computed_tokens`` every prompt token the node would compute (``num_tokens - matched_tokens`` without a
blend). The segment chunks' loads count in ``estimated_load_ms`` (and in ``local_tokens``,
``peer_tokens``, ``sources``), the computed tokens in ``estimated_compute_ms``. The score assumes every
engine blends; one that does not (``blend.enabled`` false, a refused setting, a request's own fraction)
reuses documents differently. Without segments, or without a blend asked for, ``segment_tokens`` and
``recompute_tokens`` are 0.

Ties (a prompt nobody holds) are broken by rendezvous hashing on the prompt's first chunk: new
documents spread over the nodes, and each keeps going to the same one. The served HTTP is the agent's
metrics port (``/metrics`` stays as it was); the HTTP itself is the standard library's WSGI server.
"""

from __future__ import annotations

import dataclasses
import functools
import hmac
import itertools
import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import xxhash

from .config import AgentConfig, BlendConfig
from .estimates import PeerEstimates, PrefillRate
from .ids import TIER_NAMES, NodeId
from .index.protocol import BlockIndex
from .index.schema import NodeRecord
from .keys import ChunkKey, Fingerprint, FingerprintDigest, HeadRange, chunk_keys, chunk_spans, tokens_to_array
from .plan import LOCAL, HitPlan, PlannedChunk, make_plan
from .request_params import SEGMENTS_PARAM, ParamError, read_spans
from .segments import BlendPlan, SegmentChunks, plan_blend
from .segments import segment_chunks as segment_chunks_of

MAX_BODY_BYTES = 4 << 20  # 1M token ids as JSON
MAX_TOKENS = 1 << 18  # a prompt longer than any context served here: 413
LOCAL_READ_GBPS = 4.0  # a local hit's copy-out (bench mesh: 4.2 GB/s)


@dataclasses.dataclass(frozen=True)
class Scorer:
    """What scoring reads, given by its agent once the index is up (never the agent itself).

    ``settings``: the agent's config, read at each request (``blend.*`` change live); ``holds``: this
    node holds a chunk with its engine's heads; ``usable``: a peer this node can pull from now;
    ``record``: this node's record (scored even before the mirror holds it)."""

    settings: Callable[[], AgentConfig]
    fingerprint: Fingerprint
    node_id: NodeId
    chunk_bytes: int
    index: BlockIndex | None
    peer_estimates: PeerEstimates
    prefill: PrefillRate
    holds: Callable[[ChunkKey], bool]
    usable: Callable[[NodeRecord | None], bool]
    record: Callable[[], NodeRecord]

    @property
    def fp(self) -> FingerprintDigest:
        return self.fingerprint.digest


@dataclasses.dataclass(frozen=True, slots=True)
class ScoreRequest:
    tokens: list[int]
    segments: list[tuple[int, int]] | None = None  # declared segments (documents)
    blend: bool | None = None  # whether the request asks to be blended (None: blend.by_default)


class ScoreError(ValueError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


Owners = dict[NodeId, int]  # holder -> tier byte


def parse_request(body: bytes, model_id: str) -> ScoreRequest:
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ScoreError(400, f"body is not JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ScoreError(400, "body must be a JSON object with 'tokens'")
    tokens = data.get("tokens")
    if not isinstance(tokens, list) or not tokens:
        raise ScoreError(400, "'tokens' must be a non-empty list of token ids")
    if len(tokens) > MAX_TOKENS:
        raise ScoreError(413, f"{len(tokens)} tokens: at most {MAX_TOKENS} are scored")
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in tokens):
        raise ScoreError(400, "'tokens' must hold integers in [0, 2^31)")
    model = data.get("model")
    if model is not None and model != model_id:
        raise ScoreError(404, f"model {str(model)[:200]!r} is not served here (this agent serves {model_id!r})")
    blend = data.get("blend")
    if blend is not None and not isinstance(blend, bool):
        raise ScoreError(400, "'blend' must be true or false")
    try:
        raw = data.get("segments")
        segments = read_spans(raw, len(tokens)) if raw is not None else None
    except ParamError as exc:
        raise ScoreError(400, f"'segments': {str(exc).removeprefix(SEGMENTS_PARAM + ': ')}") from exc
    return ScoreRequest(tokens, segments, blend)


def score(scorer: Scorer, tokens: list[int], segments: list[tuple[int, int]] | None = None,
          blend: bool | None = None) -> dict[str, Any]:
    """The score of every engine of this fingerprint for ``tokens`` with its declared ``segments``, blended
    when ``blend`` (None: ``blend.by_default``); see the module docstring."""
    config = scorer.settings()
    arr = tokens_to_array(tokens)
    keys, spans = chunk_keys(scorer.fp, arr, config.chunk_size), chunk_spans(len(arr), config.chunk_size)
    blends = config.blend.by_default if blend is None else blend
    declared = (segment_chunks_of(scorer.fp, tokens, segments, config.chunk_size, config.blend.lead_in)
                if segments and blends else [])
    every = keys + [ChunkKey(k) for seg in declared for k in seg.keys]
    index = scorer.index
    nodes = index.nodes() if index is not None else {}
    found = index.owners(scorer.fp, every) if index is not None else [{} for _ in every]
    fp_hex, total = scorer.fp.hex(), scorer.fingerprint.num_kv_heads
    me = scorer.node_id
    if me not in nodes:  # our own record may not be in the mirror yet (etcd down)
        nodes = {**nodes, me: scorer.record()}
        found = [{**o, me: 0} if scorer.holds(k) else o for o, k in zip(found, every, strict=True)]
    by_key = dict(zip(every, found, strict=True))
    usable: dict[NodeId, bool] = {}

    def can_pull(node: NodeId) -> bool:
        if node not in usable:
            record = nodes.get(node)
            usable[node] = record is not None and (node == me or scorer.usable(record))
        return usable[node]

    def heads_of(node: NodeId) -> HeadRange:  # asked only of nodes can_pull passed: they have a record
        return nodes[node].heads_of(fp_hex, total)

    def plan_at(node: NodeId, chunks: Sequence[ChunkKey], chunk_spans: list[tuple[int, int]]) -> HitPlan:
        return _plan_of(node, list(chunks), chunk_spans, [by_key[k] for k in chunks], can_pull, heads_of, (0, total),
                        len(arr))

    rows = []
    for node, record in nodes.items():
        if fp_hex not in record.fingerprints or record.heads_of(fp_hex, total) != (0, total):
            continue
        plan = plan_at(node, keys, spans)
        blended, loads = (_blend_of(declared, plan.hit_tokens, len(arr), functools.partial(plan_at, node),
                                    config.blend, config.layout.num_layers) if declared else (None, []))
        rows.append(_score_plan(scorer, node, record.role, plan, blended, loads, by_key, len(arr)))
    # Ties (a prompt nobody holds) go by rendezvous hashing on the prompt's first chunk: one document
    # keeps going to one node while different documents spread over all of them.
    first = bytes(keys[0]) if keys else b""
    rows.sort(key=lambda r: (r["estimated_ttft_ms"], -r["matched_tokens"] - r["segment_tokens"],
                             xxhash.xxh3_64_intdigest(first + r["node"].encode())))
    return {"fingerprint": fp_hex, "model": scorer.fingerprint.model_id, "tokens": len(arr),
            "chunk_size": config.chunk_size, "segments": len(declared), "nodes": rows,
            "best": rows[0]["node"] if rows else None}


def _blend_of(declared: list[SegmentChunks], exact_end: int, num_tokens: int,
              plan_at: Callable[[Sequence[ChunkKey], list[tuple[int, int]]], HitPlan],
              blend: BlendConfig, num_layers: int) -> tuple[BlendPlan | None, list[PlannedChunk]]:
    """The blend a node's scheduler side would plan over the declared segments after its exact prefix
    (``plan_blend``: a segment is held when its node can have all of its chunks: ``plan_at``; a blend
    costing more than ``blend.max_recompute_tokens`` is refused), and the chunks that blend loads."""
    spans = {seg.keys[0]: list(itertools.pairwise(itertools.accumulate(seg.num_tokens, initial=0)))
             for seg in declared}
    plans: dict[bytes, HitPlan] = {}

    def held(seg_keys: list[bytes]) -> bool:
        plans[seg_keys[0]] = plan = plan_at([ChunkKey(k) for k in seg_keys], spans[seg_keys[0]])
        return len(plan.chunks) == len(seg_keys)

    planned = plan_blend(declared, exact_end, num_tokens, held, blend.recompute_fraction, blend.selection,
                         num_layers)
    if planned is None or planned.cost_tokens > blend.max_recompute_tokens:
        return None, []
    return planned, [c for seg in planned.segments if not seg.fresh for c in plans[seg.keys[0]].chunks]


def _plan_of(node: NodeId, keys: list[ChunkKey], spans: list[tuple[int, int]], owners: list[Owners],
             can_pull: Callable[[NodeId], bool], heads_of: Callable[[NodeId], HeadRange], need: HeadRange,
             num_tokens: int) -> HitPlan:
    """The plan ``node``'s own planner would make (``CacheAgent.plan``: ``make_plan``): the chunks it
    holds, then usable peers', nothing in flight; usable as this agent sees its peers."""
    held = {key: node in holders for key, holders in zip(keys, owners, strict=True)}
    others = [{n: t for n, t in holders.items() if n != node} for holders in owners]
    return make_plan(keys, spans, local=held.__getitem__, owners=lambda _keys: others, usable=can_pull,
                     inflight={}, num_tokens=num_tokens, need=need, heads_of=heads_of)


def _score_plan(scorer: Scorer, node: NodeId, role: str, plan: HitPlan, blend: BlendPlan | None,
                loads: list[PlannedChunk], owners: dict[ChunkKey, Owners], num_tokens: int) -> dict[str, Any]:
    local: dict[str, int] = {}
    sources: dict[str, int] = {}  # tokens per peer (each piece of a chunk carries all of its tokens)
    pulled: dict[NodeId, int] = {}  # bytes per peer
    local_bytes = peer_tokens = 0
    for chunk in (*plan.chunks, *loads):
        tokens = chunk.end - chunk.start
        if chunk.source == LOCAL:
            tier = TIER_NAMES.get(owners[chunk.key][node], "cpu")
            local[tier] = local.get(tier, 0) + tokens
            local_bytes += scorer.chunk_bytes
            continue
        peer_tokens += tokens
        width = chunk.heads[1] - chunk.heads[0]
        for part in chunk.parts():  # a piece is its share of the chunk's bytes
            share = scorer.chunk_bytes * (part.heads[1] - part.heads[0]) // width
            sources[part.source] = sources.get(part.source, 0) + tokens
            pulled[part.source] = pulled.get(part.source, 0) + share
    matched = plan.hit_tokens
    segment = sum(seg.end - seg.start - seg.skip for seg in blend.segments if not seg.fresh) if blend else 0
    recomputed = blend.cost_tokens if blend is not None else 0
    computed = num_tokens - (blend.end if blend is not None else matched) + recomputed
    pull_s = max((scorer.peer_estimates.expected_s(p, n) for p, n in pulled.items()), default=0.0)
    load_s = pull_s + local_bytes / (LOCAL_READ_GBPS * 1e9)
    compute_s = scorer.prefill.recompute_s(computed) if computed > 0 else 0.0
    return {
        "node": node, "role": role, "matched_tokens": matched, "segment_tokens": segment,
        "recompute_tokens": recomputed, "computed_tokens": computed, "local_tokens": local,
        "peer_tokens": peer_tokens, "sources": sources,
        "estimated_load_ms": round(1e3 * load_s, 3),
        "estimated_compute_ms": None if compute_s is None else round(1e3 * compute_s, 3),
        "estimated_ttft_ms": round(1e3 * (load_s + (compute_s or 0.0)), 3),
    }


def http_app(metrics_app: Callable[..., Iterable[bytes]], scorer: Callable[[], Scorer | None],
             api_key: str | None = None) -> Callable[..., Iterable[bytes]]:
    """The agent's HTTP: ``/v1/score`` here (``scorer()``: None until the agent is started: 503; with
    ``api_key``, 401 without ``Authorization: Bearer <api_key>``), everything else to the Prometheus app."""
    expected = f"Bearer {api_key}".encode() if api_key else None

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != "/v1/score":
            return metrics_app(environ, start_response)
        try:
            if expected is not None and not hmac.compare_digest(
                    environ.get("HTTP_AUTHORIZATION", "").encode("utf-8", "replace"), expected):
                raise ScoreError(401, "send Authorization: Bearer <score_api_key>")
            if environ.get("REQUEST_METHOD") != "POST":
                raise ScoreError(405, "use POST with a JSON body")
            try:
                length = int(environ.get("CONTENT_LENGTH") or 0)
            except ValueError as exc:
                raise ScoreError(400, "bad Content-Length") from exc
            if length <= 0:
                raise ScoreError(400, "empty body: send {\"tokens\": [...]}")
            if length > MAX_BODY_BYTES:
                raise ScoreError(413, f"body of {length} bytes exceeds {MAX_BODY_BYTES}")
            body = environ["wsgi.input"].read(length)
            now = scorer()
            if now is None:
                raise ScoreError(503, "the agent is starting: nothing to score yet")
            asked = parse_request(body, now.fingerprint.model_id)
            status, payload = 200, score(now, asked.tokens, asked.segments, asked.blend)
        except ScoreError as exc:
            status, payload = exc.status, {"error": str(exc)}
        except Exception as exc:  # a scoring bug must not take the metrics server down
            status, payload = 500, {"error": f"{type(exc).__name__}: {exc}"}
        data = json.dumps(payload).encode()
        reason = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed",
                  413: "Payload Too Large", 500: "Internal Server Error", 503: "Service Unavailable"}[status]
        start_response(f"{status} {reason}", [("Content-Type", "application/json"),
                                              ("Content-Length", str(len(data)))])
        return [data]

    return app
