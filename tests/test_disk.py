import os

from lmcache_p2p.chunk import HEADER_SIZE, make_header
from lmcache_p2p.tiers import DiskTier

FP = b"f" * 16


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def fill(tier: DiskTier, n: int, size: int = 8192) -> dict[bytes, bytes]:
    data = {}
    for i in range(n):
        payload = os.urandom(size)
        tier.put(make_header(key(i), FP, payload, 256), memoryview(payload))
        data[key(i)] = payload
    return data


def test_flipped_byte_is_detected_counted_and_never_returned(tmp_path):
    tier = DiskTier(tmp_path, 1 << 20)
    fill(tier, 2)
    path = tmp_path / f"{key(0).hex()}.chunk"
    raw = bytearray(path.read_bytes())
    raw[HEADER_SIZE + 17] ^= 0xFF
    path.write_bytes(raw)
    dst = memoryview(bytearray(8192))
    assert tier.read_into(key(0), dst) is None
    assert tier.stats.corrupt_dropped == 1
    assert not path.exists() and not tier.contains(key(0))
    assert tier.read_into(key(1), dst) is not None


def test_truncated_file_detected_at_read(tmp_path):
    tier = DiskTier(tmp_path, 1 << 20)
    fill(tier, 1)
    path = tmp_path / f"{key(0).hex()}.chunk"
    path.write_bytes(path.read_bytes()[:-100])
    assert tier.read_into(key(0), memoryview(bytearray(8192))) is None
    assert tier.stats.corrupt_dropped == 1


def test_restart_recovers_valid_chunks_and_removes_bad_files(tmp_path):
    tier = DiskTier(tmp_path, 1 << 20)
    data = fill(tier, 5)
    (tmp_path / f".{key(9).hex()}.123.0.tmp").write_bytes(b"partial write")
    corrupt = tmp_path / f"{key(1).hex()}.chunk"
    raw = bytearray(corrupt.read_bytes())
    raw[-1] ^= 1
    corrupt.write_bytes(raw)
    truncated = tmp_path / f"{key(2).hex()}.chunk"
    truncated.write_bytes(truncated.read_bytes()[:30])
    renamed = tmp_path / f"{key(3).hex()}.chunk"
    renamed.rename(tmp_path / f"{key(7).hex()}.chunk")

    fresh = DiskTier(tmp_path, 1 << 20)
    found = fresh.rescan(memoryview(bytearray(8192)))
    assert sorted(h.key for h in found) == [key(0), key(4)]
    assert fresh.stats.stray_removed == 1 and fresh.stats.corrupt_dropped == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{k.hex()}.chunk" for k in (key(0), key(4)))
    dst = memoryview(bytearray(8192))
    for k in (key(0), key(4)):
        header = fresh.read_into(k, dst)
        assert header is not None and bytes(dst[: header.length]) == data[k]
    assert fresh.used_bytes == 2 * (HEADER_SIZE + 8192)


def test_capacity_evicts_oldest_files(tmp_path):
    tier = DiskTier(tmp_path, 3 * (HEADER_SIZE + 8192))
    fill(tier, 5)
    assert len(tier) == 3 and tier.used_bytes <= tier.capacity_bytes
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{key(i).hex()}.chunk" for i in (2, 3, 4))
