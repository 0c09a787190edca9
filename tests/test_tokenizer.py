"""Tokenizer tests (docs/architecture.md §10, §9.9, §13 rows 12–13): K2 pre-tokenisation, trained and released-style BPEs."""

from __future__ import annotations

import base64
import json
import re
from collections import Counter

import pytest
import tiktoken

from k3.tokenizer import (
    DEFAULT_SPECIALS,
    K2_PAT_STR,
    MAX_ENCODE_CHARS,
    MAX_RUN_CHARS,
    K3Tokenizer,
    pre_tokenize,
    train_bpe,
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog doesn't mind; it's used to the fox by now.\n",
    "Kimi Delta Attention keeps a matrix-valued state per head and decays it with a per-channel gate.\n\n",
    "We'll train the tokenizer on these paragraphs, then they're encoded and decoded again. ",
    "I'M SURE IT WORKS.\n",
    "def forward(self, hidden_states):\n    return self.norm(hidden_states + self.mlp(hidden_states))\n",
    "价格是 12345 元。我们在北京见面吧！混合专家模型（MoE）的路由器为每个词元选择专家。\n",
    "Café, naïve, résumé, Ærøskøbing — accents and ligatures; emoji 😀🚀 and symbols ∑ ≤ ∞.\n",
    "Numbers 3.14159 and 2718281828 and 1,000,000 appear in text, as do dates like 2026-05-09.\n",
]
CORPUS_TEXT = "".join(CORPUS * 3)

ROUND_TRIP_TEXTS = [
    "Hello, world! This is plain ASCII text with punctuation: (a) [b] {c}.",
    "中文分词测试：汉字连续出现时作为一个片段。",
    "emoji 😀🚀👩‍👩‍👧 and accents: café naïve Ærøskøbing ÉCOLE",
    "tabs\tand   spaces   \n\n\n   newlines\r\n\r\n  and trailing whitespace   ",
    "",
    " ",
    "\n",
    "<|media_pad|> typed by a user [BOS]",
]


@pytest.fixture(scope="module")
def trained() -> K3Tokenizer:
    return train_bpe([CORPUS_TEXT], vocab_size=400, num_special_slots=16)


RELEASED_MERGES = [b"th", b"he", b" t", b"the", b" the", b"in", b"ing", b"\xe4\xb8"]
RELEASED_NAMES = {  # offset within the special block → name, as in the K2/K3 release (§10 table, §9.9)
    0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>", 10: "<|im_system|>",
    17: "<|im_middle|>", 18: "<|media_begin|>", 19: "<|media_content|>", 20: "<|media_end|>", 21: "<|media_pad|>",
    255: "[PAD]",
}


def write_released_dir(path, *, merges=RELEASED_MERGES, names=RELEASED_NAMES, extra_lines=b"") -> int:
    """A released-style directory: 256 byte ranks + a few merges; specials named at K3 offsets; returns n."""
    path.mkdir(parents=True, exist_ok=True)
    tokens = [bytes([b]) for b in range(256)] + list(merges)
    lines = b"".join(base64.b64encode(t) + b" %d\n" % r for r, t in enumerate(tokens))
    (path / "tiktoken.model").write_bytes(lines + extra_lines)
    n = len(tokens)
    config = {
        "added_tokens_decoder": {str(n + off): {"content": name, "special": True} for off, name in names.items()},
        "bos_token": "[BOS]", "eos_token": "[EOS]", "chat_template": "{{ messages }}",
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return n


@pytest.fixture
def released(tmp_path) -> tuple[K3Tokenizer, int]:
    n = write_released_dir(tmp_path / "released")
    return K3Tokenizer.load(tmp_path / "released"), n


# ---------------------------------------------------------------------------------------------------------------
# Pre-tokenisation (§10 alternatives (1)–(8))

@pytest.mark.parametrize("text, pieces", [
    ("Hello world's 12345 foo\n\n", ["Hello", " world's", " ", "123", "45", " foo", "\n\n"]),  # (2)(4)(8)(6)
    ("我爱abc中文 x", ["我爱", "abc", "中文", " x"]),  # (1): a Han run is a piece of its own
    ("CamelCase HTTPServer ABC def", ["Camel", "Case", " HTTPServer", " ABC", " def"]),  # (2) then (3)
    ("it'S WE'LL they've", ["it'S", " WE'LL", " they've"]),  # contractions, case-insensitive
    (" !!!\n\nx", [" !!!\n\n", "x"]),  # (5): symbols then CR/LF
    ("a  \n\n  b", ["a", "  \n\n", " ", " b"]),  # (6), then (7) leaves one space for the word
    ("x   ", ["x", "   "]),  # (7) at the end of the text
    ("$100", ["$", "100"]),  # the prefix character needs letters after it
])
def test_pre_tokenize_follows_the_spec_alternatives(text, pieces):
    assert pre_tokenize(text) == pieces


def test_pre_tokenize_agrees_with_tiktoken():
    """tiktoken (Rust fancy-regex) splits exactly like our Python split: each of our pieces, made a whole token,
    must come back as one token."""
    text = ("Hello world's 12345 foo\n\n我爱北京天安门abc 漢、字々ー〆カナ Привет МИР ÉCOLE café 😀😀 \t\n  x  "
            "don'T ſ'S x\x1c\x1dy\u00a0z\u2028w \u3000 $100 a\r\n\r\n  b "
            "١٢٣٤ Ⅻ")
    pieces = pre_tokenize(text)
    ranks = {bytes([b]): b for b in range(256)}
    for piece in pieces:
        ranks.setdefault(piece.encode(), len(ranks))
    enc = tiktoken.Encoding("split", pat_str=K2_PAT_STR, mergeable_ranks=ranks, special_tokens={})
    assert [enc.decode([i]) for i in enc.encode_ordinary(text)] == pieces


# ---------------------------------------------------------------------------------------------------------------
# Encode / decode

@pytest.mark.parametrize("source", ["trained", "released"])
@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_round_trip(source, text, request):
    tok = request.getfixturevalue(source)
    tok = tok[0] if isinstance(tok, tuple) else tok
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_encoding_respects_piece_boundaries(trained):
    """No token straddles two pre-tokenised pieces; a Han run is encoded apart from the letters around it."""
    text = "abc中文def 中文"
    assert trained.encode(text) == [i for p in pre_tokenize(text) for i in trained.encode(p)]


def test_special_tokens_are_text_by_default(trained):
    text = "look: <|media_pad|> and [BOS]!"
    ids = trained.encode(text)
    assert trained.media_pad_token_id not in ids and trained.bos_token_id not in ids
    assert trained.decode(ids) == text
    parsed = trained.encode(text, allow_special=True)
    assert parsed == (trained.encode("look: ") + [trained.media_pad_token_id] + trained.encode(" and ")
                      + [trained.bos_token_id] + trained.encode("!"))
    assert trained.decode(parsed) == text


def test_reserved_slots_parse_with_allow_special(released):
    tok, n = released
    assert tok.encode(f"<|reserved_token_{n + 5}|>", allow_special=True) == [n + 5]
    assert tok.decode([n + 5]) == f"<|reserved_token_{n + 5}|>"


def test_decode_out_of_range_names_the_id(trained):
    with pytest.raises(ValueError, match=r"token id 400 "):
        trained.decode([1, 400])
    with pytest.raises(ValueError, match=r"token id -1 "):
        trained.decode([-1])
    assert trained.decode([trained.vocab_size - 1]) == "[PAD]"


def test_decode_replaces_invalid_utf8(trained):
    assert trained.decode([0xE4]) == "\ufffd"


def test_long_input_is_cut_like_the_reference(trained):
    """Texts are encoded in 400,000-character pieces, and runs of more than 25,000 whitespace or non-whitespace
    characters are cut every 25,000 characters (§10)."""
    text = ("abcdefghij " * (MAX_ENCODE_CHARS // 11 + 200))[: MAX_ENCODE_CHARS + 1234]
    pieces = pre_tokenize(text)
    assert "".join(pieces) == text
    assert pieces[MAX_ENCODE_CHARS // 11 : MAX_ENCODE_CHARS // 11 + 2] == [" abcdefg", "hij"]  # 400,000 = 11k + 7
    ids = trained.encode(text)
    assert trained.decode(ids) == text
    assert ids == trained.encode(text[:MAX_ENCODE_CHARS]) + trained.encode(text[MAX_ENCODE_CHARS:])

    n = MAX_RUN_CHARS
    run = "ab" + " " * (2 * n + 7) + "the" * (n // 3 + 1) + "yz"  # a 25,004-character letter run
    assert pre_tokenize(run) == ["ab", " " * n, " " * n, " " * 6, " " + ("the" * n)[:n], "heyz"]
    ids = trained.encode(run)
    assert trained.decode(ids) == run
    bounds = [0, 2 + n, 2 + 2 * n, 2 + 3 * n + 7, len(run)]
    assert ids == [i for a, b in zip(bounds, bounds[1:]) for i in trained.encode(run[a:b])]
    assert pre_tokenize(" " * n + "x" * n) == [" " * (n - 1), " " + "x" * n]  # runs of 25,000 stay whole


# ---------------------------------------------------------------------------------------------------------------
# Special-token table

def test_trained_special_layout(trained):
    n = 400 - 16
    assert trained.vocab_size == 400
    assert (trained.bos_token_id, trained.eod_token_id, trained.eos_token_id) == (n, n + 1, n + 2)
    assert [trained.token_to_id(name) for name in DEFAULT_SPECIALS[3:7]] == [n + 3, n + 4, n + 5, n + 6]
    assert trained.media_pad_token_id == n + 6
    assert trained.pad_token_id == n + 15
    assert [trained.token_to_id(name) for name in ("<|open|>", "<|close|>", "<|sep|>")] == [n + 7, n + 8, n + 9]
    assert trained.special_tokens[f"<|reserved_token_{n + 10}|>"] == n + 10
    assert sorted(trained.special_tokens.values()) == list(range(n, 400))
    with pytest.raises(KeyError, match="not a special token"):
        trained.token_to_id("<|im_end|>")


def test_default_special_block_is_the_release_size():
    tok = train_bpe([CORPUS_TEXT], vocab_size=256 + 30 + 256)
    n = 256 + 30
    assert len(tok.special_tokens) == 256
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (n, n + 2, n + 255)


def test_released_special_ids(released):
    tok, n = released
    assert tok.vocab_size == n + 256
    assert (tok.bos_token_id, tok.eod_token_id, tok.eos_token_id, tok.pad_token_id) == (n, n + 1, n + 2, n + 255)
    assert [tok.token_to_id(f"<|media_{s}|>") for s in ("begin", "content", "end", "pad")] == [
        n + 18, n + 19, n + 20, n + 21]
    assert tok.media_pad_token_id == n + 21
    assert tok.special_tokens[f"<|reserved_token_{n + 5}|>"] == n + 5


def test_released_merges_apply_by_rank(released):
    tok, n = released
    assert tok.encode("the") == [256 + 3]  # b"the"
    # " the" is a whole token; " thing" merges th (256), then in (261), then ing (262); " th" is no token
    assert tok.encode(" the thing") == [256 + 4, 32, 256, 256 + 6]


def test_missing_named_tokens_are_none(tmp_path):
    write_released_dir(tmp_path, names={0: "[BOS]", 3: "<|open|>"})
    tok = K3Tokenizer.load(tmp_path)
    assert tok.vocab_size == 256 + len(RELEASED_MERGES) + 4
    assert tok.bos_token_id == 256 + len(RELEASED_MERGES)
    assert tok.eos_token_id is None and tok.pad_token_id is None and tok.media_pad_token_id is None


# ---------------------------------------------------------------------------------------------------------------
# Files

def test_trained_file_format(trained, tmp_path):
    trained.save(tmp_path)
    lines = (tmp_path / "tiktoken.model").read_bytes().split(b"\n")
    assert lines[-1] == b""
    lines = lines[:-1]
    assert len(lines) == 400 - 16
    for rank, line in enumerate(lines):
        assert re.fullmatch(rb"[A-Za-z0-9+/]+=* \d+", line), line
        token, r = line.split(b" ")
        assert int(r) == rank
        if rank < 256:
            assert base64.b64decode(token) == bytes([rank])
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["added_tokens_decoder"][str(384)]["content"] == "[BOS]"
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == ("[BOS]", "<|end_of_msg|>", "[PAD]")

    reloaded = K3Tokenizer.load(tmp_path)
    assert reloaded.special_tokens == trained.special_tokens
    for text in ROUND_TRIP_TEXTS + [CORPUS_TEXT]:
        assert reloaded.encode(text) == trained.encode(text)


@pytest.mark.parametrize("source", ["trained", "released"])
def test_save_load_save_is_bit_identical(source, request, tmp_path):
    tok = request.getfixturevalue(source)
    tok = tok[0] if isinstance(tok, tuple) else tok
    tok.save(tmp_path / "a")
    K3Tokenizer.load(tmp_path / "a").save(tmp_path / "b")
    for name in ("tiktoken.model", "tokenizer_config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["tiktoken.model", "tokenizer_config.json"]


def test_save_keeps_other_config_entries(released, tmp_path):
    tok, _ = released
    tok.save(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["chat_template"] == "{{ messages }}"
    assert config["eos_token"] == "[EOS]"  # the file's own declaration is written back unchanged


def test_resave_to_the_same_directory_is_not_stale(tmp_path):
    """A tokenizer saved over another one at the same path loads as the new one (no path-keyed cache)."""
    train_bpe([CORPUS_TEXT], vocab_size=300, num_special_slots=16).save(tmp_path)
    K3Tokenizer.load(tmp_path)
    train_bpe([CORPUS_TEXT], vocab_size=320, num_special_slots=16).save(tmp_path)
    assert K3Tokenizer.load(tmp_path).vocab_size == 320


def test_save_into_a_checkpoint_directory_leaves_other_files(trained, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    trained.save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "tiktoken.model", "tokenizer_config.json"]


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        K3Tokenizer.load(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="tiktoken.model is missing"):
        K3Tokenizer.load(tmp_path / "empty")

    n = write_released_dir(tmp_path / "noconfig")
    (tmp_path / "noconfig" / "tokenizer_config.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer_config.json is missing"):
        K3Tokenizer.load(tmp_path / "noconfig")

    write_released_dir(tmp_path / "malformed", extra_lines=b"not-base64!! 999\n")
    with pytest.raises(ValueError, match=rf"tiktoken.model:{n + 1}: expected"):
        K3Tokenizer.load(tmp_path / "malformed")

    write_released_dir(tmp_path / "norank", extra_lines=base64.b64encode(b"zz") + b"\n")
    with pytest.raises(ValueError, match=rf":{n + 1}: expected"):
        K3Tokenizer.load(tmp_path / "norank")

    write_released_dir(tmp_path / "duprank", extra_lines=base64.b64encode(b"zz") + b" 7\n")
    with pytest.raises(ValueError, match=rf":{n + 1}: rank 7 already given on line 8"):
        K3Tokenizer.load(tmp_path / "duprank")

    write_released_dir(tmp_path / "duptoken", extra_lines=base64.b64encode(b"th") + b" %d\n" % n)
    with pytest.raises(ValueError, match=rf":{n + 1}: token b'th' already given on line 257"):
        K3Tokenizer.load(tmp_path / "duptoken")

    write_released_dir(tmp_path / "gap", extra_lines=base64.b64encode(b"zz") + b" %d\n" % (n + 1))
    with pytest.raises(ValueError, match=rf"rank {n} is missing"):
        K3Tokenizer.load(tmp_path / "gap")

    write_released_dir(tmp_path / "overlap", names={-1: "[BOS]"})
    with pytest.raises(ValueError, match=rf"'\[BOS\]' has id {n - 1}, which overlaps the BPE ranks"):
        K3Tokenizer.load(tmp_path / "overlap")

    write_released_dir(tmp_path / "dupname", names={0: "[BOS]", 1: "[BOS]"})
    with pytest.raises(ValueError, match="used for two ids"):
        K3Tokenizer.load(tmp_path / "dupname")


def test_constructor_rejects_bad_tables():
    ranks = {bytes([b]): b for b in range(256)}
    with pytest.raises(ValueError, match="overlaps the BPE ranks"):
        K3Tokenizer(ranks, {"[BOS]": 255})
    with pytest.raises(ValueError, match="outside the special block"):
        K3Tokenizer(ranks, {"[BOS]": 256, "[EOS]": 258})
    with pytest.raises(ValueError, match="single bytes have no rank"):
        K3Tokenizer({bytes([b]): b for b in range(255)}, {})


# ---------------------------------------------------------------------------------------------------------------
# Training

def test_merges_are_learnt_in_frequency_order():
    """Pairs: (x,y) 4, (' ',x) 3, then a tie at 2 between (' ',z) and (z,w), broken by token bytes."""
    tok = train_bpe(["xy xy xy xy zw zw"], vocab_size=260 + 16, num_special_slots=16)
    assert [tok.decode([r]) for r in range(256, 260)] == ["xy", " xy", " z", " zw"]
    assert tok.encode("xy zw xy") == [256, 259, 257]


def reference_merges(texts, n_merges):
    """Textbook BPE: recount every pair over the piece table after each merge (ties: smaller token bytes)."""
    words = Counter(tuple(bytes([b]) for b in p.encode()) for t in texts for p in pre_tokenize(t))
    merges = []
    for _ in range(n_merges):
        pairs = Counter()
        for w, f in words.items():
            for pair in zip(w, w[1:]):
                pairs[pair] += f
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best[0] + best[1])
        merged = Counter()
        for w, f in words.items():
            out, i = [], 0
            while i < len(w):
                if w[i : i + 2] == best:
                    out.append(best[0] + best[1])
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged[tuple(out)] += f
        words = merged
    return merges


def test_incremental_trainer_matches_the_textbook_algorithm(trained, tmp_path):
    trained.save(tmp_path)
    lines = (tmp_path / "tiktoken.model").read_bytes().splitlines()
    learnt = [base64.b64decode(line.split()[0]) for line in lines[256:]]
    assert learnt == reference_merges([CORPUS_TEXT], len(learnt))


def test_training_errors():
    with pytest.raises(ValueError, match="at least 256"):
        train_bpe(["abc"], vocab_size=300)  # 256 special slots leave 44 ranks
    with pytest.raises(ValueError, match="supports only"):
        train_bpe(["abc abc"], vocab_size=300, num_special_slots=16)
    with pytest.raises(ValueError, match="do not fit"):
        train_bpe([CORPUS_TEXT], vocab_size=300, num_special_slots=4)


def test_training_tolerates_lone_surrogates():
    tok = train_bpe([CORPUS_TEXT + "bad \ud800 surrogate"], vocab_size=300, num_special_slots=16)
    assert tok.decode(tok.encode("bad \ud800 x")) == "bad \ufffd x"
