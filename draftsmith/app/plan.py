"""The quickstart's sizes, and a planner that fits them into a time budget from costs measured on this machine.

`plan_quickstart(costs, shape, budget_s, elapsed_s)` is a pure function: `MachineCosts` are rates and seconds
measured in the first seconds of a run (draftsmith.app.calibrate), `DataShape` the token lengths of the prompts
and text the quickstart would use. It scales the full quickstart's data and steps by one factor s (generated
prompts, text pairs and training steps together, so the draft sees the same ~0.8 epochs of a smaller data set)
and picks the largest s in [MIN_SCALE, 1] whose predicted time fits the budget; dev-eval references and the
decoder eval stay whole so the reported before/after numbers keep their size. If even the smallest plan does not
fit, it says how many minutes this machine needs instead of starting.
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
MAX_BUDGET_MIN = 24 * 60
MIN_BUDGET_MIN = 1.0
"""No plan fits less: the smallest is predicted at ~66 s of work on a 2-core CPU with AMX in bf16, after ~14 s of
loading and measuring (Zen 4 EPYC); refused before those seconds are spent."""


@dataclass
class QuickstartSizes:
    train_prompts: int
    text_examples: int  # builtin:train-text prompt + response pairs the target scores (fixed data), 0 = none
    dev_prompts: int  # split evenly between vicuna and humaneval
    max_new_tokens: int
    steps: int
    batch_size: int
    lr: float
    layers: list[int]
    vocab_size: int
    eval_prompts: int  # decoder eval
    eval_max_new_tokens: int


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
)


def heldout_size(sizes: QuickstartSizes) -> int:
    """Generated examples held out from training (the distillation's data.eval_size)."""
    return max(1, min(16, sizes.train_prompts // 8))


def scaled(full: QuickstartSizes, s: float) -> QuickstartSizes:
    """`full` with generated prompts, text pairs and steps scaled by s (steps follow the data: same epochs)."""
    prompts = max(round(full.train_prompts * s), 8)
    text = round(full.text_examples * s)
    per_seq = full.steps / max(full.train_prompts + full.text_examples, 1)
    steps = max(round(per_seq * (prompts + text)), 1)
    return replace(full, train_prompts=prompts, text_examples=text, steps=steps)


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
    """Predicted seconds per phase: generate, score (setup + target scoring), train, evals (before/after),
    decoder_eval (0 when skipped)."""
    gen = [n for n in shape.train_prompt_lens[: sizes.train_prompts] if n <= MAX_PROMPT_TOKENS]
    dev = dev_lens(shape, sizes.dev_prompts)
    held = min(heldout_size(sizes), max(len(gen) - 1, 0))
    gen_seq = [min(n + sizes.max_new_tokens, MAX_LENGTH) for n in gen]
    train_seqs = gen_seq[held:] + [min(n, MAX_LENGTH) for n in shape.text_lens[: sizes.text_examples]]
    eval_tokens = sum(gen_seq[:held]) + sum(n + sizes.max_new_tokens for n in dev)
    saves = 5  # save_every = steps // 4: four checkpoints, then final/
    # the draft's share of an eval forward: a forward is ~1/3 of a training step (forward + backward)
    eval_rate = 1 / costs.score_tok_s + 1 / (3 * costs.train_tok_s)
    T = sizes.eval_max_new_tokens
    spec_steps = math.ceil((T - 1) / EVAL_TAU_GUESS)
    eval_prompts = dev_lens(shape, sizes.eval_prompts)
    per_prompt = [
        2 * n / costs.gen_prefill_tok_s
        + (T - 1) * costs.forward(1)
        + spec_steps * (costs.forward(k + 1) + k * costs.draft_step_s)
        for n in eval_prompts
    ]
    warmup = 16 * (costs.forward(1) + costs.forward(k + 1) + k * costs.draft_step_s) / EVAL_TAU_GUESS
    return {
        "generate": _generate_s(costs, gen, sizes.max_new_tokens)
        + _generate_s(costs, dev, sizes.max_new_tokens),
        "score": sizes.text_examples * costs.text_load_s + sum(train_seqs) / costs.score_tok_s,
        "train": sizes.steps
        * sizes.batch_size
        * expected_max(train_seqs, sizes.batch_size)
        / costs.train_tok_s
        + saves * costs.save_s,
        "evals": 2 * eval_tokens * eval_rate,
        "decoder_eval": sum(per_prompt) + warmup if decoder_eval else 0.0,
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
        phases = ", ".join(f"{name} {sec / m:.1f}" for name, sec in self.phases.items())
        scale = "given sizes" if self.scale is None else f"{self.scale:.2f} of the full quickstart"
        return [
            f"plan ({scale}): {s.train_prompts} builtin:train prompts answered (<= {s.max_new_tokens} tokens) + "
            f"{s.text_examples} builtin:train-text pairs scored; {s.steps} steps x {s.batch_size}; "
            f"{s.dev_prompts} dev-eval references; decoder eval {s.eval_prompts} prompts x {s.eval_max_new_tokens} tokens",
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
    """The largest scale s <= max_scale of `full` whose predicted time fits SAFETY x the time left, or the
    minimal plan, or a one-line DraftsmithError saying how many minutes this machine needs.

    `generated`: the training prompts are already answered (a re-plan after generation): their number is fixed,
    generation costs nothing more, and only text pairs and steps shrink (pass the plan's sizes as `full`, with
    the full quickstart's data and steps). `decoder_eval`: False when the decoder eval is skipped."""
    left = SAFETY * (budget_s - elapsed_s)

    def sizes_at(s: float) -> QuickstartSizes:
        sz = scaled(full, s)
        if generated is not None:
            per_seq = full.steps / max(full.train_prompts + full.text_examples, 1)
            sz = replace(
                sz, train_prompts=generated, steps=max(round(per_seq * (generated + sz.text_examples)), 1)
            )
        return sz

    def phases(sz: QuickstartSizes) -> dict[str, float]:
        p = predict(costs, shape, sz, decoder_eval=decoder_eval)
        return {**p, "generate": 0.0} if generated is not None else p

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
        f"({small.train_prompts} prompts, {small.text_examples} text pairs, {small.steps} steps) needs about "
        f"{need / 60:.1f} min here (target scoring {costs.score_tok_s:.0f} tokens/s, draft training "
        f"{costs.train_tok_s:.0f} tokens/s); pass --budget-min {math.ceil(need / 60)} or more"
    )


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
    """Predicted vs measured minutes per phase (generation as first planned, the rest as last planned)."""
    p, m = plan.phases, 60.0
    rows = [
        ("generate", first.phases["generate"], timings["generate_s"]),
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
        f"decode step {f[1] * 1e3:.1f} ms, verify of 5 tokens {f[5] / f[1]:.2f}x a step"
    )
