"""A distilled draft -> an ordinary causal LM + tokenizer folder (transformers `assistant_model`, vLLM draft model).

A draft trained with a reduced output vocabulary (draft_vocab.safetensors, ids K) proposes only tokens in K:
draftsmith computes logits over the K rows of lm_head. A plain causal LM has no such restriction and a Llama
lm_head has no bias, so no fixed weight can push a row's logit below every kept logit by a constant. We set every
row outside K to the *mean of the kept rows*: its logit is then the mean of the kept logits, strictly below their
maximum unless all kept logits are equal, so an excluded token never wins argmax and greedy drafting proposes
exactly what the reduced-vocab draft proposes. Under sampling the excluded tokens keep a small probability
(each at most the average kept probability); draftsmith's own decoder, given the original folder, stays exact.
Tied embeddings are untied first, so the input embeddings are unchanged.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from draftsmith.checkpoint import DRAFT_META, Checkpoint
from draftsmith.errors import DraftsmithError

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def export_hf(ckpt: Checkpoint, out: Path) -> dict:
    """Write the causal LM + tokenizer into `out` (an empty staging folder); return manifest notes."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftsmith.vocab import load_draft_vocab

    if ckpt.kind != "draft":
        raise DraftsmithError(
            f"{ckpt.path} is a {ckpt.kind} head, not a distilled draft; --format hf is for draft models "
            f"(heads: {'vllm-medusa' if ckpt.kind == 'medusa' else 'sglang-eagle3 / speculators'})"
        )
    if not any((ckpt.path / f).is_file() for f in TOKENIZER_FILES):
        raise DraftsmithError(
            f"{ckpt.path} holds no tokenizer files; save the target's tokenizer into the draft folder"
        )
    vocab_ids = load_draft_vocab(ckpt.path)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            ckpt.path, dtype="auto", use_safetensors=True, use_kernels=False
        )
        tok = AutoTokenizer.from_pretrained(ckpt.path)
    except (OSError, ValueError) as e:
        raise DraftsmithError(
            f"could not load the draft {ckpt.path} ({str(e).splitlines()[0][:160]}); re-save it"
        ) from None
    notes: dict = {"draft_vocab_size": None}
    if vocab_ids is not None:
        head = model.get_output_embeddings()
        weight = head.weight.detach().clone()  # clone also unties it from the input embeddings
        if vocab_ids.numel() < weight.shape[0]:
            keep = torch.zeros(weight.shape[0], dtype=torch.bool)
            keep[vocab_ids] = True
            weight[~keep] = weight[vocab_ids].float().mean(0).to(weight.dtype)
        model.config.tie_word_embeddings = False
        if hasattr(model.config, "get_text_config"):
            model.config.get_text_config().tie_word_embeddings = False
        head.weight = torch.nn.Parameter(weight, requires_grad=False)
        notes = {
            "draft_vocab_size": int(vocab_ids.numel()),
            "excluded_rows": "set to the mean of the kept rows: excluded logits = mean kept logit < max kept logit",
        }
        log.info(
            "reduced vocab: %d of %d rows kept; the others set to their mean",
            vocab_ids.numel(),
            weight.shape[0],
        )
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    if (ckpt.path / DRAFT_META).is_file():
        (out / DRAFT_META).write_text((ckpt.path / DRAFT_META).read_text())
    return notes
