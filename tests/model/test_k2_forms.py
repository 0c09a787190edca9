"""The switches back to Kimi K2's forms and the `kimi-k2` preset (docs/architecture.md §14)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3.config import K2_ARCHITECTURE, K3Config, k2_form
from k3.model import K3ForCausalLM
from k3.model.accounting import count_parameters
from k3.model.attn_res import attn_res_mix
from k3.model.ffn import SiTUMLP
from k3.model.mla import GatedMLA
from k3.model.moe import StableLatentMoE
from k3.ops.norm import RMSNorm
from k3.optim import make_optimizers
from conformance import build_tiny_config, ids_for, randomize_parameters, set_runtime


def k2_config(innovations=K2_ARCHITECTURE, **overrides) -> K3Config:
    """The §12.2 conformance config with the given innovations turned into their K2 forms."""
    base = build_tiny_config(**overrides)
    fields = {}
    for innovation in innovations:
        fields |= k2_form(base, innovation)
    return build_tiny_config(**overrides, **fields)


def k2_model(seed=0, innovations=K2_ARCHITECTURE, **overrides) -> K3ForCausalLM:
    torch.manual_seed(seed)
    return randomize_parameters(K3ForCausalLM(k2_config(innovations, **overrides)), seed).eval()


# ------------------------------------------------------------------------------------------- kimi-k2 preset
def test_kimi_k2_preset_has_k2_shapes_and_exact_counts():
    """61 MLA layers with RoPE, 384 experts top-8 + 1 shared, counted by hand from the published shapes."""
    c = K3Config.from_preset("kimi-k2")
    assert c.layer_types == ["mla"] * 61 and not c.mla_use_nope and not c.use_block_attn_res
    assert (c.num_experts, c.num_experts_per_token, c.num_shared_experts, c.moe_intermediate_size) == (384, 8, 1, 2048)
    with torch.device("meta"):
        params = count_parameters(K3ForCausalLM(c), c)
    D, V, H = 7168, 163840, 64
    mla = D * 1536 + 1536 + 1536 * H * 192 + D * 576 + 512 + 512 * H * 256 + H * 128 * D
    expert = 3 * D * 2048
    moe_fixed = 384 * D + 384 + expert  # router weight, its bias buffer, the shared expert
    norms = 61 * 2 * D + D
    fixed = 2 * V * D + 61 * mla + norms + 3 * D * 18432 + 60 * moe_fixed
    assert params.total_params == fixed + 60 * 384 * expert == 1_026_408_232_448
    assert params.activated_params == fixed - V * D + 60 * 8 * expert == 31_687_095_808


def test_new_depth_keeps_the_preset_schedule():
    assert K3Config.from_preset("kimi-k2", num_hidden_layers=3).layer_types == ["mla"] * 3
    assert K3Config.from_preset("k3-tiny", num_hidden_layers=5).layer_types == ["kda"] * 3 + ["mla"] * 2


def test_switches_are_written_only_when_off_and_round_trip(tmp_path):
    k3 = build_tiny_config().to_text_dict()
    assert "use_block_attn_res" not in k3 and "use_latent_moe" not in k3  # K3 files are unchanged
    c = k2_config()
    d = c.to_text_dict()
    assert d["use_block_attn_res"] is False and d["use_latent_moe"] is False and d["mla_use_nope"] is False
    c.save(tmp_path / "config.json")
    loaded = K3Config.from_json(tmp_path)
    assert loaded.to_text_dict() == d and loaded.layer_types == c.layer_types
    assert (loaded.use_block_attn_res, loaded.use_latent_moe, loaded.mla_use_nope, loaded.hidden_act) == \
        (False, False, False, "silu")


def test_unknown_innovation_is_named():
    with pytest.raises(ValueError, match="unknown K3 innovation 'mtp'"):
        k2_form(build_tiny_config(), "mtp")


# ------------------------------------------------------------------------------------------- each switch
@torch.no_grad()
def test_rope_mla_scores_depend_on_relative_positions_only():
    """K2's MLA: q_pe·k_pe of the same tokens placed Δ positions later are unchanged; the rotation is applied."""
    torch.manual_seed(0)
    mla = GatedMLA(k2_config(["attention"])).double()
    x = torch.randn(2, 6, 64, dtype=torch.float64)

    def scores(start):
        _, q_pe = mla.project_query(x, start)
        k_pe = mla.compress_kv(x, start)[..., 20:]
        return torch.einsum("bthr,bsr->bhts", q_pe, k_pe)

    torch.testing.assert_close(scores(17), scores(0))
    nope = GatedMLA(build_tiny_config()).double()
    nope.load_state_dict(mla.state_dict(), strict=False)
    _, q_raw = nope.project_query(x, 5)
    _, q_rot = mla.project_query(x, 5)
    assert not torch.allclose(q_raw, q_rot)
    assert not hasattr(mla, "g_proj")  # K2's MLA has no output gate


def test_plain_residual_is_x_plus_sublayer_of_norm():
    """Without Block AttnRes: x ← x + attn(norm(x)), x ← x + ffn(norm(x)), logits = lm_head(norm(x))."""
    model = k2_model(1, ["attn_res"])
    assert not [n for n in model.state_dict() if "_res_" in n]
    ids = ids_for(256, 2, 9, 1)
    with torch.no_grad():
        x = model.model.embed_tokens(ids)
        for layer in model.model.layers:
            x = x + layer.self_attn(layer.input_layernorm(x))
            x = x + layer.ffn(layer.post_attention_layernorm(x))
        expected = model.lm_head(model.model.norm(x))
        torch.testing.assert_close(model(ids).logits, expected, rtol=1e-5, atol=1e-5)


def test_attn_res_mix_of_one_source_is_that_source():
    """A softmax over one source weighs it 1: Block AttnRes with a single source is the plain stream."""
    norm, proj = RMSNorm(8, 1e-5), torch.nn.Linear(8, 1, bias=False)
    torch.nn.init.normal_(proj.weight)
    V = torch.randn(2, 3, 8)
    torch.testing.assert_close(attn_res_mix([V], norm, proj), V)


@torch.no_grad()
def test_full_width_moe_is_the_weighted_sum_of_experts_on_x():
    """K2's MoE: Σ_e w_e·E_e(x) + Shared(x), experts at the full width, no latent projection or norm."""
    torch.manual_seed(2)
    config = k2_config(["latent_moe"])
    moe = StableLatentMoE(config).double()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    assert not [n for n, _ in moe.named_parameters() if n.startswith("routed_expert_")]
    assert moe.experts.w1.shape == (8, 20, 64)
    x = torch.randn(3, 5, 64, dtype=torch.float64)
    x_ND = x.reshape(-1, 64)
    idx, w = moe.gate(x_ND)
    routed = torch.stack([sum(w[n, j] * moe.experts.expert(int(idx[n, j]), x_ND[n]) for j in range(idx.shape[1]))
                          for n in range(x_ND.shape[0])])
    torch.testing.assert_close(moe(x), (routed + moe.shared_experts(x_ND)).view_as(x))


@torch.no_grad()
def test_swiglu_replaces_situ_glu_in_every_gated_mlp():
    torch.manual_seed(3)
    config = k2_config(["situ"])
    mlp = SiTUMLP(config, 64, 96).double()
    x = 3 * torch.randn(4, 64, dtype=torch.float64)
    expected = mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    torch.testing.assert_close(mlp(x), expected)
    situ = SiTUMLP(build_tiny_config(), 64, 96).double()
    situ.load_state_dict(mlp.state_dict())
    assert not torch.allclose(situ(x), expected)


# ------------------------------------------------------------------------------------------- the K2 model
@pytest.mark.parametrize("mla_decode", ["absorbed", "expanded"])
@torch.no_grad()
def test_k2_model_prefill_then_decode_equals_full_forward(mla_decode):
    """With RoPE the cache holds rotated keys: prefill + one-token steps give the full forward's logits."""
    model = set_runtime(k2_model(4), mla_decode=mla_decode)
    ids = ids_for(256, 2, 11, 4)
    full = model(ids).logits
    cache = model.make_cache(2, capacity=4)  # grown on demand
    parts = [model(ids[:, :6], cache=cache).logits]
    parts += [model(ids[:, t:t + 1], cache=cache).logits for t in range(6, 11)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-4, atol=1e-4)


def test_k2_model_trains_with_every_parameter_in_a_group():
    """One optimiser step of the K2-form model (whole-matrix Muon, as K2): every parameter gets a gradient."""
    model = k2_model(5).train()
    muon, adamw = make_optimizers(model, model.config, lr=1e-2, per_head_scope="none", ns_dtype=torch.float32)
    ids = ids_for(256, 2, 13, 5)
    loss = model(ids, labels=ids).loss
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    muon.step()
    adamw.step()
    assert model(ids, labels=ids).loss < loss


def test_k2_model_save_load_round_trip(tmp_path):
    """A K2-form model saves to safetensors and loads back (the switches are in its config.json)."""
    model = k2_model(6)
    model.save_pretrained(tmp_path)
    loaded = K3ForCausalLM.from_pretrained(tmp_path).eval()
    ids = ids_for(256, 1, 7, 6)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
