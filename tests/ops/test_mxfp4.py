"""MXFP4 decode/encode and the packed experts' products: kernel and tiles against the decode-then-matmul reference
(docs/architecture.md §11.5)."""

import pytest
import torch

from k3.checkpoint import decode_mxfp4, encode_mxfp4
from k3.ops import compiled, mxfp4
from k3.ops.mxfp4 import MXFP4Weight, expert_linear, expert_linear_reference

FP4_GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _random_mxfp4(out: int, groups: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (out, groups * 16), generator=generator).to(torch.uint8)
    scale = torch.randint(100, 150, (out, groups), generator=generator).to(torch.uint8)
    return packed, scale


def test_spec_test_vector():
    packed = torch.zeros(1, 16, dtype=torch.uint8)
    packed[0, 0] = 0x9F
    scale = torch.tensor([[128]], dtype=torch.uint8)
    decoded = decode_mxfp4(packed, scale, torch.float32)
    assert decoded[0, :2].tolist() == [-12.0, -1.0]
    assert decoded[0, 2:].abs().sum() == 0


def test_code_table_and_nibble_order():
    codes = torch.arange(32) % 16  # element 2j in the low nibble, 2j+1 in the high nibble
    packed = (codes[0::2] | (codes[1::2] << 4)).to(torch.uint8).unsqueeze(0)
    decoded = decode_mxfp4(packed, torch.tensor([[127]], dtype=torch.uint8), torch.float32)[0]
    assert decoded.tolist() == (FP4_GRID + [-v for v in FP4_GRID]) * 2
    assert torch.signbit(decoded[8])  # code 8 is -0


def test_decode_dtype_and_shape():
    packed, scale = _random_mxfp4(out=3, groups=2)
    bf16 = decode_mxfp4(packed, scale)
    fp32 = decode_mxfp4(packed, scale, torch.float32)
    assert bf16.dtype == torch.bfloat16 and fp32.shape == (3, 64)
    assert torch.equal(bf16.float(), fp32)  # every FP4 x E8M0 value is exact in bf16


@pytest.mark.parametrize(
    ("packed_shape", "scale_shape", "scale_dtype", "match"),
    [
        ((2, 16), (2, 2), torch.uint8, "shapes do not match"),
        ((2, 16), (3, 1), torch.uint8, "shapes do not match"),
        ((2, 16), (2, 1), torch.float32, "must be uint8"),
    ],
)
def test_decode_rejects_bad_inputs(packed_shape, scale_shape, scale_dtype, match):
    with pytest.raises(ValueError, match=match):
        decode_mxfp4(torch.zeros(packed_shape, dtype=torch.uint8), torch.zeros(scale_shape, dtype=scale_dtype))


def test_decode_rejects_nan_scale():
    with pytest.raises(ValueError, match="NaN"):
        decode_mxfp4(torch.zeros(1, 16, dtype=torch.uint8), torch.full((1, 1), 255, dtype=torch.uint8))


def test_encode_is_exact_on_the_grid():
    packed, scale = _random_mxfp4(out=5, groups=3)
    grid_values = decode_mxfp4(packed, scale, torch.float32)
    assert torch.equal(decode_mxfp4(*encode_mxfp4(grid_values), torch.float32), grid_values)


def test_encode_reproduces_bytes_when_each_group_reaches_the_top_code():
    packed, scale = _random_mxfp4(out=4, groups=3, seed=1)
    packed[:, 0::16] = (packed[:, 0::16] & 0xF0) | 0x07  # element 0 of every group = +6: exponent is implied
    re_packed, re_scale = encode_mxfp4(decode_mxfp4(packed, scale, torch.float32))
    assert torch.equal(re_packed, packed) and torch.equal(re_scale, scale)


def test_encode_rounds_half_to_even_and_saturates():
    row = torch.zeros(32)
    row[:10] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -2.9])
    packed, scale = encode_mxfp4(row.unsqueeze(0))
    assert scale.item() == 127  # floor(log2 6) - 2 = 0
    assert decode_mxfp4(packed, scale, torch.float32)[0, :10].tolist() == [6, 0, 1, 1, 2, 2, 4, 4, -0.0, -3]

    saturating = torch.zeros(1, 32)
    saturating[0, :2] = torch.tensor([7.5, -7.0])  # floor(log2 7.5) - 2 = 0, so both exceed 6 after scaling
    packed, scale = encode_mxfp4(saturating)
    assert decode_mxfp4(packed, scale, torch.float32)[0, :2].tolist() == [6.0, -6.0]


def test_encode_error_is_bounded():
    weight = torch.randn(16, 96, generator=torch.Generator().manual_seed(2)) * 0.02
    decoded = decode_mxfp4(*encode_mxfp4(weight), torch.float32)
    group_max = weight.abs().reshape(16, 3, 32).amax(-1, keepdim=True)
    error = (decoded - weight).abs().reshape(16, 3, 32)
    # shared exponent 2^e <= max/4 and the worst case (saturation from just under 8 to 6) is 2 * 2^e
    assert (error <= group_max / 2).all()
    assert error.mean() < 0.05 * group_max.mean()


def test_encode_zero_group_and_bf16_input():
    weight = torch.zeros(2, 64, dtype=torch.bfloat16)
    weight[1, 32:] = 3.0
    packed, scale = encode_mxfp4(weight)
    assert scale[0].tolist() == [0, 0] and scale[1, 0].item() == 0
    assert torch.equal(decode_mxfp4(packed, scale), weight)


def test_encode_rejects_bad_inputs():
    with pytest.raises(ValueError, match="divisible by 32"):
        encode_mxfp4(torch.zeros(2, 48))
    with pytest.raises(ValueError, match="inf or NaN"):
        encode_mxfp4(torch.full((1, 32), float("inf")))


def test_decode_keeps_leading_axes():
    packed, scale = _random_mxfp4(out=6, groups=2, seed=3)
    stacked = decode_mxfp4(packed.view(2, 3, 32), scale.view(2, 3, 2), torch.float32)
    assert torch.equal(stacked.view(6, 64), decode_mxfp4(packed, scale, torch.float32))


def _experts(E, O, I, seed=0):
    """Packed experts with random codes and scales around 2^0 (products stay well inside fp32's range)."""
    weight = MXFP4Weight(E, O, I)
    generator = torch.Generator().manual_seed(seed)
    weight.weight_packed.copy_(torch.randint(0, 256, weight.weight_packed.shape, generator=generator))
    weight.weight_scale.copy_(torch.randint(120, 134, weight.weight_scale.shape, generator=generator))
    return weight


def _relative(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


needs_kernel = pytest.mark.skipif(compiled.load("mxfp4") is None, reason="the compiled mxfp4 kernel is unavailable")


@needs_kernel
@pytest.mark.parametrize(("O", "I"), [(37, 96), (8, 32), (53, 224)])
def test_kernel_equals_reference_with_ragged_rows(O, I, monkeypatch):
    """Few rows per expert (0..8, ragged): the in-register kernel, equal to decode-then-matmul to fp32 rounding."""
    weight = _experts(6, O, I)
    counts = torch.tensor([3, 0, 1, 8, 0, 2])
    x = torch.randn(int(counts.sum()), I, generator=torch.Generator().manual_seed(1))
    monkeypatch.setattr(mxfp4, "_tiled", None)  # the kernel must take these calls
    with torch.no_grad():
        y = expert_linear(x, weight, counts)
        y_bf16 = expert_linear(x.bfloat16(), weight, counts)  # bf16 rows: fp32 accumulation, rounded once
    reference = expert_linear_reference(x, weight, counts)
    assert _relative(y, reference) < 1e-6
    assert y_bf16.dtype == torch.bfloat16
    assert torch.equal(y_bf16, expert_linear(x.bfloat16().float(), weight, counts).bfloat16())


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_reads_every_scale_code_exactly(dtype):
    """The compiled decoding equals decode_mxfp4 bit for bit for every code and every finite E8M0 scale (0..254,
    the subnormal 2^-127 included), into fp32 and into bf16 buffers (every MXFP4 value is a bf16 value)."""
    packed = torch.arange(256, dtype=torch.uint8).repeat(255, 1)  # [255 rows, 256 bytes]: every byte per row
    scale = torch.arange(255, dtype=torch.uint8).unsqueeze(1).repeat(1, 16)
    out = torch.empty(255, 512, dtype=dtype)
    compiled.load("mxfp4").dequantize(packed, scale, out)
    assert torch.equal(out, decode_mxfp4(packed, scale, dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tile", [5 * 96, 2 * 37 * 96 + 5])  # 5 of an expert's 37 rows; two whole experts
def test_tiles_equal_reference_and_bound_their_buffer(dtype, tile, monkeypatch):
    """Many rows: one decoded tile at a time, equal to the reference: several tiles an expert (a partial last one),
    or several experts a tile (a partial last group; experts without rows skipped)."""
    monkeypatch.setattr(mxfp4, "TILE_VALUES", tile)
    weight = _experts(5, 37, 96, seed=2)
    counts = torch.tensor([20, 0, 13, 9, 11])
    x = torch.randn(int(counts.sum()), 96, generator=torch.Generator().manual_seed(3)).to(dtype)
    with torch.no_grad():
        y = expert_linear(x, weight, counts)
    assert y.dtype == dtype
    torch.testing.assert_close(y, expert_linear_reference(x, weight, counts), rtol=0,
                               atol=(1e-5 if dtype == torch.float32 else 2e-2) * y.abs().max().item())


def test_gradient_flows_to_the_rows():
    """With autograd the tiles serve (the kernel has no backward): dx equals the reference's."""
    weight = _experts(3, 16, 64, seed=4)
    counts = torch.tensor([2, 1, 2])
    x = torch.randn(5, 64, requires_grad=True)
    grad = torch.randn(5, 16)
    (expert_linear(x, weight, counts) * grad).sum().backward()
    reference = x.detach().clone().requires_grad_()
    (expert_linear_reference(reference, weight, counts) * grad).sum().backward()
    torch.testing.assert_close(x.grad, reference.grad)


def test_no_rows():
    weight = _experts(3, 16, 64)
    assert expert_linear(torch.empty(0, 64), weight, torch.zeros(3, dtype=torch.long)).shape == (0, 16)


def test_weight_object_round_trip():
    """quantize_ encodes each expert as encode_mxfp4 does."""
    dense = torch.randn(3, 10, 64) * 0.05
    weight = MXFP4Weight(3, 10, 64).quantize_(dense)
    assert weight.shape == (3, 10, 64)
    for e in range(3):
        packed, scale = encode_mxfp4(dense[e])
        assert torch.equal(weight.weight_packed[e], packed) and torch.equal(weight.weight_scale[e], scale)
    with pytest.raises(ValueError, match="divisible by 32"):
        MXFP4Weight(1, 4, 48)


@needs_kernel
def test_compiled_encoder_equals_the_reference():
    """The compiled encoder gives the reference's bytes: random groups of every magnitude, exact ties between grid
    points (to the even code), saturation, zero groups, subnormal and huge values."""
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(64, 256, generator=generator) * torch.logspace(-40, 30, 64, base=2.0).unsqueeze(1)
    weight[0] = 0.0
    weight[1, :32] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -2.9, 7.5, -7.0] + [0.0] * 20)
    weight[2] = torch.randint(-12, 13, (256,), generator=generator) * 0.25  # many exact midpoints
    weight[3, :32] = 1e-45  # subnormal
    packed, scale = encode_mxfp4(weight)
    reference = mxfp4.encode_mxfp4_reference(weight)
    assert torch.equal(packed, reference[0]) and torch.equal(scale, reference[1])
    with pytest.raises(ValueError, match="inf or NaN"):
        encode_mxfp4(torch.full((2, 32), float("nan")))


PORTABLE_PATHS = """
import torch
from k3.ops import compiled, mxfp4
assert torch.backends.cpu.get_cpu_capability() == {capability!r}, torch.backends.cpu.get_cpu_capability()
assert compiled.load("mxfp4") is not None
generator = torch.Generator().manual_seed(0)
weight = mxfp4.MXFP4Weight(5, 19, 96)
weight.weight_packed.copy_(torch.randint(0, 256, weight.weight_packed.shape, generator=generator))
weight.weight_scale.copy_(torch.randint(120, 134, weight.weight_scale.shape, generator=generator))
counts = torch.tensor([3, 0, 1, 7, 2])
x = torch.randn(13, 96, generator=generator)
with torch.no_grad():
    y = compiled.load("mxfp4").expert_linear(x, weight.weight_packed, weight.weight_scale, counts)
reference = mxfp4.expert_linear_reference(x, weight, counts)
assert ((y - reference).abs().max() / reference.abs().max()).item() < 1e-6
dense = torch.randn(8, 64, generator=generator) * torch.logspace(-30, 30, 8, base=2.0).unsqueeze(1)
packed, scale = mxfp4.encode_mxfp4(dense)
expected = mxfp4.encode_mxfp4_reference(dense)
assert torch.equal(packed, expected[0]) and torch.equal(scale, expected[1])
print("ok")
"""


@needs_kernel
@pytest.mark.parametrize("capability", ["AVX2", "DEFAULT"])
def test_the_avx2_and_portable_kernels_equal_the_reference(capability):
    """The kernel built for another CPU capability (PyTorch's dispatch limited with ATEN_CPU_CAPABILITY: AVX2's
    8-entry permute with the sign bit, or the portable scalar loop) gives the reference's products and bytes."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability.lower()}
    result = subprocess.run([sys.executable, "-c", PORTABLE_PATHS.format(capability=capability)], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-2000:]
