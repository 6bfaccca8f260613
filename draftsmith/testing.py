"""Tiny offline models and tokenizers for tests and examples (no downloads, a few MB, fast on CPU), and the
losslessness oracles every drafter kind is tested with.

`tiny_tokenizer()` is a byte-level BPE trained on a fixed corpus (deterministic) with ChatML special tokens
and a chat template; `tiny_llama(seed=...)` is a 2-layer Llama over that vocabulary. Different seeds give
different (untrained, mutually disagreeing) models with the same tokenizer: a target and a draft.
`tiny_qwen2(seed=...)` is the second architecture: Qwen2 (q/k/v biases, tied embeddings, RoPE theta 1e6) over its
own tokenizer (`tiny_tokenizer("qwen2")`: the same BPE plus Qwen2.5's extra special tokens) and a padded
vocabulary (config vocab_size 448 > 390 tokens, as Qwen2.5's 151,936 > 151,665), so a Llama-only assumption cannot
hide; `tiny_model(arch)` / `save_tiny(arch=...)` / `save_tiny_like(target)` pick by architecture.

Oracles (one per property; `decoder` is a draftsmith.decode SpeculativeDecoder, passed in because this core module
imports nothing above core):
- `assert_greedy_lossless(decoder, proposer, prompts)`: greedy speculative output == greedy plain decoding;
- `recompute_greedy(target, prompt, n)`: greedy decoding by full forwards, no cache (what a rolled-back cache gives);
- `assert_batch_greedy_lossless(decoder, proposer, prompts)`: the prompts decoded as ONE batch (different lengths,
  rows stopping at different steps) give every row exactly its greedy batch-1 plain decoding, and a row that stopped
  is in no later target forward;
- `sampled_joint_tvd(decoder, proposer, prompt)`: total-variation distance between the joint law of the first
  generated tokens under speculative sampling and the target's exact joint law (small vocabularies); `batch_with=`
  decodes the prompt in a batch beside other prompts.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN2_EXTRA = [
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
]
QWEN2_VOCAB = (
    448  # the config's (padded) vocabulary: embedding rows past the tokenizer, as Qwen2.5 ships them
)
TINY_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)
"""The sizes and special ids every tiny architecture shares (TINY_ARCHS)."""
ARCHS = ("llama", "qwen2")
"""The two architectures the per-feature tests run on; every architecture is in TINY_ARCHS."""

_CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "Speculative decoding drafts tokens cheaply and verifies them with the target model in one pass.",
    "Question: what is 12 plus 30? Answer: 42. Let's think step by step about the numbers involved.",
    "Write a short poem about the sea, the wind and the stars that guide sailors home at night.",
]


@lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return tok.to_str()


def tiny_tokenizer(arch: str = "llama"):
    """The tiny BPE tokenizer (arch "qwen2": plus Qwen2.5's extra special tokens, 390 tokens)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json()),
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|im_end|>",
    )
    tok.chat_template = CHAT_TEMPLATE
    if arch == "qwen2":
        tok.add_special_tokens({"additional_special_tokens": QWEN2_EXTRA})
    elif arch != "llama":
        raise ValueError(f"unknown tiny tokenizer {arch!r}; use one of {ARCHS}")
    return tok


def tiny_config(vocab_size: int, arch: str = "llama", **overrides):
    """The config of a tiny `arch` (TINY_ARCHS) over `vocab_size` tokens: TINY_SHAPE, the entry's own fields, then
    `overrides`, built by transformers' own config class."""
    import transformers

    entry = tiny_arch(arch)
    kw = dict(vocab_size=vocab_size, **TINY_SHAPE, **entry.fields)
    kw.update(overrides)
    return getattr(transformers, entry.config)(**kw)


@dataclass(frozen=True)
class TinyArch:
    """One tiny architecture: its transformers config and model classes and what it sets beyond TINY_SHAPE."""

    config: str
    """The transformers config class (built with TINY_SHAPE + fields)."""
    model: str
    """The *ForCausalLM class."""
    fields: dict
    what: str
    """What it exercises that Llama does not."""
    tokenizer: str = "llama"
    """tiny_tokenizer(tokenizer) is its tokenizer."""
    vocab: int | None = None
    """The config's vocabulary when it is not the tokenizer's (padded, as Qwen2.5 ships it)."""

    @property
    def model_type(self) -> str:
        import transformers

        return getattr(transformers, self.config).model_type


_ATTN16 = dict(head_dim=16)  # 4 heads x 16 = hidden 64 where the class's default head_dim is its real model's
TINY_ARCHS: dict[str, TinyArch] = {
    "llama": TinyArch("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False), "the reference"),
    "qwen2": TinyArch(
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        "q/k/v biases, tied embeddings, RoPE theta 1e6, a padded vocabulary and extra special tokens",
        tokenizer="qwen2",
        vocab=QWEN2_VOCAB,
    ),
    "qwen3": TinyArch(
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(_ATTN16, tie_word_embeddings=True),
        "q/k RMS norms, an explicit head_dim, tied embeddings",
    ),
    "qwen3_moe": TinyArch(
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            _ATTN16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, tie_word_embeddings=False
        ),
        "a mixture of experts in every layer (top-2 of 4) and q/k norms",
    ),
    "mistral": TinyArch(
        "MistralConfig",
        "MistralForCausalLM",
        dict(sliding_window=8, tie_word_embeddings=False),
        "sliding-window attention (8 tokens: shorter than every oracle sequence)",
    ),
    "gemma2": TinyArch(
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            _ATTN16,
            query_pre_attn_scalar=16,
            sliding_window=8,
            final_logit_softcapping=3.0,
            attn_logit_softcapping=50.0,
            # untied: with Gemma's tied head and sqrt(hidden)-scaled embeddings a random 2-layer model predicts
            # its input token again and again (greedy repeats one token), blind to what the context holds
            tie_word_embeddings=False,
        ),
        "final logit soft-capping (3.0: it bends the tiny model's logits), scaled embeddings, pre/post norms, "
        "local (sliding 8) / global layers",
    ),
    "phi3": TinyArch(
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(tie_word_embeddings=False),
        "fused qkv and gate/up projections",
    ),
}
"""Every tiny architecture, by name: a new one is one entry (tests/test_architectures.py runs every drafter kind on
each)."""


def tiny_arch(arch: str) -> TinyArch:
    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown tiny architecture {arch!r}; use one of {tuple(TINY_ARCHS)}")
    return TINY_ARCHS[arch]


def arch_of(model_or_config) -> str:
    """The TINY_ARCHS name of a model's (or config's) architecture, by its model_type."""
    cfg = getattr(model_or_config, "config", model_or_config)
    for name, entry in TINY_ARCHS.items():
        if entry.model_type == cfg.model_type:
            return name
    raise ValueError(f"no tiny architecture has model_type {cfg.model_type!r}")


def tiny_model(arch: str = "llama", seed: int = 0, vocab_size: int | None = None, **overrides):
    """A random 2-layer `arch` (TINY_ARCHS; eval mode, fp32). Logits are sharpened (initializer_range 0.2) so greedy
    chains are not all ties. Different seeds give different models over the same tokenizer: a target and a draft."""
    import transformers

    entry = tiny_arch(arch)
    if vocab_size is None:
        vocab_size = entry.vocab or len(tiny_tokenizer(entry.tokenizer))
    torch.manual_seed(seed)
    cfg = tiny_config(vocab_size, arch, **overrides)
    cfg.initializer_range = 0.2
    return getattr(transformers, entry.model)(cfg).eval()


def tiny_llama(seed: int = 0, vocab_size: int | None = None, **overrides):
    """tiny_model("llama")."""
    return tiny_model("llama", seed, vocab_size, **overrides)


def tiny_qwen2(seed: int = 0, vocab_size: int | None = None, **overrides):
    """tiny_model("qwen2")."""
    return tiny_model("qwen2", seed, vocab_size, **overrides)


def save_tiny(path: str | Path, seed: int = 0, arch: str = "llama", **overrides) -> Path:
    """Write a tiny model + its tokenizer folder (safetensors) and return its path."""
    path = Path(path)
    model = tiny_model(arch, seed, **overrides)
    model.save_pretrained(path)
    tiny_tokenizer(tiny_arch(arch).tokenizer).save_pretrained(path)
    return path


def save_tiny_like(path: str | Path, target, seed: int = 1, **overrides) -> Path:
    """A tiny model folder of `target`'s architecture and vocabulary (a draft for it), with its tokenizer."""
    return save_tiny(path, seed, arch=arch_of(target), vocab_size=target.config.vocab_size, **overrides)


def oracle_prompts(vocab_size: int, n: int = 3, seed: int = 0) -> list[torch.Tensor]:
    """n prompts [1, T] of ordinary token ids (no specials), lengths 9, 14, 23, ..."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, min(vocab_size, 380), (1, 9 + 5 * i + 4 * (i > 1)), generator=g) for i in range(n)
    ]


@torch.inference_mode()
def recompute_greedy(target, prompt: torch.Tensor, n: int) -> list[int]:
    """The target's greedy continuation of `prompt` [1, T], n tokens, each from a full forward over the whole
    sequence (no KV cache: the reference a cache that rolls back must reproduce)."""
    ids = prompt.reshape(1, -1)
    for _ in range(n):
        ids = torch.cat([ids, target(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return ids[0, prompt.numel() :].tolist()


def assert_greedy_lossless(decoder, proposer, prompts, *, k: int = 4, max_new_tokens: int = 24) -> list:
    """Greedy speculative decoding with `proposer` returns exactly the tokens of greedy plain decoding, and runs one
    target forward per step, for every prompt. Returns the speculative GenerationResults (acceptance may be zero:
    untrained drafters must be lossless too)."""
    results = []
    for ids in prompts:
        plain = decoder.generate(ids, None, max_new_tokens=max_new_tokens).tokens
        spec = decoder.generate(ids, proposer, k=k, max_new_tokens=max_new_tokens)
        name = getattr(proposer, "name", type(proposer).__name__)
        assert spec.tokens == plain, (
            f"{name}: speculative {spec.tokens} != plain {plain} (prompt {ids.tolist()})"
        )
        assert spec.target_forwards == 1 + len(spec.accepted), name
        results.append(spec)
    return results


def assert_batch_greedy_lossless(decoder, proposer, prompts, *, k: int = 4, max_new_tokens: int = 24):
    """Greedy speculative decoding of `prompts` ([1, T_b] of different lengths) together, as one batch: every row
    equals greedy batch-1 plain decoding of its prompt, and rows stop at different steps (for this call the token the
    first prompt emits at step max_new_tokens // 3 is also an end token, so that row ends early while others run
    on). Each target forward holds exactly the rows still decoding. Returns the BatchResult."""
    eos = decoder.eos_ids
    first = decoder.generate(prompts[0], None, max_new_tokens=max_new_tokens).tokens
    decoder.eos_ids = set(eos) | {first[min(max_new_tokens // 3, len(first) - 1)]}
    try:
        ref = [decoder.generate(p, None, max_new_tokens=max_new_tokens).tokens for p in prompts]
        out = decoder.generate_batch(
            [p.reshape(-1) for p in prompts], proposer, k=k, max_new_tokens=max_new_tokens
        )
    finally:
        decoder.eos_ids = eos
    name = getattr(proposer, "name", type(proposer).__name__)
    assert len({len(r) for r in ref}) > 1, f"the rows should stop at different steps: {ref}"
    for b, (row, want) in enumerate(zip(out.rows, ref)):
        assert row.tokens == want, f"{name} row {b} of {len(prompts)}: {row.tokens} != batch-1 plain {want}"
        assert row.target_forwards == 1 + len(row.accepted), name
    steps = range(len(out.forward_rows))
    assert out.forward_rows == [sum(r.target_forwards > j for r in out.rows) for j in steps], name
    return out


def tree_around(
    want, k: int, g: torch.Generator, vocab: tuple[int, int] = (3, 380)
) -> tuple[list[int], list[int]]:
    """A test drafter's tree: at each depth d < k the wanted token `want(d)` among two random siblings from `vocab`
    (left out at random one time in four), the next depth under it; stops where it is left out.
    -> (tokens, parents) in Proposal's node order."""
    toks, parents, parent = [], [], -1
    for d in range(k):
        wanted = want(d)
        kids = torch.randint(*vocab, (2,), generator=g).tolist()
        slot = int(torch.randint(0, 4, (), generator=g))  # 3: the wanted token is missing at this depth
        if slot < 3:
            kids.insert(slot, wanted)
        chosen = None
        for t in kids:
            toks.append(t)
            parents.append(parent)
            chosen = len(toks) - 1 if t == wanted and chosen is None else chosen
        if chosen is None:
            break
        parent = chosen
    return toks, parents


@torch.inference_mode()
def exact_joint(target, prompt: torch.Tensor, tokens: int = 3, temperature: float = 1.0) -> torch.Tensor:
    """The target's exact joint law [V] * tokens of its next `tokens` tokens after `prompt` [1, T], from full
    forwards over every prefix (independent of any cache or decoder)."""
    v = target.config.vocab_size

    def probs(ids):
        logits = target(ids.to(next(target.parameters()).device)).logits[0, -1].float().cpu()
        return torch.softmax(logits / temperature, -1)

    def law(prefix: torch.Tensor, left: int) -> torch.Tensor:
        p = probs(prefix)
        if left == 1:
            return p
        rows = [p[a] * law(torch.cat([prefix, torch.tensor([[a]])], 1), left - 1) for a in range(v)]
        return torch.stack(rows)

    return law(prompt, tokens)


def sampled_joint_tvd(decoder, proposer, prompt: torch.Tensor, **kw) -> float:
    """TVD between the joint law of the first `tokens` tokens of `n` seeded speculative-sampling runs and the
    target's exact joint law (exact_joint); keywords as sampled_joint_counts. Use a vocabulary of a few tokens
    (V**tokens outcomes); ~0.06 bounds the sampling noise of 2500 draws over 64 outcomes."""
    return joint_tvd(*sampled_joint_counts(decoder, proposer, prompt, **kw))


def joint_tvd(counts: torch.Tensor, law: torch.Tensor) -> float:
    """Total variation distance between the empirical law of `counts` and `law` (same shape)."""
    return 0.5 * float((counts / counts.sum() - law).abs().sum())


def sampled_joint_counts(
    decoder,
    proposer,
    prompt: torch.Tensor,
    *,
    n: int = 2500,
    k: int = 2,
    tokens: int = 3,
    temperature: float = 1.0,
    batch_with: tuple[torch.Tensor, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """(counts [V] * tokens of the first `tokens` tokens of `n` seeded speculative-sampling runs, the target's
    exact joint law of the same shape): what joint_tvd and chi2_pvalue compare. batch_with: other prompts
    [1, T] decoded in the same batch (generate_batch; the law is the first row's)."""
    from draftsmith.sampling import SamplingParams

    v = decoder.target.config.vocab_size
    counts = torch.zeros((v,) * tokens)
    params = SamplingParams(temperature=temperature)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: threading overhead dominates, worse on a shared CPU
    try:
        for s in range(n):
            if batch_with:
                rows = [r.reshape(-1) for r in (prompt, *batch_with)]
                kw = dict(k=k, params=params, max_new_tokens=tokens, seed=s)
                out = decoder.generate_batch(rows, proposer, **kw).rows[0].tokens
            else:
                out = decoder.generate(
                    prompt, proposer, k=k, params=params, max_new_tokens=tokens, seed=s
                ).tokens
            counts[tuple(out[:tokens])] += 1
    finally:
        torch.set_num_threads(threads)
    return counts, exact_joint(decoder.target, prompt, tokens, temperature)


def chi2_pvalue(counts: torch.Tensor, law: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson's chi-square test of `counts` against the law `law` (same shape): the p-value of a statistic at
    least this large if the counts were drawn from the law. Cells expected fewer than `min_expected` times are
    pooled into one (the test's approximation needs it). Sharper than a TVD bound at the same n: a fixed bias
    grows the statistic linearly in n, while the TVD of pure noise shrinks only as 1/sqrt(n)."""
    obs, exp = counts.flatten().double(), law.flatten().double() * float(counts.sum())
    small = exp < min_expected
    if small.any():
        obs = torch.cat([obs[~small], obs[small].sum()[None]])
        exp = torch.cat([exp[~small], exp[small].sum()[None]])
    stat = float(((obs - exp) ** 2 / exp.clamp(min=1e-12)).sum())
    df = obs.numel() - 1
    # the chi-square upper tail with df degrees of freedom: the regularized upper incomplete gamma Q(df/2, x/2)
    return float(
        torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), torch.tensor(stat / 2.0))
    )


def recipe_header(path: str | Path) -> list[str]:
    """The leading comment block of a recipe YAML (where its launch command belongs), without the '#'."""
    lines = []
    for line in Path(path).read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line[1:].strip())
    return lines


def aten_calls(fn) -> list[tuple[str, tuple[int, ...], bool]]:
    """Run fn() and return every aten op it dispatched: its name, the shape of its (first) output, and whether its
    first input is a strided view (strides other than a dense tensor's of its shape, size-1 dims included). A test
    that a product runs as one GEMM: torch's matmul on a strided 3-D slice runs aten.bmm against the expanded
    weight, which a CPU copies whole per call."""
    from torch.utils._python_dispatch import TorchDispatchMode

    calls = []

    def strided(t) -> bool:
        return isinstance(t, torch.Tensor) and t.stride() != torch.empty(t.shape, device="meta").stride()

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            first = out[0] if isinstance(out, (tuple, list)) and out else out
            shape = tuple(first.shape) if isinstance(first, torch.Tensor) else ()
            calls.append((str(func), shape, bool(args) and strided(args[0])))
            return out

    with Record():
        fn()
    return calls


def folder_snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Every path under `folder` with its size and modification time: equal before and after a command that wrote
    nothing there."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def refused_line(capsys, rc: int, folder: Path, before: dict) -> str:
    """The one `error:` line a refused CLI call printed, after checking its exit status 2 and that `folder` is as
    `before` (a folder_snapshot) had it."""
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: "), (rc, err)
    assert folder_snapshot(folder) == before, "files were written"
    return err[0]
