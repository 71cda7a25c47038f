"""The worker's blend bookkeeping: what vLLM is told to recompute and how each blend is counted.

A sync blend over segment chunks held in the worker's own agent (in-memory index, no peers): all
chunks there (loaded, the recompute runs), the second segment missing (partial: blocks from the cut
on go back to vLLM, the recompute runs over what was written), the first one missing (failed: not one
segment token was reused, every block of the blend goes back, nothing is recomputed here), and a
blend whose model work would outrun its deadline at the engine's prefill rate (refused). The
blender is a stand-in that records its calls: the KV maths is ``test_vllm_blend.py``'s, on real
engines.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import torch

from lmcache_p2p.agent import CacheAgent
from lmcache_p2p.config import load_config
from lmcache_p2p.keys import ChunkKey, Fingerprint
from lmcache_p2p.testing.memory_index import MemoryIndex, MemoryMesh

BLOCK, BLOCK_BYTES = 16, 64


class RecordingBlender:
    """What ``blend.Blender`` is asked: decode a staged chunk, write positions, recompute runs."""

    def __init__(self) -> None:
        self.written: list[tuple[int, int]] = []  # (first position, tokens)
        self.recomputed: list[list[tuple[int, int]]] = []

    def decode(self, staged: torch.Tensor, num_tokens: int) -> torch.Tensor:
        return torch.zeros(2, 1, num_tokens)

    def write(self, kv: torch.Tensor, block_ids: list[int], start: int, segment_start: int) -> None:
        self.written.append((start, kv.shape[2]))

    def recompute(self, token_ids: list[int], runs: list[tuple[int, int]], block_ids: list[int]) -> None:
        self.recomputed.append(list(runs))


class RaisingBlender(RecordingBlender):
    """A blender whose ``step`` (decode, write or recompute) raises: the engine must recompute every
    block the blend was to fill."""

    def __init__(self, step: str) -> None:
        super().__init__()
        self.step = step

    def decode(self, staged: torch.Tensor, num_tokens: int) -> torch.Tensor:
        if self.step == "decode":
            raise RuntimeError("decode broke")
        return super().decode(staged, num_tokens)

    def write(self, kv: torch.Tensor, block_ids: list[int], start: int, segment_start: int) -> None:
        if self.step == "write" and self.written:  # the second write: a segment half placed
            raise RuntimeError("write broke")
        super().write(kv, block_ids, start, segment_start)

    def recompute(self, token_ids: list[int], runs: list[tuple[int, int]], block_ids: list[int]) -> None:
        if self.step == "recompute":
            raise RuntimeError("recompute broke")
        super().recompute(token_ids, runs, block_ids)


def test_blends_are_counted_and_reported_by_how_far_their_segments_loaded() -> None:
    # In a process of its own: the worker imports vLLM, which must not load into the test runner.
    r = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-4000:]


def main() -> None:
    from lmcache_p2p.integrations.vllm.metadata import LMCacheP2PMetadata
    from lmcache_p2p.integrations.vllm.worker import P2PWorker
    from lmcache_p2p.segments import SegmentChunks
    from lmcache_p2p.transfers import BlendTransfer

    config = load_config(env={}, overrides={"tiers.cpu_capacity": 8 * 16 * BLOCK_BYTES, "node_id": "w"})
    chunk, per = config.chunk_size, config.chunk_size // BLOCK
    fingerprint = Fingerprint.of(config.layout)
    worker = P2PWorker(config, fingerprint, BLOCK)
    blender = RecordingBlender()
    # as register_kv_caches builds the parts on a blending engine (no paged KV here: nothing is scattered)
    worker.attach(CacheAgent(config, fingerprint, per * BLOCK_BYTES, secret=os.urandom(32),
                             index_factory=lambda loop, record: MemoryIndex(MemoryMesh(), record)).start(),
                  None, blender)  # type: ignore[arg-type]
    loads = worker.segments
    assert loads is not None and worker.exact is not None
    seg_keys = [[bytes([s * 16 + i + 1]) * 16 for i in range(2)] for s in range(2)]  # 2 segments of 2 chunks
    blocks = list(range(4 * per))
    end = 4 * chunk

    def blend(req: str, held: list[bytes]) -> tuple[set[int], RecordingBlender, dict[str, float]]:
        agent = worker.agent
        assert agent is not None
        for key in list(agent.tiers.cpu.keys()):
            agent.tiers.cpu.remove(key)
        payloads = [memoryview(bytes(per * BLOCK_BYTES)) for _ in held]
        assert agent.store_chunks([ChunkKey(k) for k in held], [chunk] * len(held), payloads).result(10) == len(held)
        blender = loads.blender
        assert isinstance(blender, RecordingBlender)
        blender.written.clear()
        blender.recomputed.clear()
        segments = [SegmentChunks(keys, [chunk, chunk], start=2 * chunk * s, end=2 * chunk * (s + 1))
                    for s, keys in enumerate(seg_keys)]
        segments[-1].end = end - 1  # vLLM computes the prompt's last token
        t = BlendTransfer(req, None, segments, recompute=[(0, 16), (2 * chunk, 2 * chunk + 16)],
                          token_ids=list(range(end)), block_ids=blocks, exact_end=0, end=end - 1, sync=True)
        worker.start_load_kv(LMCacheP2PMetadata(blends=[t]))
        counts = {o: agent.metrics.blend_requests.labels(o)._value.get() for o in ("loaded", "partial", "failed")}
        return worker.get_block_ids_with_load_errors(), blender, counts

    try:
        failed, b, counts = blend("all", seg_keys[0] + seg_keys[1])
        assert failed == set() and counts == {"loaded": 1, "partial": 0, "failed": 0}
        assert b.recomputed == [[(0, 16), (2 * chunk, 2 * chunk + 16)]] and len(b.written) == 4, b.written

        failed, b, counts = blend("second-missing", seg_keys[0])
        assert failed == set(blocks[2 * per:]), sorted(failed)
        assert counts == {"loaded": 1, "partial": 1, "failed": 0}
        assert b.recomputed == [[(0, 16)]] and b.written == [(0, chunk), (chunk, chunk)]

        failed, b, counts = blend("first-missing", seg_keys[1])
        assert failed == set(blocks), sorted(failed)
        assert counts == {"loaded": 1, "partial": 1, "failed": 1}
        assert b.recomputed == [] and b.written == []

        # a failure at every step of placing, with every chunk there and with a cut after the first
        # segment: every block the blend was to fill is reported (vLLM recomputes them), nothing less
        for step in ("decode", "write", "recompute"):
            for held_case, held in (("all", seg_keys[0] + seg_keys[1]), ("cut", seg_keys[0])):
                loads.blender = RaisingBlender(step)  # type: ignore[assignment]
                failed, _, _ = blend(f"{step}-{held_case}", held)
                assert failed == set(blocks), (step, held_case, sorted(set(blocks) - failed))
        loads.blender = blender  # type: ignore[assignment]

        # a blend whose model work would run past its load's deadline at this engine's measured prefill rate
        # (a client's fraction, or a slow engine): refused, every block back to vLLM, nothing recomputed here
        agent = worker.agent
        assert agent is not None
        parts = loads.parts  # what the worker's loads read of the agent: its prefill rate among them
        loads.parts = dataclasses.replace(parts, prefill=type(agent.prefill)(1.0))  # one token a second: 32
        try:                                                                       # tokens take 32 s, past 5 s
            failed, b, counts = blend("too-slow", seg_keys[0] + seg_keys[1])
        finally:
            loads.parts = parts
        assert failed == set(blocks) and b.recomputed == [] and b.written == [], sorted(failed)
        assert agent.metrics.load_failures.labels("deadline")._value.get() >= 1

        # a blend with an exact prefix that fails before that prefix is in place (no blender on this
        # worker; the exact load raising) reports the prefix's blocks too: nothing claimed goes unreported
        from lmcache_p2p.transfers import chunk_transfer

        prefix_blocks = list(range(100, 100 + per))
        for case in ("no-blender", "exact-raises"):
            exact = chunk_transfer(case, chunk, [ChunkKey(b"\x99" * 16)], prefix_blocks + blocks, 0, chunk, chunk,
                                   BLOCK)
            t = BlendTransfer(case, exact, [SegmentChunks(seg_keys[0], [chunk, chunk], start=chunk, end=3 * chunk)],
                              recompute=[], token_ids=list(range(3 * chunk)), block_ids=prefix_blocks + blocks,
                              exact_end=chunk, end=3 * chunk, sync=True)
            saved_blender, saved_load = loads.blender, worker.exact.load
            if case == "no-blender":
                loads.blender = None
            else:
                def raising(*args: object, **kwargs: object) -> set[int]:
                    raise RuntimeError("the exact load broke")
                worker.exact.load = raising  # type: ignore[method-assign]
            try:
                worker.start_load_kv(LMCacheP2PMetadata(blends=[t]))
                failed = worker.get_block_ids_with_load_errors()
            finally:
                loads.blender, worker.exact.load = saved_blender, saved_load  # type: ignore[method-assign]
            assert set(prefix_blocks) <= failed and set(blocks[:2 * per]) <= failed, (case, sorted(failed))
    finally:
        worker.shutdown()
    print("ok")


if __name__ == "__main__":
    main()


def test_the_question_selection_recomputes_where_the_question_reads_with_the_words_around() -> None:
    """``question_runs``: the positions the question's attention falls on most (summed over a window, so
    a fact's words go with it), only among the candidates (never the glue or an exact prefix), at most
    the budget, as sorted runs."""
    from lmcache_p2p.selection import QUESTION_WINDOW, question_runs

    read = torch.full((400,), 0.01)
    read[250] = 5.0  # the fact the question reads, in the second document
    read[20] = 9.0  # the exact prefix (the system prompt's first token, a sink): not a candidate
    candidates = [(100, 200), (210, 300)]
    runs = question_runs(read, candidates, 2 * QUESTION_WINDOW + 1)
    assert runs == [(250 - QUESTION_WINDOW, 251 + QUESTION_WINDOW)]
    assert question_runs(read, candidates, 0) == [] and question_runs(read, [], 5) == []
    # a budget past the candidates: all of them, never a position outside
    assert question_runs(read, candidates, 1000) == candidates
    # two facts, a budget for one window each
    read[150] = 5.0
    both = question_runs(read, candidates, 2 * (2 * QUESTION_WINDOW + 1))
    assert both == [(150 - QUESTION_WINDOW, 151 + QUESTION_WINDOW), (250 - QUESTION_WINDOW, 251 + QUESTION_WINDOW)]
