#!/usr/bin/env bash
# Equal-budget training of EAGLE-3, DFlash and P-EAGLE on the embedded target (issue 11): the three CPU recipes
# unchanged (600 steps x 8 conversations, seed 0), the same data, the same held-out rows and ONE shared
# hidden-state cache (filled by the EAGLE-3 run, read by the other two: same seed -> same batches).
#   bash scripts/block_budget.sh [OUT]      (default runs/b2; a finished stage is skipped on a rerun)
set -euo pipefail
OUT=${1:-runs/b2}
PY=${PY:-.venv/bin/python}
mkdir -p "$OUT"
if [ ! -f "$OUT/data/manifest.json" ]; then
  .venv/bin/draftsmith generate --target smollm2-135m --prompts builtin:train --limit 1275 --max-new-tokens 80 \
    --max-prompt-tokens 160 --out "$OUT/data"
fi
COMMON=("data.source=[$OUT/data,builtin:train-text]" "data.hidden_cache=$OUT/cache" "data.eval_size=20")
for kind in eagle3 dflash peagle; do
  if [ -d "$OUT/$kind/final" ]; then echo "$kind: done"; continue; fi
  resume=()
  [ -d "$OUT/$kind/checkpoints" ] && resume=(--resume)
  /usr/bin/time -v "$PY" train/heads.py --config "recipes/heads-smollm2-135m-$kind.yaml" "output_dir=$OUT/$kind" \
    "${COMMON[@]}" --no-progress "${resume[@]}" > "$OUT/$kind.log" 2>&1
  grep "done:" "$OUT/$kind.log" || { tail -n 5 "$OUT/$kind.log"; exit 1; }
done
