"""The next-token loss (docs/architecture.md §9.9): fp32 cross-entropy over the shifted labels.

`F.cross_entropy` is the reference; for fp32 CPU logits the loss runs on a compiled kernel (`loss_kernel.cpp`: one
pass per row each way, docs/architecture.md §0.6) with the same value and gradient.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from k3.ops import compiled
from k3.ops.precision import fp32

IGNORE_INDEX = -100
"""A label that is not scored (Hugging Face convention): padding, media features, prompts."""


def next_token_targets(labels_BT: torch.Tensor, document_ids_BT: torch.Tensor | None = None,
                       real_BT: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T] targets of `next_token_loss` from HF-convention labels: position t scored on label t+1, except across a
    document boundary (`document_ids_BT`, packed rows), from a padding position (`real_BT` 0/False) and at the
    last position (IGNORE_INDEX)."""
    targets_BT = labels_BT[:, 1:]
    if document_ids_BT is not None:  # never predict across a document boundary
        targets_BT = targets_BT.masked_fill(document_ids_BT[:, 1:] != document_ids_BT[:, :-1], IGNORE_INDEX)
    if real_BT is not None:  # a padding position predicts nothing (left padding)
        targets_BT = targets_BT.masked_fill(real_BT[:, :-1] == 0, IGNORE_INDEX)
    return F.pad(targets_BT, (0, 1), value=IGNORE_INDEX)


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
    scored = (targets_BT != IGNORE_INDEX).sum()
    if not bool(scored):
        warnings.warn("every label is the ignore index (-100): the loss is 0", stacklevel=3)
        return logits_BTO.sum().float() * 0.0
    logits_NO, targets_N = fp32(logits_BTO).flatten(0, 1), targets_BT.flatten()
    if not compiled.serves("loss", logits_NO) or targets_N.dtype != torch.int64:
        return F.cross_entropy(logits_NO, targets_N, ignore_index=IGNORE_INDEX)
    return _CrossEntropyFunction.apply(logits_NO.contiguous(), targets_N.contiguous()).sum() / scored


class _CrossEntropyFunction(torch.autograd.Function):
    """Cross-entropy per row (0 where the target is IGNORE_INDEX) on the compiled kernel; saves the logits, the
    targets and the log-sum-exp of each row."""

    @staticmethod
    def forward(ctx, logits_NO, targets_N):
        loss_N, lse_N = compiled.load("loss").forward(logits_NO, targets_N, IGNORE_INDEX)
        ctx.save_for_backward(logits_NO, targets_N, lse_N)
        return loss_N

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_N):
        logits_NO, targets_N, lse_N = ctx.saved_tensors
        return compiled.load("loss").backward(logits_NO, targets_N, lse_N, grad_N.contiguous(), IGNORE_INDEX), None
