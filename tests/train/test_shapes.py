"""The captioned-shapes generator: determinism, captions, geometry checked on the rendered pixels, balance."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

from k3.train.shapes import (
    COLOURS,
    MARGIN,
    MIN_SIDE,
    RELATIONS,
    SHAPES,
    Scene,
    Shape,
    all_captions,
    caption,
    describe,
    parse_caption,
    render,
    sample_scene,
    scene_for,
)


def _scenes(n: int, seed: int = 0, **kwargs) -> list[Scene]:
    return [scene_for(seed, i, **kwargs) for i in range(n)]


# ------------------------------------------------------------------------------------------- determinism


def test_scene_for_is_deterministic_and_varies_with_index_and_seed():
    assert scene_for(3, 17) == scene_for(3, 17)
    assert len({scene_for(3, i) for i in range(50)}) == 50
    assert len({scene_for(s, 17) for s in range(50)}) == 50


def test_scene_for_is_stable_across_processes():
    """The (seed, index) mix must not depend on Python's per-process salted hash()."""
    code = "from k3.train.shapes import scene_for; print(repr([scene_for(5, i) for i in range(3)]))"
    outputs = set()
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        outputs.add(result.stdout.strip())
    assert outputs == {repr([scene_for(5, i) for i in range(3)])}


def test_render_is_deterministic():
    for scene in _scenes(20):
        first, second = render(scene), render(scene)
        assert first.mode == "RGB" and first.size == (scene.width, scene.height)
        assert first.tobytes() == second.tobytes()


# ----------------------------------------------------------------------------------------------- captions


def test_caption_round_trip_and_every_caption_is_known():
    known = set(all_captions())
    for scene in _scenes(500):
        text = caption(scene)
        assert text in known
        assert parse_caption(text) == describe(scene)
        first = scene.shapes[0]
        assert text.startswith(f"a {first.colour} {first.kind}")
        if scene.relation is not None:
            assert f" {scene.relation} " in text


def test_all_captions_is_sorted_unique_and_counts_the_classes():
    captions = all_captions()
    assert captions == sorted(set(captions))
    objects = len(COLOURS) * len(SHAPES)
    assert len(captions) == objects + objects * (objects - 1) * len(RELATIONS)
    assert all(parse_caption(text) is not None for text in captions)


@pytest.mark.parametrize(
    "text",
    ["", "a red circle ", "a purple circle", "a red circle above a red circle", "a red circle below a blue square",
     "red circle", "a red circle above"],
)
def test_parse_caption_rejects_invalid_text(text):
    assert parse_caption(text) is None


# ----------------------------------------------------------------------------------------------- geometry


def _box(shape: Shape) -> tuple[float, float, float, float]:
    return shape.cx - shape.size, shape.cy - shape.size, shape.cx + shape.size, shape.cy + shape.size


def _colour_mask(pixels: np.ndarray, colour: str) -> np.ndarray:
    return np.all(pixels == np.array(COLOURS[colour], dtype=pixels.dtype), axis=-1)


def _box_mask(shape_: tuple[int, int], shape: Shape) -> np.ndarray:
    """Pixels within the shape's box, widened by one pixel for rasterisation."""
    ys, xs = np.indices(shape_)
    x0, y0, x1, y1 = _box(shape)
    return (xs >= x0 - 1) & (xs <= x1 + 1) & (ys >= y0 - 1) & (ys <= y1 + 1)


def _centroids(scene: Scene) -> list[tuple[float, float]]:
    """Each shape's centroid (x, y) measured on the rendered image, checking no pixel strays outside the boxes."""
    pixels = np.asarray(render(scene))
    background = np.all(pixels == np.array(scene.background, dtype=pixels.dtype), axis=-1)
    masks = [_colour_mask(pixels, s.colour) & _box_mask(pixels.shape[:2], s) for s in scene.shapes]
    coloured = np.zeros(pixels.shape[:2], dtype=bool)
    for colour in COLOURS:
        coloured |= _colour_mask(pixels, colour)
    assert np.array_equal(coloured, ~background), "every pixel is the background or a shape colour"
    assert np.array_equal(np.logical_or.reduce(masks), coloured), "no shape pixel outside the shapes' boxes"
    centroids = []
    for shape, mask in zip(scene.shapes, masks):
        assert mask.sum() >= 0.4 * (2 * shape.size) ** 2, "the shape is drawn at (roughly) its full size"
        ys, xs = np.nonzero(mask)
        centroids.append((xs.mean(), ys.mean()))
    return centroids


@pytest.mark.parametrize("sides", [{}, {"min_side": MIN_SIDE, "max_side": MIN_SIDE + 8}])
def test_geometry_on_rendered_images(sides):
    n = 300 if not sides else 100
    for scene in _scenes(n, seed=11, **sides):
        for shape in scene.shapes:
            x0, y0, x1, y1 = _box(shape)
            assert shape.size > 0
            assert x0 >= MARGIN - 1e-9 and y0 >= MARGIN - 1e-9
            assert x1 <= scene.width - MARGIN + 1e-9 and y1 <= scene.height - MARGIN + 1e-9
        centroids = _centroids(scene)
        if scene.relation is None:
            assert len(scene.shapes) == 1
            continue
        first, second = scene.shapes
        assert (first.colour, first.kind) != (second.colour, second.kind)
        (fx, fy), (sx, sy) = centroids
        along, across = (sy - fy, sx - fx) if scene.relation == "above" else (sx - fx, sy - fy)
        assert along > 0 and along > 1.5 * abs(across), (scene, centroids)
        a0, b0 = _box(first), _box(second)
        gap = b0[1] - a0[3] if scene.relation == "above" else b0[0] - a0[2]
        assert gap > 0, "the boxes neither overlap nor touch along the relation's axis"


def test_image_sizes_vary_within_bounds():
    scenes = _scenes(200, seed=2, min_side=60, max_side=120)
    sizes = [(s.width, s.height) for s in scenes]
    assert all(60 <= w <= 120 and 60 <= h <= 120 for w, h in sizes)
    assert len(set(sizes)) > 100
    assert any(w > h for w, h in sizes) and any(h > w for w, h in sizes)
    assert all(all(215 <= c <= 255 for c in s.background) for s in scenes)
    assert len({s.background for s in scenes}) > 100


def test_min_side_equal_to_max_side_gives_a_fixed_size():
    assert {(s.width, s.height) for s in _scenes(20, min_side=64, max_side=64)} == {(64, 64)}


# ------------------------------------------------------------------------------------------------ balance


def test_colours_shapes_and_relations_are_roughly_balanced():
    scenes = _scenes(500, seed=4)
    colours = Counter(s.colour for scene in scenes for s in scene.shapes)
    kinds = Counter(s.kind for scene in scenes for s in scene.shapes)
    relations = Counter(scene.relation for scene in scenes)
    n_shapes = sum(len(scene.shapes) for scene in scenes)
    assert all(colours[c] >= n_shapes / len(COLOURS) / 3 for c in COLOURS)
    assert all(kinds[k] >= n_shapes / len(SHAPES) / 3 for k in SHAPES)
    n_pairs = 500 - relations[None]
    assert 0.2 < relations[None] / 500 < 0.4
    assert all(relations[r] >= n_pairs / len(RELATIONS) / 3 for r in RELATIONS)
    assert set(colours) == set(COLOURS) and set(kinds) == set(SHAPES)


# --------------------------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    "kwargs", [{"min_side": MIN_SIDE - 1}, {"min_side": 0}, {"min_side": 100, "max_side": 99}]
)
def test_bad_arguments_raise(kwargs):
    with pytest.raises(ValueError):
        sample_scene(random.Random(0), **kwargs)
    with pytest.raises(ValueError):
        scene_for(0, 0, **kwargs)
