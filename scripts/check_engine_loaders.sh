#!/usr/bin/env bash
# Load draftsmith's DFlash / P-EAGLE exports with speculators' own loader (not part of the test suite).
#
#   bash scripts/check_engine_loaders.sh [OUT_DIR]      # default OUT_DIR /tmp/engine_loaders
#
# Builds a side venv ($SPEC_VENV, default /tmp/specvenv) with the CPU torch wheel and speculators installed without
# its dependencies (its declared ones pull torchvision/torchaudio, i.e. a CUDA torch), plus the pure-Python packages
# it imports; exports tiny drafters with the project venv; loads them in the side venv and compares weights, config
# fields and the DFlash forward (`draftsmith bench engine-loaders`), for a tiny Llama and a tiny Qwen2 target. Last run
# (Llama target only, before the Qwen2 half was added): speculators 0.9.0, transformers 5.19.0,
# torch 2.13.0+cpu -> "ALL LOADED AND MATCHED". vLLM and SGLang need CUDA to import their model code; their
# loaders were read, not run.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/engine_loaders}
SPEC_VENV=${SPEC_VENV:-/tmp/specvenv}
SPECULATORS=${SPECULATORS:-speculators}   # e.g. speculators==0.9.0

if ! "$SPEC_VENV/bin/python" -c "import speculators.models" 2>/dev/null; then
    python3 -m venv "$SPEC_VENV"
    pip="$SPEC_VENV/bin/pip"
    "$pip" install -q torch==2.13.0   # this pin resolves to the CPU wheel here; an unpinned torch is the CUDA build
    "$pip" install -q --no-deps "$SPECULATORS" hs-connectors
    "$pip" install -q torch==2.13.0 pydantic pydantic-settings "transformers>=5,<=5.19.0" safetensors huggingface_hub \
        "loguru>=0.7.2,<=0.7.3" "numpy>=2,<=2.5.4" "tqdm<=4.70.1" rich typer click psutil protobuf openai \
        "datasets>=4,<=5.1.0"
fi

rm -rf "$OUT"
.venv/bin/python -m draftsmith.app.cli bench engine-loaders export "$OUT"
# the side venv has no draftsmith: the module runs from this checkout (it imports nothing of draftsmith's there)
PYTHONPATH="$PWD" HF_HUB_OFFLINE=1 "$SPEC_VENV/bin/python" -m draftsmith.app.bench.engine_loaders load "$OUT"
