"""`draftsmith export CKPT --format FMT --out DIR`: checkpoints in the formats serving engines load.

    draftsmith export runs/medusa/final  --format vllm-medusa   --out exports/medusa-vllm
    draftsmith export runs/eagle3/final  --format sglang-eagle3 --out exports/eagle3-sglang
    draftsmith export runs/eagle3/final  --format speculators   --out exports/eagle3-vllm
    draftsmith export runs/distill/final --format hf            --out exports/draft-hf
    draftsmith export runs/eagle3/final  --format gguf          --out exports/eagle3-gguf   # llama.cpp

Every head export checks the exact tensor-name set and shapes, before and after mapping (engines ignore unknown
names and run with random weights), is written to a temporary folder and renamed into place, and carries
`draftsmith_export.json`: the format, source, target and how the aux-layer ids were converted. The formats a
checkpoint exports to are its kind's record's (draftsmith.kinds ExportFormat: heads.<family>.export, the draft LM's
in app.exporters.hf); `gguf` (llama.cpp, through its own converter) is app.exporters.gguf's, for the kinds llama.cpp
runs.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
from pathlib import Path

from draftsmith.app.drafters import DRAFTERS
from draftsmith.app.exporters import gguf
from draftsmith.checkpoint import EXPORT_MANIFEST, Checkpoint, read_checkpoint
from draftsmith.errors import DraftsmithError
from draftsmith.fileio import check_output_dir, replace_dir
from draftsmith.kinds import ExportFormat, ExportOptions, describe_kind, spec_for
from draftsmith.verifier import is_hub_id

log = logging.getLogger(__name__)


def formats() -> list[str]:
    """Every format some kind exports to (its record's ExportFormat names)."""
    return sorted({gguf.GGUF, *(f.name for rec in DRAFTERS.values() for f in rec.exports)})


def export(
    checkpoint: str | os.PathLike,
    fmt: str,
    out: str | os.PathLike,
    force: bool = False,
    speculative_tokens: int = 3,
    verifier: str | None = None,
    gguf_type: str = "f16",
) -> Path:
    """Export `checkpoint` as `fmt` into `out` (written to a temporary sibling, then renamed). Returns out.
    `verifier`: speculators formats, the target's Hub id or folder to name (default: recorded with the head); gguf,
    the target's HF folder the converter reads. `gguf_type`: the GGUF tensor type (f32, f16, bf16, q8_0)."""
    if fmt not in formats():
        raise DraftsmithError(f"unknown export format {fmt!r}; choose one of {formats()}")
    if (
        verifier
        and fmt != gguf.GGUF
        and not any(f.names_verifier for rec in DRAFTERS.values() for f in rec.exports if f.name == fmt)
    ):
        raise DraftsmithError(
            f"--verifier applies to the speculators formats only (and to gguf: the target folder), not {fmt}"
        )
    if gguf_type != "f16" and fmt != gguf.GGUF:
        raise DraftsmithError(f"--gguf-type applies to --format gguf only, not {fmt}")
    gguf.format_for("draft", gguf_type)  # a bad --gguf-type is refused before the checkpoint is read
    if speculative_tokens < 1:
        raise DraftsmithError(f"--speculative-tokens must be >= 1, got {speculative_tokens}")
    out = Path(out).expanduser()
    check_output_dir(out)  # before the checkpoint is read; --force never replaces a file with a folder
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise DraftsmithError(f"{out} already exists and is not empty; choose another --out or pass --force")
    ckpt = read_checkpoint(checkpoint, DRAFTERS)
    rec = DRAFTERS[ckpt.kind]
    writer = gguf.format_for(ckpt.kind, gguf_type) if fmt == gguf.GGUF else rec.format(fmt)
    if writer is None and fmt == gguf.GGUF:
        raise DraftsmithError(
            gguf.refusal(ckpt, rec.title, rec.format_names())
            + f" --drafter {spec_for(DRAFTERS, ckpt.kind) or ckpt.kind}:{ckpt.path}"
        )
    if writer is None:
        names = rec.format_names()
        raise DraftsmithError(
            f"{ckpt.path} holds {describe_kind(DRAFTERS, ckpt.kind)}, which cannot be exported as {fmt}; "
            + (
                f"it exports to {' or '.join(names)} (--format {names[0]})"
                if names
                else f"no engine reads it yet: evaluate it with draftsmith eval --drafter "
                f"{spec_for(DRAFTERS, ckpt.kind) or ckpt.kind}:{ckpt.path}"
            )
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        notes = writer.write(ckpt, tmp, ExportOptions(speculative_tokens, verifier))
        (tmp / EXPORT_MANIFEST).write_text(json.dumps(_manifest(ckpt, writer, notes), indent=2) + "\n")
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written is left behind
        raise
    log.info("exported %s (%s) as %s to %s", ckpt.path, ckpt.kind, fmt, out)
    return out


def _manifest(ckpt: Checkpoint, fmt: ExportFormat, notes: dict) -> dict:
    manifest = {
        "format": fmt.name,
        "source": str(ckpt.path.resolve()),
        "source_kind": ckpt.kind,
        "target": ckpt.target,
        **notes,
    }
    if is_hub_id(notes.get("verifier")) and not ckpt.target.get("hub_id"):  # model cards link the target
        manifest["target"] = {**ckpt.target, "hub_id": notes["verifier"]}
    if fmt.aux_note:
        manifest["aux_hidden_state_layer_ids_draftsmith"] = ckpt.config["aux_hidden_state_layer_ids"]
        manifest["aux_layer_ids_note"] = fmt.aux_note
    if fmt.serve_note:
        manifest["serve_with"] = fmt.serve_note
    return manifest


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="draftsmith checkpoint folder (a head or a distilled draft)")
    p.add_argument("--format", required=True, choices=formats(), dest="fmt", help="target format")
    p.add_argument("--out", required=True, help="output folder (must not exist or be empty, unless --force)")
    p.add_argument("--force", action="store_true", help="replace an existing --out folder")
    p.add_argument(
        "--speculative-tokens",
        type=int,
        default=3,
        help="speculators only: default number of draft tokens vLLM proposes (default 3)",
    )
    p.add_argument(
        "--verifier",
        help="speculators formats: the target's Hub id (portable) or folder, as vLLM should load it; gguf: the "
        "target's HF folder for llama.cpp's converter (default: the one recorded with the head)",
    )
    p.add_argument(
        "--gguf-type",
        default="f16",
        choices=gguf.GGUF_TYPES,
        help="gguf only: tensor type of the GGUF file (default f16)",
    )


def run(args: argparse.Namespace) -> int:
    out = export(
        args.checkpoint,
        args.fmt,
        args.out,
        force=args.force,
        speculative_tokens=args.speculative_tokens,
        verifier=args.verifier,
        gguf_type=args.gguf_type,
    )
    print(f"wrote {args.fmt} export to {out}")
    for name in sorted(os.listdir(out)):
        print(f"  {name}")
    manifest = json.loads((out / EXPORT_MANIFEST).read_text())
    for key in ("verifier", "serve_with"):
        if key in manifest:
            print(f"{key.replace('_', ' ')}: {manifest[key]}")
    return 0
