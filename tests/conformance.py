"""The docs/architecture.md §12.2 tiny conformance configuration, shared by the test modules (importable: tests/ is on sys.path)."""

from __future__ import annotations

import torch
from torch import nn

from k3.config import K3Config

# §12.2: pairwise-distinct dims, same layer pattern and mechanisms as K3
TINY_CONFORMANCE = dict(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=8,
    kda_layers=[1, 2, 3, 5, 6, 7],
    full_attn_layers=[4, 8],
    kda_num_heads=3,
    kda_head_dim=16,
    short_conv_kernel_size=4,
    use_full_rank_gate=True,
    gate_lower_bound=-5.0,
    num_attention_heads=3,
    num_key_value_heads=3,
    q_lora_rank=40,
    kv_lora_rank=20,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    mla_use_output_gate=True,
    intermediate_size=96,
    first_k_dense_replace=1,
    num_experts=8,
    num_experts_per_token=2,
    num_shared_experts=2,
    moe_intermediate_size=20,
    routed_expert_hidden_size=48,
    latent_moe_use_norm=True,
    moe_renormalize=True,
    routed_scaling_factor=2.5,
    num_expert_group=1,
    topk_group=1,
    attn_res_block_size=3,
    activation_situ_beta=4.0,
    activation_situ_linear_beta=25.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    initializer_range=0.15,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def build_tiny_config(**overrides) -> K3Config:
    return K3Config(**{**TINY_CONFORMANCE, **overrides})


def ids_for(vocab: int, B: int, T: int, seed: int) -> torch.Tensor:
    """Seeded random token ids [B, T]."""
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


# a MoonViT-V2 + projector with pairwise-distinct dims (width 24, 4 heads × 8, MLP 40, a 6 × 5 position table so
# that swapped h / w fail), feeding the §12.2 text model; `<|media_pad|>` = 250
TINY_VISION = dict(
    vt_hidden_size=24, qkv_hidden_size=32, vt_num_attention_heads=4, vt_intermediate_size=40,
    vt_num_hidden_layers=2, init_pos_emb_height=6, init_pos_emb_width=5, mm_hidden_size=24, text_hidden_size=64,
    media_placeholder_token_id=250,
)
MEDIA_PAD = 250


def build_tiny_vl_config(**vision_overrides) -> K3Config:
    from k3.config import K3VisionConfig, multimodal_top_level

    vision = K3VisionConfig(**{**TINY_VISION, **vision_overrides})
    return build_tiny_config(multimodal=multimodal_top_level(vision, vision.media_placeholder_token_id))


def random_media(grids, seed: int = 0, patch_size: int = 14) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded packed patches [Σ t·h·w, 3, P, P] and grid_thws [n, 3] for the (t, h, w) grids."""
    grid_thws = torch.tensor(grids, dtype=torch.long)
    n = int(grid_thws.prod(dim=1).sum())
    pixels = torch.randn(n, 3, patch_size, patch_size, generator=torch.Generator().manual_seed(seed))
    return pixels, grid_thws


@torch.no_grad()
def embedding_at_initializer_range_(model: nn.Module) -> nn.Module:
    """The §12.2 procedure draws every matrix at N(0, initializer_range²), the constructor the token embedding at
    N(0, 1) (§13.8) from the same random stream: scaling it restores the §12.2 draw exactly."""
    [weight] = [p for n, p in model.named_parameters() if n.endswith("embed_tokens.weight")]
    weight.mul_(model.config.initializer_range)
    return model


@torch.no_grad()
def randomize_parameters(model: nn.Module, seed: int = 0) -> nn.Module:
    """Move every parameter off its symmetric default (§12.2), in place, deterministically.

    RMSNorm gains 1 + 0.2·N, KDA dt_bias 0.5·N and A_log 0.3·N, router bias 0.1·N, AttnRes pseudo-queries
    0.1·N (so every mix is non-trivial: logits s = Σ_c key·γ·w have a std of ≈ 0.8 at hidden 64).
    """
    from k3.model.kda import KimiDeltaAttention
    from k3.model.moe import MoEGate
    from k3.ops.norm import RMSNorm

    gen = torch.Generator().manual_seed(seed)

    def randn_like(t: torch.Tensor) -> torch.Tensor:
        return torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.dtype)

    for name, module in model.named_modules():
        if isinstance(module, RMSNorm):
            module.weight.copy_(1 + 0.2 * randn_like(module.weight))
        elif isinstance(module, KimiDeltaAttention):
            module.dt_bias.copy_(0.5 * randn_like(module.dt_bias))
            module.A_log.copy_(0.3 * randn_like(module.A_log))
        elif isinstance(module, MoEGate):
            module.e_score_correction_bias.copy_(0.1 * randn_like(module.e_score_correction_bias))
        if name.endswith("_res_proj"):
            module.weight.copy_(0.1 * randn_like(module.weight))
    return model


@torch.no_grad()
def spread_weights_(module: nn.Module, std: float = 0.15) -> nn.Module:
    """In place, in parameter order: norm gains (names ending in `norm.weight`) 1 + 0.2·N, every other parameter
    N(0, std²) — no symmetric defaults (§12.2)."""
    for name, p in module.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1 + 0.2 * torch.randn_like(p))
        else:
            p.normal_(0, std)
    return module


def set_runtime(model, kda_impl: str | None = None, moe_impl: str | None = None, mla_decode: str | None = None):
    """Set the runtime choices of every layer of `model` in place and return it: the KDA core's impl, the routed
    experts' impl ("grouped" | "loop"), and the MLA form of cached short calls ("absorbed" | "expanded")."""
    from k3.model.kda import KimiDeltaAttention
    from k3.model.mla import GatedMLA, absorbed_max_tokens
    from k3.model.moe import RoutedExperts

    for module in model.modules():
        if isinstance(module, KimiDeltaAttention) and kda_impl is not None:
            module.impl = kda_impl
        elif isinstance(module, RoutedExperts) and moe_impl is not None:
            module.impl = moe_impl
        elif isinstance(module, GatedMLA) and mla_decode is not None:
            module.absorbed_max_tokens = absorbed_max_tokens(module.config) if mla_decode == "absorbed" else 0
    return model
