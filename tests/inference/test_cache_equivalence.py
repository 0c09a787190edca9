"""Cached inference equals one full forward (docs/architecture.md §2.4, §3.7, §4.3, §4.4, §12.1, §12.3 items 3, 6, 10).

`cache = model.make_cache(B)`; every `model(ids, cache=cache)` consumes the new tokens, appends them to the cache
and returns their logits only. One-token calls take the recurrent KDA / absorbed MLA path, multi-token calls the
chunk KDA / expanded MLA path; whatever the split, the concatenated logits must equal one uncached forward.
"""

from __future__ import annotations

import copy

import pytest
import torch

import k3.ops.kda.core as kda_core
from k3.config import K3Config
from k3.inference import compiled_step
from k3.inference.compiled_step import decode_one_token
from k3.model.cache import PAGE_TOKENS, K3Cache, KDACache, MLACache, step_context
from k3.model import K3ForCausalLM
from k3.model.mla import GatedMLA
from conformance import ids_for, set_runtime
from routing import K3_TINY_TOL_AFTER, K3_TINY_WINDOW, assert_close_except_flips, record_routing, routing_diff

pytestmark = pytest.mark.usefixtures("no_grad")

T_FULL = 70
SPLITS = (1, 5, 37, 64, 65, T_FULL - 1)  # around the 64-token KDA chunk, a length-1 prompt, one decode step


def run_pieces(model: K3ForCausalLM, ids: torch.Tensor, pieces: list[int], cache=None, **cache_kw):
    """Feed `ids` through one cache in consecutive pieces of the given lengths; returns (logits, cache)."""
    assert sum(pieces) == ids.shape[1]
    cache = model.make_cache(ids.shape[0], **cache_kw) if cache is None else cache
    out, pos = [], 0
    for n in pieces:
        out.append(model(ids[:, pos:pos + n], cache=cache).logits)
        pos += n
    return torch.cat(out, 1), cache


def prefill_then_decode(model: K3ForCausalLM, ids: torch.Tensor, split: int, **cache_kw):
    """Prefill `ids[:, :split]` in one call, then one-token decode steps to the end."""
    return run_pieces(model, ids, [split] + [1] * (ids.shape[1] - split), **cache_kw)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def mla_layers(model: K3ForCausalLM) -> list[int]:
    return [i for i, layer in enumerate(model.model.layers) if not layer.is_kda]


def kda_layers(model: K3ForCausalLM) -> list[int]:
    return [i for i, layer in enumerate(model.model.layers) if layer.is_kda]


# ------------------------------------------------------------------------------ prefill + decode == full
@pytest.mark.parametrize("mla_decode,kda_impl", [("absorbed", "chunk"), ("expanded", "chunk"),
                                                 ("absorbed", "recurrent")])
def test_prefill_and_decode_equal_full_forward_fp64(tiny_model, mla_decode, kda_impl):
    """fp64 §12.2 model: prefill(prefix) + one-token decode steps == one full forward (≤ 1e-10) at every split."""
    model = tiny_model(seed=3, mla_decode=mla_decode, kda_impl=kda_impl).double()
    ids = ids_for(256, 2, T_FULL, seed=3)
    full = model(ids).logits
    assert full.std() > 0.3  # a comparison of non-trivial logits
    for split in SPLITS:
        logits, cache = prefill_then_decode(model, ids, split)
        assert logits.shape == full.shape
        assert cache.length == T_FULL
        assert max_diff(logits, full) <= 1e-10, (split, max_diff(logits, full))


def test_prefill_and_decode_equal_full_forward_k3_tiny_fp32():
    """fp32 k3-tiny preset (init std 0.02): prefill + one-token decode == full forward, max |Δlogit| ≤ 1e-4,
    except for routing flips at near ties (tests/routing.py: this data has 12 decisions with a margin < 1e-5)."""
    torch.manual_seed(11)
    model = K3ForCausalLM(K3Config.from_preset("k3-tiny")).eval()
    T = 100
    ids = ids_for(model.config.vocab_size, 2, T, seed=11)
    with record_routing(model) as rec_full:
        full = model(ids).logits
    for split in (1, 37, 64, 65, T - 1):
        with record_routing(model) as rec:
            logits, _ = prefill_then_decode(model, ids, split)
        diff = routing_diff(rec_full.routing(), rec.routing(), window=K3_TINY_WINDOW, max_flips=16)
        assert_close_except_flips(logits, full, diff, 1e-4, tol_after=K3_TINY_TOL_AFTER, what=f"split {split}")
        held = diff.unaffected()  # the argmax is compared where the logits are held to 1e-4
        assert torch.equal(logits.argmax(-1)[held], full.argmax(-1)[held])


# ------------------------------------------------------------------------------------- chunked prefill
@pytest.mark.parametrize("pieces", [
    [31] + [1] * 9 + [60],  # §12.3 item 3
    [5, 64, 31],  # §12.3 item 10
    [1, 99],  # a length-1 piece followed by a long piece
    [63, 2, 35],  # a boundary straddling the 64-token KDA chunk
    [2, 1, 97],  # pieces shorter than the conv window (W − 1 = 3)
], ids=lambda p: "-".join(map(str, p)) if len(p) < 6 else "31-9x1-60")
def test_chunked_prefill_equals_one_shot_prefill(tiny_model, pieces):
    """Prefill in arbitrary pieces == one-shot prefill: logits, every cached latent / conv window / state (fp64)."""
    model = tiny_model(seed=4).double()
    ids = ids_for(256, 2, 101, seed=4)
    one_logits, one = run_pieces(model, ids[:, :100], [100])
    logits, cache = run_pieces(model, ids[:, :100], pieces)
    assert max_diff(logits, one_logits) <= 1e-10
    assert max_diff(one_logits, model(ids[:, :100]).logits) <= 1e-10
    assert cache.length == one.length == 100
    for a, b in zip(cache.layers, one.layers):
        if isinstance(a, MLACache):
            assert max_diff(a.latent_BSL[:, :100], b.latent_BSL[:, :100]) <= 1e-12
        else:
            assert max_diff(a.conv_state_B3WP, b.conv_state_B3WP) <= 1e-12
            assert max_diff(a.recurrent_state_BHKV, b.recurrent_state_BHKV) <= 1e-10
    # both caches continue identically
    assert max_diff(model(ids[:, 100:], cache=cache).logits, model(ids[:, 100:], cache=one).logits) <= 1e-10


def test_cache_copy_continues_like_the_original(tiny_model):
    """A deep-copied cache is independent: decoding from the copy does not disturb the original (fp64)."""
    model = tiny_model(seed=5).double()
    ids = ids_for(256, 1, 24, seed=5)
    _, cache = run_pieces(model, ids[:, :20], [20])
    fork = copy.deepcopy(cache)
    a = run_pieces(model, ids[:, 20:], [1, 1, 1, 1], cache=fork)[0]
    b = run_pieces(model, ids[:, 20:], [4], cache=cache)[0]
    assert max_diff(a, b) <= 1e-10
    assert max_diff(b, model(ids).logits[:, 20:]) <= 1e-10


# ------------------------------------------------------------------------------ which path runs when
def test_which_kda_and_mla_paths_run(tiny_model, monkeypatch):
    """One-token KDA calls: recurrent; longer: chunk. Cached calls up to `absorbed_max_tokens` (70 at the §12.2 dims):
    absorbed MLA (expanded where the layer's `absorbed_max_tokens` is 0); longer cached calls and uncached calls:
    expanded. `decode_one_token` runs each layer as one compiled call (recorded as "layer") where it implements the
    layer's form, else the paths above."""
    calls: list[tuple[str, int]] = []

    def spy(name, fn, t_axis):
        def wrapped(*args, **kwargs):
            calls.append((name, args[t_axis].shape[1]))
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(kda_core, "recurrent_kda", spy("recurrent", kda_core.recurrent_kda, 0))
    monkeypatch.setattr(kda_core, "chunk_kda", spy("chunk", kda_core.chunk_kda, 0))
    absorbed, expanded = GatedMLA.attend_absorbed, GatedMLA.attend_expanded
    monkeypatch.setattr(GatedMLA, "attend_absorbed", spy("absorbed", absorbed, 1))
    monkeypatch.setattr(GatedMLA, "attend_expanded", spy("expanded", expanded, 1))
    run_layer = compiled_step._run  # the compiled step of one layer

    def layer_spy(*args):
        out = run_layer(*args)
        if out is not None:
            calls.append(("layer", 1))
        return out

    monkeypatch.setattr(compiled_step, "_run", layer_spy)
    model = tiny_model(seed=6)
    n_kda, n_mla = len(kda_layers(model)), len(mla_layers(model))
    assert model.model.layers[mla_layers(model)[0]].self_attn.absorbed_max_tokens == 20 * (16 + 12) // (2 * 4)
    ids = ids_for(256, 2, 80, seed=6)
    cache = model.make_cache(2)

    def kinds():
        got = sorted(set(calls))
        calls.clear()
        return got

    model(ids[:, :8], cache=cache)
    assert kinds() == [("absorbed", 8), ("chunk", 8)]
    decode_one_token(model, ids[:, 8:9], cache=copy.deepcopy(cache))
    assert kinds() == [("layer", 1)]
    model(ids[:, 8:9], cache=cache)  # the modules
    assert kinds() == [("absorbed", 1), ("recurrent", 1)]
    model(ids[:, 9:], cache=cache)  # 71 tokens: past the crossover
    assert kinds() == [("chunk", 71), ("expanded", 71)]
    model(ids[:, :1])  # no cache: a one-token forward
    assert kinds() == [("expanded", 1), ("recurrent", 1)]

    set_runtime(model, mla_decode="expanded")
    cache = model.make_cache(2)
    decode_one_token(model, ids[:, :1], cache)  # a one-token *prompt* is a decode step too
    assert len(calls) == n_kda + n_mla
    assert kinds() == [("expanded", 1), ("layer", 1)]  # the compiled layer step is absorbed MLA only


# ------------------------------------------------------------------------------ absorbed vs expanded MLA
def random_mla_inputs(layer: GatedMLA, B: int, S: int, T: int, seed: int):
    """q_nope, q_pe for the last T of S tokens and the latent [ĉ ‖ k_pe] of all S (float64)."""
    g = torch.Generator().manual_seed(seed)
    x_BSD = torch.randn(B, S, layer.config.hidden_size, generator=g, dtype=torch.float64)
    q_nope, q_pe = layer.project_query(x_BSD[:, S - T:])
    return q_nope, q_pe, layer.compress_kv(x_BSD)


@pytest.mark.parametrize("T,S,padded", [(1, 1, False), (1, 23, False), (7, 7, False), (7, 23, False),
                                        (1, 23, True), (7, 23, True)])
def test_absorbed_equals_expanded_attention(tiny_model, T, S, padded):
    """`attend_absorbed` == `attend_expanded` (fp64 ≤ 1e-12) for multi-token queries, causal offset, key padding."""
    model = tiny_model(seed=7).double()
    layer = model.model.layers[mla_layers(model)[0]].self_attn
    q_nope, q_pe, latent = random_mla_inputs(layer, 3, S, T, seed=T * 100 + S)
    key_valid = None
    if padded:  # row 0 unpadded, row 1 four pads, row 2 padded up to one token before the queries
        key_valid = torch.ones(3, S, dtype=torch.bool)
        key_valid[1, :4] = False
        key_valid[2, : S - T - 1] = False
    a = layer.attend_absorbed(q_nope, q_pe, latent, key_valid)
    e = layer.attend_expanded(q_nope, q_pe, latent, key_valid)
    assert a.shape == e.shape == (3, T, layer.num_heads, layer.config.v_head_dim)
    assert max_diff(a, e) <= 1e-12
    assert a.abs().max() > 0.1


def test_absorbed_uses_scale_of_nope_plus_rope(tiny_model):
    """The absorbed score keeps 1/√(nope + rope) = 1/√24 here, not 1/√(kv_lora + rope) (§4.4 step 2)."""
    layer = tiny_model(seed=7).double().model.layers[3].self_attn
    assert layer.scale == (16 + 8) ** -0.5
    q_nope, q_pe, latent = random_mla_inputs(layer, 2, 9, 1, seed=1)
    ref = layer.attend_absorbed(q_nope, q_pe, latent)
    layer.scale = (20 + 8) ** -0.5
    assert max_diff(layer.attend_absorbed(q_nope, q_pe, latent), ref) > 1e-3


@pytest.mark.parametrize("mla_decode", ["absorbed", "expanded"])
def test_mla_layer_decode_equals_uncached_layer(tiny_model, mla_decode):
    """GatedMLA.forward with an MLACache: prefill + one-token steps == the uncached layer (fp64 ≤ 1e-12)."""
    model = tiny_model(seed=8, mla_decode=mla_decode).double()
    i = mla_layers(model)[0]
    cache = model.make_cache(2)
    layer, layer_cache = model.model.layers[i].self_attn, cache.layers[i]
    assert isinstance(layer_cache, MLACache)
    x = torch.randn(2, 20, 64, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    outs = []
    for lo, hi in [(0, 12)] + [(t, t + 1) for t in range(12, 20)]:
        ctx = step_context(cache, 2, hi - lo, None, x.device)
        outs.append(layer(x[:, lo:hi], layer_cache, ctx))
        cache.length += hi - lo
    assert max_diff(torch.cat(outs, 1), layer(x)) <= 1e-12


# -------------------------------------------------------------------------------- layer-type mixes
@pytest.mark.parametrize("schedule", ["all_kda", "all_mla"])
def test_decode_equals_full_forward_for_any_layer_mix(tiny_model, schedule):
    """All-KDA and all-MLA variants of the §12.2 config: prefill + decode == full forward (fp64 ≤ 1e-10)."""
    layers = list(range(1, 9))
    kw = dict(full_attn_layers=[], kda_layers=layers) if schedule == "all_kda" else \
        dict(full_attn_layers=layers, kda_layers=[])
    model = tiny_model(seed=9, **kw).double()
    assert {layer.is_kda for layer in model.model.layers} == {schedule == "all_kda"}
    ids = ids_for(256, 2, T_FULL, seed=9)
    full = model(ids).logits
    for split in (1, 37, 65):
        logits, cache = prefill_then_decode(model, ids, split)
        assert max_diff(logits, full) <= 1e-10, (split, max_diff(logits, full))
        kinds = {type(layer) for layer in cache.layers}
        assert kinds == {KDACache if schedule == "all_kda" else MLACache}
    chunked, _ = run_pieces(model, ids, [5, 64, 1])
    assert max_diff(chunked, full) <= 1e-10


# ------------------------------------------------------------------------------------ cache contents
def test_mla_cache_holds_normalised_latent_and_raw_k_pe(tiny_model):
    """MLA cache = [kv_a_layernorm(c) ‖ raw k_pe] of every consumed token, shape [B, capacity, C + R]."""
    model = tiny_model(seed=10).double()
    cfg = model.config
    inputs: dict[int, list[torch.Tensor]] = {i: [] for i in mla_layers(model)}
    hooks = [model.model.layers[i].self_attn.register_forward_pre_hook(
        lambda mod, args, i=i: inputs[i].append(args[0])) for i in inputs]
    ids = ids_for(256, 2, 45, seed=10)
    _, cache = run_pieces(model, ids, [40, 1, 1, 3])
    for h in hooks:
        h.remove()
    for i, xs in inputs.items():
        x_BTD = torch.cat(xs, 1)
        assert x_BTD.shape == (2, 45, cfg.hidden_size)
        latent = cache.layers[i].latent_BSL
        assert latent.shape == (2, cache.capacity, cfg.kv_lora_rank + cfg.qk_rope_head_dim) == (2, 256, 28)
        assert latent.dtype == torch.float64
        attn = model.model.layers[i].self_attn
        assert max_diff(latent[:, :45], attn.compress_kv(x_BTD)) <= 1e-12
        # the first kv_lora_rank numbers are normalised (RMS = the gain), the rope slot is the raw projection
        c, k_pe = attn.kv_a_proj_with_mqa(x_BTD).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], -1)
        assert max_diff(latent[:, :45, cfg.kv_lora_rank:], k_pe) <= 1e-12
        assert max_diff(latent[:, :45, :cfg.kv_lora_rank], attn.kv_a_layernorm(c)) <= 1e-12
        assert max_diff(latent[:, :45, :cfg.kv_lora_rank], c) > 1e-2


@pytest.mark.parametrize("pieces", [[45], [1, 1], [2], [40, 1, 1, 3]])
def test_kda_conv_state_is_last_projected_inputs(tiny_model, pieces):
    """KDA conv_state[:, s] = the last W−1 pre-conv projections of stream s (zeros before the first token)."""
    model = tiny_model(seed=10)
    W = model.config.short_conv_kernel_size
    i = kda_layers(model)[1]
    attn = model.model.layers[i].self_attn
    seen = {name: [] for name in ("q_proj", "k_proj", "v_proj")}
    hooks = [getattr(attn, name).register_forward_hook(lambda mod, args, out, name=name: seen[name].append(out))
             for name in seen]
    T = sum(pieces)
    ids = ids_for(256, 2, T, seed=10)
    _, cache = run_pieces(model, ids, pieces)
    for h in hooks:
        h.remove()
    conv = cache.layers[i].conv_state_B3WP
    assert conv.shape == (2, 3, W - 1, model.config.kda_num_heads * model.config.kda_head_dim)
    for s, name in enumerate(seen):
        proj = torch.cat([torch.zeros(2, W - 1, conv.shape[-1])] + seen[name], 1)  # zero left context
        assert proj.shape[1] == T + W - 1
        assert torch.equal(conv[:, s], proj[:, -(W - 1):]), name


def test_recurrent_state_stays_fp32_in_bf16_model(tiny_model):
    """bf16 model: KDA recurrent state fp32 after prefill and decode; conv windows and MLA latents bf16."""
    model = tiny_model(seed=12).to(torch.bfloat16)
    cache = model.make_cache(2)
    ids = ids_for(256, 2, 20, seed=12)

    def check():
        for layer in cache.layers:
            if isinstance(layer, KDACache):
                assert layer.recurrent_state_BHKV.dtype == torch.float32
                assert layer.conv_state_B3WP.dtype == torch.bfloat16
            else:
                assert layer.latent_BSL.dtype == torch.bfloat16

    check()
    logits = run_pieces(model, ids, [17, 1, 2], cache=cache)[0]
    check()
    out = model(ids[:, :1], cache=cache).logits
    check()
    assert torch.isfinite(logits).all() and torch.isfinite(out).all()
    assert any(layer.recurrent_state_BHKV.abs().max() > 0 for layer in cache.layers if isinstance(layer, KDACache))


def test_length_increments_and_capacity_grows(tiny_model):
    """cache.length counts consumed tokens; make_cache(B, capacity=4) grows past 70 with identical logits."""
    model = tiny_model(seed=13).double()
    ids = ids_for(256, 2, 80, seed=13)
    small = model.make_cache(2, capacity=4)
    assert small.capacity == 4 and small.length == 0
    model(ids[:, :3], cache=small)
    assert small.length == 3 and small.capacity == 4
    model(ids[:, 3:4], cache=small)
    assert small.length == 4 and small.capacity == 4
    model(ids[:, 4:5], cache=small)  # one-token step past the capacity
    assert small.length == 5 and small.capacity >= 5
    model(ids[:, 5:75], cache=small)
    assert small.length == 75 and small.capacity >= 75
    decode = [model(ids[:, t:t + 1], cache=small).logits for t in range(75, 80)]
    assert small.length == 80
    assert all(layer.latent_BSL.shape[1] == small.capacity for layer in small.layers if isinstance(layer, MLACache))
    big_logits, big = run_pieces(model, ids, [75, 1, 1, 1, 1, 1])
    assert big.capacity == 256
    assert max_diff(torch.cat(decode, 1), big_logits[:, 75:]) <= 1e-12
    for a, b in zip(small.layers, big.layers):
        if isinstance(a, MLACache):
            assert max_diff(a.latent_BSL[:, :80], b.latent_BSL[:, :80]) <= 1e-12
    assert torch.equal(small.key_mask_BS[:, :80], big.key_mask_BS[:, :80])
    # a 70-token prefill into a 4-slot cache equals the default cache
    grown_logits, grown = run_pieces(model, ids[:, :70], [70], capacity=4)
    assert grown.capacity >= 70
    assert max_diff(grown_logits, model(ids[:, :70]).logits) <= 1e-10


def test_cache_grows_in_pages_never_doubling():
    """Growth is in whole pages of PAGE_TOKENS positions, by at least an eighth of the capacity: appending one
    position at a time to 100 pages copies O(1) per position on average and never holds more than an eighth plus a
    page beyond the text (a doubling cache would hold up to twice the text)."""
    config = K3Config.from_preset("k3-tiny")
    cache = K3Cache(config, 1, torch.float32, capacity=4)
    growths = 0
    for length in range(1, 100 * PAGE_TOKENS, 97):
        before = cache.capacity
        cache.reserve(length)
        if cache.capacity != before:
            growths += 1
            assert cache.capacity % PAGE_TOKENS == 0 and cache.capacity >= before + before // 8
        assert length <= cache.capacity <= length + length // 8 + PAGE_TOKENS
        assert all(layer.latent_BSL.shape[1] == cache.capacity for layer in cache.layers
                   if isinstance(layer, MLACache))
    assert growths <= 30  # geometric: ~log_{9/8}(100) + a few first pages, not one per page


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nbytes_counts_spec_cache_sizes(tiny_model, dtype):
    """nbytes = per MLA layer (kv_lora + rope) = 28 numbers/token in the activation dtype + fixed KDA states."""
    model = tiny_model(seed=14).to(dtype)
    cfg = model.config
    B, item = 2, torch.finfo(dtype).bits // 8
    per_token = B * len(mla_layers(model)) * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * item
    assert cfg.kv_lora_rank + cfg.qk_rope_head_dim == 28
    P, W = cfg.kda_num_heads * cfg.kda_head_dim, cfg.short_conv_kernel_size
    kda_fixed = B * len(kda_layers(model)) * (3 * (W - 1) * P * item  # conv windows, activation dtype
                                               + cfg.kda_num_heads * cfg.kda_head_dim ** 2 * 4)  # S, fp32
    cache = model.make_cache(B)
    assert cache.nbytes() == kda_fixed
    ids = ids_for(256, B, 30, seed=14)
    model(ids[:, :29], cache=cache)
    assert cache.nbytes() == kda_fixed + 29 * per_token
    model(ids[:, 29:], cache=cache)
    assert cache.nbytes() == kda_fixed + 30 * per_token
    # at the released size the latent is 576 numbers per token per MLA layer (§2.4, §4.3)
    full = K3Config()
    assert full.kv_lora_rank + full.qk_rope_head_dim == 576


# ------------------------------------------------------------------------------------- a bf16 latent cache
@pytest.mark.parametrize("mla_decode", ["absorbed", "expanded"])
def test_bf16_latent_cache_equals_attention_over_rounded_latents(tiny_model, monkeypatch, mla_decode):
    """A bf16 MLA latent cache under a wider model (`make_cache(cache_dtype=torch.bfloat16)`; fp64 here): prefill
    + one-token decode steps, from a 4-position cache grown in pages, equal one uncached forward whose MLA layers
    attend over their latents rounded to bf16 (≤ 1e-10) at every split, the new tokens' own latents included; the
    cache keeps bf16 through growth, `clone`, `rows` and `join`, and holds half the bytes of an fp32 one."""
    model = tiny_model(seed=16, mla_decode=mla_decode).double()
    ids = ids_for(256, 2, T_FULL, seed=16)
    exact = model(ids).logits
    compress = GatedMLA.compress_kv
    monkeypatch.setattr(GatedMLA, "compress_kv",
                        lambda self, x, start=0: compress(self, x, start).to(torch.bfloat16).to(x.dtype))
    rounded = model(ids).logits
    monkeypatch.undo()
    assert 1e-4 < max_diff(rounded, exact) < 1e-1  # the rounding shows, and stays small
    for split in (1, 37, T_FULL - 1):
        logits, cache = prefill_then_decode(model, ids, split, capacity=4, cache_dtype=torch.bfloat16)
        assert max_diff(logits, rounded) <= 1e-10, (split, max_diff(logits, rounded))
    mla = [layer for layer in cache.layers if isinstance(layer, MLACache)]
    assert cache.capacity >= T_FULL and all(layer.latent_BSL.dtype == torch.bfloat16 for layer in mla)
    for other in (cache.clone(), cache.rows([1]), K3Cache.join([cache.rows([0]), cache.rows([1])])):
        assert all(layer.latent_BSL.dtype == torch.bfloat16 for layer in other.layers if isinstance(layer, MLACache))
    fp32 = model.float().make_cache(2, cache_dtype=torch.float32)
    model(ids, cache=fp32)
    latent_bytes = sum(layer.latent_BSL[:, :T_FULL].nbytes for layer in mla)
    assert 2 * latent_bytes == sum(layer.latent_BSL[:, :T_FULL].nbytes for layer in fp32.layers
                                   if isinstance(layer, MLACache))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64, torch.int8])
def test_a_latent_cache_dtype_it_cannot_hold_is_named(tiny_model, dtype):
    with pytest.raises(ValueError, match=f"the MLA latent cache is float32 or bfloat16, got {dtype}"):
        tiny_model(seed=16).make_cache(1, cache_dtype=dtype)


def test_batch_size_mismatch_raises(tiny_model):
    """A call whose batch size differs from the cache's raises ValueError and leaves the cache untouched."""
    model = tiny_model(seed=15)
    ids = ids_for(256, 3, 6, seed=15)
    cache = model.make_cache(2)
    with pytest.raises(ValueError, match="batch size"):
        model(ids, cache=cache)
    assert cache.length == 0
    model(ids[:2, :5], cache=cache)
    with pytest.raises(ValueError, match="batch size"):
        model(ids[:, 5:], cache=cache)
    with pytest.raises(ValueError, match="batch size"):
        model(ids[:1, 5:], cache=cache)
    assert cache.length == 5
    with pytest.raises(ValueError):
        model.make_cache(0)
