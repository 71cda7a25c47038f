#!/usr/bin/env bash
# Write k8s/cluster-secret.txt: the cluster key, 32 random bytes as hex, readable by you only.
# kustomization.yaml turns it into the Secret lmcache-p2p-secret. Refuses to overwrite an existing key
# (agents holding different keys refuse each other: rotate by restarting every agent at once).
set -euo pipefail
cd "$(dirname "$0")"
if [ -e cluster-secret.txt ]; then
  echo "cluster-secret.txt exists; remove it first to rotate the key" >&2
  exit 1
fi
umask 077
python3 -c 'import secrets; print(secrets.token_hex(32), end="")' > cluster-secret.txt
echo "wrote $(pwd)/cluster-secret.txt; keep it out of version control" >&2
