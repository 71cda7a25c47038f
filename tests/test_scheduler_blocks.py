"""The scheduler's block arithmetic: which chunks and engine blocks a load or save covers (pure)."""

from __future__ import annotations

from lmcache_p2p.keys import ChunkKey
from lmcache_p2p.transfers import blocks_from, chunk_transfer

KEYS = [ChunkKey(bytes([i]) * 16) for i in range(5)]
BLOCKS = list(range(100, 109))  # 1,100 tokens in blocks of 128: 9 blocks


def test_a_whole_prompt_with_a_partial_tail() -> None:
    t = chunk_transfer("r", 1100, KEYS, BLOCKS, 0, 1100, 256, 128)
    assert t.keys == [bytes(k) for k in KEYS]
    assert t.num_tokens == [256, 256, 256, 256, 76]
    assert t.block_ids == [[100, 101], [102, 103], [104, 105], [106, 107], [108]]
    assert t.skip_blocks == 0


def test_a_hit_after_vllms_own_prefix_cache_skips_its_blocks() -> None:
    # vLLM's prefix cache supplied 384 tokens (3 blocks): the load starts in chunk 1, whose first block
    # is vLLM's own and must not be overwritten
    t = chunk_transfer("r", 1100, KEYS, BLOCKS, 384, 1099, 256, 128)
    assert t.keys == [bytes(k) for k in KEYS[1:]] and t.skip_blocks == 1
    assert t.block_ids[0] == [102, 103]
    # if that chunk fails, vLLM recomputes its other block and every later one, never its own
    assert blocks_from(t, 0) == {103, *range(104, 109)}
    assert blocks_from(t, 2) == {106, 107, 108}


def test_a_hit_ending_inside_a_chunk_covers_that_chunk() -> None:
    t = chunk_transfer("r", 1100, KEYS, BLOCKS, 0, 700, 256, 128)
    assert len(t.keys) == 3 and t.block_ids[-1] == [104, 105]


def test_chunk_of_several_blocks_per_chunk_and_a_one_block_tail() -> None:
    blocks = list(range(40))  # 16-token blocks: 16 blocks per 256-token chunk
    t = chunk_transfer("r", 520, KEYS, blocks, 0, 520, 256, 16)
    assert [len(b) for b in t.block_ids] == [16, 16, 1] and t.num_tokens == [256, 256, 8]
    assert t.block_ids[2] == [32]
