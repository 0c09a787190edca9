"""Expert parallelism behind one endpoint: `torchrun --nproc_per_node N -m k3 serve CHECKPOINT --ep N`
(docs/architecture.md, "Serving").

Every rank loads the model and shards its routed experts with `apply_expert_parallel` (rank r keeps experts
r·E/N … (r+1)·E/N − 1). Rank 0 — the leader — runs the HTTP server and the batching engine as a single process does;
the other ranks — followers — hold no sequences and run no scheduler. They serve experts only: whenever the
leader's model reaches a MoE layer, the leader first tells them which (a one-number broadcast), then every rank
enters that layer's dispatch together (`ExpertParallelRoutedExperts.forward`, the same all-to-all of latent tokens as
in training). The leader routes all the tokens; a follower contributes none and computes the rows sent to its
experts. So the outputs are the single-process model's up to the fp32 summation order of the combine.

The control numbers: a layer index (its place in `expert_parallel_layers`), IDLE (the leader's engine has been idle
for a while: keeps the followers' wait inside the collective timeout) or STOP (the leader has shut down: followers
return).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from k3.parallel.expert import ExpertParallelRoutedExperts, apply_expert_parallel, expert_parallel_layers

IDLE, STOP = -1, -2
LEADER = 0  # the rank of the EP group that serves HTTP


class ExpertService:
    """One rank's part in serving with expert parallelism over the 1-D `ep_mesh` (module docstring)."""

    def __init__(self, model: nn.Module, ep_mesh: DeviceMesh):
        if ep_mesh.ndim != 1 or ep_mesh.size() < 2:
            raise ValueError(f"expert-parallel serving needs a 1-D mesh of at least 2 ranks, got {ep_mesh!r}")
        apply_expert_parallel(model, ep_mesh, src_data_rank=None)  # every rank loaded the same weights
        self.layers: list[ExpertParallelRoutedExperts] = expert_parallel_layers(model)
        self.group = ep_mesh.get_group()
        self.leader = dist.get_global_rank(self.group, LEADER)
        self.is_leader = ep_mesh.get_local_rank() == LEADER
        self.device = torch.device(ep_mesh.device_type, torch.cuda.current_device()) \
            if ep_mesh.device_type == "cuda" else torch.device("cpu")
        self._hooks = []
        if self.is_leader:
            self._hooks = [layer.register_forward_pre_hook(self._announcer(i)) for i, layer in enumerate(self.layers)]

    def _send(self, value: int) -> None:
        dist.broadcast(torch.tensor([value], device=self.device), src=self.leader, group=self.group)

    def _announcer(self, index: int):
        def announce(module: nn.Module, args: tuple) -> None:
            self._send(index)
        return announce

    def idle(self) -> None:
        """Leader: nothing ran for a while; the followers wait on (called from the thread that runs the model)."""
        self._send(IDLE)

    def stop(self) -> None:
        """Leader: no more model calls; the followers return from `follow`."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._send(STOP)
        dist.barrier(group=self.group)  # every rank has the STOP before any tears its process group down

    def follow(self) -> int:
        """Follower: serve the leader's MoE layers until it stops; returns the number of layer calls served."""
        if self.is_leader:
            raise RuntimeError("the leader runs the model; only the other ranks follow it")
        served = 0
        signal = torch.empty(1, dtype=torch.long, device=self.device)
        with torch.no_grad():
            while True:
                dist.broadcast(signal, src=self.leader, group=self.group)
                index = int(signal.item())
                if index == STOP:
                    dist.barrier(group=self.group)
                    return served
                if index == IDLE:
                    continue
                if not 0 <= index < len(self.layers):
                    raise RuntimeError(f"the leader announced MoE layer {index} of {len(self.layers)}")
                self._take_part(self.layers[index])
                served += 1

    def _take_part(self, layer: ExpertParallelRoutedExperts) -> None:
        """Enter `layer`'s dispatch with no tokens of this rank's own: it computes the rows routed to its experts."""
        w1 = layer.w1.to_local()  # [E/N, F, L]: the latent rows travel in the weights' dtype and width
        k = layer.config.num_experts_per_token
        layer(torch.empty(0, w1.shape[-1], dtype=w1.dtype, device=w1.device),
              torch.empty(0, k, dtype=torch.long, device=w1.device),
              torch.empty(0, k, dtype=torch.float32, device=w1.device))
