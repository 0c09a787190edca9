"""The continuous-batching engine: batched == alone, prefix cache on == off, cancelled rows freed, bounded queue."""

from __future__ import annotations

import threading

import pytest
import torch

import k3
from k3.inference.engine import Engine, EngineStopped, QueueFull, SamplingParams
from k3.inference.generate import generate
from k3.inference.prefix_cache import PrefixCache
from k3.model.cache import K3Cache

TIMEOUT_S = 120


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return k3.K3ForCausalLM(k3.K3Config.from_preset("k3-tiny")).eval()


def _prompts(model, lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in lengths]


def _run(engine: Engine, prompts, params):
    """Submit every prompt at once; the generated ids and the finishing events, in submission order."""
    tokens = [[] for _ in prompts]
    ends = [None] * len(prompts)
    done = threading.Semaphore(0)

    def emit_for(i):
        def emit(event):
            if event.token_id is not None:
                tokens[i].append(event.token_id)
            if event.finish_reason is not None:
                ends[i] = event
                done.release()
        return emit
    for i, prompt in enumerate(prompts):
        engine.submit(prompt, params, emit_for(i))
    for _ in prompts:
        assert done.acquire(timeout=TIMEOUT_S), "the engine did not finish in time"
    return tokens, ends


def test_cache_rows_and_join_keep_each_sequence(model):
    """Rows taken out of a batch and joined with another cache continue exactly as the sequences alone."""
    prompts = _prompts(model, [7, 19, 4])
    alone = []
    for p in prompts:
        cache = model.make_cache(1)
        model(torch.tensor([p]), cache=cache)
        alone.append(cache)
    joined = K3Cache.join(alone)
    assert joined.length == 19 and joined.key_mask_BS[:, :19].sum(1).tolist() == [7, 19, 4]
    picked = joined.rows([2, 0])  # the 19-token row leaves: the leading padding of both is dropped
    assert picked.length == 7 and picked.key_mask_BS[:, :7].sum(1).tolist() == [4, 7]
    step = torch.tensor([[5], [9]])
    batched = model(step, cache=picked).logits[:, -1]
    for row, i in enumerate([2, 0]):
        expected = model(step[row:row + 1], cache=alone[i].clone()).logits[:, -1]
        torch.testing.assert_close(batched[row:row + 1], expected, rtol=1e-5, atol=1e-5)


def test_batched_greedy_equals_alone(model):
    """16 requests of ragged lengths (some longer than a prefill chunk) decode to the same ids as one by one."""
    prompts = _prompts(model, [5, 40, 300, 17, 3, 90, 129, 256, 1, 33, 64, 65, 7, 200, 12, 2])
    alone = [generate(model, torch.tensor([p]), 10, temperature=0)[0, len(p):].tolist() for p in prompts]
    engine = Engine(model, max_batch=16, prefill_chunk=64, prefix_cache_bytes=0).start()
    try:
        tokens, ends = _run(engine, prompts, SamplingParams(max_tokens=10, temperature=0))
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert tokens == alone
    assert all(e.finish_reason == "length" and e.completion_tokens == 10 for e in ends)
    assert stats.decode_rows / stats.decode_steps > 4  # batched: one by one would be 1 row per step


def test_a_bf16_latent_cache_batched_equals_alone(model):
    """An engine over bf16 MLA latents (`cache_dtype`; the model fp32), prompts of ragged lengths sharing a prefix
    cache: the ids `generate` decodes one prompt at a time over a bf16 cache; every cache its prefill calls write (the
    batch joins them) holds bf16 latents. A dtype the cache cannot hold is refused when the engine is made."""
    prompts = _prompts(model, [5, 130, 17, 64], seed=5)
    prompts.append(prompts[1][:100] + prompts[3][:9])  # reuses the stored prefix of the 130-token prompt
    alone = [generate(model, torch.tensor([p]), 8, temperature=0, cache_dtype=torch.bfloat16)[0, len(p):].tolist()
             for p in prompts]
    engine = Engine(model, max_batch=4, prefill_chunk=32, cache_dtype=torch.bfloat16).start()
    seen = []
    hook = model.register_forward_pre_hook(
        lambda _, args, kwargs: seen.extend(layer.latent_BSL.dtype for layer in kwargs["cache"].layers
                                            if hasattr(layer, "latent_BSL")), with_kwargs=True)
    try:
        tokens, ends = _run(engine, prompts, SamplingParams(max_tokens=8, temperature=0))
    finally:
        engine.shutdown()
        hook.remove()
    assert tokens == alone
    assert ends[-1].cached_tokens == 96
    assert seen and set(seen) == {torch.bfloat16}
    with pytest.raises(ValueError, match="the MLA latent cache is float32 or bfloat16, got torch.float16"):
        Engine(model, cache_dtype=torch.float16)


def test_prompts_of_one_length_share_a_prefill_call(model):
    """8 new prompts of 40 tokens, asking for their prompt's log-probabilities too, prefill in 2 calls of 4 rows
    (`prefill_tokens` 160) and decode to the ids they decode to one at a time; every log-probability agrees with the
    one-at-a-time run to fp32 rounding (a shared call's products take other row counts)."""
    prompts = _prompts(model, [40] * 8, seed=4)
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=1, prompt_logprobs=1)
    runs = {}
    for max_batch in (1, 8):
        engine = Engine(model, max_batch=max_batch, prefill_chunk=64, prefill_tokens=160, prefix_cache_bytes=0)
        calls = []
        hook = model.register_forward_pre_hook(lambda _, args: calls.append(tuple(args[0].shape)))
        results = [[] for _ in prompts]
        done = threading.Semaphore(0)
        for i, prompt in enumerate(prompts):  # all waiting before the engine starts: the first step admits them all
            engine.submit(prompt, params, lambda event, i=i: (results[i].append(event),
                                                              event.finish_reason and done.release()))
        engine.start()
        try:
            for _ in prompts:
                assert done.acquire(timeout=TIMEOUT_S), "the engine did not finish in time"
        finally:
            engine.shutdown()
            hook.remove()
        runs[max_batch] = results, [shape for shape in calls if shape[1] > 1]
    (alone, alone_calls), (shared, shared_calls) = runs[1], runs[8]
    assert alone_calls == [(1, 40)] * 8 and shared_calls == [(4, 40)] * 2
    for one, many in zip(alone, shared):
        assert [e.token_id for e in one] == [e.token_id for e in many]
        pairs = list(zip(_logprobs_of(one), _logprobs_of(many)))
        assert len(pairs) == 39 + 6
        for x, y in pairs:
            assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-4
            assert [t for t, _ in x.top] == [t for t, _ in y.top]


def _logprobs_of(events):
    """A sequence's prompt log-probabilities (after the first token), then its generated tokens'."""
    found = []
    for event in events:
        found += [p for p in event.prompt_logprobs or [] if p is not None]
        found += [event.logprob] if event.logprob is not None else []
    return found


def test_prefix_cache_on_equals_off(model):
    """Prompts sharing a 300-token prefix: the second and later reuse its chunks, with identical outputs."""
    shared = _prompts(model, [300], seed=2)[0]
    prompts = [shared + tail for tail in _prompts(model, [9, 30, 1], seed=3)]
    params = SamplingParams(max_tokens=8, temperature=0)
    outputs = {}
    for budget in (0, 64 << 20):
        engine = Engine(model, max_batch=1, prefill_chunk=64, prefix_cache_bytes=budget).start()
        try:
            outputs[budget] = _run(engine, prompts[:1], params) + _run(engine, prompts[1:], params)
        finally:
            engine.shutdown()
    assert outputs[0][0] + outputs[0][2] == outputs[64 << 20][0] + outputs[64 << 20][2]
    cached = [e.cached_tokens for e in outputs[64 << 20][1] + outputs[64 << 20][3]]
    assert cached == [0, 256, 256]
    assert all(e.cached_tokens == 0 for e in outputs[0][1] + outputs[0][3])


def test_prefix_cache_evicts_least_recently_used(model):
    cache = model.make_cache(1)
    model(torch.tensor([list(range(64))]), cache=cache)
    size = cache.snapshot().nbytes()
    prefixes = PrefixCache(budget_bytes=2 * size, chunk=64)
    for first in (1, 2, 3):
        c = model.make_cache(1)
        model(torch.tensor([[first] * 64]), cache=c)
        prefixes.store([first] * 64, c)
        if first == 2:
            assert prefixes.longest([1] * 64 + [0]) is not None  # 1 becomes the most recently used
    assert len(prefixes) == 2 and prefixes.nbytes <= 2 * size
    assert prefixes.longest([2] * 64 + [0]) is None  # 2 was the least recently used
    assert prefixes.longest([1] * 64 + [0]) is not None and prefixes.longest([3] * 64 + [5]) is not None
    assert prefixes.longest([3] * 64) is None  # the whole prompt cached: its last token must still be fed


def test_cancel_frees_the_row_and_queue_is_bounded(model):
    engine = Engine(model, max_batch=1, max_queue=1, prefix_cache_bytes=0).start()
    started, ended = threading.Event(), threading.Event()
    ends = []

    def emit(event):
        started.set()
        if event.finish_reason is not None:
            ends.append(event)
            ended.set()
    try:
        seq = engine.submit([1, 2, 3], SamplingParams(max_tokens=5000, temperature=0, stop_token_ids=()), emit)
        assert started.wait(TIMEOUT_S)
        engine.submit([4], SamplingParams(max_tokens=1), lambda e: None)  # waits: the batch is full
        with pytest.raises(QueueFull, match="1 sequences running and 1 waiting"):
            engine.submit([5], SamplingParams(max_tokens=1), lambda e: None)
        engine.cancel(seq)
        assert ended.wait(TIMEOUT_S)
        assert ends[0].finish_reason == "abort" and ends[0].completion_tokens < 5000
    finally:
        engine.shutdown()
    assert engine.stats().running == 0
    with pytest.raises(EngineStopped):
        engine.submit([1], SamplingParams(), lambda e: None)


def test_bad_requests_are_named(model):
    engine = Engine(model, max_context=64)
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.submit([], SamplingParams(), lambda e: None)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.submit([model.config.vocab_size], SamplingParams(), lambda e: None)
    with pytest.raises(ValueError, match="exceed the context of 64"):
        engine.submit([1] * 60, SamplingParams(max_tokens=5), lambda e: None)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=-2)
    rope = k3.K3Config.from_preset("k3-tiny", mla_use_nope=False)
    with pytest.raises(ValueError, match="RoPE"):
        Engine(k3.K3ForCausalLM(rope))


def test_a_padded_vocabulary_samples_only_decodable_ids(model):
    """A model whose vocabulary is padded beyond its tokenizer's (vocab_size): every sampled id, greedy or not, and
    every reported alternative lies below it, and greedy is the argmax over those ids; a prompt id beyond it is
    refused."""
    V = 1000
    prompts = _prompts(model, [6, 9], seed=3)
    prompts = [[t % V for t in p] for p in prompts]
    engine = Engine(model, max_batch=4, prefill_chunk=8, vocab_size=V).start()
    try:
        (greedy, _), (sampled, _) = (_run(engine, prompts, SamplingParams(max_tokens=6, temperature=t, seed=1))
                                     for t in (0.0, 1.5))
        assert all(t < V for row in greedy + sampled for t in row)
        with torch.no_grad():
            logits = model(torch.tensor([prompts[0]])).logits[0, -1]
        assert int(logits.argmax()) >= V  # the unmasked choice would have been undecodable: the mask matters
        assert greedy[0][0] == int(logits[:V].argmax())
        with pytest.raises(ValueError, match="outside the vocabulary"):
            engine.submit([V + 5], SamplingParams(max_tokens=1), lambda event: None)
    finally:
        engine.shutdown(grace_s=0)
    with pytest.raises(ValueError, match="vocab_size"):
        Engine(model, vocab_size=model.config.vocab_size + 1)


def test_start_built_runs_the_engine_in_the_thread_that_built_it(model):
    """`Engine.start_built`: the model is loaded and run by one thread (the one the engine runs in); a failure of
    the build reaches the caller."""
    builders = []

    def build():
        builders.append(threading.current_thread())
        return Engine(model, max_batch=2)
    engine = Engine.start_built(build)
    try:
        assert builders == [engine._thread] and engine.running() and builders[0] is not threading.current_thread()
        tokens, _ = _run(engine, _prompts(model, [5]), SamplingParams(max_tokens=3, temperature=0.0))
        assert len(tokens[0]) == 3
    finally:
        engine.shutdown(grace_s=0)
    assert not engine.running()

    def broken():
        raise ValueError("checkpoint directory 'x' does not exist")
    with pytest.raises(ValueError, match="does not exist"):
        Engine.start_built(broken)
