"""A tiny C++ extension that copies whole engine blocks with one ``memcpy`` per run.

Built on first use with ``torch.utils.cpp_extension.load_inline`` (needs a C++ compiler and
``ninja``; ~30 s the first time, cached under the torch extensions dir after that). The
GIL is released during the copy, and the work is split over ATen's intra-op threads.
:func:`load` returns ``None`` when the extension cannot be built; callers then fall back
to the torch/numpy path. Callers must have validated everything (see ``layout.py``): this
code trusts its arguments.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Sequence
from typing import Protocol

import torch

from .layout import PagedGeometry

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstring>
#include <vector>

// Copy whole blocks between L layer tensors and one contiguous payload (layout.py's order: head,
// layer, block, outer; each run is `heads` pieces of `piece` bytes).
static void copy_blocks(const std::vector<at::Tensor>& layers, const at::Tensor& ids, const at::Tensor& buf,
                        int64_t block_stride, int64_t outer, int64_t outer_stride, int64_t run_bytes,
                        int64_t heads, bool to_buf, int64_t grain) {
  const int64_t n = ids.numel();
  const int64_t L = static_cast<int64_t>(layers.size());
  std::vector<char*> base(L);
  for (int64_t l = 0; l < L; ++l) base[l] = static_cast<char*>(layers[l].data_ptr());
  const int64_t* id = ids.data_ptr<int64_t>();
  char* payload = static_cast<char*>(buf.data_ptr());
  const int64_t piece = run_bytes / heads;
  const int64_t head_bytes = L * n * outer * piece;  // one head's segment of the payload
  pybind11::gil_scoped_release nogil;
  at::parallel_for(0, L * n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t l = t / n, i = t % n;
      char* blk = base[l] + id[i] * block_stride;
      for (int64_t o = 0; o < outer; ++o) {
        char* kv = blk + o * outer_stride;
        char* p = payload + (t * outer + o) * piece;
        for (int64_t h = 0; h < heads; ++h, kv += piece, p += head_bytes) {
          if (to_buf) std::memcpy(p, kv, piece); else std::memcpy(kv, p, piece);
        }
      }
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("copy_blocks", &copy_blocks, "copy whole paged-KV blocks to/from a contiguous payload");
}
"""

_FLAGS = ("-O3", "-fopenmp")  # without -fopenmp, ATen's parallel_for pragma is ignored: serial copies

# Below this many bytes per task, one thread does the whole copy (threads cost more than they save).
_TASK_BYTES = 1 << 20


class _Module(Protocol):
    def copy_blocks(
        self,
        layers: Sequence[torch.Tensor],
        ids: torch.Tensor,
        buf: torch.Tensor,
        block_stride: int,
        outer: int,
        outer_stride: int,
        run_bytes: int,
        heads: int,
        to_buf: bool,
        grain: int,
    ) -> None: ...


@functools.cache
def load() -> _Module | None:
    """Build (once per source version) and import the extension; ``None`` if that fails."""
    from torch.utils import cpp_extension

    # Named after everything its build command holds (the source, the flags, and torch's headers, whose
    # path is the virtualenv's): two virtualenvs on one machine keep a build each instead of rebuilding
    # over each other's (each rebuild took a minute of an engine's start, under a lock other starts wait on).
    headers = ";".join(cpp_extension.include_paths())
    name = "lmcache_p2p_paged_" + hashlib.sha256((_SOURCE + repr(_FLAGS) + headers).encode()).hexdigest()[:12]
    try:
        module: _Module = cpp_extension.load_inline(
            name=name, cpp_sources=[_SOURCE], extra_cflags=list(_FLAGS), extra_ldflags=["-fopenmp"], verbose=False
        )
    except Exception as exc:  # compiler, ninja or import failure: the torch path still works
        log.warning("paged-KV C++ extension unavailable, using the torch path: %s", exc)
        return None
    return module


def copy_blocks(
    module: _Module,
    layers: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    buf: torch.Tensor,
    geom: PagedGeometry,
    *,
    to_buf: bool,
) -> None:
    grain = max(1, _TASK_BYTES // geom.block_bytes)
    module.copy_blocks(
        list(layers), block_ids, buf, geom.block_stride, geom.outer, geom.outer_stride, geom.run_bytes, geom.heads,
        to_buf, grain,
    )
