"""Continuous batching for plain decoding: many prompts answered by one target, the batch kept full.

    for key, response_ids, finish in answer(model, prompts, eos, max_new_tokens=256, slots=64):
        ...

`slots` sequences decode together, one token each per target forward; a sequence that ends (an end-of-sequence id or
`max_new_tokens`) leaves its slot, and the next prompts are prefilled into the free slots (in groups: a prefill is
one forward over several left-padded prompts) -- the scheduling of serving engines (vLLM, SGLang) on one KV cache.
`transformers`' generate keeps a batch's finished rows in the forward until its longest answer ends and pads every
prompt to the batch's longest; here neither costs anything.

The KV cache is one buffer per layer, [slots, kv heads, capacity, head dim], allocated once. Every slot writes its
next token at the same column `cols`; slot b's sequence occupies columns [start_b, cols), so its position is
column - start_b and its mask admits [start_b, cols]. A slot's new prompt of length P is placed at
[cols - P, cols). When cols reaches the capacity, every slot's columns move left by the smallest live start
(`make_room`); a prompt longer than cols moves them right first. A step attends over the columns
[min_b start_b, cols] only.

Greedy answers equal the target's own greedy decoding up to the matmul kernels' near-ties: a row's numbers depend a
little on how many rows share its forward, as they do in any batched engine. Sampled answers (temperature > 0) draw
each token with one generator per run, seeded: the same prompts, order and settings give the same answers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from draftsmith.errors import DraftsmithError
from draftsmith.modeling import (
    additive_mask,
    base_decoder,
    left_pad,
    output_head,
    rollback_cache,
    text_config,
    window_masks,
)
from draftsmith.sampling import SamplingParams, sample, warp_probs


class _SlotLayer(DynamicLayer):
    """A cache layer over a preallocated [slots, heads, capacity, head_dim] buffer: a forward writes its columns at
    `cols` and attends over the view [0, cols + n) (no copy of the cache per token, unlike DynamicLayer's cat)."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.cols = 0
        self.lo = 0  # the first column a forward attends to (no live slot starts before it)

    def allocate(self, slots: int, heads: int, k_dim: int, v_dim: int, dtype, device) -> None:
        self.buf_k = torch.zeros(slots, heads, self.capacity, k_dim, dtype=dtype, device=device)
        self.buf_v = torch.zeros(slots, heads, self.capacity, v_dim, dtype=dtype, device=device)
        self.device, self.is_initialized = device, True

    def update(self, key_states, value_states, *args, **kwargs):
        n, c = key_states.shape[-2], self.cols
        self.buf_k[:, :, c : c + n] = key_states
        self.buf_v[:, :, c : c + n] = value_states
        self.keys, self.values = self.buf_k[:, :, self.lo : c + n], self.buf_v[:, :, self.lo : c + n]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.cols


@dataclass
class _Slot:
    key: object = None
    start: int = 0
    tokens: list | None = None  # None: free
    finish: str | None = (
        None  # set when the answer ended; with capture, the slot feeds its last token once more
    )
    feats: list = field(default_factory=list)  # captured hidden states, one {name: [n, D]} per forward

    @property
    def live(self) -> bool:
        return self.tokens is not None


@dataclass
class Answer:
    """One answered prompt: its key, the response ids (ending with an end-of-sequence id when finish is "stop",
    else cut at max_new_tokens: "length"), and with capture the target's hidden states over prompt + response
    ({"last": [T, H] final normed state, "aux": [T, len(layers) * H] the captured layers' inputs}; else None)."""

    key: object
    tokens: list[int]
    finish: str
    features: dict[str, torch.Tensor] | None = None


class _Recorder:
    """Forward hooks keeping, per forward, what a head trains on: HF's hidden_states[i] for i in `layers` (the input
    of decoder layer i; i = the number of layers is the final normed state) and the final normed state itself
    (heads.hidden.target_features' "aux" and "last", read here from the forwards that decode instead of a second
    pass over the text)."""

    def __init__(self, model, layers: Sequence[int], dtype: torch.dtype):
        dec = base_decoder(model)
        n = len(dec.layers)
        bad = [i for i in layers if not 0 <= i <= n]
        if bad:
            raise DraftsmithError(
                f"capture layers {bad} are outside the target's hidden_states indices [0, {n}]"
            )
        self.layers, self.dtype, self.out = list(layers), dtype, {}
        self.handles = [
            dec.layers[i].register_forward_pre_hook(self._input(i), with_kwargs=True)
            for i in self.layers
            if i < n
        ]
        self.handles.append(dec.norm.register_forward_hook(self._final(n)))

    def _input(self, i: int):
        def hook(_m, args, kwargs):
            self.out[i] = args[0] if args else kwargs["hidden_states"]

        return hook

    def _final(self, n: int):
        def hook(_m, _args, out):
            self.out["last"] = self.out[n] = out

        return hook

    def rows(self, r: int, cols: slice) -> dict[str, torch.Tensor]:
        """Row r's states at `cols` of the last forward, on the CPU in the capture dtype."""
        keep = {"last": self.out["last"][r, cols]}
        if self.layers:
            keep["aux"] = torch.cat([self.out[i][r, cols] for i in self.layers], -1)
        return {k: v.to("cpu", self.dtype) for k, v in keep.items()}

    def close(self) -> None:
        for h in self.handles:
            h.remove()


class _Batch:
    """The slots, their cache and the column bookkeeping (module docstring)."""

    def __init__(self, model, slots: int, capacity: int, recorder: _Recorder | None = None):
        self.model, self.config, self.recorder = model, model.config, recorder
        self.layers = [_SlotLayer(capacity) for _ in range(text_config(model.config).num_hidden_layers)]
        self.cache = DynamicCache()
        self.cache.layers = self.layers
        self.slots = [_Slot() for _ in range(slots)]
        self.capacity = capacity
        self.cols = 0
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device

    def _set_cols(self, cols: int, lo: int = 0) -> None:
        self.cols = cols
        for layer in self.layers:
            layer.cols, layer.lo = cols, lo

    def _shift(self, by: int) -> None:
        """Move every column by `by` (left < 0 < right): the live columns keep their contents and positions."""
        lo = min((s.start for s in self.slots if s.live), default=self.cols)
        src = slice(lo, self.cols)
        dst = slice(lo + by, self.cols + by)
        for layer in self.layers:
            for buf in (layer.buf_k, layer.buf_v):
                buf[:, :, dst] = buf[:, :, src].clone()
        for s in self.slots:
            s.start += by
        self._set_cols(self.cols + by)

    def make_room(self, need_cols: int, need_after: int) -> None:
        """At least `need_cols` columns before `cols` (a new prompt's length) and `need_after` free after it."""
        live_lo = min((s.start for s in self.slots if s.live), default=self.cols)
        if self.cols + need_after > self.capacity and live_lo > 0:
            self._shift(-live_lo)  # compact: the oldest live column to 0
        if self.cols < need_cols:
            self._shift(need_cols - self.cols)
        if self.cols + need_after > self.capacity:
            raise RuntimeError(
                "continuous batch: cache capacity exceeded"
            )  # capacity is sized so this cannot

    def admit(self, free: list[int], items: list[tuple], params, gen) -> list[tuple[int, int]]:
        """Prefill `items` ((key, ids) each) into the free slots `free`: one left-padded forward, each prompt's
        KV copied to its slot at [cols - P, cols). Returns (slot, first token) per item."""
        width = max(len(ids) for _, ids in items)
        if not self.layers[0].is_initialized:
            self._allocate(width)
        self.make_room(width, 1)
        ids, attn = left_pad([row for _, row in items], 0)
        col = torch.arange(width)
        pad = (width - attn.sum(1))[:, None, None]
        allowed = (col[None, None, :] >= pad) & (col[None, None, :] <= col[None, :, None])
        allowed |= torch.eye(width, dtype=torch.bool)  # padding rows see themselves (no all-masked query)
        positions = (col[None, :] - pad[:, :, 0]).clamp_min(0)
        mask = window_masks(
            self.config, allowed, positions, positions, lambda a: additive_mask(a, self.dtype)
        )
        cache = rollback_cache(self.config)  # every column of every layer kept, sliding ones included
        logits = self.model(
            ids.to(self.device),
            attention_mask=_to(mask, self.device),
            position_ids=positions.to(self.device),
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]
        first = _pick(logits, params, gen)
        out = []
        for r, ((key, row), b) in enumerate(zip(items, free)):
            p = len(row)
            for mine, theirs in zip(self.layers, cache.layers):
                mine.buf_k[b, :, self.cols - p : self.cols] = theirs.keys[r, :, width - p :]
                mine.buf_v[b, :, self.cols - p : self.cols] = theirs.values[r, :, width - p :]
            self.slots[b] = _Slot(key=key, start=self.cols - p, tokens=[])
            if self.recorder is not None:
                self.slots[b].feats.append(self.recorder.rows(r, slice(width - p, width)))
            out.append((b, int(first[r])))
        return out

    def _allocate(self, width: int) -> None:
        probe = rollback_cache(self.config)
        self.model(torch.zeros(1, 1, dtype=torch.long, device=self.device), cache=probe, use_cache=True)
        for mine, theirs in zip(self.layers, probe.layers):
            k, v = theirs.keys, theirs.values
            mine.allocate(len(self.slots), k.shape[1], k.shape[-1], v.shape[-1], k.dtype, self.device)

    def step(self, last: torch.Tensor, params, gen) -> torch.Tensor:
        """One token for every slot (free slots compute a throw-away row) -> next tokens [slots]."""
        self.make_room(0, 1)
        c = self.cols
        starts = torch.tensor([s.start if s.live else c for s in self.slots])
        lo = int(starts.min())
        self._set_cols(c, lo)  # attend over [lo, c]: no live slot holds a column before lo
        col = torch.arange(lo, c + 1)
        allowed = (col[None, :] >= starts[:, None])[:, None, :]  # [slots, 1, c + 1 - lo]: col <= c
        q_pos = (c - starts)[:, None]
        k_pos = col[None, :] - starts[:, None]
        mask = window_masks(self.config, allowed, q_pos, k_pos, lambda a: additive_mask(a, self.dtype))
        logits = self.model(
            last[:, None].to(self.device),
            attention_mask=_to(mask, self.device),
            position_ids=q_pos.to(self.device),
            cache=self.cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]
        self._set_cols(c + 1)
        if self.recorder is not None:
            for b, s in enumerate(self.slots):
                if s.live:
                    s.feats.append(self.recorder.rows(b, slice(0, 1)))
        return _pick(logits, params, gen)


def _to(mask, device):
    return {k: v.to(device) for k, v in mask.items()} if isinstance(mask, dict) else mask.to(device)


def _pick(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> torch.Tensor:
    if params.greedy:
        return logits.argmax(-1).cpu()
    return sample(warp_probs(logits.float(), params), gen).cpu()


@contextlib.contextmanager
def dense_head_input(model):
    """The output head reads a dense copy of its input while this is open. A forward with logits_to_keep hands the
    head hidden[:, -n:], a strided 3-D tensor that torch's CPU matmul cannot fold into one GEMM: it multiplies
    against the head expanded per row instead, a copy of the whole head per row (measured: 27 s for the prefill
    of 16 prompts on Qwen2.5-Coder-1.5B's 151,936-row head in bf16; 1 ms with the copy)."""
    handle = output_head(model).register_forward_pre_hook(lambda _m, args: (args[0].contiguous(), *args[1:]))
    try:
        yield
    finally:
        handle.remove()


@torch.inference_mode()
def answer(
    model,
    prompts: Iterable[tuple[object, list[int]]],
    eos: Iterable[int],
    *,
    max_new_tokens: int,
    slots: int = 64,
    sampling: SamplingParams | None = None,
    seed: int = 0,
    admit_every: int | None = None,
    capture: Sequence[int] | None = None,
    capture_dtype: torch.dtype = torch.bfloat16,
) -> Iterator[Answer]:
    """Answer `prompts` ((key, prompt ids) each, prefilled in the order given: sort them by length for less
    padding) with `model`: yields an Answer as each ends. admit_every: prefill new prompts once this many slots are
    free (default slots // 8, at least 1; fewer, larger prefills waste less on padding). capture: hidden_states
    indices whose states (layer inputs) each Answer carries with the final normed state, over prompt + response,
    in `capture_dtype` -- what a head trains on, taken from the forwards that decode (an answer's slot feeds its
    last token once more for its states)."""
    params = sampling or SamplingParams()
    gen = torch.Generator().manual_seed(seed)
    eos = set(int(e) for e in eos)
    queue = list(prompts)
    if not queue:
        return
    longest = max(len(ids) for _, ids in queue)
    slots = max(1, min(slots, len(queue)))
    recorder = _Recorder(model, capture, capture_dtype) if capture is not None else None
    # room for the longest live sequence and as many columns again before a compaction
    batch = _Batch(model, slots, capacity=2 * (longest + max_new_tokens + 2), recorder=recorder)
    admit_every = max(1, admit_every or slots // 8)
    last = torch.zeros(slots, dtype=torch.long)
    nxt = 0
    try:
        with dense_head_input(model):
            while True:
                free = [b for b, s in enumerate(batch.slots) if not s.live]
                live = len(batch.slots) - len(free)
                if (
                    nxt < len(queue)
                    and free
                    and (len(free) >= admit_every or live == 0 or nxt + len(free) >= len(queue))
                ):
                    take = queue[nxt : nxt + len(free)]
                    nxt += len(take)
                    for b, tok in batch.admit(free[: len(take)], take, params, gen):
                        last[b] = tok
                        yield from _record(batch, b, tok, eos, max_new_tokens)
                    continue
                if live == 0:
                    return
                out = batch.step(last, params, gen)
                for b, s in enumerate(batch.slots):
                    if s.live:
                        last[b] = out[b]
                        yield from _record(batch, b, int(out[b]), eos, max_new_tokens)
    finally:
        if recorder is not None:
            recorder.close()


def _record(batch: _Batch, b: int, tok: int, eos: set, max_new_tokens: int):
    """Slot b's forward gave `tok`: append it to the answer, or, for an answer that ended at the forward before
    (capture: its last token has now been fed), yield the Answer and free the slot."""
    s = batch.slots[b]
    if s.finish is None:
        s.tokens.append(tok)
        if tok in eos or len(s.tokens) >= max_new_tokens:
            s.finish = "stop" if tok in eos else "length"
        if s.finish is None or batch.recorder is not None:
            return
    feats = None
    if batch.recorder is not None:
        feats = {name: torch.cat([f[name] for f in s.feats]) for name in s.feats[0]}
    yield Answer(s.key, s.tokens, s.finish, feats)
    batch.slots[b] = _Slot()
