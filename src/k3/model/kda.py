"""Kimi Delta Attention layer (§3.1–§3.3, §3.9).

Shape suffixes (`x_BTD`): the package-wide legend at the top of docs/architecture.md.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from k3.config import K3Config
from k3.model.cache import KDACache, StepContext
from k3.ops.kda import delta_rule
from k3.ops.kda.conv import short_conv
from k3.ops.matvec import Linear
from k3.ops.norm import RMSNorm, l2_normalize, rms_normalize
from k3.ops.precision import KeepFP32, fp32


def kda_decay(f_BTHK: torch.Tensor, A_log_H: torch.Tensor, dt_bias_HK: torch.Tensor,
              lower_bound: float | None) -> torch.Tensor:
    """Per-channel log-decay g < 0 in fp32 (§3.3).

    bounded (K3):   g = λ·σ(exp(A_log)·(f + dt_bias)),  λ = gate_lower_bound
    softplus form:  g = −exp(A_log)·softplus(f + dt_bias)
    """
    A_H11 = fp32(A_log_H).exp()[:, None]
    x_BTHK = fp32(f_BTHK) + dt_bias_HK
    if lower_bound is None:
        return -A_H11 * F.softplus(x_BTHK)
    return lower_bound * torch.sigmoid(A_H11 * x_BTHK)


class KimiDeltaAttention(KeepFP32):
    """One KDA layer (module `self_attn` of a KDA decoder layer); parameter names are the checkpoint's.

    `impl` picks the core's implementation (`k3.ops.kda.delta_rule`: "auto", "chunk", "recurrent", "fla"); a
    runtime choice, not part of the model's configuration."""

    def __init__(self, config: K3Config, impl: str = "auto"):
        super().__init__()
        self.config = config
        self.impl = impl
        D, H, K, W = config.hidden_size, config.kda_num_heads, config.kda_head_dim, config.short_conv_kernel_size
        P = H * K
        self.num_heads, self.head_dim = H, K
        self.q_proj = Linear(D, P)
        self.k_proj = Linear(D, P)
        self.v_proj = Linear(D, P)
        self.q_conv1d = nn.Conv1d(P, P, W, groups=P, bias=False)
        self.k_conv1d = nn.Conv1d(P, P, W, groups=P, bias=False)
        self.v_conv1d = nn.Conv1d(P, P, W, groups=P, bias=False)
        self.f_a_proj = Linear(D, K)  # low-rank decay input, rank = head_dim
        self.f_b_proj = Linear(K, P)
        self.A_log = nn.Parameter(torch.zeros(H, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.zeros(P, dtype=torch.float32))
        self.b_proj = Linear(D, H)
        if config.use_full_rank_gate:
            self.g_proj = Linear(D, P)
        else:  # Kimi-Linear's low-rank output gate
            self.g_a_proj = Linear(D, K)
            self.g_b_proj = Linear(K, P)
        self.o_norm = RMSNorm(K, eps=config.rms_norm_eps)
        self.o_proj = Linear(P, D)
        self.pin_fp32()

    @torch.no_grad()
    def reset_kda_parameters(self) -> None:
        """Gate and conv init of §3.9 (the Linear layers are initialised by the model)."""
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

    def forward(self, x_BTD: torch.Tensor, cache: KDACache | None = None,
                ctx: StepContext | None = None) -> torch.Tensor:
        """x is the `input_layernorm` output; returns the layer output [B, T, D] (§3.2).

        With a cache, the conv windows and the recurrent state continue from it and are updated in place. With
        `ctx.document_ids_BT` (packed rows) the conv window and the state restart at every document. Padding tokens
        (`ctx.valid_BT` false) enter neither the conv windows (their inputs are zeroed, like the zero context
        of a fresh sequence) nor the state (identity steps: k = 0, g = 0, β = 0; §3.8).
        """
        B, T, _ = x_BTD.shape
        H, K = self.num_heads, self.head_dim
        ctx = ctx or StepContext()
        valid_BT1 = None if ctx.valid_BT is None else ctx.valid_BT[..., None]
        documents = ctx.document_ids_BT
        streams = []
        for i, (proj, conv) in enumerate(((self.q_proj, self.q_conv1d), (self.k_proj, self.k_conv1d),
                                          (self.v_proj, self.v_conv1d))):
            x_BTP = proj(x_BTD)
            if valid_BT1 is not None:
                x_BTP = x_BTP.masked_fill(~valid_BT1, 0)
            context_BWP = None if cache is None else cache.conv_state_B3WP[:, i]
            y_BTP, context_BWP = ctx.sequence.short_conv(partial(short_conv, weight_P1W=conv.weight), x_BTP,
                                                         context_BWP, documents)
            if cache is not None:
                cache.conv_state_B3WP[:, i] = context_BWP
            streams.append(y_BTP.view(B, T, H, K))
        q_BTHK, k_BTHK, v_BTHK = streams
        q_BTHK, k_BTHK = l2_normalize(q_BTHK), l2_normalize(k_BTHK)  # fp32; the op applies K^-1/2 to q
        g_BTHK = kda_decay(self.f_b_proj(self.f_a_proj(x_BTD)).view(B, T, H, K), self.A_log,
                           self.dt_bias.view(H, K), self.config.gate_lower_bound)
        beta_BTH = torch.sigmoid(fp32(self.b_proj(x_BTD)))
        if valid_BT1 is not None:  # identity steps leave S untouched
            k_BTHK = k_BTHK.masked_fill(~valid_BT1[..., None], 0)
            g_BTHK = g_BTHK.masked_fill(~valid_BT1[..., None], 0)
            beta_BTH = beta_BTH.masked_fill(~valid_BT1, 0)
        state = None if cache is None else cache.recurrent_state_BHKV
        # from the cached state (packed rows: every document from zero); a context-parallel shard continues from the
        # state the earlier shards leave
        run = partial(delta_rule, document_ids_BT=documents, impl=self.impl, chunk_size=self.config.kda_chunk_size)
        o_BTHK, state = ctx.sequence.delta_rule(run, q_BTHK, k_BTHK, v_BTHK, g_BTHK, beta_BTH, state, cache is not None)
        if cache is not None:
            cache.recurrent_state_BHKV = state
        z_BTHK = self.output_gate(x_BTD).view(B, T, H, K)
        # gated norm, entirely fp32: RMSNorm_{o_norm}(o) ⊙ σ(z)
        o_BTHK = rms_normalize(o_BTHK, self.o_norm.eps) * self.o_norm.weight * torch.sigmoid(fp32(z_BTHK))
        return self.o_proj(o_BTHK.to(x_BTD.dtype).reshape(B, T, H * K))
