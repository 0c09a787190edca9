"""Benchmark of cached decoding: cache size, context length, absorbed vs expanded MLA (docs/architecture.md §2.4, §4.4).

k3-tiny and k3-small, random init, fp32 on CPU, B=1, under `torch.no_grad()`. For each preset one cache is
filled by a chunked prefill and extended context by context (1K, 8K, 32K, 64K; --quick: 1K, 8K). At every
context reached:

* per-token decode latency through the model's modules (`model(ids, cache=...)`, not the compiled step of
  `k3.inference.compiled_step`): median over DECODE_STEPS one-token steps after one warm-up step, with the MLA
  layers in the absorbed form (MQA over the latent, §4.4) and in the expanded form (§4.2). Each step
  runs in both forms from the same cache state (paired), so both see the same tokens and the same machine
  load; their logits are compared and the expanded/absorbed ratio is the median of the per-step ratios;
* the time spent in the KDA and in the MLA `self_attn` sublayers of those steps (forward hooks): KDA keeps a
  fixed-size state (§3.7), so its per-token cost must stay flat while MLA's grows with the context;
* cache bytes: growth of `K3Cache.nbytes()` per decoded token and the fixed KDA state, against
  `accounting.cache_sizes` (§2.4) with the actual dtype size;
* at 1K and 8K: one cached decode step against recomputing the whole forward without a cache.

Prefill time is not the measurement, but its throughput is reported. A context whose prefill would take the
preset past --prefill-budget seconds (projected from the last chunk, or reached while prefilling) is skipped
and reported as such. "CPU wait" is the share of wall time in which some task waited for a core
(Linux PSI): well above 0 % means other processes were competing and the row's timings are inflated.

`--dtypes` measures instead k3-small's decode speed with fp32 and with bf16 weights side by side: the random-init
model and its copy cast by `.to(torch.bfloat16)` (the §0.4 tensors stay fp32), both on 2 MiB pages as `k3 generate`
loads them and without forward hooks (so each decoder layer is one compiled call), each with its own cache prefilled
with the same prompt (DTYPE_CONTEXTS; --quick: the first). Rounds of DTYPE_STEPS greedy steps from the same cache
state alternate between the two, who goes first alternating; tokens/s are medians over the rounds, the ratio the
median (and range) of the per-round ratios. One more round per dtype, with timers around each decoder layer's
compiled call and `lm_head`, splits a token's time.

    PYTHONPATH=src .venv/bin/python benchmarks/decode.py [--quick] [--prefill-budget S] [--threads N] [--dtypes]
"""
# Shape suffixes: B batch, T time, N decode steps, V vocabulary.

import argparse
import collections
import contextlib
import copy
import os
import statistics
import time

import torch

from k3.config import K3Config
from k3.model.cache import K3Cache, KDACache
from k3.model.accounting import cache_sizes
from k3.inference import compiled_step
from k3.inference.compiled_step import decode_one_token
from k3.model.k3 import K3ForCausalLM
from k3.model.mla import GatedMLA, absorbed_max_tokens
from k3.runtime import huge_page_weights
from common import CpuWait, allocator, machine, print_table

PRESETS = ("k3-tiny", "k3-small")
CONTEXTS = (1024, 8192, 32768, 65536)
QUICK_CONTEXTS = (1024, 8192)
NO_CACHE_CONTEXTS = (1024, 8192)  # where the full forward without a cache is also timed
PREFILL_CHUNK = 2048  # the expanded MLA prefill materialises [H, chunk, context] scores (math SDPA path)
MLA_DECODE_MODES = ("absorbed", "expanded")
DECODE_STEPS = 16  # timed one-token steps per mode and context, after one warm-up step
APPEND_TOKENS, APPEND_STEPS = 16, 4  # short multi-token calls (a chat turn, a verified draft) per mode and context
PREFILL_BUDGET_S = 180.0  # per preset, cumulative
DTYPE_PRESET, DTYPE_CONTEXTS, DTYPE_STEPS, DTYPE_ROUNDS = "k3-small", (512, 8192), 32, 10  # --dtypes (quick: 3 rounds)


# ------------------------------------------------------------------------------------------------ helpers
class SublayerTimer:
    """Wall time spent inside each decoder layer's `self_attn`, summed separately for KDA and MLA layers."""

    def __init__(self, model: K3ForCausalLM):
        self.seconds = {"kda": 0.0, "mla": 0.0}
        self.enabled = False
        for layer in model.model.layers:
            kind = "kda" if layer.is_kda else "mla"
            layer.self_attn.register_forward_pre_hook(self._start)
            layer.self_attn.register_forward_hook(lambda module, args, out, kind=kind: self._stop(kind))
        self.n_layers = {kind: sum((layer.is_kda == (kind == "kda")) for layer in model.model.layers)
                         for kind in self.seconds}

    def _start(self, module, args):
        self._t0 = time.perf_counter()

    def _stop(self, kind):
        if self.enabled:
            self.seconds[kind] += time.perf_counter() - self._t0

    @contextlib.contextmanager
    def measure(self):
        """Reset, enable for the duration of the block; read `seconds` afterwards."""
        self.seconds = dict.fromkeys(self.seconds, 0.0)
        self.enabled = True
        try:
            yield self
        finally:
            self.enabled = False


@contextlib.contextmanager
def mla_decode_mode(model: K3ForCausalLM, mode: str):
    """Every GatedMLA layer's short cached calls in the absorbed or the expanded form (`absorbed_max_tokens` 0)."""
    layers = [m for m in model.modules() if isinstance(m, GatedMLA)]
    previous = [m.absorbed_max_tokens for m in layers]
    for m in layers:
        m.absorbed_max_tokens = absorbed_max_tokens(m.config) if mode == "absorbed" else 0
    try:
        yield
    finally:
        for m, value in zip(layers, previous):
            m.absorbed_max_tokens = value


def snapshot(cache: K3Cache):
    """What a decode step changes besides positions it overwrites: the length and the KDA states."""
    states = [(layer.conv_state_B3WP.clone(), layer.recurrent_state_BHKV.clone())
              if isinstance(layer, KDACache) else None for layer in cache.layers]
    return cache.length, states


def restore(cache: K3Cache, snap) -> None:
    """Put back the length and KDA states of `snapshot`; later MLA latent positions are simply overwritten."""
    cache.length, states = snap
    for layer, state in zip(cache.layers, states):
        if state is not None:
            layer.conv_state_B3WP.copy_(state[0])
            layer.recurrent_state_BHKV = state[1].clone()


def decode_paired(model, cache, ids_BT, timer, steps, tokens=1):
    """One warm-up step, then `steps` timed steps of `tokens` new tokens each (the next ids of ids_BT), each step
    run in both MLA forms (for `tokens` > 1 the absorbed form applies up to `absorbed_max_tokens`).

    Every step is decoded absorbed and then expanded from the same cache state (the second restores what the
    first changed), so both forms see the same tokens and the same machine load; the ratio is taken per step.
    Returns per form the median seconds per step (total, in KDA `self_attn`, in MLA `self_attn`) and the
    logits of every step [steps + 1, V]; also the median per-step ratio and the cache's byte growth per token.
    """
    seconds = {mode: {"total": [], "kda": [], "mla": []} for mode in MLA_DECODE_MODES}
    logits = {mode: [] for mode in MLA_DECODE_MODES}
    bytes_before, length_before = cache.nbytes(), cache.length
    for j in range(steps + 1):
        step_ids_B1 = ids_BT[:, cache.length: cache.length + tokens]
        before = snapshot(cache)
        for mode in MLA_DECODE_MODES:
            restore(cache, before)
            with mla_decode_mode(model, mode), timer.measure():
                start = time.perf_counter()
                logits_B1V = model(step_ids_B1, cache=cache).logits[:, -1:]
                elapsed = time.perf_counter() - start
            logits[mode].append(logits_B1V[0, 0])
            if j > 0:  # step 0 is the warm-up
                for key, value in (("total", elapsed), ("kda", timer.seconds["kda"]), ("mla", timer.seconds["mla"])):
                    seconds[mode][key].append(value)
    med = statistics.median
    result = {mode: {key: med(values) for key, values in seconds[mode].items()}
              | {"logits_NV": torch.stack(logits[mode])} for mode in MLA_DECODE_MODES}
    result["ratio"] = med(e / a for e, a in zip(seconds["expanded"]["total"], seconds["absorbed"]["total"]))
    result["growth_bytes"] = (cache.nbytes() - bytes_before) / (cache.length - length_before)
    return result


class Prefill:
    """Extends one cache in PREFILL_CHUNK chunks within a time budget (the prefill is not the measurement)."""

    def __init__(self, model, cache, ids_BT, budget_s):
        self.model, self.cache, self.ids_BT, self.budget_s = model, cache, ids_BT, budget_s
        self.spent_s, self.last_s_per_token, self.projected_s = 0.0, 0.0, 0.0

    def to(self, target) -> bool:
        """Extend the cache to `target` tokens; False (and stop) if that would exceed the budget.

        Projects the remaining time from the last chunk (a lower bound: MLA attention makes later chunks slower)
        and gives up mid-way if the budget runs out anyway.
        """
        cache = self.cache
        self.projected_s = (target - cache.length) * self.last_s_per_token
        if self.spent_s + self.projected_s > self.budget_s:
            return False
        while cache.length < target:
            T = min(PREFILL_CHUNK, target - cache.length)
            start = time.perf_counter()
            self.model(self.ids_BT[:, cache.length: cache.length + T], cache=cache)
            elapsed = time.perf_counter() - start
            self.spent_s += elapsed
            self.last_s_per_token = elapsed / T
            if cache.length < target and self.spent_s > self.budget_s:
                self.projected_s = (target - cache.length) * self.last_s_per_token
                return False
        return True


def no_cache_forward(model, ids_BT, context):
    """Seconds to recompute the next token's logits from scratch over context + 1 tokens, and those logits."""
    reps = 3 if context <= 2048 else 1
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        logits_BTV = model(ids_BT[:, : context + 1]).logits
        times.append(time.perf_counter() - start)
    return statistics.median(times), logits_BTV[0, -1]


def greedy_steps(model, cache, first_B, steps):
    """`steps` greedy one-token steps from the cache's current state: (seconds, the tokens chosen [B, steps])."""
    tokens, next_B = [], first_B
    start = time.perf_counter()
    for _ in range(steps):
        next_B = decode_one_token(model, next_B[:, None], cache)[:, -1].argmax(-1)
        tokens.append(next_B)
    return time.perf_counter() - start, torch.stack(tokens, 1)


@contextlib.contextmanager
def token_split(model):
    """Seconds spent, while inside the block, in the KDA and in the MLA decoder layers' compiled calls
    (`compiled_step._run`) and in `lm_head`: a dict filled in as the block runs."""
    seconds, run, forward = collections.defaultdict(float), compiled_step._run, model.lm_head.forward

    def timed_run(layer, *args):
        start = time.perf_counter()
        out = run(layer, *args)
        seconds["KDA layers" if layer.is_kda else "MLA layers"] += time.perf_counter() - start
        return out

    def timed_lm_head(x):
        start = time.perf_counter()
        y = forward(x)
        seconds["lm_head"] += time.perf_counter() - start
        return y

    compiled_step._run, model.lm_head.forward = timed_run, timed_lm_head
    try:
        yield seconds
    finally:
        compiled_step._run = run
        del model.lm_head.forward


def spread(values, fmt: str) -> str:
    """'median (min–max)'."""
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}–{max(values):{fmt}})"


@torch.no_grad()
def bench_dtypes(contexts, rounds):
    """k3-small decode tokens/s with fp32 and with bf16 weights, alternating rounds at each context, and the split of
    a token's time: (rows of both tables)."""
    torch.manual_seed(0)
    config = K3Config.from_preset(DTYPE_PRESET)
    models = {"fp32": K3ForCausalLM(config).eval()}
    models["bf16"] = copy.deepcopy(models["fp32"]).to(torch.bfloat16)  # KeepFP32 keeps the §0.4 tensors fp32
    huge = all([huge_page_weights(m) for m in models.values()])
    ids_BT = torch.randint(0, config.vocab_size, (1, max(contexts) + 1), generator=torch.Generator().manual_seed(1))
    caches = {d: m.make_cache(1, capacity=max(contexts) + DTYPE_STEPS + 8) for d, m in models.items()}
    print(f"{DTYPE_PRESET}: {sum(p.numel() for p in models['fp32'].parameters()) / 1e6:.1f} M parameters; weights "
          f"{'on 2 MiB pages' if huge else 'on 4 KiB pages (huge pages unavailable)'}", flush=True)
    rows, split_rows = [], []
    for context in contexts:
        starts = {}
        for d, m in models.items():  # both caches to `context` (prefill chunks, not measured)
            while caches[d].length < context:
                m(ids_BT[:, caches[d].length: min(context, caches[d].length + PREFILL_CHUNK)], cache=caches[d])
            starts[d] = snapshot(caches[d])
        first_B, wait = ids_BT[:, context], CpuWait()
        speed, tokens = {d: [] for d in models}, {}
        for r in range(rounds + 1):  # round 0 warms both up
            for d in (list(models) if r % 2 else list(models)[::-1]):
                restore(caches[d], starts[d])
                seconds, tokens[d] = greedy_steps(models[d], caches[d], first_B, DTYPE_STEPS)
                if r:
                    speed[d].append(DTYPE_STEPS / seconds)
        for d in models:  # the split, one more round each
            restore(caches[d], starts[d])
            with token_split(models[d]) as seconds:
                total, _ = greedy_steps(models[d], caches[d], first_B, DTYPE_STEPS)
            ms = {part: 1e3 * s / DTYPE_STEPS for part, s in seconds.items()}
            split_rows.append([DTYPE_PRESET, context, d, f"{1e3 * total / DTYPE_STEPS:.2f}",
                               *(f"{ms.get(part, 0.0):.2f}" for part in ("lm_head", "KDA layers", "MLA layers")),
                               f"{1e3 * total / DTYPE_STEPS - sum(ms.values()):.2f}"])
        ratios = [b / f for b, f in zip(speed["bf16"], speed["fp32"])]
        same = int((tokens["bf16"] == tokens["fp32"]).cumprod(1).sum())  # greedy tokens equal until the first change
        rows.append([DTYPE_PRESET, context, spread(speed["fp32"], ".1f"), spread(speed["bf16"], ".1f"),
                     spread(ratios, ".2f"), f"{same} / {DTYPE_STEPS}", str(wait)])
        print(f"  {DTYPE_PRESET} @ {context}: done", flush=True)
    return rows, split_rows


# --------------------------------------------------------------------------------------------- benchmark
@torch.no_grad()
def bench_preset(name, contexts, budget_s):
    """All measurements of one preset; returns rows for the tables."""
    preset_start = time.perf_counter()
    torch.manual_seed(0)
    config = K3Config.from_preset(name)
    model = K3ForCausalLM(config).eval()
    timer = SublayerTimer(model)
    dtype = model.model.embed_tokens.weight.dtype
    sizes = cache_sizes(config, activation_bytes=dtype.itemsize)
    ids_BT = torch.randint(0, config.vocab_size, (1, max(contexts) + (APPEND_STEPS + 2) * APPEND_TOKENS),
                           generator=torch.Generator().manual_seed(1))
    cache = model.make_cache(1, capacity=ids_BT.shape[1])
    print(f"{name}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, "
          f"{timer.n_layers['kda']} KDA + {timer.n_layers['mla']} MLA layers, {dtype}", flush=True)

    model(ids_BT[:, :PREFILL_CHUNK])  # warm-up: first calls pay for allocator growth and kernel set-up
    decode_rows, bytes_rows, no_cache_rows, append_rows = [], [], [], []
    prefill = Prefill(model, cache, ids_BT, budget_s)
    for context in contexts:
        if not prefill.to(context):
            print(f"  {name} @ {context}: skipped, prefill would exceed the {budget_s:.0f} s budget "
                  f"({prefill.spent_s:.0f} s spent, cache at {cache.length} tokens, the rest projected at "
                  f"≥ {prefill.projected_s:.0f} s)", flush=True)
            decode_rows.append([name, context, "skipped: prefill budget"] + [""] * 9)
            append_rows.append([name, context, "skipped: prefill budget"] + [""] * 3)
            break
        snap, cpu_wait = snapshot(cache), CpuWait()
        result = decode_paired(model, cache, ids_BT, timer, DECODE_STEPS)
        restore(cache, snap)
        append = decode_paired(model, cache, ids_BT, timer, APPEND_STEPS, tokens=APPEND_TOKENS)
        restore(cache, snap)
        append_rows.append([name, context, f"{1e3 * append['absorbed']['total']:.1f}",
                            f"{1e3 * append['expanded']['total']:.1f}", f"{append['ratio']:.2f}",
                            f"{(append['absorbed']['logits_NV'] - append['expanded']['logits_NV']).abs().max():.1e}"])
        absorbed, expanded, cpu_wait = result["absorbed"], result["expanded"], str(cpu_wait)
        max_diff = (absorbed["logits_NV"] - expanded["logits_NV"]).abs().max().item()
        decode_rows.append([
            name, context, f"{context / prefill.spent_s:,.0f}",
            f"{1e3 * absorbed['total']:.1f}", f"{1e3 * expanded['total']:.1f}",
            f"{result['ratio']:.2f}",
            f"{1e3 * absorbed['kda']:.1f}", f"{1e3 * absorbed['mla']:.1f}", f"{1e3 * expanded['mla']:.1f}",
            f"{1e3 * (absorbed['total'] - absorbed['kda'] - absorbed['mla']):.1f}", f"{max_diff:.1e}", cpu_wait,
        ])
        # cache bytes: measured growth per token, and the fixed part = nbytes − length · growth
        growth = result["growth_bytes"]
        fixed = cache.nbytes() - context * growth
        bytes_rows.append([
            name, context, f"{growth:,.0f}", f"{sizes.mla_bytes_per_token:,}",
            f"{fixed:,.0f}", f"{sizes.kda_state_bytes_per_sequence + sizes.kda_conv_bytes_per_sequence:,}",
            f"{cache.nbytes() / 2**20:,.1f}", f"{sizes.bytes_at(context) / 2**20:,.1f}",
        ])
        if context in NO_CACHE_CONTEXTS:
            full_s, full_logits_V = no_cache_forward(model, ids_BT, context)
            diff = (full_logits_V - absorbed["logits_NV"][0]).abs().max().item()
            no_cache_rows.append([name, context, f"{1e3 * absorbed['total']:.1f}", f"{1e3 * full_s:,.0f}",
                                  f"{full_s / absorbed['total']:,.0f}", f"{diff:.1e}"])
        print(f"  {name} @ {context}: done (prefill {prefill.spent_s:.0f} s so far, "
              f"{time.perf_counter() - preset_start:.0f} s in all)", flush=True)
    return decode_rows, bytes_rows, no_cache_rows, append_rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="contexts 1K and 8K only")
    parser.add_argument("--prefill-budget", type=float, default=PREFILL_BUDGET_S,
                        help=f"seconds of prefill per preset (default {PREFILL_BUDGET_S:.0f})")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--dtypes", action="store_true",
                        help=f"only {DTYPE_PRESET}'s decode tokens/s with fp32 and bf16 weights, side by side")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.dtypes:
        return main_dtypes(args.quick)
    contexts = QUICK_CONTEXTS if args.quick else CONTEXTS

    start, cpu_wait = time.perf_counter(), CpuWait()
    print(f"Machine: {machine()}")
    print(f"Allocator: {allocator()}; load average at start: "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"B=1, fp32, no_grad, random init; prefill chunks of {PREFILL_CHUNK}; median of {DECODE_STEPS} decode "
          f"steps after 1 warm-up step\n", flush=True)

    decode_rows, bytes_rows, no_cache_rows, append_rows = [], [], [], []
    for name in PRESETS:
        d, b, n, a = bench_preset(name, contexts, args.prefill_budget)
        decode_rows += d
        bytes_rows += b
        no_cache_rows += n
        append_rows += a
    print()

    print("Decode latency, ms per token (absorbed = MQA over the latent, §4.4; expanded = MHA, §4.2);"
          " KDA / MLA attn = time inside the `self_attn` of all KDA / all MLA layers; other = the rest"
          " (FFN/MoE, AttnRes, lm_head)")
    print_table(["preset", "context", "prefill tok/s", "absorbed ms", "expanded ms", "expanded/absorbed",
                 "KDA attn ms", "MLA attn ms (abs.)", "MLA attn ms (exp.)", "other ms (abs.)",
                 "max Δlogit abs. vs exp.", "CPU wait"], decode_rows, "lrrrrrrrrrrr")
    print(f"Appending {APPEND_TOKENS} tokens to the cache in one call, ms per call (median of {APPEND_STEPS} after "
          f"1 warm-up; absorbed = one SDPA over the shared latent, expanded = MHA after kv_b_proj over the context)")
    print_table(["preset", "context", "absorbed ms", "expanded ms", "expanded/absorbed", "max Δlogit"],
                append_rows, "lrrrrr")
    print("Cache bytes (K3Cache.nbytes(); analytic: accounting.cache_sizes with the fp32 size)")
    print_table(["preset", "context", "growth B/token", "analytic B/token", "fixed KDA B", "analytic fixed B",
                 "cache MiB", "analytic MiB"], bytes_rows, "lrrrrrrr")
    print("Cached decode step (absorbed) vs recomputing the full forward over context + 1 tokens without a cache")
    print_table(["preset", "context", "cached ms", "no-cache ms", "no-cache/cached", "max Δlogit"],
                no_cache_rows, "lrrrrr")
    print(f"Total runtime: {time.perf_counter() - start:.0f} s; load average at end: "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; CPU wait over the run: {cpu_wait} (PSI; "
          f"well above 0 % means other processes competed for the cores)")


def main_dtypes(quick: bool):
    start, cpu_wait = time.perf_counter(), CpuWait()
    contexts, rounds = (DTYPE_CONTEXTS[:1], 3) if quick else (DTYPE_CONTEXTS, DTYPE_ROUNDS)
    print(f"Machine: {machine()}")
    print(f"Allocator: {allocator()}")
    print(f"B=1, no_grad, random init; {rounds} rounds of {DTYPE_STEPS} greedy decode steps per dtype and context, "
          f"alternating\n", flush=True)
    rows, split_rows = bench_dtypes(contexts, rounds)
    print()
    print("Decode tokens/s, fp32 against bf16 weights (median over the rounds, range in brackets; bf16/fp32: the "
          "per-round ratios); greedy tokens: bf16's equal to fp32's until the first difference")
    print_table(["preset", "context", "fp32 tok/s", "bf16 tok/s", "bf16/fp32", "greedy tokens equal", "CPU wait"],
                rows, "lrrrrrr")
    print("Where a token's time goes, ms (one more round per dtype, timers around each decoder layer's compiled call "
          "and lm_head; rest: embedding, output mix and norm, the stack's checks, Python)")
    print_table(["preset", "context", "weights", "token", "lm_head", "KDA layers", "MLA layers", "rest"], split_rows,
                "lrlrrrrr")
    print(f"Total runtime: {time.perf_counter() - start:.0f} s; CPU wait over the run: {cpu_wait} (PSI)")


if __name__ == "__main__":
    main()
