"""Where a pull's time would go in TLS records, in one process (``bench transfer``'s ``tls_pipeline``): each step a
chunk takes through Python's ``ssl`` with the transport's own contexts (mutual TLS 1.3, memory BIOs as
``TlsChannel`` drives them), beside what the same bytes cost as one AES-256-GCM operation per chunk
(``cryptography``, the library of the payload MAC and the seal) and as one copy. Since wire version 7 TLS
carries the handshake only and chunks travel sealed (``transfer/seal.py``): this is the measure of why.

    owner:      SSLObject.write (encrypt into the outgoing BIO)   BIO.read (the copy out, then the socket's)
    requester:  BIO.write (the socket's bytes in)                  SSLObject.read (decrypt; one TLS record,
                                                                   16 KiB at most, per call)

No socket is involved: the sum of a side's steps bounds what that side's core can move over TLS here.
"""

from __future__ import annotations

import os
import ssl
import tempfile
import time
from typing import Any

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ..certs import make_certs
from ..config import TransferConfig
from ..transfer.tls import client_context, server_context


def _gbps(seconds: float, nbytes: int) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def _pair() -> tuple[ssl.SSLObject, ssl.MemoryBIO, ssl.MemoryBIO, ssl.SSLObject, ssl.MemoryBIO, ssl.MemoryBIO]:
    """A handshaken (owner, its in/out BIOs, requester, its in/out BIOs) under a throw-away CA."""
    with tempfile.TemporaryDirectory() as pki:
        made = make_certs(pki, ["owner", "requester"], days=1)
        ca = f"{pki}/ca.crt"
        owner_ctx = server_context(TransferConfig(tls_ca_cert=ca, tls_cert=str(made["owner"][0]),
                                                  tls_key=str(made["owner"][1])))
        requester_ctx = client_context(TransferConfig(tls_ca_cert=ca, tls_cert=str(made["requester"][0]),
                                                      tls_key=str(made["requester"][1])))
    o_in, o_out, r_in, r_out = (ssl.MemoryBIO() for _ in range(4))
    owner = owner_ctx.wrap_bio(o_in, o_out, server_side=True)
    requester = requester_ctx.wrap_bio(r_in, r_out, server_side=False)
    pending = [owner, requester]
    for _ in range(16):
        for side in list(pending):
            try:
                side.do_handshake()
                pending.remove(side)
            except ssl.SSLWantReadError:
                pass
        o_in.write(r_out.read())
        r_in.write(o_out.read())
        if not pending:
            return owner, o_in, o_out, requester, r_in, r_out
    raise RuntimeError("the in-memory TLS handshake did not complete")


def tls_pipeline(chunk_bytes: int = 2 << 20, chunks: int = 32) -> dict[str, Any]:
    """GB/s of each step for ``chunks`` chunks of ``chunk_bytes`` (see the module docstring); raises if a
    chunk does not come out as it went in."""
    payload = bytearray(os.urandom(chunk_bytes))
    dst = bytearray(chunk_bytes)
    total = chunk_bytes * chunks

    t = time.perf_counter()
    for _ in range(chunks):
        dst[:] = payload
    copy_s = time.perf_counter() - t

    aead, nonce = AESGCM(AESGCM.generate_key(256)), os.urandom(12)
    sealed = bytearray(chunk_bytes + 16)
    t = time.perf_counter()
    for _ in range(chunks):
        aead.encrypt_into(nonce, payload, None, sealed)
    seal_s = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(chunks):
        aead.decrypt_into(nonce, sealed, None, dst)
    open_s = time.perf_counter() - t
    if dst != payload:
        raise RuntimeError("AES-GCM did not give the chunk back")

    owner, _, o_out, requester, r_in, _ = _pair()
    encrypt_s = out_s = in_s = decrypt_s = 0.0
    reads = 0
    view, dview = memoryview(payload), memoryview(dst)
    for _ in range(chunks):
        dst[:] = bytes(chunk_bytes)
        t0 = time.perf_counter()
        owner.write(view)
        t1 = time.perf_counter()
        wire = o_out.read()
        t2 = time.perf_counter()
        r_in.write(wire)
        t3 = time.perf_counter()
        pos = 0
        while pos < chunk_bytes:
            got: int = requester.read(chunk_bytes - pos, dview[pos:])  # type: ignore[assignment]  # into dview
            pos += got
            reads += 1
        t4 = time.perf_counter()
        encrypt_s, out_s, in_s, decrypt_s = encrypt_s + t1 - t0, out_s + t2 - t1, in_s + t3 - t2, decrypt_s + t4 - t3
        if dst != payload:
            raise RuntimeError("TLS did not give the chunk back")
    return {
        "chunk_bytes": chunk_bytes, "cipher": (owner.cipher() or ("?",))[0],
        "copy_gbps": _gbps(copy_s, total),
        "aes_gcm_seal_gbps": _gbps(seal_s, total), "aes_gcm_open_gbps": _gbps(open_s, total),
        "ssl_owner_encrypt_gbps": _gbps(encrypt_s, total), "ssl_owner_copy_out_gbps": _gbps(out_s, total),
        "ssl_requester_copy_in_gbps": _gbps(in_s, total), "ssl_requester_decrypt_gbps": _gbps(decrypt_s, total),
        "ssl_reads_per_chunk": reads / chunks,
        "ssl_owner_gbps": _gbps(encrypt_s + out_s, total), "ssl_requester_gbps": _gbps(in_s + decrypt_s, total),
    }


def describe(p: dict[str, Any]) -> str:
    return (f"where TLS's time goes ({p['chunk_bytes'] >> 10} KiB chunks, one process, {p['cipher']}): Python ssl "
            f"owner {p['ssl_owner_gbps']:.2f} GB/s (encrypt {p['ssl_owner_encrypt_gbps']:.2f}, copy out "
            f"{p['ssl_owner_copy_out_gbps']:.2f}), requester {p['ssl_requester_gbps']:.2f} GB/s (copy in "
            f"{p['ssl_requester_copy_in_gbps']:.2f}, decrypt {p['ssl_requester_decrypt_gbps']:.2f} in "
            f"{p['ssl_reads_per_chunk']:.0f} reads a chunk); AES-256-GCM a chunk at once "
            f"{p['aes_gcm_seal_gbps']:.2f} / {p['aes_gcm_open_gbps']:.2f} GB/s; one copy {p['copy_gbps']:.2f} GB/s")
