"""Head training data: target-generated conversations (`draftsmith generate`) as token ids, padded batches.

An example is prompt_ids + response_ids with loss_mask = 1 on the response (heads learn to draft answers).
Every example keeps a stable integer `index` so hidden-state caches can be keyed by it.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from draftsmith.errors import DraftsmithError


def load_examples(
    generated: str, *, max_length: int = 1024, limit: int | None = None, loss_on_prompt: bool = False
) -> list[dict]:
    """Rows of a generated-data folder -> [{"index", "input_ids", "loss_mask"}] (truncated to max_length).
    loss_on_prompt: also learn on prompt tokens (their target states are computed anyway: free extra signal when
    data is scarce; the labels are still the target's distributions, so nothing is learned off-policy but inputs)."""
    import json
    from pathlib import Path

    from draftsmith.prompts import is_eval_source
    from draftsmith.selfdistill import load_generated

    rows = load_generated(generated, limit=limit)
    settings = json.loads((Path(generated) / "manifest.json").read_text()).get("settings", {})
    source = str(settings.get("prompts") or "")
    if settings.get("for_eval") or (source and is_eval_source(source)):
        raise DraftsmithError(
            f"{generated} was generated from an evaluation set ({source or 'for_eval'}); "
            "train heads on training prompts (e.g. builtin:train), never on what you evaluate"
        )
    out = []
    for i, r in enumerate(rows):
        ids = (list(r["prompt_ids"]) + list(r["response_ids"]))[:max_length]
        mask = ([int(loss_on_prompt)] * len(r["prompt_ids"]) + [1] * len(r["response_ids"]))[:max_length]
        response = ([0] * len(r["prompt_ids"]) + [1] * len(r["response_ids"]))[:max_length]
        if sum(response) >= 2:
            out.append({"index": i, "input_ids": ids, "loss_mask": mask, "response_mask": response})
    if not out:
        raise DraftsmithError(
            f"{generated}: no example has a response of >= 2 tokens within max_length={max_length}"
        )
    return out


def split_examples(
    examples: list[dict], eval_fraction: float, max_eval: int, seed: int = 0
) -> tuple[list, list]:
    """Held-out split by a seeded shuffle (eval examples are never trained on)."""
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    n_eval = min(max_eval, int(round(len(examples) * eval_fraction)))
    if len(examples) > 1:
        n_eval = max(1, min(n_eval, len(examples) - 1))
    else:
        n_eval = 0
    # held-out acceptance is measured on responses only (what the decoder drafts), whatever the training mask
    ev = [{**examples[i], "loss_mask": examples[i]["response_mask"]} for i in sorted(order[:n_eval])]
    tr = [examples[i] for i in sorted(order[n_eval:])]
    return tr, ev


def collate(examples: list[dict]) -> dict[str, torch.Tensor]:
    """Right-padded batch: input_ids/attention_mask/loss_mask [B, T], lengths [B], index [B]."""
    t = max(len(e["input_ids"]) for e in examples)
    b = len(examples)
    ids = torch.zeros(b, t, dtype=torch.long)
    am = torch.zeros(b, t, dtype=torch.long)
    lm = torch.zeros(b, t, dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e["input_ids"])
        ids[i, :n] = torch.tensor(e["input_ids"])
        am[i, :n] = 1
        lm[i, :n] = torch.tensor(e["loss_mask"])
    return {
        "input_ids": ids,
        "attention_mask": am,
        "loss_mask": lm,
        "lengths": am.sum(1),
        "index": torch.tensor([e["index"] for e in examples]),
    }


def epoch_batches(examples: list[dict], batch_size: int, seed: int) -> Callable[[int], list[dict]]:
    """epoch -> list of batches: a seeded shuffle per epoch, then length-grouped chunks (less padding)."""

    def make(epoch: int) -> list[dict]:
        order = list(range(len(examples)))
        random.Random(seed * 1000 + epoch).shuffle(order)
        # sort within windows of 32 batches by length, then shuffle the batches: cheap padding control
        win = batch_size * 32
        groups = []
        for s in range(0, len(order), win):
            w = sorted(order[s : s + win], key=lambda i: len(examples[i]["input_ids"]))
            groups += [w[j : j + batch_size] for j in range(0, len(w), batch_size)]
        random.Random(seed * 1000 + epoch + 1).shuffle(groups)
        return [collate([examples[i] for i in g]) for g in groups]

    return make
