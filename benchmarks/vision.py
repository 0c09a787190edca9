"""Benchmark of the MoonViT-V2 encoder: packed vs one-at-a-time encoding of mixed-size images (docs/architecture.md §9.6).

Native-resolution packing runs all patches of a batch of images as one stream: every linear layer (wqkv, wo,
MLP) and the patch conv see one big [N, D] matrix, and only attention is split per image (block-diagonal).
The alternative encodes each image with its own forward. Both give the same features (checked here: max |Δ|).
For reference, a third column costs the usual fixed-shape batching: every image padded to the largest grid of the
batch and encoded as one batch (the compute of a padded batch; its throughput counts real patches only).

Workload: IMAGES images whose sizes cycle through SIZES (pixels, before the §9.2 pre-processing; 2 to 16
patches per side after padding), fp32 on CPU, `torch.no_grad()`. Encoders:

* `k3-tiny-vl`: the demo's vision tower (width 64, 2 layers);
* `width 1024, 2 layers`: the released layer shape (1024 wide, 12 heads × 128, MLP 4096) with 2 of its 27 layers
  (the throughput per layer is what matters; 27 layers would take minutes per measurement on a laptop CPU).

For each: median wall time over REPEATS runs after one warm-up, patches per second, and the packed/one-at-a-time
speed-up. "CPU wait" is the share of wall time in which some task waited for a core (other load: timings are
inflated).

    PYTHONPATH=src .venv/bin/python benchmarks/vision.py [--quick] [--threads N] [--repeats R]

--quick: the demo's encoder only, 2 repeats.
"""
# Shape suffixes: N packed patches, D width.

import argparse
import statistics
import time

import torch

from k3.config import K3Config, K3VisionConfig
from k3.vision import MoonViT
from k3.vision.processor import process_image
from common import CpuWait, machine

SIZES = [(28, 28), (56, 84), (112, 112), (84, 168), (196, 140), (224, 224), (56, 224), (140, 84)]
IMAGES = 16


def images(n: int) -> list[tuple[torch.Tensor, tuple[int, int, int]]]:
    """(patches, grid) of n seeded random images with sizes cycling through SIZES."""
    gen = torch.Generator().manual_seed(0)
    items = []
    for i in range(n):
        w, h = SIZES[i % len(SIZES)]
        pixels = (torch.rand(h, w, 3, generator=gen) * 255).to(torch.uint8).numpy()
        item = process_image(pixels)
        items.append((item.pixel_values, item.grid_thw))
    return items


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="the k3-tiny-vl encoder only, 2 repeats")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    encoders = {
        "k3-tiny-vl": K3Config.from_preset("k3-tiny-vl").vision_config,
        "width 1024, 2 layers": K3VisionConfig(vt_num_hidden_layers=2),
    }
    if args.quick:
        encoders, args.repeats = {"k3-tiny-vl": encoders["k3-tiny-vl"]}, 2
    batch = images(IMAGES)
    pixels_N3PP = torch.cat([p for p, _ in batch])
    grids = torch.tensor([g for _, g in batch])
    print(machine())
    print(f"{IMAGES} images, {pixels_N3PP.shape[0]} patches, grids (h×w) "
          f"{sorted({f'{h}x{w}' for _, h, w in grids.tolist()})}\n")
    h_max, w_max = int(grids[:, 1].max()), int(grids[:, 2].max())
    padded_N3PP = torch.zeros(IMAGES * h_max * w_max, *pixels_N3PP.shape[1:])
    padded_grids = torch.tensor([[1, h_max, w_max]] * IMAGES)
    print("| encoder | packed (patches/s) | one at a time (patches/s) | packed speed-up | padded to "
          f"{h_max}×{w_max} (real patches/s) | max abs diff | CPU wait |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, config in encoders.items():
        torch.manual_seed(0)
        vit = MoonViT(config).eval()
        wait = CpuWait()
        with torch.no_grad():
            packed = median_seconds(lambda: vit(pixels_N3PP, grids), args.repeats)
            single = median_seconds(lambda: [vit(p, torch.tensor([g])) for p, g in batch], args.repeats)
            padded = median_seconds(lambda: vit(padded_N3PP, padded_grids), args.repeats)
            diff = (vit(pixels_N3PP, grids) - torch.cat([vit(p, torch.tensor([g])) for p, g in batch])).abs().max()
        n = pixels_N3PP.shape[0]
        print(f"| {name} | {n / packed:,.0f} | {n / single:,.0f} | {single / packed:.2f}× | {n / padded:,.0f} "
              f"| {float(diff):.1e} | {wait} |", flush=True)


if __name__ == "__main__":
    main()
