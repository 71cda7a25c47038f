"""Which segment tokens a blend recomputes, from a score per position (``segments.py``'s selections).

``deviation`` (CacheBlend's) scores a position by how far its keys move when recomputed in the prompt's
context; ``question`` (ProphetKV's, A³'s) by how much the rest of the prompt reads it over the blended
cache, summed over ``QUESTION_WINDOW`` tokens either side so that a fact is recomputed with its words.
Either way the ``count`` best candidates are recomputed (:func:`top_runs`). The scores come from the
engine (``integrations/vllm/blend.py``); this module is plain torch.
"""

from __future__ import annotations

import torch

from .segments import merge_runs

QUESTION_WINDOW = 8  # a position's question score: what the question reads within this many tokens either side


def top_runs(score: torch.Tensor, candidates: list[tuple[int, int]], count: int) -> list[tuple[int, int]]:
    """The ``count`` positions of ``candidates`` (sorted runs) with the highest ``score`` (indexed by
    position), as sorted runs."""
    if count <= 0 or not candidates:
        return []
    pos = torch.cat([torch.arange(s, e) for s, e in candidates])
    picked = pos[torch.topk(score[pos], min(count, len(pos))).indices].sort().values.tolist()
    return merge_runs([(p, p + 1) for p in picked])


def question_runs(read: torch.Tensor, candidates: list[tuple[int, int]], count: int) -> list[tuple[int, int]]:
    """The ``count`` candidates around which the question reads most (``read``: its attention per position,
    :meth:`~lmcache_p2p.integrations.vllm.blend.Blender.question_attention`), windowed."""
    width = 2 * QUESTION_WINDOW + 1
    smooth = torch.nn.functional.avg_pool1d(read.view(1, 1, -1).float(), width, stride=1, padding=QUESTION_WINDOW,
                                            count_include_pad=False).view(-1)
    return top_runs(smooth, candidates, count)
