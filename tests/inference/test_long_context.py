"""Long-context chunked prefill followed by decode (spec §3.7, §4.3, §12.3 item 10) on the fp32 k3-tiny preset.

A full uncached forward materialises the [B, H, T, T] MLA scores (CPU SDPA falls back to its math kernel since
the query/key head dim 48 differs from the value head dim 24): 17 GB per tensor at 32K tokens. So the 32K test
checks the decode against a second, differently chunked prefill that swallows the decoded tokens, and against
the multi-token (chunk KDA, expanded MLA) form from a copy of the same cache; the fast test compares a
3000-token chunked prefill + decode against one full forward.
"""

from __future__ import annotations

import copy

import pytest
import torch

from k3.config import K3Config
from k3.model.cache import MLACache
from k3.model import K3ForCausalLM
from conformance import ids_for

pytestmark = pytest.mark.usefixtures("no_grad")

N_DECODE = 4


def k3_tiny(seed: int) -> K3ForCausalLM:
    torch.manual_seed(seed)
    return K3ForCausalLM(K3Config.from_preset("k3-tiny")).eval()


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def run_pieces(model: K3ForCausalLM, ids: torch.Tensor, pieces: list[int], cache=None, keep_from: int = 0):
    """Feed `ids` in consecutive pieces through one cache; returns (logits of positions ≥ keep_from, cache)."""
    assert sum(pieces) == ids.shape[1]
    cache = model.make_cache(ids.shape[0]) if cache is None else cache
    out, pos = [], 0
    for n in pieces:
        logits = model(ids[:, pos:pos + n], cache=cache).logits
        if pos + n > keep_from:
            out.append(logits[:, max(0, keep_from - pos):])
        pos += n
    return torch.cat(out, 1), cache


def test_chunked_prefill_3000_then_decode_equals_full_forward():
    """k3-tiny fp32: 3000-token prefill in odd chunks (capacity 256 → 4096) + decode == full forward ≤ 1e-4."""
    model = k3_tiny(seed=31)
    T = 3000
    ids = ids_for(model.config.vocab_size, 1, T + N_DECODE, seed=31)
    full = model(ids).logits[:, T - 200:]
    logits, cache = run_pieces(model, ids, [1, 999, 1100, 900] + [1] * N_DECODE, keep_from=T - 200)
    assert cache.length == T + N_DECODE and cache.capacity >= T + N_DECODE
    assert max_diff(logits, full) <= 1e-4, max_diff(logits, full)
    assert torch.equal(logits.argmax(-1), full.argmax(-1))


def test_decode_after_32k_chunked_prefill():
    """k3-tiny fp32: decode after a 32768-token chunked prefill == a differently chunked prefill (≤ 1e-4)."""
    model = k3_tiny(seed=32)
    T, chunk = 32768, 2048
    ids = ids_for(model.config.vocab_size, 1, T + N_DECODE, seed=32)
    keep = T - 64
    # A: 16 chunks of 2048, then one-token decode steps (recurrent KDA, absorbed MLA)
    prefill_a, cache = run_pieces(model, ids[:, :T], [chunk] * (T // chunk), keep_from=keep)
    assert cache.length == T and cache.capacity >= T
    fork = copy.deepcopy(cache)
    decode = torch.cat([model(ids[:, t:t + 1], cache=cache).logits for t in range(T, T + N_DECODE)], 1)
    assert cache.length == T + N_DECODE
    assert torch.isfinite(decode).all()
    # the same continuation as one multi-token call (chunk KDA, expanded MLA) from a copy of the cache
    multi = model(ids[:, T:], cache=fork).logits
    assert max_diff(decode, multi) <= 1e-4, max_diff(decode, multi)
    # B: other chunk boundaries (a 1-token piece, unaligned sizes); the decoded tokens ride in the last piece
    pieces_b = [1, 1500] + [2500] * 12 + [T + N_DECODE - 1 - 1500 - 12 * 2500]
    logits_b, cache_b = run_pieces(model, ids, pieces_b, keep_from=keep)
    assert cache_b.length == T + N_DECODE
    assert max_diff(prefill_a, logits_b[:, :T - keep]) <= 1e-4, max_diff(prefill_a, logits_b[:, :T - keep])
    assert max_diff(decode, logits_b[:, T - keep:]) <= 1e-4, max_diff(decode, logits_b[:, T - keep:])
    assert torch.equal(decode.argmax(-1), logits_b[:, T - keep:].argmax(-1))
    for a, b in zip(cache.layers, cache_b.layers):
        if isinstance(a, MLACache):
            assert max_diff(a.latent_BSL[:, :T + N_DECODE], b.latent_BSL[:, :T + N_DECODE]) <= 1e-4
        else:
            assert max_diff(a.recurrent_state_BHKV, b.recurrent_state_BHKV) <= 1e-4
            assert max_diff(a.conv_state_B3WP, b.conv_state_B3WP) <= 1e-5
