#!/usr/bin/env bash
# The test command: set up .venv (reused when up to date) and run the whole suite, slow tests included.
# Extra arguments go to pytest, e.g. scripts/test.sh -m "not slow" -x
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo}
# pytest exits 5 when it collects no tests, so an empty run fails here too.
exec .venv/bin/python -m pytest "$@"
