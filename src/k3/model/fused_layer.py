"""A whole decoder layer as one compiled call when decoding (`k3.ops.decode.layer_step`, docs/architecture.md §0.6).

After the fused operations of `k3.ops.decode`, most of a one-token step on a CPU is Python between them: the module
calls, the checks of each operation, the dispatch. Here a decoder layer's step — AttnRes mixes, norms, KDA or MLA,
dense FFN or MoE — is one call that reads the layer's tensors by their checkpoint names. It takes the calls the
fused operations take (fp32 or bf16 CPU, at most `decode.MAX_ROWS` sequences of one new token, no autograd) for
the K3 forms, where nothing watches the modules run; every other call runs the modules, which remain the reference.
A bf16 model's layer computes in fp32 inside (bf16 weights read as stored) and rounds its output and cache entries
once to their bf16 dtypes, where its modules round after every operation.
"""
# Shape suffixes (`x_BTD`): the package-wide legend at the top of docs/architecture.md.

from __future__ import annotations

import operator

import torch
from torch import nn

from k3.config import K3Config
from k3.model.cache import K3Cache, KDACache, MLACache, StepContext
from k3.model.kda import KimiDeltaAttention
from k3.model.mla import MLA_LORA_NORM_EPS, GatedMLA
from k3.model.ffn import SiTUMLP
from k3.model.moe import RoutedExperts, StableLatentMoE
from k3.ops import compiled, decode
from k3.ops.kda.gpu import use_fla


class LayerTensors:
    """The parameters and buffers of each of `layers` by their names relative to the layer (`self_attn.q_proj.weight`,
    …), and every module of `container` (the layers, or the list holding them), collected once; `current()` tells
    whether they still hold exactly these (no module, parameter or buffer replaced, added or removed since)."""

    def __init__(self, container: nn.Module, layers: list[nn.Module]):
        self.modules = list(container.modules())
        self.hook_registries = [hooks for m in self.modules for hooks in (m._forward_hooks, m._forward_pre_hooks)]
        self.tensors = [{**dict(layer.named_parameters()), **dict(layer.named_buffers())} for layer in layers]
        registries = [registry for m in self.modules for registry in (m._modules, m._parameters, m._buffers)]
        entries = [(registry, key, value) for registry in registries for key, value in registry.items()]
        self._registries, self._sizes = registries, [len(registry) for registry in registries]
        self._owners, self._keys, self._values = (list(column) for column in zip(*entries))
        self._classes = list(map(type, self.modules))  # a module's class can be reassigned in place
        self._forms: dict[tuple, bool] = {}  # whether every layer is of a form the step implements, by config key

    def hooked(self) -> bool:
        """`compiled.hooked` of the modules, over their hook registries collected once."""
        return compiled.hooked() or any(self.hook_registries)

    def current(self) -> bool:
        """Every registry of the same size holding the same objects, every module of the same class: a few C-level
        passes (this runs every step)."""
        return (list(map(len, self._registries)) == self._sizes
                and all(map(operator.is_, map(dict.get, self._owners, self._keys), self._values))
                and list(map(type, self.modules)) == self._classes)

    def takes(self, config: K3Config, layers: list[nn.Module]) -> bool:
        """`takes_layer` of every layer: the modules' classes are fixed while `current()`, so the answer is kept per
        value of the configuration fields it reads."""
        key = _form_key(config)
        if key not in self._forms:
            self._forms[key] = all(takes_layer(config, layer) for layer in layers)
        return self._forms[key]


def held_tensors(container: nn.Module, layers: list[nn.Module]) -> LayerTensors:
    """The `LayerTensors` kept on `container`, collected again where anything in it has changed since the last call."""
    held = container.__dict__.get("_fused_tensors")
    if held is None or not held.current():
        held = container.__dict__["_fused_tensors"] = LayerTensors(container, layers)
    return held


def _form_key(config: K3Config) -> tuple:
    """The configuration fields `takes_layer` reads."""
    return (config.use_block_attn_res, config.mla_use_nope, config.mla_decode, config.use_latent_moe,
            config.moe_impl, config.num_expert_group, config.topk_group)


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


def _caches(cache: KDACache | MLACache) -> list[torch.Tensor]:
    """The cache tensors a layer step updates in place."""
    return [cache.conv_state_B3WP, cache.recurrent_state_BHKV] if isinstance(cache, KDACache) else [cache.latent_BSL]


def _applies(config: K3Config, cur_BTD: torch.Tensor, bank: list[torch.Tensor], caches: list[torch.Tensor],
             ctx: StepContext | None, held: LayerTensors, layers: list[nn.Module]) -> bool:
    """Whether the compiled step may run these layers: one new token per sequence, a cache, no new padding (left
    padding in the cache is read past: `first_positions`) or packed documents, no training observers, the layers'
    forms (`takes_layer`), no forward hook on any of their modules, KDA
    on the CPU path, contiguous caches, and activations and caches the decode kernel serves (the kernel checks the
    weights itself)."""
    B, T = cur_BTD.shape[:2]
    return (T == 1 and ctx is not None and ctx.valid_BT is None
            and ctx.document_ids_BT is None and not ctx.observers and held.takes(config, layers)
            and not use_fla(config.kda_impl, cur_BTD.device) and not held.hooked()
            and all(c.is_contiguous() for c in caches) and decode.serves(B, cur_BTD, *bank, *caches))


def first_positions(ctx: StepContext) -> torch.Tensor | None:
    """Each sequence's first real cache position where some are left-padded (a batch of sequences of different
    lengths, `StepContext.key_valid_BS`), else None: the MLA step reads each row from there on."""
    return None if ctx.key_valid_BS is None else (~ctx.key_valid_BS).sum(1)


def _run(layer: nn.Module, tensors: dict, opts: dict, cur_BTD: torch.Tensor, bank: list[torch.Tensor],
         caches: list[torch.Tensor], start: int,
         first_B: torch.Tensor | None) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
    """One layer's compiled step, or None where the kernel does not take the layer's tensors (nothing done then)."""
    out_BTD = compiled.load("decode").layer_step(bank, cur_BTD, layer.starts_block, tensors, opts, caches, start,
                                                 first_B)
    if out_BTD is None:
        return None
    return out_BTD, bank + [cur_BTD] if layer.starts_block else bank  # a block's first layer banks its input


def layer_step(layer: nn.Module, cur_BTD: torch.Tensor, bank: list[torch.Tensor], cache: KDACache | MLACache | None,
               ctx: StepContext | None) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
    """`K3DecoderLayer.forward` (same arguments, same (cur, bank)) as one compiled call, or None where it does not
    apply (`_applies`; tensors the kernel does not serve)."""
    if cache is None or cur_BTD.shape[1] != 1:
        return None
    held, caches = held_tensors(layer, [layer]), _caches(cache)
    config = layer.self_attn.config
    if not _applies(config, cur_BTD, bank, caches, ctx, held, [layer]):
        return None
    return _run(layer, held.tensors[0], options(config), cur_BTD, bank, caches, ctx.start, first_positions(ctx))


def stack_step(layers: nn.ModuleList, cur_BTD: torch.Tensor, cache: K3Cache | None,
               ctx: StepContext | None) -> tuple[int, torch.Tensor, list[torch.Tensor]]:
    """The decoder layers of a one-token step, each one compiled call, with the checks of `layer_step` made once for
    the whole stack (≈ 40 µs of Python a layer otherwise): (how many layers ran, cur, bank) — 0 where the stack does
    not apply, fewer than all where a layer's tensors are not served (the caller runs the rest, from that layer)."""
    bank: list[torch.Tensor] = []
    if cache is None or cur_BTD.shape[1] != 1 or len(layers) == 0:
        return 0, cur_BTD, bank
    stack = list(layers)
    held, caches = held_tensors(layers, stack), [_caches(c) for c in cache.layers]
    config = stack[0].self_attn.config
    if not _applies(config, cur_BTD, bank, [c for layer_caches in caches for c in layer_caches], ctx, held, stack):
        return 0, cur_BTD, bank
    opts, first_B = options(config), first_positions(ctx)
    for i, (layer, tensors, layer_caches) in enumerate(zip(stack, held.tensors, caches)):
        stepped = _run(layer, tensors, opts, cur_BTD, bank, layer_caches, ctx.start, first_B)
        if stepped is None:
            return i, cur_BTD, bank
        cur_BTD, bank = stepped
    return len(stack), cur_BTD, bank
