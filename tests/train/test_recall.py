"""The pass-key recall task: prompts, batches, training, the K2 form, and `k3 eval recall`."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from k3.cli import EXIT_INTERRUPTED, main
from k3.config import K3Config
from k3.model import K3ForCausalLM
from k3.train.args import TrainArgs
from k3.train.recall import (CHANCE, FILLER, KEY_DIGITS, RecallTask, _generator, evaluate_recall, form_of,
                             make_prompt, min_prompt_length, parse_depths, parse_lengths, training_example)

# a narrower k3-tiny keeps the runs fast
SMALL = ["--override", "hidden_size=64", "--override", "intermediate_size=96", "--override", "num_experts=4",
         "--override", "num_experts_per_token=2", "--override", "num_hidden_layers=5"]


def _text(ids: torch.Tensor) -> str:
    return bytes(ids.tolist()).decode()


@pytest.mark.parametrize("length,depth", [(40, 0.0), (40, 1.0), (301, 0.37), (min_prompt_length(), 0.5)])
def test_prompt_layout(length, depth):
    """Filler letters, the needle `KEY=dddd;` at the depth, `?KEY=` last; distinct digits; exact length."""
    ids, key = make_prompt(length, depth, _generator(0, 0, length))
    text = _text(ids)
    assert len(ids) == length and text.endswith("?KEY=") and text.count("KEY=") == 2
    assert len(key) == KEY_DIGITS == len(set(key)) and key.isdigit()
    at = text.index("KEY=")
    filler = text[:at] + text[at + 9:-5]
    assert text[at:at + 9] == f"KEY={key};" and set(filler) <= set(FILLER.decode())
    assert at == round(depth * len(filler))
    assert CHANCE == 1 / 5040


def test_prompts_are_reproducible_and_streams_differ():
    a = make_prompt(200, 0.5, _generator(3, 0, 7))
    assert torch.equal(a[0], make_prompt(200, 0.5, _generator(3, 0, 7))[0])
    assert not torch.equal(a[0], make_prompt(200, 0.5, _generator(3, 1, 7))[0])
    assert not torch.equal(a[0], make_prompt(200, 0.5, _generator(4, 0, 7))[0])


@pytest.mark.parametrize("length,depth,message", [(10, 0.5, "at least 15 tokens"), (100, 1.5, "depth must be in")])
def test_bad_prompts(length, depth, message):
    with pytest.raises(ValueError, match=message):
        make_prompt(length, depth, _generator(0, 0, 0))


def test_training_rows_score_the_key_only():
    row = training_example(96, seed=0, stream=0, index=5)
    ids, labels = row["input_ids"], row["labels"]
    assert ids.shape == labels.shape == (96,)
    assert _text(ids[-KEY_DIGITS - 5:-KEY_DIGITS]) == "?KEY="
    key = _text(ids[-KEY_DIGITS:])
    assert f"KEY={key};" in _text(ids[:-KEY_DIGITS - 5])
    assert labels[:-KEY_DIGITS].eq(-100).all() and torch.equal(labels[-KEY_DIGITS:], ids[-KEY_DIGITS:])


def test_task_batches_rows_and_state():
    config = K3Config.from_preset("k3-tiny")
    task = RecallTask(config, seq_len=64, batch_size=4, seed=1)
    whole = task.next_batch()
    assert whole["input_ids"].shape == (4, 64) and task.state_dict() == {"position": 4}
    other = RecallTask(config, seq_len=64, batch_size=4, seed=1)
    assert torch.equal(other.next_batch(slice(2, 4))["input_ids"], whole["input_ids"][2:])  # a rank's rows
    other.load_state_dict({"position": 0})
    assert torch.equal(other.next_batch()["input_ids"], whole["input_ids"])
    held_out = next(task.val_batches())["input_ids"]
    assert not (held_out[:, None] == whole["input_ids"][None]).all(-1).any()  # never a training row
    assert task.counted_tokens(None, whole).all()


@pytest.mark.parametrize("kwargs,message", [(dict(seq_len=18), "--seq-len >= 19"),
                                            (dict(vocab_size=100), "vocab_size 100 is below 128")])
def test_task_refuses(kwargs, message):
    config = K3Config.from_preset("k3-tiny", **{k: v for k, v in kwargs.items() if k == "vocab_size"})
    with pytest.raises(ValueError, match=message):
        RecallTask(config, seq_len=kwargs.get("seq_len", 64), batch_size=2, seed=0)


def test_parse_lengths_and_depths():
    assert parse_lengths("2k, 8K,1m,100") == [2048, 8192, 1048576, 100]
    assert parse_depths("0,0.5,1") == [0.0, 0.5, 1.0]
    for text, message in (("2x", "'2x' is not a length"), ("5", "shorter than a recall prompt")):
        with pytest.raises(ValueError, match=message):
            parse_lengths(text)
    for text, message in (("a", "'a' is not a number"), ("1.5", "outside")):
        with pytest.raises(ValueError, match=message):
            parse_depths(text)


def test_evaluation_cells_and_shared_prompts():
    """Every (length, depth) cell scores its samples; two evaluations with one seed see the same keys."""
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.from_preset("k3-tiny", hidden_size=64, num_hidden_layers=5))
    cells = evaluate_recall(model, [48, 32], [0.0, 1.0], samples=3, seed=2)
    assert [(c.length, c.depth) for c in cells] == [(32, 0.0), (32, 1.0), (48, 0.0), (48, 1.0)]
    assert all(c.samples == 3 and 0 <= c.hits <= 3 and len(c.answers) == 3 for c in cells)
    again = evaluate_recall(model, [32], [0.0], samples=3, seed=2)
    assert again[0].keys == cells[0].keys and again[0].answers == cells[0].answers
    assert evaluate_recall(model, [32], [0.0], samples=3, seed=3)[0].keys != cells[0].keys
    marked = dataclasses.replace(cells[0], answers=["kept"] * 3)
    reused = evaluate_recall(model, [32], [0.0, 1.0], samples=3, seed=2, known=[marked])
    assert reused[0] is marked and reused[1].answers == cells[1].answers
    assert evaluate_recall(model, [32], [0.0], samples=2, seed=2, known=[marked])[0].answers != ["kept"] * 3


def test_k2_form_option():
    assert TrainArgs(steps=1, k2_forms=["attention"]).k2_forms == ("attention",)
    with pytest.raises(ValueError, match="--k2-form: 'rope' is not a K3 innovation"):
        TrainArgs(steps=1, k2_forms=("rope",))


def test_train_both_forms_then_eval_recall(tmp_path, capsys, monkeypatch):
    """`k3 train --task recall` in the K3 and the K2 form, then `k3 eval recall` of both: table, JSON, plot."""
    runs = {}
    for name, extra in (("k3", []), ("k2", ["--k2-form", "attention"])):
        out = tmp_path / name
        assert main(["train", "--task", "recall", "--steps", "3", "--seq-len", "48", "--batch-size", "4",
                     "--eval-every", "3", "--out", str(out), *SMALL, *extra]) == 0
        printed = capsys.readouterr().out
        assert "validation loss" in printed and "guessing distinct digits 2.131" in printed
        history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert 0 <= history[-1]["recall_accuracy"] <= 1
        runs[name] = out / "model"
    k2 = K3Config.from_json(runs["k2"])
    assert k2.layer_types == ["mla"] * 5 and not k2.mla_use_nope and not k2.mla_use_output_gate
    assert form_of(k2) == "RoPE MLA in all 5 layers"
    assert form_of(K3Config.from_json(runs["k3"])) == "3 KDA + 2 NoPE MLA layers"
    report_dir = tmp_path / "eval"
    assert main(["eval", "recall", str(runs["k3"]), str(runs["k2"]), "--lengths", "48,96", "--depths", "0,1",
                 "--samples", "2", "--out", str(report_dir)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert sum("tokens  depth" in line for line in lines) == 8 and lines[-1].startswith("wrote")
    report = json.loads((report_dir / "recall.json").read_text())
    assert set(report) == {"k3", "k2"} and report["k3"]["train_length"] == 48
    assert [(c["length"], c["depth"]) for c in report["k2"]["cells"]] == [(48, 0.0), (48, 1.0), (96, 0.0), (96, 1.0)]
    assert (report_dir / "recall.png").stat().st_size > 0
    assert main(["eval", "recall", str(runs["k3"]), "--lengths", "48,64", "--depths", "0,1", "--samples", "2",
                 "--out", str(report_dir)]) == 0  # adds 64 to k3's cells, keeps the rest and k2's
    lines = capsys.readouterr().out.splitlines()
    assert sum("tokens  depth" in line for line in lines) == 2 and "2 cells kept from" in lines[-2]
    again = json.loads((report_dir / "recall.json").read_text())
    assert again["k2"] == report["k2"] and again["k3"]["cells"][:2] == report["k3"]["cells"][:2]
    assert [c["length"] for c in again["k3"]["cells"]] == [48, 48, 64, 64, 96, 96]
    stopped = tmp_path / "stopped"  # Ctrl-C during the second cell: the first is on disk, and a rerun keeps it
    calls = []

    def interrupted(model, prompts_BT):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return ["0000"] * len(prompts_BT)

    monkeypatch.setattr("k3.train.recall.greedy_keys", interrupted)
    assert main(["eval", "recall", str(runs["k2"]), "--lengths", "48", "--depths", "0,1", "--samples", "2",
                 "--out", str(stopped)]) == EXIT_INTERRUPTED
    capsys.readouterr()
    assert [c["depth"] for c in json.loads((stopped / "recall.json").read_text())["k2"]["cells"]] == [0.0]
    monkeypatch.undo()
    assert main(["eval", "recall", str(runs["k2"]), "--lengths", "48", "--depths", "0,1", "--samples", "2",
                 "--out", str(stopped)]) == 0
    assert "1 cells kept from" in capsys.readouterr().out
    (report_dir / "recall.json").write_text("{\"k3\": {\"model\": 1}}")
    assert main(["eval", "recall", str(runs["k3"]), "--out", str(report_dir)]) == 2
    assert "recall.json: not a recall report of `k3 eval recall` ('k3' has no cells" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["eval", "recall", "{missing}"], "does not exist"),
    (["eval", "recall", "{missing}", "--lengths", "2k,zz"], "--lengths: 'zz' is not a length"),
    (["eval", "recall", "{missing}", "--depths", "2"], "--depths: 2 is outside [0, 1]"),
    (["eval", "recall", "{missing}", "--samples", "0"], "--samples"),
    (["train", "--task", "recall", "--steps", "2", "--k2-form", "rope", "--out", "{missing}"], "--k2-form"),
])
def test_bad_recall_command_lines(argv, message, tmp_path, capsys):
    argv = [a.format(missing=tmp_path / "nope") for a in argv]
    try:
        status = main(argv)
    except SystemExit as e:  # argparse's own usage errors (exit status 2, one line too)
        status = e.code
    assert status == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
