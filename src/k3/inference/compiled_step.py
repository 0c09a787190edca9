"""The compiled decode step: `decode_one_token` runs each decoder layer of a one-token step as one compiled call
(`layer_step` of the decode kernel, `decode_kernel.cpp`; docs/architecture.md §0.6), from outside an untouched
model.

Most of a one-token step on a CPU is Python between small operations: the module calls, the checks of each
operation, the dispatch. Here a decoder layer's step — AttnRes mixes, norms, KDA or MLA, dense FFN or MoE — is one
call that reads the layer's tensors by their checkpoint names. It takes fp32 or bf16 CPU calls of at most
`decode.MAX_ROWS` sequences of one new token, no autograd, for the K3 forms, where nothing watches the modules run;
every other call runs the modules, which remain the reference. A bf16 model's layer computes in fp32 inside (bf16
weights read as stored) and rounds its output and cache entries once to their bf16 dtypes, where its modules round
after every operation.
"""
# Shape suffixes (`x_BTD`): the package-wide legend at the top of docs/architecture.md.

from __future__ import annotations

import operator

import torch
from torch import nn

from k3.config import K3Config
from k3.model.cache import K3Cache, KDACache, MLACache, StepContext
from k3.model.ffn import SiTUMLP
from k3.model.kda import KimiDeltaAttention
from k3.model.mla import MLA_LORA_NORM_EPS, GatedMLA
from k3.model.moe import RoutedExperts, StableLatentMoE
from k3.ops import compiled, decode


class LayerTensors:
    """The parameters and buffers of each of `layers` by their names relative to the layer (`self_attn.q_proj.weight`,
    …), and every module of `container` (the layers, or the list holding them), collected once; `current()` tells
    whether they still hold exactly these (no module, parameter or buffer replaced, added or removed since)."""

    def __init__(self, container: nn.Module, layers: list[nn.Module]):
        self.modules = list(container.modules())
        self.hook_registries = [[hooks for m in layer.modules() for hooks in (m._forward_hooks, m._forward_pre_hooks)]
                                for layer in layers]
        self.tensors = [{**dict(layer.named_parameters()), **dict(layer.named_buffers())} for layer in layers]
        registries = [registry for m in self.modules for registry in (m._modules, m._parameters, m._buffers)]
        entries = [(registry, key, value) for registry in registries for key, value in registry.items()]
        self._registries, self._sizes = registries, [len(registry) for registry in registries]
        self._owners, self._keys, self._values = (list(column) for column in zip(*entries))
        self._classes = list(map(type, self.modules))  # a module's class can be reassigned in place
        # the modules whose runtime choices `takes_layer` reads (plain attributes, which `current()` does not see)
        self._choosers = [m for m in self.modules if isinstance(m, (KimiDeltaAttention, GatedMLA, RoutedExperts))]
        self._forms: dict[tuple, list[bool]] = {}  # whether each layer is of a form the step implements, by `_form_key`

    def served(self, config: K3Config, layers: list[nn.Module]) -> list[bool]:
        """Whether the compiled step may run each layer: of a form it implements (`takes_layer`: the modules' classes
        are fixed while `current()`, so the answer is kept per value of the configuration fields and module choices
        it reads) and no forward hook waiting for one of its modules (global hooks: none)."""
        key = _form_key(config, self._choosers)
        if key not in self._forms:
            self._forms[key] = [takes_layer(config, layer) for layer in layers]
        if compiled.hooked():
            return [False] * len(layers)
        return [takes and not any(hooks) for takes, hooks in zip(self._forms[key], self.hook_registries)]

    def current(self) -> bool:
        """Every registry of the same size holding the same objects, every module of the same class: a few C-level
        passes (this runs every step)."""
        return (list(map(len, self._registries)) == self._sizes
                and all(map(operator.is_, map(dict.get, self._owners, self._keys), self._values))
                and list(map(type, self.modules)) == self._classes)


def held_tensors(container: nn.Module, layers: list[nn.Module]) -> LayerTensors:
    """The `LayerTensors` kept on `container`, collected again where anything in it has changed since the last call."""
    held = container.__dict__.get("_fused_tensors")
    if held is None or not held.current():
        held = container.__dict__["_fused_tensors"] = LayerTensors(container, layers)
    return held


def _form_key(config: K3Config, choosers: list[nn.Module]) -> tuple:
    """The configuration fields and module choices `takes_layer` reads."""
    return (config.use_block_attn_res, config.mla_use_nope, config.use_latent_moe, config.num_expert_group,
            config.topk_group, *(_choice(m) for m in choosers))


def _choice(module: nn.Module):
    """The runtime choice of a KDA layer (its core's impl), an MLA layer (whether a one-token call is absorbed) or a
    layer's routed experts (grouped or loop)."""
    return module.absorbed_max_tokens >= 1 if isinstance(module, GatedMLA) else module.impl


def takes_layer(config: K3Config, layer: nn.Module) -> bool:
    """Whether the layer's form is one the compiled step implements: Block AttnRes; KDA (not forced onto fla's
    kernels), or gated-or-not NoPE MLA in the absorbed form; a dense FFN, or a latent MoE routed without group limits
    by the grouped implementation. The classes must be exactly these: a subclass (expert parallelism's experts, say)
    may compute differently."""
    mixer, ffn = layer.self_attn, layer.block_sparse_moe if hasattr(layer, "block_sparse_moe") else layer.mlp
    return (config.use_block_attn_res
            and ((type(mixer) is KimiDeltaAttention and mixer.impl != "fla")
                 or (type(mixer) is GatedMLA and config.mla_use_nope and mixer.absorbed_max_tokens >= 1))
            and (type(ffn) is SiTUMLP
                 or (type(ffn) is StableLatentMoE and type(ffn.experts) is RoutedExperts and config.use_latent_moe
                     and ffn.experts.impl == "grouped"
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


def _applies(cur_BTD: torch.Tensor, caches: list[torch.Tensor], ctx: StepContext) -> bool:
    """Whether the compiled step may run a call at all: one new token per sequence, no new padding (left padding in
    the cache is read past: `first_positions`) or packed documents, no training observers, contiguous caches, and CPU
    activations and caches the decode kernel serves (the kernel checks the weights itself)."""
    B, T = cur_BTD.shape[:2]
    return (T == 1 and ctx.valid_BT is None and ctx.document_ids_BT is None and not ctx.observers
            and all(c.is_contiguous() for c in caches) and decode.serves(B, cur_BTD, *caches))


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


def decode_one_token(model: nn.Module, input_ids_BT: torch.Tensor, cache: K3Cache) -> torch.Tensor:
    """The logits [B, T, V] of `model(input_ids, cache=cache)` (a `K3ForCausalLM`, or the text model of a
    `K3ForConditionalGeneration`; ids already checked): each decoder layer one compiled call where the step applies
    (`_applies`, `LayerTensors.served`, and the kernel takes the layer's tensors), else its modules; the same caches
    and logits, to fp32 rounding."""
    text_model = getattr(model, "language_model", model)
    backbone = text_model.model
    cur_BTD = backbone.embed_tokens(input_ids_BT)
    ctx = backbone.context(cur_BTD, cache)
    layers, bank = list(backbone.layers), []
    held, caches = held_tensors(backbone.layers, layers), [_caches(c) for c in cache.layers]
    config = text_model.config
    served = held.served(config, layers) if _applies(cur_BTD, [c for cs in caches for c in cs], ctx) else []
    opts, first_B = options(config), first_positions(ctx)
    for i, layer in enumerate(layers):
        stepped = i < len(served) and served[i] and _run(layer, held.tensors[i], opts, cur_BTD, bank, caches[i],
                                                         ctx.start, first_B)
        cur_BTD, bank = stepped or layer(cur_BTD, bank, cache.layers[i], ctx)
    cache.length += input_ids_BT.shape[1]
    return text_model.lm_head(backbone.output(cur_BTD, bank))
