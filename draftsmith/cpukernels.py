"""A small-row fp32 matmul for x86 CPUs with AVX2 and FMA: y = x W^T + b that reads the weight ONCE for all rows.

A speculative verify multiplies 2-9 token rows by every weight of the target. The BLAS kernels torch calls treat
that as a row-by-row product on CPUs without AMX (MKL's sgemm streams the whole weight again for each row: on a 2-core
AMD EPYC, 2 rows of a 1536x8960 projection cost 2.4x one row, 5 rows 5x), although a decode step is bound by reading
the weights, not by the arithmetic. `stream_linear` loads each 8-float slice of a weight row once and multiplies it
into every input row held in cache (M accumulators per weight row, 1-4 weight rows at a time; past 8 rows the
weight is tiled so the next 8 read it from L2), so a 2-5 row product costs about one row (RESULTS.md). Weights row-major [out, in], fp32, `in` a multiple of 8.

The kernel is C++ compiled on first use with torch's cpp_extension (about a minute, then cached by torch under
TORCH_EXTENSIONS_DIR); `available()` is False, and draftsmith.cpulayout simply does not offer it, where the CPU
lacks AVX2/FMA or the build fails (the failure is logged once).
"""

from __future__ import annotations

import logging
import platform
from functools import lru_cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_NAME = "draftsmith_stream_linear_v2"  # a new name whenever _SOURCE changes: torch caches builds by name
MAX_ROWS = 16
"""Rows the kernel takes in one call (larger products are left to BLAS: they are compute-bound)."""

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

static inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  __m128 sh = _mm_movehdup_ps(lo);
  __m128 s = _mm_add_ps(lo, sh);
  sh = _mm_movehl_ps(sh, s);
  s = _mm_add_ss(s, sh);
  return _mm_cvtss_f32(s);
}

// Y[r, j] = sum_i X[r, i] W[j, i] + B[j] for r < M, j in [j0, j1): J weight rows at a time, each 8-float slice of
// a weight row loaded once and multiplied into all M input rows.
template <int M, int J>
static void block(const float* X, const float* W, const float* B, float* Y, int64_t k, int64_t n, int64_t j0,
                  int64_t j1) {
  int64_t j = j0;
  for (; j + J <= j1; j += J) {
    __m256 acc[J][M];
    for (int q = 0; q < J; ++q)
      for (int r = 0; r < M; ++r) acc[q][r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i += 8) {
      for (int q = 0; q < J; ++q) {
        _mm_prefetch((const char*)(W + (j + q) * k + i + 512), _MM_HINT_T0);
        __m256 w = _mm256_loadu_ps(W + (j + q) * k + i);
        for (int r = 0; r < M; ++r) acc[q][r] = _mm256_fmadd_ps(_mm256_loadu_ps(X + r * k + i), w, acc[q][r]);
      }
    }
    for (int q = 0; q < J; ++q)
      for (int r = 0; r < M; ++r) Y[r * n + j + q] = hsum(acc[q][r]) + (B ? B[j + q] : 0.f);
  }
  for (; j < j1; ++j) {
    __m256 acc[M];
    for (int r = 0; r < M; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i += 8) {
      __m256 w = _mm256_loadu_ps(W + j * k + i);
      for (int r = 0; r < M; ++r) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(X + r * k + i), w, acc[r]);
    }
    for (int r = 0; r < M; ++r) Y[r * n + j] = hsum(acc[r]) + (B ? B[j] : 0.f);
  }
}

static void rows(int64_t m, const float* X, const float* W, const float* B, float* Y, int64_t k, int64_t n,
                 int64_t j0, int64_t j1) {
  switch (m) {
    case 1: block<1, 4>(X, W, B, Y, k, n, j0, j1); break;
    case 2: block<2, 4>(X, W, B, Y, k, n, j0, j1); break;
    case 3: block<3, 2>(X, W, B, Y, k, n, j0, j1); break;
    case 4: block<4, 2>(X, W, B, Y, k, n, j0, j1); break;
    case 5: block<5, 2>(X, W, B, Y, k, n, j0, j1); break;
    case 6: block<6, 1>(X, W, B, Y, k, n, j0, j1); break;
    case 7: block<7, 1>(X, W, B, Y, k, n, j0, j1); break;
    default: block<8, 1>(X, W, B, Y, k, n, j0, j1); break;
  }
}

torch::Tensor stream_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> b) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && w.scalar_type() == torch::kFloat, "fp32 only");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.size(1) % 8 == 0, "row-major weight, in % 8 == 0");
  auto x2 = x.reshape({-1, x.size(-1)}).contiguous();
  const int64_t m = x2.size(0), k = x2.size(1), n = w.size(0);
  TORCH_CHECK(k == w.size(1), "x and w disagree on in_features");
  auto y = torch::empty({m, n}, x2.options());
  const float* X = x2.data_ptr<float>();
  const float* W = w.data_ptr<float>();
  torch::Tensor bc;
  if (b.has_value()) bc = b->contiguous();
  const float* B = b.has_value() ? bc.data_ptr<float>() : nullptr;
  float* Y = y.data_ptr<float>();
  // weight rows in tiles of ~256 KB: past 8 input rows, the second group of 8 re-reads a tile from L2, not memory
  const int64_t tile = std::max<int64_t>(4, (int64_t(1) << 18) / (4 * k));
  at::parallel_for(0, n, 256, [&](int64_t j0, int64_t j1) {
    for (int64_t jb = j0; jb < j1; jb += tile) {
      const int64_t je = std::min(j1, jb + tile);
      for (int64_t r = 0; r < m; r += 8) rows(std::min<int64_t>(8, m - r), X + r * k, W, B, Y + r * n, k, n, jb, je);
    }
  });
  auto shape = x.sizes().vec();
  shape.back() = n;
  return y.reshape(shape);
}
"""


def _cpu_has_avx2_fma() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    return " avx2" in flags and " fma" in flags


def _built() -> bool:
    """A build of this source is already in torch's extension cache (only decides whether to announce a compile)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        return any(Path(_get_build_directory(_NAME, verbose=False)).glob("*.so"))
    except Exception:  # noqa: BLE001 - a private torch helper: if it moves, the compile is just announced
        return False


@lru_cache(maxsize=1)
def _module():
    if not _cpu_has_avx2_fma():
        return None
    try:
        from torch.utils.cpp_extension import load_inline

        if not _built():
            log.info("compiling the small-row CPU matmul (once per machine, ~1 min; cached by torch)")
        return load_inline(
            _NAME,
            cpp_sources=_SOURCE,
            functions=["stream_linear"],
            extra_cflags=["-O3", "-mavx2", "-mfma"],
            verbose=False,
        )
    except Exception as e:  # noqa: BLE001 - no compiler, no ninja, no headers: the kernel is simply not offered
        log.warning(
            "draftsmith's small-row CPU matmul is unavailable (%s: %s)", type(e).__name__, str(e)[:200]
        )
        return None


def available() -> bool:
    """True where the kernel runs (x86 with AVX2 + FMA, and it compiled)."""
    return _module() is not None


def stream_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for fp32 CPU tensors with a row-major weight [out, in] (in % 8 == 0), reading the
    weight once for up to MAX_ROWS rows of x. Call only where `available()`."""
    return _module().stream_linear(x, weight, bias)
