"""Blocked exact attention (k3.ops.attention, docs/architecture.md §4.7): time and memory against PyTorch's SDPA.

    python benchmarks/attention.py            # T = 4K and 16K
    python benchmarks/attention.py --quick    # T = 4K

One causal call of k3-long's MLA shape (absorbed form: 2 heads over one latent head of 24, values of 16) and of a
wider expanded shape (4 heads of 64, values of 48), forward only (inference) and forward + backward (training).
Compared side by side in one process: the compiled CPU kernel, the torch blocked form, and SDPA (`is_causal`, values
zero-padded to the key width so its fused kernel takes them). Memory: each path's peak RSS growth in a fresh process
over the inputs alone (VmHWM), so a [T, T] score matrix would show as 4·H·T² bytes.
"""

import argparse
import json
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from common import CpuWait, machine, print_table

SHAPES = {"absorbed (k3-long)": (2, 1, 24, 16), "expanded (4 x 64)": (4, 4, 64, 48)}  # H, G, K, V


def call(path: str, q, k, v, backward: bool):
    from k3.ops.attention.blocked import BlockedAttention
    from k3.ops.attention.cpu import CpuBlockedAttention

    if path == "sdpa":
        H = q.shape[1]
        o = F.scaled_dot_product_attention(q, k.expand(-1, H, -1, -1), F.pad(v, (0, k.shape[-1] - v.shape[-1]))
                                           .expand(-1, H, -1, -1), is_causal=True, scale=0.2)[..., : v.shape[-1]]
    else:
        o = (CpuBlockedAttention if path == "compiled" else BlockedAttention).apply(q, k, v, 0.2, None, None)
    if backward:
        o.sum().backward()


def inputs(shape: str, T: int, grad: bool):
    H, G, K, V = SHAPES[shape]
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, heads, T, width, generator=g).requires_grad_(grad)
            for heads, width in ((H, K), (G, K), (G, V))]


def measure(path: str, shape: str, T: int, backward: bool) -> dict:
    """In this (fresh) process: best of 3 timed calls after one warm-up, and the peak RSS growth over the inputs."""
    from k3.runtime import peak_rss_gib

    tensors = inputs(shape, T, backward)
    before = peak_rss_gib()
    call(path, *tensors, backward)
    grown = peak_rss_gib() - before
    best = float("inf")
    for _ in range(3):
        tensors = inputs(shape, T, backward)
        start = time.perf_counter()
        call(path, *tensors, backward)
        best = min(best, time.perf_counter() - start)
    return {"s": best, "rss_mib": 1024 * grown}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # path,shape,T,backward: one measurement in a child
    args = parser.parse_args()
    if args.one:
        path, shape, T, backward = args.one.split("|")
        print(json.dumps(measure(path, shape, int(T), backward == "1")))
        return
    lengths = [4096] if args.quick else [4096, 16384]
    print(f"Machine: {machine()}", flush=True)
    cpu_wait, rows = CpuWait(), []
    for backward in (False, True):
        for shape in SHAPES:
            for T in lengths:
                got = {}
                for path in ("compiled", "blocked", "sdpa"):
                    child = subprocess.run([sys.executable, __file__, "--one", f"{path}|{shape}|{T}|{int(backward)}"],
                                           text=True, stdout=subprocess.PIPE, check=True)
                    got[path] = json.loads(child.stdout.strip().splitlines()[-1])
                H = SHAPES[shape][0]
                rows.append(["forward + backward" if backward else "forward", shape, f"{T:,}",
                             *(f"{got[p]['s'] * 1e3:.0f}" for p in got), f"{got['sdpa']['s'] / got['compiled']['s']:.2f}x",
                             *(f"{got[p]['rss_mib']:.0f}" for p in got), f"{4 * H * T * T / 2**20:,.0f}"])
    print_table(["pass", "shape", "T", "compiled ms", "torch blocked ms", "SDPA ms", "SDPA / compiled",
                 "compiled +MiB", "blocked +MiB", "SDPA +MiB", "one [H,T,T] fp32 MiB"], rows, "llrrrrrrrrr")
    print(f"CPU wait over the run: {cpu_wait} (PSI)")


if __name__ == "__main__":
    main()
