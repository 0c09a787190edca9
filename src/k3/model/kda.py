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
from k3.ops import decode
from k3.ops.norm import RMSNorm, l2_normalize, rms_normalize
from k3.ops.precision import KeepFP32, fp32
from k3.ops.kda import chunk_kda, recurrent_kda
from k3.ops.kda.conv import compiled_short_conv
from k3.ops.kda.gpu import fla_kda, use_fla
from k3.ops.kda.varlen import chunk_kda_by_document, kda_by_document
from k3.ops.matvec import Linear, project


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


def short_conv(x_BTP: torch.Tensor, weight_P1W: torch.Tensor, context_BWP: torch.Tensor | None = None,
               document_ids_BT: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv + SiLU in fp32, cast back (§3.2 step 2, §3.7); tap W−1 is the current token.

    `context` holds the W−1 inputs before x (zeros for a fresh sequence). With `document_ids`, a tap never
    reads an input of another document (packed rows, §3.8). Returns (output [B,T,P], the last W−1
    inputs [B,W−1,P] = the context of the next call).

    y_t = Σ_j w_j · x_{t−(W−1)+j}, computed the fastest way measured on CPU: one
    token (decoding) as a product with its window, training (gradients or documents) by the compiled kernel
    (`k3.ops.kda.conv`; where it does not serve, as W shifted products), a no-grad multi-token call (prefill) by
    `conv1d`.
    """
    W = weight_P1W.shape[-1]
    if context_BWP is None:
        context_BWP = x_BTP.new_zeros(x_BTP.shape[0], W - 1, x_BTP.shape[2])
    full_BTP = torch.cat([context_BWP.to(x_BTP.dtype), x_BTP], dim=1)
    x_BTP_fp32 = fp32(full_BTP)
    w_PW = weight_P1W[:, 0].to(x_BTP_fp32.dtype)
    T = x_BTP.shape[1]
    if T == 1 and document_ids_BT is None:
        y_BTP = (x_BTP_fp32 * w_PW.t()).sum(1, keepdim=True)
    elif document_ids_BT is not None or torch.is_grad_enabled():
        fused_BTP = compiled_short_conv(x_BTP_fp32, w_PW, document_ids_BT)  # SiLU included, one pass each way
        if fused_BTP is not None:
            return fused_BTP.to(x_BTP.dtype), full_BTP[:, full_BTP.shape[1] - (W - 1):]
        # the (zero) context belongs to no document
        doc_BT = None if document_ids_BT is None else F.pad(document_ids_BT, (W - 1, 0), value=-1)
        y_BTP = sum(w_PW[:, j] * x_BTP_fp32[:, j: j + T] * (1 if doc_BT is None else
                                                            (doc_BT[:, j: j + T] == document_ids_BT)[..., None])
                    for j in range(W))
    else:
        y_BTP = F.conv1d(x_BTP_fp32.transpose(1, 2), w_PW[:, None], groups=w_PW.shape[0]).transpose(1, 2)
    return F.silu(y_BTP).to(x_BTP.dtype), full_BTP[:, full_BTP.shape[1] - (W - 1):]


class KimiDeltaAttention(KeepFP32):
    """One KDA layer (module `self_attn` of a KDA decoder layer); parameter names are the checkpoint's."""


    def __init__(self, config: K3Config):
        super().__init__()
        self.config = config
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

        With a cache, the conv windows and the recurrent state continue from it and are updated in place; a
        one-token call uses the recurrent form, longer calls the chunked one (§3.7). With
        `ctx.document_ids_BT` (packed rows) the conv window and the state restart at every document. Padding tokens
        (`ctx.valid_BT` false) enter neither the conv windows (their inputs are zeroed, like the zero context
        of a fresh sequence) nor the state (identity steps: k = 0, g = 0, β = 0; §3.8).
        """
        B, T, _ = x_BTD.shape
        H, K = self.num_heads, self.head_dim
        ctx = ctx or StepContext()
        fla = use_fla(self.config.kda_impl, x_BTD.device)
        if (T == 1 and cache is not None and ctx.valid_BT is None and not fla
                and decode.serves(B, x_BTD, cache.conv_state_B3WP, cache.recurrent_state_BHKV, self.A_log,
                                  self.dt_bias, self.o_norm.weight, self.q_conv1d.weight, self.k_conv1d.weight,
                                  self.v_conv1d.weight)):
            return self.o_proj(self.fused_step(x_BTD, cache))
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
        run = partial(self.delta_rule, fla=fla, documents=documents, one_step=T == 1 and cache is not None)
        o_BTHK, state = ctx.sequence.delta_rule(run, q_BTHK, k_BTHK, v_BTHK, g_BTHK, beta_BTH, state, cache is not None)
        if cache is not None:
            cache.recurrent_state_BHKV = state
        z_BTHK = self.output_gate(x_BTD).view(B, T, H, K)
        # gated norm, entirely fp32: RMSNorm_{o_norm}(o) ⊙ σ(z)
        o_BTHK = rms_normalize(o_BTHK, self.o_norm.eps) * self.o_norm.weight * torch.sigmoid(fp32(z_BTHK))
        return self.o_proj(o_BTHK.to(x_BTD.dtype).reshape(B, T, H * K))

    def delta_rule(self, q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, initial_state_BHKV, output_final_state, fla,
                   documents, one_step):
        """The KDA core (§3.4–§3.8) from `initial_state`: fla's kernels on the GPU (§3.11); packed rows with a reset
        at every document (the row's first document continues from `initial_state` when given); the recurrent form
        for a one-token step or `kda_impl = "recurrent"`, else the chunked one. Returns (o, final state or None)."""
        state = dict(initial_state=initial_state_BHKV, output_final_state=output_final_state)
        recurrent = self.config.kda_impl == "recurrent"
        if fla:
            return fla_kda(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, **state, document_ids=documents)
        if documents is not None and recurrent:  # the reference: every document a row of its own, from zero
            if initial_state_BHKV is not None:
                raise ValueError("packed rows continuing a state (context parallelism) need kda_impl 'chunk'")
            return kda_by_document(recurrent_kda, q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, documents), None
        if documents is not None:
            out = chunk_kda_by_document(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, documents,
                                        chunk_size=self.config.kda_chunk_size, **state)
            return out if output_final_state else (out, None)
        if recurrent or one_step:
            return recurrent_kda(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, **state)
        return chunk_kda(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, **state, chunk_size=self.config.kda_chunk_size)

    def fused_step(self, x_BTD: torch.Tensor, cache: KDACache) -> torch.Tensor:
        """A one-token step (T = 1) with a cache as one compiled call after the projections
        (`k3.ops.decode.kda_step`, the same steps as `forward`); returns the `o_proj` input [B, 1, H·K]."""
        cache.recurrent_state_BHKV = cache.recurrent_state_BHKV.contiguous()  # updated in place
        full_rank = self.config.use_full_rank_gate
        q, k, v, f_a, b, g = project(x_BTD, self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, self.b_proj,
                                     self.g_proj if full_rank else self.g_a_proj)  # one pass over their weights
        convs = (self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight)
        o_BP = decode.kda_step(q, k, v, cache.conv_state_B3WP, convs, self.f_b_proj(f_a), self.A_log, self.dt_bias,
                               self.config.gate_lower_bound, b, cache.recurrent_state_BHKV,
                               g if full_rank else self.g_b_proj(g), self.o_norm.weight, self.o_norm.eps)
        return o_BP[:, None]
