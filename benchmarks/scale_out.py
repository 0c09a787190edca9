"""Scale-out benchmark: k3 training steps on 1, 2 and 4 processes of this machine (torchrun, gloo on CPU), the
expert-parallel all-to-all bytes in the latent width against the full width, and `k3 plan` for k3-full on 256 and
1,024 H200s (docs/architecture.md, "Scale-out").

    python benchmarks/scale_out.py [--quick] [--preset k3-small] [--batch-size 4] [--seq-len 256] [--steps 3]

--quick: k3-tiny, 1 and 2 processes (ep 1 and 2), 2 timed steps after 1 warm-up.

The driver runs every layout as its own job: one plain process, or `torchrun --standalone --nproc_per_node N
benchmarks/scale_out.py --worker ...`. Each worker runs the trainer's own `train_step` (benchmarks/train.py's
`SyntheticTrainer`: synthetic packed batches, the model sharded by `k3.parallel.fsdp.parallelize` exactly as
`k3 train` does) for `--warmup` steps, then times `--steps` steps; rank 0 reports the median step time, the
loss of the last step (equal across layouts up to the reduction order: a correctness check) and the
all-to-all bytes of the timed steps summed over the ranks (forward and backward move the same bytes). The
global batch is the same in every layout; the cores are shared, so N processes get 2/N threads each (at
least one): on a 2-core machine expect no speed-up — the point is the cost of the communication and the bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from common import CpuWait, machine, print_table

LAYOUTS = [(1, 1), (2, 1), (2, 2), (4, 2), (4, 4)]  # (processes, expert-parallel degree)


def worker(args) -> None:
    import torch.distributed as dist

    from k3.parallel.distributed import init_distributed
    from k3.parallel.expert import expert_parallel_bytes, reset_expert_parallel_bytes
    from train import SyntheticTrainer

    torch.set_num_threads(args.threads)
    job = init_distributed(args.ep)
    trainer = SyntheticTrainer(args.preset, args.batch_size, args.seq_len, args.warmup + args.steps + 10,
                               distributed=job)
    for _ in range(args.warmup):
        trainer.train_step()
    reset_expert_parallel_bytes(trainer.model)
    times = []
    for _ in range(args.steps):
        started = time.perf_counter()
        metrics = trainer.train_step()
        times.append(time.perf_counter() - started)
    moved = expert_parallel_bytes(trainer.model, cumulative=True)
    counts = torch.tensor([moved.forward, moved.full_width], dtype=torch.float64)
    if job is not None:
        dist.all_reduce(counts)
        dist.destroy_process_group()
    if job is None or job.is_main:
        with open(args.result, "w") as f:
            json.dump({"step_s": statistics.median(times), "loss": metrics["loss"],
                       "latent_bytes": 2 * counts[0].item() / args.steps,  # forward + backward, per step
                       "full_bytes": 2 * counts[1].item() / args.steps}, f)


def run_layout(args, procs: int, ep: int) -> dict:
    threads = max(1, (os.cpu_count() or 1) // procs)
    with tempfile.NamedTemporaryFile(suffix=".json") as result:
        options = ["--worker", "--ep", str(ep), "--threads", str(threads), "--result", result.name,
                   "--preset", args.preset, "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
                   "--steps", str(args.steps), "--warmup", str(args.warmup)]
        launcher = [sys.executable] if procs == 1 else \
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}"]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        subprocess.run([*launcher, os.path.abspath(__file__), *options], check=True, env=env, timeout=args.timeout,
                       stdout=subprocess.DEVNULL)
        with open(result.name) as f:
            return json.load(f)


def plans() -> None:
    from k3.config import K3Config
    from k3.parallel.plan import format_plan, plan

    config = K3Config.from_preset("k3-full")
    for gpus in (256, 1024):
        print(f"`k3 plan k3-full --gpus {gpus} --gpu-memory 141 --ep 64 --seq-len 8192`:\n\n```")
        print(format_plan(plan(config, gpus, 141, ep=64, micro_batch=1, seq_len=8192)))
        print("```\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="k3-small")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=1800, help="per layout (seconds)")
    parser.add_argument("--quick", action="store_true", help="k3-tiny on 1 and 2 processes, 2 timed steps")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ep", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    layouts = LAYOUTS
    if args.quick:
        args.preset, args.steps = "k3-tiny", 2
        layouts = [(procs, ep) for procs, ep in LAYOUTS if procs <= 2]
    print(machine())
    wait = CpuWait()
    tokens = args.batch_size * args.seq_len
    rows, base = [], None
    for procs, ep in layouts:
        r = run_layout(args, procs, ep)
        base = base or r["step_s"]
        ratio = f"{r['full_bytes'] / r['latent_bytes']:.2f}×" if r["latent_bytes"] else "–"
        rows.append([procs, ep, max(1, (os.cpu_count() or 1) // procs), f"{r['step_s']:.2f}",
                     f"{tokens / r['step_s']:.0f}", f"{base / r['step_s']:.2f}", f"{r['loss']:.6f}",
                     f"{r['latent_bytes'] / 2**20:.1f}", f"{r['full_bytes'] / 2**20:.1f}", ratio])
    print(f"\n{args.preset}, global batch {args.batch_size}×{args.seq_len}, median of {args.steps} steps after "
          f"{args.warmup} warm-up; CPU-wait share {wait}\n")
    print_table(["processes", "ep", "threads each", "step s", "tokens/s", "speed vs 1", "last loss",
                 "all-to-all MiB/step (latent)", "at full width", "full / latent"], rows, "rrrrrrrrrr")
    plans()


if __name__ == "__main__":
    main()
