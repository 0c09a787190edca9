"""Atomic writes of files and directories: the one implementation every writer of the package uses.

* `atomic_write(path, data)` — bytes, or text (UTF-8), into the file `path`.
* `atomic_open(path, mode)` — a context manager yielding an open file to stream into; committed at the end.
* `atomic_path(path)` — a context manager yielding a temporary file name for writers that take a name
  (`Figure.savefig`, `safetensors.torch.save_file`, `PIL.Image.save`); committed at the end.
* `atomic_directory(path)` — build a whole directory under a temporary name, then rename it into place.
* `staging_dir(parent)` — a temporary directory to stage files in and move them out of one by one.
* `remove_stale_temporaries(directory)` — delete what killed writers left behind.
* `check_writable_directory(path)` — create `path` if needed and prove it takes a file (write + remove a probe).

Every temporary lives next to its destination (so the final rename is atomic: same directory, same file
system) and is named `.tmp-<random>-<name>` (the name's tail is kept, so writers that pick a format from the
suffix still see `.png`). A committed file is flushed and fsync'ed before the rename and its directory after
it; on any failure (an exception, Ctrl-C) the temporary is removed and the destination is left as it was.
Files end up with the permissions of any other file the process creates, 0o666 minus the umask (whatever the
writer did: safetensors creates 0o600 files), directories with 0o777 minus the umask.

Single writer: a directory is written by one process at a time — a training run owns its run directory and
its checkpoints, an export owns its model directory. `remove_stale_temporaries`, which the savers call when a
save starts, relies on it: a temporary found then belongs to a writer that died (a killed export leaves
`model/.tmp-*` behind). Directories shared by concurrent processes (the tokenizer cache) pass `older_than`,
so that only temporaries too old to belong to a live writer are removed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import shutil
import stat
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO

__all__ = [
    "TMP_PREFIX",
    "atomic_directory",
    "atomic_open",
    "atomic_path",
    "atomic_write",
    "check_writable_directory",
    "describe_error",
    "fsync_directory",
    "remove_stale_temporaries",
    "staging_dir",
]

TMP_PREFIX = ".tmp-"
"""Prefix of every temporary name written here."""

_OURS = re.compile(r"\.tmp-[0-9a-f]{8}-(.+)", re.DOTALL)  # `.tmp-<random>-<destination name>`
_SAFETENSORS_TMP = re.compile(r"\.tmp[A-Za-z0-9]{6}")  # safetensors' own temporary (renamed over its target)

_MAX_NAME = 200  # of the destination name kept in a temporary name (file names are limited to 255 bytes)


def _temporary_name(path: Path) -> Path:
    return path.with_name(f"{TMP_PREFIX}{secrets.token_hex(4)}-{path.name[-_MAX_NAME:]}")


def _create_temporary(path: Path) -> tuple[Path, int]:
    """A new, empty temporary file next to `path`, created with mode 0o666 (the umask applies); (name, mode)."""
    while True:
        tmp = _temporary_name(path)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
        except FileExistsError:  # 32 random bits already taken: draw again
            continue
        try:
            return tmp, stat.S_IMODE(os.fstat(fd).st_mode)
        finally:
            os.close(fd)


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink()


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_directory(directory: str | os.PathLike) -> None:
    """Make the entries of `directory` (names created, renamed, removed) durable; a no-op where the platform or
    file system cannot sync a directory."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary file name next to `path` for a writer that takes a name; when the block ends without an
    exception the file gets the umask's permissions, is fsync'ed and renamed over `path`. On any exception the
    temporary is removed and `path` is untouched. The temporary exists (empty) when the block starts."""
    path = Path(path)
    tmp, mode = _create_temporary(path)
    try:
        yield tmp
        os.chmod(tmp, mode)  # the writer may have replaced the file with one of its own (safetensors: 0o600)
        _fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise
    fsync_directory(path.parent)


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", *, encoding: str | None = "utf-8") -> Iterator[IO]:
    """Yield a file open for writing (`mode` "w" or "wb") that replaces `path` atomically when the block ends
    without an exception (see `atomic_path`)."""
    if mode not in ("w", "wb"):
        raise ValueError(f"mode must be 'w' or 'wb', got {mode!r}")
    with atomic_path(path) as tmp, open(tmp, mode, encoding=None if "b" in mode else encoding) as f:
        yield f
        f.flush()


def atomic_write(path: str | os.PathLike, data: bytes | str) -> None:
    """Write `data` (str: as UTF-8) to `path` atomically: readers see the old file or the new one, never a part."""
    if not isinstance(data, (bytes, bytearray, memoryview, str)):
        raise TypeError(f"data must be bytes or str, got {type(data).__name__}")
    with atomic_open(path, "w" if isinstance(data, str) else "wb") as f:
        f.write(data)


@contextlib.contextmanager
def staging_dir(parent: str | os.PathLike, name: str = "") -> Iterator[Path]:
    """Yield a new empty directory `.tmp-<random>-<name>` in `parent` (mode 0o777 minus the umask). It is removed
    with whatever is left in it when the block ends, however it ends; files moved out of it stay."""
    parent = Path(parent)
    while True:
        tmp = _temporary_name(parent / (name or "staging"))
        try:
            os.mkdir(tmp)
            break
        except FileExistsError:
            continue
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _fsync_tree(directory: Path) -> None:
    for root, dirs, files in os.walk(directory):
        for file in files:
            _fsync_file(Path(root, file))
        fsync_directory(root)


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike, *, keep_existing: bool = False) -> Iterator[Path]:
    """Yield a staging directory (a sibling `.tmp-*` of `path`) to fill; when the block ends without an exception
    its files are fsync'ed and it is renamed to `path`. On any exception it is removed and `path` is untouched.

    An existing `path` is replaced: it is first renamed aside and removed only once the new directory is in
    place, so one of the two is complete at every moment. With `keep_existing`, an existing `path` (e.g. written
    meanwhile by a concurrent process producing the same content) is kept and the staged copy discarded.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with staging_dir(path.parent, path.name) as tmp:
        yield tmp
        _fsync_tree(tmp)
        if keep_existing and path.is_dir():
            return
        old = None
        if path.exists() or path.is_symlink():
            old = _temporary_name(path.with_name("old-" + path.name))
            os.rename(path, old)
        try:
            os.rename(tmp, path)
        except BaseException:
            if old is not None:
                os.rename(old, path)
            elif keep_existing and path.is_dir():  # lost a race to another writer of the same directory
                return
            raise
        fsync_directory(path.parent)
        if old is not None:
            _remove(old)


def remove_stale_temporaries(directory: str | os.PathLike, *, names: Iterable[str] | None = None,
                             older_than: float | None = None) -> list[Path]:
    """Remove the temporaries that killed writers left in `directory`: `.tmp-*` entries (files or directories)
    and the `.tmpXXXXXX` files safetensors writes first. With `names`, only our temporaries for those
    destination names (`.tmp-<random>-<name>`, or `-old-<name>`); with `older_than` (seconds), only entries last
    modified longer ago. Returns what was removed. Savers call it when a save into `directory` starts; without
    `older_than` it assumes a single writer (see the module notes)."""
    directory = Path(directory)
    try:
        entries = list(directory.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    wanted = None if names is None else set(names) | {"old-" + n for n in names}
    now, removed = time.time(), []
    for entry in entries:
        ours = _OURS.fullmatch(entry.name)
        if wanted is not None:
            if ours is None or ours.group(1) not in wanted:
                continue
        elif ours is None and not entry.name.startswith(TMP_PREFIX) and not _SAFETENSORS_TMP.fullmatch(entry.name):
            continue
        if older_than is not None:
            try:
                if now - entry.lstat().st_mtime < older_than:
                    continue
            except OSError:
                continue
        _remove(entry)
        removed.append(entry)
    return removed


def check_writable_directory(path: str | os.PathLike) -> Path:
    """Create the directory `path` (and its parents) if needed and prove that it takes a file by writing and
    removing a probe. Raises NotADirectoryError when `path` is a file, else the OSError of the failed step."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(path))
    path.mkdir(parents=True, exist_ok=True)
    probe, _ = _create_temporary(path / "write-probe")
    try:
        with open(probe, "wb") as f:
            f.write(b"k3")
            f.flush()
            os.fsync(f.fileno())
    finally:
        _remove(probe)
    return path


def describe_error(error: BaseException, limit: int | None = 300) -> str:
    """`error` as one line of at most about `limit` characters: an OSError as its reason and file name
    ("No space left on device: 'runs/a/x'"), a KeyError as "missing 'key'", anything else as its message with
    newlines collapsed (`limit` None: never cut)."""
    if isinstance(error, OSError) and error.strerror:
        text = error.strerror + (f": {os.fsdecode(error.filename)!r}" if error.filename is not None else "")
    elif isinstance(error, KeyError) and error.args:
        text = f"missing {error.args[0]!r}"
    else:
        text = " ".join(line.strip() for line in str(error).splitlines() if line.strip()) or type(error).__name__
    return text if limit is None or len(text) <= limit else text[: limit - 1] + "…"
