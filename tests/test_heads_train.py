"""Head training: recipes load, in-process runs on tiny models write their files and resume, hidden-state caches."""

import json
from pathlib import Path

import pytest
import torch

from draftsmith.config import load_config
from draftsmith.errors import DraftsmithError
from draftsmith.heads import EagleHead, MedusaHeads
from draftsmith.heads.recipe import HeadsConfig, run_heads
from draftsmith.testing import recipe_header
from draftsmith.trainer import make_accelerator

RECIPE_DIR = Path(__file__).resolve().parents[1] / "recipes"
# recipes/ holds the showcase set (one data set and cache per target); recipes/data-engine/ the long data-scaling runs
RECIPES = sorted(RECIPE_DIR.glob("heads-*.yaml")) + sorted(RECIPE_DIR.glob("data-engine/heads-*.yaml"))


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_heads_recipe_loads(path):
    cfg = load_config(HeadsConfig, path)
    from draftsmith.heads.kinds import trained_kinds

    assert cfg.head.kind in trained_kinds()
    header = recipe_header(path)
    name = path.relative_to(RECIPE_DIR).as_posix()
    assert any("train/heads.py --config recipes/" + name in line for line in header), header
    assert all(1 <= s <= cfg.train.max_steps for s in cfg.train.snapshot_steps)


def test_unknown_recipe_key_is_an_error():
    with pytest.raises(DraftsmithError, match="valid"):
        load_config(HeadsConfig, None, ["head.widht=3"])


@pytest.fixture(scope="module")
def generated(tmp_path_factory, tiny_dirs):
    from draftsmith.prompts import Prompt
    from draftsmith.selfdistill import generate_dataset

    out = tmp_path_factory.mktemp("gen") / "data"
    prompts = [
        Prompt(
            messages=[{"role": "user", "content": f"Tell me about number {i} and the sea."}],
            category="chat",
            id=str(i),
        )
        for i in range(10)
    ]
    generate_dataset(tiny_dirs["target"], prompts, out, max_new_tokens=20, batch_size=10, progress=False)
    return str(out)


def _cfg(tiny_dirs, generated, out, kind, *extra):
    return load_config(
        HeadsConfig,
        None,
        [
            f"model.target={tiny_dirs['target']}",
            f"data.source={generated}",
            "data.eval_size=1",
            f"head.kind={kind}",
            "head.draft_vocab_size=128",
            "head.aux_layers=0,1,2",
            "head.num_heads=2",
            "train.batch_size=4",
            "loss.ttt_steps=2",
            "eval.depth=2",
            "data.max_length=160",
            "train.save_every=1",
            "train.log_every=1",
            f"output_dir={out}",
            *extra,
        ],
    )


@pytest.mark.parametrize("kind", ["medusa", "eagle3"])
def test_two_steps_write_files_and_resume(tiny_dirs, generated, tmp_path, kind):
    out = tmp_path / kind
    cfg = _cfg(tiny_dirs, generated, out, kind, "train.max_steps=2", "data.hidden_states=hybrid")
    s = run_heads(cfg, make_accelerator(cfg.train), progress=False)
    assert s["step"] == 2
    final = out / "final"
    assert {"config.json", "model.safetensors", "head_accuracy.json"} <= {p.name for p in final.iterdir()}
    acc = json.loads((final / "head_accuracy.json").read_text())
    assert (
        ("rank_accuracy" in acc)
        if kind == "medusa"
        else ("acceptance_per_depth" in acc and acc["tau_sim"] >= 1)
    )
    assert (out / "run.yaml").is_file() and (out / "checkpoints" / "step-0000002").is_dir()
    evals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any(
        e["event"] == "eval" and e["step"] == 0 for e in evals
    )  # the initialisation's numbers are logged
    cfg2 = _cfg(tiny_dirs, generated, out, kind, "train.max_steps=3", "data.hidden_states=hybrid")
    s2 = run_heads(cfg2, make_accelerator(cfg2.train), resume=True, progress=False)
    assert s2["step"] == 3
    steps = [
        json.loads(line)["step"]
        for line in (out / "metrics.jsonl").read_text().splitlines()
        if json.loads(line)["event"] == "train"
    ]
    assert steps == [1, 2, 3]
    # the trained head loads in the decoder registry for its target
    from draftsmith.app.drafters import build_proposer
    from draftsmith.decode.drafters import DrafterContext
    from draftsmith.models import load_model

    target = load_model(tiny_dirs["target"], device="cpu")
    prop = build_proposer(
        f"{'medusa' if kind == 'medusa' else 'eagle'}:{final}",
        DrafterContext(target, None, torch.device("cpu")),
    )
    assert prop.hidden_state_layers


def test_offline_cache_equals_online_and_reports_bytes(tiny_dirs, generated, tmp_path):
    from draftsmith.heads.data import collate, load_examples
    from draftsmith.heads.hidden import (
        CacheSpec,
        HiddenStateCache,
        HiddenStates,
        build_cache,
        bytes_per_token,
    )
    from draftsmith.models import load_model

    target = load_model(tiny_dirs["target"], device="cpu")
    ex = load_examples(generated, max_length=160)[:5]
    cache = HiddenStateCache(
        tmp_path / "c", CacheSpec("eagle3", [0, 1, 2], 64, "float32"), target, shard_size=2
    )
    written = build_cache(target, ex, cache, batch_size=3, progress=False)
    n_tok = sum(len(e["input_ids"]) for e in ex)
    assert written >= n_tok * bytes_per_token(3, 64, torch.float32)  # tensors + small headers
    assert written < n_tok * bytes_per_token(3, 64, torch.float32) * 1.2 + 4096
    reread = HiddenStateCache(tmp_path / "c", CacheSpec("eagle3", [0, 1, 2], 64, "float32"), target)
    batch = collate(ex[:3])
    off = HiddenStates("offline", target, [0, 1, 2], reread)(batch)
    on = HiddenStates("online", target, [0, 1, 2])(batch)
    valid = batch["attention_mask"].bool()
    for key in ("aux", "last"):
        torch.testing.assert_close(off[key][valid], on[key][valid], rtol=1e-5, atol=1e-5)
    with pytest.raises(DraftsmithError, match=r"written for hidden_states layers \[0, 1, 2\].*\[3\] missing"):
        HiddenStateCache(tmp_path / "c", CacheSpec("eagle3", [0, 1, 3], 64, "float32"), target)
    # a run reading a subset of the layers, in its own order, gets exactly its layers
    for need in ([2, 0], [1], []):
        sub = HiddenStates(
            "offline",
            target,
            need,
            HiddenStateCache(tmp_path / "c", CacheSpec("x", need, 64, "float32"), target),
        )(batch)
        ref = HiddenStates("online", target, need)(batch)
        assert sorted(sub) == sorted(ref) == (["aux", "last"] if need else ["last"])
        for key in sub:
            torch.testing.assert_close(sub[key][valid], ref[key][valid], rtol=1e-5, atol=1e-5)
    # Medusa / EAGLE-1 reuse an EAGLE-3 cache (it holds the final state too)
    as_medusa = HiddenStateCache(tmp_path / "c", CacheSpec("medusa", [], 64, "float32"), target)
    assert as_medusa.spec.kind == "eagle3"
    torch.testing.assert_close(as_medusa.get(ex[0]["index"])["last"], reread.get(ex[0]["index"])["last"])


def test_hybrid_runs_the_target_once_per_example(tiny_dirs, generated, tmp_path, monkeypatch):
    import draftsmith.heads.hidden as hidden_mod
    from draftsmith.heads.data import collate, load_examples
    from draftsmith.heads.hidden import CacheSpec, HiddenStateCache, HiddenStates
    from draftsmith.models import load_model

    target = load_model(tiny_dirs["target"], device="cpu")
    ex = load_examples(generated, max_length=160)[:4]
    calls = []
    real = hidden_mod.target_features
    monkeypatch.setattr(hidden_mod, "target_features", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    cache = HiddenStateCache(tmp_path / "c", CacheSpec("medusa", [], 64, "float32"), target, shard_size=100)
    src = HiddenStates("hybrid", target, [], cache)
    first = src(collate(ex[:2]))
    again = src(collate(ex[:2]))  # epoch 2: read back (from the unflushed buffer), no target forward
    assert len(calls) == 1
    valid = collate(ex[:2])["attention_mask"].bool()
    torch.testing.assert_close(first["last"][valid], again["last"][valid])
    src(collate(ex[2:]))
    cache.flush()
    assert len(calls) == 2 and len(HiddenStateCache(tmp_path / "c", cache.spec, target).index) == 4


def test_mixed_sources_hold_out_from_the_first_and_refuse_eval_sets(generated, tmp_path):
    """data.source may list generate folders and fixed prompt+response files; held-out rows come from the
    first source only, indices stay unique, eval sets are refused, and a cache built for other data is refused."""
    from draftsmith.heads.data import data_fingerprint, load_examples, split_examples
    from draftsmith.heads.hidden import CacheSpec, HiddenStateCache
    from draftsmith.testing import tiny_tokenizer

    tok = tiny_tokenizer()
    text = tmp_path / "fixed.jsonl"
    text.write_text(
        "\n".join(
            json.dumps({"prompt": f"Count to {i}.", "response": " ".join(str(j) for j in range(i + 3))})
            for i in range(6)
        )
        + "\n"
    )
    with pytest.raises(DraftsmithError, match="tokenizer"):
        load_examples([generated, str(text)], max_length=160)
    ex = load_examples([generated, str(text)], max_length=160, tokenizer=tok)
    gen_only = load_examples(generated, max_length=160)
    assert len(ex) == len(gen_only) + 6
    assert len({e["index"] for e in ex}) == len(ex)
    assert [e["input_ids"] for e in ex[: len(gen_only)]] == [e["input_ids"] for e in gen_only]
    fixed = ex[len(gen_only) :]
    assert fixed[0]["input_ids"][-1] == tok.eos_token_id and fixed[0]["source"] == str(text)
    assert sum(fixed[0]["response_mask"]) == len(tok(" ".join(str(j) for j in range(3)))["input_ids"]) + 1
    tr, ev = split_examples(ex, 3, seed=0)
    assert len(ev) == 3 and all(e["source"] == generated for e in ev)
    assert {e["index"] for e in tr} | {e["index"] for e in ev} == {e["index"] for e in ex}
    assert not {e["index"] for e in tr} & {e["index"] for e in ev}
    assert sum(e["source"] == str(text) for e in tr) == 6  # the second source is all trained on
    # a single source splits exactly as before (the existing caches and runs stay valid)
    tr1, ev1 = split_examples(gen_only, 3, seed=0)
    assert [e["index"] for e in ev1] == [e["index"] for e in ev if e["source"] == generated]
    limited = load_examples([generated, str(text)], max_length=160, tokenizer=tok, limit=2)
    assert len(limited) == 4
    with pytest.raises(DraftsmithError, match="evaluation set"):
        load_examples([generated, "builtin:dev-eval"], max_length=160, tokenizer=tok)
    # the cache is keyed by example index: one built for other data is refused
    HiddenStateCache(tmp_path / "c", CacheSpec("medusa", [], 64, "float32", data_fingerprint(ex)))
    assert data_fingerprint(ex) != data_fingerprint(limited)
    with pytest.raises(DraftsmithError, match="data_fingerprint"):
        HiddenStateCache(tmp_path / "c", CacheSpec("medusa", [], 64, "float32", data_fingerprint(limited)))


def test_mixed_sources_train_in_process(tiny_dirs, generated, tmp_path):
    text = tmp_path / "fixed.jsonl"
    text.write_text(
        "\n".join(
            json.dumps({"prompt": f"Say {i}.", "response": f"{i} {i} {i} and the sea."}) for i in range(8)
        )
        + "\n"
    )
    out = tmp_path / "mix"
    cfg = _cfg(
        tiny_dirs,
        generated,
        out,
        "eagle3",
        "train.max_steps=2",
        "data.hidden_states=hybrid",
        f"data.source=[{generated}, {text}]",
    )
    assert cfg.data.source == [generated, str(text)]
    s = run_heads(cfg, make_accelerator(cfg.train), progress=False)
    assert s["step"] == 2 and s["cache_bytes"] > 0
    meta = json.loads((out / "hidden_cache" / "meta.json").read_text())
    assert meta["dtype"] == "float16" and meta["data_fingerprint"]  # fp32 tiny target: fp16 cache (auto)


@pytest.mark.parametrize("kind", ["medusa", "eagle3"])
def test_held_out_eval_with_a_bf16_target_and_fp32_heads(tiny_dirs, generated, kind):
    """The eval runs outside autocast: fp32 master-weight heads must read a bf16 target's states (AMX CPUs, GPUs)."""
    from draftsmith.heads.data import collate, load_examples
    from draftsmith.heads.hidden import HiddenStates
    from draftsmith.heads.recipe import EvalSection, LossSection
    from draftsmith.heads.training import HeadTrainer, evaluate_heads
    from draftsmith.models import load_model

    target = load_model(tiny_dirs["target"], device="cpu", dtype="bf16")
    if kind == "medusa":
        head = MedusaHeads.from_target(target, 2, 1).float()
        aux = []
    else:
        head = EagleHead.from_target(target, "eagle3", aux_layers=[0, 1, 2]).float()
        aux = [0, 1, 2]
    hidden = HiddenStates("online", target, aux)
    batch = collate(load_examples(generated, max_length=160)[:3])
    res = evaluate_heads(
        HeadTrainer(head, target, hidden, LossSection(ttt_steps=2)),
        [batch],
        hidden,
        EvalSection(depth=2, tree_tokens=4),
    )
    assert ("rank_accuracy" if kind == "medusa" else "acceptance_per_depth") in res


def test_every_trained_kind_has_a_complete_record():
    """One record per kind holds everything the recipe, the folders and the decoder need (draftsmith.kinds)."""
    from draftsmith.heads.kinds import HEAD_KINDS, folder_kinds

    for name, rec in HEAD_KINDS.items():
        if rec.training is not None:
            t = rec.training
            assert t.build and t.loss and t.evaluate and t.features, name
            saved = HEAD_KINDS[t.saves_as or name]
            assert saved.load is not None and saved.check_folder is not None and saved.build is not None, name
    assert set(folder_kinds()) == {"medusa", "eagle", "eagle3", "dflash", "peagle", "earlyexit"}


def test_one_cache_for_every_kind_built_once(tiny_dirs, generated, tmp_path):
    """data.cache_layers: the first run (here the early exit) stores the union of every kind's layers, the EAGLE-3
    run then reads its subset without writing; a cache lacking a run's layers is refused in one line."""
    cache = tmp_path / "cache"
    common = ["train.max_steps=1", "data.hidden_states=offline", f"data.hidden_cache={cache}"]
    ee = _cfg(
        tiny_dirs,
        generated,
        tmp_path / "ee",
        "earlyexit",
        "head.exit_layer=1",
        "data.cache_layers=[0,1,2]",
        *common,
    )
    run_heads(ee, make_accelerator(ee.train), progress=False)
    meta = json.loads((cache / "meta.json").read_text())
    assert meta["aux_layers"] == [0, 1, 2] and meta["kind"] == "earlyexit"
    shards = {p.name: p.stat().st_mtime_ns for p in cache.glob("shard-*")}
    e3 = _cfg(tiny_dirs, generated, tmp_path / "e3", "eagle3", "data.cache_layers=[0,1,2]", *common)
    assert run_heads(e3, make_accelerator(e3.train), progress=False)["step"] == 1
    assert {p.name: p.stat().st_mtime_ns for p in cache.glob("shard-*")} == shards  # read, not rebuilt
    only = tmp_path / "only-exit"
    ee2 = _cfg(tiny_dirs, generated, tmp_path / "ee2", "earlyexit", "head.exit_layer=1", "train.max_steps=1",
               "data.hidden_states=offline", f"data.hidden_cache={only}")  # fmt: skip
    run_heads(ee2, make_accelerator(ee2.train), progress=False)
    e3b = _cfg(tiny_dirs, generated, tmp_path / "e3b", "eagle3", "train.max_steps=1", "data.hidden_states=offline",
               f"data.hidden_cache={only}")  # fmt: skip
    with pytest.raises(DraftsmithError, match=r"this run needs \[0, 1, 2\] \(\[0, 2\] missing\)"):
        run_heads(e3b, make_accelerator(e3b.train), progress=False)
    with pytest.raises(DraftsmithError, match="data.cache_layers"):
        load_config(HeadsConfig, None, ["data.cache_layers=[-1]"])
    far = _cfg(tiny_dirs, generated, tmp_path / "far", "eagle3", "data.cache_layers=[9]", *common[:2],
               f"data.hidden_cache={tmp_path / 'far-cache'}")  # fmt: skip
    with pytest.raises(DraftsmithError, match=r"data.cache_layers \[9\] are outside .* \[0, 2\]"):
        run_heads(far, make_accelerator(far.train), progress=False)
    assert (
        not (tmp_path / "far").exists() and not (tmp_path / "far-cache").exists()
    )  # refused before any write


QWEN_HEADS = sorted(
    p for p in RECIPES if p.parent == RECIPE_DIR and p.name.startswith("heads-qwen2.5-coder-1.5b-")
)


def test_the_qwen_heads_recipes_share_one_cache_and_one_budget(tiny_dirs, generated, tmp_path):
    """The five Qwen2.5-Coder-1.5B heads recipes: one data set, one cache holding every kind's layers (data.cache_layers),
    equal training tokens; each runs a step on the tiny target with the paths and layers scaled down, the first fills
    the cache and the others read it without writing a shard."""
    assert {p.name.split("-")[-1].removesuffix(".yaml") for p in QWEN_HEADS} == {
        "eagle3", "dflash", "peagle", "medusa", "earlyexit"}  # fmt: skip
    cfgs = {p.name: load_config(HeadsConfig, p) for p in QWEN_HEADS}
    assert (
        len({(c.data.hidden_cache, tuple(c.data.cache_layers), c.data.cache_dtype) for c in cfgs.values()})
        == 1
    )
    assert len({(str(c.data.source), c.data.max_length, c.data.eval_size, c.train.max_steps, c.train.batch_size,
                 c.train.seed) for c in cfgs.values()}) == 1  # fmt: skip
    from draftsmith.heads.eagle.model import default_aux_layers

    layers = set(cfgs[QWEN_HEADS[0].name].data.cache_layers)
    for c in cfgs.values():
        need = (
            set(c.head.aux_layers or default_aux_layers(28))
            if c.head.kind in ("eagle3", "dflash", "peagle")
            else set()
        )
        need |= {c.head.exit_layer} if c.head.kind == "earlyexit" else set()
        assert need <= layers, c.head.kind
        assert c.head.init == ("random" if c.head.kind == "medusa" else "target")
    cache, shards = tmp_path / "hidden", None
    for p in QWEN_HEADS:
        cfg = load_config(HeadsConfig, p, [
            f"model.target={tiny_dirs['target']}", f"data.source={generated}", f"data.hidden_cache={cache}",
            "data.cache_layers=[0,1,2]", "head.draft_vocab_size=128", f"output_dir={tmp_path / p.stem}",
            "train.max_steps=1", "train.batch_size=4", "data.eval_size=1", "train.eval_before_training=false",
            "eval.depth=2", *(["head.aux_layers=[0,1,2]"] if cfg_kind(p) in ("eagle3", "dflash", "peagle") else []),
            *(["head.exit_layer=1"] if cfg_kind(p) == "earlyexit" else []),
            *(["loss.ttt_steps=2"] if cfg_kind(p) == "eagle3" else []),
        ])  # fmt: skip
        assert run_heads(cfg, make_accelerator(cfg.train), progress=False)["step"] == 1, p.name
        now = {q.name: q.stat().st_mtime_ns for q in cache.glob("shard-*")}
        assert now and (shards is None or now == shards), p.name  # hybrid: the first run fills, the rest read
        shards = now
        assert (tmp_path / p.stem / "final" / "model.safetensors").is_file()


def cfg_kind(path: Path) -> str:
    return load_config(HeadsConfig, path).head.kind


@pytest.mark.parametrize("path", [p for p in RECIPES if p.parent.name == "data-engine"], ids=lambda p: p.name)
def test_a_data_engine_recipe_writes_loadable_snapshots(path, tiny_dirs, generated, tmp_path):
    """Scaled down to the tiny target: the snapshots are heads the decoder loads, each with the held-out numbers
    of its own step (the learning curve's points), and final/ is the last point."""
    from draftsmith.app.drafters import build_proposer
    from draftsmith.decode.drafters import DrafterContext
    from draftsmith.models import load_model

    out = tmp_path / "run"
    cfg = load_config(HeadsConfig, path, [
        f"model.target={tiny_dirs['target']}", f"data.source={generated}", f"data.hidden_cache={tmp_path / 'h'}",
        "data.cache_layers=[0,1,2]", "head.aux_layers=[0,1,2]", "head.draft_vocab_size=128", f"output_dir={out}",
        "train.max_steps=3", "train.snapshot_steps=[1,2]", "train.batch_size=2", "data.eval_size=2", "data.max_length=128",
        "eval.depth=2", "loss.ttt_steps=2", "train.save_every=0"])  # fmt: skip
    run_heads(cfg, make_accelerator(cfg.train), progress=False)
    evals = {
        e["step"]: e
        for e in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
        if e["event"] == "eval"
    }
    target = load_model(tiny_dirs["target"], device="cpu")
    for step in (1, 2):
        snap = out / "snapshots" / f"step-{step:07d}"
        acc = json.loads((snap / "head_accuracy.json").read_text())
        assert acc["acceptance_per_depth"] == evals[step]["acceptance_per_depth"]
        prop = build_proposer(f"eagle:{snap}", DrafterContext(target, None, torch.device("cpu")))
        assert prop.hidden_state_layers
    assert sorted(evals) == [0, 1, 2, 3] and (out / "final" / "model.safetensors").is_file()


def test_states_captured_while_generating_fill_the_cache_without_the_target(tiny_dirs, tmp_path, monkeypatch):
    """`generate --capture-layers` keeps the states of the forwards that decoded; a heads run whose cache needs a
    subset of them reads them (no target pass over those examples) and gets what the target computes; a folder
    captured without a layer the cache needs, or from another target, is left to the target."""
    import draftsmith.heads.hidden as hidden_mod
    from draftsmith.heads.data import collate, load_examples
    from draftsmith.heads.hidden import CacheSpec, HiddenStateCache, HiddenStates, fill_from_generated
    from draftsmith.models import load_model
    from draftsmith.prompts import Prompt
    from draftsmith.selfdistill import generate_dataset, generated_features

    prompts = [
        Prompt(messages=[{"role": "user", "content": f"Say {i} things about the sea."}], id=str(i))
        for i in range(7)
    ]
    kw = {"max_new_tokens": 30, "batch_size": 3, "shard_size": 3, "progress": False}
    gen = generate_dataset(tiny_dirs["target"], prompts, tmp_path / "gen", capture_layers=[2, 0, 1], **kw)
    meta, files = generated_features(gen)
    assert (
        meta["layers"] == [0, 1, 2] and len(files) == 7 and len(set(files.values())) == 3
    )  # a file per shard
    target = load_model(tiny_dirs["target"], device="cpu")
    ex = load_examples(str(gen), max_length=40)  # some cut: the stored states are cut the same way
    assert any(len(e["input_ids"]) == 40 for e in ex)
    calls = []
    real = hidden_mod.target_features
    monkeypatch.setattr(hidden_mod, "target_features", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    cache = HiddenStateCache(tmp_path / "c", CacheSpec("eagle3", [2, 0], 64, "bfloat16"), target)
    assert fill_from_generated(cache, ex, target) == len(ex) and not calls
    # read in place: the cache holds links to the generate folder's files, not a copy of the states
    assert not list((tmp_path / "c").glob("shard-*")) and (tmp_path / "c" / "links.json").is_file()
    assert all(int(e["index"]) in cache for e in ex)
    batch = collate(ex[:4])
    got = HiddenStates("offline", target, [2, 0], HiddenStateCache(tmp_path / "c", cache.spec, target))(batch)
    ref = HiddenStates("online", target, [2, 0])(batch)
    valid = batch["attention_mask"].bool()
    for key in ("aux", "last"):  # bf16 storage of fp32 states
        torch.testing.assert_close(got[key][valid], ref[key][valid], rtol=1e-2, atol=2e-2)
    # a hybrid heads run on that folder reads every example's states from it: the target never runs over the text
    calls.clear()
    run = _cfg(tiny_dirs, str(gen), tmp_path / "run", "eagle3", "train.max_steps=2", "data.hidden_states=hybrid",
               "head.aux_layers=0,1,2", f"data.hidden_cache={tmp_path / 'run-cache'}")  # fmt: skip
    run_heads(run, make_accelerator(run.train), progress=False)
    assert not calls and (tmp_path / "run" / "final").is_dir()
    # a captured-states file that goes away drops its links in one line: those examples are computed again
    gone = files[str(ex[0]["id"])]
    gone.rename(gone.with_suffix(".moved"))
    reopened = HiddenStateCache(tmp_path / "c", cache.spec, target)
    lost = [e for e in ex if files[str(e["id"])] == gone]
    assert lost and all(e["index"] not in reopened for e in lost)
    assert all(e["index"] in reopened for e in ex if files[str(e["id"])] != gone)
    # a cache needing a layer the folder lacks, or another target, reads nothing from it
    narrow = generate_dataset(tiny_dirs["target"], prompts, tmp_path / "narrow", capture_layers=[1], **kw)
    ex1 = load_examples(str(narrow), max_length=40)
    lacking = HiddenStateCache(tmp_path / "c1", CacheSpec("eagle3", [0, 1], 64, "bfloat16"), target)
    assert fill_from_generated(lacking, ex1, target) == 0
    other = load_model(tiny_dirs["draft"], device="cpu")
    foreign = HiddenStateCache(tmp_path / "c2", CacheSpec("medusa", [], 64, "bfloat16"), other)
    assert fill_from_generated(foreign, ex, other) == 0


def test_capture_is_refused_with_a_server_and_for_layers_out_of_range(tiny_dirs, tmp_path):
    from draftsmith.selfdistill import generate_dataset

    with pytest.raises(DraftsmithError, match="drop --server or --capture-layers"):
        generate_dataset(
            tiny_dirs["target"],
            "builtin:train",
            tmp_path / "a",
            server="http://127.0.0.1:9",
            capture_layers=[1],
        )
    with pytest.raises(DraftsmithError, match=r"outside .* hidden_states indices \[0, 2\]"):
        generate_dataset(tiny_dirs["target"], "builtin:train", tmp_path / "b", capture_layers=[3], limit=2)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_capture_may_start_in_a_folder_without_states_but_never_changes_layers(tiny_dirs, tmp_path):
    from draftsmith.prompts import Prompt
    from draftsmith.selfdistill import generate_dataset, generated_features

    prompts = [Prompt(messages=[{"role": "user", "content": f"Count to {i}."}], id=str(i)) for i in range(4)]
    kw = {"max_new_tokens": 5, "batch_size": 2, "shard_size": 2, "progress": False}
    out = tmp_path / "gen"
    generate_dataset(tiny_dirs["target"], prompts, out, limit=2, **kw)
    assert generated_features(out) is None
    generate_dataset(tiny_dirs["target"], prompts, out, limit=4, capture_layers=[1], **kw)
    meta, files = generated_features(out)
    assert meta["layers"] == [1] and sorted(files) == ["2", "3"]  # the earlier rows have none
    with pytest.raises(DraftsmithError, match="pass --capture-layers 1"):
        generate_dataset(tiny_dirs["target"], prompts, out, limit=4, capture_layers=[0, 1], **kw)
