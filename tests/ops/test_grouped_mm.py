"""`k3.ops.grouped_mm`: the fast path (torch._grouped_mm) against the per-group reference, values and gradients."""

import pytest
import torch

from k3.ops import grouped_mm as gm


def operands(counts, m=24, n=40, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    counts = torch.tensor(counts)
    x = torch.randn(int(counts.sum()), m, generator=g, dtype=dtype, requires_grad=True)
    # a transposed view, as the model passes it
    w = torch.randn(len(counts), n, m, generator=g, dtype=dtype).transpose(-1, -2).requires_grad_()
    return x, w, counts


def by_hand(x, w, counts):
    """Row i belongs to the group whose cumulative range holds it."""
    group = torch.repeat_interleave(torch.arange(len(counts)), counts)
    return torch.stack([x[i] @ w[group[i]] for i in range(x.shape[0])]) if x.shape[0] else x @ w[0]


@pytest.mark.parametrize("counts", [[5, 0, 9, 1], [0, 0, 7, 0], [3, 3, 3, 3], [0, 0, 0, 0]])
def test_reference_is_the_per_row_product(counts):
    x, w, c = operands(counts, dtype=torch.float64)
    torch.testing.assert_close(gm.grouped_mm_reference(x, w, c), by_hand(x, w, c), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("counts", [[5, 0, 9, 1], [0, 0, 7, 0], [17, 2, 0, 30, 1, 6], [0, 0, 0, 0]])
def test_fast_path_equals_reference_values_and_gradients(counts):
    """fp32 on CPU takes torch._grouped_mm where this PyTorch has it; values and both gradients (a group
    without rows gets a zero weight gradient) equal the reference's."""
    x, w, c = operands(counts, seed=len(counts))
    xr, wr = (t.detach().clone().requires_grad_() for t in (x, w))
    dy = torch.randn(x.shape[0], w.shape[-1], generator=torch.Generator().manual_seed(9))
    y, yr = gm.grouped_mm(x, w, c), gm.grouped_mm_reference(xr, wr, c)
    torch.testing.assert_close(y, yr, rtol=1e-5, atol=1e-5)
    (y * dy).sum().backward()
    (yr * dy).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad, wr.grad, rtol=1e-5, atol=1e-5)
    assert w.grad[c == 0].abs().max() == 0 if (c == 0).any() else True


def test_float64_falls_back_to_the_reference():
    """Double precision has no grouped kernel on CPU: the reference runs (same numbers, gradcheck passes)."""
    x, w, c = operands([2, 0, 3], m=3, n=4, dtype=torch.float64)
    torch.testing.assert_close(gm.grouped_mm(x, w, c), by_hand(x, w, c))
    assert torch.autograd.gradcheck(lambda a, b: gm.grouped_mm(a, b, c), (x, w))


def test_the_fast_path_is_taken_for_fp32_on_this_pytorch():
    """Where torch._grouped_mm exists (PyTorch ≥ 2.8 on CPU) fp32 uses it: the speed of training depends on it."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this PyTorch has no torch._grouped_mm")
    assert gm._fast_path_works(torch.device("cpu"), torch.float32, 24, 40)
    assert not gm._fast_path_works(torch.device("cpu"), torch.float64, 24, 40)


def test_fewer_rows_than_experts_loop_over_the_experts_in_use(monkeypatch):
    """Decoding (a few rows, many experts) never calls the kernel, whose cost grows with the expert count."""
    x, w, c = operands([0, 2, 0, 0, 1, 0, 0, 0])
    expected = by_hand(x, w, c)
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: pytest.fail("kernel called"), raising=False)
    torch.testing.assert_close(gm.grouped_mm(x, w, c), expected)
