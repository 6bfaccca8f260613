#!/usr/bin/env bash
# Loss ablation on the embedded target (resumable: rerun the same command after a stop):
#   bash scripts/loss_ablation.sh OUT distill [bench loss-ablation options]   # the quickstart draft LM recipe
#   bash scripts/loss_ablation.sh OUT eagle3  [bench loss-ablation options]   # the EAGLE-3 CPU recipe, shortened
# The training data is generated once under OUT/data (the recipes' own generate commands), every run of a trainer
# reads the same data (EAGLE-3 runs share one hidden-state cache), then `draftsmith bench loss-ablation` trains each loss
# with two seeds and measures every checkpoint in one decoder run (greedy and T=1) on dev-eval and on 64 training
# prompts its data did not use (the distribution of the trainer's held-out prediction). Writes OUT/<trainer>/ablation.*.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: bash scripts/loss_ablation.sh OUT distill|eagle3 [options]}
TRAINER=${2:?usage: bash scripts/loss_ablation.sh OUT distill|eagle3 [options]}
shift 2
PY=${PYTHON:-.venv/bin/python}
case "$TRAINER" in
  distill)
    data="$OUT/data/quickstart"
    # the target scores the data once for every loss and seed (the recipe keeps its top-64 logits per token)
    sets=(--set "data.source=[$data,builtin:train-text]" --set "data.target_topk_file=$OUT/data/quickstart-top64.safetensors")
    # training prompts the data did not use (it takes the first 400): measured beside dev-eval, they are the
    # distribution the trainer's held-out prediction is taken on
    heldout="$OUT/data/train-heldout.jsonl"
    limit=400 ;;
  eagle3)
    data="$OUT/data/heads"
    heldout="$OUT/data/train-heldout-heads.jsonl"
    # 200 of the recipe's 600 steps and 1,500 of its 6,773 text pairs (a 2-core fp32 budget); the target states a
    # run computes are cached (hybrid) in one folder every later loss and seed reads
    sets=(--set "data.source=[$data,builtin:train-text]" --set "data.limit=[null,1500]" --set train.max_steps=200
          --set data.hidden_states=hybrid --set "data.hidden_cache=$OUT/data/eagle3-cache")
    # builtin:train holds 1,275 prompts: the last 64 are the held-out ones
    limit=1211 ;;
  *) echo "error: trainer must be distill or eagle3, got $TRAINER; pass one of them second" >&2; exit 2 ;;
esac
# every argument and recipe override is checked (a dry plan, nothing written) before the data is generated;
# --dry stops there
for a in "$@"; do [ "$a" = --dry ] && exec "$PY" -m draftsmith.app.cli bench loss-ablation "$OUT" --trainer "$TRAINER" "${sets[@]}" "$@"; done
"$PY" -m draftsmith.app.cli bench loss-ablation "$OUT" --trainer "$TRAINER" "${sets[@]}" "$@" --dry > /dev/null
# the held-out prompts (the 64 after the data's), checked before any compute
[ -f "$heldout" ] || "$PY" -c "import json, sys
from pathlib import Path
from draftsmith.fileio import write_text
from draftsmith.prompts import load_prompts
n = int(sys.argv[2])
rest = load_prompts('builtin:train')[n:n + 64]
if len(rest) < 64:
    print(f'error: builtin:train has {n + len(rest)} prompts, {len(rest)} after the {n} the data uses; '
          'lower the data limit to hold 64 out', file=sys.stderr)
    sys.exit(2)
Path(sys.argv[1]).parent.mkdir(parents=True, exist_ok=True)
write_text(sys.argv[1], ''.join(json.dumps({'messages': p.messages, 'category': p.category}) + '\n' for p in rest))" "$heldout" "$limit"
"$PY" -m draftsmith.app.cli generate --target smollm2-135m --prompts builtin:train --limit "$limit" \
  --max-new-tokens 80 --max-prompt-tokens 160 --skip-long --out "$data"
sets+=(--prompts "builtin:dev-eval,$heldout")
exec "$PY" -m draftsmith.app.cli bench loss-ablation "$OUT" --trainer "$TRAINER" "${sets[@]}" "$@"
