"""`draftsmith export CKPT --format FMT --out DIR`: checkpoints in the formats serving engines load.

    draftsmith export runs/medusa/final  --format vllm-medusa   --out exports/medusa-vllm
    draftsmith export runs/eagle3/final  --format sglang-eagle3 --out exports/eagle3-sglang
    draftsmith export runs/eagle3/final  --format speculators   --out exports/eagle3-vllm
    draftsmith export runs/distill/final --format hf            --out exports/draft-hf

Every head export checks the exact tensor-name set and shapes, before and after mapping (engines ignore unknown
names and run with random weights), is written to a temporary folder and renamed into place, and carries
`draftsmith_export.json`: the format, source, target and how the aux-layer ids were converted.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from draftsmith.checkpoint import EXPORT_MANIFEST, Checkpoint, read_checkpoint
from draftsmith.errors import DraftsmithError
from draftsmith.fileio import replace_dir
from draftsmith.verifier import is_hub_id

log = logging.getLogger(__name__)

FORMATS = (
    "hf",
    "sglang-eagle3",
    "speculators",
    "vllm-medusa",
    "sglang-dflash",
    "speculators-dflash",
    "speculators-peagle",
)
KINDS = {
    "hf": ("draft", "dflash", "peagle"),
    "sglang-dflash": ("dflash",),
    "speculators-dflash": ("dflash",),
    "speculators-peagle": ("peagle",),
    "sglang-eagle3": ("eagle3",),
    "speculators": ("eagle3",),
    "vllm-medusa": ("medusa",),
}


def _write_head(build: Callable[[Checkpoint], tuple[dict, dict]]) -> Callable[[Checkpoint, Path], dict]:
    def write(ckpt: Checkpoint, out: Path) -> dict:
        from safetensors.torch import save_file

        cfg, tensors = build(ckpt)
        (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=False) + "\n")
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        notes = {"config": cfg.get("architectures")}
        verifier = (cfg.get("speculators_config") or {}).get("verifier")
        if verifier:  # the target the engine will load: a Hub id, or a folder on this machine only
            notes["verifier"] = verifier["name_or_path"]
        return notes

    return write


def _writers(
    speculative_tokens: int, verifier: str | None = None
) -> dict[str, Callable[[Checkpoint, Path], dict]]:
    from draftsmith.app.exporters import hf
    from draftsmith.heads.block import export as block
    from draftsmith.heads.eagle import export as eagle3
    from draftsmith.heads.medusa import export as medusa

    return {
        "hf": lambda c, out: (_write_head(block.native) if c.kind in block.KINDS else hf.export_hf)(c, out),
        "sglang-dflash": _write_head(block.sglang_dflash),
        "speculators-dflash": _write_head(block.speculators_dflash),
        "speculators-peagle": _write_head(block.speculators_peagle),
        "sglang-eagle3": _write_head(eagle3.sglang_eagle3),
        "speculators": _write_head(lambda c: eagle3.speculators_eagle3(c, speculative_tokens, verifier)),
        "vllm-medusa": _write_head(medusa.vllm_medusa),
    }


AUX_NOTES = {
    "sglang-eagle3": "eagle_config.eagle_aux_hidden_state_layer_ids are SGLang layer-output ids (draftsmith id - 1; "
    "SGLang captures the input of layer id+1); the top-level eagle_aux_hidden_state_layer_ids are vLLM layer-input "
    "ids (= draftsmith's), which vLLM reads first",
    "speculators": "eagle_aux_hidden_state_layer_ids are vLLM layer-input ids (= draftsmith's, unchanged)",
}
SERVE_NOTES = {
    # checked in the released wheels: vllm/v1/spec_decode/medusa.py first ships in 0.9.0 and is gone from 0.33.0
    "vllm-medusa": 'for vLLM 0.9.0 to 0.32.x: speculative_config={"method": "medusa", "model": DIR, '
    '"num_speculative_tokens": N} (top-1 chain per head); vLLM 0.33.0 and later have no Medusa at all',
}


def export(
    checkpoint: str | os.PathLike,
    fmt: str,
    out: str | os.PathLike,
    force: bool = False,
    speculative_tokens: int = 3,
    verifier: str | None = None,
) -> Path:
    """Export `checkpoint` as `fmt` into `out` (written to a temporary sibling, then renamed). Returns out.
    `verifier`: speculators only, the target's Hub id or folder to name (default: recorded with the head)."""
    if fmt not in FORMATS:
        raise DraftsmithError(f"unknown export format {fmt!r}; choose one of {list(FORMATS)}")
    out = Path(out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise DraftsmithError(f"{out} already exists and is not empty; choose another --out or pass --force")
    ckpt = read_checkpoint(checkpoint)
    if ckpt.kind not in KINDS[fmt]:
        hint = {
            "draft": "hf",
            "medusa": "vllm-medusa",
            "eagle3": "sglang-eagle3 or speculators",
            "dflash": "sglang-dflash or speculators-dflash",
            "peagle": "speculators-peagle",
        }.get(ckpt.kind)
        raise DraftsmithError(
            f"{ckpt.path} is a {ckpt.kind} checkpoint and cannot be exported as {fmt}; "
            + (
                f"use --format {hint}"
                if hint
                else "EAGLE-1 heads have no engine export yet; evaluate them with draftsmith eval"
            )
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        notes = _writers(speculative_tokens, verifier)[fmt](ckpt, tmp)
        manifest = {
            "format": fmt,
            "source": str(ckpt.path.resolve()),
            "source_kind": ckpt.kind,
            "target": ckpt.target,
            **notes,
        }
        if is_hub_id(notes.get("verifier")) and not ckpt.target.get("hub_id"):  # model cards link the target
            manifest["target"] = {**ckpt.target, "hub_id": notes["verifier"]}
        if fmt in AUX_NOTES:
            manifest["aux_hidden_state_layer_ids_draftsmith"] = ckpt.config["aux_hidden_state_layer_ids"]
            manifest["aux_layer_ids_note"] = AUX_NOTES[fmt]
        if fmt in SERVE_NOTES:
            manifest["serve_with"] = SERVE_NOTES[fmt]
        (tmp / EXPORT_MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written is left behind
        raise
    log.info("exported %s (%s) as %s to %s", ckpt.path, ckpt.kind, fmt, out)
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="draftsmith checkpoint folder (a head or a distilled draft)")
    p.add_argument("--format", required=True, choices=FORMATS, dest="fmt", help="target format")
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
        help="speculators only: the target's Hub id (portable) or folder, as vLLM should load it "
        "(default: the one recorded with the head)",
    )


def run(args: argparse.Namespace) -> int:
    if args.verifier and args.fmt != "speculators":
        raise DraftsmithError(f"--verifier applies to --format speculators only, not {args.fmt}")
    out = export(
        args.checkpoint,
        args.fmt,
        args.out,
        force=args.force,
        speculative_tokens=args.speculative_tokens,
        verifier=args.verifier,
    )
    print(f"wrote {args.fmt} export to {out}")
    for name in sorted(os.listdir(out)):
        print(f"  {name}")
    manifest = json.loads((out / EXPORT_MANIFEST).read_text())
    for key in ("verifier", "serve_with"):
        if key in manifest:
            print(f"{key.replace('_', ' ')}: {manifest[key]}")
    return 0
