"""P-EAGLE: an EAGLE-3 head that drafts k tokens in ONE forward (parallel drafting).

The head is EAGLE-3's (fc over three fused target layers, one decoder layer reading [norm(embed); norm(hidden)],
reduced-vocab lm_head with d2t/t2d) plus one learned vector `mask_hidden` [1, 1, 3 H_t]. Depth 1 is the ordinary
EAGLE-3 row (target features at t, token t+1, position t). Depths d = 2..k are placeholder rows
(embed(mask_token_id), fc(mask_hidden)) at positions t+d-1 that attend to the real context rows <= t and to the
lower placeholder rows of the same draft; their outputs are the depth-d logits. So a k-token draft is one head
forward over [new context rows; k-1 placeholders] instead of k sequential forwards.

Tensor names are EAGLE-3's (SGLang/speculators) plus `mask_hidden` (speculators' P-EAGLE name).
"""

from __future__ import annotations

import torch
from torch import nn

from draftsmith.errors import DraftsmithError
from draftsmith.heads.eagle.model import EagleConfig, EagleHead, eagle_config_from_dict


class PEagleHead(EagleHead):
    """EAGLE-3 head + mask_hidden. `num_depths` = draft depths trained (1 real + num_depths-1 placeholders)."""

    def __init__(
        self, config: EagleConfig, target: dict | None = None, *, mask_token_id: int = 0, num_depths: int = 4
    ):
        if config.kind != "eagle3":
            raise DraftsmithError("P-EAGLE extends an EAGLE-3 head (kind eagle3)")
        if num_depths < 2:
            raise DraftsmithError(
                f"P-EAGLE needs num_depths >= 2 (one parallel placeholder at least), got {num_depths}"
            )
        super().__init__(config, target)
        self.head_type = "peagle"
        self.mask_token_id = int(mask_token_id)
        self.num_depths = int(num_depths)
        self.mask_hidden = nn.Parameter(torch.randn(1, 1, 3 * config.target_hidden_size))

    @classmethod
    def from_target_head(cls, head: EagleHead, *, mask_token_id: int, num_depths: int) -> PEagleHead:
        """Wrap a freshly built EAGLE-3 head (EagleHead.from_target) as a P-EAGLE head with the same weights."""
        p = cls(head.config, head.target, mask_token_id=mask_token_id, num_depths=num_depths)
        missing, unexpected = p.load_state_dict(head.state_dict(), strict=False)
        if unexpected or missing != ["mask_hidden"]:
            raise DraftsmithError(f"P-EAGLE wrap: unexpected state mismatch {missing} {unexpected}")
        return p.to(head.fc.weight.device)

    def placeholder(self, n: int) -> torch.Tensor:
        """fc(mask_hidden) for n placeholder rows -> [1, n, H] (the layer input of depths >= 2)."""
        return self.fc(self.mask_hidden.to(self.fc.weight.dtype)).expand(1, n, -1)

    def to_config_dict(self) -> dict:
        d = super().to_config_dict()
        d.update(
            draftsmith_head_type="peagle",
            architectures=["DraftsmithPEagleHead"],
            mask_token_id=self.mask_token_id,
            num_depths=self.num_depths,
        )
        return d


def peagle_from_config_dict(config: dict) -> PEagleHead:
    """The head described by a saved P-EAGLE config.json (weights loaded by the caller)."""
    data = {**config, "draftsmith_head_type": "eagle3"}
    return PEagleHead(
        eagle_config_from_dict(data),
        config.get("target"),
        mask_token_id=int(config.get("mask_token_id", 0)),
        num_depths=int(config.get("num_depths", 4)),
    )
