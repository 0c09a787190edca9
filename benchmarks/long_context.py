"""Long-context prefill and decode of k3-long, from 1K to 1,048,576 tokens (docs/long-context.md).

    python benchmarks/long_context.py                      # 1k, 8k, 32k, 128k, 512k, 1m (about an hour on 2 cores)
    python benchmarks/long_context.py --lengths 1k,128k    # a subset; results merge into the same file
    python benchmarks/long_context.py --quick              # 1k and 8k
    python benchmarks/long_context.py --decode-only        # the decode step alone, over filled caches (a minute)
    python benchmarks/long_context.py --decode-only --cache-dtype both   # ... over an fp32 and a bf16 latent cache

Each length runs in its own process (so its peak RSS is its own): a randomly initialised fp32 k3-long (seed 0)
prefills random token ids `PREFILL_CHUNK` positions per call (`generate(prefill_chunk=)`: KDA states carried, MLA
latents appended, the blocked attention of §4.7), then decodes 32 tokens greedily. Reported: prefill time and
tokens/s, decode ms per token at that length, peak RSS (VmHWM), the MLA latent cache, and the CPU-wait share (PSI).
Results merge by length into `docs/long-context.json`, and `docs/long-context.png` plots them.
"""

import argparse
import json
import os
import subprocess
import sys
import time

import torch

from common import CpuWait, machine, print_table

HERE = os.path.dirname(os.path.abspath(__file__))
DOCS = os.path.join(HERE, "..", "docs")
PRESET = "k3-long"
DECODE_TOKENS = 32
ROUND_STEPS = 8  # --decode-only: steps timed over one cache per round


def parse_length(text: str) -> int:
    """'8k' → 8,192; '1m' → 1,048,576; '5000' → 5,000."""
    text = text.strip().lower()
    scale = {"k": 2**10, "m": 2**20}.get(text[-1:], 1)
    try:
        return int(float(text[:-1] if scale > 1 else text) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a length: {text!r} (e.g. 8k, 1m, 5000)") from None


def run_one(tokens: int) -> dict:
    """Prefill `tokens` random ids and decode DECODE_TOKENS in this process (fp32 model and latent cache); the
    measurements as a dict."""
    from k3.config import K3Config
    from k3.inference.generate import PREFILL_CHUNK, generate
    from k3.model import K3ForCausalLM
    from k3.runtime import peak_rss_gib

    config = K3Config.from_preset(PRESET)
    torch.manual_seed(0)
    model = K3ForCausalLM(config).eval()
    ids = torch.randint(0, config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(1))
    marks, token_times = [], []
    report_every = max(PREFILL_CHUNK, tokens // 16)

    def on_prefill(done: int) -> None:
        marks.append(time.perf_counter())
        if done % report_every < PREFILL_CHUNK or done == tokens:
            rate = done / (marks[-1] - start)
            print(f"  {done:>9,} / {tokens:,} tokens prefilled, {marks[-1] - start:7.1f} s, {rate:6.0f} tok/s",
                  file=sys.stderr, flush=True)

    cpu_wait, start = CpuWait(), time.perf_counter()
    generate(model, ids, DECODE_TOKENS, temperature=0, prefill_chunk=PREFILL_CHUNK, on_prefill=on_prefill,
             streamer=lambda _: token_times.append(time.perf_counter()))
    prefill_s = marks[-1] - start
    decode_ms = 1e3 * (token_times[-1] - token_times[0]) / (len(token_times) - 1)  # one model step per token
    latent = config.kv_lora_rank + config.qk_rope_head_dim
    n_mla = sum(not config.is_kda_layer(i) for i in range(config.num_hidden_layers))
    return {"tokens": tokens, "prefill_s": round(prefill_s, 2), "prefill_tok_s": round(tokens / prefill_s, 1),
            "decode_ms": round(decode_ms, 2), "peak_rss_gib": round(peak_rss_gib(), 3),
            "mla_cache_mib": round(n_mla * (tokens + DECODE_TOKENS) * latent * 4 / 2**20, 1),
            "cpu_wait": str(cpu_wait), "machine": machine()}


def filled_cache(model, tokens: int, room: int, cache_dtype: torch.dtype):
    """A cache already `tokens` positions long, with room for `room` more: its MLA latents (in `cache_dtype`) and KDA
    states filled with random values (a step's cost does not depend on them), so no prefill is needed to reach the
    length."""
    from k3.model.cache import MLACache

    g = torch.Generator().manual_seed(2)
    cache = model.make_cache(1, capacity=tokens + room, cache_dtype=cache_dtype)
    for layer in cache.layers:
        if isinstance(layer, MLACache):
            layer.latent_BSL[:, :tokens] = torch.randn(1, tokens, layer.latent_BSL.shape[-1], generator=g)
        else:
            layer.recurrent_state_BHKV.normal_(0, 0.1, generator=g)
            layer.conv_state_B3WP.normal_(0, 1, generator=g)
    cache.key_mask_BS[:, :tokens] = True
    cache.length = tokens
    return cache


def decode_only(lengths: list[int], rounds: int, cache_dtypes: list[str], steps: int = ROUND_STEPS) -> None:
    """The decode column alone: one process, one model, a filled cache per length and latent dtype (`filled_cache`),
    all held at once; each round times `steps` greedy one-token steps over every cache in turn (the order reversed
    every other round), so the steps a ratio compares run within a second of each other (this machine's speed
    drifts by tens of percent over minutes). Per length and dtype: the median ms per step, and the median (range) of
    each round's ratio to the first length over the same dtype."""
    from statistics import median

    from k3.config import K3Config
    from k3.inference.compiled_step import decode_one_token
    from k3.model import K3ForCausalLM
    from k3.runtime import keep_freed_memory

    keep_freed_memory()
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.from_preset(PRESET)).eval()
    print(f"Machine: {machine()}", flush=True)
    keys = [(n, d) for d in cache_dtypes for n in lengths]
    caches = {(n, d): filled_cache(model, n, (rounds + 1) * steps + 1, getattr(torch, d)) for n, d in keys}
    tokens = {key: torch.tensor([[1]]) for key in keys}
    cpu_wait, ms = CpuWait(), {key: [] for key in keys}
    with torch.no_grad():
        for r in range(-1, rounds):  # round -1: warm-up, not kept
            for key in keys if r % 2 == 0 else keys[::-1]:
                start = time.perf_counter()
                for _ in range(steps):
                    tokens[key] = decode_one_token(model, tokens[key], caches[key])[:, -1:].argmax(-1)
                if r >= 0:
                    ms[key].append(1e3 * (time.perf_counter() - start) / steps)
            if r >= 0:
                print(f"  round {r + 1}: " + ", ".join(f"{n:,} {d} {ms[n, d][-1]:.1f} ms" for n, d in keys),
                      file=sys.stderr, flush=True)
    base = lengths[0]
    table = []
    for n, dtype in keys:
        ratios = [a / b for a, b in zip(ms[n, dtype], ms[base, dtype])]
        table.append([f"{n:,}", dtype, f"{median(ms[n, dtype]):.2f}",
                      f"{median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"])
    print_table(["cache positions", "latent cache", "decode ms/token (median)", f"vs {base:,} (rounds)"], table,
                "rlrr")
    print(f"CPU wait {cpu_wait}")


def load_results(path: str) -> dict[int, dict]:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return {row["tokens"]: row for row in json.load(f)}


def plot(results: dict[int, dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [results[n] for n in sorted(results)]
    x = [r["tokens"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, key, label in zip(axes, ("prefill_s", "decode_ms", "peak_rss_gib"),
                              ("prefill time (s)", "decode step at that length (ms)", "peak RSS (GiB)")):
        ax.plot(x, [r[key] for r in rows], "o-")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_title(label)
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    fig.suptitle(f"{PRESET}: chunked prefill and decode on {rows[-1]['machine'].split(',')[0]}, 2 cores")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1k,8k,32k,128k,512k,1m",
                        type=lambda s: [parse_length(x) for x in s.split(",")])
    parser.add_argument("--quick", action="store_true", help="1k and 8k only")
    parser.add_argument("--decode-only", action="store_true",
                        help="only the decode step at each length, over a cache filled with random values (no "
                             "prefill: a minute instead of an hour); prints a table, writes nothing")
    parser.add_argument("--rounds", type=int, default=20,
                        help=f"with --decode-only: rounds of {ROUND_STEPS} steps over every length")
    parser.add_argument("--cache-dtype", choices=["float32", "bfloat16", "both"], default="float32",
                        help="with --decode-only: the MLA latent cache's dtype under the fp32 model (both: each, "
                             "alternating)")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # the child process of one length
    parser.add_argument("--out", default=os.path.join(DOCS, "long-context.json"))
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(run_one(args.one)))
        return
    lengths = [1024, 8192] if args.quick else args.lengths
    if args.decode_only:
        decode_only(lengths, args.rounds,
                    ["float32", "bfloat16"] if args.cache_dtype == "both" else [args.cache_dtype])
        return
    print(f"Machine: {machine()}", flush=True)
    results = load_results(args.out)
    for tokens in lengths:
        print(f"{PRESET}: {tokens:,} tokens", file=sys.stderr, flush=True)
        child = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", str(tokens)], text=True,
                               stdout=subprocess.PIPE, check=True)
        results[tokens] = json.loads(child.stdout.strip().splitlines()[-1])
        with open(args.out, "w") as f:  # after every length: a long run keeps what it measured
            json.dump([results[n] for n in sorted(results)], f, indent=1)
    rows = [results[n] for n in sorted(results)]
    base = next((r["decode_ms"] for r in rows if r["tokens"] == 1024), None)
    print_table(["tokens", "prefill s", "prefill tok/s", "decode ms/token", "vs 1K", "peak RSS GiB", "MLA cache MiB",
                 "CPU wait"],
                [[f"{r['tokens']:,}", f"{r['prefill_s']:.1f}", f"{r['prefill_tok_s']:.0f}", f"{r['decode_ms']:.1f}",
                  f"{r['decode_ms'] / base:.2f}x" if base else "", f"{r['peak_rss_gib']:.2f}",
                  f"{r['mla_cache_mib']:.0f}", r["cpu_wait"]] for r in rows], "rrrrrrrr")
    plot(results, os.path.join(os.path.dirname(args.out), "long-context.png"))


if __name__ == "__main__":
    main()
