"""K3's chat format, XTML, as token ids, and the assistant's reply read back (docs/architecture.md, "Serving").

An element opens with `<|open|>` + tag name + attributes `key="value"` + `<|sep|>` and closes with `<|close|>` + tag
+ `<|sep|>`; a message is a `message` element with a `role` attribute, followed by `<|end_of_msg|>`, the turn
terminator the model stops on. An assistant reply may hold a `think` and a `response` element. Only the four
markers are special tokens; tag names, attributes and the messages' text are encoded as ordinary text, so a user
cannot inject a marker by typing its name. k3's choices where the format leaves them open: the thinking effort is an
`effort` attribute of the assistant message the prompt opens; earlier assistant turns are rendered with their
response only (their thinking dropped); an image is the media framing of `k3.vision.processor` inside the message.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from k3.tokenizer import K3Tokenizer

MARKERS = ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")
ROLES = ("system", "user", "assistant", "tool")
EFFORTS = ("low", "medium", "high", "max")


def has_chat_format(tokenizer: K3Tokenizer) -> bool:
    """True when the tokenizer holds the four XTML markers."""
    return all(name in tokenizer.special_tokens for name in MARKERS)


def _escape(value: str) -> str:
    return value.replace("&", "&amp;").replace('"', "&quot;")


class ChatRenderer:
    """Messages → token ids in XTML. `render` takes (role, parts) pairs: parts are text strings or image
    placeholders (`IMAGE`), which the caller expands (`k3.vision.processor`)."""

    IMAGE = object()

    def __init__(self, tokenizer: K3Tokenizer):
        if not has_chat_format(tokenizer):
            raise ValueError("this checkpoint's tokenizer has no chat format (it lacks the XTML markers "
                             + ", ".join(MARKERS) + "); use /v1/completions")
        self.tokenizer = tokenizer
        self.open, self.close, self.sep, self.end = (tokenizer.token_to_id(m) for m in MARKERS)

    def _text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text) if text else []

    def _open(self, tag: str, **attributes: str) -> list[int]:
        attrs = "".join(f' {k}="{_escape(v)}"' for k, v in attributes.items())
        return [self.open, *self._text(tag + attrs), self.sep]

    def _close(self, tag: str) -> list[int]:
        return [self.close, *self._text(tag), self.sep]

    def render(self, messages: Sequence[tuple[str, Sequence[object]]], effort: str | None = None) -> list:
        """The prompt: every message, then the opening of the assistant's reply. The result holds token ids and,
        where an image goes, `IMAGE`."""
        out: list = []
        for role, parts in messages:
            out += self._open("message", role=role)
            for part in parts:
                out += [part] if part is self.IMAGE else self._text(part)
            out += self._close("message") + [self.end]
        out += self._open("message", role="assistant", **({} if effort is None else {"effort": effort}))
        return out


@dataclass
class ReplyParser:
    """Reads a generated reply token by token: `route` says whether a token is reasoning (inside `think`), content
    (all other text) or markup (the markers and tag names, not shown)."""

    renderer: ChatRenderer
    _stack: list[str] = field(default_factory=list)
    _tag: list[int] | None = None  # the ids of a tag being read (after <|open|> or <|close|>), else None
    _closing: bool = False

    def route(self, token_id: int) -> str | None:
        r = self.renderer
        if token_id in (r.open, r.close):
            self._tag, self._closing = [], token_id == r.close
            return None
        if self._tag is not None:
            if token_id != r.sep:
                self._tag.append(token_id)
                return None
            name = r.tokenizer.decode(self._tag).split(" ", 1)[0]
            self._tag = None
            if not self._closing:
                self._stack.append(name)
            elif name in self._stack:
                del self._stack[self._stack.index(name):]
            return None
        if token_id in (r.sep, r.end):
            return None
        return "reasoning" if "think" in self._stack else "content"
