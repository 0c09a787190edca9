"""Short timing of a preset on a GPU (benchmarks/gpu_check.sh runs it): training forward + backward tokens/s in
fp32 and in bf16 autocast, and decode tokens/s with `k3.generate`.

* train: `model(input_ids, labels=input_ids).loss.backward()` on random tokens, B×T (default 4×1024, no packed
  documents), random init, gradients dropped between steps (no optimiser step: the forward and backward alone).
  The warm-up steps absorb Triton's compilation and autotuning of fla's KDA kernels (the first call of each
  shape); the timed steps are then timed one by one with CUDA events, median reported; tokens/s = B·T / median.
  Model TFLOP/s = 3 · `accounting.forward_flops_per_token(config, params, T)` · B·T / median (the same count as
  benchmarks/train.py).
* decode: `k3.generate` greedy (temperature 0, no eos: every step runs) at batch 1 from a short random prompt,
  `--decode-tokens` new tokens, against the same call with one new token (the prefill and the first token):
  decode tokens/s = (n − 1) / (t(n) − t(1)); both are the median of `--repeats` calls after one warm-up call of
  each.

    PYTHONPATH=src python3 benchmarks/gpu_timing.py                                # cuda, k3-small
    PYTHONPATH=src .venv/bin/python benchmarks/gpu_timing.py --device cpu --quick   # k3-tiny, small shapes

CUDA timings run with TF32 matmuls off (PyTorch's default), so fp32 is true fp32.
"""
# Shape suffixes: B batch, T time.

import argparse
import contextlib
import platform
import statistics
import sys
import time

import torch

import k3
from k3.model.accounting import count_parameters, forward_flops_per_token
from k3.model.kda import KimiDeltaAttention


class Timer:
    """Seconds between `start()` and `stop()`: CUDA events on a GPU, wall time (after a synchronize) elsewhere."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            self.begin, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.begin.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.end.record()
            self.end.synchronize()
            self.seconds = self.begin.elapsed_time(self.end) / 1e3
        else:
            self.seconds = time.perf_counter() - self.t0


def autocast(device: torch.device, dtype: str):
    if dtype == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def time_train(model, config, device, dtype, B, T, warmup, steps):
    """Median seconds of one forward + backward of B×T tokens; the loss of the last step."""
    model.train()
    ids_BT = torch.randint(0, config.vocab_size, (B, T), device=device,
                           generator=torch.Generator(device).manual_seed(0))
    times, loss = [], float("nan")
    for i in range(warmup + steps):
        model.zero_grad(set_to_none=True)
        with Timer(device) as t:
            with autocast(device, dtype):
                out = model(input_ids=ids_BT, labels=ids_BT)
            out.loss.backward()
        loss = out.loss.item()
        if i >= warmup:
            times.append(t.seconds)
    model.zero_grad(set_to_none=True)
    return statistics.median(times), loss


def time_generate(model, config, device, dtype, prompt_len, new_tokens, repeats):
    """Median seconds of `k3.generate` with `new_tokens` new tokens at batch 1."""
    model.eval()
    ids_1T = torch.randint(0, config.vocab_size, (1, prompt_len), device=device,
                           generator=torch.Generator(device).manual_seed(1))
    times = []
    for i in range(1 + repeats):
        with Timer(device) as t:
            with autocast(device, dtype):
                out = k3.generate(model, ids_1T, max_new_tokens=new_tokens, temperature=0.0)
        assert out.shape == (1, prompt_len + new_tokens), out.shape
        if i:
            times.append(t.seconds)
    return statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--preset", default="k3-small")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--dtypes", default="bf16,fp32", help="comma-separated: bf16 (autocast), fp32")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--prompt", type=int, default=16, help="decode: prompt length")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="decode: timed calls of each length")
    parser.add_argument("--kda-impl", default="auto", help="the KDA layers' core (k3.ops.kda.delta_rule): auto (fla on "
                        "CUDA where installed), chunk (the torch ops), fla")
    parser.add_argument("--quick", action="store_true", help="k3-tiny, 2×64, 8 decode tokens, 1 timed step")
    args = parser.parse_args(argv)
    if args.quick:
        args.preset, args.batch, args.seq, args.decode_tokens = "k3-tiny", 2, 64, 8
        args.warmup, args.steps, args.repeats = 1, 1, 1
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_timing: no CUDA device; nothing timed", file=sys.stderr)
        return 2

    torch.manual_seed(0)
    config = k3.K3Config.from_preset(args.preset)
    model = k3.K3ForCausalLM(config).to(device)
    for module in model.modules():
        if isinstance(module, KimiDeltaAttention):
            module.impl = args.kda_impl
    params = count_parameters(model, config)
    from k3.ops.kda.gpu import use_fla

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(f"{args.preset} on {name}: {params.total_params / 1e6:.1f} M parameters "
          f"({params.activated_params / 1e6:.1f} M activated), torch {torch.__version__}, "
          f"KDA core: {'fla (Triton)' if use_fla(args.kda_impl, device) else 'torch ops'}, "
          f"TF32 matmul {'on' if torch.backends.cuda.matmul.allow_tf32 else 'off'}", flush=True)

    rows = []
    dtypes = [d for d in args.dtypes.split(",") if d]
    flops_per_step = 3 * forward_flops_per_token(config, params, args.seq) * args.batch * args.seq
    for dtype in dtypes:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        try:
            step_s, loss = time_train(model, config, device, dtype, args.batch, args.seq, args.warmup, args.steps)
        except Exception as err:  # report and go on: the other rows still tell something
            rows.append((f"train fwd+bwd", dtype, f"{args.batch}×{args.seq}", f"FAILED: {type(err).__name__}: "
                         f"{str(err).splitlines()[0] if str(err) else ''}", "", "", ""))
            continue
        peak = f"{torch.cuda.max_memory_allocated(device) / 2**30:.1f}" if device.type == "cuda" else "n/a"
        rows.append(("train fwd+bwd", dtype, f"{args.batch}×{args.seq}", f"{1e3 * step_s:.1f}",
                     f"{args.batch * args.seq / step_s:,.0f}", f"{flops_per_step / step_s / 1e12:.2f}",
                     f"{peak} (loss {loss:.3f})"))
        print(rows[-1], flush=True)
    for dtype in dtypes:
        try:
            first_s = time_generate(model, config, device, dtype, args.prompt, 1, args.repeats)
            all_s = time_generate(model, config, device, dtype, args.prompt, args.decode_tokens, args.repeats)
        except Exception as err:
            rows.append(("decode", dtype, f"1×({args.prompt}+{args.decode_tokens})", f"FAILED: {type(err).__name__}: "
                         f"{str(err).splitlines()[0] if str(err) else ''}", "", "", ""))
            continue
        per_token = (all_s - first_s) / max(args.decode_tokens - 1, 1)
        rate = f"{1 / per_token:,.0f}" if per_token > 0 else "n/a (noise)"
        rows.append(("decode (generate)", dtype, f"1×({args.prompt}+{args.decode_tokens})",
                     f"{1e3 * per_token:.2f} / token", rate, "",
                     f"whole call {1e3 * all_s:.0f} ms, prefill+1 {1e3 * first_s:.1f} ms"))
        print(rows[-1], flush=True)

    print()
    columns = ["what", "dtype", "B×T", "time (ms)", "tokens/s", "model TFLOP/s", "peak GiB / note"]
    print("| " + " | ".join(columns) + " |")
    print("|---|---|---|---:|---:|---:|---|")
    for row in rows:
        print("| " + " | ".join(map(str, row)) + " |")
    print(f"\ntrain: median of {args.steps} steps after {args.warmup} warm-up; decode: median of {args.repeats} "
          f"calls after 1 warm-up; {'CUDA events' if device.type == 'cuda' else 'wall time'}", flush=True)
    return 1 if any(str(r[3]).startswith("FAILED") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
