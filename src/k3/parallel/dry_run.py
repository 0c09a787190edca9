"""`k3 plan --dry-run`: shard the real model for a mesh of N ranks inside one process and count what rank 0
holds, to check the analytic plan (`k3.parallel.plan`) against the sharding code itself.

The model is built on the meta device (no memory) and sharded by the same `parallelize` the trainer uses (expert
parallelism of degree `ep`, then FSDP2), under PyTorch's fake process group (every collective is a no-op), as
rank 0 of a world of `gpus` ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from k3.config import K3Config
from k3.model import K3ForCausalLM
from k3.model.moe import RoutedExperts
from k3.parallel.distributed import make_distributed
from k3.parallel.fsdp import parallelize


def dry_run(config: K3Config, gpus: int, ep: int = 1) -> dict[str, int]:
    """Rank 0's parameter counts after sharding `config` over `gpus` data-parallel ranks (experts over `ep`):
    {"dense_params_per_rank", "expert_params_per_rank"} (local shard elements)."""
    if dist.is_initialized():
        raise RuntimeError("dry_run needs a process without a process group (it creates a fake one)")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=gpus)
    try:
        with torch.device("meta"):
            model = K3ForCausalLM(config)
        parallelize(model, make_distributed(ep))
        experts = {id(p) for m in model.modules() if isinstance(m, RoutedExperts) for p in m.parameters()}
        counts = {"dense_params_per_rank": 0, "expert_params_per_rank": 0}
        for p in model.parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            counts["expert_params_per_rank" if id(p) in experts else "dense_params_per_rank"] += local.numel()
        return counts
    finally:
        dist.destroy_process_group()
