"""Medusa heads (Cai et al. 2024) on a frozen (Medusa-1) or LoRA-tuned (Medusa-2) target.

Head k (0-based) reads the target's final (normed) hidden state at position t and predicts token t+2+k; the
target's own lm_head predicts t+1. Each head is `num_layers` residual blocks x + SiLU(W x + b) with W zero-
initialised (so an untrained head starts as the target's lm_head), then a vocab projection initialised from
the target's lm_head (its rows of a reduced vocabulary when draft_vocab_size is set: `token_map` [V_d] holds the
target id of each column, vLLM's truncated-vocabulary layout). Tensor names are vLLM's MedusaModel names:
blocks.{h}.layers.{l}.{weight,bias}, lm_heads.{h}.weight, token_map.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.errors import DraftsmithError
from draftsmith.heads.common import chunked_ce, chunked_soft_ce, target_info
from draftsmith.modeling import output_head


@dataclass
class MedusaConfig:
    num_heads: int = 4
    """Heads; head k predicts token t+2+k."""
    num_layers: int = 1
    """Residual blocks per head (vLLM calls it num_hidden_layers)."""
    hidden_size: int = 0
    vocab_size: int = 0
    medusa_fc_bias: bool = True
    draft_vocab_size: int = 0
    """Rows of each head's vocab projection: 0 = the target's full vocabulary; fewer = a reduced vocabulary
    (token_map [V_d] maps a column to its target id)."""

    def __post_init__(self):
        if self.num_heads < 1 or self.num_layers < 0:
            raise DraftsmithError(
                f"medusa needs num_heads >= 1 and num_layers >= 0, got {self.num_heads}, {self.num_layers}"
            )
        if not 0 <= self.draft_vocab_size <= self.vocab_size:
            raise DraftsmithError(
                f"medusa draft_vocab_size must be in [0, vocab_size={self.vocab_size}], got {self.draft_vocab_size}"
            )

    @property
    def reduced(self) -> bool:
        return 0 < self.draft_vocab_size < self.vocab_size


class MedusaBlock(nn.Module):
    """`num_layers` residual blocks, each a DISTINCT Linear (the classic `[ResBlock] * n` bug shares one)."""

    def __init__(self, hidden_size: int, num_layers: int, bias: bool):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden_size, hidden_size, bias=bias) for _ in range(num_layers))
        for lin in self.layers:  # zero init: the block is the identity at step 0 (Medusa sec. 2.1.1)
            nn.init.zeros_(lin.weight)
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in self.layers:
            x = x + F.silu(lin(x))
        return x


class MedusaHeads(nn.Module):
    head_type = "medusa"

    def __init__(self, config: MedusaConfig, target: dict | None = None):
        super().__init__()
        self.config = config
        self.target = target or {}
        h = config.hidden_size
        v = config.draft_vocab_size if config.reduced else config.vocab_size
        self.blocks = nn.ModuleList(
            MedusaBlock(h, config.num_layers, config.medusa_fc_bias) for _ in range(config.num_heads)
        )
        self.lm_heads = nn.ModuleList(nn.Linear(h, v, bias=False) for _ in range(config.num_heads))
        if config.reduced:
            self.register_buffer("token_map", torch.arange(v, dtype=torch.long))

    @classmethod
    def from_target(
        cls,
        target_model,
        num_heads: int = 4,
        num_layers: int = 1,
        draft_vocab_ids: torch.Tensor | None = None,
    ) -> MedusaHeads:
        """New heads for `target_model`; vocab projections copied from its lm_head (the rows of draft_vocab_ids,
        sorted target ids, when given: a reduced vocabulary)."""
        cfg = target_model.config
        v_d = (
            0
            if draft_vocab_ids is None or draft_vocab_ids.numel() >= cfg.vocab_size
            else draft_vocab_ids.numel()
        )
        c = MedusaConfig(num_heads, num_layers, cfg.hidden_size, cfg.vocab_size, draft_vocab_size=int(v_d))
        heads = cls(c, target_info(target_model))
        w = output_head(target_model).weight.detach()
        if c.reduced:
            ids = draft_vocab_ids.to(torch.long).cpu()
            if not bool((ids[1:] > ids[:-1]).all()) or int(ids[-1]) >= cfg.vocab_size or int(ids[0]) < 0:
                raise DraftsmithError("medusa draft vocab ids must be sorted, unique target ids")
            heads.token_map.copy_(ids)
            w = w[ids.to(w.device)]
        for lm in heads.lm_heads:
            lm.weight.data.copy_(w.float())
        return heads.to(w.device)

    def target_ids(self, columns: torch.Tensor) -> torch.Tensor:
        """Head logit columns -> target token ids (the identity for full-vocabulary heads)."""
        return self.token_map[columns] if self.config.reduced else columns

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] (target final normed state) -> per-head features [K, ..., H]."""
        return torch.stack([blk(hidden) for blk in self.blocks])

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> logits [K, ..., V]. Full logits: for decoding a few rows, not for training."""
        return torch.stack([lm(blk(hidden)) for blk, lm in zip(self.blocks, self.lm_heads)])

    def loss(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        *,
        decay: float = 0.8,
        chunk_size: int = 1024,
        max_rows: int = 0,
        target_head: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Medusa-1 loss sum_k decay^k * CE_k (Medusa eq. 1), CE_k averaged over valid positions.
        hidden [B, T, H] at positions t; input_ids/loss_mask [B, T]; head k's label at t is input_ids[t+2+k].
        target_head [V, H] (the frozen target's lm_head): self-distillation labels instead -- head k at t learns
        the target's distribution at t+1+k, softmax(W f_{t+1+k}), over the data's prefix (Medusa-2's
        self-distillation, sec. 2.3.2). That is exactly what greedy verification checks (the target's argmax
        there), and it makes fixed text usable: the data's tokens are inputs only, never labels.
        max_rows > 0: a uniform sample of that many positions per head (unbiased; the [H, V] projections dominate
        the cost, so on a CPU this buys many more optimizer steps per second)."""
        hidden = hidden.to(self.lm_heads[0].weight.dtype)
        total = hidden.new_zeros((), dtype=torch.float32)
        column = None  # reduced vocabulary: target id -> its column (-1 outside); soft labels over its rows
        if self.config.reduced:
            column = torch.full((self.config.vocab_size,), -1, dtype=torch.long, device=hidden.device)
            column[self.token_map] = torch.arange(self.token_map.numel(), device=hidden.device)
            if target_head is not None:
                target_head = target_head[self.token_map]
        metrics: dict[str, float] = {}
        for k, (blk, lm) in enumerate(zip(self.blocks, self.lm_heads)):
            shift = k + 2
            if hidden.shape[1] <= shift:
                break
            labels = input_ids[:, shift:]
            valid = loss_mask[:, shift:].bool()
            rows = hidden[:, :-shift][valid]  # [N, H]
            targets = labels[valid] if target_head is None else hidden[:, shift - 1 : -1][valid]
            if column is not None and target_head is None:  # tokens outside the vocabulary cannot be learned
                targets = column[targets]
                rows, targets = rows[targets >= 0], targets[targets >= 0]
            if max_rows and rows.shape[0] > max_rows:
                pick = torch.randperm(rows.shape[0], device=rows.device)[:max_rows]
                rows, targets = rows[pick], targets[pick]
            n = rows.shape[0]
            if n == 0:
                continue
            if target_head is None:
                loss_sum, top1, topk = chunked_ce(blk(rows), lm.weight, targets, chunk_size=chunk_size)
            else:
                loss_sum, top1, topk = chunked_soft_ce(
                    blk(rows), lm.weight, targets, target_head.to(lm.weight.dtype), chunk_size=chunk_size
                )
            ce = loss_sum / n
            total = total + decay**k * ce
            metrics[f"head{k}/ce"] = float(ce.detach())
            metrics[f"head{k}/top1"] = float(top1) / n
            metrics[f"head{k}/top5"] = float(topk) / n
        return total, metrics

    def to_config_dict(self) -> dict:
        c = self.config
        return {
            "draftsmith_head_type": "medusa",
            # vLLM MedusaModel fields (num_hidden_layers = residual blocks per head)
            "architectures": ["MedusaModel"],
            "model_type": "medusa",
            "num_hidden_layers": c.num_layers,
            "truncated_vocab_size": c.draft_vocab_size if c.reduced else None,
            **asdict(c),
            "target": self.target,
        }
