"""`k3.ops.matvec`: the compiled few-row products of decoding against PyTorch's, and where each one serves."""

import contextlib

import pytest
import torch
import torch.nn.functional as F

from k3.ops import compiled, matvec
from k3.ops import grouped_mm as gm

pytestmark = pytest.mark.skipif(compiled.build("matvec")[0] is None,
                                reason="the compiled matvec kernel could not be built here")


def randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("shape", [(1, 1, 200), (2, 1, 200), (1, 3, 200), (4, 200), (2, 2, 200), (200,)])
def test_few_rows_without_grad_match_f_linear(shape):
    """Every row layout up to `MAX_ROWS` rows (decoding: [B, 1, D] and a few tokens), widths not multiples of 8."""
    x, w = randn(*shape), randn(300, 200, seed=1)
    with torch.no_grad():
        y = matvec.linear(x, w)
    assert y.shape == (*shape[:-1], 300)
    torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_row_is_its_one_row_product_exactly(dtype):
    """1 to `MAX_ROWS` rows (every tiling of the inputs: up to 6 one weight row at a time, then tiles of 3, 2 and 1)
    by 301 weight rows (tiles of 4 and a remainder) of width 203 (not whole vectors): each output row equals that
    row's own one-row product bit for bit
    (a sequence decodes the same alone or batched), and `F.linear` to rounding."""
    w = randn(301, 203, seed=1, dtype=dtype)
    for rows in range(1, matvec.MAX_ROWS + 1):
        x = randn(rows, 203, seed=rows, dtype=dtype)
        with torch.no_grad():
            y = matvec.linear(x, w)
            alone = torch.cat([matvec.linear(x[i:i + 1], w) for i in range(rows)])
        assert torch.equal(y, alone), rows
        torch.testing.assert_close(y.float(), F.linear(x.float(), w.float()),
                                   rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-4)


def test_a_strided_input_is_read_correctly():
    x, w = randn(200, 3).t(), randn(37, 200, seed=1)  # [3, 200], not contiguous
    with torch.no_grad():
        torch.testing.assert_close(matvec.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["grad", "many rows", "float16", "float64", "unbuilt"])
def test_other_calls_are_f_linear_exactly(monkeypatch, case):
    """Autograd, more than `MAX_ROWS` rows, other dtypes, a kernel that could not be built: `F.linear` itself."""
    rows = matvec.MAX_ROWS + 1 if case == "many rows" else 1
    dtype = {"float16": torch.float16, "float64": torch.float64}.get(case, torch.float32)
    x, w = randn(rows, 64, dtype=dtype), randn(48, 64, seed=1, dtype=dtype)
    if case == "unbuilt":
        monkeypatch.setattr(compiled, "build", lambda name: (None, "RuntimeError: no compiler"))
    warns = pytest.warns(UserWarning, match="unavailable") if case == "unbuilt" else contextlib.nullcontext()
    with torch.set_grad_enabled(case == "grad"), warns:
        assert torch.equal(matvec.linear(x, w), F.linear(x, w))


def test_an_input_and_weight_of_different_dtypes_are_refused_as_f_linear_refuses_them():
    """The kernel could multiply fp32 rows by bf16 weights, but `F.linear` does not: neither does `linear`."""
    with torch.no_grad(), pytest.raises(RuntimeError):
        matvec.linear(randn(1, 64), randn(48, 64, dtype=torch.bfloat16))


BF16_WIDTHS = [37, 200, 1000]  # input widths that are not whole vectors of 16 or 32 lanes


def assert_rounded_once(y, reference):
    """y is bf16 and the fp32 reference rounded once: within half a bf16 ulp of it (at most 2⁻⁸ of its magnitude),
    plus the reference's own fp32 rounding."""
    assert y.dtype == torch.bfloat16
    error = (y.double() - reference.double()).abs()
    assert (error <= reference.double().abs() * 2**-8 + 1e-5 * reference.abs().max().item()).all()


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("width", BF16_WIDTHS)
def test_bf16_weights_give_the_fp32_products_of_their_values(rows, width):
    """bf16 weights are widened exactly as they are read: the kernel's products of fp32 rows with bf16 weights equal,
    bit for bit, its products with the same weights in fp32 (several weights in one pass, and per-expert rows),
    which are the float64 products to fp32 rounding: within 1e-5 (some 80 ulps) of the sum of the terms'
    magnitudes."""
    kernel = compiled.load("matvec")
    x = randn(rows, width)
    weights = [randn(301, width, seed=1, dtype=torch.bfloat16), randn(19, width, seed=2, dtype=torch.bfloat16)]
    experts, counts = randn(5, 33, width, seed=3, dtype=torch.bfloat16), torch.tensor([0, 1, 0, rows - 1, 0])
    with torch.no_grad():
        products = kernel.linears(x, weights)
        assert all(y.dtype == torch.float32 for y in products)
        for y, y32, w in zip(products, kernel.linears(x, [w.float() for w in weights]), weights):
            assert torch.equal(y, y32)
            error = (y.double() - F.linear(x.double(), w.double())).abs()
            assert (error <= 1e-5 * F.linear(x.double().abs(), w.double().abs())).all()
        assert torch.equal(kernel.expert_linear(x, experts, counts), kernel.expert_linear(x, experts.float(), counts))


@pytest.mark.parametrize("shape", [(1, 1, 37), (2, 1, 200), (3, 200), (4, 1000)])
def test_bf16_calls_take_the_kernel_and_round_once(shape):
    """A bf16 model's calls (input and weight bf16): the kernel serves `linear` and the few-row
    `grouped_mm`, and each output is bf16 — `F.linear`'s dtype — and the fp32 product of the bf16 values rounded
    once (`F.linear` rounds the same sum)."""
    kernel = compiled.load("matvec")
    x, w = randn(*shape, dtype=torch.bfloat16), randn(301, shape[-1], seed=1, dtype=torch.bfloat16)
    with torch.no_grad():
        y = matvec.linear(x, w)
        assert y.shape == (*shape[:-1], 301) and torch.equal(y, kernel.linear(x.float(), w).to(torch.bfloat16))
        assert_rounded_once(y, F.linear(x.float(), w.float()))
        rows = x.reshape(-1, shape[-1])
        counts = torch.tensor([rows.shape[0] - 1, 0, 1])
        experts = randn(3, 29, shape[-1], seed=2, dtype=torch.bfloat16)  # [E, out, in], used transposed
        grouped = gm.grouped_mm(rows, experts.transpose(-1, -2), counts)
        assert torch.equal(grouped, kernel.expert_linear(rows.float(), experts, counts).to(torch.bfloat16))
        assert_rounded_once(grouped, gm.grouped_mm_reference(rows.float(), experts.float().transpose(-1, -2), counts))


def test_linear_module_is_nn_linear_with_the_kernel():
    """Same parameter and state-dict name as `nn.Linear`, trainable as usual, the kernel only without grad."""
    layer = matvec.Linear(64, 48)
    assert isinstance(layer, torch.nn.Linear) and layer.bias is None and list(layer.state_dict()) == ["weight"]
    x = randn(1, 64)
    y = layer(x)
    y.sum().backward()
    torch.testing.assert_close(layer.weight.grad, x.expand(48, 64))
    with torch.no_grad():
        torch.testing.assert_close(layer(x), y.detach(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="has no bias"):
        matvec.Linear(4, 4, bias=True)


@pytest.mark.parametrize("counts", [[1, 0, 2, 0, 0, 1], [0, 0, 0, 4, 0, 0], [0, 0, 0, 0, 0, 0]])
def test_grouped_mm_with_few_rows_takes_the_kernel(monkeypatch, counts):
    """Fewer rows than experts (decoding): the chosen experts' rows through the compiled kernel, equal to the
    per-expert reference; with autograd the reference itself."""
    taken = []
    kernel = matvec.expert_linear
    monkeypatch.setattr(gm, "expert_linear", lambda *a: taken.append(1) or kernel(*a))
    c = torch.tensor(counts)
    x, w = randn(int(c.sum()), 200), randn(6, 300, 200, seed=1).transpose(-1, -2)  # a transposed view, as the model's
    with torch.no_grad():
        y = gm.grouped_mm(x, w, c)
    assert taken == [1]
    torch.testing.assert_close(y, gm.grouped_mm_reference(x, w, c), rtol=1e-5, atol=1e-5)
    x.requires_grad_()
    assert torch.equal(gm.grouped_mm(x, w, c), gm.grouped_mm_reference(x, w, c))


def test_counts_that_do_not_add_up_are_refused():
    with torch.no_grad(), pytest.raises(RuntimeError, match="the counts do not add up to the rows"):
        matvec.expert_linear(randn(4, 20), randn(6, 30, 20), torch.tensor([1, 0, 2, 0, 0, 2]))
