"""Benchmark paged-KV gather/scatter against a plain preallocated memcpy of the same bytes.

    lmcache-p2p bench kernels [--preset tiny|large ...] [--blocks 2 16] [--threads N]

Prints one JSON document: per preset, block count and backend, the median GB/s of gather
and scatter, and of ``torch`` ``copy_`` between two preallocated contiguous buffers of the
payload's size (the ceiling). Block ids are distinct and random over the whole cache, so
large caches read from DRAM, as an engine's would.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
from collections.abc import Sequence

import torch

from ..kernels import cpu_ext, paged
from ..usage import HelpFormatter
from .common import best_of, progress


@dataclasses.dataclass(frozen=True, slots=True)
class Preset:
    layers: int
    kv_heads: int
    block_size: int
    row: int  # 2 * head_size: vLLM CPU keeps K and V side by side in a block row
    dtype: torch.dtype
    cache_blocks: int

    @property
    def block_bytes(self) -> int:
        return self.kv_heads * self.block_size * self.row * torch.tensor([], dtype=self.dtype).element_size()


PRESETS = {
    # the tests' tiny Llama: 4 layers, 2 KV heads, head 64, bf16 -> 64 KiB per block and layer
    "tiny": Preset(layers=4, kv_heads=2, block_size=128, row=128, dtype=torch.bfloat16, cache_blocks=2048),
    # an 8B-class shape: 32 layers, 8 KV heads, head 128, fp16 -> 512 KiB per block and layer
    "large": Preset(layers=32, kv_heads=8, block_size=128, row=256, dtype=torch.float16, cache_blocks=128),
}


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 2)


def bench_preset(name: str, preset: Preset, blocks: Sequence[int], backends: Sequence[str], repeat: int) -> list[dict]:
    shape = (preset.cache_blocks, preset.kv_heads, preset.block_size, preset.row)
    layers = [torch.randn(shape).to(preset.dtype) for _ in range(preset.layers)]
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n in blocks:
        progress("kernels", f"{name}: {n} blocks per call")
        ids = torch.randperm(preset.cache_blocks, generator=gen)[:n].to(torch.int64)
        nbytes = paged.payload_nbytes(layers, n)
        buf, src = torch.empty(nbytes, dtype=torch.uint8), torch.ones(nbytes, dtype=torch.uint8)
        memcpy = best_of(functools.partial(_copy, buf, src), repeat)
        row: dict = {"preset": name, "blocks": n, "payload_bytes": nbytes, "memcpy_gbps": _gbps(nbytes, memcpy)}
        for backend in backends:
            kv = paged.PagedKV(layers, backend=backend)  # type: ignore[arg-type]
            g = best_of(functools.partial(kv.gather, ids, buf), repeat)
            s = best_of(functools.partial(kv.scatter, buf, ids), repeat)
            row[backend] = {
                "gather_gbps": _gbps(nbytes, g),
                "scatter_gbps": _gbps(nbytes, s),
                "gather_us": round(g * 1e6, 1),
                "scatter_us": round(s * 1e6, 1),
            }
        rows.append(row)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lmcache-p2p bench kernels", description=__doc__.splitlines()[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--preset", nargs="+", choices=sorted(PRESETS), default=sorted(PRESETS))
    parser.add_argument("--blocks", nargs="+", type=int, default=[2, 16], help="blocks per call")
    parser.add_argument("--backends", nargs="+", choices=["cpp", "torch"], default=["cpp", "torch"])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    backends = [b for b in args.backends if b != "cpp" or cpu_ext.load() is not None]
    rows = [
        row for name in args.preset for row in bench_preset(name, PRESETS[name], args.blocks, backends, args.repeat)
    ]
    print(json.dumps({"threads": args.threads, "backends": backends, "results": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
