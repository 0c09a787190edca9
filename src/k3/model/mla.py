"""Gated NoPE multi-head latent attention, expanded form (spec §4.1, §4.2, §4.5).

Shape legend: B batch, T query time, S key time, D hidden, H heads, N = qk_nope_head_dim, R = qk_rope_head_dim
(the never-rotated shared key slot), Vh = v_head_dim, C = kv_lora_rank, Q = q_lora_rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from k3.config import K3Config
from k3.model.norm import RMSNorm

MLA_LORA_NORM_EPS = 1e-6  # spec §0.5: class default of the reference RMSNorm; the config's eps is not passed


class GatedMLA(nn.Module):
    """One gated MLA layer (module `self_attn` of an MLA decoder layer); no positional encoding."""

    def __init__(self, config: K3Config):
        super().__init__()
        self.config = config
        D, H = config.hidden_size, config.num_attention_heads
        N, R, Vh = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.num_heads = H
        self.q_a_proj = nn.Linear(D, config.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, eps=MLA_LORA_NORM_EPS)
        self.q_b_proj = nn.Linear(config.q_lora_rank, H * (N + R), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, config.kv_lora_rank + R, bias=False)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, eps=MLA_LORA_NORM_EPS)
        self.kv_b_proj = nn.Linear(config.kv_lora_rank, H * (N + Vh), bias=False)
        if config.mla_use_output_gate:
            self.g_proj = nn.Linear(D, H * Vh, bias=False)
        self.o_proj = nn.Linear(H * Vh, D, bias=False)
        self.scale = (N + R) ** -0.5  # 1/sqrt(qk_nope + qk_rope), in every form

    def project_query(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q_nope [B,T,H,N], q_pe [B,T,H,R]) from c_q = RMSNorm_{1e-6}(x W_qaᵀ) (steps 1–2)."""
        B, T, _ = x_BTD.shape
        cfg = self.config
        q_BTHQ = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BTD))).view(B, T, self.num_heads, -1)
        return q_BTHQ.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)

    def compress_kv(self, x_BTD: torch.Tensor) -> torch.Tensor:
        """The 576-number latent per token: [ĉ = RMSNorm_{1e-6}(c) ‖ raw k_pe] (steps 3–4, spec §4.3)."""
        c_BTC, k_pe_BTR = self.kv_a_proj_with_mqa(x_BTD).split(
            [self.config.kv_lora_rank, self.config.qk_rope_head_dim], dim=-1)
        return torch.cat([self.kv_a_layernorm(c_BTC), k_pe_BTR], dim=-1)

    def gate_and_project(self, x_BTD: torch.Tensor, o_BTHV: torch.Tensor) -> torch.Tensor:
        """y = (o ⊙ σ(x W_gᵀ)) W_oᵀ: elementwise sigmoid gate per head and channel, then o_proj (steps 9–10)."""
        o_BTP = o_BTHV.flatten(2)
        if self.config.mla_use_output_gate:
            o_BTP = o_BTP * torch.sigmoid(self.g_proj(x_BTD))
        return self.o_proj(o_BTP)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        """Causal expanded attention over the whole input; x is the `input_layernorm` output."""
        B, T, _ = x_BTD.shape
        cfg = self.config
        H, N = self.num_heads, cfg.qk_nope_head_dim
        q_nope_BTHN, q_pe_BTHR = self.project_query(x_BTD)
        latent_BTL = self.compress_kv(x_BTD)
        c_BTC, k_pe_BTR = latent_BTL.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        k_nope_BTHN, v_BTHV = self.kv_b_proj(c_BTC).view(B, T, H, -1).split([N, cfg.v_head_dim], dim=-1)
        # key = [k_nope ‖ k_pe broadcast over heads]; query = [q_nope ‖ q_pe]; no rotation anywhere
        key_BTHQ = torch.cat([k_nope_BTHN, k_pe_BTR[:, :, None].expand(B, T, H, -1)], dim=-1)
        query_BTHQ = torch.cat([q_nope_BTHN, q_pe_BTHR], dim=-1)
        o_BHTV = F.scaled_dot_product_attention(
            query_BTHQ.transpose(1, 2), key_BTHQ.transpose(1, 2), v_BTHV.transpose(1, 2),
            is_causal=True, scale=self.scale)
        return self.gate_and_project(x_BTD, o_BHTV.transpose(1, 2))
