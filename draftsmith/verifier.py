"""The target ("verifier") a speculators export names, and the target's input embeddings it must carry.

speculators and `vllm serve DIR` load the target from `speculators_config.verifier.name_or_path`, so it must be a
Hub id or a folder on the serving machine; the bare folder name heads once recorded for a local target resolves to
nothing. speculators (models/eagle3, model.py `DraftVocabMixin`) builds `embed_tokens` [V, H] for the draft, fills
it with NaN and copies the verifier's embeddings in only when it can load them; checkpoints it writes itself carry
`embed_tokens.weight`, and so do ours: read from the target's own safetensors and checked against the embedding
fingerprint recorded when the head was trained.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from draftsmith.checkpoint import Checkpoint, target_hub_id
from draftsmith.errors import DraftsmithError

log = logging.getLogger(__name__)

EMBED = "embed_tokens.weight"


def is_hub_id(name: str | None) -> bool:
    from draftsmith.hub import check_repo_id

    if not name or Path(name).expanduser().exists():
        return False
    try:
        check_repo_id(name)
    except DraftsmithError:
        return False
    return True


def local_target_dir(target: dict) -> Path | None:
    """A folder on this machine with the target's config.json (the one recorded at training time, a folder given
    as its name, or the dequantized copy of an embedded GGUF target), or None."""
    from draftsmith import models

    for cand in (target.get("path"), target.get("name_or_path")):
        if cand and (Path(cand).expanduser() / "config.json").is_file():
            return Path(cand).expanduser().resolve()
    name = target.get("name_or_path")
    if name in models.EMBEDDED_TARGETS:
        return Path(models.materialize(models.resolve(name)).path).resolve()
    return None


def resolve_verifier(ckpt: Checkpoint, override: str | None = None) -> tuple[str, Path | None]:
    """(name_or_path written into the engine config, a local folder holding the target's weights or None).

    `override` (`--verifier`) is a Hub id or a target folder. Otherwise the recorded Hub id wins (portable); a
    target known only as a local folder is named by its absolute path (it loads on this machine only)."""
    target = ckpt.config.get("target") or {}
    local = local_target_dir(target)
    if override:
        folder = Path(override).expanduser()
        if folder.is_dir():
            if not (folder / "config.json").is_file():
                raise DraftsmithError(
                    f"--verifier {override} holds no config.json; pass the target's model folder"
                )
            return str(folder.resolve()), folder.resolve()
        if not is_hub_id(override):
            raise DraftsmithError(
                f"--verifier {override} is neither a folder on this machine nor a Hub id (NAMESPACE/NAME)"
            )
        return override, local
    name = target.get("name_or_path")
    hub_id = target_hub_id(target) or (name if is_hub_id(name) else None)
    if hub_id:
        return hub_id, local
    if local is not None:
        log.warning(
            "the export names its target by the local folder %s: it loads on this machine only; pass --verifier "
            "HUB_ID for a portable export",
            local,
        )
        return str(local), local
    raise DraftsmithError(
        f"{ckpt.path}: the head's target was recorded as {name!r}, which is neither a Hub id nor a folder on this "
        "machine, so speculators and vllm serve could not load it; pass --verifier HUB_ID (or the target's folder)"
    )


def _embedding_key(keys) -> str | None:
    found = sorted((k for k in keys if k == EMBED or k.endswith("." + EMBED)), key=len)
    return found[0] if found else None


def _read_local(folder: Path) -> torch.Tensor:
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        key = _embedding_key(weight_map)
        files = [folder / weight_map[key]] if key else []
    else:
        files, key = sorted(folder.glob("*.safetensors")), None
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            k = key or _embedding_key(st.keys())
            if k:
                return st.get_tensor(k)
    raise DraftsmithError(
        f"no {EMBED} in the safetensors of {folder}; pass --verifier with the target's folder"
    )


def _read_hub(repo_id: str) -> torch.Tensor:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        try:
            index = json.loads(Path(hf_hub_download(repo_id, "model.safetensors.index.json")).read_text())
            key = _embedding_key(index["weight_map"])
            file = hf_hub_download(repo_id, index["weight_map"][key]) if key else None
        except EntryNotFoundError:
            file = hf_hub_download(repo_id, "model.safetensors")
    except Exception as e:  # noqa: BLE001 - network, auth and cache errors share no base class
        raise DraftsmithError(
            f"could not read {repo_id}'s input embeddings from the Hub ({type(e).__name__}); pass --verifier with "
            "a local folder of the target"
        ) from None
    if file is None:
        raise DraftsmithError(f"{repo_id} has no {EMBED} in its safetensors index")
    return _read_local_file(Path(file))


def _read_local_file(path: Path) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as st:
        return st.get_tensor(_embedding_key(st.keys()))


def target_embeddings(
    ckpt: Checkpoint, verifier: str, local: Path | None, shape: tuple[int, int] | None = None
) -> torch.Tensor:
    """The target's input embeddings [V, H], refused unless they have `shape` and match the fingerprint recorded
    at training."""
    from draftsmith.modeling import embedding_fingerprint, fingerprints_match

    emb = _read_local(local) if local is not None else _read_hub(verifier)
    if shape is not None and tuple(emb.shape) != tuple(shape):
        raise DraftsmithError(
            f"the embeddings of {local or verifier} are {list(emb.shape)}, the draft needs {list(shape)}; "
            "pass --verifier with the target the head was trained for"
        )
    target = ckpt.config.get("target") or {}
    recorded = target.get("fingerprint")
    if recorded is not None and not fingerprints_match(recorded, embedding_fingerprint(emb)):
        raise DraftsmithError(
            f"the embeddings of {local or verifier} differ from those of the target {ckpt.path} was trained for "
            f"({target.get('name_or_path')!r}); pass --verifier with that target"
        )
    return emb
