"""QK-Clip for the gated MLA layers (§8.6) and a reference per-head max-logit computation.

Shape suffixes (`x_BTD`): the package-wide legend at the top of docs/architecture.md.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from k3.model.mla import GatedMLA
from k3.model.observer import ForwardObserver
from k3.ops.attention.blocked import block_mask
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
def mla_max_logits(mla: GatedMLA, x_BTD: torch.Tensor, document_ids_BS: torch.Tensor | None = None,
                   latent_BSL: torch.Tensor | None = None, block: int = 1024) -> torch.Tensor:
    """Per-head max pre-softmax logit [H] (fp32) of one MLA layer on its input x (§8.6 step 1).

    x is the layer's `input_layernorm` output [B, T, D]: the queries, at positions S − T.. of the keys. The keys are
    the latents [ĉ ‖ k_pe] the layer attends over, `latent_BSL` [B, S, C + R] (a context-parallel shard: every
    earlier shard's too); None: x's own (S = T). Logits are [q_nope ‖ q_pe]·[k_nope ‖ k_pe] / sqrt(N + R) over
    causal pairs (key ≤ query), within a document when `document_ids_BS` (the keys' documents, packed rows) is
    given; the max runs over batch, queries and keys. Recomputes the scores from the module's own projections,
    one extra QKᵀ per layer, `block` keys (expanded once) against `block` queries at a time: [H, block, block]
    scores at any length.
    """
    cfg = mla.config
    B, T, _ = x_BTD.shape
    H, N, C = mla.num_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
    latent_BSL = mla.compress_kv(x_BTD) if latent_BSL is None else latent_BSL
    S = latent_BSL.shape[1]
    first = S - T  # the first query's position
    q_BHTQ = (fp32(torch.cat(mla.project_query(x_BTD, first), dim=-1)) * mla.scale).transpose(1, 2)
    max_H = torch.full((H,), float("-inf"), dtype=q_BHTQ.dtype, device=x_BTD.device)
    for b, s0 in itertools.product(range(B), range(0, S, block)):  # key block [s0, s1), query block [t0, t1)
        s1 = min(s0 + block, S)
        c_sc, k_pe_sR = latent_BSL[b, s0:s1].split([C, cfg.qk_rope_head_dim], dim=-1)
        k_nope_sHK = mla.kv_b_proj(c_sc).view(s1 - s0, H, -1)[..., :N]
        k_HQs = fp32(torch.cat([k_nope_sHK, k_pe_sR[:, None].expand(-1, H, -1)], dim=-1)).permute(1, 2, 0)
        for t0 in range(0, T, block):
            t1 = min(t0 + block, T)
            if first + t1 <= s0:  # queries before every key of the block
                continue
            scores_Hts = q_BHTQ[b, :, t0:t1] @ k_HQs
            seen_B1ts = block_mask(t0, t1, s0, s1, first, None, document_ids_BS, x_BTD.device)  # None: all
            if seen_B1ts is not None:
                scores_Hts = scores_Hts.masked_fill(~seen_B1ts[b % seen_B1ts.shape[0], 0], float("-inf"))
            max_H = torch.maximum(max_H, scores_Hts.amax(dim=(1, 2)))
    return max_H


class MaxLogitRecorder(ForwardObserver):
    """Collects, from the training forwards of a step, the per-head max logit of every MLA layer of `model`
    (§8.6 step 1; attach with `K3Model.add_observer`). `pop()` returns {layer: [H]} and starts afresh."""

    def __init__(self, model: nn.Module):
        self._layer_of = {id(mla): i for i, mla in mla_layers(model).items()}
        self._max_logits: dict[int, torch.Tensor] = {}

    def on_attention(self, mla: nn.Module, x_BTD: torch.Tensor, latent_BSL: torch.Tensor,
                     document_ids_BS: torch.Tensor | None) -> None:
        i = self._layer_of.get(id(mla))
        if i is None:
            return
        m_H = mla_max_logits(mla, x_BTD, document_ids_BS, latent_BSL)
        old = self._max_logits.get(i)
        self._max_logits[i] = m_H if old is None else torch.maximum(old, m_H)

    def pop(self) -> dict[int, torch.Tensor]:
        out, self._max_logits = self._max_logits, {}
        return out
