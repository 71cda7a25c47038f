#!/usr/bin/env bash
# Lint and type-check: a step of its own (scripts/test.sh runs it before the tests; CI through it).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m ruff check .
.venv/bin/python -m mypy lmcache_p2p kernels coordinator
