"""Weight layout of nn.Linear for CPU inference, chosen by measuring the machine.

A speculative verify multiplies a handful of rows (2-16 tokens) by every weight of the target. On CPUs, MKL's sgemm
picks its kernel from the operand layout, and for 4-32 rows against the nn.Linear layout (row-major [out, in]) it
picks a slow one: on a 2-core AVX-512 Xeon a 16-token forward of SmolLM2-135M after a 300-token cache took 138 ms
against 41 ms for one token. With the same weights stored column-major (an [in, out] contiguous tensor viewed as
[out, in], so shapes and state_dict keys do not change) it takes 78 ms; 8 tokens 69 ms instead of 94 (RESULTS.md).
For 2-3 rows the row-major kernel is the faster one.

`tune_linears(model)` times both layouts for 1..16 rows on each distinct weight shape once per process, re-lays
every Linear out column-major where that layout wins, and keeps a row-major copy (a non-persistent buffer) for the
row counts where it is faster, when that copy fits `max_extra_bytes`. Prefill (hundreds of rows) uses the
column-major weight, which measured as fast or faster there. Nothing changes on GPUs or for trainable modules.
DRAFTSMITH_CPU_LAYOUT=off turns it off (for A/B timing).
"""

from __future__ import annotations

import os
import time
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.errors import DraftsmithError

ROWS = (1, 2, 3, 4, 6, 8, 12, 16)
"""Row counts measured; a count between two of them takes the decision of the lower one, above 16 the one of 16."""

_DECISIONS: dict[tuple[int, int, torch.dtype], frozenset[int]] = {}
"""(in, out, dtype) -> measured row counts where the row-major layout is faster (per process)."""

REPS, MARGIN = 5, 0.05
"""Row-major is kept for a row count only if its median time is >= 5% below column-major's (a copy costs memory)."""
_STREAM_BYTES = 32 << 20
"""Each timing multiplies this many bytes of weight copies, so they stream from memory as in a real forward."""


class TunedLinear(nn.Linear):
    """nn.Linear whose weight is column-major, with a row-major copy for the row counts where that is faster."""

    row_major_rows: frozenset[int]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_major_rows and not self.weight.requires_grad:  # a copy goes stale once the weight trains
            rows = x.numel() // self.in_features
            if _bucket(rows) in self.row_major_rows:
                return F.linear(x, self.row_major, self.bias)
        return F.linear(x, self.weight, self.bias)


_BUCKET = [max((r for r in ROWS if r <= n), default=1) for n in range(ROWS[-1] + 1)]


def _bucket(rows: int) -> int:
    return _BUCKET[rows] if rows <= ROWS[-1] else ROWS[-1]


def _time(x: torch.Tensor, weights: list[torch.Tensor]) -> float:
    """Seconds for x @ W.T over all `weights`."""
    t = time.perf_counter()
    for w in weights:
        F.linear(x, w)
    return time.perf_counter() - t


@torch.no_grad()
def measure_shape(in_features: int, out_features: int, dtype: torch.dtype) -> frozenset[int]:
    """Row counts (of ROWS) where row-major [out, in] beats column-major for x @ W.T on this CPU by MARGIN."""
    key = (in_features, out_features, dtype)
    if key not in _DECISIONS:
        row_bytes = in_features * torch.finfo(dtype).bits // 8
        # a huge head (a 128k-token vocabulary): time a slice of it
        out_rows = max(1, min(out_features, 2 * _STREAM_BYTES // row_bytes))
        copies = max(1, min(64, _STREAM_BYTES // (out_rows * row_bytes)))
        row = [torch.randn(out_rows, in_features).to(dtype) for _ in range(copies)]
        col = [w.t().contiguous().t() for w in row]
        faster = set()
        for n in ROWS:
            x = torch.randn(n, in_features).to(dtype)
            _time(x, row), _time(x, col)  # warm-up
            # interleaved, so a drift of the machine's speed hits both layouts
            ratios = sorted(_time(x, row) / _time(x, col) for _ in range(REPS))
            if ratios[REPS // 2] < 1.0 - MARGIN:
                faster.add(n)
        _DECISIONS[key] = frozenset(faster)
    return _DECISIONS[key]


def enabled() -> bool:
    """DRAFTSMITH_CPU_LAYOUT: auto (default) or off; anything else is refused in one line."""
    value = os.environ.get("DRAFTSMITH_CPU_LAYOUT", "auto").strip().lower()
    if value not in ("auto", "off"):
        raise DraftsmithError(
            f"DRAFTSMITH_CPU_LAYOUT={value!r} is not auto or off; unset it or set one of those"
        )
    return value == "auto"


@torch.no_grad()
def tune_linears(model: nn.Module | None, max_extra_bytes: int = 2 << 30) -> dict:
    """Re-lay the frozen CPU Linears of `model` out for small-row products (see the module doc). Idempotent.
    Returns a summary: linears changed, how many keep a row-major copy, the extra MiB, the row counts per shape."""
    summary = {"tuned": 0, "dual": 0, "extra_mib": 0.0, "row_major_rows": {}}
    if model is None or not enabled():
        return summary
    linears = [
        m
        for m in model.modules()
        if type(m) is nn.Linear
        and m.weight.device.type == "cpu"
        and not m.weight.requires_grad
        and m.weight.dtype.is_floating_point
        and m.weight.dim() == 2
    ]
    if not linears:
        return summary
    plans = {}
    for m in linears:
        o, i = m.weight.shape
        plans[m] = measure_shape(i, o, m.weight.dtype)
        summary["row_major_rows"][f"{i}x{o}"] = sorted(plans[m])
    extra = sum(m.weight.numel() * m.weight.element_size() for m in linears if 0 < len(plans[m]) < len(ROWS))
    keep_rows = extra <= max_extra_bytes
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))  # > 1: a tied weight
    for m in linears:
        rows = plans[m]
        if len(rows) == len(ROWS):
            continue  # row-major wins everywhere: leave it
        old = m.weight
        tied = uses[id(old)] > 1
        if rows and not keep_rows and len(rows) * 2 > len(ROWS):
            continue  # no room for both layouts and row-major wins most counts
        m.weight = nn.Parameter(old.detach().t().contiguous().t(), requires_grad=False)
        m.__class__ = TunedLinear
        m.row_major_rows = rows if keep_rows else frozenset()
        if m.row_major_rows:
            m.register_buffer("row_major", old.detach(), persistent=False)
            summary["dual"] += 1
        if m.row_major_rows or tied:  # the old tensor stays alive: as the row copy, or as the tied embedding
            summary["extra_mib"] += old.numel() * old.element_size() / 2**20
        summary["tuned"] += 1
    summary["extra_mib"] = round(summary["extra_mib"], 1)
    return summary


def describe(summary: dict) -> str:
    """One line for a tune_linears summary (eval.json conditions, benchmark logs)."""
    if not summary or not summary["tuned"]:
        return "nn.Linear (unchanged)"
    rows = sorted({r for v in summary["row_major_rows"].values() for r in v})
    return (
        f"{summary['tuned']} Linears column-major; row-major copy for {rows} rows in {summary['dual']} "
        f"(+{summary['extra_mib']} MiB)"
    )
