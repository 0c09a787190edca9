"""Independent float64 reference of the Kimi K3 vision path (MoonViT-V2, merger, projector, media interleaving),
written from the architecture specification (now docs/architecture.md) §9 (with §1.2, §2.2, §0.4/§0.5, §11.3) only.

Nothing here imports from `k3`. The input is the official checkpoint (tensor names of §11.3, read with
`k3_reference.load_official_checkpoint`) plus the parsed `config.json` dict (top-level multimodal config of §1.2,
or a bare `vision_config` dict).

Style: deliberately literal, float64 everywhere, Python loops over media items, frames, heads, merged tokens and
RoPE pairs where that keeps the arithmetic obviously equal to the documented formulas.

Public API
----------
* ``reference_vision_features(tensors, config, pixel_values, grid_thws, *, _variant=None) -> list[Tensor]``
  per media item its projected features [(h/2)(w/2), text_hidden_size].
* ``reference_multimodal_logits(tensors, config, input_ids, pixel_values, grid_thws) -> Tensor [1, S_merged, V]``
  for a single row (B = 1, no padding); the text backbone is `k3_reference.reference_logits`.
* ``merge_media_embeddings(text_embed, input_ids, features, placeholder_id) -> Tensor [S_merged, D]`` (§9.9).
* ``vision_parameter_shapes(vision_config) -> dict[name, shape]`` (§11.3) and ``SPEC_VISION_CONFIG`` (§1.2).

Generalisation to non-K3 widths (the tiny conformance model): head dim d = qkv_hidden_size / heads; RoPE
frequencies f_j = 10000^(−4j/d), j = 0..d/4−1 (§9.5 with d = 128); time-embedding frequencies
ω_i = 10000^(−i/(C/2)), i = 0..C/2−1, for ViT width C (§9.3 with C = 1024).

``_variant`` flips exactly one rule (negative controls):
  "rope_row_even"        RoPE with the ROW on even pairs and the column on odd pairs (§9.5 says column on even)
  "merge_transposed"     space-to-depth order dx before dy: (2Y,2X), (2Y+1,2X), (2Y,2X+1), (2Y+1,2X+1) (§9.7)
  "time_emb_t1"          time embedding added also for single-frame items (§9.3 says t > 1 only)
  "projector_tanh_gelu"  tanh-approximate GELU in the projector (§9.8 says exact erf GELU)
  "pos_emb_nearest"      nearest-neighbour resize of the position table instead of bilinear (§9.3)
"""

from __future__ import annotations

import math
from typing import Any

import torch

DT = torch.float64

VARIANTS = (None, "rope_row_even", "merge_transposed", "time_emb_t1", "projector_tanh_gelu", "pos_emb_nearest")

VT = "vision_tower."
PROJ = "mm_projector."

# §1.2 vision_config of the release (architecture fields only)
SPEC_VISION_CONFIG: dict[str, Any] = dict(
    model_type="kimi_k3_vision", patch_size=14, vt_hidden_size=1024, qkv_hidden_size=1536, vt_num_attention_heads=12,
    vt_intermediate_size=4096, vt_num_hidden_layers=27, norm_type="rmsnorm", mlp_type="mlp2",
    activation_func="gelu_pytorch_tanh", attn_bias=False, linear_bias=False, patch_embed_proj_bias=False,
    pos_emb_type="divided_fixed", init_pos_emb_height=64, init_pos_emb_width=64, init_pos_emb_time=4,
    pos_emb_interpolation_mode="bilinear", merge_kernel_size=[2, 2], merge_type="sd2_tpool",
    mm_projector_type="patchmergerv2", mm_hidden_size=1024, projector_hidden_act="gelu", projector_ln_eps=1e-5,
    text_hidden_size=7168, media_placeholder_token_id=163605,
)


# ----------------------------------------------------------------------------------------- config
def _vision_config(config: dict[str, Any]) -> dict[str, Any]:
    return config["vision_config"] if "vision_config" in config else config


class _VCfg:
    def __init__(self, vc: dict[str, Any]):
        self.p = int(vc.get("patch_size", 14))
        self.C = int(vc["vt_hidden_size"])
        self.Q = int(vc["qkv_hidden_size"])
        self.H = int(vc["vt_num_attention_heads"])
        assert self.Q % self.H == 0
        self.d = self.Q // self.H
        assert self.d % 4 == 0, "2D RoPE needs head dim divisible by 4 (§9.5)"
        self.I = int(vc["vt_intermediate_size"])
        self.L = int(vc["vt_num_hidden_layers"])
        self.H0 = int(vc["init_pos_emb_height"])
        self.W0 = int(vc["init_pos_emb_width"])
        self.T0 = int(vc.get("init_pos_emb_time", 4))
        self.mm = int(vc.get("mm_hidden_size", self.C))
        assert self.mm == self.C, "merger input width is the ViT width"
        self.text_hidden = int(vc["text_hidden_size"])
        self.proj_eps = float(vc.get("projector_ln_eps", 1e-5))
        # §9.4 / §0.5 / §13.10: torch default ε = machine epsilon of the compute dtype (here float64)
        eps = vc.get("vt_rms_norm_eps", None)
        self.vt_eps = float(torch.finfo(DT).eps) if eps is None else float(eps)
        # fields this reference implements; anything else is unsupported
        assert vc.get("norm_type", "rmsnorm") == "rmsnorm"
        assert vc.get("mlp_type", "mlp2") == "mlp2"
        assert vc.get("activation_func", "gelu_pytorch_tanh") == "gelu_pytorch_tanh"
        assert vc.get("pos_emb_type", "divided_fixed") == "divided_fixed"
        assert vc.get("pos_emb_interpolation_mode", "bilinear") == "bilinear"
        assert list(vc.get("merge_kernel_size", [2, 2])) == [2, 2]
        assert vc.get("merge_type", "sd2_tpool") == "sd2_tpool"
        assert vc.get("mm_projector_type", "patchmergerv2") == "patchmergerv2"
        assert vc.get("projector_hidden_act", "gelu") == "gelu"
        for b in ("attn_bias", "linear_bias", "patch_embed_proj_bias"):
            assert not vc.get(b, False), b


def _vision_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to(DT) for k, v in tensors.items() if k.startswith((VT, PROJ))}


# ------------------------------------------------------------------------------------- primitives
def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """§0.2: w ⊙ x / sqrt(mean_c x_c² + ε)."""
    return w * (x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps))


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y = x·Wᵀ, W [out, in], no bias."""
    return x @ w.transpose(0, 1)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation: 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


def gelu_erf(x: torch.Tensor) -> torch.Tensor:
    """Exact GELU: 0.5·x·(1 + erf(x/√2))."""
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def _bilinear_weights(n_in: int, n_out: int) -> list[tuple[int, int, float]]:
    """1-D bilinear taps, align_corners = False (half-pixel centres), no antialias:
    src = (dst + ½)·n_in/n_out − ½, clamped below at 0; taps floor(src) and min(floor+1, n_in−1)."""
    out = []
    scale = n_in / n_out
    for o in range(n_out):
        src = (o + 0.5) * scale - 0.5
        if src < 0.0:
            src = 0.0
        i0 = int(math.floor(src))
        i0 = min(i0, n_in - 1)
        i1 = min(i0 + 1, n_in - 1)
        lam = src - i0
        out.append((i0, i1, lam))
    return out


def resize_pos_emb(table: torch.Tensor, h: int, w: int, mode: str = "bilinear") -> torch.Tensor:
    """§9.3: the [H0, W0, C] table resized as a C-channel image to (h, w); returns [h, w, C]."""
    H0, W0, C = table.shape
    if (h, w) == (H0, W0):
        return table.clone()
    out = torch.zeros(h, w, C, dtype=DT)
    if mode == "bilinear":
        ry = _bilinear_weights(H0, h)
        rx = _bilinear_weights(W0, w)
        for y in range(h):
            y0, y1, ly = ry[y]
            for x in range(w):
                x0, x1, lx = rx[x]
                out[y, x] = ((1 - ly) * (1 - lx) * table[y0, x0] + (1 - ly) * lx * table[y0, x1]
                             + ly * (1 - lx) * table[y1, x0] + ly * lx * table[y1, x1])
    elif mode == "nearest":
        for y in range(h):
            for x in range(w):
                out[y, x] = table[min(int(math.floor(y * H0 / h)), H0 - 1), min(int(math.floor(x * W0 / w)), W0 - 1)]
    else:
        raise ValueError(mode)
    return out


def time_embedding(t: int, C: int) -> torch.Tensor:
    """§9.3: time[τ] = [sin(τ·ω_0..ω_{C/2−1}), cos(τ·ω_0..ω_{C/2−1})], ω_i = 10000^(−i/(C/2)). [t, C]."""
    half = C // 2
    out = torch.zeros(t, C, dtype=DT)
    for tau in range(t):
        for i in range(half):
            omega = 10000.0 ** (-i / half)
            out[tau, i] = math.sin(tau * omega)
            out[tau, half + i] = math.cos(tau * omega)
    return out


def rope_2d(x: torch.Tensor, ys: list[int], xs: list[int], row_on_even: bool = False) -> torch.Tensor:
    """§9.5 on one head: x [n, d]; pair p = (dims 2p, 2p+1) = (real, imag). Pair 2j rotates by column·f_j,
    pair 2j+1 by row·f_j, f_j = 10000^(−4j/d). Explicit real rotation (a + ib)·(cos θ + i sin θ)."""
    n, d = x.shape
    out = x.clone()
    for j in range(d // 4):
        f = 10000.0 ** (-4.0 * j / d)
        for pair, use_col in ((2 * j, not row_on_even), (2 * j + 1, row_on_even)):
            for r in range(n):
                theta = (xs[r] if use_col else ys[r]) * f
                c, s = math.cos(theta), math.sin(theta)
                a, b = x[r, 2 * pair], x[r, 2 * pair + 1]
                out[r, 2 * pair] = a * c - b * s
                out[r, 2 * pair + 1] = a * s + b * c
    return out


# --------------------------------------------------------------------------------------- the tower
def _encoder_layer(x: torch.Tensor, p: dict[str, torch.Tensor], i: int, cfg: _VCfg,
                   items: list[tuple[int, int, int, list[int], list[int]]], variant: str | None) -> torch.Tensor:
    """§9.4 on the packed stream x [N, C]; items = (start, count, _, rows, cols) attention segments."""
    pre = f"{VT}encoder.blocks.{i}."
    H, d, Q = cfg.H, cfg.d, cfg.Q
    hn = rms_norm(x, p[pre + "norm0.weight"], cfg.vt_eps)
    qkv = linear(hn, p[pre + "wqkv.weight"])  # [N, 3Q]: q rows 0..Q-1, k Q..2Q-1, v 2Q..3Q-1, head-major
    attn = torch.zeros(x.shape[0], Q, dtype=DT)
    for start, count, _, ys, xs in items:
        seg = qkv[start:start + count]
        for h in range(H):
            q = seg[:, h * d:(h + 1) * d]
            k = seg[:, Q + h * d:Q + (h + 1) * d]
            v = seg[:, 2 * Q + h * d:2 * Q + (h + 1) * d]
            q = rope_2d(q, ys, xs, row_on_even=(variant == "rope_row_even"))
            k = rope_2d(k, ys, xs, row_on_even=(variant == "rope_row_even"))
            scores = (q @ k.transpose(0, 1)) / math.sqrt(d)  # bidirectional, this item's patches only
            scores = scores - scores.max(dim=-1, keepdim=True).values
            e = torch.exp(scores)
            probs = e / e.sum(dim=-1, keepdim=True)
            attn[start:start + count, h * d:(h + 1) * d] = probs @ v
    x = x + linear(attn, p[pre + "wo.weight"])
    hn = rms_norm(x, p[pre + "norm1.weight"], cfg.vt_eps)
    x = x + linear(gelu_tanh(linear(hn, p[pre + "mlp.fc0.weight"])), p[pre + "mlp.fc1.weight"])
    return x


@torch.no_grad()
def reference_vision_features(tensors: dict[str, torch.Tensor], config: dict[str, Any], pixel_values: torch.Tensor,
                              grid_thws, *, _variant: str | None = None) -> list[torch.Tensor]:
    """Per media item its projected features [(h/2)(w/2), text_hidden_size] (§9.1–9.8)."""
    assert _variant in VARIANTS, f"unknown variant {_variant!r}"
    cfg = _VCfg(_vision_config(config))
    p = _vision_tensors(tensors)
    grids = [tuple(int(v) for v in g) for g in torch.as_tensor(grid_thws).tolist()]
    pix = pixel_values.detach().to(DT)
    N = sum(t * h * w for t, h, w in grids)
    P = cfg.p
    assert pix.shape == (N, 3, P, P), (pix.shape, N)

    # §9.3 patch conv: one [3, P, P] patch · kernel [C, 3, P, P], summed over (channel, row, column)
    conv_w = p[VT + "patch_embed.proj.weight"]
    assert conv_w.shape == (cfg.C, 3, P, P)
    x = pix.reshape(N, 3 * P * P) @ conv_w.reshape(cfg.C, 3 * P * P).transpose(0, 1)  # [N, C]

    # §9.3 absolute position (+ time) embedding, and per-patch (row, column) for RoPE, per item
    table = p[VT + "patch_embed.pos_emb.weight"]
    assert table.shape == (cfg.H0, cfg.W0, cfg.C), table.shape
    items = []
    start = 0
    add = torch.zeros(N, cfg.C, dtype=DT)
    for t, h, w in grids:
        assert h % 2 == 0 and w % 2 == 0 and 1 <= t <= cfg.T0, (t, h, w)
        pos = resize_pos_emb(table, h, w, "nearest" if _variant == "pos_emb_nearest" else "bilinear")
        pos = pos.reshape(h * w, cfg.C)  # row-major
        use_time = t > 1 or _variant == "time_emb_t1"
        temb = time_embedding(t, cfg.C)
        ys, xs = [], []
        for tau in range(t):  # frame-major, then row-major
            for y in range(h):
                for xx in range(w):
                    r = start + tau * h * w + y * w + xx
                    add[r] = pos[y * w + xx] + (temb[tau] if use_time else 0.0)
                    ys.append(y)
                    xs.append(xx)
        items.append((start, t * h * w, (t, h, w), ys, xs))
        start += t * h * w
    x = x + add

    # §9.4 encoder layers, then the final norm
    for i in range(cfg.L):
        x = _encoder_layer(x, p, i, cfg, items, _variant)
    x = rms_norm(x, p[VT + "encoder.final_layernorm.weight"], cfg.vt_eps)

    # §9.7 merger (temporal mean, 2×2 space-to-depth) and §9.8 projector, per item
    W1 = p[PROJ + "proj.0.weight"]
    W2 = p[PROJ + "proj.2.weight"]
    g = p[PROJ + "post_norm.weight"]
    assert W1.shape == (4 * cfg.C, 4 * cfg.C) and W2.shape == (cfg.text_hidden, 4 * cfg.C)
    feats = []
    for start, count, (t, h, w), _, _ in items:
        seg = x[start:start + count]
        mean = torch.zeros(h, w, cfg.C, dtype=DT)
        for tau in range(t):
            for y in range(h):
                for xx in range(w):
                    mean[y, xx] = mean[y, xx] + seg[tau * h * w + y * w + xx]
        mean = mean / t
        if _variant == "merge_transposed":
            order = ((0, 0), (1, 0), (0, 1), (1, 1))
        else:
            order = ((0, 0), (0, 1), (1, 0), (1, 1))  # (dy, dx): (2Y,2X), (2Y,2X+1), (2Y+1,2X), (2Y+1,2X+1)
        merged = torch.zeros((h // 2) * (w // 2), 4 * cfg.C, dtype=DT)
        for Y in range(h // 2):
            for X in range(w // 2):
                merged[Y * (w // 2) + X] = torch.cat([mean[2 * Y + dy, 2 * X + dx] for dy, dx in order])
        act = gelu_tanh if _variant == "projector_tanh_gelu" else gelu_erf
        y = rms_norm(linear(act(linear(merged, W1)), W2), g, cfg.proj_eps)
        feats.append(y)
    return feats


# ----------------------------------------------------------------------------------- interleaving
def merge_media_embeddings(text_embed: torch.Tensor, input_ids: torch.Tensor, features: list[torch.Tensor],
                           placeholder_id: int) -> torch.Tensor:
    """§9.9 for one row: occupancy 1 for text, n_item for a placeholder; new positions = cumsum − 1; text rows
    and feature rows scattered into a [S_merged, D] tensor. input_ids [S] (1-D)."""
    ids = [int(v) for v in input_ids.tolist()]
    ph = [s for s, v in enumerate(ids) if v == placeholder_id]
    assert len(ph) == len(features), f"{len(ph)} placeholders for {len(features)} media items"
    occ = []
    it = 0
    for v in ids:
        if v == placeholder_id:
            occ.append(features[it].shape[0])
            it += 1
        else:
            occ.append(1)
    ends = []
    acc = 0
    for o in occ:
        acc += o
        ends.append(acc - 1)  # cumsum − 1 = last new position of this input position
    S_merged = acc
    assert S_merged == len(ids) - len(ph) + sum(f.shape[0] for f in features)
    out = torch.full((S_merged, text_embed.shape[1]), float("nan"), dtype=DT)
    it = 0
    for s, v in enumerate(ids):
        if v == placeholder_id:
            n = features[it].shape[0]
            out[ends[s] - n + 1:ends[s] + 1] = features[it].to(DT)
            it += 1
        else:
            out[ends[s]] = text_embed[v].to(DT)
    assert not torch.isnan(out).any()
    return out


@torch.no_grad()
def reference_multimodal_logits(tensors: dict[str, torch.Tensor], config: dict[str, Any], input_ids: torch.Tensor,
                                pixel_values: torch.Tensor, grid_thws, *, _variant: str | None = None) -> torch.Tensor:
    """Logits [1, S_merged, V] of one row (B = 1, no padding): §9.9 merge, then the text backbone of
    `k3_reference.reference_logits` (run on the merged embeddings via an embedding table whose rows are the
    merged sequence, indexed by 0..S_merged−1)."""
    from k3_reference import reference_logits

    input_ids = torch.as_tensor(input_ids, dtype=torch.long)
    if input_ids.dim() == 2:
        assert input_ids.shape[0] == 1, "single row only"
        input_ids = input_ids[0]
    placeholder = int(config.get("media_placeholder_token_id",
                                 _vision_config(config).get("media_placeholder_token_id")))
    feats = reference_vision_features(tensors, config, pixel_values, grid_thws, _variant=_variant)
    embed = tensors["language_model.model.embed_tokens.weight"].to(DT)
    merged = merge_media_embeddings(embed, input_ids, feats, placeholder)
    fake = {k: v for k, v in tensors.items() if not k.startswith((VT, PROJ))}
    fake["language_model.model.embed_tokens.weight"] = merged
    return reference_logits(fake, config, torch.arange(merged.shape[0]).unsqueeze(0))


# -------------------------------------------------------------------------------- parameter shapes
def vision_parameter_shapes(vision_config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """§11.3 names and shapes of every stored vision-tower and projector tensor."""
    cfg = _VCfg(vision_config)
    C, Q, I, P = cfg.C, cfg.Q, cfg.I, cfg.p
    shapes: dict[str, tuple[int, ...]] = {
        VT + "patch_embed.proj.weight": (C, 3, P, P),
        VT + "patch_embed.pos_emb.weight": (cfg.H0, cfg.W0, C),
    }
    for i in range(cfg.L):
        pre = f"{VT}encoder.blocks.{i}."
        shapes[pre + "norm0.weight"] = (C,)
        shapes[pre + "norm1.weight"] = (C,)
        shapes[pre + "wqkv.weight"] = (3 * Q, C)
        shapes[pre + "wo.weight"] = (C, Q)
        shapes[pre + "mlp.fc0.weight"] = (I, C)
        shapes[pre + "mlp.fc1.weight"] = (C, I)
    shapes[VT + "encoder.final_layernorm.weight"] = (C,)
    shapes[PROJ + "proj.0.weight"] = (4 * C, 4 * C)
    shapes[PROJ + "proj.2.weight"] = (cfg.text_hidden, 4 * C)
    shapes[PROJ + "post_norm.weight"] = (cfg.text_hidden,)
    return shapes
