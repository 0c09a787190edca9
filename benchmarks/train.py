"""Benchmark of one training step: throughput, achieved FLOP/s against the fp32 matmul peak, and where the time goes.

k3-tiny (B×T = 8×256) and k3-small (4×256), random init, fp32 on CPU, synthetic random tokens packed as 2–3
documents per row (`document_ids`), no data download. Each step is `Trainer.train_step` itself (docs/architecture.md §7.6):
forward with document_ids (the QuantileBalancer and the QK-Clip max-logit recorder observe it through the
model's observer channel) → backward → gradient clipping → Muon (ns_dtype=float32, as the trainer uses on CPU) +
AdamW → QK-Clip → QuantileBalancer.step. Only the data source differs from `k3 train`: `SyntheticTrainer`
builds the model, optimisers, balancer and observers exactly as `Trainer.__init__`/`Trainer.run` do.

1. Throughput: median step time of the timed steps after the warm-up steps (`STEPS`), on the uninstrumented
   model; tokens/s = B·T / step time.
2. FLOP/s: model FLOPs per step = 3 · `accounting.forward_flops_per_token(config, params, T)` · B·T, i.e.
   6 · (activated non-embedding matmul parameters) per token plus 3× the forward MLA-attention and KDA-core terms
   (context = the row length T; the masked SDPA computes the full row, the packed documents would need less).
   Next to it, the Newton–Schulz FLOPs of the Muon step (5 iterations of 4m²n + 2m³ per m×n block, m ≤ n), which
   are real work but not model FLOPs. The reference peak is the median rate of ten 2048×2048×2048 fp32 `torch.mm`
   with the same thread count, measured before and after each preset's timed steps (the higher of the two);
   MFU = model FLOP/s / peak.
3. Where the time goes: the profiled steps (`STEPS`), further steps with timers (median per component):
   * forward of each sublayer type: wall time around the module's `forward` (KDA / MLA `self_attn`,
     `block_sparse_moe`, dense `mlp`) and around every `attn_res_mix` call;
   * backward of the same calls: identity autograd markers on the sublayer's output and inputs; the backward of
     the output marker runs when the sublayer's backward starts and the input markers' when it has produced the
     gradients of all its inputs. CPU autograd runs on the calling thread and pops ready nodes by decreasing
     sequence number, so nodes created inside the sublayer run before any node created before it: the window is
     the sublayer's backward (parameter-gradient accumulation included);
   * nested inside KDA, the KDA core (`chunk_kda_by_document`: re-lay every document on chunk boundaries,
     `chunk_kda` with state resets, gather back) with the same markers, reported as a sub-row;
   * the QK-Clip max-logit recomputation (observer, inside the MLA window, subtracted from it) and the QB
     statistics (observer, inside the MoE forward, subtracted from it) are timed on their own;
   * clip, Muon, AdamW, QK-Clip rescale and QB solve/install are timed around those calls (optimiser step hooks;
     wrappers of the trainer's `clip_grad_norm_`, `qk_clip_` and `balancer.step`);
   * "rest of fwd/bwd" is the forward (model call, loss included) or backward total minus the sublayers:
     embedding, norms, lm_head, cross-entropy, residual adds.
   The profiled steps' total is printed next to the clean median (timer overhead).

    PYTHONPATH=src .venv/bin/python benchmarks/train.py [--quick] [--presets k3-small] [--grad-accum N]

--quick runs k3-tiny only; --threads N sets torch's thread count; --grad-accum N takes N micro-batches of B×T per
optimiser step, as a real run does (Muon's Newton–Schulz is a cost per step, not per token). Full run: about 3.5
minutes on 2 idle cores. The load average, the CPU idle share before the start and the CPU wait (PSI) of each preset
are printed: other processes on the cores distort every number (with as many threads as cores, PyTorch's threads wait
on each other: steps become many times slower).
"""
# Shape suffixes: B batch, T time, V vocabulary.

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

import k3.model.k3 as k3_model
import k3.model.kda as kda_module
import k3.optim.qk_clip as qk_clip_module
import k3.train.trainer as trainer_module
from k3.config import K3Config
from k3.model import K3ForCausalLM
from k3.model.accounting import count_parameters, forward_flops_per_token
from k3.ops.kda.varlen import chunk_aligned_layout
from k3.model.observer import attach
from k3.optim import MaxLogitRecorder, make_optimizers, mla_layers
from k3.optim.muon import block_views
from k3.parallel.fsdp import parallelize
from k3.train.balance import QuantileBalancer
from k3.train.tasks import TextTask
from k3.train.trainer import TrainArgs, Trainer
from common import CpuWait, allocator, machine, print_table

PRESETS = {"k3-tiny": (8, 256), "k3-small": (4, 256)}  # preset: (batch, sequence length)
STEPS = {"k3-tiny": (2, 6, 3), "k3-small": (1, 5, 3)}  # preset: (warm-up, timed, profiled) steps
PEAK_N = 2048


# ------------------------------------------------------------------------------------------------ the step
def synthetic_batches(vocab_size, batch_size, seq_len, seed=0):
    """Endless random batches shaped like `k3.train.data.Batches`: every row packs 2–3 documents."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        input_ids_BT = torch.randint(0, vocab_size, (batch_size, seq_len), generator=gen)
        document_ids_BT = torch.zeros(batch_size, seq_len, dtype=torch.long)
        for row in range(batch_size):
            n_docs = int(torch.randint(2, 4, (), generator=gen))
            starts = (torch.randperm(seq_len - 1, generator=gen)[: n_docs - 1] + 1).sort().values
            document_ids_BT[row, starts] = 1
        yield {"input_ids": input_ids_BT, "labels": input_ids_BT.clone(), "document_ids": document_ids_BT.cumsum(1)}


def kda_padding_factor(config, batch_size, seq_len, n_batches, seed=0):
    """Mean over the first batches of (tokens the KDA core processes) / (real tokens): `chunk_kda_by_document`
    pads every document to a multiple of `kda_chunk_size` and the rows to the longest re-laid row."""
    batches, C, factors = synthetic_batches(config.vocab_size, batch_size, seq_len, seed), config.kda_chunk_size, []
    for _ in range(n_batches):
        _, reset_BN = chunk_aligned_layout(next(batches)["document_ids"], C)
        factors.append(reset_BN.numel() * C / (batch_size * seq_len))
    return statistics.mean(factors)


class SyntheticText(TextTask):
    """`TextTask` fed by `synthetic_batches` (no corpus, no tokenizer)."""

    def __init__(self, batches):
        self.batches = batches  # `TextTask.next_batch` draws from it


class SyntheticTrainer(Trainer):
    """`Trainer` with synthetic batches, on CPU, without run directory: `train_step` is the trainer's own."""

    def __init__(self, preset, batch_size, seq_len, total_steps, seed=0, distributed=None, grad_accum=1):
        self.args = args = TrainArgs(preset=preset, steps=total_steps, batch_size=batch_size, seq_len=seq_len, lr=0.03,
                                     grad_accum=grad_accum,
                                     out=str(Path(tempfile.gettempdir()) / "k3-train-bench-no-run"), seed=seed,
                                     ep=distributed.ep if distributed else 1).for_new_run()  # defaults filled
        self.out = Path(args.out)  # read only if the loss diverges
        self.dist, self.main = distributed, distributed is None or distributed.is_main
        self.device = torch.device("cpu")
        torch.manual_seed(seed)
        self.model = K3ForCausalLM(K3Config.from_preset(preset, **args.overrides))
        self.config = self.model.config
        if distributed is not None:  # as `Trainer._build`: experts and FSDP2 before the optimisers
            parallelize(self.model, distributed)
        self.optimizers = make_optimizers(self.model, self.config, lr=args.lr, weight_decay=args.weight_decay,
                                          ns_dtype=torch.float32)
        self.balancer = QuantileBalancer(self.model, method=args.balancer)
        self.task = SyntheticText(synthetic_batches(self.config.vocab_size, batch_size, seq_len, seed))
        self.step, self.total_steps, self.history = 0, total_steps, []
        self.mla = mla_layers(self.model)
        self.max_logits = MaxLogitRecorder(self.model)
        attach(self.max_logits, self.model)  # as `Trainer.run`


# ------------------------------------------------------------------------------------------------ timers
class _Mark(torch.autograd.Function):
    """Identity on tensors; its backward stamps the time into `record` (exit marker: start, entry: end)."""

    @staticmethod
    def forward(ctx, record, is_exit, *xs):
        ctx.record, ctx.is_exit = record, is_exit
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        now = time.perf_counter()
        if ctx.is_exit:
            ctx.record["bwd_start"] = now
        else:
            ctx.record["bwd_end"] = max(now, ctx.record.get("bwd_end", now))
        return (None, None, *grads)


class StepProfiler:
    """Forward and backward wall time per component, and the phases of `train_step` (see the module docstring)."""

    def __init__(self, trainer):
        self.trainer, self.records, self.times, self.stamps, self._patches, self._hooks = trainer, [], {}, {}, [], []
        model = trainer.model
        for layer in model.model.layers:
            moe = hasattr(layer, "block_sparse_moe")
            self._wrap(layer.self_attn, "forward", self._timed_call, "KDA" if layer.is_kda else "MLA")
            self._wrap(layer.block_sparse_moe if moe else layer.mlp, "forward", self._timed_call,
                       "MoE" if moe else "dense MLP")
        self._wrap(k3_model, "attn_res_mix", self._timed_call, "AttnRes")
        self._wrap(kda_module, "chunk_kda_by_document", self._timed_call, "KDA core")
        self._wrap(trainer.balancer, "on_routing", self._phase, "QB statistics")
        self._wrap(qk_clip_module, "mla_max_logits", self._phase, "QK-Clip max logits")
        self._wrap(model, "forward", self._phase, "forward")
        self._wrap(trainer_module, "clip_grad_norm_", self._phase, "clip")
        self._wrap(trainer_module, "qk_clip_", self._phase, "QK-Clip rescale")
        self._wrap(trainer.balancer, "step", self._phase, "QB solve + install")
        for opt, name in zip(trainer.optimizers, ("Muon", "AdamW")):
            self._hooks.append(opt.register_step_pre_hook(lambda *a: self._stamp("opt_start")))
            self._hooks.append(opt.register_step_post_hook(
                lambda *a, name=name: self._add(name, time.perf_counter() - self.stamps["opt_start"])))

    # installation
    def _wrap(self, owner, attr, wrapper, name):
        """Replace owner.attr by wrapper(name, owner.attr); `remove` undoes it."""
        had_own = attr in vars(owner)
        self._patches.append((owner, attr, vars(owner).get(attr), had_own))
        setattr(owner, attr, wrapper(name, getattr(owner, attr)))

    def remove(self):
        for owner, attr, old, had_own in reversed(self._patches):
            if had_own:
                setattr(owner, attr, old)
            else:
                delattr(owner, attr)
        for hook in self._hooks:
            hook.remove()

    # bookkeeping
    def _add(self, key, seconds):
        self.times[key] = self.times.get(key, 0.0) + seconds

    def _stamp(self, key):
        self.stamps[key] = time.perf_counter()

    def _phase(self, name, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            end = time.perf_counter()
            self._add(name, end - start)
            self.stamps.setdefault(name + " start", start)  # the first call's (micro-batches: one forward each)
            return out
        return timed

    def _timed_call(self, kind, fn):
        """fn(*args) with forward timing and backward markers on tensor / list-of-tensor args and the output."""
        def timed(*args, **kwargs):
            start = time.perf_counter()
            record = {"kind": kind}
            flat = [a for arg in args for a in (arg if isinstance(arg, list) else [arg])
                    if isinstance(a, torch.Tensor) and a.requires_grad]
            marked = iter(_Mark.apply(record, False, *flat))
            args = [[next(marked) if isinstance(a, torch.Tensor) and a.requires_grad else a for a in arg]
                    if isinstance(arg, list) else next(marked) if isinstance(arg, torch.Tensor) and arg.requires_grad
                    else arg for arg in args]
            (out,) = _Mark.apply(record, True, fn(*args, **kwargs))
            record["fwd"] = time.perf_counter() - start
            self.records.append(record)
            return out
        return timed

    def step(self):
        """One `train_step` with all timers; returns {component: (forward s, backward s)} and the phase times."""
        self.records, self.times, self.stamps = [], {}, {}
        start = time.perf_counter()
        metrics = self.trainer.train_step()
        total = time.perf_counter() - start
        comp = {}
        for r in self.records:
            fwd, bwd = comp.get(r["kind"], (0.0, 0.0))
            comp[r["kind"]] = (fwd + r["fwd"], bwd + r["bwd_end"] - r["bwd_start"])
        # the observers run inside the MoE / MLA forwards: report them on their own
        for kind, observer in (("MoE", "QB statistics"), ("MLA", "QK-Clip max logits")):
            fwd, bwd = comp[kind]
            comp[kind] = (fwd - self.times.get(observer, 0.0), bwd)
        kda_core = comp.pop("KDA core")  # nested inside the KDA window: reported, not summed
        forward = self.times.pop("forward")
        backward = self.stamps["clip start"] - self.stamps["forward start"] - forward  # all micro-batches
        inner_fwd = sum(f for f, _ in comp.values()) + self.times.get("QB statistics", 0.0) \
            + self.times.get("QK-Clip max logits", 0.0)
        comp["rest of fwd/bwd"] = (forward - inner_fwd, backward - sum(b for _, b in comp.values()))
        comp["KDA core"] = kda_core
        for name in ("QK-Clip max logits", "QB statistics"):
            comp[name] = (self.times.pop(name, 0.0), 0.0)
        step_phases = ("clip", "Muon", "AdamW", "QK-Clip rescale", "QB solve + install")
        for name in step_phases:
            comp[name] = (self.times.pop(name), 0.0)
        comp["other (zero_grad, lr, metrics)"] = (
            total - forward - backward - sum(comp[name][0] for name in step_phases), 0.0)
        return comp, total, metrics


# ------------------------------------------------------------------------------------------------ FLOPs, peak
def matmul_peak_gflops(n=PEAK_N, reps=10):
    """Median GFLOP/s of an n×n×n fp32 torch.mm (after one warm-up call)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - start)
    return 2 * n**3 / statistics.median(times) / 1e9


def newton_schulz_flops(muon):
    """FLOPs of one Muon step's NS5 iterations: per m×n block (m ≤ n) and iteration 2m²n + 2m³ + 2m²n."""
    total = 0
    for group in muon.param_groups:
        for W in group["params"]:
            for view in block_views(W.detach(), group["split"], group["split_sizes"]):
                A, B = view.shape[-2:]
                m, n = min(A, B), max(A, B)
                total += group["ns_steps"] * view[..., 0, 0].numel() * (4 * m * m * n + 2 * m**3)
    return total


# ------------------------------------------------------------------------------------------------ benchmark
def load():
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def idle_percent(seconds=2.0):
    """Share of the machine's CPU time that was idle over the next `seconds` (from /proc/stat; None elsewhere)."""
    def sample():
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:9]]
        return values[3] + values[4], sum(values)  # idle + iowait, total
    try:
        idle0, total0 = sample()
        time.sleep(seconds)
        idle1, total1 = sample()
    except OSError:
        return None
    return 100 * (idle1 - idle0) / max(total1 - total0, 1)


def bench_preset(name, accum=1):
    B, T = PRESETS[name]
    warmup, timed, profiled = STEPS[name]
    trainer = SyntheticTrainer(name, B, T, total_steps=warmup + timed + profiled + 10, grad_accum=accum)
    config = trainer.config
    params = count_parameters(trainer.model, config)
    layers = trainer.model.model.layers
    n_layers = {"KDA": sum(l.is_kda for l in layers), "MLA": sum(not l.is_kda for l in layers),
                "MoE": sum(hasattr(l, "block_sparse_moe") for l in layers),
                "dense MLP": sum(hasattr(l, "mlp") for l in layers), "AttnRes": 2 * len(layers)}
    print(f"{name}: {params.total_params / 1e6:.1f} M parameters ({params.activated_params / 1e6:.1f} M activated), "
          f"{n_layers['KDA']} KDA + {n_layers['MLA']} MLA layers, {n_layers['MoE']} MoE + "
          f"{n_layers['dense MLP']} dense FFN; B×T = {B}×{T}, {accum} micro-batch(es) a step; load {load()}",
          flush=True)

    wait = CpuWait()
    peak = matmul_peak_gflops()
    losses = []
    for _ in range(warmup):
        losses.append(trainer.train_step()["loss"])
    seconds = []
    for _ in range(timed):
        metrics = trainer.train_step()
        seconds.append(metrics["seconds"])
        losses.append(metrics["loss"])
    step_s = statistics.median(seconds)
    print(f"  {timed} timed steps: {', '.join(f'{1e3 * s:.0f}' for s in seconds)} ms", flush=True)

    peak = max(peak, matmul_peak_gflops())  # before and after the timed steps: the higher of the two medians

    profiler = StepProfiler(trainer)
    runs = []
    try:
        for _ in range(profiled):
            comp, total, metrics = profiler.step()
            runs.append((comp, total))
            losses.append(metrics["loss"])
    finally:
        profiler.remove()
    prof_total = statistics.median(t for _, t in runs)
    comp = {k: tuple(statistics.median(c[k][i] for c, _ in runs) for i in (0, 1)) for k in runs[0][0]}
    print(f"  {profiled} profiled steps: {', '.join(f'{1e3 * t:.0f}' for _, t in runs)} ms; loss "
          f"{losses[0]:.3f} → {losses[-1]:.3f}; load {load()}; CPU wait {wait}", flush=True)

    tokens = B * T * accum
    fwd_per_token = forward_flops_per_token(config, params, T)
    matmul_per_token = 2 * (params.activated_params - params.activated["norms_attn_res"])
    model_flops = 3 * fwd_per_token * tokens
    ns_flops = newton_schulz_flops(trainer.optimizers[0])
    achieved = model_flops / step_s / 1e9
    throughput = [
        name, f"{B}×{T}" + (f" ×{accum}" if accum > 1 else ""),
        f"{params.total_params / 1e6:.1f} / {params.activated_params / 1e6:.1f}",
        f"{1e3 * step_s:,.0f}", f"{tokens / step_s:,.0f}",
        f"{model_flops / 1e9:,.1f} ({100 * 3 * (fwd_per_token - matmul_per_token) / (3 * fwd_per_token):.0f} %)",
        f"{achieved:.1f}", f"{peak:.1f}", f"{100 * achieved / peak:.1f} %",
        f"{ns_flops / 1e9:,.1f}", f"{(model_flops + ns_flops) / step_s / 1e9:.1f}",
        f"{100 * (model_flops + ns_flops) / step_s / 1e9 / peak:.1f} %",
        f"{kda_padding_factor(config, B, T, (warmup + timed + profiled) * accum):.2f}", str(wait),
    ]

    rows = []
    model_keys = ["KDA", "MLA", "MoE", "dense MLP", "AttnRes", "rest of fwd/bwd"]
    hook_keys = ["QK-Clip max logits", "QB statistics"]
    step_keys = ["clip", "Muon", "AdamW", "QK-Clip rescale", "QB solve + install", "other (zero_grad, lr, metrics)"]
    summed = model_keys + hook_keys + step_keys

    def ms(x):
        return f"{1e3 * x:,.1f}"

    # model FLOPs (fwd + bwd = 3 × fwd) of the components, split as accounting.forward_flops_per_token counts them
    act, n_mla = params.activated, config.layer_types.count("mla")
    mla_attention = n_mla * 2 * config.num_attention_heads * (config.qk_head_dim + config.v_head_dim) * (T + 1) // 2
    kda_core = fwd_per_token - matmul_per_token - mla_attention
    flops = {k: 3 * v * tokens for k, v in {
        "KDA": 2 * act["kda"] + kda_core, "KDA core": kda_core, "MLA": 2 * act["mla"] + mla_attention,
        "MoE": 2 * (act["moe_fixed"] + act["routed_experts"]), "dense MLP": 2 * act["dense_ffn"],
        "rest of fwd/bwd": 2 * act["lm_head"]}.items()}
    flops["Muon"] = ns_flops
    for key in model_keys[:1] + ["KDA core"] + model_keys[1:] + hook_keys + step_keys:
        fwd, bwd = comp[key]
        label = "↳ of which KDA core (`chunk_kda_by_document`)" if key == "KDA core" else key
        rows.append([name, label, n_layers.get(key, n_layers["KDA"] if key == "KDA core" else ""),
                     ms(fwd) if key not in step_keys else "", ms(bwd) if key in model_keys + ["KDA core"] else "",
                     ms(fwd + bwd), f"{100 * (fwd + bwd) / prof_total:.1f} %",
                     f"{flops[key] / 1e9:,.1f}" if key in flops else "",
                     f"{flops[key] / (fwd + bwd) / 1e9:.1f}" if key in flops else ""])
    rows.append([name, "**sum**", "", ms(sum(comp[k][0] for k in model_keys + hook_keys)),
                 ms(sum(comp[k][1] for k in model_keys)), ms(sum(sum(comp[k]) for k in summed)),
                 f"profiled step {1e3 * prof_total:,.0f} ms = {prof_total / step_s:.2f} × clean step", "", ""])

    def share(*keys):
        return sum(sum(comp[k]) for k in keys) / prof_total
    optimiser = ("clip", "Muon", "AdamW", "QK-Clip rescale", "QK-Clip max logits", "QB statistics",
                 "QB solve + install")
    summary = [name] + [f"{100 * share(*keys):.0f} %" for keys in (
        ("KDA",), ("MLA",), ("MoE", "dense MLP"), ("AttnRes",), optimiser,
        ("rest of fwd/bwd", "other (zero_grad, lr, metrics)"), ("KDA core",), ("Muon",))]
    return throughput, rows, summary


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="k3-tiny only")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--presets", nargs="+", choices=list(PRESETS), help="these presets only")
    parser.add_argument("--grad-accum", type=int, default=1, metavar="N",
                        help="micro-batches of B×T per optimiser step, as `k3 train --grad-accum` (default 1)")
    args = parser.parse_args()
    presets = args.presets or (["k3-tiny"] if args.quick else list(PRESETS))
    if args.threads:
        torch.set_num_threads(args.threads)

    start, wait = time.perf_counter(), CpuWait()
    print(f"Machine: {machine()}")
    idle = idle_percent()
    print(f"Allocator: {allocator()}; load average at start: {load()}; CPU idle "
          f"over the 2 s before the start: {'n/a' if idle is None else f'{idle:.0f} %'} (other processes distort "
          f"everything: with 2 threads on 2 busy cores PyTorch's threads wait on each other)")
    print("fp32, random init, synthetic tokens (2–3 packed documents per row); Trainer.train_step with Muon "
          "ns_dtype=float32, QK-Clip, QuantileBalancer (qb)\n", flush=True)
    results = [bench_preset(name, args.grad_accum) for name in presets]
    print()

    print(f"Throughput: median step time of the clean steps; model GFLOP/step = 3·forward_flops_per_token(T)·B·T "
          f"× the micro-batches of a step (B×T ×N) (share of MLA-attention + KDA-core terms in brackets); peak = "
          f"median {PEAK_N}³ fp32 torch.mm (before / after the steps, the higher); NS = Muon's Newton–Schulz FLOPs "
          f"(not model FLOPs); KDA core tokens = rows × the longest row after chunk_kda_by_document re-lays every "
          f"document on chunk boundaries (each padded to a multiple of kda_chunk_size); CPU wait = share of the "
          f"preset's wall time in which some task waited for a core (/proc/pressure/cpu; ≈ 0 % = no competing "
          f"process)")
    print_table(["preset", "B×T", "params total / activated (M)", "step ms", "tokens/s", "model GFLOP/step",
                 "model GFLOP/s", "mm peak GFLOP/s", "MFU", "NS GFLOP/step", "(model + NS) GFLOP/s",
                 "(model + NS) / peak", "KDA core tokens / real tokens", "CPU wait"],
                [r[0] for r in results], "llrrrrrrrrrrrr")
    print("Where the time goes: median over the profiled steps; layers = how many calls per forward; share of "
          "the profiled step; GFLOP = the component's model FLOPs (fwd + bwd; for `rest`: lm_head; for Muon: NS) "
          "and the rate they ran at")
    print_table(["preset", "component", "layers", "fwd ms", "bwd ms", "fwd+bwd ms", "share", "GFLOP", "GFLOP/s"],
                [row for r in results for row in r[1]], "llrrrrrrr")
    print("Summary: share of the step (optimiser = clip + Muon + AdamW + QK-Clip incl. its max-logit recomputation "
          "+ QB incl. its statistics)")
    print_table(["preset", "KDA", "MLA", "MoE + dense MLP", "AttnRes", "optimiser", "rest", "KDA core alone",
                 "Muon alone"], [r[2] for r in results], "lrrrrrrrr")
    print(f"Total runtime: {time.perf_counter() - start:.0f} s; load average at end: {load()}; CPU wait over the "
          f"run: {wait}")


if __name__ == "__main__":
    main()
