"""One image or one video's frames to the vision tower's input (docs/architecture.md §9.2, §9.10).

* `load_image` opens an image file: one-line ValueErrors naming the file, EXIF orientation applied, Pillow's
  decompression-bomb limit kept (see its docstring).
* `process_image` turns one image into a `MediaItem`: RGB(A) decode → §9.2 resize → RGBA composite → pad to
  multiples of 28 → normalise → patchify, grid (1, h, w), (h/2)(w/2) LLM tokens.
* `process_video` groups already-sampled frames into chunks of ≤ 4 frames, one `MediaItem` (t ≤ 4, h, w) each,
  every frame resized with the per-frame patch limit (§9.10).

Animated images (GIF, APNG, WebP, multi-page TIFF with more than one frame) are videos: `process_image`, which returns
one image, refuses them with a ValueError saying so; `process_video` accepts them. Other multi-frame formats (MPO
photos with a depth map or preview, PSD layers, icons) are still images: their first frame is the picture.

Shape suffixes (`x_BTD`): the package-wide legend at the top of docs/architecture.md.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import ExifTags, Image, ImageOps

from k3.vision.processor_config import ImageProcessorConfig, is_int, is_number

_HIGH_DEPTH_MODES = frozenset({"I", "F"})  # PIL would clip these to 8 bits; their range is not known
_16_BIT_MODES = frozenset({"I;16", "I;16B", "I;16L", "I;16N"})  # 0..65535 grayscale (16-bit PNG): scaled to 8 bits
_ANIMATION_FORMATS = frozenset({"GIF", "PNG", "WEBP", "TIFF"})  # their frames are a sequence in time (or pages)
_DECODE_ERRORS = (OSError, EOFError, SyntaxError, TypeError, struct.error, IndexError)  # Pillow's on corrupt data
_BOMB_SIZE = re.compile(r"\((\d+) pixels\)")  # Pillow's DecompressionBombError text: "Image size (N pixels) ..."


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
        if not is_int(value) or value < 1:
            raise ValueError(f"image {name} must be a positive integer, got {value!r}")
    limit = config.in_patch_limit if patch_limit is None else patch_limit
    if not is_int(limit) or limit < 1:
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


def is_animation(pil: Image.Image) -> bool:
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
        if is_animation(pil):
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
def opened(media: Any) -> Iterator[Any]:
    """`media` itself, or the image of a file path (`load_image`), closed on exit."""
    if not isinstance(media, (str, os.PathLike)):
        yield media
        return
    pil = load_image(media)
    try:
        yield pil
    finally:
        pil.close()


def media_name(media: Any) -> str | None:
    """The file name of a path or of a PIL image read from a file, for error messages."""
    if isinstance(media, (str, os.PathLike)):
        return os.fspath(media)
    return (getattr(media, "filename", None) or None) if isinstance(media, Image.Image) else None


def decode_image(image: Any) -> Image.Image:
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
    with opened(image) as media:
        if isinstance(media, Image.Image) and is_animation(media):
            raise ValueError(f"animated image with {media.n_frames} frames: process_image encodes one image; pass it "
                             "to process_video, or to K3Processor, which encodes an animation as video chunks")
        pil = decode_image(media)
        size = resize_size(pil.width, pil.height, config)
        pixels_3hw = _normalised_3hw(_resized_rgb_hw3(pil, size, config), config)
    return _media_item(pixels_3hw[None], "image", pil.size, config)


def frame_list(frames: Any) -> list[Any]:
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
    if not is_number(rate) or not math.isfinite(rate) or rate <= 0:
        raise ValueError(f"fps must be a positive finite number, got {rate!r}")
    with opened(frames) as video:
        animated = isinstance(video, Image.Image) and is_animation(video)
        frame_iter = animation_frames(video) if animated else iter(frame_list(video))
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
                    pil = decode_image(frame)
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
    if animated and fps is None and all(is_number(d) and d > 0 for d in durations):
        starts = [float(t) / 1000 for t in np.cumsum([0, *durations[:-1]])]  # milliseconds → seconds
    else:
        starts = [i / rate for i in range(len(frames_3hw))]
    k = config.max_frames_per_chunk
    return [_media_item(torch.stack(frames_3hw[start:start + k]), "video", first_size, config, starts[start])
            for start in range(0, len(frames_3hw), k)]


_END = object()


def animation_frames(pil: Image.Image) -> Iterator[Image.Image]:
    """The frames of an animated image in order: the image itself, seeked, valid until the next frame is read."""
    for index in range(pil.n_frames):
        pil.seek(index)
        yield pil


# ----------------------------------------------------------------------------------------------------------------
# Text interleaving (§9.9)


def format_timestamp(seconds: float) -> str:
    """"hh:mm:ss.fff" text that precedes each video chunk (§9.10, §13 row 11 [U])."""
    if not is_number(seconds) or not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"timestamp must be a non-negative finite number of seconds, got {seconds!r}")
    ms = round(seconds * 1000)
    return f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d}.{ms % 1000:03d}"
