"""MXFP4 weights in the compressed-tensors ``mxfp4-pack-quantized`` format (docs/architecture.md §11.5).

A logical weight ``W [out, in]`` is stored as

* ``weight_packed [out, in/2]`` uint8: two E2M1 (FP4) codes per byte along the input dim, element 2j in the
  low nibble of byte j and element 2j+1 in the high nibble;
* ``weight_scale [out, in/32]`` uint8: one E8M0 exponent ``s`` per group of 32 consecutive input elements,
  scale factor ``2^(s - 127)``.

Only the routed experts of the released checkpoint use this format (§11.4 item 8). `MXFP4Weight` holds a layer's
stacked experts in it, as stored; `expert_linear` multiplies rows sorted by expert by them without writing a dense
expert: few rows per expert (decoding) on the compiled kernel (`mxfp4_kernel.cpp`: each 32-value block decoded in
registers inside the dot product), many rows (prefill, scoring) one decoded tile at a time into a small buffer and a
matrix product; `expert_linear_reference` (decode the expert, then multiply) is the reference and the fallback.
"""
# Shape suffixes (`x_BTD`): the package-wide legend at the top of docs/architecture.md.
# Here: A rows sorted by expert, E experts, O output width, I input width.

from __future__ import annotations

import torch
from torch import Tensor, nn

from k3.ops import compiled
from k3.ops.grouped_mm import grouped_mm

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
    """Dequantise ``packed [..., out, in/2]`` / ``scale [..., out, in/32]`` (uint8) into ``[..., out, in]`` of ``dtype``.

    ``W[o, 32g + i] = fp4(nibble(o, 32g + i)) * 2^(scale[o, g] - 127)``, computed exactly in fp32 with
    ``ldexp`` and then cast (every such value is also exact in bf16).
    """
    check_mxfp4_pair(packed, scale)
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(*scale.shape, GROUP_SIZE)
    exponents = scale.to(torch.int32).sub(E8M0_BIAS).unsqueeze(-1)
    values = torch.ldexp(_FP4_VALUES.to(packed.device)[codes.long()], exponents)
    return values.reshape(*packed.shape[:-1], 2 * packed.shape[-1]).to(dtype)


def encode_mxfp4(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Quantise ``weight [..., out, in]`` (in divisible by 32) to ``(packed, scale)`` with OCP-MX rounding (§11.5).

    Per group of 32: shared exponent ``e = floor(log2(max|x|)) - 2`` stored as ``s = e + 127`` clamped to
    [0, 254]; elements ``x * 2^-(s - 127)`` rounded to nearest (ties to the even code) onto the FP4 grid,
    saturating at ±6. An all-zero group gets ``s = 0`` and zero codes, so it decodes to 0.
    """
    if weight.dim() < 2 or weight.shape[-1] % GROUP_SIZE:
        raise ValueError(f"MXFP4 needs a [out, in] weight with in divisible by {GROUP_SIZE}, got {list(weight.shape)}")
    weight = weight.detach().float()
    if compiled.serves("mxfp4", weight):  # the same rounding in one compiled pass
        return _encode_compiled(weight.contiguous())
    return encode_mxfp4_reference(weight)


def encode_mxfp4_reference(weight: Tensor) -> tuple[Tensor, Tensor]:
    """`encode_mxfp4` in torch ops (the reference of the compiled encoder)."""
    groups = weight.detach().float().reshape(*weight.shape[:-1], -1, GROUP_SIZE)
    if not torch.isfinite(groups).all():
        raise ValueError("cannot MXFP4-encode a weight containing inf or NaN")
    scale = _shared_exponents(groups)
    scaled = torch.ldexp(groups, (E8M0_BIAS - scale.to(torch.int32)).unsqueeze(-1))
    codes = _round_to_fp4_codes(scaled).reshape(weight.shape)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, scale


def _encode_compiled(weight: Tensor) -> tuple[Tensor, Tensor]:
    """`encode_mxfp4` of a contiguous fp32 CPU weight on the compiled kernel."""
    packed = torch.empty(*weight.shape[:-1], weight.shape[-1] // 2, dtype=torch.uint8)
    scale = torch.empty(*weight.shape[:-1], weight.shape[-1] // GROUP_SIZE, dtype=torch.uint8)
    try:
        compiled.load("mxfp4").quantize(weight, packed, scale)
    except RuntimeError as error:  # a non-finite value: the reference's message
        raise ValueError(str(error).splitlines()[0]) from None
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


def check_mxfp4_pair(packed: Tensor, scale: Tensor) -> None:
    """Raise ValueError unless ``packed``/``scale`` are uint8 ``[..., out, in/2]``/``[..., out, in/32]`` with finite
    scales."""
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(f"MXFP4 tensors must be uint8, got packed {packed.dtype} and scale {scale.dtype}")
    bytes_per_group = GROUP_SIZE // 2
    if packed.dim() < 2 or packed.shape != (*scale.shape[:-1], scale.shape[-1] * bytes_per_group):
        raise ValueError(
            f"MXFP4 shapes do not match: packed {list(packed.shape)} must be [..., out, 16 * groups] "
            f"for scale {list(scale.shape)} = [..., out, groups]"
        )
    if (scale > E8M0_MAX).any():
        raise ValueError("MXFP4 scale contains the E8M0 NaN code 255")


class MXFP4Weight(nn.Module):
    """E stacked ``[out, in]`` matrices kept as stored (§11.5): buffers ``weight_packed [E, out, in/2]`` and
    ``weight_scale [E, out, in/32]`` (uint8), named like one expert's checkpoint pair. 4.25 bits a weight; no
    gradient (QAT trains dense weights, `fake_quantize`)."""

    def __init__(self, experts: int, out_features: int, in_features: int, device: torch.device | None = None):
        super().__init__()
        if in_features % GROUP_SIZE:
            raise ValueError(f"MXFP4 needs an input width divisible by {GROUP_SIZE}, got {in_features}")
        self.in_features = in_features
        self.register_buffer("weight_packed", torch.zeros(experts, out_features, in_features // 2, dtype=torch.uint8,
                                                          device=device))
        self.register_buffer("weight_scale", torch.zeros(experts, out_features, in_features // GROUP_SIZE,
                                                         dtype=torch.uint8, device=device))

    @property
    def shape(self) -> torch.Size:
        """The logical shape [E, out, in]."""
        return torch.Size((*self.weight_packed.shape[:2], self.in_features))

    def extra_repr(self) -> str:
        return f"experts={self.shape[0]}, out_features={self.shape[1]}, in_features={self.in_features}, format=mxfp4"

    @torch.no_grad()
    def quantize_(self, dense_EOI: Tensor) -> "MXFP4Weight":
        """Encode ``dense_EOI`` into the buffers one expert at a time (working memory: one expert)."""
        for e, matrix in enumerate(dense_EOI):
            self.weight_packed[e], self.weight_scale[e] = encode_mxfp4(matrix)
        return self

    @torch.no_grad()
    def reset_parameters(self, std: float) -> None:
        """Weights drawn from N(0, std²) and encoded, one expert at a time (the dense model's initialisation)."""
        E, O, I = self.shape
        for e in range(E):
            self.weight_packed[e], self.weight_scale[e] = encode_mxfp4(torch.randn(O, I) * std)


TILE_VALUES = 1 << 22
"""Decoded weights per tile of the many-rows path (8 MiB in bf16, 16 MiB in fp32): its memory, whatever the size and
number of the experts."""


def expert_linear_reference(x_AI: Tensor, weight: MXFP4Weight, counts_E: Tensor) -> Tensor:
    """x[rows of e] W_eᵀ for every expert e with rows, each expert decoded whole into x's dtype (the reference)."""
    y_AO = x_AI.new_empty(x_AI.shape[0], weight.shape[1])
    for e, start, n in _experts_with_rows(counts_E):
        w_OI = decode_mxfp4(weight.weight_packed[e], weight.weight_scale[e], x_AI.dtype)
        y_AO[start:start + n] = x_AI[start:start + n] @ w_OI.t()
    return y_AO


def expert_linear(x_AI: Tensor, weight: MXFP4Weight, counts_E: Tensor) -> Tensor:
    """Row block e of ``x_AI`` (``counts_E[e]`` rows, in expert order) times W_eᵀ, W_e in MXFP4; [A, out].

    At most `KERNEL_ROWS` rows an expert without autograd: the compiled kernel (fp32 accumulation, the result in x's
    dtype), else one decoded tile at a time."""
    if x_AI.shape[0] == 0:
        return x_AI.new_empty(0, weight.shape[1])
    few_rows = int(counts_E.max()) <= KERNEL_ROWS and not (torch.is_grad_enabled() and x_AI.requires_grad)
    x32_AI = x_AI.float()  # the kernel accumulates in fp32 whatever the activations' dtype (a few rows: no cost)
    if few_rows and _kernel_serves(x32_AI, weight):
        y_AO = compiled.load("mxfp4").expert_linear(x32_AI.contiguous(), weight.weight_packed, weight.weight_scale,
                                                    counts_E.long().contiguous())
        return y_AO.to(x_AI.dtype)
    return _tiled(x_AI, weight, counts_E)


KERNEL_ROWS = 8
"""Rows per expert up to which the in-register kernel beats a decoded tile and a matrix product."""


def _kernel_serves(x_AI: Tensor, weight: MXFP4Weight) -> bool:
    """fp32 or bf16 CPU rows, contiguous CPU weights, the kernel built."""
    packed, scale = weight.weight_packed, weight.weight_scale
    return (packed.is_contiguous() and scale.is_contiguous() and packed.is_cpu
            and compiled.serves("mxfp4", x_AI, dtypes=(torch.float32, torch.bfloat16)))


def _tiled(x_AI: Tensor, weight: MXFP4Weight, counts_E: Tensor) -> Tensor:
    """`expert_linear` for many rows, the experts' weights decoded `TILE_VALUES` at a time into x's dtype: whole
    experts together where several fit in a tile (their rows then take one grouped matrix product), else each expert
    a tile of its output rows at a time; so the working memory is the tile, not the experts. Compiled decoding into
    one reused buffer for fp32 or bf16 CPU rows without autograd; with autograd each tile is a tensor of its own (the
    product's backward keeps it)."""
    E, O, I = weight.shape
    reuse = not (torch.is_grad_enabled() and x_AI.requires_grad) and _kernel_serves(x_AI, weight)
    buffer = x_AI.new_empty(TILE_VALUES) if reuse else None
    y_AO = x_AI.new_empty(x_AI.shape[0], O)
    experts = _experts_with_rows(counts_E)
    per_tile = TILE_VALUES // (O * I)
    if per_tile >= 2:
        for g in range(0, len(experts), per_tile):
            group = experts[g:g + per_tile]
            w_GOI = _decoded(*_gathered(weight, [e for e, _, _ in group]), x_AI.dtype, buffer)
            first, last = group[0][1], group[-1][1] + group[-1][2]
            y_AO[first:last] = grouped_mm(x_AI[first:last], w_GOI.transpose(-1, -2),
                                          torch.tensor([n for _, _, n in group]))
        return y_AO
    tile_rows = max(1, min(O, TILE_VALUES // I))
    for e, start, n in experts:
        for o in range(0, O, tile_rows):
            w_tI = _decoded(weight.weight_packed[e, o:o + tile_rows], weight.weight_scale[e, o:o + tile_rows],
                            x_AI.dtype, buffer)
            y_AO[start:start + n, o:o + w_tI.shape[0]] = x_AI[start:start + n] @ w_tI.t()
    return y_AO


def _gathered(weight: MXFP4Weight, experts: list[int]) -> tuple[Tensor, Tensor]:
    """The packed bytes and scales of `experts` (ascending): a view where they are consecutive, else a copy."""
    if experts[-1] - experts[0] == len(experts) - 1:
        return weight.weight_packed[experts[0]:experts[-1] + 1], weight.weight_scale[experts[0]:experts[-1] + 1]
    ids = torch.tensor(experts, device=weight.weight_packed.device)
    return weight.weight_packed.index_select(0, ids), weight.weight_scale.index_select(0, ids)


def _decoded(packed: Tensor, scale: Tensor, dtype: torch.dtype, buffer: Tensor | None) -> Tensor:
    """``packed [..., in/2]`` with its scales decoded into the front of `buffer` (compiled), or into a new tensor
    (`decode_mxfp4`) where there is no buffer."""
    if buffer is None:
        return decode_mxfp4(packed, scale, dtype)
    out = buffer[:2 * packed.numel()].view(*packed.shape[:-1], 2 * packed.shape[-1])
    compiled.load("mxfp4").dequantize(packed.contiguous(), scale.contiguous(), out)
    return out


def _experts_with_rows(counts_E: Tensor) -> list[tuple[int, int, int]]:
    """(expert, first row, rows) of every expert with rows, for rows sorted by expert."""
    counts = counts_E.tolist()
    starts = [0]
    for c in counts[:-1]:
        starts.append(starts[-1] + c)
    return [(e, start, c) for e, (start, c) in enumerate(zip(starts, counts)) if c]


class _FakeQuantize(torch.autograd.Function):
    """W rounded to MXFP4 and back in the forward; the gradient passes straight through (QAT)."""

    @staticmethod
    def forward(ctx, weight: Tensor) -> Tensor:
        return decode_mxfp4(*encode_mxfp4(weight), weight.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad


def fake_quantize(weight: Tensor) -> Tensor:
    """``weight [..., out, in]`` as its MXFP4 encoding decodes (`encode_mxfp4`, the export's encoder), in its dtype,
    with a straight-through gradient: training sees the weights the packed export will hold."""
    return _FakeQuantize.apply(weight)
