"""Bad inputs through the real command line, as a new user would type them: each must be refused with ONE
`error: ...` line on stderr, exit status 2, and nothing written in its folder. Prints one line per case and the
count of clean ones; exits 1 when any case is not clean.

    .venv/bin/python scripts/probe_inputs.py [--only SUBSTRING] [--keep DIR] [--timeout 120]

Every case runs in its own folder beside a tiny random target and a Medusa head (draftsmith.testing), on the CPU,
offline; a case takes a few seconds (one Python start-up each).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "draftsmith.app.cli"]
TRAIN = {name: [sys.executable, str(ROOT / "train" / f"{name}.py")] for name in ("distill", "heads")}


@dataclass
class Case:
    name: str
    argv: Callable[[dict, Path], list[str]]  # (shared fixtures, the case's folder) -> command line
    setup: Callable[[Path], None] = lambda d: None


def _file(d: Path, name: str = "a_file", text: str = "not a folder\n") -> Path:
    (d / name).write_text(text)
    return d / name


def _jsonl(d: Path, name: str, rows: list) -> Path:
    (d / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d / name


def _eval_json(d: Path, **changes) -> None:
    ev = {
        "tau": 1.8,
        "alpha_per_position": [0.5, None],
        "speedup": 1.2,
        "tokens_per_s": {"speculative": 10.0, "plain": 8.0},
        "conditions": {"target": "tiny", "drafter": "medusa:head", "k": 2},
    }
    # json.dumps writes NaN for float("nan"), as a hand-edited or foreign eval.json may hold it
    (d / "eval.json").write_text(json.dumps({**ev, **changes}))


def _prompts(d: Path) -> None:  # the second record has no prompt field (a typo)
    _jsonl(d, "p.jsonl", [{"prompt": "Say hi"}, {"promt": "Say hello", "category": "x"}, {"prompt": "Count"}])


def _pairs(d: Path) -> None:  # the second record has a prompt and no response
    _jsonl(d, "pairs.jsonl", [{"prompt": "Say hi", "response": "hi"}, {"prompt": "Say hello"}])


def _quickstart_results(d: Path) -> None:
    (d / "qs").mkdir()
    (d / "qs" / "quickstart.json").write_text('{"earlier": true}\n')


def gen(f: dict, d: Path, out: str, *more: str) -> list[str]:
    return [*CLI, "generate", "--target", f["target"], "--out", out, "--limit", "1", *more]


def skip(f: dict, d: Path, out: str, *more: str) -> list[str]:
    return [*CLI, "layerskip", "--target", f["target"], "--out", out, "--limit", "1", *more]


def export(f: dict, d: Path, out: str, *more: str) -> list[str]:
    return [*CLI, "export", f["head"], "--format", "vllm-medusa", "--out", out, *more]


def push(f: dict, d: Path, out: str, *more: str) -> list[str]:
    return [*CLI, "push", f["head"], "me/tiny", "--dry-run", out, *more]


def distill(f: dict, *more: str) -> list[str]:
    return [*TRAIN["distill"], f"model.target={f['target']}", "train.max_steps=1", *more]


def heads(f: dict, *more: str) -> list[str]:
    return [*TRAIN["heads"], f"model.target={f['target']}", "head.kind=medusa", *more]


def ev(f: dict, d: Path) -> list[str]:
    return ["--eval", str(d / "eval.json")]


def cases() -> list[Case]:
    return [
        # item 1: output paths checked before any work
        Case("generate --out FILE", lambda f, d: gen(f, d, str(d / "a_file")), _file),
        Case("generate --out FILE/sub", lambda f, d: gen(f, d, str(d / "a_file" / "sub")), _file),
        Case("generate --out /proc/x", lambda f, d: gen(f, d, "/proc/draftsmith-probe")),
        Case("layerskip --out FILE/sub", lambda f, d: skip(f, d, str(d / "a_file" / "sub")), _file),
        Case("layerskip --out /proc/x", lambda f, d: skip(f, d, "/proc/draftsmith-probe")),
        Case("export --out FILE/sub", lambda f, d: export(f, d, str(d / "a_file" / "sub")), _file),
        Case("export --out FILE", lambda f, d: export(f, d, str(d / "a_file")), _file),
        Case("export --out /proc/x", lambda f, d: export(f, d, "/proc/draftsmith-probe")),
        Case("export --out /sys/x", lambda f, d: export(f, d, "/sys/draftsmith-probe")),
        Case(
            "quickstart --out FILE",
            lambda f, d: [*CLI, "quickstart", "--out", str(d / "a_file"), "--target", f["target"], "--fast"],
            _file,
        ),
        Case(
            "push --dry-run FILE/sub",
            lambda f, d: push(f, d, str(d / "a_file" / "sub"), "--no-results"),
            _file,
        ),
        Case("push --dry-run /proc/x", lambda f, d: push(f, d, "/proc/draftsmith-probe", "--no-results")),
        Case(
            "bench cost --out FILE/x.json",
            lambda f, d: (
                [*CLI, "bench", "cost", "--shape", "tiny-target", "--device", "cpu"]
                + ["--out", str(d / "a_file" / "x.json")]
            ),
            _file,
        ),
        Case(
            "bench train --out FILE/x.json",
            lambda f, d: (
                [*CLI, "bench", "train", "--shape", "tiny-target", "--device", "cpu"]
                + ["--out", str(d / "a_file" / "x.json")]
            ),
            _file,
        ),
        Case(
            "train/distill.py output_dir=FILE/sub",
            lambda f, d: distill(f, f"output_dir={d}/a_file/sub"),
            _file,
        ),
        Case(
            "train/heads.py output_dir=FILE/sub", lambda f, d: heads(f, f"output_dir={d}/a_file/sub"), _file
        ),
        Case("train/heads.py output_dir=/proc/x", lambda f, d: heads(f, "output_dir=/proc/draftsmith-probe")),
        # item 5: numbers that are not numbers, records without their fields, results that are not results
        *(
            Case(
                f"train/{t}.py {ov}",
                lambda f, d, t=t, ov=ov: (distill if t == "distill" else heads)(f, ov, f"output_dir={d}/run"),
            )  # fmt: skip
            for t, ov in [
                ("distill", "train.lr=nan"),
                ("distill", "train.lr=inf"),
                ("distill", "train.max_steps=.inf"),
                ("distill", "loss.temperature=nan"),
                ("heads", "train.lr=nan"),
                ("heads", "train.max_grad_norm=-inf"),
                ("heads", "train.adam_betas=[0.9,nan]"),
            ]
        ),
        Case(
            "eval --prompts (a record without prompt)",
            lambda f, d: (
                [*CLI, "eval", "--target", f["target"], "--drafter", "ngram:", "--device", "cpu"]
                + ["--prompts", str(d / "p.jsonl"), "--out", str(d / "ev"), "--no-progress"]
            ),
            _prompts,
        ),
        Case(
            "generate --prompts (a record without prompt)",
            lambda f, d: gen(f, d, str(d / "gen"), "--prompts", str(d / "p.jsonl")),
            _prompts,
        ),
        Case(
            "train/distill.py data.source=(a pair without response)",
            lambda f, d: distill(
                f, f"data.source=[{d}/pairs.jsonl]", "data.policy=fixed", f"output_dir={d}/run"
            ),
            _pairs,
        ),
        *(
            Case(
                f"push --eval ({key}={value})",
                lambda f, d: push(f, d, str(d / "staged"), *ev(f, d)),
                lambda d, key=key, value=value: _eval_json(d, **{key: value}),
            )  # fmt: skip
            for key, value in [
                ("tau", float("nan")),
                ("tau", None),
                ("speedup", float("nan")),
                ("speedup", None),
            ]
        ),
        # item 7: results are not replaced without --overwrite; a file is never replaced by a folder
        Case(
            "quickstart (a rerun into a folder with results)",
            lambda f, d: [*CLI, "quickstart", "--out", str(d / "qs"), "--target", f["target"], "--fast"],
            _quickstart_results,
        ),
        Case(
            "layerskip --out FILE --overwrite",
            lambda f, d: skip(f, d, str(d / "a_file"), "--overwrite"),
            _file,
        ),
        Case("export --out FILE --force", lambda f, d: export(f, d, str(d / "a_file"), "--force"), _file),
    ]


def _snapshot(d: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(d)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(d.rglob("*"))}


def run_case(case: Case, fixtures: dict, d: Path, timeout: float = 120.0) -> tuple[bool, str]:
    d.mkdir(parents=True)
    case.setup(d)
    before = _snapshot(d)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONWARNINGS": "default"}
    try:
        p = subprocess.run(
            case.argv(fixtures, d), cwd=d, env=env, capture_output=True, text=True, timeout=timeout
        )
    except (
        subprocess.TimeoutExpired
    ):  # a bad input is refused in seconds: still running means the work started
        return False, f"still running after {timeout:g} s (the input was not refused before the work)"
    err = [line for line in p.stderr.splitlines() if line.strip()]
    problems = []
    if p.returncode != 2:
        problems.append(f"exit {p.returncode}")
    if len(err) != 1 or not err[0].startswith("error: "):
        problems.append(f"{len(err)} stderr lines")
    changed = sorted(set(_snapshot(d).items()) ^ set(before.items()))
    if changed:
        problems.append(f"wrote {changed[0][0]}")
    detail = err[-1] if err else (p.stdout.strip().splitlines() or [""])[-1]
    return not problems, (", ".join(problems) + " | " if problems else "") + detail[:200]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=None, help="run only the cases whose name holds this")
    ap.add_argument("--keep", type=Path, default=None, help="work in this (new) folder and keep it")
    ap.add_argument(
        "--timeout", type=float, default=120.0, help="seconds a case may run before it counts as not clean"
    )
    args = ap.parse_args(argv)
    from draftsmith.heads.io import save_head
    from draftsmith.heads.medusa.model import MedusaHeads
    from draftsmith.testing import save_tiny, tiny_llama

    root = Path(args.keep or tempfile.mkdtemp(prefix="draftsmith-probe-"))
    root.mkdir(parents=True, exist_ok=True)
    fixtures = {
        "target": str(save_tiny(root / "target", seed=0)),
        "head": str(save_head(MedusaHeads.from_target(tiny_llama(seed=0), num_heads=2), root / "head")),
    }
    chosen = [c for c in cases() if args.only is None or args.only in c.name]
    clean = 0
    for i, case in enumerate(chosen):
        t = time.perf_counter()
        ok, detail = run_case(case, fixtures, root / f"case-{i:02d}", args.timeout)
        clean += ok
        print(
            f"{'clean' if ok else 'NOT  '} {case.name} ({time.perf_counter() - t:.0f} s): {detail}",
            flush=True,
        )
    print(f"{clean}/{len(chosen)} clean (one error line, exit 2, nothing written); work folder {root}")
    return 0 if clean == len(chosen) else 1


if __name__ == "__main__":
    sys.exit(main())
