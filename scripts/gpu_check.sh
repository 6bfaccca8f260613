#!/usr/bin/env bash
# The GPU path in one prepared run (~8 min on one H200): gpu-marked tests, the hardware cost model, training
# throughput; one report, OUT_DIR/gpu_check.json + gpu_check.md (see GPU.md).
#
#   bash scripts/gpu_check.sh OUT_DIR            # a CUDA machine (offline is fine: wheels from .whl/, see below)
#   bash scripts/gpu_check.sh OUT_DIR --dry      # any machine: tiny shapes on the CPU, proves every phase starts
#
# Offline machines: run `bash scripts/gpu_wheels.sh` where pip can reach PyPI, bring .whl/ along; this script
# installs those wheels and draftsmith itself into a temporary folder with pip --no-index (nothing is fetched).
# A rerun of what failed: PYTEST_K="medusa" passes -k to pytest (the default runs every gpu-marked test).
# Time limits (seconds, override by environment): PYTEST_S=200 BENCH_S=250; the benchmarks also stop starting new
# measurements when their own budget runs out, and the report is rewritten after every phase.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-}
MODE=${2:-}
if [ -z "$OUT" ] || { [ -n "$MODE" ] && [ "$MODE" != "--dry" ]; }; then
  echo "error: usage: bash scripts/gpu_check.sh OUT_DIR [--dry]" >&2
  exit 2
fi
if [ -e "$OUT" ] && [ -n "$(ls -A "$OUT" 2>/dev/null)" ]; then
  echo "error: $OUT exists and is not empty; pass a new folder (reports are never overwritten)" >&2
  exit 2
fi
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ "$MODE" = "--dry" ] && [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3; fi
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
# the checkout's own draftsmith/ holds only the core package (decode/, heads/, distill/ are mapped in by the
# install): with the working directory on sys.path it would shadow the installed one, so Python leaves it off
export PYTHONSAFEPATH=1
log() { echo "[gpu_check $(date +%H:%M:%S)] $*"; }

# 1. what the machine lacks, from local wheels only (.whl/ wins over the machine's own versions: the CPU suite ran
#    against them, and an older transformers than 5.24 would make the decoder refuse to run)
SITE=$(mktemp -d)/site
if [ "$MODE" != "--dry" ] && ls .whl/*.whl >/dev/null 2>&1; then  # a dry run uses the environment as it is
  log "installing $(ls .whl/*.whl | wc -l) wheels from .whl/ (no index)"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl >"$OUT/install.log" 2>&1 \
    || log "wheel install failed (see install.log); continuing"
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! "$PY" -c "import draftsmith.app.bench.gpu_check" >/dev/null 2>&1; then
  log "installing draftsmith from this checkout (no index, no dependencies)"
  "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target "$SITE" . \
    >>"$OUT/install.log" 2>&1 || { log "error: draftsmith did not install (see $OUT/install.log)"; exit 2; }
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PY" -c "import datasets, gguf" >/dev/null 2>&1 || log "note: datasets/gguf missing (bring .whl/: scripts/gpu_wheels.sh)"
log "$("$PY" -c 'import torch, transformers; print(f"torch {torch.__version__}, transformers {transformers.__version__}, cuda {torch.cuda.is_available()}")' 2>&1 | tail -1)"

# 2. gpu-marked tests (the dry run collects them from the GPU test module only: they skip without CUDA)
TESTS=tests
[ "$MODE" = "--dry" ] && TESTS=tests/test_gpu.py
log "pytest -m gpu $TESTS"
# a test module that cannot import here (an optional package the machine lacks) must not stop the gpu set
timeout "${PYTEST_S:-200}" "$PY" -m pytest -m gpu -q -p no:cacheprovider --continue-on-collection-errors "$TESTS" \
  ${PYTEST_K:+-k "$PYTEST_K"} --junitxml "$OUT/pytest-gpu.xml" >"$OUT/pytest-gpu.log" 2>&1
PYTEST_RC=$?
tail -n 3 "$OUT/pytest-gpu.log"

# 3. cost model + training throughput + the report, which names the checkout's commit: git's where it is here (a
#    copied working tree may come without .git: pass DRAFTSMITH_COMMIT then), "+changes" for uncommitted edits
COMMIT=${DRAFTSMITH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
if [ -z "${DRAFTSMITH_COMMIT:-}" ] && [ "$COMMIT" != unknown ] && ! git diff --quiet HEAD 2>/dev/null; then
  COMMIT="$COMMIT+changes"
fi
PROFILES=$(ls results/profiles/*.json 2>/dev/null || true)
log "benchmarks and report"
timeout "${BENCH_S:-250}" "$PY" -m draftsmith.app.cli bench gpu-check "$OUT" ${MODE:+--dry} --pytest-rc "$PYTEST_RC" --commit "$COMMIT" \
  --budget-s "$(( ${BENCH_S:-250} - 30 ))" ${PROFILES:+--profiles $PROFILES} 2>&1 | tee "$OUT/bench.log"
RC=${PIPESTATUS[0]}
if [ ! -s "$OUT/gpu_check.json" ]; then  # the benchmark process died before its first report
  printf '{"mode": "%s", "pytest_rc": %s, "errors": {"bench": {"error": "benchmark process exited %s before writing a report; see bench.log"}}}\n' \
    "${MODE:-gpu}" "$PYTEST_RC" "$RC" >"$OUT/gpu_check.json"
  printf '# draftsmith GPU check\n\nThe benchmark process exited %s before writing a report; see bench.log.\n' "$RC" >"$OUT/gpu_check.md"
fi
log "report: $OUT/gpu_check.md (pytest exit $PYTEST_RC, benchmarks exit $RC)"
[ "$PYTEST_RC" -eq 0 ] || [ "$PYTEST_RC" -eq 5 ] || exit 1
exit "$RC"
