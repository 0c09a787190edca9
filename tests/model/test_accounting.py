"""Parameter, cache and FLOP accounting at the released K3 dimensions, on a meta-device model (docs/architecture.md §2)."""

from __future__ import annotations

import pytest
import torch

from k3.config import K3Config
from k3.model import K3ForCausalLM
from k3.model.accounting import (attn_res_sources, cache_sizes, component_of, count_parameters, forward_flops_per_token,
                                 prefill_flops)

D = 7168


@pytest.fixture(scope="module")
def full():
    """(config, meta-device model, ParamCount) for k3-full; no memory is allocated."""
    config = K3Config.from_preset("k3-full")
    with torch.device("meta"):
        model = K3ForCausalLM(config)
    return config, model, count_parameters(model, config)


def numel(module: torch.nn.Module) -> int:
    return sum(t.numel() for t in module.state_dict(keep_vars=True).values())


def test_headline_totals(full):
    """Total 2,779,484,476,000 ≈ 2.78 T and activated 104,189,612,640 ≈ 104.2 B, exactly (§2.2)."""
    _, _, p = full
    assert p.total_params == 2_779_484_476_000
    assert p.activated_params == 104_189_612_640


def test_component_table(full):
    """Every row of the §2.2 table, total and activated."""
    _, _, p = full
    expected_total = {
        "embedding": 1_174_405_120,
        "lm_head": 1_174_405_120,
        "kda": 30_618_086_496,
        "mla": 5_572_706_304,
        "norms_attn_res": 4_021_248,
        "dense_ffn": 726_663_168,
        "moe_fixed": 17_473_358_336,
        "routed_experts": 2_722_740_830_208,
    }
    assert p.total == expected_total
    assert p.activated == {**expected_total, "embedding": 0, "routed_experts": 48_620_371_968}
    assert sum(expected_total.values()) == 2_779_484_476_000  # the table itself is consistent


def test_per_layer_counts(full):
    """One KDA layer 443,740,384; one MLA layer 232,196,096; norms+AttnRes 6·D per layer; MoE layer 29,784,936,832 (§2.1)."""
    config, model, _ = full
    layers = model.model.layers
    assert numel(layers[0].self_attn) == 443_740_384
    assert numel(layers[3].self_attn) == 232_196_096
    assert numel(layers[92].self_attn) == 232_196_096  # the extra final MLA
    assert numel(layers[0].mlp) == 3 * D * 33792 == 726_663_168
    moe = layers[1].block_sparse_moe
    assert numel(moe) == 29_784_936_832
    assert numel(moe.experts) == 896 * 33_030_144 == 29_595_009_024
    assert numel(moe) - numel(moe.experts) == 189_927_808
    assert numel(moe) - numel(moe.experts) + 16 * 33_030_144 == 718_410_112
    assert numel(moe.gate) == 896 * D + 896  # router weight + fp32 correction bias
    per_layer_norms = sum(t.numel() for n, t in layers[5].state_dict(keep_vars=True).items()
                          if not n.startswith(("self_attn.", "mlp.", "block_sparse_moe.")))
    assert per_layer_norms == 6 * D == 43_008
    n_mix = sum(1 for n, _ in model.named_parameters() if n.endswith("_res_proj.weight"))
    assert n_mix == 187


def test_components_follow_the_schedule(full):
    """component_of assigns self_attn tensors by the layer schedule, not by shape (§3.10 item 10)."""
    config, _, _ = full
    assert component_of("model.layers.91.self_attn.o_proj.weight", config) == "mla"
    assert component_of("model.layers.90.self_attn.o_proj.weight", config) == "kda"
    assert component_of("model.layers.92.self_attn.g_proj.weight", config) == "mla"
    assert component_of("model.layers.0.mlp.up_proj.weight", config) == "dense_ffn"
    assert component_of("model.layers.5.block_sparse_moe.experts.w2", config) == "routed_experts"
    assert component_of("model.layers.5.block_sparse_moe.gate.e_score_correction_bias", config) == "moe_fixed"
    assert component_of("model.layers.5.mlp_res_proj.weight", config) == "norms_attn_res"
    assert component_of("model.output_attn_res_proj.weight", config) == "norms_attn_res"


def test_cache_sizes():
    """MLA cache 13,824 numbers = 27,648 B per token; KDA state 69·96·128·128·4 = 434,110,464 B; conv 15,261,696 B (§2.4)."""
    c = cache_sizes(K3Config.from_preset("k3-full"))
    assert 69 * 96 * 128 * 128 * 4 == 434_110_464  # the documented arithmetic
    assert c.mla_numbers_per_token == 24 * (512 + 64) == 13_824
    assert c.mla_bytes_per_token == 27_648
    assert c.kda_state_bytes_per_sequence == 434_110_464
    assert c.kda_conv_bytes_per_sequence == 69 * 3 * 12288 * 3 * 2 == 15_261_696
    at_1m = c.bytes_at(2 ** 20)
    assert 27_648 * 2 ** 20 == pytest.approx(28.99e9, rel=1e-3)
    assert at_1m == 27_648 * 2 ** 20 + 434_110_464 + 15_261_696
    assert at_1m == pytest.approx(29.4e9, rel=2e-3)


def test_forward_flops(full):
    """≈ 2 × activated ≈ 208 GFLOP/token at short context; MLA adds 2·H·(192+128) = 61,440 per (query, key) pair per layer (§2.2)."""
    config, _, p = full
    f1 = forward_flops_per_token(config, p, 1)
    assert f1 == pytest.approx(2 * 104.19e9, rel=1e-2)
    f_long = forward_flops_per_token(config, p, 4097)
    assert f_long - f1 == 24 * 61_440 * 4096 // 2  # the average query sees half the causal context


@pytest.mark.parametrize("tokens", [1, 4097, 1_048_576])
def test_prefill_flops_parts_sum_to_the_per_token_count(full, tokens):
    """The prefill's parts sum to tokens × the per-token count (up to its rounding of the causal pairs, < T/2 pairs
    per layer); only MLA attention grows faster than T: 24 layers × 61,440 × T(T+1)/2."""
    config, _, p = full
    parts = prefill_flops(config, p, tokens)
    pair_rounding = 24 * 61_440 * tokens
    assert abs(sum(parts.values()) - tokens * forward_flops_per_token(config, p, tokens)) <= pair_rounding
    assert parts["mla_attention"] == 24 * 61_440 * tokens * (tokens + 1) // 2
    linear = {k: v for k, v in prefill_flops(config, p, 2 * tokens).items() if k != "mla_attention"}
    assert linear == {k: 2 * v for k, v in parts.items() if k != "mla_attention"}
    assert parts["moe"] == tokens * 2 * (p.activated["routed_experts"] + p.activated["moe_fixed"])


def test_small_model_counts_match_state_dict(tiny_config):
    """On any config the components partition the state dict, and activated routed = total·k/E."""
    config = tiny_config()
    model = K3ForCausalLM(config)
    p = count_parameters(model, config)
    assert p.total_params == sum(t.numel() for t in model.state_dict().values())
    routed = sum(t.numel() for n, t in model.state_dict().items() if ".experts." in n)
    assert p.total["routed_experts"] == routed == 7 * 3 * 8 * 48 * 20
    assert p.activated["routed_experts"] == routed * 2 // 8
    assert p.activated_params == p.total_params - p.total["embedding"] - routed * 6 // 8


@pytest.mark.parametrize("preset, total", [("k3-small", 226_373_896), ("k3-tiny", 5_046_824),
                                           ("k3-tiny-vl", 1_613_932)])
def test_preset_totals(preset, total):
    """The exact text totals the README's preset table and config.py state (meta-device count)."""
    config = K3Config.from_preset(preset)
    with torch.device("meta"):
        model = K3ForCausalLM(config)
    assert count_parameters(model, config).total_params == total


@pytest.mark.parametrize("layers, block", [(9, 4), (8, 3), (13, 13)])
def test_attn_res_source_counts_follow_the_forward(tiny_config, layers, block):
    """`attn_res_sources` equals what the layers really mix: len(bank) + 1 before each FFN and at the output."""
    config = tiny_config(num_hidden_layers=layers, attn_res_block_size=block,
                         kda_layers=[i for i in range(1, layers + 1) if i % 4],
                         full_attn_layers=list(range(4, layers + 1, 4)))
    model = K3ForCausalLM(config).eval()
    seen = []
    hooks = [layer.register_forward_hook(lambda m, args, out: seen.append(len(out[1]) + 1))
             for layer in model.model.layers]
    with torch.no_grad():
        model(torch.zeros(1, 3, dtype=torch.long))
    for h in hooks:
        h.remove()
    per_layer, output = attn_res_sources(config)
    assert per_layer == seen  # the bank after a layer is the one its FFN mix read
    assert output == seen[-1]
