"""The image processor's configuration: the released `preprocessor_config.json` (docs/architecture.md §1.2, §9.2)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any


from k3.fileio import atomic_write

CONFIG_FILE = "preprocessor_config.json"
_NESTED_KEY = "media_proc_cfg"  # the released file keeps every processor field inside this object (§1.2)
_BG_KEY = "transparent_bg_config"  # released RGBA-background object (§9.2); its colour key is not published
_BG_COLOR_KEYS = ("bg_color", "background_color", "color")  # accepted spellings of that colour; "bg_color" written


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
        if is_number(self.video_fps):
            self.video_fps = float(self.video_fps)
        self.validate()

    def validate(self) -> None:
        """ValueError naming the first invalid field."""
        def need(ok: bool, name: str, rule: str) -> None:
            if not ok:
                raise ValueError(f"ImageProcessorConfig.{name}: {rule} (got {getattr(self, name)!r})")

        for name in ("patch_size", "merge_kernel_size", "in_patch_limit", "patch_limit_on_one_side",
                     "max_frames_per_chunk", "video_patch_limit_per_frame"):
            need(is_int(getattr(self, name)) and getattr(self, name) >= 1, name, "must be a positive integer")
        need(self.patch_limit_on_one_side % self.merge_kernel_size == 0, "patch_limit_on_one_side",
             f"must be a multiple of merge_kernel_size {self.merge_kernel_size} so padding keeps sides within it")
        need(self.fixed_output_tokens is None, "fixed_output_tokens",
             "only null (the released value) is supported; the token count follows the image size (§9.2)")
        for name in ("image_mean", "image_std"):
            value = getattr(self, name)
            need(isinstance(value, tuple) and len(value) == 3 and all(is_number(v) and math.isfinite(v)
                                                                       for v in value),
                 name, "must be three finite numbers (R, G, B)")
        need(all(v > 0 for v in self.image_std), "image_std", "must be positive")
        need(isinstance(self.transparent_bg_color, tuple) and len(self.transparent_bg_color) == 3
             and all(is_int(v) and 0 <= v <= 255 for v in self.transparent_bg_color),
             "transparent_bg_color", "must be three integers in 0..255 (R, G, B)")
        need(is_int(self.pad_value) and 0 <= self.pad_value <= 255, "pad_value", "must be an integer in 0..255")
        need(is_number(self.video_fps) and math.isfinite(self.video_fps) and self.video_fps > 0, "video_fps",
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


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
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
