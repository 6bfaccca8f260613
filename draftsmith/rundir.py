"""A training run's folder: who may write it, its run.yaml, metrics.jsonl, and its checkpoints (save, restore).

    out_dir/run.yaml         resolved config; a different config in the same folder is "another run"
    out_dir/.lock            flock'ed by the live run's main process; holds "pid <n> on <host>"
    out_dir/metrics.jsonl    one JSON per event; a torn last line (power loss) is dropped on resume
    out_dir/checkpoints/step-0000010/   complete checkpoints (written under .tmp- names, then renamed): the
                             engine's state, each process's RNG state as safetensors, trainer_state.json last

`check_out_dir` only reads, so recipes call it before they spend compute or write caches; `claim_out_dir`
takes the lock and writes run.yaml once every check has passed.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import socket
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import yaml

from draftsmith.errors import DraftsmithError
from draftsmith.fileio import check_output_dir, replace_dir, write_json, write_text
from draftsmith.statefile import load_state, rng_state, save_state, set_rng_state

log = logging.getLogger(__name__)
# accelerate's own save/load logs ("[RANK 0] Model weights saved in ...", "Removed shared tensor ...") are shown
# only when draftsmith logs at DEBUG (-v): they are normal and tell a user nothing about their run
LIBRARY_LOGGERS = ("accelerate", "lightning.pytorch", "lightning.fabric")

STATE_FILE = "trainer_state.json"
LOCK_FILE = ".lock"
# keys a resumed run may change without being "another run"
# (num_workers: a removed train key that run.yaml files written before still hold; train_sample: what evals score)
RESUMABLE_CHANGES = {
    "max_steps",
    "log_every",
    "eval_every",
    "save_every",
    "keep_checkpoints",
    "num_workers",
    "train_sample",
}


def _strip_resumable(cfg: Any) -> Any:
    if isinstance(cfg, dict):
        return {k: _strip_resumable(v) for k, v in cfg.items() if k not in RESUMABLE_CHANGES}
    return cfg


def _first_diff(a: Any, b: Any, path: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if a.get(k) != b.get(k):
                return _first_diff(a.get(k), b.get(k), f"{path}.{k}" if path else str(k))
    return f"{path or '<root>'} ({a!r} vs {b!r})"


def has_run(out: Path) -> bool:
    """True once `out` holds a run: its run.yaml, a checkpoint folder or metrics (what --resume continues)."""
    return any((out / n).exists() for n in ("run.yaml", "checkpoints", "metrics.jsonl"))


def lock_holder(out_dir: str | Path) -> str | None:
    """ "pid N on HOST" when a live process holds `out_dir`'s lock, else None (a dead holder's lock is free)."""
    f = Path(out_dir) / LOCK_FILE
    if not f.is_file():
        return None
    with f.open("r") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return fh.read().strip() or "another process"
        fcntl.flock(fh, fcntl.LOCK_UN)
    return None


def check_out_dir(out_dir: str | Path, run_config: dict | None, resume: bool, overwrite: bool) -> None:
    """Refuse (DraftsmithError) unless `out_dir` is ours to write: free, the same run with --resume, or --overwrite.
    Reads only."""
    out = Path(out_dir)
    if resume and overwrite:  # --overwrite would delete the very checkpoints --resume continues from
        raise DraftsmithError(
            "--resume and --overwrite contradict each other (--overwrite deletes the run --resume continues); "
            "pass --resume to continue the run in output_dir, or --overwrite to start it again"
        )
    holder = lock_holder(out)
    if holder:
        raise DraftsmithError(
            f"{out} is in use by a live run ({holder}); wait for it to finish or stop it, or use another output_dir"
        )
    check_output_dir(out, flag="output_dir")  # a file, a folder under a file, a folder that cannot be written
    if not has_run(out):
        if resume:
            raise DraftsmithError(f"--resume: {out} holds no run to resume; drop --resume to start one")
        return
    if overwrite:
        return
    run_yaml = out / "run.yaml"
    try:
        old = yaml.safe_load(run_yaml.read_text()) if run_yaml.is_file() else None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise DraftsmithError(
            f"{run_yaml} is damaged ({type(e).__name__}); restore it to resume the run, or pass --overwrite to "
            "start it again"
        ) from None
    if run_config is not None and old is not None and _strip_resumable(old) != _strip_resumable(run_config):
        diff = _first_diff(_strip_resumable(old), _strip_resumable(run_config))
        raise DraftsmithError(
            f"{out} holds another run (run.yaml differs at {diff}); use a new output_dir or pass --overwrite"
        )
    if not resume:
        raise DraftsmithError(
            f"{out} already holds this run; pass --resume to continue it or --overwrite to restart"
        )
    # a log broken before its last line is refused now, not after the load (a torn last line is said on resuming)
    read_events(out / "metrics.jsonl", warn=False)
    ckpts = list_checkpoints(out)
    if ckpts:  # a damaged checkpoint is refused now, before the caller loads any weights for it
        read_checkpoint_state(ckpts[-1])
        check_checkpoint_files(ckpts[-1])


TORCH_FILES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


def check_checkpoint_files(ckpt: Path) -> None:
    """Every weight, optimizer and RNG file of a checkpoint is whole, from headers alone: a safetensors header
    covering its file, a torch zip archive with its central directory, a legacy torch pickle starting as one. What
    the files hold (shapes, the step their RNG state belongs to) is checked as they load."""
    import zipfile

    from safetensors import SafetensorError, safe_open

    for f in sorted(p for p in ckpt.rglob("*") if p.is_file()):
        try:
            if f.suffix == ".safetensors":
                with safe_open(str(f), framework="pt"):
                    pass
            elif f.suffix in TORCH_FILES:
                with f.open("rb") as fh:
                    head = fh.read(4)
                if head.startswith(b"PK"):
                    zipfile.ZipFile(f).close()  # a truncated archive has lost its central directory
                elif not head.startswith(b"\x80"):  # neither torch.save's zip nor a pickle's protocol mark
                    raise ValueError("neither a torch archive nor a pickle")
        except (SafetensorError, OSError, ValueError, zipfile.BadZipFile) as e:
            detail = str(e).splitlines()[0][:100] if str(e) else type(e).__name__
            raise DraftsmithError(
                f"checkpoint {ckpt}: {f.relative_to(ckpt)} is corrupt or truncated ({detail}); delete the "
                "checkpoint to resume from the previous one"
            ) from None


def lock_dir(out_dir: str | Path, what: str = "output_dir") -> TextIO:
    """Create `out_dir` and hold its lock (out_dir/.lock, flock'ed, naming this process) until the returned file is
    closed or the process dies; refused in one line while another live process holds it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fh = (out / LOCK_FILE).open("a+")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # lost a race with another start
        fh.seek(0)
        holder = fh.read().strip() or "another process"
        fh.close()
        raise DraftsmithError(
            f"{out} is in use by a live run ({holder}); wait for it or use another {what}"
        ) from None
    fh.seek(0)
    fh.truncate()
    fh.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    fh.flush()
    return fh


def claim_out_dir(out_dir: str | Path, run_config: dict | None, resume: bool, overwrite: bool) -> TextIO:
    """Check `out_dir` again, lock it, clear it for --overwrite and write run.yaml. Main process only.
    Returns the open lock file: the lock lasts until it is closed (or the process dies)."""
    out = Path(out_dir)
    check_out_dir(out, run_config, resume, overwrite)
    fh = lock_dir(out)
    if overwrite and has_run(out):
        for name in ("checkpoints", "final", "lightning_logs"):
            shutil.rmtree(out / name, ignore_errors=True)
        for name in ("metrics.jsonl", "run.yaml"):
            (out / name).unlink(missing_ok=True)
    if run_config is not None:
        write_text(out / "run.yaml", yaml.safe_dump(run_config, sort_keys=False))
    return fh


def read_events(path: str | Path, warn: bool = True) -> list[dict]:
    """metrics.jsonl's events. A torn LAST line (the writer died mid-write) is skipped with a warning (`warn`); a
    broken line elsewhere is corruption (DraftsmithError)."""
    path = Path(path)
    if not path.is_file():
        return []
    # numbered as in the file (blank lines are skipped, not renumbered)
    lines = [(n, line) for n, line in enumerate(path.read_text().splitlines(), start=1) if line.strip()]
    events = []
    for i, (n, line) in enumerate(lines):
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            if i < len(lines) - 1:
                raise DraftsmithError(
                    f"{path} line {n} is not JSON; the log is corrupt: restore it to resume, or pass --overwrite "
                    "to start the run again"
                ) from None
            if warn:
                log.warning("%s: dropped a torn last line (the run was killed while writing it)", path)
    return events


def truncate_events(path: str | Path, step: int) -> None:
    """Keep the events logged at or before `step` (a resumed run redoes the later ones)."""
    path = Path(path)
    if path.is_file():
        keep = [e for e in read_events(path) if e.get("step", 0) <= step]
        write_text(path, "".join(json.dumps(e) + "\n" for e in keep))


def list_checkpoints(out_dir: str | Path) -> list[Path]:
    """Renamed (hence complete) checkpoints, oldest first. Tmp dirs are never listed."""
    ckpt = Path(out_dir) / "checkpoints"
    if not ckpt.is_dir():
        return []
    return sorted(
        p for p in ckpt.iterdir() if p.is_dir() and p.name.startswith("step-") and p.name[5:].isdigit()
    )


def read_checkpoint_state(path: Path) -> dict:
    """The trainer_state.json of a checkpoint; a missing/corrupt one is a DraftsmithError naming it."""
    f = path / STATE_FILE
    try:
        state = json.loads(f.read_text())
        int(state["step"]), int(state["epoch"]), int(state["batch_index"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DraftsmithError(
            f"checkpoint {path} is corrupt or incomplete ({type(e).__name__} reading {STATE_FILE}); "
            "delete it to resume from the previous one"
        ) from None
    return state


# --- saving and restoring checkpoints -------------------------------------------------------------------------


@contextlib.contextmanager
def quiet_library_logs() -> Iterator[None]:
    """Raise accelerate's and Lightning's loggers to ERROR, hide transformers' progress bars and library warnings
    (torch's pickle-protocol notes before a refused optimizer.bin) inside the block unless draftsmith logs at
    DEBUG (-v)."""
    if logging.getLogger("draftsmith").isEnabledFor(logging.DEBUG):
        yield
        return
    from transformers.utils import logging as hf_logging

    loggers = [logging.getLogger(n) for n in LIBRARY_LOGGERS]
    levels = [lg.level for lg in loggers]
    bars = hf_logging.is_progress_bar_enabled()  # "Writing model shards" from save_pretrained
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
        if bars:
            hf_logging.enable_progress_bar()


def scheduler_state(scheduler) -> dict:
    """The LR scheduler's state as JSON (its lr_lambdas are functions and are rebuilt from the recipe)."""
    return {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}


def begin_checkpoint(out: Path, step: int) -> Path:
    """The empty tmp folder a checkpoint of `step` is written into (main process only)."""
    tmp = out / "checkpoints" / f".tmp-step-{step:07d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def finish_checkpoint(out: Path, tmp: Path, state: dict, keep: int) -> Path:
    """Write trainer_state.json last (its presence marks a complete checkpoint), rename `tmp` to step-N and remove
    the oldest beyond `keep` (main process only)."""
    write_json(tmp / STATE_FILE, state)
    final = replace_dir(tmp, out / "checkpoints" / f"step-{state['step']:07d}")
    ckpts = list_checkpoints(out)
    for old in ckpts[: max(len(ckpts) - keep, 0)]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def rng_file(ckpt: Path, process: int) -> Path:
    return ckpt / f"rng_state_{process}.safetensors"


def save_checkpoint(accelerator, out: Path, state: dict, keep: int) -> None:
    """accelerator.save_state (safetensors weights, the optimizer's torch file) with each process's RNG state as
    safetensors in place of accelerate's pickle, plus trainer_state.json."""
    tmp = out / "checkpoints" / f".tmp-step-{state['step']:07d}"
    if accelerator.is_main_process:
        begin_checkpoint(out, state["step"])
    accelerator.wait_for_everyone()
    with quiet_library_logs():
        accelerator.save_state(str(tmp), safe_serialization=True)
    rank = accelerator.process_index
    (tmp / f"random_states_{rank}.pkl").unlink(missing_ok=True)
    save_state(rng_file(tmp, rank), rng_state(), meta={"step": str(state["step"])})
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        finish_checkpoint(out, tmp, {**state, "engine": "accelerate"}, keep)
    accelerator.wait_for_everyone()


@dataclass
class Position:
    """Where training stands: optimizer steps done, epoch, index of the next unread batch in the epoch."""

    step: int = 0
    epoch: int = 0
    batch_index: int = 0


def newest_checkpoint(out: Path, engine: str) -> tuple[Path, dict] | None:
    """The newest complete checkpoint of `out` and its trainer_state.json, checked to come from `engine`."""
    ckpts = list_checkpoints(out)
    if not ckpts:
        return None
    state = read_checkpoint_state(ckpts[-1])
    written_by = state.get("engine", "accelerate")
    if written_by != engine:
        raise DraftsmithError(
            f"checkpoint {ckpts[-1]} was written by the {written_by} engine; resume it with --engine {written_by}"
        )
    return ckpts[-1], state


def restore_rng(ckpt: Path, process: int, step: int) -> None:
    """Set this process's RNGs from the checkpoint, or stop: a resume that cannot restore them would diverge."""
    f = rng_file(ckpt, process)
    if not f.is_file() and (ckpt / f"random_states_{process}.pkl").is_file():  # written before rng_state_N
        from accelerate.utils import load

        try:
            with quiet_library_logs():
                old = load(ckpt / f"random_states_{process}.pkl")  # torch.load(weights_only=True)
            tree = {
                "python": old["random_state"],
                "numpy": old["numpy_random_seed"],
                "torch": old["torch_manual_seed"],
            }
            if "torch_cuda_manual_seed" in old:
                tree["cuda"] = old["torch_cuda_manual_seed"]
        except Exception as e:  # noqa: BLE001 - unpickling raises many types
            raise DraftsmithError(
                f"{ckpt}/random_states_{process}.pkl is corrupt ({type(e).__name__}); "
                "delete the checkpoint to resume from the previous one"
            ) from None
    else:
        try:
            tree, meta = load_state(f)
        except DraftsmithError as e:
            raise DraftsmithError(
                f"RNG state: {e}; delete the checkpoint to resume from the previous one"
            ) from None
        if meta.get("step") != str(step):
            raise DraftsmithError(
                f"{f} belongs to step {meta.get('step')}, its checkpoint to step {step}; "
                "delete the checkpoint to resume from the previous one"
            )
    try:
        set_rng_state(tree)
    except DraftsmithError as e:
        raise DraftsmithError(f"{f}: {e}; delete the checkpoint to resume from the previous one") from None


def _first_line(e: Exception) -> str:
    text = str(e).splitlines()[0] if str(e) else ""
    return text.split(". ")[0][:120]


def restore_checkpoint(accelerator, out: Path, scheduler) -> Position:
    """Load the newest checkpoint into the prepared model/optimizer/RNGs and the scheduler; its Position."""
    found = newest_checkpoint(out, "accelerate")
    if found is None:
        accelerator.print(f"--resume: no checkpoint in {out}/checkpoints yet; starting at step 0")
        return Position()
    ckpt, state = found
    try:
        with quiet_library_logs():
            accelerator.load_state(str(ckpt))
    except Exception as e:  # noqa: BLE001 - accelerate/safetensors raise many types
        raise DraftsmithError(
            f"checkpoint {ckpt} could not be loaded ({type(e).__name__}: {_first_line(e)}); "
            "delete it to resume from the previous one, or check the model config matches"
        ) from None
    restore_rng(ckpt, accelerator.process_index, int(state["step"]))
    if "scheduler" in state:
        sched = state["scheduler"]
        scheduler.load_state_dict({"lr_lambdas": [None] * len(sched["base_lrs"]), **sched})
    pos = Position(int(state["step"]), int(state["epoch"]), int(state["batch_index"]))
    accelerator.print(f"resuming from {ckpt} (step {pos.step}, epoch {pos.epoch}, batch {pos.batch_index})")
    return pos
