"""Benchmark: the compiled decode kernels side by side (docs/architecture.md §0.6).

k3-tiny and k3-small, random init, fp32 on CPU, B=1, under `torch.no_grad()`, after a 512-token prompt. Three
settings, alternating round by round in one process so that all of them see the same machine:

* torch ops — no compiled kernel at all;
* kernels per op — every compiled kernel built, each operation's called by its module (the few-row products, SiTU-GLU,
  the norms and AttnRes mixes of `k3.ops.decode`), the layers running their modules;
* layer calls — each decoder layer as one compiled call (`k3.inference.compiled_step.decode_one_token`, what
  `generate` and the server run).

Reported: decode tokens/s (median of the rounds, each DECODE_STEPS greedy steps from the same cache state),
the ratios, and the ATen calls per token (counted by a dispatch mode over one step). "CPU wait" is the share of
wall time in which some task waited for a core (Linux PSI): well above 0 % means other processes competed.

    PYTHONPATH=src .venv/bin/python benchmarks/decode_kernels.py [--quick] [--threads N]
"""

import argparse
import statistics
import time
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from k3.config import K3Config
from k3.inference import compiled_step
from k3.inference.compiled_step import decode_one_token
from k3.model.k3 import K3ForCausalLM
from k3.ops import compiled
from common import CpuWait, machine, print_table
from decode import restore, snapshot

PROMPT, DECODE_STEPS = 512, 32
ALL = ("matvec", "activation", "decode")
SETTINGS = {  # the kernels each setting builds (the others report "unavailable" and their torch ops serve), and
    # whether a decoder layer may run as one compiled call
    "torch ops": ((), False),
    "kernels per op": (ALL, False),
    "layer calls": (ALL, True),
}


class AtenCalls(TorchDispatchMode):
    """Counts the ATen operator calls inside the `with` block."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def use_kernels(names, layer_calls: bool, build=compiled.build, run_layer=compiled_step._run) -> None:
    """Make `compiled.build` refuse every kernel but `names` (the KDA chunk kernel is prefill-only: kept), and the
    decoder layers run their modules unless `layer_calls`."""
    compiled.build = lambda name: build(name) if name in names or name == "kda" else (None, "off for comparison")
    compiled_step._run = run_layer if layer_calls else lambda *args: None


def decode_steps(model, cache, first_B, steps) -> float:
    """Seconds for `steps` greedy one-token steps from the cache's current state."""
    next_B, start = first_B, time.perf_counter()
    for _ in range(steps):
        next_B = decode_one_token(model, next_B[:, None], cache)[:, -1].argmax(-1)
    return time.perf_counter() - start


@torch.no_grad()
def bench_preset(name: str, rounds: int):
    cfg = K3Config.from_preset(name)
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg).eval()
    ids_BT = torch.randint(0, cfg.vocab_size, (1, PROMPT + 1), generator=torch.Generator().manual_seed(0))
    cache = model.make_cache(1, capacity=PROMPT + DECODE_STEPS + 8)
    model(ids_BT[:, :PROMPT], cache=cache)
    start, first_B = snapshot(cache), ids_BT[:, PROMPT]
    speeds, calls = {s: [] for s in SETTINGS}, {}
    for r in range(rounds + 1):  # round 0 warms every setting up
        for setting, (kernels, layer_calls) in SETTINGS.items():
            use_kernels(kernels, layer_calls)
            restore(cache, start)
            if r == 0:
                with AtenCalls() as counter:
                    decode_steps(model, cache, first_B, 1)
                calls[setting] = counter.calls
                restore(cache, start)
            seconds = decode_steps(model, cache, first_B, DECODE_STEPS)
            if r:
                speeds[setting].append(DECODE_STEPS / seconds)
    use_kernels(ALL, True)
    return {s: statistics.median(v) for s, v in speeds.items()}, calls


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="k3-small only, 3 rounds")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message="the compiled .* kernel is unavailable")
    presets, rounds = (("k3-small",), 3) if args.quick else (("k3-tiny", "k3-small"), 7)
    print(machine())
    print(f"fp32, B=1, no_grad, random init; {PROMPT}-token prompt; median of {rounds} rounds of {DECODE_STEPS} "
          "greedy decode steps, the three settings alternating; ratios against the first column\n")
    rows = []
    for name in presets:
        wait = CpuWait()
        speed, calls = bench_preset(name, rounds)
        base = speed["torch ops"]
        compiled_settings = list(SETTINGS)[1:]
        rows.append([name, *(f"{speed[s]:.1f}" for s in SETTINGS),
                     *(f"{speed[s] / base:.2f}×" for s in compiled_settings),
                     *(f"{calls[s]:,}" for s in SETTINGS), str(wait)])
    columns = ["preset", *(f"{s} tok/s" for s in SETTINGS), *(f"{s} ratio" for s in list(SETTINGS)[1:]),
               *(f"{s} ATen calls/token" for s in SETTINGS), "CPU wait"]
    print_table(columns, rows, "l" + "r" * (len(columns) - 1))


if __name__ == "__main__":
    main()
