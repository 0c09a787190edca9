"""Shared fixtures: the spec §12.2 tiny conformance configuration and a parameter randomiser.

The factories are exposed as fixtures returning callables so that test modules never import this file.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conformance import build_tiny_config

# Every tensor in the suite is tiny: intra-op threads only add overhead, and on a loaded 2-core machine they
# oversubscribe the CPU (a 0.03 s forward of the §12.2 model took 1–3 s with 2 threads under load).
torch.set_num_threads(1)

@torch.no_grad()
def randomize_parameters(model: nn.Module, seed: int = 0) -> nn.Module:
    """Move every parameter off its symmetric default (spec §12.2), in place, deterministically.

    RMSNorm gains 1 + 0.2·N, KDA dt_bias 0.5·N and A_log 0.3·N, router bias 0.1·N, AttnRes pseudo-queries
    0.1·N (so every mix is non-trivial: logits s = Σ_c key·γ·w have a std of ≈ 0.8 at hidden 64).
    """
    from k3.model.kda import KimiDeltaAttention
    from k3.model.moe import MoEGate
    from k3.model.norm import RMSNorm

    gen = torch.Generator().manual_seed(seed)

    def randn_like(t: torch.Tensor) -> torch.Tensor:
        return torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.dtype)

    for name, module in model.named_modules():
        if isinstance(module, RMSNorm):
            module.weight.copy_(1 + 0.2 * randn_like(module.weight))
        elif isinstance(module, KimiDeltaAttention):
            module.dt_bias.copy_(0.5 * randn_like(module.dt_bias))
            module.A_log.copy_(0.3 * randn_like(module.A_log))
        elif isinstance(module, MoEGate):
            module.e_score_correction_bias.copy_(0.1 * randn_like(module.e_score_correction_bias))
        if name.endswith("_res_proj"):
            module.weight.copy_(0.1 * randn_like(module.weight))
    return model


@pytest.fixture
def tiny_config():
    """Factory: the §12.2 conformance config, with optional field overrides."""
    return build_tiny_config


@pytest.fixture
def randomize():
    """Factory: randomise norm gains, dt_bias, A_log, router biases and AttnRes pseudo-queries in place."""
    return randomize_parameters


@pytest.fixture
def tiny_model():
    """Factory: a randomised fp32 K3ForCausalLM on the §12.2 config (eval mode)."""
    from k3.model import K3ForCausalLM

    def make(seed: int = 0, **overrides) -> "K3ForCausalLM":
        torch.manual_seed(seed)
        model = K3ForCausalLM(build_tiny_config(**overrides))
        return randomize_parameters(model, seed).eval()

    return make
