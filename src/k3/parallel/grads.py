"""Gradients of a sharded model (docs/architecture.md, "Scale-out"): scaling and clipping on the global norm.

Under FSDP2 the dense gradients are DTensors sharded over the data-parallel mesh; with expert parallelism the routed
experts' gradients are DTensors on the expert mesh. `torch.nn.utils.clip_grad_norm_` cannot stack norms that live on
different meshes, so `clip_grad_norm_` takes the norm of each mesh's gradients separately, completes each to its
global value (`full_tensor`: the sum of squares over the shards), combines them and scales every gradient with
`torch.nn.utils.clip_grads_with_norm_`. On one process (plain tensors) it is the ordinary global-norm clip.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def _by_mesh(parameters: Iterable[nn.Parameter]) -> list[list[nn.Parameter]]:
    """The parameters that have a gradient, grouped by the mesh their gradient lives on (plain tensors: one group)."""
    groups: dict[object, list[nn.Parameter]] = {}
    for p in parameters:
        if p.grad is not None:
            groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    return list(groups.values())


_REDISTRIBUTE_LOG = "torch.distributed.tensor._redistribute"


@contextlib.contextmanager
def _quiet(logger_name: str) -> Iterator[None]:
    """Warnings of the logger `logger_name` suppressed inside the block."""
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def global_grad_norm(parameters: Iterable[nn.Parameter]) -> torch.Tensor:
    """The 2-norm of all gradients together (a plain tensor, equal on every rank): the norm of the per-mesh norms,
    as `get_total_norm` combines per-tensor norms."""
    norms = []
    for group in _by_mesh(parameters):
        norm = torch.nn.utils.get_total_norm([p.grad for p in group])
        with _quiet(_REDISTRIBUTE_LOG):  # a 2-D mesh's norm is completed dimension by dimension: intended
            norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        return torch.zeros(())
    return norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack([n.cpu() for n in norms]))


def clip_grad_norm_(parameters: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Scale the gradients so that their global norm is at most `max_norm`; returns the norm before clipping."""
    groups = _by_mesh(parameters)
    norm = global_grad_norm(p for group in groups for p in group)
    for group in groups:
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm.to(group[0].grad.device))
    return norm


@torch.no_grad()
def scale_grads_(parameters: Iterable[nn.Parameter], factor: float) -> None:
    """Multiply every gradient by `factor` (each shard locally)."""
    for p in parameters:
        if p.grad is not None:
            p.grad.mul_(factor)
