"""The next-token loss (docs/architecture.md §9.9): fp32 cross-entropy over the shifted labels."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from k3.ops.precision import fp32

IGNORE_INDEX = -100
"""A label that is not scored (Hugging Face convention): padding, media features, prompts."""


def check_labels(labels_BT: torch.Tensor, vocab_size: int) -> None:
    """Labels must be integer token ids in 0..vocab_size-1 or IGNORE_INDEX; raises naming the first bad one."""
    if labels_BT.is_floating_point() or labels_BT.is_complex() or labels_BT.dtype == torch.bool:
        raise ValueError(f"labels must be an integer tensor, got {labels_BT.dtype}")
    bad = (labels_BT != IGNORE_INDEX) & ((labels_BT < 0) | (labels_BT >= vocab_size))
    if bool(bad.any()):
        where = bad.nonzero()[0].tolist()
        raise ValueError(f"labels{where} = {int(labels_BT[tuple(where)])} is neither a token id in "
                         f"0..{vocab_size - 1} nor the ignore index {IGNORE_INDEX}")


def next_token_loss(logits_BTO: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
    """Mean fp32 cross-entropy of `logits_BTO` [B, T, V] against `targets_BT` [B, T] (already shifted: position t
    is scored on the token of t+1), IGNORE_INDEX skipped. With no scored target at all the loss is defined as 0
    (still connected to the graph, so `backward` works) and a warning is issued."""
    if not bool((targets_BT != IGNORE_INDEX).any()):
        warnings.warn("every label is the ignore index (-100): the loss is 0", stacklevel=3)
        return logits_BTO.sum().float() * 0.0
    return F.cross_entropy(fp32(logits_BTO).flatten(0, 1), targets_BT.flatten(), ignore_index=IGNORE_INDEX)
