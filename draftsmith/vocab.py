"""Reduced output vocabulary for drafts: pick the target ids a draft may propose, save/load them, and compute
logits over only those rows of the lm_head.

A draft trained with a reduced vocabulary keeps its full-vocab `lm_head` (so it stays an ordinary HF causal LM)
and stores `draft_vocab.safetensors` beside the weights: tensor "vocab_ids" [V_d] int64, the sorted target ids of
the kept rows. Logits are `F.linear(h, lm_head.weight[vocab_ids])` ([.., V_d]); probabilities are scattered back
to target ids with zeros elsewhere (`to_target_probs`). Building the id list from token frequencies in the training
data follows EAGLE-3 (top-32k tokens by frequency), with special tokens always kept so the draft can end.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from draftsmith.errors import DraftsmithError
from draftsmith.fileio import atomic_write
from draftsmith.modeling import base_decoder, causal_lm, last_rows
from draftsmith.models import eos_token_ids

DRAFT_VOCAB_FILE = "draft_vocab.safetensors"


def token_counts(sequences: Iterable[Sequence[int]], vocab_size: int) -> torch.LongTensor:
    """Occurrences of each token id over all sequences -> [vocab_size] int64."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for seq in sequences:
        ids = torch.as_tensor(seq, dtype=torch.long).reshape(-1)
        if ids.numel() == 0:
            continue
        if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
            raise DraftsmithError(
                f"token id {int(ids.max()) if int(ids.max()) >= vocab_size else int(ids.min())} is outside the "
                f"vocabulary [0, {vocab_size}); count with the target's vocab_size and tokenizer"
            )
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def special_token_ids(tokenizer=None, model=None) -> list[int]:
    """Ids a reduced draft vocabulary must always keep, sorted: every special token of the tokenizer
    (bos/eos/pad/unk/additional, chat-template markers) and the model's end-of-sequence ids (its
    generation_config and config), so the draft can still propose eos and chat-template tokens."""
    ids = set(getattr(tokenizer, "all_special_ids", None) or ())
    for name in ("eos_token_id", "bos_token_id", "pad_token_id", "unk_token_id"):
        for src in (tokenizer, getattr(model, "config", None)):
            value = getattr(src, name, None)
            ids.update([value] if isinstance(value, int) else list(value or []))
    if model is not None:
        ids.update(eos_token_ids(model, tokenizer))
    return sorted(int(i) for i in ids if i is not None and int(i) >= 0)


def build_vocab_ids(counts: torch.Tensor, size: int, always: Sequence[int] = ()) -> torch.LongTensor:
    """The `size` most frequent ids (ties -> lower id), always including `always` -> sorted [size] int64."""
    counts = torch.as_tensor(counts).reshape(-1)
    vocab_size = counts.numel()
    if not 0 < size <= vocab_size:
        raise DraftsmithError(f"draft vocab size must be in [1, {vocab_size}] (the target vocab), got {size}")
    forced = sorted({int(i) for i in always})
    if any(not 0 <= i < vocab_size for i in forced):
        raise DraftsmithError(
            f"always-kept ids {forced} must lie in [0, {vocab_size}); check the special token ids"
        )
    if len(forced) > size:
        raise DraftsmithError(
            f"{len(forced)} always-kept ids do not fit in a draft vocab of {size}; raise its size"
        )
    # forced ids rank above everything; stable sort on descending counts breaks ties by lower id
    score = counts.double().clone()
    if forced:
        score[torch.tensor(forced)] = float("inf")
    order = torch.sort(-score, stable=True).indices
    return torch.sort(order[:size]).values.long()


def coverage(counts: torch.Tensor, vocab_ids: torch.Tensor) -> float:
    """The share of the counted tokens whose id is in `vocab_ids` (0.0 when nothing was counted)."""
    counts = torch.as_tensor(counts).reshape(-1)
    return float(counts[vocab_ids.to(counts.device)].sum()) / max(float(counts.sum()), 1.0)


def _validate(vocab_ids: torch.Tensor, vocab_size: int | None, where: str) -> torch.LongTensor:
    if not isinstance(vocab_ids, torch.Tensor) or vocab_ids.dim() != 1 or vocab_ids.dtype != torch.long:
        raise DraftsmithError(
            f"{where}: vocab_ids must be a 1-D int64 tensor; rebuild it with build_vocab_ids"
        )
    if vocab_ids.numel() == 0:
        raise DraftsmithError(f"{where}: vocab_ids is empty; rebuild it with build_vocab_ids")
    if vocab_ids.numel() > 1 and not bool((vocab_ids[1:] > vocab_ids[:-1]).all()):
        raise DraftsmithError(
            f"{where}: vocab_ids must be sorted and unique; rebuild it with build_vocab_ids"
        )
    hi = vocab_size if vocab_size is not None else None
    if int(vocab_ids[0]) < 0 or (hi is not None and int(vocab_ids[-1]) >= hi):
        raise DraftsmithError(
            f"{where}: vocab_ids out of range [0, {hi}); it was built for another vocabulary - rebuild it"
        )
    return vocab_ids


def save_draft_vocab(out_dir: str | os.PathLike, vocab_ids: torch.Tensor) -> None:
    """Write out_dir/draft_vocab.safetensors (tensor "vocab_ids" [V_d] int64), atomically."""
    from safetensors.torch import save_file

    vocab_ids = _validate(torch.as_tensor(vocab_ids).detach().cpu(), None, "save_draft_vocab")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(
        out / DRAFT_VOCAB_FILE, lambda tmp: save_file({"vocab_ids": vocab_ids.contiguous()}, str(tmp))
    )


def load_draft_vocab(model_dir: str | os.PathLike) -> torch.LongTensor | None:
    """vocab_ids [V_d] int64 from model_dir/draft_vocab.safetensors, or None if the draft has the full vocab.

    Validated: 1-D int64, sorted, unique, within the model's vocab_size (read from config.json when present).
    """
    path = Path(model_dir) / DRAFT_VOCAB_FILE
    if not path.is_file():
        return None
    vocab_size = None
    cfg = Path(model_dir) / "config.json"
    if cfg.is_file():
        raw = json.loads(cfg.read_text())
        vocab_size = raw.get("vocab_size") or (raw.get("text_config") or {}).get("vocab_size")
    return read_draft_vocab(path, vocab_size)


def vocab_file(path: str | os.PathLike) -> Path:
    """A draft_vocab.safetensors file, or a folder holding one (a reduced-vocab draft, `draftsmith vocab`'s output),
    -> the file; a path that is neither is one DraftsmithError line."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / DRAFT_VOCAB_FILE
    if not p.is_file():
        raise DraftsmithError(
            f"draft vocabulary {path} not found: pass a {DRAFT_VOCAB_FILE} or a folder holding one (a reduced-vocab "
            "draft's final/, or `draftsmith vocab --out DIR`)"
        )
    return p


def read_draft_vocab(path: str | os.PathLike, vocab_size: int | None) -> torch.LongTensor:
    """vocab_ids [V_d] int64 from a draft_vocab.safetensors file or a folder holding one, validated against the
    vocabulary size it must index (None: unchecked)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = vocab_file(path)
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise DraftsmithError(
            f"{path} is not a readable safetensors file ({e}); re-save it with save_draft_vocab"
        ) from None
    if set(tensors) != {"vocab_ids"}:
        raise DraftsmithError(f"{path} must hold exactly one tensor 'vocab_ids', found {sorted(tensors)}")
    return _validate(tensors["vocab_ids"], vocab_size, str(path))


def restricted_logits(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    vocab_ids: torch.Tensor | None = None,
    logits_to_keep: int = 0,
    rows: torch.Tensor | None = None,
    **kw,
) -> tuple[torch.Tensor, object]:
    """Run the base transformer, then the lm_head over `vocab_ids` rows only.

    input_ids [B, T] -> (logits [B, T', V_d] (or [B, T', V] when vocab_ids is None), decoder outputs), where
    T' = logits_to_keep if > 0 (the last positions) else T. `rows` ([B, T] bool) instead gives logits [N, V_d] at
    those positions only (= the full logits indexed by rows): a trainer that scores part of each sequence skips the
    head, the largest single product of a small large-vocabulary model, everywhere else. Extra `kw` (position_ids,
    cache, use_cache, output_hidden_states, ...) go to the decoder. Works on LlamaForCausalLM-like models and
    PeftModel wrappers.
    """
    if rows is not None and logits_to_keep > 0:
        raise DraftsmithError("restricted_logits takes rows or logits_to_keep, not both")
    lm, decoder = causal_lm(model), base_decoder(model)
    outputs = decoder(input_ids=input_ids, attention_mask=attention_mask, **kw)
    hidden = outputs.last_hidden_state  # [B, T, H]
    if logits_to_keep > 0:
        hidden = last_rows(hidden, logits_to_keep)
    if rows is not None:
        hidden = hidden[rows]  # [N, H]
    head = lm.get_output_embeddings()
    if vocab_ids is None:
        logits = head(hidden)
    else:
        # a peft-wrapped lm_head (it has .base_layer) would silently lose its adapter delta here
        if hasattr(head, "base_layer") or not isinstance(getattr(head, "weight", None), torch.Tensor):
            raise DraftsmithError(
                f"lm_head is a {type(head).__name__}, not a plain Linear; keep lm_head out of LoRA target_modules "
                "when training with a reduced vocabulary"
            )
        vocab_ids = vocab_ids.to(head.weight.device)
        bias = head.bias.index_select(0, vocab_ids) if head.bias is not None else None
        logits = F.linear(hidden, head.weight.index_select(0, vocab_ids), bias)
    return softcap_logits(lm.config, logits), outputs


def softcap_logits(config, logits: torch.Tensor) -> torch.Tensor:
    """Gemma-style final logit soft-capping, as the model's own forward applies it (a no-op for other models):
    for code that runs the lm_head itself instead of the model's forward."""
    softcap = getattr(config, "final_logit_softcapping", None)
    return torch.tanh(logits / softcap) * softcap if softcap else logits


def to_target_probs(draft_probs: torch.Tensor, vocab_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Scatter reduced-vocab probabilities [..., V_d] to target ids [..., vocab_size] (zeros elsewhere)."""
    if draft_probs.shape[-1] != vocab_ids.numel():
        raise DraftsmithError(
            f"draft probs have {draft_probs.shape[-1]} columns for {vocab_ids.numel()} vocab_ids"
        )
    out = draft_probs.new_zeros(*draft_probs.shape[:-1], vocab_size)
    index = vocab_ids.to(draft_probs.device).expand_as(draft_probs)
    return out.scatter(-1, index, draft_probs)
