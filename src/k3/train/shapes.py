"""Procedurally generated captioned images of coloured shapes: the data of the multimodal demo.

A tiny vision-language model learns to caption images such as

    "a red circle"
    "a red circle above a blue square"
    "a green triangle left of a yellow square"

and is scored by exact-match accuracy of its captions on held-out images. Everything is generated on the fly
from a seed: `scene_for(seed, index)` is example `index` of the stream seeded by `seed`, `render` draws it and
`caption` describes it.

The generator:

* image width and height are drawn independently in [min_side, max_side], so sizes and aspect ratios vary;
* the background is a random light colour (every channel in 215..255); shape colours are fixed per name and
  each has a channel far below 215, so a pixel's colour tells shape from background exactly (no anti-aliasing);
* with probability 0.3 the scene holds one shape, else two shapes with different (colour, kind) pairs;
* for two shapes the relation ("above" or "left of") is chosen first, then the shapes are placed to satisfy
  it without ambiguity: along the relation's axis the gap between the shapes' boxes is at least `MIN_GAP`
  pixels, and their offset across that axis is at most `MAX_CROSS_OFFSET` times that gap. The caption names
  the upper (or left) shape first, so each relation has one canonical caption per scene.

Chance level: a caption is one of `len(all_captions())` strings — 4 colours × 3 shapes = 12 single-shape
captions plus 12 × 11 ordered pairs × 2 relations = 264 two-shape captions, 276 in all — so guessing
uniformly scores 1/276 ≈ 0.36 %; always answering the most frequent class does no better than
0.3 / 12 = 2.5 % (one shape is drawn with probability 0.3, uniformly over its 12 captions).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache

from PIL import Image, ImageDraw

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 200, 20),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
RELATIONS: tuple[str, ...] = ("above", "left of")  # the first-named object is the upper / the left one

ONE_SHAPE_PROBABILITY = 0.3
HALF_SIZE_RANGE = (9.0, 16.0)  # half-size of a shape in pixels, before scaling down to fit a small image
MARGIN = 2.0  # minimum distance in pixels between a shape's box and the image border
MIN_GAP = 4.0  # minimum gap in pixels between the two boxes along the relation's axis
MAX_CROSS_OFFSET = 0.5  # offset of the centres across the relation's axis, as a fraction of the gap (at most)
BACKGROUND_RANGE = (215, 255)  # every channel of the background colour
MIN_SIDE = 32  # smallest image side that fits two shapes of a few pixels each

Object = tuple[str, str]  # (colour, kind)
Description = tuple  # (Object,) for one shape, (Object, relation, Object) for two, in caption order


@dataclass(frozen=True)
class Shape:
    """One filled shape: its colour name, kind, centre and half-size (pixels)."""

    colour: str
    kind: str
    cx: float
    cy: float
    size: float


@dataclass(frozen=True)
class Scene:
    """An image to draw: its size, 1 or 2 shapes in caption order, their relation (None for one shape)."""

    width: int
    height: int
    shapes: tuple[Shape, ...]
    relation: str | None
    background: tuple[int, int, int]


# ----------------------------------------------------------------------------------------------- sampling


def _check_sides(min_side: int, max_side: int) -> None:
    if min_side < MIN_SIDE:
        raise ValueError(f"min_side={min_side} is too small to fit two shapes: it must be at least {MIN_SIDE}")
    if min_side > max_side:
        raise ValueError(f"min_side={min_side} must not exceed max_side={max_side}")


def _sample_objects(rng: random.Random, count: int) -> list[Object]:
    """`count` distinct (colour, kind) pairs, uniformly."""
    pairs = [(colour, kind) for colour in COLOURS for kind in SHAPES]
    return rng.sample(pairs, count)


def _place_single(rng: random.Random, width: int, height: int, obj: Object) -> Shape:
    size = rng.uniform(*HALF_SIZE_RANGE)
    size = min(size, (min(width, height) - 2 * MARGIN) / 2)
    cx = rng.uniform(MARGIN + size, width - MARGIN - size)
    cy = rng.uniform(MARGIN + size, height - MARGIN - size)
    return Shape(obj[0], obj[1], cx, cy, size)


def _place_pair(
    rng: random.Random, along: float, across: float, s1: float, s2: float
) -> tuple[float, float, float, float, float, float]:
    """Place two shapes of half-sizes s1, s2 with shape 1 before shape 2 along an axis of length `along`.

    Returns (s1, s2, a1, c1, a2, c2): the (possibly scaled-down) half-sizes and each centre's coordinate
    along and across the axis. The gap between the boxes along the axis is at least MIN_GAP and the centres'
    offset across it at most MAX_CROSS_OFFSET times that gap.
    """
    scale = min(1.0, (along - 2 * MARGIN - MIN_GAP) / (2 * (s1 + s2)), (across - 2 * MARGIN) / (2 * max(s1, s2)))
    s1, s2 = s1 * scale, s2 * scale

    gap = rng.uniform(MIN_GAP, max(MIN_GAP, along - 2 * MARGIN - 2 * (s1 + s2)))
    free = max(0.0, along - 2 * MARGIN - 2 * (s1 + s2) - gap)
    a1 = MARGIN + s1 + rng.uniform(0.0, free)
    a2 = a1 + s1 + gap + s2

    max_offset = min(MAX_CROSS_OFFSET * gap, across - 2 * MARGIN - s1 - s2)
    offset = rng.uniform(-max_offset, max_offset)
    low = max(MARGIN + s1, MARGIN + s2 - offset)
    high = min(across - MARGIN - s1, across - MARGIN - s2 - offset)
    c1 = rng.uniform(low, high)
    return s1, s2, a1, c1, a2, c1 + offset


def _place_two(rng: random.Random, width: int, height: int, relation: str, objs: list[Object]) -> tuple[Shape, Shape]:
    (colour1, kind1), (colour2, kind2) = objs
    s1, s2 = rng.uniform(*HALF_SIZE_RANGE), rng.uniform(*HALF_SIZE_RANGE)
    if relation == "above":
        s1, s2, y1, x1, y2, x2 = _place_pair(rng, height, width, s1, s2)
    else:
        s1, s2, x1, y1, x2, y2 = _place_pair(rng, width, height, s1, s2)
    return Shape(colour1, kind1, x1, y1, s1), Shape(colour2, kind2, x2, y2, s2)


def sample_scene(rng: random.Random, min_side: int = 56, max_side: int = 140) -> Scene:
    """Draw one scene from `rng`: its size, background, 1 or 2 shapes and, for two, their relation."""
    _check_sides(min_side, max_side)
    width = rng.randint(min_side, max_side)
    height = rng.randint(min_side, max_side)
    background = tuple(rng.randint(*BACKGROUND_RANGE) for _ in range(3))
    if rng.random() < ONE_SHAPE_PROBABILITY:
        shapes: tuple[Shape, ...] = (_place_single(rng, width, height, _sample_objects(rng, 1)[0]),)
        relation = None
    else:
        relation = rng.choice(RELATIONS)
        shapes = _place_two(rng, width, height, relation, _sample_objects(rng, 2))
    return Scene(width, height, shapes, relation, background)


def _mix(seed: int, index: int) -> int:
    """A stable 64-bit mix of (seed, index) (SplitMix64 finaliser), unlike Python's salted hash()."""
    mask = (1 << 64) - 1

    def splitmix(x: int) -> int:
        x = (x + 0x9E3779B97F4A7C15) & mask
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
        return x ^ (x >> 31)

    return splitmix(splitmix(seed & mask) ^ (index & mask))


def scene_for(seed: int, index: int, **kwargs) -> Scene:
    """Example `index` of the stream seeded by `seed`, independent of every other index.

    Keyword arguments go to `sample_scene` (min_side, max_side).
    """
    return sample_scene(random.Random(_mix(seed, index)), **kwargs)


# ---------------------------------------------------------------------------------------------- rendering


def _draw_shape(draw: ImageDraw.ImageDraw, shape: Shape) -> None:
    x0, y0 = shape.cx - shape.size, shape.cy - shape.size
    x1, y1 = shape.cx + shape.size, shape.cy + shape.size
    fill = COLOURS[shape.colour]
    if shape.kind == "circle":
        draw.ellipse((x0, y0, x1, y1), fill=fill)
    elif shape.kind == "square":
        draw.rectangle((x0, y0, x1, y1), fill=fill)
    elif shape.kind == "triangle":
        draw.polygon([(shape.cx, y0), (x1, y1), (x0, y1)], fill=fill)
    else:
        raise ValueError(f"unknown shape kind {shape.kind!r}; expected one of {SHAPES}")


def render(scene: Scene) -> Image.Image:
    """The scene as an RGB image of size (width, height)."""
    image = Image.new("RGB", (scene.width, scene.height), scene.background)
    draw = ImageDraw.Draw(image)
    for shape in scene.shapes:
        _draw_shape(draw, shape)
    return image


# ----------------------------------------------------------------------------------------------- captions


def describe(scene: Scene) -> Description:
    """The scene's content in caption order: ((colour, kind),) or ((colour, kind), relation, (colour, kind))."""
    objects = [(shape.colour, shape.kind) for shape in scene.shapes]
    if len(objects) == 1:
        return (objects[0],)
    return (objects[0], scene.relation, objects[1])


def _text(description: Description) -> str:
    words = [part if isinstance(part, str) else f"a {part[0]} {part[1]}" for part in description]
    return " ".join(words)


def caption(scene: Scene) -> str:
    """The canonical caption, e.g. "a red circle" or "a red circle above a blue square"."""
    return _text(describe(scene))


@lru_cache(maxsize=1)
def _caption_table() -> dict[str, Description]:
    """Every caption the generator can produce, mapped to its description."""
    objects = [(colour, kind) for colour in COLOURS for kind in SHAPES]
    descriptions: list[Description] = [(obj,) for obj in objects]
    descriptions += [(a, relation, b) for a in objects for b in objects if a != b for relation in RELATIONS]
    return {_text(d): d for d in descriptions}


def parse_caption(text: str) -> Description | None:
    """The description of a canonical caption (the inverse of `caption`), or None if `text` is not one."""
    return _caption_table().get(text)


def all_captions() -> list[str]:
    """Every caption the generator can produce, sorted; its length is the number of classes (chance level)."""
    return sorted(_caption_table())
