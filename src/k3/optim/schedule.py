"""Learning-rate schedules: K3's cosine with linear warm-up, and WSD (docs/architecture.md §8.7).

`step` t counts the optimiser steps already taken (0 for the first step). Both schedules are proportional to
`peak_lr`, so with `peak_lr=1.0` they are `torch.optim.lr_scheduler.LambdaLR` factors:

    LambdaLR(optimizer, functools.partial(cosine_with_warmup, total_steps=T, peak_lr=1.0))

scales each group's initial lr; `set_lr` instead writes one absolute lr into every group of several optimisers
(Muon and AdamW share the schedule, §8.5), times the group's own `lr_scale` where it has one (§8.8).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


def cosine_with_warmup(step: int, total_steps: int, peak_lr: float, min_lr_ratio: float = 0.1,
                       warmup_frac: float = 0.01) -> float:
    """K3's schedule (§8.7): with t_w = max(1, round(warmup_frac·T)) warm-up steps,

        lr = peak·t/t_w                                           for t < t_w,
        lr = min + ½(peak − min)(1 + cos(π (t − t_w)/(T − t_w)))   for t_w ≤ t ≤ T,  min = min_lr_ratio·peak,

    and min after T.
    """
    warmup = max(1, round(warmup_frac * total_steps))
    if total_steps <= warmup:
        raise ValueError(f"total_steps={total_steps} must exceed the {warmup} warm-up steps")
    if step < warmup:
        return peak_lr * step / warmup
    return _cosine(min(step, total_steps) - warmup, total_steps - warmup, peak_lr, min_lr_ratio * peak_lr)


def wsd(step: int, total_steps: int, peak_lr: float, warmup_steps: int, decay_frac: float = 0.1,
        min_lr_ratio: float = 0.1, decay: str = "cosine") -> float:
    """Warm-up / stable / decay (§8.7, K2's schedule): peak·t/warmup_steps while t < warmup_steps, then
    peak until the decay phase, which covers the last round(decay_frac·T) steps and ends at
    min = min_lr_ratio·peak at t = T ("cosine": half cosine; "linear": straight line); min after T."""
    if decay not in ("cosine", "linear"):
        raise ValueError(f"decay must be 'cosine' or 'linear', got {decay!r}")
    decay_steps = round(decay_frac * total_steps)
    decay_start = total_steps - decay_steps
    if not 0 <= warmup_steps <= decay_start or decay_steps < 1:
        raise ValueError(f"need 0 <= warmup_steps ({warmup_steps}) <= decay start ({decay_start}) and at least "
                         f"one decay step (decay_frac={decay_frac}, total_steps={total_steps})")
    if step < warmup_steps:
        return peak_lr * step / warmup_steps
    if step < decay_start:
        return peak_lr
    t, min_lr = min(step, total_steps) - decay_start, min_lr_ratio * peak_lr
    if decay == "linear":
        return peak_lr - (peak_lr - min_lr) * t / decay_steps
    return _cosine(t, decay_steps, peak_lr, min_lr)


def _cosine(t: int, length: int, peak_lr: float, min_lr: float) -> float:
    """Half cosine from peak (t = 0) to min (t = length)."""
    return min_lr + 0.5 * (peak_lr - min_lr) * (1 + math.cos(math.pi * t / length))


def set_lr(optimizers: Iterable[torch.optim.Optimizer], lr: float) -> None:
    """Write `lr` into every param group of every optimiser (call before each step with the schedule's value),
    times the group's "lr_scale" (1 where it has none)."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)
