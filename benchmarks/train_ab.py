"""k3-tiny training steps of two source trees side by side: alternating processes, the ratio of their medians.

The speed of a small VM drifts by up to 2× within an hour, so a before/after figure is only worth the ratio of runs
interleaved in time. Each round starts one process per tree (tree A, then tree B); a process builds k3-tiny
(B×T = 8×256, synthetic packed documents, `Trainer.train_step` itself — each tree's own `benchmarks/train.py`
`SyntheticTrainer`), runs `--warmup` steps, then times `--steps` steps. Per round it prints both medians, their ratio
A/B and the CPU wait (PSI) over the round; at the end the median ratio.

    git worktree add /tmp/k3-before c60c72f     # the tree the performance issue measured against
    PYTHONPATH=src .venv/bin/python benchmarks/train_ab.py /tmp/k3-before . [--rounds 3] [--steps 6]

A tree's compiled kernels are built into PyTorch's extension cache by kernel name: two trees that both have
kernels would rebuild them in turn, so compare against a tree from before the kernels (as above) or one whose
kernel sources are the same.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

_CHILD = r"""
import json, statistics, sys, time, torch
tree, warmup, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
sys.path[:0] = [tree + "/benchmarks", tree + "/src"]
from train import SyntheticTrainer
try:
    from k3.runtime import keep_freed_memory  # as the k3 command of that tree does, where it has it
    keep_freed_memory()
except ImportError:
    pass
torch.set_num_threads(2)
trainer = SyntheticTrainer("k3-tiny", 8, 256, warmup + steps + 1)
for _ in range(warmup):
    trainer.train_step()
times = []
for _ in range(steps):
    start = time.perf_counter()
    trainer.train_step()
    times.append((time.perf_counter() - start) * 1000)
print(json.dumps(times))
"""


def cpu_wait_us() -> int:
    """Total µs in which some task waited for a core (/proc/pressure/cpu "some"), or -1 where unavailable."""
    try:
        with open("/proc/pressure/cpu") as f:
            return int(f.readline().split("total=")[1])
    except (OSError, IndexError, ValueError):
        return -1


def median_step_ms(tree: str, warmup: int, steps: int) -> float:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the child imports the tree's own k3
    out = subprocess.run([sys.executable, "-c", _CHILD, os.path.abspath(tree), str(warmup), str(steps)], env=env,
                         capture_output=True, text=True, check=True).stdout
    return statistics.median(json.loads(out.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tree_a")
    parser.add_argument("tree_b")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    print(f"k3-tiny 8×256 step, median of {args.steps} after {args.warmup}; A = {args.tree_a}, B = {args.tree_b}")
    print("| round | A ms | B ms | A / B | CPU wait |\n|---:|---:|---:|---:|---:|")
    ratios = []
    for r in range(1, args.rounds + 1):
        wait0, t0 = cpu_wait_us(), time.monotonic()
        a = median_step_ms(args.tree_a, args.warmup, args.steps)
        b = median_step_ms(args.tree_b, args.warmup, args.steps)
        wait = (cpu_wait_us() - wait0) / 1e6 / (time.monotonic() - t0) if wait0 >= 0 else float("nan")
        ratios.append(a / b)
        print(f"| {r} | {a:,.0f} | {b:,.0f} | {a / b:.2f} | {wait:.0%} |", flush=True)
    print(f"median A / B: {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
