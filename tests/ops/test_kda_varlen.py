"""Packed documents through the KDA cores (docs/architecture.md §3.8, §12.3 item 4): chunk-aligned layout vs separate runs."""
# Shape suffixes: B batch, T time, H heads, K key dim, V value dim, N chunks.

import pytest
import torch

from k3.ops.kda import chunk_kda, recurrent_kda
from k3.ops.kda.varlen import chunk_aligned_layout, chunk_kda_by_document, kda_by_document
from kda_inputs import LENGTHS, documents, kda_inputs

H, K, V = 2, 12, 20  # K ≠ V: kda_inputs' defaults


def separately(x, lengths_per_row, chunk_size):
    """Each document alone through the chunked core with a zero state, concatenated back."""
    out = []
    for b, row in enumerate(lengths_per_row):
        pieces, start = [], 0
        for n in row:
            piece = {name: t[b:b + 1, start:start + n] for name, t in x.items()}
            pieces.append(chunk_kda(**piece, chunk_size=chunk_size)[0])
            start += n
        out.append(torch.cat(pieces, 1))
    return torch.cat(out)


@pytest.mark.parametrize("chunk_size", [16, 8])
def test_chunk_aligned_equals_separate_runs_float64(chunk_size):
    x = kda_inputs(len(LENGTHS), 37)
    o = chunk_kda_by_document(**x, document_ids_BT=documents(LENGTHS), chunk_size=chunk_size)
    assert o.shape == (4, 37, H, V)
    torch.testing.assert_close(o, separately(x, LENGTHS, chunk_size), rtol=0, atol=1e-12)


def test_chunk_aligned_matches_the_recurrent_reference_layout():
    """Both packed layouts agree: chunk-aligned chunked core vs padded-batch recurrent core (fp32 and grads)."""
    x = kda_inputs(len(LENGTHS), 37, dtype=torch.float32, seed=1)
    docs = documents(LENGTHS)
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    fast = chunk_kda_by_document(**leaves, document_ids_BT=docs, chunk_size=16)
    ref = kda_by_document(recurrent_kda, *x.values(), docs)
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)
    fast.square().sum().backward()
    assert all(torch.isfinite(t.grad).all() and t.grad.abs().sum() > 0 for t in leaves.values())


def test_layout_positions_and_resets():
    new_pos, reset = chunk_aligned_layout(documents([[3, 5, 1], [9]]), chunk_size=4)
    # row 0: documents at 0..2, 4..8, 12; row 1: one document 0..8; rows re-laid to 16 = 4 chunks
    assert new_pos.tolist() == [[0, 1, 2, 4, 5, 6, 7, 8, 12], [0, 1, 2, 3, 4, 5, 6, 7, 8]]
    assert reset.tolist() == [[True, True, False, True], [True, False, False, False]]


def test_padding_is_less_than_a_chunk_per_document():
    lengths = [[200, 3, 53], [256], [1, 1, 254]]
    new_pos, reset = chunk_aligned_layout(documents(lengths), chunk_size=64)
    n_docs = sum(map(len, lengths))
    assert reset.shape[1] * 64 <= 256 + 3 * 63  # each document padded by < one chunk
    assert 3 * reset.shape[1] * 64 < n_docs * 256  # the padded-batch layout: every document padded to 256
    for row in new_pos:
        assert len(set(row.tolist())) == 256  # no two tokens share a slot


def test_reset_chunks_restart_the_state():
    """`reset_chunks` = a fresh zero state entering that chunk, initial state included."""
    x = kda_inputs(1, 32)
    S0 = torch.randn(1, H, K, V, dtype=torch.float64)
    reset = torch.tensor([[False, True]])
    o, _ = chunk_kda(**x, chunk_size=16, initial_state=S0, reset_chunks=reset)
    first, _ = chunk_kda(**{n: t[:, :16] for n, t in x.items()}, chunk_size=16, initial_state=S0)
    second, _ = chunk_kda(**{n: t[:, 16:] for n, t in x.items()}, chunk_size=16)
    torch.testing.assert_close(o, torch.cat([first, second], 1), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="reset_chunks"):
        chunk_kda(**x, chunk_size=16, reset_chunks=torch.tensor([[True, False, True]]))
