"""CPU weight layout for few-token forwards (draftsmith.cpulayout): same outputs, same state_dict, the dispatch
really picks the layout the measurement chose, and speculative decoding on a re-laid target stays lossless."""

import copy
import json
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from draftsmith import cpukernels, cpulayout
from draftsmith.cpulayout import ROWS, Plan, TunedLinear, measure_shape, tune_linears
from draftsmith.decode.decoder import SpeculativeDecoder
from draftsmith.decode.proposers import DraftModelProposer, NGramProposer
from draftsmith.errors import DraftsmithError
from draftsmith.testing import aten_calls, tiny_llama

PROMPT = torch.tensor([[1, 40, 50, 60, 70, 80, 40, 50, 60, 90, 40, 50]])


@pytest.fixture
def forced(monkeypatch):
    """Make every shape's measurement say: row-major wins for 2 and 3 rows (as measured on AVX-512 Xeons), oneDNN
    for 6 and 8 (as on AMD CPUs without AVX-512), column-major elsewhere."""
    decisions = {}
    monkeypatch.setattr(cpulayout, "_DECISIONS", decisions)
    plan = Plan("col", {2: "row", 3: "row", 6: "onednn", 8: "onednn"})
    monkeypatch.setattr(cpulayout, "measure_shape", lambda i, o, dtype: plan)
    return decisions


def test_outputs_state_dict_and_ties_are_unchanged(forced):
    base = tiny_llama(seed=3, tie_word_embeddings=True)
    base.requires_grad_(False)
    assert base.lm_head.weight is base.model.embed_tokens.weight
    tuned = copy.deepcopy(base)
    summary = tune_linears(tuned)
    n_linear = sum(type(m) is nn.Linear for m in base.modules())
    assert summary["tuned"] == n_linear == summary["dual"] == summary["column_major"]
    assert all(type(m) is not nn.Linear for m in tuned.modules())
    assert tuned.lm_head.weight.stride() == (1, tuned.lm_head.weight.shape[0])  # column-major
    assert tuned.model.embed_tokens.weight.is_contiguous()  # the embedding keeps its own row-major weight
    sd_base, sd_tuned = base.state_dict(), tuned.state_dict()
    assert sd_base.keys() == sd_tuned.keys()
    for key in sd_base:
        assert torch.equal(sd_base[key], sd_tuned[key]), key
    for rows in (1, 2, 3, 4, 7, 16, 40):
        ids = torch.randint(3, 300, (1, rows))
        torch.testing.assert_close(tuned(ids).logits, base(ids).logits, rtol=1e-5, atol=1e-5)
    assert tune_linears(tuned)["tuned"] == 0  # idempotent


def test_dispatch_uses_the_row_major_copy_exactly_for_its_row_counts(forced):
    lin = nn.Linear(32, 16).requires_grad_(False)
    holder = nn.Sequential(lin)
    tune_linears(holder)
    assert isinstance(lin, TunedLinear) and lin.row_major_rows == {2, 3}
    lin.other_layout.zero_()  # poison the copy: only forwards that read it change
    for rows, reads_copy in (
        (1, False),
        (2, True),
        (3, True),
        (4, False),
        (5, False),
        (6, False),
        (12, False),
        (20, False),
        (200, False),
    ):
        out = lin(torch.randn(rows, 32))
        assert torch.equal(out, lin.bias.expand_as(out)) == reads_copy, rows
    lin.weight.requires_grad_(True)  # a weight that trains again never reads the (now stale) copy
    out = lin(torch.randn(2, 32))
    assert not torch.equal(out, lin.bias.expand_as(out))


def test_dispatch_runs_onednn_exactly_for_its_row_counts(forced, monkeypatch):
    calls = []
    real, layout = cpulayout.KERNELS["onednn"]
    monkeypatch.setitem(
        cpulayout.KERNELS, "onednn", (lambda x, w, b: calls.append(x.shape[0]) or real(x, w, b), layout)
    )
    base = nn.Linear(32, 16).requires_grad_(False)
    lin = copy.deepcopy(base)
    tune_linears(nn.Sequential(lin))
    for rows in (1, 2, 4, 5, 6, 7, 8, 11, 12, 40):
        x = torch.randn(rows, 32)
        torch.testing.assert_close(lin(x), base(x), rtol=1e-5, atol=1e-5)
    assert calls == [6, 7, 8, 11]  # buckets 6 and 8 (6-7, 8-11); 12 and up are column-major again


def test_skips_trainable_and_respects_the_off_switch(forced, monkeypatch):
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8).requires_grad_(False))
    assert tune_linears(model)["tuned"] == 1
    assert type(model[0]) is nn.Linear and isinstance(model[1], TunedLinear)
    monkeypatch.setenv("DRAFTSMITH_CPU_LAYOUT", "off")
    other = nn.Sequential(nn.Linear(8, 8).requires_grad_(False))
    assert tune_linears(other)["tuned"] == 0 and type(other[0]) is nn.Linear
    monkeypatch.setenv("DRAFTSMITH_CPU_LAYOUT", "of")  # a typo is refused, not read as "on"
    with pytest.raises(DraftsmithError, match="DRAFTSMITH_CPU_LAYOUT='of' is not auto, retune or off"):
        tune_linears(other)


def test_no_room_for_both_layouts_keeps_one(forced):
    model = nn.Sequential(nn.Linear(64, 64).requires_grad_(False))
    summary = tune_linears(model, max_extra_bytes=0)
    assert summary["dual"] == 0 and summary["extra_mib"] == 0
    assert (
        isinstance(model[0], TunedLinear) and not model[0].row_major_rows
    )  # row-major wins only 2 of 10 counts
    assert model[0].kernel_of == {6: "onednn", 8: "onednn"}  # the kernels that need no copy stay


def test_measurement_is_real_and_cached(monkeypatch):
    monkeypatch.setattr(cpulayout, "_DECISIONS", {})
    plan = measure_shape(48, 40, torch.float32)
    assert plan.layout in ("row", "col") and set(plan.kernel_of) <= set(ROWS)
    assert set(plan.kernel_of.values()) <= set(cpulayout.KERNELS) - {cpulayout.DEFAULT[plan.layout]}
    assert cpulayout._DECISIONS[(48, 40, torch.float32)] is plan
    assert "onednn" in cpulayout._candidates(torch.float32, 48)  # this torch build has oneDNN for fp32


def test_choice_keeps_the_layout_closest_to_the_fastest_kernels():
    choose = cpulayout._choose
    # an AVX-512 Xeon: column-major wins from 4 rows, row-major at 2-3 -> col + a row copy for 2-3
    xeon = {n: {"row": 1.0 if n < 4 else 2.0, "col": 1.5 if n in (2, 3) else 1.0} for n in ROWS}
    assert choose(xeon) == Plan("col", {2: "row", 3: "row"})
    # an AMD EPYC without AVX-512: stream (row-major) wins up to 16 rows, oneDNN beyond -> row + a column copy
    amd = {
        n: {"row": 3.0, "col": 2.5, "onednn": 1.2 if n > 16 else 2.0, "stream": 1.0} for n in ROWS if n <= 16
    }
    amd.update({n: {"row": 1.5, "col": 1.4, "onednn": 1.0} for n in ROWS if n > 16})
    plan = choose(amd)
    assert plan.layout == "row" and plan.needs_copy
    assert plan.kernel_of == {**{n: "stream" for n in ROWS if n <= 16}, 32: "onednn", 64: "onednn"}
    assert plan.without_copy() == Plan("row", {n: "stream" for n in ROWS if n <= 16})
    # a kernel within MARGIN of the layout's own F.linear is not worth a dispatch
    flat = {n: {"row": 1.0, "col": 1.02} for n in ROWS}
    assert choose(flat) == Plan("row", {})
    # and a layout within MARGIN of the other keeps nn.Linear's own: noise cannot flip it
    near = {n: {"row": 1.0, "col": 0.97} for n in ROWS}
    assert choose(near) == Plan("row", {})


def test_choice_weighs_decode_row_counts_over_prefill():
    """Stream wins every decode count (1-16 rows), oneDNN on the column-major weight wins 32 and 64 by 2x: summed
    over the counts as equals, column-major looked closer to the fastest; weighted as a decode runs them, the
    row-major layout is primary and a copy serves only the prefill counts."""
    med = {n: {"row": 1.3, "col": 1.25, "onednn": 1.15, "stream": 1.0} for n in ROWS if n <= 16}
    med.update({n: {"row": 2.0, "col": 1.0, "onednn": 1.0} for n in ROWS if n > 16})
    plan = cpulayout._choose(med)
    assert plan.layout == "row" and plan.without_copy() == Plan("row", {n: "stream" for n in ROWS if n <= 16})
    assert plan.kernel_of[32] == plan.kernel_of[64] == "col" and 0 < plan.saving < 0.1


def test_choice_keeps_the_fast_single_row_kernel_and_the_verify_kernel_with_a_copy():
    """As measured for Qwen2.5-Coder-1.5B's MLP (1536x8960) on a 2-core AMD EPYC: oneDNN on the column-major weight
    is 1.5x faster for one row, stream on the row-major one for 3-6 rows (the verify of k = 2-5). With a copy both
    run, and the copy is ranked by what it saves over the weighted counts (6% here: 1.6x at 4 rows, less elsewhere)."""
    ms = {1: (4.3, 3.3, 2.75, 4.1), 2: (9.8, 6.8, 4.4, 4.6), 3: (13.8, 9.5, 5.6, 5.2), 4: (15.9, 13.9, 10.2, 6.5),
          6: (18.1, 15.2, 7.5, 6.9), 8: (18.8, 15.6, 7.6, 8.2), 12: (18.1, 14.4, 8.7, 9.1),
          16: (25.2, 15.8, 10.3, 12.1), 32: (28.9, 26.1, 15.5, None), 64: (38.6, 38.5, 26.1, None)}  # fmt: skip
    med = {n: {k: t for k, t in zip(("row", "col", "onednn", "stream"), ts) if t} for n, ts in ms.items()}
    plan = cpulayout._choose(med)
    assert plan.kernel_of[1] == "onednn" and plan.kernel_of[3] == plan.kernel_of[4] == "stream"
    assert plan.needs_copy and 0.05 < plan.saving < 0.1


def test_copies_are_kept_in_the_order_of_what_they_save(monkeypatch):
    monkeypatch.setattr(cpulayout, "_DECISIONS", {})
    plans = {32: Plan("col", {2: "row"}, saving=0.02), 48: Plan("col", {2: "row", 3: "row"}, saving=0.3)}
    monkeypatch.setattr(cpulayout, "measure_shape", lambda i, o, dtype: plans[i])
    model = nn.Sequential(nn.Linear(48, 32), nn.Linear(32, 48), nn.Linear(48, 32)).requires_grad_(False)
    # room for two of the three (equal-sized) copies: the two big savers, not the first Linear in the model
    summary = tune_linears(model, max_extra_bytes=48 * 32 * 4 * 2)
    assert [bool(m.row_major_rows) for m in model] == [True, False, True]
    assert summary["dual"] == 2 and summary["copies_left_out"] == 1
    assert summary["kernels"]["32x48"] == {"layout": "col", "row": [2], "linears": 1, "copies_left_out": 1}
    assert "1 more did not fit" in cpulayout.describe(summary)
    x = torch.randn(2, 48)
    torch.testing.assert_close(model(x), F.linear(F.linear(F.linear(x, model[0].weight, model[0].bias),
                               model[1].weight, model[1].bias), model[2].weight, model[2].bias))  # fmt: skip


@pytest.mark.skipif(not cpukernels.available(), reason="needs x86 with AVX2 + FMA and a C++ compiler")
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 16, 40])
def test_stream_kernel_equals_f_linear(rows):
    w = torch.randn(72, 64)
    b = torch.randn(72)
    x = torch.randn(rows, 64)
    torch.testing.assert_close(cpukernels.stream_linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    x3 = torch.randn(2, rows, 64)[:, :, :]  # a batch of sequences, and no bias
    torch.testing.assert_close(cpukernels.stream_linear(x3, w), F.linear(x3, w), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not cpukernels.available(), reason="needs x86 with AVX2 + FMA and a C++ compiler")
def test_row_major_primary_with_stream_and_a_column_copy(monkeypatch):
    monkeypatch.setattr(cpulayout, "_DECISIONS", {})
    plan = Plan("row", {1: "stream", 2: "stream", 3: "stream", 32: "onednn"})
    monkeypatch.setattr(cpulayout, "measure_shape", lambda i, o, dtype: plan)
    base = tiny_llama(seed=4).requires_grad_(False)
    tuned = copy.deepcopy(base)
    summary = tune_linears(tuned)
    assert summary["column_major"] == 0 and summary["dual"] == summary["tuned"] > 0
    assert tuned.lm_head.weight.is_contiguous() and tuned.lm_head.other_layout.stride() == (1, 384)
    for rows in (1, 2, 3, 5, 32, 40):
        ids = torch.randint(3, 300, (1, rows))
        torch.testing.assert_close(tuned(ids).logits, base(ids).logits, rtol=1e-4, atol=1e-4)


PACKED = "packed" in cpulayout._candidates(torch.float32, 64)


@pytest.mark.skipif(not PACKED, reason="this torch has no oneDNN reorder/inner product for fp32")
@pytest.mark.parametrize("rows", [1, 2, 5, 16, 40])
def test_packed_kernel_on_the_blocked_copy_equals_f_linear(rows):
    w, b = torch.randn(72, 64), torch.randn(72)
    fn, layout = cpulayout.KERNELS["packed"]
    packed = cpulayout.lay_out(w, layout)
    x = torch.randn(rows, 64)
    torch.testing.assert_close(fn(x, packed, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fn(x, packed, None), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_choice_keeps_one_copy_in_the_layout_that_saves_most():
    """As measured for the 0.5B's 896x4864 projection in bf16 on an AMX Xeon: the blocked copy is ~1.5x faster than
    F.linear for every decode count; the column-major one wins only prefill counts. One copy: the blocked one."""
    med = {n: {"row": 1.5, "col": 1.6, "onednn": 1.6, "packed": 1.0} for n in ROWS if n <= 16}
    med.update({n: {"row": 2.0, "col": 1.0, "onednn": 1.1, "packed": 1.5} for n in ROWS if n > 16})
    plan = cpulayout._choose(med)
    assert plan.layout == "row" and plan.copy_layout == "packed"
    assert plan.kernel_of == {n: "packed" for n in ROWS}  # 32-64 too: the copy it has, 1.5 < 2.0
    assert plan.without_copy() == Plan("row", {})
    # where the column-major copy saves more (it wins the prefill counts 4x, the blocked one only 1.3x and ties the
    # decode counts within MARGIN), it is the one kept, and the blocked kernel runs nowhere
    med = {n: {"row": 1.0, "col": 1.3, "packed": 0.98} for n in ROWS if n <= 16}
    med.update({n: {"row": 4.0, "col": 1.0, "packed": 3.0} for n in ROWS if n > 16})
    plan = cpulayout._choose(med)
    assert plan == Plan("row", {32: "col", 64: "col"}) and plan.copy_layout == "col"


def test_plan_without_a_kernel_chooses_again_from_the_same_medians(monkeypatch):
    med = {n: {"row": 1.5, "col": 1.0, "onednn": 1.2, "packed": 0.8} for n in ROWS}
    monkeypatch.setattr(cpulayout, "_DECISIONS", {(48, 40, torch.float32): cpulayout._choose(med)})
    monkeypatch.setattr(cpulayout, "_MEDIANS", {(48, 40, torch.float32): med})
    assert cpulayout.plan_without(48, 40, torch.float32, frozenset()).copy_layout == "packed"
    assert cpulayout.plan_without(48, 40, torch.float32, frozenset({"packed"})) == Plan("col", {})
    # a kept plan without medians: the left-out kernel's counts fall back to the layout's own F.linear
    monkeypatch.setitem(cpulayout._MEDIANS, (48, 40, torch.float32), None)
    monkeypatch.setitem(
        cpulayout._DECISIONS, (48, 40, torch.float32), Plan("row", {1: "packed", 4: "stream"})
    )
    assert cpulayout.plan_without(48, 40, torch.float32, frozenset({"packed"})) == Plan("row", {4: "stream"})
    model = nn.Sequential(nn.Linear(48, 40)).requires_grad_(False)
    assert tune_linears(model, without=frozenset({"packed", "stream"}))["plain"] == 1


@pytest.mark.skipif(not PACKED, reason="this torch has no oneDNN reorder/inner product for fp32")
def test_speculative_on_a_target_with_blocked_copies_equals_plain_greedy(monkeypatch):
    """Every Linear runs the packed kernel for 1 and 4-7 rows (a plain step, the draft's steps, verify blocks of
    k = 3-6), F.linear on the row-major weight for the rest: same tokens as the untouched model."""
    monkeypatch.setattr(cpulayout, "_DECISIONS", {})
    calls = []
    real, layout = cpulayout.KERNELS["packed"]
    monkeypatch.setitem(
        cpulayout.KERNELS, "packed", (lambda x, w, b: calls.append(x.shape[0]) or real(x, w, b), layout)
    )
    plan = Plan("row", {1: "packed", 4: "packed", 6: "packed"})
    monkeypatch.setattr(cpulayout, "measure_shape", lambda i, o, dtype: plan)
    base = tiny_llama(seed=0).requires_grad_(False)
    plain = base.generate(PROMPT, max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=2)
    tuned = copy.deepcopy(base)
    summary = tune_linears(tuned)
    assert summary["dual"] == summary["tuned"] > 0 and tuned.lm_head.weight.is_contiguous()
    other = tiny_llama(seed=1, num_hidden_layers=1).requires_grad_(False)
    tune_linears(other)
    dec = SpeculativeDecoder(tuned, None)
    want = plain[0, PROMPT.shape[1] :].tolist()
    for k in (1, 3, 5):
        for proposer in (DraftModelProposer(other, 384), NGramProposer()):
            assert dec.generate(PROMPT, proposer, k=k, max_new_tokens=40).tokens[:40] == want, (k, proposer)
    assert {1, 4, 5, 6, 7} & set(calls) and not {2, 3} & set(calls)
    assert tuned.state_dict().keys() == base.state_dict().keys()  # the blocked copy is not saved


def test_greedy_speculative_on_a_tuned_target_equals_plain_greedy_on_the_original(forced):
    base = tiny_llama(seed=0)
    base.requires_grad_(False)
    plain = base.generate(PROMPT, max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=2)
    tuned = copy.deepcopy(base)
    tune_linears(tuned)
    other = tiny_llama(seed=1, num_hidden_layers=1).requires_grad_(False)
    tune_linears(other)
    dec = SpeculativeDecoder(tuned, None)
    # the decoder's logits come from the tuned head itself (its layout and kernels were measured here), not from a
    # transposed copy of its own
    rows = []
    tuned.lm_head.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[-2]))
    dec.generate(PROMPT, None, k=1, max_new_tokens=3)
    assert rows == [1, 1, 1]  # the prefill's last row, then each plain step's
    want = plain[0, PROMPT.shape[1] :].tolist()
    # verify blocks of 1 to k+1 rows: the row-major copy (2-3 rows), the column-major weight (4-5, 12+) and oneDNN
    # (6-11) all verify
    for k in (1, 2, 4, 7):
        for proposer in (DraftModelProposer(tuned, 384), DraftModelProposer(other, 384), NGramProposer()):
            res = dec.generate(PROMPT, proposer, k=k, max_new_tokens=40)
            assert res.tokens[:40] == want, (k, proposer)


@pytest.fixture
def fresh_plans(monkeypatch, tmp_path):
    """An empty plan cache and no decisions yet in this process."""
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cpulayout, "_DECISIONS", {})
    monkeypatch.setattr(cpulayout, "_ORIGIN", {})
    return tmp_path


def test_a_plan_measured_on_a_quiet_cpu_is_kept_for_the_next_process(fresh_plans, monkeypatch):
    monkeypatch.setattr(cpulayout, "others_share", lambda fn: (fn(), 0.02))
    plan = measure_shape(48, 40, torch.float32)
    kept = json.loads(cpulayout.plans_file().read_text())
    assert kept["machine"] == cpulayout.machine()
    entry = kept["plans"]["48x40/float32"]
    assert entry["layout"] == plan.layout and set(entry["median_us"]) == {str(r) for r in ROWS}
    # a new process: nothing decided yet, and measuring again would fail
    monkeypatch.setattr(cpulayout, "_DECISIONS", {})

    def no_measuring(*a):
        raise AssertionError("measured again")

    monkeypatch.setattr(cpulayout, "measure_medians", no_measuring)
    model = nn.Sequential(nn.Linear(48, 40)).requires_grad_(False)
    summary = tune_linears(model)
    assert cpulayout._DECISIONS[(48, 40, torch.float32)] == plan
    assert summary["plans"]["kept"] == 1 and summary["plans"]["measured"] == 0
    # another machine (here: another thread count) does not read these plans
    monkeypatch.setattr(cpulayout, "_DECISIONS", {})
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        with pytest.raises(AssertionError, match="measured again"):
            measure_shape(48, 40, torch.float32)
    finally:
        torch.set_num_threads(threads)


def test_a_plan_measured_on_a_busy_cpu_is_used_but_not_kept(fresh_plans, monkeypatch):
    monkeypatch.setattr(cpulayout, "others_share", lambda fn: (fn(), 0.6))
    summary = tune_linears(nn.Sequential(nn.Linear(48, 40)).requires_grad_(False))
    assert not cpulayout.plans_file().exists()
    assert summary["plans"]["busy"] == {"48x40/float32": 0.6} and summary["plans"]["measured"] == 0
    assert "1 measured on a busy CPU (others used up to 60%; not kept)" in cpulayout.describe(
        {**summary, "tuned": 1}
    )


def test_retune_measures_again_and_a_bad_file_is_measured_over(fresh_plans, monkeypatch):
    monkeypatch.setattr(cpulayout, "others_share", lambda fn: (fn(), 0.0))
    calls = []
    real = cpulayout.measure_medians
    monkeypatch.setattr(cpulayout, "measure_medians", lambda *a: calls.append(a) or real(*a))
    measure_shape(48, 40, torch.float32)
    path = cpulayout.plans_file()
    kept = json.loads(path.read_text())
    kept["plans"]["48x40/float32"]["kernel_of"] = {"4": "no-such-kernel"}
    path.write_text(json.dumps(kept))
    monkeypatch.setattr(cpulayout, "_DECISIONS", {})
    measure_shape(48, 40, torch.float32)  # an entry this process cannot run: measured again and replaced
    assert len(calls) == 2
    assert json.loads(path.read_text())["plans"]["48x40/float32"]["kernel_of"] != {"4": "no-such-kernel"}
    path.write_text("{not json")
    monkeypatch.setattr(cpulayout, "_DECISIONS", {})
    measure_shape(48, 40, torch.float32)
    assert len(calls) == 3 and "48x40/float32" in json.loads(path.read_text())["plans"]
    monkeypatch.setattr(cpulayout, "_DECISIONS", {})
    monkeypatch.setenv("DRAFTSMITH_CPU_LAYOUT", "retune")
    measure_shape(48, 40, torch.float32)
    assert len(calls) == 4
    monkeypatch.setattr(cpulayout, "_DECISIONS", {})
    summary = tune_linears(nn.Sequential(nn.Linear(48, 40)).requires_grad_(False))  # retune still tunes
    assert len(calls) == 5 and summary["plans"]["measured"] == 1


def test_others_share_sees_a_process_that_spins_beside_it():
    if cpulayout._cpu_seconds() is None:
        pytest.skip("no /proc/stat here")
    spin = subprocess.Popen(
        [sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 3: pass"]
    )
    try:
        time.sleep(0.5)
        _, share = cpulayout.others_share(lambda: time.sleep(1.5))
    finally:
        spin.wait()
    # one spinning process holds one CPU: at least a third of a 2-CPU machine's, allowing for the scheduler
    assert share is not None and share >= 0.8 / len(os.sched_getaffinity(0)) - 0.1


@pytest.mark.parametrize("layout", ["row", "col", "plain"])
@pytest.mark.parametrize("batch", [1, 3])
def test_a_strided_slice_is_one_2d_product_that_never_copies_the_weight(monkeypatch, layout, batch):
    """transformers' logits_to_keep hands the lm_head hidden[:, -1:] of a multi-token forward: a strided 3-D
    slice that torch's matmul cannot fold into one GEMM, so it runs aten.bmm against the expanded weight, which a
    CPU copies whole per call (0.45 s for a 0.5B draft's head in bf16). A tuned Linear runs the rows as one 2-D
    product, in either layout, and so does one whose plan keeps nn.Linear's own layout and kernel ("plain")."""
    monkeypatch.setattr(cpulayout, "_DECISIONS", {})
    # a copy for 12 rows (the Linear is tuned), or nothing to change
    plan = Plan("row") if layout == "plain" else Plan(layout, {12: "col" if layout == "row" else "row"})
    monkeypatch.setattr(cpulayout, "measure_shape", lambda i, o, dtype: plan)
    base = nn.Linear(32, 512, bias=False).to(torch.bfloat16).requires_grad_(False)  # lm_heads have no bias
    lin = copy.deepcopy(base)
    summary = tune_linears(nn.Sequential(lin))
    assert isinstance(lin, TunedLinear)
    assert (summary["tuned"], summary["plain"]) == ((0, 1) if layout == "plain" else (1, 0))
    assert lin.weight.is_contiguous() == (layout != "col")
    x = torch.randn(batch, 7, 32, dtype=torch.bfloat16)[:, -1:]
    assert base(x).shape == lin(x).shape == (batch, 1, 512)
    assert not [c for c in aten_calls(lambda: lin(x)) if "bmm" in c[0]]
    torch.testing.assert_close(lin(x), base(x.clone()), rtol=1e-2, atol=1e-2)


def test_transformers_generate_on_a_frozen_model_never_runs_the_head_as_a_batched_gemm(monkeypatch):
    """A frozen weight changes torch's matmul: a trainable weight folds hidden[:, -1:] into one GEMM, a frozen one
    (every model draftsmith loads for decoding) runs aten.bmm against the expanded weight. So transformers' own
    `generate` on such a model, plain or with `assistant_model` (the peers draftsmith benches against), would copy
    the head whenever logits_to_keep slices a multi-token forward: the prefill, and an assistant's forward after a
    full accept. Every frozen Linear is tuned, even where its plan is nn.Linear's own, so none of them does."""
    monkeypatch.setattr(cpulayout, "_DECISIONS", {})
    monkeypatch.setattr(cpulayout, "measure_shape", lambda i, o, dtype: Plan("row"))
    target = tiny_llama(seed=1).requires_grad_(False)
    assistant = copy.deepcopy(target)  # accepts everything: each round starts by feeding it several tokens
    for model in (target, assistant):
        assert tune_linears(model)["plain"] == sum(isinstance(m, nn.Linear) for m in model.modules())
    vocab = target.config.vocab_size
    for kwargs in ({}, {"assistant_model": assistant}):
        calls = aten_calls(
            lambda kw=kwargs: target.generate(PROMPT, max_new_tokens=12, do_sample=False, **kw)
        )
        assert [c for c in calls if c[1] and c[1][-1] == vocab and "mm" in c[0]]  # the head ran
        assert not [c for c in calls if "bmm" in c[0] and c[1][-1] == vocab], kwargs
