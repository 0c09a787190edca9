"""Generation: the cached decode loop against full recomputation, sampling filters, seeds, EOS, streaming,
left padding and argument validation (k3.inference.generate)."""

from __future__ import annotations

import math

import pytest
import torch

from k3.config import K3Config
from k3.inference import generate, sample_next_token
from k3.model import K3ForCausalLM
from routing import assert_no_near_tie, record_routing

VOCAB = 4096  # k3-tiny


@pytest.fixture(scope="module")
def model() -> K3ForCausalLM:
    torch.manual_seed(0)
    return K3ForCausalLM(K3Config.from_preset("k3-tiny")).eval()


def prompts(B: int, T: int, seed: int = 1) -> torch.LongTensor:
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def greedy_without_cache(model: K3ForCausalLM, input_ids: torch.LongTensor, n: int) -> torch.LongTensor:
    """Reference: recompute the full forward on the growing sequence and append the argmax, n times."""
    seq = input_ids
    for _ in range(n):
        seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seq


def drawn_ids(probs: list[float], n: int = 4000, **kwargs) -> torch.LongTensor:
    """n independent draws from one distribution (one row per draw)."""
    logits_NV = torch.tensor(probs).log().expand(n, len(probs))
    return sample_next_token(logits_NV, generator=torch.Generator().manual_seed(0), **kwargs)


# ------------------------------------------------------------------------------------------------- greedy/cache
def test_greedy_equals_full_recompute_without_cache(model):
    x = prompts(2, 7)
    with record_routing(model) as rec:
        out = generate(model, x, 20, temperature=0)
        assert out.shape == (2, 27) and out.dtype == torch.long
        assert torch.equal(out, greedy_without_cache(model, x, 20))
    assert_no_near_tie(rec, what="cached vs recomputed greedy")  # fp32, differently ordered: min margin 1.5e-5


def test_zero_new_tokens_returns_the_prompt(model):
    x = prompts(2, 5)
    assert torch.equal(generate(model, x, 0), x)


def test_training_flag_and_autograd_untouched(model):
    model.train()
    try:
        out = generate(model, prompts(1, 4), 2, temperature=0)
        assert model.training and not out.requires_grad and torch.is_grad_enabled()
    finally:
        model.eval()


# ------------------------------------------------------------------------------------------------- seeds
def test_seed_reproducible_distinct_and_leaves_global_rng_alone(model):
    x = prompts(2, 6)
    rng_before = torch.get_rng_state()
    a = generate(model, x, 30, temperature=1.0, seed=123)
    b = generate(model, x, 30, temperature=1.0, seed=123)
    c = generate(model, x, 30, temperature=1.0, seed=124)
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert torch.equal(a, b)
    assert not torch.equal(a[:, 6:], c[:, 6:])


def test_no_seed_uses_the_global_generator(model):
    x = prompts(1, 6)
    torch.manual_seed(7)
    a = generate(model, x, 10)
    torch.manual_seed(7)
    assert torch.equal(a, generate(model, x, 10))


# ------------------------------------------------------------------------------------------------- filters
def test_top_k_1_and_tiny_top_p_equal_greedy(model):
    x = prompts(2, 7)
    greedy = generate(model, x, 12, temperature=0)  # routing cannot flip: the same forwards, bit-identical inputs
    assert torch.equal(generate(model, x, 12, temperature=1.0, top_k=1, seed=0), greedy)
    assert torch.equal(generate(model, x, 12, temperature=1.0, top_p=1e-6, seed=0), greedy)


def test_sample_next_token_greedy_is_argmax():
    logits_BV = torch.randn(5, 100, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sample_next_token(logits_BV, temperature=0), logits_BV.argmax(-1))


def test_sample_next_token_never_leaves_the_top_k():
    logits_V = torch.randn(64, generator=torch.Generator().manual_seed(0))
    ids = sample_next_token(logits_V.expand(3000, 64), temperature=5.0, top_k=6,
                            generator=torch.Generator().manual_seed(1))
    assert set(ids.tolist()) == set(logits_V.topk(6).indices.tolist())  # inside, and every one reachable


@pytest.mark.parametrize("top_p, kept", [(0.45, {0}), (0.75, {0, 1}), (0.85, {0, 1, 2}), (1.0, {0, 1, 2, 3})])
def test_sample_next_token_top_p_keeps_the_nucleus(top_p, kept):
    ids = drawn_ids([0.5, 0.3, 0.15, 0.05], top_p=top_p)
    assert set(ids.tolist()) == kept


def test_sample_next_token_renormalises_and_applies_temperature():
    nucleus = drawn_ids([0.5, 0.3, 0.15, 0.05], top_p=0.75)  # {0, 1} renormalised: P(0) = 0.5 / 0.8
    assert (nucleus == 0).float().mean().item() == pytest.approx(0.625, abs=0.03)
    sharpened = drawn_ids([0.5, 0.3, 0.15, 0.05], temperature=0.5)  # P ∝ p²: P(0) = 0.25 / 0.365
    assert (sharpened == 0).float().mean().item() == pytest.approx(0.25 / 0.365, abs=0.03)


# ------------------------------------------------------------------------------------------------- EOS
def test_eos_finishes_rows_and_stops_early(model):
    x, T, n = prompts(2, 7), 7, 20
    greedy = generate(model, x, n, temperature=0)[:, T:]  # routing cannot flip: every run repeats these forwards
    eos0 = int(greedy[0, 3])  # row 0's step-3 token: new for row 0 there, never emitted by row 1
    assert eos0 not in greedy[0, :3].tolist() and eos0 not in greedy[1].tolist()

    out = generate(model, x, n, temperature=0, eos_token_id=eos0)[:, T:]
    assert out.shape == (2, n)
    assert torch.equal(out[0, :4], greedy[0, :4]) and (out[0, 4:] == eos0).all()
    assert torch.equal(out[1], greedy[1])

    eos1 = int(greedy[1, 9])  # row 1 first emits it at step 9, row 0 is already done then
    assert eos1 not in greedy[1, :9].tolist() and eos1 not in greedy[0, :4].tolist()
    early = generate(model, x, n, temperature=0, eos_token_id=[eos0, eos1])[:, T:]
    assert early.shape == (2, 10)
    assert torch.equal(early[1], greedy[1, :10])
    assert torch.equal(early[0, :4], greedy[0, :4]) and (early[0, 4:] == eos0).all()  # padded with the first id


# ------------------------------------------------------------------------------------------------- streaming
class RecordingStreamer:
    def __init__(self):
        self.tokens: list[torch.Tensor] = []
        self.ended = 0

    def put(self, tokens: torch.Tensor) -> None:
        assert self.ended == 0
        self.tokens.append(tokens.clone())

    def end(self) -> None:
        self.ended += 1


def test_streamer_callable_and_put_end_forms(model):
    x = prompts(2, 5)
    received: list[torch.Tensor] = []
    out = generate(model, x, 8, seed=3, streamer=lambda t: received.append(t.clone()))
    assert all(t.shape == (2,) and t.dtype == torch.long for t in received)
    assert torch.equal(torch.stack(received, dim=1), out[:, 5:])

    streamer = RecordingStreamer()
    out = generate(model, x, 8, seed=3, streamer=streamer)
    assert streamer.ended == 1 and torch.equal(torch.stack(streamer.tokens, dim=1), out[:, 5:])

    streamer = RecordingStreamer()
    generate(model, x, 0, streamer=streamer)
    assert streamer.tokens == [] and streamer.ended == 1


# ------------------------------------------------------------------------------------------------- left padding
def test_left_padded_batch_equals_each_prompt_alone(model):
    short, long = prompts(1, 4, seed=2), prompts(1, 9, seed=3)
    pad = torch.full((1, 5), 17)
    batch = torch.cat([torch.cat([pad, short], dim=1), long])
    mask = torch.ones_like(batch)
    mask[0, :5] = 0
    with record_routing(model) as rec:
        out = generate(model, batch, 12, temperature=0, attention_mask=mask)
        assert torch.equal(out[0, 9:], generate(model, short, 12, temperature=0)[0, 4:])
        assert torch.equal(out[1], generate(model, long, 12, temperature=0)[0])
    assert_no_near_tie(rec, what="padded vs alone greedy")  # fp32 padded vs alone: min top-k margin 7e-5


# ------------------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize("kwargs, name", [
    (dict(temperature=-0.5), "temperature"),
    (dict(temperature=math.nan), "temperature"),
    (dict(top_k=0), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(max_new_tokens=-1), "max_new_tokens"),
    (dict(max_new_tokens=3.0), "max_new_tokens"),
    (dict(eos_token_id=[]), "eos_token_id"),
    (dict(eos_token_id=VOCAB), "eos_token_id"),
    (dict(seed="1"), "seed"),
    (dict(attention_mask=torch.ones(2, 3)), "attention_mask"),
    (dict(attention_mask=torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])), "attention_mask"),
    (dict(input_ids=torch.tensor([1, 2, 3])), "input_ids"),
    (dict(input_ids=torch.zeros(1, 0, dtype=torch.long)), "input_ids"),
    (dict(input_ids=torch.tensor([[1, VOCAB]])), "input_ids"),
])
def test_invalid_arguments_are_named(model, kwargs, name):
    args = dict(input_ids=prompts(2, 4), max_new_tokens=3) | kwargs
    with pytest.raises(ValueError, match=name):
        generate(model, **args)


def test_sample_next_token_validates():
    with pytest.raises(ValueError, match="top_p"):
        sample_next_token(torch.zeros(1, 4), top_p=-0.1)
    with pytest.raises(ValueError, match="logits"):
        sample_next_token(torch.zeros(4))


def test_cache_grows_with_the_generated_tokens_not_max_new_tokens(model, monkeypatch):
    """`max_new_tokens` is a bound, not an allocation: a run stopped by eos after one token holds a cache sized
    for the prompt plus the first 256 positions, whatever the bound."""
    x = prompts(1, 5)
    first = generate(model, x, 1, temperature=0)[0, -1].item()
    sizes = []
    make_cache = model.make_cache
    monkeypatch.setattr(model, "make_cache", lambda B, capacity, cache_dtype: sizes.append(capacity)
                        or make_cache(B, capacity, cache_dtype))
    out = generate(model, x, 4_000_000_000, temperature=0, eos_token_id=first)
    assert out.shape == (1, 6) and sizes == [5 + 256]
    out = generate(model, x, 300, temperature=0)  # grows past the first allocation by doubling
    assert out.shape == (1, 305)


def test_decode_steps_do_not_revalidate(model, monkeypatch):
    """The prompt is checked once; the decode steps feed ids the model produced itself."""
    calls = []
    check = model.check_input_ids
    monkeypatch.setattr(model, "check_input_ids", lambda ids: calls.append(ids.shape) or check(ids))
    generate(model, prompts(2, 3), 5, temperature=0)
    assert len(calls) == 1


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_chunked_prefill_equals_one_call(model, chunk):
    """A prompt prefilled `chunk` positions per call (left-padded batch, ragged lengths) continues greedily as the
    one-call prefill does, reporting each call's progress."""
    x = prompts(2, 7)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])
    seen = []
    out = generate(model, x, 6, temperature=0, attention_mask=mask, prefill_chunk=chunk, on_prefill=seen.append)
    assert torch.equal(out, generate(model, x, 6, temperature=0, attention_mask=mask))
    assert seen == [min(end, 7) for end in range(chunk, 7 + chunk, chunk)]


@pytest.mark.parametrize("chunk", [0, -2, 1.5, True])
def test_a_bad_prefill_chunk_is_named(model, chunk):
    with pytest.raises(ValueError, match="prefill_chunk"):
        generate(model, prompts(1, 4), 2, prefill_chunk=chunk)
