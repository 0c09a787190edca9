"""Training checkpoints: everything a run needs to continue bit-exactly, written atomically (no pickle).

A checkpoint is a directory `step_NNNNNNN/` holding the model in the official layout (`config.json` +
safetensors, the router biases of Quantile Balancing included as `e_score_correction_bias`), the tokenizer, and
`trainer_state.safetensors` + `trainer_state.json`: optimiser states (tensors in safetensors, everything else in
JSON), RNG states, the data position and the metrics so far. It is written to a temporary directory and
renamed into place, and `latest` (a one-line file) is replaced last, so a run killed at any moment resumes from
the last complete checkpoint. Every checkpoint is kept; a damaged one (a truncated file, a missing tensor, bad
JSON) is reported by `load_training_state` / `read_training_state` as `DamagedCheckpoint`, naming the file, and
`checkpoint_candidates` lists the older ones a resume can fall back to.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from k3.fileio import atomic_directory, atomic_path, atomic_write, describe_error, remove_stale_temporaries

LATEST = "latest"
STATE_TENSORS = "trainer_state.safetensors"
STATE_JSON = "trainer_state.json"
_STEP_DIR = re.compile(r"step_(\d+)")
LOAD_ERRORS = (OSError, ValueError, KeyError, TypeError, IndexError, RuntimeError, SafetensorError)
"""What reading a damaged checkpoint raises (torch: RuntimeError for a bad RNG state; safetensors: its own)."""


class DamagedCheckpoint(ValueError):
    """A checkpoint that cannot be loaded; `file` is the damaged file (relative to `checkpoint`)."""

    def __init__(self, checkpoint: Path, file: str, reason: str | BaseException):
        if isinstance(reason, BaseException):
            reason = describe_error(reason)
        self.checkpoint, self.file, self.reason = Path(checkpoint), file, reason
        super().__init__(f"{self.checkpoint / file}: {reason}")


class IncompatibleResume(ValueError):
    """`--resume` asked for something the run cannot do (changed settings, a changed corpus): nothing to fall
    back from, unlike `DamagedCheckpoint`."""


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
    state (data position, schedule, metrics history, ...). The directory is staged as a `.tmp-*` sibling and
    renamed into place (`k3.fileio.atomic_directory`); temporaries of a killed save are removed first. On any
    failure (a full disk: OSError) the staged directory is removed and the previous checkpoints and `latest`
    are untouched. A `step_<step>` directory already there (e.g. a damaged one a resume skipped) is replaced.
    """
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(root)  # the run owns its checkpoints: one writer
    final = root / f"step_{step:07d}"
    with atomic_directory(final) as tmp:
        model.save_pretrained(tmp)
        files.save(tmp)
        tensors: dict[str, torch.Tensor] = {"rng.cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            for i, s in enumerate(torch.cuda.get_rng_state_all()):
                tensors[f"rng.cuda.{i}"] = s
        optim = [_flatten_optimizer(f"optim{i}", opt.state_dict(), tensors) for i, opt in enumerate(optimizers)]
        with atomic_path(tmp / STATE_TENSORS) as path:
            save_file(tensors, path)
        atomic_write(tmp / STATE_JSON, json.dumps({"step": step, "optimizers": optim, **extra}, indent=1))
    atomic_write(root / LATEST, final.name + "\n")
    return final


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The directory `latest` points to, or None if the run has no complete checkpoint."""
    pointer = Path(run_dir) / "checkpoints" / LATEST
    if not pointer.is_file():
        return None
    try:
        path = pointer.parent / pointer.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return path if _STEP_DIR.fullmatch(path.name) and (path / STATE_JSON).is_file() else None


def checkpoint_candidates(run_dir: str | os.PathLike) -> list[Path]:
    """The checkpoints a resume may start from, best first: the one `latest` names, then the older `step_*`
    directories, newest first (without a usable `latest`: every `step_*` directory, newest first). Newer
    directories than `latest` are left out: a resume that fell back from a damaged one continued from an
    older step, so they belong to an abandoned line (each is replaced when the run reaches its step again)."""
    root = Path(run_dir) / "checkpoints"
    try:
        steps = sorted(((int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.fullmatch(p.name))
                        and p.is_dir()), reverse=True)
    except (FileNotFoundError, NotADirectoryError):
        return []
    latest = latest_checkpoint(run_dir)
    if latest is None:
        return [p for _, p in steps]
    newest = int(_STEP_DIR.fullmatch(latest.name).group(1))
    return [latest] + [p for step, p in steps if step < newest]


def read_training_state(checkpoint: str | os.PathLike) -> dict[str, Any]:
    """The JSON run state of a checkpoint (`trainer_state.json`), checked for the keys a resume needs;
    DamagedCheckpoint if it is unreadable."""
    checkpoint = Path(checkpoint)
    try:
        saved = json.loads((checkpoint / STATE_JSON).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DamagedCheckpoint(checkpoint, STATE_JSON, e) from None
    if not isinstance(saved, dict):
        raise DamagedCheckpoint(checkpoint, STATE_JSON, "not a JSON object")
    for key, kind in (("step", int), ("total_steps", int), ("optimizers", list), ("history", list),
                      ("data", dict), ("args", dict)):
        if not isinstance(saved.get(key), kind) or isinstance(saved.get(key), bool):
            raise DamagedCheckpoint(checkpoint, STATE_JSON, f"missing or malformed {key!r}")
    return saved


def load_training_state(checkpoint: str | os.PathLike, optimizers: list) -> dict[str, Any]:
    """Restore optimiser and RNG states from a checkpoint; return its JSON run state (with `step`).
    DamagedCheckpoint names the file at fault; the RNG states are set last, only once everything else loaded."""
    checkpoint = Path(checkpoint)
    saved = read_training_state(checkpoint)
    try:
        tensors = load_file(checkpoint / STATE_TENSORS)
    except LOAD_ERRORS as e:
        raise DamagedCheckpoint(checkpoint, STATE_TENSORS, e) from None
    if len(saved["optimizers"]) != len(optimizers):
        raise DamagedCheckpoint(checkpoint, STATE_JSON, f"holds {len(saved['optimizers'])} optimiser states, "
                                                        f"expected {len(optimizers)}")
    for i, (opt, state) in enumerate(zip(optimizers, saved.pop("optimizers"))):
        try:
            unflattened = _unflatten_optimizer(state, tensors)
        except KeyError as e:
            tensor = str(e.args[0] if e.args else "").startswith(f"optim{i}.")
            raise DamagedCheckpoint(checkpoint, STATE_TENSORS if tensor else STATE_JSON, e) from None
        except LOAD_ERRORS as e:
            raise DamagedCheckpoint(checkpoint, STATE_JSON, f"optimiser {i}: {describe_error(e)}") from None
        try:
            opt.load_state_dict(unflattened)
        except LOAD_ERRORS as e:
            raise DamagedCheckpoint(checkpoint, STATE_JSON, f"optimiser {i}: {describe_error(e)}") from None
    cuda_states = [tensors[k] for k in sorted(tensors) if k.startswith("rng.cuda.")]
    try:
        torch.set_rng_state(tensors["rng.cpu"])
        if cuda_states and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(cuda_states)
    except LOAD_ERRORS as e:
        raise DamagedCheckpoint(checkpoint, STATE_TENSORS, f"bad RNG state: {describe_error(e)}") from None
    return saved
