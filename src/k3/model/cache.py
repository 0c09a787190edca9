"""Inference caches (§2.4, §3.7, §4.3, §5.6).

KDA layers keep a fixed-size state per sequence: the fp32 recurrent state S [B,H,K,V] and the last W−1
projected, pre-conv inputs of q, k and v. MLA layers keep only the compressed latent [ĉ ‖ k_pe]
(kv_lora_rank + qk_rope_head_dim numbers per token, 576 at full size) in the cache dtype: the activation dtype, or
bf16 under an fp32 model (half the bytes a long context reads per decode step; the layers read the rounded
latents). AttnRes and the MoE need no cross-token state. Positions are explicit: `K3Cache.length` tokens have been
consumed and the next call writes at that position; `key_mask` marks which cached positions are real tokens (left
padding).

Shape suffixes (`x_BTD`): the package-wide legend at the top of docs/architecture.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from k3.config import K3Config
from k3.model.observer import ForwardObserver
from k3.model.sequence import WholeSequence


PAGE_TOKENS = 2048  # the cache's unit of growth (positions)
CACHE_DTYPES = (torch.float32, torch.bfloat16)  # what the MLA latents may be stored in


def check_cache_dtype(cache_dtype: torch.dtype | None) -> torch.dtype | None:
    """`cache_dtype` where the MLA latents can be stored in it (or it is None: the model's dtype), else a ValueError."""
    if cache_dtype is not None and cache_dtype not in CACHE_DTYPES:
        raise ValueError(f"the MLA latent cache is float32 or bfloat16, got {cache_dtype}")
    return cache_dtype


@dataclass
class KDACache:
    conv_state_B3WP: torch.Tensor  # last W−1 projected inputs of the q, k, v streams (activation dtype)
    recurrent_state_BHKV: torch.Tensor  # S, key-major, fp32


@dataclass
class MLACache:
    latent_BSL: torch.Tensor  # [ĉ ‖ k_pe] per position, allocated to the cache capacity


class K3Cache:
    """Per-layer caches of one batch of sequences, with explicit positions (gpt-fast style).

    MLA latents and `key_mask` are allocated for `capacity` positions and grow in pages (`reserve`) when a call
    needs more. Make one with `K3ForCausalLM.make_cache(batch_size)`.
    """

    # positions [0, real_upto) were found all real (no padding) by an earlier step; they are never rewritten, so a
    # step checks only the key mask beyond them (every cache, however built, starts from 0)
    real_upto = 0

    def __init__(self, config: K3Config, batch_size: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 capacity: int = 256, latent_dtype: torch.dtype | None = None):
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        latent_dtype = dtype if check_cache_dtype(latent_dtype) is None else latent_dtype
        H, K, W = config.kda_num_heads, config.kda_head_dim, config.short_conv_kernel_size
        L = config.kv_lora_rank + config.qk_rope_head_dim
        self.batch_size, self.length = batch_size, 0
        self.key_mask_BS = torch.zeros(batch_size, capacity, dtype=torch.bool, device=device)
        self.layers: list[KDACache | MLACache] = [
            KDACache(torch.zeros(batch_size, 3, W - 1, H * K, dtype=dtype, device=device),
                     torch.zeros(batch_size, H, K, K, dtype=torch.float32, device=device))
            if config.is_kda_layer(i) else
            MLACache(torch.zeros(batch_size, capacity, L, dtype=latent_dtype, device=device))
            for i in range(config.num_hidden_layers)
        ]

    @property
    def capacity(self) -> int:
        return self.key_mask_BS.shape[1]

    def reserve(self, length: int) -> None:
        """Make room for `length` positions in total: the capacity grows in whole pages of PAGE_TOKENS positions,
        by at least an eighth of what it holds (so appends stay amortised O(1) while at most an eighth plus a page
        is held beyond the text: a 1M-token cache never doubles to 2M)."""
        if length <= self.capacity:
            return
        wanted = max(length, self.capacity + self.capacity // 8)
        new = -(-wanted // PAGE_TOKENS) * PAGE_TOKENS
        self.key_mask_BS = _grow(self.key_mask_BS, new)
        for layer in self.layers:
            if isinstance(layer, MLACache):
                layer.latent_BSL = _grow(layer.latent_BSL, new)

    def nbytes(self) -> int:
        """Bytes held for the consumed positions (MLA latents up to `length`, KDA states, conv windows)."""
        total = 0
        for layer in self.layers:
            if isinstance(layer, MLACache):
                total += layer.latent_BSL[:, : self.length].nbytes
            else:
                total += layer.conv_state_B3WP.nbytes + layer.recurrent_state_BHKV.nbytes
        return total


    def rows(self, index: Sequence[int]) -> K3Cache:
        """A new cache of the rows `index` (in that order), the positions that are padding in all of them dropped
        from the left. Exact only for NoPE MLA (K3): the kept rows' positions move, their keys do not change."""
        index_B = torch.tensor(list(index), dtype=torch.long, device=self.key_mask_BS.device)
        real_S = self.key_mask_BS[index_B, : self.length].any(dim=0)
        first = int(real_S.to(torch.int8).argmax()) if bool(real_S.any()) else self.length
        return self._build(len(index), self.length - first, lambda x: x[index_B, first: self.length],
                           lambda x: x[index_B])

    @classmethod
    def join(cls, caches: Sequence[K3Cache]) -> K3Cache:
        """The rows of `caches` as one batch, each cache's positions moved to end at the longest one's length (the
        positions before them are padding). Exact only for NoPE MLA (K3), where a key's position is not part of it."""
        if not caches:
            raise ValueError("join needs at least one cache")
        length = max(c.length for c in caches)
        joined = caches[0]._build(sum(c.batch_size for c in caches), length)
        row = 0
        for cache in caches:
            rows, offset = slice(row, row + cache.batch_size), length - cache.length
            joined.key_mask_BS[rows, offset:length] = cache.key_mask_BS[:, : cache.length]
            for mine, theirs in zip(joined.layers, cache.layers):
                if isinstance(mine, MLACache):
                    mine.latent_BSL[rows, offset:length] = theirs.latent_BSL[:, : cache.length]
                else:
                    mine.conv_state_B3WP[rows] = theirs.conv_state_B3WP
                    mine.recurrent_state_BHKV[rows] = theirs.recurrent_state_BHKV
            row += cache.batch_size
        return joined

    def clone(self) -> K3Cache:
        """An independent copy of the consumed positions and states (a prefix snapshot)."""
        return self._build(self.batch_size, self.length, lambda x: x[:, : self.length], lambda x: x.clone())

    def snapshot(self) -> K3Cache:
        """The state after the consumed positions, for a prefix cache: the KDA states copied, the mask and the MLA
        latents up to `length` shared with this cache (views: positions below `length` are never written again, and
        `reserve` moves a growing cache to new storage). Read it through `clone`; never write to it."""
        new = K3Cache.__new__(K3Cache)
        new.batch_size, new.length = self.batch_size, self.length
        new.key_mask_BS = self.key_mask_BS[:, : self.length]
        new.layers = [MLACache(layer.latent_BSL[:, : self.length]) if isinstance(layer, MLACache) else
                      KDACache(layer.conv_state_B3WP.clone(), layer.recurrent_state_BHKV.clone())
                      for layer in self.layers]
        return new

    def _build(self, batch_size: int, length: int, positions=None, states=None) -> K3Cache:
        """A cache shaped like this one with `batch_size` rows, `length` consumed positions and whole pages of
        capacity. `positions(x)` gives the first `length` positions of the mask and of each latent, `states(x)` each
        KDA state (None: zeros)."""
        capacity = max(PAGE_TOKENS, -(-length // PAGE_TOKENS) * PAGE_TOKENS)

        def along_positions(x: torch.Tensor) -> torch.Tensor:
            out = x.new_zeros(batch_size, capacity, *x.shape[2:])
            if positions is not None:
                out[:, :length] = positions(x)
            return out

        def state(x: torch.Tensor) -> torch.Tensor:
            return x.new_zeros(batch_size, *x.shape[1:]) if states is None else states(x)

        new = K3Cache.__new__(K3Cache)
        new.batch_size, new.length = batch_size, length
        new.key_mask_BS = along_positions(self.key_mask_BS)
        new.layers = [MLACache(along_positions(layer.latent_BSL)) if isinstance(layer, MLACache) else
                      KDACache(state(layer.conv_state_B3WP), state(layer.recurrent_state_BHKV))
                      for layer in self.layers]
        return new


def _grow(x: torch.Tensor, capacity: int) -> torch.Tensor:
    grown = x.new_zeros(x.shape[0], capacity, *x.shape[2:])
    grown[:, : x.shape[1]] = x
    return grown


@dataclass
class StepContext:
    """What the sequence mixers need to know about a call besides its hidden states.

    `start` is the position of the first new token; `valid_BT` marks the real (non-padding) new tokens (None:
    all real); `key_valid_BS` marks the real tokens among all `start + T` positions (None: all real);
    `document_ids_BT` marks the documents of packed rows (None: one sequence per row); `observers` are the
    training observers of this forward (`k3.model.observer`; empty: nobody is watching); `sequence` says where the
    tokens sit in their sequence (`k3.model.sequence`: the whole of it, or a context-parallel rank's share).
    """

    start: int = 0
    valid_BT: torch.Tensor | None = None
    key_valid_BS: torch.Tensor | None = None
    document_ids_BT: torch.Tensor | None = None
    observers: tuple[ForwardObserver, ...] = ()
    sequence: WholeSequence = field(default_factory=WholeSequence)

    @contextlib.contextmanager
    def muted(self):
        """No observer is called inside (activation checkpointing's recomputation of a layer's forward)."""
        observers, self.observers = self.observers, ()
        try:
            yield
        finally:
            self.observers = observers


def step_context(cache: K3Cache | None, B: int, T: int, attention_mask: torch.Tensor | None,
                 device: torch.device, document_ids: torch.Tensor | None = None) -> StepContext:
    """Validate a call's cache, `attention_mask` and `document_ids`; record the new tokens in the cache.

    `attention_mask` (1 = real token, 0 = padding) covers either the past and the new tokens [B, length + T]
    (Hugging Face convention) or only the new ones [B, T]. Padding must be on the left: once a sequence has a
    real token, all its later tokens are real. `document_ids` [B, T] (packed training rows: non-decreasing
    integers, equal = same document) cannot be combined with a cache or a mask.
    """
    if document_ids is not None:
        if cache is not None or attention_mask is not None:
            raise ValueError("document_ids (packed rows) cannot be combined with a cache or an attention_mask")
        if tuple(document_ids.shape) != (B, T) or document_ids.is_floating_point():
            raise ValueError(f"document_ids must be an integer tensor of shape {[B, T]}, got "
                             f"{document_ids.dtype} {tuple(document_ids.shape)}")
        if (document_ids[:, 1:] < document_ids[:, :-1]).any():
            raise ValueError("document_ids must be non-decreasing along each row (contiguous documents)")
        return StepContext(document_ids_BT=document_ids.to(device))
    start = 0 if cache is None else cache.length
    if cache is not None and cache.batch_size != B:
        raise ValueError(f"input batch size {B} does not match the cache's batch size {cache.batch_size}")
    valid_BT = None
    if attention_mask is not None:
        if attention_mask.dtype != torch.bool and not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
            raise ValueError("attention_mask must hold only 0 (padding) and 1 (token), got the values "
                             f"{attention_mask.unique()[:8].tolist()}")
        mask = attention_mask.to(device=device, dtype=torch.bool)
        if tuple(mask.shape) == (B, start + T):
            past_BS, valid_BT = mask[:, :start], mask[:, start:]
            if cache is not None and not torch.equal(past_BS, cache.key_mask_BS[:, :start]):
                raise ValueError("attention_mask disagrees with the cache about which past tokens are padding")
        elif tuple(mask.shape) == (B, T):
            valid_BT = mask
        else:
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, expected [B, past + new] = "
                             f"{[B, start + T]} or [B, new] = {[B, T]}")
        history = valid_BT if cache is None else torch.cat([cache.key_mask_BS[:, :start], valid_BT], dim=1)
        if (history[:, 1:].int() < history[:, :-1].int()).any():
            raise ValueError("attention_mask must be left padding: a 0 after a 1 in the same row")
    if cache is None:
        key_valid_BS = None if valid_BT is None or bool(valid_BT.all()) else valid_BT
    else:
        cache.reserve(start + T)
        cache.key_mask_BS[:, start: start + T] = True if valid_BT is None else valid_BT
        # positions below `real_upto` were found all real before and are never rewritten: check only the rest, so a
        # long cache without padding costs no pass over its mask per step
        if bool(cache.key_mask_BS[:, cache.real_upto: start + T].all()):
            cache.real_upto, key_valid_BS = start + T, None
        else:
            key_valid_BS = cache.key_mask_BS[:, : start + T]
    if valid_BT is not None and bool(valid_BT.all()):
        valid_BT = None
    return StepContext(start, valid_BT, key_valid_BS)
