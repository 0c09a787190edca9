"""Quantile Balancing of the router biases (docs/architecture.md §7, §12.3 item 15)."""

from __future__ import annotations

import math

import pytest
import torch

from k3.config import K3Config
from k3.model import K3ForCausalLM
from k3.model.cache import StepContext
from k3.model.moe import MoEGate
from k3.model.observer import ForwardObserver, Observable
from k3.train.balance import QuantileBalancer, exact_quantile, histogram_quantile, margin_histogram
from dist_utils import run_ranks

E, K, D, N = 64, 4, 32, 8192  # §7.5 synthetic router: 64 experts, top-4, M = 8192 tokens
WIDTH = 4 / 1024  # default bin width over [−2, 2]


class ObservedGate(Observable, MoEGate):
    """A bare router whose training-mode forwards call the attached observers, as inside a `K3Model`."""

    def forward(self, x_ND: torch.Tensor, ctx: StepContext | None = None):
        return super().forward(x_ND, StepContext(observers=tuple(self.observers)) if self.training else ctx)


def skewed_gate(skew: float = 2.0, seed: int = 0) -> MoEGate:
    """A real MoEGate whose experts get a logit offset rising linearly from −skew to +skew through the constant
    input feature 0 (see `tokens`): MaxVio ≈ 3 with a zero bias."""
    gen = torch.Generator().manual_seed(seed)
    gate = ObservedGate(K3Config.from_preset("k3-tiny", num_experts=E, num_experts_per_token=K, hidden_size=D))
    with torch.no_grad():
        gate.weight.copy_(0.3 * torch.randn(E, D, generator=gen))
        gate.weight[:, 0] = skew * torch.linspace(-1, 1, E)
    return gate


def tokens(seed: int, n: int = N) -> torch.Tensor:
    """Random router inputs [n, D] whose feature 0 is the constant 1."""
    x_ND = torch.randn(n, D, generator=torch.Generator().manual_seed(1000 + seed))
    x_ND[:, 0] = 1.0
    return x_ND


def run_steps(gate: MoEGate, balancer: QuantileBalancer, steps: int) -> list[float]:
    """`steps` training steps on fresh data: route with the installed bias, then update it. MaxVio per step."""
    vios = []
    for t in range(steps):
        with torch.no_grad():
            gate(tokens(t))
        vios.append(balancer.step()[""].max_vio)
    return vios


def record_routing_bias(gate: MoEGate) -> list[torch.Tensor]:
    """An extra observer that records the bias installed while each forward routes."""
    seen = []

    class Recorder(ForwardObserver):
        def on_routing(self, gate, scores_NE, choice_NE, idx_Nk):
            seen.append(gate.e_score_correction_bias.clone())

    gate.add_observer(Recorder())
    return seen


# ------------------------------------------------------------------------------------------ §7.5 behaviour
def test_qb_drives_maxvio_down_sign_rule_lags():
    """Spec §7.5: QB cuts MaxVio ≥ 10× within 5 steps; the sign rule (u = 1e-3) stays near its start."""
    gate = skewed_gate()
    vios = run_steps(gate, QuantileBalancer(gate), 6)
    assert 2.5 < vios[0] < 4, vios  # the skewed router before any update
    assert vios[5] <= vios[0] / 10, vios  # routed with the bias of the 5th update

    gate = skewed_gate()
    sign_vios = run_steps(gate, QuantileBalancer(gate, method="sign", sign_step=1e-3), 6)
    assert sign_vios[0] == vios[0]
    assert sign_vios[5] > 0.8 * sign_vios[0], sign_vios


def test_exact_and_histogram_quantiles_agree_within_one_bin():
    """Spec §7.3: the interpolated histogram quantile matches the exact one within one bin width."""
    gen = torch.Generator().manual_seed(0)
    shift_E = torch.linspace(-1.2, 0.8, E)
    margin_NE = 0.4 * torch.randn(5000, E, generator=gen) + shift_E
    theta_exact_E = exact_quantile(margin_NE, K)
    theta_hist_E, clamped_E = histogram_quantile(margin_histogram(margin_NE, 1024, -2.0, 2.0),
                                                 5000 * K / E, -2.0, 2.0)
    assert not clamped_E.any()
    error_E = (theta_hist_E - theta_exact_E).abs()
    assert error_E.max() <= WIDTH
    assert error_E.mean() <= WIDTH / 4  # the interpolation inside the bin, not just the right bin
    # exact definition: the (⌊Mk/E⌋+1)-th largest, i.e. ⌊Mk/E⌋ margins lie strictly above it
    assert ((margin_NE > theta_exact_E.float()).sum(0) == 5000 * K // E).all()


def test_qb_and_qb_exact_biases_agree():
    """Through the balancer: θ within one bin width, so the centred biases within two."""
    biases = {}
    for method in ("qb", "qb_exact"):
        gate = skewed_gate()
        run_steps(gate, QuantileBalancer(gate, method=method), 2)
        biases[method] = gate.e_score_correction_bias.clone()
    assert (biases["qb"] - biases["qb_exact"]).abs().max() <= 2 * WIDTH


def test_histogram_quantile_walk_by_hand():
    """Buckets walked from the top, above-range overflow first, uniform density inside the bin (§7.3);
    a quantile beyond the range lands in an overflow bucket: θ is clamped to the edge and flagged."""
    # 4 bins over [0, 4): columns = below, [0,1), [1,2), [2,3), [3,4), above
    hist_EB = torch.tensor([[0, 0, 10, 10, 0, 0], [0, 0, 10, 10, 0, 3]])
    theta_E, clamped_E = histogram_quantile(hist_EB, 5.0, 0.0, 4.0)
    assert theta_E.tolist() == [3 - 5 / 10, 3 - (5 - 3) / 10] and not clamped_E.any()
    theta_E, _ = histogram_quantile(hist_EB, 15.0, 0.0, 4.0)
    assert theta_E.tolist() == [2 - (15 - 10) / 10, 2 - (15 - 13) / 10]

    margin_NE = torch.full((100, 2), 3.0)
    margin_NE[:, 1] = -3.0
    theta_E, clamped_E = histogram_quantile(margin_histogram(margin_NE, 16, -2.0, 2.0), 10.0, -2.0, 2.0)
    assert theta_E.tolist() == [2.0, -2.0] and clamped_E.all()

    gate = skewed_gate(skew=30.0)  # scores saturate: margins far outside [−0.5, 0.5]
    balancer = QuantileBalancer(gate, lo=-0.5, hi=0.5)
    with torch.no_grad():
        gate(tokens(0))
    metrics = balancer.step()[""]
    assert metrics.out_of_range > 0 and metrics.clamped_experts > 0


def test_exact_step_follows_the_spec_token_by_token():
    """qb_exact against §7.2 written out with loops in float64: α_i = (k+1)-th largest of s_i + b,
    μ_ij = s_ij − α_i, θ_j = (⌊Mk/E⌋+1)-th largest of μ_{:,j}, b = −θ − mean(−θ)."""
    config = K3Config.from_preset("k3-tiny", num_experts=8, num_experts_per_token=2, hidden_size=D)
    gate = ObservedGate(config)
    torch.nn.init.normal_(gate.weight, std=0.5)
    gate.e_score_correction_bias.copy_(0.1 * torch.randn(8, generator=torch.Generator().manual_seed(2)))
    x_ND = tokens(0, n=37)
    scores = torch.sigmoid(x_ND.double() @ gate.weight.detach().double().t()).tolist()
    bias = gate.e_score_correction_bias.double().tolist()
    alpha = [sorted((s + b for s, b in zip(row, bias)), reverse=True)[2] for row in scores]
    theta = [sorted((scores[i][j] - alpha[i] for i in range(37)), reverse=True)[37 * 2 // 8] for j in range(8)]
    b_hat = [-t for t in theta]
    expected = torch.tensor([b - sum(b_hat) / 8 for b in b_hat], dtype=torch.float32)

    balancer = QuantileBalancer(gate, method="qb_exact")
    with torch.no_grad():
        gate(x_ND)
    balancer.step()
    torch.testing.assert_close(gate.e_score_correction_bias, expected, rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------------- §7.2 causality
def test_routing_bias_of_a_step_never_depends_on_its_data():
    """The bias routing every micro-batch of step t is the one computed at step t−1, whatever step t's data;
    step t's data only determine the bias of step t+1."""
    gate = skewed_gate()
    balancer = QuantileBalancer(gate)
    with torch.no_grad():
        gate(tokens(0))
    balancer.step()
    b1 = gate.e_score_correction_bias.clone()
    seen = record_routing_bias(gate)
    installed = []
    for seeds in ((1, 2), (3, 4)):  # two alternative data sets for step 1, two micro-batches each
        gate.e_score_correction_bias.copy_(b1)
        for s in seeds:
            x_ND = tokens(s, n=N // 2)
            with torch.no_grad():
                idx_Nk, _ = gate(x_ND)
            choice_NE = torch.sigmoid(x_ND @ gate.weight.detach().t()) + b1
            assert torch.equal(idx_Nk.sort(-1).values, choice_NE.topk(K, -1).indices.sort(-1).values)
        balancer.step()
        installed.append(gate.e_score_correction_bias.clone())
    assert len(seen) == 4 and all(torch.equal(b, b1) for b in seen)
    assert not torch.equal(installed[0], installed[1])


# ------------------------------------------------------------------------------- §6.3 bias stays out
def test_bias_never_changes_weights_or_gradients():
    """Weights are the renormalised unbiased scores × scaling factor whatever the bias; with equal selected
    sets the gradients w.r.t. the router weight are equal; the bias gets no gradient."""
    config = K3Config.from_preset("k3-tiny", num_experts=E, num_experts_per_token=K, hidden_size=D,
                                  routed_scaling_factor=2.5)
    gate = ObservedGate(config)
    torch.nn.init.normal_(gate.weight, std=0.3)
    balancer = QuantileBalancer(gate)
    x_ND = tokens(0, n=256)
    gen = torch.Generator().manual_seed(1)
    b1_E = 0.01 * torch.randn(E, generator=gen)
    cost_E = torch.randn(E, generator=gen)

    def route(bias_E):
        gate.e_score_correction_bias.copy_(bias_E)
        gate.weight.grad = None
        idx_Nk, w_Nk = gate(x_ND)
        (w_Nk * cost_E[idx_Nk]).sum().backward()  # invariant to the order inside the top-k
        return idx_Nk.sort(-1).values, w_Nk, gate.weight.grad.clone()

    scores_NE = torch.sigmoid(x_ND @ gate.weight.detach().t())
    big_E = torch.zeros(E)
    big_E[:K] = 10.0  # forces experts 0..k−1 for every token
    idx_Nk, w_Nk, _ = route(big_E)
    assert (idx_Nk == torch.arange(K)).all()
    expected_Nk = scores_NE[:, :K] / scores_NE[:, :K].sum(-1, keepdim=True) * 2.5
    torch.testing.assert_close(w_Nk.sort(-1).values, expected_Nk.sort(-1).values, rtol=1e-6, atol=0)

    idx1_Nk, w1_Nk, grad1 = route(b1_E)
    idx2_Nk, w2_Nk, grad2 = route(b1_E + 1e-6 * torch.randn(E, generator=gen))  # same sets, another bias
    assert torch.equal(idx1_Nk, idx2_Nk)
    torch.testing.assert_close(w1_Nk.sort(-1).values, w2_Nk.sort(-1).values, rtol=0, atol=0)
    torch.testing.assert_close(grad1, grad2, rtol=1e-6, atol=1e-9)
    bias = gate.e_score_correction_bias
    assert not bias.requires_grad and bias.grad is None
    assert "e_score_correction_bias" not in dict(gate.named_parameters())

    balancer.detach()
    assert gate.observers == []
    idx3_Nk, w3_Nk, grad3 = route(b1_E)  # the observer changed nothing
    assert torch.equal(idx3_Nk, idx1_Nk) and torch.equal(w3_Nk, w1_Nk) and torch.equal(grad3, grad1)


# ------------------------------------------------------------------------------ counting and centring
def test_padding_tokens_are_not_counted():
    """Spec §6.7/§7.2: padding is routed but excluded; M counts only unmasked tokens."""
    x_ND = tokens(0, n=4096)
    pad_ND = tokens(1, n=1024)
    pad_ND[:, 0] = 50.0  # padding that all routes to the highest experts
    mask_N = torch.cat([torch.ones(4096, dtype=torch.bool), torch.zeros(1024, dtype=torch.bool)])
    mixed_ND = torch.cat([x_ND, pad_ND])[torch.randperm(5120, generator=torch.Generator().manual_seed(0))]
    mask_N = mask_N[torch.randperm(5120, generator=torch.Generator().manual_seed(0))]

    results = []
    for x, mask in ((x_ND, None), (mixed_ND, mask_N), (mixed_ND, None)):
        gate = skewed_gate()
        balancer = QuantileBalancer(gate)
        balancer.set_token_mask(None if mask is None else mask.view(64, 80))  # a [B, T] mask
        with torch.no_grad():
            gate(x)
        results.append((balancer.step()[""], gate.e_score_correction_bias.clone()))
    (clean, b_clean), (masked, b_masked), (unmasked, b_unmasked) = results
    assert clean.tokens == masked.tokens == 4096 and unmasked.tokens == 5120
    assert masked.max_vio == clean.max_vio
    torch.testing.assert_close(b_masked, b_clean, rtol=0, atol=1e-6)
    assert (b_unmasked - b_clean).abs().max() > 0.01

    with pytest.raises(ValueError, match="token mask"):
        balancer.set_token_mask(torch.ones(3, dtype=torch.bool))
        gate(x_ND)


@pytest.mark.parametrize("method", ["qb", "qb_exact"])
def test_installed_bias_is_mean_centred(method):
    gate = skewed_gate()
    run_steps(gate, QuantileBalancer(gate, method=method), 2)
    bias = gate.e_score_correction_bias
    assert bias.dtype == torch.float32 and bias.abs().max() > 0.01
    assert abs(float(bias.mean())) <= 1e-6


def test_sign_none_eval_and_state():
    """`sign` moves every bias by ±u towards the mean load; `none` only reports; eval forwards are not counted;
    no persistent state."""
    gate = skewed_gate()
    balancer = QuantileBalancer(gate, method="sign", sign_step=1e-3)
    with torch.no_grad():
        idx_Nk, _ = gate(tokens(0))
    balancer.step()
    load_E = torch.bincount(idx_Nk.flatten(), minlength=E)
    expected_E = 1e-3 * torch.sign(N * K / E - load_E.float())
    assert torch.equal(gate.e_score_correction_bias, expected_E)
    balancer.detach()

    gate = skewed_gate()
    balancer = QuantileBalancer(gate, method="none")
    assert run_steps(gate, balancer, 1)[0] > 2 and (gate.e_score_correction_bias == 0).all()
    gate.eval()
    with torch.no_grad():
        gate(tokens(0))
    assert balancer.step()[""].tokens == 0
    assert balancer.state_dict() == {}
    balancer.load_state_dict({})
    with pytest.raises(ValueError, match="no persistent state"):
        balancer.load_state_dict({"hist": 1})


# ---------------------------------------------------------------------------------------- full model
def test_full_k3_tiny_model():
    """Attached to every MoE layer of k3-tiny: a training forward + step() updates each layer's bias and
    reports per-layer MaxVio over the unpadded tokens."""
    torch.manual_seed(0)
    config = K3Config.from_preset("k3-tiny")
    model = K3ForCausalLM(config).train()
    balancer = QuantileBalancer(model)
    names = [f"model.layers.{i}.block_sparse_moe.gate" for i in range(config.num_hidden_layers)
             if config.is_moe_layer(i)]
    assert [layer.name for layer in balancer.layers] == names and len(names) == 8
    input_ids = torch.randint(0, config.vocab_size, (2, 24))
    attention_mask = torch.ones(2, 24, dtype=torch.long)
    attention_mask[1, :5] = 0  # left padding
    balancer.set_token_mask(attention_mask)
    model(input_ids, labels=input_ids, attention_mask=attention_mask).loss.backward()
    metrics = balancer.step()
    assert list(metrics) == names
    for name, gate in zip(names, (model.get_submodule(n) for n in names)):
        m = metrics[name]
        assert m.tokens == 43 and math.isfinite(m.max_vio) and m.max_vio >= 0
        bias = gate.e_score_correction_bias
        assert bias.abs().max() > 0 and abs(float(bias.mean())) <= 1e-6
        assert m.bias_range == pytest.approx(float(bias.max() - bias.min()))
        assert gate.e_score_correction_bias.grad is None
    balancer.detach()
    assert model.model.observers == []


# -------------------------------------------------------------------------------------- distributed
def _distributed_rank(rank: int, world_size: int):
    gate = skewed_gate()
    balancer = QuantileBalancer(gate)
    with torch.no_grad():
        gate(tokens(0)[rank::world_size])  # each rank routes its share of the global batch
    metrics = balancer.step()[""]
    return metrics.tokens, gate.e_score_correction_bias.clone()


def test_histograms_are_all_reduced_across_ranks():
    """Two data-parallel ranks holding halves of the batch install the bias of the whole batch (§7.3)."""
    gate = skewed_gate()
    balancer = QuantileBalancer(gate)
    with torch.no_grad():
        gate(tokens(0))
    balancer.step()
    for M, bias in run_ranks(_distributed_rank, 2, timeout=120):
        assert M == N
        # a routing flip cannot move the bias (α, the (k+1)-th choice score, is continuous at a tie), and the
        # rows of x[rank::2] @ W.T equal those of the whole batch bit for bit (same K = 32 dot products)
        torch.testing.assert_close(bias, gate.e_score_correction_bias, rtol=0, atol=1e-6)
