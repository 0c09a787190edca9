"""The CUDA fast paths against the CPU torch reference (docs/architecture.md §3.11). Skipped without a GPU; the
fla tests also without flash-linear-attention (`pip install 'kimi-k3[cuda]'`).

* KDA core: fla's `chunk_kda` (forward and every gradient), with an initial and a final state, packed rows
  through `cu_seqlens`, and `fused_recurrent_kda` for one decode token, against `recurrent_kda` in float64 on
  the CPU;
* the routed experts' grouped matmul on CUDA against one matmul per expert;
* the whole model on CUDA (fla core, SDPA attention, grouped experts): fp32 logits against the CPU forward,
  bf16 autocast close to them, prefill + decode equal to the full forward, and one training step.

The model comparisons are routing-aware (`routing.py`): fla's Triton kernels multiply fp32 in TF32 (10-bit
mantissas) and the GPU sums in other orders, so a router decision within GPU_TIE_TOL of a tie may pick another expert
on the GPU; such flips are allowed, and the tokens after one (in the same row) are held to TOL_AFTER_FLIP. A flip of
a decision with a wider margin fails the test: the two forwards differ for real.
"""
# Shape suffixes: B batch, T time, H heads, K key dim, V value dim, E experts, N rows.

import pytest
import torch

from k3.config import K3Config
from k3.model import K3ForCausalLM
from k3.model.cache import K3Cache
from k3.ops.grouped_mm import grouped_mm
from k3.ops.kda import recurrent_kda
from k3.ops.kda.gpu import fla_kda, fla_kernels
from k3.ops.kda.varlen import kda_by_document
from kda_inputs import kda_inputs
from routing import assert_close_except_flips, record_routing, routing_diff

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_fla = pytest.mark.skipif(fla_kernels() is None, reason="needs flash-linear-attention")
CUDA = torch.device("cuda")
GPU_TIE_TOL = 5e-3  # a choice-score margin the TF32 products of the GPU forward may cross (scores near 0.5)
FLIP_SHARE = 0.05  # flipped tokens allowed: a relative perturbation of 3e-4 of the weights flipped 1.5 % on the CPU
TOL_AFTER_FLIP = 5e-2  # logits after a flipped token of the same row (a flip moves k3-tiny's logits by ~1e-2)


def on_cuda(x, dtype=torch.float32, grad=False):
    return {name: t.to(CUDA, dtype).requires_grad_(grad) for name, t in x.items()}


@needs_fla
@pytest.mark.parametrize("K, V", [(128, 128), (32, 32), (64, 128)])
def test_fla_chunk_forward_and_gradients(K, V):
    x = kda_inputs(2, 300, 4, K, V)
    S0 = torch.randn(2, 4, K, V, dtype=torch.float64)
    ref = {n: t.clone().requires_grad_() for n, t in x.items()}
    o_ref, S_ref = recurrent_kda(**ref, initial_state=S0, output_final_state=True)
    do = torch.randn_like(o_ref)
    (o_ref * do).sum().backward()
    fast = on_cuda(x, grad=True)
    o, S = fla_kda(**fast, initial_state=S0.to(CUDA), output_final_state=True)
    (o * do.to(CUDA, o.dtype)).sum().backward()
    torch.testing.assert_close(o.double().cpu(), o_ref.detach(), rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(S.double().cpu(), S_ref, rtol=2e-3, atol=2e-3)
    for name in ("q", "k", "v", "g", "beta"):
        scale = ref[name].grad.abs().max()
        torch.testing.assert_close(fast[name].grad.double().cpu() / scale, ref[name].grad / scale,
                                   rtol=0, atol=5e-3, msg=f"d{name}")


@needs_fla
def test_fla_bf16_close_to_the_reference():
    x = kda_inputs(1, 512, 4, 128, 128, seed=1)
    o_ref, _ = recurrent_kda(**x)
    fast = on_cuda(x)
    fast.update(q=fast["q"].bfloat16(), k=fast["k"].bfloat16(), v=fast["v"].bfloat16())
    o, _ = fla_kda(**fast)
    assert o.dtype == torch.bfloat16
    err = (o.double().cpu() - o_ref).norm() / o_ref.norm()
    assert err < 2e-2, f"relative error {err:.2e}"


@needs_fla
def test_fla_packed_rows_and_decode_token():
    x = kda_inputs(3, 130, 2, 64, 64, seed=2)
    ids = torch.tensor([[0] * 64 + [1] * 66, [0] * 1 + [1] * 129, [0] * 40 + [1] * 40 + [2] * 50])
    o_ref = kda_by_document(recurrent_kda, **x, document_ids_BT=ids)
    o, _ = fla_kda(**on_cuda(x), document_ids=ids.to(CUDA))
    torch.testing.assert_close(o.double().cpu(), o_ref, rtol=2e-3, atol=2e-3)
    one = {n: t[:, :1] for n, t in x.items()}
    S0 = torch.randn(3, 2, 64, 64, dtype=torch.float64)
    o_ref, S_ref = recurrent_kda(**one, initial_state=S0, output_final_state=True)
    o, S = fla_kda(**on_cuda(one), initial_state=S0.to(CUDA), output_final_state=True)
    torch.testing.assert_close(o.double().cpu(), o_ref, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(S.double().cpu(), S_ref, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_on_cuda(dtype):
    gen = torch.Generator().manual_seed(0)
    counts = torch.tensor([5, 0, 17, 3])
    x_NA = torch.randn(int(counts.sum()), 64, generator=gen)
    w_EAB = torch.randn(4, 64, 48, generator=gen)
    expected = torch.cat([x @ w for x, w in zip(x_NA.split(counts.tolist()), w_EAB)])
    got = grouped_mm(x_NA.to(CUDA, dtype), w_EAB.to(CUDA, dtype), counts.to(CUDA))
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got.float().cpu(), expected, rtol=tol, atol=tol * 8)


def _models(preset="k3-tiny", seed=0):
    torch.manual_seed(seed)
    cpu = K3ForCausalLM(K3Config.from_preset(preset)).eval()
    gpu = K3ForCausalLM(cpu.config).to(CUDA).eval()
    gpu.load_state_dict(cpu.state_dict())
    return cpu, gpu


def test_model_on_cuda_matches_the_cpu_forward():
    cpu, gpu = _models()
    ids = torch.randint(0, cpu.config.vocab_size, (2, 200), generator=torch.Generator().manual_seed(1))
    docs = torch.tensor([[0] * 120 + [1] * 80, [0] * 200])
    with torch.no_grad():
        with record_routing(cpu) as cpu_routing:
            ref = cpu(input_ids=ids, document_ids=docs).logits
        with record_routing(gpu) as gpu_routing:
            out = gpu(input_ids=ids.to(CUDA), document_ids=docs.to(CUDA)).logits
        diff = routing_diff(cpu_routing.routing(), gpu_routing.routing(), GPU_TIE_TOL, window=ids.shape[1],
                            max_flips=int(FLIP_SHARE * ids.numel()))
        assert_close_except_flips(out.cpu(), ref, diff, 1e-3, tol_after=TOL_AFTER_FLIP, what="fp32 logits")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            low = gpu(input_ids=ids.to(CUDA), document_ids=docs.to(CUDA)).logits
    err = (low.float().cpu() - ref).norm() / ref.norm()
    assert err < 5e-2, f"bf16 relative error {err:.2e}"


def test_prefill_and_decode_on_cuda_equal_the_full_forward():
    _, gpu = _models(seed=2)
    ids = torch.randint(0, gpu.config.vocab_size, (2, 150), generator=torch.Generator().manual_seed(3)).to(CUDA)
    with torch.no_grad():
        with record_routing(gpu) as full_routing:
            full = gpu(input_ids=ids).logits
        cache = K3Cache(gpu.config, batch_size=2, dtype=torch.float32, device=CUDA)
        with record_routing(gpu) as step_routing:
            steps = [gpu(input_ids=ids[:, :140], cache=cache).logits]
            steps += [gpu(input_ids=ids[:, t:t + 1], cache=cache).logits for t in range(140, 150)]
    diff = routing_diff(full_routing.routing(), step_routing.routing(), GPU_TIE_TOL, window=ids.shape[1],
                        max_flips=int(FLIP_SHARE * ids.numel()))
    assert_close_except_flips(torch.cat(steps, 1).cpu(), full.cpu(), diff, 1e-3, tol_after=TOL_AFTER_FLIP,
                              what="prefill + decode logits")


def test_training_step_on_cuda_matches_the_cpu_step():
    """The gradients of one step: each parameter's to 5e-3 of its largest where every router decided alike on both
    devices; where a near tie flipped, the step's whole gradient still points the same way (cosine > 0.999)."""
    cpu, gpu = _models(seed=4)
    ids = torch.randint(0, cpu.config.vocab_size, (4, 128), generator=torch.Generator().manual_seed(5))
    routings = []
    for model, device in ((cpu, "cpu"), (gpu, CUDA)):
        model.train()
        with record_routing(model) as recorder:
            model(input_ids=ids.to(device), labels=ids.to(device)).loss.backward()
        routings.append(recorder.routing())
    diff = routing_diff(*routings, GPU_TIE_TOL, window=ids.shape[1], max_flips=int(FLIP_SHARE * ids.numel()))
    pairs = []
    for (name, p_cpu), p_gpu in zip(cpu.named_parameters(), gpu.parameters()):
        if p_cpu.grad is None:  # outside the loss's graph on both devices: layer 0's AttnRes query and gain (its
            # bank of earlier blocks is empty, so the mix is skipped)
            assert p_gpu.grad is None, name
            continue
        pairs.append((name, p_cpu.grad, p_gpu.grad.cpu()))
    if not diff.flips:
        for name, g_cpu, g_gpu in pairs:
            scale = g_cpu.abs().max().clamp_min(1e-8)
            torch.testing.assert_close(g_gpu / scale, g_cpu / scale, rtol=0, atol=5e-3, msg=name)
    else:
        flat_cpu = torch.cat([g.flatten() for _, g, _ in pairs])
        flat_gpu = torch.cat([g.flatten() for _, _, g in pairs])
        assert torch.nn.functional.cosine_similarity(flat_gpu, flat_cpu, dim=0) > 0.999, diff
