#!/usr/bin/env bash
# The memory-bound showcase (`draftsmith bench showcase`): data, every Qwen2.5-Coder-1.5B recipe, the layer-skip search and
# one benchmark run of every drafter and transformers' peers. Resumable: rerun the same command after a stop.
#   WITH_QWEN=1 bash scripts/setup.sh      # once: the embedded Qwen2.5-Coder parts
#   bash scripts/showcase.sh runs/showcase [--limit 8] [--max-new-tokens 64] [--dry]
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-.venv/bin/python}" -m draftsmith.app.cli bench showcase "$@"
