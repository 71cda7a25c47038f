"""``lmcache-p2p certs``: a cluster CA and certificates issued by it (openssl, EC P-256).

    lmcache-p2p certs DIR NAME[=SAN,SAN...] ...

``DIR/ca.crt`` and ``DIR/ca.key`` are created once and reused (delete them for a new CA); every
NAME gets ``DIR/NAME.crt`` and ``DIR/NAME.key`` (keys readable by the owner only), usable as TLS
server and client certificates. SANs are openssl ``subjectAltName`` entries::

    lmcache-p2p certs pki etcd-0=DNS:etcd-0.etcd,DNS:localhost,IP:127.0.0.1 agent transfer

The transfer TLS (``transfer.tls_*``) checks the CA and binds its handshake to the owner's
certificate, not to host names: one certificate may serve every node. etcd clients check each
endpoint's host name against the SANs of that member's certificate.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")
_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def _openssl(*args: str) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("openssl not found (e.g. apt-get install openssl)")
    r = subprocess.run([openssl, *args], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed: {r.stderr.strip()[-400:]}")


def make_certs(directory: str | Path, specs: Sequence[str], days: int = 825) -> dict[str, tuple[Path, Path]]:
    """Create (or reuse) ``ca.crt``/``ca.key`` and one certificate per ``NAME[=SANS]``; returns
    ``{name: (cert, key)}``."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    old_umask = os.umask(0o077)
    try:
        if not (d / "ca.key").exists():
            _openssl("req", "-x509", *_EC, "-days", str(days), "-subj", "/CN=lmcache-p2p cluster CA",
                     "-keyout", str(d / "ca.key"), "-out", str(d / "ca.crt"),
                     "-addext", "basicConstraints=critical,CA:TRUE",
                     "-addext", "keyUsage=critical,keyCertSign,cRLSign")
        out = {}
        for spec in specs:
            name, _, sans = spec.partition("=")
            if not _NAME_RE.match(name):
                raise ValueError(f"bad certificate name {name!r}: 1-64 chars of [A-Za-z0-9_.-]")
            cert, key = d / f"{name}.crt", d / f"{name}.key"
            with tempfile.TemporaryDirectory() as tmp:
                ext, csr = Path(tmp) / "ext", Path(tmp) / "csr"
                ext.write_text("basicConstraints=critical,CA:FALSE\n"
                               "keyUsage=critical,digitalSignature,keyEncipherment\n"
                               "extendedKeyUsage=serverAuth,clientAuth\n"
                               + (f"subjectAltName={sans}\n" if sans else ""))
                _openssl("req", "-new", *_EC, "-subj", f"/CN={name}", "-keyout", str(key), "-out", str(csr))
                _openssl("x509", "-req", "-in", str(csr), "-CA", str(d / "ca.crt"), "-CAkey", str(d / "ca.key"),
                         "-CAcreateserial", "-days", str(days), "-sha256", "-extfile", str(ext), "-out", str(cert))
            cert.chmod(0o644)
            out[name] = (cert, key)
        (d / "ca.crt").chmod(0o644)
        return out
    finally:
        os.umask(old_umask)
