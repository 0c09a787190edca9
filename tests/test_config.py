"""K3Config: presets, verbatim JSON round trip, validation, defaults for missing fields (docs/architecture.md §1.1–§1.4, §6.1)."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch

from k3.config import FILE_DEFAULTS, PRESETS, ConfigError, K3Config, summarize
from k3.config.text import _REQUIRED_KEYS, _REQUIRED_LINEAR_ATTN_KEYS
from k3.model import K3ForCausalLM
from k3.model.accounting import count_parameters


# --------------------------------------------------------------------------------------------- fixtures
def released_text_config() -> dict:
    """`text_config` as released (§1.1), with legacy / unused / unknown keys that must survive."""
    full = [4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60, 64, 68, 72, 76, 80, 84, 88, 92, 93]
    return {
        "model_type": "kimi_linear",
        "architectures": ["KimiLinearForCausalLM"],
        "vocab_size": 163840,
        "hidden_size": 7168,
        "num_hidden_layers": 93,
        "num_attention_heads": 96,
        "num_key_value_heads": 96,
        "head_dim": 72,  # legacy, unused
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "rope_theta": 50000.0,
        "rope_scaling": None,
        "linear_attn_config": {
            "num_heads": 96,
            "head_dim": 128,
            "short_conv_kernel_size": 4,
            "kda_layers": [i for i in range(1, 94) if i not in full],
            "full_attn_layers": full,
            "use_full_rank_gate": True,
            "gate_lower_bound": -5.0,
            "some_future_subkey": {"a": [1, 2]},
        },
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "intermediate_size": 33792,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "num_experts": 896,
        "num_experts_per_token": 16,
        "num_shared_experts": 2,
        "moe_intermediate_size": 3072,
        "routed_expert_hidden_size": 3584,
        "latent_moe_use_norm": True,
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True,
        "routed_scaling_factor": 2.5,
        "topk_method": "noaux_tc",
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "attn_res_block_size": 12,
        "rms_norm_eps": 1e-05,
        "tie_word_embeddings": False,
        "max_position_embeddings": 1048576,
        "num_nextn_predict_layers": 0,
        "initializer_range": 0.02,
        "bos_token_id": 163584,
        "eos_token_id": 163586,
        "pad_token_id": 163839,
        "torch_dtype": "bfloat16",
        "attention_dropout": 0.0,
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "mxfp4-pack-quantized",
            "config_groups": {"group_0": {"targets": ["re:.*experts\\.\\d+\\.w[123]$"]}},
        },
    }


def released_multimodal_config() -> dict:
    return {
        "model_type": "kimi_k3",
        "architectures": ["KimiK3ForConditionalGeneration"],
        "text_config": released_text_config(),
        "vision_config": {
            "model_type": "kimi_k3_vision",
            "patch_size": 14,
            "vt_hidden_size": 1024,
            "vt_num_hidden_layers": 27,
            "merge_kernel_size": [2, 2],
            "projector_ln_eps": 1e-5,
        },
        "media_placeholder_token_id": 163605,
        "ignore_index": -100,
        "tie_word_embeddings": False,
        "a_future_top_level_key": {"nested": True},
    }


def tiny_text_config_file() -> dict:
    """A text-only file whose values all differ from the K3 defaults (so parsing is really checked)."""
    return {
        "model_type": "kimi_linear",
        "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 8,
        "num_attention_heads": 3, "num_key_value_heads": 3,
        "q_lora_rank": 40, "kv_lora_rank": 20, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12,
        "mla_use_nope": True, "mla_use_output_gate": True,
        "linear_attn_config": {"num_heads": 3, "head_dim": 16, "short_conv_kernel_size": 3,
                               "kda_layers": [1, 2, 3, 5, 6, 7], "full_attn_layers": [4, 8],
                               "use_full_rank_gate": True, "gate_lower_bound": -4.0},
        "hidden_act": "situ", "activation_situ_beta": 3.0, "activation_situ_linear_beta": 20.0,
        "intermediate_size": 96, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 2, "moe_intermediate_size": 20,
        "routed_expert_hidden_size": 48, "latent_moe_use_norm": True, "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True, "routed_scaling_factor": 2.5, "topk_method": "noaux_tc",
        "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1, "attn_res_block_size": 3,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "initializer_range": 0.15,
        "bos_token_id": None, "eos_token_id": 5, "pad_token_id": None,
        "rope_theta": 10000.0,
    }


def meta_count(config: K3Config):
    with torch.device("meta"):
        model = K3ForCausalLM(config)
    return count_parameters(model, config)


# ---------------------------------------------------------------------------------------------- presets
@pytest.mark.parametrize("name", ["k3-full", "k3-small", "k3-tiny"])
def test_preset_keeps_k3_structure(name):
    """Every preset keeps the K3 schedule: [KDA,KDA,KDA,MLA]×n + final MLA, dense layer 0, partial last block (§1.4)."""
    c = K3Config.from_preset(name)
    L = c.num_hidden_layers
    types = c.layer_types
    assert types == ["mla" if (i + 1) % 4 == 0 or i == L - 1 else "kda" for i in range(L)]
    assert types[-2:] == ["mla", "mla"]
    assert sorted(c.kda_layers + c.full_attn_layers) == list(range(1, L + 1))
    assert not c.is_moe_layer(0) and all(c.is_moe_layer(i) for i in range(1, L))
    assert L % c.attn_res_block_size != 0, "the last AttnRes block must be partial, like 93 / 12"
    assert c.num_shared_experts == 2
    assert c.routed_expert_hidden_size < c.hidden_size
    assert c.mla_use_nope and c.gate_lower_bound == -5.0 and c.hidden_act == "situ"


def test_long_preset_is_k3_small_with_narrow_mla():
    """k3-long: the 3:1 schedule at 8 layers ([KDA,KDA,KDA,MLA]×2) and k3-small's widths but for MLA, narrowed to
    2 heads of 16 + 8 over a 16 + 8 latent (its prefill's T²/2 attention pairs per layer, docs/long-context.md)."""
    long, small = K3Config.from_preset("k3-long"), K3Config.from_preset("k3-small")
    assert long.layer_types == ["kda", "kda", "kda", "mla"] * 2
    mla = {"num_attention_heads": 2, "num_key_value_heads": 2, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
           "qk_rope_head_dim": 8, "v_head_dim": 16}
    assert {k: getattr(long, k) for k in mla} == mla
    same = set(PRESETS["k3-small"]) - set(mla) - {"num_hidden_layers", "layer_types", "kda_layers",
                                                  "full_attn_layers", "linear_attn_config"}
    assert {k: getattr(long, k) for k in same} == {k: getattr(small, k) for k in same}
    assert long.mla_use_nope and long.mla_use_output_gate


def test_full_preset_is_the_release():
    """k3-full has the released schedule: 69 KDA + 24 MLA, MLA at 1-based 4, 8, …, 92, 93 (§1.1, §1.4)."""
    c = K3Config.from_preset("k3-full")
    assert c.layer_types.count("kda") == 69 and c.layer_types.count("mla") == 24
    assert c.full_attn_layers == list(range(4, 93, 4)) + [93]
    assert (c.num_experts, c.num_experts_per_token, c.routed_expert_hidden_size, c.intermediate_size) == (
        896, 16, 3584, 33792)
    assert c.attn_res_block_size == 12 and c.rms_norm_eps == 1e-5 and c.tie_word_embeddings is False


def test_preset_sizes():
    """k3-tiny has ≤ 10M parameters (CPU-trainable) and k3-small 100–300M (meta-device count)."""
    tiny, small = meta_count(K3Config.from_preset("k3-tiny")), meta_count(K3Config.from_preset("k3-small"))
    assert 0 < tiny.total_params <= 10_000_000
    assert 100_000_000 <= small.total_params <= 300_000_000
    assert set(PRESETS) >= {"k3-full", "k3-small", "k3-tiny"}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_states_its_context_length(name):
    """Every preset carries max_position_embeddings and writes it to text_config (llama.cpp's converter reads it as
    `kimi-k3.context_length` and llama.cpp refuses a GGUF without it): the release's 1M for the K3 presets,
    K2's 128K for kimi-k2."""
    c = K3Config.from_preset(name)
    expected = 131072 if name == "kimi-k2" else 1048576
    assert c.max_position_embeddings == expected
    for config in (c, c.released_layout()):  # the file `save` writes and the one `save_pretrained` writes
        text = config.to_dict().get("text_config", config.to_dict())
        assert text["max_position_embeddings"] == expected
    assert K3Config.from_dict(c.to_dict()).max_position_embeddings == expected


def test_a_file_without_a_context_length_keeps_none_but_a_checkpoint_states_one():
    """A file that lacks max_position_embeddings reads as None and is written back without it (verbatim), while
    released_layout (what save_pretrained and training checkpoints write) states the default 1,048,576."""
    src = tiny_text_config_file()
    assert "max_position_embeddings" not in src
    cfg = K3Config.from_dict(copy.deepcopy(src))
    assert cfg.max_position_embeddings is None and cfg.to_dict() == src
    assert cfg.released_layout().to_dict()["text_config"]["max_position_embeddings"] == 1048576
    multimodal = _drop(released_multimodal_config(), "text_config.max_position_embeddings")
    out = K3Config.from_dict(multimodal).released_layout().to_dict()
    assert out == released_multimodal_config()  # the one key added, nothing else changed
    assert K3Config.from_dict(src, max_position_embeddings=4096).released_layout().max_position_embeddings == 4096


def test_unknown_preset_raises():
    """An unknown preset name raises ValueError naming it."""
    with pytest.raises(ValueError, match="k3-huge"):
        K3Config.from_preset("k3-huge")


# -------------------------------------------------------------------------------------------- JSON I/O
def test_multimodal_round_trip_is_verbatim():
    """A multimodal released config.json → from_dict → to_dict is identical, unknown keys included (§1.2, §1.3)."""
    src = released_multimodal_config()
    cfg = K3Config.from_dict(copy.deepcopy(src))
    assert cfg.to_dict() == src
    # and it was really parsed, not just carried
    assert cfg.hidden_size == 7168 and cfg.kda_num_heads == 96 and cfg.kda_head_dim == 128
    assert cfg.routed_scaling_factor == 2.5 and cfg.gate_lower_bound == -5.0
    assert cfg.layer_types.count("mla") == 24


@pytest.mark.parametrize("make", [released_multimodal_config, released_text_config])
def test_every_released_key_survives_save_and_load(tmp_path, make):
    """Each key of the released config.json, at the top level and inside text_config (and linear_attn_config,
    vision_config), is written back by save() with its value and type after from_json → save → from_json:
    max_position_embeddings, quantization_config, torch_dtype, the token ids, rope_theta, legacy and unknown keys."""
    src = make()
    K3Config.from_dict(copy.deepcopy(src)).save(tmp_path)
    first = (tmp_path / "config.json").read_bytes()
    loaded = K3Config.from_json(tmp_path)
    loaded.save(tmp_path)
    assert (tmp_path / "config.json").read_bytes() == first
    written = json.loads(first)

    def same(a, b, where=""):
        assert type(a) is type(b), f"{where}: {a!r} written as {b!r}"
        if isinstance(a, dict):
            assert set(a) == set(b), f"{where}: keys {set(a) ^ set(b)}"
            for key in a:
                same(a[key], b[key], f"{where}.{key}")
        else:
            assert a == b, f"{where}: {a!r} written as {b!r}"

    same(src, written)
    text = written.get("text_config", written)
    assert text["max_position_embeddings"] == loaded.max_position_embeddings == 1048576
    assert text["quantization_config"]["format"] == "mxfp4-pack-quantized" and text["torch_dtype"] == "bfloat16"
    assert (text["bos_token_id"], text["eos_token_id"], text["pad_token_id"]) == (163584, 163586, 163839)
    assert text["rope_theta"] == loaded.rope_theta == 50000.0


def test_text_only_round_trip_and_parsing():
    """A text-only file round-trips verbatim and every (non-default) value is read into its field."""
    src = tiny_text_config_file()
    cfg = K3Config.from_dict(copy.deepcopy(src))
    assert cfg.to_dict() == src
    assert cfg.multimodal is None
    assert (cfg.kda_num_heads, cfg.kda_head_dim, cfg.short_conv_kernel_size, cfg.gate_lower_bound) == (3, 16, 3, -4.0)
    assert (cfg.activation_situ_beta, cfg.activation_situ_linear_beta, cfg.rms_norm_eps) == (3.0, 20.0, 1e-6)
    assert cfg.kda_layers == [1, 2, 3, 5, 6, 7] and cfg.full_attn_layers == [4, 8]
    assert cfg.eos_token_id == 5 and cfg.bos_token_id is None


def test_from_dict_does_not_alias_its_input():
    """Mutating the config after from_dict must not change the caller's dict (deep copies)."""
    src = released_multimodal_config()
    cfg = K3Config.from_dict(src)
    cfg.kda_layers.append(999)
    cfg.extra["quantization_config"]["format"] = "x"
    cfg.multimodal["vision_config"]["patch_size"] = 1
    assert src == released_multimodal_config()


def test_knobs_are_written_only_when_changed():
    """A non-default knob (kda_chunk_size) is written and read back; the default one is not written (§1.3)."""
    src = tiny_text_config_file()
    assert "kda_chunk_size" not in K3Config.from_dict(src).to_dict()
    d = K3Config.from_dict(src, kda_chunk_size=32).to_dict()
    assert d["kda_chunk_size"] == 32 and K3Config.from_dict(d).kda_chunk_size == 32


@pytest.mark.parametrize("make", [released_multimodal_config, tiny_text_config_file])
def test_save_and_from_json(tmp_path, make):
    """save() writes config.json into a directory; from_json(dir) and from_json(file) read it back verbatim."""
    src = make()
    K3Config.from_dict(copy.deepcopy(src)).save(tmp_path)
    path = tmp_path / "config.json"
    assert json.loads(path.read_text()) == src
    assert K3Config.from_json(tmp_path).to_dict() == src
    assert K3Config.from_json(path).to_dict() == src
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]  # no temp file left behind


def test_from_json_errors(tmp_path):
    """A missing file raises FileNotFoundError; invalid JSON and non-object JSON raise ValueError."""
    with pytest.raises(FileNotFoundError):
        K3Config.from_json(tmp_path / "nope.json")
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError):
        K3Config.from_json(tmp_path)
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError):
        K3Config.from_json(bad)
    with pytest.raises(ValueError, match="linear_attn_config"):
        K3Config.from_dict({**tiny_text_config_file(), "linear_attn_config": [1]})


def test_missing_fields_take_spec_defaults():
    """Missing activation_situ_beta → 1.0, activation_situ_linear_beta → None, routed_scaling_factor → 1.0 (§6.1, §13.1)."""
    src = tiny_text_config_file()
    for key in ("activation_situ_beta", "activation_situ_linear_beta", "routed_scaling_factor"):
        del src[key]
    cfg = K3Config.from_dict(src)
    assert cfg.activation_situ_beta == 1.0
    assert cfg.activation_situ_linear_beta is None
    assert cfg.routed_scaling_factor == 1.0
    # explicit values are respected
    cfg2 = K3Config.from_dict({**src, "activation_situ_linear_beta": None, "routed_scaling_factor": 1.5})
    assert cfg2.activation_situ_linear_beta is None and cfg2.routed_scaling_factor == 1.5


# ------------------------------------------------------------------------------------------- validation
_POSITIVE_INT_FIELDS = [
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
    "qk_nope_head_dim", "v_head_dim", "kda_num_heads", "kda_head_dim", "short_conv_kernel_size",
    "intermediate_size", "moe_layer_freq", "num_experts", "num_experts_per_token", "moe_intermediate_size",
    "routed_expert_hidden_size", "attn_res_block_size", "kda_chunk_size", "num_expert_group", "topk_group",
]

_BAD = [
    # partition of 1..L into kda_layers ∪ full_attn_layers (§0.3)
    ("overlap", dict(kda_layers=[1, 2, 3, 4, 5, 6, 7]), "kda_layers"),
    ("gap", dict(kda_layers=[1, 2, 3, 5, 6]), "kda_layers"),
    ("out of range high", dict(full_attn_layers=[4, 9], kda_layers=[1, 2, 3, 5, 6, 7]), "full_attn_layers"),
    ("out of range zero", dict(kda_layers=[0, 1, 2, 3, 5, 6, 7]), "kda_layers"),
    ("duplicate", dict(full_attn_layers=[4, 4, 8]), "full_attn_layers"),
    ("not ints", dict(kda_layers=[1, 2, 3, 5, 6, 7.0]), "kda_layers"),
    ("top-k > experts", dict(num_experts_per_token=9), "num_experts_per_token"),
    ("GQA", dict(num_key_value_heads=1), "num_key_value_heads"),
    ("odd RoPE width", dict(mla_use_nope=False, qk_rope_head_dim=7), "qk_rope_head_dim"),
    ("full-width experts", dict(use_latent_moe=False), "routed_expert_hidden_size"),
    ("hidden_act", dict(hidden_act="gelu"), "hidden_act"),
    ("router act", dict(moe_router_activation_func="softmax"), "moe_router_activation_func"),
    ("topk method", dict(topk_method="greedy"), "topk_method"),
    ("positive lower bound", dict(gate_lower_bound=2.0), "gate_lower_bound"),
    ("zero lower bound", dict(gate_lower_bound=0.0), "gate_lower_bound"),
    ("beta1", dict(activation_situ_beta=0.0), "activation_situ_beta"),
    ("beta2", dict(activation_situ_linear_beta=-25.0), "activation_situ_linear_beta"),
    ("eps", dict(rms_norm_eps=0.0), "rms_norm_eps"),
    ("scaling", dict(routed_scaling_factor=0.0), "routed_scaling_factor"),
    ("tied", dict(tie_word_embeddings=True), "tie_word_embeddings"),
    ("bos ≥ vocab", dict(bos_token_id=256), "bos_token_id"),
    ("eos negative", dict(eos_token_id=-1), "eos_token_id"),
    ("pad ≥ vocab", dict(pad_token_id=1000), "pad_token_id"),
    ("topk_group > groups", dict(num_expert_group=2, topk_group=3), "topk_group"),
    ("groups do not divide", dict(num_expert_group=3, topk_group=1), "num_expert_group"),
    ("negative rope", dict(qk_rope_head_dim=-1), "qk_rope_head_dim"),
    ("negative shared", dict(num_shared_experts=-1), "num_shared_experts"),
    ("negative dense", dict(first_k_dense_replace=-1), "first_k_dense_replace"),
    ("context 0", dict(max_position_embeddings=0), "max_position_embeddings"),
    ("float context", dict(max_position_embeddings=1048576.0), "max_position_embeddings"),
] + [(f"{f}=0", {f: 0}, f) for f in _POSITIVE_INT_FIELDS] + [
    ("negative size", dict(hidden_size=-64), "hidden_size"),
    ("float size", dict(hidden_size=64.0), "hidden_size"),
    ("bool size", dict(num_experts=True), "num_experts"),
]


@pytest.mark.parametrize("case,overrides,field", _BAD, ids=[c[0] for c in _BAD])
def test_validation_names_the_field(tiny_config, case, overrides, field):
    """Each validation rule raises ValueError whose message names the offending field (§1.3)."""
    tiny_config()  # the base is valid
    with pytest.raises(ValueError) as exc:
        tiny_config(**overrides)
    assert re.search(rf"(?<![A-Za-z_]){field}(?![A-Za-z_])", str(exc.value)), str(exc.value)


def test_replace_and_from_dict_validate(tiny_config):
    """replace() and from_dict() go through the same validation."""
    with pytest.raises(ValueError, match="num_key_value_heads"):
        tiny_config().replace(num_key_value_heads=2)
    bad = tiny_text_config_file()
    bad["linear_attn_config"]["full_attn_layers"] = [4]
    with pytest.raises(ValueError, match="kda_layers"):
        K3Config.from_dict(bad)


def test_null_gate_cap_is_rejected(tiny_config):
    """activation_situ_beta = null has no meaning (§6.1 defines null only for β₂; a missing β₁ means 1.0)."""
    with pytest.raises(ValueError, match="activation_situ_beta"):
        tiny_config(activation_situ_beta=None)


# --------------------------------------------------------------------------- malformed config.json files
def write_config(tmp_path, data) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    return str(path)


def one_line_error(path_or_dir) -> str:
    """The ConfigError of from_json, checked to be one line that starts with the file's path."""
    with pytest.raises(ConfigError) as exc:
        K3Config.from_json(path_or_dir)
    message = str(exc.value)
    assert "\n" not in message and isinstance(exc.value, ValueError), message
    return message


def _lac(**changes) -> dict:
    return {**tiny_text_config_file(), "linear_attn_config": {**tiny_text_config_file()["linear_attn_config"],
                                                              **changes}}


_WRONG_TYPES = [
    ("eps string", {"rms_norm_eps": "1e-5"}, "rms_norm_eps must be a number, got '1e-5'"),
    ("eps infinite", {"rms_norm_eps": float("inf")}, "rms_norm_eps must be a finite number, got Infinity"),
    ("float count", {"num_experts": 2.5}, "num_experts must be an integer, got 2.5"),
    ("bool count", {"num_experts": True}, "num_experts must be an integer, got true"),
    ("bool size", {"hidden_size": False}, "hidden_size must be an integer, got false"),
    ("null size", {"vocab_size": None}, "vocab_size must be an integer, got null"),
    ("string flag", {"mla_use_output_gate": "yes"}, "mla_use_output_gate must be true or false, got 'yes'"),
    ("int act", {"hidden_act": 5}, "hidden_act must be a string, got 5"),
    ("list token id", {"eos_token_id": [1, 2]}, "eos_token_id must be an integer or null, got [1, 2]"),
    ("lac list", {"linear_attn_config": [1, 2]}, "linear_attn_config must be an object, got [1, 2]"),
    ("lac null", {"linear_attn_config": None}, "linear_attn_config must be an object, got null"),
    ("lac heads", _lac(num_heads="3"), "linear_attn_config.num_heads must be an integer, got '3'"),
    ("lac layers", _lac(kda_layers=[1, "2"]), "linear_attn_config.kda_layers must be a list of integers, got [1, '2']"),
    ("lac bound", _lac(gate_lower_bound="low"), "linear_attn_config.gate_lower_bound must be a number or null"),
]


@pytest.mark.parametrize("case,changes,expected", _WRONG_TYPES, ids=[c[0] for c in _WRONG_TYPES])
def test_wrong_json_type_names_file_and_key(tmp_path, case, changes, expected):
    """A value of the wrong JSON type is one ConfigError naming config.json and the key, never a TypeError."""
    path = write_config(tmp_path, {**tiny_text_config_file(), **changes})
    assert one_line_error(tmp_path).startswith(f"{path}: {expected}")
    assert one_line_error(path).startswith(f"{path}: {expected}")  # the file path itself: same message


def _multimodal(**top) -> dict:
    return {**released_multimodal_config(), **top}


def _text(**changes) -> dict:
    return _multimodal(text_config={**released_text_config(), **changes})


_WRONG_MULTIMODAL = [
    ("text_config string", _multimodal(text_config="hi"), "text_config must be an object, got 'hi'"),
    ("text_config list", _multimodal(text_config=[1]), "text_config must be an object, got [1]"),
    ("vision_config int", _multimodal(vision_config=3), "vision_config must be an object, got 3"),
    ("vision_config list", _multimodal(vision_config=[]), "vision_config must be an object, got []"),
    ("vision field", _multimodal(vision_config={"patch_size": "14"}),
     "vision_config.patch_size must be an integer, got '14'"),
    ("placeholder", _multimodal(media_placeholder_token_id="x"),
     "media_placeholder_token_id must be a token id (a non-negative integer), got 'x'"),
    ("text field", _text(rms_norm_eps="1e-5"), "text_config.rms_norm_eps must be a number, got '1e-5'"),
    ("text rule", _text(num_key_value_heads=1), "text_config.num_key_value_heads must equal num_attention_heads"),
    ("lac rule", _text(linear_attn_config={**released_text_config()["linear_attn_config"], "full_attn_layers": [4]}),
     "text_config.linear_attn_config.kda_layers together with full_attn_layers must partition 1..93"),
    ("top level list", [1, 2], "the top level must be a JSON object, got [1, 2]"),
    ("top level string", "config", "the top level must be a JSON object, got 'config'"),
]


@pytest.mark.parametrize("case,data,expected", _WRONG_MULTIMODAL, ids=[c[0] for c in _WRONG_MULTIMODAL])
def test_malformed_multimodal_file_names_file_and_key(tmp_path, case, data, expected):
    """Errors in a multimodal file name the key by its place in the file (text_config.…, vision_config.…)."""
    path = write_config(tmp_path, data)
    assert one_line_error(tmp_path).startswith(f"{path}: {expected}")


@pytest.mark.parametrize("content", [b"{not json", b"\xff\xfe\x00garbage", b""])
def test_invalid_json_names_the_file(tmp_path, content):
    (tmp_path / "config.json").write_bytes(content)
    assert one_line_error(tmp_path).startswith(f"{tmp_path / 'config.json'} is not valid JSON")


def test_a_file_given_for_the_checkpoint_directory_is_refused(tmp_path):
    """from_json(a .safetensors file) names the path and says what is expected; a config.json file still works."""
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\x00" * 16)
    K3Config.from_preset("k3-tiny").save(tmp_path)
    assert one_line_error(weights) == (f"{weights} is a file; expected a checkpoint directory with config.json "
                                       "(or a config.json file)")
    assert K3Config.from_json(tmp_path / "config.json").hidden_size == 128


def test_validation_error_values_are_summarised():
    """A huge list in a rule violation is shown as its first few entries and a count, not in full."""
    layers = list(range(1, 100_001))
    with pytest.raises(ConfigError) as exc:
        K3Config.from_preset("k3-tiny", kda_layers=layers)
    assert len(str(exc.value)) < 300 and "and 99,995 more" in str(exc.value)


def test_summarize():
    assert summarize([]) == ""
    assert summarize(["a", "b"]) == "a, b"
    assert summarize(range(12_800_000)) == "0, 1, 2, 3, 4 and 12,799,995 more"
    assert summarize((f"t{i}" for i in range(10**12)), 10**12, limit=2, sep="; ") == "t0; t1 and 999,999,999,998 more"


# ----------------------------------------------------------------------------------- required keys
def _drop(data: dict, *keys: str) -> dict:
    data = copy.deepcopy(data)
    for key in keys:
        holder = data
        *parents, last = key.split(".")
        for parent in parents:
            holder = holder[parent]
        del holder[last]
    return data


@pytest.mark.parametrize("key", list(_REQUIRED_KEYS) + [f"linear_attn_config.{k}" for k in _REQUIRED_LINEAR_ATTN_KEYS]
                         + ["linear_attn_config"])
def test_every_required_key_is_named_when_missing(tmp_path, key):
    """A file without a shape/architecture key fails naming it, instead of silently taking the k3-full value."""
    path = write_config(tmp_path, _drop(tiny_text_config_file(), key))
    message = one_line_error(tmp_path)
    assert message.startswith(f"{path}: missing required key {key} (")


def test_all_missing_keys_are_named_with_their_place_in_the_file(tmp_path):
    """Every missing key is listed (not summarised), prefixed text_config. in a multimodal file."""
    path = write_config(tmp_path, _drop(released_multimodal_config(), "text_config.hidden_size",
                                        "text_config.num_experts", "text_config.linear_attn_config.head_dim"))
    assert one_line_error(tmp_path).startswith(
        f"{path}: missing required keys text_config.hidden_size, text_config.num_experts, "
        "text_config.linear_attn_config.head_dim (")
    message = one_line_error(write_config(tmp_path, {"model_type": "kimi_linear"}))
    assert all(key in message for key in _REQUIRED_KEYS) and "more" not in message


def test_only_documented_defaults_may_be_omitted():
    """The FILE_DEFAULTS keys may be absent and then take their documented meaning (§6.1, §13.1)."""
    src = _drop(tiny_text_config_file(), *(k for k in FILE_DEFAULTS if k in tiny_text_config_file()))
    cfg = K3Config.from_dict(src)
    for key, value in FILE_DEFAULTS.items():
        assert getattr(cfg, key) == value, key
    assert cfg.bos_token_id is None and cfg.routed_scaling_factor == 1.0 and cfg.activation_situ_beta == 1.0
    assert set(FILE_DEFAULTS).isdisjoint(_REQUIRED_KEYS)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_saves_and_loads_back(tmp_path, name):
    """save() of every preset has all required keys, loads back to the same config and re-saves byte-identically."""
    preset = K3Config.from_preset(name)
    preset.save(tmp_path)
    first = (tmp_path / "config.json").read_bytes()
    loaded = K3Config.from_json(tmp_path)
    assert loaded.to_dict() == preset.to_dict()
    assert all(getattr(loaded, f) == getattr(preset, f) for f in preset.__dataclass_fields__ if f != "extra")
    loaded.save(tmp_path)
    assert (tmp_path / "config.json").read_bytes() == first
