#!/usr/bin/env bash
# Write k8s/pki/: a cluster CA and the certificates the manifests mount (git-ignored, keys mode 600).
#
#   etcd-server   etcd's client and peer certificate: the Service names, every member's peer name
#   etcd-client   the agents' client certificate (etcd runs --client-cert-auth)
#   transfer      the agents' transfer TLS certificate (transfer.tls_*: mutual TLS between agents)
#
# The names carry the namespace: NAMESPACE=other k8s/generate-certs.sh for another one. Needs
# openssl and lmcache-p2p (`pip install lmcache-p2p`; PYTHON=... picks the interpreter). Refuses to
# overwrite an existing CA: delete k8s/pki/ to issue new certificates, then restart etcd and agents.
set -euo pipefail
cd "$(dirname "$0")"
ns=${NAMESPACE:-lmcache-p2p}
if [ -e pki/ca.key ]; then
  echo "pki/ca.key exists; remove k8s/pki/ first to issue a new CA" >&2
  exit 1
fi
"${PYTHON:-python3}" -m lmcache_p2p certs pki \
  "etcd-server=DNS:lmcache-etcd,DNS:lmcache-etcd.$ns,DNS:lmcache-etcd.$ns.svc,DNS:*.lmcache-etcd-peer.$ns.svc,DNS:localhost,IP:127.0.0.1" \
  etcd-client transfer
