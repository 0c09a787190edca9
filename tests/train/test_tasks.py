"""The shapes captioning task: batches, training through the trainer, resume, `k3 generate --image`."""

from __future__ import annotations

import json

import pytest
import torch

from k3.cli import main
from k3.config import K3Config
from k3.model import K3ForConditionalGeneration
from k3.train.shapes import caption, render, scene_for
from k3.train.tasks import ShapesTask, shapes_tokenizer
from k3.train.trainer import TrainArgs, train

# a smaller text backbone than k3-tiny-vl keeps these tests fast; the vision tower is the preset's
SMALL = {"hidden_size": 64, "intermediate_size": 96, "num_experts": 4, "moe_intermediate_size": 32,
         "routed_expert_hidden_size": 32}


@pytest.fixture(scope="module")
def tokenizer():
    return shapes_tokenizer(400)


@pytest.fixture(scope="module")
def task(tokenizer):
    config = K3Config.from_preset("k3-tiny-vl")
    return ShapesTask(config, batch_size=3, seed=0, eval_images=4, tokenizer=tokenizer)


def test_batch_layout(task):
    """Left-padded rows: framing + one placeholder + `caption:` + caption + end token; loss on the caption only."""
    batch = task.next_batch()
    ids, labels, mask = batch["input_ids"], batch["labels"], batch["attention_mask"]
    tok = task.tokenizer
    assert (ids == tok.media_pad_token_id).sum(1).tolist() == [1, 1, 1]
    assert batch["grid_thws"].shape == (3, 3) and batch["pixel_values"].shape[1:] == (3, 14, 14)
    for b in range(3):
        real = ids[b, mask[b].bool()].tolist()
        assert real[0] == tok.token_to_id("<|media_begin|>") and real[-1] == tok.eos_token_id
        target = labels[b][labels[b] != -100].tolist()
        scene = scene_for(0, b)  # training stream of seed 0, example b
        assert tok.decode(target[:-1]) == " " + caption(scene)
        assert real[-len(target):] == target  # labels sit on the caption's own positions
    assert task.state_dict() == {"position": 3}
    assert not torch.equal(task.next_batch()["input_ids"], ids)  # the stream moves on


def test_validation_loss_batches_are_limited_by_eval_batches(tokenizer):
    config = K3Config.from_preset("k3-tiny-vl")
    sizes = {n: [b["input_ids"].shape[0] for b in ShapesTask(config, batch_size=3, seed=0, eval_images=7,
                                                              tokenizer=tokenizer, eval_batches=n).val_batches()]
             for n in (None, 2, 5)}
    assert sizes == {None: [3, 3, 1], 2: [3, 3], 5: [3, 3, 1]}


def test_held_out_images_are_not_training_images(task):
    held_out = [img.tobytes() for img, _ in task._held_out]
    trained = [render(scene_for(0 * 2 + 0, i)).tobytes() for i in range(50)]
    assert not set(held_out) & set(trained)


def test_tokenizer_must_match_the_config(tokenizer):
    config = K3Config.from_preset("k3-tiny-vl")
    config = config.replace(multimodal={**config.multimodal, "media_placeholder_token_id": 391})
    with pytest.raises(ValueError, match="media_placeholder_token_id"):
        ShapesTask(config, batch_size=2, seed=0, tokenizer=tokenizer)


def test_train_resume_and_caption_cli(tmp_path, capsys):
    """`k3 train --task shapes` runs, resumes bit-exactly, exports a multimodal checkpoint that
    `k3 generate --image` captions."""
    base = dict(task="shapes", steps=4, batch_size=3, eval_every=2, eval_images=4, checkpoint_every=100,
                overrides=SMALL)
    straight = train(TrainArgs(out=str(tmp_path / "a"), **base))
    train(TrainArgs(out=str(tmp_path / "b"), stop_after=2, **base))
    resumed = train(TrainArgs(out=str(tmp_path / "b"), resume=True, **base))
    assert straight["final_val_loss"] == resumed["final_val_loss"]
    assert 0 <= straight["caption_accuracy"] <= 1 and straight["chance_accuracy"] == pytest.approx(1 / 276)
    model_dir = tmp_path / "a" / "model"
    assert (model_dir / "preprocessor_config.json").is_file() and (model_dir / "tiktoken.model").is_file()
    examples = tmp_path / "a" / "examples"
    assert (examples / "examples.png").is_file() and (examples / "held_out_3.png").is_file()
    assert len((examples / "captions.txt").read_text().splitlines()) == 4  # eval_images = 4
    assert json.loads((model_dir / "config.json").read_text())["architectures"] == ["KimiK3ForConditionalGeneration"]
    metrics = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert "caption_accuracy" in metrics[0] and "caption_accuracy" in metrics[-1]

    image = tmp_path / "shape.png"
    render(scene_for(7, 0)).save(image)
    capsys.readouterr()
    assert main(["generate", str(model_dir), "--image", str(image), "--prompt", "caption:", "--temperature", "0",
                 "--max-new-tokens", "5"]) == 0
    printed = capsys.readouterr().out
    # the CLI's greedy caption is the task's own greedy caption of the same image
    model = K3ForConditionalGeneration.from_pretrained(model_dir).eval()
    task = ShapesTask(model.config, batch_size=1, seed=0, eval_images=1)
    from PIL import Image

    expected = task.captions(model, [Image.open(image)], max_new_tokens=5)[0]
    assert printed.startswith("caption:") and expected in printed
    assert main(["generate", str(model_dir), "--image", str(tmp_path / "missing.png"), "--prompt", "x"]) == 2
    assert "cannot read image" in capsys.readouterr().err


def test_each_task_has_its_own_batch_and_rate():
    """Unset, --batch-size, --lr and --min-lr-ratio take the task's tuned values (docs/demo.md); given,
    they are kept."""
    shapes = TrainArgs(task="shapes", steps=1).for_new_run()
    assert ((shapes.preset, shapes.batch_size, shapes.lr, shapes.lr_scale, shapes.min_lr_ratio)
            == ("k3-tiny-vl", 32, 0.0025, {}, 0.3))
    text = TrainArgs(steps=1).for_new_run()
    assert (text.preset, text.batch_size, text.lr, text.min_lr_ratio) == ("k3-tiny", 16, 0.03, 0.1)
    mine = TrainArgs(task="shapes", steps=1, batch_size=8, lr=0.001, min_lr_ratio=0.0).for_new_run()
    assert (mine.batch_size, mine.lr, mine.min_lr_ratio) == (8, 0.001, 0.0)
