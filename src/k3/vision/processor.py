"""Media pre-processing and text interleaving (docs/architecture.md §1.2, §9.1, §9.2, §9.9, §9.10, §10, §13 rows 11–12).

* `ImageProcessorConfig` reads and writes the released `preprocessor_config.json` (`media_proc_cfg`, §1.2).
* `load_image` opens an image file: one-line ValueErrors naming the file, EXIF orientation applied, Pillow's
  decompression-bomb limit kept (see its docstring).
* `process_image` turns one image into a `MediaItem`: RGB(A) decode → §9.2 resize → RGBA composite → pad to
  multiples of 28 → normalise → patchify, grid (1, h, w), (h/2)(w/2) LLM tokens.
* `process_video` groups already-sampled frames into chunks of ≤ 4 frames, one `MediaItem` (t ≤ 4, h, w) each,
  every frame resized with the per-frame patch limit (§9.10).
* `K3Processor` replaces the chat renderer's placeholder strings by the media framing of §9.9 (one
  `<|media_pad|>` per item; the model expands it to the item's features) and packs a padded batch.

Animated images (GIF, APNG, WebP, multi-page TIFF with more than one frame) are videos: given as an image to
`K3Processor` (or `k3 generate --image`), every frame is kept and encoded through the video path — ≤ 4-frame chunks,
each framed as "video" with its timestamp — in place of the image placeholder. `process_image`, which returns one
image, refuses them with a ValueError saying so; `process_video` accepts them. Other multi-frame formats (MPO
photos with a depth map or preview, PSD layers, icons) are still images: their first frame is the picture.

Shape suffixes (`x_BTD`): the package-wide legend at the top of docs/architecture.md.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import re
import struct
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np
import torch
from PIL import ExifTags, Image, ImageOps

from k3.fileio import atomic_write
from k3.tokenizer import K3Tokenizer

__all__ = [
    "ImageProcessorConfig",
    "K3Processor",
    "MediaItem",
    "format_timestamp",
    "load_image",
    "num_image_tokens",
    "patchify",
    "process_image",
    "process_video",
    "resize_size",
]

CONFIG_FILE = "preprocessor_config.json"
_NESTED_KEY = "media_proc_cfg"  # the released file keeps every processor field inside this object (§1.2)
_BG_KEY = "transparent_bg_config"  # released RGBA-background object (§9.2); its colour key is not published
_BG_COLOR_KEYS = ("bg_color", "background_color", "color")  # accepted spellings of that colour; "bg_color" written
_HIGH_DEPTH_MODES = frozenset({"I", "F"})  # PIL would clip these to 8 bits; their range is not known
_16_BIT_MODES = frozenset({"I;16", "I;16B", "I;16L", "I;16N"})  # 0..65535 grayscale (16-bit PNG): scaled to 8 bits
_ANIMATION_FORMATS = frozenset({"GIF", "PNG", "WEBP", "TIFF"})  # their frames are a sequence in time (or pages)
_DECODE_ERRORS = (OSError, EOFError, SyntaxError, TypeError, struct.error, IndexError)  # Pillow's on corrupt data
_BOMB_SIZE = re.compile(r"\((\d+) pixels\)")  # Pillow's DecompressionBombError text: "Image size (N pixels) ..."


@dataclass
class ImageProcessorConfig:
    """The released pre-processor configuration (§1.2 `media_proc_cfg`) plus the [U] knobs of §13 rows 11–12.

    `extra` keeps unknown keys of the `media_proc_cfg` object (or of a flat dict); `file_extra` keeps the other
    top-level keys of a nested file (e.g. `auto_map`). Both are written back unchanged.
    """

    patch_size: int = 14
    merge_kernel_size: int = 2
    in_patch_limit: int = 65536
    patch_limit_on_one_side: int = 512
    fixed_output_tokens: int | None = None  # released value null; nothing else is supported
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    transparent_bg_color: tuple[int, int, int] = (255, 255, 255)  # [U] §13.12: white
    pad_value: int = 0  # [U] §13.12: right/bottom padding in pixel space (−1 after the default normalisation)
    max_frames_per_chunk: int = 4  # §9.10 (= init_pos_emb_time)
    video_fps: float = 2.0  # [U] §13.11: sampling rate assumed for timestamps
    video_patch_limit_per_frame: int = 4096  # [U] §13.11
    extra: dict = field(default_factory=dict)
    file_extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        # JSON gives lists; store tuples so that configs compare equal after a round trip
        for name in ("image_mean", "image_std", "transparent_bg_color"):
            value = getattr(self, name)
            if isinstance(value, (list, tuple)):
                setattr(self, name, tuple(value))
        if _is_number(self.video_fps):
            self.video_fps = float(self.video_fps)
        self.validate()

    def validate(self) -> None:
        """ValueError naming the first invalid field."""
        def need(ok: bool, name: str, rule: str) -> None:
            if not ok:
                raise ValueError(f"ImageProcessorConfig.{name}: {rule} (got {getattr(self, name)!r})")

        for name in ("patch_size", "merge_kernel_size", "in_patch_limit", "patch_limit_on_one_side",
                     "max_frames_per_chunk", "video_patch_limit_per_frame"):
            need(_is_int(getattr(self, name)) and getattr(self, name) >= 1, name, "must be a positive integer")
        need(self.patch_limit_on_one_side % self.merge_kernel_size == 0, "patch_limit_on_one_side",
             f"must be a multiple of merge_kernel_size {self.merge_kernel_size} so padding keeps sides within it")
        need(self.fixed_output_tokens is None, "fixed_output_tokens",
             "only null (the released value) is supported; the token count follows the image size (§9.2)")
        for name in ("image_mean", "image_std"):
            value = getattr(self, name)
            need(isinstance(value, tuple) and len(value) == 3 and all(_is_number(v) and math.isfinite(v)
                                                                       for v in value),
                 name, "must be three finite numbers (R, G, B)")
        need(all(v > 0 for v in self.image_std), "image_std", "must be positive")
        need(isinstance(self.transparent_bg_color, tuple) and len(self.transparent_bg_color) == 3
             and all(_is_int(v) and 0 <= v <= 255 for v in self.transparent_bg_color),
             "transparent_bg_color", "must be three integers in 0..255 (R, G, B)")
        need(_is_int(self.pad_value) and 0 <= self.pad_value <= 255, "pad_value", "must be an integer in 0..255")
        need(_is_number(self.video_fps) and math.isfinite(self.video_fps) and self.video_fps > 0, "video_fps",
             "must be a positive finite number")
        for name in ("extra", "file_extra"):
            need(isinstance(getattr(self, name), dict), name, "must be a dict")

    @property
    def max_side(self) -> int:
        """Largest resized side in pixels: patch_limit_on_one_side · patch_size (7168)."""
        return self.patch_limit_on_one_side * self.patch_size

    @property
    def pad_unit(self) -> int:
        """Padded sides are multiples of patch_size · merge_kernel_size (28)."""
        return self.patch_size * self.merge_kernel_size

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ImageProcessorConfig:
        """Parse a flat dict or the released layout {"media_proc_cfg": {...}, ...}; unknown keys are kept."""
        if not isinstance(d, dict):
            raise ValueError(f"preprocessor config must be a JSON object, got {type(d).__name__}")
        file_extra: dict[str, Any] = {}
        cfg = d
        if _NESTED_KEY in d:
            cfg = d[_NESTED_KEY]
            if not isinstance(cfg, dict):
                raise ValueError(f"{_NESTED_KEY} must be a JSON object, got {type(cfg).__name__}")
            file_extra = {k: v for k, v in d.items() if k != _NESTED_KEY}
        names = {f.name for f in fields(cls)} - {"extra", "file_extra"}
        known = {k: v for k, v in cfg.items() if k in names}
        extra = {k: v for k, v in cfg.items() if k not in names}
        if _BG_KEY in extra:
            color, rest = _parse_bg_config(extra.pop(_BG_KEY))
            if rest:
                extra[_BG_KEY] = rest
            if color is not None:
                if "transparent_bg_color" in known and tuple(known["transparent_bg_color"]) != tuple(color):
                    raise ValueError(f"preprocessor config: transparent_bg_color {known['transparent_bg_color']!r} "
                                     f"contradicts {_BG_KEY} colour {color!r}")
                known["transparent_bg_color"] = color
        config = cls(**known, extra=extra, file_extra=file_extra)
        for key in sorted(names & file_extra.keys()):  # a field repeated outside media_proc_cfg must agree
            outside = tuple(file_extra[key]) if isinstance(file_extra[key], list) else file_extra[key]
            if outside != getattr(config, key):
                raise ValueError(f"preprocessor config: {key!r} is {file_extra[key]!r} at the top level but "
                                 f"{getattr(config, key)!r} from {_NESTED_KEY}")
        return config

    def to_dict(self) -> dict[str, Any]:
        """The released file layout: {**file_extra, "media_proc_cfg": {fields, transparent_bg_config, **extra}}."""
        cfg = {k: v for k, v in asdict(self).items() if k not in ("extra", "file_extra", "transparent_bg_color")}
        cfg = {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()}
        extra = dict(self.extra)
        cfg[_BG_KEY] = {**extra.pop(_BG_KEY, {}), _BG_COLOR_KEYS[0]: list(self.transparent_bg_color)}
        return {**self.file_extra, _NESTED_KEY: {**cfg, **extra}}

    def save(self, directory: str | os.PathLike) -> None:
        """Write `preprocessor_config.json` into `directory` (created if needed) atomically (tmp, then replace)."""
        os.makedirs(directory, exist_ok=True)
        text = json.dumps(self.to_dict(), indent=2, ensure_ascii=False) + "\n"
        atomic_write(os.path.join(directory, CONFIG_FILE), text)

    @classmethod
    def load(cls, directory: str | os.PathLike) -> ImageProcessorConfig:
        """Read `directory/preprocessor_config.json`."""
        path = os.path.join(directory, CONFIG_FILE)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} does not exist")
        try:
            with open(path, encoding="utf-8") as f:
                d = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: invalid JSON ({e})") from None
        return cls.from_dict(d)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _parse_bg_config(value: Any) -> tuple[list | None, dict]:
    """(colour or None, keys kept verbatim) of a released `transparent_bg_config` (null, [R, G, B] or an object)."""
    if value is None:
        return None, {}
    if isinstance(value, (list, tuple)):
        return list(value), {}
    if isinstance(value, dict):
        rest = dict(value)
        colors = [rest.pop(k) for k in _BG_COLOR_KEYS if k in rest]
        if len(colors) > 1:
            raise ValueError(f"{_BG_KEY} names its colour more than once: {value!r}")
        return (colors[0] if colors else None), rest
    raise ValueError(f"{_BG_KEY} must be null, [R, G, B] or an object, got {value!r}")


# ----------------------------------------------------------------------------------------------------------------
# Sizes (§9.2 steps 2–7)


def resize_size(width: int, height: int, config: ImageProcessorConfig,
                patch_limit: int | None = None) -> tuple[int, int]:
    """(W', H') of §9.2 steps 2–3; `patch_limit` defaults to `config.in_patch_limit`.

    scale = min(1, sqrt(limit / (max(1, ⌊W/p⌋)·max(1, ⌊H/p⌋))), side/W, side/H), side = 512·14 = 7168;
    W' = min(max(1, ⌊W·scale⌋), side). As released, the limit bounds ⌊W/p⌋·⌊H/p⌋ before padding: padding
    to 28 can add a few patches beyond it (e.g. 8000×6000 → 222×296 = 65,712 patches).
    """
    for name, value in (("width", width), ("height", height)):
        if not _is_int(value) or value < 1:
            raise ValueError(f"image {name} must be a positive integer, got {value!r}")
    limit = config.in_patch_limit if patch_limit is None else patch_limit
    if not _is_int(limit) or limit < 1:
        raise ValueError(f"patch_limit must be a positive integer, got {limit!r}")
    p, side = config.patch_size, config.max_side
    scale = min(1.0, math.sqrt(limit / (max(1, width // p) * max(1, height // p))), side / width, side / height)
    return min(max(1, math.floor(width * scale)), side), min(max(1, math.floor(height * scale)), side)


def _padded(n: int, unit: int) -> int:
    return -(-n // unit) * unit  # ⌈n/unit⌉·unit


def num_image_tokens(width: int, height: int, config: ImageProcessorConfig | None = None) -> int:
    """LLM tokens (h/2)(w/2) of an image of that original size (§9.2 step 7)."""
    config = config or ImageProcessorConfig()
    new_w, new_h = resize_size(width, height, config)
    return (_padded(new_w, config.pad_unit) // config.pad_unit) * (_padded(new_h, config.pad_unit) // config.pad_unit)


# ----------------------------------------------------------------------------------------------------------------
# Media items


@dataclass
class MediaItem:
    """One media item of §9.6: an image, or one ≤ 4-frame chunk of a video (§9.10)."""

    pixel_values: torch.Tensor  # [t·h·w, 3, P, P] float32, normalised; frame-major, then row-major patches
    grid_thw: tuple[int, int, int]  # (t, h, w) in patches; h and w multiples of merge_kernel_size
    kind: str  # "image" | "video"
    size: tuple[int, int]  # original (W, H) in pixels, shown in the framing text
    timestamp: float | None = None  # seconds of the chunk's first frame (video only)
    merge_kernel_size: int = 2

    def __post_init__(self) -> None:
        t, h, w = self.grid_thw
        m = self.merge_kernel_size
        if self.kind not in ("image", "video"):
            raise ValueError(f"MediaItem.kind must be 'image' or 'video', got {self.kind!r}")
        if min(t, h, w) < 1 or h % m or w % m:
            raise ValueError(f"MediaItem.grid_thw {self.grid_thw}: t, h, w must be positive, h and w multiples "
                             f"of {m}")
        shape = tuple(self.pixel_values.shape)
        if len(shape) != 4 or shape[0] != t * h * w or shape[1] != 3:
            raise ValueError(f"MediaItem.pixel_values has shape {shape}; grid {self.grid_thw} needs "
                             f"[{t * h * w}, 3, P, P]")

    @property
    def num_tokens(self) -> int:
        """LLM tokens after the merger: (h/2)(w/2), whatever t is (§9.7)."""
        _, h, w = self.grid_thw
        return (h // self.merge_kernel_size) * (w // self.merge_kernel_size)


def patchify(pixels_t3hw: torch.Tensor, patch_size: int) -> torch.Tensor:
    """[t, 3, H, W] → [t·(H/p)·(W/p), 3, p, p]: frame-major, then patch row y, then column x (§9.2 step 6)."""
    if pixels_t3hw.ndim != 4:
        raise ValueError(f"patchify expects [t, C, H, W], got shape {tuple(pixels_t3hw.shape)}")
    t, c, height, width = pixels_t3hw.shape
    p = patch_size
    if height % p or width % p:
        raise ValueError(f"patchify: H×W = {height}×{width} is not a multiple of the patch size {p}")
    grid = pixels_t3hw.reshape(t, c, height // p, p, width // p, p)
    return grid.permute(0, 2, 4, 1, 3, 5).reshape(-1, c, p, p)


def _array_to_pil(array: np.ndarray) -> Image.Image:
    """uint8 PIL image of an [H, W], [H, W, 1], [H, W, 3] or [H, W, 4] array (uint8 0..255 or float 0..1)."""
    shape = array.shape
    if array.ndim == 3 and shape[0] in (1, 3, 4) and shape[-1] > 4:
        raise ValueError(f"array of shape {shape} looks channel-first; pass [H, W, C] (e.g. array.transpose(1, 2, 0))")
    if not (array.ndim == 2 or (array.ndim == 3 and shape[-1] in (1, 3, 4))):
        raise ValueError(f"unsupported array shape {shape}; expected [H, W] (grayscale), [H, W, 3] (RGB) or "
                         "[H, W, 4] (RGBA)")
    if shape[0] == 0 or shape[1] == 0:
        raise ValueError(f"image is empty (array shape {shape})")
    if array.dtype.kind in "ui":
        low, high = int(array.min()), int(array.max())
        if low < 0 or high > 255:
            raise ValueError(f"integer pixels must lie in 0..255, got values in {low}..{high}")
        array = array.astype(np.uint8)
    elif array.dtype.kind == "f":
        array = array.astype(np.float64)
        if not np.isfinite(array).all():
            raise ValueError("image has NaN or infinite pixels")
        low, high = float(array.min()), float(array.max())
        if low < 0 or high > 1:
            raise ValueError(f"float pixels must lie in [0, 1], got values in [{low:g}, {high:g}]")
        array = np.rint(array * 255).astype(np.uint8)  # quantise as a decoded 8-bit image would be
    else:
        raise ValueError(f"unsupported pixel dtype {array.dtype}; use uint8 (0..255) or float (0..1)")
    if array.ndim == 3 and shape[-1] == 1:
        array = array[..., 0]
    return Image.fromarray(np.ascontiguousarray(array))


def _bomb_message(name: str, error: Exception) -> str:
    match = _BOMB_SIZE.search(str(error))
    if match is None or not Image.MAX_IMAGE_PIXELS:
        return f"image {name!r} is refused by Pillow's decompression-bomb guard: {error}"
    return (f"image {name!r} is {int(match.group(1)):,} pixels, more than Pillow's safety limit of "
            f"{2 * Image.MAX_IMAGE_PIXELS:,} (2 x PIL.Image.MAX_IMAGE_PIXELS, a guard against decompression bombs); "
            "raise PIL.Image.MAX_IMAGE_PIXELS to open a file you trust")


def _is_animation(pil: Image.Image) -> bool:
    """True for a GIF / APNG / WebP / TIFF file with more than one frame (module docstring)."""
    if pil.format not in _ANIMATION_FORMATS:
        return False
    try:
        return getattr(pil, "n_frames", 1) > 1
    except _DECODE_ERRORS as e:  # counting GIF frames reads the whole file
        raise ValueError(f"cannot decode image: {e}") from None


def load_image(path: str | os.PathLike) -> Image.Image:
    """Open an image file; every failure is a one-line ValueError naming the file.

    * Pillow's decompression-bomb guard is kept as the process has it (a safety feature against malicious files):
      a file of more than 2 x `PIL.Image.MAX_IMAGE_PIXELS` pixels (178,956,970 by default) is refused here; between
      1x and 2x Pillow only warns (DecompressionBombWarning) and the image is used (it is downscaled to ≤ 65,536
      patches anyway). To open a larger file you trust, raise `PIL.Image.MAX_IMAGE_PIXELS` yourself.
    * A still image is decoded at once, so a truncated or corrupt file fails here, and it is turned upright by its
      EXIF orientation tag (a phone photo stored sideways), as image viewers show it.
    * An animated image (module docstring) is returned undecoded: its frames are decoded one at a time when encoded.
    """
    name = os.fspath(path)
    try:
        pil = Image.open(name)
    except Image.DecompressionBombError as e:
        raise ValueError(_bomb_message(name, e)) from None
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read image {name!r}: {e}") from None
    try:
        if _is_animation(pil):
            return pil
        pil.load()
        if pil.getexif().get(ExifTags.Base.Orientation, 1) in range(2, 9):
            ImageOps.exif_transpose(pil, in_place=True)  # in place: the image keeps its file name
    except Image.DecompressionBombError as e:  # Pillow checks the size on open; kept in case a frame is checked
        pil.close()
        raise ValueError(_bomb_message(name, e)) from None
    except (ValueError, *_DECODE_ERRORS) as e:
        pil.close()
        message = str(e).removeprefix("cannot decode image: ")
        raise ValueError(f"cannot decode image {name!r}: {message}") from None
    return pil


@contextlib.contextmanager
def _opened(media: Any) -> Iterator[Any]:
    """`media` itself, or the image of a file path (`load_image`), closed on exit."""
    if not isinstance(media, (str, os.PathLike)):
        yield media
        return
    pil = load_image(media)
    try:
        yield pil
    finally:
        pil.close()


def _media_name(media: Any) -> str | None:
    """The file name of a path or of a PIL image read from a file, for error messages."""
    if isinstance(media, (str, os.PathLike)):
        return os.fspath(media)
    return (getattr(media, "filename", None) or None) if isinstance(media, Image.Image) else None


def _decode(image: Any) -> Image.Image:
    """§9.2 step 1 up to the composite: an "RGB" or "RGBA" PIL image (alpha kept when the input has one)."""
    if isinstance(image, np.ndarray):
        pil = _array_to_pil(image)
    elif isinstance(image, Image.Image):
        pil = image
        try:
            pil.load()  # a lazily opened file decodes here: a truncated or corrupt file fails now
        except _DECODE_ERRORS as e:
            raise ValueError(f"cannot decode image: {e}") from None
    else:
        raise ValueError(f"expected a PIL image, a numpy [H, W, C] array or an image file path, got "
                         f"{type(image).__module__}.{type(image).__qualname__}")
    if pil.width == 0 or pil.height == 0:
        raise ValueError(f"image is empty ({pil.width}x{pil.height})")
    if pil.mode in _16_BIT_MODES:  # 16-bit grayscale → 8 bits: round(v / 257) in exact integer arithmetic
        pil = Image.fromarray(((np.asarray(pil).astype(np.uint32) * 255 + 32767) // 65535).astype(np.uint8))
    if pil.mode in _HIGH_DEPTH_MODES:
        raise ValueError(f"PIL mode {pil.mode!r} is not 8-bit; convert it to 'L', 'RGB' or 'RGBA' first")
    if pil.mode in ("RGB", "RGBA"):
        return pil
    has_alpha = "A" in pil.getbands() or "a" in pil.getbands() or "transparency" in pil.info
    try:
        return pil.convert("RGBA" if has_alpha else "RGB")
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot convert PIL mode {pil.mode!r} to RGB: {e}") from None


def _resized_rgb_hw3(pil: Image.Image, size: tuple[int, int], config: ImageProcessorConfig) -> np.ndarray:
    """Bicubic resize to `size` (only if it changes), then composite RGBA onto the background (§9.2 steps 1, 3)."""
    try:
        if pil.size != size:
            pil = pil.resize(size, Image.Resampling.BICUBIC)
        if pil.mode == "RGBA":
            background = Image.new("RGBA", pil.size, (*config.transparent_bg_color, 255))
            pil = Image.alpha_composite(background, pil).convert("RGB")
        return np.asarray(pil, dtype=np.uint8)
    except OSError as e:  # a truncated or corrupt file surfaces here, when PIL first reads the pixels
        raise ValueError(f"cannot decode image: {e}") from None


def _normalised_3hw(rgb_hw3: np.ndarray, config: ImageProcessorConfig) -> torch.Tensor:
    """Pad right/bottom with pad_value to multiples of 28, then (x/255 − mean)/std (§9.2 steps 4–5)."""
    height, width, _ = rgb_hw3.shape
    unit = config.pad_unit
    canvas_hw3 = np.full((_padded(height, unit), _padded(width, unit), 3), config.pad_value, dtype=np.uint8)
    canvas_hw3[:height, :width] = rgb_hw3
    pixels_3hw = torch.from_numpy(canvas_hw3).permute(2, 0, 1).float() / 255
    mean = torch.tensor(config.image_mean, dtype=torch.float32).view(3, 1, 1)
    std = torch.tensor(config.image_std, dtype=torch.float32).view(3, 1, 1)
    return (pixels_3hw - mean) / std


def _media_item(pixels_t3hw: torch.Tensor, kind: str, size: tuple[int, int], config: ImageProcessorConfig,
                timestamp: float | None = None) -> MediaItem:
    t, _, height, width = pixels_t3hw.shape
    p = config.patch_size
    return MediaItem(patchify(pixels_t3hw, p), (t, height // p, width // p), kind, size, timestamp,
                     config.merge_kernel_size)


def process_image(image: Any, config: ImageProcessorConfig | None = None) -> MediaItem:
    """One image → MediaItem (§9.2): a PIL image of any 8-bit mode or 16-bit grayscale, an image file path
    (`load_image`), or a numpy [H, W] / [H, W, 3] / [H, W, 4] array (uint8 0..255 or float 0..1).

    An animated image is a ValueError (it is a video: module docstring); give it to `process_video` or K3Processor.
    """
    config = config or ImageProcessorConfig()
    with _opened(image) as media:
        if isinstance(media, Image.Image) and _is_animation(media):
            raise ValueError(f"animated image with {media.n_frames} frames: process_image encodes one image; pass it "
                             "to process_video, or to K3Processor, which encodes an animation as video chunks")
        pil = _decode(media)
        size = resize_size(pil.width, pil.height, config)
        pixels_3hw = _normalised_3hw(_resized_rgb_hw3(pil, size, config), config)
    return _media_item(pixels_3hw[None], "image", pil.size, config)


def _frame_list(frames: Any) -> list[Any]:
    if isinstance(frames, Image.Image):
        raise ValueError(f"a video must be a list of frames, a numpy [T, H, W, C] array or an animated image, got a "
                         f"single still image ({type(frames).__qualname__})")
    if isinstance(frames, np.ndarray):
        if frames.ndim != 4:
            raise ValueError(f"a video array must be [T, H, W, C], got shape {frames.shape}; pass a list of "
                             "frames for grayscale [H, W] frames")
        return list(frames)
    if isinstance(frames, (list, tuple)):
        return list(frames)
    raise ValueError(f"a video must be a list of frames or a numpy [T, H, W, C] array, got "
                     f"{type(frames).__qualname__}")


def process_video(frames: Any, config: ImageProcessorConfig | None = None,
                  fps: float | None = None) -> list[MediaItem]:
    """Already-sampled frames → one MediaItem per chunk of ≤ max_frames_per_chunk consecutive frames (§9.10).

    `frames` is a list of frames (what `process_image` takes), a numpy [T, H, W, C] array, or an animated image
    (PIL image or file path; module docstring), all of whose frames are kept. Every frame is resized with the
    per-frame limit `video_patch_limit_per_frame` as soon as it is decoded; a chunk's patches are frame-major; its
    timestamp is (index of its first frame) / fps, fps defaulting to `config.video_fps` — for an animated image
    without `fps`, the display time of its first frame from the file's frame durations, when every frame has one.
    """
    config = config or ImageProcessorConfig()
    rate = config.video_fps if fps is None else fps
    if not _is_number(rate) or not math.isfinite(rate) or rate <= 0:
        raise ValueError(f"fps must be a positive finite number, got {rate!r}")
    with _opened(frames) as video:
        animated = isinstance(video, Image.Image) and _is_animation(video)
        frame_iter = _animation_frames(video) if animated else iter(_frame_list(video))
        position = video.tell() if animated else 0
        frames_3hw, durations, first_size, size = [], [], (0, 0), (0, 0)
        try:
            for i in itertools.count():
                try:
                    frame = next(frame_iter, _END)  # an animation seeks to its next frame here
                except _DECODE_ERRORS as e:
                    raise ValueError(f"frame {i}: cannot decode image: {e}") from None
                if frame is _END:
                    break
                try:
                    pil = _decode(frame)
                    if i == 0:
                        first_size = pil.size
                        size = resize_size(pil.width, pil.height, config, config.video_patch_limit_per_frame)
                    if pil.size == first_size:
                        frames_3hw.append(_normalised_3hw(_resized_rgb_hw3(pil, size, config), config))
                except ValueError as e:
                    raise ValueError(f"frame {i}: {e}") from None
                if pil.size != first_size:
                    raise ValueError(f"frame {i} is {pil.width}x{pil.height} but frame 0 is "
                                     f"{first_size[0]}x{first_size[1]}; all frames of a video must share one size")
                if animated:
                    durations.append(video.info.get("duration"))
        finally:
            if animated:  # leave a caller's image at the frame it was on
                with contextlib.suppress(ValueError, *_DECODE_ERRORS):
                    video.seek(position)
    if not frames_3hw:
        raise ValueError("video has no frames")
    if animated and fps is None and all(_is_number(d) and d > 0 for d in durations):
        starts = [float(t) / 1000 for t in np.cumsum([0, *durations[:-1]])]  # milliseconds → seconds
    else:
        starts = [i / rate for i in range(len(frames_3hw))]
    k = config.max_frames_per_chunk
    return [_media_item(torch.stack(frames_3hw[start:start + k]), "video", first_size, config, starts[start])
            for start in range(0, len(frames_3hw), k)]


_END = object()


def _animation_frames(pil: Image.Image) -> Iterator[Image.Image]:
    """The frames of an animated image in order: the image itself, seeked, valid until the next frame is read."""
    for index in range(pil.n_frames):
        pil.seek(index)
        yield pil


# ----------------------------------------------------------------------------------------------------------------
# Text interleaving (§9.9)


def format_timestamp(seconds: float) -> str:
    """"hh:mm:ss.fff" text that precedes each video chunk (§9.10, §13 row 11 [U])."""
    if not _is_number(seconds) or not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"timestamp must be a non-negative finite number of seconds, got {seconds!r}")
    ms = round(seconds * 1000)
    return f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d}.{ms % 1000:03d}"


class K3Processor:
    """Text + media → padded `input_ids` with one `<|media_pad|>` per item, and the packed patches (§9.6, §9.9).

    Framing [U] (§13 row 12): image = `<|media_begin|>image {W}x{H}<|media_content|><|media_pad|><|media_end|>`
    with the original size; each video chunk is the same with "video", preceded by its "hh:mm:ss.fff" timestamp.
    Images are PIL images, numpy arrays or file paths (`load_image`); an animated image given as an image is
    encoded as the video chunks of its frames in place of its placeholder (module docstring). Errors are one-line
    ValueErrors naming the item (`images[i]`, with its file name when it has one).
    Text is encoded with special-token parsing disabled; framing tokens are inserted by id.
    """

    IMAGE_PLACEHOLDER = "<|kimi_image_placeholder|>"
    VIDEO_PLACEHOLDER = "<|kimi_video_placeholder|>"

    def __init__(self, tokenizer: K3Tokenizer, config: ImageProcessorConfig | None = None):
        self.tokenizer = tokenizer
        self.config = config or ImageProcessorConfig()
        ids = {}
        for name in ("<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>"):
            try:
                ids[name] = tokenizer.token_to_id(name)
            except KeyError:
                raise ValueError(f"the tokenizer has no special token {name!r}, needed for media framing") from None
        self.media_begin_id = ids["<|media_begin|>"]
        self.media_content_id = ids["<|media_content|>"]
        self.media_end_id = ids["<|media_end|>"]
        self.media_pad_id = ids["<|media_pad|>"]
        self._split = re.compile(f"({re.escape(self.IMAGE_PLACEHOLDER)}|{re.escape(self.VIDEO_PLACEHOLDER)})")

    def media_tokens(self, item: MediaItem) -> list[int]:
        """The framing of one item: [timestamp] begin "{kind} {W}x{H}" content pad end."""
        prefix: list[int] = []
        if item.kind == "video":
            if item.timestamp is None:
                raise ValueError("a video chunk needs a timestamp for its framing")
            prefix = self.tokenizer.encode(format_timestamp(item.timestamp))
        width, height = item.size
        label = self.tokenizer.encode(f"{item.kind} {width}x{height}")
        return [*prefix, self.media_begin_id, *label, self.media_content_id, self.media_pad_id, self.media_end_id]

    def __call__(self, text: str | list[str], images: Any = None, videos: Any = None,
                 padding_side: str = "left") -> dict[str, torch.Tensor | None]:
        """Tokenise a batch, replacing each placeholder (in order, row 0 first) by its media framing.

        Returns input_ids / attention_mask [B, T] (long; mask 1 real, 0 pad), pixel_values [N, 3, 14, 14] and
        grid_thws [n_items, 3] (None without media), items listed in placeholder order.
        """
        texts = [text] if isinstance(text, str) else text
        if not isinstance(texts, (list, tuple)) or not texts or not all(isinstance(t, str) for t in texts):
            raise ValueError("text must be a string or a non-empty list of strings")
        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
        image_list = _image_list(images)
        video_list = _video_list(videos)
        pieces = [self._split.split(t) for t in texts]
        for placeholder, media, noun in ((self.IMAGE_PLACEHOLDER, image_list, "image"),
                                         (self.VIDEO_PLACEHOLDER, video_list, "video")):
            n_placeholders = sum(p.count(placeholder) for p in pieces)
            if n_placeholders != len(media):
                raise ValueError(f"the text has {n_placeholders} {noun} placeholder(s) {placeholder} but "
                                 f"{len(media)} {noun}(s) were given")

        rows: list[list[int]] = []
        items: list[MediaItem] = []
        n_images = n_videos = 0
        for row_pieces in pieces:
            row: list[int] = []
            for piece in row_pieces:
                if piece == self.IMAGE_PLACEHOLDER:
                    framing, new_items = self.encode_image(image_list[n_images], f"images[{n_images}]")
                    row += framing
                    items += new_items
                    n_images += 1
                    continue
                elif piece == self.VIDEO_PLACEHOLDER:
                    new_items = self._annotate(process_video, video_list[n_videos], f"videos[{n_videos}]")
                    n_videos += 1
                else:
                    row += self.tokenizer.encode(piece)
                    continue
                for item in new_items:
                    row += self.media_tokens(item)
                items += new_items
            rows.append(row)

        input_ids, attention_mask = self.pad(rows, padding_side)
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "pixel_values": torch.cat([it.pixel_values for it in items]) if items else None,
            "grid_thws": torch.tensor([it.grid_thw for it in items], dtype=torch.long) if items else None,
        }

    def encode_image(self, image: Any, where: str = "image") -> tuple[list[int], list[MediaItem]]:
        """One image's framing tokens and media items (an animated image: its video chunks); a problem is a
        one-line ValueError starting with `where`."""
        items = self._annotate(_image_items, image, where)
        return [t for item in items for t in self.media_tokens(item)], items

    def _annotate(self, process: Any, media: Any, where: str) -> Any:
        try:
            return process(media, self.config)
        except ValueError as e:
            name = _media_name(media)
            if name is not None and repr(name) not in str(e):
                where += f" ({name!r})"
            raise ValueError(f"{where}: {e}") from None

    def pad(self, rows: list[list[int]], side: str = "left") -> tuple[torch.Tensor, torch.Tensor]:
        """[B, T] ids padded with the tokenizer's pad token on `side`, and the attention mask (1 real, 0 pad)."""
        length = max(len(r) for r in rows)
        pad_id = self.tokenizer.pad_token_id
        if pad_id is None and any(len(r) < length for r in rows):
            raise ValueError("rows have different lengths but the tokenizer has no pad token ([PAD])")
        input_ids = torch.full((len(rows), length), pad_id if pad_id is not None else 0, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), length), dtype=torch.long)
        for b, row in enumerate(rows):
            span = slice(length - len(row), length) if side == "left" else slice(0, len(row))
            input_ids[b, span] = torch.tensor(row, dtype=torch.long)
            attention_mask[b, span] = 1
        return input_ids, attention_mask

    def save(self, directory: str | os.PathLike) -> None:
        """Write `preprocessor_config.json` and, if it can save itself, the tokenizer into `directory`."""
        self.config.save(directory)
        if hasattr(self.tokenizer, "save"):
            self.tokenizer.save(directory)

    @classmethod
    def load(cls, directory: str | os.PathLike, tokenizer: K3Tokenizer | None = None) -> K3Processor:
        """Read the config from `directory`; the tokenizer too unless one is given."""
        tokenizer = K3Tokenizer.load(directory) if tokenizer is None else tokenizer
        return cls(tokenizer, ImageProcessorConfig.load(directory))


def _image_items(image: Any, config: ImageProcessorConfig) -> list[MediaItem]:
    """An image (or image file) → [its MediaItem]; an animated image → its video chunks (module docstring)."""
    with _opened(image) as media:
        if isinstance(media, Image.Image) and _is_animation(media):
            return process_video(media, config)
        return [process_image(media, config)]


def _image_list(images: Any) -> list[Any]:
    if images is None:
        return []
    return list(images) if isinstance(images, (list, tuple)) else [images]


def _video_list(videos: Any) -> list[Any]:
    """A list of videos (each a list of frames or a [T, H, W, C] array); one bare video is accepted too."""
    if videos is None:
        return []
    if isinstance(videos, np.ndarray):
        return [videos]
    if not isinstance(videos, (list, tuple)):
        raise ValueError(f"videos must be a list of videos, got {type(videos).__qualname__}")
    for i, video in enumerate(videos):
        if (isinstance(video, Image.Image) and not _is_animation(video)) or (isinstance(video, np.ndarray)
                                                                             and video.ndim < 4):
            raise ValueError(f"videos[{i}] is a single frame; videos must be a list of videos, each a list of "
                             "frames or a [T, H, W, C] array")
    return list(videos)
