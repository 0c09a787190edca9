"""QK-Clip for the gated MLA layers (§8.6) and a reference per-head max-logit computation.

Shape suffixes (`x_BTD`): the package-wide legend at the top of docs/architecture.md.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from k3.model.mla import GatedMLA
from k3.ops.attention import attention_mask
from k3.model.observer import ForwardObserver
from k3.ops.precision import fp32

if dist.is_available():
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
else:  # a torch build without distributed support: no weight can be a DTensor
    DTensor = ()

_MLA_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn$")


def mla_layers(model: nn.Module) -> dict[int, GatedMLA]:
    """The MLA sequence mixers of a `K3ForCausalLM` / `K3Model`, by 0-based decoder layer index."""
    layers = {}
    for name, module in model.named_modules():
        match = _MLA_RE.search(name)
        if match is not None and isinstance(module, GatedMLA):
            layers[int(match.group(1))] = module
    return layers


@torch.no_grad()
def qk_clip_(model_or_mla_layers: nn.Module | Mapping[int, GatedMLA], max_logits: Mapping[int, torch.Tensor],
             tau: float = 100.0) -> dict[int, torch.Tensor]:
    """Rescale the MLA query/key weights of every head whose max logit exceeded τ, in place (§8.6).

    `max_logits[i]` [H] is S_max of MLA layer i for this step: the largest pre-softmax logit (already scaled by
    1/sqrt(N + R)) over all valid causal pairs of all micro-batches, all-reduced (MAX) across data-parallel
    ranks. Layers absent from `max_logits` are left alone. For heads with S_max > τ, γ = τ / S_max and

        q_b_proj rows of head h: q_nope part × sqrt(γ), q_pe part × γ;
        kv_b_proj rows of head h: k_nope part × sqrt(γ); the v part is untouched;

    so every logit of head h scales by exactly γ while the head-shared k_pe (in `kv_a_proj_with_mqa`) and
    `q_a_proj` stay unchanged. Other heads' weights are multiplied by exactly 1 (bit-identical). Returns γ [H]
    (fp32, 1 where not clipped) for each layer in `max_logits`.

    Sharded weights (DTensors, e.g. FSDP2 Shard(0) with row chunks that cut through heads) are rescaled on each
    rank's own rows with the factor of each row's global index (head, and q_nope/q_pe or k_nope/v part): the same
    result as one process, with no communication here; every rank must pass the same (all-reduced) max logits.
    """
    layers = model_or_mla_layers if isinstance(model_or_mla_layers, Mapping) else mla_layers(model_or_mla_layers)
    gammas = {}
    for i, S_max_H in max_logits.items():
        if i not in layers:
            raise KeyError(f"max_logits has layer {i}, which is not an MLA layer (MLA layers: {sorted(layers)})")
        mla = layers[i]
        cfg = mla.config
        N = cfg.qk_nope_head_dim
        S_max_H = S_max_H.detach().float().to(mla.q_b_proj.weight.device)
        gamma_H = torch.where(S_max_H > tau, tau / S_max_H, torch.ones_like(S_max_H))
        # one factor per weight row: head h's rows are [q_nope (N) | q_pe (R)] and [k_nope (N) | v (Vh)]
        sqrt_gamma_H1, gamma_H1 = gamma_H.sqrt()[:, None], gamma_H[:, None]
        q_factor_R = torch.cat([sqrt_gamma_H1.expand(-1, N), gamma_H1.expand(-1, cfg.qk_rope_head_dim)], 1)
        kv_factor_R = torch.cat([sqrt_gamma_H1.expand(-1, N), torch.ones_like(gamma_H1).expand(-1, cfg.v_head_dim)],
                                1)
        _scale_rows_(mla.q_b_proj.weight, q_factor_R.flatten())
        _scale_rows_(mla.kv_b_proj.weight, kv_factor_R.flatten())
        gammas[i] = gamma_H
    return gammas


def _scale_rows_(W_RX: torch.Tensor, factor_R: torch.Tensor) -> None:
    """W[r] ← W[r]·factor[r] in place for every row r of W [rows, columns], computed in at least fp32 and rounded
    once to W's dtype. A DTensor W (FSDP2 Shard(0) rows that may cut through heads, uneven or not) is scaled on
    this rank's rows only: the factor column [rows, 1] is sliced like W's rows (`distribute_tensor` with
    `src_data_rank=None` takes the local slice from W's placements, no communication)."""
    if factor_R.shape != W_RX.shape[:1]:
        raise ValueError(f"{factor_R.shape[0]} row factors for a weight of shape {tuple(W_RX.shape)}")
    factor_R1 = factor_R.to(torch.promote_types(W_RX.dtype, torch.float32))[:, None]
    if isinstance(W_RX, DTensor):
        if W_RX.device_mesh.get_coordinate() is None:
            return  # this rank holds no part of W
        if any(p.is_partial() for p in W_RX.placements):
            raise ValueError(f"QK-Clip cannot rescale a weight with a Partial placement ({W_RX.placements})")
        # shards of the row axis carry over to the factor column; shards of the columns leave all rows local
        rows_only = [p if not p.is_replicate() and p.dim % W_RX.ndim == 0 else Replicate() for p in W_RX.placements]
        factor_R1 = distribute_tensor(factor_R1, W_RX.device_mesh, rows_only, src_data_rank=None).to_local()
        W_RX = W_RX.to_local()  # no_grad: the parameter's own storage
    W_RX.copy_(fp32(W_RX) * factor_R1)


@torch.no_grad()  # a statistic of the step: no autograd graph for the recomputed projections and scores
def mla_max_logits(mla: GatedMLA, x_BTD: torch.Tensor, document_ids_BT: torch.Tensor | None = None) -> torch.Tensor:
    """Per-head max pre-softmax logit [H] (fp32) of one MLA layer on its input x (§8.6 step 1).

    x is the layer's `input_layernorm` output [B, T, D]. Logits are [q_nope ‖ q_pe]·[k_nope ‖ k_pe] / sqrt(N + R)
    over causal pairs (key ≤ query), within a document when `document_ids_BT` (packed rows) is given; the max
    runs over batch, queries and keys. Recomputes the scores from the module's own projections, so it costs one
    extra QKᵀ per layer: one row at a time, every head's [T, T] scores in one product that adds −inf to the
    pairs left out (the scores of a row stay in cache; no mask pass).
    """
    cfg = mla.config
    B, T, _ = x_BTD.shape
    H, N, R = mla.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    q_nope_BTHK, q_pe_BTHR = mla.project_query(x_BTD)
    c_BTc, k_pe_BTR = mla.compress_kv(x_BTD).split([cfg.kv_lora_rank, R], dim=-1)
    k_nope_BTHK = mla.kv_b_proj(c_BTc).view(B, T, H, -1)[..., :N]
    q_BHTQ = (fp32(torch.cat([q_nope_BTHK, q_pe_BTHR], dim=-1)) * mla.scale).transpose(1, 2).contiguous()
    k_BTHQ = torch.cat([k_nope_BTHK, k_pe_BTR[:, :, None].expand(B, T, H, R)], dim=-1)
    k_BHQT = fp32(k_BTHQ).permute(0, 2, 3, 1).contiguous()
    mask_B1TT = attention_mask(T, 0, None, x_BTD.device, document_ids_BT)  # None: plain causal
    valid_BTT = torch.ones(T, T, dtype=torch.bool, device=x_BTD.device).tril()[None] if mask_B1TT is None \
        else mask_B1TT[:, 0]
    left_out_BTT = torch.zeros(valid_BTT.shape, device=x_BTD.device).masked_fill_(~valid_BTT, float("-inf"))
    max_H = torch.full((H,), float("-inf"), device=x_BTD.device)
    for b in range(B):  # −inf + s = −inf: the pairs left out never win
        scores_HTT = torch.baddbmm(left_out_BTT[b % left_out_BTT.shape[0]].expand(H, T, T), q_BHTQ[b], k_BHQT[b])
        max_H = torch.maximum(max_H, scores_HTT.view(H, -1).amax(dim=-1))
    return max_H


class MaxLogitRecorder(ForwardObserver):
    """Collects, from the training forwards of a step, the per-head max logit of every MLA layer of `model`
    (§8.6 step 1; attach with `K3Model.add_observer`). `pop()` returns {layer: [H]} and starts afresh."""

    def __init__(self, model: nn.Module):
        self._layer_of = {id(mla): i for i, mla in mla_layers(model).items()}
        self._max_logits: dict[int, torch.Tensor] = {}

    def on_attention(self, mla: nn.Module, x_BTD: torch.Tensor, document_ids_BT: torch.Tensor | None) -> None:
        i = self._layer_of.get(id(mla))
        if i is None:
            return
        m_H = mla_max_logits(mla, x_BTD, document_ids_BT)
        old = self._max_logits.get(i)
        self._max_logits[i] = m_H if old is None else torch.maximum(old, m_H)

    def pop(self) -> dict[int, torch.Tensor]:
        out, self._max_logits = self._max_logits, {}
        return out
