"""Tests of the KDA core ops (docs/architecture.md §3.4–§3.6, §12.3 items 1–3).

Ground truth is `literal_kda`, a float64 loop over batch, head and token written in the compact form
S_t = (I − β_t k_t k_tᵀ) Diag(e^{g_t}) S_{t−1} + β_t k_t v_tᵀ, o_t = S_tᵀ (scale·q_t) of §3.4,
independently of the four-step form used by `recurrent_kda`.
"""
# Shape suffixes: B batch, T time, H heads, K key dim, V value dim.

import functools

import pytest
import torch
import torch.nn.functional as F

import k3.ops.kda.chunk as chunk_module
from k3.ops import compiled
from k3.ops.kda import chunk_kda, cpu, recurrent_kda
from kda_inputs import chunk_backend

B, H, K, V = 2, 2, 24, 40  # K ≠ V: a transposed state fails on shape or value (§3.4)
# the chunkwise algorithm twice: in torch ops and compiled (`k3.ops.kda.cpu`, bounded gates only)
OPS = {"recurrent": recurrent_kda, "chunk": functools.partial(chunk_kda, backend="torch"),
       "compiled": functools.partial(chunk_kda, backend="compiled")}
BOUNDED_ONLY = {"compiled"}
NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def literal_kda(q, k, v, g, beta, scale, initial_state):
    """float64 ground truth, one explicit matrix product at a time."""
    T = q.shape[1]
    o_BTHV = torch.zeros(B, T, H, V, dtype=torch.float64)
    S_BHKV = torch.zeros(B, H, K, V, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            S = initial_state[b, h].double()
            for t in range(T):
                k_t, v_t, beta_t = k[b, t, h].double(), v[b, t, h].double(), beta[b, t, h].double()
                transition = torch.eye(K, dtype=torch.float64) - beta_t * torch.outer(k_t, k_t)
                S = transition @ torch.diag(g[b, t, h].double().exp()) @ S + beta_t * torch.outer(k_t, v_t)
                o_BTHV[b, t, h] = S.T @ (scale * q[b, t, h].double())
            S_BHKV[b, h] = S
    return o_BTHV, S_BHKV


def make_inputs(T, gate="bounded", dtype=torch.float64, seed=0):
    """Random KDA inputs with a non-zero initial state; L2-normalised q and k as the layer provides them."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    x_BTHK = 3 * randn(B, T, H, K)
    if gate == "bounded":
        g_BTHK = -5 * torch.sigmoid(x_BTHK)  # K3 form (§3.3), reaches −4.9999
    else:
        g_BTHK = -7 * F.softplus(3 * x_BTHK)  # Kimi-Linear softplus form, down to ≈ −70 per step and beyond
    inputs = dict(
        q=F.normalize(randn(B, T, H, K), dim=-1),
        k=F.normalize(randn(B, T, H, K), dim=-1),
        v=randn(B, T, H, V),
        g=g_BTHK,
        beta=torch.sigmoid(randn(B, T, H)),
        initial_state=randn(B, H, K, V),
    )
    return {name: x.to(dtype) for name, x in inputs.items()}


def reference(inputs, scale=K**-0.5):
    return literal_kda(**{name: inputs[name] for name in NAMES}, scale=scale)


def max_err(x, y):
    return (x.double() - y.double()).abs().max().item()


def op_fn(op):
    return OPS[chunk_backend(op)]


def run(op, inputs, **kwargs):
    return op_fn(op)(**inputs, output_final_state=True, **kwargs)


def with_gates(gates):
    """(op, gate) pairs: every op with every gate, the compiled kernel with bounded gates only."""
    return [(op, gate) for op in OPS for gate in gates if not (op in BOUNDED_ONLY and gate == "softplus")]


def grads(op, inputs, seed=1):
    """Gradients w.r.t. every input of a random linear function of (o, final state)."""
    leaves = {name: x.detach().clone().requires_grad_() for name, x in inputs.items()}
    o, S = run(op, leaves)
    gen = torch.Generator().manual_seed(seed)
    do, dS = (torch.randn(x.shape, generator=gen, dtype=torch.float64).to(x.dtype) for x in (o, S))
    loss = (o * do).sum() + (S * dS).sum()
    return dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("T", [1, 37, 130, 200])
def test_float64_matches_literal_loop(op, T):
    inputs = make_inputs(T)
    o, S = run(op, inputs)
    o_ref, S_ref = reference(inputs)
    assert o.dtype == S.dtype == torch.float64
    assert max_err(o, o_ref) < 1e-12 and max_err(S, S_ref) < 1e-12


@pytest.mark.parametrize("op", [op for op in OPS if op not in BOUNDED_ONLY])
def test_float64_strong_softplus_gates(op):
    inputs = make_inputs(130, gate="softplus")
    assert inputs["g"].min() < -70
    o, S = run(op, inputs)
    o_ref, S_ref = reference(inputs)
    assert max_err(o, o_ref) < 1e-12 and max_err(S, S_ref) < 1e-12


@pytest.mark.parametrize("op, gate", with_gates(["bounded", "softplus"]))
def test_fp32_close_to_float64(op, gate):
    inputs = make_inputs(200, gate=gate, dtype=torch.float32)
    o, S = run(op, inputs)
    o_ref, S_ref = reference(inputs)  # the same fp32-rounded inputs, computed in float64
    assert o.dtype == S.dtype == torch.float32
    assert max_err(o, o_ref) < 1e-5 and max_err(S, S_ref) < 1e-5


@pytest.mark.parametrize("op, gate", [p for p in with_gates(["bounded", "softplus"]) if p[0] != "recurrent"])
def test_float64_gradients_chunk_vs_recurrent(op, gate):
    inputs = make_inputs(130, gate=gate)
    chunk_grads, recurrent_grads = grads(op, inputs), grads("recurrent", inputs)
    for name in NAMES:
        torch.testing.assert_close(chunk_grads[name], recurrent_grads[name], rtol=1e-10, atol=1e-10, msg=name)


@pytest.mark.parametrize("op, gate", with_gates(["bounded", "at_bound", "softplus"]))
def test_fp32_gradients_finite_and_close(op, gate):
    """No NaN/Inf with every gate at the bound −5 or with softplus gates beyond −70; fp32 ≈ float64 gradients."""
    inputs = make_inputs(130, gate="softplus" if gate == "softplus" else "bounded")
    if gate == "at_bound":
        inputs["g"] = torch.full_like(inputs["g"], -5.0)
    exact = grads("recurrent", inputs)
    fp32 = grads(op, {name: x.float() for name, x in inputs.items()})
    for name in NAMES:
        assert fp32[name].isfinite().all(), name
        assert max_err(fp32[name], exact[name]) < 1e-4 * (1 + exact[name].abs().max().item()), name


@pytest.mark.parametrize("op, gate", [("chunk", "softplus"), ("compiled", "bounded")])
@pytest.mark.parametrize("chunk_size", [1, 16, 24, 32, 128])
def test_chunk_sizes_agree(op, gate, chunk_size):
    inputs = make_inputs(130, gate=gate)
    o, S = run(op, inputs, chunk_size=chunk_size)
    o_64, S_64 = run(op, inputs)
    assert max_err(o, o_64) < 1e-12 and max_err(S, S_64) < 1e-12


@pytest.mark.parametrize("op", ["chunk", "compiled"])
@pytest.mark.parametrize(("T", "chunk_size", "padded"), [(21, 64, 32), (10, 24, 16), (64, 64, 64), (70, 64, 64)])
def test_short_sequence_pads_to_whole_sub_chunks(monkeypatch, op, T, chunk_size, padded):
    """A sequence shorter than a chunk runs as one chunk cut to whole sub-chunks (16, or gcd(chunk_size, 16))."""
    seen = []
    function = chunk_module.cpu.CpuChunkKDAFunction if op == "compiled" else chunk_module.ChunkKDAFunction
    apply = function.apply
    # the chunk length: C of the torch path's [B,H,U,C,K]; the kernel's argument beside its [B,T,H,K] inputs
    length = (lambda a: a[7]) if op == "compiled" else (lambda a: a[0].shape[-2])
    monkeypatch.setattr(function, "apply", lambda *a: seen.append(length(a)) or apply(*a))
    inputs = make_inputs(T)
    o, S = run(op, inputs, chunk_size=chunk_size)
    o_ref, S_ref = reference(inputs)
    assert seen == [padded]
    assert max_err(o, o_ref) < 1e-12 and max_err(S, S_ref) < 1e-12


@pytest.mark.parametrize("op", OPS)
def test_single_token_and_scale(op):
    inputs = make_inputs(1)
    o, S = run(op, inputs, scale=0.3)
    o_ref, S_ref = reference(inputs, scale=0.3)
    assert max_err(o, o_ref) < 1e-14 and max_err(S, S_ref) < 1e-14
    o_default, _ = run(op, inputs)
    o_explicit, _ = run(op, inputs, scale=K**-0.5)
    assert torch.equal(o_default, o_explicit)


@pytest.mark.parametrize("op", OPS)
def test_defaults_zero_state_and_no_final_state(op):
    inputs = make_inputs(37)
    o, S = op_fn(op)(*(inputs[name] for name in NAMES[:5]))
    assert S is None
    o_ref, _ = reference({**inputs, "initial_state": torch.zeros(B, H, K, V, dtype=torch.float64)})
    assert max_err(o, o_ref) < 1e-12


@pytest.mark.parametrize("op", OPS)
def test_empty_sequence(op):
    inputs = make_inputs(0)
    o, S = run(op, inputs)
    assert o.shape == (B, 0, H, V)
    assert torch.equal(S, inputs["initial_state"])


@pytest.mark.parametrize("op", OPS)
def test_low_precision_inputs_compute_in_fp32(op):
    inputs = make_inputs(70, dtype=torch.bfloat16)
    o, S = run(op, inputs)
    o_fp32, S_fp32 = run(op, {name: x.float() for name, x in inputs.items()})
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32  # §0.4: fp32 state
    assert torch.equal(o, o_fp32.bfloat16()) and torch.equal(S, S_fp32)


def poison_after(inputs, t, value):
    """Replace every token from position t on by `value` (g: −|value| so that it stays a valid decay)."""
    poisoned = {name: x.clone() for name, x in inputs.items()}
    for name in ("q", "k", "v", "g", "beta"):
        poisoned[name][:, t:] = -abs(value) if name == "g" else value
    return poisoned


@pytest.mark.parametrize("t", [1, 30, 64])
def test_recurrent_prefix_invariance_under_nan(t):
    inputs = make_inputs(100)
    o, _ = run("recurrent", inputs)
    o_poisoned, _ = run("recurrent", poison_after(inputs, t, float("nan")))
    assert torch.equal(o_poisoned[:, :t], o[:, :t])


@pytest.mark.parametrize("t, value", [(1, 1e4), (30, 1e4), (64, float("nan")), (70, 1e4), (128, float("nan"))])
def test_chunk_prefix_invariance(t, value):
    """Later tokens never reach earlier outputs. NaN only after a chunk boundary: inside a chunk the masked
    entries are exact zeros, but 0·NaN in a matmul is NaN (as in any matmul-based kernel)."""
    inputs = make_inputs(150, gate="softplus")
    o, _ = run("chunk", inputs)
    o_poisoned, _ = run("chunk", poison_after(inputs, t, value))
    assert torch.equal(o_poisoned[:, :t], o[:, :t])


@pytest.mark.parametrize("op", OPS)
def test_split_and_carry_state(op):
    """Pieces [31, 9 × 1, rest] carrying the state equal one call (§12.3 item 3)."""
    inputs = make_inputs(130)
    o, S = run(op, inputs)
    pieces, S_carry, start = [], inputs["initial_state"], 0
    for length in [31] + [1] * 9 + [130 - 40]:
        piece = {name: inputs[name][:, start : start + length] for name in NAMES[:5]}
        o_piece, S_carry = run(op, {**piece, "initial_state": S_carry})
        pieces.append(o_piece)
        start += length
    assert max_err(torch.cat(pieces, 1), o) < 1e-12 and max_err(S_carry, S) < 1e-12


BAD_INPUTS = {
    "q rank": (lambda d: d.update(q=d["q"][0]), "q must be"),
    "k shape": (lambda d: d.update(k=d["k"][..., :-1]), "k has shape"),
    "v shape": (lambda d: d.update(v=d["v"][:, :-1]), "v has shape"),
    "g shape": (lambda d: d.update(g=d["g"][..., :1]), "g has shape"),
    "beta shape": (lambda d: d.update(beta=d["beta"][..., None]), "beta has shape"),
    "state shape": (lambda d: d.update(initial_state=d["initial_state"].transpose(-1, -2)), "initial_state has shape"),
}


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("case", BAD_INPUTS)
def test_invalid_shapes_raise(op, case):
    inputs = make_inputs(5)
    corrupt, message = BAD_INPUTS[case]
    corrupt(inputs)
    with pytest.raises(ValueError, match=message):
        op_fn(op)(**inputs)


@pytest.mark.parametrize("chunk_size", [0, -64, 16.0])
def test_invalid_chunk_size_raises(chunk_size):
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_kda(**make_inputs(5), chunk_size=chunk_size)


def test_auto_backend_takes_the_kernel_only_where_it_applies(monkeypatch):
    """"auto": the compiled kernel for bounded gates on CPU; gates beyond the bound, or a kernel that could not be
    built, run the torch ops with the same results; "compiled" then says why it cannot run."""
    calls = []
    for function in (chunk_module.ChunkKDAFunction, cpu.CpuChunkKDAFunction):
        apply = function.apply
        monkeypatch.setattr(function, "apply", lambda *a, f=function, apply=apply: calls.append(f) or apply(*a))
    bounded, softplus = make_inputs(40), make_inputs(40, gate="softplus")
    o_auto, _ = chunk_kda(**softplus)
    o_torch, _ = chunk_kda(**softplus, backend="torch")
    assert calls == [chunk_module.ChunkKDAFunction] * 2 and torch.equal(o_auto, o_torch)
    with pytest.raises(ValueError, match="backend 'compiled' needs CPU tensors, gates above -5.33 per token"):
        chunk_kda(**softplus, backend="compiled")
    nan_gates = {**bounded, "g": bounded["g"].index_fill(1, torch.tensor([3]), float("nan"))}
    with pytest.raises(ValueError, match="needs CPU tensors, gates without NaN"):
        chunk_kda(**nan_gates, backend="compiled", chunk_size=1)  # sub-chunks of 1 token: any finite gate
    monkeypatch.setattr(compiled, "build", lambda name: (None, "RuntimeError: no compiler"))
    calls.clear()
    with pytest.warns(UserWarning, match=r"the compiled kda kernel is unavailable \(RuntimeError: no compiler\)"):
        o_auto, _ = chunk_kda(**bounded)
    assert calls == [chunk_module.ChunkKDAFunction] and max_err(o_auto, reference(bounded)[0]) < 1e-12
    with pytest.raises(ValueError, match="could not be built here"), pytest.warns(UserWarning):
        chunk_kda(**bounded, backend="compiled")
    with pytest.raises(ValueError, match="backend must be one of 'auto', 'torch', 'compiled', got 'fast'"):
        chunk_kda(**bounded, backend="fast")
