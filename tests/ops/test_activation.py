"""`k3.ops.activation`: the compiled SiTU-GLU (one pass each way) against the formula in torch ops (§6.1)."""

import pytest
import torch

from k3.ops import activation, compiled

pytestmark = pytest.mark.skipif(compiled.build("activation")[0] is None,
                                reason="the compiled activation kernel could not be built here")


def pre_activations(n, seed=0, dtype=torch.float32, spread=(6.0, 40.0)):
    """By default into both tails of tanh and σ (g) and past the up cap β₂ = 25 (u); `spread=(0.5, 5.0)` keeps
    nearly every g/β₁ and u/β₂ below 1, where the kernel's tanh is its polynomial alone."""
    gen = torch.Generator().manual_seed(seed)
    g = spread[0] * torch.randn(n, generator=gen, dtype=torch.float64)
    u = spread[1] * torch.randn(n, generator=gen, dtype=torch.float64)
    return g.to(dtype), u.to(dtype)


def values_and_gradients(fn, g, u, beta2, dh):
    g, u = g.clone().requires_grad_(), u.clone().requires_grad_()
    h = fn(g, u, 4.0, beta2)
    h.backward(dh.to(h.dtype))
    return h, g.grad, u.grad


@pytest.mark.parametrize("spread", [(6.0, 40.0), (0.5, 5.0)])
@pytest.mark.parametrize("beta2", [25.0, None])
@pytest.mark.parametrize("n", [0, 1, 7, 4096 * 3 + 5])  # empty, shorter than a vector, a partial last piece
def test_as_accurate_as_the_formula_in_torch_ops(beta2, n, spread):
    """h, dg, du against the float64 formula on the same fp32 inputs: errors no larger than the fp32 torch-ops
    formula's own (both lose digits in 1 − tanh² where |g/β₁| is large) plus rounding."""
    g, u = pre_activations(n, spread=spread)
    dh = torch.randn(n, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ours = values_and_gradients(activation.situ_glu, g, u, beta2, dh)
    assert type(ours[0].grad_fn).__name__.startswith("SiTUGLUFunction")
    torch_ops = values_and_gradients(activation.situ_glu_reference, g, u, beta2, dh)
    exact = values_and_gradients(activation.situ_glu_reference, g.double(), u.double(), beta2, dh)
    for name, x, y, ref in zip(("h", "dg", "du"), ours, torch_ops, exact):
        assert x.dtype == torch.float32 and x.shape == (n,), name
        if n:
            ref = ref.detach()
            err, torch_err = ((t.detach().double() - ref).abs().max() for t in (x, y))
            assert err <= 2 * torch_err + 1e-7 * (1 + ref.abs().max()), name


def test_tanh_limits():
    """The kernel's tanh at the edges of its two branches and beyond: ±1 where tanh saturates, signed zeros, NaN."""
    g = torch.tensor([0.0, -0.0, 4.0, -4.0, 4.0001, 400.0, -400.0, float("inf"), float("-inf"), float("nan")])
    u = torch.full_like(g, 25.0)  # c(u) = β₂ tanh(1)
    got = activation.situ_glu(g, u, 4.0, 25.0)
    torch.testing.assert_close(got, activation.situ_glu_reference(g, u, 4.0, 25.0), equal_nan=True)
    assert got[0] == 0 and got[1] == 0 and torch.isnan(got[-1])


def test_shapes_and_strides_are_kept():
    g, u = (t.view(3, 5, 7) for t in pre_activations(105))
    h = activation.situ_glu(g.transpose(0, 1), u.transpose(0, 1), 4.0, 25.0)  # strided views of the same layout
    assert h.shape == (5, 3, 7)
    torch.testing.assert_close(h, activation.situ_glu_reference(g.transpose(0, 1), u.transpose(0, 1), 4.0, 25.0))


@pytest.mark.parametrize("case", ["bfloat16", "float64", "unbuilt"])
def test_other_calls_are_the_reference_exactly(monkeypatch, case):
    """Other dtypes and a kernel that could not be built run the torch-ops formula itself."""
    dtype = {"bfloat16": torch.bfloat16, "float64": torch.float64}.get(case, torch.float32)
    g, u = pre_activations(50, dtype=dtype)
    if case == "unbuilt":
        monkeypatch.setattr(compiled, "build", lambda name: (None, "RuntimeError: no compiler"))
        with pytest.warns(UserWarning, match="compiled activation kernel is unavailable"):
            h = activation.situ_glu(g, u, 4.0, 25.0)
    else:
        h = activation.situ_glu(g, u, 4.0, 25.0)
    assert torch.equal(h, activation.situ_glu_reference(g, u, 4.0, 25.0))
