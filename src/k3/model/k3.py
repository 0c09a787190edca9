"""The K3 text model: decoder layers with Block AttnRes, `K3Model`, `K3ForCausalLM` (§1.4, §5.3, App. A).

Shape suffixes (`x_BTD`): the package-wide legend at the top of docs/architecture.md.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from k3.config import K3Config
from k3.model.attn_res import attn_res_mix
from k3.model.cache import K3Cache, KDACache, MLACache, StepContext, step_context
from k3.model.ffn import SiTUMLP
from k3.model.kda import KimiDeltaAttention
from k3.model.mla import GatedMLA
from k3.model.moe import MoEGate, RoutedExperts, StableLatentMoE
from k3.model.observer import Observable
from k3.model.sequence import WholeSequence
from k3.model.pretrained import PretrainedMixin
from k3.ops.experts import reset_expert_weight
from k3.ops.loss import IGNORE_INDEX, check_labels, next_token_loss, next_token_targets
from k3.ops.norm import RMSNorm
from k3.ops.matvec import Linear


@dataclass
class CausalLMOutput:
    logits: torch.Tensor  # [B, T, V]
    loss: torch.Tensor | None = None  # mean fp32 next-token cross-entropy over labels != IGNORE_INDEX
    loss_tokens: torch.Tensor | None = None  # how many targets the loss averages (int64 scalar)


class K3DecoderLayer(nn.Module):
    """Decoder layer i: KDA or MLA by the schedule, dense FFN or Stable LatentMoE, AttnRes mixes (§5.3)."""

    def __init__(self, config: K3Config, layer_idx: int):
        super().__init__()
        D, eps = config.hidden_size, config.rms_norm_eps
        self.layer_idx = layer_idx
        self.starts_block = layer_idx % config.attn_res_block_size == 0
        self.is_kda = config.is_kda_layer(layer_idx)
        self.self_attn = KimiDeltaAttention(config) if self.is_kda else GatedMLA(config)
        if config.is_moe_layer(layer_idx):
            self.block_sparse_moe = StableLatentMoE(config)
        else:
            self.mlp = SiTUMLP(config, D, config.intermediate_size)
        self.input_layernorm = RMSNorm(D, eps)
        self.post_attention_layernorm = RMSNorm(D, eps)
        self.use_block_attn_res = config.use_block_attn_res
        if self.use_block_attn_res:
            self.self_attention_res_norm = RMSNorm(D, eps)
            self.self_attention_res_proj = nn.Linear(D, 1, bias=False)
            self.mlp_res_norm = RMSNorm(D, eps)
            self.mlp_res_proj = nn.Linear(D, 1, bias=False)

    def ffn(self, x_BTD: torch.Tensor, ctx: StepContext | None = None) -> torch.Tensor:
        return self.mlp(x_BTD) if hasattr(self, "mlp") else self.block_sparse_moe(x_BTD, ctx)

    def forward(self, cur_BTD: torch.Tensor, bank: list[torch.Tensor], cache: KDACache | MLACache | None = None,
                ctx: StepContext | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One step of §5.3. `cur` is the running partial sum of the current block (the embedding before
        layer 0); `bank` the completed sources [b₀ = embedding, b₁, …]. Returns the new (cur, bank).
        `cache` reaches the sequence mixer only (AttnRes and the FFN are per token); `ctx` also carries the
        call's training observers to the router.

        Without Block AttnRes (K2's form, §14.3) `cur` is the residual stream x and `bank` stays empty:
        x ← x + attn(norm(x)), then x ← x + ffn(norm(x))."""
        if not self.use_block_attn_res:
            x_BTD = cur_BTD + self.self_attn(self.input_layernorm(cur_BTD), cache, ctx)
            return x_BTD + self.ffn(self.post_attention_layernorm(x_BTD), ctx), bank
        prefix = cur_BTD
        h_BTD = attn_res_mix(bank + [prefix], self.self_attention_res_norm, self.self_attention_res_proj) \
            if bank else prefix
        if self.starts_block:  # bank the raw, un-mixed prefix; the new block's partial sum restarts
            bank, prefix = bank + [prefix], None
        a_BTD = self.self_attn(self.input_layernorm(h_BTD), cache, ctx)
        prefix = a_BTD if prefix is None else prefix + a_BTD
        h_BTD = attn_res_mix(bank + [prefix], self.mlp_res_norm, self.mlp_res_proj)
        return prefix + self.ffn(self.post_attention_layernorm(h_BTD), ctx), bank


class K3Model(Observable, nn.Module):
    """Embedding → decoder layers → output AttnRes mix → final norm (module `model`). Training observers
    (`add_observer`, see `k3.model.observer`) are called from its training-mode forwards."""

    def __init__(self, config: K3Config):
        super().__init__()
        D = config.hidden_size
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, D)
        self.layers = nn.ModuleList(K3DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        if config.use_block_attn_res:
            self.output_attn_res_norm = RMSNorm(D, config.rms_norm_eps)
            self.output_attn_res_proj = nn.Linear(D, 1, bias=False)
        self.norm = RMSNorm(D, config.rms_norm_eps)
        self.gradient_checkpointing = False  # recompute each layer's activations in backward (training memory)
        self.sequence = WholeSequence()  # where a call's tokens sit in the sequence (context parallelism: a share)

    def forward(self, input_ids: torch.LongTensor | None, cache: K3Cache | None = None,
                attention_mask: torch.Tensor | None = None, document_ids: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states [B, T, D] after `model.norm`, for the new tokens only when a cache is given.
        `inputs_embeds` [B, T, D] replaces the embedding lookup (media features merged in, §9.9)."""
        cur_BTD = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        ctx = self.context(cur_BTD, cache, attention_mask, document_ids)
        return self.output(*self.run_layers(cur_BTD, cache, ctx))

    def context(self, cur_BTD: torch.Tensor, cache: K3Cache | None, attention_mask: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None) -> StepContext:
        """The call's `StepContext` (checked against the cache; the training observers in training mode)."""
        B, T = cur_BTD.shape[:2]
        ctx = self.sequence.place(step_context(cache, B, T, attention_mask, cur_BTD.device, document_ids), cache, T)
        if self.training:
            ctx.observers = tuple(self.observers)
        return ctx

    def run_layers(self, cur_BTD: torch.Tensor, cache: K3Cache | None,
                   ctx: StepContext) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The decoder layers over the embeddings `cur`; the cache then holds the call's tokens. Returns the last
        layer's (cur, bank)."""
        recompute = self.gradient_checkpointing and cache is None and torch.is_grad_enabled()
        bank: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            if recompute:  # the recomputation in backward must not be observed a second time
                cur_BTD, bank = checkpoint(layer, cur_BTD, bank, None, ctx, use_reentrant=False,
                                           context_fn=lambda: (contextlib.nullcontext(), ctx.muted()))
            else:
                cur_BTD, bank = layer(cur_BTD, bank, None if cache is None else cache.layers[i], ctx)
        if cache is not None:
            cache.length += cur_BTD.shape[1]
        return cur_BTD, bank

    def output(self, cur_BTD: torch.Tensor, bank: list[torch.Tensor]) -> torch.Tensor:
        """The output AttnRes mix over the completed blocks and the last partial sum, then `norm` (K2's form: the
        last layer's output, normed)."""
        if not self.config.use_block_attn_res:
            return self.norm(cur_BTD)
        return self.norm(attn_res_mix(bank + [cur_BTD], self.output_attn_res_norm, self.output_attn_res_proj))


class K3ForCausalLM(PretrainedMixin, nn.Module):
    """K3 text model with an untied `lm_head` and the shifted next-token loss."""

    def __init__(self, config: K3Config):
        super().__init__()
        self.config = config
        self.model = K3Model(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        self.init_weights()

    @classmethod
    def from_config(cls, config: K3Config, dtype: torch.dtype = torch.float32):
        """A randomly initialised model (`init_weights`) whose tensors are allocated once, in `dtype` (the fp32 set
        of §0.4 in fp32, packed experts as uint8): a model near the machine's memory is never built in fp32 first."""
        with torch.device("meta"):
            model = cls(config)
        model.to(dtype).to_empty(device="cpu")
        model.init_weights()
        return model

    @torch.no_grad()
    def init_weights(self) -> None:
        """From-scratch init (§3.9, §4.5, §5.5, §6.7, §13.8): N(0, initializer_range²) for every matrix but the
        token embeddings, which are N(0, 1), norm gains 1, AttnRes pseudo-queries 0, router bias 0, KDA gate/conv
        parameters as in §3.9. A model on the meta device (shapes only: accounting, planning) has no values to
        initialise."""
        if self.lm_head.weight.is_meta:
            return
        std = self.config.initializer_range
        for name, module in self.named_modules():
            if isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=1.0)  # unit scale, like the normalised inputs it stands beside
            elif isinstance(module, (nn.Linear, MoEGate)):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, RoutedExperts):
                for w in (module.w1, module.w2, module.w3):
                    reset_expert_weight(w, std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
            elif isinstance(module, KimiDeltaAttention):
                module.reset_kda_parameters()
            if isinstance(module, MoEGate):
                module.e_score_correction_bias.zero_()
            if name.endswith("_res_proj"):
                nn.init.zeros_(module.weight)

    def check_input_ids(self, input_ids: torch.Tensor) -> None:
        """Reject anything but a [B, T] integer tensor of ids in 0..vocab_size-1, naming the bad id."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"input_ids must be an int64/int32 tensor, got {getattr(input_ids, 'dtype', type(input_ids))}")
        if input_ids.dim() != 2 or 0 in input_ids.shape:
            raise ValueError(f"input_ids must have shape [batch, time] with at least one token, "
                             f"got {tuple(input_ids.shape)}")
        if input_ids.numel():
            lo, hi = int(input_ids.min()), int(input_ids.max())
            vocab = self.config.vocab_size
            if lo < 0 or hi >= vocab:
                bad = lo if lo < 0 else hi
                raise ValueError(f"input_ids contains token id {bad}, outside the vocabulary 0..{vocab - 1} "
                                 f"(vocab_size={vocab})")

    def make_cache(self, batch_size: int, capacity: int = 256, cache_dtype: torch.dtype | None = None) -> K3Cache:
        """An empty cache for `batch_size` sequences (MLA latents preallocated to `capacity`, grown on demand), its
        MLA latents in `cache_dtype` (fp32 or bf16; None: the model's dtype)."""
        weight = self.model.embed_tokens.weight
        return K3Cache(self.config, batch_size, weight.dtype, weight.device, capacity, cache_dtype)

    def forward(self, input_ids: torch.LongTensor | None = None, labels: torch.LongTensor | None = None,
                cache: K3Cache | None = None, attention_mask: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                validate: bool = True, logits_to_keep: int = 0) -> CausalLMOutput:
        """`labels` follow the HF convention: same shape as `input_ids`, shifted inside so position t predicts
        token t+1; IGNORE_INDEX (-100) is ignored. The loss is computed in fp32 (0, with a warning, when no
        label is scored).

        With `cache` (from `make_cache`), the call consumes the new tokens, appends them to the cache and returns
        their logits only. `attention_mask` (1 real, 0 padding; left padding) is [B, past + new] or [B, new].
        `document_ids` [B, T] packs several documents per row: nothing crosses a boundary (KDA state and conv
        window restart, MLA attention stays inside the document, no loss on the next document's first token).
        `inputs_embeds` [B, T, D] may replace `input_ids` (exactly one of the two). `validate=False` skips the
        checks of `input_ids` and `labels` (callers that produced them themselves, e.g. a decode loop).
        `logits_to_keep` N > 0 returns the logits of the last N positions only (a prompt's prefill needs its last)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids and inputs_embeds")
        if logits_to_keep < 0 or (logits_to_keep and labels is not None):
            raise ValueError("logits_to_keep must be 0 (all) or, without labels, a positive count; "
                             f"got {logits_to_keep}")
        if validate:
            self.check_inputs(input_ids, inputs_embeds, labels)
        hidden_BTD = self.model(input_ids, cache, attention_mask, document_ids, inputs_embeds)
        logits_BTO = self.lm_head(hidden_BTD[:, -logits_to_keep:] if logits_to_keep else hidden_BTD)
        loss = loss_tokens = None
        if labels is not None:
            real_BT = None if attention_mask is None else attention_mask[:, -labels.shape[1]:].to(labels.device)
            # the last position predicts nothing: scoring all T positions against targets padded with the ignore
            # index gives the same loss without copying the [B, T−1, V] slice of the logits (nor scattering its
            # gradient back)
            targets_BT = next_token_targets(labels, document_ids, real_BT)
            loss = next_token_loss(logits_BTO, targets_BT)
            loss_tokens = (targets_BT != IGNORE_INDEX).sum()
        return CausalLMOutput(logits=logits_BTO, loss=loss, loss_tokens=loss_tokens)

    def check_inputs(self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None = None,
                     labels: torch.Tensor | None = None) -> None:
        """The public-boundary checks of `forward`: ids in the vocabulary, embeddings [B, T, D], labels of the
        input's shape holding token ids or IGNORE_INDEX."""
        if input_ids is not None:
            self.check_input_ids(input_ids)
        elif inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != self.config.hidden_size or 0 in inputs_embeds.shape:
            raise ValueError(f"inputs_embeds must have shape [batch, time, {self.config.hidden_size}], got "
                             f"{tuple(inputs_embeds.shape)}")
        if labels is not None:
            shape = (input_ids if input_ids is not None else inputs_embeds).shape[:2]
            if labels.shape != shape:
                raise ValueError(f"labels shape {tuple(labels.shape)} must equal the input shape {tuple(shape)}")
            check_labels(labels, self.config.vocab_size)
