"""The training loop: bit-exact resume, atomic checkpoints, NaN stop, Ctrl-C, outputs (docs/architecture.md §7.6, §8)."""

import errno
import json
import math
import os
import shutil
import signal

import pytest
import torch
from safetensors.torch import load_file, save_file

import k3.train.trainer as trainer_module
from k3.optim import cosine_with_warmup
from k3.train.checkpoint import IncompatibleResume, latest_checkpoint
from k3.train.trainer import SaveFailed, TrainArgs, Trainer, TrainingDiverged, train

def _args(corpus, out, **kw):
    tiny = {"vocab_size": 320, "num_hidden_layers": 5, "full_attn_layers": [4, 5], "kda_layers": [1, 2, 3]}
    base = dict(data=str(corpus), out=str(out), steps=6, seq_len=32, batch_size=2, eval_every=2, eval_batches=2,
                checkpoint_every=100, cache_dir=str(corpus.parent / "cache"), overrides=tiny)
    return TrainArgs(**{**base, **kw})


def _weights(run):
    return load_file(os.path.join(run, "model", "model.safetensors"))


def test_resume_is_bit_exact(corpus, tmp_path):
    """N + N steps with a resume in between equal 2N steps straight: weights, router biases, metrics."""
    straight = train(_args(corpus, tmp_path / "a"))
    train(_args(corpus, tmp_path / "b", stop_after=3))
    assert latest_checkpoint(tmp_path / "b").name == "step_0000003"
    resumed = train(_args(corpus, tmp_path / "b", resume=True))
    a, b = _weights(tmp_path / "a"), _weights(tmp_path / "b")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any("e_score_correction_bias" in k and a[k].abs().sum() > 0 for k in a)  # QB biases moved
    assert straight["final_val_loss"] == resumed["final_val_loss"]
    lines = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(7))
    extended = train(_args(corpus, tmp_path / "b", resume=True, steps=7))  # a finished run is extended
    assert extended["finished"] and extended["step"] == 7 and extended["resumes"][-1]["changes"] == {"steps": [6, 7]}
    c = _weights(tmp_path / "b")
    assert c.keys() == b.keys() and any(not torch.equal(c[k], b[k]) for k in b)  # trained on and re-exported


def test_outputs_and_learning(corpus, tmp_path):
    """A run writes checkpoints, metrics, the three plots and an exported model; the loss goes down."""
    summary = train(_args(corpus, tmp_path, steps=12, lr=1e-2))
    for name in ("loss.png", "expert_load.png", "attn_res.png", "metrics.jsonl", "model/config.json",
                 "model/tiktoken.model"):
        assert (tmp_path / name).is_file(), name
    assert summary["final_val_loss"] < summary["initial_val_loss"]
    metrics = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(m["max_vio"]) and m["tokens_per_s"] > 0 for m in metrics[1:])
    assert not any(p.name.startswith(".tmp") for p in (tmp_path / "checkpoints").iterdir())


def test_evaluation_rows_spread_over_the_held_out_set_and_the_bigram_scores_the_same_tokens(corpus, tmp_path):
    """Every evaluation scores `eval_batches` × `batch_size` validation rows spread from the first to the last
    row (not the first rows: one work); the bigram baseline is scored on exactly those tokens."""
    trainer = Trainer(_args(corpus, tmp_path, eval_batches=2, batch_size=2))
    task = trainer.task
    n = len(task.data.val)
    assert n > 4 and len(task.eval_rows) == 4 and task.eval_rows[0] == 0 and task.eval_rows[-1] == n - 1
    runs = task.data.val.segments(task.eval_rows)
    assert task.references["smoothed bigram (held out)"] == task.data.bigram.cross_entropy(runs)
    assert trainer.evaluate()["val_tokens"] == task.eval_tokens == sum(len(r) - 1 for r in runs)
    whole = Trainer(_args(corpus, tmp_path / "all", eval_batches=n)).task  # enough batches: every row
    assert whole.eval_rows.tolist() == list(range(n))


def test_killed_run_resumes_from_last_checkpoint(corpus, tmp_path):
    """A half-written checkpoint (as after SIGKILL) is ignored: `latest` still points at the complete one."""
    train(_args(corpus, tmp_path, stop_after=2))
    (tmp_path / "checkpoints" / ".tmp-step_0000004").mkdir()  # a save that never finished
    trainer = Trainer(_args(corpus, tmp_path, resume=True))
    assert trainer.step == 2


def test_non_finite_loss_stops_with_a_clear_message(corpus, tmp_path):
    """A NaN loss stops the run naming the step and keeps the last good checkpoint."""
    train(_args(corpus, tmp_path, stop_after=2))
    trainer = Trainer(_args(corpus, tmp_path, resume=True))
    with torch.no_grad():
        trainer.model.lm_head.weight.fill_(float("nan"))
    with pytest.raises(TrainingDiverged, match="non-finite loss .* step 2"):
        trainer.run()
    assert latest_checkpoint(tmp_path).name == "step_0000002"


@pytest.mark.parametrize("signum, name", [(signal.SIGINT, "SIGINT"), (signal.SIGTERM, "SIGTERM")])
def test_a_stop_signal_saves_a_checkpoint(corpus, tmp_path, signum, name):
    """The first SIGINT (Ctrl-C) or SIGTERM (a scheduler's warning) finishes the current step, checkpoints and
    stops; the handler is removed after the run; --resume continues from there."""
    previous = signal.getsignal(signum)
    trainer = Trainer(_args(corpus, tmp_path))
    step = trainer.train_step

    def interrupted_step():
        metrics = step()
        if trainer.step == 2:
            os.kill(os.getpid(), signum)
        return metrics

    trainer.train_step = interrupted_step
    summary = trainer.run()
    assert summary["stopped_by"] == name and summary["step"] == 2 and not summary["finished"]
    assert latest_checkpoint(tmp_path).name == "step_0000002"
    assert signal.getsignal(signum) == previous
    assert Trainer(TrainArgs(out=str(tmp_path), resume=True)).step == 2


def test_activation_checkpointing_changes_nothing(corpus, tmp_path):
    """Recomputing activations in backward gives the same weights and QB statistics (tokens counted once)."""
    train(_args(corpus, tmp_path / "plain", steps=3))
    train(_args(corpus, tmp_path / "ckpt", steps=3, activation_checkpointing=True))
    a, b = _weights(tmp_path / "plain"), _weights(tmp_path / "ckpt")
    # routing cannot flip: the recomputation repeats the forward's ops on bit-identical inputs (weights come out
    # bit-identical on x86 AVX-512), so no router margin (min 2.1e-5 here) meets fp32 noise
    assert all(torch.allclose(a[k], b[k], atol=1e-6, rtol=0) for k in a)


@pytest.mark.parametrize("bad", [
    {"steps": None}, {"steps": 0}, {"minutes": 1.0}, {"schedule": "linear"}, {"steps": None, "minutes": math.nan},
    {"steps": None, "minutes": math.inf}, {"steps": None, "minutes": -1.0}, {"lr": math.nan}, {"lr": -0.1},
    {"seed": 2**70}, {"seed": -1}, {"batch_size": 0}, {"batch_size": True}, {"balancer": "fair"},
    {"overrides": {"no_such_field": 1}}, {"stop_after": 0}, {"muon_per_head": "rows"}, {"lr_scale": [2.0]},
    {"lr_scale": {"embed": 0}}, {"lr_scale": {"embed": math.inf}}, {"lr_scale": {"embed": "5"}}])
def test_bad_arguments(corpus, tmp_path, bad):
    with pytest.raises(ValueError):
        _args(corpus, tmp_path, **bad)


def test_muon_block_view_is_an_option(corpus, tmp_path):
    """--muon-per-head none: Muon on whole matrices (K2's form, §14); the default splits q/k/v per head (§8.4)."""
    def groups(**kw):
        trainer = Trainer(_args(corpus, tmp_path / str(len(kw)), **kw))
        return {g["name"]: g["split"] for g in trainer.optimizers[0].param_groups}

    assert {"kda_qkv", "mla_q_b", "mla_kv_b"} <= set(groups())
    whole = groups(muon_per_head="none")
    assert not {"kda_qkv", "mla_q_b", "mla_kv_b"} & set(whole) and set(whole.values()) == {"none"}


def test_time_budget_ends_the_run(corpus, tmp_path):
    """--minutes: the schedule is sized after the first step; the run ends evaluated, checkpointed and exported."""
    summary = train(_args(corpus, tmp_path, steps=None, minutes=0.1))
    assert summary["finished"] and summary["step"] >= 2
    assert (tmp_path / "model" / "model.safetensors").is_file()
    last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == summary["step"] and "val_loss" in last


def test_minutes_schedule_follows_the_measured_pace(corpus, tmp_path, monkeypatch):
    """The --minutes length is re-fitted from the median step time (the first, slow step left out once others
    exist), evaluations included, 5 % of the remaining budget kept back; it never ends before the next step."""
    import k3.train.trainer as trainer_module

    t = trainer_module.Trainer.__new__(trainer_module.Trainer)
    t.args, t.dist, t.step = _args(corpus, tmp_path, steps=None, minutes=1.0).for_new_run(), None, 4
    t.history = [{"step": 0, "val_loss": 8.0}] + [{"step": i + 1, "seconds": s}
                                                  for i, s in enumerate([9.0, 1.0, 1.0, 1.0])]
    monkeypatch.setattr(trainer_module.time, "monotonic", lambda: 1000.0)
    t._fit_schedule(deadline=1000.0 + 100.0, eval_seconds=1.0)  # pace 1 s + an evaluation (1 s) every 2 steps
    assert t.total_steps == 4 + int(95 / 1.5)
    t.history += [{"step": s, "seconds": 3.0} for s in range(5, 9)]
    t.step = 8
    t._fit_schedule(deadline=1000.0 + 100.0, eval_seconds=1.0)  # the machine slowed down: median 3 s now
    assert t.total_steps == 8 + int(95 / 3.5)
    t._fit_schedule(deadline=1000.0 - 5.0, eval_seconds=1.0)  # past the deadline: one more step at least
    assert t.total_steps == 9


# ------------------------------------------------------------------------------------- up-front checks


def _no_data_reading(monkeypatch):
    """Make reading the corpus fail loudly: the checks under test must come before it."""
    import k3.train.tasks

    def refuse(*args, **kwargs):
        raise AssertionError("the corpus was read before the options were checked")

    monkeypatch.setattr(k3.train.tasks, "prepare_data", refuse)


@pytest.mark.parametrize("bad, message", [
    ({"steps": 1}, "--steps 1 is too short for the cosine schedule"),
    ({"steps": 4, "schedule": "wsd"}, "--steps 4 is too short for the wsd schedule"),
    ({"stop_after": 7}, "--stop-after 7 is beyond the end of the schedule"),
    ({"data": "missing.txt"}, "--data: data path .*missing.txt' does not exist"),
])
def test_schedule_and_data_faults_are_found_before_any_work(corpus, tmp_path, monkeypatch, bad, message):
    _no_data_reading(monkeypatch)
    with pytest.raises(ValueError, match=message):
        Trainer(_args(corpus, tmp_path / "run", **bad))


def test_out_must_be_a_writable_directory(corpus, tmp_path, monkeypatch):
    """--out naming a file, under a file, or refusing the write probe: a clear error before the corpus is read."""
    _no_data_reading(monkeypatch)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="--out '.*file' is a file"):
        Trainer(_args(corpus, tmp_path / "file"))
    with pytest.raises(ValueError, match="--out '.*file/run' is not writable"):
        Trainer(_args(corpus, tmp_path / "file" / "run"))

    def read_only(path):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(trainer_module, "check_writable_directory", read_only)
    with pytest.raises(ValueError, match=r"is not writable \(Permission denied"):
        Trainer(_args(corpus, tmp_path / "run"))


def test_little_free_space_is_reported_at_start(corpus, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(trainer_module.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10, 9, 1))
    Trainer(_args(corpus, tmp_path))
    assert "MB free, less than a checkpoint and the exported model need" in capsys.readouterr().err


# -------------------------------------------------------------------------------------------- resume


@pytest.fixture(scope="module")
def two_checkpoints(corpus, tmp_path_factory):
    """A run paused at step 2 with checkpoints at steps 1 and 2 (copied by the tests that change it)."""
    run = tmp_path_factory.mktemp("paused") / "run"
    train(_args(corpus, run, stop_after=2, checkpoint_every=1))
    return run


def _copy(run, tmp_path):
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


def test_resume_refuses_changed_settings_naming_each(corpus, two_checkpoints, tmp_path):
    """Options that define the run are refused all at once, each with its old and new value."""
    other = tmp_path / "other.txt"
    other.write_text("\n\n".join(p.read_text() for p in sorted(corpus.glob("*.txt"))))  # the same text, one file
    with pytest.raises(IncompatibleResume) as e:
        Trainer(_args(corpus, two_checkpoints, resume=True, data=str(other), seq_len=64, seed=3,
                      overrides={"vocab_size": 320, "num_hidden_layers": 9}, lr_scale={"embed": 2.0}))
    message = str(e.value)
    assert f"--data '{corpus}' -> '{other}'" in message and "--seq-len 32 -> 64" in message
    assert '--lr-scale {"embed": 5.0, "muon": 0.5} -> {"embed": 2.0}' in message
    assert "--seed 0 -> 3" in message and "--overrides" in message and "another --out" in message
    with pytest.raises(IncompatibleResume, match="--steps 2: the run is already at step 2"):
        Trainer(_args(corpus, two_checkpoints, resume=True, steps=2))
    with pytest.raises(IncompatibleResume, match="--stop-after 1: the run is already at step 2"):
        Trainer(_args(corpus, two_checkpoints, resume=True, stop_after=1))


def test_lr_scale_defaults_and_older_runs(corpus, two_checkpoints, tmp_path):
    """The text task's tuned per-group scales apply unless --lr-scale is given (§8.8); a run saved before the
    option existed resumes with every group at the peak lr, as it was trained."""
    text = Trainer(_args(corpus, tmp_path / "a"))
    assert text.args.lr_scale == {"embed": 5.0, "muon": 0.5}
    groups = {g["name"]: g["lr_scale"] for opt in text.optimizers for g in opt.param_groups}
    assert groups["embed"] == 5.0 and groups["lm_head"] == 1.0 and groups["matrix"] == 0.5
    mine = Trainer(_args(corpus, tmp_path / "b", lr_scale={"lm_head": 0.5}))
    assert {g["name"]: g["lr_scale"] for g in mine.optimizers[1].param_groups}["lm_head"] == 0.5
    run = _copy(two_checkpoints, tmp_path)
    for state_file in run.glob("checkpoints/*/trainer_state.json"):
        state_file.write_text(json.dumps(_without(json.loads(state_file.read_text()), "lr_scale")))
    old = Trainer(TrainArgs(out=str(run), resume=True))
    assert old.args.lr_scale == {} and not old.changes
    assert all(g.get("lr_scale", 1.0) == 1.0 for opt in old.optimizers for g in opt.param_groups)


def _without(value, key):
    """A JSON value with `key` removed from every object in it."""
    if isinstance(value, dict):
        return {k: _without(v, key) for k, v in value.items() if k != key}
    return [_without(v, key) for v in value] if isinstance(value, list) else value


def test_resume_takes_the_runs_options_and_extends_it(two_checkpoints, tmp_path):
    """`--resume --out DIR` alone continues with the run's options; a larger --steps and a new --lr are allowed,
    printed and recorded; the schedule's new length replaces the old one from the resume step on."""
    run = _copy(two_checkpoints, tmp_path)
    trainer = Trainer(TrainArgs(out=str(run), resume=True))
    assert (trainer.args.seq_len, trainer.args.batch_size, trainer.args.lr, trainer.total_steps) == (32, 2, 0.03, 6)
    summary = train(TrainArgs(out=str(run), resume=True, steps=4, lr=0.01))
    assert summary["finished"] and summary["step"] == 4
    state = json.loads((run / "checkpoints" / "step_0000004" / "trainer_state.json").read_text())
    assert [(r["step"], r["checkpoint"], r["changes"]) for r in state["resumes"]] == [
        (2, "step_0000002", {"lr": [0.03, 0.01], "steps": [6, 4]})]
    assert state["total_steps"] == 4 and state["args"]["lr"] == 0.01
    lrs = {m["step"]: m["lr"] for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "lr" in m}
    assert lrs[2] == cosine_with_warmup(1, 6, 0.03) and lrs[4] == cosine_with_warmup(3, 4, 0.01)


def test_resume_refuses_a_changed_corpus(two_checkpoints, tmp_path):
    """The corpus at the run's --data path changed since (its fingerprint differs): refused, not trained on."""
    run = _copy(two_checkpoints, tmp_path)
    state_file = run / "checkpoints" / "step_0000002" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state["data"]["corpus_sha256"] = "0" * 64  # as if the files had been edited after this checkpoint
    state_file.write_text(json.dumps(state))
    with pytest.raises(IncompatibleResume, match="is not the one this run was trained on"):
        Trainer(TrainArgs(out=str(run), resume=True))


def _truncate_weights(ckpt):
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[: len(data) // 2])


def _drop_optimizer_tensor(ckpt):
    tensors = load_file(ckpt / "trainer_state.safetensors")
    del tensors[sorted(k for k in tensors if k.startswith("optim"))[0]]
    save_file(tensors, ckpt / "trainer_state.safetensors")


def _bad_rng(ckpt):
    tensors = load_file(ckpt / "trainer_state.safetensors")
    tensors["rng.cpu"] = tensors["rng.cpu"][:7].clone()
    save_file(tensors, ckpt / "trainer_state.safetensors")


def _bad_json(ckpt):
    (ckpt / "trainer_state.json").write_text('{"step": 2, "optimizers": [')


@pytest.mark.parametrize("damage, file", [(_truncate_weights, "model.safetensors"),
                                          (_drop_optimizer_tensor, "trainer_state.safetensors"),
                                          (_bad_rng, "trainer_state.safetensors"),
                                          (_bad_json, "trainer_state.json")])
def test_damaged_latest_checkpoint_falls_back_to_the_previous_one(two_checkpoints, tmp_path, capsys, damage, file):
    run = _copy(two_checkpoints, tmp_path)
    damage(run / "checkpoints" / "step_0000002")
    capsys.readouterr()
    trainer = Trainer(TrainArgs(out=str(run), resume=True))
    err = capsys.readouterr().err
    assert trainer.step == 1 and trainer.resumes[-1]["skipped"] == ["step_0000002"]
    assert f"warning: checkpoint step_0000002 is damaged: {run / 'checkpoints' / 'step_0000002' / file}" in err
    assert "Traceback" not in err


def test_no_loadable_checkpoint_is_one_clear_error(two_checkpoints, tmp_path):
    run = _copy(two_checkpoints, tmp_path)
    _bad_json(run / "checkpoints" / "step_0000002")
    _truncate_weights(run / "checkpoints" / "step_0000001")
    with pytest.raises(ValueError, match="no loadable checkpoint .*step_0000002: trainer_state.json: .*"
                                         "step_0000001: model.safetensors: "):
        Trainer(TrainArgs(out=str(run), resume=True))


def test_resumed_minutes_budget_pauses_the_run(two_checkpoints, tmp_path):
    """--minutes on a resume is a budget for that invocation: the run pauses (resumable), not finished."""
    run = _copy(two_checkpoints, tmp_path)
    summary = train(TrainArgs(out=str(run), resume=True, minutes=1e-6))
    assert summary["stopped_by"] == "--minutes" and not summary["finished"] and summary["step"] == 3
    assert latest_checkpoint(run).name == "step_0000003"


# ----------------------------------------------------------------------------------- saving failures


def test_full_disk_during_a_save_keeps_the_previous_checkpoint(corpus, tmp_path, monkeypatch, capsys):
    """ENOSPC while checkpointing: the partial directory goes, the previous checkpoint stays; a periodic save
    warns and training goes on, the final one stops the run with one message."""
    import k3.checkpoint.io

    real_save, failing = k3.checkpoint.io.save_file, {4, 6}
    trainer = Trainer(_args(corpus, tmp_path, checkpoint_every=2))

    def save_file_or_full(tensors, filename, metadata=None):
        if trainer.step in failing:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(tensors, filename, metadata=metadata)

    monkeypatch.setattr(k3.checkpoint.io, "save_file", save_file_or_full)
    with pytest.raises(SaveFailed) as e:
        trainer.run()
    warning = capsys.readouterr().err
    assert "the checkpoint of step 4 could not be written (No space left on device)" in warning
    assert "training goes on" in warning
    assert str(e.value).startswith("the checkpoint of step 6 could not be written (No space left on device); its "
                                   "partial files are removed and the last checkpoint is ")
    assert str(e.value).endswith("step_0000002")
    assert latest_checkpoint(tmp_path).name == "step_0000002"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_0000002"]
