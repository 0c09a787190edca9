"""FSDP2 on an unmodified K3 model (docs/architecture.md, "Scale-out").

`apply_fsdp(model, mesh)` calls `fully_shard` on every decoder layer and then on the root (embedding, output
AttnRes mix, final norm and LM head), bottom-up like torchtitan: each parameter becomes a DTensor sharded on
dim 0 over the mesh, gathered for a layer's forward and backward and resharded after. Parameters keep their
stored dtypes: the KDA `A_log`, `dt_bias`, conv weights, `o_norm` and the router bias stay fp32 (§0.4); no
mixed-precision policy casts them (on CUDA the trainer's autocast runs the matmuls in bf16).

Gradients are SUMMED over ranks (`set_gradient_divide_factor(1.0)`): the trainer divides each rank's summed
token losses by the global token count, so the sum is the gradient of the global mean, the same as one process
computing the whole batch. Routed experts already distributed by expert parallelism (DTensors on another mesh)
are left to it (`ignored_params`).
"""

from __future__ import annotations

import warnings

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from k3.model.k3 import K3Model
from k3.model.moe import RoutedExperts


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, reshard_after_forward: bool = True,
               cpu_offload: bool = False) -> nn.Module:
    """Shard `model` (a `K3ForCausalLM` or `K3ForConditionalGeneration`) in place over `mesh`; returns it."""
    (backbone,) = [m for m in model.modules() if isinstance(m, K3Model)]
    ignored = {p for p in model.parameters() if isinstance(p, DTensor)}  # expert parallelism's own layout
    options = dict(mesh=mesh, reshard_after_forward=reshard_after_forward, ignored_params=ignored or None,
                   offload_policy=CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
                   shard_placement_fn=_expert_rows_when_too_few(model, mesh.size()))
    for layer in backbone.layers:
        fully_shard(layer, **options)
    fully_shard(model, **{**options, "reshard_after_forward": False})  # the root is needed again at once
    # FSDP2 warns about every wrapped layer whose outputs include a view; the decoder layers' outputs are only
    # read (never modified in place), which is the case the warning is about
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPK3DecoderLayer\) returned a view")
    gloo = dist.get_backend(mesh.get_group()) == "gloo"
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            if gloo:  # gloo has no PREMUL_SUM: reduce with a plain SUM (the factor is 1 anyway)
                module.set_force_sum_reduction_for_comms(True)
    return model


def _expert_rows_when_too_few(model: nn.Module, shards: int):
    """FSDP2 shards dim 0; a stacked expert tensor [E, F, L] with fewer experts than shards would leave ranks
    empty, so such stacks are sharded on dim 1 (rows of every expert) instead where dim 1 divides evenly (FSDP2
    shards only dim 0 unevenly)."""
    stacks = {id(p) for m in model.modules() if isinstance(m, RoutedExperts) for p in m.parameters(recurse=False)}

    def placement(param: nn.Parameter) -> Shard | None:
        return Shard(1) if id(param) in stacks and param.shape[0] < shards and param.shape[1] % shards == 0 \
            else None

    return placement
