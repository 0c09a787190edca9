"""The generators' states in a training checkpoint (`k3.train.checkpoint`): the CPU generator's, and one CUDA
generator state per rank of the job, each of that rank's own device, restored on resume by rank number (a resume on
more GPUs keeps the seeded generators of the new ranks). No GPU here: torch.cuda's state functions are stand-ins."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from k3.train import checkpoint
from k3.train.checkpoint import DamagedCheckpoint, cuda_rng_state, rng_states


@pytest.fixture
def fake_cuda(monkeypatch):
    """A CUDA generator per device, each a distinct byte tensor; `current` is this process's device."""
    devices = {"states": {d: torch.full((16,), d, dtype=torch.uint8) for d in range(12)}, "current": 3}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": devices["states"][devices["current"]])

    def set_state(state, device="cuda"):
        devices["states"][devices["current"]] = state

    monkeypatch.setattr(torch.cuda, "set_rng_state", set_state)
    return devices


def test_one_state_per_rank_numbered_by_rank(fake_cuda):
    """A process saves the generator of its own device (not every visible one); a job's gathered states are keyed
    by rank."""
    assert torch.equal(cuda_rng_state(), torch.full((16,), 3, dtype=torch.uint8))
    states = [torch.full((16,), 100 + r, dtype=torch.uint8) for r in range(12)]
    tensors = rng_states(states)
    assert sorted(k for k in tensors if k.startswith("rng.cuda.")) == sorted(f"rng.cuda.{r}" for r in range(12))
    assert torch.equal(tensors["rng.cpu"], torch.get_rng_state())
    assert set(rng_states([None, None])) == {"rng.cpu"}  # CPU ranks: no CUDA state


@pytest.mark.parametrize("rank", [0, 2, 10, 11])
def test_each_rank_restores_its_own_state(fake_cuda, rank):
    """Rank r takes `rng.cuda.r`, read as a number (rank 10's is not rank 1's followed by a 0)."""
    tensors = rng_states([torch.full((16,), 100 + r, dtype=torch.uint8) for r in range(12)])
    checkpoint._set_rng_states(Path("step_0000001"), tensors, rank)
    assert torch.equal(fake_cuda["states"][3], torch.full((16,), 100 + rank, dtype=torch.uint8))


def test_a_resume_on_more_ranks_keeps_the_new_ranks_seeded(fake_cuda):
    tensors = rng_states([torch.full((16,), 100 + r, dtype=torch.uint8) for r in range(2)])
    checkpoint._set_rng_states(Path("step_0000001"), tensors, 5)
    assert torch.equal(fake_cuda["states"][3], torch.full((16,), 3, dtype=torch.uint8))


def test_a_bad_state_names_the_file(fake_cuda):
    tensors = rng_states([torch.zeros(16, dtype=torch.uint8)])
    tensors["rng.cpu"] = tensors["rng.cpu"][:7].clone()
    with pytest.raises(DamagedCheckpoint, match="trainer_state.safetensors.*bad RNG state"):
        checkpoint._set_rng_states(Path("step_0000001"), tensors, 0)
