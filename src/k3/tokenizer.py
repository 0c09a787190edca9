"""The Kimi K3 tokenizer: tiktoken byte-level BPE plus a block of special-token slots (docs/architecture.md §10, §9.9, §13).

One class, `K3Tokenizer`, over two sources of the same on-disk format:

* the released tokenizer: a directory with `tiktoken.model` (one `base64(token_bytes) rank` line per mergeable
  token, ranks 0..n−1) and `tokenizer_config.json`, whose `added_tokens_decoder` names the special slots that
  follow the ranks (K3: 163,584 ranks + 256 slots = 163,840 ids); unnamed slots are `<|reserved_token_{id}|>`;
* small BPEs for tiny models, trained by `train_bpe` and saved in exactly that format.

Encoding runs in tiktoken (its Rust core) with the K2 pre-tokenisation pattern `K2_PAT_STR` and the practical
limits of the Kimi tokenizer (400,000-character pieces, runs of > 25,000 whitespace or non-whitespace characters
split). Special-token text is ordinary text unless `allow_special=True` (§10).

Design choices:

* Training is our own word-frequency BPE with incremental pair counts (`_learn_merges`): tiktoken ships only a
  pure-Python educational trainer that recounts every pair after each merge (far too slow at vocab 4096), and HF
  `tokenizers` would add a dependency whose merges and pre-tokenizer we would have to re-express as tiktoken byte
  ranks and K2 regex semantics; ours trains ~5 MB of text to vocab 4096 in seconds and pre-tokenises with the very
  pattern tiktoken encodes with.
* `tiktoken.model` is parsed here rather than by `tiktoken.load.load_tiktoken_bpe`, which caches every file it
  reads in a temporary directory keyed by its *path* (a tokenizer re-saved at the same path would load stale)
  and reports malformed input without a line number.
* Pre-tokenisation for training uses the `regex` package (a dependency of tiktoken) in V1 mode, the Python engine
  that understands the pattern's `\\p{…}` classes and `&&` set intersection; tests check that it splits text
  exactly as tiktoken does.
"""

from __future__ import annotations

import base64
import binascii
import heapq
import itertools
import json
import os
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from operator import index
from typing import Any

import regex
import tiktoken

from k3.fileio import atomic_write

__all__ = [
    "DEFAULT_SPECIALS",
    "K2_PAT_STR",
    "K3Tokenizer",
    "NUM_SPECIAL_SLOTS",
    "pre_tokenize",
    "train_bpe",
]

MODEL_FILE = "tiktoken.model"
CONFIG_FILE = "tokenizer_config.json"

NUM_SPECIAL_SLOTS = 256
"""Special-token slots after the BPE ranks in the release (§10: ids 163584..163839)."""

MAX_ENCODE_CHARS = 400_000
"""Texts are encoded in pieces of at most this many characters (§10, practical limits)."""

MAX_RUN_CHARS = 25_000
"""Runs of whitespace or non-whitespace characters longer than this are cut (§10, practical limits)."""

_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"  # "upper-class" letters and marks, not Han
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"  # "lower-class" letters and marks, not Han
_PREFIX = r"[^\r\n\p{L}\p{N}]?"  # one optional character that is not CR/LF, a letter or a digit
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"

K2_PAT_STR = "|".join([
    r"[\p{Han}]+",  # (1) a run of Han characters
    _PREFIX + _UPPER + "*" + _LOWER + "+" + _CONTRACTION,  # (2) word ending in lower-class letters
    _PREFIX + _UPPER + "+" + _LOWER + "*" + _CONTRACTION,  # (3) word of upper-class letters
    r"\p{N}{1,3}",  # (4) 1–3 digits
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",  # (5) punctuation/symbols, then any CR/LF
    r"\s*[\r\n]+",  # (6) whitespace ending in line breaks
    r"\s+(?!\S)",  # (7) whitespace not followed by non-whitespace
    r"\s+",  # (8) whitespace
])
"""The K2 pre-tokenisation pattern (§10, alternatives (1)–(8) in order), in tiktoken's regex syntax."""

DEFAULT_SPECIALS: tuple[str, ...] = (
    "[BOS]",
    "[EOS]",
    "<|end_of_msg|>",
    "<|media_begin|>",
    "<|media_content|>",
    "<|media_end|>",
    "<|media_pad|>",
    "<|open|>",
    "<|close|>",
    "<|sep|>",
    "[PAD]",
)
"""Special tokens of a trained tokenizer: the release's (§10 table, §9.9) in small.

`train_bpe` gives them offsets 0, 1, 2, … in this order within the special block, except `[PAD]`, which takes the
block's last slot as in the release (163839). With n ranks: `[BOS]` n, `[EOS]` n+1, `<|end_of_msg|>` n+2 (as in
the release), the four media tokens n+3..n+6 (the release has n+18..n+21; packing them lets the set fit a
16-slot block), the XTML chat markers `<|open|>`, `<|close|>`, `<|sep|>` n+7..n+9 (`k3.serve.chat`) and `[PAD]`
n+slots−1.
"""

_PAD = "[PAD]"
_BOS_NAMES = ("[BOS]",)
_EOS_NAMES = ("<|end_of_msg|>", "<|im_end|>")  # turn terminator = config eos_token_id (§10, §13 row 13)
_EOD_NAMES = ("[EOS]",)
_MEDIA_PAD_NAMES = ("<|media_pad|>",)

_PIECE = regex.compile(K2_PAT_STR, flags=regex.V1)
_LONG_RUN = re.compile(r"(?<!\s)\s{%d,}|(?<!\S)\S{%d,}" % (MAX_RUN_CHARS + 1, MAX_RUN_CHARS + 1))


def _reserved_name(token_id: int) -> str:
    return f"<|reserved_token_{token_id}|>"


def _encoding_chunks(text: str) -> Iterator[str]:
    """Cut `text` the way the Kimi tokenizer does before BPE (§10, practical limits).

    Pieces of at most MAX_ENCODE_CHARS characters; within each, a run of more than MAX_RUN_CHARS consecutive
    whitespace (or non-whitespace) characters is cut every MAX_RUN_CHARS characters from the run's start.
    """
    for start in range(0, len(text), MAX_ENCODE_CHARS):
        piece = text[start : start + MAX_ENCODE_CHARS]
        cut = 0
        if len(piece) > MAX_RUN_CHARS:
            for run in _LONG_RUN.finditer(piece):
                for cut_at in range(run.start() + MAX_RUN_CHARS, run.end(), MAX_RUN_CHARS):
                    yield piece[cut:cut_at]
                    cut = cut_at
        yield piece[cut:]


def pre_tokenize(text: str) -> list[str]:
    """The pieces BPE sees: `text` cut as in `_encoding_chunks`, each chunk split by `K2_PAT_STR` (§10)."""
    return [p for chunk in _encoding_chunks(text) for p in _PIECE.findall(chunk)]


class K3Tokenizer:
    """Byte-level BPE ranks 0..n−1 followed by special-token slots n..n+S−1 (§10).

    `special_tokens` must name every slot (use `<|reserved_token_{id}|>` for unused ones; `load` and `train_bpe`
    fill them in). Token ids of note are found by name, never hard-coded (§13 row 13):
    `bos_token_id` `[BOS]`; `eos_token_id` the turn terminator `<|end_of_msg|>` (K2: `<|im_end|>`), which is the
    released config's `eos_token_id`; `eod_token_id` the document terminator `[EOS]`; `pad_token_id` `[PAD]`;
    `media_pad_token_id` `<|media_pad|>` (§9.9). Each is None when the token is absent.

    `extra_config` holds further `tokenizer_config.json` entries (chat template, declared bos/eos/pad names, …);
    `save` writes them back unchanged and they do not affect the ids above.
    """

    def __init__(
        self,
        mergeable_ranks: Mapping[bytes, int],
        special_tokens: Mapping[str, int],
        *,
        extra_config: Mapping[str, Any] | None = None,
    ):
        ranks = dict(mergeable_ranks)
        specials = dict(special_tokens)
        n = len(ranks)
        if set(ranks.values()) != set(range(n)):
            raise ValueError(f"mergeable ranks must be exactly 0..{n - 1}, each once")
        missing_bytes = [b for b in range(256) if bytes([b]) not in ranks]
        if missing_bytes:
            raise ValueError(f"{len(missing_bytes)} single bytes have no rank (first: {missing_bytes[0]:#04x}); "
                             "byte-level BPE needs all 256")
        for name, token_id in specials.items():
            if not name:
                raise ValueError(f"special token {token_id} has an empty name")
            if not 0 <= token_id - n < len(specials):
                where = "overlaps the BPE ranks" if 0 <= token_id < n else "is outside the special block"
                raise ValueError(f"special token {name!r} has id {token_id}, which {where} "
                                 f"(ranks 0..{n - 1}, special slots {n}..{n + len(specials) - 1})")
        if len(set(specials.values())) != len(specials):
            raise ValueError("two special tokens share an id")
        if extra_config and "added_tokens_decoder" in extra_config:
            raise ValueError("extra_config must not hold added_tokens_decoder; pass special_tokens instead")

        self._ranks = ranks
        self._special_tokens = specials
        self._extra_config = dict(extra_config or {})
        self._encoding = tiktoken.Encoding(
            "k3", pat_str=K2_PAT_STR, mergeable_ranks=ranks, special_tokens=specials
        )
        by_length = sorted(specials, key=len, reverse=True)  # the longest name wins where one prefixes another
        self._special_pattern = re.compile("|".join(map(re.escape, by_length))) if specials else None

    def _find(self, names: Sequence[str]) -> int | None:
        return next((self._special_tokens[n] for n in names if n in self._special_tokens), None)

    @property
    def vocab_size(self) -> int:
        """BPE ranks plus special slots (163,840 for K3)."""
        return len(self._ranks) + len(self._special_tokens)

    @property
    def special_tokens(self) -> dict[str, int]:
        """Every special slot, name → id (reserved slots included)."""
        return dict(self._special_tokens)

    @property
    def bos_token_id(self) -> int | None:
        return self._find(_BOS_NAMES)

    @property
    def eos_token_id(self) -> int | None:
        return self._find(_EOS_NAMES)

    @property
    def eod_token_id(self) -> int | None:
        return self._find(_EOD_NAMES)

    @property
    def pad_token_id(self) -> int | None:
        return self._find((_PAD,))

    @property
    def media_pad_token_id(self) -> int | None:
        return self._find(_MEDIA_PAD_NAMES)

    def token_to_id(self, name: str) -> int:
        """Id of the special token `name`; KeyError if it is not one."""
        try:
            return self._special_tokens[name]
        except KeyError:
            raise KeyError(f"{name!r} is not a special token of this tokenizer") from None

    def _encode_ordinary(self, text: str) -> list[int]:
        ids: list[int] = []
        for chunk in _encoding_chunks(text):
            ids.extend(self._encoding.encode_ordinary(chunk))
        return ids

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        """Token ids of `text`. Special-token names are plain text unless `allow_special` (§10)."""
        if not allow_special or self._special_pattern is None:
            return self._encode_ordinary(text)
        ids: list[int] = []
        start = 0
        for match in self._special_pattern.finditer(text):
            ids.extend(self._encode_ordinary(text[start : match.start()]))
            ids.append(self._special_tokens[match.group()])
            start = match.end()
        ids.extend(self._encode_ordinary(text[start:]))
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids` (invalid UTF-8 becomes U+FFFD); ValueError naming the first id outside the vocabulary."""
        ids = [index(i) for i in ids]
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is outside the vocabulary 0..{self.vocab_size - 1}")
        return self._encoding.decode(ids, errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of one token (a special token's name in UTF-8); ValueError outside the vocabulary."""
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} is outside the vocabulary 0..{self.vocab_size - 1}")
        return self._encoding.decode_single_token_bytes(token_id)

    def save(self, directory: str | os.PathLike) -> None:
        """Write `tiktoken.model` and `tokenizer_config.json` into `directory` (created if needed), atomically.

        The directory may be a model checkpoint directory; other files there are left alone.
        """
        os.makedirs(directory, exist_ok=True)
        lines = sorted(self._ranks.items(), key=lambda item: item[1])
        model = b"".join(base64.b64encode(tok) + b" %d\n" % rank for tok, rank in lines)
        config: dict[str, Any] = {
            "added_tokens_decoder": {
                str(token_id): {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                                "single_word": False, "special": True}
                for name, token_id in sorted(self._special_tokens.items(), key=lambda item: item[1])
            },
        }
        names = {token_id: name for name, token_id in self._special_tokens.items()}
        for key, token_id in (("bos_token", self.bos_token_id), ("eos_token", self.eos_token_id),
                              ("pad_token", self.pad_token_id)):
            if token_id is not None:
                config[key] = names[token_id]
        config.update(self._extra_config)
        _write_atomic(os.path.join(directory, MODEL_FILE), model)
        _write_atomic(os.path.join(directory, CONFIG_FILE),
                      (json.dumps(config, indent=2, ensure_ascii=False) + "\n").encode("utf-8"))

    @classmethod
    def load(cls, directory: str | os.PathLike) -> K3Tokenizer:
        """Read a released-format tokenizer directory (or one written by `save`).

        The special block runs from the rank count n to the highest id in `added_tokens_decoder`; unlisted slots
        in it are `<|reserved_token_{id}|>`.
        """
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"tokenizer directory {os.fspath(directory)!r} does not exist")
        ranks = _read_ranks(os.path.join(directory, MODEL_FILE))
        config_path = os.path.join(directory, CONFIG_FILE)
        if not os.path.isfile(config_path):
            raise FileNotFoundError(f"{config_path} is missing (a tokenizer directory needs {MODEL_FILE} and "
                                    f"{CONFIG_FILE})")
        try:
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{config_path}: invalid JSON ({e})") from None
        if not isinstance(config, dict):
            raise ValueError(f"{config_path}: expected a JSON object")
        named = _read_added_tokens(config.get("added_tokens_decoder", {}), len(ranks), config_path)
        n_slots = max(named, default=len(ranks) - 1) - len(ranks) + 1
        specials = {named.get(i, _reserved_name(i)): i for i in range(len(ranks), len(ranks) + n_slots)}
        if len(specials) != n_slots:
            raise ValueError(f"{config_path}: a special-token name is used for two ids")
        extra = {k: v for k, v in config.items() if k != "added_tokens_decoder"}
        return cls(ranks, specials, extra_config=extra)


def _write_atomic(path: str, data: bytes) -> None:
    """Write `data` to `path` atomically (`k3.fileio.atomic_write`: umask permissions, fsync, rename)."""
    atomic_write(path, data)


def _read_ranks(path: str) -> dict[bytes, int]:
    """Parse a `tiktoken.model` file: `base64(token) rank` per line, ranks exactly 0..n−1."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing (a tokenizer directory needs {MODEL_FILE} and {CONFIG_FILE})")
    ranks: dict[bytes, int] = {}
    line_of_rank: dict[int, int] = {}
    line_of_token: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            fields = line.split()
            if not fields:
                continue
            try:
                if len(fields) != 2:
                    raise ValueError
                token = base64.b64decode(fields[0], validate=True)
                rank = int(fields[1])
                if rank < 0 or not token:
                    raise ValueError
            except (ValueError, binascii.Error):
                raise ValueError(f"{path}:{lineno}: expected 'base64(token) rank', got {line[:80]!r}") from None
            if rank in line_of_rank:
                raise ValueError(f"{path}:{lineno}: rank {rank} already given on line {line_of_rank[rank]}")
            if token in line_of_token:
                raise ValueError(f"{path}:{lineno}: token {token!r} already given on line {line_of_token[token]}")
            ranks[token] = rank
            line_of_rank[rank] = line_of_token[token] = lineno
    missing = next((r for r in range(len(ranks)) if r not in line_of_rank), None)
    if missing is not None:
        raise ValueError(f"{path}: ranks must be 0..{len(ranks) - 1} but rank {missing} is missing")
    return ranks


def _read_added_tokens(decoder: Any, n_ranks: int, path: str) -> dict[int, str]:
    """`added_tokens_decoder` (id string → {"content": name, …}) as id → name; ids must follow the ranks."""
    if not isinstance(decoder, dict):
        raise ValueError(f"{path}: added_tokens_decoder must be an object mapping ids to tokens")
    named: dict[int, str] = {}
    for key, entry in decoder.items():
        try:
            token_id = int(key)
            name = entry["content"]
        except (ValueError, TypeError, KeyError):
            raise ValueError(f"{path}: added_tokens_decoder entry {key!r} needs an integer id and a 'content'") \
                from None
        if token_id < n_ranks:
            raise ValueError(f"{path}: special token {name!r} has id {token_id}, which overlaps the BPE ranks "
                             f"0..{n_ranks - 1}")
        named[token_id] = name
    return named


def _special_table(names: Sequence[str], n_ranks: int, n_slots: int) -> dict[str, int]:
    """Every slot n_ranks..n_ranks+n_slots−1 named: `names` at offsets 0, 1, …, `[PAD]` last, the rest reserved."""
    if len(set(names)) != len(names):
        raise ValueError("special token names must be distinct")
    if len(names) > n_slots:
        raise ValueError(f"{len(names)} special tokens do not fit in {n_slots} slots")
    ordered = [name for name in names if name != _PAD]
    by_id = {n_ranks + offset: name for offset, name in enumerate(ordered)}
    if _PAD in names:
        by_id[n_ranks + n_slots - 1] = _PAD
    return {by_id.get(i, _reserved_name(i)): i for i in range(n_ranks, n_ranks + n_slots)}


def _utf8_safe(text: str) -> str:
    """`text` with lone surrogates replaced by U+FFFD, as tiktoken does before encoding."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def _merge_word(word: list[int], left: int, right: int, merged: int) -> list[int]:
    """`word` with each non-overlapping (left, right) pair, scanned left to right, replaced by `merged`."""
    out: list[int] = []
    i, n = 0, len(word)
    while i < n:
        if i + 1 < n and word[i] == left and word[i + 1] == right:
            out.append(merged)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


def _learn_merges(piece_counts: Mapping[str, int], n_ranks: int) -> dict[bytes, int]:
    """Byte-level BPE over a piece-frequency table: ranks 0..255 are the single bytes, then merges in order.

    Each step merges the most frequent adjacent pair (ties: the smaller (left, right) token bytes). Pair counts
    are kept up to date incrementally: only the pieces that contain the merged pair are rewritten, and a lazy
    max-heap holds the current count of every pair. A merge whose bytes already form a token reuses that token
    and adds no rank.
    """
    vocab = [bytes([b]) for b in range(256)]  # token id (= rank) → bytes
    token_of = {tok: i for i, tok in enumerate(vocab)}
    words: list[list[int]] = []
    freqs: list[int] = []
    for piece, count in piece_counts.items():
        encoded = piece.encode("utf-8")
        if len(encoded) > 1:
            words.append(list(encoded))
            freqs.append(count)

    pair_count: dict[tuple[int, int], int] = {}
    where: dict[tuple[int, int], set[int]] = {}
    for w, (word, freq) in enumerate(zip(words, freqs)):
        for pair in zip(word, word[1:]):
            pair_count[pair] = pair_count.get(pair, 0) + freq
            where.setdefault(pair, set()).add(w)
    heap = [(-c, vocab[a], vocab[b], (a, b)) for (a, b), c in pair_count.items()]
    heapq.heapify(heap)

    while len(vocab) < n_ranks:
        while heap:
            neg_count, _, _, pair = heapq.heappop(heap)
            if pair_count.get(pair) == -neg_count:
                break
        else:
            raise ValueError(f"the corpus supports only {len(vocab)} BPE ranks, fewer than the {n_ranks} asked for")
        left, right = pair
        merged_bytes = vocab[left] + vocab[right]
        merged = token_of.get(merged_bytes)
        if merged is None:
            merged = token_of[merged_bytes] = len(vocab)
            vocab.append(merged_bytes)

        delta: dict[tuple[int, int], int] = {}
        for w in where.pop(pair):
            word, freq = words[w], freqs[w]
            new_word = _merge_word(word, left, right, merged)
            if len(new_word) == len(word):  # the piece lost this pair to an earlier merge
                continue
            for p in zip(word, word[1:]):
                delta[p] = delta.get(p, 0) - freq
            for p in zip(new_word, new_word[1:]):
                delta[p] = delta.get(p, 0) + freq
                if merged in p:
                    where.setdefault(p, set()).add(w)
            words[w] = new_word
        for p, d in delta.items():
            if d:
                count = pair_count.get(p, 0) + d
                if count:
                    pair_count[p] = count
                    heapq.heappush(heap, (-count, vocab[p[0]], vocab[p[1]], p))
                else:
                    del pair_count[p]
    return {tok: rank for rank, tok in enumerate(vocab)}


def train_bpe(
    texts: Iterable[str],
    vocab_size: int,
    special_tokens: Sequence[str] = DEFAULT_SPECIALS,
    *,
    num_special_slots: int = NUM_SPECIAL_SLOTS,
) -> K3Tokenizer:
    """Train a byte-level BPE in the released format for a tiny model.

    `vocab_size` is the total (the model's embedding rows): vocab_size − num_special_slots BPE ranks (256 single
    bytes, then merges learnt in order of pair frequency over the pieces of `pre_tokenize`) followed by
    `num_special_slots` special slots laid out as described at `DEFAULT_SPECIALS`. The default block of 256 slots
    matches the release; tiny models may use fewer (e.g. 16). Raises ValueError when the corpus has too few
    distinct pairs to reach the requested size.
    """
    n_ranks = vocab_size - num_special_slots
    if n_ranks < 256:
        raise ValueError(f"vocab_size {vocab_size} leaves {n_ranks} BPE ranks after {num_special_slots} special "
                         "slots; at least 256 (the single bytes) are needed")
    specials = _special_table(special_tokens, n_ranks, num_special_slots)
    piece_counts: Counter[str] = Counter()
    for text in texts:
        piece_counts.update(pre_tokenize(_utf8_safe(text)))
    return K3Tokenizer(_learn_merges(piece_counts, n_ranks), specials)


def byte_pair_tokenizer(vocab_size: int, num_special_slots: int = 16) -> K3Tokenizer:
    """An untrained byte-level tokenizer in the released format with every id of a `vocab_size` model valid: the
    256 single bytes, then two-byte tokens in order (b"\\x00\\x00", b"\\x00\\x01", …), then the special slots — for a
    random-weight checkpoint (`k3 init`), whose sampled ids must all decode."""
    n_ranks = vocab_size - num_special_slots
    if not 256 <= n_ranks <= 256 + 256 * 256:
        raise ValueError(f"vocab_size {vocab_size} with {num_special_slots} special slots needs between 256 and "
                         f"{256 + 256 * 256} byte and byte-pair ranks, got {n_ranks}")
    pairs = (bytes((a, b)) for a in range(256) for b in range(256))
    ranks = [bytes((b,)) for b in range(256)] + list(itertools.islice(pairs, n_ranks - 256))
    return K3Tokenizer({token: rank for rank, token in enumerate(ranks)},
                       _special_table(DEFAULT_SPECIALS, n_ranks, num_special_slots))
