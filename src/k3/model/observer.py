"""The one channel through which training observes a forward (docs/architecture.md §7.6, §8.6).

Load balancing needs every router's scores and choices, QK-Clip every MLA layer's pre-softmax logits. Both are
training statistics, so the model layer knows nothing about them: it only calls the `ForwardObserver`s that
the trainer attached with `K3Model.add_observer`. The observers travel in the call's `StepContext`; they are
inert (empty) unless attached, in evaluation mode, and while activation checkpointing recomputes a layer in the
backward pass (each token is observed once per forward). Observers only read: the forward's result and
gradients are the same with or without them.
"""

from __future__ import annotations

import torch
from torch import nn


class ForwardObserver:
    """Receives what a training step needs to see of a forward; every method does nothing by default."""

    def on_routing(self, gate: nn.Module, scores_NE: torch.Tensor, choice_NE: torch.Tensor,
                   idx_Nk: torch.Tensor) -> None:
        """A router (`MoEGate`) chose experts: detached fp32 unbiased sigmoid scores [N, E], selection scores
        (scores + bias, after any group limit) [N, E] and the chosen indices [N, k]."""

    def on_attention(self, mla: nn.Module, x_BTD: torch.Tensor, latent_BSL: torch.Tensor,
                     document_ids_BS: torch.Tensor | None) -> None:
        """A `GatedMLA` layer attends from the (detached) `input_layernorm` output `x_BTD`, its queries, over the
        (detached) latents `latent_BSL` [ĉ ‖ k_pe] of every position it sees, the queries' own last: S = T for a
        whole sequence, S > T for a context-parallel shard (the earlier shards' latents first). `document_ids_BS`
        marks the keys' packed documents (None: one sequence per row)."""


class Observable:
    """Mixin of a module that calls attached observers from its training-mode forwards (`K3Model`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.observers: list[ForwardObserver] = []

    def add_observer(self, observer: ForwardObserver) -> None:
        """Call `observer` from every training-mode forward from now on."""
        if any(o is observer for o in self.observers):
            raise ValueError(f"{type(observer).__name__} already observes this module")
        self.observers.append(observer)

    def remove_observer(self, observer: ForwardObserver) -> None:
        self.observers = [o for o in self.observers if o is not observer]


def attach(observer: ForwardObserver, model: nn.Module) -> list[Observable]:
    """Attach `observer` to every `Observable` inside `model`; returns them (for `detach`)."""
    hosts = [m for m in model.modules() if isinstance(m, Observable)]
    for host in hosts:
        host.add_observer(observer)
    return hosts


def detach(observer: ForwardObserver, hosts: list[Observable]) -> None:
    for host in hosts:
        host.remove_observer(observer)
