"""Benchmark draftsmith's decoder against transformers' own decoding, same process, same target and prompts.

    draftsmith bench peers --limit 6 --max-new-tokens 96            # embedded smollm2-135m, CPU
    draftsmith bench peers --target Qwen/Qwen2.5-7B-Instruct --draft Qwen/Qwen2.5-0.5B-Instruct --device cuda

Methods (greedy, batch 1): transformers plain `generate`, `generate(assistant_model=draft)`,
`generate(prompt_lookup_num_tokens=N)`, draftsmith plain / with the same draft / n-gram. Per prompt every method
runs once, in an order rotated per prompt; the first prompt is a warm-up and excluded. Prints tokens/s, the
ratios the issue asks for, and whether each greedy output equals transformers' plain greedy output.
Without --draft, the draft is a shrunken copy of the target (embeddings, final norm, head and decoder layers
0 and L-1), built in a temp dir: a weak but honest drafter that shares the tokenizer.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path

import torch

from draftsmith import models
from draftsmith.decode.decoder import SpeculativeDecoder
from draftsmith.decode.evaluate import divergence
from draftsmith.decode.proposers import DraftModelProposer, NGramProposer
from draftsmith.distill.init import shrink
from draftsmith.prompts import load_prompts, prompt_ids
from draftsmith.vocab import load_draft_vocab


class _AssistantConfigNotice(logging.Filter):
    """transformers' assisted generation calls the assistant's own `generate` with its `generation_config` AND
    min/max_new_tokens (generation/candidate_generator.py, `_prepare_generation_args`), which its `generate` then
    reports as deprecated, on every assisted call. The call is transformers' internal one, not this script's (which
    passes only generation arguments): that one notice is dropped, every other log line passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Passing `generation_config` together with generation-related" not in record.getMessage()


def hf_methods(target, tok, dec: SpeculativeDecoder, draft, max_new_tokens: int, pld_tokens: int) -> dict:
    """transformers' own greedy decoding of `target`: plain `generate`, `generate(assistant_model=draft)` and
    `generate(prompt_lookup_num_tokens=pld_tokens)`, each a function ids [1, T] -> new token ids."""
    gen_kw = dict(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=sorted(dec.eos_ids),
        pad_token_id=tok.pad_token_id,
    )

    def hf(**kw):
        def run(ids):
            with torch.inference_mode():
                out = target.generate(ids, attention_mask=torch.ones_like(ids), **gen_kw, **kw)
            return out[0, ids.shape[1] :].tolist()

        return run

    logging.getLogger("transformers.generation.utils").addFilter(_AssistantConfigNotice())
    return {
        "hf_plain": hf(),
        "hf_assistant": hf(assistant_model=draft),
        "hf_prompt_lookup": hf(prompt_lookup_num_tokens=pld_tokens),
    }


def ds_methods(
    dec: SpeculativeDecoder,
    draft,
    k: int,
    max_new_tokens: int,
    *,
    vocab_ids=None,
    stop_below: float = 0.0,
    ngram: tuple[int, int] | None = None,
    ngram_k: int = 10,
    compiled_draft=None,
) -> dict:
    """draftsmith's own greedy decoding of the decoder's target, through the calls users make: plain, with `draft` as
    its `draft:` drafter (k tokens a step), given `compiled_draft` (the same draft with plain nn.Linears) with it as
    `draft:...,compile=1` and, given `ngram` = (max, min), with the n-gram drafter (ngram_k tokens).
    Run in the same loop as hf_methods, so every ratio between the two comes from the same moments of the CPU."""

    def ds(proposer, kk):
        return lambda ids: dec.generate(ids, proposer, k=kk, max_new_tokens=max_new_tokens).tokens

    methods = {
        "ds_plain": ds(None, 1),
        "ds_draft": ds(DraftModelProposer(draft, dec.target.config.vocab_size, vocab_ids, stop_below), k),
    }
    if compiled_draft is not None:
        vocab = dec.target.config.vocab_size
        proposer = DraftModelProposer(compiled_draft, vocab, vocab_ids, stop_below, compile=True)
        methods["ds_draft_compiled"] = ds(proposer, k)
    if ngram is not None:
        methods["ds_ngram"] = ds(NGramProposer(*ngram), ngram_k)
    return methods


def run_interleaved(methods: dict, encoded: list[torch.Tensor], target, dev) -> tuple[dict, dict, dict, dict]:
    """Every method on every prompt, in an order rotated per prompt; prompt 0 is a warm-up (not counted). Returns
    per method: new tokens, seconds, prompts whose output equals the first method's (the reference), and how many
    of the others differ only after a near-tie of the target (decode.evaluate.divergence)."""
    names = list(methods)
    tokens, seconds = dict.fromkeys(names, 0), dict.fromkeys(names, 0.0)
    same, ties = dict.fromkeys(names, 0), dict.fromkeys(names, 0)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for i, ids in enumerate(encoded):
        outs = {}
        for name in names[i % len(names) :] + names[: i % len(names)]:
            sync()
            t0 = time.perf_counter()
            outs[name] = methods[name](ids)
            sync()
            if i > 0:
                seconds[name] += time.perf_counter() - t0
                tokens[name] += len(outs[name])
        if i > 0:
            ref = outs[names[0]]
            for name in names:
                if outs[name] == ref:
                    same[name] += 1
                else:
                    ties[name] += divergence(target, ids, ref, outs[name])["near_tie"]
        print(f"prompt {i}{' (warm-up)' if i == 0 else ''}: {len(outs[names[0]])} tokens", flush=True)
    return tokens, seconds, same, ties


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--draft", default=None, help="draft model (default: shrunken copy of the target)")
    ap.add_argument("--prompts", default="builtin:dev-eval")
    ap.add_argument(
        "--limit", type=int, default=6, help="prompts (half vicuna, half humaneval for builtin:dev-eval)"
    )
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=4, help="draftsmith draft tokens per step (draft model)")
    ap.add_argument(
        "--ngram-k", type=int, default=None, help="draftsmith n-gram tokens per step (default: --pld-tokens)"
    )
    ap.add_argument("--ngram", default="3,1", help="draftsmith n-gram max,min")
    ap.add_argument(
        "--pld-tokens", type=int, default=10, help="transformers prompt_lookup_num_tokens (its doc default)"
    )
    ap.add_argument(
        "--stop-below",
        type=float,
        default=0.0,
        help="draftsmith draft: stop a step's draft below this confidence",
    )
    ap.add_argument(
        "--compile-draft",
        action="store_true",
        help="also draftsmith's draft with its step compiled (draft:...,compile=1; batch 1): ds_draft_compiled",
    )
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--threads", type=int, default=None)


def command(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)

    dev = torch.device(args.device) if args.device else models.default_device()
    tok = models.load_tokenizer(args.target)
    # both decoders run the same target object, with the CPU kernels draftsmith picks for it (cpulayout)
    target = models.load_model(args.target, dtype=args.dtype, device=dev, inference=True)
    tmp = None
    if args.draft is None:
        tmp = tempfile.TemporaryDirectory(prefix="draftsmith-bench-draft-")
        n = target.config.num_hidden_layers
        draft = shrink(target, [0, n - 1])  # untrained: a weak but honest drafter sharing the tokenizer
        draft.save_pretrained(tmp.name)
        tok.save_pretrained(tmp.name)
        draft_spec = tmp.name
        print(f"draft: shrunken copy of the target, layers [0, {n - 1}] (untrained)")
    else:
        draft_spec = args.draft
    draft = models.load_model(draft_spec, dtype=args.dtype, device=dev, inference=True)
    # the draft as draftsmith trained it: its reduced output vocabulary, when it has one (transformers'
    # assistant_model can only use the full lm_head of the same folder)
    vocab_ids = load_draft_vocab(draft_spec) if Path(draft_spec).is_dir() else None
    # the compiled step needs the draft with plain nn.Linears (inductor lays out its own weights)
    compiled = models.load_model(draft_spec, dtype=args.dtype, device=dev) if args.compile_draft else None

    if args.prompts == "builtin:dev-eval":  # balance chat and code prompts
        half = max(args.limit // 2, 1)
        prompts = load_prompts("builtin:vicuna", limit=half + 1) + load_prompts(
            "builtin:humaneval", limit=args.limit - half
        )
    else:
        prompts = load_prompts(args.prompts, limit=args.limit + 1)
    encoded = [torch.tensor([prompt_ids(tok, p)], device=dev) for p in prompts]

    dec = SpeculativeDecoder(target, tok)
    ngram_max, ngram_min = (int(x) for x in args.ngram.split(","))
    ngram_k = args.ngram_k or args.pld_tokens
    methods = hf_methods(target, tok, dec, draft, args.max_new_tokens, args.pld_tokens)
    methods.update(ds_methods(dec, draft, args.k, args.max_new_tokens, vocab_ids=vocab_ids, stop_below=args.stop_below,
                              ngram=(ngram_max, ngram_min), ngram_k=ngram_k, compiled_draft=compiled))  # fmt: skip
    names = list(methods)
    tokens, seconds, same, ties = run_interleaved(methods, encoded, target, dev)
    mx = args.max_new_tokens
    tps = {n: tokens[n] / seconds[n] for n in names}
    n_timed = len(encoded) - 1
    print(
        f"\n{args.target} on {dev} ({torch.get_num_threads()} threads), {n_timed} prompts timed, greedy, "
        f"max_new_tokens={mx}, draftsmith k={args.k} (draft, stop_below={args.stop_below}, reduced vocab: {vocab_ids is not None}) / {ngram_k} (ngram {ngram_max}..{ngram_min}), "
        f"HF prompt_lookup_num_tokens={args.pld_tokens}"
    )
    print(f"{'method':18s} {'tok/s':>8s} {'vs hf_plain':>12s} {'== hf_plain greedy':>20s} {'near-tie':>9s}")
    for n in names:
        print(
            f"{n:18s} {tps[n]:8.2f} {tps[n] / tps['hf_plain']:11.2f}x {same[n]:>14d}/{n_timed} {ties[n]:>9d}"
        )
    print(
        "(near-tie: the output leaves hf_plain where the target's two candidate logits are within rounding "
        "of each other - decode.evaluate.divergence; in bf16 a multi-token forward rounds differently)"
    )
    print(
        f"\nds_ngram / hf_prompt_lookup = {tps['ds_ngram'] / tps['hf_prompt_lookup']:.2f}x   (target >= 1.0)"
    )
    print(f"ds_draft / hf_assistant     = {tps['ds_draft'] / tps['hf_assistant']:.2f}x   (target >= 1.3)")
    if "ds_draft_compiled" in tps:
        print(
            f"ds_draft_compiled / hf_assistant = {tps['ds_draft_compiled'] / tps['hf_assistant']:.2f}x   (target >= 1.3)"
        )
    print(f"ds_plain / hf_plain         = {tps['ds_plain'] / tps['hf_plain']:.2f}x")
    if tmp is not None:
        tmp.cleanup()
    return 0
