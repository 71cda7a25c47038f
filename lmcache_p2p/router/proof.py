"""Which announced engines a router may use: the agent proves the engine it announces, the router checks.

Two kinds of proof, by what the router trusts:

    signed (x509:)  ECDSA/RSA signature by the node's transfer TLS key over the canonical JSON of
                    ["lmcache-p2p engine proof v2", cluster, node_id, engine_url, engine_pool, metrics_url],
                    with the node's certificate: "x509:" base64url(certificate DER) "." base64url(signature)
    keyed (hex)     hex HMAC-SHA256(router key, canonical JSON of
                    [PROOF_VERSION, cluster, node_id, engine_url, engine_pool, metrics_url])
                    router key = HMAC-SHA256(cluster secret, "lmcache-p2p router key v1")

An agent with a transfer certificate and key (``transfer.tls_*``) signs; others publish the keyed proof.
A router given the transfer CA (``--transfer-ca``) accepts **only signed proofs**: the certificate must be
issued by that CA, be valid now, and name the record's node (a URI SAN ``urn:lmcache-p2p:node:<id>``, which
covers the node's TP ranks ``<id>-r<k>``). A node's key signs for that node alone: an agent holding the
cluster secret, or a pod holding its own key and read-write etcd, cannot announce another node's engine
(``nodes/evil``, or a real node's record pointed elsewhere), and the proof expires with the certificate.
The router holds only the CA certificate: it checks proofs and can make none.

A router given only the router key accepts keyed proofs, and every holder of the cluster secret (every
agent) can make one for any node: use it where nodes have no certificates of their own. A record that
anyone else who can write etcd forges or edits fails either check and is never contacted. Neither proof
carries a time: a record replayed unchanged names the engine its agent announced (while the certificate
is valid, for a signed one).
"""

from __future__ import annotations

import base64
import binascii
import datetime
import hashlib
import hmac
import json
import urllib.parse
from collections.abc import Sequence
from typing import Any

from ..certs import NODE_URI, names_node
from ..config import valid_engine_url
from ..index.schema import KEYED_PROOF_RE, SIGNED_PROOF_RE

ROUTER_KEY_LABEL = b"lmcache-p2p router key v1"
PROOF_VERSION = "lmcache-p2p engine proof v1"
KEY_BYTES = 32
SIGNED_VERSION = "lmcache-p2p engine proof v2"
SIGNED_PREFIX = "x509:"


def router_key(secret: bytes) -> bytes:
    """The router key of a cluster secret."""
    return hmac.new(secret, ROUTER_KEY_LABEL, hashlib.sha256).digest()


def _message(version: str, cluster: str, node_id: str, engine_url: str, engine_pool: str,
             metrics_url: str | None) -> bytes:
    return json.dumps([version, cluster, node_id, engine_url, engine_pool, metrics_url],
                      separators=(",", ":"), ensure_ascii=True).encode()


def engine_proof(key: bytes, *, cluster: str, node_id: str, engine_url: str, engine_pool: str,
                 metrics_url: str | None) -> str:
    """The keyed proof an agent publishes for the engine it announces (hex, 64 chars)."""
    return hmac.new(key, _message(PROOF_VERSION, cluster, node_id, engine_url, engine_pool, metrics_url),
                    hashlib.sha256).hexdigest()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def signed_engine_proof(cert_pem: bytes, key_pem: bytes, *, cluster: str, node_id: str, engine_url: str,
                        engine_pool: str, metrics_url: str | None) -> str:
    """The signed proof (``x509:...``) an agent with a transfer certificate publishes: its certificate and
    a signature by its key over the record's fields."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa

    cert = x509.load_pem_x509_certificate(cert_pem)
    key = serialization.load_pem_private_key(key_pem, password=None)
    message = _message(SIGNED_VERSION, cluster, node_id, engine_url, engine_pool, metrics_url)
    if isinstance(key, ec.EllipticCurvePrivateKey):
        signature = key.sign(message, ec.ECDSA(hashes.SHA256()))
    elif isinstance(key, rsa.RSAPrivateKey):
        signature = key.sign(message, padding.PKCS1v15(), hashes.SHA256())
    else:
        raise ValueError(f"transfer.tls_key: a {type(key).__name__} cannot sign engine proofs (EC or RSA)")
    return SIGNED_PREFIX + _b64(cert.public_bytes(serialization.Encoding.DER)) + "." + _b64(signature)


def load_transfer_ca(pem: bytes, source: str) -> list[Any]:
    """The CA certificates of a PEM bundle (``--transfer-ca``); ValueError names ``source``."""
    from cryptography import x509

    try:
        cas = x509.load_pem_x509_certificates(pem)
    except ValueError as exc:
        raise ValueError(f"{source}: not a PEM certificate bundle ({exc})") from exc
    if not cas:
        raise ValueError(f"{source}: no certificate in it")
    return cas


def signed_proof_refusal(cas: Sequence[Any], proof: str | None, *, cluster: str, node_id: str, engine_url: str,
                         engine_pool: str, metrics_url: str | None,
                         now: datetime.datetime | None = None) -> str | None:
    """Why a signed proof does not hold under the transfer CA ``cas`` (None: it holds): ``no_proof``,
    ``keyed_proof`` (a proof any secret holder can make), ``bad_proof`` (malformed, or a signature over
    other values), ``untrusted_cert`` (not issued by the CA), ``expired_cert``, ``other_node``."""
    from cryptography import x509
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa

    if proof is None:
        return "no_proof"
    if KEYED_PROOF_RE.fullmatch(proof):
        return "keyed_proof"
    if not SIGNED_PROOF_RE.fullmatch(proof):
        return "bad_proof"
    cert_b64, _, sig_b64 = proof[len(SIGNED_PREFIX):].partition(".")
    try:
        cert = x509.load_der_x509_certificate(_unb64(cert_b64))
        signature = _unb64(sig_b64)
    except (ValueError, binascii.Error):
        return "bad_proof"
    if not any(_issued_by(cert, ca) for ca in cas):
        return "untrusted_cert"
    now = now or datetime.datetime.now(datetime.UTC)
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        return "expired_cert"
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        uris = sans.get_values_for_type(x509.UniformResourceIdentifier)
    except x509.ExtensionNotFound:
        uris = []
    if not names_node({u[len(NODE_URI):] for u in uris if u.startswith(NODE_URI)}, node_id):
        return "other_node"
    message = _message(SIGNED_VERSION, cluster, node_id, engine_url, engine_pool, metrics_url)
    key = cert.public_key()
    try:
        if isinstance(key, ec.EllipticCurvePublicKey):
            key.verify(signature, message, ec.ECDSA(hashes.SHA256()))
        elif isinstance(key, rsa.RSAPublicKey):
            key.verify(signature, message, padding.PKCS1v15(), hashes.SHA256())
        else:
            return "bad_proof"
    except InvalidSignature:
        return "bad_proof"
    return None


def _issued_by(cert: Any, ca: Any) -> bool:
    try:
        cert.verify_directly_issued_by(ca)
    except Exception:  # ValueError, TypeError, InvalidSignature: not this CA's
        return False
    return True


def proof_holds(key: bytes, proof: str | None, *, cluster: str, node_id: str, engine_url: str, engine_pool: str,
                metrics_url: str | None) -> bool:
    """Whether ``proof`` is the agent's for exactly these values (constant-time comparison)."""
    if proof is None:
        return False
    expected = engine_proof(key, cluster=cluster, node_id=node_id, engine_url=engine_url, engine_pool=engine_pool,
                            metrics_url=metrics_url)
    return hmac.compare_digest(expected.encode(), proof.encode())


def parse_router_key(text: str, source: str) -> bytes:
    """A router key given as hex (a file's contents or an environment variable); ValueError names ``source``."""
    value = text.strip()
    try:
        key = bytes.fromhex(value)
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise ValueError(f"{source}: expected the router key as {2 * KEY_BYTES} hex chars "
                         "(lmcache-p2p router key --config agent.yaml prints it)")
    return key


def plain_url(url: str | None) -> bool:
    """An http(s) URL the router may call: a host, a valid port, no user info, query or fragment."""
    if url is None or not valid_engine_url(url):
        return False
    parts = urllib.parse.urlsplit(url)
    return parts.username is None and parts.password is None and "@" not in parts.netloc
