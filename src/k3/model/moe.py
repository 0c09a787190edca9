"""Stable LatentMoE: router, routed experts in the latent space, shared experts (§6.3–§6.7).

Shape suffixes (`x_BTD`): the package-wide legend at the top of docs/architecture.md.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from k3.checkpoint.quantization import experts_format
from k3.config import K3Config
from k3.model.cache import StepContext
from k3.model.ffn import SiTUMLP, glu_activation
from k3.ops.experts import dense_expert, expert_ffn, expert_weight
from k3.ops.matvec import Linear
from k3.ops.norm import RMSNorm
from k3.ops.precision import KeepFP32, fp32, without_autocast


class MoEGate(KeepFP32):
    """Sigmoid router on the full-width input (module `gate`, §6.3).

    `e_score_correction_bias` (fp32 buffer, written only by load balancing) is added to the sigmoid scores for
    expert *selection*; the weights come from the unbiased scores, renormalised, times `routed_scaling_factor`.

    Every forward reports its routing to the call's training observers (`ForwardObserver.on_routing`: load
    balancing, §7.2), if any.
    """


    def __init__(self, config: K3Config):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts, dtype=torch.float32))

    def forward(self, x_ND: torch.Tensor, ctx: StepContext | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (top-k expert indices [N, k] int64, their fp32 weights [N, k])."""
        cfg = self.config
        x_ND = fp32(x_ND)
        with without_autocast(x_ND.device):  # fp32 scores under a caller's bf16 autocast too (§0.4)
            scores_NE = torch.sigmoid(x_ND @ self.weight.to(x_ND.dtype).t())
        choice_NE = scores_NE + self.e_score_correction_bias  # selection only
        if cfg.num_expert_group > 1 and cfg.topk_group < cfg.num_expert_group:
            choice_NE = self._limit_groups(choice_NE)
        idx_Nk = torch.topk(choice_NE, cfg.num_experts_per_token, dim=-1).indices
        for observer in () if ctx is None else ctx.observers:
            observer.on_routing(self, scores_NE.detach(), choice_NE.detach(), idx_Nk)
        w_Nk = scores_NE.gather(-1, idx_Nk)
        if cfg.moe_renormalize:
            w_Nk = w_Nk / (w_Nk.sum(-1, keepdim=True) + 1e-20)
        return idx_Nk, w_Nk * cfg.routed_scaling_factor

    def _limit_groups(self, choice_NE: torch.Tensor) -> torch.Tensor:
        """Group-limited routing (§6.3 step 4): keep the `topk_group` groups with the best top-2 sums."""
        cfg = self.config
        N = choice_NE.shape[0]
        grouped_NGe = choice_NE.view(N, cfg.num_expert_group, -1)
        group_score_NG = grouped_NGe.topk(min(2, grouped_NGe.shape[-1]), dim=-1).values.sum(-1)
        keep_NG = torch.zeros_like(group_score_NG, dtype=torch.bool)
        keep_NG.scatter_(1, group_score_NG.topk(cfg.topk_group, dim=-1).indices, True)
        return grouped_NGe.masked_fill(~keep_NG[..., None], float("-inf")).view(N, -1)


class RoutedExperts(nn.Module):
    """All routed experts of a layer, stacked (module `experts`).

    `w1` (gate) and `w3` (up) are [E, F, L], `w2` (down) is [E, L, F]: slice e is expert e's `[out, in]` weight
    (the checkpoint stores them one tensor per expert, §11.4). Their form follows the config's `quantization_config`:
    trainable dense parameters, or MXFP4 buffers kept as the release stores them (`k3.ops.experts`, §11.5).

    `impl`: "grouped" (every expert's rows in one grouped product, `k3.ops.experts.expert_ffn`) or "loop" (the
    reference: one expert at a time); a runtime choice, not part of the model's configuration.
    """

    def __init__(self, config: K3Config, impl: str = "grouped"):
        super().__init__()
        if impl not in ("grouped", "loop"):
            raise ValueError(f"routed experts impl must be 'grouped' or 'loop', got {impl!r}")
        self.config = config
        self.impl = impl
        E, L, M = config.num_experts, config.routed_expert_hidden_size, config.moe_intermediate_size
        packed = experts_format(config) == "mxfp4"
        self.w1 = expert_weight(E, M, L, packed)
        self.w3 = expert_weight(E, M, L, packed)
        self.w2 = expert_weight(E, L, M, packed)

    def forward(self, z_NL: torch.Tensor, idx_Nk: torch.Tensor, w_Nk: torch.Tensor) -> torch.Tensor:
        """r = Σ_{e ∈ top-k} w_e · E_e(z): expert outputs in the activation dtype, weighted sum in fp32, cast."""
        if self.impl == "loop":
            return self._forward_loop(z_NL, idx_Nk, w_Nk)
        return self._forward_grouped(z_NL, idx_Nk, w_Nk)

    def expert(self, e: int, z: torch.Tensor) -> torch.Tensor:
        """E_e(z) = W2_e · SiTU-GLU(W1_e z, W3_e z) for one expert e."""
        w1, w3, w2 = (dense_expert(w, e, z.dtype) for w in (self.w1, self.w3, self.w2))
        return glu_activation(self.config, z @ w1.transpose(-1, -2), z @ w3.transpose(-1, -2)) @ w2.transpose(-1, -2)

    def sorted_experts(self, z_AL: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """E_e(z) for rows sorted by expert, `counts_E[e]` rows for expert e (`k3.ops.experts.expert_ffn`: no
        padding, no copy of the weights in use, whatever their form)."""
        return expert_ffn(z_AL, counts_E, self.w1, self.w3, self.w2, functools.partial(glu_activation, self.config))

    def _forward_grouped(self, z_NL: torch.Tensor, idx_Nk: torch.Tensor, w_Nk: torch.Tensor) -> torch.Tensor:
        """The N·k (token, expert) assignments sorted by expert, then `sorted_experts`."""
        N, k = idx_Nk.shape
        expert_A = idx_Nk.flatten()  # A = N·k assignments
        order_A = torch.argsort(expert_A, stable=True)
        token_A = order_A // k
        # index_select: its backward is a scatter-add, not an accumulating index_put (4× faster on CPU, measured)
        y_AL = self.sorted_experts(z_NL.index_select(0, token_A),
                                   torch.bincount(expert_A, minlength=self.config.num_experts))
        return self._combine(y_AL, token_A, w_Nk.flatten()[order_A], N)

    def _forward_loop(self, z_NL: torch.Tensor, idx_Nk: torch.Tensor, w_Nk: torch.Tensor) -> torch.Tensor:
        """Reference: one expert at a time over the tokens that chose it (§6.7)."""
        token_parts, y_parts, w_parts = [], [], []
        for e in range(self.config.num_experts):
            token_A, slot_A = torch.nonzero(idx_Nk == e, as_tuple=True)
            if token_A.numel():
                token_parts.append(token_A)
                y_parts.append(self.expert(e, z_NL[token_A]))
                w_parts.append(w_Nk[token_A, slot_A])
        return self._combine(torch.cat(y_parts), torch.cat(token_parts), torch.cat(w_parts), z_NL.shape[0])

    @staticmethod
    def _combine(y_AL: torch.Tensor, token_A: torch.Tensor, weight_A: torch.Tensor, N: int) -> torch.Tensor:
        """Σ over each token's assignments of weight · expert output, accumulated in fp32 (§6.4 step 3)."""
        dtype = y_AL.dtype
        y_AL = fp32(y_AL)
        r_NL = y_AL.new_zeros(N, y_AL.shape[-1])
        r_NL.index_add_(0, token_A, y_AL * weight_A[:, None].to(y_AL.dtype))
        return r_NL.to(dtype)


class StableLatentMoE(nn.Module):
    """MoE(x) = up(RMSNorm(Σ_e w_e·E_e(down(x)))) + Shared(x) (module `block_sparse_moe`, §6.6).

    K2's form (`use_latent_moe = false`, `latent_moe_use_norm = false`, §14.4): Σ_e w_e·E_e(x) + Shared(x)."""

    def __init__(self, config: K3Config):
        super().__init__()
        self.config = config
        D, L = config.hidden_size, config.routed_expert_hidden_size
        self.gate = MoEGate(config)
        self.experts = RoutedExperts(config)
        if config.use_latent_moe:  # else K2's full-width experts (L = D, §14.4)
            self.routed_expert_down_proj = Linear(D, L)
            self.routed_expert_up_proj = Linear(L, D)
        if config.latent_moe_use_norm:
            self.routed_expert_norm = RMSNorm(L, eps=config.rms_norm_eps)
        if config.num_shared_experts:
            # the shared experts are stored merged as one MLP of width num_shared·M (§6.5)
            self.shared_experts = SiTUMLP(config, D, config.num_shared_experts * config.moe_intermediate_size)

    def forward(self, x_BTD: torch.Tensor, ctx: StepContext | None = None) -> torch.Tensor:
        """x is the `post_attention_layernorm` output [B, T, D]; `ctx` carries the call's training observers."""
        x_ND = x_BTD.reshape(-1, x_BTD.shape[-1])
        latent = self.config.use_latent_moe
        z_NL = self.routed_expert_down_proj(x_ND) if latent else x_ND
        idx_Nk, w_Nk = self.gate(x_ND, ctx)
        r_NL = self.experts(z_NL, idx_Nk, w_Nk)
        if self.config.latent_moe_use_norm:
            r_NL = self.routed_expert_norm(r_NL)
        y_ND = self.routed_expert_up_proj(r_NL) if latent else r_NL
        if self.config.num_shared_experts:
            y_ND = y_ND + self.shared_experts(x_ND)
        return y_ND.view_as(x_BTD)
