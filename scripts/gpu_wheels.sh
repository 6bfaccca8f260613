#!/usr/bin/env bash
# Download, on a machine with package access, the pure-Python wheels that a bare GPU machine lacks, so that
# `scripts/gpu_check.sh` can install them there without network (pip --no-index from this folder).
#
#   bash scripts/gpu_wheels.sh [DIR]          # default DIR: .whl (git-ignored), ~30 MB
#   PYVER=3.12 bash scripts/gpu_wheels.sh     # the GPU machine's Python (multiprocess ships one wheel per Python)
#
# Which packages: draftsmith's dependencies that a CUDA image with torch / transformers / accelerate / peft /
# lightning / pandas / pyarrow / xxhash lacks or carries too old, and what the newer ones need in turn:
# `transformers` itself (draftsmith needs >= 5.24, forward(cache=...); images lag behind, one seen with 5.17,
# whose models ignore cache=) and what transformers 5.25 checks at import or requires: huggingface_hub >= 2.4
# (images seen with 1.33) with httpx2 / httpcore2 / truststore / hf_xet / click, kernels with tomlkit, tokenizers,
# regex; `datasets` (with dill, multiprocess, an fsspec it accepts) and `gguf`. Pure-Python wheels except
# tokenizers, regex, hf_xet and multiprocess (one per Python: PYVER). Versions are the ones installed in this
# checkout's .venv (what the CPU test suite ran against) unless a VERSION override is set, e.g. DATASETS=5.2.0.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
PYVER=${PYVER:-3.12}
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3

version() {  # installed version of $1 in the local environment, or the override in $2
  if [ -n "${2:-}" ]; then echo "$2"; return; fi
  "$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1" 2>/dev/null || true
}

specs=()
for pair in "datasets:${DATASETS:-}" "gguf:${GGUF:-}" "dill:${DILL:-}" "multiprocess:${MULTIPROCESS:-}" \
  "fsspec:${FSSPEC:-}" "transformers:${TRANSFORMERS:-}" "huggingface_hub:${HUGGINGFACE_HUB:-}" "httpx2:" \
  "httpcore2:" "truststore:" "hf_xet:" "click:" "kernels:" "tomlkit:" "tokenizers:${TOKENIZERS:-}" "regex:"; do
  name=${pair%%:*}
  v=$(version "$name" "${pair#*:}")
  specs+=("${name}${v:+==$v}")
done

mkdir -p "$DIR"
echo "downloading ${specs[*]} (Python $PYVER, no dependencies) into $DIR"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any \
  -d "$DIR" "${specs[@]}"
# one version per package: two wheels of one name would make the offline install ambiguous
dups=$(ls "$DIR"/*.whl | xargs -n1 basename | cut -d- -f1 | sort | uniq -d)
if [ -n "$dups" ]; then
  echo "error: $DIR holds more than one version of: $dups; delete the old wheels and rerun" >&2
  exit 2
fi
ls -la "$DIR"
echo "done: scripts/gpu_check.sh installs these with pip --no-index --no-deps from $DIR"
