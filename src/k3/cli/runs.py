"""The commands that run a model: `k3 generate`, `k3 serve`, `k3 train`, `k3 ablate`, `k3 eval recall`."""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import signal
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from k3.cli.errors import Failure
from k3.cli.models import assignments, field_overrides
from k3.config import K3Config
from k3.fileio import atomic_write, describe_error
from k3.inference import generate
from k3.inference.generate import PREFILL_CHUNK
from k3.model import K3ForCausalLM, K3ForConditionalGeneration
from k3.runtime import huge_page_weights, peak_rss_gib
from k3.tokenizer import K3Tokenizer


CACHE_DTYPE_NAMES = ("bfloat16", "float32")
CACHE_DTYPE_HELP = ("the MLA latent cache's dtype (default: the model's); bfloat16 under an fp32 model halves the "
                    "bytes a decode step reads over a long context")


def cache_dtype(args: argparse.Namespace) -> torch.dtype | None:
    """The torch dtype of `--cache-dtype`, None where it was not given."""
    return None if args.cache_dtype is None else getattr(torch, args.cache_dtype)


class TextStreamer:
    """Prints the decoded continuation of row 0 as tokens arrive (whole characters only: a partial UTF-8
    sequence waits for its next byte); ids in `skip_ids` (the stop tokens) are not printed."""

    def __init__(self, tokenizer, out=None, skip_ids=()):
        self.tokenizer, self.out, self.ids, self.printed = tokenizer, out or sys.stdout, [], 0
        self.skip_ids = set(skip_ids)

    def put(self, tokens_B: torch.Tensor) -> None:
        if int(tokens_B[0]) in self.skip_ids:
            return
        self.ids.append(int(tokens_B[0]))
        text = self.tokenizer.decode(self.ids)
        if not text.endswith("\ufffd"):
            self.out.write(text[self.printed:])
            self.out.flush()
            self.printed = len(text)

    def end(self) -> None:
        self.out.write(self.tokenizer.decode(self.ids)[self.printed:] + "\n")
        self.out.flush()


def cmd_generate(args: argparse.Namespace) -> int:
    if not os.path.isdir(args.checkpoint):
        raise ValueError(f"checkpoint directory {args.checkpoint!r} does not exist")
    if args.prompt_file is not None:
        args.prompt = _read_prompt_file(args.prompt_file)
    if not args.prompt:
        raise ValueError("the prompt is empty")
    tokenizer = K3Tokenizer.load(args.checkpoint)
    multimodal = K3Config.from_json(args.checkpoint).vision_config is not None
    if args.image and not multimodal:
        raise ValueError(f"{args.checkpoint} holds a text-only model (no vision_config); --image needs a "
                         "multimodal checkpoint")
    model_class = K3ForConditionalGeneration if multimodal else K3ForCausalLM
    started = time.perf_counter()
    model = model_class.from_pretrained(args.checkpoint, experts=args.experts, progress=True).eval()
    if sys.stderr.isatty():
        print(f"loaded in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    huge_page_weights(model)  # 2 MiB pages for the weights every token reads (k3.runtime)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} ids but the model's vocab_size is "
                         f"{model.config.vocab_size}")
    media = {}
    if args.image:
        from k3.vision.processor import K3Processor, load_image

        # one-line ValueErrors naming the file (unreadable, truncated, over Pillow's decompression-bomb limit);
        # photos turned upright by their EXIF orientation; an animated GIF/WebP/APNG becomes video chunks
        images = [load_image(path) for path in args.image]
        try:
            processor = K3Processor.load(args.checkpoint, tokenizer)
            text = args.prompt if K3Processor.IMAGE_PLACEHOLDER in args.prompt else \
                K3Processor.IMAGE_PLACEHOLDER * len(images) + args.prompt  # images first unless placed in the prompt
            batch = processor(text, images=images)
        finally:
            for image in images:
                image.close()
        ids, media = batch["input_ids"], {"pixel_values": batch["pixel_values"], "grid_thws": batch["grid_thws"]}
    else:
        ids = torch.tensor([tokenizer.encode(args.prompt)])
    stops = [t for t in (tokenizer.eos_token_id, tokenizer.eod_token_id) if t is not None]
    if args.prompt_file is None:  # a prompt file is not echoed: stdout is the continuation alone
        print(args.prompt, end="", flush=True)
    T, phases = ids.shape[1], PhaseTimer()
    with tqdm(total=T, unit="tok", desc="prefill", file=sys.stderr, leave=False,
              disable=args.prompt_file is None or T <= PREFILL_CHUNK) as bar:
        def prefilled(n: int) -> None:
            bar.update(n - bar.n)
            if n == T:
                phases.mark()
        out = generate(model, ids, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                       top_p=args.top_p, eos_token_id=stops or None, seed=args.seed,
                       streamer=TextStreamer(tokenizer, skip_ids=stops), prefill_chunk=PREFILL_CHUNK,
                       on_prefill=prefilled, cache_dtype=cache_dtype(args), **media)
    if args.prompt_file is not None:
        print(phases.report(T, out.shape[1] - T), file=sys.stderr)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """`k3 serve` in one process, or under torchrun with `--ep N`: rank 0 serves HTTP, every rank holds 1/N of the
    routed experts (k3.parallel.expert_serving)."""
    import torch.distributed as dist

    try:
        from k3.serve.server import follow, listen, load, run, start_state
    except ImportError as e:
        raise ValueError(f"k3 serve needs the serve extra (pip install 'kimi-k3[serve]'): {e}") from None
    from k3.parallel.distributed import init_distributed
    from k3.parallel.expert_serving import ExpertService

    if not os.path.isdir(args.checkpoint):
        raise ValueError(f"checkpoint directory {args.checkpoint!r} does not exist")
    if args.ep > 1 and args.experts == "mxfp4":
        raise ValueError("--ep shards dense routed experts: leave --experts out (dense is the default with --ep)")
    distributed = init_distributed(ep=args.ep)
    try:
        if distributed is not None and distributed.ep != distributed.world_size:
            raise ValueError(f"k3 serve under torchrun serves one endpoint from all {distributed.world_size} "
                             f"processes: give --ep {distributed.world_size}")
        experts_form = "dense" if distributed is not None else args.experts
        ep_mesh = None if distributed is None else distributed.ep_mesh["ep"]
        if distributed is not None and not distributed.is_main:
            return follow(ExpertService(load(args.checkpoint, experts_form).model, ep_mesh))
        sock = listen(args.host, args.port)  # a taken port fails before the model loads
        api_key = args.api_key if args.api_key is not None else os.environ.get("K3_API_KEY") or None
        state, experts = start_state(
            args.checkpoint, args.model_name or os.path.basename(os.path.normpath(args.checkpoint)),
            experts=experts_form, ep_mesh=ep_mesh, api_key=api_key, max_batch=args.max_batch,
            max_queue=args.max_queue, max_context=args.max_context, prefill_chunk=args.prefill_chunk,
            prefill_tokens=args.prefill_tokens, prefix_cache_bytes=args.prefix_cache_mib << 20,
            cache_dtype=cache_dtype(args))
        return run(state, sock, args.grace, experts)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _read_prompt_file(path: str) -> str:
    """A prompt file's text; a missing, unreadable or non-UTF-8 file is a one-line ValueError naming it."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"prompt file {path}: not UTF-8 text (byte {err.start})") from None
    except OSError as err:
        raise ValueError(f"prompt file {path}: {describe_error(err)}") from None


class PhaseTimer:
    """Wall time of a generation's prefill (start to `mark()`) and decode (`mark()` to `report`)."""

    def __init__(self):
        self.start = time.perf_counter()
        self.prefilled = None

    def mark(self) -> None:
        self.prefilled = time.perf_counter()

    def report(self, prompt_tokens: int, new_tokens: int) -> str:
        """One line: each phase's tokens, seconds and tokens/s, and the process's peak resident memory."""
        end = time.perf_counter()
        prefilled = self.prefilled or end
        phases = [("prefill", prompt_tokens, prefilled - self.start), ("decode", new_tokens, end - prefilled)]
        parts = [f"{name} {n:,} tokens in {s:.2f} s ({n / s if s > 0 else 0:,.1f} tok/s)" for name, n, s in phases]
        return "; ".join(parts) + f"; peak RSS {peak_rss_gib():.2f} GiB"


def _lr_scale(items: list[str] | None) -> dict | None:
    """`--lr-scale GROUP=X` options as {group: multiplier}."""
    return assignments(items, "--lr-scale", "GROUP=NUMBER", float)


def cmd_train(args: argparse.Namespace) -> int:
    """`k3 train`, on one process or (under torchrun) on every rank of the job; rank 0 reports."""
    import torch.distributed as dist

    from k3.parallel.distributed import init_distributed
    from k3.train.corpus import CorpusUnavailable
    from k3.train.trainer import TrainArgs, TrainingDiverged, train

    options = {k: v for k, v in vars(args).items() if k in TrainArgs.__dataclass_fields__ and v is not None}
    options["overrides"] = field_overrides(args.override)
    options["lr_scale"] = _lr_scale(args.lr_scale)
    train_args = TrainArgs(**options)
    distributed = init_distributed(train_args.ep, train_args.cp)
    try:
        if distributed is not None and distributed.is_main:
            print(distributed.describe(), flush=True)
        summary = train(train_args, distributed)
    except (TrainingDiverged, CorpusUnavailable) as e:
        raise Failure(str(e)) from e
    finally:
        if dist.is_initialized():
            gc.collect()  # free the run's objects (reference cycles too) while the groups and the interpreter live
            dist.destroy_process_group()
    if distributed is not None and not distributed.is_main:
        return 0
    baselines = ", ".join(f"{label} {value:.3f}" for label, value in summary["reference_losses"].items())
    reference = f" (baselines: {baselines})" if baselines else ""
    scored = f" on {summary['val_tokens']:,} held-out tokens" if summary.get("val_tokens") else ""
    print(f"validation loss {summary['initial_val_loss']:.3f} -> {summary['final_val_loss']:.3f} nats/token"
          f"{scored}{reference} after {summary['step']} steps")
    if summary["caption_accuracy"] is not None:
        print(caption_accuracy_line(summary["caption_accuracy"], summary["eval_images"], summary["chance_accuracy"]))
    print(f"checkpoint: {summary['checkpoint']}")
    if summary["model_dir"]:
        print(f"model: {summary['model_dir']} (k3 generate {summary['model_dir']} --prompt ...)")
    print(f"plots: {os.path.join(args.out, 'loss.png')}, expert_load.png, attn_res.png; metrics.jsonl")
    if summary["model_dir"] and summary["task"] == "shapes":
        print(f"caption an image: k3 generate {summary['model_dir']} --image FILE --prompt 'caption:'")
    stopped_by = summary["stopped_by"]
    if stopped_by:
        pause = (f"stopped by {stopped_by} after step {summary['step']} of {summary['total_steps']}, checkpoint "
                 f"saved; continue with: k3 train --resume --out {args.out}")
        if stopped_by.startswith("SIG"):  # schedulers and shells see the signal's exit status, 128 + its number
            print(f"k3 train: {pause}", file=sys.stderr)
            return 128 + signal.Signals[stopped_by].value
        print(pause)
    return 0


def caption_accuracy_line(accuracy: float, images: int, chance: float) -> str:
    """The shapes task's result with its binomial standard error: with 128 held-out images a reading near 40 %
    is uncertain by about ±4 points, so the number is never shown bare."""
    error = math.sqrt(accuracy * (1 - accuracy) / images)
    return (f"caption exact match on {images} held-out images: {100 * accuracy:.1f} % ± {100 * error:.1f} "
            f"(one standard error; chance {100 * chance:.2f} %)")


def cmd_ablate(args: argparse.Namespace) -> int:
    """`k3 ablate`: K3, K2-style and K3-minus-one-innovation at equal training FLOPs (docs/architecture.md §14.5)."""
    from k3.train.ablate import AblationArgs, ablate, describe
    from k3.train.corpus import CorpusUnavailable
    from k3.train.trainer import TrainingDiverged

    options = {k: v for k, v in vars(args).items() if k in AblationArgs.__dataclass_fields__ and v is not None}
    if "variants" in options:
        options["variants"] = tuple(v.strip() for v in options["variants"].split(",") if v.strip())
    options["overrides"] = field_overrides(args.override)
    try:
        state = ablate(AblationArgs(**options))
    except (TrainingDiverged, CorpusUnavailable) as e:
        raise Failure(str(e)) from e
    if state["stopped_by"]:
        print(f"k3 ablate: stopped by {state['stopped_by']}, the run's checkpoint saved; continue with the same "
              f"command (k3 ablate --out {args.out} ...)", file=sys.stderr)
        return 128 + signal.Signals[state["stopped_by"]].value if state["stopped_by"].startswith("SIG") else 0
    print(describe(state, args.out))
    return 0


def cmd_eval_recall(args: argparse.Namespace) -> int:
    """`k3 eval recall`: greedy pass-key recall of each model by context length and needle depth; a table on
    stdout, `recall.json` and `recall.png` in --out. Cells already in --out's recall.json for the same model, seed
    and sample count are kept, so an interrupted evaluation continues and a later call adds lengths (or models)
    to the same plot."""
    from k3.train import plots
    from k3.train.recall import (cells_of, evaluate_recall, merged_cells, parse_depths, parse_lengths,
                                 read_recall_report, recall_report, run_of)

    lengths, depths = parse_lengths(args.lengths), parse_depths(args.depths)
    for model_dir in args.models:
        if not os.path.isdir(model_dir):
            raise ValueError(f"model directory {model_dir!r} does not exist")
    out = Path(args.out)
    report = read_recall_report(out / "recall.json")
    out.mkdir(parents=True, exist_ok=True)
    for model_dir in args.models:
        label, train_length = run_of(model_dir)
        model = K3ForCausalLM.from_pretrained(model_dir).eval()
        entry = report.get(label)
        same = (entry is not None and os.path.realpath(entry["model"]) == os.path.realpath(model_dir)
                and entry["seed"] == args.seed)
        earlier = cells_of(entry) if same else []

        measured = []

        def show(cell, label=label, model=model, model_dir=model_dir, train_length=train_length,
                 earlier=earlier, measured=measured):
            print(f"{label:<16} {cell.length:>10,} tokens  depth {cell.depth:.2f}  {cell.hits:>3}/{cell.samples}  "
                  f"({cell.seconds:,.1f} s)", flush=True)
            measured.append(cell)  # written after each cell: a stopped evaluation loses at most the cell under way
            report[label] = recall_report(model.config, model_dir, train_length, args.seed,
                                          merged_cells(earlier, measured))
            atomic_write(out / "recall.json", json.dumps(report, indent=2) + "\n")

        cells = evaluate_recall(model, lengths, depths, args.samples, args.seed, on_cell=show, known=earlier)
        kept = sum(any(c is e for e in earlier) for c in cells)
        if kept:
            print(f"{label:<16} {kept} cells kept from {out / 'recall.json'}")
        report[label] = recall_report(model.config, model_dir, train_length, args.seed, merged_cells(earlier, cells))
        atomic_write(out / "recall.json", json.dumps(report, indent=2) + "\n")
        del model
    train_lengths = {r["train_length"] for r in report.values()}
    plots.plot_recall({label: cells_of(r) for label, r in report.items()}, out / "recall.png",
                      train_lengths.pop() if len(train_lengths) == 1 else None)
    print(f"wrote {out / 'recall.json'} and {out / 'recall.png'}")
    return 0


# ---------------------------------------------------------------------------------------------- failures
