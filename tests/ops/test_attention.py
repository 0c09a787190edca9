"""Tests of blocked exact attention (docs/architecture.md §4.7): the torch blocked form and the compiled CPU kernel
against the materialised softmax (`naive_attention`), forward and backward, and the blocked form's working set.
"""
# Shape suffixes: B batch, H query heads, G key/value heads (H or 1), T queries, S keys, K key dim, V value dim.

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import k3.ops.attention as attention_module
from k3.ops import compiled
from k3.ops.attention import attention, naive_attention
from k3.ops.attention.blocked import K_BLOCK, Q_BLOCK, BlockedAttention
from k3.ops.attention.cpu import CpuBlockedAttention

PATHS = {"blocked": BlockedAttention.apply, "compiled": CpuBlockedAttention.apply}
needs_kernel = pytest.mark.skipif(compiled.load("attention") is None, reason="the compiled kernel is unavailable")


def inputs(B, H, G, T, S, K, V, dtype, seed, mask=None):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(*shape, generator=g, dtype=dtype) for shape in ((B, H, T, K), (B, G, S, K), (B, G, S, V)))
    valid = docs = None
    if mask == "padding":  # row 0 unpadded, the last row padded up to just before its queries (left padding)
        valid = torch.ones(B, S, dtype=torch.bool)
        valid[-1, : S - T + 1] = False
    if mask == "documents":  # packed rows: documents of ragged lengths over all S positions, different per row
        docs = torch.cumsum(torch.rand(B, S, generator=g) < 4 / S, dim=1)
    return q, k, v, valid, docs


def forward_backward(fn, q, k, v, scale, valid, docs):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    o = fn(q, k, v, scale, valid, docs)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64).to(o.dtype)
    (o * do).sum().backward()
    return o.detach(), q.grad, k.grad, v.grad


CASES = [  # (B, H, G, T, S, K, V): ragged lengths (not multiples of a block), K ≠ V, cached keys (S > T)
    (2, 3, 3, 700, 700, 40, 24),
    (2, 4, 1, 600, 1500, 56, 48),  # the absorbed form: one latent head, queries after 900 cached keys
    (1, 2, 2, 1, 1300, 32, 16),  # a decode step
    (2, 2, 1, 1100, 1100, 20, 12),
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("mask", [None, "padding", "documents"])
def test_blocked_equals_naive_float64(path, case, mask):
    """Output and the gradients of q, k and v equal the materialised softmax to float64 rounding (≤ 1e-12); with
    documents also where the queries follow earlier keys (S > T: a context-parallel shard's)."""
    B, H, G, T, S, K, V = case
    if path == "compiled" and compiled.load("attention") is None:
        pytest.skip("the compiled kernel is unavailable")
    q, k, v, valid, docs = inputs(*case, torch.float64, seed=T + S, mask=mask)
    want = forward_backward(naive_attention, q, k, v, 0.2, valid, docs)
    got = forward_backward(PATHS[path], q, k, v, 0.2, valid, docs)
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, want):
        assert a.shape == b.shape, name
        assert (a - b).abs().max() <= 1e-12 * max(1.0, b.abs().max()), name


@pytest.mark.parametrize("path", PATHS)
def test_blocked_equals_naive_fp32_at_4096(path):
    """fp32 at T = 4,096 (4 query × 4 key blocks of the torch form, 32 × 8 of the kernel): within fp32 rounding."""
    if path == "compiled" and compiled.load("attention") is None:
        pytest.skip("the compiled kernel is unavailable")
    q, k, v, valid, _ = inputs(1, 2, 2, 4096, 4096, 24, 16, torch.float32, seed=3, mask="padding")
    want = forward_backward(naive_attention, *(t.double() for t in (q, k, v)), 0.3, valid, None)
    got = forward_backward(PATHS[path], q, k, v, 0.3, valid, None)
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, want):
        assert (a.double() - b).abs().max() <= 2e-6 * b.abs().max(), name


def test_blocked_working_set_is_flat_in_the_block_count():
    """No tensor the torch blocked form makes, forward or backward, grows with T²: the largest at T = 4,096 is the
    one at T = 2,048 (one block of scores), a fraction of one [T, T] score matrix."""

    class Largest(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    self.numel = max(self.numel, t.numel())
            return out

    largest = {}
    for T in (2048, 4096):
        q, k, v, _, _ = inputs(1, 2, 2, T, T, 8, 8, torch.float32, seed=1)
        with Largest() as mode:
            forward_backward(BlockedAttention.apply, q, k, v, 0.3, None, None)
        largest[T] = mode.numel
    assert largest[4096] == largest[2048] == 2 * Q_BLOCK * K_BLOCK
    assert largest[4096] < 4096 * 4096 / 8


def test_attention_picks_the_compiled_kernel_for_fp32_cpu(monkeypatch):
    """`attention` runs the compiled kernel on fp32 CPU tensors and the torch form for bf16 (the kernel's dtypes)."""
    calls = []
    for name, cls in (("compiled", CpuBlockedAttention), ("blocked", BlockedAttention)):
        monkeypatch.setattr(cls, "apply", lambda *a, _f=cls.apply, _n=name: (calls.append(_n), _f(*a))[1])
    monkeypatch.setattr(attention_module, "CpuBlockedAttention", CpuBlockedAttention)
    q, k, v, _, _ = inputs(1, 2, 1, 9, 9, 8, 4, torch.float32, seed=2)
    attention(q, k, v, 0.5)
    attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), 0.5)
    assert calls == (["compiled"] if compiled.load("attention") is not None else ["blocked"]) + ["blocked"]
