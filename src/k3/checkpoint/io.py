"""Reading and writing safetensors checkpoint directories in the official layout (spec §11.1).

A checkpoint directory holds either one ``model.safetensors`` or shards ``model-0000i-of-0000N.safetensors``
listed by ``model.safetensors.index.json`` (``{"metadata": {"total_size": ...}, "weight_map": {name: file}}``).
Tensors are read lazily, one at a time, through ``safetensors.safe_open``; nothing is ever unpickled.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
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
) -> dict[str, Tensor]:
    """Load the weights of a checkpoint into the internal layout described by ``expected``.

    ``path`` is a checkpoint directory (sharded with an index, or one ``model.safetensors``) or a single
    ``.safetensors`` file. ``expected`` maps internal names to shapes or tensors (e.g. ``model.state_dict()``,
    meta tensors are fine). Names and shapes are validated before any data is read; see
    ``from_hf_state_dict`` for the translation and dtype rules.
    """
    with contextlib.ExitStack() as open_files:
        stored = {}
        for file, listed in _weight_files(Path(path)).items():
            handle = open_files.enter_context(safe_open(file, framework="pt"))
            stored.update((name, _SafetensorsEntry(handle, name)) for name in _names_to_read(file, handle, listed))
        return from_hf_state_dict(stored, expected, dtype)


@dataclass(frozen=True)
class _SafetensorsEntry:
    """One tensor of an open safetensors file, read only when ``load`` is called (an ``hf.LazyTensor``)."""

    handle: Any
    name: str

    @property
    def shape(self) -> list[int]:
        return self.handle.get_slice(self.name).get_shape()

    def load(self) -> Tensor:
        return self.handle.get_tensor(self.name)


def _weight_files(path: Path) -> dict[Path, list[str] | None]:
    """Map each weight file of a checkpoint to the names the index assigns to it (None: no index)."""
    if path.is_file():
        return {path: None}
    if (path / INDEX_FILE).is_file():
        return _indexed_files(path)
    if (path / SINGLE_FILE).is_file():
        return {path / SINGLE_FILE: None}
    raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} found in {path}")


def _indexed_files(directory: Path) -> dict[Path, list[str]]:
    """Group the ``weight_map`` of ``model.safetensors.index.json`` by file, checking every file exists."""
    index_path = directory / INDEX_FILE
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise CheckpointError(f"{index_path} is not a valid safetensors index: {error!r}") from error
    files: dict[Path, list[str]] = {}
    for name, file in weight_map.items():
        files.setdefault(directory / file, []).append(name)
    absent = sorted(file.name for file in files if not file.is_file())
    if absent:
        raise CheckpointError(f"{index_path} refers to missing files: {', '.join(absent)}")
    return files


def _names_to_read(file: Path, handle: Any, listed: list[str] | None) -> list[str]:
    """All tensors of an unindexed file, or those the index assigns to this shard (which must be in it)."""
    available = list(handle.keys())
    if listed is None:
        return available
    absent = sorted(set(listed).difference(available))
    if absent:
        names = ", ".join(absent)
        raise CheckpointError(f"{INDEX_FILE} places tensors in {file.name} that it does not contain: {names}")
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
    kept; weight files of a previous save that the new one does not use are removed.
    """
    if prefix not in ("", LANGUAGE_MODEL_PREFIX):
        raise ValueError(f"prefix must be '' or {LANGUAGE_MODEL_PREFIX!r}, got {prefix!r}")
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name if name.startswith(NON_TEXT_PREFIXES) else prefix + name: tensor
               for name, tensor in to_hf_state_dict(state_dict, num_kda_heads).items()}
    shards = _plan_shards(tensors, max_shard_size)
    header = dict(metadata or {"format": "pt"})
    staging = Path(tempfile.mkdtemp(prefix=".tmp-", dir=directory))
    try:
        for file, names in shards.items():
            save_file({name: _standalone(tensors[name]) for name in names}, staging / file, metadata=header)
        if len(shards) > 1:
            _write_index(staging / INDEX_FILE, tensors, shards)
        _commit(staging, directory, list(shards))
    finally:
        shutil.rmtree(staging, ignore_errors=True)


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
    index_path.write_text(json.dumps(index, indent=2) + "\n")


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


def _standalone(tensor: Tensor) -> Tensor:
    """A contiguous CPU copy that shares no storage (safetensors refuses views and shared tensors)."""
    return tensor.detach().to(device="cpu", memory_format=torch.contiguous_format, copy=True)


def _nbytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()
