"""The KDA layer around the core op: decay gate, short conv, dataflow, precision (docs/architecture.md §3.1–§3.3, §3.9, §0.4).

The core recurrence / chunk kernels have their own tests under tests/ops.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3.model.kda import KimiDeltaAttention, kda_decay


H, K, D = 3, 16, 64  # §12.2: 3 KDA heads × 16, hidden 64


def make_kda(config, seed: int = 0, impl: str = "auto") -> KimiDeltaAttention:
    """A KDA layer with N(0, 0.15²) projections, default conv init, random dt_bias / A_log / o_norm gain."""
    torch.manual_seed(seed)
    layer = KimiDeltaAttention(config, impl)
    with torch.no_grad():
        for name, module in layer.named_modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.normal_(0, 0.15)
        layer.dt_bias.copy_(0.5 * torch.randn_like(layer.dt_bias))
        layer.A_log.copy_(0.3 * torch.randn_like(layer.A_log))
        layer.o_norm.weight.copy_(1 + 0.2 * torch.randn_like(layer.o_norm.weight))
    return layer


def kda_layer_reference(layer: KimiDeltaAttention, x: torch.Tensor, gate_fn=torch.sigmoid) -> torch.Tensor:
    """Spec §3.2 steps 1–10 with the §3.4 recurrence, written out in float64 (one token at a time)."""
    cfg = layer.config
    x = x.double()
    B, T, _ = x.shape
    W = cfg.short_conv_kernel_size

    def lin(m, inp):
        return inp @ m.weight.double().t()

    def conv_silu(s, w):  # ŝ_t = Σ_j w[c,0,j] s_{t−(W−1)+j}, zeros before the start; then SiLU
        out = torch.zeros_like(s)
        for j in range(W):
            shift = W - 1 - j
            out[:, shift:] += w.double()[:, 0, j] * s[:, :T - shift]
        return F.silu(out)

    q = conv_silu(lin(layer.q_proj, x), layer.q_conv1d.weight).view(B, T, H, K)
    k = conv_silu(lin(layer.k_proj, x), layer.k_conv1d.weight).view(B, T, H, K)
    v = conv_silu(lin(layer.v_proj, x), layer.v_conv1d.weight).view(B, T, H, K)
    q = q / torch.sqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6) * K ** -0.5
    k = k / torch.sqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
    f = lin(layer.f_b_proj, lin(layer.f_a_proj, x)).view(B, T, H, K)
    g = cfg.gate_lower_bound * torch.sigmoid(layer.A_log.double().exp()[:, None] * (f + layer.dt_bias.double().view(H, K)))
    beta = torch.sigmoid(lin(layer.b_proj, x))
    S = torch.zeros(B, H, K, K, dtype=torch.float64)
    outs = []
    for t in range(T):
        S = g[:, t, :, :, None].exp() * S
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], S))
        S = S + k[:, t, :, :, None] * u[:, :, None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    o = torch.stack(outs, 1)
    z = lin(layer.g_proj, x).view(B, T, H, K)
    o = layer.o_norm.weight.double() * o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)
    o = o * gate_fn(z)
    return lin(layer.o_proj, o.reshape(B, T, H * K))


def decay_inputs(seed: int, f_scale: float = 1.0):
    gen = torch.Generator().manual_seed(seed)
    f = f_scale * torch.randn(2, 9, H, K, generator=gen)
    A_log = 0.5 * torch.randn(H, generator=gen)
    dt_bias = torch.randn(H, K, generator=gen)
    return f, A_log, dt_bias


# ------------------------------------------------------------------------------------------ decay gate
def test_bounded_decay_formula_and_range():
    """Bounded gate g = λ·σ(exp(A_log)·(f + dt_bias)) ∈ (λ, 0), fp32 even for bf16 input (§3.3)."""
    f, A_log, dt_bias = decay_inputs(0)  # moderate inputs: σ does not saturate to exactly 1 in fp32
    g = kda_decay(f, A_log, dt_bias, -5.0)
    expected = -5.0 * torch.sigmoid(A_log.double().exp()[:, None] * (f.double() + dt_bias.double()))
    torch.testing.assert_close(g.double(), expected, rtol=1e-6, atol=1e-6)
    assert g.dtype == torch.float32 and (g < 0).all() and (g > -5).all()
    assert kda_decay(f.to(torch.bfloat16), A_log, dt_bias, -5.0).dtype == torch.float32
    # exp(A_log) sits inside σ; λ·exp(A_log)·σ(f + dt) would be a different gate
    outside = -5.0 * A_log.double().exp()[:, None] * torch.sigmoid(f.double() + dt_bias.double())
    assert (g.double() - outside).abs().max() > 0.5
    assert kda_decay(f, A_log, dt_bias, -3.0).min() > -3.0  # λ is the configured bound


def test_softplus_decay_formula_and_difference():
    """Softplus form g = −exp(A_log)·softplus(f + dt_bias), unbounded below, overflow-safe; differs from the bounded one (§3.3)."""
    f, A_log, dt_bias = decay_inputs(1, f_scale=4.0)
    g = kda_decay(f, A_log, dt_bias, None)
    expected = -A_log.double().exp()[:, None] * F.softplus(f.double() + dt_bias.double())
    torch.testing.assert_close(g.double(), expected, rtol=1e-6, atol=1e-6)
    assert (g < 0).all() and g.min() < -5
    big = kda_decay(torch.full((1, 1, H, K), 200.0), torch.zeros(H), torch.zeros(H, K), None)
    torch.testing.assert_close(big, torch.full_like(big, -200.0))
    assert (kda_decay(f, A_log, dt_bias, -5.0) - g).abs().max() > 1.0


@pytest.mark.parametrize("scale", [1.0, 1e-3])
def test_layer_matches_spec_dataflow(tiny_config, scale):
    """KDA layer = §3.2 (conv+SiLU, L2Norm·K^-1/2 on q, L2Norm on k, bounded gate, σ β, §3.4 recurrence, gated o_norm).

    At input scale 1e-3 the q/k norms are ≈ 1e-4, so ε = 1e-6 inside the sqrt (not F.normalize) matters.
    """
    layer = make_kda(tiny_config(), seed=3)
    x = scale * torch.randn(2, 23, D, generator=torch.Generator().manual_seed(4))
    y = layer(x)
    assert y.shape == (2, 23, D)
    ref = kda_layer_reference(layer, x)
    peak = ref.abs().max().item()
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * peak)
    assert peak > 1e-3


def test_recurrent_and_chunk_impls_agree(tiny_config):
    """KDA impls 'recurrent' and 'chunk' give the same layer output (≤ 1e-5), over a chunk boundary (T = 70)."""
    chunk = make_kda(tiny_config(), seed=5, impl="chunk")
    rec = make_kda(tiny_config(), seed=6, impl="recurrent")
    rec.load_state_dict(chunk.state_dict())
    x = torch.randn(2, 70, D, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(chunk(x), rec(x), rtol=1e-5, atol=1e-5)
    small = make_kda(tiny_config(kda_chunk_size=16), seed=6, impl="chunk")
    small.load_state_dict(chunk.state_dict())
    torch.testing.assert_close(small(x), rec(x), rtol=1e-5, atol=1e-5)


def test_layer_is_causal(tiny_config):
    """Prefix runs equal the first L outputs of a longer run (chunk path, T = 100, L not multiples of 64)."""
    layer = make_kda(tiny_config(), seed=8)
    x = torch.randn(1, 100, D, generator=torch.Generator().manual_seed(9))
    y = layer(x)
    for L in (1, 7, 64, 65):
        torch.testing.assert_close(layer(x[:, :L]), y[:, :L], rtol=1e-5, atol=1e-5)


def test_output_gate_is_sigmoid_and_norm_gain_shared(tiny_config):
    """o_norm is one [K] gain shared by all heads (ε 1e-5); the output gate is σ, not SiLU (§3.1, §3.10 item 9)."""
    layer = make_kda(tiny_config(), seed=10)
    assert layer.o_norm.weight.shape == (K,) and layer.o_norm.eps == 1e-5
    assert layer.A_log.shape == (H,) and layer.dt_bias.shape == (H * K,)
    assert layer.q_conv1d.weight.shape == (H * K, 1, 4) and layer.g_proj.weight.shape == (H * K, D)
    assert layer.f_a_proj.weight.shape == (K, D) and layer.b_proj.weight.shape == (H, D)
    x = torch.randn(1, 12, D, generator=torch.Generator().manual_seed(11))
    y = layer(x).double()
    torch.testing.assert_close(y, kda_layer_reference(layer, x), rtol=1e-5, atol=1e-5)
    assert (y - kda_layer_reference(layer, x, gate_fn=F.silu)).abs().max() > 1e-2


def test_low_rank_gate_option(tiny_config):
    """use_full_rank_gate = false builds Kimi-Linear's g_a_proj/g_b_proj instead of g_proj and still runs."""
    layer = KimiDeltaAttention(tiny_config(use_full_rank_gate=False))
    assert not hasattr(layer, "g_proj") and layer.g_a_proj.weight.shape == (K, D)
    assert layer.g_b_proj.weight.shape == (H * K, K)
    assert torch.isfinite(layer(torch.randn(1, 5, D))).all()


def test_bf16_layer_keeps_fp32_params_and_runs(tiny_config):
    """After .to(bf16): A_log, dt_bias, conv weights, o_norm stay fp32, projections are bf16, output close (§0.4)."""
    layer = make_kda(tiny_config(), seed=12)
    x = torch.randn(2, 37, D, generator=torch.Generator().manual_seed(13))
    y = layer(x)
    layer = layer.to(torch.bfloat16)
    for name in ("A_log", "dt_bias", "q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight", "o_norm.weight"):
        assert layer.get_parameter(name).dtype == torch.float32, name
    for name in ("q_proj.weight", "f_b_proj.weight", "g_proj.weight", "o_proj.weight"):
        assert layer.get_parameter(name).dtype == torch.bfloat16, name
    y16 = layer(x.to(torch.bfloat16))
    assert y16.dtype == torch.bfloat16 and torch.isfinite(y16).all()
    assert F.cosine_similarity(y16.float().flatten(), y.flatten(), dim=0) > 0.99
    layer.half()
    assert layer.A_log.dtype == torch.float32 and layer.o_norm.weight.dtype == torch.float32
    layer.double()  # a float64 cast is allowed
    assert layer.A_log.dtype == torch.float64 and layer.q_proj.weight.dtype == torch.float64
