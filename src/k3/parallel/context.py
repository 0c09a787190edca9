"""Context parallelism: each sequence split over the ranks of a group, rank r holding positions [r·T, (r+1)·T)
(docs/architecture.md, "Scale-out", "Context parallelism"). Applied from outside the model:
`apply_context_parallel` gives the backbone a `ContextParallel` as its `sequence` (`k3.model.sequence`), which
answers the three questions K3's mixers ask about other tokens with collectives over the group; everything else
(projections, Block AttnRes, the MoE, the head) is per token and needs nothing.

- Short convolution: the W−1 projected inputs before the shard are the previous rank's last W−1 (all-gathered
  tails; rank 0 starts from zeros).
- KDA: the state entering a shard is a function of every earlier shard, but an affine one. From a state S₀ the
  delta rule gives S_t = M_t S₀ + S_t⁰ and o_t = o_t⁰ + S₀ᵀ M_tᵀ q_t, where (o⁰, S⁰) is the run from zero and
  M_t = Π (I − β k kᵀ) Diag(α) the product of the transitions. One call of the ordinary KDA core with the values
  widened to [v ‖ 0] and the initial state [0 ‖ I] yields both at once: o⁰ and q̃ = Mᵀ q (the output), S⁰_T and
  M_T (the final state). The ranks all-gather (S⁰_T, M_T), each folds the earlier ones, S ← M_j S + S⁰_j for
  j < r, and adds q̃ S to its output: exact, every shard computed at once, the KDA core's cost doubled in V.
- MLA: the latents [ĉ ‖ k_pe] (C + R numbers per token) are all-gathered and rank r attends over positions
  [0, (r+1)·T) with its own queries at the end (the causal mask of a prefill continuing a cache) — far fewer
  bytes than exchanging expanded keys and values (ring attention), H·(N + R + V) numbers per token.

The all-gathers are autograd functions (their backward sums every rank's gradient for each shard), so training's
losses and gradients are those of one process holding the whole sequence. Packed rows split too: a shard's first
document may continue the previous rank's last one (the conv window and the KDA state carry over only then; the
MLA keys keep their documents). Padding and caches are not split (a one-line error says so). Shape suffixes: the legend at the top of docs/architecture.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_gather_single_autograd
from torch import nn

from k3.model.cache import K3Cache, StepContext
from k3.model.k3 import K3Model
from k3.model.sequence import DeltaRule, ShortConv, WholeSequence
from k3.ops.loss import next_token_targets


class ContextParallel(WholeSequence):
    """This rank's share of every sequence: positions [rank·T, (rank+1)·T) of a sequence split over `group`.
    `continues_RB` (set per call by `place`): whether rank j's row b continues the document the previous rank's row
    ends with (always, without packed documents; never for rank 0)."""

    def __init__(self, group: dist.ProcessGroup, continues_RB: torch.Tensor | None = None):
        self.group, self.continues_RB = group, continues_RB
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    def place(self, ctx: StepContext, cache: K3Cache | None, T: int) -> StepContext:
        if cache is not None or ctx.valid_BT is not None:
            raise ValueError("context parallelism splits whole unpadded sequences: no cache or attention_mask")
        documents_BT = ctx.document_ids_BT
        if documents_BT is None:
            continues_RB = torch.ones(self.size, 1, dtype=torch.bool)
        else:  # every rank's first and last document ids: rank j continues when its first is rank j−1's last
            B = documents_BT.shape[0]
            ends_NB2 = torch.empty(self.size * B, 2, dtype=torch.long, device=documents_BT.device)  # N = R·B
            dist.all_gather_into_tensor(ends_NB2, documents_BT[:, [0, -1]].long().contiguous(), group=self.group)
            ends_RB2 = ends_NB2.view(self.size, B, 2)
            continues_RB = torch.ones(self.size, documents_BT.shape[0], dtype=torch.bool)
            continues_RB[1:] = (ends_RB2[1:, :, 0] == ends_RB2[:-1, :, 1]).cpu()
        continues_RB[0] = False
        ctx.sequence = ContextParallel(self.group, continues_RB.to(documents_BT.device if documents_BT is not None
                                                                   else "cpu"))
        ctx.start = self.rank * T  # the shard's positions (K2's RoPE rotates by them)
        return ctx

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x stacked [size, ...], differentiable (backward: each rank's x gets the sum of the ranks'
        gradients for it). Each rank uses the whole result, zero weights where it needs no part, so the ranks' graphs
        match and their backward runs the same collectives in the same order."""
        return all_gather_single_autograd(x.contiguous()[None], 0, self.group)

    def short_conv(self, run: ShortConv, x_BTP: torch.Tensor, context_BWP: torch.Tensor | None,
                   document_ids_BT: torch.Tensor | None) -> tuple[torch.Tensor, None]:
        """The window reaches the previous rank's last W−1 inputs (rank 0, or a row starting a new document: zeros)."""
        (B, T, _), taps = x_BTP.shape, run.keywords["weight_P1W"].shape[-1] - 1
        if T < taps:
            raise ValueError(f"context parallelism needs at least {taps} tokens per rank, got {T}")
        tails_RBWP = self._gather(x_BTP[:, T - taps:])
        before_BWP = torch.cat([torch.zeros_like(tails_RBWP[:1]), tails_RBWP[:-1]])[self.rank]
        if document_ids_BT is None:
            return run(x_BTP, context_BWP=before_BWP, document_ids_BT=None)[0], None
        # packed rows: the window over [before ‖ x], `before` in the first document where the row continues it
        first_B1 = document_ids_BT[:, :1]
        before_B1 = torch.where(self.continues_RB[self.rank][:, None], first_B1, first_B1 - 1)
        y_BSP, _ = run(torch.cat([before_BWP, x_BTP], dim=1), context_BWP=None,
                       document_ids_BT=torch.cat([before_B1.expand(B, taps), document_ids_BT], dim=1))
        return y_BSP[:, taps:], None

    def delta_rule(self, run: DeltaRule, q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, state_BHKV,
                   output_final_state: bool) -> tuple[torch.Tensor, None]:
        B, T, H, K = k_BTHK.shape
        V = v_BTHV.shape[-1]
        widened_BTHX = torch.cat([v_BTHV, v_BTHV.new_zeros(B, T, H, K)], dim=-1)  # [v ‖ 0]
        eye_BHKK = torch.eye(K, dtype=torch.float32, device=k_BTHK.device).expand(B, H, K, K)
        start_BHKX = torch.cat([eye_BHKK.new_zeros(B, H, K, V), eye_BHKK], dim=-1)  # [0 ‖ I]
        o_BTHX, final_BHKX = run(q_BTHK, k_BTHK, widened_BTHX, g_BTHK, beta_BTH, start_BHKX, True)
        o_BTHV, q_tilde_BTHK = o_BTHX.split([V, K], dim=-1)  # o⁰, Mᵀq (0 after a document start)
        S_zero_BHKV, M_BHKK = final_BHKX.split([V, K], dim=-1)
        S_zero_RBHKV, M_RBHKK = self._gather(S_zero_BHKV), self._gather(M_BHKK)
        keep_RB11 = self.continues_RB.to(S_zero_BHKV.dtype)[..., None, None, None].expand(self.size, B, 1, 1, 1)
        entering = [torch.zeros_like(S_zero_BHKV)]  # the state entering shard j: S ← M_j (c_j S) + S⁰_j
        for j in range(self.size - 1):
            entering.append(M_RBHKK[j] @ (keep_RB11[j] * entering[-1]) + S_zero_RBHKV[j])
        S_in_BHKV = keep_RB11[self.rank] * torch.stack(entering)[self.rank]
        o_BTHV = o_BTHV + torch.einsum("bthk,bhkv->bthv", q_tilde_BTHK.to(S_in_BHKV.dtype), S_in_BHKV).to(o_BTHV.dtype)
        return o_BTHV, None

    def keys(self, latent_BTL: torch.Tensor, document_ids_BT: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        R, B, T, L = (gathered := self._gather(latent_BTL)).shape
        S = (self.rank + 1) * T
        latent_BSL = gathered.transpose(0, 1).reshape(B, R * T, L)[:, :S]
        if document_ids_BT is None:
            return latent_BSL, None
        documents_NT = torch.empty(R * B, T, dtype=torch.long, device=document_ids_BT.device)  # N = R·B
        dist.all_gather_into_tensor(documents_NT, document_ids_BT.long().contiguous(), group=self.group)
        return latent_BSL, documents_NT.view(R, B, T).transpose(0, 1).reshape(B, R * T)[:, :S].contiguous()


def apply_context_parallel(model: nn.Module, group: dist.ProcessGroup) -> nn.Module:
    """Split every sequence `model` (a `K3ForCausalLM` or `K3ForConditionalGeneration`) sees over `group`; in
    place, returns it. Each rank then feeds its own share (`shard_batch`)."""
    (backbone,) = [m for m in model.modules() if isinstance(m, K3Model)]
    backbone.sequence = ContextParallel(group)
    return model


@contextlib.contextmanager
def whole_sequences(model: nn.Module) -> Iterator[nn.Module]:
    """`model` takes whole sequences inside (every rank the same ones: evaluation, plots), its split restored after;
    nothing changes for a model that is not split."""
    (backbone,) = [m for m in model.modules() if isinstance(m, K3Model)]
    split, backbone.sequence = backbone.sequence, WholeSequence()
    try:
        yield model
    finally:
        backbone.sequence = split


def shard_batch(batch: dict[str, torch.Tensor], rank: int, size: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s share of a batch of whole rows [B, T]: positions [rank·T/size, (rank+1)·T/size) of
    `input_ids` (and `document_ids`, packed rows), and `targets`, the next-token targets of `next_token_loss`
    (from `labels`, or the ids where there are none, computed on the whole rows: a shard's last position is scored on
    the next shard's first token), so the shards' summed losses are the whole rows'."""
    ids_BT = batch["input_ids"]
    T = ids_BT.shape[1]
    if T % size:
        raise ValueError(f"a sequence of {T} tokens does not split evenly over {size} context-parallel ranks")
    documents_BT = batch.get("document_ids")
    targets_BT = next_token_targets(batch.get("labels", ids_BT), documents_BT)
    share = slice(rank * (T // size), (rank + 1) * (T // size))
    shard = {"input_ids": ids_BT[:, share], "targets": targets_BT[:, share]}
    for key in ("labels", "document_ids"):  # the labels: which positions the router's balancing counts
        if key in batch:
            shard[key] = batch[key][:, share]
    return shard
