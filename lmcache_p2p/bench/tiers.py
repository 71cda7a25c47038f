"""``lmcache-p2p bench tiers``: the CPU and disk tiers against memcpy and raw file I/O.

Same bytes, same buffers, one run: CPU loads are compared with the faster of a torch
``copy_`` and a numpy ``copyto`` into the same preallocated destination; disk reads (which
verify the checksum) with a raw ``readinto`` of the same files.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
import torch

from ..chunk import make_header
from ..keys import ChunkKey, FingerprintDigest
from ..tiers import CpuPool, DiskTier
from .common import bench_parser, best_of, emit, gbps, progress, ratio


def run(num_chunks: int, chunk_bytes: int, rounds: int, disk_dir: str | None) -> dict[str, object]:
    total = num_chunks * chunk_bytes
    fp = FingerprintDigest(b"\x01" * 16)
    rng = np.random.default_rng(0)
    src = torch.from_numpy(rng.integers(0, 256, total, dtype=np.uint8))
    dst = torch.zeros(total, dtype=torch.uint8)
    src_views = [src.numpy()[i * chunk_bytes : (i + 1) * chunk_bytes].data for i in range(num_chunks)]
    dst_views = [dst.numpy()[i * chunk_bytes : (i + 1) * chunk_bytes].data for i in range(num_chunks)]
    keys = [ChunkKey(i.to_bytes(16, "little")) for i in range(num_chunks)]
    headers = [make_header(k, fp, v, 256) for k, v in zip(keys, src_views, strict=True)]
    pool = CpuPool(total, chunk_bytes)

    def cpu_store() -> None:
        for k, v in zip(keys, src_views, strict=True):
            pool.put(make_header(k, fp, v, 256), v)

    def cpu_load() -> None:
        for k, v in zip(keys, dst_views, strict=True):
            if pool.read_into(k, v) is None:
                raise RuntimeError("bench: CPU pool lost a chunk")

    def torch_copy() -> None:
        for i in range(num_chunks):
            dst[i * chunk_bytes : (i + 1) * chunk_bytes].copy_(src[i * chunk_bytes : (i + 1) * chunk_bytes])

    def numpy_copy() -> None:
        for s, d in zip(src_views, dst_views, strict=True):
            np.copyto(np.frombuffer(d, np.uint8), np.frombuffer(s, np.uint8))

    progress("tiers", f"CPU pool: {num_chunks} chunks, {rounds} rounds")
    t_store = best_of(cpu_store, rounds)
    t_load = best_of(cpu_load, rounds)
    t_memcpy = min(best_of(torch_copy, rounds), best_of(numpy_copy, rounds))
    if not torch.equal(src, dst):
        raise RuntimeError("bench: CPU load returned different bytes")

    progress("tiers", "disk tier against raw file I/O")
    with tempfile.TemporaryDirectory(dir=disk_dir) as tmp:
        disk = DiskTier(os.path.join(tmp, "tier"), total * 2)
        raw_dir = os.path.join(tmp, "raw")
        os.makedirs(raw_dir)

        def disk_write() -> None:
            for k in keys:
                disk.remove(k)
            for h, v in zip(headers, src_views, strict=True):
                disk.put(h, v)

        def raw_write() -> None:
            for i, v in enumerate(src_views):
                with open(os.path.join(raw_dir, f"{i}.bin"), "wb", buffering=0) as f:
                    f.write(headers[i].pack())
                    f.write(v)

        def disk_read() -> None:
            for k, v in zip(keys, dst_views, strict=True):
                if disk.read_into(k, v) is None:
                    raise RuntimeError("bench: disk tier lost a chunk")

        def raw_read() -> None:
            head = bytearray(len(headers[0].pack()))  # the header as raw_write wrote it
            for i, v in enumerate(dst_views):
                with open(os.path.join(raw_dir, f"{i}.bin"), "rb", buffering=0) as f:
                    f.readinto(head)
                    f.readinto(v)

        t_dw = best_of(disk_write, rounds)
        t_rw = best_of(raw_write, rounds)
        t_dr = best_of(disk_read, rounds)
        t_rr = best_of(raw_read, rounds)
        if not torch.equal(src, dst):
            raise RuntimeError("bench: disk read returned different bytes")

    return {
        "chunks": num_chunks,
        "chunk_bytes": chunk_bytes,
        "cpu_store_gbps": gbps(total, t_store),
        "cpu_load_gbps": gbps(total, t_load),
        "memcpy_gbps": gbps(total, t_memcpy),
        "cpu_load_vs_memcpy": ratio(t_memcpy, t_load),
        "disk_write_gbps": gbps(total, t_dw),
        "raw_write_gbps": gbps(total, t_rw),
        "disk_write_vs_raw": ratio(t_rw, t_dw),
        "disk_read_gbps": gbps(total, t_dr),
        "raw_read_gbps": gbps(total, t_rr),
        "disk_read_vs_raw": ratio(t_rr, t_dr),
    }


def main(argv: list[str]) -> int:
    parser = bench_parser("tiers", __doc__, keeps=None)
    parser.add_argument("--chunks", type=int, default=64)
    parser.add_argument("--chunk-bytes", type=int, default=2 << 20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=None, help="directory for the disk tier (default: system temp)")
    args = parser.parse_args(argv)
    result = run(args.chunks, args.chunk_bytes, args.rounds, args.dir)
    emit(result, args.json, "bench tiers (median of rounds; GB/s = 1e9 bytes/s)")
    return 0
