"""`k3.ops.norm`: the compiled norms and AttnRes mix of many rows (forward and hand-derived backward) against their
formulas in torch ops and in float64 (docs/architecture.md §0.2, §5.1)."""

import pytest
import torch

from k3.ops import compiled
from k3.ops.norm import RMSNorm, l2_normalize, normalized_key_mix, rms_normalize
from k3.ops.precision import fp32

pytestmark = pytest.mark.skipif(compiled.build("norm")[0] is None,
                                reason="the compiled norm kernel could not be built here")


def randn(*shape, seed=0, scale=1.0):
    return scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def values_and_grads(fn, inputs, dy):
    """fn(*inputs) and the gradients of Σ fn · dy with respect to every input (leaves of their own)."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    y = fn(*leaves)
    y.backward(dy.to(y.dtype))
    return y.detach(), [t.grad for t in leaves], y.grad_fn


def norm_formula(x, w, eps, mean):
    ss = x.pow(2).mean(-1, keepdim=True) if mean else x.pow(2).sum(-1, keepdim=True)
    y = x * torch.rsqrt(ss + eps)
    return y if w is None else w * y


def assert_as_accurate_as_torch_ops(ours, torch_ops, exact, what):
    """fp32 results no further from float64 than the fp32 torch ops are, plus rounding."""
    err, torch_err = ((a.double() - exact).abs().max() for a in (ours, torch_ops))
    assert err <= 2 * torch_err + 1e-7 * (1 + exact.abs().max()), what


@pytest.mark.parametrize("shape", [(3, 5, 37), (2, 70, 4, 24), (1, 128)])  # odd width; ragged rows per thread
@pytest.mark.parametrize("kind", ["RMSNorm", "rms_normalize", "l2_normalize"])
def test_norms_and_their_gradients(shape, kind):
    x, w, dy = randn(*shape, scale=3.0), 1 + 0.3 * randn(shape[-1], seed=1), randn(*shape, seed=2)
    if kind == "RMSNorm":
        norm = RMSNorm(shape[-1], eps=1e-5)

        def ours(x, w):
            return torch.func.functional_call(norm, {"weight": w}, (x,))
        formula = lambda x, w: norm_formula(x, w, 1e-5, True)  # noqa: E731
        inputs = [x, w]
    else:
        mean, eps = (True, 1e-5) if kind == "rms_normalize" else (False, 1e-6)
        ours = (lambda x: rms_normalize(x, 1e-5)) if mean else l2_normalize
        formula = lambda x: norm_formula(x, None, eps, mean)  # noqa: E731
        inputs = [x]
    y, grads, node = values_and_grads(ours, [t.float() for t in inputs], dy)
    assert type(node).__name__.startswith("_RowNormFunction")
    y_t, grads_t, _ = values_and_grads(formula, [t.float() for t in inputs], dy)
    y_64, grads_64, _ = values_and_grads(formula, inputs, dy)
    assert y.shape == x.shape and y.dtype == torch.float32
    for what, a, b, c in zip(["y", "dx", "dw"], [y, *grads], [y_t, *grads_t], [y_64, *grads_64]):
        assert a.dtype == torch.float32 and a.shape == c.shape, what
        assert_as_accurate_as_torch_ops(a, b, c, what)


def mix_formula(query, *sources, eps=1e-5):
    """§5.1 in torch ops: softmax over the sources of q·V/sqrt(mean(V²)+ε), then the weighted sum of the V."""
    logits = torch.stack([(V @ query) * torch.rsqrt(V.pow(2).mean(-1) + eps) for V in sources])
    return sum(p[..., None] * V for p, V in zip(torch.softmax(logits, 0), sources))


@pytest.mark.parametrize("n_sources", [1, 2, 5])
@pytest.mark.parametrize("shape", [(2, 33, 40), (70, 96)])
def test_mix_and_its_gradients(n_sources, shape):
    """Sources of very different scales and offsets (the embedding is small, block sums large)."""
    sources = [randn(*shape, seed=10 + i, scale=0.05 * 10 ** (i % 3)) + 0.1 * i for i in range(n_sources)]
    query, dy = 0.5 * randn(shape[-1], seed=5), randn(*shape, seed=6)

    def ours(query, *sources):
        return normalized_key_mix(list(sources), query, 1e-5)
    inputs = [query, *sources]
    y, grads, node = values_and_grads(ours, [t.float() for t in inputs], dy)
    assert type(node).__name__.startswith("_MixFunction")
    y_t, grads_t, _ = values_and_grads(mix_formula, [t.float() for t in inputs], dy)
    y_64, grads_64, _ = values_and_grads(mix_formula, inputs, dy)
    names = ["y", "dq"] + [f"dV{s}" for s in range(n_sources)]
    for what, a, b, c in zip(names, [y, *grads], [y_t, *grads_t], [y_64, *grads_64]):
        assert a.dtype == torch.float32 and a.shape == c.shape, what
        assert_as_accurate_as_torch_ops(a, b, c, what)


def test_without_grad_the_forward_alone():
    x = randn(6, 50).float()
    with torch.no_grad():
        y = l2_normalize(x)
        mixed = normalized_key_mix([x, 2 * x + 1], randn(50, seed=1).float(), 1e-5)
    assert y.grad_fn is None and mixed.grad_fn is None
    torch.testing.assert_close(y, norm_formula(x, None, 1e-6, False))
    torch.testing.assert_close(mixed, mix_formula(randn(50, seed=1).float(), x, 2 * x + 1))


@pytest.mark.parametrize("case", ["float64", "bfloat16", "unbuilt", "shapes differ"])
def test_other_calls_keep_the_torch_ops(monkeypatch, case):
    """Other dtypes and a kernel that could not be built: the norms run their torch ops and the mix declines (its
    caller then runs the torch ops), as for sources of different shapes."""
    dtype = {"float64": torch.float64, "bfloat16": torch.bfloat16}.get(case, torch.float32)
    x = randn(8, 16).to(dtype)
    if case == "unbuilt":
        monkeypatch.setattr(compiled, "build", lambda name: (None, "RuntimeError: no compiler"))
        monkeypatch.setattr(compiled, "load", lambda name: None)
    second = randn(8, 15).to(dtype) if case == "shapes differ" else x + 1
    assert normalized_key_mix([x, second], randn(16, seed=1).to(dtype)[: x.shape[-1]], 1e-5) is None
    if case != "shapes differ":
        y = l2_normalize(x.requires_grad_())
        assert not type(y.grad_fn).__name__.startswith("_RowNorm")
        assert torch.equal(y, norm_formula(fp32(x), None, 1e-6, False))


@pytest.mark.parametrize("shape", [(0, 16), (3, 0)])
def test_empty_inputs_keep_the_torch_ops(shape):
    """No rows, or rows of width 0: the torch ops' (empty) results, no kernel call."""
    x = torch.zeros(shape, requires_grad=True)
    for y in (l2_normalize(x), rms_normalize(x, 1e-5), RMSNorm(shape[-1], eps=1e-5)(x)):
        assert y.shape == x.shape and not type(y.grad_fn).__name__.startswith("_RowNorm")
    assert normalized_key_mix([x, x + 1], torch.zeros(shape[-1]), 1e-5) is None
