"""Kimi Delta Attention layer (spec §3.1–§3.3, §3.9).

Shape legend: B batch, T time, D hidden, P = H·K projection width, H heads, K key/value head dim, W conv width.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from k3.config import K3Config
from k3.model.norm import RMSNorm, l2_normalize, rms_normalize
from k3.model.precision import KeepFP32, fp32
from k3.ops.kda import chunk_kda, recurrent_kda


def kda_decay(f_BTHK: torch.Tensor, A_log_H: torch.Tensor, dt_bias_HK: torch.Tensor,
              lower_bound: float | None) -> torch.Tensor:
    """Per-channel log-decay g < 0 in fp32 (spec §3.3).

    bounded (K3):   g = λ·σ(exp(A_log)·(f + dt_bias)),  λ = gate_lower_bound
    softplus form:  g = −exp(A_log)·softplus(f + dt_bias)
    """
    A_H11 = fp32(A_log_H).exp()[:, None]
    x_BTHK = fp32(f_BTHK) + dt_bias_HK
    if lower_bound is None:
        return -A_H11 * F.softplus(x_BTHK)
    return lower_bound * torch.sigmoid(A_H11 * x_BTHK)


def short_conv(x_BTP: torch.Tensor, weight_P1W: torch.Tensor) -> torch.Tensor:
    """Causal depthwise conv + SiLU in fp32, cast back (spec §3.2 step 2); tap W−1 is the current token."""
    W = weight_P1W.shape[-1]
    x_BPT = fp32(x_BTP).transpose(1, 2)
    y_BPT = F.conv1d(F.pad(x_BPT, (W - 1, 0)), weight_P1W.to(x_BPT.dtype), groups=weight_P1W.shape[0])
    return F.silu(y_BPT).transpose(1, 2).to(x_BTP.dtype)


class KimiDeltaAttention(KeepFP32):
    """One KDA layer (module `self_attn` of a KDA decoder layer); parameter names are the checkpoint's."""

    fp32_names = ("A_log", "dt_bias", "q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight", "o_norm.weight")

    def __init__(self, config: K3Config):
        super().__init__()
        self.config = config
        D, H, K, W = config.hidden_size, config.kda_num_heads, config.kda_head_dim, config.short_conv_kernel_size
        P = H * K
        self.num_heads, self.head_dim = H, K
        self.q_proj = nn.Linear(D, P, bias=False)
        self.k_proj = nn.Linear(D, P, bias=False)
        self.v_proj = nn.Linear(D, P, bias=False)
        self.q_conv1d = nn.Conv1d(P, P, W, groups=P, bias=False)
        self.k_conv1d = nn.Conv1d(P, P, W, groups=P, bias=False)
        self.v_conv1d = nn.Conv1d(P, P, W, groups=P, bias=False)
        self.f_a_proj = nn.Linear(D, K, bias=False)  # low-rank decay input, rank = head_dim
        self.f_b_proj = nn.Linear(K, P, bias=False)
        self.A_log = nn.Parameter(torch.zeros(H, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.zeros(P, dtype=torch.float32))
        self.b_proj = nn.Linear(D, H, bias=False)
        if config.use_full_rank_gate:
            self.g_proj = nn.Linear(D, P, bias=False)
        else:  # Kimi-Linear's low-rank output gate
            self.g_a_proj = nn.Linear(D, K, bias=False)
            self.g_b_proj = nn.Linear(K, P, bias=False)
        self.o_norm = RMSNorm(K, eps=config.rms_norm_eps)
        self.o_proj = nn.Linear(P, D, bias=False)
        self.pin_fp32()

    @torch.no_grad()
    def reset_kda_parameters(self) -> None:
        """Gate and conv init of spec §3.9 (the Linear layers are initialised by the model)."""
        self.A_log.zero_()
        # dt = exp(U(ln 1e-3, ln 1e-1)) clamped ≥ 1e-4; dt_bias = inverse-softplus(dt) = dt + ln(−expm1(−dt))
        u = torch.rand_like(self.dt_bias)
        dt = torch.exp(u * (math.log(1e-1) - math.log(1e-3)) + math.log(1e-3)).clamp_min(1e-4)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        for conv in (self.q_conv1d, self.k_conv1d, self.v_conv1d):
            conv.reset_parameters()  # U(−1/√W, 1/√W), PyTorch's Conv1d default
        self.o_norm.weight.fill_(1.0)

    def output_gate(self, x_BTD: torch.Tensor) -> torch.Tensor:
        if self.config.use_full_rank_gate:
            return self.g_proj(x_BTD)
        return self.g_b_proj(self.g_a_proj(x_BTD))

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        """x is the `input_layernorm` output; returns the layer output [B, T, D] (spec §3.2)."""
        B, T, _ = x_BTD.shape
        H, K = self.num_heads, self.head_dim
        q_BTHK = short_conv(self.q_proj(x_BTD), self.q_conv1d.weight).view(B, T, H, K)
        k_BTHK = short_conv(self.k_proj(x_BTD), self.k_conv1d.weight).view(B, T, H, K)
        v_BTHK = short_conv(self.v_proj(x_BTD), self.v_conv1d.weight).view(B, T, H, K)
        q_BTHK, k_BTHK = l2_normalize(q_BTHK), l2_normalize(k_BTHK)  # fp32; the op applies K^-1/2 to q
        g_BTHK = kda_decay(self.f_b_proj(self.f_a_proj(x_BTD)).view(B, T, H, K), self.A_log,
                           self.dt_bias.view(H, K), self.config.gate_lower_bound)
        beta_BTH = torch.sigmoid(fp32(self.b_proj(x_BTD)))
        if self.config.kda_impl == "recurrent":
            o_BTHK, _ = recurrent_kda(q_BTHK, k_BTHK, v_BTHK, g_BTHK, beta_BTH)
        else:
            o_BTHK, _ = chunk_kda(q_BTHK, k_BTHK, v_BTHK, g_BTHK, beta_BTH, chunk_size=self.config.kda_chunk_size)
        z_BTHK = self.output_gate(x_BTD).view(B, T, H, K)
        # gated norm, entirely fp32: RMSNorm_{o_norm}(o) ⊙ σ(z)
        o_BTHK = rms_normalize(o_BTHK, self.o_norm.eps) * self.o_norm.weight * torch.sigmoid(fp32(z_BTHK))
        return self.o_proj(o_BTHK.to(x_BTD.dtype).reshape(B, T, H * K))
