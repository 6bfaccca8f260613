#!/usr/bin/env bash
# Speculative decoding by batch size on this machine, both embedded targets, one benchmark process per target
# (`draftsmith bench drafters --batch-size`): n-gram, the distilled draft LM, EAGLE-3 and the best drafter against plain
# batched decoding at B = 1, 2, 4, 8, 16 (tau, tokens/s, speedup, verify cost, best k, break-even batch size).
#   bash scripts/bench_batch.sh OUT SMOL_DRAFT SMOL_EAGLE3 QWEN_DRAFT QWEN_EAGLE3 [SMOL_BEST] [QWEN_BEST]
# SMOL_* / QWEN_* are drafter folders trained for smollm2-135m / qwen2.5-coder-1.5b (a draft may also be an embedded
# name, e.g. qwen2.5-coder-0.5b; "" leaves that drafter out, e.g. a head not trained yet); *_BEST is a further
# drafter as NAME=SPEC@K (e.g. eagle3-k1=eagle:DIR,top_k=1@1), or "" for none. Writes OUT/smollm2-135m/ and
# OUT/qwen2.5-coder-1.5b/ (bench.json with a `batch` section per drafter, bench.png, bench-batch.png, log.txt).
# Settings (environment): BATCH=1,2,4,8,16 PROMPTS=builtin:dev-eval LIMIT=16 NEW=64 K_DRAFT=4 K_EAGLE=2 K_NGRAM=4
# SWEEP=1 (also measure every k <= K at every batch size), SMOL_TARGET / QWEN_TARGET (other targets, e.g. tests).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 5 ]; then
  echo "error: usage: bash scripts/bench_batch.sh OUT SMOL_DRAFT SMOL_EAGLE3 QWEN_DRAFT QWEN_EAGLE3 [SMOL_BEST] [QWEN_BEST]" >&2
  exit 2
fi
OUT=$1
PY=${PYTHON:-.venv/bin/python}
BATCH=${BATCH:-1,2,4,8,16} PROMPTS=${PROMPTS:-builtin:dev-eval} LIMIT=${LIMIT:-16} NEW=${NEW:-64}
K_DRAFT=${K_DRAFT:-4} K_EAGLE=${K_EAGLE:-2} K_NGRAM=${K_NGRAM:-4}
SWEEP_FLAG=()
if [ "${SWEEP:-0}" = 1 ]; then SWEEP_FLAG=(--sweep-k); fi
EMBEDDED=" $("$PY" -c 'from draftsmith.models import EMBEDDED_TARGETS; print(*EMBEDDED_TARGETS)') "
for folder in "$2" "$3" "$4" "$5"; do
  if [ -z "$folder" ] || [[ "$EMBEDDED" == *" $folder "* ]]; then continue; fi
  [ -d "$folder" ] || { echo "error: drafter folder $folder does not exist; pass trained drafter folders, an embedded name or \"\" to leave one out" >&2; exit 2; }
done
if [ -e "$OUT" ]; then echo "error: $OUT exists; pass a new OUT (results are never overwritten)" >&2; exit 2; fi

run() {  # TARGET NAME DRAFT EAGLE3 BEST
  local target=$1 name=$2 best=$5
  local drafters=(--drafter "ngram=ngram:@$K_NGRAM")
  if [ -n "$3" ]; then drafters+=(--drafter "draft=draft:$3@$K_DRAFT"); fi
  if [ -n "$4" ]; then drafters+=(--drafter "eagle3=eagle3:$4,top_k=1@$K_EAGLE"); fi
  if [ -n "$best" ]; then drafters+=(--drafter "$best"); fi
  mkdir -p "$OUT/$name"
  nice -n "${NICE:-0}" "$PY" -m draftsmith.app.cli bench drafters --target "$target" --prompts "$PROMPTS" --limit "$LIMIT" \
    --max-new-tokens "$NEW" --batch-size "$BATCH" "${SWEEP_FLAG[@]}" "${drafters[@]}" --out "$OUT/$name" \
    2>&1 | tee "$OUT/$name/log.txt"
}
run "${SMOL_TARGET:-smollm2-135m}" smollm2-135m "$2" "$3" "${6:-}"
run "${QWEN_TARGET:-qwen2.5-coder-1.5b}" qwen2.5-coder-1.5b "$4" "$5" "${7:-}"
