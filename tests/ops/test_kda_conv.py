"""`k3.ops.kda.conv`: KDA's short convolution + SiLU (§3.2 step 2, §3.8): `short_conv` against a tap loop, its paths
against each other, and the compiled kernel of many tokens (forward and backward) against the shifted products in
torch ops and float64."""

import pytest
import torch
import torch.nn.functional as F

from k3.ops import compiled
from k3.ops.kda import conv
from k3.ops.kda.conv import short_conv

pytestmark = pytest.mark.skipif(compiled.build("kda")[0] is None,
                                reason="the compiled kda kernel could not be built here")


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def run(x, w, context, documents, dy, reference, monkeypatch):
    """short_conv's output and the gradients of Σ output · dy for x, w and the context."""
    with monkeypatch.context() as patch:
        if reference:
            patch.setattr(conv, "compiled_short_conv", lambda *args: None)
        leaves = [t.detach().clone().requires_grad_() for t in (x, w, context)]
        y, new_context = short_conv(*leaves, documents)
        y.backward(dy.to(y.dtype))
    return [y.detach(), *(t.grad for t in leaves)], new_context


@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("B,T,P", [(2, 37, 20), (1, 5, 64), (3, 1, 12)])
def test_matches_the_shifted_products(monkeypatch, B, T, P, documents):
    """Values and the gradients of x, the taps and the context: the kernel within fp32 rounding of the torch ops,
    both close to float64; a context that is not zero (a continued sequence), documents of ragged lengths."""
    W = 4
    x, w, context = randn(B, T, P, seed=1), 0.5 * randn(P, 1, W, seed=2), randn(B, W - 1, P, seed=3)
    dy = randn(B, T, P, seed=4)
    doc = torch.cumsum(torch.rand(B, T, generator=torch.Generator().manual_seed(5)) < 0.2, 1) if documents else None
    calls = []
    spy = conv.ShortConvFunction.apply
    monkeypatch.setattr(conv.ShortConvFunction, "apply", lambda *a: (calls.append(1), spy(*a))[1])
    ours, new_context = run(*(t.float() for t in (x, w, context)), doc, dy, False, monkeypatch)
    assert calls or (T == 1 and not documents), "the compiled kernel served the call"  # one token: the window product
    torch_ops, _ = run(*(t.float() for t in (x, w, context)), doc, dy, True, monkeypatch)
    exact, _ = run(x, w, context, doc, dy, True, monkeypatch)
    for what, a, b, c in zip(["y", "dx", "dw", "dcontext"], ours, torch_ops, exact):
        assert a.dtype == torch.float32 and a.shape == c.shape, what
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=what)
        err, torch_err = ((t.double() - c).abs().max() for t in (a, b))
        assert err <= 2 * torch_err + 1e-6, what
    torch.testing.assert_close(new_context, torch.cat([context.float(), x.float()], 1)[:, -(W - 1):])


def test_without_grad_and_other_dtypes(monkeypatch):
    """A no-grad call with documents takes the kernel's forward; float64 keeps the torch ops."""
    x, w = randn(2, 9, 8).float(), randn(8, 1, 4, seed=1).float()
    doc = torch.tensor([[0] * 4 + [1] * 5, [2] * 9])
    with torch.no_grad():
        y, _ = short_conv(x, w, None, doc)
    monkeypatch.setattr(conv, "compiled_short_conv", lambda *args: None)
    with torch.no_grad():
        torch.testing.assert_close(y, short_conv(x, w, None, doc)[0])
    assert conv.compiled_short_conv(x.double(), w[:, 0].double(), doc) is None


def test_no_new_token():
    """A call without new tokens (T = 0) declines the kernel; the torch ops return an empty output and the context."""
    x, w, context = randn(2, 0, 8).float().requires_grad_(), randn(8, 1, 4, seed=1).float(), randn(2, 3, 8).float()
    y, new_context = short_conv(x, w, context)
    assert y.shape == (2, 0, 8) and torch.equal(new_context, context)


# ---------------------------------------------------------------------------------------------- the entry
def test_short_conv_matches_tap_loop():
    """Causal depthwise conv with tap W−1 on the current token, zero left context, then SiLU, fp32 inside (§3.2 step 2)."""
    gen = torch.Generator().manual_seed(2)
    P, T, W = 10, 13, 4
    x = torch.randn(2, T, P, generator=gen)
    w = torch.randn(P, 1, W, generator=gen)
    y, context = short_conv(x, w)
    assert torch.equal(context, x[:, T - (W - 1):])  # the next call's left context: the last W−1 inputs
    ref = torch.zeros(2, T, P, dtype=torch.float64)
    for t in range(T):
        for j in range(W):
            tau = t - (W - 1) + j
            if tau >= 0:
                ref[:, t] += w[:, 0, j].double() * x[:, tau].double()
    torch.testing.assert_close(y.double(), F.silu(ref), rtol=1e-6, atol=1e-6)
    # the current token really uses the last tap: a delta at t = 0 shows w[:, 0, W-1] at t = 0
    delta = torch.zeros(1, T, P)
    delta[0, 0] = 1.0
    torch.testing.assert_close(short_conv(delta, w)[0][0, :W], F.silu(w[:, 0, :].flip(-1).t()), rtol=1e-6, atol=1e-6)
    y16, _ = short_conv(x.to(torch.bfloat16), w)
    assert y16.dtype == torch.bfloat16
    # split-and-carry: two calls with the carried context equal one call
    y_a, ctx_a = short_conv(x[:, :5], w)
    y_b, _ = short_conv(x[:, 5:], w, ctx_a)
    torch.testing.assert_close(torch.cat([y_a, y_b], 1), y, rtol=0, atol=1e-6)


def test_short_conv_paths_agree():
    """The three ways of computing the conv (W shifted products with gradients, conv1d for a no-grad prefill,
    the window product for one token) give the same outputs and carried contexts."""
    gen = torch.Generator().manual_seed(3)
    P, T, W = 12, 9, 4
    x, w = torch.randn(2, T, P, generator=gen), torch.randn(P, 1, W, generator=gen)
    context = torch.randn(2, W - 1, P, generator=gen)
    taps, taps_ctx = short_conv(x, w, context)  # grad mode: the shifted products
    with torch.no_grad():
        prefill, prefill_ctx = short_conv(x, w, context)  # conv1d
        steps, ctx = [], context
        for t in range(T):  # one token at a time: the window product
            y, ctx = short_conv(x[:, t:t + 1], w, ctx)
            steps.append(y)
    torch.testing.assert_close(prefill, taps, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.cat(steps, 1), taps, rtol=1e-6, atol=1e-6)
    assert torch.equal(prefill_ctx, taps_ctx) and torch.equal(ctx, taps_ctx)

# -------------------------------------------------------------------------------------------- layer
