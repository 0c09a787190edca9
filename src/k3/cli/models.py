"""The commands about a model's files and shapes: `k3 info`, `k3 diagram`, `k3 plan`, `k3 init`, `k3 export`."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from k3.config import PRESETS, K3Config
from k3.model import K3ForCausalLM
from k3.checkpoint.quantization import with_experts_format
from k3.model.accounting import architecture_report, human, published_comparison
from k3.cli.errors import UsageError


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


def cmd_init(args: argparse.Namespace) -> int:
    """A random checkpoint of a preset's widths: config.json, safetensors and a byte-level tokenizer."""
    from k3.tokenizer import byte_pair_tokenizer

    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not an empty directory")
    overrides = field_overrides(args.override) or {}
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


def assignments(items: list[str] | None, option: str, form: str, parse) -> dict | None:
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


def json_or_text(value: str):
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def field_overrides(items: list[str] | None) -> dict | None:
    """`--override FIELD=VALUE` options as K3Config field overrides (VALUE as JSON, else as a string)."""
    return assignments(items, "--override", "FIELD=VALUE", json_or_text)
