"""Media pre-processing and interleaving (docs/architecture.md §1.2, §9.2, §9.9, §9.10, §13 rows 11–12): k3.vision.processor."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
import torch
from PIL import Image

from k3.tokenizer import train_bpe
from k3.vision.processor import (
    ImageProcessorConfig,
    K3Processor,
    MediaItem,
    format_timestamp,
    num_image_tokens,
    patchify,
    process_image,
    process_video,
    resize_size,
)

P = 14


def rng_image(height: int, width: int, channels: int = 3, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, channels), dtype=np.uint8)


def unpatchify_hw3(item: MediaItem, frame: int = 0) -> np.ndarray:
    """Pixel-space [H_p, W_p, 3] of one frame of an item normalised with the default mean = std = 0.5."""
    _, h, w = item.grid_thw
    patches = item.pixel_values[frame * h * w:(frame + 1) * h * w]
    pixels = (patches * 0.5 + 0.5) * 255
    return pixels.reshape(h, w, 3, P, P).permute(0, 3, 1, 4, 2).reshape(h * P, w * P, 3).numpy()


@pytest.fixture(scope="module")
def tokenizer():
    subjects = ["the cat", "a dog", "my friend", "the old man", "a small bird", "the teacher", "our team"]
    verbs = ["sees", "likes", "paints", "finds", "carries", "watches", "follows", "describes"]
    objects = ["a red ball", "the blue sky", "an image", "the video", "a bright window", "two apples"]
    endings = ["today.", "at night.", "in the park.", "with care.", "again.", "at 10:30."]
    texts = [" ".join(words) for words in itertools.product(subjects, verbs, objects, endings)][::7]
    return train_bpe(texts, vocab_size=300, num_special_slots=16)


@pytest.fixture(scope="module")
def processor(tokenizer):
    return K3Processor(tokenizer)


# ----------------------------------------------------------------------------------------------------------------
# Sizes (§9.2)


@pytest.mark.parametrize("width, height, tokens", [
    (224, 224, 64), (1024, 768, 1036), (1920, 1080, 2691), (3584, 3584, 16384), (4000, 3000, 15444),
])
def test_worked_examples(width, height, tokens):
    assert num_image_tokens(width, height) == tokens


@pytest.mark.parametrize("width, height, grid", [(224, 224, (1, 16, 16)), (1024, 768, (1, 56, 74))])
def test_worked_examples_through_process_image(width, height, grid):
    item = process_image(np.zeros((height, width, 3), dtype=np.uint8))
    assert item.grid_thw == grid
    assert item.pixel_values.shape == (grid[1] * grid[2], 3, P, P)
    assert item.pixel_values.dtype == torch.float32
    assert item.num_tokens == num_image_tokens(width, height)
    assert item.size == (width, height) and item.kind == "image" and item.timestamp is None


def test_large_images_are_scaled_to_the_limits():
    config = ImageProcessorConfig()
    cap_tokens = config.in_patch_limit // 4
    for width, height in [(8192, 8192), (12000, 9000), (20000, 100), (100, 30000), (9999, 7777), (7169, 7169)]:
        new_w, new_h = resize_size(width, height, config)
        assert new_w <= width and new_h <= height
        assert abs(new_w * height - new_h * width) <= max(width, height)  # aspect kept up to the floors
        h, w = -(-new_h // 28) * 2, -(-new_w // 28) * 2
        assert h <= 512 and w <= 512
        # the limit bounds ⌊W/14⌋·⌊H/14⌋ before padding; padding to 28 adds at most a few % (released formula)
        assert (new_w // P) * (new_h // P) <= config.in_patch_limit * 1.01
        assert num_image_tokens(width, height) <= cap_tokens * 1.03
    assert resize_size(8192, 8192, config) == (3584, 3584)  # exactly the cap: 256×256 patches
    assert resize_size(20000, 100, config) == (7168, 35)  # side cap 512·14 px
    # released formula, kept as is: 8000×6000 → 4142×3107 → padded 222×296 = 65,712 patches (> 65,536)
    assert resize_size(8000, 6000, config) == (4142, 3107) and num_image_tokens(8000, 6000) == 111 * 148


def test_small_images_are_not_upscaled():
    config = ImageProcessorConfig()
    assert resize_size(1, 1, config) == (1, 1)
    assert resize_size(13, 500, config) == (13, 500)
    assert process_image(np.zeros((1, 1, 3), dtype=np.uint8)).grid_thw == (1, 2, 2)


def test_downscale_is_bicubic_then_pad_then_normalise():
    config = ImageProcessorConfig(in_patch_limit=16)
    image = rng_image(84, 112)
    new_size = resize_size(112, 84, config)  # scale sqrt(16/48): 64×48
    assert new_size == (64, 48)
    expected = np.asarray(Image.fromarray(image).resize(new_size, Image.Resampling.BICUBIC), dtype=np.float64)
    item = process_image(image, config)
    assert item.grid_thw == (1, 4, 6) and item.size == (112, 84)
    pixels = unpatchify_hw3(item)
    np.testing.assert_allclose(pixels[:48, :64], expected, atol=1e-3)
    assert np.all(pixels[48:] == 0) and np.all(pixels[:, 64:] == 0)


# ----------------------------------------------------------------------------------------------------------------
# Pixels (§9.2 steps 4–6)


def test_patch_order_and_padding():
    height, width = 30, 50
    rows, cols = np.mgrid[:height, :width]
    image = np.stack([rows, cols, (rows * 7 + cols) % 256], axis=-1).astype(np.uint8)
    item = process_image(image)
    assert item.grid_thw == (1, 4, 4)  # 30×50 padded to 56×56
    canvas = np.zeros((56, 56, 3), dtype=np.float64)
    canvas[:height, :width] = image
    expected = (canvas / 255 - 0.5) / 0.5  # padding 0 → −1
    for index, (y, x) in enumerate(itertools.product(range(4), range(4))):
        block_3PP = expected[y * P:(y + 1) * P, x * P:(x + 1) * P].transpose(2, 0, 1)
        np.testing.assert_allclose(item.pixel_values[index].numpy(), block_3PP, atol=1e-6)
    padding = item.pixel_values[-1]  # patch (3, 3) covers rows 42..55, columns 42..55: pixels only above row 30
    assert torch.all(padding == -1)


def test_patchify_layout():
    pixels_t3hw = torch.arange(2 * 3 * 28 * 42, dtype=torch.float32).reshape(2, 3, 28, 42)
    patches_N3hw = patchify(pixels_t3hw, P)
    assert patches_N3hw.shape == (2 * 2 * 3, 3, P, P)
    for n, (f, y, x) in enumerate(itertools.product(range(2), range(2), range(3))):
        assert torch.equal(patches_N3hw[n], pixels_t3hw[f, :, y * P:(y + 1) * P, x * P:(x + 1) * P])
    with pytest.raises(ValueError, match="multiple of the patch size"):
        patchify(torch.zeros(1, 3, 28, 30), P)


def test_pad_value_is_configurable():
    item = process_image(np.full((10, 10, 3), 255, dtype=np.uint8), ImageProcessorConfig(pad_value=51))
    assert item.pixel_values[0, :, 0, 0].tolist() == [1.0, 1.0, 1.0]
    assert torch.allclose(item.pixel_values[0, :, 13, 13], torch.tensor((51 / 255 - 0.5) / 0.5))


def test_normalisation_uses_mean_and_std():
    image = rng_image(28, 28, seed=1)
    image[0, 0], image[0, 1] = 0, 255
    default = process_image(image)
    assert default.pixel_values.min() == -1 and default.pixel_values.max() == 1
    mean, std = (0.1, 0.2, 0.3), (0.5, 0.25, 2.0)
    item = process_image(image, ImageProcessorConfig(image_mean=mean, image_std=std))
    expected_3hw = (image.transpose(2, 0, 1) / 255 - np.array(mean)[:, None, None]) / np.array(std)[:, None, None]
    actual_3hw = item.pixel_values.reshape(2, 2, 3, P, P).permute(2, 0, 3, 1, 4).reshape(3, 28, 28)
    np.testing.assert_allclose(actual_3hw.numpy(), expected_3hw, atol=1e-5)


def test_equivalent_inputs_give_identical_pixels():
    rgb = rng_image(20, 30, seed=2)
    reference = process_image(rgb).pixel_values
    for same in (rgb / 255, (rgb / 255).astype(np.float32), rgb.astype(np.int64), Image.fromarray(rgb)):
        assert torch.equal(process_image(same).pixel_values, reference)
    gray = rgb[..., 0]
    as_rgb = process_image(np.repeat(gray[..., None], 3, axis=-1)).pixel_values
    for same in (gray, gray[..., None], Image.fromarray(gray), gray / 255):
        assert torch.equal(process_image(same).pixel_values, as_rgb)
    palette = Image.fromarray(rgb).quantize(colors=16)
    assert torch.equal(process_image(palette).pixel_values, process_image(palette.convert("RGB")).pixel_values)
    # floats are quantised to the nearest 8-bit level (0.999·255 = 254.7 → 255)
    assert torch.equal(process_image(np.full((4, 4, 3), 0.999)).pixel_values,
                       process_image(np.full((4, 4, 3), 255, dtype=np.uint8)).pixel_values)


def test_rgba_is_composited_after_the_resize_onto_the_configured_colour():
    background = (0, 255, 0)
    config = ImageProcessorConfig(in_patch_limit=16, transparent_bg_color=background)
    rows, cols = np.mgrid[:112, :112]
    rgba = np.zeros((112, 112, 4), dtype=np.uint8)
    rgba[..., :3] = (200, 40, 120)
    rgba[..., 3] = np.where((rows // 4 + cols // 4) % 2 == 0, 255, 0)  # 4-px alpha checkerboard
    size = resize_size(112, 112, config)
    assert size == (56, 56)

    def composite(pixels_HW4: np.ndarray) -> np.ndarray:
        alpha = pixels_HW4[..., 3:] / 255
        return pixels_HW4[..., :3] * alpha + np.array(background) * (1 - alpha)

    resized = np.asarray(Image.fromarray(rgba).resize(size, Image.Resampling.BICUBIC), dtype=np.float64)
    after = composite(resized)
    before_image = Image.fromarray(np.rint(composite(rgba.astype(np.float64))).astype(np.uint8))
    before = np.asarray(before_image.resize(size, Image.Resampling.BICUBIC), dtype=np.float64)
    assert np.abs(after - before).max() > 4  # the order matters for this image

    pixels = unpatchify_hw3(process_image(rgba, config))[:56, :56]
    assert np.abs(pixels - after).max() <= 1.0 + 1e-3
    assert process_image(Image.fromarray(rgba), config).pixel_values.equal(process_image(rgba, config).pixel_values)

    transparent = rgba.copy()
    transparent[..., 3] = 0
    pixels = unpatchify_hw3(process_image(transparent[:28, :28], config))
    np.testing.assert_allclose(pixels.reshape(-1, 3), np.tile(background, (28 * 28, 1)), atol=1e-3)
    white = unpatchify_hw3(process_image(transparent[:28, :28]))
    np.testing.assert_allclose(white, 255, atol=1e-3)  # default background white

    gray_alpha = Image.fromarray(rgba[:28, :28, [0, 3]], mode="LA")  # alpha of LA / transparent P is kept
    expected = process_image(Image.fromarray(rgba[:28, :28, [0, 0, 0, 3]]), config).pixel_values
    assert process_image(gray_alpha, config).pixel_values.equal(expected)
    palette = Image.new("P", (28, 28), 0)
    palette.info["transparency"] = 0
    assert torch.all(process_image(palette).pixel_values[:, :, :, :] == 1)  # transparent → white → +1


# ----------------------------------------------------------------------------------------------------------------
# Video (§9.10)


def constant_frames(count: int, height: int = 28, width: int = 56) -> list[np.ndarray]:
    return [np.full((height, width, 3), 10 * i, dtype=np.uint8) for i in range(count)]


def test_video_chunks_timestamps_and_frame_major_order():
    items = process_video(constant_frames(10))
    assert [item.grid_thw for item in items] == [(4, 2, 4), (4, 2, 4), (2, 2, 4)]
    assert [item.timestamp for item in items] == [0.0, 2.0, 4.0]  # 2 fps default
    assert all(item.kind == "video" and item.size == (56, 28) and item.num_tokens == 2 for item in items)
    for chunk, item in enumerate(items):
        for frame in range(item.grid_thw[0]):
            value = (10 * (4 * chunk + frame) / 255 - 0.5) / 0.5
            frame_patches = item.pixel_values[frame * 8:(frame + 1) * 8]
            assert torch.allclose(frame_patches, torch.tensor(value, dtype=torch.float32))
    assert [item.timestamp for item in process_video(constant_frames(10), fps=4)] == [0.0, 1.0, 2.0]
    array_items = process_video(np.stack(constant_frames(10)))
    assert all(a.pixel_values.equal(b.pixel_values) for a, b in zip(items, array_items))


def test_video_uses_the_per_frame_patch_limit():
    config = ImageProcessorConfig(video_patch_limit_per_frame=16, max_frames_per_chunk=3)
    frames = [rng_image(84, 112, seed=i) for i in range(5)]
    items = process_video(frames, config)
    assert [item.grid_thw for item in items] == [(3, 4, 6), (2, 4, 6)]  # each frame resized to 64×48
    assert process_image(frames[0], config).grid_thw == (1, 6, 8)  # an image keeps its size
    expected = process_image(frames[4], ImageProcessorConfig(in_patch_limit=16)).pixel_values
    assert items[1].pixel_values[24:].equal(expected)


def test_format_timestamp():
    assert format_timestamp(0) == "00:00:00.000"
    assert format_timestamp(3725.5) == "01:02:05.500"
    assert format_timestamp(2 / 3) == "00:00:00.667"
    with pytest.raises(ValueError, match="non-negative"):
        format_timestamp(-1.0)


# ----------------------------------------------------------------------------------------------------------------
# Bad inputs


@pytest.mark.parametrize("image, message", [
    (np.zeros((0, 5, 3), dtype=np.uint8), "empty"),
    (Image.new("RGB", (0, 4)), "empty"),
    (np.zeros((4, 4, 2), dtype=np.uint8), "unsupported array shape"),
    (np.zeros((3, 20, 30), dtype=np.uint8), "channel-first"),
    (np.zeros((2, 4, 4, 3), dtype=np.uint8), "unsupported array shape"),
    (np.full((4, 4, 3), np.nan), "NaN"),
    (np.full((4, 4, 3), np.inf), "NaN or infinite"),
    (np.full((4, 4, 3), 1.5), r"\[0, 1\]"),
    (np.full((4, 4, 3), -0.1), r"\[0, 1\]"),
    (np.full((4, 4, 3), 256, dtype=np.int32), "0..255"),
    (np.full((4, 4, 3), -1, dtype=np.int16), "0..255"),
    (np.zeros((4, 4, 3), dtype=bool), "dtype"),
    (Image.new("I", (4, 4)), "not 8-bit"),
    (Image.new("F", (4, 4)), "not 8-bit"),
    ("no/such/cat.png", "cannot read image 'no/such/cat.png'"),
    (torch.zeros(3, 4, 4), "PIL image, a numpy"),
])
def test_bad_images_raise(image, message):
    with pytest.raises(ValueError, match=message):
        process_image(image)


def test_bad_sizes_raise():
    with pytest.raises(ValueError, match="width"):
        resize_size(0, 10, ImageProcessorConfig())
    with pytest.raises(ValueError, match="height"):
        num_image_tokens(10, 2.5)


@pytest.mark.parametrize("frames, message", [
    ([], "no frames"),
    ([np.zeros((28, 28, 3), np.uint8), np.zeros((28, 30, 3), np.uint8)], r"frame 1 is 30x28 but frame 0 is 28x28"),
    ([np.zeros((28, 28, 3), np.uint8), np.full((28, 28, 3), 2.0)], r"frame 1: float pixels"),
    (np.zeros((28, 28, 3), np.uint8), r"\[T, H, W, C\]"),
    (Image.new("RGB", (28, 28)), "list of frames"),
])
def test_bad_videos_raise(frames, message):
    with pytest.raises(ValueError, match=message):
        process_video(frames)
    with pytest.raises(ValueError, match="fps"):
        process_video(constant_frames(2), fps=0)


def test_media_item_checks_its_shape():
    with pytest.raises(ValueError, match="pixel_values"):
        MediaItem(torch.zeros(3, 3, P, P), (1, 2, 2), "image", (28, 28))
    with pytest.raises(ValueError, match="grid_thw"):
        MediaItem(torch.zeros(3, 3, P, P), (1, 1, 3), "image", (28, 42))
    with pytest.raises(ValueError, match="kind"):
        MediaItem(torch.zeros(4, 3, P, P), (1, 2, 2), "audio", (28, 28))


# ----------------------------------------------------------------------------------------------------------------
# K3Processor (§9.9)


def special(tokenizer, name: str) -> int:
    return tokenizer.token_to_id(name)


def test_image_framing(processor, tokenizer):
    out = processor("Look: <|kimi_image_placeholder|> ok", images=[rng_image(20, 30)])
    begin, content, pad, end = (special(tokenizer, f"<|media_{n}|>") for n in ("begin", "content", "pad", "end"))
    expected = (tokenizer.encode("Look: ") + [begin] + tokenizer.encode("image 30x20") + [content, pad, end]
                + tokenizer.encode(" ok"))
    assert out["input_ids"].tolist() == [expected]
    assert out["attention_mask"].tolist() == [[1] * len(expected)]
    framing = "<|media_begin|>image 30x20<|media_content|><|media_pad|><|media_end|>"
    assert tokenizer.decode(expected) == f"Look: {framing} ok"
    assert out["grid_thws"].tolist() == [[1, 2, 4]] and out["grid_thws"].dtype == torch.long
    assert out["pixel_values"].equal(process_image(rng_image(20, 30)).pixel_values)


def test_video_framing(processor, tokenizer):
    out = processor("<|kimi_video_placeholder|>", videos=[constant_frames(6)])
    text = tokenizer.decode(out["input_ids"][0].tolist())
    frame = "<|media_begin|>video 56x28<|media_content|><|media_pad|><|media_end|>"
    assert text == f"00:00:00.000{frame}00:00:02.000{frame}"
    assert out["grid_thws"].tolist() == [[4, 2, 4], [2, 2, 4]]
    assert out["pixel_values"].shape == (48, 3, P, P)


def test_batch_order_and_padding(processor, tokenizer):
    images = [rng_image(20, 30, seed=3), rng_image(40, 60, seed=4)]
    video = constant_frames(5, 56, 28)
    texts = ["a <|kimi_image_placeholder|> b <|kimi_video_placeholder|>", "<|kimi_image_placeholder|> the cat sees"]
    items = [process_image(images[0]), *process_video(video), process_image(images[1])]
    pad_id = special(tokenizer, "<|media_pad|>")
    results = {side: processor(texts, images=images, videos=[video], padding_side=side) for side in ("left", "right")}
    for side, out in results.items():
        assert out["grid_thws"].tolist() == [list(item.grid_thw) for item in items]
        assert out["pixel_values"].equal(torch.cat([item.pixel_values for item in items]))
        assert (out["input_ids"] == pad_id).sum(dim=1).tolist() == [3, 1]  # one media_pad per item
        assert out["input_ids"].dtype == torch.long and out["attention_mask"].dtype == torch.long
    rows = [processor(text, images=ims, videos=vids)["input_ids"][0].tolist()
            for text, ims, vids in ((texts[0], images[:1], [video]), (texts[1], images[1:], None))]
    assert len(rows[0]) != len(rows[1])
    length = max(map(len, rows))
    padded = {"left": [[tokenizer.pad_token_id] * (length - len(r)) + r for r in rows],
              "right": [r + [tokenizer.pad_token_id] * (length - len(r)) for r in rows]}
    masks = {"left": [[0] * (length - len(r)) + [1] * len(r) for r in rows],
             "right": [[1] * len(r) + [0] * (length - len(r)) for r in rows]}
    for side, out in results.items():
        assert out["input_ids"].tolist() == padded[side]
        assert out["attention_mask"].tolist() == masks[side]


def test_text_only_and_literal_special_tokens(processor, tokenizer):
    text = "<|media_pad|> <|media_begin|>[PAD] <|end_of_msg|>"
    out = processor(text)
    assert out["pixel_values"] is None and out["grid_thws"] is None
    ids = out["input_ids"][0].tolist()
    assert ids == tokenizer.encode(text)
    assert max(ids) < min(tokenizer.special_tokens.values())  # nothing parsed as special
    assert tokenizer.decode(ids) == text


class _Without:
    """A tokenizer wrapper that hides its pad token or its media tokens."""

    def __init__(self, tokenizer, hide: str):
        self._tokenizer, self._hide = tokenizer, hide

    @property
    def pad_token_id(self):
        return None if self._hide == "[PAD]" else self._tokenizer.pad_token_id

    def token_to_id(self, name):
        if name == self._hide:
            raise KeyError(name)
        return self._tokenizer.token_to_id(name)

    def encode(self, text):
        return self._tokenizer.encode(text)


def test_processor_errors(processor, tokenizer):
    image = rng_image(20, 30)
    with pytest.raises(ValueError, match=r"2 image placeholder\(s\) .* but 1 image\(s\)"):
        processor("<|kimi_image_placeholder|><|kimi_image_placeholder|>", images=[image])
    with pytest.raises(ValueError, match=r"0 image placeholder\(s\) .* but 1 image\(s\)"):
        processor("no image here", images=[image])
    with pytest.raises(ValueError, match=r"1 image placeholder\(s\) .* but 0 image\(s\)"):
        processor("<|kimi_image_placeholder|>")
    with pytest.raises(ValueError, match=r"1 video placeholder\(s\) .* but 2 video\(s\)"):
        processor("<|kimi_video_placeholder|>", videos=[constant_frames(2), constant_frames(2)])
    with pytest.raises(ValueError, match=r"0 video placeholder\(s\) .* but 1 video\(s\)"):
        processor(["a", "<|kimi_image_placeholder|>"], images=[image], videos=[constant_frames(2)])
    with pytest.raises(ValueError, match=r"images\[1\]: .*channel-first"):
        processor("<|kimi_image_placeholder|> <|kimi_image_placeholder|>", images=[image, np.zeros((3, 9, 9))])
    with pytest.raises(ValueError, match=r"videos\[0\]: frame 1 is"):
        processor("<|kimi_video_placeholder|>", videos=[[image, image[:10]]])
    with pytest.raises(ValueError, match=r"videos\[0\] is a single frame"):
        processor("<|kimi_video_placeholder|>", videos=[image])
    with pytest.raises(ValueError, match="padding_side"):
        processor("a", padding_side="middle")
    with pytest.raises(ValueError, match="non-empty list of strings"):
        processor([])
    no_pad = K3Processor(_Without(tokenizer, "[PAD]"))
    assert no_pad(["the cat", "the cat"])["input_ids"].shape[0] == 2  # equal lengths need no padding
    with pytest.raises(ValueError, match="no pad token"):
        no_pad(["the cat", "the cat sees a dog"])
    with pytest.raises(ValueError, match="media_content"):
        K3Processor(_Without(tokenizer, "<|media_content|>"))


def test_processor_save_load(processor, tmp_path):
    processor.config = ImageProcessorConfig(pad_value=3)
    try:
        processor.save(tmp_path)
    finally:
        processor.config = ImageProcessorConfig()
    loaded = K3Processor.load(tmp_path)
    assert loaded.config == ImageProcessorConfig(pad_value=3)
    text, images = "the dog <|kimi_image_placeholder|>", [rng_image(20, 30)]
    assert loaded(text, images=images)["input_ids"].equal(processor(text, images=images)["input_ids"])


# ----------------------------------------------------------------------------------------------------------------
# Configuration (§1.2)


def test_config_json_round_trip(tmp_path):
    config = ImageProcessorConfig(pad_value=7, transparent_bg_color=(1, 2, 3), video_fps=1, image_mean=[0.4, 0.5, 0.6],
                                  extra={"sample_mode": "uniform"}, file_extra={"processor_class": "X"})
    assert config.image_mean == (0.4, 0.5, 0.6) and config.video_fps == 1.0
    config.save(tmp_path)
    text = (tmp_path / "preprocessor_config.json").read_text()
    on_disk = json.loads(text)
    assert on_disk["processor_class"] == "X"
    assert on_disk["media_proc_cfg"]["sample_mode"] == "uniform"
    assert on_disk["media_proc_cfg"]["transparent_bg_config"] == {"bg_color": [1, 2, 3]}
    loaded = ImageProcessorConfig.load(tmp_path)
    assert loaded == config
    loaded.save(tmp_path)
    assert (tmp_path / "preprocessor_config.json").read_text() == text
    assert [p.name for p in tmp_path.iterdir()] == ["preprocessor_config.json"]  # no temporary file left


def test_config_accepts_the_released_nested_layout():
    released = {
        "auto_map": {"AutoProcessor": "processing_kimi_k3.KimiK3Processor"},
        "media_proc_cfg": {
            "patch_size": 14, "merge_kernel_size": 2, "in_patch_limit": 65536, "patch_limit_on_one_side": 512,
            "fixed_output_tokens": None, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
            "transparent_bg_config": {"enabled": True, "bg_color": [0, 0, 0]},
            "in_patch_limit_each_frame": 4096,
        },
    }
    config = ImageProcessorConfig.from_dict(released)
    assert config.transparent_bg_color == (0, 0, 0)
    assert config.extra == {"in_patch_limit_each_frame": 4096, "transparent_bg_config": {"enabled": True}}
    assert config.file_extra == {"auto_map": released["auto_map"]}
    written = config.to_dict()
    assert written["auto_map"] == released["auto_map"]
    assert {k: written["media_proc_cfg"][k] for k in released["media_proc_cfg"]} == released["media_proc_cfg"]
    assert ImageProcessorConfig.from_dict(written) == config
    flat = ImageProcessorConfig.from_dict({"in_patch_limit": 100, "transparent_bg_config": [9, 9, 9], "foo": 1})
    assert flat.in_patch_limit == 100 and flat.transparent_bg_color == (9, 9, 9) and flat.extra == {"foo": 1}
    assert ImageProcessorConfig.from_dict({"transparent_bg_config": None}) == ImageProcessorConfig()


@pytest.mark.parametrize("overrides, field_name", [
    ({"patch_size": 0}, "patch_size"),
    ({"patch_size": "14"}, "patch_size"),
    ({"merge_kernel_size": True}, "merge_kernel_size"),
    ({"in_patch_limit": -1}, "in_patch_limit"),
    ({"patch_limit_on_one_side": 511}, "patch_limit_on_one_side"),
    ({"fixed_output_tokens": 256}, "fixed_output_tokens"),
    ({"image_mean": [0.5, 0.5]}, "image_mean"),
    ({"image_std": [0.5, 0.0, 0.5]}, "image_std"),
    ({"image_std": [0.5, math.nan, 0.5]}, "image_std"),
    ({"transparent_bg_color": [255, 255, 256]}, "transparent_bg_color"),
    ({"transparent_bg_config": {"bg_color": [1.5, 0, 0]}}, "transparent_bg_color"),
    ({"pad_value": -1}, "pad_value"),
    ({"max_frames_per_chunk": 0}, "max_frames_per_chunk"),
    ({"video_fps": 0}, "video_fps"),
    ({"video_fps": math.inf}, "video_fps"),
    ({"video_patch_limit_per_frame": 2.5}, "video_patch_limit_per_frame"),
])
def test_config_rejects_invalid_fields(overrides, field_name):
    with pytest.raises(ValueError, match=field_name):
        ImageProcessorConfig.from_dict(overrides)
    with pytest.raises(ValueError, match=field_name):
        ImageProcessorConfig.from_dict({"media_proc_cfg": overrides})


def test_config_rejects_inconsistent_files(tmp_path):
    with pytest.raises(ValueError, match="patch_size"):
        ImageProcessorConfig.from_dict({"patch_size": 16, "media_proc_cfg": {"patch_size": 14}})
    with pytest.raises(ValueError, match="in_patch_limit"):  # a top-level field may not silently lose to a default
        ImageProcessorConfig.from_dict({"in_patch_limit": 16384, "media_proc_cfg": {}})
    repeated = {"image_mean": [0.5, 0.5, 0.5], "media_proc_cfg": {}}
    assert ImageProcessorConfig.from_dict(repeated).to_dict()["image_mean"] == [0.5, 0.5, 0.5]  # kept, agrees
    with pytest.raises(ValueError, match="media_proc_cfg must be a JSON object"):
        ImageProcessorConfig.from_dict({"media_proc_cfg": [14]})
    with pytest.raises(ValueError, match="transparent_bg_config"):
        ImageProcessorConfig.from_dict({"transparent_bg_config": "white"})
    (tmp_path / "preprocessor_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="invalid JSON"):
        ImageProcessorConfig.load(tmp_path)
    with pytest.raises(FileNotFoundError):
        ImageProcessorConfig.load(tmp_path / "missing")


# ----------------------------------------------------------------------------------------------------------------
# Files: decompression bombs, animations, truncated files, 16-bit grayscale, EXIF orientation


def png_header_only(path, width: int, height: int) -> None:
    """A 57-byte PNG whose header claims width × height RGB pixels (no pixel data): cheap to write and to refuse."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))


def test_decompression_bomb_is_one_line_naming_the_image(processor, tmp_path, monkeypatch):
    """A header claiming 200,000,000 pixels (> 2 × Pillow's MAX_IMAGE_PIXELS) is a ValueError naming the file,
    from load_image, process_image and K3Processor alike; the limit is Pillow's own, as the process sets it."""
    from k3.vision.processor import load_image

    bomb = tmp_path / "bomb.png"
    png_header_only(bomb, 20_000, 10_000)
    expected = (f"image {str(bomb)!r} is 200,000,000 pixels, more than Pillow's safety limit of 178,956,970 "
                "(2 x PIL.Image.MAX_IMAGE_PIXELS, a guard against decompression bombs); raise "
                "PIL.Image.MAX_IMAGE_PIXELS to open a file you trust")
    for call in (lambda: load_image(bomb), lambda: process_image(str(bomb)), lambda: process_video(bomb)):
        with pytest.raises(ValueError) as error:
            call()
        assert str(error.value) == expected
    with pytest.raises(ValueError) as error:
        processor("<|kimi_image_placeholder|>", images=[bomb])
    assert str(error.value) == f"images[0]: {expected}"
    small = tmp_path / "small.png"
    Image.fromarray(rng_image(50, 50)).save(small)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # a stricter limit set by the application is honoured
    with pytest.raises(ValueError, match=r"is 2,500 pixels, more than Pillow's safety limit of 2,000 "):
        load_image(small)


def save_animation(path, frames: list[np.ndarray], durations: list[int], fmt: str) -> None:
    pils = [Image.fromarray(f) for f in frames]
    options = {"lossless": True} if fmt == "WEBP" else {}
    pils[0].save(path, fmt, save_all=True, append_images=pils[1:], duration=durations, loop=0, **options)


@pytest.mark.parametrize("fmt", ["GIF", "PNG", "WEBP", "TIFF"])
def test_animated_image_is_encoded_as_a_video(processor, tokenizer, tmp_path, fmt):
    """A 3-frame animation given as an image becomes one 3-frame video chunk in place of the image placeholder,
    with every frame (not only the first); process_image refuses it with a message saying what to do."""
    from PIL import ImageSequence

    path = tmp_path / f"anim.{fmt.lower()}"
    frames = [np.full((20, 30, 3), value, dtype=np.uint8) for value in (0, 120, 250)]
    save_animation(path, frames, [100, 200, 300], fmt)
    with Image.open(path) as opened:
        decoded = [np.asarray(f.convert("RGB")) for f in ImageSequence.Iterator(opened)]
    expected = process_video(decoded)
    assert len(expected) == 1 and expected[0].grid_thw == (3, 2, 4)
    frame = "<|media_begin|>video 30x20<|media_content|><|media_pad|><|media_end|>"
    with Image.open(path) as opened:
        for image in (path, str(path), opened):
            out = processor("Look: <|kimi_image_placeholder|>", images=[image])
            assert out["grid_thws"].tolist() == [[3, 2, 4]]
            assert out["pixel_values"].equal(expected[0].pixel_values)
            assert tokenizer.decode(out["input_ids"][0].tolist()) == f"Look: 00:00:00.000{frame}"
        assert opened.tell() == 0
        with pytest.raises(ValueError, match="^animated image with 3 frames: process_image encodes one image; pass "
                                             "it to process_video, or to K3Processor"):
            process_image(opened)
        assert process_video(opened)[0].pixel_values.equal(expected[0].pixel_values)
        assert processor("<|kimi_video_placeholder|>", videos=[opened])["grid_thws"].tolist() == [[3, 2, 4]]


def test_animation_chunks_take_their_timestamps_from_the_frame_durations(tmp_path):
    """6 GIF frames of 250 ms → chunks of 4 and 2 frames at 0 s and 1 s; an explicit fps overrides the file."""
    path = tmp_path / "six.gif"
    save_animation(path, [np.full((28, 28, 3), 40 * i, dtype=np.uint8) for i in range(6)], [250] * 6, "GIF")
    items = process_video(path)
    assert [(item.grid_thw, item.timestamp, item.kind) for item in items] == [((4, 2, 2), 0.0, "video"),
                                                                             ((2, 2, 2), 1.0, "video")]
    assert [item.timestamp for item in process_video(path, fps=2)] == [0.0, 2.0]


def test_multi_picture_photo_stays_an_image(tmp_path):
    """An MPO photo (primary picture + e.g. a depth map or preview) is a still image: its first frame."""
    path = tmp_path / "photo.mpo"
    first, second = rng_image(20, 30, seed=1), rng_image(20, 30, seed=2)
    Image.fromarray(first).save(path, "MPO", save_all=True, append_images=[Image.fromarray(second)])
    with Image.open(path) as opened:
        assert opened.n_frames == 2
        expected = process_image(opened.convert("RGB")).pixel_values
    item = process_image(path)
    assert item.grid_thw == (1, 2, 4) and item.pixel_values.equal(expected)


def test_truncated_files_are_one_line_naming_the_file(processor, tmp_path):
    from k3.vision.processor import load_image

    full, cut = tmp_path / "photo.jpg", tmp_path / "cut.jpg"
    Image.fromarray(rng_image(200, 300)).save(full)
    cut.write_bytes(full.read_bytes()[:full.stat().st_size // 2])
    with pytest.raises(ValueError, match=rf"^cannot decode image {str(cut)!r}: image file is truncated"):
        load_image(cut)
    with pytest.raises(ValueError, match=rf"^images\[0\]: cannot decode image {str(cut)!r}: image file is trunc"):
        processor("<|kimi_image_placeholder|>", images=[cut])
    with Image.open(cut) as opened:  # opened by the caller: decoded (and failing) inside the processor
        with pytest.raises(ValueError, match=rf"^images\[0\] \({str(cut)!r}\): cannot decode image: image file is"):
            processor("<|kimi_image_placeholder|>", images=[opened])
    gif, cut_gif = tmp_path / "anim.gif", tmp_path / "cut.gif"
    save_animation(gif, [rng_image(20, 30, seed=i) for i in range(3)], [100] * 3, "GIF")
    cut_gif.write_bytes(gif.read_bytes()[:-10])  # the last frame loses its end
    with pytest.raises(ValueError, match=rf"^images\[0\] \({str(cut_gif)!r}\): frame 2: cannot decode image: "):
        processor("<|kimi_image_placeholder|>", images=[cut_gif])
    with pytest.raises(ValueError, match=rf"^cannot read image {str(tmp_path / 'none.png')!r}: "):
        load_image(tmp_path / "none.png")


def test_16_bit_grayscale_is_scaled_to_8_bits(tmp_path):
    """16-bit grayscale (mode I;16, e.g. a 16-bit PNG) is encoded as round(v / 257), not refused or clipped."""
    values = np.array([[0, 128, 129, 257], [32896, 65278, 65407, 65535]], dtype=np.uint16)
    eight = np.array([[0, 0, 1, 1], [128, 254, 255, 255]], dtype=np.uint8)
    expected = process_image(eight).pixel_values
    assert process_image(Image.fromarray(values)).pixel_values.equal(expected)
    path = tmp_path / "depth16.png"
    Image.fromarray(values).save(path)
    with Image.open(path) as opened:
        assert opened.mode == "I;16"
    assert process_image(path).pixel_values.equal(expected)


def test_exif_orientation_is_applied_to_image_files(tmp_path):
    """A photo stored sideways with EXIF Orientation 6 (rotate 90° clockwise) is encoded upright."""
    from k3.vision.processor import load_image

    stored = np.zeros((20, 40, 3), dtype=np.uint8)
    stored[:, :10] = 255  # a white band on the left of the stored pixels
    image = Image.fromarray(stored)
    exif = image.getexif()
    exif[0x0112] = 6
    path = tmp_path / "sideways.png"
    image.save(path, exif=exif)
    upright = np.asarray(Image.fromarray(stored).transpose(Image.Transpose.ROTATE_270))  # band on top
    loaded = load_image(path)
    assert loaded.size == (20, 40) and loaded.filename == str(path)
    np.testing.assert_array_equal(np.asarray(loaded), upright)
    item = process_image(path)
    assert item.size == (20, 40) and item.pixel_values.equal(process_image(upright).pixel_values)
