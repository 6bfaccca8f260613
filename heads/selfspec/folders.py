"""Self-speculative drafter folders and builders: `layerskip:DIR` and `earlyexit:DIR` (draftsmith.heads.selfspec.drafting).

layerskip DIR: config.json {"draftsmith_drafter": "layerskip", "skip_layers": [...], "target": {target record},
"search": {what the search measured}} (+ draft_vocab.safetensors: the reduced head's target ids). No weights: the
draft is the target itself. earlyexit DIR: a head folder (heads.selfspec.earlyexit adapter, config.json + model.safetensors).
Both record the target they were made for; another target is refused with one line before any drafting.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.fileio import replace_dir, temp_path, write_json
from draftsmith.heads.common import check_target, target_info
from draftsmith.heads.layers import KVBuffer, rope_cos_sin
from draftsmith.heads.selfspec.drafting import NormHeadTop, SelfSpecProposer
from draftsmith.heads.selfspec.earlyexit import EarlyExitAdapter
from draftsmith.vocab import load_draft_vocab, save_draft_vocab

LAYERSKIP = "layerskip"


class EarlyExitTop:
    """The adapter on top of the shared layers at decode time, with its own KV buffer of context rows (the
    verify pass's layer-L states of committed tokens) and drafted rows (dropped after each draft)."""

    def __init__(self, adapter: EarlyExitAdapter, target):
        self.ad = adapter
        c = adapter.config
        self.hidden_state_layers = (c.exit_layer,)
        w = target.get_output_embeddings().weight
        self.vocab_ids = adapter.vocab_ids.to(w.device)
        self.weight = w[self.vocab_ids].detach().clone()  # contiguous rows: no gather per draft step
        self.dtype, self.device = w.dtype, w.device

    def _rope(self, positions: torch.Tensor):
        c = self.ad.config
        return rope_cos_sin(positions.view(1, -1), c.head_dim, c.rope_theta, self.dtype)

    def _context(self, h: torch.Tensor) -> None:
        n, start = h.shape[1], self.kv.length
        pos = torch.arange(start, start + n, device=self.device)
        mask = torch.ones(n, start + n, dtype=torch.bool, device=self.device)
        mask[:, start:] = mask[:, start:].tril()
        self.ad(h.to(self.dtype), *self._rope(pos), mask[None, None], self.kv)
        self.kv.length = self.ctx = start + n

    def begin(self, tokens, hidden) -> None:
        c = self.ad.config
        cap = max(256, 2 * tokens.shape[1])
        self.kv = KVBuffer(1, c.num_key_value_heads, c.head_dim, self.dtype, self.device, cap)
        self.ctx = 0
        self._context(hidden[0])

    def advance(self, new_tokens, hidden) -> None:
        self._context(hidden[0])

    def logits(self, h, positions, block_mask, m):
        n = h.shape[1]
        self.kv.length = self.ctx + m
        mask = None
        if block_mask is not None:
            mask = torch.ones(n, self.ctx + m + n, dtype=torch.bool, device=self.device)
            mask[:, self.ctx :] = block_mask
            mask = mask[None, None]
        out = self.ad(h, *self._rope(positions), mask, self.kv)
        return self.ad.logits(out, self.weight)

    def end_draft(self) -> None:
        self.kv.length = self.ctx


def save_layerskip(out: str | os.PathLike, target, skip: list[int], vocab_ids, search: dict) -> Path:
    """Write a layerskip drafter folder (config.json + optional draft_vocab.safetensors), whole or not at all."""
    out = Path(out)
    tmp = temp_path(out)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if vocab_ids is not None:
        save_draft_vocab(tmp, vocab_ids)
    cfg = {"draftsmith_drafter": LAYERSKIP, "skip_layers": sorted(int(i) for i in skip),
           "vocab_size": int(target.config.vocab_size), "target": target_info(target), "search": search}  # fmt: skip
    write_json(tmp / "config.json", cfg)
    return replace_dir(tmp, out)


def read_layerskip(path: str | os.PathLike, target) -> tuple[list[int], torch.Tensor | None, dict]:
    """(skip layers, reduced-vocab ids or None, config) of a layerskip folder made for `target` (else refused)."""
    p = Path(path)
    f = p / "config.json"
    try:
        cfg = json.loads(f.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DraftsmithError(
            f"{f} is missing or not JSON ({e}); run draftsmith layerskip to write it"
        ) from None
    if cfg.get("draftsmith_drafter") != LAYERSKIP:
        raise DraftsmithError(
            f"{p} is not a layerskip folder (config.json has no draftsmith_drafter=layerskip)"
        )
    check_target(cfg.get("target", {}), target, f"layerskip {p}")
    n = target.config.num_hidden_layers
    skip = cfg.get("skip_layers")
    if not isinstance(skip, list) or not skip or any(not isinstance(i, int) or not 0 <= i < n for i in skip):
        raise DraftsmithError(f"{f}: skip_layers must be a non-empty list of layer indices in [0, {n})")
    if len(set(skip)) >= n:
        raise DraftsmithError(f"{f}: skip_layers skips every layer; keep at least one")
    return sorted(skip), load_draft_vocab(p), cfg


def check_layerskip_folder(ckpt) -> None:
    """A layerskip folder's config.json names its skip set and target (draftsmith.kinds check_folder)."""
    cfg = ckpt.config
    if not isinstance(cfg.get("skip_layers"), list) or not isinstance(cfg.get("target"), dict):
        raise DraftsmithError(
            f"{ckpt.path}: a layerskip config.json needs skip_layers and target; re-run draftsmith layerskip"
        )


def build_layerskip(path: str, o: dict, ctx) -> SelfSpecProposer:
    """`layerskip:DIR[,top_k=1,depth=D,total_tokens=N,stop_below=P,reuse=1]`: the target minus DIR's skip set."""
    skip, vocab_ids, _ = read_layerskip(path, ctx.target)
    keep = [i for i in range(ctx.target.config.num_hidden_layers) if i not in set(skip)]
    return SelfSpecProposer(ctx.target, keep, NormHeadTop(ctx.target, vocab_ids), name=LAYERSKIP, **o)


def build_earlyexit(path: str, o: dict, ctx) -> SelfSpecProposer:
    """`earlyexit:DIR[,top_k=1,depth=D,total_tokens=N,stop_below=P,reuse=1]`: first L target layers + adapter."""
    from draftsmith.heads.io import load_head

    ad = load_head(path, ctx.target)
    if not isinstance(ad, EarlyExitAdapter):
        raise DraftsmithError(f"{path} holds a {ad.head_type} head, not an early-exit adapter")
    top = EarlyExitTop(ad, ctx.target)
    return SelfSpecProposer(ctx.target, range(ad.config.exit_layer), top, name="earlyexit", **o)
