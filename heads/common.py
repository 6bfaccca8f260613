"""What every head shares: the target record, PEFT-style save/load, and a memory-bounded vocab CE.

A head folder is `config.json` + `model.safetensors` (+ optional README.md / extra json files). Tensor names are
the ones serving engines load, so export is validation, not renaming.
The config records the target the head was trained for; `load_head(dir, target_model)` refuses another one.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from draftsmith import divergences
from draftsmith.acceptance import rounds_along_text, tau_from_conditional
from draftsmith.checkpoint import read_json
from draftsmith.errors import DraftsmithError
from draftsmith.fileio import replace_dir
from draftsmith.modeling import fingerprints_match, target_fingerprint

log = logging.getLogger(__name__)

LossKind = divergences.LossKind
"""A head's per-step loss: an entry of draftsmith.divergences.LOSSES (soft_ce, the native one, or a divergence)."""


def target_info(model) -> dict[str, Any]:
    """What a head records about its target: name, absolute folder path, Hub id, architecture, sizes and an
    embedding fingerprint."""
    cfg = model.config
    source = getattr(model, "draftsmith_source", None) or {}  # set by draftsmith.models.load_model
    name = source.get("name") or getattr(cfg, "_name_or_path", "") or ""
    hub_id = source.get("hub_id") or (name if name.count("/") == 1 and not Path(name).exists() else None)
    # the folder the weights were read from (a dequantized GGUF's cache folder included): `name` is only its
    # basename, which engines reading the export (speculators' verifier) cannot resolve
    folder = next(
        (Path(c) for c in (source.get("path"), name) if c and (Path(c) / "config.json").is_file()), None
    )
    return {
        "name_or_path": name,
        "hub_id": hub_id,
        "path": str(folder.resolve()) if folder else None,
        "architectures": list(getattr(cfg, "architectures", None) or [type(model).__name__]),
        "hidden_size": int(cfg.hidden_size),
        "vocab_size": int(cfg.vocab_size),
        "num_hidden_layers": int(cfg.num_hidden_layers),
        "fingerprint": target_fingerprint(model),
    }


def check_target(recorded: dict[str, Any], model, where: str) -> None:
    """Refuse a target that differs from the one the head was trained for (shapes, architecture, weights)."""
    have = target_info(model)
    for key in ("hidden_size", "vocab_size", "num_hidden_layers"):
        if key in recorded and int(recorded[key]) != have[key]:
            raise DraftsmithError(
                f"{where} was trained for {recorded.get('name_or_path')!r} ({key}={recorded[key]}) but the target "
                f"has {key}={have[key]}; pass the target the head was trained for"
            )
    fp = recorded.get("fingerprint")
    if fp is not None and not fingerprints_match(fp, have["fingerprint"]):
        raise DraftsmithError(
            f"{where} was trained for {recorded.get('name_or_path')!r} but the target's weights differ "
            f"(embedding fingerprint {have['fingerprint']} != {fp}); pass the target the head was trained for"
        )


def write_head_dir(
    out_dir: str | os.PathLike,
    config: dict[str, Any],
    state: dict[str, torch.Tensor],
    extra_json: dict[str, Any] | None = None,
) -> Path:
    """Write config.json + model.safetensors (+ extra json files) to a tmp dir, then rename into place."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    tensors = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    keep = {}
    if out.is_dir():  # measured files written after training (e.g. head_accuracy.json) survive a re-save
        keep = {p.name: p.read_text() for p in out.glob("*.json") if p.name not in ("config.json",)}
    for name, text in keep.items():
        (tmp / name).write_text(text)
    for name, obj in (extra_json or {}).items():
        (tmp / name).write_text(json.dumps(obj, indent=2) + "\n")
    return replace_dir(tmp, out)


def read_head_dir(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    p = Path(path)
    if not (p / "config.json").is_file() or not (p / "model.safetensors").is_file():
        raise DraftsmithError(
            f"{p} is not a head folder (needs config.json and model.safetensors); "
            "pass the final/ folder written by train/heads.py"
        )
    from draftsmith.heads.kinds import folder_kinds

    config = read_json(p / "config.json", "re-save the head, or copy its config.json again")
    if config.get("draftsmith_head_type") not in folder_kinds():
        raise DraftsmithError(
            f"{p}/config.json has draftsmith_head_type={config.get('draftsmith_head_type')!r}; "
            f"expected one of {folder_kinds()}"
        )
    try:
        return config, load_file(str(p / "model.safetensors"))
    except (SafetensorError, OSError, ValueError) as e:  # truncated copy, interrupted download, wrong file
        raise DraftsmithError(
            f"{p}/model.safetensors is not a readable safetensors file ({str(e).splitlines()[0][:120]}); "
            "copy or re-save the head again"
        ) from None


def config_from_dict(cls, data: dict[str, Any], where: str):
    """Lenient (PEFT-style) config load: unknown keys are logged and dropped, missing ones take defaults."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        log.debug("%s: ignoring config keys %s", where, unknown)
    return cls(**{k: v for k, v in data.items() if k in names})


def load_state_strict(module: torch.nn.Module, state: dict[str, torch.Tensor], where: str) -> None:
    """Exact key set: engines silently ignore unknown names and keep random weights, so we refuse both ways."""
    own = module.state_dict()
    missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or extra:
        raise DraftsmithError(
            f"{where}: tensor names do not match the head config (missing {missing[:4]}, "
            f"unexpected {extra[:4]}); the folder was written for another head layout"
        )
    for k, v in state.items():
        if tuple(v.shape) != tuple(own[k].shape):
            raise DraftsmithError(
                f"{where}: tensor {k} has shape {tuple(v.shape)}, config implies {tuple(own[k].shape)}"
            )
    module.load_state_dict(state, strict=True)


def _ce_chunk(h, labels, weight, topk: int):
    logits = F.linear(h, weight).float()
    loss = F.cross_entropy(logits, labels, reduction="sum")
    with torch.no_grad():
        top = logits.topk(topk, dim=-1).indices
        hit = top == labels[:, None]
        return loss, hit[:, 0].sum(), hit.any(-1).sum()


def _soft_ce_chunk(h, t_h, weight, t_weight, topk: int):
    logits = F.linear(h, weight).float()
    with torch.no_grad():
        p = torch.softmax(F.linear(t_h, t_weight).float(), -1)
        best = p.argmax(-1)
    loss = -(p * torch.log_softmax(logits, -1)).sum()
    with torch.no_grad():
        hit = logits.topk(topk, dim=-1).indices == best[:, None]
        return loss, hit[:, 0].sum(), hit.any(-1).sum()


def _sum_chunks(chunk_fn, rows: tuple, fixed: tuple, chunk_size: int, grad: bool):
    """Sum chunk_fn(*row_slices, *fixed) -> (loss, top1, topk) over row chunks, each checkpointed when `grad`."""
    dev = rows[0].device
    total = torch.zeros((), dtype=torch.float32, device=dev)
    top1 = torch.zeros((), dtype=torch.long, device=dev)
    topk_hits = torch.zeros((), dtype=torch.long, device=dev)
    for s in range(0, rows[0].shape[0], chunk_size):
        args = tuple(r[s : s + chunk_size] for r in rows) + fixed
        loss, a, b = checkpoint(chunk_fn, *args, use_reentrant=False) if grad else chunk_fn(*args)
        total, top1, topk_hits = total + loss, top1 + a, topk_hits + b
    return total, top1, topk_hits


def chunked_ce(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, chunk_size: int = 1024, topk: int = 5
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sum of CE(F.linear(hidden, weight), labels) over rows, computed chunk by chunk with activation
    checkpointing so at most chunk_size x V logits live at once (forward and backward).
    hidden [N, H], weight [V, H], labels [N] -> (loss_sum, top1_hits, topk_hits)."""
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    k = min(topk, weight.shape[0])
    return _sum_chunks(_ce_chunk, (hidden, labels), (weight, k), chunk_size, grad)


def chunked_soft_ce(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_hidden: torch.Tensor,
    target_weight: torch.Tensor,
    *,
    chunk_size: int = 1024,
    topk: int = 5,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sum over rows of the soft CE -sum_x p(x) log q(x), p = softmax(target_weight target_hidden) (no grad),
    q = softmax(weight hidden), chunked and checkpointed like chunked_ce. hidden, target_hidden [N, H];
    weight, target_weight [V, H] -> (loss_sum, top1_hits, topk_hits) against the target's argmax."""
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    k = min(topk, weight.shape[0])
    rows = (hidden, target_hidden.detach())
    return _sum_chunks(_soft_ce_chunk, rows, (weight, target_weight, k), chunk_size, grad)


def weighted_means(
    batches, device, metrics_of, weight_of, prefixes=("acc_", "top1_", "loss_", "rounds_per_token_")
) -> dict[str, float]:
    """Held-out evals: run `metrics_of(batch) -> {name: value}` on every batch (moved to `device`) and average the
    metrics whose names start with `prefixes`, weighted by `weight_of(batch, metrics)` (e.g. the scored tokens)."""
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}
    for batch in batches:
        batch = {n: v.to(device) for n, v in batch.items()}
        m = metrics_of(batch)
        w = weight_of(batch, m)
        for key, v in m.items():
            if key.startswith(prefixes):
                sums[key] = sums.get(key, 0.0) + v * w
                weights[key] = weights.get(key, 0.0) + w
    return {key: sums[key] / weights[key] for key in sums if weights[key]}


def shift_left(x: torch.Tensor, s: int) -> torch.Tensor:
    """x [B, T, ...] -> y with y[:, t] = x[:, t+s] (zeros past the end)."""
    if s == 0:
        return x
    return torch.cat([x[:, s:], x.new_zeros(x[:, :s].shape)], 1)


class DepthAcceptance:
    """Greedy acceptance per unroll depth i, conditional on depths < i accepted, at every column t (a draft chain
    rooted at t uses steps 0..i at the same column): acc_i, top1_i (unconditional) and the simulated tau.

    walk: the columns are consecutive round starts (EAGLE, P-EAGLE: column t drafts the token two after it at
    depth 0), so the result also walks the rounds a greedy decoder takes along each sequence's scored text
    (draftsmith.acceptance.rounds_along_text with acceptance per start and depth): `rounds_per_token_{k}` for
    k = 1..depths, whose token-weighted mean over batches is 1 / tau. A run of columns scored at depth 0 is one
    stretch of drafted text (a response); each starts with a fresh round."""

    def __init__(self, shape: tuple[int, int], device, *, walk: bool = False):
        self.alive = torch.ones(shape, dtype=torch.bool, device=device)
        self.accepts: list[float] = []
        self.metrics: dict[str, float] = {}
        self.walk = walk
        self.hits: list[torch.Tensor] = []  # walk: per depth, the columns whose draft matches [B, T]
        self.starts: torch.Tensor | None = None  # walk: the columns scored at depth 0

    @torch.no_grad()
    def update(self, i: int, valid: torch.Tensor, draft_top: torch.Tensor, target_top: torch.Tensor) -> None:
        ok = torch.zeros_like(self.alive)
        ok[valid] = draft_top == target_top
        prev = self.alive & valid
        self.metrics[f"acc_{i}"] = float((ok & prev).sum()) / max(int(prev.sum()), 1)
        self.metrics[f"top1_{i}"] = float(ok.sum()) / max(int(valid.sum()), 1)
        self.accepts.append(self.metrics[f"acc_{i}"])
        self.alive &= ok
        if self.walk:
            if i == 0:
                self.starts = valid.clone()
            self.hits.append(ok)

    def rounds(self) -> dict[str, float]:
        """{"rounds_per_token_{k}": expected greedy rounds per drafted token} (empty without walk or text)."""
        if not self.walk or self.starts is None:
            return {}
        hits = torch.stack(self.hits, -1).double().cpu()  # [B, T, depths]
        ks = range(1, hits.shape[-1] + 1)
        rounds, n = dict.fromkeys(ks, 0.0), 0
        for row, starts in zip(hits, self.starts.cpu()):
            cols = torch.nonzero(starts).flatten()
            if cols.numel() == 0:
                continue
            cuts = (torch.nonzero(cols[1:] != cols[:-1] + 1).flatten() + 1).tolist()
            for lo, hi in zip([0, *cuts], [*cuts, cols.numel()]):
                table = row[cols[lo:hi]].tolist()  # [start][depth]; depths past the text end are never read
                for k, r in rounds_along_text(table, ks).items():
                    rounds[k] += r
            n += cols.numel()
        return {f"rounds_per_token_{k}": rounds[k] / n for k in ks} if n else {}

    def result(self, attention_mask: torch.Tensor) -> dict[str, float]:
        return {
            **self.metrics,
            "tau_sim": tau_from_conditional(self.accepts),
            **self.rounds(),
            "n_tokens": float(attention_mask.sum()),
        }


def tau_estimates(avg: dict[str, float], acc: list[float]) -> dict:
    """A held-out eval's tau from token-weighted means of DepthAcceptance metrics: the rounds walk when the
    metrics have it (`tau_sim` at the deepest k, every k in `tau_rounds`), else the chain formula over the
    start-averaged conditional acceptances `acc` (which overstates tau where acceptance comes in runs); the chain
    value is kept as `tau_chain` either way."""
    chain = tau_from_conditional(acc)
    ks = [k for k in range(1, len(acc) + 1) if avg.get(f"rounds_per_token_{k}")]
    if not acc or len(ks) < len(acc):
        return {"tau_sim": chain, "tau_chain": chain, "tau_estimate": "chain"}
    taus = {k: 1.0 / avg[f"rounds_per_token_{k}"] for k in ks}
    return {"tau_sim": taus[ks[-1]], "tau_rounds": taus, "tau_chain": chain, "tau_estimate": "rounds"}


def training_vocab(
    target, train_examples: list[dict], size: int
) -> tuple[torch.Tensor, torch.Tensor, set[int]]:
    """The draft vocabulary of a trained head: the `size` most frequent target ids of the training data plus the
    special tokens (size 0 or >= V: the whole vocabulary). Returns (sorted ids [V_d], token counts [V], special ids)."""
    from draftsmith.vocab import build_vocab_ids, special_token_ids, token_counts

    v = target.config.vocab_size
    counts = token_counts((e["input_ids"] for e in train_examples), v)
    special = set(special_token_ids(None, target))
    return build_vocab_ids(counts, min(size, v) or v, always=sorted(special)), counts, special
