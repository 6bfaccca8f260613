"""`draftsmith push CKPT REPO_ID`: publish a drafter with a model card carrying its measured results.

    draftsmith push runs/eagle3/final me/smollm2-eagle3 --eval runs/eagle3/eval/eval.json
    draftsmith push exports/eagle3-vllm me/smollm2-eagle3-speculators --private
    draftsmith push runs/distill/final me/smollm2-draft --dry-run staged/   # writes exactly what would upload

Everything is checked before anything is staged (repo id, checkpoint tensors, eval.json), the folder is staged in
a temporary directory (checkpoint files + README.md + eval/ + run.yaml) and then uploaded with one
`HfApi.upload_folder` commit. The token comes from `--token-env NAME`, HF_TOKEN or the huggingface_hub login
cache; it is only handed to HfApi, never written, logged or put in the card - and the staged files are scanned
for it before upload.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

from huggingface_hub import HfApi

from draftsmith.checkpoint import EXPORT_MANIFEST, read_checkpoint
from draftsmith.errors import DraftsmithError
from draftsmith.fileio import check_output_dir
from draftsmith.kinds import DrafterKind
from draftsmith.modelcard import build_card, describe_folder, find_eval, find_run_yaml, kind_card, load_eval

log = logging.getLogger(__name__)

# Safetensors, configs, tokenizers, docs. Pickles (*.bin, *.pt) and remote code (*.py) are never published.
ALLOWED_SUFFIXES = (
    ".json",
    ".safetensors",
    ".txt",
    ".md",
    ".yaml",
    ".yml",
    ".model",
    ".tiktoken",
    ".jinja",
    ".png",
)


def check_repo_id(repo_id: str) -> None:
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise DraftsmithError(
            f"invalid repo id {repo_id!r} ({str(e).splitlines()[0]}); use NAMESPACE/NAME"
        ) from None
    if repo_id.count("/") != 1:
        raise DraftsmithError(f"invalid repo id {repo_id!r}; use NAMESPACE/NAME, e.g. my-user/smollm2-eagle3")


def stage(
    checkpoint_dir: str | os.PathLike,
    repo_id: str,
    eval_json: str | os.PathLike | None,
    out: Path,
    require_results: bool = True,
    *,
    kinds: Mapping[str, DrafterKind],
) -> list[str]:
    """Write into `out` exactly what would be uploaded; return the relative paths written. `kinds`: the drafter
    table (draftsmith.app.drafters.DRAFTERS): a native folder is checked against it first (its tensors match its
    kind's layout), and the card says what the kind is from its record."""
    if not (Path(checkpoint_dir).expanduser() / EXPORT_MANIFEST).is_file():
        read_checkpoint(checkpoint_dir, kinds)
    info = describe_folder(checkpoint_dir)
    kind_card(
        kinds, info["kind"]
    )  # a kind with nothing to say on a card is refused before anything is staged
    src: Path = info["path"]
    if str(info.get("format") or "").startswith("speculators"):
        _check_portable_verifier(src, repo_id)
    eval_path = Path(eval_json).expanduser() if eval_json else (find_eval(src) if require_results else None)
    if eval_json and not eval_path.is_file():
        raise DraftsmithError(
            f"eval JSON {eval_path} not found; pass the eval.json written by draftsmith eval --out DIR"
        )
    if eval_path is None and require_results:
        raise DraftsmithError(
            f"no eval.json given or found near {src}; run draftsmith eval --out DIR and pass --eval DIR/eval.json "
            "(or --no-results to publish without measured results)"
        )
    eval_data = load_eval(eval_path) if eval_path else None
    run_yaml = find_run_yaml(src)
    written = []
    for f in sorted(src.iterdir()):
        if (
            f.is_file()
            and not f.name.startswith(".")
            and f.suffix in ALLOWED_SUFFIXES
            and f.name != "README.md"
        ):
            shutil.copy2(f, out / f.name)
            written.append(f.name)
        elif f.name != "README.md":
            log.info("not publishing %s (only safetensors, configs, tokenizer and docs are uploaded)", f.name)
    eval_png = None
    if eval_path:
        (out / "eval").mkdir()
        for name in ("eval.json", "report.md", "eval.png"):
            p = eval_path if name == "eval.json" else eval_path.parent / name
            if p.is_file():
                shutil.copy2(p, out / "eval" / name)
                written.append(f"eval/{name}")
        eval_png = "eval/eval.png" if (out / "eval" / "eval.png").is_file() else None
    if run_yaml and "run.yaml" not in written:
        shutil.copy2(run_yaml, out / "run.yaml")
        written.append("run.yaml")
    card = build_card(
        info, repo_id, eval_data, run_yaml.read_text() if run_yaml else None, eval_png, kinds=kinds
    )
    (out / "README.md").write_text(card)
    written.append("README.md")
    return written


def _check_portable_verifier(src: Path, repo_id: str) -> None:
    """`vllm serve REPO_ID` loads the target named in the export; a folder of the exporting machine fails anywhere
    else, so a speculators export must name its target by Hub id before it is published."""
    from draftsmith.checkpoint import read_json

    cfg = read_json(src / "config.json", "re-run draftsmith export")
    name = ((cfg.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    try:
        check_repo_id(str(name))
    except DraftsmithError:
        raise DraftsmithError(
            f"{src} names its target as {name!r}, which only exists on this machine: vllm serve {repo_id} would "
            "fail anywhere else; re-export with --verifier HUB_ID"
        ) from None


def _scan_for_token(folder: Path, token: str | None) -> None:
    if not token:
        return
    needle = token.encode()
    for f in folder.rglob("*"):
        if f.is_file() and needle in f.read_bytes():
            raise DraftsmithError(
                f"{f.name} contains your Hub token; remove it from the checkpoint files before pushing"
            )


def _push_error(repo_id: str, e: Exception) -> DraftsmithError:
    status = getattr(getattr(e, "response", None), "status_code", None)
    detail = str(e).splitlines()[0][:160] if str(e) else ""
    fix = {
        401: "log in (hf auth login) or pass --token-env with a valid token",
        403: "use a token with write access to this namespace",
    }.get(status, "check your network connection and token, or stage it first with --dry-run DIR")
    return DraftsmithError(f"could not push to {repo_id} ({type(e).__name__}: {detail}); {fix}")


def push_to_hub(
    checkpoint_dir: str | os.PathLike,
    repo_id: str,
    private: bool = False,
    eval_json: str | os.PathLike | None = None,
    dry_run_dir: str | os.PathLike | None = None,
    token: str | None = None,
    require_results: bool = True,
    commit_message: str | None = None,
    *,
    kinds: Mapping[str, DrafterKind],
) -> str:
    """Publish a checkpoint (or export) folder with a generated model card; returns the commit URL, or the
    dry-run folder. `token=None` lets huggingface_hub find it (HF_TOKEN, login cache). `kinds`: the drafter table
    (draftsmith.app.drafters.DRAFTERS) a native folder's tensors are checked against before anything is staged and
    whose record of the folder's kind the card describes."""
    check_repo_id(repo_id)
    if dry_run_dir is not None:
        dest = Path(dry_run_dir).expanduser()
        check_output_dir(dest, flag="--dry-run DIR")
        if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
            raise DraftsmithError(f"dry-run folder {dest} already exists and is not empty; choose another")
    tmp = Path(tempfile.mkdtemp(prefix="draftsmith-push-"))
    try:
        staged = tmp / "repo"
        staged.mkdir()
        files = stage(checkpoint_dir, repo_id, eval_json, staged, require_results, kinds=kinds)
        from huggingface_hub import get_token

        _scan_for_token(staged, token or get_token())
        if dry_run_dir is not None:
            dest.parent.mkdir(parents=True, exist_ok=True)
            if dest.exists():
                dest.rmdir()
            shutil.move(str(staged), str(dest))
            log.info("dry run: %d files staged in %s (nothing uploaded)", len(files), dest)
            return str(dest)
        api = HfApi(token=token)
        try:
            api.create_repo(repo_id=repo_id, repo_type="model", private=private, exist_ok=True)
            info = api.upload_folder(
                repo_id=repo_id,
                repo_type="model",
                folder_path=str(staged),
                commit_message=commit_message or "Upload drafter with draftsmith",
            )
        except Exception as e:  # noqa: BLE001 - the HTTP client's errors (no network, 401, 5xx) share no base
            raise _push_error(repo_id, e) from None
        url = getattr(info, "commit_url", None) or f"https://huggingface.co/{repo_id}"
        log.info("pushed %d files to %s", len(files), url)
        return str(url)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
