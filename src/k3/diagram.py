"""`k3 diagram`: the architecture of any config in one picture (docs/architecture.md §2, §14).

Everything drawn comes from the config and `k3.model.accounting`: the layer stack coloured by sequence mixer, with
the dense and MoE layers and the Block AttnRes blocks; one panel per component (KDA, MLA, MoE, vision when the
config has it) with its shapes; the parameter budget (total and activated) by part, and the cache per sequence.
The figure is A4 landscape; `draw` returns it, `save_diagram` writes it atomically (svg, png or pdf).
"""

from __future__ import annotations

import os
import re

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from matplotlib.patches import FancyBboxPatch, Rectangle  # noqa: E402

from k3.config import K3Config  # noqa: E402
from k3.fileio import atomic_path  # noqa: E402
from k3.model.accounting import (  # noqa: E402
    CONTEXTS, architecture_report, attn_res_sources, component_of, human, meta_model)

FORMATS = (".svg", ".png", ".pdf")
COLORS = {"kda": "#4C78A8", "mla": "#F58518", "dense": "#54A24B", "moe": "#B279A2"}
BUDGET_PARTS = {  # part: (label, colour)
    "embedding": ("input embedding", "#9D9D9D"), "lm_head": ("LM head", "#BAB0AC"),
    "kda": ("KDA", COLORS["kda"]), "mla": ("MLA", COLORS["mla"]), "dense_ffn": ("dense FFN", COLORS["dense"]),
    "router": ("router", "#E45756"), "shared_experts": ("shared experts", "#72B7B2"),
    "latent": ("latent projections", "#EECA3B"), "routed_experts": ("routed experts", COLORS["moe"]),
    "norms_attn_res": ("norms + AttnRes", "#FF9DA6"), "vision": ("vision + projector", "#9C755F"),
}
_MOE_PART = re.compile(r"\.block_sparse_moe\.(gate|shared_experts|routed_expert_\w+)\.")


def budget(config: K3Config, model: torch.nn.Module, report: dict) -> dict[str, tuple[int, int]]:
    """(total, activated) parameters per part of `BUDGET_PARTS`: the accounting's components (§2.2, `report` of
    the meta-device `model`) with the MoE fixed part split into router, shared experts and latent projections;
    vision apart (outside the text headline: in the total bar only)."""
    parts = {k: [v["total"], v["activated"]] for k, v in report["components"].items() if k != "moe_fixed"}
    fixed = dict.fromkeys(("router", "shared_experts", "latent"), 0)
    for name, tensor in model.state_dict(keep_vars=True).items():
        if component_of(name, config) == "moe_fixed":
            kind = _MOE_PART.search(name).group(1)
            fixed["router" if kind == "gate" else kind if kind == "shared_experts" else "latent"] += tensor.numel()
    for k, n in fixed.items():
        parts[k] = [n, n]
    parts["vision"] = [sum(report["vision_params"].values()), 0]
    return {k: (parts[k][0], parts[k][1]) for k in BUDGET_PARTS}


def _bytes(n: float) -> str:
    """A memory size in binary units: 29.44 GiB, 160.0 MiB, 24.0 KiB."""
    if n >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def _box(ax, x, y, w, h, text, color="#F2F2F2", size=7.0, weight="normal"):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.004,rounding_size=0.01", fc=color, ec="#555555",
                                lw=0.6))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size, weight=weight)


def _arrow(ax, x, y0, y1):
    ax.annotate("", xy=(x, y1), xytext=(x, y0), arrowprops=dict(arrowstyle="-|>", lw=0.7, color="#555555"))


def _flow(ax, x, top, w, lines, color):
    """A vertical chain of boxes with arrows, one line each, from `top` down; returns the bottom."""
    h, gap = 0.034, 0.015
    y = top
    for i, line in enumerate(lines):
        _box(ax, x, y - h, w, h, line, color if i else "#FFFFFF")
        if i + 1 < len(lines):
            _arrow(ax, x + w / 2, y - h, y - h - gap)
        y -= h + gap
    return y


def _layer_stack(ax, config: K3Config, report: dict) -> None:
    """Top band: one cell per layer, the FFN kind below it, the AttnRes blocks as brackets."""
    L = config.num_hidden_layers
    x0, width, top = 0.03, 0.94, 0.865
    w = width / L
    for i, kind in enumerate(config.layer_types):
        ax.add_patch(Rectangle((x0 + i * w, top - 0.045), w * 0.9, 0.045, fc=COLORS[kind], ec="none"))
        ffn = "moe" if config.is_moe_layer(i) else "dense"
        ax.add_patch(Rectangle((x0 + i * w, top - 0.062), w * 0.9, 0.012, fc=COLORS[ffn], ec="none"))
    ticks = sorted({1, L} | set(range(1, L + 1, config.attn_res_block_size if config.use_block_attn_res else 10)))
    for t in ticks:
        ax.text(x0 + (t - 0.55) * w, top + 0.008, str(t), ha="center", va="bottom", fontsize=6, color="#333333")
    n_dense = sum(not config.is_moe_layer(i) for i in range(L))
    legend = [(COLORS["kda"], f"KDA ({report['kda_layers']})"),
              (COLORS["mla"], f"{'gated ' if config.mla_use_output_gate else ''}"
                              f"{'NoPE MLA' if config.mla_use_nope else 'MLA with RoPE'} ({report['mla_layers']})"),
              (COLORS["dense"], f"dense FFN ({n_dense})"), (COLORS["moe"], f"MoE FFN ({L - n_dense})")]
    legend = [(color, label) for color, label in legend if not label.endswith(" (0)")]
    for j, (color, label) in enumerate(legend):
        ax.add_patch(Rectangle((0.03 + j * 0.16, 0.905), 0.012, 0.014, fc=color, ec="none"))
        ax.text(0.046 + j * 0.16, 0.912, label, va="center", fontsize=7)
    per_layer, output = attn_res_sources(config)
    y = top - 0.075
    if not per_layer:
        ax.text(0.5, y - 0.02, "plain pre-norm residual stream: x + attn(norm(x)), then x + ffn(norm(x))",
                ha="center", va="center", fontsize=7)
        return
    B = config.attn_res_block_size
    for b, start in enumerate(range(0, L, B)):
        end = min(start + B, L)
        xa, xb = x0 + start * w, x0 + end * w - 0.1 * w
        ax.plot([xa, xa, xb, xb], [y + 0.006, y, y, y + 0.006], color="#333333", lw=0.7)
        label = f"{per_layer[start]}" if xb - xa < 0.05 else f"{per_layer[start]} sources"
        ax.text((xa + xb) / 2, y - 0.006, label, ha="center", va="top", fontsize=6)
    ax.text(0.5, y - 0.036, f"Block AttnRes: blocks of {B} layers; each sublayer's input is a softmax mix over the "
            f"embedding, the completed block sums and the block's partial sum (sources per block above); "
            f"output mix over {output} sources", ha="center", va="center", fontsize=7)


def _panels(ax, config: K3Config, report: dict) -> None:
    """Middle band: the components, with their shapes."""
    c = config
    D = c.hidden_size
    act = "SiTU-GLU" if c.hidden_act == "situ" else "SwiGLU"
    panels = []
    if report["kda_layers"]:
        H, K = c.kda_num_heads, c.kda_head_dim
        state = _bytes(H * K * K * 4)
        panels.append(("Kimi Delta Attention", COLORS["kda"], [
            f"x ({D})", f"q, k, v: {H} heads x {K}", f"short conv (width {c.short_conv_kernel_size}) + SiLU",
            "per-channel decay g" + (f" >= {c.gate_lower_bound:g}" if c.gate_lower_bound is not None else ""),
            f"delta rule: state {K} x {K} per head", "full-rank output gate" if c.use_full_rank_gate
            else "output gate", f"o_proj {H * K} -> {D}"], f"state {state} per layer and sequence (fp32)"))
    H, N, R, V = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    panels.append(("Gated NoPE MLA" if c.mla_use_nope and c.mla_use_output_gate else
                   "MLA with RoPE" if not c.mla_use_nope else "NoPE MLA", COLORS["mla"], [
        f"x ({D})", f"q: {D} -> {c.q_lora_rank} -> {H} x ({N}+{R})",
        f"kv latent: {D} -> {c.kv_lora_rank} + k_pe {R}",
        f"cache {c.kv_lora_rank + R} numbers per token", "no positional encoding" if c.mla_use_nope
        else f"RoPE on {R} channels", f"k, v: {c.kv_lora_rank} -> {H} x ({N}+{V})",
        "sigmoid output gate" if c.mla_use_output_gate else "no output gate", f"o_proj {H * V} -> {D}"], None))
    L, E, k, M = c.routed_expert_hidden_size, c.num_experts, c.num_experts_per_token, c.moe_intermediate_size
    moe = [f"x ({D})", f"router on {D}: top-{k} of {E}"]
    moe += [f"down {D} -> latent {L}"] if c.use_latent_moe else []
    moe += [f"{k} experts: {act} {L} -> {M} -> {L}", "weighted sum" + (", RMSNorm" if c.latent_moe_use_norm else "")]
    moe += [f"up {L} -> {D}"] if c.use_latent_moe else []
    moe += [f"+ {c.num_shared_experts} shared ({act}, {c.num_shared_experts * M})"]
    panels.append(("Stable LatentMoE" if c.use_latent_moe else "MoE (full width)", COLORS["moe"], moe, None))
    vision = c.vision_config
    if vision is not None:
        panels.append(("MoonViT-V2 -> text", "#9C755F", [
            f"patches {vision.patch_size} x {vision.patch_size} px",
            f"{vision.vt_num_hidden_layers} layers, width {vision.vt_hidden_size}",
            f"{vision.vt_num_attention_heads} heads x {vision.head_dim}, 2D RoPE",
            f"2 x 2 merge -> {vision.merged_hidden_size}", f"projector -> {vision.text_hidden_size}",
            "tokens interleaved with text"], None))
    n = len(panels)
    gap = 0.02
    w = (0.94 - gap * (n - 1)) / n
    for j, (title, color, lines, note) in enumerate(panels):
        x = 0.03 + j * (w + gap)
        ax.add_patch(Rectangle((x, 0.27), w, 0.455, fc="#FAFAFA", ec=color, lw=1.2))
        ax.text(x + w / 2, 0.705, title, ha="center", va="center", fontsize=9, weight="bold", color=color)
        light = matplotlib.colors.to_rgba(color, 0.18)
        bottom = _flow(ax, x + 0.012, 0.685, w - 0.024, lines, light)
        if note:
            ax.text(x + w / 2, bottom - 0.002, note, ha="center", va="top", fontsize=6.5, style="italic")


def _budget(ax, config: K3Config, report: dict, parts: dict[str, tuple[int, int]]) -> None:
    """Bottom band: total and activated parameters by part (`budget`), the cache per sequence."""
    rows = [("total", {k: t for k, (t, _) in parts.items()}), ("activated", {k: a for k, (_, a) in parts.items()})]
    for r, (name, values) in enumerate(rows):
        y, s = 0.175 - r * 0.05, sum(values.values())
        ax.text(0.03, y + 0.015, name, va="center", fontsize=7.5, weight="bold")
        ax.text(0.595, y + 0.015, f"{s:,}\n({human(s)})", va="center", fontsize=7)
        x = 0.10
        for key, n in values.items():
            width = 0.49 * n / s
            ax.add_patch(Rectangle((x, y), width, 0.03, fc=BUDGET_PARTS[key][1], ec="white", lw=0.3))
            x += width
    text = "text model (the headline numbers; vision in the total bar only)" if config.vision_config is not None \
        else "text model"
    ax.text(0.03, 0.232, f"Parameters of the {text}: {report['total_params']:,} total, "
            f"{report['activated_params']:,} activated per token", fontsize=7.5, weight="bold", va="center")
    shown = [k for k, (t, _) in parts.items() if t]
    for j, key in enumerate(shown):
        col, row = divmod(j, 6)
        x, y = 0.715 + col * 0.14, 0.21 - row * 0.027
        ax.add_patch(Rectangle((x, y - 0.006), 0.009, 0.012, fc=BUDGET_PARTS[key][1], ec="none"))
        label = "norms" if key == "norms_attn_res" and not config.use_block_attn_res else BUDGET_PARTS[key][0]
        ax.text(x + 0.013, y, f"{label} {human(parts[key][0])}", va="center", fontsize=6.5)
    caches = "   ".join(f"{name}: {_bytes(report['cache_bytes_per_sequence'][name])}" for name in CONTEXTS)
    state = f", fp32 KDA state {_bytes(report['kda_state_bytes_per_sequence_fp32'])}" \
        if report["kda_layers"] else ""
    ax.text(0.03, 0.045, f"Cache per sequence (bf16 MLA latent {report['mla_cache_numbers_per_token']:,} numbers per "
            f"token{state}):   {caches}", fontsize=7.5, va="center")


def draw(config: K3Config, name: str) -> plt.Figure:
    """The architecture picture of `config` (`name` in the title) as an A4 landscape figure."""
    model = meta_model(config)
    report = architecture_report(config, model)
    fig = plt.figure(figsize=(11.69, 8.27))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.axis("off")
    ax.text(0.03, 0.965, f"{name}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, vocabulary "
            f"{config.vocab_size:,}; {human(report['total_params'])} parameters, {human(report['activated_params'])} "
            "activated", fontsize=12, weight="bold", va="center")
    _layer_stack(ax, config, report)
    _panels(ax, config, report)
    _budget(ax, config, report, budget(config, model, report))
    return fig


def save_diagram(config: K3Config, name: str, path: str | os.PathLike) -> None:
    """Draw `config` and write the picture to `path` (its suffix picks svg, png or pdf), atomically."""
    suffix = os.path.splitext(os.fspath(path))[1].lower()
    if suffix not in FORMATS:
        raise ValueError(f"{os.fspath(path)!r}: the picture's file name must end in {', '.join(FORMATS)}")
    fig = draw(config, name)
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=150)
    finally:
        plt.close(fig)
