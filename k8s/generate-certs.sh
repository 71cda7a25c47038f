#!/usr/bin/env bash
# Write k8s/pki/: two CAs and the certificates the manifests mount (git-ignored, keys mode 600).
#
#   pki/etcd/       the etcd CA (ca.crt) and
#     etcd-server   etcd's client and peer certificate: the Service names, every member's peer name
#   and one client certificate per etcd user (etcd runs --client-cert-auth; with auth on, which
#   etcd-auth.sh turns on, the certificate's CN, here its file name, is the etcd user):
#     lmcache-p2p-agent    the agents' (read-write on the cluster's keys; Secret lmcache-p2p-etcd-client)
#     lmcache-p2p-router   the router's (read-only; Secret lmcache-p2p-etcd-router)
#     root                 etcd's root user, for etcd-auth-job.yaml only (Secret lmcache-p2p-etcd-root)
#   pki/transfer/   the transfer CA (ca.crt: transfer.tls_ca_cert) and one transfer TLS certificate
#     <pod>         per agent pod (transfer.tls_*), naming that pod: lmcache-vllm-0 ..
#                   lmcache-vllm-(VLLM_REPLICAS-1) and lmcache-cache-agent-0 ..
#                   lmcache-cache-agent-(CACHE_AGENTS-1); a peer refuses it as any other node
#
# Two CAs, so that neither kind of certificate passes as the other: the transfer port trusts only
# the transfer CA (an etcd client certificate, whose key every agent or router holds and which names
# no node, cannot answer as a node), and etcd trusts only its own (a pod's transfer key opens no etcd).
#
# The names carry the namespace: NAMESPACE=other k8s/generate-certs.sh for another one. Needs
# openssl and lmcache-p2p (`pip install lmcache-p2p`; PYTHON=... picks the interpreter). Refuses to
# overwrite an existing CA: delete k8s/pki/ to issue new certificates, then restart etcd and agents.
# For pods added later, issue their certificates with the same transfer CA (k8s/README.md: TLS):
#   python3 -m lmcache_p2p certs k8s/pki/transfer lmcache-vllm-2=node:lmcache-vllm-2
set -euo pipefail
cd "$(dirname "$0")"
ns=${NAMESPACE:-lmcache-p2p}
vllm=${VLLM_REPLICAS:-2}      # keep equal to replicas in vllm.yaml and the files in kustomization.yaml
cache=${CACHE_AGENTS:-0}      # likewise for cache-agent.yaml
for ca in pki/ca.key pki/etcd/ca.key pki/transfer/ca.key; do
  if [ -e "$ca" ]; then
    echo "$ca exists; remove k8s/pki/ first to issue new CAs" >&2
    exit 1
  fi
done
transfer=()
for ((i = 0; i < vllm; i++)); do transfer+=("lmcache-vllm-$i=node:lmcache-vllm-$i"); done
for ((i = 0; i < cache; i++)); do transfer+=("lmcache-cache-agent-$i=node:lmcache-cache-agent-$i"); done
"${PYTHON:-python3}" -m lmcache_p2p certs pki/etcd \
  "etcd-server=DNS:lmcache-etcd,DNS:lmcache-etcd.$ns,DNS:lmcache-etcd.$ns.svc,DNS:*.lmcache-etcd-peer.$ns.svc,DNS:localhost,IP:127.0.0.1" \
  lmcache-p2p-agent lmcache-p2p-router root
"${PYTHON:-python3}" -m lmcache_p2p certs pki/transfer "${transfer[@]}"
