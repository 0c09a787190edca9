"""XTML rendering and reading, and the text stream's stop strings and partial characters."""

from __future__ import annotations

import pytest

from k3.serve.chat import ChatRenderer, ReplyParser
from k3.serve.text import TextStream
from k3.tokenizer import byte_pair_tokenizer, train_bpe


@pytest.fixture(scope="module")
def tokenizer():
    return byte_pair_tokenizer(1024)


def test_render_is_the_xtml_layout(tokenizer):
    r = ChatRenderer(tokenizer)
    ids = r.render([("system", ["Be brief."]), ("user", ['Say "hi" & go'])], effort="high")
    text = tokenizer.decode(ids)
    assert text == ('<|open|>message role="system"<|sep|>Be brief.<|close|>message<|sep|><|end_of_msg|>'
                    '<|open|>message role="user"<|sep|>Say "hi" & go<|close|>message<|sep|><|end_of_msg|>'
                    '<|open|>message role="assistant" effort="high"<|sep|>')
    assert ids.count(r.open) == 3 and ids.count(r.end) == 2


def test_a_typed_marker_stays_text(tokenizer):
    r = ChatRenderer(tokenizer)
    ids = r.render([("user", ["<|end_of_msg|><|open|>"])])
    assert ids.count(r.end) == 1 and ids.count(r.open) == 2  # only the renderer's own markers are special


def test_reply_parser_splits_thinking_from_the_answer(tokenizer):
    r = ChatRenderer(tokenizer)
    reply = (r._open("think") + tokenizer.encode("hmm") + r._close("think") + r._open("response")
             + tokenizer.encode("Yes.") + r._close("response") + r._close("message") + [r.end])
    parser = ReplyParser(r)
    routes = [(parser.route(t), t) for t in reply]
    reasoning = tokenizer.decode([t for route, t in routes if route == "reasoning"])
    content = tokenizer.decode([t for route, t in routes if route == "content"])
    assert (reasoning, content) == ("hmm", "Yes.")
    plain = ReplyParser(r)
    assert {plain.route(t) for t in tokenizer.encode("just text")} == {"content"}  # no markup: all content


def test_tokenizer_without_markers_is_refused():
    old = train_bpe(["some text some text"], vocab_size=256 + 16, num_special_slots=16,
                    special_tokens=("[BOS]", "[EOS]", "<|end_of_msg|>", "[PAD]"))
    with pytest.raises(ValueError, match="no chat format"):
        ChatRenderer(old)


def test_text_stream_holds_back_possible_stops_and_partial_characters(tokenizer):
    ids = tokenizer.encode("ab STOP cd")
    stream = TextStream(tokenizer, ["STOP"])
    out = "".join(stream.push(t) for t in ids) + stream.finish()
    assert out == "ab " and stream.stopped
    stream = TextStream(tokenizer, ["STOP"])
    out = "".join(stream.push(t) for t in tokenizer.encode("ab STO")) + stream.finish()
    assert out == "ab STO" and not stream.stopped  # a stop's beginning is released once the text ends
    euro = "€".encode()
    stream = TextStream(tokenizer)
    pieces = [stream.push(b) for b in euro]  # byte by byte: nothing until the character is whole
    assert pieces == ["", "", "€"]
