"""Gated NoPE multi-head latent attention, expanded form (§4.1, §4.2, §4.5); RoPE for the K2 baseline (§14.2).

Shape suffixes (`x_BTD`): the package-wide legend at the top of docs/architecture.md.
"""

from __future__ import annotations

import torch
from torch import nn

from k3.config import K3Config
from k3.model.cache import MLACache, StepContext
from k3.ops.attention import attention
from k3.ops.matvec import Linear
from k3.ops.norm import RMSNorm
from k3.ops.rope import apply_rope, rope_angles

MLA_LORA_NORM_EPS = 1e-6  # §0.5: class default of the reference RMSNorm; the config's eps is not passed


def absorbed_max_tokens(config: K3Config) -> int:
    """Longest cached call that is cheaper in the absorbed form. Per (query, key) pair the absorbed form attends over
    C + R latent numbers instead of N + R (×2 for scores and values); the expanded form pays kv_b_proj, C·(N + Vh)
    per head, for every cached key. Absorbed wins while T·2(C − N) < C·(N + Vh)."""
    C, N = config.kv_lora_rank, config.qk_nope_head_dim
    if C <= N:
        return 2**62  # never more work per pair
    return max(1, C * (N + config.v_head_dim) // (2 * (C - N)))


class GatedMLA(nn.Module):
    """One gated MLA layer (module `self_attn` of an MLA decoder layer); no positional encoding.

    The K2 form (`mla_use_nope = false`, `mla_use_output_gate = false`, §14.2) rotates q_pe and k_pe by their
    positions (RoPE, θ = `config.rope_theta`) and has no output gate; the cache then holds the rotated k_pe."""

    def __init__(self, config: K3Config):
        super().__init__()
        self.config = config
        D, H = config.hidden_size, config.num_attention_heads
        N, R, Vh = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.num_heads = H
        self.q_a_proj = Linear(D, config.q_lora_rank)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, eps=MLA_LORA_NORM_EPS)
        self.q_b_proj = Linear(config.q_lora_rank, H * (N + R))
        self.kv_a_proj_with_mqa = Linear(D, config.kv_lora_rank + R)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, eps=MLA_LORA_NORM_EPS)
        self.kv_b_proj = Linear(config.kv_lora_rank, H * (N + Vh))
        if config.mla_use_output_gate:
            self.g_proj = Linear(D, H * Vh)
        self.o_proj = Linear(H * Vh, D)
        self.scale = (N + R) ** -0.5  # 1/sqrt(qk_nope + qk_rope), in every form
        # cached calls of at most this many new tokens take the absorbed form (0: never; a runtime choice)
        self.absorbed_max_tokens = absorbed_max_tokens(config)

    def project_query(self, x_BTD: torch.Tensor, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(q_nope [B,T,H,N], q_pe [B,T,H,R]) from c_q = RMSNorm_{1e-6}(x W_qaᵀ) (steps 1–2); q_pe rotated to
        the positions start.. in the RoPE form."""
        B, T, _ = x_BTD.shape
        cfg = self.config
        q_BTHQ = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BTD))).view(B, T, self.num_heads, -1)
        q_nope_BTHK, q_pe_BTHR = q_BTHQ.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        return q_nope_BTHK, self._rotate(q_pe_BTHR, start)

    def compress_kv(self, x_BTD: torch.Tensor, start: int = 0) -> torch.Tensor:
        """The 576-number latent per token: [ĉ = RMSNorm_{1e-6}(c) ‖ raw k_pe] (steps 3–4, §4.3); k_pe rotated
        to the positions start.. in the RoPE form."""
        kv_a_BTL = self.kv_a_proj_with_mqa(x_BTD)
        c_BTc, k_pe_BTR = kv_a_BTL.split([self.config.kv_lora_rank, self.config.qk_rope_head_dim], dim=-1)
        return torch.cat([self.kv_a_layernorm(c_BTc), self._rotate(k_pe_BTR, start)], dim=-1)

    def _rotate(self, x_BTR: torch.Tensor, start: int) -> torch.Tensor:
        """x unchanged (K3: no positional encoding), or rotated to the positions start..start+T-1 (K2's RoPE)."""
        if self.config.mla_use_nope:
            return x_BTR
        positions_T = torch.arange(start, start + x_BTR.shape[1], device=x_BTR.device)
        return apply_rope(x_BTR, *rope_angles(positions_T, x_BTR.shape[-1], self.config.rope_theta))

    def gate_and_project(self, x_BTD: torch.Tensor, o_BTHV: torch.Tensor) -> torch.Tensor:
        """y = (o ⊙ σ(x W_gᵀ)) W_oᵀ: elementwise sigmoid gate per head and channel, then o_proj (steps 9–10)."""
        o_BTP = o_BTHV.flatten(2)
        if self.config.mla_use_output_gate:
            o_BTP = o_BTP * torch.sigmoid(self.g_proj(x_BTD))
        return self.o_proj(o_BTP)

    def forward(self, x_BTD: torch.Tensor, cache: MLACache | None = None,
                ctx: StepContext | None = None) -> torch.Tensor:
        """Causal attention of the new tokens over the cached and new ones; x is the `input_layernorm` output.

        Only the latent [ĉ ‖ k_pe] is cached (in the cache's dtype: a bf16 cache under an fp32 model rounds it, and
        the layer attends over the rounded latents, the new tokens' included). Cached calls of at most
        `absorbed_max_tokens` new tokens (decode steps, short chunks) use the absorbed form (§4.4); training and
        longer prefill chunks the expanded form (§4.2).
        """
        ctx = ctx or StepContext()
        T = x_BTD.shape[1]
        latent_BSL = self.compress_kv(x_BTD, ctx.start)
        if cache is not None:  # every key as the cache holds it (rounded where it is bf16), widened to x's dtype
            cache.latent_BSL[:, ctx.start: ctx.start + T] = latent_BSL
            latent_BSL = cache.latent_BSL[:, : ctx.start + T].to(x_BTD.dtype)
        # a context-parallel shard: with the earlier shards' latents (and their documents)
        latent_BSL, document_ids_BS = ctx.sequence.keys(latent_BSL, ctx.document_ids_BT)
        for observer in ctx.observers:  # QK-Clip's max logits over the pairs this layer scores (§8.6)
            observer.on_attention(self, x_BTD.detach(), latent_BSL.detach(), document_ids_BS)
        q_nope_BTHK, q_pe_BTHR = self.project_query(x_BTD, ctx.start)
        absorbed = cache is not None and T <= self.absorbed_max_tokens
        attend = self.attend_absorbed if absorbed else self.attend_expanded
        o_BTHV = attend(q_nope_BTHK, q_pe_BTHR, latent_BSL, ctx.key_valid_BS, document_ids_BS)
        return self.gate_and_project(x_BTD, o_BTHV)

    def attend_expanded(self, q_nope_BTHK: torch.Tensor, q_pe_BTHR: torch.Tensor, latent_BSL: torch.Tensor,
                        key_valid_BS: torch.Tensor | None = None,
                        document_ids_BS: torch.Tensor | None = None) -> torch.Tensor:
        """Expanded MHA (§4.2 steps 5–8): keys [k_nope ‖ k_pe broadcast over heads], values from ĉ; the T new
        queries sit at positions S − T.. (blocked exact attention, §4.7)."""
        cfg = self.config
        B, S, _ = latent_BSL.shape
        H, N = self.num_heads, cfg.qk_nope_head_dim
        c_BSc, k_pe_BSR = latent_BSL.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        k_nope_BSHK, v_BSHV = self.kv_b_proj(c_BSc).view(B, S, H, -1).split([N, cfg.v_head_dim], dim=-1)
        # key = [k_nope ‖ k_pe broadcast over heads]; query = [q_nope ‖ q_pe] (rotated in the RoPE form only)
        key_BSHQ = torch.cat([k_nope_BSHK, k_pe_BSR[:, :, None].expand(B, S, H, -1)], dim=-1)
        query_BTHQ = torch.cat([q_nope_BTHK, q_pe_BTHR], dim=-1)
        o_BHTV = attention(query_BTHQ.transpose(1, 2), key_BSHQ.transpose(1, 2), v_BSHV.transpose(1, 2), self.scale,
                           key_valid_BS, document_ids_BS)
        return o_BHTV.transpose(1, 2)

    def attend_absorbed(self, q_nope_BTHK: torch.Tensor, q_pe_BTHR: torch.Tensor, latent_BSL: torch.Tensor,
                        key_valid_BS: torch.Tensor | None = None,
                        document_ids_BS: torch.Tensor | None = None) -> torch.Tensor:
        """MQA over the latent (§4.4): W_UK folded into the query, W_UV applied per head after attention.

        score = [W_UKᵀ q_nope ‖ q_pe] · [ĉ ‖ k_pe] / sqrt(N + R); o = W_UV (Σ_s p_s ĉ_s): the latent is one key/value
        head read by every head (blocked exact attention with G = 1, §4.7).
        """
        cfg = self.config
        C, N = cfg.kv_lora_rank, cfg.qk_nope_head_dim
        W_HXc = self.kv_b_proj.weight.view(self.num_heads, N + cfg.v_head_dim, C)
        W_UK_HKc, W_UV_HVc = W_HXc[:, :N], W_HXc[:, N:]
        q_BTHL = torch.cat([torch.einsum("bthn,hnc->bthc", q_nope_BTHK, W_UK_HKc), q_pe_BTHR], dim=-1)
        o_lat_BHTc = attention(q_BTHL.transpose(1, 2), latent_BSL[:, None], latent_BSL[:, None, :, :C], self.scale,
                               key_valid_BS, document_ids_BS)
        return torch.einsum("bhtc,hvc->bthv", o_lat_BHTc, W_UV_HVc)
