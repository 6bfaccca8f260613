"""Training runs that a script drives to completion across stops: one recipe + overrides + run folder each.

A run is `done` once its final/ folder holds a config.json, `resume` once its folder holds a run (run.yaml, a step
checkpoint or metrics: a run stopped before its first checkpoint restarts at step 0 under --resume), `new` otherwise;
`run()` trains a new run, resumes an unfinished one (the trainer's own --resume) and leaves a finished one alone, so
rerunning the calling command after a stop (or kill -9) continues where it was. Recipes are validated strictly (every
override) before anything runs. Used by `draftsmith bench loss-ablation` and `draftsmith bench showcase`.

Exit statuses, as draftsmith's own commands: bad input (a `DraftsmithError`, raised before anything is written) is
one `error: ...` line and status 2 (the CLI prints it); a training or bench step that fails at run time is one line
and status 1 (`SystemExit`).
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from draftsmith.errors import DraftsmithError

ROOT = Path(__file__).resolve().parents[3]
"""The checkout: the recipes/ and train/ entry scripts the runs launch live there, not in the installed package."""
SCRIPTS = {"distill": "train/distill.py", "heads": "train/heads.py"}


def config_class(trainer: str):
    if trainer == "distill":
        from draftsmith.distill.recipe import DistillConfig

        return DistillConfig
    from draftsmith.heads.recipe import HeadsConfig

    return HeadsConfig


@dataclass
class RecipeRun:
    name: str
    trainer: str  # "distill" | "heads"
    config: Path
    out: Path
    overrides: list[str] = field(default_factory=list)

    @property
    def argv(self) -> list[str]:
        return [*self.overrides, f"output_dir={self.out}"]

    @property
    def final(self) -> Path:
        return self.out / "final"

    def validate(self):
        """The recipe with every override, strictly (a bad key or value is one error line); returns the config."""
        from draftsmith.config import load_config

        try:
            return load_config(config_class(self.trainer), str(self.config), self.argv)
        except DraftsmithError as e:
            raise DraftsmithError(f"{self.name}: {e}") from None

    def state(self) -> str:
        if (self.final / "config.json").is_file():
            return "done"
        from draftsmith.rundir import has_run

        return "resume" if has_run(self.out) else "new"

    def run(self, label: str = "") -> float:
        """Train to completion (resuming when it can); seconds spent, 0 for a finished run."""
        state = self.state()
        if state == "done":
            print(f"{label}{self.name}: done, kept", flush=True)
            return 0.0
        cmd = [
            sys.executable,
            str(ROOT / SCRIPTS[self.trainer]),
            "--config",
            str(self.config),
            "--no-progress",
        ]
        cmd += self.argv + (["--resume"] if state == "resume" else [])
        print(
            f"{label}{self.name}: {'resuming' if state == 'resume' else 'training'} -> {self.out}", flush=True
        )
        t0 = time.time()
        proc = subprocess.run(cmd, cwd=ROOT)
        if proc.returncode != 0:
            raise SystemExit(
                f"error: training {self.name} failed (exit {proc.returncode}); rerun the same command to resume it"
            )
        took = time.time() - t0
        print(f"{label}{self.name}: {took:.0f} s", flush=True)
        return took
