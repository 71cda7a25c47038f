#!/usr/bin/env bash
# Lint and type-check: a step of its own (scripts/test.sh runs it before the tests; CI through it).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m ruff check .
# mypy's cache is kept per machine, like the test models (a cold check takes ~50 s, a warm one seconds;
# mypy revalidates every cached module against its source).
export MYPY_CACHE_DIR=${MYPY_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/lmcache-p2p/mypy}
.venv/bin/python -m mypy lmcache_p2p kernels coordinator
