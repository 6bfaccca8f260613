"""Training examples, one pipeline for every trainer: a prompt and a response as token ids, read from
`draftsmith generate` folders (the target's own answers) or prompt+response files (`builtin:train-text`, jsonl),
a deterministic held-out split, and right-padded batches with a loss mask on the response.

Evaluation prompt sets are refused wherever they appear in a list of training sources.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, TypeVar

import torch

from draftsmith.errors import DraftsmithError

E = TypeVar("E")


@dataclass
class DataSources:
    """The `data:` section every trainer shares (each adds its own fields)."""

    source: str | list[str] | None = None
    """Training sources, one or a list: `draftsmith generate` folders (the target's own answers, token ids),
    prompt+response files (.jsonl/.json/.parquet) or `builtin:train-text`. Never an eval set. Held-out examples
    come from the first source."""
    limit: int | list[int | None] | None = None
    """Use only the first N examples of each source (one number, or a list with one limit per source, null = all)."""
    max_length: int = 1024
    """Prompt + response tokens per sequence (longer ones are cut); at most the target's context."""
    eval_size: int = 64
    """Examples held out from the first source for the acceptance eval (never trained on)."""
    split_seed: int | None = None
    """Seed of the held-out draw; null = train.seed. Set it to compare runs of other seeds on one held-out split."""

    RENAMED: ClassVar[dict[str, str]] = {
        "generated": "source",
        "eval_fraction": "eval_size",
        "max_eval_examples": "eval_size",
    }

    def __post_init__(self) -> None:
        if self.max_length < 2:
            raise DraftsmithError(f"data.max_length must be >= 2 (prompt + response), got {self.max_length}")
        if self.eval_size < 0:
            raise DraftsmithError(f"data.eval_size must be >= 0, got {self.eval_size}")
        if self.split_seed is not None and self.split_seed < 0:
            raise DraftsmithError(f"data.split_seed must be >= 0 (null = train.seed), got {self.split_seed}")
        for lim in self.limit if isinstance(self.limit, list) else [self.limit]:
            if lim is not None and lim < 1:
                raise DraftsmithError(f"data.limit must be >= 1 (null = all), got {lim}")

    def held_out_seed(self, train_seed: int) -> int:
        return train_seed if self.split_seed is None else self.split_seed

    @property
    def sources(self) -> list[str]:
        if not self.source:
            raise DraftsmithError(
                "data.source is required: a draftsmith generate folder, a .jsonl with responses or builtin:train-text"
            )
        return [self.source] if isinstance(self.source, str) else list(self.source)


@dataclass
class Example:
    prompt_ids: list[int]
    response_ids: list[int]
    id: str = ""
    category: str = "default"
    source: str = ""
    """The training source it was read from (held-out examples come from the first source only)."""
    target_topk: tuple[torch.Tensor, torch.Tensor] | None = None
    """Cached target scores of the response tokens: (values [R, k] fp16, ids [R, k] int32); see cache_target_topk."""


def examples_from_generated(path: str | Path, for_eval: bool = False) -> list[Example]:
    """Examples from a `draftsmith generate` folder (token ids kept as generated). Folders of reference answers
    to evaluation prompts (generated with for_eval) are refused unless `for_eval`: never train on them."""
    from draftsmith.prompts import is_eval_source
    from draftsmith.selfdistill import MANIFEST, load_generated

    man = Path(path) / MANIFEST
    settings = json.loads(man.read_text()).get("settings", {}) if man.is_file() else {}
    if not for_eval and (settings.get("for_eval") or is_eval_source(str(settings.get("prompts") or ""))):
        raise DraftsmithError(
            f"{path} holds answers to evaluation prompts; train on data generated from other prompts"
        )

    return [
        Example(
            list(r["prompt_ids"]), list(r["response_ids"]), str(r["id"]), str(r.get("category", "default"))
        )
        for r in load_generated(path)
    ]


def examples_from_file(path: str | Path, tokenizer) -> list[Example]:
    """Examples from a jsonl/json file of records holding a prompt and its response: `messages` with an assistant
    turn, or `prompt`/`instruction`/`question` + `response`/`output`/`answer`/`completion`. The prompt gets the chat
    template (assistant turn opened); the response text is tokenised and closed with eos."""
    from draftsmith.prompts import (
        PROMPT_FIELDS,
        _read_records,
        builtin_file,
        prompt_ids,
        record_to_prompt,
        unusable_record,
    )

    p = builtin_file(str(path)) or Path(path)
    if p.is_dir():
        return examples_from_generated(p)
    if not p.is_file():
        raise DraftsmithError(
            f"data file {p} not found; pass a draftsmith generate folder or a .jsonl with responses"
        )
    out = []
    for i, rec in enumerate(_read_records(p)):
        if not isinstance(rec, dict):
            raise unusable_record(p, i, rec, "prompt and response fields")
        response = None
        conv = rec.get("messages", rec.get("conversations"))
        if isinstance(conv, list):
            answers = [
                m
                for m in conv
                if isinstance(m, dict) and m.get("role", m.get("from")) in ("assistant", "gpt")
            ]
            if answers:
                response = str(answers[0].get("content", answers[0].get("value", "")))
        if response is None:
            response = next(
                (str(rec[k]) for k in ("response", "output", "answer", "completion") if rec.get(k)), None
            )
        prompt = record_to_prompt(rec, i, p.stem)
        if prompt is None:
            raise unusable_record(p, i, rec, f"prompt text (one of the fields {PROMPT_FIELDS})")
        if not response:
            raise unusable_record(
                p,
                i,
                rec,
                "response (an assistant turn or one of the fields response, output, answer or completion)",
            )
        ids = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        out.append(Example(prompt_ids(tokenizer, prompt), ids, prompt.id, prompt.category))
    if not out:
        raise DraftsmithError(
            f"{p} holds no record with both a prompt and a response; the fixed policy needs responses"
        )
    return out


def examples_from_sources(
    sources: str | list[str], tokenizer=None, limits: int | list[int | None] | None = None
) -> list[list[Example]]:
    """One list of Examples per training source (a `draftsmith generate` folder, a prompt+response file or
    `builtin:train-text`), each cut to its limit (one int for all, or one per source; None/0 = all). Evaluation
    sets are refused wherever they stand in the list; `tokenizer` is needed only to read files (folders hold ids)."""
    from draftsmith.prompts import is_eval_source

    sources = [sources] if isinstance(sources, str) else list(sources)
    if not sources:
        raise DraftsmithError(
            "no training data source given: a draftsmith generate folder or a .jsonl with responses"
        )
    limits = limits if isinstance(limits, list) else [limits] * len(sources)
    if len(limits) != len(sources):
        raise DraftsmithError(
            f"data.limit has {len(limits)} entries for {len(sources)} sources; give one per source"
        )
    for src in sources:
        if is_eval_source(src):
            raise DraftsmithError(
                f"{src} is or holds an evaluation set (its prompts match builtin:dev-eval's); train on other "
                "data (a draftsmith generate folder of builtin:train prompts, builtin:train-text), never on what "
                "you evaluate"
            )
    out = []
    for src, lim in zip(sources, limits):
        if tokenizer is None and not Path(src).is_dir():
            raise DraftsmithError(f"{src} is a text file: reading it needs the target's tokenizer")
        examples = examples_from_file(src, tokenizer)[: lim or None]
        for e in examples:
            e.source = src
        out.append(examples)
    return out


def split_heldout(
    examples: Sequence[E], n_eval: int, seed: int = 0, source: Callable[[E], str] = lambda e: e.source
) -> tuple[list[E], list[E]]:
    """Deterministic (train, held-out) split for every trainer: `n_eval` examples drawn by a seeded shuffle from
    the FIRST source only (the main data, e.g. the target's own answers, closest to what the decoder drafts); the
    other sources are all trained on, and held-out examples never appear in training. Order is kept."""
    if n_eval < 0:
        raise DraftsmithError(f"data.eval_size must be >= 0, got {n_eval}")
    first = source(examples[0]) if examples else None
    pool = [i for i, e in enumerate(examples) if source(e) == first]
    if n_eval >= len(examples) or n_eval > len(pool):
        raise DraftsmithError(
            f"cannot hold out data.eval_size={n_eval} examples: the first source has {len(pool)} of "
            f"{len(examples)}, and some must remain to train on; lower data.eval_size or add data"
        )
    order = list(range(len(pool)))
    random.Random(seed).shuffle(order)
    held = {pool[j] for j in order[:n_eval]}
    return [e for i, e in enumerate(examples) if i not in held], [examples[i] for i in sorted(held)]


def collate(seqs: list[tuple[list[int], list[int]]], pad_id: int, max_length: int) -> dict[str, torch.Tensor]:
    """(prompt_ids, response_ids) pairs -> right-padded input_ids/attention_mask/loss_mask [B, T], T <= max_length.

    Responses are cut at max_length; loss_mask marks response tokens (the tokens the draft is scored on)."""
    rows = []
    for prompt, response in seqs:
        ids = (list(prompt) + list(response))[:max_length]
        rows.append((ids, len(prompt)))
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for r, (ids, n_prompt) in enumerate(rows):
        input_ids[r, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention_mask[r, : len(ids)] = 1
        loss_mask[r, n_prompt : len(ids)] = True
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}


def save_examples(path: str | Path, examples: list[Example]) -> None:
    """Write examples as jsonl (used to record the held-out split beside a run)."""
    with Path(path).open("w") as f:
        for e in examples:
            f.write(
                json.dumps(
                    {
                        "id": e.id,
                        "category": e.category,
                        "prompt_ids": e.prompt_ids,
                        "response_ids": e.response_ids,
                    }
                )
                + "\n"
            )
