"""K3ForConditionalGeneration: placeholder expansion, labels, caches, checkpoints (docs/architecture.md §9.9, §11, §12.3 item 14)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conformance import MEDIA_PAD, build_tiny_vl_config, random_media, randomize_parameters
from k3.config import K3Config
from k3.inference import generate
from k3.model import K3ForConditionalGeneration
from k3.model.accounting import count_parameters

GRIDS = [(1, 4, 6), (1, 2, 2), (2, 4, 4)]  # 6, 1 and 4 merged tokens


@pytest.fixture(scope="module")
def vl():
    torch.manual_seed(0)
    return randomize_parameters(K3ForConditionalGeneration(build_tiny_vl_config()), seed=0).double().eval()


def batch():
    """Row 0: text, image 0, text, image 1; row 1: video chunk 2 then text."""
    ids = torch.tensor([[3, 4, MEDIA_PAD, 5, 6, MEDIA_PAD, 7], [MEDIA_PAD, 8, 9, 10, 11, 12, 13]])
    pixels, grids = random_media(GRIDS, seed=3)
    return ids, pixels.double(), grids


def test_placeholder_expansion(vl):
    """Each placeholder becomes its item's (h/2)(w/2) projected features, text keeps its order, and the shorter
    merged row is padded on the left (zero embeddings, mask 0)."""
    ids, pixels, grids = batch()
    features = vl.encode_media(pixels, grids)
    assert [f.shape[0] for f in features] == [6, 1, 4]
    embeds, labels, mask = vl.merge_inputs(ids, features, vl.layout(ids, grids), labels=ids)
    text = vl.language_model.model.embed_tokens
    assert embeds.shape == (2, 7 - 2 + 7, 64)  # row 0: 5 text + 7 features = 12; row 1: 6 text + 4 = 10
    row0 = torch.cat([text(ids[0, :2]), features[0], text(ids[0, 3:5]), features[1], text(ids[0, 6:])])
    torch.testing.assert_close(embeds[0], row0, rtol=0, atol=0)
    row1 = torch.cat([features[2], text(ids[1, 1:])])
    torch.testing.assert_close(embeds[1, 2:], row1, rtol=0, atol=0)
    assert torch.equal(embeds[1, :2], torch.zeros(2, 64))
    assert mask.tolist() == [[1] * 12, [0, 0] + [1] * 10]
    # labels: −100 at every feature row and the padding, the text ids elsewhere
    assert labels[0].tolist() == [3, 4] + [-100] * 6 + [5, 6, -100, 7]
    assert labels[1].tolist() == [-100] * 6 + [8, 9, 10, 11, 12, 13]
    assert torch.equal(vl.merged_attention_mask(ids, grids), mask)


def test_loss_ignores_media_and_padding(vl):
    """The loss equals the cross-entropy over text targets whose predecessor is real (no media, no padding)."""
    ids, pixels, grids = batch()
    out = vl(ids, pixels, grids, labels=ids)
    _, labels, mask = vl.merge_inputs(ids, vl.encode_media(pixels, grids), vl.layout(ids, grids), labels=ids)
    logits, targets = out.logits[:, :-1], labels[:, 1:].masked_fill(mask[:, :-1] == 0, -100)
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    torch.testing.assert_close(out.loss, expected)
    assert targets[0].tolist() == [4] + [-100] * 6 + [5, 6, -100, 7]
    assert targets[1].tolist() == [-100] * 5 + [8, 9, 10, 11, 12, 13]


def test_rows_equal_running_alone(vl):
    """A padded multimodal batch gives each row the logits of running that row alone (§9.9 padding)."""
    ids, pixels, grids = batch()
    logits = vl(ids, pixels, grids).logits
    lengths = grids.prod(1).tolist()
    alone0 = vl(ids[:1], pixels[:lengths[0] + lengths[1]], grids[:2]).logits
    alone1 = vl(ids[1:], pixels[lengths[0] + lengths[1]:], grids[2:]).logits
    torch.testing.assert_close(logits[0], alone0[0], rtol=0, atol=1e-10)
    torch.testing.assert_close(logits[1, 2:], alone1[0], rtol=0, atol=1e-10)


def test_prefill_with_images_then_decode_equals_full_forward(vl):
    """A cached prompt with media followed by token-by-token text decoding == one full forward (float64)."""
    ids, pixels, grids = batch()
    extra = torch.tensor([[20, 21, 22], [23, 24, 25]])
    full = vl(torch.cat([ids, extra], 1), pixels, grids).logits
    cache = vl.make_cache(2)
    steps = [vl(ids, pixels, grids, cache=cache).logits[:, -1]]
    for t in range(extra.shape[1]):
        steps.append(vl(extra[:, t:t + 1], cache=cache).logits[:, -1])
    torch.testing.assert_close(torch.stack(steps[:-1], 1), full[:, -4:-1], rtol=0, atol=1e-10)


def test_generate_greedy_matches_argmax_loop(vl):
    ids, pixels, grids = batch()
    out = generate(vl, ids, 4, pixel_values=pixels, grid_thws=grids, temperature=0)
    seq = ids
    for _ in range(4):
        logits = vl(seq, pixels, grids).logits[:, -1]
        logits[:, MEDIA_PAD] = -float("inf")  # generation never emits a placeholder
        seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, seq)


@pytest.mark.parametrize("change, message", [
    (lambda ids, px, g: (ids, px, g[:2]), "3 media placeholders .* 2 media items"),
    (lambda ids, px, g: (ids.masked_fill(ids == MEDIA_PAD, 1), None, None), None),
    (lambda ids, px, g: (ids.masked_fill(ids == 7, MEDIA_PAD), px, g), "4 media placeholders .* 3 media items"),
    (lambda ids, px, g: (ids, px, None), "together"),
    (lambda ids, px, g: (ids, px, torch.tensor([[1, 4, 6], [1, 2, 2], [2, 4, 3]])), "even"),
])
def test_media_mismatches_raise(vl, change, message):
    ids, pixels, grids = change(*batch())
    if message is None:  # text only, no media: fine
        assert vl(ids).logits.shape == (2, 7, 256)
        return
    with pytest.raises(ValueError, match=message):
        vl(ids, pixels, grids)


def test_save_load_round_trip_official_names(vl, tmp_path):
    """Full layout: `language_model.*`, `vision_tower.*`, `mm_projector.*`; bit-exact reload; config kept."""
    model = vl.float()
    try:
        model.save_pretrained(tmp_path)
        stored = load_file(tmp_path / "model.safetensors")
        assert "vision_tower.encoder.blocks.1.wqkv.weight" in stored
        assert "vision_tower.patch_embed.pos_emb.weight" in stored
        assert "mm_projector.proj.2.weight" in stored and "mm_projector.post_norm.weight" in stored
        assert "language_model.model.layers.0.self_attn.A_log" in stored
        assert "language_model.model.layers.1.block_sparse_moe.experts.7.w2.weight" in stored
        text_keys = [k for k in stored if not k.startswith(("vision_tower.", "mm_projector."))]
        assert all(k.startswith("language_model.") for k in text_keys)
        config = json.loads((tmp_path / "config.json").read_text())
        assert config["architectures"] == ["KimiK3ForConditionalGeneration"]
        assert config["vision_config"]["vt_hidden_size"] == 24
        loaded = K3ForConditionalGeneration.from_pretrained(tmp_path)
        for (k, a), (k2, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
            assert k == k2 and torch.equal(a, b), k
        ids, pixels, grids = batch()
        assert torch.equal(loaded(ids, pixels.float(), grids).logits, model(ids, pixels.float(), grids).logits)
        # the text-only class reads the same directory and skips the vision tensors
        from k3.model import K3ForCausalLM

        text = K3ForCausalLM.from_pretrained(tmp_path)
        assert torch.equal(text(ids[:, 6:]).logits, model.language_model(ids[:, 6:]).logits)
    finally:
        vl.double()


def test_missing_vision_tensor_is_named(vl, tmp_path):
    from safetensors.torch import save_file

    from k3.checkpoint import CheckpointError

    vl.float().save_pretrained(tmp_path)
    vl.double()
    stored = load_file(tmp_path / "model.safetensors")
    del stored["vision_tower.encoder.blocks.0.wo.weight"]
    save_file(stored, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"vision_tower\.encoder\.blocks\.0\.wo\.weight: expected \[24, 32\]"):
        K3ForConditionalGeneration.from_pretrained(tmp_path)


def test_text_only_config_is_rejected():
    from conformance import build_tiny_config

    with pytest.raises(ValueError, match="vision_config"):
        K3ForConditionalGeneration(build_tiny_config())


def test_full_size_counts_on_meta():
    """`k3 info k3-full`: text 2.78 T / 104.2 B unchanged; vision 401,214,464 and projector 46,144,512 apart."""
    config = K3Config.from_preset("k3-full")
    with torch.device("meta"):
        model = K3ForConditionalGeneration(config)
    p = count_parameters(model, config)
    assert p.total_params == 2_779_484_476_000 and p.activated_params == 104_189_612_640
    assert p.vision == {"vision_tower": 401_214_464, "mm_projector": 46_144_512}


def test_media_placeholder_must_be_in_the_vocabulary():
    config = build_tiny_vl_config()
    config = config.replace(multimodal={**config.multimodal, "media_placeholder_token_id": 256})
    with pytest.raises(ValueError, match="media_placeholder_token_id=256"):
        K3ForConditionalGeneration(config)


def test_vision_config_without_text_width_follows_the_text_model():
    """A vision_config that omits text_hidden_size / mm_hidden_size takes the text width / the ViT width."""
    config = build_tiny_vl_config()
    vision = {k: v for k, v in config.multimodal["vision_config"].items() if k not in ("text_hidden_size",
                                                                                        "mm_hidden_size")}
    config = config.replace(multimodal={**config.multimodal, "vision_config": vision})
    assert config.vision_config.text_hidden_size == 64 and config.vision_config.mm_hidden_size == 24
    assert config.to_dict()["vision_config"] == vision  # the file is still written back verbatim


def test_bf16_model_runs_and_its_media_features_match(vl):
    """A bf16 copy runs (KDA gate/conv tensors stay fp32, §0.4); its projected media features have cosine
    ≥ 0.999 with the float64 ones (the randomised text model itself is too sensitive for a tight bound)."""
    import copy

    ids, pixels, grids = batch()
    half = copy.deepcopy(vl).to(torch.bfloat16)
    assert half.language_model.model.layers[0].self_attn.A_log.dtype == torch.float32
    assert torch.isfinite(half(ids, pixels.float(), grids).logits).all()
    with torch.no_grad():
        reference = torch.cat(vl.encode_media(pixels, grids))
        features = torch.cat(half.encode_media(pixels.float(), grids))
    assert features.dtype == torch.bfloat16
    cosine = torch.nn.functional.cosine_similarity(features.double().flatten(), reference.flatten(), dim=0)
    assert cosine > 0.999
