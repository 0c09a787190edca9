"""A whole decoder layer as one compiled call when decoding (`k3.ops.decode.layer_step`, docs/architecture.md §0.6).

After the fused operations of `k3.ops.decode`, most of a one-token step on a CPU is Python between them: the module
calls, the checks of each operation, the dispatch. Here a decoder layer's step — AttnRes mixes, norms, KDA or MLA,
dense FFN or MoE — is one call that reads the layer's tensors by their checkpoint names. It takes the calls the
fused operations take (fp32 CPU, at most `compiled.MAX_ROWS` sequences of one new token, no autograd) for the K3
forms, where nothing watches the modules run; every other call runs the modules, which remain the reference.
"""
# Shape suffixes (`x_BTD`): the package-wide legend at the top of docs/architecture.md.

from __future__ import annotations

import operator

import torch
from torch import nn

from k3.config import K3Config
from k3.model.cache import KDACache, MLACache, StepContext
from k3.model.kda import KimiDeltaAttention
from k3.model.mla import MLA_LORA_NORM_EPS, GatedMLA
from k3.model.ffn import SiTUMLP
from k3.model.moe import RoutedExperts, StableLatentMoE
from k3.ops import compiled, decode
from k3.ops.kda.gpu import use_fla


class LayerTensors:
    """A layer's parameters and buffers by their names relative to the layer (`self_attn.q_proj.weight`, …), and its
    modules, collected once; `current()` tells whether the layer still holds exactly these (no module, parameter or
    buffer replaced, added or removed since)."""

    def __init__(self, layer: nn.Module):
        self.modules = list(layer.modules())
        self.hook_registries = [hooks for m in self.modules for hooks in (m._forward_hooks, m._forward_pre_hooks)]
        self.tensors = {**dict(layer.named_parameters()), **dict(layer.named_buffers())}
        registries = [registry for m in self.modules for registry in (m._modules, m._parameters, m._buffers)]
        entries = [(registry, key, value) for registry in registries for key, value in registry.items()]
        self._registries, self._sizes = registries, [len(registry) for registry in registries]
        self._owners, self._keys, self._values = (list(column) for column in zip(*entries))

    def hooked(self) -> bool:
        """`compiled.hooked` of the layer's modules, over their hook registries collected once."""
        return compiled.hooked() or any(self.hook_registries)

    def current(self) -> bool:
        """Every registry of the same size holding the same objects: a few C-level passes (this runs every step)."""
        return (list(map(len, self._registries)) == self._sizes
                and all(map(operator.is_, map(dict.get, self._owners, self._keys), self._values)))


def layer_tensors(layer: nn.Module) -> LayerTensors:
    """The layer's `LayerTensors`, collected again where the layer has changed since the last call."""
    held = layer.__dict__.get("_fused_tensors")
    if held is None or not held.current():
        held = layer.__dict__["_fused_tensors"] = LayerTensors(layer)
    return held


def takes_layer(config: K3Config, layer: nn.Module) -> bool:
    """Whether the layer's form is one the compiled step implements: Block AttnRes; KDA, or gated-or-not NoPE MLA in
    the absorbed form; a dense FFN, or a latent MoE routed without group limits by the grouped implementation. The
    classes must be exactly these: a subclass (expert parallelism's experts, say) may compute differently."""
    mixer, ffn = layer.self_attn, layer.block_sparse_moe if hasattr(layer, "block_sparse_moe") else layer.mlp
    return (config.use_block_attn_res
            and (type(mixer) is KimiDeltaAttention
                 or (type(mixer) is GatedMLA and config.mla_use_nope and config.mla_decode == "absorbed"))
            and (type(ffn) is SiTUMLP
                 or (type(ffn) is StableLatentMoE and type(ffn.experts) is RoutedExperts and config.use_latent_moe
                     and config.moe_impl != "loop"
                     and not (config.num_expert_group > 1 and config.topk_group < config.num_expert_group))))


def options(config: K3Config) -> dict:
    """The configuration numbers a layer step reads (`Options` in decode_kernel.cpp)."""
    return dict(eps=config.rms_norm_eps, lora_eps=MLA_LORA_NORM_EPS, lower_bound=config.gate_lower_bound,
                nope_dim=config.qk_nope_head_dim, v_dim=config.v_head_dim,
                scale=(config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5,
                top_k=config.num_experts_per_token, renormalize=config.moe_renormalize,
                scaling=config.routed_scaling_factor, situ=config.hidden_act != "silu",
                beta1=config.activation_situ_beta, beta2=config.activation_situ_linear_beta or 0.0)


def layer_step(layer: nn.Module, cur_BTD: torch.Tensor, bank: list[torch.Tensor], cache: KDACache | MLACache | None,
               ctx: StepContext | None) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
    """`K3DecoderLayer.forward` (same arguments, same (cur, bank)) as one compiled call, or None where it does not
    apply: more than one new token, no cache, padding, training observers, another form (`takes_layer`), a forward
    hook on any module of the layer, or tensors the decode kernel does not serve."""
    config = layer.self_attn.config
    B, T = cur_BTD.shape[:2]
    if (T != 1 or cache is None or ctx is None or ctx.valid_BT is not None or ctx.key_valid_BS is not None
            or ctx.document_ids_BT is not None or ctx.observers or not takes_layer(config, layer)):
        return None
    kda = isinstance(cache, KDACache)
    if kda and use_fla(config.kda_impl, cur_BTD.device):
        return None
    held = layer_tensors(layer)
    caches = [cache.conv_state_B3WP, cache.recurrent_state_BHKV] if kda else [cache.latent_BSL]
    if held.hooked() or not all(c.is_contiguous() for c in caches) or not decode.serves(B, cur_BTD, *bank, *caches):
        return None
    # the kernel checks the layer's own tensors (fp32, CPU, no tensor subclass) and returns None where one is not
    out_BTD = compiled.load("decode").layer_step(bank, cur_BTD, layer.starts_block, held.tensors, options(config),
                                                 caches, ctx.start)
    if out_BTD is None:
        return None
    return out_BTD, bank + [cur_BTD] if layer.starts_block else bank  # a block's first layer banks its input
