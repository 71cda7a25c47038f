"""Which announced engines a router may use: the agent proves the engine it announces, the router checks.

    router key    HMAC-SHA256(cluster secret, "lmcache-p2p router key v1")          32 bytes
    engine proof  hex HMAC-SHA256(router key, canonical JSON of
                  [PROOF_VERSION, cluster, node_id, engine_url, engine_pool, metrics_url])

An agent holds the cluster secret and publishes ``engine_proof`` in its node record; a router holds
only the router key (``lmcache-p2p router key`` prints it from a node's config). The key is derived for
this one purpose: with it a router checks (and could make) engine proofs, but it cannot pass the
transfer handshake, which needs the cluster secret, so it cannot join the mesh as a node. A record that
anyone else who can write etcd forges or edits (another engine URL, pool, metrics URL, node id or
cluster) fails the check and is never contacted. A proof does not expire: a record replayed unchanged
names the engine its agent announced.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import urllib.parse

from ..config import valid_engine_url

ROUTER_KEY_LABEL = b"lmcache-p2p router key v1"
PROOF_VERSION = "lmcache-p2p engine proof v1"
KEY_BYTES = 32
PROOF_RE = re.compile("[0-9a-f]{64}")


def router_key(secret: bytes) -> bytes:
    """The router key of a cluster secret."""
    return hmac.new(secret, ROUTER_KEY_LABEL, hashlib.sha256).digest()


def engine_proof(key: bytes, *, cluster: str, node_id: str, engine_url: str, engine_pool: str,
                 metrics_url: str | None) -> str:
    """What an agent publishes for the engine it announces (hex, 64 chars)."""
    message = json.dumps([PROOF_VERSION, cluster, node_id, engine_url, engine_pool, metrics_url],
                         separators=(",", ":"), ensure_ascii=True).encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


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
