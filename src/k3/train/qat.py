"""Quantisation-aware training of the routed experts in MXFP4, as K3's were trained (docs/architecture.md §11.5).

`apply_mxfp4_qat(model)` turns every layer's routed experts into `MXFP4QATRoutedExperts` in place (same parameters,
same checkpoint names, dense fp32 master weights): their forward uses the weights as the MXFP4 export will store
them (`k3.ops.mxfp4.fake_quantize`, the export's own encoder) and the gradient passes straight through to the dense
weights. A model trained so and exported with `k3 export --experts mxfp4` computes what it computed in training.
Applied from outside the model, like expert parallelism.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from k3.config import K3Config
from k3.model.moe import RoutedExperts
from k3.ops.mxfp4 import GROUP_SIZE, fake_quantize


class MXFP4QATRoutedExperts(RoutedExperts):
    """`RoutedExperts` whose forward reads its weights MXFP4-rounded (straight-through gradient)."""

    def _rounded(self) -> SimpleNamespace:
        return SimpleNamespace(config=self.config, **{n: fake_quantize(getattr(self, n)) for n in ("w1", "w3", "w2")})

    def expert(self, e: int, z: torch.Tensor) -> torch.Tensor:
        return RoutedExperts.expert(self._rounded(), e, z)

    def sorted_experts(self, z_AL: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        return RoutedExperts.sorted_experts(self._rounded(), z_AL, counts_E)


def check_mxfp4_widths(config: K3Config) -> None:
    """ValueError unless the routed experts' input widths (latent and expert width) are multiples of 32."""
    widths = {"routed_expert_hidden_size": config.routed_expert_hidden_size,
              "moe_intermediate_size": config.moe_intermediate_size}
    bad = [f"{name} = {width}" for name, width in widths.items() if width % GROUP_SIZE]
    if bad:
        raise ValueError(f"MXFP4 experts need widths divisible by {GROUP_SIZE}: {', '.join(bad)}")


def apply_mxfp4_qat(model: nn.Module) -> int:
    """Every dense `RoutedExperts` of `model` trained MXFP4-aware (class changed in place); returns how many."""
    layers = [m for m in model.modules() if type(m) is RoutedExperts and isinstance(m.w1, nn.Parameter)]
    for experts in layers:
        check_mxfp4_widths(experts.config)
        experts.__class__ = MXFP4QATRoutedExperts
    return len(layers)
