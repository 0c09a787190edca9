"""`k3.ops.decode`: the fused one-token operations against their formulas, and the calls they leave to torch."""

import contextlib
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from k3.model.attn_res import attn_res_mix
from k3.ops import compiled, decode
from k3.ops.mxfp4 import MXFP4Weight, decode_mxfp4
from k3.ops.norm import RMSNorm, l2_normalize, rms_normalize

pytestmark = pytest.mark.skipif(compiled.build("decode")[0] is None,
                                reason="the compiled decode kernel could not be built here")


def randn(*shape, seed=0, scale=1.0, dtype=torch.float32):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (scale * x).to(dtype)


@contextlib.contextmanager
def num_threads(n: int):
    """torch's intra-op threads set to n inside, restored after."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("shape", [(1, 1, 200), (2, 1, 37), (4, 64), (3,)])
@pytest.mark.parametrize("mean", [True, False])
@pytest.mark.parametrize("gain", [True, False])
def test_norms_match_the_float64_formula(shape, mean, gain):
    """RMS (mean of squares) and L2 (sum of squares) normalisation with and without a gain, up to `MAX_ROWS`
    rows, odd widths, inputs far from unit scale (ε matters at 1e-3)."""
    x, w = randn(*shape, scale=1e-3), randn(shape[-1], seed=1) if gain else None
    with torch.no_grad():
        y = decode.rms_norm(x, w, 1e-6, mean=mean)
    x64 = x.double()
    ss = x64.pow(2).mean(-1, keepdim=True) if mean else x64.pow(2).sum(-1, keepdim=True)
    expected = x64 / torch.sqrt(ss + 1e-6) * (1 if w is None else w.double())
    assert y.shape == x.shape and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), expected, rtol=2e-6, atol=1e-7)


def test_norm_module_and_functions_take_the_kernel_when_decoding(monkeypatch):
    """`RMSNorm`, `rms_normalize` and `l2_normalize` on one row without grad: the kernel, within fp32 rounding of
    the torch ops (with grad, the norm kernel serves)."""
    calls = []
    kernel, load = compiled.load("decode"), compiled.load
    spy = SimpleNamespace(rms_norm=lambda *args: (calls.append(args[1] is not None), kernel.rms_norm(*args))[1])
    monkeypatch.setattr(decode.compiled, "load", lambda name: spy if name == "decode" else load(name))
    norm = RMSNorm(96, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(randn(96, seed=2))
    x = randn(1, 1, 96, seed=3)
    with torch.no_grad():
        fused = [f(x) for f in (norm, lambda x: rms_normalize(x, 1e-5), l2_normalize)]
    assert calls == [True, False, False]  # with the gain once, then without
    reference = [norm.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5),  # the formulas in torch ops
                 x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5), x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)]
    assert len(calls) == 3
    for a, b in zip(fused, reference):
        torch.testing.assert_close(a, b.detach(), rtol=1e-6, atol=1e-7)


def mix_inputs(n_sources: int, shape=(2, 1, 80)):
    """Sources of very different scales (the embedding is small, block sums large), a random gain and query."""
    sources = [randn(*shape, seed=10 + i, scale=0.05 * 10 ** (i % 3)) + 0.1 * i for i in range(n_sources)]
    norm, proj = RMSNorm(shape[-1], eps=1e-5), nn.Linear(shape[-1], 1, bias=False)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * randn(shape[-1], seed=4))
        proj.weight.copy_(0.5 * randn(1, shape[-1], seed=5))
    return sources, norm, proj


@pytest.mark.parametrize("n_sources", [1, 2, 5])
def test_attn_res_mix_matches_the_torch_ops(monkeypatch, n_sources):
    """The fused mix equals `attn_res_mix`'s torch ops (the kernel unbuilt) and its float64 value."""
    sources, norm, proj = mix_inputs(n_sources)
    with torch.no_grad():
        fused = decode.attn_res_mix(sources, norm.weight, proj.weight[0], norm.eps)
        assert fused is not None and torch.equal(attn_res_mix(sources, norm, proj), fused)
        monkeypatch.setattr(compiled, "build", lambda name: (None, "off"))
        with pytest.warns(UserWarning, match="unavailable"):
            torch_ops = attn_res_mix(sources, norm, proj)
        reference = attn_res_mix([s.double() for s in sources], norm.double(), proj.double())
    torch.testing.assert_close(fused, torch_ops, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fused.double(), reference, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", ["grad", "many rows", "float64", "float16", "unbuilt", "shapes differ"])
def test_other_calls_are_left_to_the_torch_ops(monkeypatch, case):
    """Autograd, more than `MAX_ROWS` rows, other dtypes, sources of different shapes, an unbuilt kernel: None,
    and the callers' torch ops serve."""
    dtype = {"float64": torch.float64, "float16": torch.float16}.get(case, torch.float32)
    shape = (decode.MAX_ROWS + 1, 1, 16) if case == "many rows" else (1, 1, 16)
    sources, norm, proj = mix_inputs(2, shape)
    sources = [s.to(dtype) for s in sources]
    if case == "shapes differ":
        sources[1] = sources[1][:, :, :8]
    if case == "unbuilt":
        monkeypatch.setattr(compiled, "build", lambda name: (None, "RuntimeError: no compiler"))
    warns = pytest.warns(UserWarning, match="unavailable") if case == "unbuilt" else contextlib.nullcontext()
    with torch.set_grad_enabled(case == "grad"), warns:
        if case != "shapes differ":
            assert decode.rms_norm(sources[0], None, 1e-5) is None
        assert decode.attn_res_mix(sources, norm.weight, proj.weight[0], 1e-5) is None


# latent widths C + R: 26 (the scores row by row), 24 (a multiple of 8: eight rows at once on AVX2 / AVX-512 builds)
LATENT_C = [20, 18]


@pytest.mark.parametrize("C", LATENT_C)
@pytest.mark.parametrize("threads,H", [(1, 3), (2, 3), (2, 1), (2, 2), (2, 4), (2, 5), (2, 8), (2, 9)])
def test_mla_step_matches_the_formula_over_long_caches(threads, H, C):
    """`mla_step` over 300 of 320 cached positions (several blocks, split over the threads, a last block of 44 rows),
    H heads (blocks of 1, 2, 4 or 8 heads, partly padded for 3, 5 and 9), B = 2, distinct widths (N 5, R 6, C, Vh 7),
    with and without the gate: the float64 formula softmax([W_UKᵀ q_nope ‖ q_pe]·latent·scale) → W_UV Σ p ĉ →
    σ(gate)."""
    B, N, R, Vh, S = 2, 5, 6, 7, 300
    q, latent = randn(B, 1, H, N + R, seed=20), randn(B, 320, C + R, seed=21)
    kv_b, gate = randn(H * (N + Vh), C, seed=22, scale=0.3), randn(B, 1, H * Vh, seed=23)
    W = kv_b.double().view(H, N + Vh, C)
    q_lat = torch.cat([torch.einsum("bhn,hnc->bhc", q[:, 0, :, :N].double(), W[:, :N]), q[:, 0, :, N:].double()], -1)
    p = torch.softmax(torch.einsum("bhl,bsl->bhs", q_lat, latent[:, :S].double()) * 0.25, -1)
    o = torch.einsum("bhc,hvc->bhv", torch.einsum("bhs,bsc->bhc", p, latent[:, :S, :C].double()), W[:, N:])
    with num_threads(threads), torch.no_grad():
        plain = decode.mla_step(q, latent, S, kv_b, N, Vh, None, 0.25)
        gated = decode.mla_step(q, latent, S, kv_b, N, Vh, gate, 0.25)
    torch.testing.assert_close(plain.double(), o.reshape(B, H * Vh), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gated.double(), (o.reshape(B, H * Vh) * torch.sigmoid(gate[:, 0].double())),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("latent_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("trend", ["rising", "falling", "spike"])
def test_mla_step_over_scores_far_apart(trend, latent_dtype):
    """Scores spread over tens of units along 1,000 positions (rising: the softmax's shift moves in block after block,
    past its headroom of 8; falling: the first block holds the largest; spike: one position far above the rest in
    the middle of a task), over an fp32 or a bf16 latent cache: the float64 formula over the latents as stored."""
    B, H, N, R, C, Vh, S = 1, 2, 5, 6, 18, 7, 1000
    q, kv_b = randn(B, 1, H, N + R, seed=27), randn(H * (N + Vh), C, seed=28, scale=0.3)
    latent = randn(B, S, C + R, seed=29)
    spread = {"rising": torch.linspace(0.1, 12, S), "falling": torch.linspace(12, 0.1, S),
              "spike": torch.ones(S).index_fill(0, torch.tensor([700]), 40.0)}[trend]
    latent = (latent * spread[None, :, None]).to(latent_dtype)
    W = kv_b.double().view(H, N + Vh, C)
    q_lat = torch.cat([torch.einsum("bhn,hnc->bhc", q[:, 0, :, :N].double(), W[:, :N]), q[:, 0, :, N:].double()], -1)
    scores = torch.einsum("bhl,bsl->bhs", q_lat, latent.double())
    assert scores.amax(-1).min() - scores.amin(-1).max() > 3 * 8  # far beyond the headroom
    o = torch.einsum("bhc,hvc->bhv", torch.einsum("bhs,bsc->bhc", torch.softmax(scores, -1), latent[..., :C].double()),
                     W[:, N:])
    with num_threads(2), torch.no_grad():
        out = decode.mla_step(q, latent, S, kv_b, N, Vh, None, 1.0)
    torch.testing.assert_close(out.double(), o.reshape(B, H * Vh), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("C", LATENT_C)
def test_mla_step_reads_each_row_from_its_first_position(C):
    """Left-padded rows (a batch of sequences of different lengths): row b attends to positions first[b]..S-1 only,
    the float64 formula over those positions; first 0 is the whole row."""
    B, H, N, R, Vh, S = 3, 2, 5, 6, 7, 300
    first = torch.tensor([0, 37, 299])
    q, latent = randn(B, 1, H, N + R, seed=24), randn(B, 320, C + R, seed=25)
    kv_b = randn(H * (N + Vh), C, seed=26, scale=0.3)
    W = kv_b.double().view(H, N + Vh, C)
    with torch.no_grad():
        out = decode.mla_step(q, latent, S, kv_b, N, Vh, None, 0.25, first)
    for b in range(B):
        lat = latent[b, first[b]:S].double()
        q_lat = torch.cat([torch.einsum("hn,hnc->hc", q[b, 0, :, :N].double(), W[:, :N]), q[b, 0, :, N:].double()], -1)
        p = torch.softmax(q_lat @ lat.T * 0.25, -1)
        o = torch.einsum("hc,hvc->hv", p @ lat[:, :C], W[:, N:])
        torch.testing.assert_close(out[b].double(), o.reshape(-1), rtol=1e-5, atol=1e-6)


# ---- bf16: each operation on bf16 tensors is the same operation on their fp32 values, its result rounded once ----

def bf16(*tensors):
    return [t.to(torch.bfloat16) for t in tensors]


def widened(*tensors):
    """The fp32 values of bf16 tensors (exact), fp32 tensors unchanged (the fp32 set of §0.4)."""
    return [t.float() for t in tensors]


@pytest.mark.parametrize("rows", [1, 4])
def test_bf16_norms_and_mix_are_the_fp32_ones_rounded_once(rows):
    """RMSNorm (bf16 gain) returns x's dtype, the plain and L2 norms fp32 (the torch ops' contracts), the AttnRes mix
    its sources' dtype; each equals, bit for bit, the kernel's fp32 result on the widened values, rounded once where
    its dtype is bf16. Widths 37 and 200: not whole vectors."""
    for width in (37, 200):
        x, gain = bf16(randn(rows, 1, width, scale=3.0), 1 + 0.3 * randn(width, seed=1))
        sources, norm, proj = mix_inputs(3, (rows, 1, width))
        sources, (gamma, query) = bf16(*sources), bf16(norm.weight.detach(), proj.weight.detach()[0])
        with torch.no_grad():
            y = decode.rms_norm(x, gain, 1e-5)
            assert torch.equal(y, decode.rms_norm(*widened(x, gain), 1e-5).to(torch.bfloat16))
            for mean in (True, False):
                plain = decode.rms_norm(x, None, 1e-6, mean=mean)
                assert plain.dtype == torch.float32 and torch.equal(plain, decode.rms_norm(x.float(), None, 1e-6, mean))
            mix = decode.attn_res_mix(sources, gamma, query, 1e-5)
            assert torch.equal(mix, decode.attn_res_mix(widened(*sources), *widened(gamma, query), 1e-5).to(
                torch.bfloat16))


def test_bf16_kda_step_is_the_fp32_step_rounded_once():
    """A bf16 model's KDA step: bf16 projections and conv windows, the fp32 tensors of §0.4 and the fp32 state. The
    output is the fp32 step's on the widened values rounded once to bf16, the state the fp32 step's, the windows its
    inputs (bf16 already: stored exactly). K = 20, not a whole vector."""
    B, H, K, W = 2, 3, 20, 4
    P = H * K
    q, k, v, f, z = bf16(*(randn(B, P, seed=s) for s in range(5)))
    b, windows = bf16(randn(B, H, seed=5), randn(B, 3, W - 1, P, seed=6))
    convs = [0.5 * randn(P, 1, W, seed=7 + i) for i in range(3)]
    A_log, dt_bias, o_norm = 0.3 * randn(H, seed=10), 0.5 * randn(P, seed=11), 1 + 0.2 * randn(K, seed=12)
    state = 0.1 * randn(B, H, K, K, seed=13)
    fp32_windows, fp32_state = windows.float(), state.clone()
    with torch.no_grad():
        out = decode.kda_step(q, k, v, windows, convs, f, A_log, dt_bias, -5.0, b, state, z, o_norm, 1e-5)
        expected = decode.kda_step(*widened(q, k, v), fp32_windows, convs, f.float(), A_log, dt_bias, -5.0,
                                   b.float(), fp32_state, z.float(), o_norm, 1e-5)
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected.to(torch.bfloat16))
    assert torch.equal(state, fp32_state) and torch.equal(windows, fp32_windows.to(torch.bfloat16))


@pytest.mark.parametrize("rows", [1, 3, 16])
def test_bf16_moe_routed_is_the_fp32_one_rounded_once(rows):
    """Router and routed experts with bf16 weights (the router bias fp32): the fp32 result on the widened values,
    rounded once to z's dtype (bf16). Widths D 37, L 21, M 27: not whole vectors."""
    D, L, M, E = 37, 21, 27, 6
    x, z = bf16(randn(rows, D, seed=1), randn(rows, L, seed=2))
    gate, w1, w3, w2 = bf16(randn(E, D, seed=3), randn(E, M, L, seed=4), randn(E, M, L, seed=5), randn(E, L, M, seed=6))
    bias = 0.1 * randn(E, seed=7)
    with torch.no_grad():
        r = decode.moe_routed(x, z, gate, bias, w1, w3, w2, 2, True, 2.5, (4.0, 25.0))
        expected = decode.moe_routed(*widened(x, z, gate), bias, *widened(w1, w3, w2), 2, True, 2.5, (4.0, 25.0))
    assert r.dtype == torch.bfloat16 and torch.equal(r, expected.to(torch.bfloat16))


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_routed_with_mxfp4_experts_equals_their_decoded_weights(rows, dtype):
    """Router and routed experts with MXFP4 experts (each block decoded in registers): the result of the same call
    on the decoded dense weights, to fp32 rounding (the blocks are summed scaled, a dense row plainly), in the
    activations' dtype. L 64 and M 96 (whole MXFP4 groups), D 37."""
    D, L, M, E = 37, 64, 96, 6
    x, z = randn(rows, D, seed=1, dtype=dtype), randn(rows, L, seed=2, dtype=dtype)
    gate, bias = randn(E, D, seed=3, dtype=dtype), 0.1 * randn(E, seed=7)
    packed = [MXFP4Weight(E, *shape).quantize_(randn(E, *shape, seed=seed))
              for seed, shape in ((4, (M, L)), (5, (M, L)), (6, (L, M)))]
    dense = [decode_mxfp4(w.weight_packed, w.weight_scale, torch.float32) for w in packed]
    with torch.no_grad():
        r = decode.moe_routed(x, z, gate, bias, *packed, 2, True, 2.5, (4.0, 25.0))
        expected = decode.moe_routed(x.float(), z.float(), gate.float(), bias, *dense, 2, True, 2.5, (4.0, 25.0))
    assert r is not None and r.dtype == dtype
    torch.testing.assert_close(r.float(), expected.to(dtype).float(), rtol=0,
                               atol=(1e-5 if dtype == torch.float32 else 2 ** -7) * expected.abs().max().item())


def routed_inputs(form: str, rows: int, E: int):
    """x [rows, 37], z [rows, 64], the router's weight and bias, and the experts' w1, w3 [E, 96, 64] and w2 [E, 64,
    96] of a routed-experts call, dense fp32 or MXFP4 (`form`; L 64 and M 96: whole MXFP4 groups)."""
    D, L, M = 37, 64, 96
    x, z = randn(rows, D, seed=1), randn(rows, L, seed=2)
    gate, bias = randn(E, D, seed=3), 0.1 * randn(E, seed=7)
    shapes = ((4, (M, L)), (5, (M, L)), (6, (L, M)))
    if form == "mxfp4":
        experts = [MXFP4Weight(E, *shape).quantize_(randn(E, *shape, seed=seed)) for seed, shape in shapes]
    else:
        experts = [randn(E, *shape, seed=seed) for seed, shape in shapes]
    return x, z, gate, bias, experts


@pytest.mark.parametrize("form", ["fp32", "mxfp4"])
def test_moe_routed_rows_equal_their_one_row_calls(form):
    """16 rows over 3 experts, top 2 (10 or so tokens per expert: tiles of 3 and 2, more than one MXFP4 pass of 8):
    each row's output equals the same row routed alone, bit for bit."""
    rows = 16
    x, z, gate, bias, experts = routed_inputs(form, rows, E=3)
    with torch.no_grad():
        r = decode.moe_routed(x, z, gate, bias, *experts, 2, True, 2.5, (4.0, 25.0))
        alone = torch.cat([decode.moe_routed(x[i:i + 1], z[i:i + 1], gate, bias, *experts, 2, True, 2.5, (4.0, 25.0))
                           for i in range(rows)])
    assert torch.equal(r, alone)


@pytest.mark.parametrize("form", ["fp32", "mxfp4"])
@pytest.mark.parametrize("rows", [1, 16])
def test_moe_routed_is_the_same_on_any_number_of_threads(form, rows):
    """The routed experts' tasks (whole experts, or slices of each where there are fewer experts than twice the
    threads: 1 token on 5 threads, 2 experts in 5 slices) give the same output bit for bit on 1, 2 and 5 threads."""
    x, z, gate, bias, experts = routed_inputs(form, rows, E=5)
    outputs = []
    for threads in (1, 2, 5):
        with num_threads(threads), torch.no_grad():
            outputs.append(decode.moe_routed(x, z, gate, bias, *experts, 2, True, 2.5, (4.0, 25.0)))
    assert all(torch.equal(outputs[0], out) for out in outputs[1:])


@pytest.mark.parametrize("C", LATENT_C)
def test_bf16_mla_step_is_the_fp32_step_rounded_once(C):
    """Absorbed MLA over a bf16 latent cache with a bf16 kv_b weight and gate: the fp32 step on the widened values
    (over 300 positions, several blocks and tasks), rounded once to bf16 (within one bf16 rounding: bf16 rows are
    taken 64 per block, fp32 rows 32, so the fp32 sums round differently); the same shapes as the fp32 test above."""
    B, H, N, R, Vh, S = 2, 3, 5, 6, 7, 300
    q, latent = bf16(randn(B, 1, H, N + R, seed=20), randn(B, 320, C + R, seed=21))
    kv_b, gate = bf16(randn(H * (N + Vh), C, seed=22, scale=0.3), randn(B, 1, H * Vh, seed=23))
    with torch.no_grad():
        o = decode.mla_step(q, latent, S, kv_b, N, Vh, gate, 0.25)
        expected = decode.mla_step(*widened(q, latent), S, kv_b.float(), N, Vh, gate.float(), 0.25)
    assert o.dtype == torch.bfloat16
    torch.testing.assert_close(o.float(), expected, rtol=2**-8, atol=1e-6)
