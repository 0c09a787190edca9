"""Parameters that stay float32 whatever the model dtype (spec §0.4)."""

from __future__ import annotations

import torch
from torch import nn


HALF_DTYPES = (torch.float16, torch.bfloat16)


def fp32(x: torch.Tensor) -> torch.Tensor:
    """x for an "in fp32" computation of spec §0.4: half precision is upcast, fp32 and float64 are kept (so a
    float64 model is a true float64 reference)."""
    return x.float() if x.dtype in HALF_DTYPES else x


class KeepFP32(nn.Module):
    """Base for modules whose tensors named in `fp32_names` never drop below fp32 (`.to(bf16)`, `.half()`).

    Spec §0.4: KDA `A_log`, `dt_bias`, conv weights and `o_norm`, and the router's `e_score_correction_bias`
    are stored and used in fp32 even when the rest of the model runs in bf16. A float64 cast is allowed
    (float64 reference runs in tests).
    """

    fp32_names: tuple[str, ...] = ()

    def pin_fp32(self) -> None:
        """Upcast the pinned tensors if they are in half precision (call at the end of `__init__`)."""
        tensors = dict(self.named_parameters()) | dict(self.named_buffers())
        for name in self.fp32_names:
            t = tensors[name]
            if t.dtype in HALF_DTYPES:
                t.data = t.data.float()

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.pin_fp32()
        return self
