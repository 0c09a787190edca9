"""The K3 training loop (docs/architecture.md §7.6 order of operations, §8.7 schedule).

One step: forward every micro-batch (routing with the installed router biases, Quantile Balancing statistics,
per-head MLA max logits) → backward → gradient clipping → Muon + AdamW step → QK-Clip → QB solve and install →
metrics, evaluation, checkpoint. Runs resume bit-exactly from their last checkpoint (`k3.train.checkpoint`).

The loss of a step is the mean over every scored token of the global batch: each micro-batch's backward takes
its summed token loss and the gradients are divided by the step's token count afterwards — the same numbers on
one process and on N (docs/architecture.md, "Scale-out"). Under torchrun (`distributed` given) the model is
sharded by `k3.parallel.parallelize` (expert parallelism, then FSDP2), every rank takes its rows of the same
global batch, and the step's reductions are global: token count and loss, the gradient norm over every mesh,
the MLA max logits (QK-Clip), the Quantile Balancing histograms, a non-finite loss and a stop request on any
rank. Evaluation and the AttnRes probe are collective forwards; rank 0 alone writes metrics, plots and the
exported model; checkpoints are sharded (DCP).

A resume keeps the run's options unless told otherwise and refuses changes that would make it another run
(`RESUME_FIXED`); a larger `steps` extends it (the schedule is recomputed for the new length). A damaged
checkpoint is skipped for the previous one. The first SIGINT or SIGTERM checkpoints after the current step and
stops; a checkpoint that cannot be written (a full disk) keeps the previous one.
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
import sys
import time
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from k3.config import K3Config, k2_overrides, summarize
from k3.fileio import atomic_directory, atomic_write, check_writable_directory, describe_error, \
    remove_stale_temporaries
from k3.model.k3 import CausalLMOutput, K3Model
from k3.model.observer import attach, detach
from k3.ops.loss import IGNORE_INDEX, next_token_loss
from k3.optim import MaxLogitRecorder, cosine_with_warmup, make_optimizers, mla_layers, qk_clip_, set_lr, wsd
from k3.parallel.context import apply_context_parallel, shard_batch, whole_sequences
from k3.parallel.distributed import Distributed, rank_rows
from k3.parallel.fsdp import gathered, parallelize
from k3.parallel.grads import clip_grad_norm_, scale_grads_
from k3.train.args import TrainArgs, describe_change
from k3.train.signals import StopRequest
from k3.train.balance import QuantileBalancer
from k3.train.checkpoint import (
    LOAD_ERRORS,
    DamagedCheckpoint,
    IncompatibleResume,
    checkpoint_candidates,
    is_sharded,
    latest_checkpoint,
    load_sharded_state,
    load_training_state,
    read_training_state,
    save_sharded_checkpoint,
    save_training_checkpoint,
    weights_file,
)
from k3.train.export import export_checkpoint
from k3.train.qat import apply_mxfp4_qat
from k3.train.corpus import check_data_path
from k3.train.tasks import TASKS
from k3.train import plots


class TrainingDiverged(RuntimeError):
    """A non-finite loss: the run stops and its last good checkpoint is kept."""


class SaveFailed(OSError):
    """A checkpoint or the exported model could not be written (a full disk, a lost permission); the message
    says what is kept."""


class Trainer:
    """One training run in `args.out`: a fresh one, or (`args.resume`) the continuation of the run there.

    Before anything expensive it checks the options, the schedule's length, the corpus path and that `out` is a
    writable directory. A resume starts from the newest loadable checkpoint (`checkpoint_candidates`): a damaged
    one is reported with its file and skipped, with a warning. Each resume is recorded in the run's `resumes`
    (checkpoint state and summary): its step, the checkpoint, the skipped ones and the options changed.

    `distributed` (from `k3.parallel.init_distributed`, under torchrun): this process's place in the job; None
    for one process.
    """

    def __init__(self, args: TrainArgs, distributed: Distributed | None = None):
        self.out = Path(args.out)
        if self.out.exists() and not self.out.is_dir():
            raise ValueError(f"--out {str(self.out)!r} is a file, not a run directory")
        self.dist = distributed
        self.main = distributed is None or distributed.is_main
        self.device = distributed.device if distributed else torch.device("cuda" if torch.cuda.is_available()
                                                                          else "cpu")
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
            self._warn(f"{self.out} has {free / 1e6:,.1f} MB free, less than a checkpoint and the exported model need "
                  f"(about {needed / 1e6:,.1f} MB): saves will fail unless space is freed")

    def _preflight(self) -> None:
        """The cheap checks, before the model is built or loaded and the data read."""
        a = self.args
        if a.steps is not None:
            self._check_schedule(a.steps)
        if a.stop_after is not None and a.steps is not None and a.stop_after > a.steps:
            raise ValueError(f"--stop-after {a.stop_after} is beyond the end of the schedule (--steps {a.steps})")
        problems = self.args.parallel_problems(self.dist, self.device)
        if problems:
            raise ValueError("; ".join(problems))
        if a.data is not None:
            try:
                check_data_path(a.data)
            except (OSError, ValueError) as e:
                raise ValueError(f"--data: {describe_error(e)}") from None
        if self.main:  # one writer of the run directory
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
        if args.k2_forms:
            config = K3Config.from_preset(args.preset, **args.overrides | k2_overrides(config, args.k2_forms))
        self._build(task.model_class(config).to(self.device))
        self.step, self.total_steps, self.history, self.resumes = 0, args.steps, [], []

    def _build(self, model) -> None:
        """Set up the model's run: the task (its data; built once), the parallel layout (torchrun), optimisers
        and balancer."""
        args = self.args
        self.model, self.config = model, model.config
        (self.backbone,) = [m for m in self.model.modules() if isinstance(m, K3Model)]
        self.backbone.gradient_checkpointing = args.activation_checkpointing
        if self.task is None:
            self.task = TASKS[args.task].from_args(self.config, args)
        if args.mxfp4_experts:
            apply_mxfp4_qat(self.model)
        if self.dist is not None:
            parallelize(self.model, self.dist, args.reshard_after_forward, args.cpu_offload,
                        mixed_precision=self.device.type == "cuda")  # bf16 all-gathers, fp32 reduction
            if self.dist.cp > 1:
                apply_context_parallel(self.model, self.dist.cp_mesh.get_group("cp"))
        self.optimizers = make_optimizers(
            self.model, self.config, lr=args.lr, weight_decay=args.weight_decay, per_head_scope=args.muon_per_head,
            lr_scale=args.lr_scale, ns_dtype=torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.balancer = QuantileBalancer(self.model, method=args.balancer)

    def _resume(self, args: TrainArgs, candidates: list[Path]) -> None:
        skipped: list[DamagedCheckpoint] = []
        for path in candidates:
            try:
                state = self._load(args, path)
                break
            except DamagedCheckpoint as e:
                skipped.append(e)
                self._warn(f"checkpoint {path.name} is damaged: {e}"
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
            message += "; changed: " + ", ".join(describe_change(k, old, new) for k, (old, new) in self.changes.items())
        if self.step >= self.total_steps:
            message += " (the run is complete; a larger --steps extends it)"
        if "steps" in self.changes:
            message += (f" (the {self.args.schedule} schedule is now {self.total_steps} steps long: the learning "
                        f"rate continues from step {self.step} as if the run had been planned that long)")
        if self.main:
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
            config = K3Config.from_json(path)
        except LOAD_ERRORS as e:
            raise DamagedCheckpoint(path, "config.json", e) from None
        if is_sharded(path):  # shards of a torchrun job: any layout reads them
            self._build(task.model_class(config).to(self.device))
            state = load_sharded_state(path, self.model, list(self.optimizers))
        else:
            try:
                model = task.model_class.from_pretrained(path)
            except LOAD_ERRORS as e:
                raise DamagedCheckpoint(path, weights_file(path), e) from None
            self._build(model.to(self.device))
            state = load_training_state(path, list(self.optimizers), self.model)
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

    def _warn(self, message: str) -> None:
        if self.main:  # one copy of each message in a torchrun job
            tqdm.write(f"warning: {message}", file=sys.stderr)

    # ------------------------------------------------------------------------------- collectives (torchrun)
    def _all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """`t` reduced over every rank (unchanged on one process)."""
        if self.dist is not None:
            t = t.to(self.device)
            dist.all_reduce(t, op=op)
        return t

    def _any_rank(self, *flags: bool) -> list[bool]:
        """Each flag OR-ed over the ranks (every rank then takes the same decision)."""
        return [bool(f) for f in self._all_reduce(torch.tensor(flags, dtype=torch.int32), dist.ReduceOp.MAX)]

    def _global_max_logits(self) -> dict[int, torch.Tensor]:
        """This step's per-head MLA max logits, the maximum over every rank's tokens (QK-Clip, §8.6)."""
        local = self.max_logits.pop()
        if self.dist is None or not local:
            return local
        layers = sorted(local)
        stacked = self._all_reduce(torch.stack([local[i] for i in layers]), dist.ReduceOp.MAX)
        return dict(zip(layers, stacked.to(local[layers[0]].device)))

    def _next_batch(self) -> dict[str, torch.Tensor]:
        """This rank's rows of the next global batch (all of it on one process)."""
        rows = slice(None) if self.dist is None else \
            rank_rows(self.args.batch_size, self.dist.data_size, self.dist.data_rank)
        batch = self.task.next_batch(rows)
        if self.dist is not None and self.dist.cp > 1:  # this rank's share of every sequence
            batch = shard_batch(batch, self.dist.rank % self.dist.cp, self.dist.cp)
        return {k: v.to(self.device) for k, v in batch.items()}

    def _forward(self, batch: dict[str, torch.Tensor]) -> CausalLMOutput:
        """The model's output and loss on a batch; a context-parallel share is scored on its `targets` (its last
        position on the next share's first token)."""
        if "targets" not in batch:
            return self.model(**batch)
        targets_BT = batch["targets"]
        out = self.model(batch["input_ids"], document_ids=batch.get("document_ids"))
        return CausalLMOutput(logits=out.logits, loss=next_token_loss(out.logits, targets_BT),
                              loss_tokens=(targets_BT != IGNORE_INDEX).sum())

    # ------------------------------------------------------------------------------------------- the step
    def train_step(self) -> dict:
        a, model = self.args, self.model
        model.train()
        lr = self._lr(self.step)
        set_lr(self.optimizers, lr)
        started = time.perf_counter()
        sums = torch.zeros(3, dtype=torch.float64)  # summed token loss, scored tokens, tokens the router counted
        for _ in range(a.grad_accum):
            batch = self._next_batch()
            counted = self.task.counted_tokens(model, batch)
            self.balancer.set_token_mask(counted)
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
                out = self._forward(batch)
            summed = out.loss * out.loss_tokens  # divided by the global token count below, after backward
            summed.backward()
            sums += torch.stack([summed.detach().double(), out.loss_tokens.double(), counted.sum().double()]).cpu()
        loss_sum, scored, tokens = self._all_reduce(sums).tolist()
        if not math.isfinite(loss_sum):  # on any rank: the reduced sum is not finite on every rank
            raise TrainingDiverged(f"non-finite loss at step {self.step}; the last good checkpoint is "
                                   f"{latest_checkpoint(self.out)}")
        scale_grads_(model.parameters(), 1.0 / max(scored, 1.0))
        grad_norm = clip_grad_norm_(model.parameters(), a.clip)
        for opt in self.optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        max_logits = self._global_max_logits()
        gammas = qk_clip_(self.mla, max_logits, a.qk_clip_tau)
        max_logit = max((float(m.max()) for m in max_logits.values()), default=0.0)
        self.last_load_XE = torch.stack([layer.load_E.float() for layer in self.balancer.layers])
        balance = self.balancer.step()
        self.step += 1
        seconds = time.perf_counter() - started
        vio = [m.max_vio for m in balance.values()]
        return {"step": self.step, "loss": loss_sum / max(scored, 1.0), "lr": lr, "grad_norm": float(grad_norm),
                "tokens_per_s": tokens / seconds, "seconds": seconds, "max_vio": max(vio),
                "max_vio_per_layer": vio, "mla_max_logit": max_logit,
                "qk_clipped_heads": sum(int((g < 1).sum()) for g in gammas.values())}

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Token-weighted mean validation loss over the task's evaluation batches (`eval_batches` of them; router
        biases frozen), the number of tokens it scored, and the task's own metrics (caption accuracy for
        shapes). Under torchrun every rank evaluates the same batches (the forwards are collective), whole
        sequences under context parallelism too; rank 0's numbers are reported."""
        self.model.eval()
        total, count = 0.0, 0
        with whole_sequences(self.model):
            for batch in self.task.val_batches():
                out = self.model(**{k: v.to(self.device) for k, v in batch.items()})
                n = int(out.loss_tokens)  # the targets the loss kept (none across a document boundary)
                total, count = total + out.loss.item() * n, count + n
            return {"val_loss": total / max(count, 1), "val_tokens": count, **self.task.evaluate(self.model)}

    # ------------------------------------------------------------------------------------------ the run
    def save(self, final: bool = True) -> Path | None:
        """Checkpoint the run, then rewrite metrics.jsonl and the plots. When the checkpoint cannot be written
        (a full disk: any OSError) its partial files are removed and the previous checkpoints kept; a periodic
        save (`final=False`) then warns and training goes on (the next checkpoint tries again), a final one
        raises SaveFailed. Returns the checkpoint, or None after such a warning."""
        save = save_training_checkpoint if self.dist is None else save_sharded_checkpoint
        try:
            path = save(self.out, self.step, self.model, self.task, list(self.optimizers),
                        {"total_steps": self.total_steps, "data": self.task.state_dict(), "history": self.history,
                         "args": asdict(self.args), "resumes": self.resumes})
        except OSError as e:
            last = latest_checkpoint(self.out)
            message = (f"the checkpoint of step {self.step} could not be written ({describe_error(e)}); its "
                       f"partial files are removed and the last checkpoint is {last or 'none'}")
            if not final:
                self._warn(f"{message}; training goes on and tries again at the next checkpoint")
                return None
            raise SaveFailed(message) from e
        mixing = self._attn_res_mixing()  # a collective forward: every rank, before rank 0 writes
        if not self.main:
            return path
        try:
            self._write_metrics()
            self.plot(mixing)
        except OSError as e:
            self._warn(f"metrics.jsonl and plots not written ({describe_error(e)}); the checkpoint {path} is saved")
        return path

    def _write_metrics(self) -> None:
        """metrics.jsonl mirrors the history up to the last checkpoint (rewritten atomically; rank 0)."""
        if self.main:
            atomic_write(self.out / "metrics.jsonl", "".join(json.dumps(m) + "\n" for m in self.history))

    def _attn_res_mixing(self) -> tuple[torch.Tensor, list[str]] | None:
        """The AttnRes mixing table of the model on the task's probe batch; None without Block AttnRes."""
        if not self.config.use_block_attn_res:
            return None
        self.model.eval()
        probe = {k: v.to(self.device) for k, v in self.task.probe_batch().items()}
        with whole_sequences(self.model):
            if self.dist is None:
                return plots.attn_res_mixing(self.model, probe)
            return plots.attn_res_mixing(self.model, probe, lambda: gathered(self.model))

    def plot(self, mixing: tuple[torch.Tensor, list[str]] | None = None) -> None:
        plots.plot_losses(self.history, self.out / "loss.png", references=self.task.references)
        if hasattr(self, "last_load_XE"):
            load_XE = self.last_load_XE / self.last_load_XE.mean(dim=1, keepdim=True)
            plots.plot_expert_load(load_XE.cpu(), self.out / "expert_load.png")
        mixing = mixing or self._attn_res_mixing()
        if mixing is not None:
            plots.plot_attn_res(*mixing, self.out / "attn_res.png")

    def export(self) -> Path:
        """The final model + tokenizer (+ processor) as a plain checkpoint directory `out/model` (for
        `k3 generate`), staged and renamed into place (an earlier export is replaced whole), then the task's
        report. SaveFailed if it cannot be written; the final checkpoint is saved by then."""
        path = self.out / "model"
        try:
            if self.dist is not None:  # from the final checkpoint, on rank 0
                error = None
                if self.main:
                    try:
                        export_checkpoint(latest_checkpoint(self.out), path)
                    except OSError as e:
                        error = e
                if self._any_rank(error is not None)[0]:
                    raise error or OSError("rank 0 could not export the model")
                self.task.report(self.model, self.out if self.main else None)
                return path
            with atomic_directory(path) as staged:
                self.model.save_pretrained(staged)
                self.task.save(staged)
            self.task.report(self.model, self.out)
        except OSError as e:
            raise SaveFailed(f"the model could not be exported to {path} ({describe_error(e)}); the final "
                             f"checkpoint {latest_checkpoint(self.out)} is saved: `k3 train --resume --out "
                             f"{self.out}` exports it again") from e
        return path

    def _fit_schedule(self, deadline: float, eval_seconds: float) -> None:
        """--minutes: set the schedule's length so that it ends at the deadline at the pace measured so far.

        Called after steps 1, 2, 4, 8, … and after every evaluation, so the length follows the machine's real
        speed (the first step pays one-time costs; a machine may speed up or slow down): the pace is the median
        of the last 16 step times (step 1 only while it is the only one), evaluations every `eval_every` steps
        count at the time the first one took, and 5 % of the remaining budget is kept for checkpoints and the
        export. Every rank gets the shortest length of all ranks. The step that sees the deadline passed ends
        the run in any case."""
        times = [m["seconds"] for m in self.history if "seconds" in m]
        pace = statistics.median(times[1:][-16:] or times)
        remaining = 0.95 * (deadline - time.monotonic())
        fitted = self.step + int(remaining / (pace + eval_seconds / self.args.eval_every))
        fitted = int(self._all_reduce(torch.tensor(fitted), dist.ReduceOp.MIN))  # one length for all ranks
        self.total_steps = self._shortest_schedule(max(self.step + 1, fitted))

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
            with StopRequest() as stop:
                if sized_here:  # the first step runs at lr 0 whatever the length (§8.7): fitted after it
                    self.total_steps = 10**9
                bar = tqdm(total=self.total_steps, initial=self.step, desc="train", dynamic_ncols=True,
                           disable=not self.main)
                finished = self.step >= self.total_steps
                while not finished:
                    metrics = self.train_step()
                    # the schedule's end (or the budget that sized it) ends the run; a signal, --stop-after or
                    # the --minutes budget of a resumed run pause it (a signal or the clock of any rank: all)
                    signalled, out_of_time = self._any_rank(
                        stop.requested, deadline is not None and time.monotonic() > deadline)
                    finished = self.step >= self.total_steps or (out_of_time and sized_here)
                    stopped_by = None if finished else (stop.signal or "SIGTERM") if signalled else (
                        "--stop-after" if self.step == a.stop_after else "--minutes" if out_of_time else None)
                    if self.step % a.eval_every == 0 or finished:
                        metrics.update(self.evaluate())
                    self.history.append(metrics)
                    if sized_here and not finished and (self.step & (self.step - 1) == 0 or "val_loss" in metrics):
                        self._fit_schedule(deadline, eval_seconds)
                        bar.total = self.total_steps
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
                "val_tokens": last_eval.get("val_tokens"),
                "reference_losses": self.task.references, "caption_accuracy": last_eval.get("caption_accuracy"),
                "eval_images": self.args.eval_images, "chance_accuracy": getattr(self.task, "chance", None),
                "resumes": self.resumes, "model_dir": str(self.export()) if finished else None,
                "checkpoint": str(latest_checkpoint(self.out))}


_OUT_FILES = ("metrics.jsonl", "loss.png", "expert_load.png", "attn_res.png", "model", "write-probe")
"""What a run writes atomically into `out` (only their temporaries are removed there: `out` may hold other files)."""


def train(args: TrainArgs, distributed: Distributed | None = None) -> dict:
    return Trainer(args, distributed).run()
