"""The process group and device mesh of a `torchrun` job (docs/architecture.md, "Scale-out").

`torchrun --standalone --nproc_per_node N -m k3 train ...` (or the multi-node `--nnodes/--rdzv-endpoint` form)
sets RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous variables; `init_distributed` joins the group with gloo on
CPU or, on CUDA, NCCL for CUDA tensors and gloo for CPU ones (`--cpu-offload`), chosen automatically, and a timeout
on every collective, so a rank that dies brings the
others down with an error instead of a hang. Without torchrun (no WORLD_SIZE, or 1) nothing is initialised and
training runs exactly as a single process.

Layout: all W ranks are data-parallel; FSDP2 shards every dense parameter over all of them. Expert parallelism
of degree `ep` (dividing W) groups the ranks into blocks of `ep` consecutive ranks; each EP rank owns
`num_experts / ep` experts and receives the tokens routed to them from the other ranks of its block ("dp2ep":
every rank still sees different data). Context parallelism of degree `cp` (dividing W) groups the ranks into blocks
of `cp` consecutive ranks that take the same rows of the global batch, each a share of every sequence
(`k3.parallel.context`); FSDP2 still shards over all W ranks, whose gradients sum to the whole batch's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

DEFAULT_TIMEOUT_S = 600.0


@dataclass
class Distributed:
    """This process's place in the job: the data-parallel mesh over all ranks and the expert-parallel mesh."""

    rank: int
    world_size: int
    device: torch.device
    backend: str
    mesh: DeviceMesh  # 1-D ("dp",) over all ranks: FSDP2 and the data-parallel reductions
    ep: int = 1
    ep_mesh: DeviceMesh | None = None  # ("dp_rep", "ep") view of the same ranks when ep > 1
    cp: int = 1
    cp_mesh: DeviceMesh | None = None  # ("data", "cp") view when cp > 1: groups of cp ranks share their sequences

    @property
    def data_rank(self) -> int:
        """Which rows of the global batch this rank takes: its context-parallel group's index."""
        return self.rank // self.cp

    @property
    def data_size(self) -> int:
        """Groups of ranks taking distinct rows (all ranks without context parallelism)."""
        return self.world_size // self.cp

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def describe(self) -> str:
        """The one start-up line: world, backend, device and the parallel degrees."""
        ep = f", ep {self.ep} × replicas {self.world_size // self.ep}" if self.ep > 1 else ""
        cp = f", cp {self.cp} (sequences split) × data {self.data_size}" if self.cp > 1 else ""
        return (f"distributed: {self.world_size} ranks ({self.backend} on {self.device.type}); FSDP2 over "
                f"dp {self.world_size}{ep}{cp}")


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init_distributed(ep: int = 1, cp: int = 1, timeout_s: float = DEFAULT_TIMEOUT_S) -> Distributed | None:
    """Join the torchrun job (None when not launched by torchrun with more than one process)."""
    if not launched_by_torchrun():
        for flag, value in (("--ep", ep), ("--cp", cp)):
            if value != 1:
                raise ValueError(f"{flag} {value} needs a multi-process torchrun job (this is a single process)")
        return None
    cuda = torch.cuda.is_available()
    # on GPUs, NCCL for CUDA tensors and gloo for CPU ones: --cpu-offload keeps the shards, their gradients and so the
    # gradient norm's collectives on the CPU, which NCCL does not take
    backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return make_distributed(ep, cp)


def make_distributed(ep: int = 1, cp: int = 1) -> Distributed:
    """The meshes of an already initialised process group (tests join the group themselves)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    for flag, value in (("--ep", ep), ("--cp", cp)):
        if value < 1 or world % value:
            raise ValueError(f"{flag} {value} must be a positive divisor of the number of processes ({world})")
    config = dist.get_backend_config()  # "cpu:gloo,cuda:nccl" on GPUs (`init_distributed`)
    cuda = torch.cuda.is_available() and "cuda:nccl" in config
    backend = ("nccl, gloo for CPU tensors" if "cpu:gloo" in config else "nccl") if cuda else dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
    ep_mesh = init_device_mesh(device.type, (world // ep, ep), mesh_dim_names=("dp_rep", "ep")) if ep > 1 else None
    cp_mesh = init_device_mesh(device.type, (world // cp, cp), mesh_dim_names=("data", "cp")) if cp > 1 else None
    return Distributed(rank, world, device, backend, mesh, ep, ep_mesh, cp, cp_mesh)


def rank_rows(global_rows: int, world_size: int, rank: int) -> slice:
    """This rank's contiguous share of a global batch of `global_rows` rows (the same global batch at any world
    size, so the data order does not depend on the number of processes)."""
    if global_rows % world_size:
        raise ValueError(f"the global batch ({global_rows} rows) must divide evenly over {world_size} processes")
    per_rank = global_rows // world_size
    return slice(rank * per_rank, (rank + 1) * per_rank)
