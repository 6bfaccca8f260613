"""Writing files so that a reader never sees half of one: write to a temporary name in the same folder, then
rename over the destination (`os.replace` is atomic on POSIX). A killed process leaves the old file or the new
one, never a torn mix; temporaries are named `.tmp<pid>.<name>` so they keep the suffix (matplotlib, safetensors
and json readers look at it) and two processes never share one.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from draftsmith.errors import DraftsmithError


def cache_dir() -> Path:
    """draftsmith's cache (assembled embedded models, dequantized GGUFs, measured CPU plans): $DRAFTSMITH_CACHE, by
    default ~/.cache/draftsmith."""
    return Path(os.environ.get("DRAFTSMITH_CACHE", Path.home() / ".cache" / "draftsmith"))


def check_cache_dir() -> Path:
    """Refuse a DRAFTSMITH_CACHE that is a file or lies under one, before any command spends time on what it would
    keep there (a dequantized GGUF is written there after minutes of work)."""
    path = cache_dir()
    base = path
    while not base.exists() and base != base.parent:
        base = base.parent
    if not base.is_dir():
        raise DraftsmithError(
            f"DRAFTSMITH_CACHE={path}: {base} is a file, not a folder; point it to a folder or unset it "
            "(default ~/.cache/draftsmith)"
        )
    return path


def temp_path(path: str | os.PathLike) -> Path:
    path = Path(path)
    return path.with_name(f".tmp{os.getpid()}.{path.name}")


def atomic_write(path: str | os.PathLike, write: Callable[[Path], Any]) -> Path:
    """Call `write(tmp)` to produce the file at a temporary path, then rename it to `path`."""
    path = Path(path)
    tmp = temp_path(path)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_text(text))


def write_json(path: str | os.PathLike, obj: Any, indent: int | None = 1, **kwargs) -> Path:
    return write_text(path, json.dumps(obj, indent=indent, **kwargs) + "\n")


def replace_dir(tmp: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Put the fully written folder `tmp` at `out`, replacing what was there (moved aside first, then deleted:
    at every moment `out` is either the old folder or the new one)."""
    tmp, out = Path(tmp), Path(out)
    if out.exists():
        old = out.with_name(f".old{os.getpid()}.{out.name}")
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)
    return out


def check_output_dir(
    path: str | os.PathLike, results: tuple[str, ...] = (), overwrite: bool = False, flag: str = "--out"
) -> Path:
    """Refuse, before any compute, an output folder that cannot be written or that already holds `results`
    (unless `overwrite`: a file is never replaced by a folder). Creates nothing: a probe file in the nearest
    existing folder is written and removed. `flag`: the option the messages tell the user to change."""
    out = Path(path).expanduser()
    if out.exists() and not out.is_dir():
        raise DraftsmithError(f"output folder {out} is a file; choose another {flag}")
    held = [name for name in results if (out / name).exists()]
    if held and not overwrite:
        raise DraftsmithError(
            f"{out} already holds {held[0]} from an earlier run; pass --overwrite to replace it "
            f"or choose another {flag}"
        )
    base = out
    while not base.exists():
        base = base.parent
    if not base.is_dir():
        raise DraftsmithError(f"cannot create output folder {out}: {base} is a file; choose another {flag}")
    try:
        fd, probe = tempfile.mkstemp(prefix=".probe-", dir=base)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise DraftsmithError(
            f"cannot write output folder {out} ({e.strerror}); choose a writable {flag}"
        ) from None
    return out
