"""Parameter partition (docs/architecture.md §8.1, §8.4, §8.5, §12.3 item 16) on the §12.2 tiny model."""

from __future__ import annotations

import pytest
import torch

from k3.model import K3ForCausalLM
from k3.optim import build_param_groups, make_optimizers


def group_of(groups: list[dict]) -> dict[str, dict]:
    """Qualified parameter name → the group holding it (asserting each name appears once)."""
    where = {}
    for group in groups:
        for name, _ in group["params"]:
            assert name not in where, name
            where[name] = group
    return where


@pytest.fixture(scope="module")
def model_and_config():
    from conformance import build_tiny_config

    config = build_tiny_config()
    torch.manual_seed(0)
    return K3ForCausalLM(config), config


def test_every_parameter_in_exactly_one_group(model_and_config):
    model, config = model_and_config
    for scope in ("qkv", "qkv+o+gates", "none"):
        for router in ("muon", "adamw"):
            muon, adamw = build_param_groups(model, config, lr=1e-3, per_head_scope=scope, router=router)
            where = group_of(muon + adamw)
            assert sorted(where) == sorted(n for n, _ in model.named_parameters())
            ids = [id(p) for g in muon + adamw for _, p in g["params"]]
            assert len(ids) == len(set(ids))


def test_default_partition(model_and_config):
    """AdamW: embeddings, lm_head, norm gains, AttnRes pseudo-queries, A_log, dt_bias, conv weights (decay 0.1
    on embeddings, lm_head and conv only); Muon: experts per expert, router whole, per-head q/k/v, MLA q_b per
    head [nope | pe] and kv_b as K and V blocks; the router bias buffer nowhere."""
    model, config = model_and_config
    muon, adamw = build_param_groups(model, config, lr=1e-3)
    where = group_of(muon + adamw)
    muon_names = {n for g in muon for n, _ in g["params"]}
    kda, mla = config.layer_types.index("kda"), config.layer_types.index("mla")
    K, N, R, Vh = config.kda_head_dim, config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
    expected = {
        "model.embed_tokens.weight": ("embed", 0.1),
        "lm_head.weight": ("lm_head", 0.1),
        "model.norm.weight": ("norm", 0.0),
        "model.output_attn_res_norm.weight": ("norm", 0.0),
        "model.output_attn_res_proj.weight": ("res_proj", 0.0),
        f"model.layers.{kda}.self_attention_res_proj.weight": ("res_proj", 0.0),
        f"model.layers.{kda}.mlp_res_proj.weight": ("res_proj", 0.0),
        f"model.layers.{kda}.input_layernorm.weight": ("norm", 0.0),
        f"model.layers.{kda}.self_attn.o_norm.weight": ("norm", 0.0),
        f"model.layers.{kda}.self_attn.A_log": ("A_log", 0.0),
        f"model.layers.{kda}.self_attn.dt_bias": ("dt_bias", 0.0),
        f"model.layers.{kda}.self_attn.q_conv1d.weight": ("conv", 0.1),
        f"model.layers.{mla}.self_attn.q_a_layernorm.weight": ("norm", 0.0),
        f"model.layers.{mla}.self_attn.kv_a_layernorm.weight": ("norm", 0.0),
        f"model.layers.{mla}.block_sparse_moe.routed_expert_norm.weight": ("norm", 0.0),
    }
    for name, (group_name, wd) in expected.items():
        assert (where[name]["name"], where[name]["weight_decay"]) == (group_name, wd), name
        assert name not in muon_names
    views = {
        f"model.layers.{kda}.self_attn.q_proj.weight": ("rows", (K,)),
        f"model.layers.{kda}.self_attn.v_proj.weight": ("rows", (K,)),
        f"model.layers.{mla}.self_attn.q_b_proj.weight": ("rows", (N + R,)),
        f"model.layers.{mla}.self_attn.kv_b_proj.weight": ("rows", (N, Vh)),
        f"model.layers.{mla}.self_attn.q_a_proj.weight": ("none", ()),
        f"model.layers.{mla}.self_attn.o_proj.weight": ("none", ()),
        f"model.layers.{kda}.self_attn.f_b_proj.weight": ("none", ()),
        "model.layers.0.mlp.gate_proj.weight": ("none", ()),
        f"model.layers.{mla}.block_sparse_moe.gate.weight": ("none", ()),
        f"model.layers.{mla}.block_sparse_moe.experts.w2": ("none", ()),  # [E, L, M]: E matrices
        f"model.layers.{mla}.block_sparse_moe.routed_expert_up_proj.weight": ("none", ()),
    }
    for name, view in views.items():
        assert (where[name]["split"], where[name]["split_sizes"]) == view, name
    assert where[f"model.layers.{mla}.block_sparse_moe.experts.w1"]["name"] == "experts"
    assert where[f"model.layers.{mla}.block_sparse_moe.gate.weight"]["name"] == "router"
    assert f"model.layers.{mla}.block_sparse_moe.gate.e_score_correction_bias" in dict(model.named_buffers())
    assert not any("e_score_correction_bias" in n for n in where)


def test_options(model_and_config):
    """router="adamw"; scope "qkv+o+gates" adds o_proj column blocks and g_proj row blocks; "none" keeps every
    projection whole; kv_b_blocks="head" makes one [N + Vh, C] block per head; no_decay is configurable."""
    model, config = model_and_config
    kda, mla = config.layer_types.index("kda"), config.layer_types.index("mla")
    K, N, Vh = config.kda_head_dim, config.qk_nope_head_dim, config.v_head_dim
    muon, adamw = build_param_groups(model, config, lr=1e-3, router="adamw", no_decay=("norm",))
    where = group_of(muon + adamw)
    router = where[f"model.layers.{mla}.block_sparse_moe.gate.weight"]
    assert router in adamw and router["weight_decay"] == 0.1
    assert where[f"model.layers.{kda}.self_attn.A_log"]["weight_decay"] == 0.1
    where = group_of(sum(build_param_groups(model, config, lr=1e-3, per_head_scope="qkv+o+gates"), []))
    assert (where[f"model.layers.{kda}.self_attn.o_proj.weight"]["split"],
            where[f"model.layers.{kda}.self_attn.o_proj.weight"]["split_sizes"]) == ("cols", (K,))
    assert where[f"model.layers.{mla}.self_attn.o_proj.weight"]["split_sizes"] == (Vh,)
    assert where[f"model.layers.{mla}.self_attn.g_proj.weight"]["split"] == "rows"
    where = group_of(sum(build_param_groups(model, config, lr=1e-3, per_head_scope="none"), []))
    assert where[f"model.layers.{kda}.self_attn.k_proj.weight"]["split"] == "none"
    where = group_of(sum(build_param_groups(model, config, lr=1e-3, kv_b_blocks="head"), []))
    assert where[f"model.layers.{mla}.self_attn.kv_b_proj.weight"]["split_sizes"] == (N + Vh,)


def test_layer_type_comes_from_the_config(model_and_config):
    """A config whose schedule disagrees with the model is rejected, not silently re-derived from shapes."""
    model, config = model_and_config
    swapped = config.replace(kda_layers=[2, 3, 4, 5, 6, 7], full_attn_layers=[1, 8])
    with pytest.raises(ValueError, match="config schedule"):
        build_param_groups(model, swapped, lr=1e-3)


def test_frozen_parameters_are_skipped():
    from conformance import build_tiny_config

    config = build_tiny_config()
    model = K3ForCausalLM(config)
    model.model.embed_tokens.weight.requires_grad_(False)
    muon, adamw = build_param_groups(model, config, lr=1e-3)
    assert "model.embed_tokens.weight" not in group_of(muon + adamw)


def test_make_optimizers_trains(model_and_config):
    """Muon (bf16 NS, spec default) + AdamW step the tiny model; the loss goes down and every parameter that
    gets a gradient moves (layer 0's pre-attention AttnRes mix has a single source, so it is never used)."""
    _, config = model_and_config
    torch.manual_seed(0)
    model = K3ForCausalLM(config)
    muon, adamw = make_optimizers(model, config, lr=3e-3)
    assert adamw.defaults["betas"] == (0.9, 0.95) and adamw.defaults["eps"] == 1e-8
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses = []
    for _ in range(3):
        loss = model(ids, labels=ids).loss
        losses.append(loss.item())
        loss.backward()
        muon.step()
        adamw.step()
        muon.zero_grad()
        adamw.zero_grad()
    assert losses[-1] < losses[0]
    loss = model(ids, labels=ids).loss
    loss.backward()
    unmoved = [n for n, p in model.named_parameters() if p.grad is not None and torch.equal(p, before[n])]
    assert not unmoved, unmoved


def test_lr_scale(model_and_config):
    """`lr_scale` (§8.8): a group's own key beats its optimiser's ("muon" / "adamw"), the rest stay at 1; each
    group starts at lr × its scale and `set_lr` keeps the ratio; a key naming no group is refused, listing the
    groups."""
    from k3.optim import set_lr

    model, config = model_and_config
    muon, adamw = make_optimizers(model, config, lr=1e-3, lr_scale={"embed": 5, "muon": 0.5, "experts": 2})
    scales = {g["name"]: (g["lr_scale"], g["lr"]) for g in muon.param_groups + adamw.param_groups}
    assert scales["embed"] == (5.0, pytest.approx(5e-3)) and scales["lm_head"] == (1.0, 1e-3)
    assert scales["matrix"] == (0.5, 5e-4) and scales["kda_qkv"] == (0.5, 5e-4) and scales["experts"] == (2.0, 2e-3)
    set_lr([muon, adamw], 0.1)
    assert {g["name"]: g["lr"] for g in muon.param_groups + adamw.param_groups}["embed"] == pytest.approx(0.5)
    assert all(g["lr"] == pytest.approx(0.1 * g["lr_scale"]) for g in muon.param_groups + adamw.param_groups)
    with pytest.raises(ValueError, match=r"lr scale for 'embeddings': no such parameter group in this model "
                                         r"\(groups: muon, adamw, .*embed"):
        build_param_groups(model, config, lr=1e-3, lr_scale={"embeddings": 2.0})
