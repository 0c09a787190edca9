"""Two source trees side by side: alternating processes, the ratio of their medians.

The speed of a small VM drifts by up to 2× within an hour, so a before/after figure is only worth the ratio of runs
interleaved in time. Each round starts one process per tree (tree A, then tree B); a process imports its tree's own
k3, builds the workload, runs `--warmup` steps, then times `--steps` steps. Per round it prints both medians, their
ratio A/B and the CPU wait (PSI) over the round; at the end the median ratio. Workloads:

* `train`: k3-tiny training steps, B×T = 8×256, synthetic packed documents (`Trainer.train_step` itself: each tree's
  own `benchmarks/train.py` `SyntheticTrainer`);
* `decode`: k3-small greedy decode steps, fp32 (`--dtype bf16`: the model cast to bf16), random init, B = 1, after a
  512-token prompt, through the tree's `generate` (the time between consecutive tokens), its weights on 2 MiB pages
  as `k3 generate` loads them.

    git worktree add /tmp/k3-before c60c72f     # the tree to compare against
    PYTHONPATH=src .venv/bin/python benchmarks/ab.py /tmp/k3-before . [--workload decode] [--rounds 3] [--steps 6]

Each tree builds its compiled kernels into an extension cache of its own (`TORCH_EXTENSIONS_DIR` under
~/.cache/torch_extensions/ab/, by the tree's path: two trees sharing one would rebuild them in turn), in an untimed
round 0 that also warms both up.
"""

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time

_TRAIN = r"""
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

_DECODE = r"""
import json, sys, time, torch
tree, warmup, steps, dtype = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
sys.path[:0] = [tree + "/src"]
from k3.config import K3Config
from k3.inference import generate
from k3.model import K3ForCausalLM
from k3.runtime import huge_page_weights, keep_freed_memory
keep_freed_memory()
torch.set_num_threads(2)
torch.manual_seed(0)
model = K3ForCausalLM(K3Config.from_preset("k3-small")).eval()
if dtype == "bf16":
    model = model.to(torch.bfloat16)
huge_page_weights(model)
ids = torch.randint(0, model.config.vocab_size, (1, 512), generator=torch.Generator().manual_seed(0))
stamps = []
with torch.no_grad():
    generate(model, ids, warmup + steps + 1, temperature=0, streamer=lambda tokens: stamps.append(time.perf_counter()))
print(json.dumps([(b - a) * 1000 for a, b in zip(stamps[warmup:], stamps[warmup + 1:])]))
"""


def cpu_wait_us() -> int:
    """Total µs in which some task waited for a core (/proc/pressure/cpu "some"), or -1 where unavailable."""
    try:
        with open("/proc/pressure/cpu") as f:
            return int(f.readline().split("total=")[1])
    except (OSError, IndexError, ValueError):
        return -1


def median_step_ms(tree: str, args: argparse.Namespace) -> float:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the child imports the tree's own k3
    tree_key = hashlib.sha1(os.path.abspath(tree).encode()).hexdigest()[:12]
    env["TORCH_EXTENSIONS_DIR"] = os.path.join(os.path.expanduser("~"), ".cache", "torch_extensions", "ab", tree_key)
    child = [_TRAIN] if args.workload == "train" else [_DECODE]
    extra = [] if args.workload == "train" else [args.dtype]
    out = subprocess.run([sys.executable, "-c", *child, os.path.abspath(tree), str(args.warmup), str(args.steps),
                          *extra], env=env, capture_output=True, text=True, check=True).stdout
    return statistics.median(json.loads(out.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tree_a")
    parser.add_argument("tree_b")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--workload", choices=("train", "decode"), default="train")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="decode: the weights' dtype")
    args = parser.parse_args()
    what = "k3-tiny 8×256 training step" if args.workload == "train" else \
        f"k3-small {args.dtype} decode step after 512 tokens"
    print(f"{what}, median of {args.steps} after {args.warmup}; A = {args.tree_a}, B = {args.tree_b}")
    print("| round | A ms | B ms | A / B | CPU wait |\n|---:|---:|---:|---:|---:|")
    for tree in (args.tree_a, args.tree_b):  # round 0: builds the kernels, warms up
        median_step_ms(tree, args)
    ratios = []
    for r in range(1, args.rounds + 1):
        wait0, t0 = cpu_wait_us(), time.monotonic()
        a = median_step_ms(args.tree_a, args)
        b = median_step_ms(args.tree_b, args)
        wait = (cpu_wait_us() - wait0) / 1e6 / (time.monotonic() - t0) if wait0 >= 0 else float("nan")
        ratios.append(a / b)
        print(f"| {r} | {a:,.1f} | {b:,.1f} | {a / b:.2f} | {wait:.0%} |", flush=True)
    print(f"median A / B: {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
