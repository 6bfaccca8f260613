"""An adaptive draft length (`--k auto`): each step's k chosen from the acceptance measured so far on this request
and the costs measured at the start of the run, down to 0 (a plain target step) where drafting does not pay, and
back up where it does.

Model (Leviathan et al. 2023, Thm 3.8, with measured costs, as decode.speed): drafting k tokens costs
k * t_draft + t_verify(1 + nodes(k)) and commits tau(k) = 1 + sum_{i<=k} prod_{j<=i} a_j tokens in expectation, a_j
the conditional acceptance at depth j (REFERENCE: the general tau); a plain step commits 1 token in t_step. The
policy takes the k in 0..k_max with the most tokens per second, tau(k) / cost(k) (EAGLE-2's dynamic depth and
SpecDec++'s stopping rule decide from the draft's confidence instead; this rule needs none, so it fits every
drafter). The a_j are this request's counts (steps that accepted depth j over steps that reached it), discounted by
`decay` per step so that recent text weighs more, plus `prior_steps` pseudo-steps at a prior: `prior_alpha` for
depth 1 and, for each deeper depth, the estimate of the depth above it. A depth the policy has not drafted yet so
borrows what the request measured above it, instead of a fixed guess that keeps the policy shallow where the draft is
good (with a fixed 0.6, depths 1-2 at .95 and a 0.17-step draft chose k 3 while k 5 paid more). At k = 0 the
counts stop moving, so after `probe_every` plain steps in a row the policy drafts once at its best k > 0 and learns
whether drafting pays again (SuffixDecoding re-probes its adaptive length the same way). The drafter's cost per
drafted token is re-measured on the request as it drafts (it grows with the context: a long prompt costs a draft
LM more per token than the short one timed at the start).

Lossless by construction: a step's k is fixed before its draft, from earlier steps only (never from this step's
draft or target tokens), and every step is verified by the same rule (decode.verify).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from .speed import StepCosts


@dataclass
class AdaptiveK:
    """The draft-length policy of one run; `start()` resets it for each request (SpeculativeDecoder.generate)."""

    costs: StepCosts
    """step_s (a plain step), verify_s by block width, draft_s per drafted token: measured at the start."""
    k_max: int
    """The deepest draft a step may take."""
    nodes: Callable[[int], int] = lambda k: k
    """Nodes a proposal of depth k holds (a tree drafter's verify block is 1 + nodes(k))."""
    prior_alpha: float = 0.6
    prior_steps: float = 2.0
    decay: float = 0.95
    probe_every: int = 8
    draft_blend: float = 0.3
    """Weight of each step's measured drafting cost per token in the running estimate."""
    chosen: list[int] = field(default_factory=list)  # this request's k per step
    probes: int = 0

    def __post_init__(self):
        if self.k_max < 1:
            raise ValueError(f"k_max must be >= 1, got {self.k_max}")
        self.start()

    def start(self) -> None:
        """A new request: no acceptance measured yet, the start's drafting cost."""
        self.reached = [0.0] * (self.k_max + 1)  # [j]: steps that drafted depth j with depths < j accepted
        self.hits = [0.0] * (self.k_max + 1)  # [j]: those that accepted depth j
        self.draft_s = self.costs.draft_s
        self.chosen, self.probes, self._plain_run = [], 0, 0

    def alpha(self) -> list[float]:
        """The conditional acceptance estimate a_1 .. a_{k_max}, each depth's prior the estimate above it."""
        out, prior, w = [], self.prior_alpha, self.prior_steps
        for j in range(1, self.k_max + 1):
            prior = (self.hits[j] + w * prior) / (self.reached[j] + w)
            out.append(prior)
        return out

    def rates(self) -> list[float]:
        """Expected tokens per second at k = 0 .. k_max."""
        out, tau, reach = [1.0 / self.costs.step_s], 1.0, 1.0
        for k, a in enumerate(self.alpha(), start=1):
            reach *= a
            tau += reach
            out.append(tau / (k * self.draft_s + self.costs.verify(1 + self.nodes(k))))
        return out

    def choose(self) -> int:
        """This step's k (recorded in `chosen`)."""
        rates = self.rates()
        k = max(range(len(rates)), key=lambda i: (rates[i], -i))  # ties: the shorter draft
        if k == 0:
            self._plain_run += 1
            if self._plain_run >= self.probe_every:  # learn whether drafting pays again
                self._plain_run = 0
                self.probes += 1
                k = max(range(1, len(rates)), key=lambda i: (rates[i], -i))
        else:
            self._plain_run = 0
        self.chosen.append(k)
        return k

    def observe(self, drafted: int, accepted: int, draft_s: float = 0.0) -> None:
        """After a step that drafted `drafted` deep and accepted `accepted` of them, in draft_s seconds."""
        if drafted <= 0:
            return
        self.reached = [r * self.decay for r in self.reached]
        self.hits = [h * self.decay for h in self.hits]
        for j in range(1, min(drafted, self.k_max) + 1):
            if accepted >= j - 1:
                self.reached[j] += 1
                self.hits[j] += accepted >= j
        if draft_s > 0:
            self.draft_s += self.draft_blend * (draft_s / drafted - self.draft_s)

    def summary(self) -> dict:
        """This request's decisions, for eval.json: k per step as a string, how often each k, the probes."""
        return {
            "k_steps": "".join(str(k) if k < 10 else f"({k})" for k in self.chosen),
            "chosen": {str(k): n for k, n in sorted(Counter(self.chosen).items())},
            "plain_steps": self.chosen.count(0),
            "probes": self.probes,
            "draft_s_end": self.draft_s,
        }


def start_policy(decoder, proposer, k_max: int, warm_spec, warm_plain, context: int = 128) -> AdaptiveK:
    """The policy of one drafter for a run, from costs measured now on this machine: a plain step and a verify
    of every block width the drafter may ask for (decode.speed.measure_forward_costs, through the decoder's own
    forward, compiled or not), and the drafter's cost per drafted token from a warm-up generation at k_max
    (`warm_spec`, beside the plain warm-up `warm_plain`: GenerationResults)."""
    from .proposer import proposal_nodes
    from .speed import costs_from_results, measure_forward_costs

    widths = sorted({1, *(1 + proposal_nodes(proposer, k) for k in range(1, k_max + 1))})
    forward = measure_forward_costs(decoder.target, widths, context=context, decoder=decoder)
    warm = costs_from_results([warm_spec], [warm_plain])
    costs = StepCosts(
        step_s=forward[1],
        verify_s={float(n): s for n, s in forward.items() if n > 1},
        draft_s=warm.draft_s if warm is not None else 0.0,
    )
    return AdaptiveK(costs, k_max, nodes=lambda k: proposal_nodes(proposer, k))
