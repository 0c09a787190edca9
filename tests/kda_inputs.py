"""KDA core inputs for the op tests (importable: tests/ is on sys.path): random q, k, v, g, β with K3's bounded
gates, packed-document ids, and the chunkwise backends."""
# Shape suffixes: B batch, T time, H heads, K key dim, V value dim.

import pytest
import torch
import torch.nn.functional as F

from k3.ops.kda import cpu

CHUNK_BACKENDS = ("torch", "compiled")  # `chunk_kda(backend=...)`: the same algorithm in torch ops and compiled


def chunk_backend(name):
    """`name`, or skip the test where the compiled kernel could not be built."""
    if name == "compiled" and not cpu.available():
        pytest.skip("the compiled KDA kernel could not be built here")
    return name

# rows of 37 tokens: one-token documents, documents longer than a chunk, a boundary on a chunk edge (16)
LENGTHS = [[16, 1, 20], [37], [5, 5, 5, 22], [1, 1, 35]]


def kda_inputs(B, T, H=2, K=12, V=20, dtype=torch.float64, seed=0):
    """q, k L2-normalised, v, g ∈ (−5, 0) (K3's bounded gate), β ∈ (0, 1); drawn in float64, cast to `dtype`.
    The defaults have K ≠ V."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    return dict(q=F.normalize(randn(B, T, H, K), dim=-1), k=F.normalize(randn(B, T, H, K), dim=-1),
                v=randn(B, T, H, V), g=-5 * torch.sigmoid(3 * randn(B, T, H, K)), beta=torch.sigmoid(randn(B, T, H)))


def documents(lengths_per_row):
    """document_ids [rows, T] of rows holding documents of the given lengths."""
    return torch.tensor([[d for d, n in enumerate(row) for _ in range(n)] for row in lengths_per_row])
