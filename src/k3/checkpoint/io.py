"""Reading and writing safetensors checkpoint directories in the official layout (docs/architecture.md §11.1).

A checkpoint directory holds either one ``model.safetensors`` or shards ``model-0000i-of-0000N.safetensors``
listed by ``model.safetensors.index.json`` (``{"metadata": {"total_size": ...}, "weight_map": {name: file}}``).
Tensors are read lazily, one at a time, by positioned reads into their own memory (the header is JSON and the data
raw little-endian bytes, so nothing is ever unpickled); files are written with ``safetensors``.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor

from k3.checkpoint.hf import (
    LANGUAGE_MODEL_PREFIX,
    NON_TEXT_PREFIXES,
    CheckpointError,
    ExpectedShape,
    from_hf_state_dict,
    to_hf_state_dict,
)
from k3.config import show_value, summarize
from k3.fileio import atomic_path, atomic_write, fsync_directory, remove_stale_temporaries, staging_dir

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = 5 * 2**30
_WEIGHT_FILE = re.compile(r"model(-\d+-of-\d+)?\.safetensors")
"""Names of weight files this module writes (and may remove as stale on the next save)."""


# ------------------------------------------------------------------------------------------------------ loading


def load_checkpoint_state(
    path: str | os.PathLike,
    expected: Mapping[str, ExpectedShape],
    dtype: torch.dtype | None = None,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Tensor]:
    """Load the weights of a checkpoint into the internal layout described by ``expected``.

    ``path`` is a checkpoint directory (sharded with an index, or one ``model.safetensors``) or a single
    ``.safetensors`` file. ``expected`` maps internal names to shapes or tensors (e.g. ``model.state_dict()``,
    meta tensors are fine). Every file's framing and every name, shape and dtype are validated before any tensor
    data is read; see ``from_hf_state_dict`` for the translation and dtype rules. A malformed checkpoint (a
    truncated or foreign weight file, a bad index, an index entry naming a file outside the directory) raises a
    one-line ``CheckpointError`` naming the file and the problem.

    Tensors are read one at a time with positioned reads straight into their new memory (a stored dtype that
    needs no cast lands in place; a cast goes through one temporary of that tensor's size), so the memory held is
    the tensors built so far plus one tensor, whatever the shard sizes; nothing is memory-mapped into the process.
    ``progress``, if given, is called with the bytes of each tensor read.
    """
    stored = {}
    for file, listed in _weight_files(Path(path)).items():
        header, data_start = _read_header(file)
        stored.update((name, _SafetensorsEntry(file, name, header[name], data_start, progress))
                      for name in _names_to_read(file, header, listed))
    return from_hf_state_dict(stored, expected, dtype)


def checkpoint_bytes(path: str | os.PathLike) -> int:
    """The bytes of tensor data in a checkpoint's weight files (what `load_checkpoint_state` reads at most)."""
    total = 0
    for file, listed in _weight_files(Path(path)).items():
        header, _ = _read_header(file)
        total += sum(_data_size(header[name]) for name in _names_to_read(file, header, listed))
    return total


_SAFETENSORS_DTYPES = {code: getattr(torch, name) for code, name in (
    ("BOOL", "bool"), ("U8", "uint8"), ("I8", "int8"), ("U16", "uint16"), ("I16", "int16"), ("U32", "uint32"),
    ("I32", "int32"), ("U64", "uint64"), ("I64", "int64"), ("F16", "float16"), ("BF16", "bfloat16"),
    ("F32", "float32"), ("F64", "float64"), ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"),
    ("F8_E8M0", "float8_e8m0fnu"), ("C64", "complex64"),
) if hasattr(torch, name)}
"""safetensors dtype codes -> torch dtypes."""

_MAX_HEADER_SIZE = 100_000_000
"""safetensors' own limit on the JSON header of a file."""


@dataclass(frozen=True)
class _SafetensorsEntry:
    """One tensor of a safetensors file, read only when ``load`` is called (an ``hf.LazyTensor``)."""

    file: Path
    name: str
    entry: Mapping[str, Any]  # the header's {"dtype", "shape", "data_offsets"}
    data_start: int  # where the data section begins in the file
    progress: Callable[[int], None] | None = None

    @property
    def shape(self) -> list[int]:
        return list(self.entry["shape"])

    @property
    def dtype(self) -> torch.dtype:
        code = self.entry["dtype"]
        if code not in _SAFETENSORS_DTYPES:
            raise CheckpointError(f"{self.file}: tensor {self.name} has dtype {code}, which torch cannot load")
        return _SAFETENSORS_DTYPES[code]

    def load(self) -> Tensor:
        """The tensor in new memory, its bytes read from the file straight into it."""
        tensor = torch.empty(self.shape, dtype=self.dtype)
        begin, end = self.entry["data_offsets"]
        size = end - begin  # the dtype and shape's size (`_read_header`)
        if size:
            target = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
            try:
                with open(self.file, "rb", buffering=0) as fh:
                    fh.seek(self.data_start + begin)
                    got = fh.readinto(target)
            except OSError as error:
                raise CheckpointError(f"{self.file}: cannot read tensor {self.name} "
                                      f"({error.strerror or error})") from None
            if got != size:
                raise CheckpointError(f"{self.file}: truncated while reading tensor {self.name}")
        if self.progress is not None:
            self.progress(size)
        return tensor


def _data_size(entry: Mapping[str, Any]) -> int:
    begin, end = entry["data_offsets"]
    return end - begin


def _read_header(file: Path) -> tuple[dict[str, Any], int]:
    """The JSON header of a safetensors file (its tensors by name, ``__metadata__`` dropped) and where its data
    begins, after checking the file's framing: an 8-byte little-endian header length, a JSON object whose entries
    each have a dtype, a shape and data offsets, then exactly the data the header describes. An empty, truncated
    or foreign file is a ``CheckpointError`` naming it and the problem."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as fh:
            if size < 8:
                raise CheckpointError(f"{file}: {'empty file' if size == 0 else f'only {size} bytes'}, not a "
                                      "safetensors file (it starts with an 8-byte header length)")
            (header_size,) = struct.unpack("<Q", fh.read(8))
            if header_size > min(size - 8, _MAX_HEADER_SIZE):
                raise CheckpointError(f"{file}: truncated or not a safetensors file: its first 8 bytes announce a "
                                      f"{header_size:,}-byte header but the file has {size:,} bytes")
            raw_header = fh.read(header_size)
    except OSError as error:
        raise CheckpointError(f"{file}: cannot read ({error.strerror or error})") from None
    try:
        header = json.loads(raw_header)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{file}: not a safetensors file: its header is not valid JSON ({error})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: not a safetensors file: its header is not a JSON object")
    header.pop("__metadata__", None)
    malformed = [name for name, entry in header.items() if not _is_entry(entry)]
    if malformed:
        raise CheckpointError(f"{file}: not a valid safetensors file: malformed header entries for "
                              f"{summarize(malformed)}")
    described, present = max((e["data_offsets"][1] for e in header.values()), default=0), size - 8 - header_size
    if described > present:
        raise CheckpointError(f"{file}: truncated: its header describes {described:,} bytes of tensor data but only "
                              f"{present:,} follow the header")
    if described < present:
        raise CheckpointError(f"{file}: {present - described:,} bytes follow the {described:,} bytes of tensor data "
                              "its header describes (not a safetensors file, or two files joined)")
    mis_sized = [f"{name}: {e['dtype']} {e['shape']} in {_data_size(e):,} bytes" for name, e in header.items()
                 if e["dtype"] in _SAFETENSORS_DTYPES and _data_size(e) != math.prod(e["shape"])
                 * _SAFETENSORS_DTYPES[e["dtype"]].itemsize]
    if mis_sized:
        raise CheckpointError(f"{file}: not a valid safetensors file: the data of {len(mis_sized):,} "
                              f"tensor{'s' * (len(mis_sized) > 1)} does not fit its dtype and shape "
                              f"({summarize(mis_sized, sep='; ')})")
    return header, 8 + header_size


def _is_entry(entry: Any) -> bool:
    """A header entry: a dtype code, a shape of non-negative ints, and data offsets 0 ≤ begin ≤ end."""
    if not isinstance(entry, dict) or not isinstance(entry.get("dtype"), str):
        return False
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    return (isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape)
            and isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(n, int) for n in offsets)
            and 0 <= offsets[0] <= offsets[1])


def _weight_files(path: Path) -> dict[Path, list[str] | None]:
    """Map each weight file of a checkpoint to the names the index assigns to it (None: no index)."""
    if path.is_file():
        if path.suffix != ".safetensors":
            raise CheckpointError(f"{path} is a file but not a .safetensors file; expected a checkpoint directory "
                                  "(config.json + safetensors weights) or a .safetensors file")
        return {path: None}
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint at {path}: it does not exist")
    if (path / INDEX_FILE).is_file():
        return _indexed_files(path)
    if (path / SINGLE_FILE).is_file():
        return {path / SINGLE_FILE: None}
    raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} found in {path}")


def _indexed_files(directory: Path) -> dict[Path, list[str]]:
    """Group the ``weight_map`` of ``model.safetensors.index.json`` by file, checking every file exists.

    Only files directly inside ``directory`` may be named: an entry with a path separator, an absolute path,
    ``.`` or ``..`` is refused (symlinks in the directory are followed, as in a Hugging Face cache snapshot).
    """
    index_path = directory / INDEX_FILE
    try:
        index = json.loads(index_path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{index_path}: not valid JSON ({error})") from None
    except OSError as error:
        raise CheckpointError(f"{index_path}: cannot read ({error.strerror or error})") from None
    if not isinstance(index, dict) or "weight_map" not in index:
        found = f"keys {summarize(index)}" if isinstance(index, dict) else show_value(index)
        raise CheckpointError(f"{index_path}: must be a JSON object with a weight_map, got {found}")
    weight_map = index["weight_map"]
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index_path}: weight_map must be an object mapping tensor names to file names, "
                              f"got {show_value(weight_map)}")
    files: dict[Path, list[str]] = {}
    not_names, outside = [], []
    for name, file in weight_map.items():
        if not isinstance(file, str):
            not_names.append(f"{name}: {show_value(file)}")
        elif not _is_plain_file_name(file):
            outside.append(f"{name}: {show_value(file, width=300)}")
        else:
            files.setdefault(directory / file, []).append(name)
    if not_names:
        raise CheckpointError(f"{index_path}: weight_map values must be file names (strings); {len(not_names):,} "
                              f"{'is' if len(not_names) == 1 else 'are'} not: {summarize(not_names, sep='; ')}")
    if outside:
        raise CheckpointError(f"{index_path}: weight_map may only name files inside the checkpoint directory; "
                              f"{len(outside):,} {'entry does' if len(outside) == 1 else 'entries do'} not: "
                              f"{summarize(outside, sep='; ')}")
    absent = sorted(file.name for file in files if not file.is_file())
    if absent:
        raise CheckpointError(f"{index_path} refers to missing files: {summarize(absent)}")
    return files


def _is_plain_file_name(file: str) -> bool:
    """Whether an index entry is the name of a file directly inside the checkpoint directory."""
    return (file not in ("", ".", "..") and "/" not in file and "\\" not in file and "\0" not in file
            and not os.path.isabs(file) and Path(file).name == file)


def _names_to_read(file: Path, header: Mapping[str, Any], listed: list[str] | None) -> list[str]:
    """All tensors of an unindexed file, or those the index assigns to this shard (which must be in it)."""
    if listed is None:
        return list(header)
    absent = sorted(set(listed).difference(header))
    if absent:
        raise CheckpointError(f"{INDEX_FILE} places tensors in {file.name} that it does not contain: "
                              f"{summarize(absent)}")
    return listed


# ------------------------------------------------------------------------------------------------------- saving


def save_checkpoint_state(
    path: str | os.PathLike,
    state_dict: Mapping[str, Tensor],
    num_kda_heads: int,
    *,
    prefix: str = "",
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write an internal state dict to directory ``path`` in the official layout (§11.1-§11.4).

    ``prefix`` is ``""`` or ``"language_model."`` (the released multimodal checkpoint's text prefix; vision and
    projector tensors, ``vision_tower.*`` / ``mm_projector.*``, are written unprefixed either way). One
    ``model.safetensors`` is written if everything fits in ``max_shard_size`` bytes, else numbered shards plus
    ``model.safetensors.index.json``. ``metadata`` (default ``{"format": "pt"}``) goes into every file header.

    The files are staged in a temporary directory inside ``path`` and moved in so that an interrupted save
    never looks like a complete checkpoint (see ``_commit``). Other files in ``path`` (config, tokenizer) are
    kept; weight files of a previous save that the new one does not use are removed, and so are temporaries
    (``.tmp*``) that a killed save left in ``path`` (one writer per directory: ``k3.fileio``). Files get the
    umask's permissions.
    """
    if prefix not in ("", LANGUAGE_MODEL_PREFIX):
        raise ValueError(f"prefix must be '' or {LANGUAGE_MODEL_PREFIX!r}, got {prefix!r}")
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name if name.startswith(NON_TEXT_PREFIXES) else prefix + name: tensor
               for name, tensor in to_hf_state_dict(state_dict, num_kda_heads).items()}
    shards = _plan_shards(tensors, max_shard_size)
    header = dict(metadata or {"format": "pt"})
    remove_stale_temporaries(directory)
    with staging_dir(directory) as staging:
        for file, names in shards.items():
            with atomic_path(staging / file) as tmp:  # fsync'ed, umask permissions (safetensors makes 0o600)
                save_file({name: _standalone(tensors[name]) for name in names}, tmp, metadata=header)
        if len(shards) > 1:
            _write_index(staging / INDEX_FILE, tensors, shards)
        _commit(staging, directory, list(shards))


def _plan_shards(tensors: Mapping[str, Tensor], max_shard_size: int) -> dict[str, list[str]]:
    """Greedily group tensor names, in order, into files of at most ``max_shard_size`` bytes.

    A tensor larger than the limit gets a file of its own. Returns file name -> tensor names.
    """
    groups: list[list[str]] = [[]]
    group_size = 0
    for name, tensor in tensors.items():
        size = _nbytes(tensor)
        if groups[-1] and group_size + size > max_shard_size:
            groups.append([])
            group_size = 0
        groups[-1].append(name)
        group_size += size
    if len(groups) == 1:
        return {SINGLE_FILE: groups[0]}
    return {f"model-{i:05d}-of-{len(groups):05d}.safetensors": names for i, names in enumerate(groups, start=1)}


def _write_index(index_path: Path, tensors: Mapping[str, Tensor], shards: Mapping[str, Sequence[str]]) -> None:
    weight_map = {name: file for file, names in shards.items() for name in names}
    index = {
        "metadata": {"total_size": sum(_nbytes(tensor) for tensor in tensors.values())},
        "weight_map": dict(sorted(weight_map.items())),
    }
    atomic_write(index_path, json.dumps(index, indent=2) + "\n")


def _commit(staging: Path, directory: Path, files: Sequence[str]) -> None:
    """Move staged weight files (and index) from ``staging`` into ``directory``.

    A checkpoint counts as complete when it has an index, or else a ``model.safetensors``. The old markers
    that the new save replaces are removed first and the index is moved last, so every intermediate state
    is either the old complete checkpoint or an incomplete one that ``load_checkpoint_state`` rejects.
    """
    sharded = (staging / INDEX_FILE).exists()
    (directory / INDEX_FILE).unlink(missing_ok=True)
    if sharded:
        (directory / SINGLE_FILE).unlink(missing_ok=True)
    for file in files:
        os.replace(staging / file, directory / file)
    if sharded:
        os.replace(staging / INDEX_FILE, directory / INDEX_FILE)
    for stale in directory.iterdir():
        if _WEIGHT_FILE.fullmatch(stale.name) and stale.name not in files:
            stale.unlink()
    fsync_directory(directory)


def _standalone(tensor: Tensor) -> Tensor:
    """A contiguous CPU copy that shares no storage (safetensors refuses views and shared tensors)."""
    return tensor.detach().to(device="cpu", memory_format=torch.contiguous_format, copy=True)


def _nbytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()
