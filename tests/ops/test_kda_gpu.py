"""The GPU fast path's plumbing on the CPU (docs/architecture.md §3.11): backend choice, `cu_seqlens` from packed
rows, and `fla_kda` / the KDA layer driving kernels with fla's contract. Here the kernels are stand-ins built from
the torch reference (fla's `chunk_kda` / `fused_recurrent_kda` signature and semantics, `cu_seqlens` included);
tests/ops/test_cuda.py runs the real ones against the reference on a GPU."""
# Shape suffixes: B batch, T time, H heads, K key dim, V value dim, N documents.

from types import SimpleNamespace

import pytest
import torch

import k3.ops.kda.core as kda_core
import k3.ops.kda.gpu as gpu
from k3.model.cache import K3Cache
from k3.ops.kda import chunk_kda, recurrent_kda
from k3.ops.kda.varlen import chunk_kda_by_document
from kda_inputs import LENGTHS, documents, kda_inputs as inputs

def reference_kernel(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None):
    """fla's kernel contract from the torch reference: with `cu_seqlens` (batch 1) every segment runs from a zero
    state and no final state is returned."""
    if cu_seqlens is None:
        return chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state, chunk_size=16)
    assert q.shape[0] == 1 and initial_state is None
    bounds = cu_seqlens.tolist()
    pieces = [recurrent_kda(*(x[:, s:e] for x in (q, k, v, g, beta)), scale=scale)[0]
              for s, e in zip(bounds[:-1], bounds[1:])]
    return torch.cat(pieces, 1), None


@pytest.fixture
def stand_in(monkeypatch):
    """fla's kernels replaced by `reference_kernel`, recording which one ran."""
    calls = []

    def kernel(name):
        def run(*args, **kwargs):
            calls.append(name)
            return reference_kernel(*args, **kwargs)
        return run

    monkeypatch.setattr(gpu, "fla_kernels", lambda: SimpleNamespace(chunk=kernel("chunk"),
                                                                    fused_recurrent=kernel("fused_recurrent")))
    return calls


def test_cu_seqlens_marks_every_document_and_row_start():
    ids_BT = documents([[3, 2], [5], [1, 1, 3]])
    assert gpu.cu_seqlens(ids_BT).tolist() == [0, 3, 5, 10, 11, 12, 15]
    assert gpu.cu_seqlens(torch.zeros(2, 4, dtype=torch.long)).tolist() == [0, 4, 8]


def test_flattened_rows_with_cu_seqlens_equal_the_chunk_aligned_layout(stand_in):
    """Packed rows as one sequence cut by `cu_seqlens` give what `chunk_kda_by_document` gives (float64)."""
    x = inputs(len(LENGTHS), 37)
    ids_BT = documents(LENGTHS)
    o, state = gpu.fla_kda(**x, document_ids=ids_BT)
    assert state is None and stand_in == ["chunk"] and o.shape == (4, 37, 2, 20)
    # g and β travel in fp32, as fla takes them: agreement to fp32 rounding of the gates
    torch.testing.assert_close(o, chunk_kda_by_document(**x, document_ids_BT=ids_BT, chunk_size=16),
                               rtol=0, atol=1e-6)


def test_state_in_and_out_and_the_one_token_kernel(stand_in):
    x = inputs(2, 21, seed=1)
    S0 = torch.randn(2, 2, 12, 20, dtype=torch.float64)
    o, S = gpu.fla_kda(**x, initial_state=S0, output_final_state=True)
    o_ref, S_ref = recurrent_kda(**x, initial_state=S0, output_final_state=True)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=1e-6)  # g, β and S travel in fp32, as fla takes them
    torch.testing.assert_close(S, S_ref, rtol=0, atol=1e-5)
    one = {name: t[:, :1] for name, t in x.items()}
    gpu.fla_kda(**one, initial_state=S0, output_final_state=True)
    assert stand_in == ["chunk", "fused_recurrent"]


def test_backend_choice():
    cpu = torch.device("cpu")
    assert not any(gpu.use_fla(impl, cpu) for impl in ("auto", "chunk", "recurrent"))
    with pytest.raises(ValueError, match="KDA impl 'fla' .* need a CUDA device; use impl 'auto'"):
        gpu.use_fla("fla", cpu)


def test_no_fla_installed_falls_back_or_says_so(monkeypatch):
    monkeypatch.setattr(gpu, "fla_kernels", lambda: None)
    cuda = torch.device("cuda")  # only compared, never allocated on
    assert not gpu.use_fla("auto", cuda)
    with pytest.raises(ValueError, match=r"need flash-linear-attention \(pip install 'kimi-k3\[cuda\]'\)"):
        gpu.use_fla("fla", cuda)


def test_model_through_the_fast_path_equals_the_torch_path(stand_in, monkeypatch, tiny_model):
    """The model (projections, conv, gate, gated norm around the core) gives the same logits whichever core runs:
    packed rows, and a cached prefill followed by one decode step."""
    reference = tiny_model(seed=3, kda_impl="chunk").double()
    fast = tiny_model(seed=3, kda_impl="auto").double()
    monkeypatch.setattr(kda_core, "use_fla", lambda impl, device: impl == "auto")
    ids = torch.randint(0, reference.config.vocab_size, (3, 37), generator=torch.Generator().manual_seed(0))
    packed = dict(input_ids=ids, document_ids=documents(LENGTHS[:3]))
    torch.testing.assert_close(fast(**packed).logits, reference(**packed).logits, rtol=1e-5, atol=1e-5)
    assert set(stand_in) == {"chunk"}
    stand_in.clear()
    logits = {}
    for name, model in (("fast", fast), ("reference", reference)):
        cache = K3Cache(model.config, batch_size=3, dtype=torch.float64)
        prefill = model(input_ids=ids[:, :36], cache=cache).logits
        logits[name] = torch.cat([prefill, model(input_ids=ids[:, 36:], cache=cache).logits], 1)
    torch.testing.assert_close(logits["fast"], logits["reference"], rtol=1e-5, atol=1e-5)
    assert set(stand_in) == {"chunk", "fused_recurrent"}
