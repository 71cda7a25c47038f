"""Deterministic paged KV caches sharded by KV head exactly as vLLM shards them over TP ranks.

An engine's cache for a prompt is a list of layer tensors ``(num_blocks, heads, block_size,
2*head_size)`` (vLLM CPU). A TP rank holds heads ``head_range(H, tp, rank)`` of every layer, as a
tensor of its own. The prompt's blocks sit at engine-chosen block ids; ``full_cache(seed)`` is what
a TP=1 engine computed for prompt ``seed``, so every engine and rank can check its bytes.
"""

from __future__ import annotations

import torch

from lmcache_p2p.agent import CacheAgent
from lmcache_p2p.config import LayoutConfig
from lmcache_p2p.kernels.paged import PagedKV
from lmcache_p2p.keys import HeadRange
from lmcache_p2p.testing.synthetic import synthetic_tokens

NUM_BLOCKS = 24
TOKENS = 1024 + 100  # 4 full chunks and a partial tail (9 blocks of 128)


def full_cache(layout: LayoutConfig, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, layout.num_kv_heads, layout.block_size, 2 * layout.head_size)
    return [torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(layout.num_layers)]


def block_ids(seed: int, n: int) -> list[int]:
    """Where an engine put the prompt's ``n`` blocks (engines differ: the seed says which)."""
    return torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed))[:n].tolist()


def shard(layers: list[torch.Tensor], heads: HeadRange) -> list[torch.Tensor]:
    return [t[:, heads[0]:heads[1]].contiguous() for t in layers]


def chunk_blocks(layout: LayoutConfig, chunk_size: int, ids: list[int], num_tokens: int) -> list[list[int]]:
    per = chunk_size // layout.block_size
    blocks = -(-num_tokens // layout.block_size)
    return [ids[i:min(i + per, blocks)] for i in range(0, blocks, per)]


def store_prompt(agent: CacheAgent, layers: list[torch.Tensor], seed: int, ids: list[int]) -> int:
    """Gather the prompt's chunks out of ``layers`` (this rank's heads) and store them."""
    heads = agent.heads[1] - agent.heads[0]
    kv = PagedKV(layers, heads=heads)
    tokens = synthetic_tokens(seed, TOKENS)
    keys, spans = agent.keys_for(tokens)
    payloads = []
    for blocks in chunk_blocks(agent.config.layout, agent.config.chunk_size, ids, TOKENS):
        out = torch.empty(kv.payload_nbytes(len(blocks)), dtype=torch.uint8)
        kv.gather(torch.tensor(blocks, dtype=torch.int64), out)
        payloads.append(memoryview(out.numpy()))
    return agent.store_chunks(keys, [e - s for s, e in spans], payloads).result(timeout=60)
