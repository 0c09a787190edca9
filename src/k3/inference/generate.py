"""Autoregressive text generation with the K3 caches: one prefill call, then one decode call per token.

The prefill runs the whole prompt through the chunked/expanded paths and fills the caches; each later step feeds
one token, so KDA layers take the recurrent decode step (§3.7) and MLA layers attend over the cached latent
(§4.3, §4.4). AttnRes and the MoE are stateless across tokens (App. A). Left-padded prompts are
supported through `attention_mask` (§3.8): the cache remembers which prompt positions are padding, so the
decode steps need no mask.

Sampling (not part of the model): temperature 0 is greedy; otherwise the logits are divided by the
temperature in fp32, filtered by top-k and then top-p (nucleus), and one token is drawn from the softmax.

Shape suffixes (`x_BTD`): the package-wide legend at the top of docs/architecture.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from k3.inference.compiled_step import decode_one_token
from k3.model import K3ForCausalLM, K3ForConditionalGeneration

PREFILL_CHUNK = 2048
"""Prompt positions per prefill call of `k3 generate`: the prefill's working memory (the expanded MLA attention of
a chunk over the context) follows the chunk, not the prompt."""

FIRST_CACHE_TOKENS = 256
"""Generated positions the cache is first sized for beyond the prompt; it grows by doubling on demand, so memory
follows the tokens really generated, not `max_new_tokens`."""


def _check_sampling_args(temperature: float, top_k: int | None, top_p: float | None) -> None:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be an integer >= 1 or None, got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float))
                              or not 0 < top_p <= 1):
        raise ValueError(f"top_p must be a number in (0, 1] or None, got {top_p!r}")


def sample_next_token(logits_BO: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                      top_p: float | None = None, generator: torch.Generator | None = None) -> torch.LongTensor:
    """Pick one token per row of `logits_BO` [B, V]; returns a LongTensor [B].

    `temperature == 0` is greedy (argmax; `top_k`, `top_p` and `generator` are then irrelevant). Otherwise, in
    fp32: divide by `temperature`; keep the `top_k` largest logits (all if None or ≥ V); keep the smallest set
    of most probable remaining tokens whose cumulative probability reaches `top_p` (the most probable token
    always survives); draw from the softmax with `generator` (None: torch's default generator).
    """
    _check_sampling_args(temperature, top_k, top_p)
    if logits_BO.dim() != 2:
        raise ValueError(f"logits must have shape [batch, vocab], got {tuple(logits_BO.shape)}")
    if temperature == 0:
        return logits_BO.argmax(dim=-1)
    logits_BO = logits_BO.float() / temperature
    V = logits_BO.shape[-1]
    if top_k is not None and top_k < V:
        top_Bk = logits_BO.topk(top_k, dim=-1)
        logits_BO = torch.full_like(logits_BO, -math.inf).scatter(-1, top_Bk.indices, top_Bk.values)
    if top_p is not None and top_p < 1:
        sorted_BO, order_BO = logits_BO.sort(dim=-1, descending=True)
        probs_BO = sorted_BO.softmax(dim=-1)
        mass_before_BO = probs_BO.cumsum(dim=-1) - probs_BO  # probability of the strictly more probable tokens
        sorted_BO = sorted_BO.masked_fill(mass_before_BO >= top_p, -math.inf)  # index 0 has 0 before: kept
        logits_BO = torch.empty_like(logits_BO).scatter(-1, order_BO, sorted_BO)
    return torch.multinomial(logits_BO.softmax(dim=-1), 1, generator=generator).squeeze(-1)


def _eos_ids(eos_token_id: int | Sequence[int], vocab_size: int) -> list[int]:
    """`eos_token_id` as a validated, non-empty list of ids in the vocabulary."""
    ids = [eos_token_id] if isinstance(eos_token_id, int) else eos_token_id
    if not isinstance(ids, (list, tuple)) or not ids \
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"eos_token_id must be an int, a non-empty list of ints or None, got {eos_token_id!r}")
    if not all(0 <= i < vocab_size for i in ids):
        raise ValueError(f"eos_token_id {eos_token_id!r} is outside the vocabulary 0..{vocab_size - 1}")
    return list(ids)


def _check_generate_args(model: K3ForCausalLM | K3ForConditionalGeneration, input_ids: torch.Tensor, max_new_tokens: int,
                         attention_mask: torch.Tensor | None, seed: int | None) -> None:
    model.check_input_ids(input_ids)  # tensor, integer dtype, 2-D, ids in the vocabulary
    if input_ids.numel() == 0:
        raise ValueError(f"input_ids must be non-empty [batch, time], got shape {tuple(input_ids.shape)}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"seed must be an integer or None, got {seed!r}")
    if attention_mask is not None:
        if tuple(attention_mask.shape) != tuple(input_ids.shape):
            raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} must equal input_ids shape "
                             f"{tuple(input_ids.shape)}")
        if not bool(attention_mask[:, -1].bool().all()):
            raise ValueError("attention_mask must be left padding with a real last token in every row")


def _stream(streamer: Any, tokens_B: torch.Tensor) -> None:
    if hasattr(streamer, "put"):
        streamer.put(tokens_B)
    else:
        streamer(tokens_B)


@torch.no_grad()
def generate(model: K3ForCausalLM | K3ForConditionalGeneration, input_ids: torch.LongTensor, max_new_tokens: int,
             temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
             eos_token_id: int | Sequence[int] | None = None, attention_mask: torch.Tensor | None = None,
             seed: int | None = None, streamer: Callable[[torch.LongTensor], Any] | Any | None = None,
             pixel_values: torch.Tensor | None = None, grid_thws: torch.Tensor | None = None,
             prefill_chunk: int | None = None, on_prefill: Callable[[int], Any] | None = None,
             cache_dtype: torch.dtype | None = None) -> torch.LongTensor:
    """Continue each prompt of `input_ids` [B, T] by up to `max_new_tokens`; returns [B, T + n], n ≤ max_new_tokens.

    The prompt is prefilled in one call on a fresh cache, then one token per step is decoded with the cache.
    Runs under `torch.no_grad()`; the module's training flag is not touched (K3 has no dropout). The arguments
    are checked once here; the decode steps feed the model ids it produced itself, unchecked.

    * `temperature`, `top_k`, `top_p`: see `sample_next_token` (temperature 0 = greedy).
    * `eos_token_id` (int or list of ints): a row that emits one is finished; its later positions hold the
      (first) eos id as padding. Generation stops as soon as every row is finished. None: never stop early.
    * `attention_mask` [B, T] (1 real, 0 padding): left-padded prompts; each row's last token must be real.
    * `seed`: sample from a local `torch.Generator` seeded with it (same seed, same output; the global RNG is
      untouched). None: torch's default generator.
    * `streamer`: receives each step's new tokens as a LongTensor [B] (eos padding of finished rows included),
      via `streamer.put(tokens)` when it has `put` (then `streamer.end()` once at the end), else `streamer(tokens)`.
    * `pixel_values`, `grid_thws` (a `K3ForConditionalGeneration` only): the prompt's media, encoded in the
      prefill. A multimodal model never samples its media placeholder (no media could follow it).
    * `prefill_chunk`: prefill a text prompt `prefill_chunk` positions per call (KDA states carried, MLA latents
      appended: the same caches and logits as one call, to fp32 rounding), so the prefill's working memory is
      bounded by the chunk, not the prompt. None: one call. A prompt with media is one call.
    * `on_prefill`: called with the number of prompt positions prefilled so far after each prefill call.
    * `cache_dtype`: the MLA latent cache's dtype (fp32 or bf16; None: the model's). A bf16 cache under an fp32
      model halves the bytes each decode step reads over a long context; the logits then follow the rounded latents.
    """
    _check_sampling_args(temperature, top_k, top_p)
    _check_generate_args(model, input_ids, max_new_tokens, attention_mask, seed)
    if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int)
                                      or prefill_chunk < 1):
        raise ValueError(f"prefill_chunk must be an integer >= 1 or None, got {prefill_chunk!r}")
    prefill_inputs, suppress_ids = {}, []
    if isinstance(model, K3ForConditionalGeneration):
        prefill_inputs = {"pixel_values": pixel_values, "grid_thws": grid_thws}
        suppress_ids = [model.media_placeholder_token_id]
    elif pixel_values is not None or grid_thws is not None:
        raise ValueError("pixel_values/grid_thws need a K3ForConditionalGeneration (this is a text-only model)")
    eos = None if eos_token_id is None else _eos_ids(eos_token_id, model.config.vocab_size)
    B, T = input_ids.shape
    device = input_ids.device
    generator = None if seed is None else torch.Generator(device=device).manual_seed(seed)
    eos_tensor = None if eos is None else torch.tensor(eos, device=device)
    suppress = torch.tensor(suppress_ids, dtype=torch.long, device=device)
    finished_B = torch.zeros(B, dtype=torch.bool, device=device)

    new_tokens: list[torch.Tensor] = []
    if max_new_tokens > 0:
        cache = model.make_cache(B, capacity=T + min(max_new_tokens, FIRST_CACHE_TOKENS), cache_dtype=cache_dtype)
        chunk = T if prefill_chunk is None or prefill_inputs else prefill_chunk
        for start in range(0, T, chunk):  # input_ids were checked above
            end = min(start + chunk, T)
            logits_BO = model(input_ids[:, start:end], cache=cache, validate=False, logits_to_keep=1,
                              attention_mask=None if attention_mask is None else attention_mask[:, :end],
                              **prefill_inputs).logits[:, -1]
            if on_prefill is not None:
                on_prefill(end)
        for step in range(max_new_tokens):
            if suppress.numel():
                logits_BO = logits_BO.index_fill(-1, suppress, -math.inf)
            next_B = sample_next_token(logits_BO, temperature, top_k, top_p, generator)
            if eos_tensor is not None:
                next_B = next_B.masked_fill(finished_B, eos[0])
                finished_B |= torch.isin(next_B, eos_tensor)
            new_tokens.append(next_B)
            if streamer is not None:
                _stream(streamer, next_B)
            if step == max_new_tokens - 1 or bool(finished_B.all()):
                break
            # the cache keeps the prompt's padding mask; a new token is always real, so no mask is needed
            logits_BO = decode_one_token(model, next_B[:, None], cache)[:, -1]
    if streamer is not None and hasattr(streamer, "put"):
        streamer.end()
    return torch.cat([input_ids.long(), *(t[:, None] for t in new_tokens)], dim=1)
