"""Worker side (one per GPU / TP rank): the embedded cache agent and the engine's paged KV.

    start_load_kv:  plan (local tiers, then peers) -> load verified chunks into staging
                    -> scatter into the request's blocks; a chunk that fails and every later
                    one are reported by block id, so vLLM recomputes them (fail closed)
    wait_for_save:  gather each new chunk from the engine's blocks straight into a reserved CPU
                    slot (synchronous: the blocks may be reused after the step), then checksum,
                    commit and publish in the background
"""

from __future__ import annotations

import gc
import logging
import os
import time

import torch

from ...agent import CacheAgent
from ...config import AgentConfig, cluster_secret
from ...kernels.paged import PagedKV
from ...keys import ChunkKey, Fingerprint
from ...plan import LOCAL
from .metadata import ChunkTransfer, LMCacheP2PMetadata

log = logging.getLogger(__name__)


class P2PWorker:
    def __init__(self, config: AgentConfig, fingerprint: Fingerprint, block_size: int) -> None:
        self._config = config
        self._fingerprint = fingerprint
        self._blocks_per_chunk = config.chunk_size // block_size
        self._kv: PagedKV | None = None
        self.agent: CacheAgent | None = None
        self._load_errors: set[int] = set()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv = PagedKV(list(kv_caches.values()))
        chunk_bytes = self._kv.payload_nbytes(self._blocks_per_chunk)
        self.agent = CacheAgent(self._config, self._fingerprint, chunk_bytes,
                                secret=cluster_secret(self._config)).start()
        # Everything alive now (model, KV cache, engine state) is long-lived: keep it out of the
        # collector, whose full passes over it stalled the agent's loop for 20-80 ms (measured).
        # LMCACHE_P2P_GC_FREEZE=0 turns this off.
        if os.environ.get("LMCACHE_P2P_GC_FREEZE", "1") != "0":
            gc.freeze()
        log.info("lmcache-p2p worker: %d layers, chunk %d bytes, agent %s", len(kv_caches), chunk_bytes,
                 self.agent.node_id)

    # -- load --------------------------------------------------------------------------------------
    def start_load_kv(self, meta: LMCacheP2PMetadata) -> None:
        for transfer in meta.loads:
            self._load(transfer)

    def _load(self, t: ChunkTransfer) -> None:
        assert self.agent is not None and self._kv is not None
        t0 = time.perf_counter()
        keys = [ChunkKey(k) for k in t.keys]
        spans, pos = [], 0
        for n in t.num_tokens:
            spans.append((pos, pos + n))
            pos += n
        plan = self.agent.plan(keys, spans, pos)
        self.agent.count_lookup(plan, 0)
        t1 = time.perf_counter()
        pins = self.agent.load_pinned(plan) if plan.chunks else []
        t2 = time.perf_counter()
        try:
            for i, blocks in enumerate(t.block_ids):
                pin = pins[i] if i < len(pins) else None
                if pin is not None and pin.header.length != self._kv.payload_nbytes(len(blocks)):
                    log.error("request %s: chunk %d is %d bytes, its %d blocks need %d: layout mismatch", t.req_id,
                              i, pin.header.length, len(blocks), self._kv.payload_nbytes(len(blocks)))
                    pin = None
                if pin is None:
                    failed = [b for later in t.block_ids[i:] for b in later]
                    log.warning("request %s: chunk %d of %d not loadable, %d blocks recomputed", t.req_id, i,
                                len(keys), len(failed))
                    self._load_errors.update(failed)
                    break
                view = self.agent.tiers.cpu.slot_view(pin.slot, pin.header.length)
                self._scatter(torch.frombuffer(view, dtype=torch.uint8), blocks, t.skip_blocks if i == 0 else 0)
        finally:
            for pin in pins:
                if pin is not None:
                    self.agent.unpin_chunk(pin)
        log.debug("request %s: %d chunks (%d from peers) plan %.2f ms, load %.2f ms, scatter %.2f ms", t.req_id,
                  len(keys), len(plan.chunks) - len(plan.by_source().get(LOCAL, [])), 1e3 * (t1 - t0),
                  1e3 * (t2 - t1), 1e3 * (time.perf_counter() - t2))

    def _scatter(self, staging: torch.Tensor, blocks: list[int], skip: int) -> None:
        assert self._kv is not None
        nbytes = self._kv.payload_nbytes(len(blocks))
        payload = staging[:nbytes]
        if skip:
            # Payload is layer-major; drop the first ``skip`` blocks of every layer (they belong to
            # vLLM's own prefix cache and may be shared with other requests).
            layers = self._num_layers()
            per_layer = payload.view(layers, len(blocks), self._kv.payload_nbytes(1) // layers)
            payload = per_layer[:, skip:, :].contiguous().view(-1)
            blocks = blocks[skip:]
        if blocks:
            self._kv.scatter(payload, torch.tensor(blocks, dtype=torch.int64))

    def _num_layers(self) -> int:
        assert self.agent is not None
        return self.agent.config.layout.num_layers

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # -- save ---------------------------------------------------------------------------------------
    def wait_for_save(self, meta: LMCacheP2PMetadata) -> None:
        for transfer in meta.saves:
            self._save(transfer)

    def _save(self, t: ChunkTransfer) -> None:
        agent, kv = self.agent, self._kv
        assert agent is not None and kv is not None
        computed = [n for k, n in zip(t.keys, t.num_tokens, strict=True) if agent.tiers.where(ChunkKey(k)) is None]
        agent.metrics.miss_tokens.inc(sum(computed))  # tokens the engine computed: nothing held them
        for key, ntok, blocks in zip(t.keys, t.num_tokens, t.block_ids, strict=True):
            if agent.tiers.where(ChunkKey(key)) is not None or not blocks:
                continue
            nbytes = kv.payload_nbytes(len(blocks))
            try:
                res = agent.reserve_chunk()
            except Exception as exc:  # a full, pinned pool must not fail the forward pass
                log.warning("request %s: no slot to save a chunk: %s", t.req_id, exc)
                return
            out = torch.frombuffer(res.view, dtype=torch.uint8, count=nbytes)
            kv.gather(torch.tensor(blocks, dtype=torch.int64), out)
            agent.commit_chunk(res, ChunkKey(key), ntok, nbytes)

    def shutdown(self) -> None:
        if self.agent is not None:
            self.agent.stop()
            self.agent = None
