"""Distillation recipe: config sections, draft set-up, the loss closure and held-out acceptance eval.

`train/distill.py` (accelerate entry script) and `draftsmith quickstart` both call `run_distill(cfg, accelerator)`;
the loop itself is the generic `draftsmith.trainer.run`. Loss (DistillSpec, Zhou et al. 2024, eq. 1):
    L = mean over response tokens t of  D(p(.|x, y<t) || q(.|x, y<t)),  p = target (no grad), q = draft,
both at `loss.temperature`; D from `draftsmith.divergences` (fkl, rkl, jsd, tvd, neg_log_accept, lk).
Every eval logs predicted acceptance on held-out data (teacher-forced, i.i.d. tau formula): alpha (1 - TVD at the
decode warp), top-1 agreement (greedy alpha) and tau for k = 1..8, bonus token included.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from accelerate.utils import set_seed

from draftsmith.distill.policies import DataPolicy, PolicyKind, dense_from_topk
from draftsmith.divergences import DivergenceKind, divergence, fkl_from_topk
from draftsmith.engines import engine_name, params_sharded, plain_model_init, resolve_mixed_precision
from draftsmith.errors import DraftsmithError
from draftsmith.examples import DataSources, Example, collate, examples_from_sources, split_heldout
from draftsmith.kinds import DrafterKind
from draftsmith.modeling import cast_frozen, causal_lm
from draftsmith.rundir import check_out_dir
from draftsmith.sampling import top_margin
from draftsmith.trainer import TrainArgs
from draftsmith.vocab import softcap_logits

log = logging.getLogger(__name__)


@dataclass
class LoraArgs:
    enabled: bool = False
    """Train LoRA adapters instead of all draft weights (merged into the weights before saving final/)."""
    r: int = 16
    """LoRA rank."""
    alpha: int = 32
    """LoRA scaling numerator (scale = alpha / r)."""
    dropout: float = 0.0
    """LoRA dropout."""
    target_modules: str = "all-linear"
    """peft target_modules ("all-linear" = every Linear but lm_head)."""


@dataclass
class ModelArgs:
    target: str = "smollm2-135m"
    """Target model: Hub id, folder, .gguf or smollm2-135m."""
    init: Literal["existing", "shrink", "fresh"] = "shrink"
    """Draft initialisation: a pretrained small model, a subset of the target's layers, or random."""
    draft: str | None = None
    """init=existing: the draft model (Hub id/folder); its tokenizer is checked against the target's first."""
    layers: list[int] | None = None
    """init=shrink: target layer indices to keep; null = num_layers spread evenly (first and last included).
    init=existing: keep only these layers of the draft (a layer-pruned small model, e.g. 6 of a 0.5B's 24 layers);
    null = all of them."""
    num_layers: int = 4
    """init=shrink/fresh: number of draft decoder layers."""
    hidden_size: int = 0
    """init=fresh: hidden size (0 = half the target's)."""
    intermediate_size: int = 0
    """init=fresh: MLP size (0 = the target's ratio)."""
    vocab_size: int = 0
    """Reduced draft output vocabulary: the N most frequent training tokens (+ special tokens); 0 = full vocab."""
    dtype: str = "auto"
    """Target weights dtype (auto = bf16 on CUDA and on CPUs with AMX or AVX512-BF16, else fp32: models.default_dtype). Draft master weights are fp32."""
    trust_remote_code: bool = False
    """Allow model repos with custom code (off: only enable for repos you trust)."""
    lora: LoraArgs = field(default_factory=LoraArgs)


@dataclass
class DataArgs(DataSources):
    """data.source / limit / max_length / eval_size: draftsmith.examples.DataSources (shared by every trainer)."""

    policy: PolicyKind = "target"
    """fixed | target | on_policy | mixture (DistillSpec data policies)."""
    on_policy_fraction: float = 0.5
    """mixture: probability a batch is sampled by the draft."""
    on_policy_max_new_tokens: int = 128
    """on_policy/mixture: response length the draft samples."""
    on_policy_temperature: float = 1.0
    """on_policy/mixture: draft sampling temperature (0 = greedy)."""
    cache_target_topk: int = 0
    """>0: score the training data with the target once and keep its top-k logits per token, so training steps
    on that data skip the target forward (~3x faster for small drafts; the loss sees the top-k truncated target).
    Memory: k x 6 bytes per response token. 0 = exact target every step. Evals always use the exact target."""
    target_topk_file: str | None = None
    """cache_target_topk > 0: a safetensors file the scores are written to and read back from by later runs over
    the same data (e.g. a LoRA and a full fine-tune of the same draft: a large target scores the data once)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.target_topk_file and not self.cache_target_topk:
            raise DraftsmithError(
                "data.target_topk_file needs data.cache_target_topk > 0 (the number of target logits kept per token)"
            )


@dataclass
class LossArgs:
    kind: DivergenceKind = "fkl"
    """Divergence: fkl, rkl, jsd, tvd, neg_log_accept, lk. Measured by scripts/loss_ablation.sh on the quickstart
    recipe (RESULTS.md): greedy, none beat fkl by 5%; at T=1 neg_log_accept gave 1.057x fkl's tau (2 seeds)."""
    temperature: float = 1.0
    """Temperature both distributions are taken at in the loss (the decode temperature; 0 is treated as 1)."""
    beta: float = 0.5
    """jsd: weight in (0, 1)."""
    chunk_size: int = 1024
    """Tokens per chunk in the loss (bounds the [chunk, V] fp32 memory)."""
    warmup_kind: DivergenceKind | None = None
    """A divergence for the first `warmup_steps` optimizer steps, then `kind` (e.g. fkl, then tvd: KL's dense
    gradients first, the acceptance gap itself once the draft overlaps the target). null = `kind` throughout."""
    warmup_steps: int = 0
    min_margin: float = 0.0
    """Train on the tokens where the target is decided: its top-1 probability leads its second by at least this
    (p1 - p2 at temperature 1, over the cached top-k when there is one); 0 = every token. For greedy decoding: at
    the target's near-ties a smaller draft matches its argmax about as often as a coin does, and the loss spent
    there is not spent where the target is sure (the held-out `top1_by_margin` shows where the misses are).
    The held-out evals still score every token. Measured (RESULTS.md, 2026-12-05, the 0.5B toward the 1.5B, one
    epoch): 0.4 matched plain fkl (held-out top-1 .832 vs .833) in every margin bin, the decided ones included."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_margin < 1.0:
            raise DraftsmithError(
                f"loss.min_margin must be in [0, 1) (0 = train on every token), got {self.min_margin}"
            )
        if self.warmup_steps < 0:
            raise DraftsmithError(f"loss.warmup_steps must be >= 0, got {self.warmup_steps}")
        if (self.warmup_kind is None) != (self.warmup_steps == 0):
            raise DraftsmithError(
                "loss.warmup_kind and loss.warmup_steps go together: set both (e.g. warmup_kind=fkl "
                f"warmup_steps=50) or neither; got warmup_kind={self.warmup_kind}, warmup_steps={self.warmup_steps}"
            )

    def kind_at(self, step: int) -> DivergenceKind:
        """The divergence optimizer step `step` (0-based) trains with."""
        return self.warmup_kind if self.warmup_kind is not None and step < self.warmup_steps else self.kind


@dataclass
class EvalArgs:
    temperature: float = 0.0
    """Decode temperature the predicted acceptance is measured at (0 = greedy)."""
    top_p: float = 1.0
    """Decode top-p for the predicted acceptance."""
    top_k: int = 0
    """Decode top-k for the predicted acceptance."""
    batch_size: int = 8
    """Sequences per eval forward pass."""
    k: int = 4
    """Draft length whose predicted tau is the headline number."""
    train_sample: int = 0
    """Also score this many training examples (a fixed seeded sample of the training split) at every eval, beside
    the held-out ones. After an epoch the draft has trained on each once: the gap train_sample - heldout tells a
    draft that learns its answers but does not carry it to new prompts (more data would help) from one that does
    not learn them either (capacity, lr, loss). 0 = off."""

    def __post_init__(self) -> None:
        for name in ("batch_size", "k"):
            if getattr(self, name) < 1:
                raise DraftsmithError(f"eval.{name} must be >= 1, got {getattr(self, name)}")
        if self.train_sample < 0:
            raise DraftsmithError(f"eval.train_sample must be >= 0 (0 = off), got {self.train_sample}")


@dataclass
class DistillConfig:
    model: ModelArgs = field(default_factory=ModelArgs)
    data: DataArgs = field(default_factory=DataArgs)
    loss: LossArgs = field(default_factory=LossArgs)
    train: TrainArgs = field(default_factory=TrainArgs)
    eval: EvalArgs = field(default_factory=EvalArgs)
    output_dir: str = "runs/distill"
    """Run folder: run.yaml, metrics.jsonl, checkpoints/, final/."""
    push_to_hub: str | None = None
    """Hub repo id to publish final/ to after training (token from HF_TOKEN / huggingface-cli login)."""


class DraftLM(torch.nn.Module):
    """The draft as one module for accelerate: forward gives logits over its (reduced) vocabulary [B, T, V_d], or
    [N, V_d] at the positions `rows` ([B, T] bool) marks (the head runs there only)."""

    def __init__(self, model: torch.nn.Module, vocab_ids: torch.Tensor | None):
        super().__init__()
        self.model = model
        self.has_vocab = vocab_ids is not None
        self.register_buffer(
            "vocab_ids", vocab_ids if self.has_vocab else torch.zeros(0, dtype=torch.long), persistent=False
        )

    @property
    def _no_split_modules(self):  # FSDP/accelerate auto-wrap looks for this on the prepared module
        inner = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        return getattr(inner, "_no_split_modules", None)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        from draftsmith.vocab import restricted_logits

        vocab_ids = self.vocab_ids if self.has_vocab else None
        return restricted_logits(self.model, input_ids, attention_mask, vocab_ids=vocab_ids, rows=rows)[0]


def target_logits_at(
    target, input_ids: torch.Tensor, attention_mask: torch.Tensor, rows: torch.Tensor
) -> torch.Tensor:
    """Target logits [N, V] at the positions `rows` ([B, T] bool) only: the vocab projection of a large-V target is
    a large share of its forward, so it runs on the scored positions alone."""
    with torch.no_grad():
        try:
            decoder, head = target.get_decoder(), target.get_output_embeddings()
        except (AttributeError, NotImplementedError):
            decoder = head = None
        if decoder is None or head is None:
            return target(input_ids=input_ids, attention_mask=attention_mask).logits[rows]
        hidden = decoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return softcap_logits(target.config, head(hidden[rows]))


def make_loss_fn(target, policy: DataPolicy, cfg: LossArgs):
    """(loss_fn, before_step) for draftsmith.trainer.run: loss_fn(prepared DraftLM, RawBatch) -> (loss, metrics);
    before_step(step) picks the divergence of that optimizer step (loss.warmup_kind, then loss.kind)."""

    vocab = target.config.get_text_config().vocab_size
    t2d = None  # KL-type losses only see p on the draft's support: scatter cached top-k straight into it
    if policy.vocab_ids is not None:
        t2d = torch.full((vocab,), -1, dtype=torch.long, device=policy.vocab_ids.device)
        t2d[policy.vocab_ids] = torch.arange(policy.vocab_ids.numel(), device=t2d.device)
    current = {"kind": cfg.kind_at(0)}

    def before_step(step: int) -> None:
        current["kind"] = cfg.kind_at(step)

    def loss_fn(model: torch.nn.Module, raw) -> tuple[torch.Tensor, dict]:
        kind = current["kind"]
        draft = causal_lm(model)
        batch = policy.materialize(raw, draft.model if raw.on_policy else None)
        dev = next(draft.parameters()).device
        input_ids, attn = batch["input_ids"].to(dev), batch["attention_mask"].to(dev)
        rows = batch["loss_mask"].to(dev)[:, 1:]  # logits at t predict token t+1: score response tokens
        scored = torch.nn.functional.pad(rows, (0, 1))  # the same, as positions of input_ids
        vocab_ids = policy.vocab_ids
        cached = "target_topk_values" in batch
        if cached:
            values, ids = batch["target_topk_values"].to(dev), batch["target_topk_ids"].to(dev)
        else:
            target_logits = target_logits_at(target, input_ids, attn, scored)
        if cfg.min_margin > 0:  # drop the target's near-ties, before the draft's head runs on them
            keep = top_margin(values if cached else target_logits) >= cfg.min_margin
            if cached:
                values, ids = values[keep], ids[keep]
            else:
                target_logits = target_logits[keep]
            scored = scored.masked_scatter(scored, keep)
        draft_logits = model(input_ids, attn, rows=scored)  # the head runs at the scored positions only
        if cached and kind == "fkl":  # one pass over the draft's logits, no dense target
            loss = fkl_from_topk(
                values,
                ids,
                draft_logits,
                temperature=cfg.temperature,
                columns=None if t2d is None else t2d.to(dev),
            )
            return loss, _metrics(attn, scored, raw)
        if cached and t2d is not None and kind in ("rkl", "jsd"):
            # = restricting the dense [N, V] logits, at V_d / V the memory
            target_logits = dense_from_topk(values, ids, vocab_ids.numel(), t2d.to(dev))
            vocab_ids = None
        elif cached:
            target_logits = dense_from_topk(values, ids, vocab)
        loss = divergence(
            kind,
            target_logits,
            draft_logits,
            temperature=cfg.temperature,
            beta=cfg.beta,
            vocab_ids=vocab_ids,
            chunk_size=cfg.chunk_size,
        )
        return loss, _metrics(attn, scored, raw)

    return loss_fn, before_step


def _metrics(attn: torch.Tensor, scored: torch.Tensor, raw) -> dict:
    return {
        "n_tokens": int(attn.sum()),
        "loss_tokens": float(scored.sum()),
        "on_policy": float(raw.on_policy),
    }


def evaluate_examples(
    target,
    draft: DraftLM,
    examples: list[Example],
    cfg: EvalArgs,
    loss_cfg: LossArgs,
    pad_id: int,
    max_length: int,
) -> dict:
    """Teacher-forced predicted acceptance of `draft` on `examples` (responses scored, prompts not)."""
    from draftsmith.distill.metrics import AcceptanceMeter

    meter = AcceptanceMeter(cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k)
    dev = next(draft.parameters()).device
    vocab_ids = draft.vocab_ids if draft.has_vocab else None
    loss_sum, n = 0.0, 0
    for b in range(0, len(examples), cfg.batch_size):
        chunk = examples[b : b + cfg.batch_size]
        batch = collate([(e.prompt_ids, e.response_ids) for e in chunk], pad_id, max_length)
        input_ids, attn = batch["input_ids"].to(dev), batch["attention_mask"].to(dev)
        rows = batch["loss_mask"].to(dev)[:, 1:]
        if not rows.any():
            continue
        scored = torch.nn.functional.pad(rows, (0, 1))  # the positions whose logits predict response tokens
        t_logits = target_logits_at(target, input_ids, attn, scored)
        d_logits = draft(input_ids, attn, rows=scored)
        seqs = torch.arange(rows.shape[0], device=dev)[:, None].expand_as(rows)[
            rows
        ]  # sequence of each token
        meter.update(t_logits, d_logits, vocab_ids=vocab_ids, segments=seqs)
        kw = {"temperature": loss_cfg.temperature, "beta": loss_cfg.beta, "vocab_ids": vocab_ids}
        loss_sum += float(divergence(loss_cfg.kind, t_logits, d_logits, **kw)) * int(rows.sum())
        n += int(rows.sum())
    res = meter.compute()
    res["loss"] = loss_sum / max(n, 1)
    res["n_examples"] = len(examples)
    res[f"tau_k{cfg.k}"] = res["tau"][cfg.k] if cfg.k in res["tau"] else None
    res[f"tau_greedy_k{cfg.k}"] = res["tau_greedy"].get(cfg.k)
    return res


# --- set-up and the whole run ------------------------------------------------------------------------------------


@dataclass
class DistillSetup:
    target: torch.nn.Module
    draft: DraftLM
    tokenizer: object
    policy: DataPolicy
    eval_examples: list[Example]
    init_info: dict
    train_sample: list[Example] = field(default_factory=list)


def build_draft(cfg: ModelArgs, target, device) -> tuple[torch.nn.Module, dict]:
    """The draft before training, per `cfg.init` (+ LoRA). Returns (model in train mode, fp32; init record)."""
    from draftsmith.distill import init

    n_target = target.config.get_text_config().num_hidden_layers
    if cfg.init == "existing":
        if not cfg.draft:
            raise DraftsmithError(
                "model.init=existing needs model.draft (a Hub id or folder of a small model)"
            )
        draft = init.existing(cfg.draft, dtype="fp32", device=device)
        info = {"init": "existing", "draft": cfg.draft}
        if cfg.layers:  # a layer subset of the small model: its embeddings, norm and head stay
            draft = init.shrink(draft, cfg.layers)
            info["layers"] = list(cfg.layers)
    elif cfg.init == "shrink":
        layers = cfg.layers if cfg.layers else init.select_layers(n_target, cfg.num_layers)
        draft = init.shrink(target, layers)
        info = {"init": "shrink", "layers": list(layers)}
    else:
        tcfg = target.config.get_text_config()
        hidden = cfg.hidden_size or tcfg.hidden_size // 2
        draft = init.fresh(
            target.config,
            hidden_size=hidden,
            num_layers=cfg.num_layers,
            intermediate_size=cfg.intermediate_size or None,
            copy_from=target if hidden == tcfg.hidden_size else None,
        )
        info = {"init": "fresh", "hidden_size": hidden, "num_layers": cfg.num_layers}
    draft = draft.to(device=device, dtype=torch.float32).train()
    draft.requires_grad_(True)
    if cfg.lora.enabled:
        from draftsmith.modeling import add_lora

        draft = add_lora(
            draft,
            r=cfg.lora.r,
            alpha=cfg.lora.alpha,
            dropout=cfg.lora.dropout,
            target_modules=cfg.lora.target_modules,
        )
        info["lora"] = {"r": cfg.lora.r, "alpha": cfg.lora.alpha}
    return draft, info


def setup(cfg: DistillConfig, device: torch.device, target=None, tokenizer=None) -> DistillSetup:
    """Load/check the target, data and draft. `target`/`tokenizer` may be passed in (already loaded)."""
    from draftsmith import models
    from draftsmith.compat import check_compatible
    from draftsmith.vocab import build_vocab_ids, coverage, special_token_ids, token_counts

    m, d = cfg.model, cfg.data
    if cfg.push_to_hub:  # a bad repo id fails now, not after hours of training
        from draftsmith.hub import check_repo_id

        check_repo_id(cfg.push_to_hub)
    sources = d.sources  # one-line error when missing
    if m.init == "existing" and m.draft:
        check_compatible(m.target, m.draft, m.trust_remote_code)  # before any weights load
    if tokenizer is None:
        tokenizer = models.load_tokenizer(m.target, m.trust_remote_code)
    loaded = [e for examples in examples_from_sources(sources, tokenizer, d.limit) for e in examples]
    train_ex, eval_ex = split_heldout(loaded, d.eval_size, d.held_out_seed(cfg.train.seed))
    if cfg.eval.train_sample > len(train_ex):
        raise DraftsmithError(
            f"eval.train_sample={cfg.eval.train_sample} exceeds the {len(train_ex)} training examples; lower it"
        )
    # the context from the target's config: a data.max_length beyond it is refused before the weights load
    target_config = target.config if target is not None else models.load_config(m.target, m.trust_remote_code)
    ctx = getattr(target_config.get_text_config(), "max_position_embeddings", None)
    if ctx and d.max_length > ctx:
        raise DraftsmithError(
            f"data.max_length={d.max_length} exceeds the target's context ({ctx} tokens, "
            f"max_position_embeddings); set data.max_length <= {ctx}"
        )
    if target is None:
        target = models.load_model(
            m.target, dtype=m.dtype, device=device, trust_remote_code=m.trust_remote_code
        )
    target.eval().requires_grad_(False)
    vocab = target.config.get_text_config().vocab_size
    set_seed(cfg.train.seed)  # before the draft is built: init=fresh (and LoRA) draw random weights
    draft, info = build_draft(m, target, device)
    specials = special_token_ids(tokenizer, target)
    vocab_ids = None
    if m.vocab_size:
        counts = token_counts((e.prompt_ids + e.response_ids for e in train_ex), vocab)
        vocab_ids = build_vocab_ids(counts, m.vocab_size, always=specials).to(device)
        covered = coverage(counts, vocab_ids)
        info["draft_vocab"] = {"size": m.vocab_size, "train_token_coverage": round(covered, 4)}
    elif draft.config.get_text_config().vocab_size != vocab:
        # same tokenizer, different padding rows (e.g. Qwen2.5-7B 152064 vs 0.5B 151936): score the shared ids
        shared = min(vocab, draft.config.get_text_config().vocab_size)
        vocab_ids = torch.arange(shared, device=device)
        info["draft_vocab"] = {"size": shared, "reason": "target and draft vocab sizes differ (padding rows)"}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else specials[0]
    policy = DataPolicy(
        d.policy,
        train_ex,
        cfg.train.batch_size,
        pad_id=pad,
        eos_ids=_eos(target, tokenizer),
        max_length=d.max_length,
        on_policy_fraction=d.on_policy_fraction,
        max_new_tokens=d.on_policy_max_new_tokens,
        temperature=d.on_policy_temperature,
        seed=cfg.train.seed,
        vocab_ids=vocab_ids,
    )
    if d.cache_target_topk and d.policy != "on_policy":
        from draftsmith.distill.policies import cache_target_topk

        cache_target_topk(
            target,
            policy.examples,
            d.cache_target_topk,
            pad,
            d.max_length,
            cfg.train.batch_size,
            file=d.target_topk_file,
            target_name=str(m.target),
        )
    # drawn from what the policy trains on (prompts that fit data.max_length), fixed for the whole run
    n_sample = min(cfg.eval.train_sample, len(policy.examples))
    sample = random.Random(f"train-sample:{d.held_out_seed(cfg.train.seed)}").sample(
        policy.examples, n_sample
    )
    return DistillSetup(target, DraftLM(draft, vocab_ids), tokenizer, policy, eval_ex, info, sample)


def _eos(target, tokenizer) -> list[int]:
    from draftsmith.models import eos_token_ids

    return eos_token_ids(target, tokenizer, required=True)


def save_draft(
    draft: DraftLM, out_dir: Path, tokenizer, target_spec: str, info: dict, run_config: dict
) -> None:
    """final/: an HF causal LM folder (full-vocab lm_head; LoRA merged) + tokenizer + draft_vocab + provenance."""
    from draftsmith import models
    from draftsmith.vocab import save_draft_vocab

    model = draft.model
    if hasattr(model, "merge_and_unload"):  # peft: bake the adapters into the weights, in fp32 (cast_frozen)
        model = model.float().merge_and_unload()
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    if draft.has_vocab:
        save_draft_vocab(out_dir, draft.vocab_ids.cpu())
    try:
        target_info = models.describe(target_spec)
    except DraftsmithError:
        target_info = {"name": target_spec}
    record = {"target": target_info, "init": info, "recipe": run_config}
    (Path(out_dir) / "draftsmith_draft.json").write_text(json.dumps(record, indent=1, default=str))


def run_distill(
    cfg: DistillConfig,
    accelerator,
    *,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    target=None,
    tokenizer=None,
    extra_eval: dict[str, list[Example]] | None = None,
    kinds: Mapping[str, DrafterKind] | None = None,
) -> dict:
    """Set up and train a draft; returns draftsmith.trainer.run's summary plus "final_dir" and "init".

    `extra_eval` {name: examples} are scored at every eval beside the held-out split (the quickstart uses it for
    target responses to dev-eval prompts: measuring on them is fine, training on them is not). `kinds`: the drafter
    table whose `draft` record the push_to_hub model card describes (draftsmith.app.drafters.DRAFTERS, which
    train/distill.py passes); push_to_hub needs it."""
    from draftsmith.config import to_dict
    from draftsmith.trainer import run

    if cfg.push_to_hub:  # a bad repo id or no table for the card fails now, not after hours of training
        from draftsmith.hub import check_repo_id

        check_repo_id(cfg.push_to_hub)
        if kinds is None:
            raise DraftsmithError(
                "push_to_hub publishes with a model card read from the drafter table; run train/distill.py, or "
                "drop push_to_hub and publish final/ with draftsmith push"
            )
    run_config = to_dict(cfg)
    check_out_dir(cfg.output_dir, run_config, resume, overwrite)  # before any compute; reads only
    if cfg.data.policy in ("on_policy", "mixture") and params_sharded(accelerator):
        raise DraftsmithError(
            f"data.policy={cfg.data.policy} samples from the draft, whose parameters {engine_name(accelerator)} "
            "shards across processes; use data.policy=target|fixed, or DDP / ZeRO-2 (whole draft per process)"
        )
    with plain_model_init(accelerator):  # ZeRO-3 would partition the frozen target as it loads
        s = setup(cfg, accelerator.device, target=target, tokenizer=tokenizer)
    # LoRA under bf16 autocast: the frozen base in bf16 where each process holds whole parameters (sharding engines
    # would have to gather mixed dtypes)
    bf16 = resolve_mixed_precision(cfg.train.mixed_precision) == "bf16"
    if cfg.model.lora.enabled and bf16 and engine_name(accelerator) in ("single", "ddp"):
        n = cast_frozen(s.draft, torch.bfloat16)
        log.info("LoRA: the frozen base (%d tensors) held in bf16, adapters in fp32", n)
    pad = s.policy.pad_id
    eval_sets = {"heldout": s.eval_examples, "train_sample": s.train_sample, **(extra_eval or {})}
    # evals score whole examples (up to the target's context), whatever length training cuts sequences to
    ctx = getattr(s.target.config.get_text_config(), "max_position_embeddings", None) or 10**9
    eval_len = {
        name: min(ctx, max([cfg.data.max_length] + [len(e.prompt_ids) + len(e.response_ids) for e in exs]))
        for name, exs in eval_sets.items()
    }

    def eval_fn(model: DraftLM) -> dict:
        return {
            name: evaluate_examples(s.target, model, exs, cfg.eval, cfg.loss, pad, eval_len[name])
            for name, exs in eval_sets.items()
            if exs
        }

    out = Path(cfg.output_dir)

    def save_fn(model: DraftLM, out_dir: Path) -> None:
        save_draft(model, out_dir, s.tokenizer, cfg.model.target, s.init_info, run_config)

    if accelerator.is_main_process and s.init_info.get("draft_vocab"):
        log.info("draft vocab: %s", s.init_info["draft_vocab"])
    loss_fn, before_step = make_loss_fn(s.target, s.policy, cfg.loss)
    summary = run(
        accelerator,
        s.draft,
        loss_fn,
        s.policy,
        cfg.train,
        out,
        eval_fn=eval_fn,
        save_fn=save_fn,
        resume=resume,
        overwrite=overwrite,
        run_config=run_config,
        progress=progress,
        before_step=before_step,
    )
    summary.update({"final_dir": str(out / "final"), "init": s.init_info})
    if cfg.push_to_hub and accelerator.is_main_process:
        from draftsmith.hub import push_to_hub

        # a card with measured results needs `draftsmith eval --out OUT/eval` first; without it the card says so
        eval_json = out / "eval" / "eval.json"
        has_eval = eval_json.is_file()
        push_to_hub(
            str(out / "final"),
            cfg.push_to_hub,
            eval_json=str(eval_json) if has_eval else None,
            require_results=has_eval,
            kinds=kinds,
        )
    return summary
