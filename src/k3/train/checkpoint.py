"""Training checkpoints: everything a run needs to continue bit-exactly, written atomically.

A checkpoint is a directory `step_NNNNNNN/` holding the model in the official layout (`config.json` +
safetensors, the router biases of Quantile Balancing included as `e_score_correction_bias`), the tokenizer, and
`trainer_state.safetensors` + `trainer_state.json`: optimiser states (tensors in safetensors, everything else in
JSON), RNG states, the data position and the metrics so far. It is written to a temporary directory and
renamed into place, and `latest` (a one-line file) is replaced last, so a run killed at any moment resumes from
the last complete checkpoint. Every checkpoint is kept; a damaged one (a truncated file, a missing tensor, bad
JSON) is reported by `load_training_state` / `read_training_state` as `DamagedCheckpoint`, naming the file, and
`checkpoint_candidates` lists the older ones a resume can fall back to.

A torchrun job writes sharded checkpoints instead (`save_sharded_checkpoint`): the same directory with the
model and optimiser states as `torch.distributed.checkpoint` (DCP) shards in `dcp/` in place of safetensors, which
a job of any size, or a single process, loads (`load_sharded_state`). Single-process checkpoints contain no
pickle; DCP's metadata is a pickle, so load only sharded checkpoints your own runs wrote.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_optimizer_state_dict, \
    set_state_dict
from torch.distributed.tensor import DTensor

from k3.fileio import atomic_directory, atomic_path, atomic_write, describe_error, remove_stale_temporaries
from k3.checkpoint.quantization import with_experts_format

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
        tensors = rng_states([cuda_rng_state()])
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


def load_training_state(checkpoint: str | os.PathLike, optimizers: list, model=None) -> dict[str, Any]:
    """Restore optimiser and RNG states from a checkpoint; return its JSON run state (with `step`).
    DamagedCheckpoint names the file at fault; the RNG states are set last, only once everything else loaded.
    `model` (the optimisers' model) is needed when it is sharded (a torchrun job resuming a one-process run):
    each rank then takes its shards of the whole states."""
    checkpoint = Path(checkpoint)
    saved = read_training_state(checkpoint)
    try:
        tensors = load_file(checkpoint / STATE_TENSORS)
    except LOAD_ERRORS as e:
        raise DamagedCheckpoint(checkpoint, STATE_TENSORS, e) from None
    if len(saved["optimizers"]) != len(optimizers):
        raise DamagedCheckpoint(checkpoint, STATE_JSON, f"holds {len(saved['optimizers'])} optimiser states, "
                                                        f"expected {len(optimizers)}")
    states = []
    for i, state in enumerate(saved.pop("optimizers")):
        try:
            states.append(_unflatten_optimizer(state, tensors))
        except KeyError as e:
            tensor = str(e.args[0] if e.args else "").startswith(f"optim{i}.")
            raise DamagedCheckpoint(checkpoint, STATE_TENSORS if tensor else STATE_JSON, e) from None
        except LOAD_ERRORS as e:
            raise DamagedCheckpoint(checkpoint, STATE_JSON, f"optimiser {i}: {describe_error(e)}") from None
    try:  # (parameters that never had a gradient have no state: not strict)
        if model is not None and any(isinstance(p, DTensor) for p in model.parameters()):
            for opt, state in zip(optimizers, states):
                set_optimizer_state_dict(model, opt, _by_name(model, opt, state),
                                         options=StateDictOptions(full_state_dict=True, strict=False))
                for group, saved_group in zip(opt.param_groups, state["param_groups"]):
                    # set_optimizer_state_dict keeps only torch's own group options: restore Muon's (split, ...)
                    group.update({k: v for k, v in saved_group.items() if k != "params"})
        else:
            for opt, state in zip(optimizers, states):
                opt.load_state_dict(state)
    except LOAD_ERRORS as e:
        raise DamagedCheckpoint(checkpoint, STATE_JSON, f"optimiser states: {describe_error(e)}") from None
    _set_rng_states(checkpoint, tensors)
    return saved


def _by_name(model, optimizer, state: dict) -> dict:
    """An optimiser state dict (parameters numbered in the optimiser's order) keyed by parameter name, the form
    `set_optimizer_state_dict` takes."""
    names = {p: n for n, p in model.named_parameters()}
    order = [names[p] for group in optimizer.param_groups for p in group["params"]]
    return {"state": {order[i]: entries for i, entries in state["state"].items()},
            "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in state["param_groups"]]}


def cuda_rng_state() -> torch.Tensor | None:
    """This process's CUDA generator state (of its current device), None without CUDA."""
    return torch.cuda.get_rng_state() if torch.cuda.is_available() else None


def rng_states(cuda_states: list[torch.Tensor | None]) -> dict[str, torch.Tensor]:
    """The CPU generator's state and every rank's CUDA generator state (`cuda_states[rank]`, one per process of the
    job, each of its own device), under `rng.cuda.<rank>`."""
    tensors = {"rng.cpu": torch.get_rng_state()}
    tensors.update({f"rng.cuda.{rank}": state for rank, state in enumerate(cuda_states) if state is not None})
    return tensors


def _set_rng_states(checkpoint: Path, tensors: dict[str, torch.Tensor], rank: int = 0) -> None:
    """Restore the CPU generator, and this rank's CUDA generator from `rng.cuda.<rank>` (the rank number read as a
    number). A rank the checkpoint has no state for (a resume on more GPUs) keeps the generator its seed gave."""
    try:
        torch.set_rng_state(tensors["rng.cpu"])
        cuda_states = {int(key.rsplit(".", 1)[1]): t for key, t in tensors.items() if key.startswith("rng.cuda.")}
        if rank in cuda_states and torch.cuda.is_available():
            torch.cuda.set_rng_state(cuda_states[rank])
    except LOAD_ERRORS as e:
        raise DamagedCheckpoint(checkpoint, STATE_TENSORS, f"bad RNG state: {describe_error(e)}") from None


# ------------------------------------------------------------------------------------- sharded (torchrun)
DCP_DIR = "dcp"
"""Where a sharded checkpoint keeps the model and optimiser states (`torch.distributed.checkpoint`)."""


DCP_ERRORS = (Exception, CheckpointException)
"""What a DCP save or load raises: CheckpointException (a BaseException) gathers every rank's error."""


def dcp_failure(error: BaseException) -> BaseException:
    """The lowest failing rank's own error inside a CheckpointException (whose text is a traceback per rank)."""
    if isinstance(error, CheckpointException) and error.failures:
        return error.failures[min(error.failures)][0]
    return error


@contextlib.contextmanager
def single_process_dcp():
    """DCP used outside a process group (one process reading shards) warns that it assumes so — the intent here;
    the warning is filtered inside the block."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def is_sharded(checkpoint: str | os.PathLike) -> bool:
    """Whether a checkpoint holds DCP shards (written by a torchrun job) instead of safetensors."""
    return (Path(checkpoint) / DCP_DIR / ".metadata").is_file()


def weights_file(checkpoint: Path) -> str:
    """The file that marks a checkpoint's weights (the index of a sharded one), for messages."""
    return "model.safetensors.index.json" if (checkpoint / "model.safetensors.index.json").is_file() \
        else "model.safetensors"


def _agree(error: BaseException | None, what: str) -> None:
    """Collective: raise OSError on every rank when `error` is set on any (naming the first failing rank)."""
    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, None if error is None else describe_error(error))
    for rank, message in enumerate(errors):
        if message is not None:
            raise OSError(f"{what} failed on rank {rank}: {message}") from error


def save_sharded_checkpoint(run_dir: str | os.PathLike, step: int, model, files, optimizers: list,
                            extra: dict[str, Any]) -> Path:
    """Collective `save_training_checkpoint` of a torchrun job: every rank writes its shards of the model and
    optimiser states with DCP into `step_<step>/dcp/` (the `.metadata` file, written last, completes them);
    rank 0 adds the config, the tokenizer, the RNG states (the CPU generator's: all ranks draw the same global
    batches, so one copy serves any world size; each rank's CUDA generator's, gathered) and the JSON run state,
    renames the staged directory into place and updates `latest`. A failure on any rank (OSError on every rank) leaves the previous checkpoints untouched.
    DCP stores its metadata with pickle: load only checkpoints your own runs wrote."""
    root, main = Path(run_dir) / "checkpoints", dist.get_rank() == 0
    final = root / f"step_{step:07d}"
    error, staged = None, [None]
    with contextlib.ExitStack() as stack:
        if main:
            try:
                root.mkdir(parents=True, exist_ok=True)
                remove_stale_temporaries(root)
                staged[0] = str(stack.enter_context(atomic_directory(final)))
            except OSError as e:
                error = e
        _agree(error, "creating the checkpoint directory")
        dist.broadcast_object_list(staged, src=0)
        tmp = Path(staged[0])
        cuda_states: list[torch.Tensor | None] = [None] * dist.get_world_size()
        dist.all_gather_object(cuda_states, cuda_rng_state())  # each rank's own device's generator
        try:
            model_state, optim_state = get_state_dict(model, optimizers)
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=tmp / DCP_DIR)
        except DCP_ERRORS as e:  # any rank's failure is every rank's (see _agree)
            error = dcp_failure(e)
        _agree(error, "writing the checkpoint shards")
        if main:
            try:
                with_experts_format(model.config.released_layout(), "dense").save(tmp)
                files.save(tmp)
                with atomic_path(tmp / STATE_TENSORS) as path:
                    save_file(rng_states(cuda_states), path)
                atomic_write(tmp / STATE_JSON, json.dumps({"step": step, "optimizers": [], **extra}, indent=1))
            except OSError as e:
                error = e
                stack.pop_all().close()  # nothing to keep: the staged directory is removed
        _agree(error, "writing the checkpoint")
    if main:  # the staged directory is in place
        try:
            atomic_write(root / LATEST, final.name + "\n")
        except OSError as e:
            error = e
    _agree(error, "updating checkpoints/latest")
    return final


def load_sharded_state(checkpoint: str | os.PathLike, model, optimizers: list) -> dict[str, Any]:
    """Load a sharded checkpoint into `model` and `optimizers` as they are laid out now — any world size or
    expert-parallel degree, or one process without torchrun (DCP reshards on load) — then the RNG state; returns
    the JSON run state. DamagedCheckpoint names the file at fault."""
    checkpoint = Path(checkpoint)
    saved = read_training_state(checkpoint)
    model_state, optim_state = get_state_dict(model, optimizers)
    try:
        with single_process_dcp():
            dcp.load({"model": model_state}, checkpoint_id=checkpoint / DCP_DIR)
            # parameters that never had a gradient (the one-source AttnRes mix of layer 0) have no optimiser
            # state in the checkpoint; `get_state_dict` made an empty one for them, which stays
            dcp.load({"optim": optim_state}, checkpoint_id=checkpoint / DCP_DIR,
                     planner=DefaultLoadPlanner(allow_partial_load=True))
        set_state_dict(model, optimizers, model_state_dict=model_state, optim_state_dict=optim_state)
    except DCP_ERRORS as e:
        raise DamagedCheckpoint(checkpoint, DCP_DIR, dcp_failure(e)) from None
    try:
        tensors = load_file(checkpoint / STATE_TENSORS)
    except LOAD_ERRORS as e:
        raise DamagedCheckpoint(checkpoint, STATE_TENSORS, e) from None
    _set_rng_states(checkpoint, tensors, dist.get_rank() if dist.is_initialized() else 0)
    return saved
