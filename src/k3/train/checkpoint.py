"""Training checkpoints: everything a run needs to continue bit-exactly, written atomically (no pickle).

A checkpoint is a directory `step_NNNNNNN/` holding the model in the official layout (`config.json` +
safetensors, the router biases of Quantile Balancing included as `e_score_correction_bias`), the tokenizer, and
`trainer_state.safetensors` + `trainer_state.json`: optimiser states (tensors in safetensors, everything else in
JSON), RNG states, the data position and the metrics so far. It is written to a temporary directory and
renamed into place, and `latest` (a one-line file) is replaced last, so a run killed at any moment resumes from
the last complete checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

LATEST = "latest"
STATE_TENSORS = "trainer_state.safetensors"
STATE_JSON = "trainer_state.json"


def _flatten_optimizer(prefix: str, state_dict: dict, tensors: dict[str, torch.Tensor]) -> dict:
    """Move the tensors of an optimiser state dict into `tensors`; return the JSON-able rest."""
    state = {}
    for param_id, entries in state_dict["state"].items():
        state[str(param_id)] = {}
        for name, value in entries.items():
            if isinstance(value, torch.Tensor):
                key = f"{prefix}.{param_id}.{name}"
                tensors[key] = value.detach().cpu().contiguous().clone()
                state[str(param_id)][name] = {"tensor": key}
            else:
                state[str(param_id)][name] = value
    groups = [{k: {"dtype": str(v).removeprefix("torch.")} if isinstance(v, torch.dtype) else v
               for k, v in group.items()} for group in state_dict["param_groups"]]
    return {"state": state, "param_groups": groups}


def _unflatten_optimizer(saved: dict, tensors: dict[str, torch.Tensor]) -> dict:
    state = {}
    for param_id, entries in saved["state"].items():
        state[int(param_id)] = {name: tensors[v["tensor"]] if isinstance(v, dict) and "tensor" in v else v
                                for name, v in entries.items()}
    groups = [{k: getattr(torch, v["dtype"]) if isinstance(v, dict) and set(v) == {"dtype"} else v
               for k, v in group.items()} for group in saved["param_groups"]]
    return {"state": state, "param_groups": groups}


def save_training_checkpoint(run_dir: str | os.PathLike, step: int, model, files, optimizers: list,
                             extra: dict[str, Any]) -> Path:
    """Write `run_dir/checkpoints/step_<step>/` atomically and point `latest` at it; returns its path.

    `files.save(directory)` writes the non-weight files (tokenizer, processor config). `extra` is JSON-able run
    state (data position, schedule, metrics history, ...).
    """
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:07d}"
    tmp = root / f".tmp-step_{step:07d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    model.save_pretrained(tmp)
    files.save(tmp)
    tensors: dict[str, torch.Tensor] = {"rng.cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{i}"] = s
    optim = [_flatten_optimizer(f"optim{i}", opt.state_dict(), tensors) for i, opt in enumerate(optimizers)]
    save_file(tensors, tmp / STATE_TENSORS)
    (tmp / STATE_JSON).write_text(json.dumps({"step": step, "optimizers": optim, **extra}, indent=1))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    latest_tmp = root / f".{LATEST}.tmp"
    latest_tmp.write_text(final.name + "\n")
    os.replace(latest_tmp, root / LATEST)
    return final


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The directory `latest` points to, or None if the run has no complete checkpoint."""
    pointer = Path(run_dir) / "checkpoints" / LATEST
    if not pointer.is_file():
        return None
    path = pointer.parent / pointer.read_text().strip()
    return path if (path / STATE_JSON).is_file() else None


def load_training_state(checkpoint: str | os.PathLike, optimizers: list) -> dict[str, Any]:
    """Restore optimiser and RNG states from a checkpoint; return its JSON run state (with `step`)."""
    checkpoint = Path(checkpoint)
    tensors = load_file(checkpoint / STATE_TENSORS)
    saved = json.loads((checkpoint / STATE_JSON).read_text())
    if len(saved["optimizers"]) != len(optimizers):
        raise ValueError(f"{checkpoint} holds {len(saved['optimizers'])} optimiser states, expected {len(optimizers)}")
    for opt, state in zip(optimizers, saved.pop("optimizers")):
        opt.load_state_dict(_unflatten_optimizer(state, tensors))
    torch.set_rng_state(tensors["rng.cpu"])
    cuda_states = [tensors[k] for k in sorted(tensors) if k.startswith("rng.cuda.")]
    if cuda_states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda_states)
    return saved
