"""The training loop: bit-exact resume, atomic checkpoints, NaN stop, Ctrl-C, outputs (spec §7.6, §8)."""

import json
import math
import os
import signal

import pytest
import torch
from safetensors.torch import load_file

from k3.train.checkpoint import latest_checkpoint
from k3.train.trainer import TrainArgs, Trainer, TrainingDiverged, train

CORPUS = "\n\n".join(f"Scene {i}. " + "To be, or not to be, that is the question. " * (3 + i % 4) +
                     "Whether 'tis nobler in the mind to suffer the slings and arrows. " * (i % 3 + 1)
                     for i in range(40))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small multi-document corpus directory (one document per file) and a tokenizer cache."""
    root = tmp_path_factory.mktemp("corpus")
    for i, doc in enumerate(CORPUS.split("\n\n")):
        (root / f"doc{i:02d}.txt").write_text(doc)
    return root


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


def test_ctrl_c_saves_a_checkpoint(corpus, tmp_path):
    """The first SIGINT finishes the current step, checkpoints and stops; --resume continues from there."""
    trainer = Trainer(_args(corpus, tmp_path))
    step = trainer.train_step

    def interrupted_step():
        metrics = step()
        if trainer.step == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return metrics

    trainer.train_step = interrupted_step
    summary = trainer.run()
    assert summary["step"] == 2 and not summary["finished"]
    assert latest_checkpoint(tmp_path).name == "step_0000002"


def test_activation_checkpointing_changes_nothing(corpus, tmp_path):
    """Recomputing activations in backward gives the same weights and QB statistics (tokens counted once)."""
    train(_args(corpus, tmp_path / "plain", steps=3))
    train(_args(corpus, tmp_path / "ckpt", steps=3, activation_checkpointing=True))
    a, b = _weights(tmp_path / "plain"), _weights(tmp_path / "ckpt")
    assert all(torch.allclose(a[k], b[k], atol=1e-6, rtol=0) for k in a)


@pytest.mark.parametrize("bad", [{"steps": None}, {"steps": 0}, {"minutes": 1.0}, {"schedule": "linear"}])
def test_bad_arguments(corpus, tmp_path, bad):
    with pytest.raises(ValueError):
        _args(corpus, tmp_path, **bad)


def test_time_budget_ends_the_run(corpus, tmp_path):
    """--minutes: the schedule is sized after the first step; the run ends evaluated, checkpointed and exported."""
    summary = train(_args(corpus, tmp_path, steps=None, minutes=0.1))
    assert summary["finished"] and summary["step"] >= 2
    assert (tmp_path / "model" / "model.safetensors").is_file()
    last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == summary["step"] and "val_loss" in last
