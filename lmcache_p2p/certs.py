"""``lmcache-p2p certs``: a cluster CA and certificates issued by it (openssl, EC P-256).

    lmcache-p2p certs DIR NAME[=SAN,SAN...] ...

``DIR/ca.crt`` and ``DIR/ca.key`` are created once and reused (delete them for a new CA); every
NAME gets ``DIR/NAME.crt`` and ``DIR/NAME.key`` (keys readable by the owner only), usable as TLS
server and client certificates. SANs are openssl ``subjectAltName`` entries, plus ``node:ID``
for a transfer certificate that names the node ``ID`` (a URI SAN ``urn:lmcache-p2p:node:ID``)::

    lmcache-p2p certs pki etcd-0=DNS:etcd-0.etcd,DNS:localhost,IP:127.0.0.1 etcd-client
    lmcache-p2p certs pki node-a=node:node-a node-b=node:node-b

The transfer TLS (``transfer.tls_*``) checks the CA and binds its handshake to the owner's
certificate, not to host names. Give every node a certificate of its own that names it: a
requester then refuses an owner whose certificate names another node (a name covers the node's
tensor-parallel ranks ``ID-r<k>`` too), and no two nodes share a channel binding. A certificate
that names no node is refused as an owner by a node whose own certificate names one
(``transfer.tls_require_node_name``, on by default then); only nodes that all share one unnamed
certificate accept it (then only the HMAC proofs tell nodes apart). Issue transfer certificates
from a CA of their own, apart from etcd's (``k8s/generate-certs.sh``: ``pki/etcd``,
``pki/transfer``). etcd clients check each endpoint's host name against the SANs of that member's
certificate.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Collection, Sequence
from pathlib import Path

from .ids import NODE_ID_RE, engine_of

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")
NODE_URI = "urn:lmcache-p2p:node:"  # the URI SAN a transfer certificate names its node with (transfer/tls.py)
_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def names_node(names: Collection[str], node_id: str) -> bool:
    """A certificate naming ``names`` may serve as ``node_id``: one of them, or a TP rank of one."""
    return node_id in names or engine_of(node_id) in names


def _sans(spec: str) -> str:
    """openssl subjectAltName entries, ``node:ID`` expanded to the URI that names node ``ID``."""
    out = []
    for san in filter(None, (s.strip() for s in spec.split(","))):
        kind, _, value = san.partition(":")
        if kind == "node":
            if not NODE_ID_RE.fullmatch(value):
                raise ValueError(f"bad node id {value!r} in {san!r}: must match {NODE_ID_RE.pattern}")
            san = f"URI:{NODE_URI}{value}"
        out.append(san)
    return ",".join(out)


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
            name, _, spec_sans = spec.partition("=")
            sans = _sans(spec_sans)
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
