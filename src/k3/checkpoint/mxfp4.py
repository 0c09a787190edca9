"""MXFP4 weights in the compressed-tensors ``mxfp4-pack-quantized`` format (docs/architecture.md §11.5).

A logical weight ``W [out, in]`` is stored as

* ``weight_packed [out, in/2]`` uint8: two E2M1 (FP4) codes per byte along the input dim, element 2j in the
  low nibble of byte j and element 2j+1 in the high nibble;
* ``weight_scale [out, in/32]`` uint8: one E8M0 exponent ``s`` per group of 32 consecutive input elements,
  scale factor ``2^(s - 127)``.

Only the routed experts of the released checkpoint use this format (§11.4 item 8).
"""

from __future__ import annotations

import torch
from torch import Tensor

GROUP_SIZE = 32
"""Input elements sharing one E8M0 exponent."""

E8M0_BIAS = 127
E8M0_MAX = 254
"""Largest finite E8M0 code; 255 encodes NaN (§11.5)."""

FP4_MAX = 6.0
FP4_MAX_EXPONENT = 2
"""floor(log2(FP4_MAX)): the OCP-MX shared exponent is floor(log2(max|x|)) minus this."""

FP4_SIGN_BIT = 8

FP4_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""E2M1 value of the codes 0..7; codes 8..15 are the same magnitudes with the sign bit set."""

_FP4_VALUES = torch.tensor(FP4_MAGNITUDES + tuple(-v for v in FP4_MAGNITUDES), dtype=torch.float32)
_FP4_MIDPOINTS = torch.tensor([(a + b) / 2 for a, b in zip(FP4_MAGNITUDES, FP4_MAGNITUDES[1:])])


def decode_mxfp4(packed: Tensor, scale: Tensor, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """Dequantise ``packed [out, in/2]`` / ``scale [out, in/32]`` (both uint8) into ``[out, in]`` of ``dtype``.

    ``W[o, 32g + i] = fp4(nibble(o, 32g + i)) * 2^(scale[o, g] - 127)``, computed exactly in fp32 with
    ``ldexp`` and then cast (every such value is also exact in bf16).
    """
    _check_mxfp4_pair(packed, scale)
    out, half_width = packed.shape
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(out, -1, GROUP_SIZE)
    exponents = scale.to(torch.int32).sub(E8M0_BIAS).unsqueeze(-1)
    values = torch.ldexp(_FP4_VALUES.to(packed.device)[codes.long()], exponents)
    return values.reshape(out, 2 * half_width).to(dtype)


def encode_mxfp4(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Quantise ``weight [out, in]`` (in divisible by 32) to ``(packed, scale)`` with OCP-MX rounding (§11.5).

    Per group of 32: shared exponent ``e = floor(log2(max|x|)) - 2`` stored as ``s = e + 127`` clamped to
    [0, 254]; elements ``x * 2^-(s - 127)`` rounded to nearest (ties to the even code) onto the FP4 grid,
    saturating at ±6. An all-zero group gets ``s = 0`` and zero codes, so it decodes to 0.
    """
    if weight.dim() != 2 or weight.shape[1] % GROUP_SIZE:
        raise ValueError(f"MXFP4 needs a [out, in] weight with in divisible by {GROUP_SIZE}, got {list(weight.shape)}")
    groups = weight.detach().float().reshape(weight.shape[0], -1, GROUP_SIZE)
    if not torch.isfinite(groups).all():
        raise ValueError("cannot MXFP4-encode a weight containing inf or NaN")
    scale = _shared_exponents(groups)
    scaled = torch.ldexp(groups, (E8M0_BIAS - scale.to(torch.int32)).unsqueeze(-1))
    codes = _round_to_fp4_codes(scaled).reshape(weight.shape)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed, scale


def _shared_exponents(groups: Tensor) -> Tensor:
    """E8M0 code ``clamp(floor(log2(max|x|)) - 2 + 127, 0, 254)`` of each group; 0 for all-zero groups."""
    amax = groups.abs().amax(dim=-1)
    exponent = torch.frexp(amax).exponent - 1  # floor(log2(amax)) for amax > 0, exact (no log2 rounding)
    code = (exponent - FP4_MAX_EXPONENT + E8M0_BIAS).clamp(0, E8M0_MAX)
    return torch.where(amax > 0, code, 0).to(torch.uint8)


def _round_to_fp4_codes(x: Tensor) -> Tensor:
    """Nearest FP4 code (0..15, uint8) of each element; ties go to the even code, magnitudes above 6 saturate."""
    magnitude = x.abs()
    midpoints = _FP4_MIDPOINTS.to(x.device)
    rounded_down = torch.bucketize(magnitude, midpoints, right=False)  # a tie resolves to the lower code
    rounded_up = torch.bucketize(magnitude, midpoints, right=True)  # a tie resolves to the upper code
    code = torch.where(rounded_down % 2 == 0, rounded_down, rounded_up)
    sign = torch.signbit(x).to(code.dtype) * FP4_SIGN_BIT
    return (code + sign).to(torch.uint8)


def _check_mxfp4_pair(packed: Tensor, scale: Tensor) -> None:
    """Raise ValueError unless ``packed``/``scale`` are uint8 ``[out, in/2]``/``[out, in/32]`` with finite scales."""
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(f"MXFP4 tensors must be uint8, got packed {packed.dtype} and scale {scale.dtype}")
    groups_per_row = GROUP_SIZE // 2
    if packed.dim() != 2 or scale.dim() != 2 or packed.shape != (scale.shape[0], scale.shape[1] * groups_per_row):
        raise ValueError(
            f"MXFP4 shapes do not match: packed {list(packed.shape)} must be [out, 16 * groups] "
            f"for scale {list(scale.shape)} = [out, groups]"
        )
    if (scale > E8M0_MAX).any():
        raise ValueError("MXFP4 scale contains the E8M0 NaN code 255")
