"""Presets (`K3Config.from_preset`) and Kimi K2's forms of K3's innovations (docs/architecture.md §1.4, §14)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from k3.config.text import K3Config, k3_full_attn_layers, multimodal_top_level
from k3.config.vision import K3VisionConfig


def k3_structure(num_hidden_layers: int) -> dict[str, Any]:
    """The layer lists of the K3 schedule ([KDA,KDA,KDA,MLA]×n + one final MLA) for any depth."""
    full = k3_full_attn_layers(num_hidden_layers)
    return {
        "num_hidden_layers": num_hidden_layers,
        "full_attn_layers": full,
        "kda_layers": [i for i in range(1, num_hidden_layers + 1) if i not in full],
    }


def mla_structure(num_hidden_layers: int) -> dict[str, Any]:
    """The layer lists of K2's schedule: MLA in every layer."""
    return {"num_hidden_layers": num_hidden_layers, "full_attn_layers": list(range(1, num_hidden_layers + 1)),
            "kda_layers": []}


K2_ARCHITECTURE = ("attention", "attn_res", "latent_moe", "situ")
"""K3's architectural innovations that `k2_form` turns back into Kimi K2's forms (§14)."""


def k2_form(config: K3Config, innovation: str) -> dict[str, Any]:
    """The config fields that replace one K3 innovation of `config` by its K2 form (§14):

    * "attention": MLA with RoPE in every layer, no output gate (instead of 3:1 KDA : gated NoPE MLA);
    * "attn_res": the plain pre-norm residual stream (instead of Block AttnRes);
    * "latent_moe": routed experts at full width, no latent projection, no RMSNorm on their sum;
    * "situ": SwiGLU (instead of SiTU-GLU) in every gated MLP.
    """
    if innovation == "attention":
        return {**mla_structure(config.num_hidden_layers), "mla_use_nope": False, "mla_use_output_gate": False}
    if innovation == "attn_res":
        return {"use_block_attn_res": False}
    if innovation == "latent_moe":
        return {"use_latent_moe": False, "routed_expert_hidden_size": config.hidden_size,
                "latent_moe_use_norm": False}
    if innovation == "situ":
        return {"hidden_act": "silu"}
    raise ValueError(f"unknown K3 innovation {innovation!r}; choose one of {', '.join(K2_ARCHITECTURE)}")


def k2_overrides(config: K3Config, innovations: Sequence[str]) -> dict[str, Any]:
    """The config fields that replace each of `innovations` of `config` by its K2 form (`k2_form`)."""
    overrides: dict[str, Any] = {}
    for innovation in innovations:
        overrides |= k2_form(config, innovation)
    return overrides


_TINY_VISION = K3VisionConfig(
    vt_hidden_size=64, qkv_hidden_size=96, vt_num_attention_heads=4, vt_intermediate_size=128,
    vt_num_hidden_layers=2, init_pos_emb_height=16, init_pos_emb_width=16, mm_hidden_size=64, text_hidden_size=128,
    media_placeholder_token_id=390)

# Every preset carries max_position_embeddings: the field's default, the release's 1,048,576, for the K3 ones (NoPE
# MLA and KDA have no positional limit, and nothing in k3 reads it as one), K2's 131,072 for kimi-k2.
# The small presets chunk KDA by 32 tokens (the knob's default is 64): with head widths of 32 and 64 the compiled
# CPU core runs 32-token chunks 8–12 % faster, and packed documents pad less.
PRESETS: dict[str, dict[str, Any]] = {
    # the released numbers (§1.1, §1.2): text model, MoonViT-V2 and projector
    "k3-full": {"multimodal": multimodal_top_level(K3VisionConfig(), 163605)},
    # same structure, 226,373,896 parameters: 13 layers = [K,K,K,M]x3 + M, AttnRes blocks of 4 (last one partial)
    "k3-small": {
        **k3_structure(13), "vocab_size": 32768, "hidden_size": 512, "num_attention_heads": 8,
        "num_key_value_heads": 8, "q_lora_rank": 192, "kv_lora_rank": 128, "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 32, "v_head_dim": 64, "kda_num_heads": 8, "kda_head_dim": 64,
        "intermediate_size": 2048, "num_experts": 32, "num_experts_per_token": 4, "moe_intermediate_size": 512,
        "routed_expert_hidden_size": 256, "attn_res_block_size": 4, "kda_chunk_size": 32, "bos_token_id": None,
        "eos_token_id": None, "pad_token_id": None,
    },
    # k3-small's width at 8 layers = [K,K,K,M]x2 (K3's 3:1 schedule, last layer MLA) with MLA narrowed to 2 heads of
    # 16 + 8 over a 16 + 8 latent: a prefill's attention grows as T²/2 pairs per MLA layer, and these widths keep the
    # 1,048,576-token prefill within an hour of two CPU cores (docs/long-context.md)
    "k3-long": {
        **k3_structure(8), "vocab_size": 32768, "hidden_size": 512, "num_attention_heads": 2,
        "num_key_value_heads": 2, "q_lora_rank": 192, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8, "v_head_dim": 16, "kda_num_heads": 8, "kda_head_dim": 64,
        "intermediate_size": 2048, "num_experts": 32, "num_experts_per_token": 4, "moe_intermediate_size": 512,
        "routed_expert_hidden_size": 256, "attn_res_block_size": 4, "kda_chunk_size": 32, "bos_token_id": None,
        "eos_token_id": None, "pad_token_id": None,
    },
    # same structure, < 10M parameters; trains on a CPU: 9 layers = [K,K,K,M]x2 + M, blocks of 4 (last partial)
    "k3-tiny": {
        **k3_structure(9), "vocab_size": 4096, "hidden_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 48, "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16, "v_head_dim": 24, "kda_num_heads": 4, "kda_head_dim": 32,
        "intermediate_size": 384, "num_experts": 16, "num_experts_per_token": 4, "moe_intermediate_size": 96,
        "routed_expert_hidden_size": 64, "attn_res_block_size": 4, "kda_chunk_size": 32, "bos_token_id": None,
        "eos_token_id": None, "pad_token_id": None,
    },
    # a vision-language K3 for the CPU shapes-captioning demo: 5 layers = [K,K,K,M] + M, vocab 400 (384 BPE
    # ranks + 16 special slots: <|media_pad|> is 390), MoonViT-V2 with 2 layers of width 64 (4 heads × 24)
    "k3-tiny-vl": {
        **k3_structure(5), "vocab_size": 400, "hidden_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 48, "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16, "v_head_dim": 24, "kda_num_heads": 4, "kda_head_dim": 32,
        "intermediate_size": 384, "num_experts": 8, "num_experts_per_token": 2, "moe_intermediate_size": 96,
        "routed_expert_hidden_size": 64, "attn_res_block_size": 4, "kda_chunk_size": 32, "bos_token_id": None,
        "eos_token_id": None, "pad_token_id": None, "multimodal": multimodal_top_level(_TINY_VISION, 390),
    },
    # Kimi K2's published shapes in K2's forms (§14.1): 61 MLA layers with RoPE, plain residuals, 384 full-width
    # SwiGLU experts top-8 + 1 shared, first layer dense; no multi-token-prediction layer
    "kimi-k2": {
        **mla_structure(61), "vocab_size": 163840, "hidden_size": 7168, "num_attention_heads": 64,
        "num_key_value_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": False, "mla_use_output_gate": False,
        "hidden_act": "silu", "intermediate_size": 18432, "first_k_dense_replace": 1, "num_experts": 384,
        "num_experts_per_token": 8, "num_shared_experts": 1, "moe_intermediate_size": 2048,
        "routed_expert_hidden_size": 7168, "use_latent_moe": False, "latent_moe_use_norm": False,
        "routed_scaling_factor": 2.827, "use_block_attn_res": False, "rms_norm_eps": 1e-6,
        "bos_token_id": 163584, "eos_token_id": 163585, "pad_token_id": None,
        "max_position_embeddings": 131072, "extra": {"model_type": "kimi_k2", "rope_theta": 50000.0},
    },
}
