"""Weight layout and matmul kernel of nn.Linear for CPU inference, chosen by measuring the machine.

A speculative verify multiplies a handful of rows (2-16 tokens) by every weight of the target. On CPUs, MKL's sgemm
picks its kernel from the operand layout, and for 4-32 rows against the nn.Linear layout (row-major [out, in]) it
picks a slow one: on a 2-core AVX-512 Xeon a 16-token forward of SmolLM2-135M after a 300-token cache took 138 ms
against 41 ms for one token. With the same weights stored column-major (an [in, out] contiguous tensor viewed as
[out, in], so shapes and state_dict keys do not change) it takes 78 ms; 8 tokens 69 ms instead of 94 (RESULTS.md).
For 2-3 rows the row-major kernel is the faster one. On AMD CPUs without AVX-512, MKL's small-row sgemm is slow in
both layouts, and oneDNN's inner-product kernel (torch.ops.mkldnn._linear_pointwise, the one inductor's CPU
backend calls; same weight, same shapes) is up to ~1.8x faster for 4-16 rows of the large projections.

`tune_linears(model)` times, for each distinct weight shape once per process and for each row count of ROWS, the
kernels: "col" (F.linear on the column-major weight), "row" (F.linear on a row-major copy) and "onednn" (oneDNN
on the column-major weight, where torch has it and it runs for the dtype). It re-lays every Linear out column-major
where some row count's winner needs it, keeps a row-major copy (a non-persistent buffer) when "row" wins a row count
and the copy fits `max_extra_bytes`, and dispatches each forward to the winner of its row count. Prefill (hundreds
of rows) takes the decision of the largest count measured. Nothing changes on GPUs or for trainable modules.
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

ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)
"""Row counts measured; a count between two of them takes the decision of the lower one, above 64 the one of 64
(a verify is 2-17 rows at batch 1, B x (k + 1) rows for a batch)."""

KERNELS = ("col", "row", "onednn")
_DECISIONS: dict[tuple[int, int, torch.dtype], dict[int, str]] = {}
"""(in, out, dtype) -> {row count: the measured fastest kernel} (per process)."""

REPS, MARGIN = 5, 0.05
"""A kernel other than "col" is chosen for a row count only if its median time is >= 5% below col's (a row-major
copy costs memory; an alternative kernel must earn its place)."""
_STREAM_BYTES = 32 << 20
"""Each timing multiplies this many bytes of weight copies, so they stream from memory as in a real forward."""


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class TunedLinear(nn.Linear):
    """nn.Linear with a column-major weight whose forward runs the kernel measured fastest for its row count."""

    kernel_of: dict[int, str]  # row bucket -> kernel (buckets not listed: "col")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel_of and not self.weight.requires_grad:  # a copy goes stale once the weight trains
            kernel = self.kernel_of.get(_bucket(x.numel() // self.in_features), "col")
            if kernel == "row":
                return F.linear(x, self.row_major, self.bias)
            if kernel == "onednn":
                return _onednn(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    @property
    def row_major_rows(self) -> frozenset[int]:
        """Row counts (of ROWS) that read the row-major copy."""
        return frozenset(r for r, k in self.kernel_of.items() if k == "row")


_BUCKET = [max((r for r in ROWS if r <= n), default=1) for n in range(ROWS[-1] + 1)]


def _bucket(rows: int) -> int:
    return _BUCKET[rows] if rows <= ROWS[-1] else ROWS[-1]


def _time(kernel, x: torch.Tensor, weights: list[torch.Tensor]) -> float:
    """Seconds for kernel(x, W) over all `weights`."""
    t = time.perf_counter()
    for w in weights:
        kernel(x, w, None)
    return time.perf_counter() - t


def _candidates(dtype: torch.dtype, in_features: int) -> dict[str, tuple]:
    """kernel name -> (function, which weight copy it reads); oneDNN only where it runs for this dtype."""
    kernels = {"col": (F.linear, "col"), "row": (F.linear, "row")}
    if hasattr(torch.ops.mkldnn, "_linear_pointwise") and torch.backends.mkldnn.is_available():
        try:
            w = torch.randn(4, in_features).to(dtype).t().contiguous().t()
            _onednn(torch.randn(2, in_features).to(dtype), w, None)
            kernels["onednn"] = (_onednn, "col")
        except RuntimeError:  # e.g. bf16 on a CPU without native bf16 dot products
            pass
    return kernels


@torch.no_grad()
def measure_shape(in_features: int, out_features: int, dtype: torch.dtype) -> dict[int, str]:
    """{row count: kernel} for the row counts of ROWS where a kernel beats "col" by MARGIN on this CPU (others: col)."""
    key = (in_features, out_features, dtype)
    if key not in _DECISIONS:
        row_bytes = in_features * torch.finfo(dtype).bits // 8
        # a huge head (a 128k-token vocabulary): time a slice of it
        out_rows = max(1, min(out_features, 2 * _STREAM_BYTES // row_bytes))
        copies = max(1, min(64, _STREAM_BYTES // (out_rows * row_bytes)))
        weights = {"row": [torch.randn(out_rows, in_features).to(dtype) for _ in range(copies)]}
        weights["col"] = [w.t().contiguous().t() for w in weights["row"]]
        kernels = _candidates(dtype, in_features)
        chosen = {}
        for n in ROWS:
            x = torch.randn(n, in_features).to(dtype)
            # past 8 rows the product is compute-bound: fewer copies keep the timing short without changing it
            part = {c: ws[: max(1, len(ws) * 8 // n)] if n > 8 else ws for c, ws in weights.items()}
            for fn, copy in kernels.values():  # warm-up
                _time(fn, x, part[copy])
            # interleaved, so a drift of the machine's speed hits every kernel alike
            runs = {name: [] for name in kernels}
            for _ in range(REPS):
                for name, (fn, copy) in kernels.items():
                    runs[name].append(_time(fn, x, part[copy]))
            med = {name: sorted(v)[REPS // 2] for name, v in runs.items()}
            best = min(med, key=med.get)
            if best != "col" and med[best] < (1.0 - MARGIN) * med["col"]:
                chosen[n] = best
        _DECISIONS[key] = chosen
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
    """Give the frozen CPU Linears of `model` the measured layout and kernels for small-row products (see the module
    doc). Idempotent. Returns a summary: linears changed, how many keep a row-major copy, the extra MiB, and per
    shape the row counts of each kernel other than col."""
    summary = {"tuned": 0, "dual": 0, "extra_mib": 0.0, "kernels": {}}
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
        summary["kernels"][f"{i}x{o}"] = {
            k: sorted(r for r, v in plans[m].items() if v == k) for k in KERNELS[1:]
        }
    extra = sum(m.weight.numel() * m.weight.element_size() for m in linears if "row" in plans[m].values())
    keep_rows = extra <= max_extra_bytes
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))  # > 1: a tied weight
    for m in linears:
        plan = dict(plans[m])
        row_rows = [r for r, k in plan.items() if k == "row"]
        if len(row_rows) == len(ROWS):
            continue  # row-major wins everywhere: leave it
        if row_rows and not keep_rows:
            if len(row_rows) * 2 > len(ROWS):
                continue  # no room for both layouts and row-major wins most counts
            plan = {r: k for r, k in plan.items() if k != "row"}
        old = m.weight
        tied = uses[id(old)] > 1
        m.weight = nn.Parameter(old.detach().t().contiguous().t(), requires_grad=False)
        m.__class__ = TunedLinear
        m.kernel_of = plan
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
    per_kernel = {
        k: sorted({r for v in summary["kernels"].values() for r in v.get(k, [])}) for k in KERNELS[1:]
    }
    others = "; ".join(f"{k} for {rows} rows" for k, rows in per_kernel.items() if rows)
    return (
        f"{summary['tuned']} Linears column-major{'; ' + others if others else ''}; row-major copy in "
        f"{summary['dual']} (+{summary['extra_mib']} MiB)"
    )
