"""The worker's save path keeps the pool whole when a gather fails: the reserved slot goes back, the
chunk is just not cached, and later saves still land (a leaked slot per failure would exhaust a pool).
A step whose sync load failed saves none of that request's chunks from the failed one on: the forward
pass ran over blocks that were never loaded, so their KV (and everything after) is wrong until vLLM
recomputes it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

import torch

from lmcache_p2p.agent import CacheAgent
from lmcache_p2p.config import load_config
from lmcache_p2p.keys import ChunkKey, Fingerprint
from lmcache_p2p.testing.memory_index import MemoryIndex, MemoryMesh
from lmcache_p2p.transfers import ChunkTransfer

BLOCK, BLOCK_BYTES = 16, 64


class FlakyKV:
    """Paged KV whose gathers fail while ``failing`` is set."""

    def __init__(self) -> None:
        self.failing = True

    def payload_nbytes(self, num_blocks: int) -> int:
        return num_blocks * BLOCK_BYTES

    def gather(self, blocks: torch.Tensor, out: torch.Tensor) -> None:
        if self.failing:
            raise RuntimeError("gather kernel failed")
        out.fill_(7)

    def scatter(self, payload: torch.Tensor, blocks: torch.Tensor) -> None:
        pass


def run(case: str) -> None:
    # In a process of its own: the worker imports vLLM, which must not load into the test runner.
    r = subprocess.run([sys.executable, __file__, case], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-4000:]


def test_a_failed_gather_returns_its_slot() -> None:
    run("gather")


def test_a_failed_sync_load_saves_nothing_computed_over_it() -> None:
    run("sync-load")


def test_after_a_cache_reset_nothing_is_loaded_until_the_weights_are_read_and_changed_weights_stop_sharing() -> None:
    """The weights' digest after a reset is read on a thread of its own (here held back until released):
    meanwhile a held chunk's load is reported failed and nothing is saved; once read and equal to the
    start's, loads go on; after the weights change, the next reset stops the node's sharing (its agent
    stopped, loads failed, the scheduler told through ``WorkerState``)."""
    run("weights")


def test_kv_laid_out_otherwise_than_the_fingerprint_says_is_refused_and_the_engine_serves() -> None:
    """A KV cache whose strides name another order than the layout fingerprint (its chunks would carry other
    bytes under the same keys) is refused, not fatal: no agent starts, every planned load is reported failed
    (recomputed: never a request left waiting), and the scheduler is told (``WorkerState.stopped_sharing``)."""
    run("layout")


def failed_gather() -> None:
    from lmcache_p2p.integrations.vllm.metadata import LMCacheP2PMetadata
    from lmcache_p2p.integrations.vllm.worker import P2PWorker

    config = load_config(env={}, overrides={"tiers.cpu_capacity": 4 * 16 * BLOCK_BYTES, "node_id": "w"})
    fingerprint = Fingerprint.of(config.layout)
    worker = P2PWorker(config, fingerprint, BLOCK)
    kv = FlakyKV()
    chunk_bytes = kv.payload_nbytes(config.chunk_size // BLOCK)
    mesh = MemoryMesh()
    # the engine's KV, as register_kv_caches gives it to the parts
    worker.attach(CacheAgent(config, fingerprint, chunk_bytes, secret=os.urandom(32),
                             index_factory=lambda loop, record: MemoryIndex(mesh, record)).start(),
                  kv, None)  # type: ignore[arg-type]
    assert worker.agent is not None
    try:
        pool = worker.agent.tiers.cpu
        assert pool.num_slots == 4

        def save(i: int) -> ChunkTransfer:
            return ChunkTransfer(f"r{i}", [bytes([i]) * 16], [config.chunk_size], [list(range(16))], generated=True)

        worker.wait_for_save(LMCacheP2PMetadata(saves=[save(i) for i in range(8)]))  # 8 failures, 4 slots
        assert pool.free_slots == 4 and len(pool) == 0
        kv.failing = False
        worker.wait_for_save(LMCacheP2PMetadata(saves=[save(i) for i in range(8, 11)]))
        worker.agent.intake.drain(10)  # the commits behind the saves are done
        assert sorted(pool.keys()) == [ChunkKey(bytes([i]) * 16) for i in range(8, 11)]
    finally:
        worker.shutdown()
    print("ok")


def attached_worker() -> tuple[Any, Any]:
    """A worker over a started agent (an 8-slot pool, an in-memory index) and working paged KV, as
    register_kv_caches builds its parts: ``(worker, config)``."""
    from lmcache_p2p.integrations.vllm.worker import P2PWorker

    config = load_config(env={}, overrides={"tiers.cpu_capacity": 8 * 16 * BLOCK_BYTES, "node_id": "w"})
    fingerprint = Fingerprint.of(config.layout)
    worker = P2PWorker(config, fingerprint, BLOCK)
    kv = FlakyKV()
    kv.failing = False
    per = config.chunk_size // BLOCK
    worker.attach(CacheAgent(config, fingerprint, kv.payload_nbytes(per), secret=os.urandom(32),
                             index_factory=lambda loop, record: MemoryIndex(MemoryMesh(), record)).start(),
                  kv, None)  # type: ignore[arg-type]
    return worker, config


def failed_sync_load() -> None:
    from lmcache_p2p.integrations.vllm.metadata import LMCacheP2PMetadata

    worker, config = attached_worker()
    chunk, per = config.chunk_size, config.chunk_size // BLOCK
    assert worker.agent is not None
    keys = [bytes([i + 1]) * 16 for i in range(3)]
    blocks = [list(range(i * per, (i + 1) * per)) for i in range(3)]

    def step(meta: LMCacheP2PMetadata) -> set[int]:
        worker.step_started(meta)
        worker.start_load_kv(meta)
        worker.wait_for_save(meta)
        worker.step_finished()
        assert worker.agent is not None
        worker.agent.intake.drain(10)  # the commits behind the saves are done
        return worker.get_block_ids_with_load_errors()

    try:
        pool = worker.agent.tiers.cpu
        step(LMCacheP2PMetadata(saves=[ChunkTransfer("r0", keys[:1], [chunk], blocks[:1])]))  # held: chunk 0 only
        # r1's scheduler side counted chunks 0 and 1 as this engine's (e.g. chunk 1 evicted since): a sync load.
        # In the same step the prompt completes and its save covers all three chunks.
        failed = step(LMCacheP2PMetadata(loads=[ChunkTransfer("r1", keys[:2], [chunk] * 2, blocks[:2], sync=True)],
                                         saves=[ChunkTransfer("r1", keys, [chunk] * 3, blocks)]))
        assert failed == set(blocks[1])
        assert sorted(pool.keys()) == [ChunkKey(keys[0])]  # chunks 1 and 2 were computed over unloaded blocks
        step(LMCacheP2PMetadata(saves=[ChunkTransfer("r1", keys, [chunk] * 3, blocks)]))  # recomputed: saved
        assert sorted(pool.keys()) == sorted(ChunkKey(k) for k in keys)
        # vLLM reset its caches (new weights): every chunk goes, unannounced
        step(LMCacheP2PMetadata(reset_cache=True))
        index = worker.agent.index
        assert index is not None and len(pool) == 0
        assert not any(index.owners(worker.agent.fp, [ChunkKey(k) for k in keys]))  # no entry left for any
    finally:
        worker.shutdown()
    print("ok")


def layout_refused() -> None:
    from lmcache_p2p.integrations.vllm.metadata import LMCacheP2PMetadata
    from lmcache_p2p.integrations.vllm.worker import P2PWorker
    from lmcache_p2p.transfers import blocks_from

    config = load_config(env={}, overrides={"node_id": "w"})  # layout vllm-cpu: head-major blocks
    worker = P2PWorker(config, Fingerprint.of(config.layout), BLOCK)
    token_major = torch.zeros(4, BLOCK, 2, 8).transpose(1, 2)  # (block, head, token, content), tokens outer
    worker.register_kv_caches({"layer.0": token_major, "layer.1": token_major.clone()})
    assert worker.agent is None and worker.stopped_sharing is not None and "LBNHC" in worker.stopped_sharing
    assert worker.state().stopped_sharing == worker.stopped_sharing
    chunk = config.chunk_size
    sync = ChunkTransfer("r-sync", [b"\1" * 16], [chunk], [list(range(16))], sync=True)
    later = ChunkTransfer("r-async", [b"\2" * 16], [chunk], [list(range(16, 32))])
    meta = LMCacheP2PMetadata(loads=[sync, later], saves=[ChunkTransfer("r-save", [b"\3" * 16], [chunk],
                                                                        [list(range(32, 48))], finished=True)])
    worker.step_started(meta)
    worker.start_load_kv(meta)
    worker.wait_for_save(meta)
    worker.step_finished()
    assert worker.get_block_ids_with_load_errors() == blocks_from(sync, 0) | blocks_from(later, 0)
    sent, done = worker.get_finished()
    assert sent == {"r-save"} and done == {"r-async"}  # the saved tail's blocks go back; the load is done
    worker.shutdown()
    print("ok")


class HeldModel:
    """What the digest reads of a model (``named_parameters``/``named_buffers``), read only once released."""

    def __init__(self) -> None:
        import threading

        self.weight = torch.arange(64, dtype=torch.float32)
        self.release = threading.Event()
        self.release.set()

    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        assert self.release.wait(60)
        return [("w", self.weight)]

    def named_buffers(self) -> list[tuple[str, torch.Tensor]]:
        return []


def weights_checked() -> None:
    from lmcache_p2p.integrations.vllm import worker as worker_module
    from lmcache_p2p.integrations.vllm.metadata import LMCacheP2PMetadata

    worker, config = attached_worker()
    chunk, per = config.chunk_size, config.chunk_size // BLOCK
    model = HeldModel()
    worker._model, worker._weights = model, worker_module._digest_later(model)  # as register_kv_caches does
    key, blocks = [b"\1" * 16], [list(range(per))]

    def step(meta: LMCacheP2PMetadata) -> set[int]:
        worker.step_started(meta)
        worker.start_load_kv(meta)
        worker.wait_for_save(meta)
        worker.step_finished()
        return worker.get_block_ids_with_load_errors()

    def load() -> LMCacheP2PMetadata:
        return LMCacheP2PMetadata(loads=[ChunkTransfer("r", key, [chunk], blocks, sync=True)])

    def settled(resets: int) -> bool:
        deadline = time.monotonic() + 30
        while worker.state().resets < resets and time.monotonic() < deadline:
            time.sleep(0.01)
        return worker.state().resets == resets

    try:
        assert worker._weights.result(30) is not None
        step(LMCacheP2PMetadata(saves=[ChunkTransfer("s", key, [chunk], blocks)]))
        assert worker.agent is not None
        worker.agent.intake.drain(10)
        model.release.clear()  # the next read waits
        step(LMCacheP2PMetadata(reset_cache=True))  # drops the chunk; the check starts
        step(LMCacheP2PMetadata(saves=[ChunkTransfer("s", key, [chunk], blocks)]))  # not saved meanwhile
        assert worker.state().resets == 0 and len(worker.agent.tiers.cpu) == 0
        assert step(load()) == set(blocks[0])  # nothing loaded while the weights are in question
        model.release.set()
        assert settled(1) and worker.stopped_sharing is None  # the same weights: sharing goes on
        step(LMCacheP2PMetadata(saves=[ChunkTransfer("s", key, [chunk], blocks)]))
        worker.agent.intake.drain(10)
        assert step(load()) == set()  # held and loaded again
        model.weight[5] += 1.0  # updated in place
        step(LMCacheP2PMetadata(reset_cache=True))
        assert settled(2) and worker.stopped_sharing is not None and "changed in place" in worker.stopped_sharing
        assert worker.agent is None and worker.state().stopped_sharing == worker.stopped_sharing
        assert step(load()) == set(blocks[0])
    finally:
        worker.shutdown()
    print("ok")


if __name__ == "__main__":
    {"gather": failed_gather, "sync-load": failed_sync_load, "layout": layout_refused,
     "weights": weights_checked}[sys.argv[1]]()
