"""MXFP4 decode/encode (docs/architecture.md §11.5)."""

import pytest
import torch

from k3.checkpoint import decode_mxfp4, encode_mxfp4

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
