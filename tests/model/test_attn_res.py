"""Block Attention Residuals: the mix operator (docs/architecture.md §5.1) and the exact per-layer algorithm (§5.3, §5.5, §5.7)."""

from __future__ import annotations

import torch
from torch import nn

import k3.model.k3 as k3_module
from k3.model import K3ForCausalLM
from k3.model.attn_res import attn_res_mix
from k3.ops.norm import RMSNorm
from routing import assert_no_near_tie, record_routing

D = 64


def mix_params(seed: int, zero_query: bool = False) -> tuple[RMSNorm, nn.Linear]:
    gen = torch.Generator().manual_seed(seed)
    norm, proj = RMSNorm(D, eps=1e-5), nn.Linear(D, 1, bias=False)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(D, generator=gen))
        proj.weight.copy_(torch.zeros(1, D) if zero_query else 0.1 * torch.randn(1, D, generator=gen))
    return norm, proj


def mix_formula(sources, norm, proj, eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor]:
    """Spec §5.1 in float64: returns (mix, p) with p [S, B, T]."""
    V = torch.stack([s.double() for s in sources])
    key = V / torch.sqrt(V.pow(2).mean(-1, keepdim=True) + eps)
    s = (key * norm.weight.double() * proj.weight.double()[0]).sum(-1)
    p = torch.softmax(s, dim=0)
    return (p[..., None] * V).sum(0), p


def hand_sources(seed: int, n: int = 4) -> list[torch.Tensor]:
    """Sources with very different scales and offsets (the embedding is small, block sums are large)."""
    gen = torch.Generator().manual_seed(seed)
    return [(0.05 * 10 ** i) * torch.randn(2, 7, D, generator=gen) + 0.1 * i for i in range(n)]


# ------------------------------------------------------------------------------------------ the operator
def test_mix_matches_formula():
    """MIX = Σ softmax_i(key_i·(γ⊙w))·V_i, key = RMS-normalised source (ε inside), no temperature (§5.1)."""
    norm, proj = mix_params(0)
    V = hand_sources(1)
    expected, p = mix_formula(V, norm, proj)
    out = attn_res_mix(V, norm, proj)
    assert out.shape == (2, 7, D) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    assert p.max() < 0.99 and p.min() > 1e-3, "the test mix must be non-trivial"
    # a 1/√D temperature would be a different operator
    proj_t = nn.Linear(D, 1, bias=False)
    with torch.no_grad():
        proj_t.weight.copy_(proj.weight / D ** 0.5)
    assert (mix_formula(V, norm, proj_t)[0] - out.double()).abs().max() > 1e-2


def test_zero_query_gives_arithmetic_mean():
    """With w = 0 every mix is the arithmetic mean of its sources, whatever γ (§5.5, §5.7 item 8)."""
    norm, proj = mix_params(2, zero_query=True)
    V = hand_sources(3, n=5)
    torch.testing.assert_close(attn_res_mix(V, norm, proj), torch.stack(V).mean(0), rtol=1e-6, atol=1e-6)


def test_values_are_raw_keys_are_normalised():
    """Scaling source j by c scales its contribution by c but leaves every weight p unchanged (§5.1, §5.7 item 1)."""
    norm, proj = mix_params(4)
    V = hand_sources(5)
    out = attn_res_mix(V, norm, proj).double()
    _, p = mix_formula(V, norm, proj)
    j, c = 2, 7.0
    V_scaled = list(V)
    V_scaled[j] = c * V[j]
    out_c = attn_res_mix(V_scaled, norm, proj).double()
    torch.testing.assert_close(out_c, out + (c - 1) * p[j, ..., None] * V[j].double(), rtol=1e-5, atol=1e-4)


def test_only_gamma_times_w_matters_and_mix_is_per_token():
    """γ and w enter only as γ⊙w; the mix at token t ignores every other token (§5.1)."""
    norm, proj = mix_params(6)
    V = hand_sources(7)
    out = attn_res_mix(V, norm, proj)
    norm2, proj2 = mix_params(6)
    with torch.no_grad():
        norm2.weight.mul_(2.0)
        proj2.weight.div_(2.0)
    torch.testing.assert_close(attn_res_mix(V, norm2, proj2), out, rtol=1e-6, atol=1e-6)
    V2 = [v.clone() for v in V]
    V2[1][:, 3] += 5.0
    out2 = attn_res_mix(V2, norm, proj)
    changed = (out2 - out).abs().amax(dim=(0, 2)) > 0
    assert changed.tolist() == [t == 3 for t in range(7)]


def test_mix_in_fp32_cast_back():
    """bf16 sources: the mix is computed in fp32 and rounded once to bf16 (§0.4)."""
    norm, proj = mix_params(8)
    V = [v.to(torch.bfloat16) for v in hand_sources(9)]
    out = attn_res_mix(V, norm.to(torch.bfloat16), proj.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16
    expected, _ = mix_formula(V, norm.to(torch.bfloat16), proj.to(torch.bfloat16))
    torch.testing.assert_close(out.double(), expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())
    torch.testing.assert_close(out, expected.to(torch.bfloat16), rtol=0, atol=expected.abs().max().item() * 2 ** -7)


# ------------------------------------------------------------------------------------ the model-level loop
def hand_written_forward(model: K3ForCausalLM, ids: torch.Tensor, mean_mix: bool = False):
    """Spec §5.3 literally, with the model's own sublayers but our own bank bookkeeping and mix.

    Returns (final hidden after model.norm, {layer: bank after that layer}, [number of sources of each mix]).
    """
    m = model.model
    S = model.config.attn_res_block_size

    def mix(sources, norm, proj):
        n_sources.append(len(sources))
        if mean_mix:
            return torch.stack(sources).mean(0)
        return mix_formula(sources, norm, proj)[0].float()

    n_sources: list[int] = []
    banks = {}
    e = m.embed_tokens(ids)
    bank, cur = [], e
    for i, layer in enumerate(m.layers):
        prefix = cur  # 1
        h = mix(bank + [prefix], layer.self_attention_res_norm, layer.self_attention_res_proj) if bank else prefix  # 2
        if i % S == 0:  # 3: bank the raw prefix
            bank = bank + [prefix]
            prefix = None
        a = layer.self_attn(layer.input_layernorm(h))  # 4
        prefix = a if prefix is None else prefix + a  # 5
        h2 = mix(bank + [prefix], layer.mlp_res_norm, layer.mlp_res_proj)  # 6
        f = layer.ffn(layer.post_attention_layernorm(h2))  # 7
        cur = prefix + f  # 8
        banks[i] = list(bank)
    out = mix(bank + [cur], m.output_attn_res_norm, m.output_attn_res_proj)
    return m.norm(out), banks, n_sources, e


# pre-attention (absent at layer 0) and pre-FFN mixes of layers 0..7, then the output mix (8 layers, block 3)
EXPECTED_SOURCES = [2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 4, 4, 4, 4]


@torch.no_grad()
def test_model_equals_hand_written_block_attn_res(tiny_model, monkeypatch):
    """K3Model = a literal §5.3 loop on the §12.2 config (8 layers, block 3), including every bank boundary."""
    model = tiny_model(seed=0)
    ids = torch.randint(0, 256, (2, 37), generator=torch.Generator().manual_seed(10))
    with record_routing(model) as rec:
        ref_hidden, ref_banks, ref_counts, e = hand_written_forward(model, ids)
    assert ref_counts == EXPECTED_SOURCES
    # the float64 hand-written mixes reach the routers as other fp32 roundings: the data must hold no near tie
    assert_no_near_tie(rec, what="hand-written AttnRes loop")  # min top-k margin 1.6e-4 (tests/routing.py)

    calls: list[list[torch.Tensor]] = []
    real_mix = k3_module.attn_res_mix

    def recording_mix(sources, norm, proj):
        calls.append(list(sources))
        return real_mix(sources, norm, proj)

    monkeypatch.setattr(k3_module, "attn_res_mix", recording_mix)
    io = {}
    hooks = [layer.register_forward_hook(lambda mod, args, out, i=i: io.__setitem__(i, (args, out)))
             for i, layer in enumerate(model.model.layers)]
    try:
        hidden = model.model(ids)
    finally:
        for h in hooks:
            h.remove()

    torch.testing.assert_close(hidden, ref_hidden, rtol=1e-4, atol=1e-4)
    assert [len(c) for c in calls] == EXPECTED_SOURCES

    cur_out = {i: io[i][1][0] for i in io}  # `cur` leaving layer i
    bank_out = {i: io[i][1][1] for i in io}
    emb = model.model.embed_tokens(ids)
    # layer 0 banks the embedding itself (b₀) and nothing else
    assert len(bank_out[0]) == 1 and torch.equal(bank_out[0][0], emb)
    # block boundaries at 0, 3, 6: b₁ = cur after layer 2, b₂ = cur after layer 5
    assert [len(bank_out[i]) for i in range(8)] == [1, 1, 1, 2, 2, 2, 3, 3]
    assert torch.equal(bank_out[3][1], cur_out[2]) and torch.equal(bank_out[6][2], cur_out[5])
    for i in range(8):
        assert len(ref_banks[i]) == len(bank_out[i])
        for ours, theirs in zip(ref_banks[i], bank_out[i]):
            torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)
    # layer 3's pre-attention mix is over [e, b₁] (call index 5: l0 ffn, l1 ×2, l2 ×2, l3 attn)
    pre_attn_3 = calls[5]
    assert torch.equal(pre_attn_3[0], emb) and torch.equal(pre_attn_3[1], cur_out[2])
    # the output mix is over [e, b₁, b₂, b₃] with b₃ = cur after the last (partial-block) layer
    final = calls[-1]
    assert torch.equal(final[0], emb) and torch.equal(final[1], cur_out[2])
    assert torch.equal(final[2], cur_out[5]) and torch.equal(final[3], cur_out[7])


@torch.no_grad()
def test_zero_pseudo_queries_make_every_mix_a_mean(tiny_model):
    """All w = 0 ⇒ the model equals the §5.3 loop with plain arithmetic means (§5.7 item 8)."""
    model = tiny_model(seed=1)
    for name, p in model.named_parameters():
        if name.endswith("_res_proj.weight"):
            p.zero_()
    ids = torch.randint(0, 256, (1, 29), generator=torch.Generator().manual_seed(11))
    with record_routing(model) as rec:
        ref_hidden, *_ = hand_written_forward(model, ids, mean_mix=True)
        torch.testing.assert_close(model.model(ids), ref_hidden, rtol=1e-4, atol=1e-4)
    assert_no_near_tie(rec, what="mean-mix loop")  # fp32, other reduction order: min top-k margin 3.6e-4


@torch.no_grad()
def test_block_size_off_by_one_changes_logits(tiny_model):
    """Negative control: the same weights with attn_res_block_size 4 instead of 3 give clearly different logits (§5.3)."""
    model = tiny_model(seed=2)
    other = K3ForCausalLM(model.config.replace(attn_res_block_size=4)).eval()
    other.load_state_dict(model.state_dict())
    ids = torch.randint(0, 256, (2, 37), generator=torch.Generator().manual_seed(12))
    delta = (model(ids).logits - other(ids).logits).abs().max()
    assert delta > 1e-2


def test_layer0_pre_attention_mix_gets_no_gradient(tiny_model):
    """Layer 0's pre-attention mix is never evaluated (bank empty): zero gradient; every other pseudo-query learns (§5.5)."""
    model = tiny_model(seed=3).train()
    ids = torch.randint(0, 256, (2, 19), generator=torch.Generator().manual_seed(13))
    model(ids, labels=ids).loss.backward()
    g0 = model.model.layers[0].self_attention_res_proj.weight.grad
    assert g0 is None or torch.count_nonzero(g0) == 0
    for name, p in model.named_parameters():
        if name.endswith("_res_proj.weight") and name != "model.layers.0.self_attention_res_proj.weight":
            assert p.grad is not None and p.grad.abs().max() > 0, name
