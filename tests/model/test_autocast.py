"""Under a caller's bf16 `torch.autocast`, the parts §0.4 keeps in fp32 stay fp32: the router's scores and choices,
the KDA core, the norms' statistics and the AttnRes mix equal their fp32 results on the same inputs (CPU autocast;
the torch ops, which autocast reaches, as well as the compiled kernels)."""

from __future__ import annotations

import pytest
import torch

from k3.ops import compiled

BF16_AUTOCAST = dict(device_type="cpu", dtype=torch.bfloat16)


@pytest.fixture(params=["compiled", "torch ops"])
def kernels(request, monkeypatch):
    if request.param == "torch ops":
        monkeypatch.setattr(compiled, "build", lambda name: (None, "off for this test"))
        monkeypatch.setattr(compiled, "load", lambda name: None)
    return request.param


def both(fn):
    """fn() without and with a bf16 autocast."""
    with torch.no_grad():
        plain = fn()
        with torch.autocast(**BF16_AUTOCAST):
            autocast = fn()
    return plain, autocast


def test_router_decisions_and_weights_stay_fp32(tiny_model, kernels):
    gate = tiny_model(seed=1).model.layers[1].block_sparse_moe.gate
    x = torch.randn(64, gate.weight.shape[1], generator=torch.Generator().manual_seed(2))
    (idx, w), (idx_ac, w_ac) = both(lambda: gate(x))
    assert w_ac.dtype == torch.float32 and torch.equal(idx_ac, idx) and torch.equal(w_ac, w)


def test_kda_core_stays_fp32(tiny_model, kernels):
    from k3.model.kda import KimiDeltaAttention
    from k3.ops.kda import delta_rule

    model = tiny_model(seed=3)
    kda = next(m for m in model.modules() if isinstance(m, KimiDeltaAttention))
    x = torch.randn(2, 21, model.config.hidden_size, generator=torch.Generator().manual_seed(4))
    B, T, H, K = 2, 21, kda.config.kda_num_heads, kda.config.kda_head_dim
    g = torch.Generator().manual_seed(5)
    q, k = (torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(B, T, H, K, generator=g)
    decay = -torch.rand(B, T, H, K, generator=g)
    beta = torch.rand(B, T, H, generator=g)
    (o, state), (o_ac, state_ac) = both(lambda: delta_rule(q, k, v, decay, beta, None, True))
    assert o_ac.dtype == torch.float32 and torch.equal(o_ac, o) and torch.equal(state_ac, state)
    _, autocast = both(lambda: kda(x))  # the whole layer runs under autocast (its projections in bf16)
    assert torch.isfinite(autocast).all()


def test_norm_statistics_and_attn_res_mix_stay_fp32(tiny_model, kernels):
    from k3.model.attn_res import attn_res_mix, attn_res_weights
    from k3.ops.norm import l2_normalize, rms_normalize

    g = torch.Generator().manual_seed(6)
    x = torch.randn(3, 7, 64, generator=g) * 3
    for normalize in (rms_normalize, l2_normalize):
        plain, autocast = both(lambda: normalize(x, 1e-6))
        assert autocast.dtype == torch.float32 and torch.equal(autocast, plain)
    norm, proj = _first_mix(tiny_model(seed=7).model.layers[2])
    with torch.no_grad():
        proj.weight.normal_(generator=g)
    sources = [torch.randn(2, 5, norm.weight.shape[0], generator=g) for _ in range(4)]
    for mix in (attn_res_mix, attn_res_weights):
        plain, autocast = both(lambda: mix(sources, norm, proj))
        assert autocast.dtype == torch.float32 and torch.equal(autocast, plain)


def _first_mix(layer):
    """A (RMSNorm, Linear(D, 1)) pair of the layer's AttnRes mixes."""
    names = dict(layer.named_modules())
    for name, module in names.items():
        if name.endswith("_res_norm") and name.replace("_res_norm", "_res_proj") in names:
            return module, names[name.replace("_res_norm", "_res_proj")]
    raise AssertionError("no AttnRes mix in the layer")
