"""`k3 export`: the model of a training checkpoint as a plain model directory (docs/architecture.md §11).

A checkpoint of either format — safetensors (one process) or DCP shards (a torchrun job) — becomes the official
layout that `from_pretrained` and `k3 generate` read: `config.json`, safetensors in the released tensor names,
sharded by size with `model.safetensors.index.json` when larger than one shard, and the checkpoint's tokenizer
(and processor) files. The directory is staged and renamed into place (an existing one is replaced whole).
The model is assembled on this one process (a full copy in memory).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from k3.checkpoint.io import DEFAULT_MAX_SHARD_SIZE
from k3.config import K3Config
from k3.fileio import atomic_directory
from k3.train.checkpoint import DCP_DIR, DCP_ERRORS, LOAD_ERRORS, STATE_JSON, STATE_TENSORS, DamagedCheckpoint, \
    checkpoint_candidates, dcp_failure, is_sharded, read_training_state, single_process_dcp
from k3.train.tasks import TASKS

_NOT_COPIED = {DCP_DIR, STATE_JSON, STATE_TENSORS, "config.json"}  # besides the weights (model*): written anew


def run_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint directory itself, or the newest complete checkpoint of a run directory."""
    path = Path(path)
    if (path / STATE_JSON).is_file():
        return path
    if not path.is_dir():
        raise ValueError(f"{path} is neither a run directory nor a training checkpoint")
    candidates = checkpoint_candidates(path)
    if not candidates:
        raise ValueError(f"{path} holds no training checkpoint (checkpoints/step_*)")
    return candidates[0]


def load_checkpoint_model(checkpoint: str | os.PathLike) -> torch.nn.Module:
    """The (unsharded) model of a training checkpoint, on the CPU. DamagedCheckpoint names the file at fault."""
    checkpoint = Path(checkpoint)
    model_class = TASKS[read_training_state(checkpoint)["args"].get("task") or "text"].model_class
    if not is_sharded(checkpoint):
        try:
            return model_class.from_pretrained(checkpoint)
        except LOAD_ERRORS as e:
            raise DamagedCheckpoint(checkpoint, "model.safetensors", e) from None
    try:
        model = model_class(K3Config.from_json(checkpoint))
    except LOAD_ERRORS as e:
        raise DamagedCheckpoint(checkpoint, "config.json", e) from None
    state = model.state_dict()
    try:  # only the model's entries; this process alone, even inside a torchrun job
        with single_process_dcp():
            dcp.load({"model": state}, checkpoint_id=checkpoint / DCP_DIR, no_dist=True)
    except DCP_ERRORS as e:
        raise DamagedCheckpoint(checkpoint, DCP_DIR, dcp_failure(e)) from None
    model.load_state_dict(state)
    return model


def export_checkpoint(checkpoint: str | os.PathLike, out: str | os.PathLike,
                      max_shard_size: int = DEFAULT_MAX_SHARD_SIZE, experts: str = "dense") -> Path:
    """Write the model of `checkpoint` (a checkpoint, or a run directory: its newest) to `out`, its routed experts
    `experts` ("dense", or "mxfp4" as the release stores them); returns `out`."""
    checkpoint = run_checkpoint(checkpoint)
    model = load_checkpoint_model(checkpoint)
    with atomic_directory(out) as staged:
        model.save_pretrained(staged, max_shard_size=max_shard_size, experts=experts)
        for entry in checkpoint.iterdir():
            if entry.is_file() and entry.name not in _NOT_COPIED and not entry.name.startswith("model"):
                shutil.copy2(entry, staged / entry.name)
    return Path(out)
