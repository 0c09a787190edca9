"""Gated NoPE MLA (expanded form) against a per-head loop written from docs/architecture.md §4.2 (also §0.5, §4.6)."""

from __future__ import annotations

import math

import pytest
import torch

from conformance import spread_weights_
from k3.config import K3Config
from k3.model.mla import GatedMLA


def make_mla(config: K3Config, seed: int = 0) -> GatedMLA:
    """A GatedMLA with N(0, 0.15²) weights and random norm gains (no symmetric defaults, §12.2)."""
    torch.manual_seed(seed)
    return spread_weights_(GatedMLA(config))


def mla_reference(m: GatedMLA, x: torch.Tensor, eps: float = 1e-6, scale: float | None = None,
                  gate: bool = True) -> torch.Tensor:
    """Spec §4.2 steps 1–10 in float64, one head at a time, explicit causal mask."""
    cfg = m.config
    H, N, R, Vh, C = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                      cfg.kv_lora_rank)
    x = x.double()
    T = x.shape[1]

    def w(lin):
        return lin.weight.double()

    def rms(v, gain):
        return gain.double() * v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + eps)

    c_q = rms(x @ w(m.q_a_proj).t(), m.q_a_layernorm.weight)  # 1
    q = c_q @ w(m.q_b_proj).t()  # 2: per head [q_nope | q_pe]
    a = x @ w(m.kv_a_proj_with_mqa).t()  # 3
    c, k_pe = a[..., :C], a[..., C:]  # k_pe stays raw
    kv = rms(c, m.kv_a_layernorm.weight) @ w(m.kv_b_proj).t()  # 4–5: per head [k_nope | v]
    g = torch.sigmoid(x @ w(m.g_proj).t()) if gate else torch.ones(*x.shape[:2], H * Vh, dtype=x.dtype)
    scale = (N + R) ** -0.5 if scale is None else scale
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    heads = []
    for h in range(H):
        q_h = q[..., h * (N + R):(h + 1) * (N + R)]
        k_h = torch.cat([kv[..., h * (N + Vh):h * (N + Vh) + N], k_pe], -1)  # 6
        v_h = kv[..., h * (N + Vh) + N:(h + 1) * (N + Vh)]
        scores = (q_h @ k_h.transpose(-1, -2)) * scale  # 7
        p = torch.softmax(scores.masked_fill(future, -math.inf), -1)
        heads.append((p @ v_h) * g[..., h * Vh:(h + 1) * Vh])  # 8–9
    return torch.cat(heads, -1) @ w(m.o_proj).t()  # 10


@pytest.fixture
def mla(tiny_config):
    return make_mla(tiny_config())


def test_forward_matches_per_head_reference(mla):
    """Expanded gated MLA equals the §4.2 per-head loop (scale 1/√(nope+rope), causal softmax, σ gate, o_proj)."""
    x = torch.randn(2, 37, 64, generator=torch.Generator().manual_seed(1))
    y = mla(x)
    assert y.shape == (2, 37, 64)
    ref = mla_reference(mla, x)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    assert ref.abs().max() > 0.5  # the comparison is not between two near-zero tensors


def test_reference_is_sensitive_to_scale_and_gate(mla):
    """Negative controls: 1/√nope instead of 1/√(nope+rope), or dropping the gate, is far from the model."""
    x = torch.randn(2, 37, 64, generator=torch.Generator().manual_seed(2))
    y = mla(x).double()
    assert (y - mla_reference(mla, x, scale=16 ** -0.5)).abs().max() > 1e-2
    assert (y - mla_reference(mla, x, gate=False)).abs().max() > 1e-1
    assert mla.scale == pytest.approx(24 ** -0.5)
    with torch.device("meta"):
        full = GatedMLA(K3Config())
    assert full.scale == pytest.approx(192 ** -0.5)


def test_ungated_variant(tiny_config):
    """mla_use_output_gate = false has no g_proj and equals the reference without the gate."""
    m = make_mla(tiny_config(mla_use_output_gate=False))
    assert not hasattr(m, "g_proj")
    x = torch.randn(1, 20, 64, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(m(x).double(), mla_reference(m, x, gate=False), rtol=1e-5, atol=1e-5)


def test_lora_norms_use_eps_1e6(mla):
    """q_a/kv_a layernorms use ε = 1e-6, not rms_norm_eps = 1e-5: visible on small-RMS inputs (§0.5, §4.6)."""
    assert mla.q_a_layernorm.eps == 1e-6 and mla.kv_a_layernorm.eps == 1e-6
    x = 2e-3 * torch.randn(2, 23, 64, generator=torch.Generator().manual_seed(4))  # latent mean square ≈ 1e-6
    y = mla(x).double()
    torch.testing.assert_close(y, mla_reference(mla, x, eps=1e-6), rtol=1e-5, atol=1e-5)
    wrong = mla_reference(mla, x, eps=1e-5)
    assert (y - wrong).abs().max() > 1e-2 * y.abs().max()
    mla.q_a_layernorm.eps = mla.kv_a_layernorm.eps = 1e-5  # the "ported with the config eps" bug
    assert (mla(x).double() - y).abs().max() > 1e-2 * y.abs().max()


def test_only_the_latent_is_normalised(mla):
    """compress_kv = [RMSNorm_{1e-6}(c) ‖ raw k_pe]; scaling the k_pe rows scales k_pe and nothing else (§4.2 step 4)."""
    x = torch.randn(2, 11, 64, generator=torch.Generator().manual_seed(5))
    C = mla.config.kv_lora_rank
    lat = mla.compress_kv(x)
    assert lat.shape == (2, 11, 20 + 8)
    a = (x.double() @ mla.kv_a_proj_with_mqa.weight.double().t())
    c = a[..., :C]
    c_hat = mla.kv_a_layernorm.weight.double() * c / torch.sqrt(c.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(lat[..., :C].double(), c_hat, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lat[..., C:].double(), a[..., C:], rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        mla.kv_a_proj_with_mqa.weight[C:] *= 3.0
    lat3 = mla.compress_kv(x)
    torch.testing.assert_close(lat3[..., :C], lat[..., :C], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lat3[..., C:], 3 * lat[..., C:], rtol=1e-5, atol=1e-5)


def test_query_split_nope_then_pe(mla):
    """project_query splits each head's q_b_proj rows as [nope | pe] (§4.1)."""
    x = torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(6))
    q_nope, q_pe = mla.project_query(x)
    assert q_nope.shape == (1, 5, 3, 16) and q_pe.shape == (1, 5, 3, 8)
    xd = x.double()
    c_q = xd @ mla.q_a_proj.weight.double().t()
    c_q = mla.q_a_layernorm.weight.double() * c_q / torch.sqrt(c_q.pow(2).mean(-1, keepdim=True) + 1e-6)
    q = (c_q @ mla.q_b_proj.weight.double().t()).view(1, 5, 3, 24)
    torch.testing.assert_close(q_nope.double(), q[..., :16], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(q_pe.double(), q[..., 16:], rtol=1e-5, atol=1e-6)


def test_causal_prefix_invariance(mla):
    """Output at position t depends only on positions ≤ t: prefix runs match, huge future inputs change nothing."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 41, 64, generator=gen)
    y = mla(x)
    for L in (1, 7, 16, 40):
        torch.testing.assert_close(mla(x[:, :L]), y[:, :L], rtol=1e-5, atol=1e-6)
    poisoned = x.clone()
    poisoned[:, 25:] = 1e4 * torch.randn(2, 16, 64, generator=gen)
    y_p = mla(poisoned)
    torch.testing.assert_close(y_p[:, :25], y[:, :25], rtol=1e-5, atol=1e-6)
    assert (y_p[:, 25:] - y[:, 25:]).abs().max() > 1e-1


def test_no_positional_encoding(mla):
    """NoPE: permuting the earlier tokens leaves the last position's output unchanged (no RoPE anywhere, §4.2)."""
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(2, 29, 64, generator=gen)
    perm = torch.cat([torch.randperm(28, generator=gen), torch.tensor([28])])
    y, y_perm = mla(x), mla(x[:, perm])
    torch.testing.assert_close(y_perm[:, -1], y[:, -1], rtol=1e-5, atol=1e-6)
    # ...while the last output does depend on the content of earlier tokens
    x2 = x.clone()
    x2[:, 3] = torch.randn(2, 64, generator=gen)
    assert (mla(x2)[:, -1] - y[:, -1]).abs().max() > 1e-3


def test_bf16_runs_close_to_fp32(mla):
    """A bf16 MLA layer runs and stays close to fp32 (cosine ≥ 0.999)."""
    x = torch.randn(2, 37, 64, generator=torch.Generator().manual_seed(9))
    y = mla(x)
    y16 = mla.to(torch.bfloat16)(x.to(torch.bfloat16))
    assert y16.dtype == torch.bfloat16 and torch.isfinite(y16).all()
    cos = torch.nn.functional.cosine_similarity(y16.float().flatten(), y.flatten(), dim=0)
    assert cos > 0.999
