"""Several sequences of different lengths in one HF KV cache: left padding, per-row lengths, per-row rollback.

Layout (B rows, `cols` cache columns for every row): row b's committed tokens occupy columns [pad_b, length_b);
prompts are left-padded so they all end at the same column, and the position of column c in row b is c - pad_b.
Columns from length_b to cols are scratch: rows that accepted fewer tokens than the longest row leave them, and
every query masks them out. A step appends a block of n columns [cols, cols + n) to every row (`block_inputs`:
position ids and the attention mask), and `commit` then keeps, per row, some of the block's columns: they are
gathered to [length_b, length_b + kept_b) -- one gather over the window [min_b length_b, cols + n), not the whole
cache -- and the cache is cropped to the longest row. Rolling a row back is lowering its length (host arithmetic);
finished rows leave the batch with `retain` (their rows, and left padding no remaining row needs, are dropped).

One row, or rows of equal length without padding, appending a chain: no mask, no position ids, and the roll-back is
a crop (a gather then crop for a tree path), exactly as the batch-1 decoder always did. Lengths live on the host,
so no step waits for the device to learn them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from draftsmith.modeling import additive_mask, window_masks

from .cache import compact_cache, crop_to


def block_visibility(parents: Sequence[Sequence[int]], n: int, device) -> torch.Tensor:
    """Per row, which block columns each block row sees: [B, n, n] bool for the block [root, node_1 .. node_{n-1}]
    with the row's node parents (-1 = the root). A row sees the root, its ancestors and itself (tree attention);
    padding rows past a row's own nodes see the root and themselves (they are nobody's ancestor)."""
    out = torch.eye(n, dtype=torch.bool).repeat(len(parents), 1, 1)
    out[:, :, 0] = True
    for b, row in enumerate(parents):
        for i, p in enumerate(row):  # parents precede children: row i+1 inherits its parent's ancestors
            if p >= 0:
                out[b, i + 1] |= out[b, p + 1]
    return out.to(device)


class RaggedCache:
    """Per-row bookkeeping for an HF Dynamic/StaticCache holding B left-padded rows (module docstring)."""

    def __init__(self, cache, pads: Sequence[int], *, kv_len: int | None = None, config=None):
        """pads: left padding per row. kv_len: the key length of a static cache's buffers (None: dynamic). config:
        the model's, whose sliding-window layers get their window in the masks made here (modeling.window_masks;
        the cache must keep every column: modeling.rollback_cache)."""
        self.cache = cache
        self.config = config
        self.pads = list(pads)
        self.lengths = list(self.pads)  # no token committed yet
        self.cols = 0
        self.kv_len = kv_len

    @property
    def batch(self) -> int:
        return len(self.pads)

    @property
    def uniform(self) -> bool:
        """Every row's tokens fill columns [0, cols): the model's own causal mask and positions are right."""
        return not any(self.pads) and all(n == self.cols for n in self.lengths)

    # -- inputs of a forward ------------------------------------------------------------------------------------
    def prefill_inputs(self, width: int, dtype: torch.dtype, device) -> dict:
        """Position ids and mask for the left-padded prompts [B, width] ({} without padding). Padding rows see
        only themselves (a query that sees nothing would give NaN in some attention kernels)."""
        if not any(self.pads):
            return {}
        col = torch.arange(width, device=device)
        pad = torch.tensor(self.pads, device=device)[:, None, None]
        allowed = (col[None, None, :] >= pad) & (col[None, None, :] <= col[None, :, None])  # [B, T, T]
        allowed |= torch.eye(width, dtype=torch.bool, device=device)
        positions = (col[None, :] - pad[:, :, 0]).clamp_min(0)
        return {"position_ids": positions, "attention_mask": self._mask(allowed, positions, positions, dtype)}

    def prefilled(self, width: int) -> None:
        self.lengths = [width] * self.batch
        self.cols = width

    def block_inputs(
        self,
        n: int,
        dtype: torch.dtype,
        device,
        visible: torch.Tensor | None = None,
        depths: torch.Tensor | None = None,
    ) -> dict:
        """Position ids [B, n] and the additive mask [B, 1, n, kv] for a block of n columns appended to every row.
        visible [B, n, n] bool (block_visibility; None = a causal chain); depths [B, n] position offsets from each
        row's length (None = 0, 1, .., n-1). {} where the model's own causal mask and positions are right."""
        if visible is None and self.uniform:
            return {}
        if visible is None:
            visible = torch.ones(n, n, dtype=torch.bool, device=device).tril().expand(self.batch, n, n)
        if depths is None:
            depths = torch.arange(n, device=device).expand(self.batch, n)
        allowed = block_allowed(self.pads, self.lengths, self.cols, visible.to(device))
        length = torch.tensor(self.lengths, device=device)[:, None]
        pad = torch.tensor(self.pads, device=device)[:, None]
        positions = (length - pad) + depths
        keys = torch.cat([torch.arange(self.cols, device=device)[None] - pad, positions], 1)
        return {"position_ids": positions, "attention_mask": self._mask(allowed, positions, keys, dtype)}

    def _mask(self, allowed: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, dtype):
        """bool [B, q, k] -> the forward's attention_mask (a {layer type: mask} dict where layers differ)."""
        if self.config is None:
            return additive_mask(allowed, dtype, self.kv_len)
        return window_masks(
            self.config, allowed, q_pos, k_pos, lambda a: additive_mask(a, dtype, self.kv_len)
        )

    # -- after a forward ----------------------------------------------------------------------------------------
    def commit(self, kept: Sequence[Sequence[int]], n: int) -> None:
        """The block of n columns at [cols, cols + n) was written; row b keeps block columns kept[b] (ascending)."""
        start = self.cols
        new = [length + len(k) for length, k in zip(self.lengths, kept)]
        in_place = all(
            length == start and list(k) == list(range(len(k))) for length, k in zip(self.lengths, kept)
        )
        if in_place:
            crop_to(self.cache, max(new), current=start + n)
        elif self.batch == 1:  # gathers the row's kept columns to `start`, then crops
            keep = torch.tensor(kept[0], dtype=torch.long, device=self._device())
            compact_cache(self.cache, start, keep, current=start + n)
        else:
            self._gather(kept, start, n)
            crop_to(self.cache, max(new), current=start + n)
        self.lengths, self.cols = new, max(new)

    def _gather(self, kept: Sequence[Sequence[int]], start: int, n: int) -> None:
        """Move each row's kept block columns to the end of its committed tokens: one gather per layer over the
        window [min length, start + n) (columns of the window that stay put map to themselves)."""
        w0, w1 = min(self.lengths), start + n
        src = torch.arange(w0, w1).repeat(self.batch, 1)
        for b, (length, k) in enumerate(zip(self.lengths, kept)):
            if k:
                src[b, length - w0 : length - w0 + len(k)] = start + torch.tensor(k)
        src = (src - w0).to(self._device())
        for layer in self.cache.layers:
            for name in ("keys", "values"):
                t = getattr(layer, name)  # [B, heads, cols, head_dim]
                idx = src[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3])
                t[:, :, w0:w1] = t[:, :, w0:w1].gather(2, idx)  # gather copies first: overlaps are safe

    def set_lengths(self, lengths: Sequence[int]) -> None:
        """Roll rows back to `lengths` (each <= its current length) and crop what no row holds any more."""
        self.lengths = list(lengths)
        top = max(self.lengths)
        crop_to(self.cache, top, current=self.cols)
        self.cols = top

    def retain(self, rows: Sequence[int]) -> None:
        """Keep only `rows` (batch indices, ascending) and drop left padding that no remaining row needs."""
        trim = min(self.pads[r] for r in rows)
        top = max(self.lengths[r] for r in rows)
        idx = torch.tensor(list(rows), device=self._device()) if self.cols else None
        for layer in self.cache.layers if self.cols else ():  # before the first forward it holds nothing
            layer.keys = layer.keys[idx, :, trim:top]
            layer.values = layer.values[idx, :, trim:top]
        self.pads = [self.pads[r] - trim for r in rows]
        self.lengths = [self.lengths[r] - trim for r in rows]
        self.cols = top - trim

    def _device(self):
        return self.cache.layers[0].keys.device


def block_mask(
    pads: Sequence[int],
    lengths: Sequence[int],
    cols: int,
    visible: torch.Tensor,
    dtype: torch.dtype,
    kv_len: int | None = None,
) -> torch.Tensor:
    """Additive mask [B, 1, n, kv] for a block of n columns appended after `cols` cache columns: block row j of
    row b sees the committed columns [pads[b], lengths[b]) and the block columns visible[b, j] says."""
    return additive_mask(block_allowed(pads, lengths, cols, visible), dtype, kv_len)


def block_allowed(pads: Sequence[int], lengths: Sequence[int], cols: int, visible: torch.Tensor):
    """block_mask's bool form [B, n, cols + n] (True = attend)."""
    device = visible.device
    col = torch.arange(cols, device=device)
    pad = torch.tensor(list(pads), device=device)[:, None]
    length = torch.tensor(list(lengths), device=device)[:, None]
    prefix = (col >= pad) & (col < length)  # [B, cols]: committed columns
    n = visible.shape[1]
    return torch.cat([prefix[:, None, :].expand(-1, n, -1), visible], 2)  # [B, n, cols + n]


# -- the decoder's verify block and what a step keeps of it ------------------------------------------------------
def verify_inputs(ragged: RaggedCache, proposal, depths: list[list[int]], dtype, device) -> dict:
    """Position ids and attention mask of the verify block [root, nodes] of every row, node depths `depths` per row
    ({} where the model's own causal mask is right)."""
    n = 1 + proposal.num_nodes
    if proposal.is_chain:
        return ragged.block_inputs(n, dtype, device)
    parents = [proposal.row_parents(b) for b in range(ragged.batch)]
    offsets = torch.ones(ragged.batch, n, dtype=torch.long)
    offsets[:, 0] = 0
    for b, d in enumerate(depths):
        offsets[b, 1 : 1 + len(d)] = torch.tensor(d, dtype=torch.long)
    visible = block_visibility(parents, n, device)
    return ragged.block_inputs(n, dtype, device, visible, offsets.to(device))


def committed_tokens(proposal, paths: list[list[int]], last: torch.Tensor) -> torch.Tensor:
    """[B, A] each row's accepted node tokens then its next token, right-padded with that token."""
    width = 1 + max(len(p) for p in paths)
    new = last[:, None].expand(-1, width).clone()
    for b, p in enumerate(paths):
        if p:
            new[b, : len(p)] = proposal.tokens[b, p].to(new.device)
    return new


def kept_hidden(hidden: tuple | None, paths: list[list[int]], device) -> tuple | None:
    """The hidden rows that predicted each row's committed tokens: the root's and the accepted nodes', [B, A, H]
    right-padded (with the root's row)."""
    if hidden is None:
        return None
    width = 1 + max(len(p) for p in paths)
    rows = torch.zeros(len(paths), width, dtype=torch.long)
    for b, p in enumerate(paths):
        rows[b, 1 : 1 + len(p)] = torch.tensor([1 + i for i in p], dtype=torch.long)
    rows = rows.to(device)
    if len(paths) == 1:
        return tuple(h[:, rows[0]] for h in hidden)
    return tuple(h.gather(1, rows[:, :, None].expand(-1, -1, h.shape[-1])) for h in hidden)
