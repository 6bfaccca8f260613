import json

import pytest
import torch

from draftsmith.config import load_config
from draftsmith.distill.recipe import DistillConfig, run_distill
from draftsmith.errors import DraftsmithError
from draftsmith.trainer import list_checkpoints, make_accelerator


@pytest.fixture(scope="module")
def gen_dir(tmp_path_factory, tiny_dirs):
    from draftsmith.selfdistill import generate_dataset

    root = tmp_path_factory.mktemp("distill")
    f = root / "prompts.jsonl"
    f.write_text("\n".join(json.dumps({"prompt": f"Tell me about the number {i}."}) for i in range(12)))
    return str(generate_dataset(tiny_dirs["target"], str(f), root / "gen", max_new_tokens=8, progress=False))


def _cfg(tiny_dirs, gen_dir, out, *extra):
    base = [
        f"model.target={tiny_dirs['target']}",
        "model.init=shrink",
        "model.num_layers=1",
        f"data.source={gen_dir}",
        "data.eval_size=3",
        "data.max_length=64",
        "train.max_steps=2",
        "train.batch_size=3",
        "train.lr=1e-3",
        "train.save_every=1",
        "train.log_every=1",
        f"output_dir={out}",
    ]
    return load_config(DistillConfig, None, base + list(extra))


def _events(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_distill_reduced_vocab_writes_hf_draft_and_resumes(
    tiny_dirs, gen_dir, tmp_path, tiny_target, tiny_tokenizer
):
    from transformers import AutoModelForCausalLM

    from draftsmith.vocab import load_draft_vocab

    out = tmp_path / "run"
    cfg = _cfg(tiny_dirs, gen_dir, out, "model.vocab_size=96", "loss.kind=fkl")
    res = run_distill(cfg, make_accelerator(cfg.train, cpu=True), progress=False)
    assert res["step"] == 2
    final = out / "final"
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "draft_vocab.safetensors",
        "draftsmith_draft.json",
    ):
        assert (final / name).is_file(), name
    vocab_ids = load_draft_vocab(final)
    assert vocab_ids.numel() == 96 and 2 in vocab_ids.tolist()  # eos always kept
    record = json.loads((final / "draftsmith_draft.json").read_text())
    assert record["init"]["layers"] == [0] and record["recipe"]["model"]["vocab_size"] == 96
    draft = AutoModelForCausalLM.from_pretrained(final)
    assert draft.config.num_hidden_layers == 1 and draft.config.vocab_size == tiny_target.config.vocab_size
    evals = [e for e in _events(out) if e["event"] == "eval"]
    assert [e["step"] for e in evals] == [0, 2]
    for e in evals:
        held = e["heldout"]
        assert "train_sample" not in e  # eval.train_sample is off by default
        assert (
            0 <= held["alpha"] <= 1
            and 0 <= held["top1"] <= 1
            and set(held["tau"]) == {str(k) for k in range(1, 9)}
        )
        # the eval knows sequence boundaries: tokens over expected rounds, with the i.i.d. formula alongside
        assert held["tau_estimate"] == "rounds" and 1.0 <= held["tau_greedy"]["4"] <= 5.0
        assert held["tau_greedy_iid"]["4"] == pytest.approx(sum(held["top1"] ** i for i in range(5)))
    # transformers assisted generation with the draft reproduces the target's greedy output
    from draftsmith.prompts import Prompt, prompt_ids

    ids = torch.tensor(
        [prompt_ids(tiny_tokenizer, Prompt([{"role": "user", "content": "Tell me about 3."}]))]
    )
    plain = tiny_target.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=2)
    assisted = tiny_target.generate(
        ids, max_new_tokens=12, do_sample=False, pad_token_id=2, assistant_model=draft.eval()
    )
    assert torch.equal(plain, assisted)
    # resume with a longer budget: the step count continues from the newest checkpoint
    cfg4 = _cfg(tiny_dirs, gen_dir, out, "model.vocab_size=96", "loss.kind=fkl", "train.max_steps=4")
    res = run_distill(cfg4, make_accelerator(cfg4.train, cpu=True), resume=True, progress=False)
    assert res["step"] == 4
    assert [e["step"] for e in _events(out) if e["event"] == "train"] == [1, 2, 3, 4]
    assert [p.name for p in list_checkpoints(out)] == ["step-0000003", "step-0000004"]
    # the same output dir with another recipe is refused
    other = _cfg(tiny_dirs, gen_dir, out, "loss.kind=tvd")
    with pytest.raises(DraftsmithError, match="another run"):
        run_distill(other, make_accelerator(other.train, cpu=True), progress=False)


@pytest.mark.parametrize("policy,loss", [("on_policy", "jsd"), ("mixture", "lk")])
def test_on_policy_and_mixture_train(tiny_dirs, gen_dir, tmp_path, policy, loss):
    cfg = _cfg(
        tiny_dirs,
        gen_dir,
        tmp_path / policy,
        f"data.policy={policy}",
        f"loss.kind={loss}",
        "data.on_policy_max_new_tokens=4",
        "data.on_policy_fraction=0.5",
        "model.vocab_size=80",
        "train.save_every=0",
    )
    res = run_distill(cfg, make_accelerator(cfg.train, cpu=True), progress=False)
    train_ev = [e for e in _events(tmp_path / policy) if e["event"] == "train"]
    assert res["step"] == 2 and all(torch.isfinite(torch.tensor(e["loss"])) for e in train_ev)
    if policy == "on_policy":
        assert all(e["on_policy"] == 1.0 for e in train_ev)


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_existing_lora_draft_is_checked_and_merged(tiny_dirs, gen_dir, tmp_path, precision):
    from transformers import AutoModelForCausalLM

    cfg = _cfg(
        tiny_dirs,
        gen_dir,
        tmp_path / "lora",
        "model.init=existing",
        f"model.draft={tiny_dirs['draft']}",
        "model.lora.enabled=true",
        "model.lora.r=4",
        "train.save_every=0",
        f"train.mixed_precision={precision}",
    )
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # one mixed precision per process otherwise
    try:
        run_distill(cfg, make_accelerator(cfg.train, cpu=True), progress=False)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "lora" / "final", dtype="auto")
    assert not any("lora" in k for k in merged.state_dict())
    base = AutoModelForCausalLM.from_pretrained(tiny_dirs["draft"])
    diff = [
        not torch.equal(a, b)
        for (_, a), (_, b) in zip(sorted(merged.state_dict().items()), sorted(base.state_dict().items()))
    ]
    assert any(diff)  # the adapters were trained and merged in
    # the frozen base trained in bf16 under bf16 autocast (cast_frozen) and was upcast before the merge: saved fp32,
    # holding exactly the bf16 weights the run used; without autocast it stays the fp32 base
    emb, base_emb = merged.model.embed_tokens.weight, base.model.embed_tokens.weight
    assert emb.dtype == torch.float32 and not torch.equal(base_emb.bfloat16().float(), base_emb)
    assert torch.equal(emb, base_emb.bfloat16().float() if precision == "bf16" else base_emb)


def test_distill_bad_inputs(tiny_dirs, gen_dir, tmp_path):
    with pytest.raises(DraftsmithError, match="valid keys"):
        _cfg(tiny_dirs, gen_dir, tmp_path / "x", "loss.kindd=fkl")
    with pytest.raises(DraftsmithError, match="is not one of"):
        _cfg(tiny_dirs, gen_dir, tmp_path / "x", "data.policy=offline")
    for extra, match in [
        (["data.source=builtin:dev-eval"], "evaluation set"),
        ([f"data.source={tmp_path / 'nope.jsonl'}"], "not found"),
        (["data.eval_size=50"], "cannot hold out"),
        (["model.init=existing"], "model.draft"),
        (["data.max_length=4"], "max_length"),
        (["push_to_hub=not a/valid//repo"], "repo"),
    ]:
        cfg = _cfg(tiny_dirs, gen_dir, tmp_path / "x", *extra)
        with pytest.raises(DraftsmithError, match=match):
            run_distill(cfg, make_accelerator(cfg.train, cpu=True), progress=False)
    assert not (tmp_path / "x" / "checkpoints").exists()


# --- data policies ---------------------------------------------------------------------------------------------


def test_collate_masks_response_tokens_only():
    from draftsmith.examples import collate

    b = collate([([5, 6, 7], [8, 9]), ([5], [8, 9, 10, 11])], pad_id=0, max_length=5)
    assert b["input_ids"].tolist() == [[5, 6, 7, 8, 9], [5, 8, 9, 10, 11]]
    assert b["loss_mask"].tolist() == [[False, False, False, True, True], [False, True, True, True, True]]
    b = collate([([5, 6], [7]), ([5, 6, 7], [8, 9, 10])], pad_id=0, max_length=4)  # cut at max_length, padded
    assert b["input_ids"].tolist() == [[5, 6, 7, 0], [5, 6, 7, 8]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert b["loss_mask"].tolist() == [[False, False, True, False], [False, False, False, True]]


def test_policies_deal_deterministic_batches_and_mixture_fraction():
    from draftsmith.distill.policies import DataPolicy
    from draftsmith.examples import Example, split_heldout

    exs = [Example([1, 2], [3, 4], str(i)) for i in range(40)]
    train, held = split_heldout(exs, 5, seed=0)
    assert len(held) == 5 and not {e.id for e in train} & {e.id for e in held}
    pol = DataPolicy("target", train, batch_size=4, pad_id=0, eos_ids=[2])
    e0, e0b, e1 = pol(0), pol(0), pol(1)
    assert [[x.id for x in b.examples] for b in e0] == [[x.id for x in b.examples] for b in e0b]  # resumable
    assert [[x.id for x in b.examples] for b in e0] != [[x.id for x in b.examples] for b in e1]  # reshuffled
    assert sorted(x.id for b in e0 for x in b.examples) == sorted(e.id for e in train) and not any(
        b.on_policy for b in e0
    )
    mix = DataPolicy("mixture", exs * 10, batch_size=2, pad_id=0, eos_ids=[2], on_policy_fraction=0.3)
    frac = sum(b.on_policy for b in mix(0)) / len(mix(0))
    assert 0.2 < frac < 0.4
    assert all(b.on_policy for b in DataPolicy("on_policy", exs, 4, 0, [2])(0))
    with pytest.raises(DraftsmithError, match="empty"):
        DataPolicy("target", [], 4, 0, [2])
    with pytest.raises(DraftsmithError, match="needs responses"):
        DataPolicy("fixed", [Example([1, 2], [])], 4, 0, [2])


def test_fixed_policy_reads_prompt_response_files(tmp_path, tiny_tokenizer):
    from draftsmith.examples import examples_from_file

    f = tmp_path / "sft.jsonl"
    f.write_text(
        json.dumps(
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
        )
        + "\n"
        + json.dumps({"prompt": "2+2?", "response": "4"})
    )
    with f.open("a") as fh:
        fh.write("\n" + json.dumps({"prompt": "no answer"}))
    with pytest.raises(
        DraftsmithError, match="record 3 has no response"
    ):  # refused, not dropped without a word
        examples_from_file(f, tiny_tokenizer)
    f.write_text("\n".join(f.read_text().splitlines()[:2]))
    exs = examples_from_file(f, tiny_tokenizer)
    assert len(exs) == 2
    assert tiny_tokenizer.decode(exs[0].response_ids) == "hello<|im_end|>"
    assert tiny_tokenizer.decode(exs[0].prompt_ids).endswith("<|im_start|>assistant\n")


def test_on_policy_samples_stay_in_the_draft_vocab(tiny_draft):
    from draftsmith.distill.policies import sample_responses

    vocab_ids = torch.tensor(sorted({2, *range(100, 140)}))
    torch.manual_seed(0)
    out = sample_responses(
        tiny_draft,
        [[1, 50, 60], [1, 70]],
        max_new_tokens=12,
        temperature=1.0,
        eos_ids=[2],
        pad_id=2,
        vocab_ids=vocab_ids,
    )
    assert len(out) == 2 and all(1 <= len(r) <= 12 for r in out)
    assert all(t in set(vocab_ids.tolist()) for r in out for t in r)
    assert all(2 not in r[:-1] for r in out)  # cut right after eos


def test_cached_target_topk_equals_online_target_when_k_is_the_vocab(tiny_dirs, gen_dir, tiny_target):
    from draftsmith.distill.policies import DataPolicy, cache_target_topk
    from draftsmith.distill.recipe import DraftLM, LossArgs, make_loss_fn
    from draftsmith.examples import examples_from_generated
    from draftsmith.testing import tiny_llama

    exs = examples_from_generated(gen_dir)[:4]
    vocab = tiny_target.config.vocab_size
    draft = DraftLM(tiny_llama(seed=3, num_hidden_layers=1), None)
    online = DataPolicy("target", [e for e in exs], 4, pad_id=2, eos_ids=[2], max_length=64)
    raw = online(0)[0]
    loss_online, _ = make_loss_fn(tiny_target, online, LossArgs(kind="fkl"))[0](draft, raw)
    cache_target_topk(tiny_target, exs, vocab, pad_id=2, max_length=64, progress=False)
    batch = online.materialize(raw)
    assert batch["target_topk_values"].shape == (int(batch["loss_mask"].sum()), vocab)
    loss_cached, _ = make_loss_fn(tiny_target, online, LossArgs(kind="fkl"))[0](draft, raw)
    torch.testing.assert_close(loss_cached, loss_online, atol=2e-3, rtol=2e-3)  # fp16 storage of the logits
    cache_target_topk(tiny_target, exs, 8, pad_id=2, max_length=64, progress=False)
    loss_top8, _ = make_loss_fn(tiny_target, online, LossArgs(kind="fkl"))[0](draft, raw)
    assert torch.isfinite(loss_top8) and not torch.allclose(loss_top8, loss_online)


@pytest.mark.parametrize("cached", [False, True])
def test_min_margin_trains_on_the_decided_tokens_only(gen_dir, tiny_target, cached):
    # oracle: the divergence over the kept rows alone, the draft's head run at those rows only
    from draftsmith.distill.policies import DataPolicy, cache_target_topk, dense_from_topk
    from draftsmith.distill.recipe import DraftLM, LossArgs, make_loss_fn, target_logits_at
    from draftsmith.divergences import divergence
    from draftsmith.examples import examples_from_generated
    from draftsmith.sampling import top_margin
    from draftsmith.testing import tiny_llama

    exs = examples_from_generated(gen_dir)[:4]
    vocab = tiny_target.config.vocab_size
    draft = DraftLM(tiny_llama(seed=3, num_hidden_layers=1), None)
    policy = DataPolicy("target", exs, 4, pad_id=2, eos_ids=[2], max_length=64)
    if cached:
        cache_target_topk(tiny_target, exs, 16, pad_id=2, max_length=64, progress=False)
    raw = policy(0)[0]
    batch = policy.materialize(raw)
    scored = torch.nn.functional.pad(batch["loss_mask"][:, 1:], (0, 1))
    if cached:
        target = dense_from_topk(batch["target_topk_values"], batch["target_topk_ids"], vocab)
        margin = top_margin(batch["target_topk_values"])
    else:
        target = target_logits_at(tiny_target, batch["input_ids"], batch["attention_mask"], scored)
        margin = top_margin(target)
    cut = float(margin.median())
    keep = margin >= cut
    assert 0 < int(keep.sum()) < keep.numel()
    draft_all = draft(batch["input_ids"], batch["attention_mask"], rows=scored)
    for kind in ("fkl", "tvd"):
        want = divergence(kind, target[keep], draft_all[keep])
        got, metrics = make_loss_fn(tiny_target, policy, LossArgs(kind=kind, min_margin=cut))[0](draft, raw)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
        assert metrics["loss_tokens"] == int(keep.sum())
    seen = []
    hook = draft.model.lm_head.register_forward_hook(lambda m, i, o: seen.append(i[0].shape[0]))
    make_loss_fn(tiny_target, policy, LossArgs(kind="fkl", min_margin=cut))[0](draft, raw)
    hook.remove()
    assert seen == [int(keep.sum())]  # the near-ties never reach the head
    with pytest.raises(DraftsmithError, match="loss.min_margin must be in"):
        LossArgs(min_margin=1.0)


def test_tied_embeddings_draft_checkpoints_and_resumes(tmp_path, gen_dir):
    # SmolLM2 ties lm_head to the embeddings: accelerate drops the shared tensor when saving state; the resumed
    # draft must still be tied and continue
    from transformers import AutoModelForCausalLM

    from draftsmith.testing import save_tiny

    target = str(save_tiny(tmp_path / "tied", seed=0, tie_word_embeddings=True))
    dirs = {"target": target}
    out = tmp_path / "run"
    cfg = _cfg(dirs, gen_dir, out, "model.vocab_size=64", "data.cache_target_topk=16")
    run_distill(cfg, make_accelerator(cfg.train, cpu=True), progress=False)
    cfg3 = _cfg(dirs, gen_dir, out, "model.vocab_size=64", "data.cache_target_topk=16", "train.max_steps=3")
    assert run_distill(cfg3, make_accelerator(cfg3.train, cpu=True), resume=True, progress=False)["step"] == 3
    draft = AutoModelForCausalLM.from_pretrained(out / "final")
    assert draft.lm_head.weight.data_ptr() == draft.model.embed_tokens.weight.data_ptr()
    trained_row = draft.model.embed_tokens.weight
    base = AutoModelForCausalLM.from_pretrained(target).model.embed_tokens.weight
    assert not torch.equal(trained_row, base)


def test_mixed_sources_hold_out_from_the_first_only(tiny_dirs, gen_dir, tmp_path, tiny_tokenizer):
    from draftsmith.distill.recipe import setup

    text = tmp_path / "text.jsonl"
    text.write_text(
        "\n".join(
            json.dumps({"question": f"What is {i} + 1?", "answer": f"It is {i + 1}."}) for i in range(7)
        )
    )
    cfg = _cfg(
        tiny_dirs, gen_dir, tmp_path / "run", f"data.source=[{gen_dir}, {text}]", "data.limit=[null, 5]"
    )
    s = setup(cfg, torch.device("cpu"), tokenizer=tiny_tokenizer)
    assert len(s.eval_examples) == 3 and all(e.category != "text" for e in s.eval_examples)
    assert len(s.policy.examples) == 12 - 3 + 5  # the second source is all training data, cut to its limit
    fixed = [e for e in s.policy.examples if e.category == "text"]  # (category = file stem)
    assert len(fixed) == 5 and tiny_tokenizer.decode(fixed[0].response_ids).startswith("It is 1.")
    # the shipped fixed text resolves without a path, and eval sets are refused in any position of the list
    from draftsmith.examples import examples_from_file

    assert len(examples_from_file("builtin:train-text", tiny_tokenizer)) > 6000
    with pytest.raises(DraftsmithError, match="evaluation set"):
        setup(
            _cfg(tiny_dirs, gen_dir, tmp_path / "r2", f"data.source=[{gen_dir}, builtin:vicuna]"),
            torch.device("cpu"),
        )
    with pytest.raises(DraftsmithError, match="one per source"):
        setup(
            _cfg(tiny_dirs, gen_dir, tmp_path / "r3", f"data.source=[{gen_dir}, {text}]", "data.limit=[1]"),
            torch.device("cpu"),
        )


def test_train_sample_is_scored_beside_heldout(tiny_dirs, gen_dir, tmp_path, tiny_tokenizer):
    """eval.train_sample: a fixed sample of what the draft trains on, scored at every eval (the generalization gap)."""
    from draftsmith.distill.recipe import setup

    def ids(exs):
        return [tuple(e.prompt_ids + e.response_ids) for e in exs]

    out = tmp_path / "run"
    cfg = _cfg(tiny_dirs, gen_dir, out, "eval.train_sample=4")
    s = setup(cfg, torch.device("cpu"), tokenizer=tiny_tokenizer)
    again = setup(cfg, torch.device("cpu"), target=s.target, tokenizer=tiny_tokenizer)
    assert len(s.train_sample) == 4 and ids(s.train_sample) == ids(again.train_sample)
    assert set(ids(s.train_sample)) <= set(ids(s.policy.examples))
    assert not set(ids(s.train_sample)) & set(ids(s.eval_examples))
    run_distill(
        cfg, make_accelerator(cfg.train, cpu=True), target=s.target, tokenizer=tiny_tokenizer, progress=False
    )
    evals = [e for e in _events(out) if e["event"] == "eval"]
    assert [e["step"] for e in evals] == [0, 2]
    n_tokens = sum(len(e.response_ids) for e in s.train_sample)
    for e in evals:
        seen = e["train_sample"]
        assert seen["n_examples"] == 4 and seen["n_tokens"] == n_tokens and 0 <= seen["top1"] <= 1
        assert e["heldout"]["n_examples"] == 3
    # an eval setting: a resumed run may change it (a run.yaml written before the key existed resumes too)
    more = _cfg(tiny_dirs, gen_dir, out, "eval.train_sample=2", "train.max_steps=3")
    run_distill(more, make_accelerator(more.train, cpu=True), target=s.target, resume=True, progress=False)
    assert _events(out)[-1]["train_sample"]["n_examples"] == 2
    assert (
        setup(_cfg(tiny_dirs, gen_dir, out), torch.device("cpu"), target=s.target).train_sample == []
    )  # off
    with pytest.raises(DraftsmithError, match="eval.train_sample=10 exceeds the 9 training examples"):
        setup(_cfg(tiny_dirs, gen_dir, tmp_path / "big", "eval.train_sample=10"), torch.device("cpu"))
    with pytest.raises(DraftsmithError, match="eval.train_sample must be >= 0"):
        _cfg(tiny_dirs, gen_dir, tmp_path / "neg", "eval.train_sample=-1")


def test_topk_scattered_into_draft_vocab_equals_restricting_the_full_logits():
    from draftsmith.distill.policies import dense_from_topk
    from draftsmith.divergences import divergence

    g = torch.Generator().manual_seed(0)
    vocab, n, k = 50, 6, 8
    full = torch.randn(n, vocab, generator=g) * 3
    values, ids = full.topk(k, dim=-1)
    vocab_ids = torch.tensor(
        sorted(set(ids[:, :3].flatten().tolist()) | {0, 7, 11})
    )  # some top-k ids fall outside
    t2d = torch.full((vocab,), -1, dtype=torch.long)
    t2d[vocab_ids] = torch.arange(vocab_ids.numel())
    dense_full = dense_from_topk(values.half(), ids.int(), vocab)
    dense_draft = dense_from_topk(values.half(), ids.int(), vocab_ids.numel(), t2d)
    torch.testing.assert_close(dense_draft, dense_full[:, vocab_ids])
    draft = torch.randn(n, vocab_ids.numel(), generator=g, requires_grad=True)
    for kind in ("fkl", "rkl", "jsd"):
        a = divergence(kind, dense_full, draft, vocab_ids=vocab_ids)
        b = divergence(kind, dense_draft, draft)
        torch.testing.assert_close(a, b)


def test_loss_warmup_switches_divergence_at_its_step(gen_dir, tiny_target):
    from draftsmith.distill.policies import DataPolicy
    from draftsmith.distill.recipe import DraftLM, LossArgs, make_loss_fn
    from draftsmith.examples import examples_from_generated
    from draftsmith.testing import tiny_llama

    exs = examples_from_generated(gen_dir)[:4]
    draft = DraftLM(tiny_llama(seed=3, num_hidden_layers=1), None)
    policy = DataPolicy("target", exs, 4, pad_id=2, eos_ids=[2], max_length=64)
    raw = policy(0)[0]
    plain = {
        kind: make_loss_fn(tiny_target, policy, LossArgs(kind=kind))[0](draft, raw)[0]
        for kind in ("fkl", "tvd")
    }
    assert not torch.allclose(plain["fkl"], plain["tvd"])
    loss_fn, before_step = make_loss_fn(
        tiny_target, policy, LossArgs(kind="tvd", warmup_kind="fkl", warmup_steps=2)
    )
    for step, kind in (
        (0, "fkl"),
        (1, "fkl"),
        (2, "tvd"),
        (7, "tvd"),
        (1, "fkl"),
    ):  # a resume may restart at 1
        before_step(step)
        torch.testing.assert_close(loss_fn(draft, raw)[0], plain[kind])


def test_existing_draft_pruned_to_a_layer_subset(tiny_dirs, gen_dir, tmp_path):
    # init=existing with model.layers: a layer-pruned small model (its embeddings, norm and head kept)
    from transformers import AutoModelForCausalLM

    from draftsmith.testing import save_tiny

    two = str(save_tiny(tmp_path / "two-layer-draft", seed=5, num_hidden_layers=2))
    cfg = _cfg(
        tiny_dirs,
        gen_dir,
        tmp_path / "pruned",
        "model.init=existing",
        f"model.draft={two}",
        "model.layers=[1]",
    )
    run_distill(cfg, make_accelerator(cfg.train, cpu=True), progress=False)
    pruned = AutoModelForCausalLM.from_pretrained(tmp_path / "pruned" / "final")
    assert pruned.config.num_hidden_layers == 1
    record = json.loads((tmp_path / "pruned" / "final" / "draftsmith_draft.json").read_text())
    assert record["init"]["layers"] == [1] and record["init"]["init"] == "existing"
    with pytest.raises(DraftsmithError, match="must be distinct indices in"):
        bad = _cfg(
            tiny_dirs,
            gen_dir,
            tmp_path / "bad",
            "model.init=existing",
            f"model.draft={two}",
            "model.layers=[2]",
        )
        run_distill(bad, make_accelerator(bad.train, cpu=True), progress=False)
    assert not (tmp_path / "bad").exists()


def test_target_topk_file_is_scored_once_and_shared(tiny_dirs, gen_dir, tmp_path, monkeypatch):
    from draftsmith.distill import policies

    topk = tmp_path / "scores" / "topk.safetensors"
    common = ("data.cache_target_topk=16", f"data.target_topk_file={topk}", "train.save_every=0")
    first = _cfg(tiny_dirs, gen_dir, tmp_path / "a", *common)
    res_a = run_distill(first, make_accelerator(first.train, cpu=True), progress=False)
    assert topk.is_file()

    def no_scoring(*args, **kwargs):
        raise AssertionError("the second run must read the scores, not recompute them")

    monkeypatch.setattr(policies, "_score_topk", no_scoring)
    second = _cfg(tiny_dirs, gen_dir, tmp_path / "b", *common)
    res_b = run_distill(second, make_accelerator(second.train, cpu=True), progress=False)
    assert res_b["train"]["loss"] == pytest.approx(res_a["train"]["loss"], rel=1e-5)  # same scores, same run
    other = _cfg(tiny_dirs, gen_dir, tmp_path / "c", *common, "data.max_length=32")  # other data: refused
    with pytest.raises(DraftsmithError, match="holds scores of other data"):
        run_distill(other, make_accelerator(other.train, cpu=True), progress=False)
    with pytest.raises(DraftsmithError, match="needs data.cache_target_topk > 0"):
        _cfg(tiny_dirs, gen_dir, tmp_path / "d", f"data.target_topk_file={topk}")
