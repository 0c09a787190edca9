"""Muon and NS5 (docs/architecture.md §8.2–§8.4, §12.3 item 16): singular-value band, batching, agreement with
`torch.optim.Muon`, and block views (per head, K/V split, per expert, columns) equal to separate matrices."""

from __future__ import annotations

import pytest
import torch
import torch.optim._muon as torch_muon

from k3.optim.muon import Muon, newton_schulz5, orthogonalized_update, orthogonalized_updates

FP32_NS = dict(ns_dtype=torch.float32)


def random_with_singular_values(rows: int, cols: int, singular_values: torch.Tensor, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    U, _ = torch.linalg.qr(torch.randn(rows, rows, generator=gen))
    V, _ = torch.linalg.qr(torch.randn(cols, cols, generator=gen))
    k = len(singular_values)
    return U[:, :k] @ torch.diag(singular_values) @ V[:, :k].T


@pytest.mark.parametrize("shape", [(64, 24), (24, 64), (40, 40)])
@pytest.mark.parametrize("ns_dtype", [torch.float32, torch.bfloat16])
def test_ns5_singular_values_in_band(shape, ns_dtype):
    """Random and ill-conditioned (condition number 100) inputs, tall, wide and square: σ(NS5(U)) ⊂ [0.5, 1.5]
    (observed ≈ [0.68, 1.2]); the output keeps U's shape and dtype."""
    k = min(shape)
    inputs = [torch.randn(shape, generator=torch.Generator().manual_seed(0)),
              random_with_singular_values(*shape, torch.logspace(0, -2, k), seed=1),
              1e3 * random_with_singular_values(*shape, torch.logspace(0, -2, k), seed=2)]
    for U in inputs:
        O = newton_schulz5(U, ns_dtype=ns_dtype)
        assert O.shape == U.shape and O.dtype == U.dtype
        s = torch.linalg.svdvals(O.double())
        assert 0.5 <= s.min() and s.max() <= 1.5, (s.min(), s.max())


def test_ns5_batched_equals_per_matrix():
    """Every matrix of a [2, 3, A, B] batch is normalised by its own norm: batched = one at a time."""
    for A, B in ((20, 12), (12, 20)):
        scales = torch.tensor([1e-3, 1.0, 1e3]).view(1, 3, 1, 1)
        U = torch.randn(2, 3, A, B, generator=torch.Generator().manual_seed(0)) * scales
        O = newton_schulz5(U, **FP32_NS)
        for i in range(2):
            for j in range(3):
                torch.testing.assert_close(O[i, j], newton_schulz5(U[i, j], **FP32_NS), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("ns_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split, sizes", [("none", ()), ("rows", (32,)), ("rows", (32, 16)), ("cols", (16,))])
def test_updates_of_several_tensors_equal_each_alone(ns_dtype, split, sizes):
    """Muon orthogonalises all blocks of one shape in a group with one batched call: bit for bit what each
    tensor gets on its own (distinct shapes, a batch axis, blocks of two sizes)."""
    gen = torch.Generator().manual_seed(0)
    Us = [torch.randn(96, 48, generator=gen), torch.randn(3, 96, 48, generator=gen),
          torch.randn(192, 48, generator=gen), torch.randn(288, 96, generator=gen)]
    together = orthogonalized_updates(Us, split, sizes, ns_dtype=ns_dtype)
    for U, O in zip(Us, together):
        assert O.shape == U.shape and torch.equal(O, orthogonalized_update(U, split, sizes, ns_dtype=ns_dtype))


def test_ns5_matches_torch_in_bf16():
    """Same iteration as torch's NS in bf16; the only differences are rounding (we normalise in fp32 before
    casting) and eps placement (‖U‖ + eps vs max(‖U‖, eps)), so they agree to bf16 accuracy."""
    for shape in ((48, 20), (20, 48)):
        U = torch.randn(shape, generator=torch.Generator().manual_seed(3))
        ours = newton_schulz5(U, ns_dtype=torch.bfloat16)
        theirs = torch_muon._zeropower_via_newtonschulz(U, (3.4445, -4.7750, 2.0315), 5, 1e-7).float()
        assert (ours - theirs).norm() / theirs.norm() < 0.03


def run(opt_params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, grads: list[list[torch.Tensor]]):
    for step_grads in grads:
        for p, g in zip(opt_params, step_grads):
            p.grad = g.clone()
        optimizer.step()


def make_grads(shape, steps: int = 4, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for _ in range(steps)]


@pytest.mark.parametrize("shape", [(48, 20), (20, 48)])
def test_matches_torch_muon_with_fp32_ns(shape, monkeypatch):
    """Several steps of whole-matrix Muon vs `torch.optim.Muon` (match_rms_adamw, μ = 0.95, Nesterov, same lr
    and weight decay), with torch's bf16-only NS swapped for our fp32 NS so the comparison is tight. This checks
    momentum, Nesterov, weight decay order and the 0.2·sqrt(max(A, B)) scale; torch's EMA momentum differs from
    ours by the factor (1 − μ), which the NS normalisation cancels."""
    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz",
                        lambda G, coefficients, steps, eps: newton_schulz5(G, steps, eps, coefficients, torch.float32))
    W0 = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    ours, theirs = torch.nn.Parameter(W0.clone()), torch.nn.Parameter(W0.clone())
    grads = [[g] for g in make_grads(shape)]
    run([ours], Muon([ours], lr=0.02, weight_decay=0.1, **FP32_NS), grads)
    run([theirs], torch.optim.Muon([theirs], lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True,
                                   adjust_lr_fn="match_rms_adamw"), grads)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    assert (ours - W0).abs().max() > 0.01


def test_matches_unmodified_torch_muon_in_bf16():
    """Against `torch.optim.Muon` as shipped (NS in bf16): same trajectory to bf16 accuracy."""
    shape = (48, 20)
    W0 = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    ours, theirs = torch.nn.Parameter(W0.clone()), torch.nn.Parameter(W0.clone())
    grads = [[g] for g in make_grads(shape)]
    run([ours], Muon([ours], lr=0.02, weight_decay=0.1), grads)
    run([theirs], torch.optim.Muon([theirs], lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"), grads)
    assert (ours - theirs).norm() / (theirs - W0).norm() < 0.03


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr", ["match_rms_adamw", "original"])
def test_block_view_equals_separate_matrices(nesterov, adjust_lr):
    """Per head (KDA q_proj: H × [d, in]), K/V split with N ≠ Vh (MLA kv_b_proj: per head [N, C] and [Vh, C]),
    per expert ([E, A, B]) and column blocks (o_proj: H × [out, d]) each equal plain whole-matrix Muon run on
    every block as its own parameter (§8.4, §12.3 item 16)."""
    H, d, D, N, Vh, C, E = 3, 8, 20, 16, 12, 10, 4
    cases = [  # (shape, view, blocks: index of each block in the full weight)
        ((H * d, D), dict(split="rows", split_sizes=(d,)), [(slice(h * d, (h + 1) * d),) for h in range(H)]),
        ((H * (N + Vh), C), dict(split="rows", split_sizes=(N, Vh)),
         [(slice(h * (N + Vh) + a, h * (N + Vh) + b),) for h in range(H) for a, b in ((0, N), (N, N + Vh))]),
        ((E, 12, 7), dict(split="none"), [(e,) for e in range(E)]),
        ((D, H * d), dict(split="cols", split_sizes=(d,)), [(slice(None), slice(h * d, (h + 1) * d))
                                                            for h in range(H)]),
    ]
    options = dict(lr=0.03, weight_decay=0.1, nesterov=nesterov, adjust_lr=adjust_lr, **FP32_NS)
    for shape, view, blocks in cases:
        W0 = torch.randn(shape, generator=torch.Generator().manual_seed(5))
        grads = make_grads(shape, seed=6)
        whole = torch.nn.Parameter(W0.clone())
        run([whole], Muon([dict(params=[whole], **view)], **options), [[g] for g in grads])
        parts = [torch.nn.Parameter(W0[idx].clone()) for idx in blocks]
        run(parts, Muon(parts, **options), [[g[idx] for idx in blocks] for g in grads])
        for idx, part in zip(blocks, parts):
            torch.testing.assert_close(whole[idx], part, rtol=0, atol=1e-6)
        # and the view matters: whole-matrix Muon on the full weight is a different update
        reference = torch.nn.Parameter(W0.clone())
        if view["split"] != "none":
            run([reference], Muon([reference], **options), [[g] for g in grads])
            assert (reference - whole).abs().max() > 1e-3


def test_momentum_buffer_fp32_for_bf16_parameters():
    W = torch.nn.Parameter(torch.randn(16, 8).bfloat16())
    opt = Muon([W], lr=0.01)
    W.grad = torch.randn(16, 8).bfloat16()
    opt.step()
    assert opt.state[W]["momentum_buffer"].dtype == torch.float32 and W.dtype == torch.bfloat16


def test_rejects_views_that_do_not_fit():
    with pytest.raises(ValueError, match="multiple"):
        Muon([dict(params=[torch.nn.Parameter(torch.zeros(30, 8))], split="rows", split_sizes=(16, 12))])
    with pytest.raises(ValueError, match="matrices"):
        Muon([torch.nn.Parameter(torch.zeros(8))])
    with pytest.raises(ValueError, match="split"):
        Muon([dict(params=[torch.nn.Parameter(torch.zeros(8, 8))], split="heads", split_sizes=(4,))])
    opt = Muon([torch.nn.Parameter(torch.zeros(8, 8))])
    with pytest.raises(ValueError, match="multiple"):
        opt.add_param_group(dict(params=[torch.nn.Parameter(torch.zeros(8, 6))], split="cols", split_sizes=(4,)))
    assert len(opt.param_groups) == 1
