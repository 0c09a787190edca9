"""A real-width K3 layer on this machine: k3-full's widths (hidden 7168, 896 routed experts in MXFP4) cut to 2 layers.

    k3 init runs/k3-full-2 --preset k3-full --layers 2 --vocab 32768 --experts mxfp4   # (done here if absent)
    PYTHONPATH=src .venv/bin/python benchmarks/k3_full_layer.py [--model runs/k3-full-2] [--tokens 16]

Layer 0 is KDA with the dense FFN, layer 1 MLA with Stable LatentMoE (all 896 experts packed, about 15.7 GB); every
other tensor is bf16. A child process loads the checkpoint with `from_pretrained` (its peak RSS and load time), checks
the packed model's next-token logits against the expert-by-expert dense reference (loop experts: each chosen
expert decoded, run, discarded) and decodes `--tokens` tokens greedily. The roofline: the bytes one decode step reads
(every weight a token uses: all non-expert tensors but one embedding row, and the 16 chosen experts' packed bytes)
divided by a copy bandwidth measured on the same machine (reads + writes of a 1 GiB copy), against the step time.
"""

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from common import CpuWait, machine, print_table

REPO = Path(__file__).resolve().parent.parent


def copy_bandwidth(gib: float = 1.0, rounds: int = 5) -> float:
    """Bytes moved per second (read + write) by the best of `rounds` copies of a `gib` GiB fp32 buffer."""
    src = torch.ones(int(gib * 2**30) // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * 4 / best


def child(model_dir: str, tokens: int) -> None:
    """Load, check, decode; prints one JSON line."""
    from k3.inference import generate
    from k3.model import K3ForCausalLM
    from k3.model.moe import RoutedExperts
    from k3.ops.mxfp4 import MXFP4Weight

    torch.set_grad_enabled(False)
    start = time.perf_counter()
    model = K3ForCausalLM.from_pretrained(model_dir).eval()
    load_s = time.perf_counter() - start
    load_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    config = model.config
    ids = torch.randint(0, config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    logits = model(ids).logits[0, -1].float()
    experts = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    for m in experts:
        m.impl = "loop"  # the reference: each chosen expert decoded alone, run, discarded
    reference = model(ids).logits[0, -1].float()
    for m in experts:
        m.impl = "grouped"
    relative = ((logits - reference).abs().max() / reference.abs().max()).item()
    generate(model, ids, 2, temperature=0)  # warm-up
    start = time.perf_counter()
    out = generate(model, ids, tokens, temperature=0)
    decode_s = time.perf_counter() - start
    packed = [m for m in model.modules() if isinstance(m, MXFP4Weight)]
    expert_bytes = sum(b.numel() * b.element_size() for m in packed for b in m.buffers()) // config.num_experts
    other = sum(t.numel() * t.element_size() for n, t in model.state_dict().items() if ".experts." not in n)
    embedding_row = config.hidden_size * model.model.embed_tokens.weight.element_size()
    moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
    step_bytes = (other - model.model.embed_tokens.weight.numel() * model.model.embed_tokens.weight.element_size()
                  + embedding_row + moe_layers * config.num_experts_per_token * expert_bytes)
    print(json.dumps({"load_s": load_s, "load_peak_rss": load_rss,
                      "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                      "relative": relative, "tokens": out.shape[1] - ids.shape[1], "decode_s": decode_s,
                      "step_bytes": step_bytes, "expert_bytes": expert_bytes}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(REPO / "runs" / "k3-full-2"))
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--child", choices=["bandwidth", "model"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child == "bandwidth":
        return print(copy_bandwidth())
    if args.child == "model":
        return child(args.model, args.tokens)
    print(machine())
    wait = CpuWait()
    if not Path(args.model).is_dir():
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "k3", "init", args.model, "--preset", "k3-full", "--layers", "2",
                        "--vocab", "32768", "--experts", "mxfp4"], check=True)
        print(f"k3 init: {time.perf_counter() - start:.0f} s")
    disk = sum(f.stat().st_size for f in Path(args.model).glob("*.safetensors"))
    def run_child(*options: str) -> str:  # each measurement in its own process: the model needs the memory
        return subprocess.run([sys.executable, __file__, *options], check=True, capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip().splitlines()[-1]

    bandwidth = float(run_child("--child", "bandwidth"))
    result = json.loads(run_child("--child", "model", "--model", args.model, "--tokens", str(args.tokens)))
    tok_s = result["tokens"] / result["decode_s"]
    roofline = result["step_bytes"] * tok_s / bandwidth
    rows = [["weights on disk", f"{disk / 1e9:.2f} GB"],
            ["load time (from_pretrained)", f"{result['load_s']:.1f} s"],
            ["peak RSS after load / overall", f"{result['load_peak_rss'] / 2**30:.2f} / "
                                              f"{result['peak_rss'] / 2**30:.2f} GiB"],
            ["logits vs expert-by-expert dense reference", f"{result['relative']:.1e} relative"],
            ["decode (batch 1, greedy)", f"{tok_s:.2f} tok/s"],
            ["bytes read per token", f"{result['step_bytes'] / 1e9:.3f} GB"],
            ["copy bandwidth (read + write)", f"{bandwidth / 1e9:.1f} GB/s"],
            ["roofline reached", f"{roofline:.0%}"],
            ["CPU wait", str(wait)]]
    print_table(["k3-full widths, 2 layers", "value"], rows, "lr")


if __name__ == "__main__":
    main()
