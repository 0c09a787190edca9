"""Long-context chunked prefill followed by decode (docs/architecture.md §3.7, §4.3, §12.3 item 10) on the fp32 k3-tiny preset.

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
from routing import (K3_TINY_STATE_TOL_AFTER, K3_TINY_TOL_AFTER, K3_TINY_WINDOW, assert_close_except_flips,
                     record_routing, routing_diff)

pytestmark = pytest.mark.usefixtures("no_grad")

N_DECODE = 4
# how far and how much a routing flip at an fp32 near tie legitimately moves k3-tiny (measured: tests/routing.py)
FLIP_WINDOW, FLIP_TOL, FLIP_STATE_TOL = K3_TINY_WINDOW, K3_TINY_TOL_AFTER, K3_TINY_STATE_TOL_AFTER


def k3_tiny(seed: int) -> K3ForCausalLM:
    torch.manual_seed(seed)
    return K3ForCausalLM(K3Config.from_preset("k3-tiny")).eval()


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
    """k3-tiny fp32: 3000-token prefill in odd chunks (capacity 256 → 4096) + decode == full forward ≤ 1e-4,
    except for routing flips at near ties (tests/routing.py; this data has 6 decisions with a margin < 1e-6)."""
    model = k3_tiny(seed=31)
    T = 3000
    ids = ids_for(model.config.vocab_size, 1, T + N_DECODE, seed=31)
    with record_routing(model) as rec_full:
        full = model(ids).logits[:, T - 200:]
    with record_routing(model) as rec:
        logits, cache = run_pieces(model, ids, [1, 999, 1100, 900] + [1] * N_DECODE, keep_from=T - 200)
    assert cache.length == T + N_DECODE and cache.capacity >= T + N_DECODE
    diff = routing_diff(rec_full.routing(), rec.routing(), window=FLIP_WINDOW, max_flips=16)  # ≈ 1 flip + induced
    assert_close_except_flips(logits, full, diff, 1e-4, tol_after=FLIP_TOL, index=(slice(None), slice(T - 200, None)),
                              what="chunked prefill + decode vs full forward")
    held = diff.unaffected()[:, T - 200:]  # the argmax is compared where the logits are held to 1e-4
    assert torch.equal(logits.argmax(-1)[held], full.argmax(-1)[held])


@pytest.mark.parametrize("T", [16384, pytest.param(32768, marks=pytest.mark.slow)])
def test_decode_after_long_chunked_prefill(T):
    """k3-tiny fp32: decode after a 16K (32K: the slow extra) chunked prefill == a differently chunked prefill
    (≤ 1e-4).

    Over 8 × 32772 routing decisions a few sit at exact / 1-ulp ties of the choice scores; which of them flip
    between the two chunkings depends on the CPU's kernels (AVX-512 EPYC: 3, at layers 6, 7, 8, tokens 23074,
    6123, 2101, margins ≤ 2.4e-7). The comparisons therefore go through tests/routing.py: a flipped token is
    excused (only finite), tokens up to FLIP_WINDOW after it are held to FLIP_TOL, every other one to 1e-4, and
    every flip must sit at a near tie (≤ 1e-5) or be induced by an earlier one (≤ 1e-2, within the window).
    """
    model = k3_tiny(seed=32)
    chunk = 2048
    ids = ids_for(model.config.vocab_size, 1, T + N_DECODE, seed=32)
    keep = T - 64
    # A: 16 chunks of 2048, then one-token decode steps (recurrent KDA, absorbed MLA)
    with record_routing(model) as rec_a:
        prefill_a, cache = run_pieces(model, ids[:, :T], [chunk] * (T // chunk), keep_from=keep)
        assert cache.length == T and cache.capacity >= T
        fork = copy.deepcopy(cache)
        decode = torch.cat([model(ids[:, t:t + 1], cache=cache).logits for t in range(T, T + N_DECODE)], 1)
    assert cache.length == T + N_DECODE
    assert torch.isfinite(decode).all()
    # the same continuation as one multi-token call (chunk KDA, expanded MLA) from a copy of the cache
    with record_routing(model) as rec_multi:
        multi = model(ids[:, T:], cache=fork).logits
    routing_a = rec_a.routing()
    flips = dict(window=FLIP_WINDOW, max_flips=100)  # ≤ 0.3 % of the tokens, induced flips included
    multi_diff = routing_diff(routing_a[:, T:], rec_multi.routing(), **flips)
    assert_close_except_flips(decode, multi, multi_diff, 1e-4, tol_after=FLIP_TOL, what="decode vs multi-token")
    # B: other chunk boundaries (a 1-token piece, unaligned sizes); the decoded tokens ride in the last piece
    n_b = (T - 2768) // 2500  # a 1-token piece, 1500, n_b × 2500, the rest (≥ 1268 tokens)
    pieces_b = [1, 1500] + [2500] * n_b + [T + N_DECODE - 1 - 1500 - n_b * 2500]
    with record_routing(model) as rec_b:
        logits_b, cache_b = run_pieces(model, ids, pieces_b, keep_from=keep)
    assert cache_b.length == T + N_DECODE
    diff = routing_diff(routing_a, rec_b.routing(), **flips)
    tail = (slice(None), slice(keep, None))
    assert_close_except_flips(torch.cat([prefill_a, decode], 1), logits_b, diff, 1e-4, tol_after=FLIP_TOL,
                              index=tail, what="logits, chunkings A vs B")
    held = diff.unaffected()[:, T:]  # the argmax is compared where the logits are held to 1e-4
    assert torch.equal(decode.argmax(-1)[held], logits_b[:, T - keep:].argmax(-1)[held])
    for i, (a, b) in enumerate(zip(cache.layers, cache_b.layers)):  # layer i's cache: flips in layers < i count
        if isinstance(a, MLACache):
            assert_close_except_flips(a.latent_BSL[:, :T + N_DECODE], b.latent_BSL[:, :T + N_DECODE], diff, 1e-4,
                                      before_layer=i, tol_after=FLIP_TOL, what=f"layer {i} MLA latents")
        else:
            assert_close_except_flips(a.recurrent_state_BHKV, b.recurrent_state_BHKV, diff, 1e-4, before_layer=i,
                                      tol_after=FLIP_STATE_TOL, positional=False, what=f"layer {i} KDA state")
            assert_close_except_flips(a.conv_state_B3WP, b.conv_state_B3WP, diff, 1e-5, before_layer=i,
                                      tol_after=FLIP_TOL, positional=False, what=f"layer {i} conv window")
