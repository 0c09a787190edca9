"""Parameters that stay float32 whatever the model dtype (spec §0.4)."""

from __future__ import annotations

import torch
from torch import nn


class KeepFP32(nn.Module):
    """Base for modules whose tensors named in `fp32_names` stay fp32 through `.to(dtype)` / `.bfloat16()`.

    Spec §0.4: KDA `A_log`, `dt_bias`, conv weights and `o_norm`, and the router's `e_score_correction_bias`
    are stored and used in fp32 even when the rest of the model runs in bf16.
    """

    fp32_names: tuple[str, ...] = ()

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        tensors = dict(self.named_parameters()) | dict(self.named_buffers())
        for name in self.fp32_names:
            t = tensors[name]
            if t.is_floating_point() and t.dtype != torch.float32:
                t.data = t.data.float()
        return self
