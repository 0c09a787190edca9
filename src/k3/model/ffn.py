"""The configured gated activation and the SiTU MLP used by the dense layer 0 and the shared experts (docs/architecture.md §6.1, §6.2, §6.5)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from k3.config import K3Config
from k3.ops.activation import situ_glu
from k3.ops.matvec import Linear


def glu_activation(config: K3Config, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The configured gated activation: SiTU-GLU (K3) or SwiGLU (`hidden_act = "silu"`)."""
    if config.hidden_act == "silu":
        return F.silu(gate) * up
    return situ_glu(gate, up, config.activation_situ_beta, config.activation_situ_linear_beta)


class SiTUMLP(nn.Module):
    """y = down_proj(SiTU-GLU(gate_proj x, up_proj x)): dense FFN of layer 0, and the merged shared experts."""

    def __init__(self, config: K3Config, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.config = config
        self.gate_proj = Linear(hidden_size, intermediate_size)
        self.up_proj = Linear(hidden_size, intermediate_size)
        self.down_proj = Linear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(glu_activation(self.config, self.gate_proj(x), self.up_proj(x)))
