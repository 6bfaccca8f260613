"""Exports of the block-parallel drafters: engine layouts, key validation, round trips and one-line refusals."""

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith.app.export import export
from draftsmith.decode.decoder import SpeculativeDecoder
from draftsmith.errors import DraftsmithError
from draftsmith.heads import load_head, save_head
from draftsmith.heads.block.dflash import DFlashDrafter
from draftsmith.heads.block.peagle import PEagleHead
from draftsmith.heads.block.proposers import DFlashProposer, PEagleProposer
from draftsmith.heads.eagle.model import EagleHead

AUX = [1]  # hidden_states index 1 = input of layer 1 of the 2-layer tiny target (engines capture [1, N-1])


def _named(head):
    head.target["name_or_path"] = "org/tiny-target"  # the verifier name engine configs carry
    return head


def _dflash(target, frozen=False, layers=2, full_vocab=None):
    torch.manual_seed(0)
    v = target.config.vocab_size
    ids = torch.arange(v) if (frozen if full_vocab is None else full_vocab) else torch.arange(0, v, 2)
    return _named(
        DFlashDrafter.from_target(
            target,
            draft_vocab_ids=ids,
            mask_token_id=3,
            block_size=4,
            num_layers=layers,
            aux_layers=AUX,
            freeze_lm_head=frozen,
        ).eval()
    )


def _peagle(target):
    torch.manual_seed(0)
    e3 = EagleHead.from_target(
        target, "eagle3", draft_vocab_ids=torch.arange(0, 384, 2), aux_layers=[1, 1, 1]
    )
    return _named(PEagleHead.from_target_head(e3, mask_token_id=3, num_depths=3).eval())


def test_native_folder_round_trip_keeps_the_drafts(tiny_target, tmp_path):
    dec = SpeculativeDecoder(tiny_target, eos_ids=set())
    ids = torch.randint(3, 300, (1, 8), generator=torch.Generator().manual_seed(0))
    for head, prop in ((_dflash(tiny_target), DFlashProposer), (_peagle(tiny_target), PEagleProposer)):
        out = tmp_path / head.head_type
        save_head(head, out)
        back = load_head(out, tiny_target)
        assert type(back) is type(head)
        assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), back.state_dict().values()))
        hf = export(out, "hf", tmp_path / f"{head.head_type}-hf")  # the native layout, re-validated
        again = load_head(hf, tiny_target)
        assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), again.state_dict().values()))
        a = dec.generate(ids, prop(head, tiny_target), k=3, max_new_tokens=12)
        b = dec.generate(ids, prop(back, tiny_target), k=3, max_new_tokens=12)
        assert a.tokens == b.tokens and a.accepted == b.accepted


def test_speculators_dflash_export_names_and_round_trip(tiny_target, tiny_dirs, tmp_path):
    d = _dflash(tiny_target)
    d.target["path"] = tiny_dirs[
        "target"
    ]  # a saved copy of tiny_target: the export reads its embeddings there
    save_head(d, tmp_path / "d")
    out = export(tmp_path / "d", "speculators-dflash", tmp_path / "x")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dflash" and cfg["architectures"] == ["DFlashSpeculator"]
    assert cfg["block_size"] == 4 and cfg["mask_token_id"] == 3 and cfg["aux_hidden_state_layer_ids"] == AUX
    assert cfg["transformer_layer_config"]["num_hidden_layers"] == 2
    assert cfg["draft_vocab_size"] == 192
    tensors = load_file(str(out / "model.safetensors"))
    native = d.state_dict()
    # speculators' DFlash model NaN-fills embed_tokens unless the folder carries the target's
    assert set(tensors) == set(native) | {"embed_tokens.weight"}
    assert torch.equal(tensors["embed_tokens.weight"], tiny_target.model.embed_tokens.weight)
    assert {"layers.1.self_attn.q_norm.weight", "fc.weight", "hidden_norm.weight", "d2t", "t2d"} <= set(
        tensors
    )
    assert all(torch.equal(tensors[k], native[k]) for k in native)


def test_sglang_dflash_export_and_refusals(tiny_target, tmp_path):
    save_head(_dflash(tiny_target), tmp_path / "reduced")
    with pytest.raises(DraftsmithError, match="no lm_head"):
        export(tmp_path / "reduced", "sglang-dflash", tmp_path / "bad")
    assert not (tmp_path / "bad").exists()  # nothing written
    save_head(_dflash(tiny_target, frozen=True), tmp_path / "frozen")
    out = export(tmp_path / "frozen", "sglang-dflash", tmp_path / "ok")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"] == {
        "target_layer_ids": [0],
        "mask_token_id": 3,
        "block_size": 4,
    }  # layer outputs
    assert cfg["num_target_layers"] == 2 and cfg["num_hidden_layers"] == 2
    names = set(load_file(str(out / "model.safetensors")))
    assert not names & {"lm_head.weight", "d2t", "t2d", "embed_tokens.weight"}
    with pytest.raises(
        DraftsmithError,
        match=r"\(dflash\), which cannot be exported as speculators-peagle; it exports to hf or sglang-dflash or speculators-dflash",
    ):
        export(tmp_path / "frozen", "speculators-peagle", tmp_path / "wrong")


def test_speculators_peagle_export(tmp_path):
    from draftsmith.testing import tiny_llama

    target = tiny_llama(0, num_hidden_layers=5)
    target.save_pretrained(
        tmp_path / "target"
    )  # speculators folders carry the target's embeddings, read from here
    for aux, name in (([1, 2, 4], "ok"), ([2, 1, 4], "bad")):
        torch.manual_seed(0)
        e3 = EagleHead.from_target(target, "eagle3", draft_vocab_ids=torch.arange(0, 384, 2), aux_layers=aux)
        head = _named(PEagleHead.from_target_head(e3, mask_token_id=3, num_depths=3))
        head.target["path"] = str(tmp_path / "target")
        save_head(head, tmp_path / name)
    out = export(tmp_path / "ok", "speculators-peagle", tmp_path / "x")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "peagle" and cfg["architectures"] == ["PEagleSpeculator"]
    assert (
        cfg["mask_token_id"] == 3
        and cfg["num_depths"] == 3
        and cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]
    )
    assert cfg["speculators_config"]["algorithm"] == "peagle"
    tensors = load_file(str(out / "model.safetensors"))
    native = load_file(str(tmp_path / "ok" / "model.safetensors"))
    renamed = {("layers.0." + k[9:]) if k.startswith("midlayer.") else k: v for k, v in native.items()}
    assert set(tensors) == set(renamed) | {"embed_tokens.weight"} and tensors["mask_hidden"].shape == (
        1,
        1,
        192,
    )
    assert torch.equal(tensors["embed_tokens.weight"], target.model.embed_tokens.weight)
    assert all(torch.equal(tensors[k], renamed[k]) for k in renamed)
    with pytest.raises(DraftsmithError, match="increasing"):  # engines concatenate aux states in layer order
        export(tmp_path / "bad", "speculators-peagle", tmp_path / "y")
    with pytest.raises(
        DraftsmithError, match=r"holds a P-EAGLE head \(peagle\), which cannot be exported as sglang-dflash"
    ):
        export(tmp_path / "ok", "sglang-dflash", tmp_path / "z")


def test_tampered_block_checkpoints_are_refused(tiny_target, tmp_path):
    d = _dflash(tiny_target)
    save_head(d, tmp_path / "d")
    f = tmp_path / "d" / "model.safetensors"
    t = load_file(str(f))
    t.pop("layers.1.self_attn.k_norm.weight")
    save_file(t, str(f))
    with pytest.raises(DraftsmithError, match="missing"):
        export(tmp_path / "d", "speculators-dflash", tmp_path / "x")
    save_head(d, tmp_path / "d2")
    cfg = json.loads((tmp_path / "d2" / "config.json").read_text())
    cfg["block_size"] = 1
    (tmp_path / "d2" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DraftsmithError, match="block_size"):
        export(tmp_path / "d2", "speculators-dflash", tmp_path / "y")


def test_speculators_block_exports_match_the_engine_loaders(tiny_target, tiny_dirs, tmp_path):
    """What speculators 0.9.0 (DFlashDraftModel / PEagleDraftModel) and vLLM 0.33.0 (update_dflash, DFlash and
    EAGLE-3 load_weights) expect; scripts/check_engine_loaders.sh loads these folders with speculators itself."""
    d = _dflash(tiny_target, frozen=True)
    d.target["path"] = tiny_dirs["target"]
    save_head(d, tmp_path / "full")
    out = export(tmp_path / "full", "speculators-dflash", tmp_path / "x")
    cfg = json.loads((out / "config.json").read_text())
    tensors = load_file(str(out / "model.safetensors"))
    layer = cfg["transformer_layer_config"]
    # a full draft vocabulary: speculators registers no d2t/t2d and vLLM's loader raises on a d2t it has no slot for
    assert cfg["draft_vocab_size"] == layer["vocab_size"] == 384 and not {"d2t", "t2d"} & set(tensors)
    assert cfg["sample_from_anchor"] is False  # the anchor row predicts nothing: block_size - 1 draft tokens
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == cfg["block_size"] - 1
    # speculators sizes fc from the draft layer config; vLLM captures aux ids as layer inputs and gives the model id - 1
    assert tensors["fc.weight"].shape == (layer["hidden_size"], len(AUX) * layer["hidden_size"])
    assert cfg["aux_hidden_state_layer_ids"] == AUX and min(AUX) - 1 >= 0

    own = _dflash(
        tiny_target, full_vocab=True
    )  # a trained full-vocabulary head: speculators would swap in the target's
    save_head(own, tmp_path / "own")
    with pytest.raises(DraftsmithError, match="replaces a full-vocabulary"):
        export(tmp_path / "own", "speculators-dflash", tmp_path / "y")
    base = _dflash(tiny_target)
    narrow = DFlashDrafter(
        replace(base.config, hidden_size=32, intermediate_size=64, num_attention_heads=2), base.target
    )
    narrow.set_draft_vocab(base.vocab_ids)
    save_head(narrow, tmp_path / "narrow")
    with pytest.raises(DraftsmithError, match="must equal the target's"):
        export(tmp_path / "narrow", "speculators-dflash", tmp_path / "z")

    from draftsmith.testing import tiny_llama

    target = tiny_llama(0, num_hidden_layers=4)
    target.save_pretrained(tmp_path / "target4")
    torch.manual_seed(0)
    e3 = EagleHead.from_target(target, "eagle3", draft_vocab_ids=torch.arange(384), aux_layers=[1, 2, 3])
    head = _named(PEagleHead.from_target_head(e3, mask_token_id=3, num_depths=3))
    head.target["path"] = str(tmp_path / "target4")
    save_head(head, tmp_path / "pfull")
    out = export(tmp_path / "pfull", "speculators-peagle", tmp_path / "p")
    tensors = load_file(str(out / "model.safetensors"))
    assert not {"d2t", "t2d"} & set(tensors) and tensors["mask_hidden"].shape == (1, 1, 3 * 64)
