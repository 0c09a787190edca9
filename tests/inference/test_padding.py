"""Left padding with `attention_mask` (docs/architecture.md §3.8): padding never enters conv windows, KDA state or MLA attention.

`attention_mask` (1 real, 0 padding, left padding only) is [B, past + new] or [B, new]. Every sequence of a
left-padded batch must produce, at its real positions, the logits it produces when run alone.
"""

from __future__ import annotations

import pytest
import torch

from k3.config import K3Config
from k3.model import K3ForCausalLM
from conformance import ids_for
from routing import K3_TINY_TOL_AFTER, K3_TINY_WINDOW, assert_close_except_flips, record_routing, routing_diff

pytestmark = pytest.mark.usefixtures("no_grad")

PROMPT_LENGTHS = (13, 20, 7)  # row 2's first 13 positions are padding
N_DECODE = 6


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def left_pad(seqs: list[torch.Tensor], vocab: int, pad_seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad 1-D id sequences with random *valid* token ids; returns (ids [B, P], mask [B, P] int64)."""
    P = max(len(s) for s in seqs)
    ids = ids_for(vocab, len(seqs), P, seed=pad_seed)
    mask = torch.zeros(len(seqs), P, dtype=torch.long)
    for b, s in enumerate(seqs):
        if len(s):
            ids[b, P - len(s):] = s
            mask[b, P - len(s):] = 1
    return ids, mask


def make_batch(vocab: int, lengths, seed: int, pad_seed: int = 1000):
    """Prompts of the given lengths, their decode continuations, the padded prompt ids and mask."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (n,), generator=g) for n in lengths]
    new = torch.randint(0, vocab, (len(lengths), N_DECODE), generator=g)
    ids, mask = left_pad(prompts, vocab, pad_seed)
    return prompts, new, ids, mask


def alone(model: K3ForCausalLM, prompt: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Logits of one unpadded sequence (prompt + continuation), full uncached forward: [len, V]."""
    return model(torch.cat([prompt, new])[None]).logits[0]


def decode_padded(model, ids, mask, new, prefill_form: str, decode_form: str | None = None, pieces=None):
    """Prefill the padded prompt (in `pieces`), then decode `new` one token a step.

    Masks: "full" = [B, past + new], "new" = [B, new], "none" = omitted (decode only). Returns (prompt logits
    [B, P, V], decode logits [B, len(new), V]).
    """
    B, P = ids.shape
    cache = model.make_cache(B)
    prompt_logits, pos = [], 0
    for n in pieces or [P]:
        m = mask[:, : pos + n] if prefill_form == "full" else mask[:, pos: pos + n]
        prompt_logits.append(model(ids[:, pos: pos + n], cache=cache, attention_mask=m).logits)
        pos += n
    full_mask, out = mask, []
    for t in range(new.shape[1]):
        full_mask = torch.cat([full_mask, torch.ones(B, 1, dtype=mask.dtype)], 1)
        m = {"full": full_mask, "new": full_mask[:, -1:], "none": None}[decode_form or prefill_form]
        out.append(model(new[:, t: t + 1], cache=cache, attention_mask=m).logits)
    assert cache.length == P + new.shape[1]
    assert torch.equal(cache.key_mask_BS[:, : cache.length], full_mask.bool())
    return torch.cat(prompt_logits, 1), torch.cat(out, 1)


def check_rows(model, prompts, new, prompt_logits, decode_logits, tol):
    P = prompt_logits.shape[1]
    for b, prompt in enumerate(prompts):
        n = len(prompt)
        if n == 0 and (decode_logits is None or decode_logits.shape[1] == 0):
            continue  # nothing real to compare
        ref = alone(model, prompt, new[b])
        if n:
            assert max_diff(prompt_logits[b, P - n:], ref[:n]) <= tol, (b, max_diff(prompt_logits[b, P - n:], ref[:n]))
        if decode_logits is not None:
            assert max_diff(decode_logits[b], ref[n:]) <= tol, (b, max_diff(decode_logits[b], ref[n:]))


def check_rows_routed(model, prompts, new, prompt_logits, decode_logits, routing, tol):
    """`check_rows` for fp32 k3-tiny, except for routing flips at near ties (tests/routing.py): `routing` is the
    padded run's [B, P (+ decoded)]; each row's real positions are compared with the row run alone."""
    P = prompt_logits.shape[1]
    for b, prompt in enumerate(prompts):
        n = len(prompt)
        with record_routing(model) as rec:
            ref = alone(model, prompt, new[b])
        got = prompt_logits[b, P - n:] if decode_logits is None else torch.cat([prompt_logits[b, P - n:],
                                                                                  decode_logits[b]])
        diff = routing_diff(routing[b:b + 1, P - n:], rec.routing(), window=K3_TINY_WINDOW, max_flips=16)
        assert_close_except_flips(got[None], ref[None], diff, tol, tol_after=K3_TINY_TOL_AFTER, what=f"row {b}")


# ------------------------------------------------------------------------------------------ no cache
@pytest.mark.parametrize("kda_impl", ["chunk", "recurrent"])
def test_left_padded_batch_equals_rows_alone_without_cache(tiny_model, kda_impl):
    """Uncached forward of a left-padded batch: each row's real-position logits == the row alone (fp64 ≤ 1e-10)."""
    model = tiny_model(seed=21, kda_impl=kda_impl).double()
    prompts, new, ids, mask = make_batch(256, PROMPT_LENGTHS, seed=21)
    logits = model(ids, attention_mask=mask).logits
    assert torch.isfinite(logits).all()
    check_rows(model, prompts, new[:, :0], logits, None, 1e-10)
    # a bool mask works the same
    assert torch.equal(model(ids, attention_mask=mask.bool()).logits, logits)


# ---------------------------------------------------------------------------------------- with cache
@pytest.mark.parametrize("mask_form", ["full", "new", "none"])
@pytest.mark.parametrize("pieces", [None, [10, 10], [4, 1, 15]], ids=["one-shot", "10-10", "4-1-15"])
def test_left_padded_prefill_and_decode_equal_rows_alone(tiny_model, mask_form, pieces):
    """Padded prefill (whole or chunked) + decode, mask [B, past+new] / [B, new] / none: each row alone (≤ 1e-10)."""
    # "full": [B, past + new] growing by a 1 per decode step; "new": [B, new]; "none": [B, new] slices for the
    # prefill, no mask for the decode steps (the cache remembers which past positions are padding). Pieces
    # [10, 10] and [4, 1, 15] give row 2 (13 pads) calls that are entirely padding, one of them a 1-token call.
    model = tiny_model(seed=22).double()
    prompts, new, ids, mask = make_batch(256, PROMPT_LENGTHS, seed=22)
    prefill_form = "full" if mask_form == "full" else "new"
    prompt_logits, decode = decode_padded(model, ids, mask, new, prefill_form, mask_form, pieces)
    assert torch.isfinite(prompt_logits).all() and torch.isfinite(decode).all()
    check_rows(model, prompts, new, prompt_logits, decode, 1e-10)


@pytest.mark.parametrize("mla_decode", ["absorbed", "expanded"])
def test_padded_decode_for_both_mla_forms(tiny_model, mla_decode):
    """Both one-token MLA forms respect the cached key padding (fp64 ≤ 1e-10)."""
    model = tiny_model(seed=23, mla_decode=mla_decode).double()
    prompts, new, ids, mask = make_batch(256, PROMPT_LENGTHS, seed=23)
    prompt_logits, decode = decode_padded(model, ids, mask, new, "full")
    check_rows(model, prompts, new, prompt_logits, decode, 1e-10)


def test_left_padding_k3_tiny_fp32():
    """fp32 k3-tiny preset: padded batch (no cache, and prefill + decode) == each row alone, ≤ 1e-4, except for
    routing flips at near ties (tests/routing.py: this data has 6 decisions with a margin < 1e-5)."""
    torch.manual_seed(24)
    model = K3ForCausalLM(K3Config.from_preset("k3-tiny")).eval()
    prompts, new, ids, mask = make_batch(model.config.vocab_size, (30, 45, 9), seed=24)
    with record_routing(model) as rec:
        logits = model(ids, attention_mask=mask).logits
    check_rows_routed(model, prompts, new[:, :0], logits, None, rec.routing(), 1e-4)
    with record_routing(model) as rec:
        prompt_logits, decode = decode_padded(model, ids, mask, new, "full", pieces=[20, 25])
    check_rows_routed(model, prompts, new, prompt_logits, decode, rec.routing(), 1e-4)


def test_pad_token_ids_do_not_matter(tiny_model):
    """Two different pad fillings give the same real-position logits (fp64 ≤ 1e-12), uncached and cached."""
    model = tiny_model(seed=25).double()
    prompts, new, ids_a, mask = make_batch(256, PROMPT_LENGTHS, seed=25, pad_seed=1)
    _, _, ids_b, mask_b = make_batch(256, PROMPT_LENGTHS, seed=25, pad_seed=2)
    assert torch.equal(mask, mask_b) and not torch.equal(ids_a, ids_b)
    real = mask.bool()
    a, b = model(ids_a, attention_mask=mask).logits, model(ids_b, attention_mask=mask).logits
    assert max_diff(a[real], b[real]) <= 1e-12
    pa, da = decode_padded(model, ids_a, mask, new, "full", pieces=[8, 12])
    pb, db = decode_padded(model, ids_b, mask, new, "full", pieces=[8, 12])
    assert max_diff(pa[real], pb[real]) <= 1e-12
    assert max_diff(da, db) <= 1e-12


def test_all_padding_row_in_prompt(tiny_model):
    """A row that is all padding (in the prompt and its first decode steps) gives no NaN and starts fresh."""
    model = tiny_model(seed=26).double()
    prompts, new, ids, mask = make_batch(256, (13, 0, 20), seed=26)
    assert mask[1].sum() == 0
    logits = model(ids, attention_mask=mask).logits
    assert torch.isfinite(logits).all()
    check_rows(model, prompts, new[:, :0], logits, None, 1e-10)
    # cached: row 1 keeps padding for two more steps, then its real tokens start
    B, P = ids.shape
    cache = model.make_cache(B)
    prompt_logits = [model(ids[:, :5], cache=cache, attention_mask=mask[:, :5]).logits,
                     model(ids[:, 5:], cache=cache, attention_mask=mask[:, 5:]).logits]
    step_mask = torch.ones(B, 1, dtype=torch.long)
    decode = []
    for t in range(N_DECODE):
        m = step_mask.clone()
        m[1] = int(t >= 2)
        decode.append(model(new[:, t: t + 1], cache=cache, attention_mask=m).logits)
    decode = torch.cat(decode, 1)
    assert torch.isfinite(torch.cat(prompt_logits, 1)).all() and torch.isfinite(decode).all()
    for b in (0, 2):
        ref = alone(model, prompts[b], new[b])
        assert max_diff(decode[b], ref[len(prompts[b]):]) <= 1e-10
    assert max_diff(decode[1, 2:], model(new[1:, 2:]).logits[0]) <= 1e-10  # a fresh sequence


# ------------------------------------------------------------------------------------- invalid masks
def test_invalid_masks_raise_and_leave_cache_untouched(tiny_model):
    """Right padding, wrong shapes and a full mask disagreeing with the cache's past raise ValueError."""
    model = tiny_model(seed=27)
    ids = ids_for(256, 2, 8, seed=27)
    right = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 0, 0]])
    with pytest.raises(ValueError, match="left padding"):
        model(ids, attention_mask=right)
    middle = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 0, 1, 1, 1]])
    with pytest.raises(ValueError, match="left padding"):
        model(ids, attention_mask=middle)
    for bad in (torch.ones(2, 7), torch.ones(2, 9), torch.ones(3, 8), torch.ones(8), torch.ones(1, 2, 8)):
        with pytest.raises(ValueError, match="shape"):
            model(ids, attention_mask=bad)

    cache = model.make_cache(2)
    prompt_mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    model(ids[:, :6], cache=cache, attention_mask=prompt_mask)
    snapshot = cache.key_mask_BS.clone()
    bad_calls = [
        (torch.ones(2, 7, dtype=torch.long), "disagrees"),  # claims row 0's padded past is real
        (torch.cat([prompt_mask, torch.tensor([[1], [0]])], 1), "left padding"),  # a 0 after real tokens
        (torch.tensor([[1], [0]]), "left padding"),  # the same as [B, new]
        (torch.ones(2, 6), "shape"),  # neither [B, past + new] nor [B, new]
        (torch.ones(2, 2), "shape"),
    ]
    for m, match in bad_calls:
        with pytest.raises(ValueError, match=match):
            model(ids[:, 6:7], cache=cache, attention_mask=m)
        assert cache.length == 6 and torch.equal(cache.key_mask_BS, snapshot)
    # a multi-token call whose full mask is right-padded inside the new tokens
    with pytest.raises(ValueError, match="left padding"):
        model(ids[:, 6:8], cache=cache, attention_mask=torch.tensor([[1, 0], [1, 1]]))
    assert cache.length == 6
    # the rejected calls changed nothing: the cache still continues exactly like a fresh one
    good = model(ids[:, 6:8], cache=cache, attention_mask=torch.ones(2, 2)).logits
    fresh = model.make_cache(2)
    model(ids[:, :6], cache=fresh, attention_mask=prompt_mask)
    assert torch.equal(good, model(ids[:, 6:8], cache=fresh, attention_mask=torch.ones(2, 2)).logits)
