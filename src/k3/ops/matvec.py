"""Products with a few rows, the shape of decoding: a compiled kernel (`matvec_kernel.cpp`) beside PyTorch's.

A one-token step multiplies one row (or one per sequence) by every weight it uses once; its time is the weights'
memory traffic. PyTorch's matrix–vector path streamed fp32 weights at 5–11 GB/s on a 2-core VM; the kernel reads
each weight row once and takes its dot products with every row of x while it is in cache (2 to 6 rows of x: one
weight row after another; more: register tiles of 4 weight rows × up to 3 rows of x), with the output rows split
over the threads (15–21 GB/s; 16 rows of x by k3-small's
32,768 × 512 lm_head in 4.9 ms, against 13.1 ms for `F.linear`, EPYC). It serves CPU calls without autograd and
with at most `MAX_ROWS` rows whose input and weight are both fp32 or both bf16: bf16 weights are read as stored
(half the bytes) and widened exactly, the sums are fp32, and a bf16 product is rounded once, as `F.linear`'s dtype
contract has it. Every other call, and every call where the kernel could not be built, runs `F.linear` /
`grouped_mm`, which are also the references the tests compare against.
"""
# Shape suffixes (`x_BTD`): the package-wide legend at the top of docs/architecture.md.
# Here: N rows, I input width, O output width, A rows each with its own expert, E experts.

import torch
import torch.nn.functional as F
from torch import nn

from k3.ops import compiled

MAX_ROWS = compiled.MAX_ROWS  # the most rows the kernel takes
DTYPES = (torch.float32, torch.bfloat16)  # what the kernel reads; input and weight of one dtype, as F.linear takes them


def _applies(x: torch.Tensor, w: torch.Tensor, rows: int) -> bool:
    """A no-grad call with few rows, x and a contiguous weight of one dtype that the kernel serves
    (`compiled.serves_few_rows`)."""
    return (x.dtype is w.dtype and w.is_contiguous()
            and compiled.serves_few_rows("matvec", rows, x, w, dtypes=DTYPES))


def linear(x_NI: torch.Tensor, weight_OI: torch.Tensor) -> torch.Tensor:
    """x Wᵀ over the last axis of x (`F.linear` without bias)."""
    if not _applies(x_NI, weight_OI, compiled.rows(x_NI)):
        return F.linear(x_NI, weight_OI)
    return compiled.load("matvec").linear(x_NI, weight_OI)  # any leading shape


def expert_linear(x_AI: torch.Tensor, weight_EOI: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor | None:
    """x[a] W[e]ᵀ for the rows a of expert e, rows sorted by expert, `counts_E[e]` of them (`grouped_mm`'s
    contract); None where the kernel does not apply (the caller's matmul serves): it takes up to `MAX_ROWS` rows
    per expert on average (a decode step, a short prompt: k3-small's 64-token prefill routes 8 rows to an expert)."""
    if not _applies(x_AI, weight_EOI, -(-x_AI.shape[0] // weight_EOI.shape[0])):
        return None
    return compiled.load("matvec").expert_linear(x_AI.contiguous(), weight_EOI, counts_E.long().contiguous())


class Linear(nn.Linear):
    """`nn.Linear` without bias (same parameter, same checkpoint name) whose few-row no-grad calls run `linear`."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        if bias:
            raise ValueError("k3.ops.matvec.Linear has no bias (no K3 projection has one)")
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)
