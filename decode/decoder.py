"""Speculative decoding of a batch of prompts, and plain decoding through the same code.

Invariant between steps: the target's KV cache holds every committed token of every row except its last one (the
row's "root"); a step runs ONE target forward over [root, node_1 .. node_N] of every row (tree mask, position =
the row's length + depth), accepts a path of a_b nodes per row, rolls each row's cache back to root + accepted
nodes (decode.ragged: a crop for a lone chain, a gather then crop otherwise; no recomputation) and commits
a_b + 1 tokens per row. Rows that stop (EOS, stop string, length) leave the batch, so they cost nothing after.
Plain decoding is the same step with an empty proposal, so the baseline pays exactly the same per-step overhead.
A batch of one is exactly the batch-1 decoder: no mask, a crop, lengths tracked on the host.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import transformers

from draftsmith.cpulayout import TunedLinear
from draftsmith.errors import DraftsmithError
from draftsmith.gqa import use_packed_gqa
from draftsmith.modeling import last_rows, rollback_cache
from draftsmith.models import eos_token_ids
from draftsmith.sampling import SamplingParams, sample, warp_probs

from .adaptive import AdaptiveK
from .cache import compile_options, static_len
from .proposer import Proposal, Proposer, node_depths, proposal_nodes
from .ragged import RaggedCache, committed_tokens, kept_hidden, verify_inputs
from .results import BatchResult, GenerationResult
from .rowwise import batched
from .verify import verify_rows

# forward(cache=...) arrived in transformers 5.24 (before: past_key_values=)
_TRANSFORMERS_TOO_OLD = tuple(int(x) for x in transformers.__version__.split(".")[:2]) < (5, 24)


@dataclass
class _Run:
    """The state of one `generate_batch` call, shared by its steps."""

    proposer: Proposer | None
    params: SamplingParams
    layers: tuple[int, ...]
    verify_gen: torch.Generator
    draft_gen: torch.Generator
    out: BatchResult
    active: list[int]  # the prompts still decoding, in batch order
    t0: float = 0.0
    ragged: RaggedCache | None = None
    last: torch.Tensor | None = None  # [B] each row's last committed token (the next block's root)
    prefill_hidden: tuple | None = None
    paths: list[list[int]] = field(default_factory=list)  # the accepted nodes of the last step, per row
    new: torch.Tensor | None = None  # [B, A] the tokens the last step committed, per row (right-padded)
    policy: AdaptiveK | None = None  # the draft length per step (batch 1), or None: k every step


class SpeculativeDecoder:
    """Wraps a HF causal LM target. `generate(ids, proposer)` for one prompt, `generate_batch(prompts, proposer)` for
    several; proposer None = plain decoding."""

    def __init__(
        self,
        target,
        tokenizer=None,
        *,
        eos_ids: set[int] | None = None,
        stop_strings=(),
        compile: bool | str = False,
        static_cache: bool = False,
    ):
        self.target = target
        if _TRANSFORMERS_TOO_OLD:  # it would drop the KV cache we pass as cache= and decode garbage, silently
            raise DraftsmithError(
                f"transformers {transformers.__version__} is too old for the decoder; pip install 'transformers>=5.24'"
            )
        # compile: a StaticCache (buffers allocated once, rollback = moving its length, HF StaticLayer.crop) plus
        # torch.compile of the target's decode/verify step, gpt-fast style. True = inductor with CUDA graphs (mode
        # reduce-overhead; tests/test_gpu.py); a backend name ("aot_eager", "eager") traces the same step without
        # code generation (the CPU tests, tests/test_compile.py). The prefill stays eager: prompt lengths vary and
        # each would be a new graph. dynamic=None: the first step length compiles static, a second marks lengths
        # dynamic, so plain steps, chains and trees share a few graphs instead of one per length (dynamic=False
        # recompiled per draft length until the recompile limit, then fell back to eager).
        self.static = bool(compile) or static_cache
        use_packed_gqa(target)  # verify blocks and compiled steps attend without repeating the cache's heads
        self._forward_fn = target
        if compile:
            self._forward_fn = torch.compile(target.forward, dynamic=None, **compile_options(compile))
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids if eos_ids is not None else set(eos_token_ids(target, tokenizer))
        self.stop_strings = tuple(stop_strings)
        if self.stop_strings and tokenizer is None:
            raise DraftsmithError("stop strings need a tokenizer; pass tokenizer= to SpeculativeDecoder")
        cfg = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
        self.config = cfg
        self.max_positions = int(getattr(cfg, "max_position_embeddings", 0) or 0)
        self.device = next(target.parameters()).device
        self._sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        self._head_t = self._cpu_head() if not compile else None
        self.reserved = 0  # static cache rows reserved for the run (reserve); 0 = sized per prompt

    def reserve(self, tokens: int) -> None:
        """The longest sequence the run decodes (prompt + new tokens + the widest verify block): static caches are
        all this long, so prompts of any length up to it run the compiled step's graphs of the first (a new cache
        length would compile again inside a request). No effect without a static cache."""
        self.reserved = static_len(tokens) if self.static else 0

    @torch.inference_mode()
    def _cpu_head(self) -> torch.Tensor | None:
        """CPU only: the lm_head as a contiguous [H, V] matrix. `h @ W^T` with W stored [V, H] takes a GEMM path
        that costs ~2x more for 5-11 rows than for 1 (measured: 52 vs 25 ms at 5 rows, smollm2 head, 2 cores);
        with the transposed copy 5 rows cost ~1.4x one row, so verifying k+1 tokens stays near one plain step.
        Used only if it reproduces the model's own logits exactly on a probe (no bias/softcap/scaling surprises)
        and the copy is small; plain and speculative decoding both use it, so comparisons stay like for like.
        Not for a head draftsmith.cpulayout tuned: its layout and kernels were measured on this machine, this copy's
        was not (Qwen2.5-Coder-1.5B's bf16 head on a Zen 4: 76 ms a row through the copy, 47 ms row-major)."""
        head = self.target.get_output_embeddings()
        if self.device.type != "cpu" or not isinstance(head, torch.nn.Linear) or head.bias is not None:
            return None
        if isinstance(head, TunedLinear):
            return None
        if head.weight.numel() * head.weight.element_size() > (512 << 20):
            return None
        head_t = head.weight.t().contiguous()
        probe = torch.tensor([[1, 2, 3]], device=self.device)
        ref = self.target(probe).logits
        got = self.target.get_decoder()(probe).last_hidden_state @ head_t
        return head_t if torch.allclose(ref, got, atol=1e-4, rtol=1e-4) else None

    def _cache_len(self, tokens: int) -> int:
        """Rows of a cache for `tokens` tokens: static caches come in whole 256s (cache.static_len), so prompts of
        similar length (and decode.speed.measure_forward_costs) share the compiled step's shapes."""
        return max(static_len(tokens), self.reserved) if self.static else tokens

    def _new_cache(self, max_len: int):
        return rollback_cache(self.target.config, max_len if self.static else None)

    def _forward(self, ids, cache, layers, logits_to_keep: int = 0, eager: bool = False, **kw):
        """Target forward -> (logits [B, n, V] for the last `logits_to_keep` rows (0 = all), hidden per layer).
        eager: bypass the compiled step (the prefill)."""
        if self._head_t is not None:
            out = self.target.get_decoder()(
                ids, cache=cache, use_cache=True, output_hidden_states=bool(layers), **kw
            )
            h = out.last_hidden_state
            logits = (last_rows(h, logits_to_keep) if logits_to_keep else h) @ self._head_t
        else:
            out = (self.target if eager else self._forward_fn)(
                ids,
                cache=cache,
                use_cache=True,
                output_hidden_states=bool(layers),
                logits_to_keep=logits_to_keep,
                **kw,
            )
            logits = out.logits
        hidden = tuple(out.hidden_states[i] for i in layers) if layers else None
        return logits, hidden

    @torch.inference_mode()
    def generate(
        self,
        input_ids: torch.Tensor,
        proposer: Proposer | None = None,
        *,
        k: int | AdaptiveK = 4,
        params: SamplingParams | None = None,
        max_new_tokens: int = 128,
        seed: int = 0,
    ) -> GenerationResult:
        """input_ids: [1, T] prompt ids. Returns the generated ids and per-step acceptance statistics. k: draft
        tokens per step, or an AdaptiveK policy choosing each step's (decode.adaptive; its decisions in k_policy)."""
        if input_ids.dim() == 2 and input_ids.shape[0] != 1:
            raise DraftsmithError(
                f"generate decodes one prompt ([1, T]), got a batch of {input_ids.shape[0]}; "
                "pass a list of prompts to generate_batch"
            )
        out = self.generate_batch(
            [input_ids.reshape(-1)], proposer, k=k, params=params, max_new_tokens=max_new_tokens, seed=seed
        )
        res = out.rows[0]
        res.time_total, res.time_prefill, res.time_draft = out.time_total, out.time_prefill, out.time_draft
        res.time_draft_prefill = out.time_draft_prefill
        return res

    @torch.inference_mode()
    def generate_batch(
        self,
        prompts: Sequence[torch.Tensor],
        proposer: Proposer | None = None,
        *,
        k: int | AdaptiveK = 4,
        params: SamplingParams | None = None,
        max_new_tokens: int = 128,
        seed: int = 0,
    ) -> BatchResult:
        """Decode B prompts (token ids [T_b] each, any lengths) together: each row accepts its own number of draft
        tokens per step, and a row that stops (EOS, stop string, length) leaves the batch. Returns one
        GenerationResult per prompt (in order) and the batch's costs."""
        params = params if params is not None else SamplingParams()  # greedy
        proposer = batched(proposer)  # a single-row proposer drafts each row with its own copy
        policy, k = (k, k.k_max) if isinstance(k, AdaptiveK) else (None, k)
        ids, pads = self._check(prompts, proposer, k, max_new_tokens)
        if policy is not None:
            self._check_adaptive(prompts, proposer)
            policy.start()
        run = _Run(
            proposer=proposer,
            params=params,
            layers=tuple(proposer.hidden_state_layers) if proposer is not None else (),
            verify_gen=torch.Generator().manual_seed(2 * seed),  # host walk in verify_sampling
            draft_gen=torch.Generator(device=self.device).manual_seed(2 * seed + 1),  # independent streams
            out=BatchResult([GenerationResult(tokens=[], prompt_len=len(p.reshape(-1))) for p in prompts]),
            active=list(range(len(prompts))),
            policy=policy,
        )
        self._sync()
        t0 = run.t0 = time.perf_counter()
        self._prefill(run, ids, pads, k, max_new_tokens)
        run.out.time_prefill = time.perf_counter() - t0
        self._begin_draft(run, ids, pads)
        self._retain(run, self._ended(run, [1] * len(prompts), max_new_tokens))
        while run.active:
            n_new, hidden = self._step(run, k, max_new_tokens)
            keep = self._ended(run, n_new, max_new_tokens)
            if keep and proposer is not None:
                self._timed_draft(run, proposer.advance, run.paths, run.new, hidden)
            self._retain(run, keep)
        self._sync()
        run.out.time_total = time.perf_counter() - t0
        if policy is not None:
            run.out.rows[0].k_policy = policy.summary()
        return run.out

    @staticmethod
    def _check_adaptive(prompts, proposer) -> None:
        if len(prompts) > 1:
            raise DraftsmithError(
                "an adaptive draft length (k auto) decodes one prompt at a time; use batch size 1"
            )
        if proposer is not None and not getattr(proposer, "adaptive_k", False):
            raise DraftsmithError(
                f"drafter {proposer.name!r} cannot skip drafting for a step, which an adaptive draft length (k auto) "
                "needs; use a fixed k, or a draft: or ngram: drafter"
            )

    def _check(self, prompts, proposer, k: int, max_new_tokens: int) -> tuple[torch.Tensor, list[int]]:
        """-> (prompts left-padded to one width [B, T], padding per row). Refuses what the decoder cannot run."""
        if k < 1:
            raise DraftsmithError(f"k must be >= 1 (draft tokens per step), got {k}")
        rows = [p.reshape(-1) for p in prompts]
        if not rows or min(len(r) for r in rows) < 1:
            raise DraftsmithError("every prompt needs at least one token")
        if len(rows) > 1 and self.static:
            raise DraftsmithError(
                "the static cache (--compile) decodes one prompt at a time; use batch size 1"
            )
        if len(rows) > 1 and proposer is not None and not hasattr(proposer, "retain"):
            raise DraftsmithError(
                f"drafter {proposer.name!r} cannot decode a batch; use batch size 1 (--batch-size 1)"
            )
        T = max(len(r) for r in rows)
        if self.max_positions and T + max_new_tokens + k + 1 > self.max_positions:
            raise DraftsmithError(
                f"prompt ({T} tokens) + max_new_tokens ({max_new_tokens}) + k + 1 exceeds the target's context "
                f"({self.max_positions}); shorten the prompt or lower --max-new-tokens"
            )
        pads = [T - len(r) for r in rows]
        ids = torch.stack([torch.cat([r.new_zeros(T - len(r)), r]) for r in rows])  # left padding (masked)
        return ids.to(self.device), pads

    def _prefill(self, run: _Run, ids: torch.Tensor, pads: list[int], k: int, max_new_tokens: int) -> None:
        """The prompts' forward; the first token of every row comes from the target alone (as in plain decoding)."""
        T = ids.shape[1]
        # a tree block briefly occupies 1 + N cache rows before compaction (static buffers must hold them)
        nodes = proposal_nodes(run.proposer, k)
        max_len = self._cache_len(T + max_new_tokens + 1 + nodes)
        kv_len = max_len if self.static else None
        run.ragged = RaggedCache(self._new_cache(max_len), pads, kv_len=kv_len, config=self.target.config)
        kw = run.ragged.prefill_inputs(T, self.target.dtype, self.device)
        logits, run.prefill_hidden = self._forward(ids, run.ragged.cache, run.layers, 1, eager=True, **kw)
        run.ragged.prefilled(T)
        run.out.forward_rows.append(len(pads))
        run.last = self._pick(logits[:, -1], run.params, run.verify_gen)  # [B]
        for res, tok in zip(run.out.rows, run.last.tolist()):  # tolist() waits for the prefill on any device
            res.tokens.append(tok)
            res.target_forwards = 1

    def _begin_draft(self, run: _Run, ids: torch.Tensor, pads: list[int]) -> None:
        proposer = run.proposer
        if proposer is None:
            return
        t = run.out.time_draft
        if hasattr(proposer, "attach"):  # self-speculative drafters draft on the target's own KV cache
            self._timed_draft(run, proposer.attach, self, run.ragged)
        tokens = torch.cat([ids, run.last[:, None]], 1)
        if any(pads):
            self._timed_draft(run, proposer.begin, tokens, run.prefill_hidden, pads)
        else:
            self._timed_draft(run, proposer.begin, tokens, run.prefill_hidden)
        if hasattr(proposer, "prefill_prompt"):  # its prompt's forward now, timed apart from drafting
            self._timed_draft(run, proposer.prefill_prompt)
        run.out.time_draft_prefill = run.out.time_draft - t
        run.prefill_hidden = None

    def _timed_draft(self, run: _Run, fn, *args):
        """Call a proposer hook, adding its time (device work included) to the drafting time."""
        td = time.perf_counter()
        out = fn(*args)
        self._sync()
        run.out.time_draft += time.perf_counter() - td
        return out

    def _step(self, run: _Run, k: int, max_new_tokens: int) -> tuple[list[int], tuple | None]:
        """One speculative step (gpt-fast's `speculative_decode`) for every row of the batch: draft, verify every
        row's root and nodes in ONE target forward, accept a path per row, roll each row's cache back to it.
        Returns (tokens committed per row, the hidden rows that predicted them, for the proposer). A plain step is
        the same with an empty proposal."""
        rows = [run.out.rows[i] for i in run.active]
        room = [max_new_tokens - len(r.tokens) - 1 for r in rows]  # draft tokens each row may still commit
        policy = run.policy
        kk = min(k if policy is None else policy.choose(), max(room))
        proposer, B = run.proposer, len(rows)
        drafting = run.out.time_draft
        # under a policy even k = 0 goes to the proposer: it marks a step without draft work (adaptive_k)
        if proposer is not None and (kk > 0 or policy is not None):
            proposal = self._timed_draft(run, proposer.propose, kk, run.params, run.draft_gen)
        else:
            proposal = Proposal.empty(B, self.device)
        depths = self._check_proposal(proposal, B, kk, proposer)
        block = torch.cat([run.last[:, None], proposal.tokens.to(self.device)], 1)  # [B, 1 + N]
        # a self-speculative proposer may verify reusing its shared-layer rows (None: nothing to reuse)
        shared = proposer.verify_forward(block, proposal) if hasattr(proposer, "verify_forward") else None
        if shared is None:
            kw = verify_inputs(run.ragged, proposal, depths, self.target.dtype, self.device)
            shared = self._forward(block, run.ragged.cache, run.layers, **kw)
        logits, hidden = shared
        run.out.forward_rows.append(B)
        run.out.step_depths.append(max((max(d, default=0) for d in depths), default=0))
        paths, last = verify_rows(logits, proposal, run.params, run.verify_gen)
        if policy is not None:
            policy.observe(max(depths[0], default=0), len(paths[0]), run.out.time_draft - drafting)
        for b, cap in enumerate(room):  # a row near its length limit keeps what it may still emit
            if len(paths[b]) > cap:
                last[b] = proposal.tokens[b, paths[b][cap]]
                paths[b] = paths[b][:cap]
        run.ragged.commit([[0, *(1 + i for i in p)] for p in paths], block.shape[1])
        run.paths, run.last = paths, last.to(self.device)
        run.new = committed_tokens(proposal, paths, run.last)  # [B, A]: each row's accepted tokens + its next
        for b, (res, path) in enumerate(zip(rows, paths)):
            res.accepted.append(len(path))
            res.proposed.append(max(depths[b], default=0))
            res.verified.append(1 + proposal.row_size(b))
            res.target_forwards += 1
            res.tokens.extend(run.new[b, : len(path) + 1].tolist())
        return [len(p) + 1 for p in paths], kept_hidden(hidden, paths, self.device)

    def _check_proposal(self, proposal: Proposal, B: int, kk: int, proposer) -> list[list[int]]:
        """Depth of every row's nodes; a proposal for the wrong rows or deeper than kk is a proposer bug."""
        if proposal.tokens.shape[0] != B:
            raise DraftsmithError(
                f"proposer {proposer.name!r} proposed {proposal.tokens.shape[0]} rows for {B}"
            )
        depths = [node_depths(proposal.row_parents(b)) for b in range(B)]
        deepest = max((max(d, default=0) for d in depths), default=0)
        if deepest > kk:
            raise DraftsmithError(
                f"proposer {proposer.name!r} drafted depth {deepest} > k={kk}; proposers must honour k"
            )
        return depths

    def _ended(self, run: _Run, n_new: list[int], max_new_tokens: int) -> list[int]:
        """Truncate the rows that stopped (EOS, stop string, length) at their stop; -> the batch rows that go on."""
        keep, now = [], time.perf_counter() - run.t0
        for b, (i, n) in enumerate(zip(run.active, n_new)):
            res = run.out.rows[i]
            if self._finished(res, n, max_new_tokens):
                res.time_total = now
            else:
                keep.append(b)
        return keep

    def _retain(self, run: _Run, keep: list[int]) -> None:
        """Take the rows that stopped out of the batch: cache, roots, proposer state (they cost nothing after)."""
        if len(keep) == len(run.active):
            return
        run.active = [run.active[b] for b in keep]
        if not keep:
            return
        run.ragged.retain(keep)
        run.last = run.last[keep]
        if run.proposer is not None:
            self._timed_draft(run, run.proposer.retain, keep)

    def _pick(self, logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> torch.Tensor:
        if params.greedy:
            return logits.argmax(-1)
        return sample(warp_probs(logits, params).cpu(), gen).to(self.device)

    def _finished(self, res: GenerationResult, n_new: int, max_new_tokens: int) -> bool:
        """Truncate at EOS / stop string / length; True when generation is over. n_new: tokens added last."""
        toks = res.tokens
        start = len(toks) - n_new
        for i in range(start, len(toks)):
            if toks[i] in self.eos_ids:
                del toks[i + 1 :]
                res.stop_reason = "eos"
                return True
        if self.stop_strings and any(s in self.tokenizer.decode(toks) for s in self.stop_strings):
            for n in range(max(start, 1), len(toks) + 1):  # keep the shortest prefix holding a stop string
                if any(s in self.tokenizer.decode(toks[:n]) for s in self.stop_strings):
                    del toks[n:]
                    break
            res.stop_reason = "stop_string"
            return True
        if len(toks) >= max_new_tokens:
            del toks[max_new_tokens:]
            res.stop_reason = "length"
            return True
        return False
