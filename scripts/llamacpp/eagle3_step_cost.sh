#!/usr/bin/env bash
# The EAGLE-3 draft step's cost inside llama.cpp, apart from the target's: a reproduction for an upstream report.
#
#   bash scripts/llamacpp/eagle3_step_cost.sh TARGET.gguf HEAD.gguf [OUT_DIR]
#
# TARGET.gguf: the target (e.g. Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf); HEAD.gguf: its EAGLE-3 head
# (`draftsmith export HEAD_DIR --format gguf --target-dir ...`, or any EAGLE-3 GGUF). Runs, on one greedy prompt:
#   1. llama-bench tg N: the target's plain decode rate;
#   2. llama-speculative-simple --spec-type draft-eagle3 at --spec-draft-n-max 1, 2 and 3 with --spec-draft-p-min 0
#      (every step drafts n-max tokens), the head in f16 as given: decode rate, drafted/accepted tokens and the
#      draft generation time llama.cpp itself records (dur(b,g,a): begin, generate, accept, in ms);
#   3. the same at n-max 3 under `perf record -g` (user space, cpu-clock) and the top of `perf report`.
# Per drafted token: generate time / drafted tokens. If that is far above the head's weight bytes over the
# target's bytes per plain token (the memory-bound cost), the rest is the engine's overhead; the profile says where.
# Env: LLAMACPP_BIN (default the pinned build of scripts/llamacpp/build.sh), THREADS (default nproc), N (64).
set -euo pipefail
T=${1:?usage: eagle3_step_cost.sh TARGET.gguf HEAD.gguf [OUT_DIR]}
H=${2:?usage: eagle3_step_cost.sh TARGET.gguf HEAD.gguf [OUT_DIR]}
OUT=${3:-eagle3-step-cost}
BIN=${LLAMACPP_BIN:-$HOME/.cache/draftsmith/llama.cpp/11434.0.0/bin}
THREADS=${THREADS:-$(nproc)}
N=${N:-64}
for f in "$T" "$H" "$BIN/llama-bench" "$BIN/llama-speculative-simple"; do
  [ -e "$f" ] || { echo "error: $f not found; build llama.cpp (WITH_LLAMACPP=1 bash scripts/setup.sh) or fix the path" >&2; exit 2; }
done
if [ -e "$OUT" ]; then echo "error: $OUT exists; choose another OUT_DIR" >&2; exit 2; fi
mkdir -p "$OUT"
PROMPT="Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring and two tests."
{
  echo "# $(date -u +%F) $(lscpu | sed -n 's/^Model name: *//p'), $THREADS threads; llama.cpp $(cat "$BIN/../BUILD_INFO" 2>/dev/null | head -1)"
  echo "# target $(basename "$T") ($(stat -c %s "$T") bytes), head $(basename "$H") ($(stat -c %s "$H") bytes)"
  "$BIN/llama-bench" -m "$T" -p 0 -n "$N" -t "$THREADS" -r 3 -o md 2>/dev/null
} | tee "$OUT/plain.md"
for nmax in 1 2 3; do
  "$BIN/llama-speculative-simple" -m "$T" -md "$H" --spec-type draft-eagle3 --spec-draft-n-max "$nmax" \
    --spec-draft-n-min 0 --spec-draft-p-min 0 -p "$PROMPT" -n "$N" -t "$THREADS" --temp 0 -lv 4 \
    > "$OUT/eagle3-n$nmax.log" 2>&1
  echo "n-max $nmax: $(grep -E 'decoded|n_drafted|n_accept|dur\(b,g,a\)' "$OUT/eagle3-n$nmax.log" | tr -s ' ' | tr '\n' ';')"
done | tee "$OUT/eagle3.txt"
perf record -q -g -e cpu-clock -o "$OUT/perf.data" -- "$BIN/llama-speculative-simple" -m "$T" -md "$H" \
  --spec-type draft-eagle3 --spec-draft-n-max 3 --spec-draft-n-min 0 --spec-draft-p-min 0 -p "$PROMPT" -n "$N" \
  -t "$THREADS" --temp 0 > "$OUT/perf-run.log" 2>&1
perf report -i "$OUT/perf.data" --stdio --no-children --sort dso,symbol 2>/dev/null | grep -v '^$' | head -80 > "$OUT/perf-top.txt"
head -40 "$OUT/perf-top.txt"
