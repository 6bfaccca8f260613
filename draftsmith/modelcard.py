"""Model cards for published drafters: front matter + a model-index holding the *measured* results of
`draftsmith eval` (eval.json), the recipe, and how to load the drafter with draftsmith,
transformers, vLLM or SGLang.

What the card says of the drafter (its opening line, its method tag, the library that loads it, how to serve it)
comes from its kind's record (draftsmith.kinds: Card, the export formats): the caller passes the drafter table
(draftsmith.app.drafters.DRAFTERS), so a kind added there has its card without an edit here.

Every number in the model-index is copied unrounded from eval.json, so the card can be checked against the run.
τ is the mean accepted length per target step *including the bonus token* (EAGLE's convention), and the speedup
is wall-clock against plain decoding of the same target measured in the same run.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from draftsmith.checkpoint import EXPORT_MANIFEST, read_json, target_hub_id
from draftsmith.errors import DraftsmithError
from draftsmith.evalsettings import CONDITION_KEYS, METRIC_KEYS
from draftsmith.kinds import Card, DrafterKind, ExportFormat, spec_for

log = logging.getLogger(__name__)

REQUIRED_EVAL = ("tau", "alpha_per_position", "speedup", "tokens_per_s", "conditions")
# eval.json conditions a card's table leaves out: a path on the measuring machine, a convention the card states
CARD_OMITS = ("drafter", "tau_convention")


def describe_folder(path: str | os.PathLike) -> dict:
    """What a folder to publish is: kind (draft/medusa/eagle/eagle3), export format (or None), target dict."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise DraftsmithError(f"checkpoint {p} not found; pass a draftsmith checkpoint or export folder")
    fmt = None
    if (p / EXPORT_MANIFEST).is_file():
        man = read_json(p / EXPORT_MANIFEST, "re-run draftsmith export")
        fmt, kind, target = man.get("format"), man.get("source_kind"), dict(man.get("target") or {})
        return {"kind": kind, "format": fmt, "target": target, "path": p}
    from draftsmith.checkpoint import read_checkpoint

    ckpt = read_checkpoint(p)  # validates tensor names/shapes of heads before anything is published
    return {"kind": ckpt.kind, "format": None, "target": ckpt.target, "path": p, "config": ckpt.config}


def load_eval(path: str | os.PathLike) -> dict:
    """Read and check an eval.json written by `draftsmith eval --out DIR`."""
    data = read_json(Path(path), "pass the eval.json written by draftsmith eval --out DIR")
    for key in REQUIRED_EVAL:
        if key not in data:
            raise DraftsmithError(
                f"{path} lacks {key!r}; pass the eval.json written by draftsmith eval --out DIR"
            )
    alphas = data["alpha_per_position"]
    if (
        not isinstance(alphas, list)
        or not all(a is None or _finite(a) for a in alphas)
        or not isinstance(data["tokens_per_s"], dict)
    ):
        raise DraftsmithError(
            f"{path}: alpha_per_position must be a list of numbers (null where a depth was never reached) "
            "and tokens_per_s an object; re-run draftsmith eval"
        )
    # the card's results are these two numbers: null or NaN is no result (publish with --no-results instead)
    categories = data.get("per_category") or {}
    checks = [(key, data[key], False) for key in ("tau", "speedup")] + [
        (f"per_category.{c}.{key}", v.get(key), True)
        for c, v in (categories.items() if isinstance(categories, dict) else [])
        if isinstance(v, dict)
        for key in ("tau", "speedup")
    ]
    for key, value, may_be_null in checks:
        if not (_finite(value) or (may_be_null and value is None)):
            raise DraftsmithError(
                f"{path}: {key} must be a finite number, got {value!r}; re-run draftsmith eval "
                "(or publish with --no-results)"
            )
    return data


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def find_eval(ckpt_dir: Path) -> Path | None:
    """eval.json beside or under the checkpoint (or in its run folder), if any."""
    for base in (ckpt_dir, ckpt_dir.parent, ckpt_dir.parent.parent):
        for cand in (base / "eval.json", base / "eval" / "eval.json"):
            if cand.is_file():
                return cand
    return None


def find_run_yaml(ckpt_dir: Path) -> Path | None:
    """run.yaml of the training run: in the checkpoint, its run folder (final/), or above checkpoints/step-N/."""
    for base in (ckpt_dir, ckpt_dir.parent, ckpt_dir.parent.parent):
        if (base / "run.yaml").is_file():
            return base / "run.yaml"
    return None


def _front_matter(text: str) -> dict:
    if not text.startswith("---"):
        return {}
    try:
        data = yaml.safe_load(text.split("---", 2)[1])
    except (yaml.YAMLError, IndexError):
        return {}
    return data if isinstance(data, dict) else {}


def target_license(target: dict) -> tuple[str | None, str]:
    """(license, where it came from) for the target: its folder's README front matter, GGUF metadata, or the Hub."""
    from draftsmith import models

    for key in ("name_or_path", "name"):
        spec = target.get(key)
        if not spec:
            continue
        try:
            ref = models.resolve(spec)
        except DraftsmithError:
            continue
        if ref.kind == "dir" and (Path(ref.path) / "README.md").is_file():
            lic = _front_matter((Path(ref.path) / "README.md").read_text(errors="replace")).get("license")
            if lic:
                return str(lic), f"{ref.path}/README.md"
        gguf_path = Path(ref.path) / ref.gguf_file if ref.kind == "gguf" else None
        if (
            ref.kind == "dir" and (Path(ref.path) / "DRAFTSMITH_SOURCE.txt").is_file()
        ):  # dequantized GGUF cache
            gguf_path = Path((Path(ref.path) / "DRAFTSMITH_SOURCE.txt").read_text().strip())
        if gguf_path is not None and gguf_path.is_file():
            try:
                import gguf

                field = gguf.GGUFReader(str(gguf_path)).fields.get("general.license")
                if field is not None:
                    return str(field.contents()), f"GGUF metadata of {gguf_path.name}"
            except Exception as e:  # noqa: BLE001 - metadata is optional; the card says the license is unknown
                log.debug("no GGUF license: %s", e)
    hub_id = target.get("hub_id")
    if hub_id and os.environ.get("HF_HUB_OFFLINE", "0") in ("0", "", "false"):
        try:
            from huggingface_hub import model_info

            lic = (model_info(hub_id).card_data or {}).get("license")
            if lic:
                return str(lic), f"https://huggingface.co/{hub_id}"
        except Exception as e:  # noqa: BLE001
            log.debug("no Hub license for %s: %s", hub_id, e)
    return None, ""


def _eval_results(ev: dict, prompts: str) -> list:
    from huggingface_hub import EvalResult

    cond = ev["conditions"]
    args = {k: cond[k] for k in METRIC_KEYS if k in cond and cond[k] is not None}
    config = f"k={cond.get('k')} tree={cond.get('tree')} temperature={cond.get('temperature')}"
    common = dict(
        task_type="text-generation",
        task_name="Speculative decoding",
        dataset_type=prompts,
        dataset_name=prompts,
        dataset_args={"n_prompts": cond.get("n_prompts"), "max_new_tokens": cond.get("max_new_tokens")},
        metric_config=config,
        metric_args=args,
    )
    rows = [
        (
            "mean_accepted_length",
            ev["tau"],
            "tau: mean accepted tokens per target step (bonus token included)",
        ),
        ("speedup", ev["speedup"], "wall-clock speedup vs plain decoding (same run)"),
        ("tokens_per_second", ev["tokens_per_s"].get("speculative"), "tokens/s, speculative"),
        ("tokens_per_second", ev["tokens_per_s"].get("plain"), "tokens/s, plain decoding"),
    ]
    rows += [
        ("acceptance_rate", a, f"alpha at draft position {i + 1}")
        for i, a in enumerate(ev["alpha_per_position"])
    ]
    return [
        EvalResult(metric_type=t, metric_value=v, metric_name=n, **common)
        for t, v, n in rows
        if v is not None
    ]


def kind_card(kinds: Mapping[str, DrafterKind], kind: str) -> tuple[DrafterKind, Card]:
    """The record and card of a folder's kind, or one DraftsmithError line (a kind the table does not know, or a
    record without a card, has nothing true to say on a card)."""
    rec = kinds.get(kind)
    if rec is None or rec.card is None:
        known = ", ".join(sorted(n for n, r in kinds.items() if r.card is not None))
        raise DraftsmithError(
            f"no model card for drafter kind {kind!r} (known: {known}); publish a draftsmith checkpoint or export folder"
        )
    return rec, rec.card


def _num(value, unit: str = "") -> str:
    # eval.json writes null where nothing was measured (a draft depth never reached, no plain tokens)
    return "n/a" if value is None else f"{value:.3f}{unit}"


def _usage(rec: DrafterKind, spec: str, fmt: str | None, repo_id: str, target_id: str, k: int) -> str:
    """How to serve it: the export format's engine command, or for a native folder its kind's way (a causal LM's
    transformers / vLLM lines, or the export formats of its record)."""
    if fmt == "sglang-eagle3":
        return (
            f"```bash\npython -m sglang.launch_server --model {target_id} --speculative-algorithm EAGLE3 \\\n"
            f"    --speculative-draft-model-path {repo_id} --speculative-num-steps {k} \\\n"
            "    --speculative-eagle-topk 1 --speculative-num-draft-tokens "
            f"{k + 1}\n```\n"
            "For vLLM, export the head with `--format speculators` instead: the aux-layer ids in this folder "
            "follow SGLang's convention.\n"
        )
    if fmt == "speculators":
        return (
            f"```bash\nvllm serve {repo_id}   # the verifier {target_id} is read from speculators_config\n"
            f"# or: vllm serve {target_id} --speculative-config "
            f'\'{{"method": "eagle3", "model": "{repo_id}", "num_speculative_tokens": {k}}}\'\n```\n'
        )
    if fmt == "vllm-medusa":
        return (
            f"```bash\nvllm serve {target_id} --speculative-config "
            f'\'{{"method": "medusa", "model": "{repo_id}", "num_speculative_tokens": {k}}}\'\n```\n'
            "Needs vLLM 0.9.0-0.32.x (0.33.0 removed Medusa); vLLM proposes top-1 chains only.\n"
        )
    if rec.card.causal_lm:
        return (
            "```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n"
            f'target = AutoModelForCausalLM.from_pretrained("{target_id}")\n'
            f'draft = AutoModelForCausalLM.from_pretrained("{repo_id}")\n'
            f'tok = AutoTokenizer.from_pretrained("{target_id}")\n'
            'inputs = tok.apply_chat_template([{"role": "user", "content": "Hi!"}], add_generation_prompt=True,'
            ' return_tensors="pt", return_dict=True)\n'
            "out = target.generate(**inputs, assistant_model=draft, max_new_tokens=128)\n```\n"
            f"```bash\nvllm serve {target_id} --speculative-config "
            f'\'{{"method": "draft_model", "model": "{repo_id}", "num_speculative_tokens": {k}}}\'\n```\n'
        )
    name = repo_id.split("/")[-1]
    formats = rec.format_names()
    if not formats:
        return (f"This is draftsmith's native {rec.name} format: draftsmith decodes it "
                f"(`--drafter {spec}:./{name}`); no serving engine reads this format yet.\n")  # fmt: skip
    others = f"   # or {', '.join(formats[1:])}" if len(formats) > 1 else ""
    return (
        f"This is draftsmith's native {rec.name} format. Serving engines need an export:\n\n"
        f"```bash\ndraftsmith export ./{name} --format {formats[0]} --out exported{others}\n```\n"
    )


def build_card(
    info: dict,
    repo_id: str,
    eval_data: dict | None,
    run_yaml: str | None = None,
    eval_png: str | None = None,
    *,
    kinds: Mapping[str, DrafterKind],
) -> str:
    """README.md text: YAML front matter (incl. model-index from eval.json) + body. `kinds`: the drafter table
    (draftsmith.app.drafters.DRAFTERS) whose record of the folder's kind says what it is (module docstring)."""
    from huggingface_hub import ModelCard

    kind, fmt, target = info["kind"], info.get("format"), dict(info.get("target") or {})
    rec, card = kind_card(kinds, kind)
    target["hub_id"] = target_hub_id(target)
    target_id = target["hub_id"] or target.get("name_or_path") or target.get("name") or "TARGET"
    name = repo_id.split("/")[-1]
    lic, lic_src = target_license(target)
    cond = (eval_data or {}).get("conditions", {})
    body = [
        f"# {name}\n",
        f"{card.text[0].upper()}{card.text[1:]}. A drafter for speculative decoding with "
        f"[{target_id}](https://huggingface.co/{target_id}), trained with draftsmith; the method: {card.paper}."
        + (f" Exported as `{fmt}`." if fmt else "")
        + "\n",
        *_results_section(eval_data, eval_png),
        *_usage_section(
            info, rec, spec_for(kinds, kind) or kind, repo_id, target_id, int(cond.get("k") or 4)
        ),
    ]
    if run_yaml:
        body += [
            "## Training recipe\n",
            "The resolved `run.yaml` of the training run:\n",
            f"```yaml\n{run_yaml.rstrip()}\n```\n",
        ]
    body += [
        "## License\n",
        f"`{lic}`, inherited from the target ({lic_src})."
        if lic
        else "Not stated: the target's license could not be determined offline; it governs use of this drafter.",
    ]
    data = _card_data(card, rec.format(fmt) if fmt else None, fmt, target, lic, name, eval_data)
    content = f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body) + "\n"
    ModelCard(
        content, ignore_metadata_errors=False
    )  # parses the front matter back: fails loudly if malformed
    return content


def _card_data(
    card: Card,
    export: ExportFormat | None,
    fmt: str | None,
    target: dict,
    lic: str | None,
    name: str,
    eval_data: dict | None,
):
    """The front matter: library (the export format's, or transformers for a native causal LM), license, tags,
    and the model-index from eval.json."""
    from huggingface_hub import ModelCardData

    prompts = str((eval_data or {}).get("conditions", {}).get("prompts") or "unknown")
    if fmt is not None:
        library = export.library if export is not None else "draftsmith"
    else:
        library = "transformers" if card.causal_lm else "draftsmith"
    return ModelCardData(
        base_model=target.get("hub_id") or None,
        library_name=library,
        license=lic,
        tags=["speculative-decoding", "draftsmith", card.tag] + ([fmt] if fmt else []),
        datasets=None,
        model_name=name if eval_data else None,
        eval_results=_eval_results(eval_data, prompts) if eval_data else None,
        pipeline_tag="text-generation" if card.causal_lm else None,
    )


def _results_section(eval_data: dict | None, eval_png: str | None) -> list[str]:
    """The measured numbers, their conditions (every eval.json condition but CARD_OMITS) and per category."""
    if not eval_data:
        return ["## Measured results\n", "None published with this checkpoint (pushed with --no-results).\n"]
    cond = eval_data["conditions"]
    alphas = ", ".join(_num(a) for a in eval_data["alpha_per_position"])
    tps = eval_data["tokens_per_s"]
    lines = [
        "## Measured results\n",
        "Measured by `draftsmith eval`; τ counts the bonus token, speedup is wall-clock against plain "
        "decoding of the same target in the same run.\n",
        "| metric | value |\n|---|---|",
        f"| τ (mean accepted length, bonus incl.) | {_num(eval_data['tau'])} |",
        f"| α per draft position (n/a: depth never reached) | {alphas} |",
        f"| speedup | {_num(eval_data['speedup'], '×')} |",
        f"| tokens/s speculative / plain | {tps.get('speculative')} / {tps.get('plain')} |",
        f"| lossless (greedy output identical, numerical near-ties aside) | {eval_data.get('lossless')} |\n",
        "Conditions:\n",
        "| condition | value |\n|---|---|",
    ]
    lines += [f"| {key} | {cond[key]} |" for key in CONDITION_KEYS if key in cond and key not in CARD_OMITS]
    per_cat = eval_data.get("per_category") or {}
    if per_cat:
        lines += ["\nPer category:\n", "| category | n | τ | speedup |\n|---|---|---|---|"]
        lines += [
            f"| {c} | {v.get('n_prompts')} | {_num(v.get('tau'))} | {_num(v.get('speedup'), '×')} |"
            for c, v in per_cat.items()
        ]
    if eval_png:
        lines.append(f"\n![acceptance and speedup]({eval_png})")
    return [*lines, ""]


def _usage_section(
    info: dict, rec: DrafterKind, spec: str, repo_id: str, target_id: str, k: int
) -> list[str]:
    """How to load it (draftsmith, transformers, vLLM, SGLang) and how to measure it again. `spec`: the drafter
    spec kind that decodes the folder."""
    fmt, name = info.get("format"), repo_id.split("/")[-1]
    lines = ["## How to use\n", _usage(rec, spec, fmt, repo_id, target_id, k)]
    if (
        rec.card.causal_lm
        and fmt is None
        and info.get("path")
        and (Path(info["path"]) / "draft_vocab.safetensors").is_file()
    ):
        lines.append(
            "This draft was trained with a reduced output vocabulary (`draft_vocab.safetensors`): draftsmith "
            "restricts its logits to those rows, other loaders do not. For transformers or vLLM publish "
            "`draftsmith export --format hf` instead, which keeps excluded tokens from ever winning argmax.\n"
        )
    if fmt in (None, "hf"):  # draftsmith eval reads native checkpoints and hf drafts, not engine exports
        lines.append(
            f"Measure it yourself:\n\n```bash\ndraftsmith eval --target {target_id} --drafter "
            f"{spec}:./{name} --prompts builtin:dev-eval --out eval\n```\n"
        )
    return lines


def parse_card(text: str) -> dict:
    """Front matter of a card as a dict (for tests and checks)."""
    return _front_matter(text)
