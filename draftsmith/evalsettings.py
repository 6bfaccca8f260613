"""What a decoder measurement runs with (`EvalSettings`) and what eval.json records of it (`conditions`).

One object carries the settings from the command line to the decoder, and the same object writes eval.json's
`conditions`, so what is recorded is what was used. `CONDITION_KEYS` is the one list of those keys (eval.json,
model cards and tests read it from here).
"""

from __future__ import annotations

import datetime
from dataclasses import asdict, dataclass, fields, replace

from draftsmith.errors import DraftsmithError
from draftsmith.prompts import check_limit
from draftsmith.sampling import SamplingParams

TAU_CONVENTION = "tau = tokens per target verify forward, bonus/correction token included"


@dataclass(frozen=True)
class EvalSettings:
    """How drafters are measured against plain decoding (`draftsmith eval`, `draftsmith bench drafters`, quickstart)."""

    k: int = 4
    """Draft tokens per step (the depth of a tree drafter's tree); with adaptive_k the most a step may take."""
    adaptive_k: bool = False
    """`--k auto`: each step's draft length, 0 (a plain step) to k, from the acceptance measured so far on the prompt
    and the costs measured at the start (decode.adaptive); batch size 1, draft: and ngram: drafters."""
    temperature: float = 0.0
    """0 = greedy (the losslessness check is on)."""
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 128
    seed: int = 0
    """Prompt i is decoded with seed + i (plain and speculative alike)."""
    compile: bool = False
    """StaticCache + torch.compile of the target step (CUDA; see decode.decoder.SpeculativeDecoder)."""
    limit: int | None = None
    """First N prompts only."""
    warmup_tokens: int = 16
    """The first prompt is decoded once this long by every method before timing; excluded from every number."""
    batch_sizes: tuple[int, ...] = ()
    """Also decode the prompts in batches of these sizes (decode.batching; 1 is added as the reference);
    () = batch 1 only."""
    sweep_k: bool = False
    """At every batch size, also measure every draft length 1..k (the best k measured)."""

    def __post_init__(self):
        if self.k < 1:
            raise DraftsmithError(f"k must be >= 1 (draft tokens per step), got {self.k}")
        if self.max_new_tokens < 1:
            raise DraftsmithError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        check_limit(self.limit)
        if self.adaptive_k and (max(self.batch_sizes, default=1) > 1 or self.sweep_k):
            raise DraftsmithError(
                "--k auto chooses each step's draft length for one prompt at a time; drop --batch-size / --sweep-k"
            )
        if self.batch_sizes:
            if any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in self.batch_sizes):
                raise DraftsmithError(f"batch sizes must be integers >= 1, got {list(self.batch_sizes)}")
            object.__setattr__(self, "batch_sizes", tuple(sorted({1, *self.batch_sizes})))
            if self.compile and max(self.batch_sizes) > 1:
                raise DraftsmithError(
                    "--compile decodes one prompt at a time; drop --compile or --batch-size"
                )
        self.params  # noqa: B018 - SamplingParams validates temperature/top_p/top_k with one-line errors

    @property
    def params(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)

    def with_k(self, k: int) -> EvalSettings:
        """The same settings at another draft length (a drafter measured at its own k)."""
        return replace(self, k=k)


SETTING_KEYS = tuple(f.name for f in fields(EvalSettings))
RUN_KEYS = (
    "target",
    "drafter",
    "drafter_kind",
    "tree",  # the tree a tree drafter drafts (its `tree` attribute), False for chains
    "prompts",  # the prompt source
    "n_prompts",
    "device",
    "dtype",
    "hardware",
    "cpu_layout",
)
"""What the run measured on: filled by whoever loaded the target and built the drafter."""
CONDITION_KEYS = (
    *RUN_KEYS[:3],
    *SETTING_KEYS,
    *RUN_KEYS[3:],
    "torch_version",
    "draftsmith_version",
    "date",
    "tau_convention",
    "warmup",
)
"""Every key of eval.json's `conditions`, in the order written."""
METRIC_KEYS = ("k", "tree", "temperature", "top_p", "top_k", "max_new_tokens", "device", "dtype", "hardware")
"""The conditions a published number depends on (a model card's metric arguments)."""


def conditions(settings: EvalSettings, **run) -> dict:
    """eval.json `conditions`: the settings as used plus the run's facts (every key of RUN_KEYS)."""
    import torch

    import draftsmith

    missing = set(RUN_KEYS) - run.keys()
    unknown = run.keys() - set(RUN_KEYS)
    if missing or unknown:
        raise TypeError(f"conditions(): missing {sorted(missing)}, unknown {sorted(unknown)}")
    values = {
        **asdict(settings),
        **run,
        "torch_version": torch.__version__,
        "draftsmith_version": draftsmith.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "tau_convention": TAU_CONVENTION,
        "warmup": f"first prompt decoded once ({settings.warmup_tokens} tokens, every method) before timing; "
        "excluded",
    }
    return {key: values[key] for key in CONDITION_KEYS}


AUTO_K_MAX = 6
"""`--k auto`: the deepest draft a step may take (`auto:N` for another)."""


def parse_k(text: str) -> tuple[int, bool]:
    """--k: '4' -> (4, False); 'auto' -> (AUTO_K_MAX, True); 'auto:8' -> (8, True). Anything else is one line."""
    head, _, most = text.partition(":")
    try:
        if head == "auto":
            k, adaptive = (int(most) if most else AUTO_K_MAX), True
        else:
            k, adaptive = (int(text), False)
    except ValueError:
        k = 0
    if k < 1:
        raise DraftsmithError(
            f"--k must be an integer >= 1 (draft tokens per step) or auto (auto:N: at most N), got {text!r}"
        )
    return k, adaptive


def parse_batch_sizes(text: str) -> tuple[int, ...]:
    """'1,2,4,8' -> (1, 2, 4, 8); anything else is a one-line error naming the fix."""
    try:
        sizes = tuple(int(x) for x in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or any(b < 1 for b in sizes):
        raise DraftsmithError(
            f"--batch-size must be a comma-separated list of integers >= 1, e.g. 1,2,4,8; got {text!r}"
        )
    return sizes
