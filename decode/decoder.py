"""Speculative decoding loop (batch 1, leading batch dim kept) and plain decoding through the same code.

Invariant between steps: the target's DynamicCache holds every committed token except the last one (the
"root"); a step runs ONE target forward over [root, node_1 .. node_N] (tree mask, position = prefix + depth),
accepts a path of a nodes, compacts the cache to prefix + root + accepted nodes (`cache.crop` for chains,
a gather then crop for trees: no recomputation) and commits a + 1 tokens. Plain decoding is the same step
with an empty proposal, so the baseline pays exactly the same per-step overhead.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import transformers

from draftsmith.errors import DraftsmithError
from draftsmith.models import eos_token_ids
from draftsmith.sampling import SamplingParams, sample, warp_probs

from .cache import compact_cache, crop_to
from .proposer import Proposal, Proposer, node_depths, tree_attention_mask
from .verify import verify

# forward(cache=...) arrived in transformers 5.24 (before: past_key_values=)
_TRANSFORMERS_TOO_OLD = tuple(int(x) for x in transformers.__version__.split(".")[:2]) < (5, 24)


@dataclass
class GenerationResult:
    """One generation. `accepted[s]` = draft tokens accepted at verify step s (the step also adds one token)."""

    tokens: list[int]  # generated ids (prompt excluded)
    prompt_len: int
    accepted: list[int] = field(default_factory=list)
    proposed: list[int] = field(default_factory=list)  # proposal depth per step (0 = plain step)
    target_forwards: int = 0  # including the prefill forward
    time_total: float = 0.0
    time_draft: float = 0.0  # proposer.begin/propose/advance
    time_prefill: float = 0.0  # the prompt's forward (part of time_total): per-step costs leave it out
    verified: list[int] = field(default_factory=list)  # tokens in each verify forward (1 + proposal nodes)
    stop_reason: str = "length"

    @property
    def tau(self) -> float:
        """Mean tokens per verify forward, bonus/correction token included."""
        return (sum(self.accepted) + len(self.accepted)) / max(len(self.accepted), 1)


@dataclass
class _Run:
    """The state of one `generate` call, shared by its steps."""

    proposer: Proposer | None
    params: SamplingParams
    layers: tuple[int, ...]
    verify_gen: torch.Generator
    draft_gen: torch.Generator
    res: GenerationResult
    cache: object = None
    max_len: int = 0
    cached: int = 0  # tokens in the target cache (tracked on the host: no device sync)
    last: torch.Tensor | None = None  # [1] the last committed token (the next block's root)
    prefill_hidden: tuple | None = None
    path: list[int] = field(default_factory=list)  # the accepted nodes of the last step
    new: torch.Tensor | None = None  # [1, a + 1] the tokens the last step committed


class SpeculativeDecoder:
    """Wraps a HF causal LM target. `generate(ids, proposer)`; proposer None = plain decoding."""

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
        if isinstance(compile, str) and compile not in torch._dynamo.list_backends(exclude_tags=()):
            raise DraftsmithError(
                f"unknown compile backend {compile!r}; use True (inductor) or one of "
                f"{', '.join(torch._dynamo.list_backends(exclude_tags=()))}"
            )
        self.static = bool(compile) or static_cache
        self._forward_fn = target
        if compile:
            how = {"mode": "reduce-overhead"} if compile is True else {"backend": compile}
            self._forward_fn = torch.compile(target.forward, dynamic=None, **how)
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

    @torch.inference_mode()
    def _cpu_head(self) -> torch.Tensor | None:
        """CPU only: the lm_head as a contiguous [H, V] matrix. `h @ W^T` with W stored [V, H] takes a GEMM path
        that costs ~2x more for 5-11 rows than for 1 (measured: 52 vs 25 ms at 5 rows, smollm2 head, 2 cores);
        with the transposed copy 5 rows cost ~1.4x one row, so verifying k+1 tokens stays near one plain step.
        Used only if it reproduces the model's own logits exactly on a probe (no bias/softcap/scaling surprises)
        and the copy is small; plain and speculative decoding both use it, so comparisons stay like for like."""
        head = self.target.get_output_embeddings()
        if self.device.type != "cpu" or not isinstance(head, torch.nn.Linear) or head.bias is not None:
            return None
        if head.weight.numel() * head.weight.element_size() > (512 << 20):
            return None
        head_t = head.weight.t().contiguous()
        probe = torch.tensor([[1, 2, 3]], device=self.device)
        ref = self.target(probe).logits
        got = self.target.get_decoder()(probe).last_hidden_state @ head_t
        return head_t if torch.allclose(ref, got, atol=1e-4, rtol=1e-4) else None

    def _cache_len(self, tokens: int) -> int:
        """Rows of a cache for `tokens` tokens: static caches come in whole 256s, so prompts of similar length (and
        decode.speed.measure_forward_costs) share the compiled step's shapes instead of recompiling."""
        return -(-tokens // 256) * 256 if self.static else tokens

    def _new_cache(self, max_len: int):
        from transformers import DynamicCache, StaticCache

        if self.static:
            return StaticCache(config=self.target.config, max_cache_len=max_len)
        return DynamicCache(config=self.target.config)

    def _forward(self, ids, cache, layers, logits_to_keep: int = 0, eager: bool = False, **kw):
        """Target forward -> (logits [B, n, V] for the last `logits_to_keep` rows (0 = all), hidden per layer).
        eager: bypass the compiled step (the prefill)."""
        if self._head_t is not None:
            out = self.target.get_decoder()(
                ids, cache=cache, use_cache=True, output_hidden_states=bool(layers), **kw
            )
            h = out.last_hidden_state
            logits = (h[:, -logits_to_keep:] if logits_to_keep else h) @ self._head_t
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
        k: int = 4,
        params: SamplingParams | None = None,
        max_new_tokens: int = 128,
        seed: int = 0,
    ) -> GenerationResult:
        """input_ids: [1, T] prompt ids. Returns the generated ids and per-step acceptance statistics."""
        params = params if params is not None else SamplingParams()  # greedy
        input_ids = self._check(input_ids, proposer, k, max_new_tokens)
        run = _Run(
            proposer=proposer,
            params=params,
            layers=tuple(proposer.hidden_state_layers) if proposer is not None else (),
            verify_gen=torch.Generator().manual_seed(2 * seed),  # host walk in verify_sampling
            draft_gen=torch.Generator(device=self.device).manual_seed(2 * seed + 1),  # independent streams
            res=GenerationResult(tokens=[], prompt_len=input_ids.shape[1]),
        )
        self._sync()
        t0 = time.perf_counter()
        self._prefill(run, input_ids, k, max_new_tokens)
        run.res.time_prefill = time.perf_counter() - t0
        self._begin_draft(run, input_ids)
        done = self._finished(run.res, 1, max_new_tokens)
        while not done:
            kk = min(k, max_new_tokens - len(run.res.tokens) - 1)
            n_new, hidden = self._step(run, kk)
            done = self._finished(run.res, n_new, max_new_tokens)
            if proposer is not None and not done:
                self._timed_draft(run, proposer.advance, run.path, run.new, hidden)
        self._sync()
        run.res.time_total = time.perf_counter() - t0
        return run.res

    def _check(self, input_ids: torch.Tensor, proposer, k: int, max_new_tokens: int) -> torch.Tensor:
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if input_ids.shape[0] != 1:
            raise DraftsmithError(
                f"batch size {input_ids.shape[0]} is not supported yet; decode one prompt at a time"
            )
        if k < 1:
            raise DraftsmithError(f"k must be >= 1 (draft tokens per step), got {k}")
        T = input_ids.shape[1]
        if self.max_positions and T + max_new_tokens + k + 1 > self.max_positions:
            raise DraftsmithError(
                f"prompt ({T} tokens) + max_new_tokens ({max_new_tokens}) + k + 1 exceeds the target's context "
                f"({self.max_positions}); shorten the prompt or lower --max-new-tokens"
            )
        return input_ids.to(self.device)

    def _prefill(self, run: _Run, input_ids: torch.Tensor, k: int, max_new_tokens: int) -> None:
        """The prompt's forward; the first token comes from the target alone (as in plain decoding)."""
        T = input_ids.shape[1]
        # a tree block briefly occupies 1 + N cache rows before compaction (static buffers must hold them)
        nodes = max(k, int(getattr(run.proposer, "max_nodes", 0) or 0))
        run.max_len = self._cache_len(T + max_new_tokens + 1 + nodes)
        run.cache = self._new_cache(run.max_len)
        run.cached = T  # tokens in the target cache (tracked on the host: no device sync)
        logits, run.prefill_hidden = self._forward(
            input_ids, run.cache, run.layers, logits_to_keep=1, eager=True
        )
        run.res.target_forwards = 1
        run.last = self._pick(logits[:, -1], run.params, run.verify_gen)  # [1]
        run.res.tokens.append(int(run.last[0]))  # int() waits for the prefill on any device

    def _begin_draft(self, run: _Run, input_ids: torch.Tensor) -> None:
        proposer = run.proposer
        if proposer is None:
            return
        if hasattr(proposer, "attach"):  # self-speculative drafters draft on the target's own KV cache
            self._timed_draft(run, proposer.attach, self, run.cache)
        tokens = torch.cat([input_ids, run.last[:, None]], 1)
        self._timed_draft(run, proposer.begin, tokens, run.prefill_hidden)
        run.prefill_hidden = None

    def _timed_draft(self, run: _Run, fn, *args):
        """Call a proposer hook, adding its time (device work included) to the drafting time."""
        td = time.perf_counter()
        out = fn(*args)
        self._sync()
        run.res.time_draft += time.perf_counter() - td
        return out

    def _step(self, run: _Run, kk: int) -> tuple[int, tuple | None]:
        """One speculative step (gpt-fast's `speculative_decode`): draft up to kk tokens, verify them and the root
        in ONE target forward, accept a path, roll the cache back to it. Returns (tokens committed, the hidden
        rows of the committed tokens for the proposer). A plain step is the same with an empty proposal."""
        res, proposer = run.res, run.proposer
        if proposer is not None and kk > 0:
            proposal = self._timed_draft(run, proposer.propose, kk, run.params, run.draft_gen)
        else:
            proposal = Proposal.empty(1, self.device)
        prefix = run.cached
        node_depth = node_depths(proposal.parents)
        depth = max(node_depth, default=0)
        if depth > kk:
            raise DraftsmithError(
                f"proposer {proposer.name!r} drafted depth {depth} > k={kk}; proposers must honour k"
            )
        block = torch.cat([run.last[:, None], proposal.tokens.to(self.device)], 1)  # [1, 1 + N]
        # a self-speculative proposer may verify reusing its shared-layer rows (None: nothing to reuse)
        shared = proposer.verify_forward(block, proposal) if hasattr(proposer, "verify_forward") else None
        if shared is None:
            shared = self._forward(
                block, run.cache, run.layers, **self._tree_inputs(proposal, node_depth, prefix, run)
            )
        logits, hidden = shared
        res.target_forwards += 1
        path, run.last = verify(logits, proposal, run.params, run.verify_gen)
        self._roll_back(run, proposal, path, prefix)
        run.path = path
        run.new = torch.cat([proposal.tokens[:, path].to(self.device), run.last[:, None]], 1)  # [1, a + 1]
        res.accepted.append(len(path))
        res.proposed.append(depth)
        res.verified.append(1 + proposal.num_nodes)
        res.tokens.extend(run.new[0].tolist())
        if (
            hidden is not None
        ):  # the rows that predicted the committed tokens: the root's and the accepted nodes'
            rows = torch.tensor([0, *(1 + i for i in path)], device=self.device)
            hidden = tuple(h[:, rows] for h in hidden)
        return len(path) + 1, hidden

    def _tree_inputs(self, proposal: Proposal, node_depth: list[int], prefix: int, run: _Run) -> dict:
        """Position ids and the tree attention mask of a tree block ({} for chains: the model's causal mask)."""
        if proposal.is_chain:
            return {}
        depths = torch.tensor([0, *node_depth], device=self.device)
        mask = tree_attention_mask(
            proposal.parents,
            prefix,
            self.target.dtype,
            self.device,
            kv_len=run.max_len if self.static else None,
        )
        return {"position_ids": (prefix + depths)[None], "attention_mask": mask}

    def _roll_back(self, run: _Run, proposal: Proposal, path: list[int], prefix: int) -> None:
        """Keep the root and the accepted path in the cache: crop a chain, gather-then-crop a tree."""
        a = len(path)
        if proposal.is_chain:
            crop_to(run.cache, prefix + 1 + a, current=prefix + 1 + proposal.num_nodes)
        else:
            keep = torch.tensor(path, device=self.device, dtype=torch.long)
            compact_cache(run.cache, prefix + 1, keep, current=prefix + 1 + proposal.num_nodes)
        run.cached = prefix + 1 + a

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
