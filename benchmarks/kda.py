"""Benchmark of the KDA core: chunk_kda (torch ops and compiled) vs recurrent_kda on CPU in fp32 (docs/architecture.md
§3.4, §3.5, §3.12).

B=1, H=4, K=V=128, T ∈ {1024, 4096, 16384} (--quick: up to 4096); forward (no grad) and forward+backward.
Every measurement runs in a fresh process, so the reported peak RSS belongs to that measurement alone.

FLOP rate of the chunk path: the KDA-core term of `k3.model.accounting.forward_flops_per_token`,
H·(6K² + 3CK + C²) per token forward (state read, write and W·S: 3 × 2K²; the C×C scores and M·Ũ: 3CK; the
triangular solve: C²), and 3× that for forward+backward, against the fp32 matmul peak (median rate of a
2048³ `torch.mm` with the same threads, measured before the cells; `train.matmul_peak_gflops`). The CPU-wait
share (PSI) of the whole run says whether other processes competed for the cores.

    PYTHONPATH=src .venv/bin/python benchmarks/kda.py [--quick] [--lengths T ...]

By default glibc returns large freed blocks to the OS, so every big temporary is page-faulted in again; on small
VMs that can be half of the chunk path's time. Like the `k3` command, the benchmarks switch that off at start
(`k3.runtime.keep_freed_memory`); the header line reports the allocator settings in effect.
"""
# Shape suffixes: B batch, T time, H heads, K key dim, V value dim.

import argparse
import concurrent.futures
import functools
import multiprocessing
import resource
import statistics
import time

import torch
import torch.nn.functional as F

from k3.ops.kda import chunk_kda, recurrent_kda
from common import CpuWait, allocator, machine
from train import matmul_peak_gflops

B, H, K, V = 1, 4, 128, 128
OPS = {"recurrent": recurrent_kda, "chunk": functools.partial(chunk_kda, backend="torch"),
       "compiled": functools.partial(chunk_kda, backend="compiled")}
BUDGET_S = 5.0  # repeat a measurement while it fits in this many seconds (always at least once)
WARMUP_CALLS = 3
C = 64  # kda_chunk_size, the default of chunk_kda


def chunk_flops(T, backward):
    """Model FLOPs of the chunked core: H·(6K² + 3CK + C²) per token forward (accounting's KDA term), ×3 with
    backward."""
    return (3 if backward else 1) * B * T * H * (6 * K * K + 3 * C * K + C * C)


def make_inputs(T, requires_grad):
    gen = torch.Generator().manual_seed(0)
    q_BTHK = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k_BTHK = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v_BTHV = torch.randn(B, T, H, V, generator=gen)
    g_BTHK = -5 * torch.sigmoid(3 * torch.randn(B, T, H, K, generator=gen))  # K3 bounded gate (§3.3)
    beta_BTH = torch.rand(B, T, H, generator=gen)
    return [x.requires_grad_(requires_grad) for x in (q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH)]


def measure(op_name, T, backward):
    """Median seconds per call and the process's peak RSS in MiB. Warm-up: 3 calls (1 when a call takes over a
    second): the first calls of a fresh process run up to 2× slower while its heap grows."""
    op, inputs = OPS[op_name], make_inputs(T, requires_grad=backward)
    do_BTHV = torch.randn(B, T, H, V)

    def call():
        if backward:
            op(*inputs)[0].backward(do_BTHV)
        else:
            with torch.no_grad():
                op(*inputs)

    for _ in range(WARMUP_CALLS):
        start = time.perf_counter()
        call()
        warmup_s = time.perf_counter() - start
        if warmup_s > 1.0:
            break
    times = []
    for _ in range(max(1, min(10, int(BUDGET_S / warmup_s)))):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def in_fresh_process(*args):
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(measure, *args).result()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="T up to 4096 only")
    parser.add_argument("--lengths", type=int, nargs="+", help="these sequence lengths instead")
    args = parser.parse_args()
    lengths = args.lengths or ([1024, 4096] if args.quick else [1024, 4096, 16384])

    cpu_wait, peak_gflops = CpuWait(), matmul_peak_gflops()
    print(f"Machine: {machine()}")
    print(f"Allocator: {allocator()}")
    print(f"fp32 matmul peak (2048³ torch.mm): {peak_gflops:.1f} GFLOP/s")
    print(f"B={B}, H={H}, K=V={K}, fp32, median ms per call; peak RSS of the measuring process; chunk GFLOP = "
          f"H·(6K² + 3CK + C²)·T (×3 with backward), C={C}\n")
    columns = ["T", "pass", "ms: recurrent / chunk / compiled", "compiled tok/s", "recurrent / compiled",
               "chunk / compiled", "chunk GFLOP", "GFLOP/s (% of peak): chunk / compiled",
               "peak RSS MiB: recurrent / chunk / compiled"]
    print("| " + " | ".join(columns) + " |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for T in lengths:
        for backward in (False, True):
            (rec_s, rec_mib), (chunk_s, chunk_mib), (comp_s, comp_mib) = (in_fresh_process(op, T, backward)
                                                                          for op in OPS)
            gflop = chunk_flops(T, backward) / 1e9
            rates = [f"{gflop / t:.1f} ({100 * gflop / t / peak_gflops:.0f} %)" for t in (chunk_s, comp_s)]
            cells = [T, "fwd+bwd" if backward else "fwd", " / ".join(f"{1e3 * t:.0f}" for t in (rec_s, chunk_s, comp_s)),
                     f"{B * T / comp_s:,.0f}", f"{rec_s / comp_s:.1f}", f"{chunk_s / comp_s:.1f}", f"{gflop:.2f}",
                     " / ".join(rates), f"{rec_mib:,.0f} / {chunk_mib:,.0f} / {comp_mib:,.0f}"]
            print("| " + " | ".join(map(str, cells)) + " |", flush=True)
    print(f"\nCPU wait (share of the run's wall time in which some task waited for a core): {cpu_wait}")


if __name__ == "__main__":
    main()
