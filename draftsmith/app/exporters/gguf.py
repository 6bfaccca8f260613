"""Checkpoints -> one GGUF file llama.cpp runs, through llama.cpp's own converter (the pinned build's
convert_hf_to_gguf.py, draftsmith.llamacpp.convert).

    draftsmith export runs/distill/final --format gguf --out exports/draft-gguf     # llama-server -md FILE
    draftsmith export runs/eagle3/final  --format gguf --out exports/eagle3-gguf    # ... --spec-type draft-eagle3

What llama.cpp runs (src/models, common/speculative.cpp of the pinned source): a draft LM of any architecture its
converter registers (`--spec-type draft-simple`), an EAGLE-3 head or a DFlash drafter whose target's graph records
its layer inputs (`--spec-type draft-eagle3` / `draft-dflash`, draftsmith.llamacpp.EAGLE3_TARGET_TYPES), and prompt
lookup without any file (`ngram-*`). The draft LM goes through the `hf` export first (a reduced vocabulary becomes
full rows), the EAGLE-3 head through the `sglang-eagle3` layout: the converter reads its top-level
`eagle_aux_hidden_state_layer_ids`, which are layer inputs as draftsmith's, and llama.cpp captures `t_layer_inp[id]`,
the input of layer id: the same states. DFlash goes through the layout of llama.cpp's converter
(heads/block/export.py: llamacpp_dflash; the target's width, any head: the target's frozen one, its own full one, or
its own reduced one with d2t), whose layer-output ids the converter turns back into layer inputs (id + 1).
Everything is checked before any weight is read; the converter's intermediate folder is a temporary one.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from draftsmith import llamacpp
from draftsmith.checkpoint import Checkpoint, head_export
from draftsmith.errors import DraftsmithError
from draftsmith.kinds import ExportFormat, ExportOptions

GGUF = "gguf"
GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")
SPEC_TYPES = (
    "draft-simple (a draft LM), draft-eagle3 (EAGLE-3 heads), draft-dflash (DFlash) and ngram-* (no drafter)"
)


def refusal(ckpt: Checkpoint, title: str, other_formats: list[str]) -> str:
    """Why a kind without a GGUF export cannot go to llama.cpp, and what would work instead."""
    why = {
        "medusa": "llama.cpp has no Medusa drafting",
        "eagle": "llama.cpp runs EAGLE-3 heads only, not EAGLE-1",
        "peagle": "llama.cpp has no P-EAGLE drafting",
    }.get(ckpt.kind, f"llama.cpp cannot run {title}")
    instead = f"export --format {other_formats[0]} for another engine, or " if other_formats else ""
    return (
        f"{ckpt.path} holds {title} ({ckpt.kind}): {why}; its speculative types are {SPEC_TYPES}. "
        f"{instead}evaluate it with draftsmith eval"
    )


def format_for(kind: str, outtype: str = "f16") -> ExportFormat | None:
    """The GGUF export of a checkpoint kind (None: llama.cpp cannot run it)."""
    if outtype not in GGUF_TYPES:
        raise DraftsmithError(f"--gguf-type {outtype!r} is not one of {', '.join(GGUF_TYPES)}")
    if kind == "draft":
        return ExportFormat(
            GGUF,
            lambda ckpt, out, opts: _write_draft(ckpt, out, outtype),
            serve_note="llama-server -m TARGET.gguf -md FILE --spec-type draft-simple --spec-draft-n-max K",
        )
    if kind == "eagle3":
        return ExportFormat(
            GGUF,
            lambda ckpt, out, opts: _write_eagle3(ckpt, out, opts, outtype),
            aux_note="eagle_aux_hidden_state_layer_ids (GGUF target_layers) are layer inputs (= draftsmith's); "
            "llama.cpp reads t_layer_inp[id], the input of target layer id",
            serve_note="llama-server -m TARGET.gguf -md FILE --spec-type draft-eagle3 --spec-draft-n-max K "
            "(the target GGUF must be of the head's target)",
            names_verifier=True,
        )
    if kind == "dflash":
        return ExportFormat(
            GGUF,
            lambda ckpt, out, opts: _write_dflash(ckpt, out, opts, outtype),
            serve_note="llama-server -m TARGET.gguf -md FILE --spec-type draft-dflash --spec-draft-n-max K "
            "(K < the block size; the target GGUF must be of the drafter's target)",
            names_verifier=True,
        )
    return None


def _config(folder: Path) -> dict:
    try:
        return json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DraftsmithError(
            f"cannot read {folder / 'config.json'} ({e}); pass the model's folder"
        ) from None


def check_draft(ckpt: Checkpoint) -> None:
    """A draft LM converts when llama.cpp's converter registers its architecture."""
    archs = list(_config(ckpt.path).get("architectures") or [])
    known = llamacpp.converter_architectures()
    if not any(a in known for a in archs):
        raise DraftsmithError(
            f"{ckpt.path}: llama.cpp's converter does not know the architecture {archs or '(none recorded)'}; "
            "export --format hf and serve it with vLLM or transformers, or distill a draft of a llama.cpp "
            "architecture (llama, qwen2, qwen3...)"
        )


def feature_target_dir(ckpt: Checkpoint, verifier: str | None) -> Path:
    """The target of a head reading its hidden states (EAGLE-3, DFlash) as an HF folder (tokenizer, layer count for
    the converter), checked runnable by llama.cpp (its graph records layer inputs)."""
    from draftsmith.verifier import local_target_dir

    if verifier:
        folder = Path(verifier).expanduser()
        if not (folder / "config.json").is_file():
            raise DraftsmithError(
                f"--verifier {verifier} holds no config.json; pass the target's HF model folder"
            )
    else:
        folder = local_target_dir(ckpt.target)
        if folder is None:
            raise DraftsmithError(
                f"{ckpt.path}: the head's target ({ckpt.target.get('name_or_path')!r}) is not a folder on this "
                "machine; pass --verifier with the target's HF model folder (the converter reads its tokenizer)"
            )
    cfg = _config(folder)
    model_type = (cfg.get("text_config") or cfg).get("model_type")
    if model_type not in llamacpp.EAGLE3_TARGET_TYPES:
        raise DraftsmithError(
            f"{ckpt.path}: llama.cpp cannot run this {ckpt.kind} drafter for a {model_type!r} target (its graph "
            "does not record the layer inputs the drafter reads; it does for "
            f"{', '.join(sorted(llamacpp.EAGLE3_TARGET_TYPES))}); export --format "
            f"{'sglang-dflash' if ckpt.kind == 'dflash' else 'sglang-eagle3 or speculators'} for SGLang / vLLM instead"
        )
    n_layers = (cfg.get("text_config") or cfg).get("num_hidden_layers")
    recorded = ckpt.target.get("num_hidden_layers")
    if recorded and n_layers != recorded:
        raise DraftsmithError(
            f"{ckpt.path}: the head was trained for a {recorded}-layer target but {folder} has {n_layers} layers; "
            "pass --verifier with the head's own target folder"
        )
    return folder


def _write_draft(ckpt: Checkpoint, out: Path, outtype: str) -> dict:
    from draftsmith.app.exporters.hf import export_hf

    check_draft(ckpt)
    with tempfile.TemporaryDirectory(prefix="draftsmith-gguf-") as tmp:
        notes = export_hf(ckpt, Path(tmp))
        # a SentencePiece model is what the converter reads first (Llama-2-style vocabularies); the HF export
        # writes tokenizer.json only
        if (ckpt.path / "tokenizer.model").is_file() and not (Path(tmp) / "tokenizer.model").exists():
            shutil.copyfile(ckpt.path / "tokenizer.model", Path(tmp) / "tokenizer.model")
        file = llamacpp.convert(tmp, out / f"draft.{outtype}.gguf", outtype=outtype)
    return {**notes, "gguf_file": file.name, "gguf_type": outtype, "llama_cpp": llamacpp.build_info()}


def _write_eagle3(ckpt: Checkpoint, out: Path, opts: ExportOptions, outtype: str) -> dict:
    from draftsmith.heads.eagle.export import check_sglang, sglang_eagle3

    return _write_head(ckpt, out, opts, outtype, "eagle3", check_sglang, sglang_eagle3)


def _write_dflash(ckpt: Checkpoint, out: Path, opts: ExportOptions, outtype: str) -> dict:
    from draftsmith.heads.block.export import check_llamacpp_dflash, llamacpp_dflash

    return _write_head(ckpt, out, opts, outtype, "dflash", check_llamacpp_dflash, llamacpp_dflash)


def _write_head(
    ckpt: Checkpoint, out: Path, opts: ExportOptions, outtype: str, name: str, check, export
) -> dict:
    """A head through its SGLang layout (the converter's input), then llama.cpp's converter with the target's
    folder (--target-model-dir)."""
    check(ckpt.config, str(ckpt.path))
    target = feature_target_dir(ckpt, opts.verifier)
    llamacpp.converter()  # the build is there before any tensor is read
    with tempfile.TemporaryDirectory(prefix="draftsmith-gguf-") as tmp:
        notes = head_export(export)(ckpt, Path(tmp), opts)
        file = llamacpp.convert(tmp, out / f"{name}.{outtype}.gguf", outtype=outtype, target_dir=target)
    return {
        **notes,
        "gguf_file": file.name,
        "gguf_type": outtype,
        "target_dir": str(target),
        "llama_cpp": llamacpp.build_info(),
    }
