"""Grouped matmul: rows sorted by group, each group multiplied by its own matrix (the routed experts, §6.7).

`grouped_mm(x_AI, w_GIO, counts_G)`: rows `x_AI` sorted by group, `counts_G[g]` of them for group g (zeros
allowed), `w_GIO` one [I, O] matrix per group (a transposed view is fine); returns the [A, O] products in the
rows' order. The fast path is PyTorch's `torch._grouped_mm` (one kernel, no padding, no copy of the weights
of the groups in use; its backward gives every group's weight gradient, zeros for groups without rows). It
exists where the installed PyTorch has it for the tensors' device and dtype (checked once per combination);
elsewhere, for example float64 on CPU or an older PyTorch, `grouped_mm_reference` does one matmul per group.
"""

from __future__ import annotations

import functools

import torch


def grouped_mm_reference(x_AI: torch.Tensor, w_GIO: torch.Tensor, counts_G: torch.Tensor) -> torch.Tensor:
    """The readable reference: x[rows of g] @ w[g] for every group g that has rows."""
    ends = torch.cumsum(counts_G, 0).tolist()
    pieces = [x_AI[end - n:end] @ w_GIO[g] for g, (n, end) in enumerate(zip(counts_G.tolist(), ends)) if n]
    if not pieces:  # no rows at all: still an autograd path to the weights (their gradient is zero)
        return x_AI @ w_GIO[0]
    return torch.cat(pieces)


@functools.cache
def _fast_path_works(device: torch.device, dtype: torch.dtype, I: int, O: int) -> bool:
    """Whether `torch._grouped_mm` runs for these operands here (device, dtype, shapes: CUDA needs aligned
    bf16 matrices), tried once on a small problem of the same width."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        x = torch.zeros(2, I, dtype=dtype, device=device)
        w = torch.zeros(2, O, I, dtype=dtype, device=device).transpose(-1, -2)
        torch._grouped_mm(x, w, offs=torch.tensor([1, 2], dtype=torch.int32, device=device))
    except (RuntimeError, NotImplementedError):
        return False
    return True


def grouped_mm(x_AI: torch.Tensor, w_GIO: torch.Tensor, counts_G: torch.Tensor) -> torch.Tensor:
    """Row block g of `x_AI` (`counts_G[g]` rows, in group order) times `w_GIO[g]`; [A, O]."""
    w_GIO = w_GIO.to(x_AI.dtype)  # autocast does not cover the grouped kernel: the weights follow x (no-op in fp32)
    if not _fast_path_works(x_AI.device, x_AI.dtype, *w_GIO.shape[1:]):
        return grouped_mm_reference(x_AI, w_GIO, counts_G)
    offs_G = torch.cumsum(counts_G, 0, dtype=torch.int32)  # end row of every group
    return torch._grouped_mm(x_AI, w_GIO, offs=offs_G)
