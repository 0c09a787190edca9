"""RMSNorm, L2Norm and SiTU-GLU against their written formulas (docs/architecture.md §0.2, §0.4, §0.5, §6.1, §6.2)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from k3.model.ffn import SiTUMLP, glu_activation
from k3.ops.activation import situ_glu
from k3.ops.norm import RMSNorm, l2_normalize, rms_normalize


def a_ref(g: torch.Tensor, b1: float = 4.0) -> torch.Tensor:
    """a(g) = β₁·tanh(g/β₁)·σ(g), float64."""
    g = g.double()
    return b1 * torch.tanh(g / b1) * torch.sigmoid(g)


def a_impl(g: torch.Tensor) -> torch.Tensor:
    """The implementation's gate branch alone (up branch = 1, uncapped)."""
    return situ_glu(g, torch.ones_like(g), 4.0, None)


# ------------------------------------------------------------------------------------------------ norms
def test_rms_norm_matches_formula():
    """RMSNorm(x) = w ⊙ x / sqrt(mean(x²) + ε) with ε inside the sqrt (§0.2)."""
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(37, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(37, generator=gen))
    for scale in (1.0, 1e-3):  # at 1e-3 the mean square (≈1e-6) is below ε, so ε placement matters
        x = scale * torch.randn(3, 5, 37, generator=gen, dtype=torch.float64)
        ref = norm.weight.double() * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
        out = norm(x.float())
        torch.testing.assert_close(out.double(), ref, rtol=2e-6, atol=1e-7)
    # ε outside the sqrt (x / (rms + ε)) would be a different function at small scale
    wrong = norm.weight.double() * x / (x.pow(2).mean(-1, keepdim=True).sqrt() + 1e-5)
    assert (out.double() - wrong).abs().max() > 0.1


def test_rms_norm_stats_in_fp32_then_round_then_gain():
    """Low-precision RMSNorm = gain ⊙ round(fp32 normalise(x)): no fp16 overflow of x² (§0.4)."""
    gen = torch.Generator().manual_seed(1)
    norm = RMSNorm(64, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(64, generator=gen))
    for dtype in (torch.bfloat16, torch.float16):
        n = norm.to(dtype)
        x = (300 * torch.randn(4, 64, generator=gen)).to(dtype)  # x² ≈ 9e4 overflows fp16
        out = n(x)
        assert out.dtype == dtype and torch.isfinite(out).all()
        xf = x.float()
        expected = n.weight * (xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
        torch.testing.assert_close(out, expected.to(dtype), rtol=0, atol=0)


def test_rms_normalize_has_no_gain_and_returns_fp32():
    """rms_normalize(x) is the gain-free fp32 normalisation used by AttnRes keys and gated norms (§0.4)."""
    x = torch.randn(2, 9, dtype=torch.bfloat16)
    y = rms_normalize(x, 1e-5)
    assert y.dtype == torch.float32
    xf = x.float()
    torch.testing.assert_close(y, xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5))


def test_l2_normalize_is_not_f_normalize():
    """L2Norm(x) = x / sqrt(Σx² + 1e-6): ε inside the sqrt, unlike F.normalize's max(‖x‖, ε) (§0.2)."""
    x = torch.tensor([[3e-4, 4e-4], [3.0, 4.0]])
    y = l2_normalize(x)
    expected = x.double() / torch.sqrt(x.double().pow(2).sum(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(y.double(), expected, rtol=1e-6, atol=0)
    assert y[0, 0].item() == pytest.approx(3e-4 / math.sqrt(2.5e-7 + 1e-6), rel=1e-5)  # ≈ 0.268, not 0.6
    assert (y[0] - F.normalize(x[0], dim=-1, eps=1e-6)).abs().max() > 0.2
    torch.testing.assert_close(y[1], torch.tensor([0.6, 0.8]), rtol=1e-6, atol=1e-6)  # large vectors: unit norm
    assert l2_normalize(x.to(torch.bfloat16)).dtype == torch.float32


# --------------------------------------------------------------------------------------------- SiTU-GLU
def test_situ_reference_values():
    """a(1) = 0.71620, a(2) = 1.62813 (not SiLU's 0.73106, 1.76159), a'(0) = 0.5 (§6.1)."""
    g = torch.tensor([1.0, 2.0])
    assert a_impl(g).tolist() == pytest.approx([0.71620, 1.62813], abs=5e-6)
    g0 = torch.zeros(1, requires_grad=True)
    a_impl(g0).sum().backward()
    assert g0.grad.item() == pytest.approx(0.5, abs=1e-7)


def test_situ_minimum_and_limits():
    """min a ≈ −0.26977 at g ≈ −1.219; a → 4 as g → +∞ and → 0 as g → −∞ (§6.1)."""
    g = torch.arange(-3.0, 0.0, 1e-4, dtype=torch.float64)
    a = a_impl(g.float()).double()
    i = int(a.argmin())
    assert a[i].item() == pytest.approx(-0.26977, abs=1e-5)
    assert g[i].item() == pytest.approx(-1.219, abs=2e-3)
    big = torch.tensor([30.0, 60.0, 1e4])
    torch.testing.assert_close(a_impl(big), torch.full((3,), 4.0), rtol=0, atol=1e-5)
    assert a_impl(-big).abs().max() < 1e-10


def test_situ_caps():
    """|u'| ≤ β₂ = 25 and |output| ≤ β₁·β₂ = 100 for any input; u' ≈ u near 0 (§6.1)."""
    gen = torch.Generator().manual_seed(2)
    g = 1e3 * torch.randn(10_000, generator=gen)
    u = 1e4 * torch.randn(10_000, generator=gen)
    u_capped = situ_glu(torch.full_like(u, 1e4), u, 4.0, 25.0) / 4.0  # a(1e4) = 4 exactly in fp32
    assert u_capped.abs().max() <= 25.0
    assert u_capped.abs().max() > 24.9
    assert situ_glu(g, u, 4.0, 25.0).abs().max() <= 100.0
    small = torch.tensor([1e-3, -2e-3])
    torch.testing.assert_close(situ_glu(torch.full_like(small, 1e4), small, 4.0, 25.0) / 4.0, small,
                               rtol=1e-6, atol=0)


def test_situ_matches_formula_and_uncapped_up_branch():
    """SiTU-GLU(g, u) = a(g)·β₂tanh(u/β₂); β₂ = None leaves u uncapped (§6.1)."""
    gen = torch.Generator().manual_seed(3)
    g = 5 * torch.randn(1000, generator=gen)
    u = 60 * torch.randn(1000, generator=gen)
    capped = a_ref(g) * 25 * torch.tanh(u.double() / 25)
    torch.testing.assert_close(situ_glu(g, u, 4.0, 25.0).double(), capped, rtol=1e-5, atol=1e-5)
    uncapped = situ_glu(g, u, 4.0, None)
    torch.testing.assert_close(uncapped.double(), a_ref(g) * u.double(), rtol=1e-5, atol=1e-5)
    assert uncapped.abs().max() > 100  # really uncapped
    # β₁ is a parameter: β₁ = 1 gives a different gate
    torch.testing.assert_close(situ_glu(g, u, 1.0, None).double(), a_ref(g, 1.0) * u.double(), rtol=1e-5, atol=1e-5)


def test_situ_gradients_match_closed_form():
    """da/dg = (1 − tanh²(g/β₁))σ(g) + β₁tanh(g/β₁)σ(g)(1 − σ(g)); du'/du = 1 − tanh²(u/β₂) (§6.1)."""
    gen = torch.Generator().manual_seed(4)
    g = (4 * torch.randn(500, generator=gen)).requires_grad_()
    u = (40 * torch.randn(500, generator=gen)).requires_grad_()
    gd, ud = g.detach().double(), u.detach().double()
    # d/dg of a(g)·u'(u) is a'(g)·u'(u); d/du is a(g)·du'/du
    s, t1, t2 = torch.sigmoid(gd), torch.tanh(gd / 4), torch.tanh(ud / 25)
    da = (1 - t1**2) * s + 4 * t1 * s * (1 - s)
    du = 1 - t2**2
    situ_glu(g, u, 4.0, 25.0).sum().backward()
    torch.testing.assert_close(g.grad.double(), da * 25 * t2, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(u.grad.double(), a_ref(gd) * du, rtol=1e-4, atol=1e-6)


def test_situ_computes_in_fp32_and_casts_back():
    """bf16 pre-activations: internals in fp32, result rounded once to bf16 (§0.4)."""
    gen = torch.Generator().manual_seed(5)
    g = (3 * torch.randn(256, generator=gen)).to(torch.bfloat16)
    u = (3 * torch.randn(256, generator=gen)).to(torch.bfloat16)
    out = situ_glu(g, u, 4.0, 25.0)
    assert out.dtype == torch.bfloat16
    gf, uf = g.float(), u.float()
    expected = (4 * torch.tanh(gf / 4) * torch.sigmoid(gf) * (25 * torch.tanh(uf / 25))).to(torch.bfloat16)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    in_bf16 = 4 * torch.tanh(g / 4) * torch.sigmoid(g) * (25 * torch.tanh(u / 25))  # what bf16 internals give
    assert not torch.equal(in_bf16, expected)


def test_situ_mlp_and_silu_option(tiny_config):
    """SiTUMLP = down(SiTU-GLU(gate x, up x)) (§6.2); hidden_act='silu' selects SwiGLU instead."""
    cfg = tiny_config()
    torch.manual_seed(0)
    mlp = SiTUMLP(cfg, 64, 96)
    x = torch.randn(2, 7, 64)
    g, u = x @ mlp.gate_proj.weight.t(), x @ mlp.up_proj.weight.t()
    ref = (a_ref(g) * 25 * torch.tanh(u.double() / 25)) @ mlp.down_proj.weight.double().t()
    torch.testing.assert_close(mlp(x).double(), ref, rtol=1e-5, atol=1e-6)
    silu = glu_activation(tiny_config(hidden_act="silu"), g, u)
    torch.testing.assert_close(silu, F.silu(g) * u)
    assert (silu - glu_activation(cfg, g, u)).abs().max() > 1e-2
