"""The quickstart's sizes, and a planner that fits them into a time budget from costs measured on this machine.

`plan_quickstart(costs, shape, budget_s, elapsed_s)` is a pure function: `MachineCosts` are rates and seconds
measured in the first seconds of a run (draftsmith.app.calibrate), `DataShape` the token lengths of the prompts
and text the quickstart would use. The quickstart trains up to two drafters on the same generated answers:

1. an EAGLE-3 head, first, because it is the one that pays on the 135M target (a tree of its drafts costs ~0.1 of
   a target step; the distilled 4-layer draft costs ~0.2 a token and decodes below plain speed). Its data and
   steps scale by one factor s (generated prompts, text pairs and steps together: the same ~1 epoch of a smaller
   data set), the largest s in [MIN_SCALE, 1] whose predicted time fits the budget;
2. the distilled draft LM, only when the full head leaves time for at least DISTILL_MIN_SCALE of the full
   distillation (its text pairs and steps scale; its dev-eval references and the decoder eval stay whole so the
   reported before/after numbers keep their size). Otherwise the plan says which budget would train it too.

If even the smallest plan does not fit, it says how many minutes this machine needs instead of starting.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

from draftsmith.errors import DraftsmithError

MAX_PROMPT_TOKENS = 160  # builtin:train prompts longer than this are skipped (~2%): padding and prefill time
GEN_BATCH = 32  # prompts per batched generation
MAX_LENGTH = 512  # data.max_length of the quickstart's distillation
SAFETY = 0.9  # plan for 90% of the time left: the predictions are measured, the machine may slow down
MIN_SCALE = 0.1  # below ~40 prompts + 200 text pairs + 25 steps the before/after comparison says little
EVAL_TAU_GUESS = 1.2  # decoder-eval time is predicted before the draft exists: tau of earlier quickstarts
HEAD_TAU_GUESS = 1.6  # the same for the EAGLE-3 head (1.8 after 600 steps on the 135M, RESULTS.md)
DISTILL_MIN_SCALE = 0.5  # a distilled draft on less than half the full data is not worth the minutes it takes
CHAIN_ABOVE = 1.3
"""A head's tree pays where verifying HEAD_NODES + 1 tokens costs little more than a step (AMX, bf16: 1.0-1.1x, tree
1.38x); where it costs more than CHAIN_ABOVE steps the head drafts a chain of 2 (AVX-512 fp32: chain 1.06x, the
10-node tree 0.91x; RESULTS.md)."""
EVAL_PROCESS_S = 15.0  # a decoder eval runs in a process of its own: start, imports, the target's load
HEAD_TRAINER_SLOWER = 1.3
"""The head trainer's steps run this much slower than the calibrated step (547 against 713 tokens/s over 358 steps on
a 2-core AMX Xeon: batches of every width, the trainer's own work, and steps that slow as the run goes on)."""
HEAD_TOP_K, HEAD_NODES, HEAD_DEPTH = 6, 10, 3  # the tree that measured best on the 135M (RESULTS.md, "Heads")
MAX_BUDGET_MIN = 24 * 60
MIN_BUDGET_MIN = 1.0
"""No plan fits less: the smallest is predicted at ~66 s of work on a 2-core CPU with AMX in bf16, after ~14 s of
loading and measuring (Zen 4 EPYC); refused before those seconds are spent."""


@dataclass
class QuickstartSizes:
    train_prompts: int  # builtin:train prompts the target answers (both drafters train on the answers)
    text_examples: int  # distillation: builtin:train-text pairs the target scores (fixed data), 0 = none
    dev_prompts: int  # distillation's dev-eval references, split evenly between vicuna and humaneval
    max_new_tokens: int
    steps: int  # distillation steps; 0 = no distilled draft
    batch_size: int
    lr: float
    layers: list[int]
    vocab_size: int
    eval_prompts: int  # decoder eval (per drafter)
    eval_max_new_tokens: int
    head_steps: int = 0  # EAGLE-3 head training steps; 0 = no head
    head_text_examples: int = 0  # builtin:train-text pairs the head trains on beside the answers
    head_batch_size: int = 8
    head_lr: float = 2e-3
    head_vocab_size: int = 8192  # the head's draft vocabulary (95% of held-out response tokens on the 135M)
    head_depth: int = HEAD_DEPTH  # decoder eval: draft depth (--k) of the head's tree
    head_top_k: int = HEAD_TOP_K  # children per expanded node; 1 = a chain
    head_nodes: int = HEAD_NODES  # drafted tokens verified per step


FULL = QuickstartSizes(
    train_prompts=400,
    text_examples=2000,
    dev_prompts=24,
    max_new_tokens=80,
    steps=250,
    batch_size=8,
    lr=2e-3,
    layers=[0, 1, 2, 3],  # the first layers: keeping the last layer (30 -> 4) starts at 0% top-1 on SmolLM2
    vocab_size=8192,
    eval_prompts=6,
    eval_max_new_tokens=64,
    head_steps=360,  # one epoch of 384 answers + 2,500 text pairs: ~11 min on a 2-core AMX Xeon
    head_text_examples=2500,
)
FAST = QuickstartSizes(
    train_prompts=24,
    text_examples=16,
    dev_prompts=4,
    max_new_tokens=24,
    steps=8,
    batch_size=4,
    lr=1e-3,
    layers=[0, 1],
    vocab_size=2048,
    eval_prompts=2,
    eval_max_new_tokens=16,
    head_steps=8,
    head_text_examples=16,
    head_vocab_size=2048,
)


def heldout_size(sizes: QuickstartSizes) -> int:
    """Generated examples held out from training (the distillation's data.eval_size)."""
    return max(1, min(16, sizes.train_prompts // 8))


def _steps(full_steps: int, full_seqs: int, seqs: int) -> int:
    """Training steps for `seqs` sequences at the epochs `full_steps` gives `full_seqs` (0 stays 0: not trained)."""
    return max(round(full_steps / max(full_seqs, 1) * seqs), 1) if full_steps else 0


def with_data(full: QuickstartSizes, prompts: int, text: int, head_text: int) -> QuickstartSizes:
    """`full` on `prompts` answers, `text` distillation and `head_text` head text pairs; each drafter's steps follow
    its data (the same epochs as in `full`)."""
    return replace(
        full,
        train_prompts=prompts,
        text_examples=text,
        head_text_examples=head_text,
        steps=_steps(full.steps, full.train_prompts + full.text_examples, prompts + text),
        head_steps=_steps(full.head_steps, full.train_prompts + full.head_text_examples, prompts + head_text),
    )


def scaled(full: QuickstartSizes, s: float) -> QuickstartSizes:
    """`full` with generated prompts, text pairs and steps scaled by s (steps follow the data: same epochs)."""
    prompts = max(round(full.train_prompts * s), 8)
    return with_data(full, prompts, round(full.text_examples * s), round(full.head_text_examples * s))


def head_draft(sizes: QuickstartSizes, costs: MachineCosts) -> QuickstartSizes:
    """`sizes` with the head's decoding shape for this machine: the HEAD_NODES-node tree where verifying it costs at
    most CHAIN_ABOVE target steps, else a chain of 2 (CHAIN_ABOVE says why)."""
    if costs.forward(HEAD_NODES + 1) <= CHAIN_ABOVE * costs.forward(1):
        return replace(sizes, head_depth=HEAD_DEPTH, head_top_k=HEAD_TOP_K, head_nodes=HEAD_NODES)
    return replace(sizes, head_depth=2, head_top_k=1, head_nodes=2)


def without_distill(sizes: QuickstartSizes) -> QuickstartSizes:
    """`sizes` with no distilled draft (nor the dev-eval references only its predicted numbers use)."""
    return replace(sizes, steps=0, text_examples=0, dev_prompts=0)


def minimal(full: QuickstartSizes) -> QuickstartSizes:
    """The smallest plan offered: MIN_SCALE of the data and steps, 8 dev-eval references, 2 decoder-eval prompts."""
    return replace(
        scaled(full, MIN_SCALE),
        dev_prompts=min(full.dev_prompts, 8),
        eval_prompts=min(full.eval_prompts, 2),
        eval_max_new_tokens=min(full.eval_max_new_tokens, 32),
    )


@dataclass(frozen=True)
class MachineCosts:
    """Rates and seconds measured on this machine at the start of the run (draftsmith.app.calibrate)."""

    gen_prefill_tok_s: float  # prompt tokens/s of a batched generate prefill
    gen_step_s: float  # one batched generation step at GEN_BATCH rows
    score_tok_s: float  # tokens/s of scoring sequences with the target (top-k kept)
    train_tok_s: float  # padded tokens/s of a draft training step (forward, backward, AdamW)
    draft_step_s: float  # one batch-1 draft forward for one token (decoding)
    forward_s: dict[int, float] = field(default_factory=dict)  # batch-1 target forward over n new tokens
    text_load_s: float = 0.0  # seconds per builtin:train-text pair to load and tokenize
    save_s: float = 0.0  # seconds to save one training checkpoint (draft weights + optimizer state)
    head_train_tok_s: float = 0.0  # tokens/s of an EAGLE-3 head training step, the target's forward included
    head_step_s: float = 0.0  # one head forward over a tree depth's top_k rows (decoding)

    def slowed(self, f: float) -> MachineCosts:
        """The same machine f times slower (another job started, thermal throttling)."""
        return MachineCosts(
            self.gen_prefill_tok_s / f,
            self.gen_step_s * f,
            self.score_tok_s / f,
            self.train_tok_s / f,
            self.draft_step_s * f,
            {n: s * f for n, s in self.forward_s.items()},
            self.text_load_s * f,
            self.save_s * f,
            self.head_train_tok_s / f,
            self.head_step_s * f,
        )

    def forward(self, n: int) -> float:
        """Batch-1 target forward over n tokens (nearest measured size at or above n, else the largest)."""
        sizes = sorted(self.forward_s)
        return self.forward_s[next((m for m in sizes if m >= n), sizes[-1])]


@dataclass(frozen=True)
class DataShape:
    """Token lengths (chat template applied) of the data a quickstart may use, in the order it uses them."""

    train_prompt_lens: list[int]  # builtin:train prompts, file order (generate takes the first N)
    text_lens: list[int]  # builtin:train-text pairs, prompt + response, file order
    vicuna_lens: list[int]  # dev-eval prompts (that fit the context), in order
    humaneval_lens: list[int]


def expected_max(lengths: list[int], b: int) -> float:
    """E[max of b lengths drawn at random] (a training batch is padded to its longest sequence)."""
    xs = sorted(lengths)
    n = len(xs)
    return sum(x * (((i + 1) / n) ** b - (i / n) ** b) for i, x in enumerate(xs)) if n else 0.0


def _generate_s(costs: MachineCosts, prompt_lens: list[int], max_new: int) -> float:
    """Batched greedy generation: length-sorted batches, each a left-padded prefill + max_new steps (upper
    bound: a batch stops early only when every row has stopped). Partial batches scale the step linearly."""
    lens = sorted(prompt_lens)
    step1 = costs.forward(1)
    total = 0.0
    for b in range(0, len(lens), GEN_BATCH):
        chunk = lens[b : b + GEN_BATCH]
        step = step1 + (costs.gen_step_s - step1) * (len(chunk) - 1) / (GEN_BATCH - 1)
        total += len(chunk) * chunk[-1] / costs.gen_prefill_tok_s + max_new * max(step, step1)
    return total


def dev_lens(shape: DataShape, n: int) -> list[int]:
    """Prompt lengths of the first n dev-eval prompts (half Vicuna, half HumanEval: dev_eval_prompts)."""
    return shape.vicuna_lens[: (n + 1) // 2] + shape.humaneval_lens[: n // 2]


def predict(
    costs: MachineCosts, shape: DataShape, sizes: QuickstartSizes, k: int = 4, decoder_eval: bool = True
) -> dict[str, float]:
    """Predicted seconds per phase (0 for a drafter not trained): generate; the head's head_train (text setup,
    training with the target's forward, held-out eval) and head_decoder_eval; the distillation's score (setup +
    target scoring), train, evals (before/after) and decoder_eval. Decoder evals are 0 when skipped."""
    gen = [n for n in shape.train_prompt_lens[: sizes.train_prompts] if n <= MAX_PROMPT_TOKENS]
    dev = dev_lens(shape, sizes.dev_prompts) if sizes.steps else []
    held = min(heldout_size(sizes), max(len(gen) - 1, 0))
    gen_seq = [min(n + sizes.max_new_tokens, MAX_LENGTH) for n in gen]
    phases = {
        "generate": _generate_s(costs, gen, sizes.max_new_tokens)
        + _generate_s(costs, dev, sizes.max_new_tokens)
    }
    phases.update(_head_phases(costs, shape, sizes, gen_seq, held, decoder_eval))
    phases.update(_distill_phases(costs, shape, sizes, gen_seq, held, dev, k, decoder_eval))
    return phases


def _decode_s(
    costs: MachineCosts, shape: DataShape, sizes: QuickstartSizes, verify: int, draft_s: float, tau: float
):
    """A decoder eval: plain and speculative decoding of each eval prompt (two prefills, T - 1 plain steps, the
    speculative steps at `tau` tokens each, each a verify of `verify` tokens + `draft_s` of drafting), plus the
    warm-up of both."""
    T = sizes.eval_max_new_tokens
    spec_steps = math.ceil((T - 1) / tau)
    step = costs.forward(verify) + draft_s
    per_prompt = [
        2 * n / costs.gen_prefill_tok_s + (T - 1) * costs.forward(1) + spec_steps * step
        for n in dev_lens(shape, sizes.eval_prompts)
    ]
    return EVAL_PROCESS_S + sum(per_prompt) + 16 * (costs.forward(1) + step) / tau


def _head_phases(costs, shape, sizes, gen_seq, held, decoder_eval) -> dict[str, float]:
    if not sizes.head_steps:
        return {"head_train": 0.0, "head_decoder_eval": 0.0}
    seqs = gen_seq[held:] + [min(n, MAX_LENGTH) for n in shape.text_lens[: sizes.head_text_examples]]
    # batches are length-grouped (heads.data.epoch_batches): a step's tokens are close to batch x the mean length
    step_tokens = sizes.head_batch_size * sum(seqs) / max(len(seqs), 1)
    # one held-out eval at the end, unrolled to eval depth 6: about a training step's work per token
    tokens = sizes.head_steps * step_tokens + sum(gen_seq[:held])
    train = (
        sizes.head_text_examples * costs.text_load_s
        + HEAD_TRAINER_SLOWER * tokens / costs.head_train_tok_s
        + 2 * costs.save_s
    )
    draft_s = sizes.head_depth * costs.head_step_s
    dec = (
        _decode_s(costs, shape, sizes, sizes.head_nodes + 1, draft_s, HEAD_TAU_GUESS) if decoder_eval else 0.0
    )
    return {"head_train": train, "head_decoder_eval": dec}


def _distill_phases(costs, shape, sizes, gen_seq, held, dev, k, decoder_eval) -> dict[str, float]:
    if not sizes.steps:
        return {"score": 0.0, "train": 0.0, "evals": 0.0, "decoder_eval": 0.0}
    train_seqs = gen_seq[held:] + [min(n, MAX_LENGTH) for n in shape.text_lens[: sizes.text_examples]]
    eval_tokens = sum(gen_seq[:held]) + sum(n + sizes.max_new_tokens for n in dev)
    saves = 5  # save_every = steps // 4: four checkpoints, then final/
    # the draft's share of an eval forward: a forward is ~1/3 of a training step (forward + backward)
    eval_rate = 1 / costs.score_tok_s + 1 / (3 * costs.train_tok_s)
    dec = (
        _decode_s(costs, shape, sizes, k + 1, k * costs.draft_step_s, EVAL_TAU_GUESS) if decoder_eval else 0.0
    )
    return {
        "score": sizes.text_examples * costs.text_load_s + sum(train_seqs) / costs.score_tok_s,
        "train": sizes.steps
        * sizes.batch_size
        * expected_max(train_seqs, sizes.batch_size)
        / costs.train_tok_s
        + saves * costs.save_s,
        "evals": 2 * eval_tokens * eval_rate,
        "decoder_eval": dec,
    }


@dataclass
class Plan:
    sizes: QuickstartSizes
    phases: dict[str, float]  # predicted seconds still to spend, per phase
    budget_s: float
    elapsed_s: float  # already spent when planning (model load, measurements, done phases)
    scale: float | None  # fraction of the full quickstart; None = sizes given, not fitted
    note: str = ""

    @property
    def total_s(self) -> float:
        return self.elapsed_s + sum(self.phases.values())

    def lines(self) -> list[str]:
        s = self.sizes
        m = 60.0
        phases = ", ".join(f"{name} {sec / m:.1f}" for name, sec in self.phases.items() if sec)
        scale = "given sizes" if self.scale is None else f"{self.scale:.2f} of the full quickstart"
        head = (
            f"EAGLE-3 head {s.head_steps} steps x {s.head_batch_size} on the answers + {s.head_text_examples} "
            f"builtin:train-text pairs"
            if s.head_steps
            else "no EAGLE-3 head"
        )
        draft = (
            f"distilled draft {s.steps} steps x {s.batch_size} on the answers + {s.text_examples} "
            f"builtin:train-text pairs scored, {s.dev_prompts} dev-eval references"
            if s.steps
            else "no distilled draft"
        )
        return [
            f"plan ({scale}): {s.train_prompts} builtin:train prompts answered (<= {s.max_new_tokens} tokens); "
            f"{head}; {draft}; decoder eval {s.eval_prompts} prompts x {s.eval_max_new_tokens} tokens per drafter",
            f"predicted minutes: {phases}; total {self.total_s / m:.1f} of the {self.budget_s / m:g}-min budget "
            f"({self.elapsed_s / m:.1f} spent loading and measuring)"
            + (f"; {self.note}" if self.note else ""),
        ]


def check_budget(budget_min: object) -> float:
    """--budget-min as minutes (a number in [MIN_BUDGET_MIN, MAX_BUDGET_MIN]); anything else is refused in one
    line."""
    try:
        value = float(budget_min)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        value = float("nan")
    if not (math.isfinite(value) and MIN_BUDGET_MIN <= value <= MAX_BUDGET_MIN):
        raise DraftsmithError(
            f"--budget-min must be a number of minutes in [{MIN_BUDGET_MIN:g}, {MAX_BUDGET_MIN}] (no quickstart "
            f"fits in less than a minute), got {budget_min!r}; e.g. --budget-min 15"
        )
    return value


def plan_quickstart(
    costs: MachineCosts,
    shape: DataShape,
    budget_s: float,
    elapsed_s: float,
    *,
    full: QuickstartSizes = FULL,
    max_scale: float = 1.0,
    generated: int | None = None,
    decoder_eval: bool = True,
) -> Plan:
    """The EAGLE-3 head at the largest scale s <= max_scale of `full` whose predicted time fits SAFETY x the time
    left (or the minimal plan, or a one-line DraftsmithError saying how many minutes this machine needs), then the
    distilled draft beside it where the full head leaves room for it (module docstring). A `full` without a head
    (head_steps 0) plans the distilled draft alone the same way; one without a distillation (steps 0), the head.

    `generated`: the training prompts are already answered (a re-plan after generation): their number is fixed,
    generation costs nothing more, and only text pairs and steps shrink (pass the plan's sizes as `full`, with
    the full quickstart's data and steps). `decoder_eval`: False when the decoder evals are skipped."""
    left = SAFETY * (budget_s - elapsed_s)
    full = head_draft(full, costs) if full.head_steps else full
    both = bool(full.head_steps and full.steps)
    first = without_distill(full) if both else full
    plan = _fit(costs, shape, first, budget_s, elapsed_s, left, max_scale, generated, decoder_eval)
    if not both:
        return plan
    if plan.scale is not None and plan.scale >= max_scale:
        with_draft = _add_distill(costs, shape, plan, full, left, decoder_eval, generated is not None)
        if with_draft is not None:
            return with_draft
    # the budget that trains both at full size, from this machine's costs
    total = sum(_phases(costs, shape, replace(scaled(full, max_scale), dev_prompts=full.dev_prompts),
                        decoder_eval, generated).values())  # fmt: skip
    need = math.ceil((elapsed_s + total / SAFETY) / 60)
    note = f"EAGLE-3 head only: --budget-min {need} trains the distilled draft too"
    if plan.note == "the full quickstart fits":
        note = f"the full EAGLE-3 head fits; {note}"
    elif plan.note:
        note = f"{plan.note}; {note}"
    return replace(plan, note=note)


def _phases(costs, shape, sz: QuickstartSizes, decoder_eval: bool, generated: int | None) -> dict[str, float]:
    p = predict(costs, shape, sz, decoder_eval=decoder_eval)
    return {**p, "generate": 0.0} if generated is not None else p


def _fit(costs, shape, full, budget_s, elapsed_s, left, max_scale, generated, decoder_eval) -> Plan:
    """The largest scale of `full` that fits `left` seconds, else its minimal plan, else the refusal."""

    def sizes_at(s: float) -> QuickstartSizes:
        sz = scaled(full, s)
        if generated is not None:
            sz = with_data(full, generated, sz.text_examples, sz.head_text_examples)
        return sz

    def phases(sz: QuickstartSizes) -> dict[str, float]:
        return _phases(costs, shape, sz, decoder_eval, generated)

    def fits(sz: QuickstartSizes) -> bool:
        return sum(phases(sz).values()) <= left

    top = sizes_at(max_scale)
    if fits(top):
        note = "the full quickstart fits" if max_scale >= 1.0 and generated is None else ""
        return Plan(top, phases(top), budget_s, elapsed_s, max_scale, note)
    lo, hi = MIN_SCALE, max_scale
    if lo < hi and fits(sizes_at(lo)):
        for _ in range(30):  # predicted time grows with s: bisect for the largest s that fits
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if fits(sizes_at(mid)) else (lo, mid)
        sz = sizes_at(lo)
        return Plan(sz, phases(sz), budget_s, elapsed_s, lo)
    small = minimal(full)
    if generated is not None:  # the dev-eval references are answered already: keep them
        small = replace(small, train_prompts=generated, dev_prompts=full.dev_prompts)
    if fits(small):
        return Plan(
            small,
            phases(small),
            budget_s,
            elapsed_s,
            MIN_SCALE,
            "minimal plan: fewer dev-eval references and a shorter decoder eval, numbers are rough",
        )
    need = elapsed_s + sum(phases(small).values()) / SAFETY
    raise DraftsmithError(
        f"a {budget_s / 60:g}-min budget is too small for the quickstart on this machine: even the smallest plan "
        f"({_smallest(small)}) needs about {need / 60:.1f} min here (target scoring {costs.score_tok_s:.0f} "
        f"tokens/s, draft training {costs.train_tok_s:.0f} tokens/s); pass --budget-min {math.ceil(need / 60)} "
        "or more"
    )


def _smallest(s: QuickstartSizes) -> str:
    if s.head_steps:
        return f"{s.train_prompts} prompts, {s.head_text_examples} text pairs, {s.head_steps} head steps"
    return f"{s.train_prompts} prompts, {s.text_examples} text pairs, {s.steps} steps"


def _add_distill(costs, shape, plan: Plan, full, left, decoder_eval, generated: bool) -> Plan | None:
    """`plan` (the head at full size) with the distilled draft at the largest scale in [DISTILL_MIN_SCALE, 1] of
    `full`'s distillation that still fits, on the same answers; None if not even DISTILL_MIN_SCALE fits."""
    head = plan.sizes

    def sizes_at(s: float) -> QuickstartSizes:
        sz = with_data(full, head.train_prompts, round(full.text_examples * s), head.head_text_examples)
        return replace(sz, head_steps=head.head_steps)

    def phases(sz):
        return _phases(costs, shape, sz, decoder_eval, None if not generated else head.train_prompts)

    def fits(sz):
        return sum(phases(sz).values()) <= left

    if fits(sizes_at(1.0)):
        sz = sizes_at(1.0)
        return Plan(sz, phases(sz), plan.budget_s, plan.elapsed_s, plan.scale, plan.note)
    lo, hi = DISTILL_MIN_SCALE, 1.0
    if not fits(sizes_at(lo)):
        return None
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if fits(sizes_at(mid)) else (lo, mid)
    sz = sizes_at(lo)
    note = f"the distilled draft at {lo:.2f} of its full data and steps"
    return Plan(sz, phases(sz), plan.budget_s, plan.elapsed_s, plan.scale, note)


def plan_record(plan: Plan) -> dict:
    """A plan as quickstart.json records it."""
    return {
        "sizes": asdict(plan.sizes),
        "scale": plan.scale,
        "predicted_s": plan.phases,
        "budget_s": plan.budget_s,
        "elapsed_at_plan_s": plan.elapsed_s,
        "predicted_total_s": plan.total_s,
        "note": plan.note,
    }


def time_table(first: Plan, plan: Plan, timings: dict) -> list[str]:
    """Predicted vs measured minutes per phase planned (generation as first planned, the rest as last planned)."""
    p, m = plan.phases, 60.0
    rows = [("generate", first.phases["generate"], timings["generate_s"])]
    if plan.sizes.head_steps:
        rows += [
            ("head train", p["head_train"], timings["head_s"]),
            ("head decoder eval", p["head_decoder_eval"], timings.get("head_decoder_eval_s", 0.0)),
        ]
    if plan.sizes.steps:
        rows += [
            ("score + evals", p["score"] + p["evals"], timings["distill_s"] - timings["train_s"]),
            ("train", p["train"], timings["train_s"]),
            ("decoder eval", p["decoder_eval"], timings.get("decoder_eval_s", 0.0)),
        ]
    return [
        "minutes per phase, predicted / measured: "
        + ", ".join(f"{name} {a / m:.1f} / {b / m:.1f}" for name, a, b in rows)
        + f"; load + measure {timings['load_and_measure_s'] / m:.1f}; total {timings['total_s'] / m:.1f} "
        f"of the {plan.budget_s / m:g}-min budget"
    ]


def dev_eval_sets(tokenizer=None, max_length: int | None = None) -> tuple[list, list]:
    """(Vicuna-80, HumanEval) dev-eval prompts (evaluation only), without any that would not fit `max_length`
    tokens with the chat template applied."""
    from draftsmith.prompts import load_prompts, prompt_ids

    def fits(p) -> bool:
        return tokenizer is None or max_length is None or len(prompt_ids(tokenizer, p)) <= max_length

    return (
        [p for p in load_prompts("builtin:vicuna") if fits(p)],
        [p for p in load_prompts("builtin:humaneval") if fits(p)],
    )


def dev_eval_prompts(n: int, tokenizer=None, max_length: int | None = None, sets: tuple | None = None):
    """n dev-eval prompts, half Vicuna-80 and half HumanEval (dev_lens counts them the same way)."""
    vic, he = sets or dev_eval_sets(tokenizer, max_length)
    return vic[: (n + 1) // 2] + he[: n // 2]


def costs_line(costs, seconds: float) -> str:
    """One line: what the first seconds measured (printed before the plan)."""
    f = costs.forward_s
    return (
        f"measured in {seconds:.0f} s: generation step {costs.gen_step_s * 1e3:.0f} ms at batch {GEN_BATCH}, "
        f"target scoring {costs.score_tok_s:.0f} tokens/s, draft training {costs.train_tok_s:.0f} tokens/s, "
        + (f"EAGLE-3 head training {costs.head_train_tok_s:.0f} tokens/s, " if costs.head_train_tok_s else "")
        + f"decode step {f[1] * 1e3:.1f} ms, verify of 5 tokens {f[5] / f[1]:.2f}x a step"
    )
