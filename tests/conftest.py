"""Shared fixtures: the docs/architecture.md §12.2 tiny conformance configuration and a parameter randomiser.

The factories are exposed as fixtures returning callables so that test modules never import this file.
"""

from __future__ import annotations

import pytest
import torch

from conformance import build_tiny_config, randomize_parameters, set_runtime

# Every tensor in the suite is tiny: intra-op threads only add overhead, and on a loaded 2-core machine they
# oversubscribe the CPU (a 0.03 s forward of the §12.2 model took 1–3 s with 2 threads under load).
torch.set_num_threads(1)


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
    """Factory: a randomised fp32 K3ForCausalLM on the §12.2 config (eval mode); config field overrides, and the
    runtime choices of `conformance.set_runtime` (kda_impl, moe_impl, mla_decode)."""
    from k3.model import K3ForCausalLM

    def make(seed: int = 0, kda_impl: str | None = None, moe_impl: str | None = None, mla_decode: str | None = None,
             **overrides) -> "K3ForCausalLM":
        torch.manual_seed(seed)
        model = K3ForCausalLM(build_tiny_config(**overrides))
        return set_runtime(randomize_parameters(model, seed).eval(), kda_impl, moe_impl, mla_decode)

    return make
