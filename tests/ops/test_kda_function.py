"""The hand-derived backward of the chunkwise KDA core (`ChunkKDAFunction`, docs/architecture.md §3.5, §3.6, §3.8),
in torch ops and compiled (`k3.ops.kda.cpu`, K3's bounded gates).

Every gradient (q, k, v, g, β, initial state) of `chunk_kda` against autograd through the token-by-token
reference `recurrent_kda` (§3.4), in float64 to ~1e-10 and in float32 within a stated tolerance; with K ≠ V, T not
a multiple of the chunk size, several chunk sizes, state resets (§3.8) and with the final state used or not.
"""
# Shape suffixes: B batch, T time, H heads, K key dim, V value dim, U chunks.

import contextlib
import functools
import math

import pytest
import torch
import torch.nn.functional as F

from k3.ops.kda import chunk_kda, recurrent_kda
from k3.ops.kda import function
from kda_inputs import CHUNK_BACKENDS, chunk_backend

B, H, K, V = 2, 3, 12, 20  # K ≠ V
NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def make_inputs(T, gate="bounded", dtype=torch.float64, seed=0, b=B, h=H, k=K, v=V):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    x = 3 * randn(b, T, h, k)
    g = -5 * torch.sigmoid(x) if gate == "bounded" else -7 * F.softplus(3 * x)  # K3 gate (§3.3) or softplus
    inputs = dict(q=F.normalize(randn(b, T, h, k), dim=-1), k=F.normalize(randn(b, T, h, k), dim=-1),
                  v=randn(b, T, h, v), g=g, beta=torch.sigmoid(randn(b, T, h)), initial_state=randn(b, h, k, v))
    return {name: t.to(dtype) for name, t in inputs.items()}


def segmented_recurrent(inputs, chunk_size, reset_chunks, output_final_state):
    """`recurrent_kda` restarted from a zero state at every reset chunk: the meaning of `reset_chunks` (§3.8)."""
    T = inputs["q"].shape[1]
    o_rows, S_rows = [], []
    for b in range(inputs["q"].shape[0]):
        starts = [n * chunk_size for n in range(1, reset_chunks.shape[1]) if reset_chunks[b, n]]
        S = inputs["initial_state"][b:b + 1] * (0 if reset_chunks[b, 0] else 1)
        pieces = []
        for start, end in zip([0] + starts, starts + [T]):
            if start > 0:
                S = torch.zeros_like(S)  # a new sequence starts at this chunk
            piece = {name: inputs[name][b:b + 1, start:end] for name in NAMES[:5]}
            o, S = recurrent_kda(**piece, initial_state=S, output_final_state=True)
            pieces.append(o)
        o_rows.append(torch.cat(pieces, 1))
        S_rows.append(S)
    return torch.cat(o_rows), (torch.cat(S_rows) if output_final_state else None)


def losses_and_grads(op, inputs, output_final_state=True, seed=1, forward_context=contextlib.nullcontext, **kwargs):
    """(o, S, gradients of a random linear function of o and S w.r.t. every input); the op runs inside
    `forward_context()`, the loss and the backward outside it."""
    leaves = {name: t.detach().clone().requires_grad_() for name, t in inputs.items()}
    with forward_context():
        o, S = op(leaves, output_final_state=output_final_state, **kwargs)
    gen = torch.Generator().manual_seed(seed)
    loss = (o * torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)).sum()
    if output_final_state:
        loss = loss + (S * torch.randn(S.shape, generator=gen, dtype=torch.float64).to(S.dtype)).sum()
    return o, S, dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))


def chunked(inputs, **kwargs):
    return chunk_kda(**inputs, **kwargs)


@pytest.fixture(params=CHUNK_BACKENDS)
def backend(request):
    return chunk_backend(request.param)


def recurrent(inputs, **kwargs):
    return recurrent_kda(**inputs, **kwargs)


def assert_all_close(chunk_result, reference_result, tol):
    (o, S, grads), (o_ref, S_ref, grads_ref) = chunk_result, reference_result
    torch.testing.assert_close(o, o_ref, rtol=tol, atol=tol, msg="o")
    assert (S is None) == (S_ref is None)
    if S is not None:
        torch.testing.assert_close(S, S_ref, rtol=tol, atol=tol, msg="final state")
    for name in NAMES:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=tol, atol=tol, msg=f"d{name}")


@pytest.mark.parametrize("chunk_size, T", [(64, 150), (16, 45), (24, 50), (8, 8), (5, 13)])
@pytest.mark.parametrize("output_final_state", [True, False])
def test_float64_every_gradient_matches_recurrent(backend, chunk_size, T, output_final_state):
    inputs = make_inputs(T)
    assert_all_close(losses_and_grads(chunked, inputs, output_final_state, chunk_size=chunk_size, backend=backend),
                     losses_and_grads(recurrent, inputs, output_final_state), 1e-10)


def test_float64_strong_softplus_gates_every_gradient():
    """Unbounded gates far beyond fp32's exp range inside one chunk: nothing excluded is ever exponentiated."""
    inputs = make_inputs(70, gate="softplus")
    assert inputs["g"].min() < -70
    assert_all_close(losses_and_grads(chunked, inputs, chunk_size=32),
                     losses_and_grads(recurrent, inputs), 1e-10)


@pytest.mark.parametrize("output_final_state", [True, False])
def test_float64_reset_chunks_every_gradient(backend, output_final_state):
    """A reset zeroes the state entering the chunk (§3.8); the initial state's gradient stops there."""
    chunk_size, T = 8, 37
    inputs = make_inputs(T)
    reset = torch.tensor([[False, True, False, True, True], [True, False, False, True, False]])
    chunk_result = losses_and_grads(chunked, inputs, output_final_state, chunk_size=chunk_size, reset_chunks=reset,
                                    backend=backend)
    reference_result = losses_and_grads(
        lambda x, output_final_state: segmented_recurrent(x, chunk_size, reset, output_final_state), inputs,
        output_final_state)
    assert_all_close(chunk_result, reference_result, 1e-10)
    assert chunk_result[2]["initial_state"][1].abs().max() == 0  # row 1 resets its first chunk


def test_only_the_final_state_or_only_the_output_is_used(backend):
    """Unused outputs arrive in backward as None (no zero tensors materialised) and give the same gradients."""
    inputs = make_inputs(40)
    for use in ("o", "S"):
        grads = []
        for op, kwargs in ((chunked, dict(chunk_size=16, backend=backend)), (recurrent, {})):
            leaves = {name: t.clone().requires_grad_() for name, t in inputs.items()}
            o, S = op(leaves, output_final_state=True, **kwargs)
            loss = (o.sin() if use == "o" else S.cos()).sum()
            grads.append(torch.autograd.grad(loss, list(leaves.values()), allow_unused=True))
        for name, ours, ref in zip(NAMES, *grads):
            ref = torch.zeros_like(ours) if ref is None else ref  # q does not reach the final state
            torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-10, msg=f"{use}: d{name}")


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
def test_bounded_gate_matmul_path_equals_the_pairwise_path(monkeypatch, dtype, tol):
    """K3's bounded gates take the all-matmul diagonal blocks (§3.6 bound); forcing the pairwise path gives the
    same outputs and gradients (float64 to rounding, fp32 within 2e-6 of the largest magnitude)."""
    inputs = make_inputs(100, dtype=dtype)
    inputs["g"][:, :40] = -5.0  # at the bound: −75 nats across a sub-chunk
    fast = losses_and_grads(chunked, inputs, backend="torch")
    monkeypatch.setattr(function, "MAX_EXPONENT", -1.0)  # no gate passes: pairwise diagonal blocks
    pairwise = losses_and_grads(chunked, inputs, backend="torch")
    for name, ours, ref in [("o", fast[0], pairwise[0]), ("S", fast[1], pairwise[1]),
                            *((f"d{n}", fast[2][n], pairwise[2][n]) for n in NAMES)]:
        assert (ours - ref).abs().max() <= tol * (1 + ref.abs().max()), name


def test_bounded_path_is_taken_only_within_the_bound():
    """The all-matmul diagonal blocks need every sub-chunk to decay by at most `MAX_EXPONENT` nats."""
    k_BHUCK = torch.ones(1, 1, 1, 32, 4)

    def pairwise(g_BHUCK):
        return function._score_factors(k_BHUCK, g_BHUCK, 16).pairs_BHUuYK is not None

    g_BHUCK = torch.full((1, 1, 1, 32, 4), -5.0)
    assert not pairwise(g_BHUCK)  # K3's bound: 15 · 5 = 75 ≤ 80 nats across a sub-chunk
    assert pairwise(1.1 * g_BHUCK)  # 82.5 nats
    assert pairwise(g_BHUCK.index_fill(-2, torch.tensor([3]), math.nan))


def test_gradcheck_tiny_double(backend):
    """torch.autograd.gradcheck (finite differences) of the Function itself, with a reset and a ragged T."""
    inputs = make_inputs(7, b=2, h=1, k=3, v=2)
    reset = torch.tensor([[False, False, True, False], [False, True, False, False]])
    leaves = [inputs[name].clone().requires_grad_() for name in NAMES]

    def op(q, k, v, g, beta, initial_state):
        o, S = chunk_kda(q, k, v, g, beta, initial_state=initial_state, output_final_state=True, chunk_size=2,
                         reset_chunks=reset, scale=0.7, backend=backend)
        return o, S

    assert torch.autograd.gradcheck(op, leaves, eps=1e-6, atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("backend, gate, forward_tol, gradient_tol",
                         [("torch", "bounded", 2e-6, 5e-6), ("compiled", "bounded", 2e-6, 5e-6),
                          ("torch", "softplus", 2e-5, 1e-4)])
def test_float32_close_to_float64(backend, gate, forward_tol, gradient_tol):
    """fp32 forward and gradients vs the float64 recurrence on the same fp32-rounded inputs, relative to
    1 + the largest magnitude. Measured: ≤ 4e-7 / 7e-7 with K3's gates, ≤ 3e-6 / 1e-5 with softplus gates down to
    −70 per step (as before the hand-derived backward)."""
    inputs32 = make_inputs(200, gate=gate, dtype=torch.float32)
    o, S, grads = losses_and_grads(chunked, inputs32, backend=chunk_backend(backend))
    o_ref, S_ref, grads_ref = losses_and_grads(recurrent, {name: t.double() for name, t in inputs32.items()})
    assert o.dtype == S.dtype == torch.float32
    for name, ours, ref, tol in [("o", o, o_ref, forward_tol), ("S", S, S_ref, forward_tol),
                                 *((f"d{n}", grads[n], grads_ref[n], gradient_tol) for n in NAMES)]:
        assert ours.isfinite().all(), name
        assert (ours.double() - ref).abs().max() <= tol * (1 + ref.abs().max()), name


def test_saves_only_the_inputs_and_the_chunk_states(backend):
    """Memory linear in T: what the Function keeps for backward is its inputs (the compiled one: e^g for g) and one
    [K,V] state per chunk."""
    T, chunk_size = 100, 16
    inputs = {name: t.requires_grad_() for name, t in make_inputs(T).items()}
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        chunk_kda(**inputs, chunk_size=chunk_size, backend=backend)
    n_chunks = -(-T // chunk_size)
    if backend == "compiled":  # token-major [B,T',H,·] inputs (T' = whole chunks) and the [B,H,U,K,V] states
        Tp = n_chunks * chunk_size
        expected = [(B, Tp, H, K)] * 3 + [(B, Tp, H, V), (B, Tp, H), (B, H, n_chunks, K, V)]
    else:  # the [B,H,U,C,·] chunks and the [B,H,U,K,V] states
        expected = [(B, H, n_chunks, chunk_size, K)] * 3 + [(B, H, n_chunks, chunk_size, V),
                                                            (B, H, n_chunks, chunk_size, 1), (B, H, n_chunks, K, V)]
    function_saved = [tuple(t.shape) for t in saved if tuple(t.shape) in set(expected)]
    assert sorted(function_saved) == sorted(expected)


@pytest.mark.parametrize("op", ["torch", "compiled", "recurrent"])
def test_autocast_leaves_the_core_in_fp32(op):
    """Under a caller's bf16 autocast (a bf16 training step) the core computes in fp32 exactly as without it, and
    its backward runs: autocast used to turn the Function's forward matmuls to bf16, and the backward (run
    outside autocast) then failed on bf16 gradients meeting fp32 operands."""
    inputs32 = make_inputs(40, dtype=torch.float32)
    run = recurrent if op == "recurrent" else functools.partial(chunked, chunk_size=16, backend=chunk_backend(op))
    plain = losses_and_grads(run, inputs32)
    mixed = losses_and_grads(run, inputs32, forward_context=lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    assert mixed[0].dtype == mixed[1].dtype == torch.float32
    assert_all_close(mixed, plain, tol=0)
