"""Head training data: target-generated conversations (`draftsmith generate`) and fixed prompt+response text
as token ids, padded batches.

An example is prompt_ids + response_ids with loss_mask = 1 on the response (heads learn to draft answers).
Every example keeps a stable integer `index` so hidden-state caches can be keyed by it.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.examples import examples_from_sources, split_heldout


def load_examples(
    sources: str | list[str],
    *,
    max_length: int = 1024,
    limit: int | list[int | None] | None = None,
    loss_on_prompt: bool = False,
    tokenizer=None,
) -> list[dict]:
    """Training conversations -> [{"index", "id", "input_ids", "loss_mask", "response_mask", "source"}].

    `sources`: one source or a list mixing `draftsmith generate` folders (target-answered prompts) and fixed
    prompt+response files (.jsonl/.json/.parquet, or `builtin:train-text`; read by
    draftsmith.examples.examples_from_sources, which needs `tokenizer` for files). Fixed text is legitimate head data:
    an EAGLE/Medusa head's labels are the target's own distributions on whatever tokens it reads (EAGLE-1 trained
    on fixed ShareGPT text); only its inputs are off-policy. `limit` caps each source; every example keeps a
    stable integer `index` (position in the concatenation) so hidden-state caches can be keyed by it.
    loss_on_prompt: also learn on prompt tokens (their target states are computed anyway: free extra signal when
    data is scarce; the labels are still the target's distributions, so nothing is learned off-policy but inputs)."""
    sources = [sources] if isinstance(sources, str) else list(sources)
    out: list[dict] = []
    index = 0
    for src, examples in zip(sources, examples_from_sources(sources, tokenizer, limit)):
        n_src = 0
        for e in examples:
            prompt, response = e.prompt_ids, e.response_ids
            ids = (prompt + response)[:max_length]
            mask = ([int(loss_on_prompt)] * len(prompt) + [1] * len(response))[:max_length]
            resp = ([0] * len(prompt) + [1] * len(response))[:max_length]
            if sum(resp) >= 2:
                out.append(
                    {
                        "index": index,
                        "id": e.id,
                        "input_ids": ids,
                        "loss_mask": mask,
                        "response_mask": resp,
                        "source": src,
                    }
                )
                n_src += 1
            index += 1
        if n_src == 0:
            raise DraftsmithError(
                f"{src}: no example has a response of >= 2 tokens within max_length={max_length}"
            )
    return out


def data_fingerprint(examples: list[dict]) -> str:
    """sha1 of every example's index and token ids: a hidden-state cache keyed by index is only valid for it."""
    import hashlib
    from array import array

    h = hashlib.sha1()
    for e in examples:
        h.update(array("q", [e["index"], len(e["input_ids"]), *e["input_ids"]]).tobytes())
    return h.hexdigest()[:16]


def split_examples(examples: list[dict], eval_size: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """draftsmith.examples.split_heldout on head rows (held-out rows from the first source only); held-out
    acceptance is measured on responses only (what the decoder drafts), whatever the training mask."""
    train, held = split_heldout(examples, eval_size, seed, source=lambda e: e["source"])
    return train, [{**e, "loss_mask": e["response_mask"]} for e in held]


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
