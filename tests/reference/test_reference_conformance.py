"""Conformance of the project model against the independent float64 reference (docs/architecture.md §12.1–12.2).

The project model is used only through its public surface: the constructor, `named_parameters()`, the
router-bias buffer `model.model.layers[i].block_sparse_moe.gate.e_score_correction_bias`, `save_pretrained`,
`from_pretrained`, `model(input_ids).logits`, and forward hooks on `model.model.layers[i]` (per-layer `cur`
for divergence reports), on `model.model.layers[i].block_sparse_moe.gate` (its routed expert indices) and on
the sublayers `self_attn` / `mlp` / `block_sparse_moe` (their input and output, for sublayer-isolated checks).
The reference (`k3_reference.py`) reads only the official checkpoint files written by `save_pretrained`.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from conformance import TINY_CONFORMANCE, build_tiny_config, embedding_at_initializer_range_
from k3 import K3Config
from k3_reference import (VARIANTS, load_official_checkpoint, reference_attention, reference_ffn,
                          reference_logits)

TINY = TINY_CONFORMANCE

MODEL_SEED = 0  # a deterministic scan of seeds 0..39 (this file's init + randomisation) picked this one
INPUT_SEED = 7
B = 2
TOL_MAX = 1e-3  # §12.1 acceptance thresholds
TOL_MEAN = 1e-4
# Spec §12.1 asks for a smallest top-k routing margin >= 1e-3 (~100x fp32 noise). With up to B*T*7 = 980
# routing decisions per case that is out of reach: over model seeds 0..39 the smallest margin over the
# T = 37 and T = 70 cases ranged from 3.9e-6 to 5.6e-4 (best: seed 0 with 6.5e-4 / 5.6e-4). The measured
# fp32-vs-fp64 error of the router's sigmoid scores is ~1.3e-5..2.3e-5, so we require (a) margin >= 2.5e-4 and
# (b) margin >= 10x the measured score error, and we compare the project's own routed index sets (forward
# hook on the gate) with the reference's, token by token. If the project's init order ever changes, (a) may
# fail: that means "re-pick MODEL_SEED", not a conformance bug.
MIN_ROUTING_MARGIN = 2.5e-4
MIN_MARGIN_OVER_NOISE = 10.0


# --------------------------------------------------------------------------------------------- helpers
def tiny_config() -> K3Config:
    return build_tiny_config()


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> None:
    """Spec §12.2 randomisation on top of the N(0, initializer_range²) init of the constructor."""
    gen = torch.Generator().manual_seed(10_000 + seed)
    embedding_at_initializer_range_(model)

    def randn(shape) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float64)

    for name, prm in model.named_parameters():
        if name.endswith("norm.weight"):  # includes every "layernorm.weight"
            prm.copy_(1 + 0.2 * randn(prm.shape))
        elif name.endswith("dt_bias"):
            prm.copy_(0.5 * randn(prm.shape))
        elif name.endswith("A_log"):
            prm.copy_(0.5 * randn(prm.shape))
        elif name.endswith("_res_proj.weight"):
            prm.copy_(0.15 * randn(prm.shape))
    n_bias = 0
    for layer in model.model.layers:
        moe = getattr(layer, "block_sparse_moe", None)
        if moe is not None:
            b = moe.gate.e_score_correction_bias
            b.copy_(0.1 * randn(b.shape))
            n_bias += 1
    assert n_bias == 7, n_bias


def build_model(config: K3Config, seed: int = MODEL_SEED):
    from k3.model import K3ForCausalLM

    torch.manual_seed(seed)
    model = K3ForCausalLM(config).float().eval()
    randomize(model, seed)
    return model


def make_ids(T: int) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (B, T), generator=torch.Generator().manual_seed(INPUT_SEED))


def strip(name: str) -> str:
    return name[len("language_model."):] if name.startswith("language_model.") else name


def expected_official_names(tc: dict) -> set[str]:
    """Spec §11.2 text tensor names for a text config."""
    lac = tc["linear_attn_config"]
    names = {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
             "model.output_attn_res_norm.weight", "model.output_attn_res_proj.weight"}
    for i in range(tc["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        names |= {pre + n for n in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                    "self_attention_res_norm.weight", "mlp_res_norm.weight",
                                    "self_attention_res_proj.weight", "mlp_res_proj.weight")}
        if (i + 1) in lac["kda_layers"]:
            names |= {pre + "self_attn." + n for n in (
                "q_proj.weight", "k_proj.weight", "v_proj.weight", "q_conv1d.weight", "k_conv1d.weight",
                "v_conv1d.weight", "A_log", "dt_bias", "f_a_proj.weight", "f_b_proj.weight", "b_proj.weight",
                "g_proj.weight", "o_norm.weight", "o_proj.weight")}
        else:
            names |= {pre + "self_attn." + n for n in (
                "q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight",
                "kv_a_layernorm.weight", "kv_b_proj.weight", "g_proj.weight", "o_proj.weight")}
        if i >= tc["first_k_dense_replace"]:
            moe = pre + "block_sparse_moe."
            names |= {moe + n for n in (
                "gate.weight", "gate.e_score_correction_bias", "shared_experts.gate_proj.weight",
                "shared_experts.up_proj.weight", "shared_experts.down_proj.weight",
                "routed_expert_down_proj.weight", "routed_expert_up_proj.weight", "routed_expert_norm.weight")}
            for e in range(tc["num_experts"]):
                names |= {f"{moe}experts.{e}.w{j}.weight" for j in (1, 2, 3)}
        else:
            names |= {pre + "mlp." + n for n in ("gate_proj.weight", "up_proj.weight", "down_proj.weight")}
    return names


@torch.no_grad()
def run_project(model, ids: torch.Tensor):
    """Project logits plus hook captures: per-layer `cur` and the gate's routed indices per MoE layer."""
    curs: dict[int, torch.Tensor] = {}
    gate_in: dict[int, torch.Tensor] = {}
    gate_idx: dict[int, torch.Tensor | None] = {}
    handles = []
    for i, layer in enumerate(model.model.layers):
        def layer_hook(mod, inp, out, i=i):
            curs[i] = (out[0] if isinstance(out, (tuple, list)) else out).detach().double()
        handles.append(layer.register_forward_hook(layer_hook))
        moe = getattr(layer, "block_sparse_moe", None)
        if moe is not None:
            def gate_hook(mod, inp, out, i=i):
                gate_in[i] = inp[0].detach().double()
                outs = out if isinstance(out, (tuple, list)) else (out,)
                ints = [o for o in outs if isinstance(o, torch.Tensor) and not o.is_floating_point()]
                gate_idx[i] = ints[0].detach() if ints else None
            handles.append(moe.gate.register_forward_hook(gate_hook))
    try:
        logits = model(ids).logits.detach().double()
    finally:
        for h in handles:
            h.remove()
    return logits, curs, gate_in, gate_idx


def compare(model, tensors, conf, ids) -> dict:
    ref, aux = reference_logits(tensors, conf, ids, return_aux=True)
    got, curs, gate_in, gate_idx = run_project(model, ids)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    d = (got - ref).abs()
    # per-layer divergence report (relative to the reference's scale)
    per_layer = []
    for i, r in enumerate(aux["cur"]):
        c = curs.get(i)
        per_layer.append(float("nan") if c is None or c.shape != r.shape
                         else float((c - r).abs().max() / r.abs().max()))
    # router score error: the project's router input vs the reference's, through the same fp64 router
    score_err = 0.0
    route_mismatch = 0
    route_compared = 0
    k = TINY["num_experts_per_token"]
    for i, x_ref in aux["router_input"].items():
        W = tensors[next(n for n in tensors if strip(n) == f"model.layers.{i}.block_sparse_moe.gate.weight")]
        W = W.double()
        if i in gate_in and gate_in[i].numel() == x_ref.numel():
            s_proj = torch.sigmoid(gate_in[i].reshape(-1, W.shape[1]) @ W.T)
            s_ref = torch.sigmoid(x_ref.reshape(-1, W.shape[1]) @ W.T)
            score_err = max(score_err, float((s_proj - s_ref).abs().max()))
        idx = gate_idx.get(i)
        if idx is not None and idx.numel() == x_ref.shape[0] * x_ref.shape[1] * k:
            proj_sets = idx.reshape(-1, k).sort(dim=-1).values
            ref_sets = aux["routing"][i].reshape(-1, k)
            route_mismatch += int((proj_sets != ref_sets).any(dim=-1).sum())
            route_compared += 1
    return dict(
        ref=ref, got=got, aux=aux,
        max=float(d.max()), mean=float(d.mean()),
        argmax_agree=float((got.argmax(-1) == ref.argmax(-1)).double().mean()),
        per_layer=per_layer, score_err=score_err,
        route_mismatch=route_mismatch, route_layers_compared=route_compared,
        margin=aux["min_margin"],
    )


def assert_conforms(r: dict, label: str) -> None:
    first_bad = next((i for i, e in enumerate(r["per_layer"]) if not e <= 1e-4), None)
    msg = (f"[{label}] max|dlogit|={r['max']:.3e} mean={r['mean']:.3e} argmax={r['argmax_agree']:.4f} "
           f"route_mismatch={r['route_mismatch']} margin={r['margin']:.3e} score_err={r['score_err']:.3e} "
           f"per-layer rel err of cur={[f'{e:.1e}' for e in r['per_layer']]} first layer > 1e-4: {first_bad}")
    print(msg)
    assert r["margin"] >= MIN_ROUTING_MARGIN, "routing on a knife edge for this seed/input: " + msg
    assert r["margin"] >= MIN_MARGIN_OVER_NOISE * r["score_err"], "routing margin not >> fp32 noise: " + msg
    assert r["route_layers_compared"] == 7, "could not read the project's routed indices: " + msg
    assert r["route_mismatch"] == 0, msg
    assert r["max"] <= TOL_MAX, msg
    assert r["mean"] <= TOL_MEAN, msg
    assert r["argmax_agree"] == 1.0, msg


# -------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def text_ckpt(tmp_path_factory):
    model = build_model(tiny_config())
    d = tmp_path_factory.mktemp("k3_text")
    model.save_pretrained(str(d))
    tensors, conf = load_official_checkpoint(d)
    return model, str(d), tensors, conf


@pytest.fixture(scope="module")
def mm_ckpt(tmp_path_factory):
    cfg = K3Config.from_dict({"model_type": "kimi_k3", "text_config": tiny_config().to_text_dict(),
                              "vision_config": {}})
    model = build_model(cfg)
    d = tmp_path_factory.mktemp("k3_mm")
    model.save_pretrained(str(d))
    tensors, conf = load_official_checkpoint(d)
    return model, str(d), tensors, conf


# ----------------------------------------------------------------------------------------------- tests
def test_checkpoint_uses_official_layout(text_ckpt):
    _, _, tensors, top = text_ckpt
    # a text-only save has the released multimodal top level without vision_config, text tensors prefixed
    assert top["architectures"] == ["KimiK3ForConditionalGeneration"] and "vision_config" not in top
    conf, tensors = top["text_config"], {strip(n): t for n, t in tensors.items()}
    names = set(tensors)
    expected = expected_official_names(conf)
    assert names == expected, (sorted(names - expected)[:10], sorted(expected - names)[:10])
    H = conf["linear_attn_config"]["num_heads"]
    for i in range(conf["num_hidden_layers"]):
        if (i + 1) in conf["linear_attn_config"]["kda_layers"]:
            a = tensors[f"model.layers.{i}.self_attn.A_log"]
            assert a.shape == (128,), a.shape  # §11.4: zero-padded to a multiple of 128
            assert torch.all(a[H:] == 0) and torch.any(a[:H] != 0)
        else:
            assert tensors[f"model.layers.{i}.self_attn.q_b_proj.weight"].shape == (3 * 24, 40)
            assert tensors[f"model.layers.{i}.self_attn.kv_b_proj.weight"].shape == (3 * 28, 20)
            assert tensors[f"model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight"].shape == (28, 64)
    assert tensors["model.layers.1.block_sparse_moe.experts.5.w1.weight"].shape == (20, 48)
    assert tensors["model.layers.1.block_sparse_moe.experts.5.w2.weight"].shape == (48, 20)
    assert tensors["model.layers.1.block_sparse_moe.shared_experts.gate_proj.weight"].shape == (40, 64)
    assert tensors["model.layers.1.block_sparse_moe.gate.e_score_correction_bias"].dtype == torch.float32


@pytest.mark.parametrize("T", [37, 70])
def test_logits_match_reference(text_ckpt, T):
    model, _, tensors, conf = text_ckpt
    r = compare(model, tensors, conf, make_ids(T))
    assert_conforms(r, f"text T={T}")


def test_multimodal_config_form(mm_ckpt):
    model, d, tensors, conf = mm_ckpt
    assert "text_config" in conf and "vision_config" in conf
    assert tensors and all(n.startswith("language_model.") for n in tensors), sorted(tensors)[:5]
    assert {strip(n) for n in tensors} == expected_official_names(conf["text_config"])
    r = compare(model, tensors, conf, make_ids(37))
    assert_conforms(r, "multimodal T=37")


def test_from_pretrained_reproduces_saved_model(text_ckpt):
    from k3.model import K3ForCausalLM

    model, d, tensors, conf = text_ckpt
    ids = make_ids(37)
    reloaded = K3ForCausalLM.from_pretrained(d).float().eval()
    with torch.no_grad():
        a = model(ids).logits
        b = reloaded(ids).logits
    assert torch.equal(a, b), float((a - b).abs().max())


def test_loader_reads_sharded_checkpoint(text_ckpt, tmp_path):
    """The helper loader follows model.safetensors.index.json (two shards) and yields identical tensors."""
    _, d, tensors, conf = text_ckpt
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    weight_map = {}
    for shard, part in shards.items():
        save_file({n: tensors[n].contiguous() for n in part}, str(tmp_path / shard))
        weight_map.update({n: shard for n in part})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps(conf))
    t2, c2 = load_official_checkpoint(tmp_path)
    assert c2 == conf and sorted(t2) == names
    assert all(torch.equal(t2[n], tensors[n]) for n in names)


# Expected effect of each single-rule flip. The spec (§12.1) reports 4.9–5.8 for real semantic bugs; the MLA
# latent-norm ε only needs to be measurable (§12.3 item 6).
NEGATIVE_CONTROL_MIN = {
    "softplus_gate": 1e-2,
    "no_bias": 1e-2,
    "block_size_plus_1": 1e-2,
    "beta2_none": 1e-2,
    "mla_eps_1e-5": 1e-7,
}


@torch.no_grad()
def capture_sublayers(model, ids):
    """Inputs and outputs of every `self_attn` and FFN module of the project model during one forward."""
    cap: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    handles = []
    for i, layer in enumerate(model.model.layers):
        ffn = getattr(layer, "block_sparse_moe", None) or getattr(layer, "mlp")
        for kind, mod in (("attn", layer.self_attn), ("ffn", ffn)):
            def hook(mod, inp, out, key=(i, kind)):
                o = out[0] if isinstance(out, (tuple, list)) else out
                cap[key] = (inp[0].detach().clone(), o.detach().double())
            handles.append(mod.register_forward_hook(hook))
    try:
        model(ids)
    finally:
        for h in handles:
            h.remove()
    return cap


def test_sublayers_match_reference_in_isolation(text_ckpt):
    """Each sublayer of the project, fed its own fp32 input, vs the fp64 reference on the same input.

    Removes error accumulation across layers (noise ~1e-7 relative instead of ~1e-5), which makes the MLA
    latent-norm ε (1e-6 vs 1e-5) distinguishable (§12.3 item 6); at the logits it is below fp32 noise.
    """
    model, _, tensors, conf = text_ckpt
    ids = make_ids(70)
    cap = capture_sublayers(model, ids)
    assert len(cap) == 2 * TINY["num_hidden_layers"]
    errs = {}
    for (i, kind), (x, y) in sorted(cap.items()):
        if kind == "attn":
            ref = reference_attention(tensors, conf, i, x)
        else:
            ref, _, margin = reference_ffn(tensors, conf, i, x)
            assert margin >= MIN_ROUTING_MARGIN, (i, margin)
        errs[(i, kind)] = float((y - ref).abs().max() / ref.abs().max())
    print("sublayer rel err:", {f"{i}{k[0]}": f"{e:.1e}" for (i, k), e in errs.items()})
    assert all(e < 2e-5 for e in errs.values()), errs
    # MLA latent-norm epsilon: the project must be much closer to ε = 1e-6 than to ε = 1e-5
    for i in (3, 7):
        x, y = cap[(i, "attn")]
        good = reference_attention(tensors, conf, i, x)
        wrong = reference_attention(tensors, conf, i, x, _variant="mla_eps_1e-5")
        d_good = float((y - good).abs().max())
        d_wrong = float((y - wrong).abs().max())
        print(f"MLA layer {i}: |proj - ref(eps 1e-6)| = {d_good:.2e}, |proj - ref(eps 1e-5)| = {d_wrong:.2e}, "
              f"|ref(1e-5) - ref(1e-6)| = {float((wrong - good).abs().max()):.2e}")
        assert d_wrong > 5 * d_good, (i, d_good, d_wrong)


def test_negative_controls_fail_loudly(text_ckpt):
    model, _, tensors, conf = text_ckpt
    assert set(NEGATIVE_CONTROL_MIN) == set(VARIANTS) - {None}
    ids = make_ids(37)
    ref = reference_logits(tensors, conf, ids)
    with torch.no_grad():
        got = model(ids).logits.double()
    base = float((got - ref).abs().max())
    report = {}
    for variant, floor in NEGATIVE_CONTROL_MIN.items():
        wrong = reference_logits(tensors, conf, ids, _variant=variant)
        d_ref = float((wrong - ref).abs().max())
        d_proj = float((got - wrong).abs().max())
        report[variant] = (d_ref, d_proj)
        assert d_ref > floor, f"{variant}: flipping the rule moved the reference by only {d_ref:.3e}"
        if floor >= 1e-2:
            # the project must be far from every wrong model, not merely close to the right one
            assert d_proj > 1e-2 and d_proj > 10 * base, (variant, d_proj, base)
    print("negative controls (max|wrong-ref|, max|project-wrong|), project-vs-ref =", f"{base:.2e}:",
          {k: (f"{a:.3e}", f"{b:.3e}") for k, (a, b) in report.items()})


def test_reference_is_deterministic_and_float64(text_ckpt):
    _, _, tensors, conf = text_ckpt
    ids = make_ids(5)
    a = reference_logits(tensors, conf, ids)
    b = reference_logits(tensors, conf, ids)
    assert a.dtype == torch.float64 and a.shape == (B, 5, TINY["vocab_size"])
    assert torch.equal(a, b)
    assert math.isfinite(float(a.abs().max()))
