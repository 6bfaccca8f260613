"""Measure, in the first seconds of a quickstart, what its phases cost on this machine (-> plan.MachineCosts),
and the token lengths of the data it would use (-> plan.DataShape); after generation, `replan` re-measures one rate
when generation overran its prediction. Nothing is written outside a temp folder.

Each measurement runs the operation the phase runs, at its shapes, on random token ids (costs do not depend on
the ids): a batched `model.generate` (prefill and steps timed by a streamer), target scoring as
`cache_target_topk` does it, one training step of the quickstart's draft (cut from the target as the
distillation will), one training step of its EAGLE-3 head (the target's forward included) and a head forward at a
tree depth's rows, batch-1 target forwards the way the decoder runs them, and one checkpoint-sized save.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch

from draftsmith.app.plan import (
    FULL,
    GEN_BATCH,
    MAX_LENGTH,
    MAX_PROMPT_TOKENS,
    DataShape,
    MachineCosts,
    Plan,
    QuickstartSizes,
    expected_max,
    plan_quickstart,
    without_distill,
)
from draftsmith.errors import DraftsmithError
from draftsmith.trainer import TrainArgs
from draftsmith.trainstep import make_optimizer


class _StepClock:
    """A transformers streamer that records the time of each `put` (the prompt, then every new token)."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, _tokens) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


@torch.inference_mode()
def _generation_costs(model, eos_id: int, prompt_len: int = 32, new: int = 8) -> tuple[float, float]:
    """(prefill tokens/s, seconds per step) of `model.generate` on a GEN_BATCH x prompt_len batch."""
    dev = next(model.parameters()).device
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (GEN_BATCH, prompt_len), generator=torch.Generator().manual_seed(1)).to(dev)
    clock = _StepClock()
    model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new,
        min_new_tokens=new,  # random prompts could end at eos at once
        do_sample=False,
        pad_token_id=eos_id,
        eos_token_id=eos_id,
        streamer=clock,
    )
    t = clock.times  # [prompt, token 1 (after the prefill), token 2, ...]
    steps = [b - a for a, b in zip(t[2:], t[3:])]  # the first step at this batch shape is a warm-up
    return GEN_BATCH * prompt_len / (t[1] - t[0]), _median(steps)


@torch.inference_mode()
def score_rate(model, topk: int = 64, batch: int = 4, width: int = 192) -> float:
    """Tokens/s of scoring with the target as `cache_target_topk` does (logits at response rows, top-k kept)."""
    from draftsmith.distill.recipe import target_logits_at

    dev = next(model.parameters()).device
    vocab = model.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(2)
    times = []
    for b, w in ((1, 32), (batch, width)):  # the first call warms up
        ids = torch.randint(0, vocab, (b, w), generator=gen).to(dev)
        rows = torch.zeros(b, w, dtype=torch.bool, device=dev)
        rows[:, w // 2 :] = True  # about half of a sequence is response
        t0 = time.perf_counter()
        target_logits_at(model, ids, torch.ones_like(ids), rows).float().topk(topk, dim=-1)
        times.append(time.perf_counter() - t0)
    return batch * width / times[-1]


def _optimizer(module: torch.nn.Module) -> torch.optim.Optimizer:
    """The trainers' AdamW (draftsmith.trainstep: fused where it can be) at an LR too small to move the weights: the
    step is timed, the model stays as loaded."""
    return make_optimizer(module, None, TrainArgs(lr=1e-12))


def _timed_train_step(module, opt, forward, bf16: bool, loss_of=lambda loss: loss) -> float:
    """Seconds of one training step as the trainer takes it: `forward()` under autocast (as accelerate wraps the
    forward), `loss_of` its output outside it, backward, clipping, the optimizer step."""
    t0 = time.perf_counter()
    with torch.autocast(next(module.parameters()).device.type, dtype=torch.bfloat16, enabled=bf16):
        out = forward()
    loss_of(out).backward()
    torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def _draft_costs(model, sizes: QuickstartSizes, width: int, bf16: bool) -> tuple[float, float, float]:
    """(training padded tokens/s, batch-1 draft step seconds, checkpoint save seconds) of the quickstart's draft:
    the target's `sizes.layers` with a `sizes.vocab_size` output head, fp32 master weights, fused AdamW."""
    from safetensors.torch import save_file
    from transformers import DynamicCache

    from draftsmith.distill.init import shrink
    from draftsmith.distill.recipe import DraftLM
    from draftsmith.divergences import fkl_from_topk
    from draftsmith.vocab import restricted_logits

    dev = next(model.parameters()).device
    n_layers = model.config.get_text_config().num_hidden_layers
    vocab = model.config.get_text_config().vocab_size
    layers = [i for i in sizes.layers if i < n_layers] or [0]
    v_d = min(sizes.vocab_size, vocab)
    draft = DraftLM(shrink(model, layers).to(device=dev, dtype=torch.float32), torch.arange(v_d, device=dev))
    draft.train().requires_grad_(True)
    opt = _optimizer(draft)
    gen = torch.Generator().manual_seed(3)
    times = []
    for b, w in ((2, 64), (sizes.batch_size, width)):  # the first step warms up (and allocates AdamW state)
        ids = torch.randint(0, vocab, (b, w), generator=gen).to(dev)
        rows = torch.zeros(b, w - 1, dtype=torch.bool, device=dev)
        rows[:, (w - 1) // 2 :] = True
        n = int(rows.sum())
        values = torch.randn(n, 64, generator=gen).to(dev)
        top = torch.randint(0, v_d, (n, 64), generator=gen).to(dev)
        times.append(
            _timed_train_step(
                draft,
                opt,
                partial(draft, ids, torch.ones_like(ids), rows=torch.nn.functional.pad(rows, (0, 1))),
                bf16,
                loss_of=partial(fkl_from_topk, values, top),  # the trainer's loss against a cached top-k
            )
        )
    train_tok_s = sizes.batch_size * width / times[-1]

    draft.eval()
    steps = []
    with torch.inference_mode():
        ids = torch.randint(0, vocab, (1, 72), generator=gen).to(dev)
        cache = DynamicCache(config=draft.model.config)
        restricted_logits(draft.model, ids[:, :64], vocab_ids=draft.vocab_ids, cache=cache, use_cache=True)
        for i in range(64, 72):
            t0 = time.perf_counter()
            restricted_logits(
                draft.model,
                ids[:, i : i + 1],
                vocab_ids=draft.vocab_ids,
                cache=cache,
                use_cache=True,
            )
            steps.append(time.perf_counter() - t0)
    with tempfile.TemporaryDirectory() as tmp:
        state = {k: v.detach().contiguous() for k, v in draft.model.state_dict().items()}
        seen, unique = set(), {}
        for (
            k,
            v,
        ) in state.items():  # tied weights share storage: save each tensor once, as save_pretrained does
            if v.data_ptr() not in seen:
                seen.add(v.data_ptr())
                unique[k] = v
        t0 = time.perf_counter()
        save_file(unique, str(Path(tmp) / "model.safetensors"))
        # a checkpoint holds the weights and AdamW's two moments: ~3x the weights
        save_s = 3 * (time.perf_counter() - t0)
    return train_tok_s, _median(steps[1:]), save_s


def _head_costs(model, sizes: QuickstartSizes, width: int, bf16: bool) -> tuple[float, float]:
    """(training tokens/s, batch-1 tree-depth forward seconds) of the quickstart's EAGLE-3 head on `model` (the target
    as the head trainer loads it): a training step as draftsmith.heads.recipe runs it (the target's forward for the
    features, the head unrolled loss.ttt_steps times, backward, fused AdamW), then one head forward over top_k rows."""
    from draftsmith.app.quickstart import head_config
    from draftsmith.heads.data import collate
    from draftsmith.heads.hidden import HiddenStates
    from draftsmith.heads.recipe import build_head
    from draftsmith.heads.training import HeadTrainer

    dev = next(model.parameters()).device
    vocab = model.config.get_text_config().vocab_size
    cfg = head_config(Path("."), "measured", sizes)
    gen = torch.Generator().manual_seed(4)

    def examples(b: int, w: int) -> list[dict]:
        ids = torch.randint(0, vocab, (b, w), generator=gen).tolist()
        return [
            {"index": i, "input_ids": x, "loss_mask": [1] * w, "response_mask": [1] * w}
            for i, x in enumerate(ids)
        ]

    head = build_head(cfg, model, examples(4, 64)).to(dev)
    aux = list(head.config.aux_hidden_state_layer_ids)
    trainer = HeadTrainer(head, model, HiddenStates("online", model, aux), cfg.loss, kind="eagle3")
    opt = _optimizer(head)
    times = []
    for b, w in (
        (2, 64),
        (sizes.head_batch_size, width),
    ):  # the first step warms up (and allocates AdamW state)
        batch = {k: v.to(dev) for k, v in collate(examples(b, w)).items()}
        times.append(_timed_train_step(head, opt, partial(trainer, batch), bf16, loss_of=lambda out: out[0]))
    train_tok_s = sizes.head_batch_size * width / times[-1]

    head.eval()
    hidden_size = head.config.hidden_size
    dtype = next(model.parameters()).dtype
    head.to(dtype)
    steps = []
    with torch.inference_mode():
        rows = sizes.head_top_k
        x = torch.randn(1, rows, hidden_size, generator=gen).to(dev, dtype)
        pos = torch.arange(64, 64 + rows, device=dev)[None]
        for _ in range(6):
            t0 = time.perf_counter()
            out, _ = head.step(x, x, pos, None, from_target=False)
            head.logits(out).topk(rows, dim=-1)
            steps.append(time.perf_counter() - t0)
    return train_tok_s, _median(steps[1:])


def measure_costs(
    model,
    tokenizer,
    sizes: QuickstartSizes,
    train_width: float,
    bf16_training: bool,
    text_load_s: float = 0.0,
    head_model=None,
    head_width: float = 0.0,
) -> MachineCosts:
    """Measure every rate the planner needs on the loaded target (~5-30 s on a 2-core CPU).
    train_width: the expected padded width of a training batch (plan.expected_max over the data);
    text_load_s: seconds per text pair to load (measured by `data_shape`); head_model: the target as the head
    trainer loads it (the decoding one has its Linears re-laid out for few-row products), None = no head;
    head_width: the mean length of the head's sequences (its batches are length-grouped)."""
    from draftsmith.decode.speed import measure_forward_costs
    from draftsmith.models import eos_token_ids

    forward_s = measure_forward_costs(model, sizes=(1, 2, 3, 5, 9, 11), context=128, reps=3)  # also warms up
    eos = (eos_token_ids(model, tokenizer) or [0])[0]
    prefill_tok_s, gen_step_s = _generation_costs(model, eos)
    score_tok_s = score_rate(model)
    width = max(16, min(int(round(train_width)), MAX_LENGTH))
    train_tok_s, draft_step_s, save_s = _draft_costs(model, sizes, width, bf16_training)
    head_tok_s, head_step_s = 0.0, 0.0
    if head_model is not None:
        w = max(16, min(int(round(head_width)), MAX_LENGTH))
        head_tok_s, head_step_s = _head_costs(head_model, sizes, w, bf16_training)
    return MachineCosts(
        gen_prefill_tok_s=prefill_tok_s,
        gen_step_s=gen_step_s,
        score_tok_s=score_tok_s,
        train_tok_s=train_tok_s,
        draft_step_s=draft_step_s,
        forward_s=forward_s,
        text_load_s=text_load_s,
        save_s=save_s,
        head_train_tok_s=head_tok_s,
        head_step_s=head_step_s,
    )


def data_shape(tokenizer, full: QuickstartSizes, vicuna: list, humaneval: list) -> tuple[DataShape, float]:
    """Token lengths of the first `full.train_prompts` builtin:train prompts and of as many builtin:train-text pairs
    as either drafter uses, and of the dev-eval prompts given; plus the seconds per text pair it took to load and
    tokenize them (each trainer's setup does the same again)."""
    from draftsmith.examples import examples_from_sources
    from draftsmith.prompts import load_prompts, prompt_ids

    train = [len(prompt_ids(tokenizer, p)) for p in load_prompts("builtin:train", limit=full.train_prompts)]
    t0 = time.perf_counter()
    n_text = max(full.text_examples, full.head_text_examples)
    text = examples_from_sources(["builtin:train-text"], tokenizer, [n_text])[0] if n_text else []
    text_load_s = (time.perf_counter() - t0) / max(len(text), 1)
    shape = DataShape(
        train_prompt_lens=train,
        text_lens=[len(e.prompt_ids) + len(e.response_ids) for e in text],
        vicuna_lens=[len(prompt_ids(tokenizer, p)) for p in vicuna],
        humaneval_lens=[len(prompt_ids(tokenizer, p)) for p in humaneval],
    )
    return shape, text_load_s


def train_width(shape: DataShape, sizes: QuickstartSizes) -> float:
    """Expected padded width of a training batch of the full data mix (generated answers assumed full length)."""
    gen = [
        min(n + sizes.max_new_tokens, MAX_LENGTH) for n in shape.train_prompt_lens if n <= MAX_PROMPT_TOKENS
    ]
    return expected_max(gen + [min(n, MAX_LENGTH) for n in shape.text_lens], sizes.batch_size)


def head_width(shape: DataShape, sizes: QuickstartSizes) -> float:
    """Mean length of the head's sequences (generated answers assumed full length, then its text pairs)."""
    gen = [
        min(n + sizes.max_new_tokens, MAX_LENGTH) for n in shape.train_prompt_lens if n <= MAX_PROMPT_TOKENS
    ]
    seqs = gen + [min(n, MAX_LENGTH) for n in shape.text_lens[: sizes.head_text_examples]]
    return sum(seqs) / max(len(seqs), 1)


def replan(
    plan: Plan, costs, shape, generate_s: float, budget_s: float, elapsed: float, evals: bool, model
) -> Plan:
    """After generation: if it took longer than predicted, re-measure one rate (target scoring) to tell a machine
    that got slower (another job started) from a phase that cost more than predicted, scale the remaining costs
    by that slowdown, and shrink text pairs and steps to what the time left allows."""
    if generate_s <= 1.1 * plan.phases["generate"]:
        return plan
    slow = max(1.0, costs.score_tok_s / score_rate(model))
    kept = replace(
        FULL if plan.sizes.steps else without_distill(FULL),  # a drafter not planned is not added now
        dev_prompts=plan.sizes.dev_prompts,
        eval_prompts=plan.sizes.eval_prompts,
        eval_max_new_tokens=plan.sizes.eval_max_new_tokens,
    )
    kw = dict(full=kept, max_scale=plan.scale, generated=plan.sizes.train_prompts, decoder_eval=evals)
    elapsed = elapsed + 2.0  # the probe
    try:
        new = plan_quickstart(costs.slowed(slow), shape, budget_s, elapsed, **kw)
    except DraftsmithError:  # not even the smallest plan fits any more: run it anyway, and say so
        new = plan_quickstart(costs.slowed(slow), shape, float("inf"), 0.0, **{**kw, "max_scale": 0.1})
        new = Plan(new.sizes, new.phases, budget_s, elapsed, new.scale, "over the budget")
    if new.sizes == plan.sizes:
        return plan
    print(
        f"      re-plan: generation took {generate_s / 60:.1f} min, predicted {plan.phases['generate'] / 60:.1f}; "
        f"target scoring now runs {slow:.2f}x slower than at the start:"
    )
    for line in new.lines():
        print(f"      {line}")
    return new
