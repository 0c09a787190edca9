"""Stable LatentMoE: router, latent routed experts, shared experts (docs/architecture.md §6.3–§6.8, §12.3 item 8)."""

from __future__ import annotations

import pytest
import torch

from conformance import spread_weights_
from k3.checkpoint.hf import convert_experts
from k3.checkpoint.quantization import with_experts_format
from k3.model.moe import MoEGate, StableLatentMoE
from k3.ops.mxfp4 import MXFP4Weight
from routing import TIE_TOL, top_k_margin

D, E, K, L, M = 64, 8, 2, 48, 20  # §12.2: hidden, experts, top-k, latent, expert width


def make_moe(config, seed: int = 0, bias_std: float = 0.1, impl: str = "grouped") -> StableLatentMoE:
    """A MoE layer with N(0, 0.15²) weights, random latent-norm gain and router bias (§12.2); routed experts `impl`."""
    torch.manual_seed(seed)
    moe = spread_weights_(StableLatentMoE(config))
    moe.experts.impl = impl
    with torch.no_grad():
        moe.gate.e_score_correction_bias.copy_(bias_std * torch.randn(config.num_experts))
    return moe


def situ(g, u):
    return 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)


def moe_reference(moe: StableLatentMoE, x_ND: torch.Tensor):
    """Spec §6.3–§6.6 token by token, expert by expert, in float64. Returns (index sets, weights, output)."""
    cfg = moe.config
    x = x_ND.double()
    W_r = moe.gate.weight.double()
    bias = moe.gate.e_score_correction_bias.double()
    W_down, W_up = moe.routed_expert_down_proj.weight.double(), moe.routed_expert_up_proj.weight.double()
    w1, w2, w3 = (w.double() for w in (moe.experts.w1, moe.experts.w2, moe.experts.w3))
    gain = moe.routed_expert_norm.weight.double()
    sh = moe.shared_experts
    sets, weights, outs = [], [], []
    for n in range(x.shape[0]):
        s = torch.sigmoid(W_r @ x[n])  # 1–2: full-width x, sigmoid
        choice = (s + bias).tolist()  # 3: bias on the sigmoid scores, selection only
        chosen = sorted(range(cfg.num_experts), key=lambda e: -choice[e])[:cfg.num_experts_per_token]  # 5
        w = {e: s[e] for e in chosen}  # 6: unbiased scores, renormalised, scaled
        total = sum(w.values())
        w = {e: v / (total + 1e-20) * cfg.routed_scaling_factor for e, v in w.items()}
        z = W_down @ x[n]  # latent, shared by all experts of the token
        r = torch.zeros(cfg.routed_expert_hidden_size, dtype=torch.float64)
        for e in chosen:
            r = r + w[e] * (w2[e] @ situ(w1[e] @ z, w3[e] @ z))
        r_hat = gain * r / torch.sqrt(r.pow(2).mean() + cfg.rms_norm_eps)
        shared = sh.down_proj.weight.double() @ situ(sh.gate_proj.weight.double() @ x[n],
                                                      sh.up_proj.weight.double() @ x[n])
        sets.append(set(chosen))
        weights.append(w)
        outs.append(W_up @ r_hat + shared)
    return sets, weights, torch.stack(outs)


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, D, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------- router
def test_router_selects_with_bias_weights_without(tiny_config):
    """Selection = top-k of σ(logits) + b; weights = renormalised unbiased σ scores × scaling factor (§6.3)."""
    moe = make_moe(tiny_config(), bias_std=0.3)
    x = tokens(200, 1)
    idx, w = moe.gate(x)
    assert top_k_margin(moe.gate, x).min() > TIE_TOL  # no near tie: the fp32 and float64 top-k cannot differ
    assert idx.shape == (200, K) and w.shape == (200, K) and w.dtype == torch.float32
    s = torch.sigmoid(x.double() @ moe.gate.weight.double().t())
    biased = torch.topk(s + moe.gate.e_score_correction_bias.double(), K).indices
    assert [set(r) for r in idx.tolist()] == [set(r) for r in biased.tolist()]
    unbiased = torch.topk(s, K).indices
    assert [set(r) for r in idx.tolist()] != [set(r) for r in unbiased.tolist()], "bias must change some choices"
    s_sel = s.gather(1, idx)
    torch.testing.assert_close(w.double(), s_sel / s_sel.sum(1, keepdim=True) * 2.5, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(w.sum(1), torch.full((200,), 2.5), rtol=1e-6, atol=1e-6)


def test_huge_bias_forces_selection_but_not_weight(tiny_config):
    """A huge bias on expert j selects it for every token; its weight is still its renormalised unbiased score (§12.3.8)."""
    moe = make_moe(tiny_config(), seed=1)
    x = tokens(64, 2)
    j = 5
    with torch.no_grad():
        moe.gate.e_score_correction_bias[j] = 1e3
    idx, w = moe.gate(x)
    assert (idx == j).any(1).all()
    s = torch.sigmoid(x.double() @ moe.gate.weight.double().t())
    s_sel = s.gather(1, idx)
    expected = s_sel / s_sel.sum(1, keepdim=True) * 2.5
    torch.testing.assert_close(w.double(), expected, rtol=1e-6, atol=1e-7)
    assert w.max() < 2.5 - 1e-3  # the bias never leaks into the weight (it would give j a weight of ≈ 2.5)


def test_router_without_renormalisation(tiny_config):
    """moe_renormalize = false: weights are the raw selected sigmoid scores × scaling factor."""
    moe = make_moe(tiny_config(moe_renormalize=False))
    x = tokens(50, 3)
    idx, w = moe.gate(x)
    s = torch.sigmoid(x.double() @ moe.gate.weight.double().t())
    torch.testing.assert_close(w.double(), s.gather(1, idx) * 2.5, rtol=1e-6, atol=1e-7)


def test_router_runs_in_fp32_for_bf16(tiny_config):
    """In a bf16 layer the router upcasts x and W, keeps an fp32 bias and returns fp32 weights (§0.4)."""
    moe = make_moe(tiny_config()).to(torch.bfloat16)
    gate = moe.gate
    assert gate.weight.dtype == torch.bfloat16 and gate.e_score_correction_bias.dtype == torch.float32
    x = tokens(300, 4).to(torch.bfloat16)
    idx, w = gate(x)
    assert w.dtype == torch.float32
    s = torch.sigmoid(x.float() @ gate.weight.float().t())
    expected_idx = torch.topk(s + gate.e_score_correction_bias, K).indices  # the gate's own fp32 ops: bit-identical
    assert [set(r) for r in idx.tolist()] == [set(r) for r in expected_idx.tolist()]
    s_sel = s.gather(1, idx)
    torch.testing.assert_close(w, s_sel / s_sel.sum(1, keepdim=True) * 2.5, rtol=1e-6, atol=1e-6)
    s16 = torch.sigmoid(x @ gate.weight.t())  # what a bf16 router would compute
    w16 = s16.gather(1, idx).float()
    assert (w - w16 / w16.sum(1, keepdim=True) * 2.5).abs().max() > 1e-4


def test_group_limited_routing(tiny_config):
    """num_expert_group 4 / topk_group 2: experts only come from the 2 groups with the best top-2 sums (§6.3 step 4)."""
    cfg = tiny_config(num_expert_group=4, topk_group=2, num_experts_per_token=3)
    moe = make_moe(cfg, seed=2, bias_std=0.3)
    x = tokens(200, 5)
    idx, _ = moe.gate(x)
    assert top_k_margin(moe.gate, x).min() > TIE_TOL  # no near tie (experts or groups): fp32 == float64 choice
    s = torch.sigmoid(x.double() @ moe.gate.weight.double().t()) + moe.gate.e_score_correction_bias.double()
    group_score = s.view(200, 4, 2).sum(-1)  # group size 2: the top-2 sum is the sum of both
    best_groups = group_score.topk(2, dim=1).indices
    allowed = [set((2 * best_groups[n, :, None] + torch.arange(2)).flatten().tolist()) for n in range(200)]
    assert all(set(idx[n].tolist()) <= allowed[n] for n in range(200))
    # within the allowed groups, the choice is the plain top-3
    masked = s.clone()
    for n in range(200):
        masked[n, [e for e in range(8) if e not in allowed[n]]] = -float("inf")
    assert [set(r) for r in idx.tolist()] == [set(r) for r in masked.topk(3, dim=1).indices.tolist()]
    # without the group limit some tokens would pick an expert from a third group
    ungrouped = s.topk(3, dim=1).indices
    assert any(not set(ungrouped[n].tolist()) <= allowed[n] for n in range(200))


def test_correction_bias_is_an_fp32_buffer_without_grad(tiny_config):
    """e_score_correction_bias is a persistent fp32 buffer, never a parameter, never given a gradient (§6.3 step 7)."""
    moe = make_moe(tiny_config())
    names = dict(moe.named_parameters())
    assert "gate.e_score_correction_bias" not in names
    assert "gate.e_score_correction_bias" in moe.state_dict()
    assert not moe.gate.e_score_correction_bias.requires_grad
    assert isinstance(moe.gate, MoEGate)


# ----------------------------------------------------------------------------------------- full layer
def test_moe_matches_token_by_token_reference(tiny_config):
    """StableLatentMoE = up(RMSNorm(Σ w_e E_e(down x))) + Shared(x), checked against a float64 double loop (§6.6)."""
    moe = make_moe(tiny_config(), seed=3)
    x = tokens(3 * 13, 6)
    sets, weights, ref = moe_reference(moe, x)
    idx, w = moe.gate(x)
    assert top_k_margin(moe.gate, x).min() > TIE_TOL  # no near tie: the fp32 and float64 top-k cannot differ
    assert [set(r) for r in idx.tolist()] == sets
    y = moe(x.view(3, 13, D))
    assert y.shape == (3, 13, D)
    torch.testing.assert_close(y.view(-1, D).double(), ref, rtol=1e-5, atol=1e-5)
    assert ref.abs().max() > 0.5


@pytest.mark.parametrize("impl", ["grouped", "loop"])
def test_both_expert_paths_match_reference(tiny_config, impl):
    """Grouped and loop expert paths each equal the hand-written per-token, per-expert reference (§6.7)."""
    moe = make_moe(tiny_config(), seed=4, impl=impl)
    x = tokens(45, 7)
    assert top_k_margin(moe.gate, x).min() > TIE_TOL  # no near tie: the fp32 and float64 top-k cannot differ
    torch.testing.assert_close(moe(x[None]).squeeze(0).double(), moe_reference(moe, x)[2], rtol=1e-5, atol=1e-5)


def test_grouped_equals_loop_with_unbalanced_routing(tiny_config):
    """Grouped and looped experts agree to 1e-6 in fp32 with skewed routing and unused experts (§6.7)."""
    grouped = make_moe(tiny_config(), seed=5, impl="grouped")
    with torch.no_grad():
        grouped.gate.e_score_correction_bias.copy_(torch.tensor([2.0, 0.1, 0, 0.3, -0.2, 0, -10, -10]))
    loop = make_moe(tiny_config(), seed=6, impl="loop")
    loop.load_state_dict(grouped.state_dict())  # routing cannot differ: equal gates on bit-identical inputs
    x = tokens(2 * 37, 8)
    idx, _ = grouped.gate(x)
    counts = torch.bincount(idx.flatten(), minlength=E)
    assert counts[0] == 74 and counts[6] == counts[7] == 0 and counts[1:6].max() > 3 * counts[1:6].min().clamp_min(1)
    z = grouped.routed_expert_down_proj(x)
    r_g = grouped.experts(z, *grouped.gate(x))
    r_l = loop.experts(z, *loop.gate(x))
    torch.testing.assert_close(r_g, r_l, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grouped(x.view(2, 37, D)), loop(x.view(2, 37, D)), rtol=1e-6, atol=1e-6)


def test_latent_norm_cancels_scaling_factor(tiny_config):
    """routed_scaling_factor 2.5 → 1.0 changes the output only through ε; without the latent norm it changes a lot (§6.4)."""
    x = tokens(40, 9)[None]

    def rel_change(use_norm: bool) -> float:
        a = make_moe(tiny_config(routed_scaling_factor=2.5, latent_moe_use_norm=use_norm), seed=7)
        b = make_moe(tiny_config(routed_scaling_factor=1.0, latent_moe_use_norm=use_norm), seed=7)
        b.load_state_dict(a.state_dict())
        ya, yb = a(x), b(x)
        return ((ya - yb).abs().max() / ya.abs().max()).item()

    with_norm, without_norm = rel_change(True), rel_change(False)
    assert with_norm < 1e-3
    assert without_norm > 0.1


def test_shared_mlp_is_sum_of_halves(tiny_config):
    """The merged 2m-wide shared MLP equals the sum of two m-wide SiTU experts (split rows / down columns) (§6.5)."""
    moe = make_moe(tiny_config(), seed=8)
    sh = moe.shared_experts
    assert sh.gate_proj.weight.shape == (2 * M, D) and sh.down_proj.weight.shape == (D, 2 * M)
    x = tokens(30, 10)
    total = torch.zeros(30, D, dtype=torch.float64)
    for half in (slice(0, M), slice(M, 2 * M)):
        g = x.double() @ sh.gate_proj.weight[half].double().t()
        u = x.double() @ sh.up_proj.weight[half].double().t()
        total += situ(g, u) @ sh.down_proj.weight[:, half].double().t()
    torch.testing.assert_close(sh(x).double(), total, rtol=1e-5, atol=1e-6)


def test_gradients_reach_experts_router_and_latent_projections(tiny_config):
    """Backward reaches the router weight, the used experts (not unused ones), latent projections and shared MLP."""
    moe = make_moe(tiny_config(), seed=9)
    with torch.no_grad():
        moe.gate.e_score_correction_bias.copy_(torch.tensor([0, 0, 0, 0, 0, 0, -10.0, -10.0]))  # 6, 7 unused
    x = tokens(40, 11)[None]
    moe(x).pow(2).sum().backward()
    assert moe.gate.weight.grad.abs().max() > 0
    for w in (moe.experts.w1, moe.experts.w2, moe.experts.w3):
        per_expert = w.grad.abs().amax(dim=(1, 2))
        assert (per_expert[:6] > 0).all() and (per_expert[6:] == 0).all()
    for p in (moe.routed_expert_down_proj.weight, moe.routed_expert_up_proj.weight,
              moe.routed_expert_norm.weight, moe.shared_experts.down_proj.weight):
        assert p.grad.abs().max() > 0
    assert moe.gate.e_score_correction_bias.grad is None


@pytest.mark.parametrize("impl", ["grouped", "loop"])
@pytest.mark.parametrize("tokens_", [3, 45])  # few rows an expert (the in-register kernel), many (decoded tiles)
def test_packed_experts_equal_their_decoded_weights(tiny_config, impl, tokens_):
    """A layer with MXFP4 experts computes what the same layer with the decoded dense weights computes (§11.5)."""
    config = tiny_config(routed_expert_hidden_size=64, moe_intermediate_size=32)
    packed_moe = StableLatentMoE(with_experts_format(config, "mxfp4"))
    packed_moe.experts.impl = impl
    dense_moe = make_moe(config, seed=11, impl=impl)
    prefix = "model.layers.1.block_sparse_moe."  # convert_experts reads the model's names
    state = convert_experts({prefix + k: v for k, v in dense_moe.state_dict().items()}, "mxfp4")
    packed_moe.load_state_dict({k.removeprefix(prefix): v for k, v in state.items()})
    decoded = convert_experts(state, "dense")  # the decoded values, exact in bf16, held in fp32
    dense_moe.load_state_dict({k.removeprefix(prefix): v for k, v in decoded.items()})
    assert isinstance(packed_moe.experts.w1, MXFP4Weight)
    x = tokens(tokens_, 12)[None]
    with torch.no_grad():
        torch.testing.assert_close(packed_moe(x), dense_moe(x), rtol=1e-5, atol=1e-5)
