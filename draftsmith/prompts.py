"""Prompt sets: load, normalise to chat messages, apply chat templates.

Sources (`load_prompts(source)`):
  - `builtin:train`      ~1.3k training prompts shipped with draftsmith (GSM8K, GPTeacher, self-instruct, OASST)
  - `builtin:train-text` ~6.8k prompt + human response pairs (GSM8K answers, GPTeacher code/roleplay), disjoint
                         from builtin:train: fixed text for trainers to have the target score (responses kept)
  - `builtin:dev-eval`   Vicuna-80 + HumanEval (164); `builtin:vicuna`, `builtin:humaneval` separately.
                         Evaluation only: never train on these.
  - `shared:spec-bench-half[:CATEGORY]`  200 Spec-Bench prompts (translation, summarization, qa, math_reasoning,
                         rag; long ones 500-1,000 tokens) kept beside the checkout, not shipped (shared_data_dir).
                         Evaluation only, like dev-eval.
  - a local .json / .jsonl / .jsonl.gz / .parquet file
  - `hf:<dataset>[:<split>]` (or any non-path name) through `datasets.load_dataset`

Field shapes understood per record: a plain string; `messages`/`conversations` (role/content or from/value);
`turns` (first turn used); `instruction` (+ `input`); `question`; `prompt`; `text`. `category` is kept.
"""

from __future__ import annotations

import gzip
import hashlib
import itertools
import json
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from draftsmith.errors import DraftsmithError

BUILTIN = {
    "train": ["train/quickstart_prompts.jsonl"],
    "train-text": ["train/reference_responses.jsonl.gz"],
    "vicuna": ["dev-eval/vicuna_bench/question.jsonl"],
    "humaneval": ["dev-eval/humaneval/HumanEval.jsonl.gz"],
    "dev-eval": ["dev-eval/vicuna_bench/question.jsonl", "dev-eval/humaneval/HumanEval.jsonl.gz"],
}
EVAL_ONLY = {"vicuna", "humaneval", "dev-eval"}
SHARED = {"spec-bench-half": "dev-eval/spec_bench_half/question.jsonl"}
"""Evaluation sets read from shared_data_dir() (`shared:NAME`): every one is evaluation only."""


def shared_data_dir() -> Path:
    """$DRAFTSMITH_SHARED_DATA, else `shared/data` beside the checkout (a clean clone with shared/ next to it)."""
    import os

    env = os.environ.get("DRAFTSMITH_SHARED_DATA")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "data"


def _shared_file(name: str) -> Path:
    if name not in SHARED:
        raise DraftsmithError(f"unknown shared prompt set {name!r}; choose one of {sorted(SHARED)}")
    path = shared_data_dir() / SHARED[name]
    if not path.is_file():
        raise DraftsmithError(
            f"shared:{name} reads {path}, which is missing; put shared/ beside the checkout or set "
            "DRAFTSMITH_SHARED_DATA to its data folder"
        )
    return path


@dataclass
class Prompt:
    """One prompt as chat messages (user/system turns only; the model writes the answer)."""

    messages: list[dict[str, str]]
    category: str = "default"
    id: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def text(self) -> str:
        return "\n\n".join(m["content"] for m in self.messages)


def _data_path(rel: str) -> Path:
    return Path(str(resources.files("draftsmith") / "data" / rel))


def builtin_file(source: str) -> Path | None:
    """The shipped file behind a single-file `builtin:NAME` source (None for other sources)."""
    if not source.startswith("builtin:"):
        return None
    name = source.split(":", 1)[1]
    if name not in BUILTIN or len(BUILTIN[name]) != 1:
        raise DraftsmithError(f"unknown builtin data file {name!r}; choose one of {sorted(BUILTIN)}")
    return _data_path(BUILTIN[name][0])


def _is_jsonl(path: Path) -> bool:
    return path.name.endswith((".jsonl", ".jsonl.gz"))


def _read_records(path: Path) -> list[Any]:
    name = path.name
    try:
        if name.endswith(".parquet"):
            import pyarrow.parquet as pq

            try:
                return pq.read_table(path).to_pylist()
            except (ValueError, OSError) as e:  # pyarrow's ArrowInvalid (a ValueError): not a parquet file
                raise DraftsmithError(
                    f"prompt file {path} is not a readable parquet file ({type(e).__name__}: "
                    f"{str(e).split('. ')[0][:160]}); check the file or convert it to .jsonl"
                ) from None
        opener = gzip.open if name.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            if _is_jsonl(path):
                records = []
                for n, line in enumerate(f, start=1):
                    if not line.strip():
                        continue
                    try:
                        records.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise DraftsmithError(
                            f"prompt file {path} line {n} is not valid JSON ({e.msg} at column {e.colno}); "
                            "fix or remove that line"
                        ) from None
                return records
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError, OSError, EOFError) as e:
        raise DraftsmithError(
            f"prompt file {path} could not be read ({type(e).__name__}: {e}); check its format"
        ) from None
    if isinstance(data, dict):
        for key in ("data", "prompts", "rows", "examples"):
            if isinstance(data.get(key), list):
                return data[key]
        raise DraftsmithError(f"prompt file {path}: a JSON object needs a list under 'data' or 'prompts'")
    if not isinstance(data, list):  # a bare string would be read as one prompt per character
        raise DraftsmithError(
            f"prompt file {path} holds a JSON {_json_type(data)}, not a list of records; write a list "
            '(["first prompt", {"prompt": "second"}]) or an object with the list under "data" or "prompts"'
        )
    return data


def _json_type(value: Any) -> str:
    names = {str: "string", bool: "boolean", int: "number", float: "number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _role(msg: dict) -> str:
    role = msg.get("role", msg.get("from", "user"))
    return {"human": "user", "gpt": "assistant", "bot": "assistant", "model": "assistant"}.get(role, role)


def record_to_prompt(rec: Any, idx: int, default_category: str) -> Prompt | None:
    """Normalise one record; returns None for records with no usable prompt text."""
    if isinstance(rec, str):
        msgs = [{"role": "user", "content": rec}]
        return Prompt(msgs, default_category, str(idx)) if rec.strip() else None
    if not isinstance(rec, dict):
        return None
    cat = str(rec.get("category", default_category))
    rid = str(rec.get("id", rec.get("question_id", rec.get("task_id", idx))))
    conv = rec.get("messages", rec.get("conversations"))
    if isinstance(conv, list) and conv:
        msgs = []
        for m in conv:  # keep the turns up to the first assistant answer: that is what the target rewrites
            if not isinstance(m, dict):
                continue
            role = _role(m)
            if role == "assistant":
                break
            msgs.append({"role": role, "content": str(m.get("content", m.get("value", "")))})
        if any(m["role"] == "user" and m["content"].strip() for m in msgs):
            return Prompt(msgs, cat, rid)
        return None
    if isinstance(rec.get("turns"), list) and rec["turns"]:
        text = str(rec["turns"][0])
    elif "instruction" in rec:
        text = str(rec["instruction"])
        extra = str(rec.get("input") or "").strip()
        if extra:
            text = f"{text}\n\n{extra}"
    else:
        text = next((str(rec[k]) for k in ("question", "prompt", "text") if rec.get(k)), "")
    if not text.strip():
        return None
    return Prompt([{"role": "user", "content": text}], cat, rid)


PROMPT_FIELDS = "prompt, question, instruction, messages, conversations, turns or text"


def unusable_record(source: Any, i: int, rec: Any, missing: str) -> DraftsmithError:
    """The error for record `i` (0-based) of `source` that lacks `missing`, naming what the record holds."""
    holds = (
        f"its fields: {', '.join(map(str, rec))}"
        if isinstance(rec, dict)
        else f"it is a {type(rec).__name__}"
    )
    return DraftsmithError(
        f"{source}: record {i + 1} has no {missing}; {holds}; fix or remove that record{_line_of(source, i)}"
    )


def _line_of(source: Any, i: int) -> str:
    """The suffix " (line N of the file)" for record `i` (0-based) of a .jsonl file, where blank lines (skipped when reading)
    put the record on a later line than i + 1; "" for other sources."""
    path = Path(str(source)).expanduser()
    if not (_is_jsonl(path) and path.is_file()):
        return ""
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        lines = (n for n, line in enumerate(f, start=1) if line.strip())
        return f" (line {next(itertools.islice(lines, i, None), i + 1)} of the file)"


def _category_for(rel: str) -> str:
    return "humaneval" if "humaneval" in rel else ("vicuna" if "vicuna" in rel else "default")


def check_limit(limit: int | None, what: str = "--limit") -> None:
    """`limit` is None (everything) or a count >= 1 (0 used to mean "all" and -1 "all but the last")."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise DraftsmithError(
            f"{what} must be >= 1 (the number of prompts to use), got {limit!r}; omit it for all"
        )


def load_prompts(source: str, limit: int | None = None, category: str | None = None) -> list[Prompt]:
    """Load and normalise prompts from `source` (see module docstring). Errors on empty results."""
    check_limit(limit)
    recs: list[tuple[Any, str]] = []
    if source.startswith("builtin:"):
        name = source.split(":", 1)[1]
        if name not in BUILTIN:
            raise DraftsmithError(f"unknown builtin prompt set {name!r}; choose one of {sorted(BUILTIN)}")
        for rel in BUILTIN[name]:
            recs += [(r, _category_for(rel)) for r in _read_records(_data_path(rel))]
    elif source.startswith("shared:"):  # shared:NAME[:CATEGORY]
        name, _, only = source.split(":", 1)[1].partition(":")
        recs = [(r, name) for r in _read_records(_shared_file(name))]
        category = category or only or None
    else:
        p = Path(source).expanduser()
        if p.exists():
            if p.is_dir():
                raise DraftsmithError(f"prompt source {p} is a folder; pass a .json/.jsonl/.parquet file")
            recs = [(r, p.stem) for r in _read_records(p)]
        elif source.startswith("hf:") or ("/" in source and not source.startswith((".", "/", "~"))):
            recs = [(r, source) for r in _load_hub(source.removeprefix("hf:"))]
        else:
            raise DraftsmithError(
                f"prompt file {source} not found; pass a file, hf:<dataset>[:split] or builtin:train"
            )
    prompts = []
    for i, (rec, cat) in enumerate(recs):
        pr = record_to_prompt(rec, i, cat)
        if pr is None:  # never dropped without a word: the user's file is not what they think it is
            raise unusable_record(source, i, rec, f"prompt text (one of the fields {PROMPT_FIELDS})")
        if category is None or pr.category == category:
            prompts.append(pr)
    if not prompts:
        raise DraftsmithError(
            f"no usable prompts in {source}; records need a prompt/question/instruction/messages field"
        )
    return prompts[:limit] if limit else prompts


def _load_hub(spec: str) -> list[dict]:
    import datasets

    name, _, split = spec.partition(":")
    try:
        ds = datasets.load_dataset(name, split=split or "train")
    except Exception as e:  # noqa: BLE001
        raise DraftsmithError(
            f"could not load dataset {name!r} ({type(e).__name__}); check the name or pass a local file"
        ) from None
    return list(ds)


def _content_key(prompt: Prompt) -> str:
    # whitespace-insensitive, so a reformatted copy (other field name, re-indented, stripped) still matches
    return hashlib.sha256(" ".join(prompt.text.split()).encode()).hexdigest()


@lru_cache(maxsize=1)
def _eval_keys() -> frozenset[str]:
    sources = [f"builtin:{name}" for name in sorted(EVAL_ONLY)]
    sources += [f"shared:{name}" for name in sorted(SHARED) if (shared_data_dir() / SHARED[name]).is_file()]
    return frozenset(_content_key(p) for source in sources for p in load_prompts(source))


def eval_prompt_overlap(prompts: list[Prompt]) -> int:
    """How many of `prompts` are prompts of the shipped evaluation sets (by content: hash of the text)."""
    keys = _eval_keys()
    return sum(_content_key(p) in keys for p in prompts)


def is_eval_source(source: str) -> bool:
    """True for the shipped evaluation sets, which trainers refuse as training data: by name
    (`builtin:dev-eval` ...) and, for a local file, by content: a file holding any of their prompts (a copy, a
    reformatted copy, a mix) is an evaluation source too."""
    if source.startswith("builtin:"):
        return source.split(":", 1)[1] in EVAL_ONLY
    if source.startswith("shared:"):
        return True
    path = Path(source).expanduser()
    if not path.is_file():
        return False
    try:
        prompts = load_prompts(str(path))
    except DraftsmithError:  # unreadable or prompt-less: the loader that reads it for real says why
        return False
    return eval_prompt_overlap(prompts) > 0


def prompt_ids(tokenizer, prompt: Prompt, max_length: int | None = None) -> list[int]:
    """Token ids of the prompt with the chat template applied and the assistant turn opened.

    Raises a clear error when the prompt does not fit `max_length` (the model's context minus the room
    the caller needs for new tokens)."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
    else:
        ids = tokenizer(prompt.text)["input_ids"]
    ids = list(ids)
    # the new tokens alone fill the context: no prompt is at fault, however short
    if max_length is not None and max_length < 1:
        raise DraftsmithError(
            f"the new tokens asked for fill the model's context: no room is left for prompt {prompt.id!r} (not "
            f"even its first token; {1 - max_length} positions short); lower max_new_tokens (and k, the draft "
            "length, where drafting)"
        )
    if max_length is not None and len(ids) > max_length:
        raise DraftsmithError(
            f"prompt {prompt.id!r} is {len(ids)} tokens but only {max_length} fit the context; "
            "shorten it, lower max_new_tokens, or filter long prompts"
        )
    return ids
