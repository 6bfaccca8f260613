"""draftsmith.woq and `draft:<model>,bits=4|8`: a draft whose matmul weights are read as int4 (groups) / int8 (rows).
The products equal the dequantized weights' (exactly for weights already on the int4 grid), every Linear of the
draft and its head are replaced while a tied input embedding keeps its weights, decoding stays lossless (greedy ==
plain, sampled law == the target's, batch 1 and 2, both tiny architectures, eager and compiled), the weight reads
and FLOPs are counted (decode.flops), and a width or device the kernels do not take is one line, exit 2."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from draftsmith import woq
from draftsmith.app.cli import main
from draftsmith.decode.decoder import SpeculativeDecoder
from draftsmith.decode.flops import decode_flops
from draftsmith.decode.proposers import DraftModelProposer
from draftsmith.errors import DraftsmithError
from draftsmith.testing import ARCHS, sampled_joint_tvd, tiny_model
from draftsmith.woq import Int4Linear, Int8Linear, check_quantizable, quantize_linears, weight_bytes

PROMPT = torch.tensor([[1, 40, 50, 60, 70, 80, 40, 50, 60, 90, 40, 50]])


def _dense(q: nn.Module, in_features: int) -> torch.Tensor:
    """The weight [out, in] a quantized Linear's decode steps multiply by (the kernel's product with the identity,
    bias removed; an Int4Linear's forward would take its dense weight for that many rows)."""
    eye = torch.eye(in_features)
    if isinstance(q, Int4Linear):
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, q.packed, q.group, q.scales_zeros)
        return out[:, : q.out_features].t()
    out = q(eye)
    return (out if q.bias is None else out - q.bias).t()


def test_int4_product_is_exact_for_weights_on_its_grid():
    """Weights that ARE 4-bit values in groups of 32 (each group spans 0..15) come back exactly (fp32)."""
    torch.manual_seed(0)
    n, k, g = 48, 128, 32
    q = torch.randint(0, 16, (n, k)).float()
    q[:, 0::g], q[:, 1::g] = 0, 15
    scale, zero = torch.rand(n, k // g) * 0.01 + 1e-3, torch.randn(n, k // g) * 0.01
    lin = nn.Linear(k, n)
    lin.weight.data = (q.reshape(n, k // g, g) * scale[..., None] + zero[..., None]).reshape(n, k)
    m = Int4Linear(lin, g)
    torch.testing.assert_close(_dense(m, k), lin.weight.data, rtol=0, atol=1e-6)
    x = torch.randn(2, 3, k)  # any leading shape, bias added
    torch.testing.assert_close(m(x), lin(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("group", [32, 128])
def test_int4_and_int8_errors_stay_within_half_a_step(group):
    """Random weights: every int4 value is within half its group's step (max - min) / 15 of the weight; every int8
    value within half its row's step max|w| / 127."""
    torch.manual_seed(1)
    lin = nn.Linear(256, 40, bias=False)
    w = lin.weight.data
    groups = w.reshape(40, 256 // group, group)
    step = ((groups.amax(-1) - groups.amin(-1)) / 15).repeat_interleave(group, 1)
    assert bool(((_dense(Int4Linear(lin, group), 256) - w).abs() <= step / 2 + 1e-6).all())
    step8 = (w.abs().amax(1, keepdim=True) / 127).expand_as(w)
    err8 = (_dense(Int8Linear(lin), 256) - w).abs()
    assert bool((err8 <= step8 / 2 + 1e-6).all()) and float(err8.max()) > 0  # quantized, not a copy


def test_a_prefill_multiplies_the_dense_weight_and_a_step_the_int4_one():
    """More than DENSE_ROWS rows (a prompt) take the Linear's own weight; fewer (a draft step) the int4 kernel."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 40)
    q = Int4Linear(lin)
    many, few = torch.randn(woq.DENSE_ROWS + 1, 64), torch.randn(woq.DENSE_ROWS, 64)
    torch.testing.assert_close(q(many), lin(many), rtol=0, atol=0)
    int4_w = _dense(q, 64)
    torch.testing.assert_close(q(few), few @ int4_w.t() + lin.bias, rtol=1e-5, atol=1e-5)
    assert not torch.equal(int4_w, lin.weight.detach())  # the step really reads the 4-bit copy
    assert "dense" not in q.state_dict() and weight_bytes(q) == q.packed.nbytes + q.scales_zeros.nbytes


@pytest.mark.parametrize("arch", ARCHS)
def test_a_quantized_draft_replaces_every_linear_and_keeps_the_embedding(arch):
    draft = tiny_model(arch, 1, num_hidden_layers=1)
    emb = draft.get_input_embeddings().weight.clone()
    bf = weight_bytes(draft)
    prop = DraftModelProposer(draft, draft.config.vocab_size, bits=4)
    assert not any(type(m) is nn.Linear for m in prop.decoder.modules())
    assert sum(isinstance(m, Int4Linear) for m in prop.decoder.modules()) == 7  # q k v o gate up down
    assert isinstance(prop.head, Int4Linear) and prop.head.out_features == prop.out_size
    torch.testing.assert_close(draft.get_input_embeddings().weight, emb, rtol=0, atol=0)
    # fp32 weights read as 4 bits: ~1/8 of the layers' bytes (scales and zeros beside them)
    assert weight_bytes(prop.decoder) < 0.2 * bf


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_draft_greedy_equals_plain_alone_and_in_a_batch(arch, bits):
    target = tiny_model(arch, 0)
    dec = SpeculativeDecoder(target, eos_ids=set())
    ref = dec.generate(PROMPT, None, max_new_tokens=24).tokens
    # the target's own weights as the draft: acceptance is high, so long accepted runs and rollbacks both occur
    prop = DraftModelProposer(tiny_model(arch, 0), target.config.vocab_size, bits=bits)
    res = dec.generate(PROMPT, prop, k=3, max_new_tokens=24)
    assert res.tokens == ref and sum(res.accepted) > 0
    other = torch.tensor([[1, 7, 9, 11, 13, 17, 19]])
    rows = dec.generate_batch([PROMPT[0], other[0]], prop, k=3, max_new_tokens=24).rows
    assert rows[0].tokens == ref
    assert rows[1].tokens == dec.generate(other, None, max_new_tokens=24).tokens


@pytest.mark.parametrize("arch", ARCHS)
def test_an_int4_draft_in_groups_of_64_reads_fewer_bytes_and_stays_lossless(arch):
    target = tiny_model(arch, 0)
    dec = SpeculativeDecoder(target, eos_ids=set())
    ref = dec.generate(PROMPT, None, max_new_tokens=24).tokens
    g32 = DraftModelProposer(tiny_model(arch, 0), target.config.vocab_size, bits=4)
    g64 = DraftModelProposer(tiny_model(arch, 0), target.config.vocab_size, bits=4, group=64)
    quantized = [m for m in g64.decoder.modules() if isinstance(m, Int4Linear)]
    layers = tiny_model(arch, 0).config.num_hidden_layers
    assert len(quantized) == 7 * layers and {m.group for m in quantized} == {64} and g64.head.group == 64
    assert weight_bytes(g64.decoder) < weight_bytes(g32.decoder)  # half the scales and zeros
    res = dec.generate(PROMPT, g64, k=3, max_new_tokens=24)
    assert res.tokens == ref and sum(res.accepted) > 0


def test_a_group_that_does_not_divide_the_drafts_widths_names_one_that_does():
    from types import SimpleNamespace

    from draftsmith.woq import check_group_divides

    qwen_05b = SimpleNamespace(hidden_size=896, intermediate_size=4864)
    check_group_divides(128, qwen_05b)
    with pytest.raises(
        DraftsmithError, match="group=256 does not divide the draft's width 896; use group=128"
    ):
        check_group_divides(256, qwen_05b)
    with pytest.raises(DraftsmithError, match="no int4 group divides it: use bits=8"):
        check_group_divides(32, SimpleNamespace(hidden_size=100, intermediate_size=256))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_sampled_decoding_with_an_int4_draft_matches_target_distribution(arch):
    """Temperature 1, 4-token vocabulary: the joint law of tokens 1-3 drafted by an int4 draft (k=2) equals the
    target's exact law, alone and beside a longer prompt (batch 2)."""
    target = tiny_model(arch, 0, vocab_size=4)
    dec = SpeculativeDecoder(target, eos_ids=set())
    prop = DraftModelProposer(tiny_model(arch, 3, vocab_size=4, num_hidden_layers=1), 4, bits=4)
    assert isinstance(prop.head, Int4Linear)
    tvd = sampled_joint_tvd(dec, prop, torch.tensor([[1, 3, 0, 2]]), n=3000)
    assert tvd < 0.06, tvd
    other = (torch.tensor([[2, 0, 1, 3, 3, 1, 0]]),)
    tvd = sampled_joint_tvd(dec, prop, torch.tensor([[1, 3, 0, 2]]), batch_with=other)
    assert tvd < 0.06, ("B=2", tvd)


def test_compiled_int4_draft_decodes_as_the_eager_one(tiny_target, monkeypatch):
    """compile= and bits= together: the quantized step traced as one graph accepts exactly what the eager one does
    (every product in int4 here: a compiled draft's first prompt feeds its last tokens one and two at a time, which
    would otherwise be int4 rows where the eager draft's prefill multiplied dense weights)."""
    monkeypatch.setattr(woq, "DENSE_ROWS", 10**9)
    dec = SpeculativeDecoder(tiny_target, eos_ids=set())
    vocab = tiny_target.config.vocab_size
    eager = dec.generate(
        PROMPT, DraftModelProposer(tiny_model("llama", 0), vocab, bits=4), k=3, max_new_tokens=20
    )
    prop = DraftModelProposer(tiny_model("llama", 0), vocab, bits=4, compile="aot_eager")
    compiled = dec.generate(PROMPT, prop, k=3, max_new_tokens=20)
    assert compiled.tokens == eager.tokens and compiled.accepted == eager.accepted


def test_flops_count_the_quantized_weights(tiny_target):
    """decode.flops sees the int4 products: the draft's FLOPs as the fp32 draft's, its bytes read ~1/8 of them."""
    dec = SpeculativeDecoder(tiny_target, eos_ids=set())
    vocab = tiny_target.config.vocab_size
    full = decode_flops(dec, DraftModelProposer(tiny_model("llama", 1), vocab), PROMPT, k=2, max_new_tokens=8)
    quant = DraftModelProposer(tiny_model("llama", 1), vocab, bits=4)
    q = decode_flops(dec, quant, PROMPT, k=2, max_new_tokens=8)
    assert q["draft_flops_per_token"] == pytest.approx(full["draft_flops_per_token"], rel=0.15)
    assert 0.05 * full["weight_share"] < q["weight_share"] < 0.2 * full["weight_share"]


def test_check_quantizable_names_the_fix():
    with pytest.raises(DraftsmithError, match="use bits=4 or bits=8"):
        check_quantizable(5)
    with pytest.raises(DraftsmithError, match="int4 group size"):
        check_quantizable(4, group=48)
    with pytest.raises(DraftsmithError, match="on cuda drop bits="):
        check_quantizable(4, device="cuda")
    with pytest.raises(DraftsmithError, match="on meta drop bits="):
        quantize_linears(nn.Linear(64, 8, device="meta"), 8)  # a module's own device is checked too


@pytest.mark.parametrize(
    "opts, named",
    [("bits=5", "bits"), ("bits=16", "bits"), ("bits=x", "bits"), ("group=64", "add bits=4"),
     ("bits=8,group=64", "add bits=4"), ("bits=4,group=48", "int4 group size"),
     ("bits=4,group=256", "does not divide the draft's width 64; use group=64"),
     ("nodes=6,siblings=0", "siblings=0 allows none"), ("nodes=0", "nodes"), ("nodes=65", "nodes")],
)  # fmt: skip
def test_eval_refuses_a_draft_option_it_cannot_use(tiny_dirs, tmp_path, capsys, opts, named):
    """int4/int8 widths and groups (here), and the draft's tree budget (nodes=, test_draft_siblings)."""
    out = tmp_path / "ev"
    rc = main(["eval", "--target", tiny_dirs["target"], "--drafter", f"draft:{tiny_dirs['draft']},{opts}",
               "--prompts", "builtin:vicuna", "--limit", "1", "--max-new-tokens", "4", "--device", "cpu",
               "--no-progress", "--out", str(out)])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    if "divide" in named:  # the draft's widths are read from its config, after the target has loaded
        err = [line for line in err if not line.startswith("Loading weights")]
    assert rc == 2 and len(err) == 1 and named in err[0], err
    assert not out.exists()


def test_eval_with_an_int4_draft_is_lossless(tiny_dirs, tmp_path, capsys):
    out = tmp_path / "ev"
    spec = f"draft:{tiny_dirs['draft']},bits=4"
    rc = main(["eval", "--target", tiny_dirs["target"], "--drafter", spec, "--prompts", "builtin:vicuna",
               "--limit", "2", "--k", "3", "--max-new-tokens", "12", "--device", "cpu", "--no-progress",
               "--out", str(out)])  # fmt: skip
    assert rc == 0, capsys.readouterr().err
    res = json.loads((out / "eval.json").read_text())
    assert res["lossless"] is True and res["conditions"]["drafter"] == spec
