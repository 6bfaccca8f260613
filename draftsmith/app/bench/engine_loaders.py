"""Do draftsmith's block-drafter exports load in speculators' own loader, with the same weights and meaning?

Two halves, run by scripts/check_engine_loaders.sh (which also builds the side venv):

    draftsmith bench engine-loaders export DIR      # draftsmith venv: tiny target + drafters
    PYTHONPATH=. /tmp/specvenv/bin/python -m draftsmith.app.bench.engine_loaders load DIR   # side venv: speculators

The load half runs where draftsmith is not installed (speculators' own venv, its own transformers): it imports nothing
of draftsmith's beyond this module's package, and runs as `python -m` from the checkout for that reason.

`export` saves, for each tiny architecture (DIR/llama, DIR/qwen2: q/k/v biases, tied embeddings, padded
vocabulary), a 4-layer target, a reduced-vocab DFlash drafter, a full-vocab (frozen head) DFlash drafter and a
P-EAGLE head, exports them (speculators-dflash, sglang-dflash, speculators-peagle) and records
draftsmith's own DFlash logits for fixed inputs. `load` opens each speculators folder with
`SpeculatorModel.from_pretrained` (the path vLLM's speculators support documents), checks that every exported
tensor arrives unchanged, that nothing is left NaN, that the config fields mean what draftsmith meant (block size,
mask token, aux-layer ids in the layer-input convention, d2t/t2d, depths) and that speculators' DFlash layers give
draftsmith's logits on the recorded inputs. Not part of the test suite: it needs the speculators package.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

AUX_DFLASH = [1, 3]  # layer inputs of the 4-layer target (draftsmith's convention)
AUX_PEAGLE = [1, 2, 3]
BLOCK, MASK, DEPTHS, CTX = 4, 3, 3, 6


ARCHS = ("llama", "qwen2")


def export(root: Path) -> None:
    for arch in ARCHS:
        _export_arch(root / arch, arch)


def _export_arch(root: Path, arch: str) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from draftsmith.app.export import export as ds_export
    from draftsmith.heads import save_head
    from draftsmith.heads.block.dflash import DFlashDrafter
    from draftsmith.heads.block.peagle import PEagleHead
    from draftsmith.heads.eagle.model import EagleHead
    from draftsmith.heads.layers import rope_cos_sin as rope
    from draftsmith.testing import save_tiny

    save_tiny(root / "target", seed=0, arch=arch, num_hidden_layers=4)
    target = AutoModelForCausalLM.from_pretrained(
        root / "target"
    ).eval()  # recorded with its folder: the verifier
    v = target.config.vocab_size
    for name, ids, frozen in (
        ("dflash", torch.arange(0, v, 2), False),
        ("dflash-full", torch.arange(v), True),
    ):
        torch.manual_seed(0)
        d = DFlashDrafter.from_target(
            target,
            draft_vocab_ids=ids,
            mask_token_id=MASK,
            block_size=BLOCK,
            num_layers=2,
            aux_layers=AUX_DFLASH,
            freeze_lm_head=frozen,
        ).eval()
        with torch.no_grad():  # random weights: make the norms non-trivial so a swapped norm shows
            for n, p in d.named_parameters():
                if n.endswith("norm.weight"):
                    p.add_(torch.rand_like(p))
        save_head(d, root / f"native-{name}")
        ds_export(root / f"native-{name}", "speculators-dflash", root / f"spec-{name}", force=True)
        # draftsmith's own block forward on fixed inputs: context rows 0..CTX-1, block [anchor, mask...] after them
        g = torch.Generator().manual_seed(1)
        feats = torch.randn(1, CTX, len(AUX_DFLASH) * target.config.hidden_size, generator=g)
        block_ids = torch.tensor([[17] + [MASK] * (BLOCK - 1)])
        c = d.config
        cos_c, sin_c = rope(torch.arange(CTX)[None], c.head_dim, c.rope_theta, torch.float32)
        cos_b, sin_b = rope(torch.arange(CTX, CTX + BLOCK)[None], c.head_dim, c.rope_theta, torch.float32)
        with torch.no_grad():
            kv = d.context_kv(d.context(feats), cos_c, sin_c)
            out = d.block(target.model.embed_tokens(block_ids), cos_b, sin_b, kv, mask=None)
            logits = d.logits(out)
        save_file(
            {"feats": feats, "block_ids": block_ids, "logits": logits}, str(root / f"ref-{name}.safetensors")
        )
    ds_export(root / "native-dflash-full", "sglang-dflash", root / "sglang-dflash", force=True)

    for name, ids in (("peagle", torch.arange(0, v, 2)), ("peagle-full", torch.arange(v))):
        torch.manual_seed(0)
        e3 = EagleHead.from_target(target, "eagle3", draft_vocab_ids=ids, aux_layers=AUX_PEAGLE)
        head = PEagleHead.from_target_head(e3, mask_token_id=MASK, num_depths=DEPTHS)
        save_head(head, root / f"native-{name}")
        ds_export(root / f"native-{name}", "speculators-peagle", root / f"spec-{name}", force=True)
    print(f"exported into {root}")


def _same_tensors(model, folder: Path, native: dict, rename=lambda k: k) -> list[str]:
    """Every tensor in the export equals the model's loaded one and (under rename) the native checkpoint's."""
    import torch
    from safetensors.torch import load_file

    sd = model.state_dict()
    written = load_file(str(folder / "model.safetensors"))
    problems = [f"{k} not a model tensor (silently dropped)" for k in written if k not in sd]
    for k, w in written.items():
        if k in sd and not torch.equal(sd[k].to(w.dtype), w):
            problems.append(f"{k} changed on load")
    for k, t in native.items():
        if rename(k) in sd and not torch.equal(sd[rename(k)].to(t.dtype), t):
            problems.append(f"{k} (native) != loaded {rename(k)}")
        elif rename(k) not in sd:
            problems.append(f"native {k} has no place in the speculators model")
    problems += [f"{k} is NaN after load" for k, t in sd.items() if t.is_floating_point() and t.isnan().any()]
    return problems


def _dflash_logits(model, ref: dict):
    """speculators' own modules (fc, hidden_norm, Qwen3DFlashDecoderLayer, norm, lm_head) on the recorded inputs,
    every row seeing every context row and the whole block (attention_mask None, eager attention)."""
    import torch

    model.config.transformer_layer_config._attn_implementation = "eager"
    ctx = model.hidden_norm(model.fc(ref["feats"]))
    x = model.embed_tokens(ref["block_ids"])
    pos = torch.arange(CTX + BLOCK)[None]
    pe = model.rotary_emb(x, pos)
    with torch.no_grad():
        for layer in model.layers:
            x = layer(hidden_states=x, target_hidden=ctx, attention_mask=None, position_embeddings=pe)
        return model.lm_head(model.norm(x))


def load(root: Path) -> int:
    from importlib.metadata import version

    import torch

    print(
        f"speculators {version('speculators')}, transformers {version('transformers')}, torch {torch.__version__}"
    )
    failures = []
    for arch in ARCHS:
        print(f"-- {arch} target")
        failures += _load_arch(root / arch)
    print("ALL LOADED AND MATCHED" if not failures else f"{len(failures)} PROBLEM(S)")
    return 1 if failures else 0


def _load_arch(root: Path) -> list[str]:
    from safetensors.torch import load_file
    from speculators import SpeculatorModel
    from speculators.models import DFlashDraftModel, PEagleDraftModel

    failures = []
    n_target = json.loads((root / "target" / "config.json").read_text())["num_hidden_layers"]

    def load(name: str, cls) -> tuple:
        """speculators' model of export `name`, draftsmith's native tensors (without d2t/t2d for a full
        vocabulary: speculators keeps none and reloads the verifier's head) and config, and the first problems."""
        folder, native_dir = root / f"spec-{name}", root / f"native-{name}"
        m = SpeculatorModel.from_pretrained(str(folder)).eval()
        native = load_file(str(native_dir / "model.safetensors"))
        if not m.use_draft_vocab:
            native = {k: t for k, t in native.items() if k not in ("d2t", "t2d")}
        ncfg = json.loads((native_dir / "config.json").read_text())
        return (
            folder,
            m,
            native,
            ncfg,
            m.config,
            [] if isinstance(m, cls) else [f"loaded as {type(m).__name__}"],
        )

    for name in ("dflash", "dflash-full"):
        folder, m, native, ncfg, c, probs = load(name, DFlashDraftModel)
        probs += _same_tensors(m, folder, native)
        if c.block_size != ncfg["block_size"] or c.mask_token_id != ncfg["mask_token_id"]:
            probs.append(f"block_size/mask_token_id {c.block_size}/{c.mask_token_id}")
        if c.aux_hidden_state_layer_ids != ncfg["aux_hidden_state_layer_ids"]:  # both layer inputs
            probs.append(f"aux ids {c.aux_hidden_state_layer_ids} != {ncfg['aux_hidden_state_layer_ids']}")
        if max(c.aux_hidden_state_layer_ids) > n_target:
            probs.append("aux ids beyond speculators' [0, N] range")
        if c.speculators_config.proposal_methods[0].speculative_tokens != ncfg["block_size"] - 1:
            probs.append("speculative_tokens != block_size - 1")
        if c.sample_from_anchor:
            probs.append("sample_from_anchor is on (draftsmith predicts from the mask rows only)")
        if m.use_draft_vocab != (ncfg["draft_vocab_size"] != ncfg["vocab_size"]):
            probs.append("draft vocabulary on/off differs")
        ref = load_file(str(root / f"ref-{name}.safetensors"))
        logits = _dflash_logits(m, ref)
        err = (logits - ref["logits"]).abs().max().item()
        if err > 1e-4:
            probs.append(f"speculators' forward differs from draftsmith's by {err:.2e}")
        print(
            f"{name}: {type(m).__name__}, draft vocab {c.draft_vocab_size}, aux {c.aux_hidden_state_layer_ids}, "
            f"block {c.block_size}, mask {c.mask_token_id}, forward max |diff| {err:.1e}: "
            + ("OK" if not probs else "; ".join(probs))
        )
        failures += probs

    for name in ("peagle", "peagle-full"):
        folder, m, native, ncfg, c, probs = load(name, PEagleDraftModel)
        probs += _same_tensors(
            m, folder, native, lambda k: "layers.0." + k[9:] if k.startswith("midlayer.") else k
        )
        if c.mask_token_id != ncfg["mask_token_id"] or m.mask_token_id != ncfg["mask_token_id"]:
            probs.append(f"mask_token_id {c.mask_token_id}")
        if c.eagle_aux_hidden_state_layer_ids != ncfg["aux_hidden_state_layer_ids"]:
            probs.append(f"aux ids {c.eagle_aux_hidden_state_layer_ids}")
        depths = c.speculators_config.proposal_methods[0].speculative_tokens
        if depths != ncfg["num_depths"]:
            probs.append("speculative_tokens != num_depths")
        if c.norm_before_residual != ncfg.get("norm_before_residual", False):
            probs.append("norm_before_residual differs")
        print(
            f"{name}: {type(m).__name__}, draft vocab {c.draft_vocab_size}, aux {c.eagle_aux_hidden_state_layer_ids}, "
            f"mask {c.mask_token_id}, depths {depths}: " + ("OK" if not probs else "; ".join(probs))
        )
        failures += probs
    return failures


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "half", choices=("export", "load"), help="export: draftsmith's venv; load: speculators' venv"
    )
    ap.add_argument("dir", type=Path, help="the folder the export half writes and the load half reads")


def command(args: argparse.Namespace) -> int:
    root = args.dir.resolve()
    root.mkdir(parents=True, exist_ok=True)
    if args.half == "export":
        export(root)
        return 0
    return load(root)


if __name__ == "__main__":  # the load half, in a venv without draftsmith installed (see the docstring)
    ap = argparse.ArgumentParser(prog="python -m draftsmith.app.bench.engine_loaders")
    add_arguments(ap)
    sys.exit(command(ap.parse_args()))
