"""Media pre-processing and text interleaving (docs/architecture.md §1.2, §9.1, §9.2, §9.9, §9.10, §10, §13 rows 11–12).

* `ImageProcessorConfig` (`k3.vision.processor_config`) reads and writes the released `preprocessor_config.json`
  (`media_proc_cfg`, §1.2).
* `load_image`, `process_image`, `process_video` (`k3.vision.images`) turn one image or one video's frames into a
  `MediaItem`.
* `K3Processor` replaces the chat renderer's placeholder strings by the media framing of §9.9 (one
  `<|media_pad|>` per item; the model expands it to the item's features) and packs a padded batch.

Animated images (GIF, APNG, WebP, multi-page TIFF with more than one frame) are videos: given as an image to
`K3Processor` (or `k3 generate --image`), every frame is kept and encoded through the video path — ≤ 4-frame chunks,
each framed as "video" with its timestamp — in place of the image placeholder.

Shape suffixes (`x_BTD`): the package-wide legend at the top of docs/architecture.md.
"""

from __future__ import annotations

import os
import re
from typing import Any

import numpy as np
import torch
from PIL import Image

from k3.tokenizer import K3Tokenizer
from k3.vision.images import (MediaItem, format_timestamp, is_animation, load_image, media_name, num_image_tokens,
                             opened, patchify, process_image, process_video, resize_size)
from k3.vision.processor_config import ImageProcessorConfig

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
            name = media_name(media)
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
    with opened(image) as media:
        if isinstance(media, Image.Image) and is_animation(media):
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
        if (isinstance(video, Image.Image) and not is_animation(video)) or (isinstance(video, np.ndarray)
                                                                             and video.ndim < 4):
            raise ValueError(f"videos[{i}] is a single frame; videos must be a list of videos, each a list of "
                             "frames or a [T, H, W, C] array")
    return list(videos)
