"""Run a function on N CPU processes joined by a gloo process group, with a hard timeout.

`run_ranks(fn, world_size, *args, timeout=...)` starts `world_size` spawned processes; each calls
`fn(rank, world_size, *args)` inside an initialised gloo group (its own collectives time out too) and returns a
picklable result. The results come back in rank order. A rank that raises, exits or outlives the timeout fails
the test (every process is killed), so a hang can never block CI.
"""

from __future__ import annotations

import os
import queue as queue_module
import socket
import traceback
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _portable(value, to_numpy: bool):
    """Tensors as numpy arrays (and back): a tensor sent through a queue would be shared memory owned by a
    process that exits right after sending."""
    import numpy as np
    import torch

    if isinstance(value, dict):
        return {k: _portable(v, to_numpy) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_portable(v, to_numpy) for v in value)
    if to_numpy and isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy().copy()
    if not to_numpy and isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    return value


def _worker(fn, rank, world_size, port, collective_timeout, results, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=collective_timeout))
        results.put((rank, "ok", _portable(fn(rank, world_size, *args), to_numpy=True)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout: float = 120.0, collective_timeout: float = 60.0) -> list:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, collective_timeout, results, args))
             for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    try:
        for _ in range(world_size):
            try:
                rank, status, value = results.get(timeout=timeout)
            except queue_module.Empty:
                raise AssertionError(f"ranks {sorted(set(range(world_size)) - set(out))} did not finish within "
                                     f"{timeout} s") from None
            if status != "ok":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            out[rank] = _portable(value, to_numpy=False)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(world_size)]
