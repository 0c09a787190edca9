"""A stream of token ids as text, for the server: whole characters only, stop strings cut off."""

from __future__ import annotations

from collections.abc import Sequence

from k3.tokenizer import K3Tokenizer


class TextStream:
    """Text of the tokens pushed so far, released as it becomes final: a partial UTF-8 character waits for its next
    byte, and the last `len(longest stop) - 1` characters wait until they cannot begin a stop string. Once a stop
    string appears, the text ends before it (`stopped`)."""

    def __init__(self, tokenizer: K3Tokenizer, stops: Sequence[str] = ()):
        self.tokenizer, self.stops = tokenizer, [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.ids: list[int] = []
        self.text, self.sent, self.stopped = "", 0, False

    def push(self, token_id: int) -> str:
        """The newly final text after one more token ("" while a character or a possible stop is incomplete)."""
        if self.stopped:
            return ""
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        self.text = text
        return self._release(final=False)

    def finish(self) -> str:
        """The rest of the text once the stream has ended."""
        if self.stopped:
            return ""
        self.text = self.tokenizer.decode(self.ids)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        hits = [i for i in (self.text.find(s, self.sent) for s in self.stops) if i >= 0]
        if hits:
            end, self.stopped = min(hits), True
        else:
            end = len(self.text) if final else max(self.sent, len(self.text) - self.hold)
        out, self.sent = self.text[self.sent: end], end
        return out

    @property
    def released(self) -> str:
        """All the text released so far."""
        return self.text[: self.sent]
