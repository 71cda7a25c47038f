#!/usr/bin/env bash
# Write k8s/cluster-secret.txt: the cluster key, 32 random bytes as hex, readable by you only.
# kustomization.yaml turns it into the Secret lmcache-p2p-secret. Refuses to overwrite an existing key
# (agents holding different keys refuse each other: rotate by restarting every agent at once).
# Also writes k8s/router-key.txt: the router key derived from it (what `lmcache-p2p router key` prints;
# lmcache_p2p/router/proof.py), for the Secret lmcache-p2p-router-key: routers check the engines'
# proofs with it and never hold the cluster key itself. And k8s/score-key.txt (when missing): the agents'
# score_api_key, which the router presents to their /v1/score (in the same Secret).
set -euo pipefail
cd "$(dirname "$0")"
umask 077
if [ ! -e score-key.txt ]; then
  python3 -c 'import secrets; print(secrets.token_hex(32), end="")' > score-key.txt
  echo "wrote $(pwd)/score-key.txt" >&2
fi
if [ -e cluster-secret.txt ]; then
  echo "cluster-secret.txt exists; remove it first to rotate the key" >&2
  exit 1
fi
python3 -c 'import secrets; print(secrets.token_hex(32), end="")' > cluster-secret.txt
python3 -c 'import hashlib, hmac
secret = open("cluster-secret.txt", "rb").read()
print(hmac.new(secret, b"lmcache-p2p router key v1", hashlib.sha256).hexdigest(), end="")' > router-key.txt
echo "wrote $(pwd)/cluster-secret.txt and router-key.txt; keep them out of version control" >&2
