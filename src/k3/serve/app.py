"""The HTTP server: the OpenAI API over a continuous-batching `Engine` (docs/architecture.md, "Serving").

`create_app` builds a FastAPI application; `k3 serve` runs it under uvicorn. Handlers never run the model: they
turn a request into engine sequences (one per prompt and sample, `n`), and the engine's events into the API's JSON
or server-sent events. Every failure a client can cause is an OpenAI-style error with a 4xx status; a stream whose
client disconnects cancels its sequences, which frees their batch rows before the next step.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import io
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from k3.inference.engine import Engine, EngineStopped, Event, QueueFull, SamplingParams, TokenLogprob
from k3.serve.chat import ChatRenderer, ReplyParser, has_chat_format
from k3.serve.metrics import render_metrics
from k3.serve.protocol import APIError, ChatRequest, CompletionRequest, parse
from k3.serve.text import TextStream
from k3.tokenizer import K3Tokenizer

CHAT_PAGE = (Path(__file__).parent / "chat.html").read_text(encoding="utf-8")  # GET /: plain HTML + JS, no build
ROUTES = ("/", "/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions")
MAX_BODY_BYTES = 16 << 20  # a request body above this is refused with 413 (an image as a data: URI fits)


@dataclass
class ServerState:
    engine: Engine
    tokenizer: K3Tokenizer
    model_name: str
    api_key: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    processor: Any = None  # a K3Processor for a vision checkpoint, else None
    created: int = field(default_factory=lambda: int(time.time()))
    http_requests: dict[tuple[str, int], int] = field(default_factory=dict)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return tuple(t for t in (self.tokenizer.eos_token_id, self.tokenizer.eod_token_id) if t is not None)


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="k3", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.k3 = state

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(APIError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def server_error(request: Request, e: Exception) -> JSONResponse:
        return JSONResponse(APIError(500, f"internal error: {type(e).__name__}: {e}").body(), status_code=500)

    @app.middleware("http")
    async def count(request: Request, call_next):
        response = await call_next(request)
        path = request.url.path if request.url.path in ROUTES else "other"  # a bounded set of labels
        key = (path, response.status_code)
        state.http_requests[key] = state.http_requests.get(key, 0) + 1
        return response

    @app.get("/")
    async def chat_page() -> HTMLResponse:
        return HTMLResponse(CHAT_PAGE)

    @app.get("/health")
    async def health() -> JSONResponse:
        alive = state.engine.error is None and state.engine.running()
        return JSONResponse({"status": "ok" if alive else "engine stopped"}, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(render_metrics(state.engine.stats(), state.http_requests),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        _authorise(state, request)
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                            "owned_by": "k3", "max_model_len": state.engine.max_context,
                                            "capabilities": {"vision": state.processor is not None}}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        _authorise(state, request)
        req = parse(CompletionRequest, await _json_body(state, request))
        _check_model(state, req.model)
        prompts = _prompt_ids(state.tokenizer, req.prompt)
        return await _serve(state, request, req, [CompletionChoice(state, p, req) for p in prompts
                                                  for _ in range(req.n)])

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        _authorise(state, request)
        req = parse(ChatRequest, await _json_body(state, request))
        _check_model(state, req.model)
        prompt, media = _render_chat(state, req)
        return await _serve(state, request, req, [ChatChoice(state, prompt, req, media) for _ in range(req.n)])

    return app


# ------------------------------------------------------------------------------------------------ requests
def _authorise(state: ServerState, request: Request) -> None:
    if state.api_key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), state.api_key.encode()):
        raise APIError(401, "missing or wrong API key (send Authorization: Bearer KEY)",
                       headers={"WWW-Authenticate": "Bearer"})


async def _json_body(state: ServerState, request: Request) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > state.max_body_bytes:
        raise APIError(413, f"the request body of {int(declared)} bytes is over the limit of "
                            f"{state.max_body_bytes} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > state.max_body_bytes:
            raise APIError(413, f"the request body is over the limit of {state.max_body_bytes} bytes")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None


def _check_model(state: ServerState, name: str | None) -> None:
    if name is not None and name != state.model_name:
        raise APIError(404, f"the model {name!r} does not exist; this server serves {state.model_name!r}", "model",
                       kind="model_not_found")


def _prompt_ids(tokenizer: K3Tokenizer, prompt: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        prompts = [tokenizer.encode(prompt)]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [list(prompt)]
    else:
        prompts = [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt]
    if not prompts or any(not p for p in prompts):
        raise APIError(400, "the prompt is empty", "prompt")
    vocab = tokenizer.vocab_size
    if any(not 0 <= t < vocab for p in prompts for t in p):
        raise APIError(400, f"the prompt holds token ids outside the vocabulary 0..{vocab - 1}", "prompt")
    return prompts


def _render_chat(state: ServerState, req: ChatRequest) -> tuple[list[int], dict]:
    if not has_chat_format(state.tokenizer):
        raise APIError(400, "this checkpoint's tokenizer has no chat format (no XTML markers); use /v1/completions",
                       "messages")
    renderer = ChatRenderer(state.tokenizer)
    messages, images = [], []
    for i, message in enumerate(req.messages):
        parts: list = []
        content = message.content if isinstance(message.content, list) else [message.content or ""]
        for j, part in enumerate(content):
            if isinstance(part, str):
                parts.append(part)
            elif part.type == "text":
                parts.append(part.text or "")
            else:
                where = f"messages[{i}].content[{j}]"
                if state.processor is None:
                    raise APIError(400, f"{where}: this model is text-only and cannot take images", "messages")
                if part.image_url is None:
                    raise APIError(400, f"{where}: an image_url part needs image_url.url", "messages")
                images.append(_data_uri_image(part.image_url.url, where))
                parts.append(ChatRenderer.IMAGE)
        role = "system" if message.role == "developer" else message.role
        messages.append((role, parts))
    pieces = renderer.render(messages, req.reasoning_effort)
    if not images:
        return pieces, {}
    return _expand_images(state, pieces, images)


def _data_uri_image(url: str, where: str):
    from PIL import Image

    if not url.startswith("data:"):
        raise APIError(400, f"{where}: only data: URIs are accepted for images (the server fetches no URL)",
                       "messages")
    header, comma, payload = url[5:].partition(",")
    if not comma or not header.endswith(";base64"):
        raise APIError(400, f"{where}: the image must be a base64 data: URI (data:image/png;base64,...)", "messages")
    try:
        data = base64.b64decode(payload, validate=True)
        image = Image.open(io.BytesIO(data))
        image.load()
    except (binascii.Error, ValueError) as e:
        raise APIError(400, f"{where}: the image's base64 is invalid: {e}", "messages") from None
    except Exception as e:  # Pillow's decoders raise OSError and others for a file that is not an image
        raise APIError(400, f"{where}: cannot decode the image: {e}", "messages") from None
    return image


def _expand_images(state: ServerState, pieces: list, images: list) -> tuple[list[int], dict]:
    import torch

    ids, items, n_images = [], [], 0
    for piece in pieces:
        if piece is ChatRenderer.IMAGE:
            image = images[n_images]
            try:
                framing, new_items = state.processor.encode_image(image, f"image {n_images}")
            except ValueError as e:
                raise APIError(400, str(e), "messages") from None
            finally:
                image.close()
            ids += framing
            items += new_items
            n_images += 1
        else:
            ids.append(piece)
    pixel_values = torch.cat([item.pixel_values for item in items])
    grid_thws = torch.tensor([item.grid_thw for item in items], dtype=torch.long)
    return ids, {"pixel_values": pixel_values, "grid_thws": grid_thws}


# ------------------------------------------------------------------------------------------------ choices
class Choice:
    """One sequence of a request: what it was asked, what has come back, and its part of the response."""

    def __init__(self, state: ServerState, prompt: list[int], req: Any, logprobs: int | None,
                 prompt_logprobs: int | None, media: dict | None = None):
        self.state, self.prompt, self.req, self.media = state, prompt, req, media or {}
        max_tokens = req.max_tokens
        if isinstance(req, ChatRequest) and req.max_completion_tokens is not None:
            max_tokens = req.max_completion_tokens
        if max_tokens is None:
            max_tokens = max(0, state.engine.max_context - len(prompt))
        top_k = None if req.top_k in (None, -1, 0) else req.top_k
        self.params = SamplingParams(max_tokens=max_tokens, temperature=1.0 if req.temperature is None else
                                     req.temperature, top_k=top_k, top_p=req.top_p, seed=req.seed,
                                     stop_token_ids=state.stop_ids, logprobs=logprobs,
                                     prompt_logprobs=prompt_logprobs)
        self.text = TextStream(state.tokenizer, req.stops())
        self.seq_id: int | None = None
        self.finish_reason: str | None = None
        self.usage = (0, 0, 0)

    def seed_offset(self, index: int) -> None:
        if self.req.seed is not None and index:  # the n samples of one seeded request differ, reproducibly
            self.params = SamplingParams(**{**self.params.__dict__, "seed": self.req.seed + index})

    def on_event(self, event: Event) -> dict | None:
        """The event as this choice's part of a stream chunk (None: nothing to send yet)."""
        raise NotImplementedError

    def result(self) -> dict:
        raise NotImplementedError


class CompletionChoice(Choice):
    def __init__(self, state: ServerState, prompt: list[int], req: CompletionRequest):
        echo_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
        super().__init__(state, prompt, req, req.logprobs, echo_logprobs)
        self.tokens: list[TokenLogprob] = []
        self.all_text = ""
        self.echoed = not req.echo

    def on_event(self, event: Event) -> dict | None:
        delta, logprobs = "", []
        if not self.echoed and (event.prompt_logprobs is not None or self.params.prompt_logprobs is None):
            self.echoed, delta = True, self.state.tokenizer.decode(self.prompt)  # echo: the prompt comes first
            if event.prompt_logprobs is not None:
                logprobs = [TokenLogprob(self.prompt[0], None, None), *event.prompt_logprobs[1:]]
        if event.token_id is not None and not self.text.stopped:
            delta += self.text.push(event.token_id)
            logprobs.append(event.logprob)
        if event.finish_reason is not None:
            delta += self.text.finish()
        if self.text.stopped and self.finish_reason is None:
            self.finish_reason = "stop"
        self.all_text += delta
        shown = [lp for lp in logprobs if lp is not None]
        self.tokens += shown
        chunk = {"text": delta, "logprobs": self._logprobs(shown) if shown else None, "finish_reason": None}
        return chunk if delta or shown else None

    def _logprobs(self, entries: Sequence[TokenLogprob]) -> dict:
        tok = self.state.tokenizer
        return {"tokens": [tok.decode([e.token_id]) for e in entries],
                "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [None if e.top is None else {tok.decode([t]): lp for t, lp in e.top}
                                 for e in entries]}

    def result(self) -> dict:
        return {"text": self.all_text, "logprobs": self._logprobs(self.tokens) if self.req.logprobs is not None
                else None, "finish_reason": self.finish_reason}


class ChatChoice(Choice):
    def __init__(self, state: ServerState, prompt: list[int], req: ChatRequest, media: dict):
        top = (req.top_logprobs or 0) if req.logprobs else None
        super().__init__(state, prompt, req, top, None, media)
        self.parser = ReplyParser(ChatRenderer(state.tokenizer))
        self.reasoning = TextStream(state.tokenizer)
        self.content, self.reasoning_text, self.tokens = "", "", []
        self.started = False

    def on_event(self, event: Event) -> dict | None:
        delta: dict[str, Any] = {}
        if not self.started:
            self.started, delta["role"] = True, "assistant"
        content, reasoning, logprobs = "", "", []
        if event.token_id is not None and not self.text.stopped:
            route = self.parser.route(event.token_id)
            if route == "content":
                content = self.text.push(event.token_id)
                if event.logprob is not None:
                    logprobs.append(event.logprob)
            elif route == "reasoning":
                reasoning = self.reasoning.push(event.token_id)
        if event.finish_reason is not None:
            content += self.text.finish()
            reasoning += self.reasoning.finish()
        if self.text.stopped and self.finish_reason is None:
            self.finish_reason = "stop"
        self.content += content
        self.reasoning_text += reasoning
        self.tokens += logprobs
        if content:
            delta["content"] = content
        if reasoning:
            delta["reasoning_content"] = reasoning
        if not delta:
            return None
        return {"delta": delta, "logprobs": {"content": self._logprobs(logprobs)} if self.params.logprobs is not None
                and logprobs else None, "finish_reason": None}

    def _logprobs(self, entries: Sequence[TokenLogprob]) -> list[dict]:
        tok = self.state.tokenizer

        def one(token_id: int, logprob: float) -> dict:
            raw = tok.token_bytes(token_id)
            return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}
        return [{**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries]

    def result(self) -> dict:
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning_text:
            message["reasoning_content"] = self.reasoning_text
        return {"message": message, "logprobs": {"content": self._logprobs(self.tokens)}
                if self.params.logprobs is not None else None, "finish_reason": self.finish_reason}


# ------------------------------------------------------------------------------------------------ serving
async def _serve(state: ServerState, request: Request, req: Any, choices: list[Choice]) -> Response:
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
    chat = isinstance(req, ChatRequest)
    for index, choice in enumerate(choices):
        choice.seed_offset(index)
    try:
        for index, choice in enumerate(choices):
            choice.seq_id = state.engine.submit(
                choice.prompt, choice.params,
                lambda event, i=index: loop.call_soon_threadsafe(events.put_nowait, (i, event)), choice.media)
    except (QueueFull, EngineStopped, ValueError) as e:
        for choice in choices:
            if choice.seq_id is not None:
                state.engine.cancel(choice.seq_id)
        if isinstance(e, QueueFull):
            raise APIError(429, f"the server is busy: {e}; retry later", headers={"Retry-After": "1"}) from None
        if isinstance(e, EngineStopped):
            raise APIError(503, str(e), headers={"Retry-After": "5"}) from None
        raise APIError(400, str(e), "max_tokens" if "max_tokens" in str(e) else "messages" if chat else "prompt") \
            from None
    response_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    header = {"id": response_id, "object": "chat.completion.chunk" if chat else "text_completion",
              "created": int(time.time()), "model": state.model_name}
    if req.stream:
        return StreamingResponse(_stream(state, req, choices, events, header), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    try:
        await _collect(state, request, choices, events)
    finally:
        _cancel_unfinished(state, choices)
    header["object"] = "chat.completion" if chat else "text_completion"
    return JSONResponse({**header, "choices": [{"index": i, **c.result()} for i, c in enumerate(choices)],
                         "usage": _usage(choices)})


def _handle(state: ServerState, choices: list[Choice], index: int, event: Event) -> dict | None:
    choice = choices[index]
    part = choice.on_event(event)
    if choice.text.stopped and choice.seq_id is not None and event.finish_reason is None:
        state.engine.cancel(choice.seq_id)  # a stop string: the engine ends the sequence, reported as "stop"
    if event.finish_reason is not None:
        if choice.finish_reason is None:
            choice.finish_reason = event.finish_reason
        choice.usage = (event.prompt_tokens, event.completion_tokens, event.cached_tokens)
        choice.seq_id = None
    return part


async def _collect(state: ServerState, request: Request, choices: list[Choice],
                   events: asyncio.Queue[tuple[int, Event]]) -> None:
    while any(c.seq_id is not None for c in choices):
        try:
            index, event = await asyncio.wait_for(events.get(), timeout=0.5)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                return
            continue
        _handle(state, choices, index, event)


async def _stream(state: ServerState, req: Any, choices: list[Choice], events: asyncio.Queue[tuple[int, Event]],
                  header: dict) -> AsyncIterator[str]:
    def sse(payload: dict) -> str:
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
    try:
        while any(c.seq_id is not None for c in choices):
            index, event = await events.get()
            part = _handle(state, choices, index, event)
            if part is not None:
                yield sse({**header, "choices": [{"index": index, **part}]})
            if event.finish_reason is not None:
                end = {"delta": {}} if isinstance(req, ChatRequest) else {"text": ""}
                yield sse({**header, "choices": [{"index": index, **end, "logprobs": None,
                                                  "finish_reason": choices[index].finish_reason}]})
        if req.include_usage():
            yield sse({**header, "choices": [], "usage": _usage(choices)})
        yield "data: [DONE]\n\n"
    except Exception as e:  # after the headers went out: the error as the stream's last event, not a cut-off body
        yield sse(APIError(500, f"internal error: {type(e).__name__}: {e}").body())
        yield "data: [DONE]\n\n"
    finally:  # the client left (the task is cancelled) or the stream ended: no sequence keeps its row
        _cancel_unfinished(state, choices)


def _cancel_unfinished(state: ServerState, choices: list[Choice]) -> None:
    for choice in choices:
        if choice.seq_id is not None:
            state.engine.cancel(choice.seq_id)


def _usage(choices: list[Choice]) -> dict:
    seen, prompt = set(), 0
    for c in choices:  # the n samples of one prompt count it once
        if id(c.prompt) not in seen:
            seen.add(id(c.prompt))
            prompt += c.usage[0]
    completion = sum(c.usage[1] for c in choices)
    cached = sum(c.usage[2] for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}
