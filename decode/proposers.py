"""The two model-free / small-model proposers: a draft causal LM and n-gram prompt lookup.

Both are chains (the draft LM a tree with `siblings`) and both decode batches (rows of different lengths, each
accepting its own number of tokens).
Instances are reusable across prompts: `begin()` resets all per-sequence state.
"""

from __future__ import annotations

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.gqa import use_packed_gqa
from draftsmith.modeling import rollback_cache
from draftsmith.sampling import SamplingParams, sample, warp_probs
from draftsmith.vocab import softcap_logits
from draftsmith.woq import DENSE_ROWS, GROUP, quantize_linear, quantize_linears

from .cache import compile_options, crop_to, static_len
from .proposer import Proposal
from .ragged import RaggedCache


class DraftModelProposer:
    """A small causal LM drafting k tokens autoregressively with its own KV cache (Leviathan et al. 2023).

    With a reduced output vocabulary `vocab_ids` [V_d] (target ids of the kept lm_head rows, sorted), draft
    logits are computed over those rows only and mapped back to target ids; q is zero outside them.

    Batches: the draft's cache is a RaggedCache like the target's (left-padded prompts, per-row lengths). Each
    propose first feeds every row's committed tokens the cache lacks (1, or 2 after a full accept or an accepted
    sibling), then drafts one token per forward for all rows; a row whose draft stops early (stop_below) proposes
    fewer tokens.

    Compiled (`compile`): the draft's forward + head run as one torch.compile graph over a StaticCache, one prompt at
    a time. On a CPU, inductor's freezing folds the weights into the graph (oneDNN's blocked copies, what
    draftsmith.cpulayout's packed kernel uses) and fuses the norms, rotary and activation ops that cost a small
    draft as much as its matmuls' dispatch. A run that knows its longest sequence calls `reserve(tokens)` and then
    `warm_up()` before its first request: the buffers are sized once for every prompt of the run and both step
    graphs (one column, several) compile there, so no request compiles (tests/test_compile_buffers.py). Without a
    reservation the buffers hold `CACHE_ROOM` tokens beyond the prompt and serve the next prompts while they fit
    (new buffer lengths recompile the step: measured 32 s inside one 664-token prompt with the Qwen 0.5B in int4);
    a sequence that outgrows them is prefilled again into larger ones (one draft prefill per CACHE_ROOM tokens).
    """

    name = "draft"
    hidden_state_layers: tuple[int, ...] = ()
    adaptive_k = True  # propose(0) drafts nothing and costs nothing; the next propose feeds what it missed
    CACHE_ROOM = 512

    def __init__(
        self,
        model,
        target_vocab_size: int,
        vocab_ids: torch.Tensor | None = None,
        stop_below: float = 0.0,
        compile: bool | str = False,
        bits: int = 0,
        group: int = GROUP,
        siblings: int = 0,
        nodes: int = 0,
    ):
        """stop_below: stop drafting (this step) at the first token whose draft probability (softmax at
        temperature 1 over the draft's outputs) is below it — a dynamic draft length in the spirit of EAGLE-2's
        confidence / SpecDec++'s stopping rule. The decision depends on the draft alone, so verification stays
        lossless; it saves the draft steps and the wider verify forward that would likely be rejected.
        compile: True = inductor (on a CPU with freezing), a backend name = that torch.compile backend (tests trace
        with "aot_eager"); the draft's modules must then keep plain nn.Linears (inductor lays the weights out).
        bits: 4 or 8 = the draft's matmul weights (its layers' and its head's) read as int4 in groups / int8
        (draftsmith.woq, CPU kernels): ~4x / 2x fewer bytes a step; the proposals stay proposals, so decoding stays
        lossless and only acceptance can move. The input embedding keeps its weights (a tied head gets its own
        quantized rows). group: int4's input columns per scale/zero pair.
        siblings: S > 0 turns the chain into a tree at no extra draft forward: beside the chain's token at every
        depth, S alternatives from the same draft distribution, each a leaf under the chain's previous token.
        Greedy: the next S tokens by draft logit (when the target rejects the draft's first choice, its second is
        often the target's); sampling: S more independent draws from q (SpecInfer's multi-candidate rule keeps
        that lossless). A sibling the target accepts ends the round there, so the draft never drafts after it; the
        verify grows to 1 + k (1 + S) tokens, about free while the target's step is bound by its weight reads.
        nodes: N > 0 spends a budget of N drafted nodes instead (the verify block: 1 + N, at least the chain's): the
        chain, then the siblings worth most until the tree holds N, at most S per depth (siblings=S; 3 if not
        given). A sibling's worth is the draft's estimate that the target takes it: the draft probability of the
        chain up to its depth times its own (greedy: its probability under the draft's softmax; sampling: the
        draft's r-th largest probability there, the draws themselves unseen), so the siblings go where the chain
        is unsure and not past a depth the chain is unlikely to reach (EAGLE-2's dynamic tree on a draft LM's
        chain). With stop_below, a row that stops at depth n keeps that depth's candidates (its own drafted token
        first, rated by the draft's largest probabilities there) as leaves that compete for the budget. The counts
        depend on the draft's distributions and the chain only, never on a sibling's draw, so sampling stays
        lossless (the recursive rule's stopping point may depend on the candidates it rejected)."""
        self.model = model
        use_packed_gqa(model)  # a few columns over the cache without repeating its key/value heads
        self.stop_below = float(stop_below)
        self.nodes = int(nodes)
        self.siblings = int(siblings) or (SIBLINGS_PER_DEPTH if self.nodes else 0)
        if self.nodes:
            self.tree = f"chain + siblings by draft confidence to {self.nodes} nodes, {self.siblings} per depth at most"
            self.max_nodes = lambda k: max(k, self.nodes)  # the decoder sizes static caches from it
        elif self.siblings:
            self.tree = f"chain + {self.siblings} sibling(s) per depth"
            self.max_nodes = lambda k: k * (1 + self.siblings)
        self.target_vocab_size = int(target_vocab_size)
        self.device = next(model.parameters()).device
        self.decoder = model.get_decoder()
        self.vocab_ids = None if vocab_ids is None else vocab_ids.to(self.device, torch.long)
        lm_w = model.get_output_embeddings().weight
        # rows the draft may emit: the kept vocabulary (a head of their rows, an nn.Linear so that the decoder's
        # CPU weight layout tunes it like the model's own), or every row the target also has
        self.head = None
        if self.vocab_ids is not None:
            self.head = torch.nn.Linear(lm_w.shape[1], self.vocab_ids.numel(), bias=False, device="meta")
            self.head.weight = torch.nn.Parameter(lm_w[self.vocab_ids].detach(), requires_grad=False)
        self.out_size = (
            self.vocab_ids.numel()
            if self.vocab_ids is not None
            else min(lm_w.shape[0], self.target_vocab_size)
        )
        if bits:
            # a head of its own (the rows the draft may emit), so a tied input embedding keeps its weights
            if self.head is None:
                self.head = torch.nn.Linear(lm_w.shape[1], self.out_size, bias=False, device="meta")
                self.head.weight = torch.nn.Parameter(lm_w[: self.out_size].detach(), requires_grad=False)
            quantize_linears(self.decoder, bits, group)
            self.head = quantize_linear(self.head, bits, group)
        self.compiles = bool(compile)
        self.reserved = 0  # static buffer rows reserved for the run (reserve); 0 = sized per prompt
        self._first = None  # [B, out_size] the draft's logits after the prompts (prefill_prompt)
        self._step, self._freezing, self._warm = None, False, False
        if compile:
            from torch._inductor import config as inductor_config

            self._inductor_config = inductor_config
            # inductor reads `freezing` from its global config when it compiles (a torch.compile options= entry
            # did not reach it: measured 72 vs 58 ms a step for the 0.5B), so each call sets it for its compiles
            self._freezing = compile is True and self.device.type == "cpu"
            how = {} if self._freezing else compile_options(compile)
            self._step = torch.compile(self._last_logits, dynamic=None, **how)

    def reserve(self, tokens: int) -> None:
        """The longest sequence the run decodes (prompt + new tokens + k + 1): a compiled draft sizes its static
        buffers for it once, so every prompt of the run uses the same buffers and the same graphs."""
        if self.compiles:
            self.reserved = static_len(tokens)
            # smaller buffers of an earlier prompt: the next begin allocates the reserved ones
            if getattr(self, "cache", None) is not None and self.cache.kv_len < self.reserved:
                del self.cache

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Compile the step's graphs now (a compiled draft), in the buffers the next prompts use: one column (a
        drafted token), then several (the committed tokens after a full accept; dynamo marks their count dynamic
        at the second length, so a third reuses it), then more than woq.DENSE_ROWS (the tokens an adaptive draft
        length's plain steps left to feed: an int4 Linear takes its dense branch there, a graph of its own; met
        inside a measured prompt, it compiled for 70 s). Nothing for an eager draft."""
        if not self.compiles:
            return
        ids = torch.ones(1, 2 * DENSE_ROWS, dtype=torch.long, device=self.device)
        self.begin(ids[:, :4])
        self._feed_committed()
        rc = self.cache
        for n in (1, 2, 3, 2 * DENSE_ROWS):
            self._run(ids[:, :n].clone(), rc.block_inputs(n, self.model.dtype, self.device), None)
            rc.commit([range(n)], n)

    def prefill_prompt(self) -> None:
        """The prompts' forward now; the first propose drafts from its logits."""
        self._first = self._feed_committed()

    def begin(self, tokens: torch.Tensor, hidden=None, pad: list[int] | None = None) -> None:
        """tokens [B, L] left-padded by `pad` (None: no padding)."""
        pad = pad or [0] * tokens.shape[0]
        if self.compiles and len(pad) > 1:
            raise DraftsmithError(
                "a compiled draft (compile=1) drafts one prompt at a time; use batch size 1 or drop compile="
            )
        self.seq = [row[p:].to(self.device) for row, p in zip(tokens, pad)]  # committed tokens per row
        self._new_cache(tokens, pad)

    def _new_cache(self, tokens: torch.Tensor, pad: list[int], k: int = 0) -> None:
        """An empty cache for prompts `tokens` [B, L], fed by the next propose (static buffers: room for k drafted
        tokens and CACHE_ROOM more)."""
        if self.compiles:
            need = tokens.shape[1] + k + (0 if self.reserved else self.CACHE_ROOM)
            static = getattr(self, "cache", None)
            # the same buffers again while they fit (the graph's shapes hold); larger ones recompile the step once
            if static is not None and static.kv_len >= need:
                crop_to(static.cache, 0, current=static.cols)
                static, room = static.cache, static.kv_len
            else:
                room = max(static_len(need), self.reserved)
                static = rollback_cache(self.model.config, room)
            self.cache = RaggedCache(static, pad, kv_len=room, config=self.model.config)
        else:
            self.cache = RaggedCache(rollback_cache(self.model.config), pad, config=self.model.config)
        self.prefill = tokens.to(self.device)
        self._first = None

    def _last_logits(self, ids: torch.Tensor, cache, **kw) -> torch.Tensor:
        """Draft logits [B, out_size] after the last column of ids [B, n]: the compiled step (one graph)."""
        return self._head(self.decoder(ids, cache=cache, use_cache=True, **kw).last_hidden_state[:, -1])

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        """Hidden rows [B, H] -> draft logits [B, out_size]."""
        if self.head is not None:
            return softcap_logits(self.model.config, self.head(h))
        return softcap_logits(self.model.config, self.model.get_output_embeddings()(h)[:, : self.out_size])

    def retain(self, rows: list[int]) -> None:
        if self.prefill is not None:  # a row ended before the prompts were fed: drop it there
            trim = min(self.cache.pads[r] for r in rows)
            self.prefill = self.prefill[torch.tensor(rows, device=self.prefill.device), trim:]
        self.cache.retain(rows)
        self.seq = [self.seq[r] for r in rows]
        self._first = None if self._first is None else self._first[rows]

    def _run(
        self, ids: torch.Tensor, kw: dict, last: list[int] | None, prefill: bool = False
    ) -> torch.Tensor:
        """Feed ids [B, n] (positions/mask in kw) -> draft logits [B, out_size] at column last[b] of each row
        (None: the last column).

        The model's own forward runs only for one column: with several (a prompt, two tokens after a full accept)
        its logits_to_keep slice reaches the lm_head as a strided 3-D tensor, and a CPU then copies the whole head
        for the product (~0.45 s for a 150k-row head in bf16, against ~11 ms from the [B, H] rows used here)."""
        # compiled: one row (begin), its last column; prompts run eagerly (a graph per length otherwise)
        if self.compiles:
            if prefill:
                logits = self._last_logits(ids, self.cache.cache, **kw)
                if self._freezing:  # the buffers exist now (HF allocates them at the first update)
                    _unmark_static(self.cache.cache)
                return logits
            # new buffer lengths (longer prompts, regrowth) add graphs: past dynamo's recompile_limit (8) the step
            # would fall back to eager silently, with the plain Linears a compiled draft keeps
            with (
                self._inductor_config.patch(freezing=self._freezing),
                _DYNAMO.patch(recompile_limit=RECOMPILE_LIMIT),
            ):
                return self._step(ids, self.cache.cache, **kw)
        if self.head is None and last is None and ids.shape[1] == 1:
            return self.model(ids, cache=self.cache.cache, use_cache=True, **kw).logits[
                :, -1, : self.out_size
            ]
        h = self.decoder(ids, cache=self.cache.cache, use_cache=True, **kw).last_hidden_state
        h = (
            h[:, -1]
            if last is None
            else h[torch.arange(h.shape[0], device=h.device), torch.tensor(last, device=h.device)]
        )
        return self._head(h)

    def _feed_committed(self) -> torch.Tensor:
        """Put every row's committed tokens the cache lacks into it; -> logits [B, out_size] after the last."""
        rc, dtype = self.cache, self.model.dtype
        if self.prefill is not None:  # the prompts: left-padded, one forward
            ids, self.prefill = self.prefill, None
            # a compiled step has two graphs, one column and several (dynamo specialises a length of 1); the first
            # prompt feeds its last 3 tokens through both, so they compile now, in whatever warm-up the caller runs,
            # and not at the first full accept of a later, timed prompt
            tail = 3 if self.compiles and not self._warm and ids.shape[1] > 3 else 0
            self._warm = self._warm or tail > 0
            width = ids.shape[1] - tail
            logits = self._run(
                ids[:, :width], rc.prefill_inputs(width, dtype, self.device), None, prefill=True
            )
            rc.prefilled(width)
            for n in (1, 2)[: 2 if tail else 0]:  # 1 first: a length-2 graph after it is the dynamic one
                # fresh strides, as later steps' inputs have (dynamo guards on strides, size-1 dims too)
                part = ids[:, width : width + n].clone(memory_format=torch.contiguous_format)
                logits = self._run(part, rc.block_inputs(n, dtype, self.device), None)
                rc.commit([range(n)], n)
                width += n
            if all(len(s) == n - p for s, n, p in zip(self.seq, rc.lengths, rc.pads)):
                return logits
            # tokens committed since begin (plain steps of an adaptive draft length): fed after the prompts
        counts = [len(s) - (n - p) for s, n, p in zip(self.seq, rc.lengths, rc.pads)]
        width = max(counts)
        ids = torch.zeros(len(counts), width, dtype=torch.long, device=self.device)
        for b, (s, c) in enumerate(zip(self.seq, counts)):
            ids[b, :c] = s[len(s) - c :]
        kw = rc.block_inputs(width, dtype, self.device)
        logits = self._run(ids, kw, None if min(counts) == width else [c - 1 for c in counts])
        rc.commit([range(c) for c in counts], width)
        return logits

    def _to_target(self, idx: torch.Tensor) -> torch.Tensor:
        return idx if self.vocab_ids is None else self.vocab_ids[idx]

    def propose(self, k: int, params: SamplingParams, generator: torch.Generator | None = None) -> Proposal:
        B = len(self.seq)
        first, self._first = self._first, None
        # a plain step (adaptive draft length): no draft work; the next propose feeds what it missed
        if k == 0:
            self.base, self.proposed = list(self.cache.lengths), [0] * B
            return Proposal.empty(B, self.device)
        if self.compiles and len(self.seq[0]) + k > self.cache.kv_len:  # drafting would outgrow the buffers:
            self._new_cache(self.seq[0][None], [0], k)  # prefill the sequence into larger ones
            first = None
        logits = first if first is not None else self._feed_committed()
        self.base = list(self.cache.lengths)
        sizes = [k] * B  # drafted tokens per row (a confidence stop shortens a row)
        # per depth: [B] chain tokens, [B, V] q (sampling), [B, S] sibling candidates (greedy: target ids; sampling:
        # the q they are drawn from), the draft's largest S + 1 probabilities [B, S + 1] and the chain token's [B]
        tokens, probs, alts, alt_p, conf = [], [], [], [], []
        for i in range(k):
            if i > 0:  # the previous token goes into the cache; its logits give this one
                rc = self.cache
                logits = self._run(
                    tokens[-1][:, None], rc.block_inputs(1, self.model.dtype, self.device), None
                )
                rc.commit([[0]] * B, 1)
            unsure = None
            # the draft's softmax, once a depth, for the confidence stop and a greedy budget's worths
            soft = (
                torch.softmax(logits.float(), -1)
                if self.stop_below > 0.0 or (self.nodes and params.greedy)
                else None
            )
            if self.stop_below > 0.0:
                unsure = (soft.amax(-1) < self.stop_below).tolist()
                sizes = [i if u and s == k else s for u, s in zip(unsure, sizes)]
                if all(s < k for s in sizes) and not self.nodes:
                    break  # every row stopped: the cache holds the last drafted token, advance() crops it
            if params.greedy:
                idx = logits.argmax(-1)  # [B]
                if self.siblings:  # the next best tokens after the chain's own
                    alt = logits.scatter(-1, idx[:, None], float("-inf")).topk(self.siblings, -1)
                    alts.append(self._to_target(alt.indices))
                    if self.nodes:  # the draft's largest S + 1 probabilities, the chain token's
                        alt_p.append(soft.topk(self.siblings + 1, -1).values)
                        conf.append(soft.gather(1, idx[:, None])[:, 0])
            else:
                q = warp_probs(logits, params)  # [B, out_size]: the distribution the token is drawn from
                idx = sample(q, generator)
                if self.siblings:  # the draws come once their number is known (_with_siblings)
                    alts.append(q)
                    if self.nodes:
                        alt_p.append(q.topk(self.siblings + 1, -1).values.float())
                        conf.append(q.gather(1, idx[:, None])[:, 0].float())
                full = q.new_zeros(q.shape[0], self.target_vocab_size)
                if self.vocab_ids is not None:
                    full.index_copy_(1, self.vocab_ids, q)
                else:
                    full[:, : self.out_size] = q
                probs.append(full)
            tokens.append(self._to_target(idx))
            if unsure is not None and all(s < k for s in sizes):
                break  # (nodes=) every row stopped, with its unsure depth's candidates at hand
        self.proposed = sizes
        if self.nodes:  # the chain, and leaves where the budget puts them (a stopped row's unsure depth too)
            top = torch.stack(alt_p, 1)  # [B, w, S + 1]
            cand = top[:, :, 1:].clone()  # beside a chain token: the next S probabilities
            opened = [n < k for n in sizes]
            # where a row stopped, its own drafted token comes first: the S largest probabilities there (the
            # draw's own probability would make its inclusion depend on the draw)
            for b, n in enumerate(sizes):
                if opened[b]:
                    cand[b, n] = top[b, n, :-1]
            counts = sibling_counts(torch.stack(conf, 1), cand, sizes, self.nodes, opened)
            q = torch.stack(probs, 1) if probs else None
            return self._with_siblings(
                torch.stack(tokens, 1), q, torch.stack(alts, 1), counts, sizes, generator
            )
        width = max(sizes)
        if width == 0:
            return Proposal.empty(B, self.device)
        toks = torch.stack(tokens[:width], 1)
        q = torch.stack(probs[:width], 1) if probs else None
        if not self.siblings:
            return Proposal.chain(toks, q, None if min(sizes) == width else sizes)
        counts = [[self.siblings] * n for n in sizes]
        return self._with_siblings(toks, q, torch.stack(alts[:width], 1), counts, sizes, generator)

    def _with_siblings(
        self,
        toks: torch.Tensor,
        q: torch.Tensor | None,
        alts: torch.Tensor,
        counts: list[list[int]],
        sizes: list[int],
        generator: torch.Generator | None,
    ) -> Proposal:
        """Row b's chain toks[b, :sizes[b]] with counts[b][d] leaves beside its depth d: its nodes are its chain,
        then depth 1's leaves, depth 2's, ... (each a child of the chain node before its depth); rows with the same
        tree share one parents list (Proposal.stack). A row stopped at depth n (stop_below) may have leaves at
        depth n too (counts[b] one longer than its chain): there the first leaf is its own drafted token toks[b, n],
        never fed to the draft, and the rest are siblings. alts: greedy, the candidates [B, w, S] by rank;
        sampling (q given), the draft-vocabulary q [B, w, V_d] each depth's siblings are drawn from,
        independently (a stopped depth's own token was drawn from it too)."""

        def one(b: int, per_depth: list[int]) -> Proposal:
            n = sizes[b]
            sib = []
            for d, c in enumerate(per_depth):
                # a stopped depth (d == n): its own drafted token is the first leaf
                own = toks[b, d : d + 1] if d == n and c else toks[b, :0]
                c -= own.numel()
                if q is None:
                    sib += [own, alts[b, d, :c]]
                else:
                    drawn = sample(alts[b, d].expand(c, -1), generator) if c else toks[b, :0]
                    sib += [own, self._to_target(drawn)]
            tokens = torch.cat([toks[b, :n], *sib])[None]
            leaves = torch.tensor(per_depth, device=toks.device)
            m = len(per_depth)
            probs = None if q is None else torch.cat([q[b, :n], q[b, :m].repeat_interleave(leaves, 0)])[None]
            parents = list(range(-1, n - 1)) + [d - 1 for d, c in enumerate(per_depth) for _ in range(c)]
            return Proposal(tokens, parents, probs)

        if not any(map(sum, counts)) and max(sizes) == 0:
            return Proposal.empty(len(sizes), self.device)
        return Proposal.stack([one(b, c) for b, c in enumerate(counts)])

    def advance(self, accepted_nodes: list[list[int]], new_tokens: torch.Tensor, hidden=None) -> None:
        # per row the cache holds the committed tokens + the drafted tokens fed after them (all but the last
        # drafted one); only drafted[:a] stays valid, and at most drafted[:n-1] is known to be there (no recompute)
        # (a sibling, index >= n, is a leaf the draft never fed: it counts as the first token to feed)
        keep = [
            min(base + min(sum(i < n for i in acc), max(n - 1, 0)), length)
            for base, acc, n, length in zip(self.base, accepted_nodes, self.proposed, self.cache.lengths)
        ]
        self.cache.set_lengths(keep)
        new = new_tokens.to(self.device)
        self.seq = [
            torch.cat([s, new[b, : len(acc) + 1]]) for b, (s, acc) in enumerate(zip(self.seq, accepted_nodes))
        ]


SIBLINGS_PER_DEPTH = 3
"""`nodes=` without `siblings=`: the most siblings one depth may get."""


def sibling_counts(
    conf: torch.Tensor, alt_p: torch.Tensor, sizes: list[int], nodes: int, opened: list[bool] | None = None
) -> list[list[int]]:
    """How many leaves each depth of each row gets under a budget of `nodes` drafted nodes: the chain's sizes[b]
    first, then the candidates of highest worth. conf [B, w]: the draft probability of each chain token; alt_p
    [B, w, S]: each depth's candidates' probabilities, largest first. A candidate at depth d is worth the chain's
    probability of reaching d (the product of conf before d) times its own; a depth's candidates are taken largest
    first, so the chosen ones are a prefix of each depth's (ties go to the shallower depth). opened[b]: row b's
    depth sizes[b] (where its draft stopped) has candidates too, and its list of counts is one longer."""
    reach = torch.cat([conf.new_ones(conf.shape[0], 1), conf[:, :-1].cumprod(1)], 1)  # [B, w]
    worth = (reach[:, :, None] * alt_p).detach().cpu()
    out = []
    for b, n in enumerate(sizes):
        room, S = max(0, nodes - n), alt_p.shape[-1]
        depths = n + bool(opened and opened[b])
        taken = [0] * depths
        if room and depths:
            flat = worth[b, :depths].flatten().tolist()
            # a stable order: equal worth keeps depth order, and within a depth the rank order
            order = sorted(range(len(flat)), key=lambda i: (-flat[i], i))[:room]
            for i in order:
                taken[i // S] += 1
        out.append(taken)
    return out


RECOMPILE_LIMIT = 64
"""Graphs the compiled drafts of a process may build (2 per draft and buffer length; dynamo counts them per code
object, and every draft's step is this one method's) before dynamo runs the step eagerly. Its default, 8, let the
fifth compiled draft of a process draft eagerly with the plain Linears a compiled draft keeps (measured on tiny
models: 8 graphs, then none): a frozen draft's weights are graph constants, guarded by identity."""
_DYNAMO = torch._dynamo.config


def _unmark_static(cache) -> None:
    """HF's StaticCache marks its buffers as static addresses (for CUDA graphs); inductor's freezing folds static
    inputs into the graph as constants, so a compiled step kept writing the FIRST cache it saw (measured: the next
    prompt's step indexed the old 768-row buffer and failed). Unmarked, they stay inputs of the graph."""
    for layer in cache.layers:
        for t in (layer.keys, layer.values, layer.cumulative_length):
            if hasattr(t, "_dynamo_static_input_type"):
                del t._dynamo_static_input_type


class NGramProposer:
    """Prompt lookup (Saxena 2023; transformers `prompt_lookup_num_tokens`, vLLM `ngram`): find the most recent
    earlier occurrence of the last n tokens (n = max_n .. min_n) in the context and propose what followed it.
    Each row of a batch looks up its own context."""

    name = "ngram"
    hidden_state_layers: tuple[int, ...] = ()
    adaptive_k = True  # propose(0) looks nothing up; advance keeps the context whole

    def __init__(self, max_n: int = 3, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            from draftsmith.errors import DraftsmithError

            raise DraftsmithError(
                f"ngram needs 1 <= min <= max, got min={min_n} max={max_n}; e.g. ngram:max=3,min=1"
            )
        self.max_n, self.min_n = max_n, min_n

    def begin(self, tokens: torch.Tensor, hidden=None, pad: list[int] | None = None) -> None:
        self.device = tokens.device
        pad = pad or [0] * tokens.shape[0]
        # lookup runs on the host: tiny integer work
        self.rows = [_Context(row[p:].detach().to("cpu", torch.long)) for row, p in zip(tokens, pad)]

    def retain(self, rows: list[int]) -> None:
        self.rows = [self.rows[r] for r in rows]

    def propose(self, k: int, params: SamplingParams | None = None, generator=None) -> Proposal:
        found = [row.lookup(k, self.max_n, self.min_n) for row in self.rows]
        if len(found) == 1:
            return (
                Proposal.chain(found[0][None].to(self.device))
                if found[0].numel()
                else Proposal.empty(1, self.device)
            )
        width = max(f.numel() for f in found)
        if width == 0:
            return Proposal.empty(len(found), self.device)
        toks = torch.zeros(len(found), width, dtype=torch.long)
        for b, f in enumerate(found):
            toks[b, : f.numel()] = f
        sizes = [f.numel() for f in found]
        return Proposal.chain(toks.to(self.device), None, None if min(sizes) == width else sizes)

    def advance(self, accepted_nodes: list[list[int]], new_tokens: torch.Tensor, hidden=None) -> None:
        new = new_tokens.to("cpu", torch.long)
        for row, acc, toks in zip(self.rows, accepted_nodes, new):
            row.append(toks[: len(acc) + 1])


class _Context:
    """One row's committed tokens in a geometrically grown host buffer."""

    def __init__(self, tokens: torch.Tensor):
        self.buf, self.len = tokens.clone(), tokens.numel()

    def lookup(self, k: int, max_n: int, min_n: int) -> torch.Tensor:
        """What followed the most recent earlier occurrence of the longest matching suffix (up to k tokens)."""
        ctx, L = self.buf, self.len
        for n in range(min(max_n, L - 1), min_n - 1, -1):
            # windows over ctx[:L-1] so every match has at least one following token
            windows = ctx[: L - 1].unfold(0, n, 1)  # [L-n, n]
            hits = (windows == ctx[L - n : L]).all(1).nonzero()
            if hits.numel():
                start = int(hits[-1]) + n
                return ctx[start : min(start + k, L)]
        return ctx[:0]

    def append(self, new: torch.Tensor) -> None:
        if self.len + new.numel() > self.buf.numel():  # grow geometrically, not per step
            grown = torch.empty(max(2 * self.buf.numel(), self.len + new.numel()), dtype=torch.long)
            grown[: self.len] = self.buf[: self.len]
            self.buf = grown
        self.buf[self.len : self.len + new.numel()] = new
        self.len += new.numel()
