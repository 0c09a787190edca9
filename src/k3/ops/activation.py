"""SiTU-GLU, the gated activation of every K3 text FFN (docs/architecture.md §6.1)."""

from __future__ import annotations

import torch

from k3.ops.precision import fp32


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta1: float, beta2: float | None) -> torch.Tensor:
    """SiTU-GLU(g, u) = β₁·tanh(g/β₁)·σ(g) · β₂·tanh(u/β₂), in fp32, cast back (§6.1).

    β₂ = None leaves the up branch uncapped. Inputs are pre-activations in the activation dtype.
    """
    g, u = fp32(gate), fp32(up)
    a = beta1 * torch.tanh(g / beta1) * torch.sigmoid(g)
    if beta2 is not None:
        u = beta2 * torch.tanh(u / beta2)
    return (a * u).to(gate.dtype)
