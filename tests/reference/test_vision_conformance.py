"""Conformance of the project's vision path against the independent float64 reference `vision_reference.py`
(docs/architecture.md §9, §11.3, §2.2).

The project is used only through its public surface: the `K3ForConditionalGeneration` constructor,
`named_parameters()`, `.double()`, `save_pretrained`, `state_dict()`, `encode_media(pixel_values, grid_thws)` and
`model(input_ids, pixel_values, grid_thws).logits`. The reference reads only the official checkpoint files
written by `save_pretrained` (tensor names of §11.3, loaded by `k3_reference.load_official_checkpoint`).
"""

from __future__ import annotations

import pytest
import torch

from conformance import MEDIA_PAD, build_tiny_vl_config, random_media, randomize_parameters
from k3_reference import load_official_checkpoint
from vision_reference import (SPEC_VISION_CONFIG, VARIANTS, reference_multimodal_logits, reference_vision_features,
                              vision_parameter_shapes)

MODEL_SEED = 3
MEDIA_SEED = 11
TOL = 1e-10  # both sides float64
NEG_MIN = 1e5 * TOL  # a flipped rule must move some feature by at least this (tanh vs erf GELU moves ~1e-3)

# (1, 10, 8) is larger than the tiny 6 × 5 position table in both directions; (3, 6, 4) is a 3-frame video chunk
GRIDS = [(1, 4, 6), (1, 2, 2), (3, 6, 4), (1, 8, 2), (1, 10, 8)]
NORM_SUFFIXES = ("norm0.weight", "norm1.weight", "final_layernorm.weight", "post_norm.weight")

# §2.2 exact vision counts
VIT_PARAMS = 401_214_464
PROJECTOR_PARAMS = 46_144_512


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from k3.model import K3ForConditionalGeneration

    torch.manual_seed(MODEL_SEED)
    model = K3ForConditionalGeneration(build_tiny_vl_config())
    randomize_parameters(model, MODEL_SEED)
    gen = torch.Generator().manual_seed(1000 + MODEL_SEED)
    n_norms = 0
    with torch.no_grad():
        for name, prm in model.named_parameters():
            if name.startswith(("vision_tower.", "mm_projector.")) and name.endswith(NORM_SUFFIXES):
                prm.copy_(1 + 0.2 * torch.randn(prm.shape, generator=gen, dtype=torch.float64))
                n_norms += 1
    assert n_norms == 2 * 2 + 1 + 1, n_norms  # 2 layers × (norm0, norm1) + final_layernorm + post_norm
    model = model.double().eval()
    ckpt = tmp_path_factory.mktemp("k3_vl_ckpt")
    model.save_pretrained(ckpt)
    tensors, config = load_official_checkpoint(ckpt)
    return model, tensors, config


@pytest.fixture(scope="module")
def media():
    return random_media(GRIDS, seed=MEDIA_SEED)


@pytest.fixture(scope="module")
def project_features(setup, media):
    model, _, _ = setup
    pixels, grids = media
    with torch.no_grad():
        feats = model.encode_media(pixels.double(), grids)
    return [f.detach().to(torch.float64) for f in feats]


@pytest.fixture(scope="module")
def reference_features(setup, media):
    _, tensors, config = setup
    pixels, grids = media
    return reference_vision_features(tensors, config, pixels, grids)


def _max_delta(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[float]:
    return [float((x - y).abs().max()) for x, y in zip(a, b)]


# --------------------------------------------------------------------------------------------- features
def test_checkpoint_has_the_spec_vision_tensors(setup):
    _, tensors, config = setup
    expected = vision_parameter_shapes(config["vision_config"])
    got = {k: tuple(v.shape) for k, v in tensors.items() if k.startswith(("vision_tower.", "mm_projector."))}
    assert got == expected


def test_features_match_reference(project_features, reference_features):
    assert len(project_features) == len(reference_features) == len(GRIDS)
    for (t, h, w), pf, rf in zip(GRIDS, project_features, reference_features):
        assert rf.shape == ((h // 2) * (w // 2), 64)
        assert pf.shape == rf.shape, ((t, h, w), pf.shape, rf.shape)
    deltas = _max_delta(project_features, reference_features)
    report = {g: d for g, d in zip(GRIDS, deltas)}
    assert max(deltas) <= TOL, f"per-item max |Δ feature|: {report}"


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v is not None])
def test_negative_controls_fail_loudly(setup, media, project_features, reference_features, variant):
    """Flipping one rule in the reference must move the features far beyond the tolerance."""
    _, tensors, config = setup
    pixels, grids = media
    flipped = reference_vision_features(tensors, config, pixels, grids, _variant=variant)
    d_ref = max(_max_delta(flipped, reference_features))
    d_proj = max(_max_delta(flipped, project_features))
    assert d_ref > NEG_MIN, (variant, d_ref)
    assert d_proj > NEG_MIN, (variant, d_proj)


# ------------------------------------------------------------------------------------ multimodal logits
def test_multimodal_logits_match_reference(setup):
    model, tensors, config = setup
    grids = [(1, 4, 6), (3, 2, 4)]  # 6 and 2 merged tokens
    pixels, grid_thws = random_media(grids, seed=MEDIA_SEED + 1)
    ids = torch.tensor([[3, 17, MEDIA_PAD, 41, 200, MEDIA_PAD, 99, 7]])
    s_merged = ids.shape[1] - 2 + 6 + 2
    with torch.no_grad():
        logits = model(ids, pixels.double(), grid_thws).logits.to(torch.float64)
    ref = reference_multimodal_logits(tensors, config, ids, pixels, grid_thws)
    assert ref.shape == (1, s_merged, 256)
    assert logits.shape == ref.shape, (logits.shape, ref.shape)
    delta = (logits - ref).abs()
    assert float(delta.max()) <= 1e-9, f"max |Δlogit| {float(delta.max()):.3e}, per position {delta.amax(-1)}"


# -------------------------------------------------------------------------------------- full-size counts
def test_full_size_parameter_counts():
    from k3 import K3Config
    from k3.model import K3ForConditionalGeneration

    shapes = vision_parameter_shapes(SPEC_VISION_CONFIG)

    def numel(s):
        n = 1
        for v in s:
            n *= v
        return n

    ref_vit = sum(numel(s) for k, s in shapes.items() if k.startswith("vision_tower."))
    ref_proj = sum(numel(s) for k, s in shapes.items() if k.startswith("mm_projector."))
    assert (ref_vit, ref_proj) == (VIT_PARAMS, PROJECTOR_PARAMS)

    with torch.device("meta"):
        model = K3ForConditionalGeneration(K3Config.from_preset("k3-full"))
    sd = model.state_dict()
    got = {k: tuple(v.shape) for k, v in sd.items() if k.startswith(("vision_tower.", "mm_projector."))}
    vit = sum(v.numel() for k, v in sd.items() if k.startswith("vision_tower."))
    proj = sum(v.numel() for k, v in sd.items() if k.startswith("mm_projector."))
    assert (vit, proj) == (VIT_PARAMS, PROJECTOR_PARAMS)
    assert got == shapes


# ------------------------------------------------------------------------------ reference self-checks
def test_reference_bilinear_resize_matches_torch(setup):
    """The hand-written align_corners=False bilinear resize equals F.interpolate (and is the identity at 6 × 5)."""
    import torch.nn.functional as F

    from vision_reference import resize_pos_emb

    _, tensors, _ = setup
    table = tensors["vision_tower.patch_embed.pos_emb.weight"].to(torch.float64)
    assert torch.equal(resize_pos_emb(table, 6, 5), table)
    for h, w in [(4, 6), (2, 2), (6, 4), (8, 2), (10, 8), (12, 14)]:
        ours = resize_pos_emb(table, h, w)
        theirs = F.interpolate(table.permute(2, 0, 1)[None], size=(h, w), mode="bilinear", align_corners=False)
        assert (ours - theirs[0].permute(1, 2, 0)).abs().max() <= 1e-14, (h, w)


def test_project_attention_is_block_diagonal(setup, media, project_features):
    """§9.4: perturbing the patches of item 2 leaves every other item's features unchanged."""
    model, _, _ = setup
    pixels, grids = media
    pixels = pixels.clone()
    sizes = [t * h * w for t, h, w in GRIDS]
    start = sum(sizes[:2])
    pixels[start:start + sizes[2]] += torch.randn(sizes[2], 3, 14, 14, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        feats = [f.to(torch.float64) for f in model.encode_media(pixels.double(), grids)]
    deltas = _max_delta(feats, project_features)
    assert deltas[2] > 1e-3
    assert max(deltas[:2] + deltas[3:]) <= TOL, deltas
