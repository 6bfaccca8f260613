"""The benchmark half of `scripts/gpu_check.sh`: the hardware cost model (costbench) and training throughput
(trainbench) in one process, and one JSON + Markdown report with the gpu-marked test results beside them.

    draftsmith bench gpu-check OUT_DIR [--dry] [--pytest-xml OUT_DIR/pytest-gpu.xml] [--budget-s 300]

--dry: tiny shapes on the CPU, compile with torch.compile's `eager` backend (dynamo tracing of the same
StaticCache path, no code generation): proves the check starts and every phase runs, in seconds; its timings mean
nothing. The report is rewritten after every phase, so a run cut short still leaves what it measured.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path

import torch
import transformers

from draftsmith.app import costbench
from draftsmith.app.bench import costbatch, trainbench
from draftsmith.errors import DraftsmithError
from draftsmith.fileio import write_json, write_text

REPORT = "gpu_check"


def pytest_summary(xml_path: Path) -> dict:
    """Counts and failing test ids from a pytest --junitxml file ({} if the file is missing)."""
    if not xml_path.is_file():
        return {}
    root = ET.parse(xml_path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    out = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0, "failed": [], "skip_reasons": {}}
    for s in suites:
        for key in ("tests", "failures", "errors", "skipped"):
            out[key] += int(s.get(key, 0))
        for case in s.iter("testcase"):
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            bad = case.find("failure")
            bad = bad if bad is not None else case.find("error")
            if bad is not None:
                out["failed"].append({"test": name, "message": (bad.get("message") or "")[:300]})
            skip = case.find("skipped")
            if skip is not None:
                reason = (skip.get("message") or "")[:120]
                out["skip_reasons"][reason] = out["skip_reasons"].get(reason, 0) + 1
    out["passed"] = out["tests"] - out["failures"] - out["errors"] - out["skipped"]
    return out


def _phase(report: dict, name: str, fn) -> None:
    t0 = time.perf_counter()
    try:
        report[name] = fn()
    except Exception as e:  # noqa: BLE001 - a failed phase is a finding to report, not a reason to stop
        report.setdefault("errors", {})[name] = {
            "error": f"{type(e).__name__}: {e}"[:2000],
            "traceback": traceback.format_exc()[-4000:],
        }
    report.setdefault("phase_s", {})[name] = round(time.perf_counter() - t0, 2)


def markdown(report: dict) -> str:
    lines = [
        f"# draftsmith GPU check ({report['mode']})",
        "",
        f"{report['date']} · device {report['device']} · torch {report['torch']} · transformers "
        f"{report.get('transformers')} · draftsmith {report['draftsmith']} · commit {report.get('commit', 'unknown')}",
        "",
    ]
    if report["mode"] == "dry":
        lines += [
            "Dry mode: tiny shapes on the CPU; proves every phase runs. The numbers below are not timings "
            "anyone should quote.",
            "",
        ]
    py = report.get("pytest") or {}
    lines += ["## gpu-marked tests", ""]
    if py:
        lines.append(
            f"{py['tests']} collected: {py['passed']} passed, {py['failures']} failed, {py['errors']} errors, "
            f"{py['skipped']} skipped (pytest exit status {report.get('pytest_rc')})."
        )
        lines += [f"- FAILED `{f['test']}`: {f['message']}" for f in py["failed"]]
        lines += [f"- skipped x{n}: {r}" for r, n in py["skip_reasons"].items()]
    else:
        lines.append(f"no pytest result (exit status {report.get('pytest_rc')}); see pytest-gpu.log")
    for name, title, md in (
        ("cost", "Cost model (target forward, drafters, predicted speedups)", costbench.markdown),
        (
            "batch",
            "Cost model by batch size (predicted speedup of each profile at batch B)",
            costbatch.markdown,
        ),
        ("train", "Training throughput", trainbench.markdown),
    ):
        lines += ["", f"## {title}", ""]
        if name in report:
            lines.append(md(report[name]))
        err = report.get("errors", {}).get(name)
        if err:
            lines += [
                f"**{name} failed**: `{err['error'].splitlines()[0]}`",
                "",
                "```",
                err["traceback"],
                "```",
            ]
        if name not in report and not err:
            lines.append("not run (time limit)")
    return "\n".join(lines) + "\n"


def write_report(out: Path, report: dict) -> None:
    write_json(out / f"{REPORT}.json", report)
    write_text(out / f"{REPORT}.md", markdown(report))


def command(args: argparse.Namespace) -> int:
    out = Path(args.out)
    bad = _bad_input(out, args.profiles)
    if bad:
        print(f"error: {bad}", file=sys.stderr)
        return 2
    cuda = torch.cuda.is_available() and not args.dry
    report = _header(args, cuda, out)
    if not cuda and not args.dry:
        report["errors"] = {
            "device": {"error": "no CUDA device: run with --dry for the CPU check", "traceback": ""}
        }
        write_report(out, report)
        print("error: no CUDA device; pass --dry for the CPU check", file=sys.stderr)
        return 2
    write_report(out, report)
    cost_args, batch_args, train_args = _bench_args(args.dry, list(args.profiles))
    _run_phases(report, out, (cost_args, batch_args, train_args), args.budget_s, args.dry)
    print(f"wrote {out / REPORT}.json and {out / REPORT}.md")
    return 1 if report.get("errors") or (report["pytest"] or {}).get("failures") else 0


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("out", help="the check's folder (gpu_check.sh creates it)")
    ap.add_argument("--dry", action="store_true", help="tiny shapes on the CPU: checks that every phase runs")
    ap.add_argument(
        "--pytest-xml", default=None, help="junit XML of the gpu-marked tests (default OUT/pytest-gpu.xml)"
    )
    ap.add_argument("--pytest-rc", type=int, default=None)
    ap.add_argument(
        "--commit", default="unknown", help="the checkout's commit (gpu_check.sh: git, or DRAFTSMITH_COMMIT)"
    )
    ap.add_argument("--budget-s", type=float, default=300.0, help="time for both benchmarks together")
    ap.add_argument(
        "--profiles", nargs="*", default=[], help="eval.json acceptance profiles for the cost model"
    )


def _bad_input(out: Path, profiles: list[str]) -> str | None:
    """The one error line for input the check cannot run with (before any compute), or None."""
    if not out.is_dir():
        return f"{out} is not a folder; create it (scripts/gpu_check.sh does)"
    if (out / f"{REPORT}.json").exists():
        return f"{out / REPORT}.json exists; pass a new folder (reports are never overwritten)"
    try:
        for p in profiles:
            costbench.load_profile(p)  # bad profiles fail before any compute
    except DraftsmithError as e:
        return str(e)
    return None


def _header(args: argparse.Namespace, cuda: bool, out: Path) -> dict:
    import draftsmith

    return {
        "mode": "dry" if args.dry else "gpu",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "draftsmith": draftsmith.__version__,
        "commit": args.commit,
        "pytest_rc": args.pytest_rc,
        "pytest": pytest_summary(Path(args.pytest_xml) if args.pytest_xml else out / "pytest-gpu.xml"),
    }


def _bench_args(dry: bool, profiles: list[str]) -> tuple:
    """The benchmarks' settings (cost model, cost model by batch size, training): real shapes on the GPU, tiny ones
    on the CPU in dry mode."""
    if not dry:
        batch_args = costbatch.CurveArgs(profiles=profiles)
        # 3 profiled steps per drafter: the first check's eager head steps (44-268 ms) were unexplained
        cost_args = costbench.BenchArgs(profiles=profiles, profile_steps=3)
        return cost_args, batch_args, trainbench.TrainBenchArgs()
    batch_args = costbatch.CurveArgs(
        shape="tiny-target",
        device="cpu",
        dtype="float32",
        context=32,
        batch_sizes=(1, 2, 4),
        reps=1,
        plain_tokens=4,
        profiles=profiles,
    )
    cost_args = costbench.BenchArgs(
        shape="tiny-target",
        device="cpu",
        dtype="float32",
        context=32,
        reps=1,
        compile="eager",  # dynamo traces the compiled path; no code generation
        plain_tokens=8,
        profiles=profiles,
        profile_steps=1,
    )
    train_args = trainbench.TrainBenchArgs(
        shape="tiny-target",
        device="cpu",
        steps=2,
        eagle_batch=2,
        eagle_length=16,
        ttt_steps=2,
        distill_batch=2,
        distill_length=16,
    )
    return cost_args, batch_args, train_args


def _run_phases(report: dict, out: Path, bench_args: tuple, budget_s: float, dry: bool) -> None:
    """Cheap and certain first: the eager path and every drafter, then the same by batch size, then training, then
    the compile time (the one phase whose length is hard to predict: inductor on an 8B graph, CUDA graph recording
    per length). The report is rewritten after every phase."""
    cost_args, batch_args, train_args = bench_args
    t0 = time.perf_counter()

    def keeper(name: str):
        def keep(res: dict) -> None:  # partial results survive a run cut short
            report[name] = res
            write_report(out, report)

        return keep

    keep = keeper("cost")

    def left() -> float:
        return max(budget_s - (time.perf_counter() - t0), 1e-9)

    cost_args.budget_s = 0.3 * budget_s
    _phase(report, "cost", lambda: costbench.run(cost_args, modes=("eager",), on_update=keep))
    write_report(out, report)
    batch_args.budget_s = 0.25 * budget_s
    _phase(report, "batch", lambda: costbatch.run(batch_args, on_update=keeper("batch")))
    write_report(out, report)
    if dry or left() > 0.35 * budget_s:
        _phase(report, "train", lambda: trainbench.run(train_args))
        write_report(out, report)
    if "cost" in report:
        cost_args.budget_s = left()
        eager = report["cost"]
        _phase(
            report, "cost", lambda: costbench.run(cost_args, modes=("compiled",), prior=eager, on_update=keep)
        )
        write_report(out, report)
