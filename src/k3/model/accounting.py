"""Parameter, FLOP and cache accounting (docs/architecture.md §2).

Counting convention (§2.2): *total* counts every stored text tensor (parameters and the router's
persistent `e_score_correction_bias`), both vocabulary matrices included; *activated* counts what one token
touches, excluding the input-embedding table and the unselected routed experts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from k3.config import K3Config

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
    counts = dict.fromkeys(COMPONENTS + VISION_COMPONENTS, 0)
    for name, tensor in model.state_dict(keep_vars=True).items():
        counts[component_of(name, config)] += tensor.numel()
    total = {k: counts[k] for k in COMPONENTS}
    activated = dict(total)
    activated["embedding"] = 0
    activated["routed_experts"] = total["routed_experts"] * config.num_experts_per_token // config.num_experts
    return ParamCount(total, activated, {k: counts[k] for k in VISION_COMPONENTS})


@dataclass
class CacheSizes:
    """Inference cache/state sizes (§2.4): MLA latent in the activation dtype, KDA state in fp32."""

    mla_numbers_per_token: int  # over all MLA layers
    mla_bytes_per_token: int
    kda_state_bytes_per_sequence: int  # over all KDA layers, fp32
    kda_conv_bytes_per_sequence: int  # short-conv windows, activation dtype

    def bytes_at(self, tokens: int) -> int:
        """Cache bytes of one sequence of `tokens` tokens."""
        return self.mla_bytes_per_token * tokens + self.kda_state_bytes_per_sequence + self.kda_conv_bytes_per_sequence


def cache_sizes(config: K3Config, activation_bytes: int = 2) -> CacheSizes:
    n_mla = config.layer_types.count("mla")
    n_kda = config.num_hidden_layers - n_mla
    H, K = config.kda_num_heads, config.kda_head_dim
    per_token = n_mla * (config.kv_lora_rank + config.qk_rope_head_dim)
    conv = n_kda * 3 * H * K * (config.short_conv_kernel_size - 1)
    return CacheSizes(per_token, per_token * activation_bytes, n_kda * H * K * K * 4, conv * activation_bytes)


def forward_flops_per_token(config: K3Config, params: ParamCount, context: int) -> int:
    """Forward FLOPs of one token at a given context (§2.2): 2 per activated matmul weight, plus MLA
    attention 2·H·(qk + v) per (query, key) pair over the causal prefix, plus the chunked KDA core."""
    matmul = 2 * (params.activated_params - params.activated["norms_attn_res"])
    H, Hk, d, C = config.num_attention_heads, config.kda_num_heads, config.kda_head_dim, config.kda_chunk_size
    n_mla = config.layer_types.count("mla")
    mla = n_mla * 2 * H * (config.qk_head_dim + config.v_head_dim) * (context + 1) // 2
    kda = (config.num_hidden_layers - n_mla) * Hk * (6 * d * d + 3 * C * d + C * C)
    return matmul + mla + kda
