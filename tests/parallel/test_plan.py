"""The analytic training-memory planner (`k3.parallel.plan`): exact per-rank shard sizes, the optimiser-state
split, activations, all-to-all volume, mesh validation and the printed report; the serving plan
(`k3.parallel.serve_plan`): weight bytes per expert format, caches, fits on a mesh or a host."""

from __future__ import annotations

import json
import math

import pytest
import torch

from k3.checkpoint.quantization import with_experts_format
from k3.config import K3Config
from k3.model import K3ForCausalLM
from k3.model.accounting import architecture_report, cache_sizes, count_parameters
from k3.parallel.census import parameter_census
from k3.parallel.plan import GIB, KINDS, USABLE_FRACTION, format_plan, layer_activations, plan
from k3.parallel.serve_plan import format_serve_plan, serve_plan


@pytest.fixture(scope="module")
def full():
    return K3Config.from_preset("k3-full")


def row_numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape[1:])


def test_census_matches_a_real_model():
    """The census of the meta-device model has exactly the tensors of a real K3ForCausalLM: names, shapes,
    optimiser kinds."""
    config = K3Config.from_preset("k3-tiny")
    torch.manual_seed(0)
    model = K3ForCausalLM(config)
    planned, real = parameter_census(config), parameter_census(config, model)
    assert planned == real
    assert {t.name for t in planned} == set(model.state_dict())
    params = sum(t.numel for t in planned if t.kind != "buffer")
    buffers = sum(t.numel for t in planned if t.kind == "buffer")
    assert params + buffers == count_parameters(model, config).total_params
    assert {t.kind for t in planned} == {*KINDS, "buffer"}


def test_k3_full_rank_holds_what_the_scale_out_note_measured(full):
    """Design-note dry run (W = 1024, ep = 64, efsdp = 16): rank 0 holds 3.10B parameters. That run used FSDP2's
    default Shard(0) on the experts: ceil(14 / 16) = 1 whole expert per layer and tensor (2 of 16 ranks empty)."""
    note = plan(full, 1024, 141, ep=64, expert_sharding="experts")
    assert (note.dp, note.efsdp, note.expert_placement) == (1024, 16, "Shard(0)")
    assert note.params_per_rank == pytest.approx(3.10e9, rel=0.01)
    M, L = full.moe_intermediate_size, full.routed_expert_hidden_size
    assert note.expert_params_per_rank == 92 * 3 * M * L
    # the default layout switches to Shard(1) since efsdp = 16 > 14 experts: exactly 14/16 of an expert per tensor
    auto = plan(full, 1024, 141, ep=64)
    assert auto.expert_placement == "Shard(1)"
    assert auto.expert_params_per_rank * 16 == 92 * 3 * 14 * M * L
    assert auto.dense_params_per_rank == note.dense_params_per_rank
    assert auto.total_params == 2_779_484_476_000 - 92 * 896  # docs/architecture.md §2.2 total less the router-bias buffers


@pytest.mark.parametrize("gpus,ep,sharding", [(1024, 64, "auto"), (1024, 64, "experts"), (256, 64, "auto"),
                                              (512, 16, "rows"), (1024, 8, "auto"), (64, 64, "auto")])
def test_expert_shards_cover_all_experts_within_one_expert(full, gpus, ep, sharding):
    p = plan(full, gpus, 141, ep=ep, expert_sharding=sharding)
    assert p.ep * p.efsdp == p.dp == gpus
    covered = p.expert_params_per_rank * p.ep * p.efsdp
    assert covered >= p.total_expert_params
    expert_tensors = 3 * sum(full.is_moe_layer(i) for i in range(full.num_hidden_layers))
    one_expert_each = expert_tensors * full.moe_intermediate_size * full.routed_expert_hidden_size
    assert p.expert_params_per_rank - p.total_expert_params / (p.ep * p.efsdp) < one_expert_each
    assert p.groups["muon_experts"].params == p.expert_params_per_rank


@pytest.mark.parametrize("preset,gpus,ep", [("k3-full", 1024, 64), ("k3-small", 24, 8), ("k3-tiny", 7, 1)])
def test_dense_shards_cover_all_dense_within_one_row_per_tensor(preset, gpus, ep):
    config = K3Config.from_preset(preset)
    p = plan(config, gpus, 80, ep=ep)
    dense = [t for t in parameter_census(config) if t.kind not in ("muon_experts", "buffer")]
    assert sum(t.numel for t in dense) == p.total_dense_params
    assert p.dense_params_per_rank * p.dp >= p.total_dense_params
    assert p.dense_params_per_rank - p.total_dense_params / p.dp <= sum(row_numel(t.shape) for t in dense)
    # uneven tensors show: rank 0 holds a whole row of a [1, D] AttnRes query and ceil(rows/dp) of the others
    exact = sum(-(-t.shape[0] // p.dp) * row_numel(t.shape) for t in dense)
    assert p.dense_params_per_rank == exact


def test_state_bytes_per_optimiser_kind(full):
    p = plan(full, 1024, 141, ep=64)
    for kind in KINDS:
        g = p.groups[kind]
        assert g.weight_bytes == g.grad_bytes == 4 * g.params
        assert g.optimizer_bytes == (8 if kind == "adamw" else 4) * g.params
    assert sum(g.params for g in p.groups.values()) == p.params_per_rank
    assert p.buffer_bytes == 4 * 92 * 896  # replicated fp32 router bias
    assert p.total_bytes == p.state_bytes + p.buffer_bytes + p.activation_bytes + p.fsdp_buffer_bytes


def test_all_to_all_moves_the_latent(full):
    p = plan(full, 1024, 141, ep=64, micro_batch=1, seq_len=8192)
    tokens_out = 8192 * 16 * 63 // 64  # routed copies that leave the rank
    assert p.all_to_all_bytes == 4 * 92 * tokens_out * 3584 * 2
    assert p.all_to_all_latent_ratio == pytest.approx(full.routed_expert_hidden_size / full.hidden_size) == 0.5
    assert p.all_to_all_recompute_bytes * 2 == p.all_to_all_bytes
    narrow = K3Config.from_preset("k3-tiny", routed_expert_hidden_size=32)
    q = plan(narrow, 8, 80, ep=4, seq_len=256)
    assert q.all_to_all_latent_ratio == pytest.approx(32 / 128)
    assert plan(narrow, 8, 80, ep=1).all_to_all_bytes == 0


def test_layer_activation_formulas(full):
    mla = next(i for i, t in enumerate(full.layer_types) if t == "mla")
    a = layer_activations(full, mla, micro_batch=2, seq_len=8192)
    assert a.mla_latent == 2 * 8192 * 576 * 2 and a.kda_chunk_states == 0
    b = layer_activations(full, 1, micro_batch=2, seq_len=8200)
    assert b.kda_chunk_states == 4 * 2 * 96 * 129 * 128 * 128 and b.mla_latent == 0
    assert b.layer_input == 2 * 8200 * 7168 * 2
    assert layer_activations(full, 1, 2, 8200, tp=4).mixer < b.mixer
    # the dense layer 0 saves 3·F per token for its FFN, an MoE layer more (16 experts' intermediates)
    assert layer_activations(full, 0, 1, 64).ffn == 64 * 3 * 33792 * 2 < layer_activations(full, 1, 1, 64).ffn


def test_context_parallel_activations(full):
    """Under cp a rank computes seq_len / cp positions, but its MLA layers keep the whole sequence's latents and
    expanded keys (the last share attends over all of them); KDA's chunk states are twice as wide."""
    mla = next(i for i, t in enumerate(full.layer_types) if t == "mla")
    one, split = layer_activations(full, mla, 1, 65536), layer_activations(full, mla, 1, 65536, cp=8)
    assert split.mla_latent == one.mla_latent == 2 * 65536 * 576
    assert split.layer_input * 8 == one.layer_input and split.ffn * 8 == one.ffn
    keys = 2 * 65536 * 96 * (192 + 128)  # all positions' expanded keys and values, bf16
    assert one.mixer - split.mixer == pytest.approx((one.mixer - keys - one.mla_latent) * 7 / 8)
    kda_one, kda_split = layer_activations(full, 1, 1, 65536), layer_activations(full, 1, 1, 65536, cp=8)
    assert kda_split.kda_chunk_states * 4 == kda_one.kda_chunk_states  # ⌈T/C⌉ / 8 chunks, each [v ‖ 0] wide


def test_context_parallel_plan_of_one_million_tokens(full):
    seq, cp = 1 << 20, 16
    one, split = plan(full, 1024, 141, ep=64, seq_len=seq), plan(full, 1024, 141, ep=64, seq_len=seq, cp=cp)
    assert split.cp == cp and one.cp == 1 and one.cp_bytes == one.cp_ring_bytes == 0
    assert split.activation_bytes < one.activation_bytes and split.weight_bytes == one.weight_bytes
    assert split.all_to_all_bytes * cp == one.all_to_all_bytes  # the MoE sees this rank's tokens only
    n, mla = seq // cp, full.layer_types.count("mla")
    kda = full.num_hidden_layers - mla
    per_kda = 4 * 96 * 128 * 256 + 2 * 3 * 3 * 96 * 128  # (S⁰, M) fp32 and the conv's last 3 q/k/v inputs
    assert split.cp_bytes == 3 * (cp - 1) * (mla * 2 * n * 576 + kda * per_kda)
    assert split.cp_ring_bytes == 3 * (cp - 1) * mla * 2 * n * 96 * (192 + 128)
    assert split.cp_ring_bytes > 30 * split.cp_bytes  # the latents against expanded K/V (§4.3)
    text = format_plan(split)
    assert f"{seq:,} tokens split over cp {cp} ranks: {n:,} per rank" in text
    assert f"context parallel {split.cp_bytes / GIB:.2f}" in text and f"{split.cp_ring_bytes / GIB:.2f}" in text
    assert "context parallel" not in format_plan(one)


@pytest.mark.parametrize("preset,gpus,ep", [("k3-full", 1024, 64), ("k3-small", 16, 4)])
def test_activation_checkpointing_reduces_activations(preset, gpus, ep):
    config = K3Config.from_preset(preset)
    on = plan(config, gpus, 141, ep=ep, seq_len=4096, activation_checkpointing=True)
    off = plan(config, gpus, 141, ep=ep, seq_len=4096, activation_checkpointing=False)
    assert on.activation_bytes < off.activation_bytes
    assert on.recompute_bytes > 0 and off.recompute_bytes == 0
    assert off.activation_bytes >= config.num_hidden_layers * on.layer_input_bytes
    assert on.state_bytes == off.state_bytes


@pytest.mark.parametrize("ep,sharding", [(8, "auto"), (64, "auto"), (64, "experts"), (16, "rows")])
def test_more_gpus_never_increase_per_rank_weights(full, ep, sharding):
    weights = [plan(full, gpus, 141, ep=ep, expert_sharding=sharding).weight_bytes
               for gpus in (64, 128, 256, 512, 1024, 2048, 4096)]
    assert all(b <= a for a, b in zip(weights, weights[1:])), weights
    assert weights[-1] < weights[0]


def test_tensor_and_pipeline_parallelism(full):
    base = plan(full, 1024, 141, ep=64)
    tp = plan(full, 2048, 141, ep=64, tp=2)  # same dp: the attention heads are halved
    assert tp.dp == base.dp and tp.dense_params_per_rank < base.dense_params_per_rank
    assert tp.expert_params_per_rank == base.expert_params_per_rank
    pp = plan(full, 1024, 141, ep=16, pp=8)
    bounds = [(s.first_layer, s.end_layer) for s in pp.stages]
    assert bounds[0][0] == 0 and bounds[-1][1] == 93 and len(bounds) == 8
    assert all(a[1] == b[0] and a[1] % 12 == 0 for a, b in zip(bounds, bounds[1:]))  # AttnRes block cuts
    assert pp.total_bytes == max(s.total_bytes for s in pp.stages)
    assert [s.in_flight for s in pp.stages] == list(range(8, 0, -1))


@pytest.mark.parametrize("preset", ["k3-tiny", "k3-small"])
def test_small_presets(preset):
    config = K3Config.from_preset(preset)
    p = plan(config, 8, 24, ep=2, tp=2, pp=2, micro_batch=4, seq_len=512)
    assert p.fits and p.headroom_bytes == p.usable_bytes - p.total_bytes > 0
    assert sum(s.first_layer == 0 for s in p.stages) == 1 and p.stages[-1].end_layer == config.num_hidden_layers
    moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
    stage_experts = p.total_expert_params * p.moe_layers // moe_layers  # the worst stage's share
    assert p.expert_params_per_rank * p.ep * p.efsdp >= stage_experts > 0


def test_fits_against_the_usable_fraction(full):
    small = plan(full, 256, 141, ep=64, seq_len=8192)  # 2.78T parameters × 12 B over 256 GPUs: too much
    big = plan(full, 1024, 141, ep=64, seq_len=8192)
    assert big.usable_bytes == small.usable_bytes == int(141 * GIB * USABLE_FRACTION)
    assert not small.fits and small.headroom_bytes < 0
    assert big.fits and big.headroom_bytes == big.usable_bytes - big.total_bytes > 0
    assert not plan(full, 1024, 40, ep=64, seq_len=8192).fits


@pytest.mark.parametrize("kwargs,option", [
    (dict(gpus=1000, pp=3), "gpus=1000"),
    (dict(gpus=1024, ep=3), "ep=3"),
    (dict(gpus=1024, ep=256), "num_experts"),
    (dict(gpus=1024, tp=5, ep=1), "gpus"),
    (dict(gpus=1280, tp=5), "tp=5"),
    (dict(gpus=1024, pp=16), "pp=16"),
    (dict(gpus=0), "gpus"),
    (dict(gpus=1024, micro_batch=0), "micro_batch"),
    (dict(gpus=1024, seq_len=-1), "seq_len"),
    (dict(gpus=1024, cp=0), "cp"),
    (dict(gpus=1024, cp=3), "cp=3"),
    (dict(gpus=1024, cp=8, seq_len=4100), "seq_len = 4100"),
    (dict(gpus=1024, gpu_memory_gib=0), "gpu_memory_gib"),
    (dict(gpus=1024, expert_sharding="cols"), "expert_sharding"),
    (dict(gpus=1024, usable_fraction=1.5), "usable_fraction"),
])
def test_bad_meshes_raise_naming_the_option(full, kwargs, option):
    kwargs = {"gpu_memory_gib": 141, **kwargs}
    with pytest.raises(ValueError) as e:
        plan(full, **kwargs)
    assert option in str(e.value) and "\n" not in str(e.value)


def test_format_plan_shows_the_key_numbers(full):
    p = plan(full, 1024, 141, ep=64, seq_len=8192)
    text = format_plan(p)
    for number in (p.total_bytes, p.activation_bytes, p.usable_bytes, p.groups["muon_experts"].total_bytes,
                   p.all_to_all_bytes, p.all_to_all_full_width_bytes):
        assert f"{number / GIB:.2f}" in text
    assert f"{p.params_per_rank:,}" in text and f"{p.expert_params_per_rank:,}" in text
    assert "fits        yes" in text and "ep 64 × efsdp 16" in text and "ratio 0.50" in text


def test_to_dict_is_json(full):
    p = plan(full, 1024, 141, ep=64, pp=2)
    d = json.loads(json.dumps(p.to_dict()))
    assert d["params_per_rank"] == p.params_per_rank and d["fits"] is p.fits
    assert d["groups"]["adamw"]["total_bytes"] == p.groups["adamw"].total_bytes
    assert len(d["stages"]) == 2 and d["all_to_all_latent_ratio"] == pytest.approx(0.5)
    assert json.loads(json.dumps(plan(full, 1024, 141).to_dict()))["all_to_all_latent_ratio"] is None


def test_dry_run_shards_the_real_model_like_the_plan():
    """`parallelize` on the meta device under a fake process group: rank 0 holds what the plan says — FSDP2 on 16
    ranks, EP 4 × 4 replicas (whole experts over the replicas), EP 32 × 4 replicas (2 experts per EP rank: rows
    of every expert over the replicas)."""
    import subprocess
    import sys

    code = ("from k3 import K3Config; from k3.parallel.dry_run import dry_run; from k3.parallel.plan import plan; "
            "c = K3Config.from_preset('k3-small')\n"
            "for gpus, ep in ((16, 1), (16, 4), (128, 32)):\n"
            "    d = dry_run(c, gpus, ep); p = plan(c, gpus, 80, ep=ep)\n"
            "    print(d['dense_params_per_rank'] == p.dense_params_per_rank, "
            "d['expert_params_per_rank'] == p.expert_params_per_rank, d['dense_params_per_rank'] > 0, "
            "p.expert_placement)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert result.stdout.split() == ["True", "True", "True", "Shard(0)"] * 2 + ["True", "True", "True", "Shard(1)"], \
        result.stdout + result.stderr[-2000:]


# ------------------------------------------------------------------------------------------------ serving
# k3-full by hand (§2.1, §2.2, §2.4, §11.5): 92 MoE layers × 896 experts of 3·3072·3584 weights; the text weights
# other than the routed experts; the §0.4 fp32 set (per KDA layer: conv 3·12288·4, dt_bias 12288, A_log 96,
# o_norm 128; per MoE layer the 896 router biases); MoonViT-V2 + projector.
FULL_EXPERTS, EXPERT_WEIGHTS = 92 * 896, 3 * 3072 * 3584
FULL_OTHER_TEXT = 2_779_484_476_000 - 2_722_740_830_208
FULL_FP32_SET = 69 * (3 * 12288 * 4 + 12288 + 96 + 128) + 92 * 896
FULL_VISION = 401_214_464 + 46_144_512
MIB = 2**20


def test_serving_weights_per_expert_format(full):
    """MXFP4 experts: 17,547,264 B each (4.25 bits a weight), 82,432 of them = 1.446 TB, all weights ≈ 1.56 TB;
    bf16 experts: 5.45 TB; every other weight bf16 (the fp32 set 4 B) in both."""
    mx, bf = serve_plan(full, "mxfp4"), serve_plan(full, "bf16")
    assert mx.expert_bytes == EXPERT_WEIGHTS * 17 // 32 == 17_547_264
    assert mx.routed_experts == FULL_EXPERTS == 82_432
    assert mx.routed_expert_bytes == 17_547_264 * 82_432 == 1_446_456_066_048
    assert bf.routed_expert_bytes == 2 * 2_722_740_830_208 == 5_445_481_660_416
    for p in (mx, bf):
        assert p.other_text_bytes == 2 * FULL_OTHER_TEXT + 2 * FULL_FP32_SET == 113_509_532_032
        assert p.vision_bytes == 2 * FULL_VISION
    assert round(mx.weights / 1e12, 2) == 1.56 and round(bf.weights / 1e12, 2) == 5.56
    assert round(mx.routed_expert_bytes / 1e12, 3) == 1.446 and round(bf.routed_expert_bytes / 1e12, 2) == 5.45


def test_serving_caches_follow_the_accounting(full):
    """One 1M-token sequence: 24·576 bf16 numbers per token + 69 fp32 [96, 128, 128] states + 69 conv windows
    (3·12288 channels × 3 past inputs, bf16) = 29,440,401,408 B = 29.4 GB (27.42 GiB)."""
    p = serve_plan(full, context=MIB)
    assert p.cache_bytes == {"mla_latent": 24 * 576 * 2 * MIB, "kda_state": 69 * 96 * 128 * 128 * 4,
                             "kda_conv": 69 * 3 * 12288 * 3 * 2}
    assert p.sequence_cache == cache_sizes(full).bytes_at(MIB) == 29_440_401_408
    assert round(p.sequence_cache / 1e9, 1) == 29.4 and round(p.sequence_cache / GIB, 2) == 27.42
    short = serve_plan(full, context=4096, batch=3)
    assert short.cache_bytes["mla_latent"] * 256 == p.cache_bytes["mla_latent"]  # linear in the context
    assert short.cache_bytes["kda_state"] == p.cache_bytes["kda_state"]  # independent of it
    assert short.caches == 3 * short.sequence_cache and short.total == short.weights + short.caches


@pytest.mark.parametrize("experts,gpus,fits", [("mxfp4", 8, False), ("mxfp4", 16, True), ("mxfp4", 32, True),
                                               ("bf16", 32, False), ("bf16", 64, True)])
def test_serving_mesh_fits(full, experts, gpus, fits):
    """H200s (141 GiB, 90 % usable) holding k3-full and one 1M-token sequence: the fullest GPU holds
    ceil(896 / N) experts of each MoE layer and 1/N of everything else."""
    p = serve_plan(full, experts, gpus=gpus, gpu_memory_gib=141)
    assert p.experts_per_device == -(-896 // gpus)
    assert p.device_bytes == {"routed_experts": p.experts_per_device * 92 * p.expert_bytes,
                              "other_weights": -(-(p.weights - p.routed_expert_bytes) // gpus),
                              "caches": -(-p.sequence_cache // gpus)}
    assert p.usable_bytes == int(141 * GIB * USABLE_FRACTION)
    assert p.fits is fits is (p.device_total <= p.usable_bytes)


def test_serving_uneven_meshes_and_hosts(full):
    """12 GPUs: 75 experts of a layer on the fullest (896 = 74⅔ × 12); more GPUs than experts: one each. A host
    holds everything."""
    assert serve_plan(full, gpus=12, gpu_memory_gib=141).experts_per_device == 75
    assert serve_plan(full, gpus=1024, gpu_memory_gib=141).experts_per_device == 1
    host = serve_plan(full, context=4096, host_memory_gib=2048)
    assert host.target == "host" and host.device_total == host.total and host.fits
    assert not serve_plan(full, context=4096, host_memory_gib=1024).fits
    assert not serve_plan(full, "bf16", context=4096, host_memory_gib=2048).fits
    alone = serve_plan(full)
    assert alone.target == "none" and alone.fits is None and alone.device_total == alone.total


@pytest.mark.parametrize("kwargs,option", [
    (dict(context=0), "context"), (dict(batch=-1), "batch"), (dict(experts="fp8"), "experts"),
    (dict(gpus=8), "gpu_memory_gib"), (dict(gpu_memory_gib=141), "gpus"), (dict(gpus=0, gpu_memory_gib=141), "gpus"),
    (dict(gpus=8, gpu_memory_gib=float("inf")), "gpu_memory_gib"), (dict(host_memory_gib=-1), "host_memory_gib"),
    (dict(host_memory_gib=512, gpus=8, gpu_memory_gib=141), "host_memory_gib"), (dict(usable_fraction=0), "usable"),
])
def test_bad_serving_inputs_raise_naming_the_option(full, kwargs, option):
    with pytest.raises(ValueError) as e:
        serve_plan(full, **kwargs)
    assert option in str(e.value) and "\n" not in str(e.value)


def test_mxfp4_needs_rows_of_32():
    """A routed-expert row that is not a whole number of 32-weight groups has no MXFP4 form."""
    config = K3Config.from_preset("k3-tiny", routed_expert_hidden_size=48)
    with pytest.raises(ValueError, match="multiple of 32"):
        serve_plan(config)
    assert serve_plan(config, "bf16").expert_bytes == 2 * 3 * 48 * config.moe_intermediate_size


def test_a_config_declaring_mxfp4_experts_plans_like_its_dense_twin():
    """The release's config.json declares MXFP4 experts (a model built from it holds packed uint8 pairs): counts,
    serving bytes and the training plan all start from the logical [E, out, in] shapes all the same."""
    dense = K3Config.from_preset("k3-tiny")
    packed = with_experts_format(dense, "mxfp4")
    assert architecture_report(packed)["total_params"] == architecture_report(dense)["total_params"]
    for experts in ("mxfp4", "bf16"):
        assert serve_plan(packed, experts, context=4096) == serve_plan(dense, experts, context=4096)
    assert plan(packed, 8, 80, ep=4) == plan(dense, 8, 80, ep=4)


def test_format_serve_plan_shows_the_key_numbers(full):
    p = serve_plan(full, gpus=16, gpu_memory_gib=141)
    text = format_serve_plan(p)
    for number in (p.routed_expert_bytes, p.other_text_bytes, p.weights, p.sequence_cache, p.total):
        assert f"{number:,}" in text and f"{number / 1e9:,.2f}" in text
    assert "82,432 x 17,547,264 B" in text and "56 of the 896" in text and "fits        yes" in text
    assert f"{p.device_total / GIB:,.2f} GiB" in text and "4.25 bits" in text
    assert "mesh" not in format_serve_plan(serve_plan(full)) and "vision" not in format_serve_plan(
        serve_plan(K3Config.from_preset("k3-tiny")))
    d = json.loads(json.dumps(p.to_dict()))
    assert d["weights"] == p.weights and d["fits"] is True and d["device_bytes"] == p.device_bytes


def test_serve_plan_prefill_flops_k3_against_k2_at_one_million_tokens(full):
    """The serving plan carries the prefill's FLOPs by part (accounting.prefill_flops) and prints each; at 1M tokens
    the K2 form (61 RoPE MLA layers, 64 heads of 192 + 128) spends more on attention than K3's 24 MLA layers (96
    heads), and K3 has the smaller cache per sequence."""
    context = 1_048_576
    k3, k2 = serve_plan(full, context=context), serve_plan(K3Config.from_preset("kimi-k2"), context=context)
    assert k3.prefill_flops["mla_attention"] == 24 * 2 * 96 * (192 + 128) * context * (context + 1) // 2
    assert k2.prefill_flops["mla_attention"] == 61 * 2 * 64 * (192 + 128) * context * (context + 1) // 2
    assert k2.prefill_flops["kda"] == 0 < k3.prefill_flops["kda"]
    assert k2.prefill_flops["mla_attention"] > k3.prefill_flops["mla_attention"]
    assert k3.sequence_cache < k2.sequence_cache
    text = format_serve_plan(k3)
    for n in k3.prefill_flops.values():
        assert f"{n:,}" in text
    assert f"{sum(k3.prefill_flops.values()):,}" in text and "MLA attention (causal pairs)" in text
