"""Draft/target tokenizer compatibility, checked on configs and tokenizers before any weights load.

A drafter is only usable if a token id means the same string to both models: the draft proposes ids that
the target verifies. We require the same id->token mapping over the shared range, the same special-token
ids (bos/eos/unk), and config vocab sizes that both cover the tokenizer (extra rows are padding).
"""

from __future__ import annotations

from draftsmith.errors import DraftsmithError


def check_tokenizers(target_tok, draft_tok, target_vocab_size: int, draft_vocab_size: int) -> None:
    """Raise DraftsmithError naming the first difference; return None when compatible."""
    n_t, n_d = len(target_tok), len(draft_tok)
    if n_t != n_d:
        raise DraftsmithError(
            f"tokenizer mismatch: target has {n_t} tokens, draft has {n_d}; use a draft trained with the target's tokenizer"
        )
    for name, size, n in (("target", target_vocab_size, n_t), ("draft", draft_vocab_size, n_d)):
        if size < n:
            raise DraftsmithError(
                f"{name} config vocab_size {size} is smaller than its tokenizer ({n} tokens); the checkpoint is broken"
            )
    vt, vd = target_tok.get_vocab(), draft_tok.get_vocab()
    if vt != vd:
        diff = sorted(set(vt.items()) ^ set(vd.items()), key=lambda kv: kv[1])[0]
        tok_str, tok_id = diff
        raise DraftsmithError(
            f"tokenizer mismatch: token {tok_str!r} maps to id {vt.get(tok_str)} in the target but {vd.get(tok_str)} "
            f"in the draft (first of {len(set(vt.items()) ^ set(vd.items()))} differences); draft and target need the same tokenizer"
        )
    for attr in ("bos_token_id", "eos_token_id", "unk_token_id"):
        a, b = getattr(target_tok, attr, None), getattr(draft_tok, attr, None)
        if a != b:
            raise DraftsmithError(
                f"special token mismatch: {attr} is {a} in the target but {b} in the draft; align the special tokens"
            )


def check_compatible(target: str, draft: str, trust_remote_code: bool = False) -> None:
    """Check a target/draft pair by id/path without loading weights."""
    from draftsmith import models

    t_cfg = models.load_config(target, trust_remote_code)
    d_cfg = models.load_config(draft, trust_remote_code)
    t_tok = models.load_tokenizer(target, trust_remote_code)
    d_tok = models.load_tokenizer(draft, trust_remote_code)
    check_tokenizers(t_tok, d_tok, _vocab_size(t_cfg), _vocab_size(d_cfg))


def _vocab_size(cfg) -> int:
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return int(text.vocab_size)
