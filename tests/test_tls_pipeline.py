"""``bench transfer``'s TLS breakdown (``bench/tls_pipeline.py``) runs the transport's own TLS contexts in
memory: every chunk comes out of Python's ssl and out of AES-GCM as it went in, one TLS record (16 KiB at
most) per read, and every step is measured (rates, not bounds: the bench reports them)."""

from __future__ import annotations

from lmcache_p2p.bench.tls_pipeline import describe, tls_pipeline


def test_the_pipeline_moves_each_chunk_intact_and_reads_one_record_at_a_time() -> None:
    p = tls_pipeline(chunk_bytes=256 << 10, chunks=2)
    assert p["cipher"].startswith("TLS_")  # TLS 1.3 suites only (the transport's minimum)
    assert p["ssl_reads_per_chunk"] >= (256 << 10) // (16 << 10)
    for name in ("copy_gbps", "aes_gcm_seal_gbps", "aes_gcm_open_gbps", "ssl_owner_gbps", "ssl_requester_gbps"):
        assert p[name] > 0, name
    assert "where TLS's time goes (256 KiB chunks" in describe(p)
