"""K3ForCausalLM.from_pretrained / save_pretrained on real models in the official layout (docs/architecture.md §11)."""

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from k3 import K3Config
from k3.checkpoint import CheckpointError, decode_mxfp4, encode_mxfp4, to_hf_state_dict
from k3.model import K3ForCausalLM
from k3.ops.mxfp4 import MXFP4Weight

IDS = torch.tensor([[5, 17, 300, 4095, 0, 9, 42, 77, 1000, 3]])


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.from_preset("k3-tiny"))
    with torch.no_grad():  # no parameter at a symmetric default
        for name, p in model.named_parameters():
            if name.endswith(("_res_proj.weight", "norm.weight", "A_log")):
                p.add_(0.1 * torch.randn_like(p))
        for layer in model.model.layers[1:]:
            layer.block_sparse_moe.gate.e_score_correction_bias.normal_(0, 0.05)
    return model


def _files(path):
    return {f: open(os.path.join(path, f), "rb").read() for f in sorted(os.listdir(path))}


def test_round_trip_is_bit_exact(tiny, tmp_path):
    """save → load → save reproduces every file byte for byte, and the reloaded model the logits."""
    tiny.save_pretrained(tmp_path / "a", max_shard_size=300_000)
    assert (tmp_path / "a" / "model.safetensors.index.json").exists()
    loaded = K3ForCausalLM.from_pretrained(tmp_path / "a")
    loaded.save_pretrained(tmp_path / "b", max_shard_size=300_000)
    assert _files(tmp_path / "a") == _files(tmp_path / "b")
    for (n1, t1), (n2, t2) in zip(tiny.state_dict().items(), loaded.state_dict().items()):
        assert n1 == n2 and t1.dtype == t2.dtype and torch.equal(t1, t2), n1
    assert torch.equal(tiny(IDS).logits, loaded(IDS).logits)


def test_official_names_and_a_log_padding(tiny, tmp_path):
    """The file uses per-expert w1/w2/w3 names and A_log padded to 128 (§11.2, §11.4)."""
    tiny.save_pretrained(tmp_path)
    stored = {k.removeprefix("language_model."): v for k, v in load_file(tmp_path / "model.safetensors").items()}
    assert stored["model.layers.0.self_attn.A_log"].shape == (128,)
    assert torch.equal(stored["model.layers.0.self_attn.A_log"][4:], torch.zeros(124))
    assert stored["model.layers.1.block_sparse_moe.experts.15.w2.weight"].shape == (64, 96)
    assert "model.layers.3.self_attn.kv_a_proj_with_mqa.weight" in stored  # layer 3 is MLA
    assert not any(".experts.w" in k for k in stored)


def test_multimodal_layout_uses_prefix_and_skips_vision(tiny, tmp_path):
    """A multimodal config saves under `language_model.`; vision tensors in the file are ignored on load."""
    top = {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"],
           "text_config": tiny.config.to_text_dict(), "media_placeholder_token_id": 7,
           "vision_config": {"vt_hidden_size": 8, "mm_hidden_size": 8, "text_hidden_size": tiny.config.hidden_size}}
    model = K3ForCausalLM(K3Config.from_dict(top))
    model.load_state_dict(tiny.state_dict())
    model.save_pretrained(tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    assert all(k.startswith("language_model.") for k in stored)
    stored["vision_tower.patch_embed.proj.weight"] = torch.zeros(8, 3, 14, 14)
    stored["mm_projector.post_norm.weight"] = torch.ones(8)
    save_file(stored, tmp_path / "model.safetensors")
    loaded = K3ForCausalLM.from_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["vision_config"]["vt_hidden_size"] == 8
    assert torch.equal(loaded(IDS).logits, tiny(IDS).logits)


def _save_mxfp4(model, path):
    """`model` written as the release stores it, its experts encoded here (not by save_pretrained); returns the
    stored (packed, scale) pairs by dense name."""
    hf = {k: v.contiguous() for k, v in to_hf_state_dict(model.state_dict(), model.config.kda_num_heads).items()}
    stored = {}
    for name in [k for k in hf if ".experts." in k]:
        packed, scale = encode_mxfp4(hf.pop(name))
        hf[name + "_packed"], hf[name + "_scale"] = packed, scale
        stored[name] = (packed, scale)
    save_file(hf, path / "model.safetensors")
    model.config.replace(extra={"quantization_config": {"format": "mxfp4-pack-quantized"}}).save(path)
    return stored


def test_mxfp4_experts_stay_packed_on_load(tiny, tmp_path):
    """MXFP4 routed experts load as stored (uint8 pairs, stacked per layer); a packed re-save writes the same bytes
    and the file's own quantization_config (§11.5)."""
    stored = _save_mxfp4(tiny, tmp_path)
    loaded = K3ForCausalLM.from_pretrained(tmp_path)
    w2 = loaded.model.layers[2].block_sparse_moe.experts.w2
    assert isinstance(w2, MXFP4Weight) and w2.weight_packed.dtype == torch.uint8
    assert torch.equal(w2.weight_packed[7], stored["model.layers.2.block_sparse_moe.experts.7.w2.weight"][0])
    assert torch.equal(w2.weight_scale[7], stored["model.layers.2.block_sparse_moe.experts.7.w2.weight"][1])
    dense = K3ForCausalLM.from_pretrained(tmp_path, experts="dense")
    torch.testing.assert_close(loaded(IDS).logits, dense(IDS).logits, rtol=1e-5, atol=1e-5)
    loaded.save_pretrained(tmp_path / "again")
    with safe_open(tmp_path / "again" / "model.safetensors", "pt") as f:
        for name, (packed, scale) in stored.items():
            name = "language_model." + name
            assert torch.equal(f.get_tensor(name + "_packed"), packed) and torch.equal(f.get_tensor(name + "_scale"),
                                                                                        scale), name
    config = json.loads((tmp_path / "again" / "config.json").read_text())
    assert config["text_config"]["quantization_config"] == {"format": "mxfp4-pack-quantized"}
    assert config["quantization_config"] == config["text_config"]["quantization_config"]


def test_mxfp4_experts_decoded_on_request(tiny, tmp_path):
    """experts="dense" decodes MXFP4 experts exactly; a dense re-save drops the quantization config."""
    stored = _save_mxfp4(tiny, tmp_path)
    loaded = K3ForCausalLM.from_pretrained(tmp_path, experts="dense")
    w2 = loaded.model.layers[2].block_sparse_moe.experts.w2
    assert w2.dtype == torch.float32  # the stored embedding's dtype
    assert torch.equal(w2[7], decode_mxfp4(*stored["model.layers.2.block_sparse_moe.experts.7.w2.weight"],
                                           dtype=torch.float32))
    original = tiny.model.layers[2].block_sparse_moe.experts.w2[7]
    assert 0 < (w2[7] - original).abs().max() <= original.abs().max() / 4  # quantisation error bound
    loaded.save_pretrained(tmp_path / "dense")
    dense = json.loads((tmp_path / "dense" / "config.json").read_text())
    assert "quantization_config" not in dense and "quantization_config" not in dense["text_config"]


def test_dense_model_saved_and_loaded_as_mxfp4(tiny, tmp_path):
    """save_pretrained(experts="mxfp4") writes the release's pairs and quantization_config; loading them packed, or
    loading the dense file with experts="mxfp4", gives the same weights."""
    tiny.save_pretrained(tmp_path / "packed", experts="mxfp4")
    tiny.save_pretrained(tmp_path / "dense")
    config = json.loads((tmp_path / "packed" / "config.json").read_text())
    assert config["text_config"]["quantization_config"]["format"] == "mxfp4-pack-quantized"
    assert config["text_config"]["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] == 32
    with safe_open(tmp_path / "packed" / "model.safetensors", "pt") as f:
        name = "language_model.model.layers.1.block_sparse_moe.experts.3.w1.weight"
        assert name not in f.keys()
        packed, scale = f.get_tensor(name + "_packed"), f.get_tensor(name + "_scale")
    assert (packed.dtype, scale.dtype) == (torch.uint8, torch.uint8)
    expected = encode_mxfp4(tiny.model.layers[1].block_sparse_moe.experts.w1[3])
    assert torch.equal(packed, expected[0]) and torch.equal(scale, expected[1])
    a = K3ForCausalLM.from_pretrained(tmp_path / "packed")
    b = K3ForCausalLM.from_pretrained(tmp_path / "dense", experts="mxfp4")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert torch.equal(a(IDS).logits, b(IDS).logits)


def test_bf16_load_keeps_fp32_set(tiny, tmp_path):
    """dtype=bf16 casts everything except A_log, dt_bias, conv weights, o_norm and the router bias (§0.4)."""
    tiny.save_pretrained(tmp_path)
    model = K3ForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    fp32 = {n for n, t in model.state_dict().items() if t.dtype == torch.float32}
    assert fp32 and all(n.endswith(("A_log", "dt_bias", "_conv1d.weight", "o_norm.weight",
                                    "e_score_correction_bias")) for n in fp32)
    assert len(fp32) == 6 * 6 + 8  # 6 KDA layers x 6 tensors + 8 MoE layers' router bias
    assert model(IDS).logits.dtype == torch.bfloat16


def test_mismatches_are_listed(tiny, tmp_path):
    """Missing, unexpected and mis-shaped tensors are reported together with names and shapes."""
    tiny.save_pretrained(tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    del stored["language_model.model.layers.4.self_attn.q_proj.weight"]
    stored["model.layers.4.self_attn.bogus"] = torch.zeros(3)
    stored["language_model.lm_head.weight"] = torch.zeros(4096, 127)
    save_file(stored, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError) as err:
        K3ForCausalLM.from_pretrained(tmp_path)
    msg = str(err.value)
    assert "model.layers.4.self_attn.q_proj.weight: expected [128, 128]" in msg
    assert "model.layers.4.self_attn.bogus: found [3]" in msg
    assert "lm_head.weight: expected [4096, 128], found [4096, 127]" in msg


def test_layer_type_comes_from_the_schedule(tiny, tmp_path):
    """Declaring layer 2 MLA and layer 3 KDA in config.json makes the same tensors fail to load."""
    tiny.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    lac = cfg["text_config"]["linear_attn_config"]
    lac["kda_layers"] = [1, 2, 4, 5, 6, 7]
    lac["full_attn_layers"] = [3, 8, 9]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="model.layers.2.self_attn.q_a_proj.weight"):
        K3ForCausalLM.from_pretrained(tmp_path)


def test_missing_directory_and_bad_config(tmp_path):
    with pytest.raises(FileNotFoundError):
        K3ForCausalLM.from_pretrained(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        K3ForCausalLM.from_pretrained(tmp_path)


def test_text_only_save_has_the_released_top_level(tiny, tmp_path, capsys):
    """A text-only model is saved as the release lays it out (what llama.cpp's converter recognises): the
    `kimi_k3` / `KimiK3ForConditionalGeneration` top level without vision_config, the text fields in
    `text_config` (`kimi_linear` / `KimiLinearForCausalLM`), text tensors under `language_model.`."""
    from k3.cli import main
    from k3.model import K3ForConditionalGeneration

    tiny.save_pretrained(tmp_path)
    top = json.loads((tmp_path / "config.json").read_text())
    assert (top["model_type"], top["architectures"]) == ("kimi_k3", ["KimiK3ForConditionalGeneration"])
    assert "vision_config" not in top and "media_placeholder_token_id" not in top
    text = top["text_config"]
    assert (text["model_type"], text["architectures"]) == ("kimi_linear", ["KimiLinearForCausalLM"])
    assert text["hidden_size"] == 128 and text["linear_attn_config"]["num_heads"] == 4
    assert all(name.startswith("language_model.") for name in load_file(tmp_path / "model.safetensors"))
    assert tiny.config.multimodal is None  # the model's own config is not changed by saving
    loaded = K3ForCausalLM.from_pretrained(tmp_path)
    assert loaded.config.vision_config is None and torch.equal(loaded(IDS).logits, tiny(IDS).logits)
    with pytest.raises(ValueError, match="needs a multimodal config with a vision_config"):
        K3ForConditionalGeneration.from_pretrained(tmp_path)
    assert main(["info", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["layers"] == 9


def test_every_earlier_layout_still_loads(tiny, tmp_path):
    """Text-only top level (written by earlier versions), multimodal top level with or without vision_config,
    tensors with or without `language_model.`: all load to the same model; a re-save is the released layout."""
    from k3.checkpoint import save_checkpoint_state
    from k3.config import multimodal_top_level, text_only_top_level

    vision = {"vt_hidden_size": 8, "mm_hidden_size": 8, "text_hidden_size": 128}
    layouts = {
        "text-only": (None, ""),
        "multimodal, no vision_config, unprefixed": (text_only_top_level(), ""),
        "multimodal, no vision_config, prefixed": (text_only_top_level(), "language_model."),
        "multimodal with vision_config, prefixed": ({**multimodal_top_level(K3Config(), 7), "vision_config": vision},
                                                    "language_model."),
    }
    for i, (layout, (top, prefix)) in enumerate(layouts.items()):
        directory = tmp_path / str(i)
        save_checkpoint_state(directory, tiny.state_dict(), tiny.config.kda_num_heads, prefix=prefix)
        tiny.config.replace(multimodal=top).save(directory)
        loaded = K3ForCausalLM.from_pretrained(directory)
        assert torch.equal(loaded(IDS).logits, tiny(IDS).logits), layout
    K3ForCausalLM.from_pretrained(tmp_path / "0").save_pretrained(tmp_path / "again")  # an earlier text-only save
    assert json.loads((tmp_path / "again" / "config.json").read_text()) == tiny.config.released_layout().to_dict()


def test_saved_config_keeps_every_key_and_states_the_context_length(tiny, tmp_path):
    """save_pretrained writes `max_position_embeddings` into text_config (llama.cpp's converter reads it as
    `kimi-k3.context_length`, without which llama.cpp refuses the GGUF), also for a model read from a file that
    lacked it; and the file's other keys (top level and text_config, unknown ones included) are written back."""
    tiny.save_pretrained(tmp_path / "plain")
    text = json.loads((tmp_path / "plain" / "config.json").read_text())["text_config"]
    assert text["max_position_embeddings"] == 1048576

    extra = {"torch_dtype": "bfloat16", "rope_theta": 50000.0, "rope_scaling": None, "head_dim": 72,
             "attention_dropout": 0.0, "num_nextn_predict_layers": 0, "some_future_key": {"a": [1, 2]}}
    text = {**tiny.config.to_text_dict(), **extra, "max_position_embeddings": 524288, "eos_token_id": 7}
    text["linear_attn_config"]["some_future_subkey"] = [3]
    top = {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"], "ignore_index": -100,
           "tie_word_embeddings": False, "a_future_top_level_key": {"nested": True}}
    model = K3ForCausalLM(K3Config.from_dict({**top, "text_config": text}))
    model.save_pretrained(tmp_path / "keys")
    assert json.loads((tmp_path / "keys" / "config.json").read_text()) == {**top, "text_config": text}

    del text["max_position_embeddings"]  # an earlier k3 save: the context length is stated on the next one
    model = K3ForCausalLM(K3Config.from_dict({**top, "text_config": text}))
    model.save_pretrained(tmp_path / "earlier")
    written = json.loads((tmp_path / "earlier" / "config.json").read_text())
    assert written == {**top, "text_config": {**text, "max_position_embeddings": 1048576}}
