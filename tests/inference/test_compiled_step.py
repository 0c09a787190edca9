"""The compiled decode step (`k3.inference.compiled_step.decode_one_token`): one compiled call per decoder layer gives
the logits and caches of the modules' path, and leaves every call it does not implement to the modules."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from k3.checkpoint.hf import convert_experts
from k3.checkpoint.quantization import with_experts_format
from k3.config import K3Config
from k3.inference import compiled_step
from k3.inference.compiled_step import decode_one_token
from k3.model import K3ForCausalLM
from k3.model.moe import RoutedExperts
from k3.ops import compiled
from k3.ops.decode import MAX_ROWS as DECODE_MAX_ROWS
from k3.ops.mxfp4 import MXFP4Weight

pytestmark = pytest.mark.skipif(compiled.build("decode")[0] is None,
                                reason="the compiled decode kernel could not be built here")

EPS32 = torch.finfo(torch.float32).eps
FORMS = {  # the K3 form and its switches the compiled step implements
    "k3": {},
    "softplus gate, SwiGLU": dict(gate_lower_bound=None, hidden_act="silu"),
    "low-rank KDA gate, ungated MLA, no latent norm": dict(use_full_rank_gate=False, mla_use_output_gate=False,
                                                          latent_moe_use_norm=False),
    "no shared experts, uncapped, no renormalisation": dict(num_shared_experts=0, activation_situ_linear_beta=None,
                                                            moe_renormalize=False),
}


def spy_layer_steps(monkeypatch) -> list[int]:
    """Record the index of each layer the compiled step served."""
    served, run = [], compiled_step._run

    def spy(layer, *args):
        out = run(layer, *args)
        if out is not None:
            served.append(layer.layer_idx)
        return out

    monkeypatch.setattr(compiled_step, "_run", spy)
    return served


def modules_only(monkeypatch):
    """No compiled layer step from here on: every layer runs its modules."""
    monkeypatch.setattr(compiled_step, "_run", lambda *args: None)


def decode(model, ids, steps: int, mask=None, cache_dtype=None):
    """Prefill all but the last `steps` tokens, then decode those one at a time with `decode_one_token` (the cache
    keeps the prompt's padding): (stacked logits, cache)."""
    B, T = ids.shape
    with torch.no_grad():
        cache = model.make_cache(B, capacity=4, cache_dtype=cache_dtype)  # grown during the run
        logits = [model(ids[:, : T - steps], cache=cache,
                        attention_mask=None if mask is None else mask[:, : T - steps]).logits[:, -1]]
        for t in range(T - steps, T):
            logits.append(decode_one_token(model, ids[:, t: t + 1], cache)[:, -1])
    return torch.stack(logits, 1), cache


def assert_close_to_rounding(a, b):
    """Equal to fp32 rounding relative to the largest value: the layer step and the modules share the few-row
    products, but the modules run KDA, MLA, the router and the experts' sums in torch ops, in other orders (9e-6 at
    logits up to 4.1 seen)."""
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())


def assert_same_caches(a, b, close=torch.testing.assert_close, **tolerance):
    for la, lb in zip(a.layers, b.layers):
        for name in ("conv_state_B3WP", "recurrent_state_BHKV", "latent_BSL"):
            if hasattr(la, name):
                close(getattr(la, name), getattr(lb, name), **tolerance)


@pytest.mark.parametrize("B", [2, DECODE_MAX_ROWS])
@pytest.mark.parametrize("form", FORMS)
def test_layer_step_matches_the_modules(tiny_model, monkeypatch, form, B):
    """B sequences (up to a batching server's 16, whose MoE tokens share experts), a 6-token prefill then 5 one-token
    steps: the compiled layer step serves every layer of every step and
    gives the logits of one forward over all tokens, and the logits and caches (KDA windows and states, MLA latents)
    of the modules (the same few-row products, so to rounding) and of the torch ops (no compiled kernel at all), to
    fp32 accuracy."""
    model = tiny_model(seed=21, **FORMS[form])
    ids = torch.randint(0, model.config.vocab_size, (B, 11), generator=torch.Generator().manual_seed(21))
    served = spy_layer_steps(monkeypatch)
    logits, cache = decode(model, ids, steps=5)
    assert sorted(served) == sorted(list(range(len(model.model.layers))) * 5)

    with torch.no_grad():  # prefill + decode through the layer step == one forward over all tokens
        full_logits = model(ids).logits[:, 5:]
    torch.testing.assert_close(logits, full_logits, rtol=1e-4, atol=1e-4)

    modules_only(monkeypatch)
    module_logits, module_cache = decode(model, ids, steps=5)
    if B <= compiled.MAX_ROWS:  # the modules' projections take the same few-row products: equal to rounding
        assert_close_to_rounding(logits, module_logits)
        assert_same_caches(cache, module_cache, close=assert_close_to_rounding)
    else:  # beyond, the modules' projections are torch's matrix products, summed in another order
        torch.testing.assert_close(logits, module_logits, rtol=1e-4, atol=1e-4)
        assert_same_caches(cache, module_cache, rtol=1e-4, atol=1e-4)

    monkeypatch.setattr(compiled, "build", lambda name: (None, "off"))
    with pytest.warns(UserWarning, match="unavailable"):
        torch_logits, torch_cache = decode(model, ids, steps=5)
    torch.testing.assert_close(logits, torch_logits, rtol=1e-4, atol=1e-4)
    assert_same_caches(cache, torch_cache, rtol=1e-4, atol=1e-4)


def test_left_padded_rows_decode_through_the_layer_step(tiny_model, monkeypatch):
    """Sequences of different lengths in one batch (left padding, as a batching server's rows): every layer of every
    one-token step is one compiled call whose MLA reads each row from its first real position, with the logits and
    caches of the modules, which mask the padding."""
    model = tiny_model(seed=31)
    ids = torch.randint(0, model.config.vocab_size, (3, 12), generator=torch.Generator().manual_seed(31))
    mask = torch.ones_like(ids)
    mask[0, :3], mask[2, :6] = 0, 0
    served = spy_layer_steps(monkeypatch)
    logits, cache = decode(model, ids, steps=5, mask=mask)
    assert sorted(served) == sorted(list(range(len(model.model.layers))) * 5)
    modules_only(monkeypatch)
    module_logits, module_cache = decode(model, ids, steps=5, mask=mask)
    torch.testing.assert_close(logits, module_logits, rtol=1e-5, atol=1e-5 * module_logits.abs().max().item())
    assert_same_caches(cache, module_cache, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["autograd", "too many rows", "float64", "K2 residual"])
def test_other_calls_are_left_to_the_modules(tiny_model, monkeypatch, case):
    """No compiled layer step where it does not implement the call: with autograd, more than `MAX_ROWS` sequences,
    float64 weights, K2's plain residual stream."""
    model = tiny_model(seed=22, **({"use_block_attn_res": False} if case == "K2 residual" else {}))
    if case == "float64":
        model = model.double()
    B = DECODE_MAX_ROWS + 1 if case == "too many rows" else 2
    ids = torch.randint(0, model.config.vocab_size, (B, 8), generator=torch.Generator().manual_seed(22))
    served = spy_layer_steps(monkeypatch)
    with torch.enable_grad() if case == "autograd" else torch.no_grad():
        cache = model.make_cache(B)
        model(ids[:, :7], cache=cache)
        decode_one_token(model, ids[:, 7:], cache)
    assert served == []


@pytest.mark.parametrize("form", ["RoPE MLA", "expanded MLA decoding", "loop experts", "group-limited routing",
                                  "subclassed experts"])
def test_layers_of_other_forms_run_their_modules(tiny_model, monkeypatch, form):
    """A layer whose sequence mixer or FFN the compiled step does not implement runs its modules; the others of the
    model still take the step. A subclass of a module (expert parallelism's experts are one) may compute
    differently: its layer runs its modules too."""
    overrides, refused = {
        "RoPE MLA": (dict(mla_use_nope=False), lambda layer: not layer.is_kda),
        "expanded MLA decoding": (dict(mla_decode="expanded"), lambda layer: not layer.is_kda),
        "loop experts": (dict(moe_impl="loop"), lambda layer: hasattr(layer, "block_sparse_moe")),
        "group-limited routing": (dict(num_expert_group=2, topk_group=1),
                                  lambda layer: hasattr(layer, "block_sparse_moe")),
        "subclassed experts": ({}, lambda layer: hasattr(layer, "block_sparse_moe")),
    }[form]
    model = tiny_model(seed=22, **overrides)
    if form == "subclassed experts":
        for layer in model.model.layers:
            if hasattr(layer, "block_sparse_moe"):
                layer.block_sparse_moe.experts.__class__ = type("Subclass", (RoutedExperts,), {})
    served = spy_layer_steps(monkeypatch)
    decode(model, torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(22)), 1)
    assert sorted(served) == [layer.layer_idx for layer in model.model.layers if not refused(layer)]


def test_a_hooked_layer_runs_its_modules(tiny_model, monkeypatch):
    """A forward hook on any module of a layer (here its router) keeps that layer on its modules, so the hook sees
    its call; the other layers still take the compiled step."""
    model = tiny_model(seed=23)
    hooked = next(layer for layer in model.model.layers if hasattr(layer, "block_sparse_moe"))
    seen = []
    hooked.block_sparse_moe.gate.register_forward_hook(lambda module, args, out: seen.append(out[0].shape))
    served = spy_layer_steps(monkeypatch)
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(23))
    decode(model, ids, steps=1)
    assert sorted(served) == [i for i in range(len(model.model.layers)) if i != hooked.layer_idx]
    assert seen == [torch.Size([12, 2]), torch.Size([2, 2])]  # [B·T, k]: the prefill, then the decode step


def test_a_replaced_parameter_or_module_is_read_again(tiny_model, monkeypatch):
    """The layer's tensors are collected once and collected again when the layer has changed: after a decode step,
    a parameter, a submodule and a buffer replaced in one model and the same values given to its copy, the next
    steps match the copy's modules."""
    model = tiny_model(seed=24)
    twin = copy.deepcopy(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(24))
    decode(model, ids[:, :7], steps=1)  # the tensors of every layer collected
    g = torch.Generator().manual_seed(25)
    for m in (model, twin):
        layer = m.model.layers[1]
        layer.self_attn.o_proj.weight = nn.Parameter(torch.randn(layer.self_attn.o_proj.weight.shape, generator=g))
        moe = layer.block_sparse_moe
        moe.shared_experts = copy.deepcopy(moe.shared_experts)
        with torch.no_grad():
            moe.shared_experts.down_proj.weight.mul_(3.0)
        moe.gate.e_score_correction_bias = torch.linspace(-1, 1, m.config.num_experts)
        g.manual_seed(25)
    served = spy_layer_steps(monkeypatch)
    logits, _ = decode(model, ids, steps=2)
    assert served
    modules_only(monkeypatch)
    twin_logits, _ = decode(twin, ids, steps=2)
    assert_close_to_rounding(logits, twin_logits)


def test_a_layer_the_kernel_refuses_mid_stack(tiny_model, monkeypatch):
    """A layer whose tensors the kernel does not take (here a float64 router bias) runs its modules, between layers
    that take the compiled step: the logits and caches of the modules' path."""
    model = tiny_model(seed=26)
    refused = [layer for layer in model.model.layers if hasattr(layer, "block_sparse_moe")][1]
    gate = refused.block_sparse_moe.gate
    gate.e_score_correction_bias = gate.e_score_correction_bias.double()
    served = spy_layer_steps(monkeypatch)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(26))
    logits, cache = decode(model, ids, steps=2)
    assert sorted(served) == sorted([i for i in range(len(model.model.layers)) if i != refused.layer_idx] * 2)
    modules_only(monkeypatch)
    module_logits, module_cache = decode(model, ids, steps=2)
    assert_close_to_rounding(logits, module_logits)
    assert_same_caches(cache, module_cache, close=assert_close_to_rounding)


def test_a_module_class_reassigned_after_a_step_runs_its_modules(tiny_model, monkeypatch):
    """The form is judged once per collection of the layers' tensors; reassigning a module's class in place (no
    registry changes) collects them again, so a subclassed experts module then runs its modules."""
    model = tiny_model(seed=27)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(27))
    decode(model, ids[:, :7], steps=1)  # collected, every layer served
    moe_layers = [layer for layer in model.model.layers if hasattr(layer, "block_sparse_moe")]
    moe_layers[0].block_sparse_moe.experts.__class__ = type("Subclass", (RoutedExperts,), {})
    served = spy_layer_steps(monkeypatch)
    decode(model, ids, steps=1)
    assert sorted(served) == [i for i in range(len(model.model.layers)) if i != moe_layers[0].layer_idx]


def one_token_at_a_time(model, ids):
    """Every token of `ids` as a one-token step from an empty cache: (stacked logits, cache)."""
    with torch.no_grad():
        cache = model.make_cache(ids.shape[0], capacity=4)
        logits = [decode_one_token(model, ids[:, t: t + 1], cache)[:, -1] for t in range(ids.shape[1])]
    return torch.stack(logits, 1), cache


def assert_equal(a, b):
    assert torch.equal(a, b)


def test_a_bf16_latent_cache_under_an_fp32_model(tiny_model, monkeypatch):
    """An fp32 model over a bf16 MLA latent cache, B = 2, a 6-token prefill then 5 one-token steps: the layer step
    serves every layer of every step, reading the bf16 latents and writing each new one rounded once, with the logits
    of the modules (which widen the latents they read) to fp32 rounding and the same bf16 latents (a latent whose
    fp32 values differ by rounding may round to neighbouring bf16 numbers: one bf16 ulp)."""
    model = tiny_model(seed=42)
    ids = torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(42))
    served = spy_layer_steps(monkeypatch)
    logits, cache = decode(model, ids, steps=5, cache_dtype=torch.bfloat16)
    assert sorted(served) == sorted(list(range(len(model.model.layers))) * 5)
    modules_only(monkeypatch)
    module_logits, module_cache = decode(model, ids, steps=5, cache_dtype=torch.bfloat16)
    assert logits.dtype == torch.float32
    assert_close_to_rounding(logits, module_logits)
    for ours, theirs in zip(cache.layers, module_cache.layers):
        if hasattr(ours, "latent_BSL"):
            assert ours.latent_BSL.dtype == theirs.latent_BSL.dtype == torch.bfloat16
            torch.testing.assert_close(ours.latent_BSL, theirs.latent_BSL, rtol=2**-7, atol=1e-6)
        else:
            assert ours.conv_state_B3WP.dtype == torch.float32
            assert_close_to_rounding(ours.recurrent_state_BHKV, theirs.recurrent_state_BHKV)


def test_bf16_weights_are_read_as_their_fp32_values(tiny_model, monkeypatch):
    """The layer step reads a bf16 weight as its exact fp32 value: decoder layers holding bf16 weights (their §0.4
    tensors fp32) under an fp32 embedding, so fp32 activations and caches, give bit for bit the logits and caches of
    the same model holding those values in fp32 (the same kernels, the same order of operations). Every token is a
    one-token step: the modules would refuse the mixed dtypes of a longer call, as `F.linear` does."""
    model = tiny_model(seed=28)
    model.model.layers.to(torch.bfloat16)
    assert model.model.layers[0].self_attn.A_log.dtype == torch.float32
    twin = copy.deepcopy(model).float()
    served = spy_layer_steps(monkeypatch)
    ids = torch.randint(0, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(28))
    logits, cache = one_token_at_a_time(model, ids)
    assert sorted(served) == sorted(list(range(len(model.model.layers))) * 6)
    twin_logits, twin_cache = one_token_at_a_time(twin, ids)
    assert torch.equal(logits, twin_logits)
    assert_same_caches(cache, twin_cache, close=assert_equal)


def test_a_bf16_model_decodes_through_the_layer_step(monkeypatch):
    """k3-tiny in bf16 (`.to(torch.bfloat16)`, the §0.4 tensors fp32), B = 2, an 8-token prefill then 8 one-token
    steps: the layer step serves every layer of every step, and the logits and caches keep the dtypes of the
    modules' path (bf16; the KDA state fp32). Its logits, those of the modules and those of the torch ops (every kernel switched off) are each within 2 bf16 ulps of the largest logit of the fp32 model
    holding the same values, and the layer step's within 2 ulps of the torch ops': every path ends in bf16 logits
    (`lm_head` rounds once: half an ulp) after bf16 activations rounded at different places — once per layer in the
    layer step, after every operation in the torch ops — which moved the logits by at most one more ulp here
    (random init: top-2 margins of 0.001–0.005 at logits near 1, below one ulp, so greedy tokens are not compared)."""
    torch.manual_seed(29)
    model = K3ForCausalLM(K3Config.from_preset("k3-tiny")).eval().to(torch.bfloat16)
    assert model.model.layers[0].self_attn.dt_bias.dtype == torch.float32
    fp32_model = copy.deepcopy(model).float()
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(29))
    served = spy_layer_steps(monkeypatch)
    logits, cache = decode(model, ids, steps=8)
    assert sorted(served) == sorted(list(range(len(model.model.layers))) * 8)
    reference, _ = decode(fp32_model, ids, steps=8)
    modules_only(monkeypatch)
    module_logits, module_cache = decode(model, ids, steps=8)
    monkeypatch.setattr(compiled, "build", lambda name: (None, "off"))
    with pytest.warns(UserWarning, match="unavailable"):
        torch_logits, torch_cache = decode(model, ids, steps=8)
    assert logits.dtype == module_logits.dtype == torch_logits.dtype == torch.bfloat16
    for ours, theirs in zip(cache.layers, torch_cache.layers):
        for name in ("conv_state_B3WP", "recurrent_state_BHKV", "latent_BSL"):
            if hasattr(ours, name):
                assert getattr(ours, name).dtype == getattr(theirs, name).dtype
    ulp = 2.0 ** (torch.floor(torch.log2(reference.abs().max())).item() - 7)  # bf16: 8 significant bits
    for path in (logits, module_logits, torch_logits):
        assert (path.float() - reference).abs().max() <= 2 * ulp
    assert (logits.float() - torch_logits.float()).abs().max() <= 2 * ulp


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_experts_decode_through_the_layer_step(tiny_model, monkeypatch, dtype):
    """A model holding its routed experts packed in MXFP4 (§11.5), B = 2, a 6-token prefill then 5 one-token steps:
    the layer step serves every layer of every step (the experts' blocks decoded in registers), and its logits and
    caches are those of the same model holding the decoded weights densely, through the layer step and through the
    modules alike: in fp32 to 1e-5 (a packed row's blocks are summed scaled, a dense row plainly, so the sums round
    differently), in bf16 within one ulp of the largest logit."""
    dense = tiny_model(seed=30, routed_expert_hidden_size=64, moe_intermediate_size=32)
    state = convert_experts(dense.state_dict(), "mxfp4")
    packed = K3ForCausalLM(with_experts_format(dense.config, "mxfp4")).eval()
    packed.load_state_dict(state)
    dense.load_state_dict(convert_experts(state, "dense"))  # the decoded values, held densely
    packed, dense = packed.to(dtype), dense.to(dtype)
    assert isinstance(packed.model.layers[1].block_sparse_moe.experts.w1, MXFP4Weight)
    ids = torch.randint(0, dense.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(30))
    served = spy_layer_steps(monkeypatch)
    runs = [decode(packed, ids, steps=5), decode(dense, ids, steps=5)]
    assert sorted(served) == sorted(list(range(len(packed.model.layers))) * 10)
    modules_only(monkeypatch)
    runs += [decode(packed, ids, steps=5), decode(dense, ids, steps=5)]
    for (logits, cache), (dense_logits, dense_cache) in (runs[:2], runs[2:]):
        assert logits.dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(logits, dense_logits, rtol=1e-5, atol=1e-5 * dense_logits.abs().max().item())
            assert_same_caches(cache, dense_cache, close=lambda a, b: torch.testing.assert_close(
                a, b, rtol=1e-5, atol=1e-5 * max(1.0, b.abs().max().item())))  # 1.09e-5 seen on an AVX2 build
        else:
            ulp = 2.0 ** (torch.floor(torch.log2(dense_logits.float().abs().max())).item() - 7)
            assert (logits.float() - dense_logits.float()).abs().max() <= ulp
