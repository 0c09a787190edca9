"""Parameter, FLOP and cache accounting (docs/architecture.md §2).

Counting convention (§2.2): *total* counts every stored text tensor (parameters and the router's
persistent `e_score_correction_bias`), both vocabulary matrices included; *activated* counts what one token
touches, excluding the input-embedding table and the unselected routed experts.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
from torch import nn

from k3.checkpoint.quantization import with_experts_format
from k3.config import K3Config
from k3.model.k3 import K3DecoderLayer, K3ForCausalLM
from k3.model.multimodal import K3ForConditionalGeneration
from k3.ops.mxfp4 import GROUP_SIZE
from k3.ops.precision import is_fp32_tensor

COMPONENTS = ("embedding", "lm_head", "kda", "mla", "norms_attn_res", "dense_ffn", "moe_fixed", "routed_experts")
VISION_COMPONENTS = ("vision_tower", "mm_projector")  # outside both headline numbers (§2.2)
_LAYER = re.compile(r"model\.layers\.(\d+)\.(\w+)\.")


def component_of(name: str, config: K3Config) -> str:
    """Which accounting component a state-dict entry belongs to (layer type from the schedule, §1.4)."""
    if name.startswith(VISION_COMPONENTS):
        return name.split(".", 1)[0]
    name = name.removeprefix("language_model.")
    if name.startswith("model.embed_tokens."):
        return "embedding"
    if name.startswith("lm_head."):
        return "lm_head"
    m = _LAYER.match(name)
    if m is None:
        return "norms_attn_res"  # model.norm, output_attn_res_*
    layer, sub = int(m.group(1)), m.group(2)
    if sub == "self_attn":
        return "kda" if config.is_kda_layer(layer) else "mla"
    if sub == "mlp":
        return "dense_ffn"
    if sub == "block_sparse_moe":
        return "routed_experts" if ".experts." in name else "moe_fixed"
    return "norms_attn_res"  # per-layer norms and AttnRes pseudo-queries


@dataclass
class ParamCount:
    total: dict[str, int]  # text components (the headline convention of §2.2)
    activated: dict[str, int]
    vision: dict[str, int]  # MoonViT-V2 and the projector, counted apart (0 for a text-only model)

    @property
    def total_params(self) -> int:
        return sum(self.total.values())

    @property
    def activated_params(self) -> int:
        return sum(self.activated.values())


def count_parameters(model: nn.Module, config: K3Config) -> ParamCount:
    """Total and activated counts per component; works on a meta-device model (no memory), text-only
    (`K3ForCausalLM`) or multimodal (`K3ForConditionalGeneration`)."""
    counts = _component_counts(model.state_dict(keep_vars=True).items(), config)
    total = {k: counts[k] for k in COMPONENTS}
    return ParamCount(total, _activated(total, config), {k: counts[k] for k in VISION_COMPONENTS})


def _component_counts(tensors, config: K3Config) -> dict[str, int]:
    """Elements per component of (checkpoint name, tensor) pairs."""
    counts = dict.fromkeys(COMPONENTS + VISION_COMPONENTS, 0)
    for name, tensor in tensors:
        counts[component_of(name, config)] += tensor.numel()
    return counts


def _activated(total: dict[str, int], config: K3Config) -> dict[str, int]:
    """What one token uses of each component's `total`: not the input embedding (a row lookup), top-k of the E
    routed experts, everything else."""
    return {**total, "embedding": 0,
            "routed_experts": total["routed_experts"] * config.num_experts_per_token // config.num_experts}


@dataclass
class CacheSizes:
    """Inference cache/state sizes (§2.4): MLA latent in the activation dtype, KDA state in fp32."""

    mla_numbers_per_token: int  # over all MLA layers
    mla_bytes_per_token: int
    kda_state_bytes_per_sequence: int  # over all KDA layers, fp32
    kda_conv_bytes_per_sequence: int  # short-conv windows, activation dtype

    def parts_at(self, tokens: int) -> dict[str, int]:
        """Cache bytes of one sequence of `tokens` tokens: MLA latent, KDA state, KDA conv windows."""
        return {"mla_latent": self.mla_bytes_per_token * tokens, "kda_state": self.kda_state_bytes_per_sequence,
                "kda_conv": self.kda_conv_bytes_per_sequence}

    def bytes_at(self, tokens: int) -> int:
        """Cache bytes of one sequence of `tokens` tokens."""
        return sum(self.parts_at(tokens).values())


def cache_sizes(config: K3Config, activation_bytes: int = 2) -> CacheSizes:
    n_mla = config.layer_types.count("mla")
    n_kda = config.num_hidden_layers - n_mla
    H, K = config.kda_num_heads, config.kda_head_dim
    per_token = n_mla * (config.kv_lora_rank + config.qk_rope_head_dim)
    conv = n_kda * 3 * H * K * (config.short_conv_kernel_size - 1)
    return CacheSizes(per_token, per_token * activation_bytes, n_kda * H * K * K * 4, conv * activation_bytes)


EXPERT_FORMATS = ("mxfp4", "bf16")
"""How the routed experts are held: the released MXFP4 packing (§11.5) or dense bf16."""


def mxfp4_bytes(shape: tuple[int, ...]) -> int:
    """Bytes of an MXFP4 weight of logical `shape` (§11.5, rows along the last dim): one 4-bit code per weight, two
    per uint8, and one uint8 E8M0 scale per GROUP_SIZE weights of a row (4.25 bits a weight)."""
    if shape[-1] % GROUP_SIZE:
        raise ValueError(f"MXFP4 packs rows of a multiple of {GROUP_SIZE} weights; a routed expert weight of shape "
                         f"{list(shape)} has rows of {shape[-1]}")
    weights = math.prod(shape)
    return weights // 2 + weights // GROUP_SIZE


def weight_bytes(model: nn.Module, config: K3Config, experts: str = "mxfp4") -> dict[str, int]:
    """Bytes of each component's stored tensors (COMPONENTS + VISION_COMPONENTS) with the routed experts in the
    `experts` format (EXPERT_FORMATS), the §0.4 fp32 set in fp32 and every other tensor in bf16."""
    if experts not in EXPERT_FORMATS:
        raise ValueError(f"experts must be one of {', '.join(EXPERT_FORMATS)}, got {experts!r}")
    sizes = dict.fromkeys(COMPONENTS + VISION_COMPONENTS, 0)
    for name, tensor in model.state_dict(keep_vars=True).items():
        component = component_of(name, config)
        if component == "routed_experts" and experts == "mxfp4":
            sizes[component] += mxfp4_bytes(tuple(tensor.shape))
        else:
            sizes[component] += tensor.numel() * (4 if is_fp32_tensor(name) else 2)
    return sizes


def forward_flops_per_token(config: K3Config, params: ParamCount, context: int) -> int:
    """Forward FLOPs of one token at a given context (§2.2): 2 per activated matmul weight, plus MLA
    attention 2·H·(qk + v) per (query, key) pair over the causal prefix, plus the chunked KDA core."""
    matmul = 2 * (params.activated_params - params.activated["norms_attn_res"])
    H, Hk, d, C = config.num_attention_heads, config.kda_num_heads, config.kda_head_dim, config.kda_chunk_size
    n_mla = config.layer_types.count("mla")
    mla = n_mla * 2 * H * (config.qk_head_dim + config.v_head_dim) * (context + 1) // 2
    kda = (config.num_hidden_layers - n_mla) * Hk * (6 * d * d + 3 * C * d + C * C)
    return matmul + mla + kda


PREFILL_PARTS = ("kda", "mla_projections", "mla_attention", "moe", "dense_ffn", "lm_head")


def prefill_flops(config: K3Config, params: ParamCount, tokens: int) -> dict[str, int]:
    """Forward FLOPs of prefilling one sequence of `tokens` tokens, by part (PREFILL_PARTS): KDA (projections and
    the chunked core), MLA projections, MLA attention (2·H·(qk + v) per causal (query, key) pair, T(T+1)/2 pairs
    per layer: the only part that grows faster than T), the MoE (routed experts as activated, shared experts and
    router), the dense FFN of layer 0 and the output head (logits at every position, as training computes them).
    The parts sum to `tokens` × `forward_flops_per_token` up to its rounding of the pairs."""
    a = params.activated
    H, Hk, d, C = config.num_attention_heads, config.kda_num_heads, config.kda_head_dim, config.kda_chunk_size
    n_mla = config.layer_types.count("mla")
    kda_core = (config.num_hidden_layers - n_mla) * Hk * (6 * d * d + 3 * C * d + C * C)
    return {"kda": tokens * (2 * a["kda"] + kda_core), "mla_projections": tokens * 2 * a["mla"],
            "mla_attention": n_mla * 2 * H * (config.qk_head_dim + config.v_head_dim) * tokens * (tokens + 1) // 2,
            "moe": tokens * 2 * (a["routed_experts"] + a["moe_fixed"]), "dense_ffn": tokens * 2 * a["dense_ffn"],
            "lm_head": tokens * 2 * a["lm_head"]}


def human(n: float, unit: str = "") -> str:
    """A count for people: 2.78 T, 104.19 B, 5.05 M; with a `unit`, G for 10⁹ and P for 10¹⁵ (212.23 GFLOP)."""
    scales = ((1e15, " P"),) if unit else ()
    for scale, suffix in (*scales, (1e12, " T"), (1e9, " B" if not unit else " G"), (1e6, " M"), (1e3, " K")):
        if n >= scale:
            return f"{n / scale:.2f}{suffix}{unit}"
    return f"{n:.0f} {unit}".rstrip()


def attn_res_sources(config: K3Config) -> tuple[list[int], int]:
    """How many sources Block AttnRes mixes (§5.3): per layer, the mix before its FFN (the embedding, the completed
    block sums, the current block's partial sum), and the output mix; ([], 0) without Block AttnRes."""
    if not config.use_block_attn_res:
        return [], 0
    banked, per_layer = 0, []
    for i in range(config.num_hidden_layers):
        banked += i % config.attn_res_block_size == 0  # a block starts: the previous partial sum is banked
        per_layer.append(banked + 1)
    return per_layer, banked + 1


CONTEXTS = {"4K": 4096, "128K": 131072, "1M": 1048576}  # the contexts of the cache and FLOP figures
PUBLISHED = {"k3-full": (2.78e12, 104.2e9), "kimi-k2": (1.04e12, 32.6e9)}
"""Total and activated parameters quoted at each model's launch (§2.3), beside the exact counts of the presets."""


def mtp_layer_params(config: K3Config) -> tuple[int, int]:
    """(total, activated) of one DeepSeek-V3-style multi-token-prediction module at `config`'s shapes (§14.1): an
    MoE decoder layer like the last one, a 2D → D projection and three norms. No preset has one; this explains
    quoted totals that include it."""
    with torch.device("meta"):
        layer = K3DecoderLayer(config, config.num_hidden_layers - 1)
    prefix = f"model.layers.{config.num_hidden_layers - 1}."
    counts = _component_counts(((prefix + name, t) for name, t in layer.state_dict(keep_vars=True).items()), config)
    total = {k: counts[k] for k in COMPONENTS}
    extra = 2 * config.hidden_size ** 2 + 3 * config.hidden_size  # the 2D → D projection, three norms
    return sum(total.values()) + extra, sum(_activated(total, config).values()) + extra


def meta_model(config: K3Config) -> nn.Module:
    """`config`'s model on the meta device (shapes only, no memory): text-only or multimodal, its routed experts
    dense whatever form the config declares (so every count and byte size starts from the logical shapes)."""
    config = with_experts_format(config, "dense")
    with torch.device("meta"):
        return K3ForCausalLM(config) if config.vision_config is None else K3ForConditionalGeneration(config)


def architecture_report(config: K3Config, model: nn.Module | None = None) -> dict:
    """Counts, cache sizes and FLOPs of `config` (what `k3 info` prints), computed on its meta-device model
    (`model`, if already built)."""
    model = meta_model(config) if model is None else model
    params = count_parameters(model, config)
    caches = cache_sizes(config)
    types = config.layer_types
    return {
        "layers": config.num_hidden_layers, "kda_layers": types.count("kda"), "mla_layers": types.count("mla"),
        "total_params": params.total_params, "activated_params": params.activated_params,
        "components": {k: {"total": params.total[k], "activated": params.activated[k]} for k in params.total},
        "vision_params": params.vision,
        "mla_cache_numbers_per_token": caches.mla_numbers_per_token,
        "mla_cache_bytes_per_token_bf16": caches.mla_bytes_per_token,
        "kda_state_bytes_per_sequence_fp32": caches.kda_state_bytes_per_sequence,
        "kda_conv_bytes_per_sequence_bf16": caches.kda_conv_bytes_per_sequence,
        "cache_bytes_per_sequence": {k: caches.bytes_at(t) for k, t in CONTEXTS.items()},
        "forward_flops_per_token": {k: forward_flops_per_token(config, params, t) for k, t in CONTEXTS.items()},
    }


def published_comparison(name: str, report: dict) -> dict | None:
    """The launch figures of preset `name` beside its exact counts, with the counts under the other conventions
    (input embedding activated, one MTP layer added) that explain a difference (§14.1); None for other names."""
    if name not in PUBLISHED:
        return None
    config = K3Config.from_preset(name)
    mtp_total, mtp_activated = mtp_layer_params(config)
    embedding = report["components"]["embedding"]["total"]
    total, activated = report["total_params"], report["activated_params"]
    return {"quoted_total": PUBLISHED[name][0], "quoted_activated": PUBLISHED[name][1],
            "total": total, "activated": activated, "activated_with_embedding": activated + embedding,
            "mtp_layer_total": mtp_total, "mtp_layer_activated": mtp_activated,
            "total_with_mtp": total + mtp_total, "activated_with_mtp": activated + mtp_activated}
