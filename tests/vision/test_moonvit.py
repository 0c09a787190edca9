"""MoonViT-V2, merger and projector (docs/architecture.md §9.3–§9.8, §12.3 item 14)."""

from __future__ import annotations

import contextlib
import math
import os

import pytest
import torch
import torch.nn.functional as F

from conformance import TINY_VISION, random_media
from k3.config import K3Config, K3VisionConfig
from k3.vision import MoonViT, PatchMergerProjector, merge_patches
from k3.vision.moonvit import apply_rope_2d, rope_2d_angles, time_embedding

GRIDS = [(1, 4, 6), (1, 2, 2), (3, 6, 4), (1, 8, 2)]  # images of different sizes and one 3-frame video chunk


def tiny_vit(seed: int = 0, dtype=torch.float64, **overrides) -> MoonViT:
    torch.manual_seed(seed)
    vit = MoonViT(K3VisionConfig(**{**TINY_VISION, **overrides})).to(dtype)
    with torch.no_grad():  # move norm gains off 1 so that a skipped norm fails
        for name, p in vit.named_parameters():
            if name.endswith(("norm0.weight", "norm1.weight", "final_layernorm.weight")):
                p.copy_(1 + 0.2 * torch.randn_like(p))
    return vit.eval()


@pytest.fixture(scope="module")
def vit():
    return tiny_vit()


def test_packing_invariance(vit):
    """A packed batch of differently sized items encodes each item exactly as encoding it alone (§9.6)."""
    pixels, grids = random_media(GRIDS, seed=1)
    packed = vit(pixels.double(), grids)
    assert packed.shape == (pixels.shape[0], 24)
    for item, (px, grid) in enumerate(zip(pixels.double().split(grids.prod(1).tolist()), grids)):
        alone = vit(px, grid[None])
        start = int(grids[:item].prod(1).sum())
        torch.testing.assert_close(packed[start:start + len(px)], alone, rtol=0, atol=1e-12)


def test_no_cross_item_attention(vit):
    """Perturbing one image changes its own features and leaves every other item's unchanged."""
    pixels, grids = random_media(GRIDS, seed=2)
    pixels = pixels.double()
    lengths = grids.prod(1).tolist()
    before = vit(pixels, grids).split(lengths)
    perturbed = pixels.clone()
    start = lengths[0]
    perturbed[start:start + lengths[1]] += torch.randn_like(perturbed[start:start + lengths[1]])
    after = vit(perturbed, grids).split(lengths)
    for i in range(len(lengths)):
        if i == 1:
            assert (after[i] - before[i]).abs().max() > 1e-2
        else:
            assert torch.equal(after[i], before[i])


def naive_block(block, x_ND, grids, theta=10000.0):
    """One encoder layer written out with an explicit [N, N] block-diagonal mask and real-valued RoPE."""
    H, K = block.num_heads, block.head_dim
    N = x_ND.shape[0]
    item = torch.cat([torch.full((t * h * w,), i) for i, (t, h, w) in enumerate(grids)])
    rows, cols = [], []
    for t, h, w in grids:
        for _ in range(t):
            for y in range(h):
                for x in range(w):
                    rows.append(y)
                    cols.append(x)
    y_N, x_N = torch.tensor(rows, dtype=torch.float64), torch.tensor(cols, dtype=torch.float64)

    def rope(v_NHK):
        out = v_NHK.clone()
        for p in range(K // 2):
            j, uses_row = p // 2, p % 2 == 1
            angle = (y_N if uses_row else x_N) * theta ** (-4 * j / K)
            c, s = angle.cos()[:, None], angle.sin()[:, None]
            a, b = v_NHK[..., 2 * p], v_NHK[..., 2 * p + 1]
            out[..., 2 * p], out[..., 2 * p + 1] = a * c - b * s, a * s + b * c
        return out

    h_ND = block.norm0(x_ND)
    qkv = h_ND @ block.wqkv.weight.t()
    q, k, v = (qkv[:, i * H * K:(i + 1) * H * K].reshape(N, H, K) for i in range(3))
    q, k = rope(q), rope(k)
    scores = torch.einsum("nhk,mhk->hnm", q, k) / math.sqrt(K)
    scores = scores.masked_fill(item[:, None] != item[None, :], -math.inf)
    attn = torch.einsum("hnm,mhk->nhk", scores.softmax(-1), v).reshape(N, H * K)
    x_ND = x_ND + attn @ block.wo.weight.t()
    mlp = F.gelu(block.norm1(x_ND) @ block.mlp.fc0.weight.t(), approximate="tanh") @ block.mlp.fc1.weight.t()
    return x_ND + mlp


def test_encoder_layer_matches_naive_masked_attention(vit):
    """Per-item SDPA + complex RoPE == dense masked attention + explicit pair rotation (float64)."""
    grids = [tuple(g) for g in GRIDS]
    x = torch.randn(sum(t * h * w for t, h, w in grids), 24, dtype=torch.float64)
    angles = rope_2d_angles(grids, vit.config.head_dim)
    lengths = [t * h * w for t, h, w in grids]
    block = vit.encoder.blocks[0]
    torch.testing.assert_close(block(x, lengths, angles), naive_block(block, x, grids), rtol=0, atol=1e-12)


def test_rope_pairs_column_on_even_pairs():
    """Pair 2j turns by x·f_j and pair 2j+1 by y·f_j, f_j = 10000^(−4j/K) (§9.5)."""
    K = 16
    angles = rope_2d_angles([(1, 3, 5)], K)  # positions row-major: index = y·5 + x
    f = 10000.0 ** (-4 * torch.arange(K // 4, dtype=torch.float64) / K)
    y, x = 2, 3
    torch.testing.assert_close(angles[y * 5 + x, 0::2], x * f)
    torch.testing.assert_close(angles[y * 5 + x, 1::2], y * f)
    # frames of one item repeat the same spatial angles
    video = rope_2d_angles([(3, 3, 5)], K)
    torch.testing.assert_close(video, angles.repeat(3, 1))


def test_rope_relative_position_property():
    """⟨RoPE(q, p₁), RoPE(k, p₂)⟩ depends only on p₁ − p₂ in both axes, and a row shift ≠ a column shift."""
    K = 16
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, K, generator=gen, dtype=torch.float64), torch.randn(1, 1, K, generator=gen,
                                                                                  dtype=torch.float64)
    angles = rope_2d_angles([(1, 8, 8)], K)

    def score(p1, p2):
        a1, a2 = angles[p1[0] * 8 + p1[1]][None], angles[p2[0] * 8 + p2[1]][None]
        return float((apply_rope_2d(q, a1) * apply_rope_2d(k, a2)).sum())

    assert score((1, 2), (0, 0)) == pytest.approx(score((5, 6), (4, 4)), abs=1e-12)
    assert score((3, 1), (2, 5)) == pytest.approx(score((6, 3), (5, 7)), abs=1e-12)
    assert abs(score((1, 0), (0, 0)) - score((0, 1), (0, 0))) > 1e-3


def test_merge_order_on_a_hand_built_grid():
    """Merged token (Y, X) = patches (2Y,2X), (2Y,2X+1), (2Y+1,2X), (2Y+1,2X+1); row-major; mean over t (§9.7)."""
    t, h, w, D = 2, 4, 6, 3
    coords = torch.zeros(t, h, w, D)
    for f in range(t):
        for y in range(h):
            for x in range(w):
                coords[f, y, x] = torch.tensor([y, x, 10 * f])  # patch coordinates in the channels
    merged = merge_patches(coords.reshape(-1, D), [(t, h, w)])
    assert merged.shape == ((h // 2) * (w // 2), 4 * D)
    for Y in range(h // 2):
        for X in range(w // 2):
            row = merged[Y * (w // 2) + X].view(4, D)
            expected = [[2 * Y, 2 * X, 5], [2 * Y, 2 * X + 1, 5], [2 * Y + 1, 2 * X, 5], [2 * Y + 1, 2 * X + 1, 5]]
            assert row.tolist() == expected


def test_position_embedding_rules():
    """Identity at the table size; bilinear resize otherwise; no time embedding for t = 1; time[τ] for t > 1."""
    vit = tiny_vit(dtype=torch.float32)
    pos = vit.patch_embed.pos_emb
    table = pos.weight
    assert torch.equal(pos((1, 6, 5)), table.flatten(0, 1))
    resized = F.interpolate(table.permute(2, 0, 1)[None], size=(4, 8), mode="bilinear", align_corners=False)
    torch.testing.assert_close(pos((1, 4, 8)), resized[0].flatten(1).t())
    video = pos((3, 6, 5)).view(3, 30, 24)
    time = time_embedding(3, 24).float()
    for tau in range(3):
        torch.testing.assert_close(video[tau], table.flatten(0, 1) + time[tau])
    assert torch.equal(time[0, :12], torch.zeros(12)) and torch.equal(time[0, 12:], torch.ones(12))
    omega = 10000.0 ** (-torch.arange(12) / 12)
    torch.testing.assert_close(time[2], torch.cat([(2 * omega).sin(), (2 * omega).cos()]))


def test_vit_norm_eps_is_the_dtype_machine_epsilon():
    """ViT RMSNorm ε defaults to finfo(dtype).eps (§9.4, §13 row 10) and is configurable."""
    x = torch.full((1, 24), 1e-3, dtype=torch.float32)
    norm = tiny_vit(dtype=torch.float32).encoder.final_layernorm
    expected = norm.weight * x / torch.sqrt(x.pow(2).mean() + torch.finfo(torch.float32).eps)
    torch.testing.assert_close(norm(x), expected)
    fixed = tiny_vit(dtype=torch.float32, vt_rms_norm_eps=1e-5).encoder.final_layernorm
    assert not torch.allclose(fixed(x), norm(x), rtol=1e-3, atol=0)


def test_projector_is_linear_gelu_erf_linear_rmsnorm():
    torch.manual_seed(0)
    proj = PatchMergerProjector(K3VisionConfig(**TINY_VISION)).double()
    v = torch.randn(5, 96, dtype=torch.float64)
    h = F.gelu(v @ proj.proj[0].weight.t()) @ proj.proj[2].weight.t()  # exact erf GELU
    expected = proj.post_norm.weight * h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(proj(v), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("grids, message", [
    ([(1, 3, 4)], "even"),
    ([(5, 2, 2)], "t must be in 1..4"),
    ([(1, 2, 2), (1, 2, 4)], "pixel_values holds"),
])
def test_bad_grids_raise(vit, grids, message):
    pixels, _ = random_media([(1, 2, 2), (1, 2, 2)])
    with pytest.raises(ValueError, match=message):
        vit(pixels.double(), torch.tensor(grids))


def test_bad_pixels_raise(vit):
    pixels, grids = random_media([(1, 2, 2)])
    with pytest.raises(ValueError, match=r"\[N, 3, 14, 14\]"):
        vit(pixels[:, :, :7].double(), grids)
    pixels[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="finite"):
        vit(pixels.double(), grids)


def test_full_size_vision_counts_on_meta():
    """MoonViT-V2 = 401,214,464 and projector = 46,144,512 parameters (§2.2), per-layer 14,682,112."""
    vision = K3Config.from_preset("k3-full").vision_config
    with torch.device("meta"):
        vit, proj = MoonViT(vision), PatchMergerProjector(vision)
    assert sum(p.numel() for p in vit.parameters()) == 401_214_464
    assert sum(p.numel() for p in vit.encoder.blocks[0].parameters()) == 14_682_112
    assert sum(p.numel() for p in proj.parameters()) == 46_144_512
    shapes = {k: tuple(v.shape) for k, v in vit.state_dict().items()}
    assert shapes["patch_embed.proj.weight"] == (1024, 3, 14, 14)
    assert shapes["patch_embed.pos_emb.weight"] == (64, 64, 1024)
    assert shapes["encoder.blocks.26.wqkv.weight"] == (4608, 1024)
    assert shapes["encoder.blocks.26.wo.weight"] == (1024, 1536)
    assert len(shapes) == 2 + 27 * 6 + 1  # no buffers: the time embedding and RoPE tables are not stored


# ----------------------------------------------------------------------------------------------------------------
# Memory-bounded attention: query chunks per item (a 12 MP photo is one item of 62,208 patches)


def unchunked_attention(q_NHK, k_NHK, v_NHK, lengths):
    """The previous implementation: one SDPA call per item on 3-D [H, L, K] inputs (math kernel, L × L scores)."""
    outs = []
    for q, k, v in zip(*(t.split(lengths) for t in (q_NHK, k_NHK, v_NHK))):
        outs.append(F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
                    .transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("backend", ["default", "math"])
def test_chunked_attention_matches_unchunked(backend):
    """Chunked == one call per item in float64 (≤ 1e-12), on the fused and on the math kernel: packed items of 24, 4,
    72 (a 3-frame video chunk) and 16 patches, the 72-patch item in chunks of 1, 5, 7, 11, 13 or 72 rows (the others
    in proportionally larger ones, mostly not dividing their length), and one row per call (max_scores = 1)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from k3.vision.moonvit import block_diagonal_attention

    lengths = [t * h * w for t, h, w in GRIDS]
    H, K = 4, 8
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(lengths), H, K, generator=gen, dtype=torch.float64) for _ in range(3))
    expected = unchunked_attention(q, k, v, lengths)
    longest = max(lengths)
    with sdpa_kernel(SDPBackend.MATH) if backend == "math" else contextlib.nullcontext():
        for rows in (1, 5, 7, 11, 13, longest):
            got = block_diagonal_attention(q, k, v, lengths, max_scores=H * longest * rows)
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
        torch.testing.assert_close(block_diagonal_attention(q, k, v, lengths, max_scores=1), expected,
                                   rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="max_scores"):
        block_diagonal_attention(q, k, v, lengths, max_scores=0)


def test_chunked_encoder_matches_the_naive_layer_and_packing(vit, monkeypatch):
    """With tiny chunks forced through MAX_SCORES_PER_CALL the whole encoder is unchanged (2D RoPE, block-diagonal
    per item, float64 ≤ 1e-12)."""
    from k3.vision import moonvit

    pixels, grids = random_media(GRIDS, seed=3)
    pixels = pixels.double()
    reference = vit(pixels, grids)
    grid_list = [tuple(g) for g in GRIDS]
    x = torch.randn(pixels.shape[0], 24, dtype=torch.float64)
    angles = rope_2d_angles(grid_list, vit.config.head_dim)
    lengths = [t * h * w for t, h, w in grid_list]
    block = vit.encoder.blocks[0]
    monkeypatch.setattr(moonvit, "MAX_SCORES_PER_CALL", 4 * 72 * 5)  # 5-row chunks of the 72-patch video item
    torch.testing.assert_close(vit(pixels, grids), reference, rtol=0, atol=1e-12)
    torch.testing.assert_close(block(x, lengths, angles), naive_block(block, x, grid_list), rtol=0, atol=1e-12)


def test_attention_scores_per_call_are_bounded_for_a_large_item(monkeypatch):
    """One 20,000-patch item: no SDPA call sees more than MAX_SCORES_PER_CALL scores (H·rows·L), and together the
    calls cover every query once. The old path asked for one call of 4·20,000² = 1.6·10⁹ scores (6.4 GB fp32)."""
    from k3.vision import moonvit

    calls = []

    def spy(q, k, v, *args, **kwargs):  # records the score-matrix size; returns zeros instead of computing
        calls.append((q.shape[-3] if q.dim() > 2 else 1, q.shape[-2], k.shape[-2]))
        return torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    vit = tiny_vit(dtype=torch.float32)
    block = vit.encoder.blocks[0]
    grids = [(1, 100, 200), (1, 2, 2)]
    N = 20_004
    with torch.no_grad():
        out = block.attention(torch.randn(N, 24), [20_000, 4], rope_2d_angles(grids, vit.config.head_dim))
    assert out.shape == (N, 24)
    assert max(heads * rows * keys for heads, rows, keys in calls) <= moonvit.MAX_SCORES_PER_CALL
    assert sum(rows for _, rows, keys in calls if keys == 20_000) == 20_000
    assert [(rows, keys) for _, rows, keys in calls if keys == 4] == [(4, 4)]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="samples the resident set from /proc")
def test_large_item_attention_peak_memory_is_linear(monkeypatch):
    """One attention over a 20,000-patch item (1 head, fp32) while a thread samples the resident set every ms:
    it grows by < 200 MB (the old path held 20,000² fp32 scores = 1.6 GB, then their softmax)."""
    import threading

    from k3.vision import moonvit

    monkeypatch.setattr(moonvit, "MAX_SCORES_PER_CALL", 2 ** 22)  # ≤ 16 MiB of fp32 scores even on the math kernel
    vit = tiny_vit(dtype=torch.float32, vt_num_attention_heads=1, qkv_hidden_size=8)
    x, angles = torch.randn(20_000, 24), rope_2d_angles([(1, 100, 200)], 8)
    baseline, peak, done = _rss_bytes(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss_bytes())
            done.wait(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        with torch.no_grad():
            out = vit.encoder.blocks[0].attention(x, [20_000], angles)
    finally:
        done.set()
        sampler.join()
    assert out.shape == (20_000, 24) and torch.isfinite(out).all()
    grown_mb = (max(peak[0], _rss_bytes()) - baseline) / 2 ** 20
    assert grown_mb < 200, f"resident memory grew by {grown_mb:.0f} MB"
