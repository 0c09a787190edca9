"""Independent float64 reference of the Kimi K3 text forward pass, written from the architecture specification only (now docs/architecture.md).

Purpose: cross-check the project implementation (`k3.model`) without sharing any of its code. Nothing here
imports from `k3`; the input is the official checkpoint (tensor names of docs/architecture.md §11.2) plus the parsed
`config.json` dict (§1.1 / §1.2).

Style: deliberately literal. Python loops over layers, heads and tokens where that keeps the arithmetic
obviously equal to the documented formulas; float64 everywhere. Sections referenced as §x.y are those of the spec.

Public API
----------
* ``load_official_checkpoint(directory) -> (tensors, config_dict)``
* ``reference_logits(tensors, config, input_ids, *, return_aux=False, _variant=None)``
* ``reference_attention(tensors, config, i, x, *, _variant=None)`` / ``reference_ffn(...)``: one sublayer of
  decoder layer i applied to a given (already PreNormed) input x [B, T, D], for sublayer-isolated checks.

``_variant`` flips exactly one rule (negative controls, §12.3 item 12):
  "softplus_gate"      Kimi-Linear softplus decay instead of the bounded σ form (§3.3)
  "no_bias"            router selection without `e_score_correction_bias` (§6.3 step 3)
  "block_size_plus_1"  AttnRes block size S_b + 1 (§5.3)
  "mla_eps_1e-5"       MLA q_a/kv_a layernorm ε = 1e-5 instead of 1e-6 (§4.2, §0.5)
  "beta2_none"         SiTU-GLU up cap β₂ removed (§6.1)
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import torch

DT = torch.float64

VARIANTS = (None, "softplus_gate", "no_bias", "block_size_plus_1", "mla_eps_1e-5", "beta2_none")

TEXT_PREFIX = "language_model."
NON_TEXT_PREFIXES = ("vision_tower.", "mm_projector.")


# ------------------------------------------------------------------------------------------------ loading
def load_official_checkpoint(directory: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Read `config.json` and `model.safetensors` (or the shards of `model.safetensors.index.json`)."""
    from safetensors.torch import load_file

    directory = os.fspath(directory)
    with open(os.path.join(directory, "config.json"), encoding="utf-8") as fh:
        config = json.load(fh)
    index_path = os.path.join(directory, "model.safetensors.index.json")
    tensors: dict[str, torch.Tensor] = {}
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as fh:
            index = json.load(fh)
        shards = sorted(set(index["weight_map"].values()))
        for shard in shards:
            part = load_file(os.path.join(directory, shard))
            for k, v in part.items():
                assert k not in tensors, f"tensor {k} appears in two shards"
                assert index["weight_map"].get(k) == shard, f"tensor {k} found in {shard}, index disagrees"
                tensors[k] = v
        missing = set(index["weight_map"]) - set(tensors)
        assert not missing, f"index lists tensors absent from the shards: {sorted(missing)[:5]}"
    else:
        tensors = dict(load_file(os.path.join(directory, "model.safetensors")))
    return tensors, config


def _text_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Strip `language_model.`, drop vision/projector tensors, convert everything to float64 (§11.1)."""
    out: dict[str, torch.Tensor] = {}
    for k, v in tensors.items():
        if k.startswith(NON_TEXT_PREFIXES):
            continue
        if k.startswith(TEXT_PREFIX):
            k = k[len(TEXT_PREFIX):]
        assert k not in out, f"duplicate text tensor {k}"
        out[k] = v.detach().to(DT)
    return out


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The `text_config` of a multimodal config.json, else the dict itself (§1.2)."""
    if "text_config" in config:
        return config["text_config"]
    return config


# ----------------------------------------------------------------------------------------- primitives
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """§0.2: w ⊙ x / sqrt(mean_c x_c² + ε)."""
    return weight * (x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps))


def l2_norm(x: torch.Tensor) -> torch.Tensor:
    """§0.2: x / sqrt(Σ_c x_c² + 1e-6) (ε inside the sqrt; not F.normalize)."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


def silu(x: torch.Tensor) -> torch.Tensor:
    return x * sigmoid(x)


def softplus(x: torch.Tensor) -> torch.Tensor:
    """ln(1 + eˣ), overflow-safe (x for x > 20, §3.3)."""
    return torch.where(x > 20, x, torch.log1p(torch.exp(torch.clamp(x, max=20.0))))


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y = x·Wᵀ, W stored [out, in], no bias (§0.2)."""
    return x @ w.transpose(0, 1)


def glu(g: torch.Tensor, u: torch.Tensor, act: str, beta1: float | None, beta2: float | None) -> torch.Tensor:
    """§6.1 SiTU-GLU: β₁·tanh(g/β₁)·σ(g) · (β₂·tanh(u/β₂) or u). `silu` = plain SwiGLU."""
    if act == "silu":
        return silu(g) * u
    assert act == "situ", act
    a = beta1 * torch.tanh(g / beta1) * sigmoid(g)
    up = u if beta2 is None else beta2 * torch.tanh(u / beta2)
    return a * up


# -------------------------------------------------------------------------------------------- config
class _Cfg:
    """Plain attribute view of the text config with the documented defaults for omitted fields."""

    def __init__(self, tc: dict[str, Any], variant: str | None):
        self.D = tc["hidden_size"]
        self.V = tc["vocab_size"]
        self.L = tc["num_hidden_layers"]
        self.eps = float(tc.get("rms_norm_eps", 1e-5))
        # MLA
        self.mla_heads = tc["num_attention_heads"]
        assert tc.get("num_key_value_heads", self.mla_heads) == self.mla_heads
        self.q_lora = tc["q_lora_rank"]
        self.kv_lora = tc["kv_lora_rank"]
        self.d_nope = tc["qk_nope_head_dim"]
        self.d_rope = tc["qk_rope_head_dim"]
        self.d_vh = tc["v_head_dim"]
        assert tc.get("mla_use_nope", True) is True, "K3 MLA is NoPE"
        self.mla_gate = bool(tc.get("mla_use_output_gate", True))
        self.mla_norm_eps = 1e-5 if variant == "mla_eps_1e-5" else 1e-6  # §0.5: class default, not the config
        # KDA (§1.1 linear_attn_config)
        lac = tc["linear_attn_config"]
        self.kda_heads = lac["num_heads"]
        self.kda_dim = lac["head_dim"]
        self.conv_w = lac["short_conv_kernel_size"]
        self.kda_layers = set(lac["kda_layers"])  # 1-based
        self.full_layers = set(lac["full_attn_layers"])  # 1-based
        assert self.kda_layers | self.full_layers == set(range(1, self.L + 1))
        assert not (self.kda_layers & self.full_layers)
        self.full_rank_gate = bool(lac.get("use_full_rank_gate", True))
        self.gate_lb = lac.get("gate_lower_bound", None)
        if variant == "softplus_gate":
            self.gate_lb = None
        # FFN / MoE
        self.act = tc.get("hidden_act", "situ")
        self.beta1 = tc.get("activation_situ_beta", 1.0)
        self.beta1 = 1.0 if self.beta1 is None else float(self.beta1)
        self.beta2 = tc.get("activation_situ_linear_beta", None)
        if variant == "beta2_none":
            self.beta2 = None
        self.first_dense = tc.get("first_k_dense_replace", 1)
        self.moe_freq = tc.get("moe_layer_freq", 1)
        self.n_experts = tc["num_experts"]
        self.top_k = tc["num_experts_per_token"]
        self.n_shared = tc.get("num_shared_experts", 0)
        self.latent_norm = bool(tc.get("latent_moe_use_norm", True))
        assert tc.get("moe_router_activation_func", "sigmoid") == "sigmoid"
        self.renorm = bool(tc.get("moe_renormalize", True))
        self.scale = float(tc.get("routed_scaling_factor", 1.0))  # §13.1: 1.0 if absent
        assert tc.get("topk_method", "noaux_tc") == "noaux_tc"
        self.n_group = tc.get("num_expert_group", 1)
        self.topk_group = tc.get("topk_group", 1)
        self.use_bias = variant != "no_bias"
        # AttnRes
        self.block = tc["attn_res_block_size"] + (1 if variant == "block_size_plus_1" else 0)

    def is_kda(self, i: int) -> bool:  # §0.3: 0-based i is KDA iff i+1 in kda_layers
        return (i + 1) in self.kda_layers

    def is_moe(self, i: int) -> bool:  # §0.3
        return i >= self.first_dense and i % self.moe_freq == 0


# ------------------------------------------------------------------------------------------- KDA (§3)
def kda_layer(x: torch.Tensor, p: dict[str, torch.Tensor], cfg: _Cfg) -> torch.Tensor:
    """§3.2 dataflow with the per-token recurrence of §3.4. x: [B, T, D] (input_layernorm output)."""
    B, T, _ = x.shape
    H, d, W = cfg.kda_heads, cfg.kda_dim, cfg.conv_w
    P = H * d

    # 1. projections
    streams = {s: linear(x, p[f"{s}_proj.weight"]) for s in ("q", "k", "v")}  # [B, T, P]

    # 2. depthwise causal short conv per stream and channel, tap W-1 = current token, then SiLU
    conv = {}
    for s, pre in streams.items():
        w = p[f"{s}_conv1d.weight"]  # [P, 1, W]
        assert w.shape == (P, 1, W), (s, w.shape)
        out = torch.zeros_like(pre)
        for t in range(T):
            acc = torch.zeros(B, P, dtype=DT)
            for j in range(W):
                tau = t - (W - 1) + j
                if tau >= 0:
                    acc = acc + w[:, 0, j] * pre[:, tau, :]
            out[:, t, :] = acc
        conv[s] = silu(out)

    # 3./4. heads; q ← L2Norm(q)·d^-1/2, k ← L2Norm(k), v raw
    q = l2_norm(conv["q"].view(B, T, H, d)) * (d ** -0.5)
    k = l2_norm(conv["k"].view(B, T, H, d))
    v = conv["v"].view(B, T, H, d)

    # 5. decay gate (§3.3), A_log sliced to the KDA head count (§11.4)
    f = linear(linear(x, p["f_a_proj.weight"]), p["f_b_proj.weight"]).view(B, T, H, d)
    A_log = p["A_log"][:H]
    dt_bias = p["dt_bias"].view(H, d)
    g = torch.empty(B, T, H, d, dtype=DT)
    for h in range(H):
        if cfg.gate_lb is not None:
            g[:, :, h, :] = float(cfg.gate_lb) * sigmoid(torch.exp(A_log[h]) * (f[:, :, h, :] + dt_bias[h]))
        else:
            g[:, :, h, :] = -torch.exp(A_log[h]) * softplus(f[:, :, h, :] + dt_bias[h])

    # 6. beta
    beta = sigmoid(linear(x, p["b_proj.weight"]))  # [B, T, H]

    # 7. recurrence §3.4, state S [d_k, d_v] per (b, h), S0 = 0
    o = torch.zeros(B, T, H, d, dtype=DT)
    for b in range(B):
        for h in range(H):
            S = torch.zeros(d, d, dtype=DT)
            for t in range(T):
                kt, vt, qt = k[b, t, h], v[b, t, h], q[b, t, h]
                S = torch.diag(torch.exp(g[b, t, h])) @ S  # 1. decay key rows
                u = beta[b, t, h] * (vt - S.transpose(0, 1) @ kt)  # 2. residual vs the decayed state
                S = S + torch.outer(kt, u)  # 3. write
                o[b, t, h] = S.transpose(0, 1) @ qt  # 4. read the updated state

    # 8. output gate
    if cfg.full_rank_gate:
        z = linear(x, p["g_proj.weight"])
    else:
        z = linear(linear(x, p["g_a_proj.weight"]), p["g_b_proj.weight"])
    z = z.view(B, T, H, d)

    # 9. gated RMSNorm per head (o_norm gain shared by heads, ε = rms_norm_eps)
    o = rms_norm(o, p["o_norm.weight"], cfg.eps) * sigmoid(z)

    # 10. output projection on head-major flattening
    return linear(o.reshape(B, T, P), p["o_proj.weight"])


# ------------------------------------------------------------------------------------------- MLA (§4)
def mla_layer(x: torch.Tensor, p: dict[str, torch.Tensor], cfg: _Cfg) -> torch.Tensor:
    """§4.2 expanded form. x: [B, T, D] (input_layernorm output)."""
    B, T, _ = x.shape
    H, dn, dr, dv, dc = cfg.mla_heads, cfg.d_nope, cfg.d_rope, cfg.d_vh, cfg.kv_lora
    eps = cfg.mla_norm_eps

    c_q = rms_norm(linear(x, p["q_a_proj.weight"]), p["q_a_layernorm.weight"], eps)  # 1
    q = linear(c_q, p["q_b_proj.weight"]).view(B, T, H, dn + dr)  # 2
    a = linear(x, p["kv_a_proj_with_mqa.weight"])  # 3
    c, k_pe = a[..., :dc], a[..., dc:]
    assert k_pe.shape[-1] == dr
    c_hat = rms_norm(c, p["kv_a_layernorm.weight"], eps)  # 4 (k_pe raw)
    kv = linear(c_hat, p["kv_b_proj.weight"]).view(B, T, H, dn + dv)  # 5
    k_nope, v = kv[..., :dn], kv[..., dn:]

    scale = 1.0 / math.sqrt(dn + dr)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    o = torch.zeros(B, T, H, dv, dtype=DT)
    for b in range(B):
        for h in range(H):
            query = q[b, :, h, :]  # [T, dn+dr] = [q_nope ‖ q_pe], no rotation
            key = torch.cat([k_nope[b, :, h, :], k_pe[b]], dim=-1)  # 6: k_pe broadcast to every head
            scores = (query @ key.transpose(0, 1)) * scale  # 7
            scores = scores.masked_fill(~causal, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            o[b, :, h, :] = probs @ v[b, :, h, :]  # 8
    o = o.reshape(B, T, H * dv)
    if cfg.mla_gate:
        o = o * sigmoid(linear(x, p["g_proj.weight"]))  # 9 (same normed input x)
    return linear(o, p["o_proj.weight"])  # 10


# ------------------------------------------------------------------------------------------- FFN (§6)
def dense_mlp(x: torch.Tensor, p: dict[str, torch.Tensor], cfg: _Cfg) -> torch.Tensor:
    """§6.2 / §6.5: down(SiTU-GLU(gate x, up x))."""
    h = glu(linear(x, p["gate_proj.weight"]), linear(x, p["up_proj.weight"]), cfg.act, cfg.beta1, cfg.beta2)
    return linear(h, p["down_proj.weight"])


def route_token(x_t: torch.Tensor, p: dict[str, torch.Tensor], cfg: _Cfg):
    """§6.3 for one token x_t [D]. Returns (sorted expert ids, weights aligned with ids, top-k margin)."""
    E, k = cfg.n_experts, cfg.top_k
    logits = p["gate.weight"] @ x_t  # 1
    s = sigmoid(logits)  # 2
    sel = s + p["gate.e_score_correction_bias"] if cfg.use_bias else s.clone()  # 3 (bias on the scores)
    if cfg.n_group > 1 and cfg.n_group > cfg.topk_group:  # 4 group-limited routing
        per = E // cfg.n_group
        groups = sel.view(cfg.n_group, per)
        gscore = torch.stack([torch.sort(gr, descending=True).values[:2].sum() for gr in groups])
        keep = torch.sort(gscore, descending=True).indices[: cfg.topk_group]
        mask = torch.full((cfg.n_group, per), float("-inf"), dtype=DT)
        mask[keep] = 0.0
        sel = (groups + mask).reshape(E)
    order = torch.sort(sel, descending=True)
    ids = order.indices[:k]  # 5
    margin = float(order.values[k - 1] - order.values[k]) if k < E else math.inf
    w = s[ids]  # 6 unbiased scores
    if cfg.renorm:
        w = w / (w.sum() + 1e-20)
    w = w * cfg.scale
    ids_sorted, perm = torch.sort(ids)
    return ids_sorted, w[perm], margin


def latent_moe(x: torch.Tensor, p: dict[str, torch.Tensor], cfg: _Cfg):
    """§6.3–6.6 with a per-token loop over the selected experts. Returns (y, ids [B,T,k], min margin)."""
    B, T, D = x.shape
    ell = p["routed_expert_down_proj.weight"].shape[0]
    ids_all = torch.zeros(B, T, cfg.top_k, dtype=torch.long)
    min_margin = math.inf
    r = torch.zeros(B, T, ell, dtype=DT)
    for b in range(B):
        for t in range(T):
            x_t = x[b, t]
            ids, w, margin = route_token(x_t, p, cfg)
            ids_all[b, t] = ids
            min_margin = min(min_margin, margin)
            z = p["routed_expert_down_proj.weight"] @ x_t  # §6.4.1, once per token
            acc = torch.zeros(ell, dtype=DT)
            for e, w_e in zip(ids.tolist(), w):
                pre = f"experts.{e}."
                hid = glu(p[pre + "w1.weight"] @ z, p[pre + "w3.weight"] @ z, cfg.act, cfg.beta1, cfg.beta2)
                acc = acc + w_e * (p[pre + "w2.weight"] @ hid)  # §6.4.2–3, weight after w2
            r[b, t] = acc
    if cfg.latent_norm:
        r = rms_norm(r, p["routed_expert_norm.weight"], cfg.eps)  # §6.4.4
    else:
        assert "routed_expert_norm.weight" not in p
    y = linear(r, p["routed_expert_up_proj.weight"])  # §6.4.5
    if cfg.n_shared > 0:  # §6.5 on full-width x
        y = y + dense_mlp(x, _sub(p, "shared_experts."), cfg)
    return y, ids_all, min_margin


# --------------------------------------------------------------------------------------- AttnRes (§5)
def attn_res_mix(sources: list[torch.Tensor], gamma: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """§5.1: keys RMS-normalised (no gain), s_i = Σ key·γ·w, softmax over sources, raw values."""
    w = w.reshape(-1)
    scores = []
    for V in sources:
        key = V / torch.sqrt((V * V).mean(dim=-1, keepdim=True) + eps)
        scores.append((key * gamma * w).sum(dim=-1))  # [B, T]
    probs = torch.softmax(torch.stack(scores, dim=0), dim=0)  # over the source axis
    out = torch.zeros_like(sources[0])
    for i, V in enumerate(sources):
        out = out + probs[i].unsqueeze(-1) * V
    return out


# ----------------------------------------------------------------------------------------- the model
def _sub(p: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix):]: v for k, v in p.items() if k.startswith(prefix)}


@torch.no_grad()
def reference_logits(
    tensors: dict[str, torch.Tensor],
    text_config: dict[str, Any],
    input_ids: torch.Tensor,
    *,
    return_aux: bool = False,
    _variant: str | None = None,
):
    """Logits [B, T, V] in float64 (Appendix A, §5.3).

    With ``return_aux=True`` returns ``(logits, aux)`` where aux has
      "routing": {layer i: LongTensor [B, T, k] of sorted expert ids}
      "min_margin": smallest gap between the k-th and (k+1)-th selection score over all MoE layers/tokens
      "min_margin_per_layer": {layer i: float}
      "router_input": {layer i: post_attention_layernorm output [B, T, D] fed to the router}
      "embedding": e, "cur": [cur after layer i for each i], "final_hidden": model.norm output.
    """
    assert _variant in VARIANTS, f"unknown variant {_variant!r}"
    cfg = _Cfg(_text_config(text_config), _variant)
    p = _text_tensors(tensors)
    input_ids = torch.as_tensor(input_ids, dtype=torch.long)
    assert input_ids.dim() == 2
    eps = cfg.eps

    e = p["model.embed_tokens.weight"][input_ids]  # [B, T, D]
    cur = e
    bank: list[torch.Tensor] = []
    routing: dict[int, torch.Tensor] = {}
    router_inputs: dict[int, torch.Tensor] = {}
    margins: dict[int, float] = {}
    curs: list[torch.Tensor] = []

    for i in range(cfg.L):
        lp = _sub(p, f"model.layers.{i}.")
        # 1. prefix ← cur
        prefix = cur
        # 2. pre-attention mix
        if not bank:
            h = prefix
        else:
            h = attn_res_mix(bank + [prefix], lp["self_attention_res_norm.weight"],
                             lp["self_attention_res_proj.weight"], eps)
        # 3. block boundary on the 0-based index: bank the raw prefix
        if i % cfg.block == 0:
            bank.append(prefix)
            prefix = None
        # 4. attention on the PreNorm of the mix
        x = rms_norm(h, lp["input_layernorm.weight"], eps)
        attn_p = _sub(lp, "self_attn.")
        a = kda_layer(x, attn_p, cfg) if cfg.is_kda(i) else mla_layer(x, attn_p, cfg)
        # 5.
        prefix = a if prefix is None else prefix + a
        # 6. pre-FFN mix (bank never empty here)
        h2 = attn_res_mix(bank + [prefix], lp["mlp_res_norm.weight"], lp["mlp_res_proj.weight"], eps)
        # 7. FFN
        x2 = rms_norm(h2, lp["post_attention_layernorm.weight"], eps)
        if cfg.is_moe(i):
            f, ids, margin = latent_moe(x2, _sub(lp, "block_sparse_moe."), cfg)
            routing[i] = ids
            router_inputs[i] = x2
            margins[i] = margin
        else:
            f = dense_mlp(x2, _sub(lp, "mlp."), cfg)
        # 8.
        cur = prefix + f
        curs.append(cur)

    out = attn_res_mix(bank + [cur], p["model.output_attn_res_norm.weight"],
                       p["model.output_attn_res_proj.weight"], eps)
    final = rms_norm(out, p["model.norm.weight"], eps)
    logits = linear(final, p["lm_head.weight"])
    if not return_aux:
        return logits
    aux = {
        "routing": routing,
        "min_margin": min(margins.values()) if margins else math.inf,
        "min_margin_per_layer": margins,
        "router_input": router_inputs,
        "embedding": e,
        "cur": curs,
        "final_hidden": final,
    }
    return logits, aux


@torch.no_grad()
def reference_attention(tensors, text_config, i: int, x: torch.Tensor, *, _variant: str | None = None):
    """`self_attn` of decoder layer i (KDA or MLA per the schedule) on the `input_layernorm` output x."""
    assert _variant in VARIANTS, f"unknown variant {_variant!r}"
    cfg = _Cfg(_text_config(text_config), _variant)
    lp = _sub(_text_tensors(tensors), f"model.layers.{i}.self_attn.")
    x = x.to(DT)
    return kda_layer(x, lp, cfg) if cfg.is_kda(i) else mla_layer(x, lp, cfg)


@torch.no_grad()
def reference_ffn(tensors, text_config, i: int, x: torch.Tensor, *, _variant: str | None = None):
    """FFN of decoder layer i on the `post_attention_layernorm` output x: returns (y, routed ids or None,
    smallest routing margin or inf)."""
    assert _variant in VARIANTS, f"unknown variant {_variant!r}"
    cfg = _Cfg(_text_config(text_config), _variant)
    lp = _sub(_text_tensors(tensors), f"model.layers.{i}.")
    x = x.to(DT)
    if cfg.is_moe(i):
        return latent_moe(x, _sub(lp, "block_sparse_moe."), cfg)
    return dense_mlp(x, _sub(lp, "mlp."), cfg), None, math.inf
