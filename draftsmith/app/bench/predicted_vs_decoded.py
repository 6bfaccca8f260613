"""Does a head's predicted tau say what the decoder does? Check it on the same text.

For each prompt: decode greedily with the head (lossless, so the text is the target's own greedy answer) and count
the verify steps; then teacher-force the head along that same text with its trainer's held-out eval (the one that
prints the predicted tau after training) and walk the rounds it predicts. Both count rounds over the same tokens
(the answer after its first token, which the prefill writes), so a correct estimator gives the same number up to
near-ties that flip between the batched eval and the step-by-step decoder. The trainer's own prediction is taken
on held-out training answers; the gap between it and a decoder run on other prompts is then the prompts, which
this script separates from the estimator.

    draftsmith bench predicted-vs-decoded --target qwen2.5-coder-1.5b --head runs/eagle3/final \
        --prompts builtin:dev-eval --limit 8 --k 3 --max-new-tokens 64 [--json out.json]

Heads of the kinds whose held-out eval walks rounds (EAGLE-1, EAGLE-3, P-EAGLE). Bad input: one line, exit 2.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from draftsmith.errors import DraftsmithError

WALKED = ("eagle", "eagle3", "peagle")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--target", required=True, help="the target the head was trained for (name, folder or .gguf)"
    )
    ap.add_argument("--head", required=True, type=Path, help="a trained head folder")
    ap.add_argument("--prompts", default="builtin:dev-eval")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--json", type=Path, default=None, help="also write the numbers here (a new file)")


def check(args: argparse.Namespace) -> argparse.Namespace:
    """The arguments' values, checked before anything loads (one DraftsmithError line)."""
    if args.k < 1 or args.limit < 1 or args.max_new_tokens < 2:
        raise DraftsmithError("--k and --limit must be >= 1 and --max-new-tokens >= 2")
    if args.json is not None and args.json.exists():
        raise DraftsmithError(f"{args.json} exists; name a new file")
    if args.json is not None and not args.json.parent.is_dir():
        raise DraftsmithError(f"{args.json.parent} is not a folder; create it or name another --json path")
    return args


def check_head(path: Path) -> str:
    """The head folder's kind, if its held-out eval walks rounds; else one DraftsmithError line."""
    from draftsmith.kinds import folder_kind

    kind = folder_kind(path)
    if kind is None:
        raise DraftsmithError(
            f"--head {path}: not a drafter folder; pass a trained head folder (<run>/final)"
        )
    if kind not in WALKED:
        raise DraftsmithError(
            f"--head {path} is a {kind!r} drafter; this check covers {', '.join(WALKED)} heads, whose held-out eval "
            "walks rounds (the others predict with the chain formula)"
        )
    return kind


def command(args: argparse.Namespace) -> int:
    try:
        check(args)
        kind = check_head(args.head)
        from draftsmith.prompts import load_prompts

        prompts = load_prompts(args.prompts, limit=args.limit)
    except DraftsmithError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    import torch

    from draftsmith import models
    from draftsmith.app.drafters import build_proposer
    from draftsmith.decode.decoder import SpeculativeDecoder
    from draftsmith.decode.drafters import DrafterContext
    from draftsmith.fileio import write_json
    from draftsmith.heads.data import collate
    from draftsmith.heads.hidden import HiddenStates
    from draftsmith.heads.io import load_head
    from draftsmith.heads.kinds import head_kind
    from draftsmith.heads.recipe import LossSection
    from draftsmith.prompts import prompt_ids

    tok = models.load_tokenizer(args.target)
    target = models.load_model(args.target, inference=True)
    ctx = DrafterContext(
        target=target, tokenizer=tok, device=next(target.parameters()).device, target_spec=args.target
    )
    chain = f"peagle:{args.head}" if kind == "peagle" else f"eagle:{args.head},top_k=1,total_tokens={args.k}"
    proposer = build_proposer(chain, ctx, k=args.k)  # what the eval predicts: a chain of k
    head = load_head(args.head, target)
    training = head_kind(kind).training
    trainer = SimpleNamespace(head=head, frozen_target=target, loss_cfg=LossSection())
    hidden = HiddenStates("online", target, training.features(head)[1])
    decoder = SpeculativeDecoder(target, tok, eos_ids=set())  # every answer runs to max_new_tokens
    rows, t0 = [], time.perf_counter()
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([prompt_ids(tok, prompt)])
        res = decoder.generate(ids, proposer, k=args.k, max_new_tokens=args.max_new_tokens)
        text = ids[0].tolist() + res.tokens
        n_prompt, n = ids.shape[1], len(res.tokens) - 1
        mask = [0] * (n_prompt + 1) + [1] * n  # what the rounds draft: the answer after its prefill token
        batch = collate([{"index": i, "input_ids": text, "loss_mask": mask}])
        with torch.no_grad():
            ev = training.evaluate(trainer, [batch], hidden, SimpleNamespace(depth=args.k))
        taus = ev.get("tau_rounds") or {}
        if args.k not in taus:
            raise SystemExit(
                f"error: the {kind} eval returned no rounds walk at k {args.k} (got {sorted(taus)})"
            )
        rows.append({"prompt": i, "tokens": n, "decoded_rounds": len(res.accepted),
                     "predicted_rounds": n / taus[args.k], "chain_tau": ev["tau_chain"]})  # fmt: skip
        print(f"[{i + 1}/{len(prompts)}] {n} tokens: decoded {len(res.accepted)} rounds, predicted "
              f"{n / taus[args.k]:.2f}  ({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip
    tokens = sum(r["tokens"] for r in rows)
    decoded = tokens / sum(r["decoded_rounds"] for r in rows)
    predicted = tokens / sum(r["predicted_rounds"] for r in rows)
    exact = sum(abs(r["predicted_rounds"] - r["decoded_rounds"]) < 1e-6 for r in rows)
    print(f"{kind} k {args.k}, {args.prompts} ({len(rows)} prompts, {tokens} tokens): decoded tau {decoded:.3f}, "
          f"predicted {predicted:.3f} (x{predicted / decoded:.3f}); rounds equal on {exact}/{len(rows)} "
          f"prompts", flush=True)  # fmt: skip
    if args.json is not None:
        write_json(args.json, {"target": args.target, "head": str(args.head), "kind": kind, "k": args.k,
                               "prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
                               "dtype": str(target.dtype), "date": time.strftime("%Y-%m-%d"),
                               "decoded_tau": decoded, "predicted_tau": predicted, "rows": rows})  # fmt: skip
    return 0
