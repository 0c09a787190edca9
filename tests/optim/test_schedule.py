"""Learning-rate schedules (docs/architecture.md §8.7)."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from k3.optim import Muon, cosine_with_warmup, set_lr, wsd

PEAK = 2e-4


def test_cosine_with_warmup():
    """Linear warm-up from 0 to peak over 1 % of the steps, then a half cosine from peak down to 0.1·peak at T,
    monotone after warm-up, min after T."""
    T = 1000
    lr = [cosine_with_warmup(t, T, PEAK) for t in range(T + 5)]
    assert lr[0] == 0 and lr[5] == pytest.approx(PEAK / 2) and lr[10] == pytest.approx(PEAK)
    assert all(a < b for a, b in zip(lr[:10], lr[1:11]))
    assert all(a >= b for a, b in zip(lr[10:], lr[11:]))
    assert lr[10 + 495] == pytest.approx(0.55 * PEAK)  # halfway through the cosine: (peak + min) / 2
    assert lr[T] == pytest.approx(0.1 * PEAK) and lr[T + 4] == pytest.approx(0.1 * PEAK)
    t = 300
    assert lr[t] == pytest.approx(0.1 * PEAK + 0.45 * PEAK * (1 + math.cos(math.pi * (t - 10) / 990)))


def test_cosine_warmup_is_at_least_one_step():
    assert cosine_with_warmup(0, 20, PEAK) == 0 and cosine_with_warmup(1, 20, PEAK) == PEAK
    with pytest.raises(ValueError):
        cosine_with_warmup(0, 1, PEAK)


@pytest.mark.parametrize("decay", ["cosine", "linear"])
def test_wsd(decay):
    """Warm-up, a constant plateau at peak, then the decay over the last 20 % of the steps to min."""
    T, warmup = 500, 50
    lr = [wsd(t, T, PEAK, warmup, decay_frac=0.2, decay=decay) for t in range(T + 3)]
    assert lr[0] == 0 and lr[25] == pytest.approx(PEAK / 2)
    assert all(v == PEAK for v in lr[warmup:400])
    assert all(a > b for a, b in zip(lr[400:T], lr[401:T + 1]))
    assert lr[T] == pytest.approx(0.1 * PEAK) and lr[T + 2] == pytest.approx(0.1 * PEAK)
    assert lr[450] == pytest.approx(0.55 * PEAK)  # halfway through the decay, both shapes
    if decay == "linear":
        assert lr[425] == pytest.approx(0.775 * PEAK)


def test_schedules_drive_optimizers():
    """As a LambdaLR factor (peak 1) the schedule scales each group's base lr; `set_lr` writes absolute lrs."""
    W = torch.nn.Parameter(torch.zeros(4, 4))
    muon = Muon([W], lr=PEAK)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        muon, functools.partial(cosine_with_warmup, total_steps=200, peak_lr=1.0))
    for t in range(1, 6):
        W.grad = torch.ones(4, 4)
        muon.step()
        scheduler.step()
        assert muon.param_groups[0]["lr"] == pytest.approx(cosine_with_warmup(t, 200, PEAK))
    adamw = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], lr=1.0)
    set_lr([muon, adamw], 1e-5)
    assert muon.param_groups[0]["lr"] == adamw.param_groups[0]["lr"] == 1e-5
