"""The OpenAI API's request bodies, as k3 accepts them (`/v1/completions`, `/v1/chat/completions`).

Types are strict (a string is not a number); fields k3 does not know are ignored, as the API ignores them, except
those that would change the answer and that k3 does not implement (penalties, logit bias, tools, a JSON response
format, `suffix`, `best_of` ≠ n): those are refused rather than silently dropped. Errors become the API's error
object (`APIError`), with the field named.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_N = 16
MAX_LOGPROBS = 20
MAX_STOPS = 4


class APIError(Exception):
    """An error answered as `{"error": {...}}` with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}
        self.kind = kind or {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                             413: "invalid_request_error", 429: "rate_limit_exceeded",
                             503: "service_unavailable"}.get(status, "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOPS:
            raise APIError(400, f"stop holds {len(stops)} strings; at most {MAX_STOPS}", "stop")
        return stops

    def check_supported(self) -> None:
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) not in (None, 0):
                raise APIError(400, f"{name} is not supported by this server (only 0)", name)
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported by this server", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options needs stream: true", "stream_options")

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage", False))


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise APIError(400, "suffix (insertion) is not supported by this server", "suffix")
        if self.best_of not in (None, self.n):
            raise APIError(400, "best_of must equal n (the server returns every sample)", "best_of")


class ImageURL(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    url: str


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text", "image_url"]
    text: str | None = None
    image_url: ImageURL | None = None


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None


class ChatRequest(_Request):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    reasoning_effort: Literal["low", "medium", "high", "max"] | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools:
            raise APIError(400, "tools (function calling) are not supported by this server", "tools")
        if self.response_format not in (None, {"type": "text"}):
            raise APIError(400, "response_format other than text is not supported by this server",
                           "response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")


def parse(model: type[BaseModel], body: Any) -> Any:
    """`body` (parsed JSON) as the request `model`; the first problem is an APIError(400) naming its field."""
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        request = model.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(p) for p in first["loc"] if not str(p).startswith(("function-", "str", "list[")))
        raise APIError(400, f"{field or 'body'}: {first['msg']}", field or None) from None
    request.check_supported()
    return request
