"""Weight layout and matmul kernel of nn.Linear for CPU inference, chosen by measuring the machine.

A speculative verify multiplies a handful of rows (2-16 tokens) by every weight of the target. On CPUs, MKL's sgemm
picks its kernel from the operand layout, and for 4-32 rows against the nn.Linear layout (row-major [out, in]) it
picks a slow one: on a 2-core AVX-512 Xeon a 16-token forward of SmolLM2-135M after a 300-token cache took 138 ms
against 41 ms for one token. With the same weights stored column-major (an [in, out] contiguous tensor viewed as
[out, in], so shapes and state_dict keys do not change) it takes 78 ms; 8 tokens 69 ms instead of 94 (RESULTS.md).
For 2-3 rows the row-major kernel is the faster one. On AMD CPUs without AVX-512, MKL's small-row sgemm is slow in
both layouts, and oneDNN's inner-product kernel (torch.ops.mkldnn._linear_pointwise, the one inductor's CPU
backend calls; same weight, same shapes) is up to ~1.8x faster for 4-16 rows of the large projections.

On x86 CPUs with AVX2 and FMA a fourth kernel is offered: draftsmith.cpukernels.stream_linear, which reads
a row-major weight once for up to 16 rows (BLAS re-reads it per row there), so a 2-3 token verify of a memory-bound
target costs about one decode step. A fifth, "packed", is oneDNN's inner product on the weight reordered into
oneDNN's own blocked format (torch.ops.mkldnn._reorder_linear_weight: the weight that inductor's CPU freezing
pass packs). On a 2-core AMX Xeon in bf16 it streams every shape of Qwen2.5-Coder-0.5B/1.5B at 17-22 GB/s, where
F.linear on the row-major weight reaches 10-12 GB/s for the 0.5B's 896-wide projections and 15-19 GB/s for the
1.5B's (RESULTS.md). The blocked tensor is not a matrix any other op can read, so it is only ever a copy.

`tune_linears(model)` times, for each distinct weight shape once per process and for each row count of ROWS, every
kernel on the layout it reads: "row" (F.linear on the row-major weight, nn.Linear's own), "col" (F.linear on a
column-major copy), "onednn" (oneDNN on the column-major weight, where it runs for the dtype), "stream" and
"packed" (oneDNN on the blocked copy, where it runs for the dtype). Each
Linear keeps the layout whose kernels cost least over the row counts as a decode weighs them (ROW_WEIGHT: one row as
much as the verify blocks of the usual k; nn.Linear's row-major layout unless column-major wins by MARGIN), its
"primary" (row- or column-major), and one copy in another layout (the other of the two, or the blocked one)
where kernels on it win row counts by MARGIN: the copy layout that saves most. Copies are kept in the
order of what they save until they fill `max_extra_bytes` (by default a quarter of the memory available): on a
memory-bound target both the one-row kernel of a plain step and the few-row kernel of a verify then run at their
best, where a single layout would make one of them pay (Qwen2.5-Coder-1.5B on a 2-core AMD EPYC: column-major alone
made the plain step 15% faster and the 5-token verify 30% slower, RESULTS.md). Each forward runs the winner of its
row count; prefill (hundreds of rows) takes the decision of the largest count measured. Every frozen CPU Linear,
even one whose plan is nn.Linear's own, runs its rows as one 2-D product: torch's matmul runs a strided 3-D slice
(logits_to_keep's hidden[:, -1:]) against a frozen weight as a batched GEMM that copies the weight per call. Shapes
and state_dict are unchanged; nothing changes on GPUs or for trainable modules.

The timings are only as good as the moment they are taken in: beside one single-thread training on a 2-core AMD
EPYC, the one-row times of the 1.5B's shapes doubled and scattered and every shape went row-major, where two quiet
processes chose the same plans (RESULTS.md). So a plan measured while the CPU was quiet (other processes used at most
BUSY_SHARE of this process's CPUs meanwhile, from /proc/stat) is kept in the cache (DRAFTSMITH_CACHE/cpulayout/, one
JSON file per machine: CPU model, usable CPUs, torch threads and version, the kernels available and these rules),
and later processes on the same machine reuse it instead of measuring again; a plan measured on a busy CPU is used
by its process only. DRAFTSMITH_CPU_LAYOUT=off turns the layout off (for A/B timing), =retune measures every shape
again and replaces the kept plans (when the CPU is quiet).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith import cpukernels
from draftsmith.errors import DraftsmithError
from draftsmith.fileio import cache_dir, write_json

log = logging.getLogger(__name__)

ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)
"""Row counts measured; a count between two of them takes the decision of the lower one, above 64 the one of 64
(a verify is 2-17 rows at batch 1, B x (k + 1) rows for a batch)."""

_DECISIONS: dict[tuple[int, int, torch.dtype], Plan] = {}
"""(in, out, dtype) -> the measured plan (per process)."""
_MEDIANS: dict[tuple[int, int, torch.dtype], dict[int, dict[str, float]] | None] = {}
"""(in, out, dtype) -> the median seconds the plan was chosen from (None: a kept plan without them)."""

REPS, MARGIN = 7, 0.05
"""A kernel other than the primary layout's own F.linear is chosen for a row count only if its median time is >= 5%
below that one's (a copy costs memory; an alternative kernel must earn its place), and column-major becomes the
primary layout only if its weighted cost is >= 5% below row-major's (a near tie keeps nn.Linear's own layout, so
the choice does not flip with the machine's noise from one process to the next)."""
ROW_WEIGHT = {1: 1.0, 2: 0.2, 3: 0.2, 4: 0.2, 6: 0.2, 8: 0.2, 12: 0.1, 16: 0.1, 32: 0.05, 64: 0.05}
"""How much each row count weighs when the primary layout is chosen and copies are ranked: as much for one row (a
plain decode step, a draft model's step) as for the verify blocks of the usual k (2-8 rows, 1.0 together), less for
long verifies (12-16) and least for batched verifies and prefill (32+), which a CPU decode rarely runs. Every count
weighs as a ratio to its fastest kernel, so the slow large products do not outweigh the fast small ones."""
EXTRA_SHARE = 0.25
"""By default the copies in another layout may take this share of the memory available when tuning starts."""
BUSY_SHARE = 0.15
"""A measurement during which other processes used more than this share of this process's CPUs is not kept."""
_STREAM_BYTES = 32 << 20
"""Each timing multiplies this many bytes of weight copies, so they stream from memory as in a real forward."""


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _stream(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return cpukernels.stream_linear(x, weight, bias)


KERNELS: dict[str, tuple] = {"row": (F.linear, "row"), "col": (F.linear, "col"), "onednn": (_onednn, "col"),
                             "stream": (_stream, "row"), "packed": (_onednn, "packed")}  # fmt: skip
"""kernel name -> (function(x, weight, bias), the weight layout it reads)."""
DEFAULT = {"row": "row", "col": "col"}
"""The kernel a layout runs when nothing beat it: F.linear. Only these two layouts can be a Linear's weight."""


def lay_out(weight: torch.Tensor, layout: str) -> torch.Tensor:
    """A copy of a weight [out, in] in `layout`: row-major, column-major (an [in, out] contiguous tensor viewed as
    [out, in]) or packed (oneDNN's blocked format for few-row products; readable only by the "packed" kernel)."""
    w = weight.detach()
    if layout == "row":
        return w.contiguous()
    if layout == "col":
        return w.t().contiguous().t()
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 1)


@dataclass(frozen=True)
class Plan:
    """For one weight shape: the layout the weight is stored in, and the kernel of each measured row count that does
    not run the layout's own F.linear (a kernel on another layout needs a copy)."""

    layout: str
    kernel_of: dict[int, str] = field(default_factory=dict)
    saving: float = field(default=0.0, compare=False)
    """The share of the layout-only plan's weighted cost that the copy saves (0 where there is no copy): copies are
    kept in this order until the memory budget is spent."""

    @property
    def needs_copy(self) -> bool:
        return self.copy_layout is not None

    @property
    def copy_layout(self) -> str | None:
        """The layout of the one copy the plan reads (None: no copy)."""
        return next((KERNELS[k][1] for k in self.kernel_of.values() if KERNELS[k][1] != self.layout), None)

    def without_copy(self) -> Plan:
        return Plan(self.layout, {r: k for r, k in self.kernel_of.items() if KERNELS[k][1] == self.layout})


_REFERENCE = [0]
"""> 0 inside reference_kernels(): every TunedLinear runs F.linear on its own weight."""


@contextmanager
def reference_kernels():
    """Inside: every TunedLinear runs F.linear on its stored weight, the product torch's FLOP counter and dispatch
    modes see (oneDNN's inner product and stream_linear are invisible to them, so counting through a tuned model would
    miss those Linears). Same values, the layout's own kernel; for counting, not timing."""
    _REFERENCE[0] += 1
    try:
        yield
    finally:
        _REFERENCE[0] -= 1


class TunedLinear(nn.Linear):
    """nn.Linear whose weight is stored in the measured layout and whose forward runs the kernel measured fastest for
    its row count (on a copy in another layout where that kernel reads it)."""

    plan: Plan

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.requires_grad or _REFERENCE[0]:  # a copy goes stale once the weight trains
            return F.linear(x, self.weight, self.bias)
        # rows as one 2-D product: F.linear on a strided 3-D slice (transformers' logits_to_keep takes
        # hidden[:, -1:] of a multi-token forward) cannot fold into one GEMM, and torch then copies the whole
        # weight per call (450 ms for a 0.5B draft's 150k-row head in bf16, 11 ms as 2-D)
        rows = x.reshape(-1, self.in_features).contiguous()  # a copy only of a strided slice's few rows
        kernel = self.plan.kernel_of.get(_bucket(rows.shape[0]))
        if kernel is None:
            out = F.linear(rows, self.weight, self.bias)
        else:
            fn, layout = KERNELS[kernel]
            out = fn(rows, self.weight if layout == self.plan.layout else self.other_layout, self.bias)
        return out.view(*x.shape[:-1], out.shape[-1])

    @property
    def kernel_of(self) -> dict[int, str]:
        return self.plan.kernel_of

    @property
    def row_major_rows(self) -> frozenset[int]:
        """Row counts (of ROWS) that read a row-major copy of a column-major weight."""
        return frozenset(
            r for r, k in self.plan.kernel_of.items() if self.plan.layout == "col" and k == "row"
        )


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
    """The kernels that run here for this dtype and width: F.linear always, oneDNN (on the column-major and on the
    packed weight) where torch has it for the dtype (not for bf16 on CPUs without native bf16), stream for fp32 on
    AVX2+FMA with in_features % 8 == 0."""
    names = ["row", "col"]
    if hasattr(torch.ops.mkldnn, "_linear_pointwise") and torch.backends.mkldnn.is_available():
        x, w = torch.randn(2, in_features).to(dtype), torch.randn(4, in_features).to(dtype)
        for name in ("onednn", "packed"):
            try:
                _onednn(x, lay_out(w, KERNELS[name][1]), None)
                names.append(name)
            except (RuntimeError, AttributeError):  # AttributeError: a torch without the reorder op
                pass
    if dtype == torch.float32 and in_features % 8 == 0 and cpukernels.available():
        names.append("stream")
    return {n: KERNELS[n] for n in names}


def _cost(med: dict[int, dict[str, float]], plan: Plan) -> float:
    """Weighted cost of a plan: per row count its kernel's time over the fastest kernel's, weighted by ROW_WEIGHT."""
    return sum(
        ROW_WEIGHT[n] * m[plan.kernel_of.get(n, DEFAULT[plan.layout])] / min(m.values())
        for n, m in med.items()
    )


def _choose(med: dict[int, dict[str, float]]) -> Plan:
    """The plan from median seconds per row count and kernel: per layout, each row count takes the best kernel on
    that layout if it beats the layout's own F.linear by MARGIN; the primary layout is the one whose plan costs
    least (ROW_WEIGHT; column-major only if MARGIN below row-major); then each row count may take a kernel on
    another layout, again by MARGIN: one copy at most, in the layout (the other of row- and column-major, or packed)
    whose plan costs least (tune_linears keeps copies in the order of what they save while memory allows)."""

    def best_plan(layout: str, kernels: set[str]) -> Plan:
        kernel_of = {}
        for n, m in med.items():
            best = min((k for k in m if k in kernels), key=m.get)
            if best != DEFAULT[layout] and m[best] < (1.0 - MARGIN) * m[DEFAULT[layout]]:
                kernel_of[n] = best
        return Plan(layout, kernel_of)

    def on(*layouts: str) -> set[str]:
        return {k for k, (_, kl) in KERNELS.items() if kl in layouts}

    own = {lay: best_plan(lay, on(lay)) for lay in DEFAULT}
    layout = "col" if _cost(med, own["col"]) < (1.0 - MARGIN) * _cost(med, own["row"]) else "row"
    # one copy at most: of each other layout, the plan it makes possible; the cheapest wins
    duals = [best_plan(layout, on(layout, other)) for other in ("row", "col", "packed") if other != layout]
    dual = min(duals, key=lambda p: _cost(med, p))
    if not dual.needs_copy:
        return own[layout]
    saving = 1.0 - _cost(med, dual) / _cost(med, own[layout])
    return Plan(layout, dual.kernel_of, saving)


_ORIGIN: dict[tuple[int, int, torch.dtype], str | float] = {}
"""(in, out, dtype) -> where this process's plan came from: "kept" (this machine's file), "measured" (now, and kept),
or the share of the CPUs other processes used while it was measured (more than BUSY_SHARE: used here, not kept)."""


def _cpu_seconds() -> float | None:
    """CPU seconds all processes have spent on this process's CPUs (/proc/stat, busy time: everything but idle and
    iowait); None where that cannot be read."""
    try:
        mine = os.sched_getaffinity(0)
        total = 0
        with open("/proc/stat") as f:
            for line in f:
                name, *vals = line.split()
                if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in mine:
                    v = [int(x) for x in vals[:8]]
                    total += sum(v) - v[3] - v[4]
        return total / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def others_share(fn):
    """Run fn(); return (its result, the share of this process's CPUs that other processes used meanwhile, or None
    where /proc/stat cannot be read)."""
    before, own, t = _cpu_seconds(), time.process_time(), time.perf_counter()
    result = fn()
    after, own, wall = _cpu_seconds(), time.process_time() - own, time.perf_counter() - t
    if before is None or after is None or wall <= 0:
        return result, None
    return result, max(0.0, (after - before - own) / (wall * len(os.sched_getaffinity(0))))


def machine() -> dict:
    """What a kept plan is valid for: the CPU model, the CPUs this process may use, torch's threads and version, the
    kernels available, and the rules that turn timings into plans."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    rules = json.dumps([ROWS, REPS, MARGIN, sorted(ROW_WEIGHT.items()), sorted(KERNELS)])
    return {
        "cpu": cpu,
        "cpus": len(os.sched_getaffinity(0)),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "stream_kernel": cpukernels.available(),
        "rules": hashlib.sha256(rules.encode()).hexdigest()[:12],
    }


def plans_file() -> Path:
    """This machine's kept plans: DRAFTSMITH_CACHE/cpulayout/<hash of machine()>.json."""
    key = hashlib.sha256(json.dumps(machine(), sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "cpulayout" / f"{key}.json"


def _shape_key(in_features: int, out_features: int, dtype: torch.dtype) -> str:
    return f"{in_features}x{out_features}/{str(dtype).removeprefix('torch.')}"


_SAID: set[str] = set()
"""Damaged plan files this process has said it discards."""


def _read_kept(say: bool = False) -> dict:
    """The kept plans of this machine (shape key -> entry); {} where there are none or the file is unreadable
    (`say`: with one line saying the damaged file is discarded; the plans are measured again and the file
    rewritten)."""
    path = plans_file()
    try:
        kept = json.loads(path.read_text())
        if not isinstance(kept, dict) or not isinstance(kept.get("plans"), dict):
            raise ValueError("no 'plans' object")
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        if say and str(path) not in _SAID:  # once per process, not once per shape
            _SAID.add(str(path))
            log.warning("cpu layout: discarded the damaged plan cache %s (%s); measuring again", path, e)
        return {}
    return kept["plans"] if kept.get("machine") == machine() else {}


def _kept_plan(entry, dtype: torch.dtype, in_features: int) -> Plan | None:
    """A kept entry as a Plan, or None where it does not make one this process can run (a kernel this torch lacks,
    or an entry that is not a plan at all: the cache file is the user's to damage)."""
    try:
        plan = Plan(
            entry["layout"], {int(r): k for r, k in entry["kernel_of"].items()}, float(entry["saving"])
        )
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    if not isinstance(plan.layout, str) or not all(isinstance(k, str) for k in plan.kernel_of.values()):
        return None  # a list or a number where a name should be
    usable = _candidates(dtype, in_features)
    ok = plan.layout in DEFAULT and all(r in ROWS and k in usable for r, k in plan.kernel_of.items())
    return plan if ok else None


def _kept_medians(entry: dict) -> dict[int, dict[str, float]] | None:
    """The median seconds a kept plan was chosen from, or None where the entry lacks them."""
    try:
        return {int(n): {k: float(v) / 1e6 for k, v in m.items()} for n, m in entry["median_us"].items()}
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def plan_without(in_features: int, out_features: int, dtype: torch.dtype, kernels: frozenset[str]) -> Plan:
    """The plan this process would choose for a shape if `kernels` did not exist (same medians, so a benchmark can
    time a kernel's contribution in one process); the shape is measured first if it has not been."""
    plan = measure_shape(in_features, out_features, dtype)
    if not kernels:
        return plan
    med = _MEDIANS.get((in_features, out_features, dtype))
    # no medians to choose again from: those row counts fall back to the layout's own F.linear
    if med is None:
        return Plan(plan.layout, {n: k for n, k in plan.kernel_of.items() if k not in kernels})
    return _choose({n: {k: v for k, v in m.items() if k not in kernels} for n, m in med.items()})


def _keep(key: str, plan: Plan, med: dict, share: float | None) -> None:
    """Add a measured plan to this machine's file (read, merge, atomic write); a cache that cannot be written only
    means the next process measures again."""
    entry = {"layout": plan.layout, "kernel_of": {str(r): k for r, k in sorted(plan.kernel_of.items())},
             "saving": plan.saving, "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "others_share": share,
             "median_us": {str(n): {k: round(v * 1e6, 1) for k, v in m.items()} for n, m in med.items()}}  # fmt: skip
    try:
        path = plans_file()
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, {"machine": machine(), "plans": {**_read_kept(), key: entry}})
    except OSError:
        pass


@torch.no_grad()
def measure_shape(in_features: int, out_features: int, dtype: torch.dtype) -> Plan:
    """The plan of a weight shape on this CPU: decided once per process, from this machine's kept plan where there is
    one (unless DRAFTSMITH_CPU_LAYOUT=retune), else measured now and kept if the CPU was quiet meanwhile."""
    key = (in_features, out_features, dtype)
    if key in _DECISIONS:
        return _DECISIONS[key]
    name = _shape_key(*key)
    entry = None if mode() == "retune" else _read_kept(say=True).get(name)
    plan = _kept_plan(entry, dtype, in_features)
    if entry is not None and plan is None:
        log.warning("cpu layout: discarded the kept plan of %s in %s (not a plan this process can run); "
                    "measuring it again", name, plans_file())  # fmt: skip
    _ORIGIN[key] = "kept"
    if plan is not None:
        _MEDIANS[key] = _kept_medians(entry)
    else:
        med, share = others_share(lambda: measure_medians(in_features, out_features, dtype))
        plan = _choose(med)
        _MEDIANS[key] = med
        if share is None or share <= BUSY_SHARE:
            _keep(name, plan, med, share)
            _ORIGIN[key] = "measured"
        else:
            _ORIGIN[key] = round(share, 3)
    _DECISIONS[key] = plan
    return plan


@torch.no_grad()
def measure_medians(in_features: int, out_features: int, dtype: torch.dtype) -> dict[int, dict[str, float]]:
    """Median seconds of each kernel that runs here, per row count of ROWS, for a weight shape (weights streamed
    from memory, kernels interleaved)."""
    row_bytes = in_features * torch.finfo(dtype).bits // 8
    # a huge head (a 128k-token vocabulary): time a slice of it
    out_rows = max(1, min(out_features, 2 * _STREAM_BYTES // row_bytes))
    copies = max(1, min(64, _STREAM_BYTES // (out_rows * row_bytes)))
    kernels = _candidates(dtype, in_features)
    weights = {"row": [torch.randn(out_rows, in_features).to(dtype) for _ in range(copies)]}
    for layout in {KERNELS[k][1] for k in kernels} - {"row"}:
        weights[layout] = [lay_out(w, layout) for w in weights["row"]]
    med = {}
    for n in ROWS:
        x = torch.randn(n, in_features).to(dtype)
        # past 8 rows the product is compute-bound: fewer copies keep the timing short without changing it
        part = {c: ws[: max(1, len(ws) * 8 // n)] if n > 8 else ws for c, ws in weights.items()}
        usable = {k: v for k, v in kernels.items() if k != "stream" or n <= cpukernels.MAX_ROWS}
        for fn, layout in usable.values():  # warm-up
            _time(fn, x, part[layout])
        # interleaved, so a drift of the machine's speed hits every kernel alike
        runs = {name: [] for name in usable}
        for _ in range(REPS):
            for name, (fn, layout) in usable.items():
                runs[name].append(_time(fn, x, part[layout]))
        med[n] = {name: sorted(v)[REPS // 2] for name, v in runs.items()}
    return med


def mode() -> str:
    """DRAFTSMITH_CPU_LAYOUT: auto (default), retune or off; anything else is refused in one line."""
    value = os.environ.get("DRAFTSMITH_CPU_LAYOUT", "auto").strip().lower()
    if value not in ("auto", "retune", "off"):
        raise DraftsmithError(
            f"DRAFTSMITH_CPU_LAYOUT={value!r} is not auto, retune or off; unset it or set one of those"
        )
    return value


def enabled() -> bool:
    """The layout is applied: DRAFTSMITH_CPU_LAYOUT is auto or retune."""
    return mode() != "off"


def available_bytes() -> int:
    """Memory available now (MemAvailable of /proc/meminfo; 8 GiB where that cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 8 << 30


@torch.no_grad()
def tune_linears(
    model: nn.Module | None, max_extra_bytes: int | None = None, without: frozenset[str] = frozenset()
) -> dict:
    """Give the frozen CPU Linears of `model` the measured layout and kernels for small-row products (see the module
    doc). Copies in another layout are kept in the order of what they save, up to `max_extra_bytes` in all
    (default: EXTRA_SHARE of the memory available now); a Linear whose copy does not fit keeps its own layout's
    kernels. Idempotent. Every one becomes a TunedLinear, which runs its rows as one 2-D product; those whose plan
    is nn.Linear's own layout and kernel count as "plain", the others as "tuned". Returns a summary: Linears tuned
    and plain, how many were re-laid out column-major, how many keep a copy in another layout, the extra MiB, how
    many copies did not fit, per shape its layout and the row counts of each kernel it runs, and where the plans
    came from (kept on this machine, measured now, or measured while other processes used the CPU: that share, per
    shape). `without`: kernels to leave out (benchmarks: the plans as they would be without them, plan_without)."""
    summary = {
        "tuned": 0,
        "plain": 0,
        "column_major": 0,
        "dual": 0,
        "extra_mib": 0.0,
        "copies_left_out": 0,
        "kernels": {},
        "plans": {"kept": 0, "measured": 0, "busy": {}},
    }
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
    measured = {
        m: plan_without(m.weight.shape[1], m.weight.shape[0], m.weight.dtype, without) for m in linears
    }
    for key in {(m.weight.shape[1], m.weight.shape[0], m.weight.dtype) for m in linears}:
        origin = _ORIGIN.get(key, "measured")
        if isinstance(origin, float):
            summary["plans"]["busy"][_shape_key(*key)] = origin
        else:
            summary["plans"][origin] += 1
    summary["plans"]["file"] = str(plans_file())
    plans = dict(measured)  # the shape's plan, copy included, until memory says otherwise
    budget = int(EXTRA_SHARE * available_bytes()) if max_extra_bytes is None else max_extra_bytes
    for m in sorted((m for m in linears if plans[m].needs_copy), key=lambda m: -plans[m].saving):
        size = m.weight.numel() * m.weight.element_size()
        if size <= budget:
            budget -= size
        else:  # no room for both layouts: this Linear keeps one
            plans[m] = plans[m].without_copy()
            summary["copies_left_out"] += 1
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))  # > 1: a tied weight
    for m in linears:
        plan = plans[m]
        o, i = m.weight.shape
        shape_plan = measured[m]
        entry = summary["kernels"].setdefault(
            f"{i}x{o}",
            {
                "layout": shape_plan.layout,
                **{
                    k: sorted(r for r, v in shape_plan.kernel_of.items() if v == k)
                    for k in KERNELS
                    if k in shape_plan.kernel_of.values()
                },
                "linears": 0,
                "copies_left_out": 0,
            },
        )
        entry["linears"] += 1
        entry["copies_left_out"] += plan != shape_plan
        m.__class__ = TunedLinear
        m.plan = plan
        if plan.layout == "row" and not plan.kernel_of:
            # nn.Linear's own layout and kernel win everywhere: only the input is flattened to one 2-D product
            # (an lm_head called by transformers' own generate gets hidden[:, -1:] from logits_to_keep)
            summary["plain"] += 1
            continue
        old = m.weight
        tied = uses[id(old)] > 1
        if plan.layout == "col":
            m.weight = nn.Parameter(old.detach().t().contiguous().t(), requires_grad=False)
            summary["column_major"] += 1
        if plan.needs_copy:
            m.register_buffer("other_layout", lay_out(old, plan.copy_layout), persistent=False)
            summary["dual"] += 1
        if plan.needs_copy or (
            tied and plan.layout == "col"
        ):  # a second tensor: the copy, or the tied embedding
            summary["extra_mib"] += old.numel() * old.element_size() / 2**20
        summary["tuned"] += 1
    summary["extra_mib"] = round(summary["extra_mib"], 1)
    return summary


def describe(summary: dict) -> str:
    """One line for a tune_linears summary (eval.json conditions, benchmark logs)."""
    plain = summary["plain"] if summary else 0
    if not summary or not summary["tuned"]:
        return "nn.Linear's layout and kernels" + (
            f" ({plain} Linears: their rows as one 2-D product)" if plain else ""
        )
    kernels = sorted({k for v in summary["kernels"].values() for k in v if k in KERNELS})
    per_kernel = {k: sorted({r for v in summary["kernels"].values() for r in v.get(k, [])}) for k in kernels}
    others = "; ".join(f"{k} for {rows} rows" for k, rows in per_kernel.items())
    plans = summary.get("plans", {})
    origin = ", ".join(f"{plans[k]} {k}" for k in ("kept", "measured") if plans.get(k))
    if plans.get("busy"):
        worst = max(plans["busy"].values())
        origin += f"{', ' if origin else ''}{len(plans['busy'])} measured on a busy CPU (others used up to "
        origin += f"{worst:.0%}; not kept)"
    return (
        f"{summary['tuned']} Linears tuned ({plain} more keep nn.Linear's kernels), "
        f"{summary['column_major']} column-major{'; ' + others if others else ''}; "
        f"a copy in another layout in {summary['dual']} (+{summary['extra_mib']} MiB)"
        + (f", {summary['copies_left_out']} more did not fit" if summary.get("copies_left_out") else "")
        + (f"; shape plans: {origin}" if origin else "")
    )
