"""Checkpoint name translation and safetensors I/O (docs/architecture.md §11), on small synthetic state dicts."""

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import k3.checkpoint.io as checkpoint_io
from k3.checkpoint import (
    CheckpointError,
    encode_mxfp4,
    from_hf_state_dict,
    load_checkpoint_state,
    save_checkpoint_state,
    to_hf_state_dict,
)

KDA_HEADS = 3
HIDDEN = 10
FP32_NAMES = {
    "model.layers.0.self_attn.A_log",
    "model.layers.0.self_attn.dt_bias",
    "model.layers.0.self_attn.q_conv1d.weight",
    "model.layers.0.self_attn.k_conv1d.weight",
    "model.layers.0.self_attn.v_conv1d.weight",
    "model.layers.0.self_attn.o_norm.weight",
    "model.layers.1.block_sparse_moe.gate.e_score_correction_bias",
}
STACKED = "model.layers.1.block_sparse_moe.experts"


def internal_state(num_experts: int = 4, expert_dim: int = 6, latent: int = 8, seed: int = 0) -> dict:
    """Internal state dict: layer 0 = KDA + dense FFN, layer 1 = MLA + MoE with stacked experts.

    Distinct, mostly non-power-of-2 sizes; bf16 except the fp32 set (§0.4).
    """
    kda_width = KDA_HEADS * 5
    shapes = {
        "model.embed_tokens.weight": (22, HIDDEN),
        "lm_head.weight": (22, HIDDEN),
        "model.norm.weight": (HIDDEN,),
        "model.output_attn_res_norm.weight": (HIDDEN,),
        "model.output_attn_res_proj.weight": (1, HIDDEN),
    }
    for layer in (0, 1):
        prefix = f"model.layers.{layer}."
        for norm in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
            shapes[f"{prefix}{norm}.weight"] = (HIDDEN,)
        for proj in ("self_attention_res_proj", "mlp_res_proj"):
            shapes[f"{prefix}{proj}.weight"] = (1, HIDDEN)
    kda = "model.layers.0.self_attn."
    shapes |= {f"{kda}{p}_proj.weight": (kda_width, HIDDEN) for p in "qkvg"}
    shapes |= {f"{kda}{p}_conv1d.weight": (kda_width, 1, 4) for p in "qkv"}
    shapes |= {
        f"{kda}A_log": (KDA_HEADS,),
        f"{kda}dt_bias": (kda_width,),
        f"{kda}f_a_proj.weight": (5, HIDDEN),
        f"{kda}f_b_proj.weight": (kda_width, 5),
        f"{kda}b_proj.weight": (KDA_HEADS, HIDDEN),
        f"{kda}o_norm.weight": (5,),
        f"{kda}o_proj.weight": (HIDDEN, kda_width),
        "model.layers.0.mlp.gate_proj.weight": (14, HIDDEN),
        "model.layers.0.mlp.up_proj.weight": (14, HIDDEN),
        "model.layers.0.mlp.down_proj.weight": (HIDDEN, 14),
    }
    mla = "model.layers.1.self_attn."
    shapes |= {
        f"{mla}q_a_proj.weight": (7, HIDDEN),
        f"{mla}q_a_layernorm.weight": (7,),
        f"{mla}q_b_proj.weight": (18, 7),
        f"{mla}kv_a_proj_with_mqa.weight": (9, HIDDEN),
        f"{mla}kv_a_layernorm.weight": (6,),
        f"{mla}kv_b_proj.weight": (24, 6),
        f"{mla}g_proj.weight": (12, HIDDEN),
        f"{mla}o_proj.weight": (HIDDEN, 12),
    }
    moe = "model.layers.1.block_sparse_moe."
    shapes |= {
        f"{moe}gate.weight": (num_experts, HIDDEN),
        f"{moe}gate.e_score_correction_bias": (num_experts,),
        f"{STACKED}.w1": (num_experts, expert_dim, latent),
        f"{STACKED}.w3": (num_experts, expert_dim, latent),
        f"{STACKED}.w2": (num_experts, latent, expert_dim),
        f"{moe}shared_experts.gate_proj.weight": (11, HIDDEN),
        f"{moe}shared_experts.up_proj.weight": (11, HIDDEN),
        f"{moe}shared_experts.down_proj.weight": (HIDDEN, 11),
        f"{moe}routed_expert_down_proj.weight": (latent, HIDDEN),
        f"{moe}routed_expert_up_proj.weight": (HIDDEN, latent),
        f"{moe}routed_expert_norm.weight": (latent,),
    }
    generator = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(shape, generator=generator).to(torch.float32 if name in FP32_NAMES else torch.bfloat16)
        for name, shape in shapes.items()
    }


def shapes_of(state: dict) -> dict:
    return {name: tensor.shape for name, tensor in state.items()}


def assert_bit_exact(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype, name
        assert actual[name].shape == tensor.shape, name
        assert torch.equal(actual[name].view(torch.uint8), tensor.view(torch.uint8)), name


def load_error(hf: dict, expected: dict) -> str:
    with pytest.raises(CheckpointError) as error:
        from_hf_state_dict(hf, expected)
    return str(error.value)


# ---------------------------------------------------------------------------------------------- translation


def test_to_hf_pads_a_log_and_splits_experts():
    state = internal_state()
    hf = to_hf_state_dict(state, KDA_HEADS)
    a_log = hf["model.layers.0.self_attn.A_log"]
    assert a_log.shape == (128,) and a_log.dtype == torch.float32
    assert torch.equal(a_log[:KDA_HEADS], state["model.layers.0.self_attn.A_log"]) and not a_log[KDA_HEADS:].any()
    for projection, shape in (("w1", (6, 8)), ("w3", (6, 8)), ("w2", (8, 6))):
        assert f"{STACKED}.{projection}" not in hf
        for expert in range(4):
            weight = hf[f"{STACKED}.{expert}.{projection}.weight"]
            assert weight.shape == shape
            assert torch.equal(weight, state[f"{STACKED}.{projection}"][expert])
    untouched = state.keys() - {f"{STACKED}.w{i}" for i in (1, 2, 3)} - {"model.layers.0.self_attn.A_log"}
    assert all(hf[name] is state[name] for name in untouched)
    assert len(hf) == len(untouched) + 1 + 3 * 4


def test_to_hf_rejects_wrong_a_log_length():
    state = internal_state()
    with pytest.raises(CheckpointError, match=r"A_log: expected \[4\] \(KDA heads\), got \[3\]"):
        to_hf_state_dict(state, num_kda_heads=4)


def test_round_trip_is_bit_exact():
    state = internal_state()
    assert_bit_exact(from_hf_state_dict(to_hf_state_dict(state, KDA_HEADS), shapes_of(state)), state)


def test_expected_may_be_meta_tensors():
    state = internal_state()
    expected = {name: torch.empty_like(tensor, device="meta") for name, tensor in state.items()}
    assert_bit_exact(from_hf_state_dict(to_hf_state_dict(state, KDA_HEADS), expected), state)


def test_language_model_prefix_stripped_and_non_text_skipped():
    state = internal_state()
    hf = {f"language_model.{name}": tensor for name, tensor in to_hf_state_dict(state, KDA_HEADS).items()}
    hf["model.norm.weight"] = hf.pop("language_model.model.norm.weight")  # prefixes may be mixed
    hf["vision_tower.encoder.final_layernorm.weight"] = torch.ones(4)
    hf["mm_projector.post_norm.weight"] = torch.ones(HIDDEN)
    assert_bit_exact(from_hf_state_dict(hf, shapes_of(state)), state)


def test_tensor_stored_with_and_without_prefix_is_rejected():
    hf = {"model.norm.weight": torch.ones(2), "language_model.model.norm.weight": torch.ones(2)}
    with pytest.raises(CheckpointError, match="model.norm.weight is stored both with and without"):
        from_hf_state_dict(hf, {"model.norm.weight": (2,)})


def test_error_lists_missing_unexpected_and_misshaped_with_shapes():
    state = internal_state()
    hf = to_hf_state_dict(state, KDA_HEADS)
    del hf["model.norm.weight"], hf[f"{STACKED}.2.w2.weight"]
    hf["model.layers.0.self_attn.A_log"] = torch.zeros(96)
    hf["model.layers.1.self_attn.q_b_proj.weight"] = torch.zeros(18, 8)
    hf["model.layers.7.mlp.up_proj.weight"] = torch.zeros(3, 5)
    message = load_error(hf, shapes_of(state))
    assert "\n" not in message and message.startswith("checkpoint does not match the model (5 problems): ")
    assert f"2 missing (model.norm.weight: expected [10]; {STACKED}.2.w2.weight: expected [8, 6])" in message
    assert "1 unexpected (model.layers.7.mlp.up_proj.weight: found [3, 5])" in message
    assert ("2 mis-shaped (model.layers.0.self_attn.A_log: expected [128], found [96]; "
            "model.layers.1.self_attn.q_b_proj.weight: expected [18, 7], found [18, 8])") in message


def test_fp32_set_is_upcast_and_other_tensors_follow_dtype():
    state = internal_state()
    hf = {name: tensor.to(torch.bfloat16) for name, tensor in to_hf_state_dict(state, KDA_HEADS).items()}
    expected = shapes_of(state)

    kept = from_hf_state_dict(hf, expected)
    assert {name for name, tensor in kept.items() if tensor.dtype == torch.float32} == FP32_NAMES
    assert all(tensor.dtype == torch.bfloat16 for name, tensor in kept.items() if name not in FP32_NAMES)

    for dtype in (torch.float16, torch.float32):
        cast = from_hf_state_dict(hf, expected, dtype=dtype)
        assert all(tensor.dtype == (torch.float32 if name in FP32_NAMES else dtype) for name, tensor in cast.items())
        assert torch.equal(cast["model.norm.weight"], hf["model.norm.weight"].to(dtype))


def test_integer_tensors_keep_their_dtype():
    """An integer tensor the model expects (its spec is an integer tensor) is loaded as it is, never cast."""
    counts = torch.arange(5)
    expected = {"model.counts": torch.empty(5, dtype=torch.int64, device="meta")}
    loaded = from_hf_state_dict({"model.counts": counts}, expected, dtype=torch.bfloat16)
    assert loaded["model.counts"].dtype == torch.int64
    with pytest.raises(CheckpointError, match=r"model.counts: stored as int32, expected int64"):
        from_hf_state_dict({"model.counts": counts.int()}, expected)


# ------------------------------------------------------------------------------------------------------ MXFP4


def mxfp4_experts(state: dict) -> dict:
    """Official tensors of ``state`` with every routed expert in MXFP4 form instead of dense."""
    hf = {}
    for name, tensor in to_hf_state_dict(state, KDA_HEADS).items():
        if name.startswith(STACKED):
            stem = name.removesuffix(".weight")
            hf[f"{stem}.weight_packed"], hf[f"{stem}.weight_scale"] = encode_mxfp4(tensor)
        else:
            hf[name] = tensor
    return hf


def quantised_state() -> dict:
    """A state whose experts are exactly representable in MXFP4 (in-dims 96 and 160 are multiples of 32)."""
    state = internal_state(num_experts=3, expert_dim=96, latent=160)
    quantised = from_hf_state_dict(mxfp4_experts(state), shapes_of(state))
    for projection in ("w1", "w2", "w3"):
        name = f"{STACKED}.{projection}"
        assert not torch.equal(quantised[name], state[name])
        state[name] = quantised[name]
    return state


def test_mxfp4_experts_decode_on_load(tmp_path):
    state = quantised_state()
    hf = mxfp4_experts(state)
    assert hf[f"{STACKED}.1.w2.weight_packed"].shape == (160, 48)
    assert hf[f"{STACKED}.1.w2.weight_scale"].shape == (160, 3)
    save_file(hf, tmp_path / "model.safetensors")
    assert_bit_exact(load_checkpoint_state(tmp_path, shapes_of(state)), state)
    as_fp32 = load_checkpoint_state(tmp_path, shapes_of(state), dtype=torch.float32)
    assert torch.equal(as_fp32[f"{STACKED}.w3"], state[f"{STACKED}.w3"].float())


def test_mxfp4_expert_with_missing_scale_is_reported():
    state = quantised_state()
    hf = mxfp4_experts(state)
    del hf[f"{STACKED}.0.w1.weight_scale"]
    hf[f"{STACKED}.2.w2.weight_packed"] = hf[f"{STACKED}.2.w2.weight_packed"][:, :40]
    message = load_error(hf, shapes_of(state))
    assert f"{STACKED}.0.w1.weight_scale: expected [96, 5]" in message
    assert f"{STACKED}.2.w2.weight_packed: expected [160, 48], found [160, 40]" in message


def test_expert_stored_both_dense_and_packed_reports_the_packed_pair():
    state = quantised_state()
    hf = mxfp4_experts(state) | {f"{STACKED}.0.w1.weight": state[f"{STACKED}.w1"][0]}
    message = load_error(hf, shapes_of(state))
    assert "2 unexpected (" in message and f"{STACKED}.0.w1.weight_packed: found [96, 80]" in message


# --------------------------------------------------------------------------------------------------------- I/O


def test_save_single_file_and_reload_bit_exact(tmp_path):
    state = internal_state()
    save_checkpoint_state(tmp_path, state, KDA_HEADS)
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]
    loaded = load_checkpoint_state(tmp_path, shapes_of(state))
    assert_bit_exact(loaded, state)
    save_checkpoint_state(tmp_path / "again", loaded, KDA_HEADS)
    assert (tmp_path / "again/model.safetensors").read_bytes() == (tmp_path / "model.safetensors").read_bytes()


def test_saved_file_uses_official_layout(tmp_path):
    state = internal_state()
    save_checkpoint_state(tmp_path, state, KDA_HEADS, prefix="language_model.")
    with safe_open(tmp_path / "model.safetensors", framework="pt") as stored:
        assert stored.metadata() == {"format": "pt"}
        assert all(name.startswith("language_model.model.") or name == "language_model.lm_head.weight"
                   for name in stored.keys())
        assert stored.get_slice("language_model.model.layers.0.self_attn.A_log").get_shape() == [128]
        assert f"language_model.{STACKED}.3.w2.weight" in stored.keys()
    assert_bit_exact(load_checkpoint_state(tmp_path, shapes_of(state)), state)


def test_unknown_prefix_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="prefix must be"):
        save_checkpoint_state(tmp_path, internal_state(), KDA_HEADS, prefix="text.")


def test_sharded_save_writes_index_and_reloads_bit_exact(tmp_path):
    state = internal_state()
    (tmp_path / "config.json").write_text("{}")
    save_checkpoint_state(tmp_path, state, KDA_HEADS, max_shard_size=600)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    hf = to_hf_state_dict(state, KDA_HEADS)
    assert index["weight_map"].keys() == hf.keys()
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in hf.values())
    assert sorted(os.listdir(tmp_path)) == sorted(shards + ["config.json", "model.safetensors.index.json"])
    assert_bit_exact(load_checkpoint_state(tmp_path, shapes_of(state)), state)


def test_resave_replaces_previous_weight_files_and_keeps_others(tmp_path):
    first, second = internal_state(seed=1), internal_state(seed=2)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    save_checkpoint_state(tmp_path, first, KDA_HEADS, max_shard_size=600)
    save_checkpoint_state(tmp_path, second, KDA_HEADS)
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors", "tokenizer_config.json"]
    assert_bit_exact(load_checkpoint_state(tmp_path, shapes_of(second)), second)
    save_checkpoint_state(tmp_path, first, KDA_HEADS, max_shard_size=600)
    assert "model.safetensors" not in os.listdir(tmp_path)
    assert_bit_exact(load_checkpoint_state(tmp_path, shapes_of(first)), first)


def test_interrupted_save_leaves_previous_checkpoint_and_no_temp_dir(tmp_path, monkeypatch):
    previous = internal_state(seed=1)
    save_checkpoint_state(tmp_path, previous, KDA_HEADS, max_shard_size=600)
    before = sorted(os.listdir(tmp_path))
    writes = []

    def failing_save_file(tensors, filename, metadata):
        writes.append(filename)
        if len(writes) == 3:
            raise OSError("disk full")
        save_file(tensors, filename, metadata=metadata)

    monkeypatch.setattr(checkpoint_io, "save_file", failing_save_file)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint_state(tmp_path, internal_state(seed=2), KDA_HEADS, max_shard_size=600)
    assert sorted(os.listdir(tmp_path)) == before
    assert_bit_exact(load_checkpoint_state(tmp_path, shapes_of(previous)), previous)


def test_save_handles_shared_storage(tmp_path):
    state = internal_state()
    state["lm_head.weight"] = state["model.embed_tokens.weight"]  # tied weights share storage
    save_checkpoint_state(tmp_path, state, KDA_HEADS)
    assert_bit_exact(load_checkpoint_state(tmp_path, shapes_of(state)), state)


def test_load_single_safetensors_file(tmp_path):
    state = internal_state()
    save_file(to_hf_state_dict(state, KDA_HEADS), tmp_path / "weights.safetensors")
    assert_bit_exact(load_checkpoint_state(tmp_path / "weights.safetensors", shapes_of(state)), state)


def test_load_without_weights_fails_clearly(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="no model.safetensors or model.safetensors.index.json found"):
        load_checkpoint_state(tmp_path, {})


def test_index_referring_to_missing_shard_fails_clearly(tmp_path):
    save_checkpoint_state(tmp_path, internal_state(), KDA_HEADS, max_shard_size=600)
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"refers to missing files: {shard.name}"):
        load_checkpoint_state(tmp_path, {})


def test_index_placing_tensor_in_wrong_shard_fails_clearly(tmp_path):
    save_checkpoint_state(tmp_path, internal_state(), KDA_HEADS, max_shard_size=600)
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    weight_map = index["weight_map"]
    weight_map["model.norm.weight"] = next(f for f in weight_map.values() if f != weight_map["model.norm.weight"])
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="that it does not contain: model.norm.weight"):
        load_checkpoint_state(tmp_path, {})
