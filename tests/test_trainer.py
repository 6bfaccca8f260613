import json
import shutil

import pytest
import torch

from draftsmith.errors import DraftsmithError
from draftsmith.trainer import TrainArgs, list_checkpoints, make_accelerator, run

ENGINES = ["accelerate", "lightning"]


def make_engine(engine: str, args: TrainArgs):
    """The accelerate engine (one CPU process) or the Lightning engine (one process) for `args`."""
    if engine == "accelerate":
        return make_accelerator(args, cpu=True)
    pytest.importorskip("lightning")
    from draftsmith.lightning_engine import LightningEngine

    return LightningEngine(args)


class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.lin(x)

    def save_pretrained(self, d):
        from safetensors.torch import save_file

        d.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, str(d / "model.safetensors"))


def batches(epoch):
    # deterministic per epoch; each batch is tagged with its position so tests can check the data order
    g = torch.Generator().manual_seed(epoch)
    out = []
    for i in range(5):
        x = torch.randn(3, 4, generator=g)
        out.append({"x": x, "y": x.sum(-1, keepdim=True), "tag": torch.tensor(epoch * 100 + i)})
    return out


class Killed(Exception):
    pass


def loss_fn(seen, kill_at=None):
    def fn(model, batch):
        if kill_at is not None and len(seen) == kill_at:
            raise Killed  # a run killed mid-step
        seen.append(int(batch["tag"]))
        loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
        # a random weight, as DFlash's anchors or dropout: a resume that does not restore the RNG diverges
        return loss * (1 + 0.1 * torch.rand(())), {"n_tokens": 3}

    return fn


def _run(
    out, seen, resume=False, overwrite=False, cfg=None, kill_at=None, kw_steps=None, engine="accelerate", **kw
):
    args = TrainArgs(
        **{
            "max_steps": 6,
            "lr": 0.05,
            "log_every": 1,
            "save_every": 2,
            "keep_checkpoints": 2,
            "grad_accum": 2,
            "warmup_steps": 1,
            **kw,
        }
    )
    model = Toy()
    evals = []
    kw_run = {"before_step": kw_steps.append} if kw_steps is not None else {}
    res = run(
        make_engine(engine, args),
        model,
        loss_fn(seen, kill_at),
        batches,
        args,
        out,
        eval_fn=lambda m: evals.append(1) or {"w0": float(m.lin.weight[0, 0])},
        resume=resume,
        overwrite=overwrite,
        run_config=cfg or {"a": 1, "train": {"max_steps": args.max_steps}},
        progress=False,
        **kw_run,
    )
    return model, res, evals


@pytest.mark.parametrize("engine", ENGINES)
def test_train_writes_outputs_and_resume_matches_straight_run(engine, tmp_path):
    seen_a, steps_a = [], []
    straight, res, evals = _run(tmp_path / "a", seen_a, kw_steps=steps_a, engine=engine)
    assert steps_a == [0, 1, 2, 3, 4, 5]  # before_step: once per optimizer step
    out = tmp_path / "a"
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train_ev = [e for e in events if e["event"] == "train"]
    assert [e["step"] for e in train_ev] == [1, 2, 3, 4, 5, 6]
    assert all("loss" in e and "lr" in e and e["tokens_per_s"] > 0 and e["n_tokens"] == 6 for e in train_ev)
    assert [e["step"] for e in events if e["event"] == "eval"] == [0, 6] and len(evals) == 2
    assert train_ev[-1]["loss"] < train_ev[0]["loss"]
    assert [p.name for p in list_checkpoints(out)] == ["step-0000004", "step-0000006"]  # keep_checkpoints=2
    assert (out / "final" / "model.safetensors").is_file() and (out / "run.yaml").is_file()
    # 6 steps x 2 micro-batches = 12 batches: epoch 0 (5), epoch 1 (5), epoch 2 (2)
    assert seen_a == [0, 1, 2, 3, 4, 100, 101, 102, 103, 104, 200, 201]

    # a run killed in step 5 (after the step-4 checkpoint), then resumed
    seen_b = []
    with pytest.raises(Killed):
        _run(tmp_path / "b", seen_b, kill_at=9, engine=engine)
    assert [p.name for p in list_checkpoints(tmp_path / "b")] == ["step-0000002", "step-0000004"]
    del seen_b[8:]  # the killed step's micro-batch is redone after resuming
    steps_b = []
    resumed, res_b, _ = _run(tmp_path / "b", seen_b, resume=True, kw_steps=steps_b, engine=engine)
    assert steps_b == [4, 5]
    assert res_b["step"] == 6
    assert seen_b == seen_a  # data position restored: no batch repeated or skipped
    for p, q in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(p, q)  # optimizer/scheduler/RNG state restored too: bit-exact
    assert _train_losses(tmp_path / "b") == _train_losses(tmp_path / "a")  # each step's loss, bit-exact
    # a longer max_steps is an allowed change on resume: the step count continues
    cfg = {"a": 1, "train": {"max_steps": 8}}
    _, res_c, _ = _run(tmp_path / "b", [], resume=True, max_steps=8, cfg=cfg, engine=engine)
    assert res_c["step"] == 8


def _train_losses(out) -> dict[int, float]:
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {e["step"]: e["loss"] for e in events if e["event"] == "train"}


def _corrupt_rng(engine: str, out):
    """Yield (how, break_it) cases that leave the newest checkpoint's RNG state truncated or foreign."""
    new, old = list_checkpoints(out)[-1], list_checkpoints(out)[-2]
    name = "rng_state_0.safetensors" if engine == "accelerate" else "checkpoint.safetensors"
    good = (new / name).read_bytes()

    def truncate():
        (new / name).write_bytes(good[: len(good) // 2])

    def foreign():  # the state of another step, as if copied over from an older checkpoint
        shutil.copy(old / name, new / name)

    def not_ours():  # a safetensors file that is not a draftsmith state
        shutil.copy(out / "final" / "model.safetensors", new / name)

    for how, fn in (("truncated", truncate), ("foreign", foreign), ("not ours", not_ours)):
        fn()
        yield how
        (new / name).write_bytes(good)


@pytest.mark.parametrize("engine", ENGINES)
def test_resume_with_a_bad_rng_state_stops_instead_of_diverging(engine, tmp_path):
    out = tmp_path / "run"
    _run(out, [], max_steps=4, cfg={"a": 1, "train": {"max_steps": 4}}, engine=engine)
    events = (out / "metrics.jsonl").read_text()
    for how in _corrupt_rng(engine, out):
        with pytest.raises(DraftsmithError, match="step-0000004") as err:
            _run(out, [], max_steps=6, resume=True, cfg={"a": 1, "train": {"max_steps": 6}}, engine=engine)
        assert "\n" not in str(err.value) and "delete" in str(err.value), (how, str(err.value))
        assert (out / "metrics.jsonl").read_text() == events, how  # stopped before writing anything
    assert not list((out / "checkpoints").glob("random_states_*.pkl"))  # no pickle for the RNG state
    # resuming a checkpoint with the other engine is one line too
    other = ENGINES[1 - ENGINES.index(engine)]
    with pytest.raises(
        DraftsmithError, match=f"written by the {engine} engine; resume it with --engine {engine}"
    ):
        _run(out, [], max_steps=6, resume=True, cfg={"a": 1, "train": {"max_steps": 6}}, engine=other)
    _, res, _ = _run(
        out, [], max_steps=6, resume=True, cfg={"a": 1, "train": {"max_steps": 6}}, engine=engine
    )
    assert res["step"] == 6  # the intact checkpoint still resumes


def test_resume_reads_checkpoints_with_accelerates_rng_pickle(tmp_path):
    # checkpoints written before RNG states were safetensors hold accelerate's random_states_0.pkl (loaded
    # weights_only): they resume bit-exact, and a corrupt one stops the resume too
    from draftsmith.statefile import load_state

    _run(tmp_path / "a", [])
    out = tmp_path / "b"
    with pytest.raises(Killed):
        _run(out, [], kill_at=9)
    ckpt = list_checkpoints(out)[-1]
    rng = load_state(ckpt / "rng_state_0.safetensors")[0]
    legacy = {"step": 4, "random_state": rng["python"], "numpy_random_seed": rng["numpy"]}
    torch.save({**legacy, "torch_manual_seed": rng["torch"]}, ckpt / "random_states_0.pkl")
    (ckpt / "rng_state_0.safetensors").unlink()
    good = (ckpt / "random_states_0.pkl").read_bytes()
    (ckpt / "random_states_0.pkl").write_bytes(good[:100])
    with pytest.raises(DraftsmithError, match="random_states_0.pkl is corrupt"):
        _run(out, [], resume=True)
    (ckpt / "random_states_0.pkl").write_bytes(good)
    _run(out, [], resume=True)
    assert _train_losses(out) == _train_losses(tmp_path / "a")


def test_foreign_optimizer_state_is_one_error_without_warnings(tmp_path):
    import collections
    import pickle
    import warnings

    out = tmp_path / "run"
    _run(out, [], max_steps=2, cfg={"a": 1})
    # a pickle torch's weights_only loader refuses (it warns about the protocol first)
    (list_checkpoints(out)[-1] / "optimizer.bin").write_bytes(pickle.dumps(collections.Counter("abc")))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(DraftsmithError, match="step-0000002 could not be loaded .UnpicklingError"):
            _run(out, [], max_steps=4, resume=True, cfg={"a": 1})
    assert not [str(w.message) for w in caught if "pickle" in str(w.message).lower()]


@pytest.mark.parametrize("engine", ENGINES)
def test_out_dir_guards_and_corrupt_checkpoint(engine, tmp_path):
    out = tmp_path / "run"
    _run(out, [], max_steps=2, cfg={"a": 1}, engine=engine)
    with pytest.raises(DraftsmithError, match="another run"):
        _run(out, [], max_steps=2, cfg={"a": 2}, engine=engine)
    with pytest.raises(DraftsmithError, match="--resume"):
        _run(out, [], max_steps=2, cfg={"a": 1}, engine=engine)
    with pytest.raises(DraftsmithError, match="no run to resume"):
        _run(tmp_path / "fresh", [], resume=True, engine=engine)
    # a half-written checkpoint (tmp name) is ignored; a renamed one without its state file is named as corrupt
    ckpt = list_checkpoints(out)[-1]
    shutil.copytree(ckpt, out / "checkpoints" / ".tmp-step-0000009")
    (ckpt / "trainer_state.json").write_text("{not json")
    with pytest.raises(DraftsmithError, match="step-0000002 is corrupt"):
        _run(out, [], max_steps=4, resume=True, cfg={"a": 1}, engine=engine)
    # overwrite wipes the old run (Lightning's CSV logs included)
    _, res, _ = _run(out, [], max_steps=2, overwrite=True, cfg={"a": 3}, engine=engine)
    assert res["step"] == 2 and len(list_checkpoints(out)) == 1
    logs = sorted(p.name for p in (out / "lightning_logs").glob("*"))
    assert logs == (["version_0"] if engine == "lightning" else [])


def test_train_args_validation_and_empty_data(tmp_path):
    with pytest.raises(DraftsmithError, match="train.grad_accum"):
        TrainArgs(grad_accum=0)
    with pytest.raises(DraftsmithError, match="train.lr"):
        TrainArgs(lr=0)
    args = TrainArgs(max_steps=2)
    with pytest.raises(DraftsmithError, match="no batch"):
        run(make_accelerator(args, cpu=True), Toy(), loss_fn([]), [], args, tmp_path / "e", progress=False)
    bad = TrainArgs(max_steps=2, grad_accum=2)
    with pytest.raises(DraftsmithError, match="gradient_accumulation_steps"):
        run(
            make_accelerator(args, cpu=True), Toy(), loss_fn([]), batches, bad, tmp_path / "f", progress=False
        )


def test_live_run_folder_is_locked_naming_its_holder(tmp_path):
    import os
    import socket

    out = tmp_path / "run"
    refused = []

    def fn(model, batch):
        if not refused:  # while the run lives: a second --resume or --overwrite on its folder
            for kw in ({"resume": True}, {"overwrite": True}):
                try:
                    _run(out, [], **kw)
                except DraftsmithError as e:
                    refused.append(str(e))
        loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
        return loss, {}

    args = TrainArgs(max_steps=2, save_every=1, log_every=1)
    run(make_accelerator(args, cpu=True), Toy(), fn, batches, args, out, run_config={"a": 1}, progress=False)
    assert len(refused) == 2, refused
    holder = f"pid {os.getpid()} on {socket.gethostname()}"
    assert all("in use by a live run" in e and holder in e for e in refused)
    assert [e["step"] for e in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())] == [1, 2]
    _run(out, [], resume=True, max_steps=3, cfg={"a": 1})  # the lock ends with the run


def test_resume_tolerates_a_torn_last_metrics_line(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(Killed):
        _run(out, [], kill_at=9)
    with (out / "metrics.jsonl").open("a") as f:
        f.write('{"event": "train", "step": 5, "lo')  # power loss mid-write
    _, res, _ = _run(out, [], resume=True)
    assert res["step"] == 6
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps) and steps.count(5) == 1
    # a broken line that is not the last one is corruption, named as such
    (out / "metrics.jsonl").write_text('{"step": 1}\n{"st\n{"step": 2}\n')
    with pytest.raises(DraftsmithError, match="line 2 is not JSON"):
        _run(out, [], resume=True, max_steps=8, cfg={"a": 1, "train": {"max_steps": 8}})


def test_failed_check_before_training_writes_nothing(tmp_path):
    out = tmp_path / "run"
    args = TrainArgs(max_steps=2)
    frozen = Toy().requires_grad_(False)
    with pytest.raises(DraftsmithError, match="nothing to train"):
        run(make_accelerator(args, cpu=True), frozen, loss_fn([]), batches, args, out, run_config={"a": 1})
    assert not out.exists()


def test_tied_weights_checkpoint_round_trips_without_library_chatter(tmp_path, caplog):
    import logging

    from transformers import AutoModelForCausalLM

    from draftsmith.testing import tiny_llama

    def lm_loss(model, batch):
        return model(input_ids=batch, labels=batch).loss, {"n_tokens": batch.numel()}

    def data(epoch):
        g = torch.Generator().manual_seed(epoch)
        return [torch.randint(3, 300, (2, 12), generator=g) for _ in range(4)]

    def train(out, steps, resume=False):
        args = TrainArgs(max_steps=steps, save_every=2, log_every=1, lr=1e-2, warmup_steps=0)
        model = tiny_llama(seed=3, tie_word_embeddings=True).train()
        res = run(
            make_accelerator(args, cpu=True), model, lm_loss, data, args, out, resume=resume, progress=False
        )
        return model, res

    caplog.set_level(logging.INFO)
    straight, _ = train(tmp_path / "a", 4)
    with pytest.raises(Killed):  # a run stopped after its step-2 checkpoint
        args = TrainArgs(max_steps=4, save_every=2, log_every=1, lr=1e-2, warmup_steps=0)
        calls = []

        def dying(model, batch):
            if len(calls) == 2:
                raise Killed
            calls.append(1)
            return lm_loss(model, batch)

        m = tiny_llama(seed=3, tie_word_embeddings=True).train()
        run(make_accelerator(args, cpu=True), m, dying, data, args, tmp_path / "b", progress=False)
    resumed, res = train(tmp_path / "b", 4, resume=True)
    assert res["step"] == 4
    assert resumed.lm_head.weight is resumed.model.embed_tokens.weight  # still tied after load_state
    for (n, p), q in zip(straight.named_parameters(), resumed.parameters()):
        torch.testing.assert_close(p, q, msg=n)
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "b" / "final")
    assert final.lm_head.weight.data_ptr() == final.model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(final.model.embed_tokens.weight, straight.model.embed_tokens.weight)
    chatter = [r.getMessage() for r in caplog.records if r.name.startswith("accelerate")]
    assert not [m for m in chatter if "Removed shared tensor" in m or "Model weights saved" in m], chatter


def test_num_workers_is_not_a_train_key():
    # it was validated and never used (batches are built in-process); run folders that recorded it still resume
    from draftsmith.config import load_config
    from draftsmith.rundir import RESUMABLE_CHANGES

    with pytest.raises(DraftsmithError, match="num_workers"):
        load_config(TrainArgs, None, ["num_workers=2"])
    assert "num_workers" in RESUMABLE_CHANGES


@pytest.mark.parametrize("engine", ENGINES)
def test_snapshots_are_the_model_at_their_steps(engine, tmp_path):
    # train.snapshot_steps: snapshots/step-N/ holds what a run stopped at N writes as final/ (constant schedule, so
    # the LR does not depend on max_steps), each evaluated first; training goes on to the end unchanged
    from safetensors.torch import load_file

    common = dict(schedule="constant", save_every=0, engine=engine)
    _, _, evals = _run(tmp_path / "long", [], max_steps=6, snapshot_steps=[2, 5, 6], **common)
    snaps = tmp_path / "long" / "snapshots"
    assert sorted(p.name for p in snaps.iterdir()) == ["step-0000002", "step-0000005"]  # step 6 is final/
    events = [json.loads(line) for line in (tmp_path / "long" / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "eval"] == [0, 2, 5, 6] and len(evals) == 4
    for n in (2, 5):
        _run(tmp_path / f"short{n}", [], max_steps=n, **common)
        want = load_file(str(tmp_path / f"short{n}" / "final" / "model.safetensors"))
        got = load_file(str(snaps / f"step-{n:07d}" / "model.safetensors"))
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    with pytest.raises(
        DraftsmithError, match=r"train.snapshot_steps must be steps in \[1, train.max_steps=6\]"
    ):
        TrainArgs(max_steps=6, snapshot_steps=[0, 7])
