"""MoonViT-V2, the K3 vision encoder (module `vision_tower`; docs/architecture.md §9.1, §9.3–§9.6, §9.11).

All patches of all media items of a batch run as one packed stream (native resolution, no padding between items);
`grid_thws` [I, 3] gives each item's (t, h, w) patch grid, and attention is block-diagonal per item: different
images never attend to each other, the ≤ 4 frames of one video chunk attend jointly. Each item's attention runs
in query chunks (`block_diagonal_attention`), so memory stays linear in its patch count (a 12 MP photo is one item
of 62,208 patches).

Shape suffixes (`x_BTD`): the package-wide legend at the top of docs/architecture.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from k3.config import K3VisionConfig
from k3.ops.norm import RMSNorm
from k3.ops.precision import fp32

ROPE_MAX_SIDE = 512  # the released 2D RoPE table is 512 × 512 (§9.5)

Grid = tuple[int, int, int]


def check_grids(grid_thws: torch.Tensor | Sequence[Sequence[int]], num_patches: int,
                config: K3VisionConfig) -> list[Grid]:
    """Validate `grid_thws` against the packed patch count and the encoder's limits; return [(t, h, w), ...]."""
    grids_I3 = torch.as_tensor(grid_thws)
    if grids_I3.dim() != 2 or grids_I3.shape[1] != 3 or grids_I3.is_floating_point() or grids_I3.shape[0] == 0:
        raise ValueError(f"grid_thws must be an integer tensor [n_items, 3] of (t, h, w) patch grids, got "
                         f"{grids_I3.dtype} {tuple(grids_I3.shape)}")
    grids = [tuple(int(v) for v in row) for row in grids_I3.tolist()]
    for i, (t, h, w) in enumerate(grids):
        if not 1 <= t <= config.init_pos_emb_time:
            raise ValueError(f"grid_thws[{i}] = {(t, h, w)}: t must be in 1..{config.init_pos_emb_time} "
                             "(frames per media item)")
        if h <= 0 or w <= 0 or h % 2 or w % 2:
            raise ValueError(f"grid_thws[{i}] = {(t, h, w)}: h and w must be positive and even (2×2 merge, §9.7)")
        if h > ROPE_MAX_SIDE or w > ROPE_MAX_SIDE:
            raise ValueError(f"grid_thws[{i}] = {(t, h, w)}: h and w must be at most {ROPE_MAX_SIDE} patches")
    total = sum(t * h * w for t, h, w in grids)
    if total != num_patches:
        raise ValueError(f"grid_thws describe {total} patches (Σ t·h·w) but pixel_values holds {num_patches}")
    return grids


def fan_in_trunc_normal_(weight: torch.Tensor) -> None:
    """Truncated normal (±2 std) with std = √(2/fan_in): the released vision init of MLP and projector linears."""
    std = math.sqrt(2 / weight.shape[1])
    nn.init.trunc_normal_(weight, std=std, a=-2 * std, b=2 * std)


def time_embedding(num_frames: int, dim: int) -> torch.Tensor:
    """Fixed [num_frames, dim] table (float64): time[τ] = [sin(τ·ω_i), cos(τ·ω_i)], ω_i = 10000^(−i/(dim/2))
    (§9.3; frame 0 gets +1 on the cosine half)."""
    omega = 10000.0 ** (-torch.arange(dim // 2, dtype=torch.float64) / (dim // 2))
    angle = torch.arange(num_frames, dtype=torch.float64)[:, None] * omega
    return torch.cat([angle.sin(), angle.cos()], dim=-1)


class PosEmb(nn.Module):
    """Learned [H₀, W₀, D] absolute position table, bilinearly resized per item; fixed time embedding for
    multi-frame items (module `patch_embed.pos_emb`, §9.3)."""

    def __init__(self, config: K3VisionConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.init_pos_emb_height, config.init_pos_emb_width,
                                               config.vt_hidden_size))

    def forward(self, grid: Grid) -> torch.Tensor:
        """Position embeddings [t·h·w, D] of one item, frame-major then row-major."""
        t, h, w = grid
        table_hwD = self.weight
        if (h, w) == tuple(table_hwD.shape[:2]):
            pos_XD = table_hwD.flatten(0, 1)
        else:  # resize the table like a D-channel image (align_corners=False, no antialiasing)
            pos_1Dhw = F.interpolate(table_hwD.permute(2, 0, 1)[None], size=(h, w), mode="bilinear",
                                     align_corners=False)
            pos_XD = pos_1Dhw[0].flatten(1).t()
        if t == 1:
            return pos_XD  # single frames get no time embedding at all
        time_t1D = time_embedding(t, pos_XD.shape[-1]).to(pos_XD)[:, None]  # fixed, not in the checkpoint (§11.3)
        return (pos_XD[None] + time_t1D).flatten(0, 1)


class PatchEmbed(nn.Module):
    """Conv2d(3, D, P, stride P, no bias) on each [3, P, P] patch, plus the position embedding (§9.3)."""

    def __init__(self, config: K3VisionConfig):
        super().__init__()
        P = config.patch_size
        self.proj = nn.Conv2d(3, config.vt_hidden_size, kernel_size=P, stride=P, bias=False)
        self.pos_emb = PosEmb(config)

    def forward(self, pixels_N3hw: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        # each row of pixels is one P×P patch, which the stride-P conv covers exactly: a matmul with the flattened
        # kernel (4× faster than the conv call on CPU, forward and backward)
        x_ND = F.linear(pixels_N3hw.to(self.proj.weight.dtype).flatten(1), self.proj.weight.flatten(1))
        return x_ND + torch.cat([self.pos_emb(g) for g in grids]).to(x_ND.dtype)


def rope_2d_angles(grids: Sequence[Grid], head_dim: int, theta: float = 10000.0,
                   device: torch.device | None = None) -> torch.Tensor:
    """Rotation angles [N, K/2] (float64) of the packed patches (§9.5): complex pair 2j turns by x·f_j (column),
    pair 2j+1 by y·f_j (row), f_j = θ^(−4j/K); every frame of an item repeats the same spatial angles."""
    freq_J = theta ** (-4 * torch.arange(head_dim // 4, dtype=torch.float64, device=device) / head_dim)
    angles = []
    for t, h, w in grids:
        y_X = torch.arange(h, dtype=torch.float64, device=device).repeat_interleave(w)
        x_X = torch.arange(w, dtype=torch.float64, device=device).repeat(h)
        pairs_XJ2 = torch.stack([x_X[:, None] * freq_J, y_X[:, None] * freq_J], dim=-1)
        angles.append(pairs_XJ2.flatten(1).repeat(t, 1))
    return torch.cat(angles)


def apply_rope_2d(x_NHK: torch.Tensor, angles_NX: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs (x_{2p} + i·x_{2p+1}) by e^{i·angle_p} in fp32 (complex multiply), cast back."""
    x = fp32(x_NHK)
    pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
    angles_NX = angles_NX.to(x.dtype)
    rotated = pairs * torch.polar(torch.ones_like(angles_NX), angles_NX)[:, None, :]
    return torch.view_as_real(rotated).flatten(-2).to(x_NHK.dtype)


MAX_SCORES_PER_CALL = 2 ** 28  # attention scores one SDPA call may hold: 1 GiB in fp32 if it falls back to math


def block_diagonal_attention(q_NHK: torch.Tensor, k_NHK: torch.Tensor, v_NHK: torch.Tensor, lengths: Sequence[int],
                             max_scores: int | None = None) -> torch.Tensor:
    """Softmax attention within each item of the packed stream (items of `lengths` patches) → [N, H, K].

    Memory is linear in the item's length L, never O(L²): each item's queries go to
    `F.scaled_dot_product_attention` in chunks of ⌊max_scores / (H·L)⌋ rows (at least 1; max_scores defaults to
    MAX_SCORES_PER_CALL), so a call holds at most max(max_scores, H·L) scores at a time even where SDPA uses its
    math kernel, which materialises them (CPU with 3-D inputs, CUDA float64, ...). Inputs are passed 4-D
    [1, H, rows, K], the layout the fused kernels (CPU flash, CUDA flash / memory-efficient) accept, which never
    materialise the scores. Softmax is per query row, so the chunks give the unchunked result up to floating-point
    rounding (§9.4 numerics unchanged). A 4032×3024 photo is one item of 62,208 patches, whose unchunked fp32
    scores would take 15.5 GB per head. (With autograd, the math kernel keeps every chunk's probabilities for the
    backward pass; the fused kernels keep only a log-sum-exp per row.)
    """
    max_scores = MAX_SCORES_PER_CALL if max_scores is None else max_scores
    if not isinstance(max_scores, int) or max_scores < 1:
        raise ValueError(f"max_scores must be a positive integer, got {max_scores!r}")
    outs = []
    for q, k, v in zip(*(t.split(list(lengths)) for t in (q_NHK, k_NHK, v_NHK))):  # block-diagonal per item
        q_1HTK, k_1HSK, v_1HSK = (t.transpose(0, 1)[None] for t in (q, k, v))
        heads, length = q_1HTK.shape[1], q_1HTK.shape[2]
        rows = max(1, max_scores // (heads * length))
        for start in range(0, length, rows):
            out_1HTK = F.scaled_dot_product_attention(q_1HTK[:, :, start:start + rows], k_1HSK, v_1HSK)
            outs.append(out_1HTK[0].transpose(0, 1))
    return torch.cat(outs)


class VisionMLP(nn.Module):
    """fc1(GELU_tanh(fc0(x))), no biases (`mlp_type = mlp2`, §9.4)."""

    def __init__(self, config: K3VisionConfig):
        super().__init__()
        self.fc0 = nn.Linear(config.vt_hidden_size, config.vt_intermediate_size, bias=False)
        self.fc1 = nn.Linear(config.vt_intermediate_size, config.vt_hidden_size, bias=False)

    def forward(self, x_ND: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.gelu(self.fc0(x_ND), approximate="tanh"))


class EncoderBlock(nn.Module):
    """Pre-norm layer (§9.4): x ← x + wo·Attn(RoPE2D(wqkv·norm0(x))); x ← x + mlp(norm1(x))."""

    def __init__(self, config: K3VisionConfig):
        super().__init__()
        D, eps = config.vt_hidden_size, config.vt_rms_norm_eps
        self.num_heads, self.head_dim = config.vt_num_attention_heads, config.head_dim
        self.norm0 = RMSNorm(D, eps)
        self.wqkv = nn.Linear(D, 3 * config.qkv_hidden_size, bias=False)
        self.wo = nn.Linear(config.qkv_hidden_size, D, bias=False)
        self.norm1 = RMSNorm(D, eps)
        self.mlp = VisionMLP(config)

    def attention(self, x_ND: torch.Tensor, lengths: Sequence[int], angles_NX: torch.Tensor) -> torch.Tensor:
        N = x_ND.shape[0]
        qkv_N3HK = self.wqkv(x_ND).view(N, 3, self.num_heads, self.head_dim)  # rows q | k | v, head-major
        q_NHK = apply_rope_2d(qkv_N3HK[:, 0], angles_NX)
        k_NHK = apply_rope_2d(qkv_N3HK[:, 1], angles_NX)
        v_NHK = qkv_N3HK[:, 2]
        return self.wo(block_diagonal_attention(q_NHK, k_NHK, v_NHK, lengths).flatten(1))

    def forward(self, x_ND: torch.Tensor, lengths: Sequence[int], angles_NX: torch.Tensor) -> torch.Tensor:
        x_ND = x_ND + self.attention(self.norm0(x_ND), lengths, angles_NX)
        return x_ND + self.mlp(self.norm1(x_ND))


class Encoder(nn.Module):
    def __init__(self, config: K3VisionConfig):
        super().__init__()
        self.blocks = nn.ModuleList(EncoderBlock(config) for _ in range(config.vt_num_hidden_layers))
        self.final_layernorm = RMSNorm(config.vt_hidden_size, config.vt_rms_norm_eps)

    def forward(self, x_ND: torch.Tensor, lengths: Sequence[int], angles_NX: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x_ND = block(x_ND, lengths, angles_NX)
        return self.final_layernorm(x_ND)


class MoonViT(nn.Module):
    """Packed patches [N, 3, P, P] + `grid_thws` [I, 3] → encoded patches [N, D] after the final norm (§9.1)."""

    def __init__(self, config: K3VisionConfig):
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.encoder = Encoder(config)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """From-scratch init of the released code (§9.11 [U]): pos_emb ~ N(0, 1); MLP linears ~ truncated
        normal with std √(2/fan_in); wqkv, wo and the patch conv keep PyTorch's defaults; norm gains 1."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Conv2d)):
                module.reset_parameters()
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        nn.init.normal_(self.patch_embed.pos_emb.weight)
        for block in self.encoder.blocks:
            fan_in_trunc_normal_(block.mlp.fc0.weight)
            fan_in_trunc_normal_(block.mlp.fc1.weight)

    def forward(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor | Sequence[Sequence[int]]) -> torch.Tensor:
        P = self.config.patch_size
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (3, P, P):
            raise ValueError(f"pixel_values must be packed patches [N, 3, {P}, {P}], got {tuple(pixel_values.shape)}")
        if not pixel_values.is_floating_point() or not torch.isfinite(pixel_values).all():
            raise ValueError("pixel_values must be finite floating-point (normalised) pixels")
        grids = check_grids(grid_thws, pixel_values.shape[0], self.config)
        x_ND = self.patch_embed(pixel_values, grids)
        angles_NX = rope_2d_angles(grids, self.config.head_dim, self.config.rope_theta, x_ND.device)
        return self.encoder(x_ND, [t * h * w for t, h, w in grids], angles_NX)
