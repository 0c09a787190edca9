"""A continuous-batching engine: many sequences decoded together, one batched model call per token.

The scheduler (`Engine._schedule`) runs in one thread and owns the model. Each iteration it
1. drops the sequences that finished or were cancelled from the batch (their cache rows are freed at once),
2. admits waiting requests while the batch has room (`max_batch`),
3. prefills the next chunk (up to a multiple of `prefill_chunk` positions) of the oldest admitted prompts, about
   `prefill_tokens` positions in all, so a long prompt interleaves with decoding instead of stalling the running
   streams; prompts whose chunks cover the same positions (a burst of new prompts of one length) share one call as
   the rows of a batch, reading the weights once, and a prompt whose prefill completes joins the batch,
4. decodes one token for every running sequence in one call.

Every sequence keeps its own KDA states and MLA latents in one row of the batch's `K3Cache`; rows are right-aligned
(a shorter sequence's first positions are padding), which K3's position-free MLA allows: a sequence's keys may sit
at any position of its row. The batch's positions are those of its longest live sequence, so the cache holds
`rows × longest live sequence`, and a finished sequence's row is dropped before the next step. Prompts prefill on
their own single-row cache (a shared call's rows are taken apart after it), reusing the state of a stored prefix
when there is one (`k3.inference.prefix_cache`). Decode steps are bit for bit the same whatever else runs (the
compiled step takes each row alone); a shared prefill call agrees with the prompt's own call to fp32 rounding, as
its products take other row counts (and, for the routed experts, other kernels).

Requests come from other threads (`submit`, `cancel`); each sequence reports its tokens through its `emit`
callback, called from the engine thread. Shape suffixes (`x_BTD`): the legend at the top of docs/architecture.md.
"""

from __future__ import annotations

import itertools
import math
import queue
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from k3.inference.compiled_step import decode_one_token
from k3.inference.generate import _check_sampling_args, sample_next_token
from k3.inference.prefix_cache import PrefixCache
from k3.model import K3ForCausalLM, K3ForConditionalGeneration
from k3.model.cache import K3Cache, check_cache_dtype


class QueueFull(RuntimeError):
    """The engine holds `max_batch` running and `max_queue` waiting sequences already."""


class EngineStopped(RuntimeError):
    """The engine no longer admits requests (it is shutting down)."""


@dataclass(frozen=True)
class SamplingParams:
    """How one sequence is continued (see `k3.inference.generate.sample_next_token`)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None  # report the chosen token's log-probability and this many alternatives
    prompt_logprobs: int | None = None  # ... the same for each prompt token after the first (echo)

    def __post_init__(self) -> None:
        _check_sampling_args(self.temperature, self.top_k, self.top_p)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be an integer >= 0 or None, got {value!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise ValueError(f"max_tokens must be an integer >= 0, got {self.max_tokens!r}")


@dataclass
class TokenLogprob:
    """A token with its log-probability under the model and the `top` most likely tokens at its position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Event:
    """What a sequence reports: prompt log-probabilities (once, first), a generated token, or its end."""

    token_id: int | None = None
    logprob: TokenLogprob | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finish_reason: str | None = None  # "stop" (a stop token), "length" (max_tokens or the context), "abort"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


@dataclass
class EngineSequence:
    """One sequence in the engine: its prompt, how to sample it and where it stands."""

    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    emit: Callable[[Event], None]
    media: dict = field(default_factory=dict)
    generator: torch.Generator | None = None
    cache: K3Cache | None = None  # its own cache while prefilling; then a row of the batch's
    prefilled: int = 0
    cached_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    cancelled: bool = False
    finished: bool = False
    submitted: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None


@dataclass
class EngineStats:
    """Counters of one engine since it started (read by the server's /metrics)."""

    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    waiting: int = 0
    running: int = 0
    prefilling: int = 0
    max_batch: int = 1
    decode_steps: int = 0
    decode_rows: int = 0
    time_to_first_token: list[float] = field(default_factory=list)
    prefix_lookups: int = 0
    prefix_hits: int = 0
    prefix_tokens_reused: int = 0
    prefix_bytes: int = 0
    tokens_per_second: float = 0.0  # generated tokens over the last RATE_WINDOW_S seconds


TTFT_WINDOW = 1024  # time-to-first-token samples kept for /metrics (the newest)
RATE_WINDOW_S = 10.0  # the window of the generated tokens/s in /metrics


class Engine:
    """Continuous batching over one model; thread-safe `submit` / `cancel`, the model used by one thread only.

    `max_context`: positions a sequence may reach (prompt + generated); `prefill_chunk`: the chunk of a prompt one
    call prefills (and the prefix cache's granularity); `prefill_tokens`: prompt positions prefilled between two
    decode steps (a chunk of each of the oldest prompts, at least one chunk); `max_queue`: waiting requests beyond
    the running batch before `submit` raises QueueFull; `prefix_cache_bytes`: the prefix cache's budget (0: off);
    `on_idle`: called from the engine thread after each `idle_s` seconds with nothing to run (expert-parallel
    serving tells its other ranks to wait on, `k3.parallel.expert_serving`); `vocab_size`: sample (and report
    log-probabilities) over the ids below it only, those the tokenizer can decode, where the model's vocabulary is
    padded beyond the tokenizer's (default: the model's); `cache_dtype`: the MLA latents' dtype (fp32 or bf16;
    default: the model's).
    """

    def __init__(self, model: K3ForCausalLM | K3ForConditionalGeneration, *, max_batch: int = 16,
                 max_queue: int = 64, max_context: int = 8192, prefill_chunk: int = 256, prefill_tokens: int = 1024,
                 prefix_cache_bytes: int = 256 << 20, on_idle: Callable[[], None] | None = None,
                 idle_s: float = 30.0, vocab_size: int | None = None, cache_dtype: torch.dtype | None = None):
        if not model.config.mla_use_nope:
            raise ValueError("the batching engine moves a sequence's cached keys to other positions, which only "
                             "position-free MLA allows; this model's MLA uses RoPE (mla_use_nope = false)")
        for name, value in (("max_batch", max_batch), ("max_context", max_context), ("prefill_chunk", prefill_chunk),
                            ("prefill_tokens", prefill_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"max_queue must be an integer >= 0, got {max_queue!r}")
        self.model, self.max_batch, self.max_queue = model, max_batch, max_queue
        self.max_context, self.prefill_chunk, self.prefill_tokens = max_context, prefill_chunk, prefill_tokens
        self.on_idle, self.idle_s = on_idle, idle_s
        self.cache_dtype = check_cache_dtype(cache_dtype)
        self.prefix_cache = PrefixCache(prefix_cache_bytes, prefill_chunk)
        if vocab_size is not None and not 1 <= vocab_size <= model.config.vocab_size:
            raise ValueError(f"vocab_size must be in 1..{model.config.vocab_size} (the model's), got {vocab_size!r}")
        self.vocab_size = vocab_size or model.config.vocab_size
        self.suppress_ids = [model.media_placeholder_token_id] if isinstance(model, K3ForConditionalGeneration) \
            and model.media_placeholder_token_id < self.vocab_size else []
        self._ids = itertools.count()
        self._lock = threading.Condition()
        self._waiting: deque[EngineSequence] = deque()
        self._prefilling: deque[EngineSequence] = deque()
        self._running: list[EngineSequence] = []  # in the order of the batch cache's rows
        self._batch: K3Cache | None = None
        self._accepting, self._stopping = True, False
        self._stats = EngineStats(max_batch=max_batch)
        self._token_times: deque[float] = deque()  # when each token of the last RATE_WINDOW_S seconds was sampled
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    # ----------------------------------------------------------------------------------- other threads
    def start(self) -> Engine:
        return Engine.start_built(lambda: self)

    @staticmethod
    def start_built(build: Callable[[], Engine]) -> Engine:
        """Call `build` (load a model, make its Engine) in a new thread that then runs the engine it made; returns
        the engine once built, or raises what `build` raised. On a CPU the thread that loads a model should be the
        one that runs it: a thread whose first parallel region comes after another thread's (a model loaded in the
        main thread) ran k3-small's decode step at 1.4-1.5x the time on 2 cores."""
        built: queue.Queue = queue.Queue(maxsize=1)

        def body() -> None:
            try:
                engine = build()
            except BaseException as error:  # handed to the caller
                built.put(error)
                return
            engine._thread = threading.current_thread()
            built.put(engine)
            engine._run()
        threading.Thread(target=body, name="k3-engine", daemon=True).start()
        result = built.get()
        if isinstance(result, BaseException):
            raise result
        return result

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams, emit: Callable[[Event], None],
               media: dict | None = None) -> int:
        """Queue a sequence; returns its id. Raises ValueError for a prompt the engine cannot take, QueueFull when
        the queue is full, EngineStopped after `shutdown`."""
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("the prompt is empty")
        vocab = self.vocab_size
        if not all(0 <= t < vocab for t in prompt):
            raise ValueError(f"the prompt holds token ids outside the vocabulary 0..{vocab - 1}")
        if len(prompt) + params.max_tokens > self.max_context:
            raise ValueError(f"the prompt's {len(prompt)} tokens plus max_tokens {params.max_tokens} exceed the "
                             f"context of {self.max_context} tokens")
        if params.prompt_logprobs is not None and media:
            raise ValueError("prompt log-probabilities (echo) are not available for prompts with images")
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        seq = EngineSequence(next(self._ids), prompt, params, emit, dict(media or {}),
                             torch.Generator().manual_seed(seed))
        with self._lock:
            if not self._accepting:
                raise EngineStopped("the server is shutting down")
            busy = len(self._running) + len(self._prefilling)
            if len(self._waiting) >= self.max_queue + max(0, self.max_batch - busy):
                raise QueueFull(f"{busy} sequences running and {len(self._waiting)} waiting (--max-batch "
                                f"{self.max_batch}, queue {self.max_queue})")
            self._waiting.append(seq)
            self._stats.requests += 1
            self._stats.prompt_tokens += len(prompt)
            self._lock.notify_all()
        return seq.seq_id

    def cancel(self, seq_id: int) -> None:
        """Stop a sequence (its client left, or a stop string was found); its row is freed before the next step."""
        with self._lock:
            for seq in itertools.chain(self._waiting, self._prefilling, self._running):
                if seq.seq_id == seq_id:
                    seq.cancelled = True
            self._lock.notify_all()

    def stats(self) -> EngineStats:
        with self._lock:
            s = self._stats
            s.waiting, s.running, s.prefilling = len(self._waiting), len(self._running), len(self._prefilling)
            p = self.prefix_cache
            s.prefix_lookups, s.prefix_hits, s.prefix_tokens_reused, s.prefix_bytes = \
                p.lookups, p.hits, p.tokens_reused, p.nbytes
            self._trim_token_times(time.perf_counter())
            s.tokens_per_second = len(self._token_times) / RATE_WINDOW_S
            return EngineStats(**{**s.__dict__, "time_to_first_token": list(s.time_to_first_token)})

    def running(self) -> bool:
        """True while the engine thread is alive (it ends at `shutdown` or when the model fails: see `error`)."""
        return self._thread is not None and self._thread.is_alive()

    def shutdown(self, grace_s: float = 30.0) -> None:
        """Stop admitting, let the sequences under way finish for up to `grace_s` seconds, abort the rest, stop."""
        with self._lock:
            self._accepting = False
            self._lock.wait_for(lambda: not (self._waiting or self._prefilling or self._running)
                                or self._thread is None or not self._thread.is_alive(), timeout=grace_s)
            self._stopping = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join()

    # ----------------------------------------------------------------------------------- the engine thread
    def _run(self) -> None:
        try:
            with torch.no_grad():
                while self._schedule():
                    pass
        except BaseException as error:  # the model failed: every sequence ends, the server reports unhealthy
            self.error = error
        finally:
            with self._lock:
                for seq in itertools.chain(self._waiting, self._prefilling, self._running):
                    if not seq.finished:
                        self._finish(seq, "abort")
                self._waiting.clear(), self._prefilling.clear(), self._running.clear()
                self._batch = None
                self._lock.notify_all()

    def _schedule(self) -> bool:
        """One iteration; False when the engine is to stop."""
        with self._lock:
            work = self._lock.wait_for(lambda: bool(self._stopping or self._waiting or self._prefilling
                                                    or self._running),
                                       timeout=None if self.on_idle is None else self.idle_s)
            if self._stopping:
                return False
            self._drop_ended()
            while self._waiting and len(self._running) + len(self._prefilling) < self.max_batch:
                seq = self._waiting.popleft()
                if seq.cancelled:
                    self._finish(seq, "abort")
                else:
                    self._prefilling.append(seq)
            self._lock.notify_all()
            prefilling = list(self._prefilling)
        budget = self.prefill_tokens  # one chunk of each of the oldest prompts, about this many positions in all
        while prefilling and budget > 0:
            group = self._prefill_group(prefilling, budget)
            prefilling = [seq for seq in prefilling if all(seq is not g for g in group)]
            budget -= self._prefill_chunk(group)
        if self._running:
            self._decode_step()
        if not work:  # on_idle is set and nothing arrived for idle_s seconds
            self.on_idle()
        return True

    def _drop_ended(self) -> None:
        for seq in [s for s in self._prefilling if s.cancelled]:
            self._prefilling.remove(seq)
            self._finish(seq, "abort")
        keep = [i for i, seq in enumerate(self._running) if not (seq.cancelled or seq.finished)]
        for seq in self._running:
            if seq.cancelled and not seq.finished:
                self._finish(seq, "abort")
        if len(keep) < len(self._running):
            self._batch = self._batch.rows(keep) if keep else None
            self._running = [self._running[i] for i in keep]

    def _next_chunk(self, seq: EngineSequence) -> tuple[int, int]:
        """The positions [start, end) of `seq`'s prompt that its next prefill call takes: up to the next chunk
        boundary (a prompt with media: all of it in one call). The first call finds its cache: a stored prefix's
        state, or a new one."""
        if seq.cache is None:
            seq.cache = None if seq.params.prompt_logprobs is not None or seq.media else \
                self.prefix_cache.longest(seq.prompt_ids)
            if seq.cache is None:
                seq.cache = self.model.make_cache(1, capacity=len(seq.prompt_ids) + 1, cache_dtype=self.cache_dtype)
            seq.prefilled = seq.cached_tokens = seq.cache.length
            seq.prompt_logprobs = [None]
        boundary = (seq.prefilled // self.prefill_chunk + 1) * self.prefill_chunk  # whole chunks: a prompt's calls
        # are the same whether or not its prefix came from the cache
        return seq.prefilled, len(seq.prompt_ids) if seq.media else min(boundary, len(seq.prompt_ids))

    def _prefill_group(self, prefilling: list[EngineSequence], budget: int) -> list[EngineSequence]:
        """The oldest prompt in `prefilling` and the others whose next chunk has the same positions (so one call
        takes them as rows of a batch, no padding), as many as `budget` positions hold; prompts with media alone."""
        first = prefilling[0]
        chunk, keep = self._next_chunk(first), first.params.prompt_logprobs is None
        group = [first]
        for seq in [] if first.media else prefilling[1:]:
            if (len(group) + 1) * (chunk[1] - chunk[0]) > budget:
                break
            if not seq.media and (seq.params.prompt_logprobs is None) == keep and self._next_chunk(seq) == chunk:
                group.append(seq)
        return group

    def _prefill_chunk(self, group: list[EngineSequence]) -> int:
        """Prefill the next chunk of each prompt in `group` (`_prefill_group`: the same positions) in one call;
        returns the positions prefilled."""
        start, end = self._next_chunk(group[0])
        cache = group[0].cache if len(group) == 1 else K3Cache.join([seq.cache for seq in group])
        ids = torch.tensor([seq.prompt_ids[start:end] for seq in group])
        keep = 0 if group[0].params.prompt_logprobs is not None else 1  # the prompt's logits only where asked for
        logits_BTV = self.model(ids, cache=cache, validate=False, logits_to_keep=keep,
                                **group[0].media).logits[..., :self.vocab_size]
        for i, seq in enumerate(group):
            if len(group) > 1:
                seq.cache = cache.rows([i])
            self._prefilled(seq, end, logits_BTV[i])
        return len(group) * (end - start)

    def _prefilled(self, seq: EngineSequence, end: int, logits_TV: torch.Tensor) -> None:
        """`seq`'s prompt is prefilled up to `end`, with these logits: store the prefix, and at the prompt's end
        sample its first token and move it into the running batch."""
        if seq.params.prompt_logprobs is not None:
            targets = seq.prompt_ids[seq.prefilled + 1: end + 1]
            seq.prompt_logprobs += _logprobs(logits_TV[: len(targets)], targets, seq.params.prompt_logprobs)
        seq.prefilled = end
        if not seq.media and end % self.prefill_chunk == 0:
            self.prefix_cache.store(seq.prompt_ids[:end], seq.cache)
        if end < len(seq.prompt_ids):
            return
        if seq.params.prompt_logprobs is not None:
            seq.emit(Event(prompt_logprobs=seq.prompt_logprobs))
        if seq.params.max_tokens > 0:
            self._sample(seq, logits_TV[-1])
        with self._lock:  # from prefilling to running (or gone) at once: `submit` never sees the row free meanwhile
            self._prefilling.remove(seq)
            if seq.params.max_tokens == 0:
                self._finish(seq, "length")
            elif not seq.finished:
                cache, seq.cache = seq.cache, None
                self._batch = cache if self._batch is None else K3Cache.join([self._batch, cache])
                self._running.append(seq)

    def _decode_step(self) -> None:
        """One token for every running sequence, in one model call."""
        ids_B1 = torch.tensor([[seq.output_ids[-1]] for seq in self._running])
        logits_BV = decode_one_token(self.model, ids_B1, self._batch)[:, -1, :self.vocab_size]
        self._stats.decode_steps += 1
        self._stats.decode_rows += len(self._running)
        for seq, logits_V in zip(self._running, logits_BV):
            if not seq.cancelled:
                self._sample(seq, logits_V)

    def _sample(self, seq: EngineSequence, logits_V: torch.Tensor) -> None:
        """Choose `seq`'s next token from `logits_V`, report it, and end the sequence where it stops."""
        if self.suppress_ids:
            logits_V = logits_V.index_fill(-1, torch.tensor(self.suppress_ids), -math.inf)
        p = seq.params
        token = int(sample_next_token(logits_V[None], p.temperature, p.top_k, p.top_p, seq.generator)[0])
        logprob = None if p.logprobs is None else _logprobs(logits_V[None], [token], p.logprobs)[0]
        seq.output_ids.append(token)
        if seq.first_token_at is None:
            seq.first_token_at = time.perf_counter()
            ttft = self._stats.time_to_first_token
            ttft.append(seq.first_token_at - seq.submitted)
            del ttft[:-TTFT_WINDOW]
        self._stats.generated_tokens += 1
        now = time.perf_counter()
        with self._lock:
            self._token_times.append(now)
            self._trim_token_times(now)
        seq.emit(Event(token_id=token, logprob=logprob))
        if token in p.stop_token_ids:
            self._finish(seq, "stop")
        elif len(seq.output_ids) >= p.max_tokens or len(seq.prompt_ids) + len(seq.output_ids) >= self.max_context:
            self._finish(seq, "length")

    def _trim_token_times(self, now: float) -> None:
        while self._token_times and self._token_times[0] < now - RATE_WINDOW_S:
            self._token_times.popleft()

    def _finish(self, seq: EngineSequence, reason: str) -> None:
        seq.finished, seq.cache = True, None
        with self._lock:
            self._lock.notify_all()  # `shutdown` waits for the last sequence to end
        seq.emit(Event(finish_reason=reason, prompt_tokens=len(seq.prompt_ids),
                       completion_tokens=len(seq.output_ids), cached_tokens=seq.cached_tokens))


def _logprobs(logits_TV: torch.Tensor, targets: Sequence[int], top: int) -> list[TokenLogprob]:
    """Each target's log-probability under its row of logits, and the row's `top` most likely tokens."""
    logp_TV = torch.log_softmax(logits_TV.float(), dim=-1)
    chosen_T = logp_TV[torch.arange(len(targets)), torch.tensor(list(targets), dtype=torch.long)]
    best = logp_TV.topk(top, dim=-1) if top else None
    return [TokenLogprob(t, float(chosen_T[i]),
                         [] if best is None else list(zip(best.indices[i].tolist(), best.values[i].tolist())))
            for i, t in enumerate(targets)]
