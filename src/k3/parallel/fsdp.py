"""FSDP2 on an unmodified K3 model (docs/architecture.md, "Scale-out").

`apply_fsdp(model, mesh)` calls `fully_shard` on every decoder layer and then on the root (embedding, output
AttnRes mix, final norm and LM head), bottom-up like torchtitan: each parameter becomes a DTensor sharded on
dim 0 over the mesh, gathered for a layer's forward and backward and resharded after. Parameters are stored in
their dtypes (fp32 for training). With `mixed_precision` (the trainer's choice on CUDA) each unit's parameters are
all-gathered and computed in bf16 and their gradients reduced in fp32 (`MixedPrecisionPolicy`), except the fp32
set of §0.4 (KDA's `A_log`, `dt_bias`, conv weights, `o_norm`; the router bias is a buffer, never sharded): a KDA
layer is two units, its fp32 set in an fp32 unit and every submodule without an fp32 tensor in one bf16 unit.

Gradients are SUMMED over ranks (`set_gradient_divide_factor(1.0)`): the trainer divides each rank's summed
token losses by the global token count, so the sum is the gradient of the global mean, the same as one process
computing the whole batch. Routed experts already distributed by expert parallelism (DTensors on the expert
mesh) are sharded further over `expert_mesh` when given — the data-parallel replicas of each expert block
("efsdp"; their gradients are then reduce-scattered over the replicas) — and otherwise left to expert parallelism
(`ignored_params`).

`parallelize` applies everything in the fixed order: expert parallelism (it replaces the expert weights), FSDP2
of the expert blocks over their replicas, FSDP2 of every decoder layer, FSDP2 of the root.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from k3.model.k3 import K3Model
from k3.model.moe import RoutedExperts
from k3.ops.precision import is_fp32_tensor
from k3.parallel.distributed import Distributed
from k3.parallel.expert import apply_expert_parallel


BF16_COMPUTE = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
"""bf16 all-gathers and compute, fp32 gradient reduction."""


def parallelize(model: nn.Module, distributed: Distributed, reshard_after_forward: bool = True,
                cpu_offload: bool = False, mixed_precision: bool = False) -> nn.Module:
    """Expert parallelism over `distributed.ep_mesh["ep"]` (when ep > 1), then FSDP2 over everything else; in
    place, returns `model`. Apply it before building the optimisers (the parameters become new objects)."""
    expert_mesh = None
    if distributed.ep > 1:
        apply_expert_parallel(model, distributed.ep_mesh["ep"])
        if distributed.world_size > distributed.ep:
            expert_mesh = distributed.ep_mesh["dp_rep"]
    return apply_fsdp(model, distributed.mesh, reshard_after_forward, cpu_offload, expert_mesh, mixed_precision)


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, reshard_after_forward: bool = True,
               cpu_offload: bool = False, expert_mesh: DeviceMesh | None = None,
               mixed_precision: bool = False) -> nn.Module:
    """Shard `model` (a `K3ForCausalLM` or `K3ForConditionalGeneration`) in place over `mesh` (and its
    expert-parallel experts over `expert_mesh`); returns it. `mixed_precision`: bf16 compute, fp32 reduction,
    the fp32 set kept fp32 (module docstring)."""
    (backbone,) = [m for m in model.modules() if isinstance(m, K3Model)]
    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    half = BF16_COMPUTE if mixed_precision else MixedPrecisionPolicy()
    if expert_mesh is not None:
        for m in model.modules():
            if isinstance(m, RoutedExperts) and isinstance(m.w1, DTensor):
                fully_shard(m, mesh=expert_mesh, reshard_after_forward=reshard_after_forward, offload_policy=offload,
                            shard_placement_fn=_expert_rows_when_too_few(m, expert_mesh.size()), mp_policy=half)
    ignored = {p for p in model.parameters() if isinstance(p, DTensor)}  # the experts' own layout
    options = dict(mesh=mesh, reshard_after_forward=reshard_after_forward, ignored_params=ignored or None,
                   offload_policy=offload, shard_placement_fn=_expert_rows_when_too_few(model, mesh.size()))
    for layer in backbone.layers:
        units = _half_units(layer) if mixed_precision else [layer]
        if units != [layer]:  # a KDA layer in mixed precision: its fp32 set in an fp32 unit of its own
            fully_shard(units, **options, mp_policy=half)
            fully_shard(layer, **options)
        else:
            fully_shard(layer, **options, mp_policy=half)
    fully_shard(model, **{**options, "reshard_after_forward": False}, mp_policy=half)  # needed again at once
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


def _half_units(module: nn.Module, prefix: str = "") -> list[nn.Module]:
    """The largest submodules of `module` (itself included) that hold no tensor of the fp32 set (§0.4), found by
    the parameters' names relative to the decoder layer, and that are called: the AttnRes gains and pseudo-queries
    (`*_res_norm`, `*_res_proj`) are read by the mix, so they stay in the layer's own unit, gathered when it runs."""
    names = [prefix + name for name, _ in module.named_parameters()]
    if prefix.endswith(("_res_norm.", "_res_proj.")) or not names:
        return []
    if not any(is_fp32_tensor(name) for name in names):
        return [module]
    return [unit for name, child in module.named_children() for unit in _half_units(child, f"{prefix}{name}.")]


def _expert_rows_when_too_few(model: nn.Module, shards: int):
    """FSDP2 shards dim 0; a stack of expert matrices [E, F, L] (E: the rank's own experts under expert
    parallelism) with fewer experts than shards would leave ranks empty, so such stacks are sharded on dim 1 (rows
    of every expert) instead where dim 1 divides evenly (FSDP2 shards only dim 0 unevenly)."""
    stacks = {id(p) for m in model.modules() if isinstance(m, RoutedExperts) for p in m.parameters(recurse=False)}

    def placement(param: nn.Parameter) -> Shard | None:
        experts = param.to_local().shape[0] if isinstance(param, DTensor) else param.shape[0]
        return Shard(1) if id(param) in stacks and experts < shards and param.shape[1] % shards == 0 else None

    return placement


@contextlib.contextmanager
def gathered(model: nn.Module) -> Iterator[nn.Module]:
    """Every FSDP2 unit of `model` unsharded (a collective all-gather on every rank) for reading parameters
    outside a forward — e.g. the AttnRes mixing weights of the training plots — and resharded after. Needs
    memory for the whole (non-expert-parallel) model on each rank."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.unshard()
    try:
        yield model
    finally:
        for unit in units:
            unit.reshard()
