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
    verify pass's layer-L states of committed tokens) and drafted rows (dropped after each draft).

    Batches: every row gets the same columns in the buffer; `valid` [B, ctx] marks which hold one of the row's
    committed tokens (not left padding, not the padding after a row that accepted fewer tokens than another), and
    every query sees only its row's valid columns. A context row's position is the count of valid columns before
    it, which is its token's position in the target."""

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
        pos = positions if positions.dim() == 2 else positions.view(1, -1)
        return rope_cos_sin(pos, c.head_dim, c.rope_theta, self.dtype)

    def _context(self, h: torch.Tensor, new_valid: torch.Tensor) -> None:
        """h [B, n, H] context rows; new_valid [B, n] which of them hold committed tokens."""
        n, start = h.shape[1], self.kv.length
        pos = self.count[:, None] + new_valid.long().cumsum(1) - 1
        causal = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
        mask = torch.cat([self.valid[:, None].expand(-1, n, -1), causal & new_valid[:, None]], 2)
        mask[:, :, start:] |= torch.eye(n, dtype=torch.bool, device=self.device)  # no query sees nothing
        self.ad(h.to(self.dtype), *self._rope(pos.clamp_min(0)), mask[:, None], self.kv)
        self.kv.length = self.ctx = start + n
        self.valid = torch.cat([self.valid, new_valid], 1)
        self.count = self.count + new_valid.sum(1)

    def begin(self, tokens, hidden, pad) -> None:
        c = self.ad.config
        B, cap = tokens.shape[0], max(256, 2 * tokens.shape[1])
        self.kv = KVBuffer(B, c.num_key_value_heads, c.head_dim, self.dtype, self.device, cap)
        self.ctx = 0
        self.valid = torch.zeros(B, 0, dtype=torch.bool, device=self.device)
        self.count = torch.zeros(B, dtype=torch.long, device=self.device)
        cols = torch.arange(hidden[0].shape[1], device=self.device)
        self._context(hidden[0], cols[None] >= torch.tensor(pad, device=self.device)[:, None])

    def advance(self, new_tokens, hidden, counts) -> None:
        cols = torch.arange(hidden[0].shape[1], device=self.device)
        self._context(hidden[0], cols[None] < torch.tensor(counts, device=self.device)[:, None])

    def retain(self, rows) -> None:
        self.kv.k, self.kv.v = self.kv.k[rows], self.kv.v[rows]
        self.valid, self.count = self.valid[rows], self.count[rows]

    def logits(self, h, positions, block_mask, m):
        B, n = h.shape[:2]
        self.kv.length = self.ctx + m
        mask = None
        if block_mask is not None or not bool(self.valid.all()):
            if block_mask is None:  # one row: it sees every drafted row
                block_mask = torch.ones(n, m + n, dtype=torch.bool, device=self.device)
            drafted = block_mask.expand(B, n, m + n) if block_mask.dim() == 2 else block_mask
            mask = torch.cat([self.valid[:, None].expand(-1, n, -1), drafted], 2)[:, None]
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
