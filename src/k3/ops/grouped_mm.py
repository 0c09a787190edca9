"""Grouped matmul: rows sorted by expert, each expert's rows times its own matrix (the routed experts, §6.7).

`grouped_mm(x_Am, w_Emn, counts_E)`: rows `x_Am` sorted by expert, `counts_E[e]` of them for expert e (zeros
allowed), `w_Emn` one [m, n] matrix per expert (a transposed view is fine); returns the [A, n] products in the
rows' order. The fast path is PyTorch's `torch._grouped_mm` (one kernel, no padding, no copy of the weights
in use; its backward gives every expert's weight gradient, zeros for experts without rows). It
exists where the installed PyTorch has it for the tensors' device and dtype (checked once per combination);
elsewhere, for example float64 on CPU or an older PyTorch, `grouped_mm_reference` does one matmul per expert
with rows. No-grad CPU calls of a few rows per expert (decoding, short prompts) run `k3.ops.matvec.expert_linear`
(one compiled pass over the chosen experts' weights, each expert's rows in register tiles: k3-small's 64-token
prefill spent 95 ms in the grouped kernel's small products); calls with fewer rows than experts that it does not
take run the reference, as the kernel costs a few µs per expert on CPU even for experts without rows (k3-full
decode: 896 experts for 16 rows, measured 4.4× slower than the loop over the 16).
"""

from __future__ import annotations

import functools

import torch

from k3.ops.matvec import expert_linear


def grouped_mm_reference(x_Am: torch.Tensor, w_Emn: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """The readable reference: x[rows of e] @ w[e] for every expert e that has rows."""
    ends = torch.cumsum(counts_E, 0).tolist()
    pieces = [x_Am[end - c:end] @ w_Emn[e] for e, (c, end) in enumerate(zip(counts_E.tolist(), ends)) if c]
    if not pieces:  # no rows at all: still an autograd path to the weights (their gradient is zero)
        return x_Am @ w_Emn[0]
    return torch.cat(pieces)


@functools.cache
def _fast_path_works(device: torch.device, dtype: torch.dtype, m: int, n: int) -> bool:
    """Whether `torch._grouped_mm` runs for these operands here (device, dtype, shapes: CUDA needs aligned
    bf16 matrices), tried once on a small problem of the same width."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        x = torch.zeros(2, m, dtype=dtype, device=device)
        w = torch.zeros(2, n, m, dtype=dtype, device=device).transpose(-1, -2)
        torch._grouped_mm(x, w, offs=torch.tensor([1, 2], dtype=torch.int32, device=device))
    except (RuntimeError, NotImplementedError):
        return False
    return True


def grouped_mm(x_Am: torch.Tensor, w_Emn: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """Row block e of `x_Am` (`counts_E[e]` rows, in expert order) times `w_Emn[e]`; [A, n]."""
    w_Emn = w_Emn.to(x_Am.dtype)  # autocast does not cover the grouped kernel: the weights follow x (no-op in fp32)
    y_An = expert_linear(x_Am, w_Emn.transpose(-1, -2), counts_E)  # w_Emn: a view of the stored [E, n, m]
    if y_An is not None:
        return y_An
    few_rows = x_Am.shape[0] < w_Emn.shape[0]  # e.g. decoding: the kernel's per-expert cost, empty or not, dominates
    if few_rows or not _fast_path_works(x_Am.device, x_Am.dtype, *w_Emn.shape[1:]):
        return grouped_mm_reference(x_Am, w_Emn, counts_E)
    offs_E = torch.cumsum(counts_E, 0, dtype=torch.int32)  # end row of every expert
    return torch._grouped_mm(x_Am, w_Emn, offs=offs_E)
