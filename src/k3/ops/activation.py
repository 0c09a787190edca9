"""SiTU-GLU, the gated activation of every K3 text FFN (docs/architecture.md §6.1).

`situ_glu_reference` is the formula in torch ops; `situ_glu` runs it as one compiled pass each way (forward, and a
hand-derived backward that recomputes tanh and σ; `activation_kernel.cpp`, docs/architecture.md §0.6) for fp32
CPU tensors where the kernel could be built, and the reference for everything else.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from k3.ops import compiled
from k3.ops.precision import fp32


def situ_glu_reference(gate: torch.Tensor, up: torch.Tensor, beta1: float, beta2: float | None) -> torch.Tensor:
    """SiTU-GLU(g, u) = β₁·tanh(g/β₁)·σ(g) · β₂·tanh(u/β₂), in fp32, cast back (§6.1).

    β₂ = None leaves the up branch uncapped. Inputs are pre-activations in the activation dtype.
    """
    g, u = fp32(gate), fp32(up)
    a = beta1 * torch.tanh(g / beta1) * torch.sigmoid(g)
    if beta2 is not None:
        u = beta2 * torch.tanh(u / beta2)
    return (a * u).to(gate.dtype)


class SiTUGLUFunction(torch.autograd.Function):
    """`situ_glu_reference` on the compiled kernel; saves only g and u."""

    @staticmethod
    def forward(ctx, gate, up, beta1, beta2):
        gate, up = gate.contiguous(), up.contiguous()
        ctx.save_for_backward(gate, up)
        ctx.betas = beta1, 0.0 if beta2 is None else beta2  # the kernel reads β₂ ≤ 0 as uncapped
        return compiled.load("activation").forward(gate, up, *ctx.betas)

    @staticmethod
    @once_differentiable
    def backward(ctx, dh):
        gate, up = ctx.saved_tensors
        dgate, dup = compiled.load("activation").backward(gate, up, dh.contiguous(), *ctx.betas)
        return dgate, dup, None, None


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta1: float, beta2: float | None) -> torch.Tensor:
    """SiTU-GLU(g, u) of §6.1 (see `situ_glu_reference`): compiled for fp32 CPU tensors, the reference otherwise."""
    compiled_applies = (gate.shape == up.shape and (beta2 is None or beta2 > 0)
                        and compiled.serves("activation", gate, up))
    if not compiled_applies:
        return situ_glu_reference(gate, up, beta1, beta2)
    if not (torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad)):  # inference: no autograd node
        return compiled.load("activation").forward(gate.contiguous(), up.contiguous(), beta1,
                                                   0.0 if beta2 is None else beta2)
    return SiTUGLUFunction.apply(gate, up, beta1, beta2)
