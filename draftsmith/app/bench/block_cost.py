"""Draft cost per decoding step: block-parallel drafters (DFlash, P-EAGLE: one forward) vs the EAGLE-3 chain of the
same depth (one head forward per token), measured in ONE process, drafters interleaved per prompt.

    draftsmith bench block-cost --eagle3 runs/block/eagle3/final --dflash runs/block/dflash/final \
        --peagle runs/block/peagle/final --prompts runs/block/dev12.jsonl --depths 3,4,7

Prints, per depth d: mean draft milliseconds per step (proposer begin/propose/advance time / verify steps) of each
drafter at k = d (chains), and the ratio to EAGLE-3's chain of depth d. Greedy decoding; outputs are checked equal to
plain decoding as a side effect (a mismatch aborts).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--eagle3", required=True)
    p.add_argument("--dflash")
    p.add_argument("--peagle")
    p.add_argument("--prompts", default="builtin:dev-eval")
    p.add_argument("--limit", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--depths", default="4")


def command(a: argparse.Namespace) -> int:

    from draftsmith import models
    from draftsmith.app.drafters import build_proposer
    from draftsmith.decode.decoder import SpeculativeDecoder
    from draftsmith.decode.drafters import DrafterContext
    from draftsmith.prompts import load_prompts, prompt_ids

    target = models.load_model(a.target, inference=True)
    tok = models.load_tokenizer(a.target)
    ctx = DrafterContext(target, tok, next(target.parameters()).device)
    dec = SpeculativeDecoder(target, tok)
    prompts = [torch.tensor([prompt_ids(tok, q)]) for q in load_prompts(a.prompts, limit=a.limit)]
    depths = [int(x) for x in a.depths.split(",")]
    specs: dict[tuple[str, int], str] = {}
    for d in depths:
        specs[("eagle3-chain", d)] = f"eagle:{a.eagle3},top_k=1,depth={d},total_tokens={d}"
        if a.peagle:
            specs[("peagle-chain", d)] = f"peagle:{a.peagle},depth={d}"
        if a.dflash:
            specs[("dflash-chain", d)] = f"dflash:{a.dflash}"
    props = {key: build_proposer(spec, ctx) for key, spec in specs.items()}
    dec.generate(prompts[0], props[next(iter(props))], k=depths[0], max_new_tokens=8)  # warm-up
    per_step: dict[tuple[str, int], list[float]] = {key: [] for key in props}
    depth_used: dict[tuple[str, int], list[int]] = {key: [] for key in props}
    for ids in prompts:
        plain = dec.generate(ids, None, max_new_tokens=a.max_new_tokens).tokens
        for (name, d), prop in props.items():
            res = dec.generate(ids, prop, k=d, max_new_tokens=a.max_new_tokens)
            if res.tokens != plain:
                print(f"error: {name} depth {d} changed the greedy output", file=sys.stderr)
                return 1
            per_step[(name, d)].append(1000 * res.time_draft / max(len(res.accepted), 1))
            depth_used[(name, d)].append(max(res.proposed, default=0))
    print(
        f"draft ms per step, {len(prompts)} prompts x {a.max_new_tokens} tokens, target {a.target}, "
        f"{torch.get_num_threads()} threads"
    )
    print("| drafter | k | drafted depth | draft ms / step | vs EAGLE-3 chain, same depth |")
    print("|---|---|---|---|---|")
    for d in depths:
        base = statistics.mean(per_step[("eagle3-chain", d)])
        for (name, dd), xs in per_step.items():
            if dd == d:
                m = statistics.mean(xs)
                print(f"| {name} | {d} | {max(depth_used[(name, d)])} | {m:.2f} | {m / base:.2f}x |")
    return 0
