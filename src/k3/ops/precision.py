"""Parameters that stay float32 whatever the model dtype (docs/architecture.md §0.4)."""

from __future__ import annotations

import contextlib

import torch
from torch import nn


HALF_DTYPES = (torch.float16, torch.bfloat16)

FP32_TENSORS = ("A_log", "dt_bias", "q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight", "o_norm.weight",
                "e_score_correction_bias")
"""Tensors stored and used in fp32 whatever the model dtype (§0.4): KDA `A_log`, `dt_bias`, the three
short-conv weights and `o_norm` (only KDA has an `o_norm`), and the router's `e_score_correction_bias`."""


def is_fp32_tensor(name: str) -> bool:
    """Whether the tensor `name` (a local, internal or official checkpoint name) is in the fp32 set."""
    return any(name == t or name.endswith("." + t) for t in FP32_TENSORS)


def fp32(x: torch.Tensor) -> torch.Tensor:
    """x for an "in fp32" computation of §0.4: half precision is upcast, fp32 and float64 are kept (so a
    float64 model is a true float64 reference)."""
    return x.float() if x.dtype in HALF_DTYPES else x


class KeepFP32(nn.Module):
    """Base for modules whose tensors in the fp32 set (`is_fp32_tensor`) never drop below fp32 (`.to(bf16)`,
    `.half()`). A float64 cast is allowed (float64 reference runs in tests)."""

    def pin_fp32(self) -> None:
        """Upcast the pinned tensors if they are in half precision (call at the end of `__init__`)."""
        for name, t in [*self.named_parameters(), *self.named_buffers()]:
            if is_fp32_tensor(name) and t.dtype in HALF_DTYPES:
                t.data = t.data.float()

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.pin_fp32()
        return self



def without_autocast(device: torch.device):
    """A context with autocast off on `device` (a no-op where it is off already): the products that §0.4 keeps in
    fp32 — the router, the KDA core, the norms' statistics, the AttnRes mix — stay fp32 inside a caller's
    `torch.autocast` too, which would run them in bf16 (6 of 64 k3-tiny tokens routed differently; the KDA core's
    backward met bf16 gradients beside fp32 operands). Costs one check where autocast is off."""
    try:
        enabled = torch.is_autocast_enabled(device.type)
    except RuntimeError:  # a device type autocast does not know (meta): nothing to turn off
        enabled = False
    return torch.autocast(device.type, enabled=False) if enabled else contextlib.nullcontext()
