"""Long-range recall: a pass key hidden in filler, asked for at the end (`k3 train --task recall`,
`k3 eval recall`; docs/long-context.md, "Recall").

A prompt of T byte tokens (`byte_pair_tokenizer`: every ASCII character is one token) is filler of random
lowercase letters with the needle `KEY=dddd;` inserted at a depth (the fraction of the filler before it) and the
question `?KEY=` closing it; the answer is the key's 4 digits. The digits are distinct, so each one names the
next: copying the key needs an induction match on content (find the earlier `=`, then the earlier copy of the
digit just written), never a count of positions. Filler holds no digit, `=` or `?`. Chance of guessing a key:
1 / (10 · 9 · 8 · 7) = 1 / 5,040.

Examples are generated on the fly from (seed, stream, index), so a run's data is its seed and its position;
held-out prompts come from another stream and are never trained on.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from k3.config import K3Config
from k3.fileio import describe_error
from k3.inference import generate
from k3.model import K3ForCausalLM
from k3.ops.loss import IGNORE_INDEX
from k3.tokenizer import K3Tokenizer, byte_pair_tokenizer
from k3.train.checkpoint import LOAD_ERRORS, latest_checkpoint, read_training_state

FILLER = b"abcdefghijklmnopqrstuvwxyz"
NEEDLE, QUESTION = "KEY=", "?KEY="
KEY_DIGITS = 4
CHANCE = 1 / math.perm(10, KEY_DIGITS)
TRAIN_STREAM, HELD_OUT_STREAM, EVAL_STREAM = 0, 1, 2
PREFILL_CHUNK = 8192  # prompt positions per prefill call of the evaluation: its working memory
EVAL_ROW_TOKENS = 65536  # prompts of one (length, depth) cell decoded together up to this many tokens


def needle_length() -> int:
    """Tokens of `KEY=dddd;`."""
    return len(NEEDLE) + KEY_DIGITS + 1


def min_prompt_length() -> int:
    """The shortest prompt: the needle, the question and one filler token."""
    return needle_length() + len(QUESTION) + 1


def _generator(seed: int, stream: int, index: int) -> torch.Generator:
    """The random stream of example `index` of `stream` (train, held out, evaluation) under `seed`: a hash of the
    three, as torch's CPU generator keeps only 32 bits of its seed."""
    digest = hashlib.blake2b(f"{seed}/{stream}/{index}".encode(), digest_size=4).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little"))


def make_prompt(length: int, depth: float, generator: torch.Generator) -> tuple[torch.Tensor, str]:
    """[length] token ids of one prompt (byte ids) with its needle at `depth` of the filler, and the key."""
    if length < min_prompt_length():
        raise ValueError(f"a recall prompt needs at least {min_prompt_length()} tokens, got {length}")
    if not 0 <= depth <= 1:
        raise ValueError(f"depth must be in [0, 1], got {depth!r}")
    key = "".join(str(int(d)) for d in torch.randperm(10, generator=generator)[:KEY_DIGITS])
    filler_len = length - needle_length() - len(QUESTION)
    letters = torch.tensor(list(FILLER))
    filler = letters[torch.randint(len(FILLER), (filler_len,), generator=generator)]
    at = round(depth * filler_len)
    needle = torch.tensor(list(f"{NEEDLE}{key};".encode()))
    question = torch.tensor(list(QUESTION.encode()))
    return torch.cat([filler[:at], needle, filler[at:], question]), key


def key_ids(key: str) -> torch.Tensor:
    return torch.tensor(list(key.encode()))


def training_example(seq_len: int, seed: int, stream: int, index: int) -> dict[str, torch.Tensor]:
    """One row of `seq_len` tokens: a prompt at a uniform depth followed by its key; labels on the key only."""
    g = _generator(seed, stream, index)
    depth = float(torch.rand((), generator=g))
    prompt, key = make_prompt(seq_len - KEY_DIGITS, depth, g)
    ids = torch.cat([prompt, key_ids(key)])
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[-KEY_DIGITS:] = ids[-KEY_DIGITS:]
    return {"input_ids": ids, "labels": labels}


def batch_of(examples: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([e[k] for e in examples]) for k in examples[0]}


@torch.no_grad()
def greedy_keys(model: K3ForCausalLM, prompts_BT: torch.Tensor) -> list[str]:
    """The model's greedy 4-token answers to `prompts_BT`, decoded as text (chunked prefill, then the caches)."""
    device = next(model.parameters()).device
    out = generate(model, prompts_BT.to(device), KEY_DIGITS, temperature=0, prefill_chunk=PREFILL_CHUNK)
    return ["".join(chr(i) if 32 <= i < 127 else "\N{MIDDLE DOT}" for i in row)  # any id an untrained model emits
            for row in out[:, -KEY_DIGITS:].tolist()]


class RecallTask:
    """Train a K3 (or K2-form) model to recall a pass key at `seq_len` tokens (`--task recall`)."""

    name = "recall"
    model_class = K3ForCausalLM
    default_preset = "k3-tiny"
    default_batch_size = 16
    default_lr = 0.01
    default_lr_scale: dict[str, float] = {}
    default_min_lr_ratio = 0.1

    def __init__(self, config: K3Config, *, seq_len: int, batch_size: int, seed: int, eval_batches: int | None = None,
                 eval_prompts: int = 64):
        if seq_len < min_prompt_length() + KEY_DIGITS:
            raise ValueError(f"--task recall needs --seq-len >= {min_prompt_length() + KEY_DIGITS} (the needle, "
                             f"the question and the key), got {seq_len}")
        if config.vocab_size < 128:
            raise ValueError(f"--task recall writes ASCII byte tokens; the model's vocab_size {config.vocab_size} "
                             "is below 128")
        self.seq_len, self.batch_size, self.seed, self.position = seq_len, batch_size, seed, 0
        self.tokenizer: K3Tokenizer = byte_pair_tokenizer(config.vocab_size)
        self.eval_prompts = eval_prompts
        self.eval_batches = eval_batches
        self.references = {"guessing distinct digits": -sum(math.log(1 / (10 - i)) for i in range(KEY_DIGITS))
                           / KEY_DIGITS}
        self.chance = CHANCE

    @classmethod
    def from_args(cls, config: K3Config, args) -> RecallTask:
        if args.data is not None:
            raise ValueError("--data is for the text task; the recall task generates its own prompts")
        return cls(config, seq_len=args.seq_len, batch_size=args.batch_size, seed=args.seed,
                   eval_batches=args.eval_batches)

    def next_batch(self, rows: slice = slice(None)) -> dict[str, torch.Tensor]:
        """The next batch of the stream, or its `rows`."""
        start, self.position = self.position, self.position + self.batch_size
        return batch_of([training_example(self.seq_len, self.seed, TRAIN_STREAM, i)
                         for i in range(start, self.position)[rows]])

    @staticmethod
    def counted_tokens(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Every position is real (no padding)."""
        return torch.ones_like(batch["input_ids"], dtype=torch.bool)

    def val_batches(self) -> Iterator[dict[str, torch.Tensor]]:
        """Held-out rows at the training length (`eval_batches` batches; default 4)."""
        for b in range(self.eval_batches or 4):
            yield batch_of([training_example(self.seq_len, self.seed, HELD_OUT_STREAM, b * self.batch_size + i)
                            for i in range(self.batch_size)])

    def evaluate(self, model) -> dict[str, float]:
        """Exact-match recall of `eval_prompts` held-out keys at the training length, greedy."""
        model.eval()
        prompts, keys = [], []
        for i in range(self.eval_prompts):
            row = training_example(self.seq_len, self.seed, HELD_OUT_STREAM, 10**6 + i)
            prompts.append(row["input_ids"][:-KEY_DIGITS])
            keys.append(bytes(row["input_ids"][-KEY_DIGITS:].tolist()).decode())
        hits = 0
        for start in range(0, len(prompts), 32):
            answers = greedy_keys(model, torch.stack(prompts[start:start + 32]))
            hits += sum(a == k for a, k in zip(answers, keys[start:start + 32]))
        return {"recall_accuracy": hits / len(prompts)}

    def report(self, model, directory: Path | None) -> None:
        """Nothing beyond the run's plots (`k3 eval recall` measures lengths and depths)."""

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])

    def probe_batch(self) -> dict[str, torch.Tensor]:
        """2 held-out rows cut to 64 tokens, for the AttnRes mixing plot."""
        return {"input_ids": next(self.val_batches())["input_ids"][:2, -64:]}

    def save(self, directory: Path) -> None:
        self.tokenizer.save(directory)


# ------------------------------------------------------------------------------------------- evaluation

_LENGTH = re.compile(r"^(\d+)([km]?)$")


def parse_lengths(text: str) -> list[int]:
    """`2k,8k,1m` → [2048, 8192, 1048576] (k = 1,024, m = 1,048,576); ValueError naming a bad entry."""
    lengths = []
    for item in text.split(","):
        m = _LENGTH.match(item.strip().lower())
        if not m:
            raise ValueError(f"--lengths: {item.strip()!r} is not a length (e.g. 2048, 8k, 1m)")
        n = int(m.group(1)) * {"": 1, "k": 1024, "m": 1024 * 1024}[m.group(2)]
        if n < min_prompt_length():
            raise ValueError(f"--lengths: {item.strip()} is shorter than a recall prompt ({min_prompt_length()} "
                             "tokens)")
        lengths.append(n)
    return lengths


def parse_depths(text: str) -> list[float]:
    """`0,0.5,1` → [0.0, 0.5, 1.0]; ValueError naming an entry outside [0, 1]."""
    depths = []
    for item in text.split(","):
        try:
            d = float(item)
        except ValueError:
            raise ValueError(f"--depths: {item.strip()!r} is not a number") from None
        if not 0 <= d <= 1:
            raise ValueError(f"--depths: {item.strip()} is outside [0, 1] (the fraction of the filler before the "
                             "needle)")
        depths.append(d)
    return depths


@dataclass
class RecallCell:
    length: int
    depth: float
    hits: int
    samples: int
    seconds: float
    answers: list[str] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)

    @property
    def accuracy(self) -> float:
        return self.hits / self.samples


def evaluate_recall(model: K3ForCausalLM, lengths: Sequence[int], depths: Sequence[float], samples: int,
                    seed: int = 0, on_cell: Callable[[RecallCell], object] | None = None,
                    known: Sequence[RecallCell] = ()) -> list[RecallCell]:
    """Greedy exact-match recall of `samples` fresh prompts per (length, depth), longest lengths last; every model
    sees the same prompts for the same seed. A cell of `known` (measured earlier with this seed) with as many
    samples is kept, not measured again; `on_cell` is called after each cell measured."""
    model.eval()
    kept = {(c.length, c.depth): c for c in known if c.samples == samples}
    cells = []
    for length in sorted(lengths):
        for depth in depths:
            if (length, depth) in kept:
                cells.append(kept[length, depth])
                continue
            started = time.perf_counter()
            g = _generator(seed, EVAL_STREAM, length * 1001 + round(depth * 1000))  # one stream per cell
            made = [make_prompt(length, depth, g) for _ in range(samples)]
            rows = max(1, EVAL_ROW_TOKENS // length)
            answers = []
            for start in range(0, samples, rows):
                answers += greedy_keys(model, torch.stack([p for p, _ in made[start:start + rows]]))
            keys = [k for _, k in made]
            cell = RecallCell(length, depth, sum(a == k for a, k in zip(answers, keys)), samples,
                              time.perf_counter() - started, answers, keys)
            cells.append(cell)
            if on_cell is not None:
                on_cell(cell)
    return cells


def form_of(config: K3Config) -> str:
    """The sequence mixing of a model in words: K3's hybrid or K2's RoPE MLA everywhere."""
    mla = sum(t == "mla" for t in config.layer_types)
    mixing = f"{'NoPE' if config.mla_use_nope else 'RoPE'} MLA"
    if mla == config.num_hidden_layers:
        return f"{mixing} in all {mla} layers"
    return f"{config.num_hidden_layers - mla} KDA + {mla} {mixing} layers"


def run_of(model_dir: str | os.PathLike) -> tuple[str, int | None]:
    """A label for a model directory and the sequence length it was trained at: a run's `model/` is named after
    the run, its length read from the run's newest checkpoint (None when it is not a run's or unreadable)."""
    path = Path(model_dir).resolve()
    if path.name != "model" or latest_checkpoint(path.parent) is None:
        return path.name, None
    try:
        return path.parent.name, int(read_training_state(latest_checkpoint(path.parent))["args"]["seq_len"])
    except LOAD_ERRORS:
        return path.parent.name, None


def recall_report(config: K3Config, model_dir: str | os.PathLike, train_length: int | None, seed: int,
                  cells: Sequence[RecallCell]) -> dict:
    """One model's results as JSON: where it came from, its form, the prompts' seed and every cell."""
    return {"model": str(model_dir), "form": form_of(config), "train_length": train_length, "seed": seed,
            "cells": [{**asdict(c), "accuracy": c.accuracy} for c in cells]}


def cells_of(entry: dict) -> list[RecallCell]:
    """The cells of one model's `recall_report` entry."""
    return [RecallCell(**{f: c[f] for f in RecallCell.__dataclass_fields__}) for c in entry["cells"]]


def read_recall_report(path: str | os.PathLike) -> dict:
    """An earlier `recall.json` ({} when there is none); ValueError naming the file when it cannot be read."""
    if not os.path.exists(path):
        return {}
    try:
        report = json.loads(Path(path).read_text())
        for label, entry in report.items():
            missing = {"model", "form", "train_length", "seed", "cells"} - set(entry)
            if missing:
                raise ValueError(f"{label!r} has no {', '.join(sorted(missing))}")
            cells_of(entry)
        return report
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path}: not a recall report of `k3 eval recall` ({describe_error(e)}); move it away or "
                         "choose another --out") from None


def merged_cells(earlier: Sequence[RecallCell], measured: Sequence[RecallCell]) -> list[RecallCell]:
    """Earlier cells at (length, depth)s not measured now, and the measured ones, by length then depth."""
    now = {(c.length, c.depth) for c in measured}
    return sorted([c for c in earlier if (c.length, c.depth) not in now] + list(measured),
                  key=lambda c: (c.length, c.depth))
