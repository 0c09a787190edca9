"""Expert parallelism for Stable LatentMoE, applied from outside the model (docs/architecture.md §6.4, §6.7).

`apply_expert_parallel(model, ep_mesh)` takes an unmodified model (a `K3ForCausalLM`, or any module tree holding
`StableLatentMoE` layers) and a 1-D `DeviceMesh` of `ep` ranks (a whole mesh, or one dimension of a larger one:
`mesh["ep"]`). The ranks are data-parallel ("dp2ep"): each routes its own tokens. Afterwards, in every MoE layer:

* the stacked expert weights `experts.w1`, `w3` [E, F, L] and `w2` [E, L, F] are DTensors `Shard(0)` on
  `ep_mesh`: `to_local()` is the rank's contiguous block of `E / ep` whole experts (rank r owns experts
  r·E/ep … (r+1)·E/ep − 1). Parameter and state-dict names are unchanged, so DCP and FSDP2 (`fully_shard` with
  these parameters in `ignored_params`, or on an orthogonal mesh) compose with it;
* `experts` (the module instance is kept; its class becomes `ExpertParallelRoutedExperts`, a `RoutedExperts`
  subclass) dispatches instead of computing every expert locally. The router, the gate weights w_Nk, the down /
  up projections, the latent norm and the shared experts never leave the source rank; only the latent tokens
  z [N, L] (after `routed_expert_down_proj`: L = `routed_expert_hidden_size`, half the full width in K3) and the
  expert outputs travel.

Dispatch, per layer and forward (every rank of `ep_mesh` must run it: it is a collective):

1. the rank's N·k (token, expert) assignments are sorted by expert — hence by owner rank, then by local expert;
2. the per-expert counts [E] go through a no-grad `all_to_all_single` (E/ep counts to each rank), so each rank
   learns how many rows every peer sends to each of its experts; one host sync turns them into split sizes;
3. the latent rows travel with an autograd-aware uneven all-to-all
   (`torch.distributed._functional_collectives.all_to_all_single_autograd`; its backward is the reverse
   all-to-all, so gradients of z go home and the expert weight gradients stay with the owner);
4. the owner groups the received rows by local expert and evaluates them with the model's own expert math
   (`RoutedExperts.sorted_experts` / `expert`: SiTU-GLU via `k3.model.ffn.glu_activation`), honouring the module's
   `impl` ("grouped": one grouped matmul per weight, "loop": one expert at a time);
5. the outputs return along the reverse all-to-all, and the source rank forms Σ w·E_e(z) with
   `RoutedExperts._combine` (weights applied after `w2`, accumulated in fp32, cast back) — so the result equals
   the single-process layer up to the fp32 summation order.

Traffic: each layer records the bytes of its last forward (`ExpertParallelRoutedExperts.ep_bytes`) and a running
total since `reset_expert_parallel_bytes`; `expert_parallel_bytes(model)` sums them over layers into an
`AllToAllBytes`. Only rows crossing to another rank count (the rank's own block is a local copy). Backward moves
exactly the forward's amounts in the opposite directions (`AllToAllBytes.backward`), plus the forward again under
activation checkpointing. `full_width` is what the same routing would move if the experts ran at `hidden_size`.

Parameter gradients: expert gradients are DTensors on `ep_mesh` holding the full gradient of the owned experts
(contributions of every rank's tokens), so with the loss of each rank normalised by the global token count they
need no further reduction over `ep_mesh` (only over mesh dimensions that replicate the experts). Every other
gradient is a per-rank partial, to be summed over the data-parallel ranks (FSDP2 or an all-reduce).

Device-agnostic: all tensors stay on the activations' device (gloo on CPU, NCCL on CUDA). Apply it before
building the optimiser (the expert parameters are new objects) and before `fully_shard`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from k3.model.moe import RoutedExperts, StableLatentMoE

EXPERT_WEIGHTS = ("w1", "w3", "w2")


@dataclass(frozen=True)
class AllToAllBytes:
    """One rank's expert-parallel all-to-all traffic (bytes) of the forward passes it covers.

    Only rows exchanged with *other* ranks count. `dispatch_*` carry latent tokens, `combine_*` expert outputs;
    `assignments_sent` (own (token, expert) pairs whose expert lives on another rank) and `assignments_received`
    (peers' pairs routed to this rank's experts) are the row counts behind them, `splits` the no-grad exchange of
    per-expert counts (sent + received) and `full_width` what dispatch + combine (sent + received) would move at
    `hidden_size` instead of `routed_expert_hidden_size`."""

    dispatch_sent: int = 0
    dispatch_received: int = 0
    combine_sent: int = 0
    combine_received: int = 0
    splits: int = 0
    full_width: int = 0
    assignments_sent: int = 0
    assignments_received: int = 0
    forwards: int = 0  # MoE-layer forwards summed in

    @property
    def sent(self) -> int:
        return self.dispatch_sent + self.combine_sent

    @property
    def received(self) -> int:
        return self.dispatch_received + self.combine_received

    @property
    def forward(self) -> int:
        """Latent bytes sent + received by the token all-to-alls of the forward."""
        return self.sent + self.received

    @property
    def backward(self) -> int:
        """The backward all-to-alls move the same rows in the opposite directions: the same bytes."""
        return self.forward

    def __add__(self, other: AllToAllBytes) -> AllToAllBytes:
        return AllToAllBytes(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})


class ExpertParallelRoutedExperts(RoutedExperts):
    """`RoutedExperts` whose w1/w2/w3 are `Shard(0)` DTensors on `ep_mesh` and whose forward dispatches the latent
    tokens to the experts' owners (installed by `apply_expert_parallel`; see the module docstring)."""

    ep_mesh: DeviceMesh
    ep_bytes: AllToAllBytes  # the last forward
    ep_bytes_total: AllToAllBytes  # since `reset_expert_parallel_bytes`

    @property
    def ep_size(self) -> int:
        return self.ep_mesh.size()

    @property
    def ep_rank(self) -> int:
        return self.ep_mesh.get_local_rank()

    @property
    def num_local_experts(self) -> int:
        return self.config.num_experts // self.ep_size

    @property
    def local_expert_range(self) -> range:
        """The global indices of the experts this rank owns."""
        first = self.ep_rank * self.num_local_experts
        return range(first, first + self.num_local_experts)

    def _local_weights(self) -> SimpleNamespace:
        """The owned experts as plain [E/ep, ...] tensors (autograd flows back into the DTensor parameters)."""
        return SimpleNamespace(config=self.config, **{n: getattr(self, n).to_local() for n in EXPERT_WEIGHTS})

    def expert(self, e: int, z: torch.Tensor) -> torch.Tensor:
        """E_e(z) for an expert `e` (global index) owned by this rank."""
        local = e - self.local_expert_range.start
        if not 0 <= local < self.num_local_experts:
            raise ValueError(f"expert {e} is not on EP rank {self.ep_rank} (it owns {self.local_expert_range})")
        return RoutedExperts.expert(self._local_weights(), local, z)

    def forward(self, z_NL: torch.Tensor, idx_Nk: torch.Tensor, w_Nk: torch.Tensor) -> torch.Tensor:
        N, k = idx_Nk.shape
        W, El, L = self.ep_size, self.num_local_experts, z_NL.shape[-1]
        group, device = self.ep_mesh.get_group(), z_NL.device

        # 1. sort the assignments by expert: contiguous per owner rank, then per local expert
        expert_A = idx_Nk.flatten()
        order_A = torch.argsort(expert_A, stable=True)
        token_A, weight_A = order_A // k, w_Nk.flatten()[order_A]

        # 2. per-expert counts → split sizes (sent to rank j / received from rank j) and rows per local expert
        send_counts = torch.bincount(expert_A, minlength=self.config.num_experts)
        recv_counts = torch.empty_like(send_counts)
        with torch.no_grad():
            dist.all_to_all_single(recv_counts, send_counts, group=group)
        recv_WE = recv_counts.view(W, El)  # [source rank, local expert]
        sizes = torch.cat([send_counts.view(W, El).sum(1), recv_WE.sum(1), recv_WE.sum(0)]).tolist()  # host sync
        input_splits, output_splits, per_expert = sizes[:W], sizes[W:2 * W], sizes[2 * W:]

        # 3. dispatch the latent rows to their experts' owners
        z_RL = all_to_all_single_autograd(z_NL[token_A], output_splits, input_splits, group)

        # 4. local experts on the received rows (source-rank-major, local-expert-minor order)
        local_R = torch.repeat_interleave(torch.arange(El, device=device).repeat(W), recv_counts)
        y_RL = self._run_local_experts(z_RL, local_R, per_expert)

        # 5. outputs home (the reverse all-to-all) and the fp32 weighted combine on the source rank
        y_AL = all_to_all_single_autograd(y_RL, input_splits, output_splits, group)
        self._record(input_splits, output_splits, z_NL.element_size(), y_RL.element_size(), L)
        return self._combine(y_AL, token_A, weight_A, N)

    def _run_local_experts(self, z_RL: torch.Tensor, local_R: torch.Tensor, per_expert: list[int]) -> torch.Tensor:
        """E_{local_R[i]}(z_RL[i]) for every received row, in the received order."""
        weights = self._local_weights()
        active = [i for i, c in enumerate(per_expert) if c]
        if not active:
            # nothing received: still an autograd path from z and the weights, so that this rank takes part in
            # the backward all-to-all like its peers (and its expert gradients are zeros, not None)
            return RoutedExperts.expert(weights, 0, z_RL)
        if self.impl == "loop":
            rows, outs = [], []
            for i in active:
                rows_i = torch.nonzero(local_R == i).flatten()
                rows.append(rows_i)
                outs.append(RoutedExperts.expert(weights, i, z_RL[rows_i]))
            inverse = torch.empty_like(local_R)
            order = torch.cat(rows)
            inverse[order] = torch.arange(order.numel(), device=order.device)
            return torch.cat(outs)[inverse]
        # grouped: the received rows sorted by local expert, one grouped matmul per weight, then unsorted
        order_R = torch.argsort(local_R, stable=True)
        counts = torch.tensor(per_expert, device=z_RL.device)
        y_sorted = RoutedExperts.sorted_experts(weights, z_RL[order_R], counts)
        return torch.empty_like(y_sorted).index_copy(0, order_R, y_sorted)

    def _record(self, input_splits: list[int], output_splits: list[int], z_size: int, y_size: int,
                width: int) -> None:
        """The last forward's traffic: rows exchanged with other ranks (the own block is a local copy)."""
        r = self.ep_rank
        out_rows = sum(input_splits) - input_splits[r]
        in_rows = sum(output_splits) - output_splits[r]
        D = self.config.hidden_size
        self.ep_bytes = AllToAllBytes(
            dispatch_sent=out_rows * width * z_size, dispatch_received=in_rows * width * z_size,
            combine_sent=in_rows * width * y_size, combine_received=out_rows * width * y_size,
            splits=2 * (self.ep_size - 1) * self.num_local_experts * 8,  # int64 counts
            full_width=(out_rows + in_rows) * D * (z_size + y_size),
            assignments_sent=out_rows, assignments_received=in_rows, forwards=1)
        self.ep_bytes_total = self.ep_bytes_total + self.ep_bytes


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh, *, src_data_rank: int | None = 0) -> nn.Module:
    """Shard the routed experts of every `StableLatentMoE` in `model` over the 1-D `ep_mesh` and install the
    all-to-all dispatcher (module docstring). In place; returns `model`.

    `src_data_rank` (as in `distribute_tensor`): the rank of `ep_mesh` whose full expert weights are scattered
    (default 0: the other ranks' copies are ignored); None slices each rank's own copy with no communication
    (meta-device or identically seeded models). Raises ValueError, before changing anything, if the mesh is not
    1-D, `model` has no `StableLatentMoE`, a layer is already expert-parallel or FSDP-sharded, or the mesh size
    does not divide `num_experts`."""
    if not isinstance(ep_mesh, DeviceMesh) or ep_mesh.ndim != 1:
        raise ValueError(f"apply_expert_parallel needs a 1-D DeviceMesh of EP ranks (e.g. mesh['ep']), got "
                         f"{ep_mesh!r}")
    ep = ep_mesh.size()
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, StableLatentMoE)]
    if not layers:
        raise ValueError("apply_expert_parallel: the model has no StableLatentMoE layer")
    for name, moe in layers:
        experts = moe.experts
        if type(experts) is not RoutedExperts:
            raise ValueError(f"{name}.experts is already {type(experts).__name__}: apply expert parallelism once, "
                             f"to an unmodified model")
        if not isinstance(experts.w1, nn.Parameter):
            raise ValueError(f"{name}.experts are packed (MXFP4): expert parallelism shards dense experts (load the "
                             f"checkpoint with experts='dense')")
        if any(isinstance(getattr(experts, w), DTensor) for w in EXPERT_WEIGHTS):
            raise ValueError(f"{name}.experts already holds DTensors: apply expert parallelism before fully_shard")
        E = experts.w1.shape[0]
        if E % ep:
            raise ValueError(f"expert parallelism: ep={ep} (the size of ep_mesh) must divide num_experts={E} "
                             f"(config.num_experts) so that every EP rank owns the same number of whole experts; "
                             f"choose ep among the divisors of {E}")
    for _, moe in layers:
        experts = moe.experts
        for w in EXPERT_WEIGHTS:
            old = getattr(experts, w)
            sharded = distribute_tensor(old.detach(), ep_mesh, [Shard(0)], src_data_rank=src_data_rank)
            setattr(experts, w, nn.Parameter(sharded, requires_grad=old.requires_grad))
        experts.__class__ = ExpertParallelRoutedExperts
        experts.ep_mesh = ep_mesh
        experts.ep_bytes = experts.ep_bytes_total = AllToAllBytes()
    return model


def expert_parallel_layers(model: nn.Module) -> list[ExpertParallelRoutedExperts]:
    return [m for m in model.modules() if isinstance(m, ExpertParallelRoutedExperts)]


def expert_parallel_bytes(model: nn.Module, cumulative: bool = False) -> AllToAllBytes:
    """This rank's all-to-all bytes summed over the MoE layers: of each layer's last forward, or (cumulative)
    since the last `reset_expert_parallel_bytes`. Per training step (no checkpointing): `forward + backward`."""
    total = AllToAllBytes()
    for m in expert_parallel_layers(model):
        total = total + (m.ep_bytes_total if cumulative else m.ep_bytes)
    return total


def reset_expert_parallel_bytes(model: nn.Module) -> None:
    for m in expert_parallel_layers(model):
        m.ep_bytes = m.ep_bytes_total = AllToAllBytes()
