"""Expert parallelism (`k3.parallel.expert.apply_expert_parallel`) on a 5-layer k3-tiny, float64, 2 and 4 gloo ranks.

Each rank routes its own rows of one global batch ("dp2ep"); the results must equal one process computing the
whole batch: logits, the owned experts' gradients, the summed dense gradients, and (2 ranks) the same with FSDP2
sharding the rest of the model. The ranks of one world size run once per module (a spawn costs seconds) and the
tests read their results.
"""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_ranks

GLOBAL_ROWS, T = 4, 8
TOL = 1e-10  # float64: only the summation order differs
TIMEOUT_S = 90.0  # per spawned run: a hang fails the test instead of blocking CI


LAYERS = 5  # k3-tiny cut to [KDA, KDA, KDA, MLA] + MLA: layer 0 dense, 4 MoE layers (2 after KDA, 2 after MLA)
N_MOE = LAYERS - 1


def config(**overrides):
    from k3.config import K3Config, k3_full_attn_layers

    mla = k3_full_attn_layers(LAYERS)
    return K3Config.from_preset("k3-tiny", num_hidden_layers=LAYERS, full_attn_layers=mla,
                                kda_layers=[i for i in range(1, LAYERS + 1) if i not in mla], **overrides)


def build(seed: int = 0, **overrides):
    from k3.model import K3ForCausalLM

    torch.manual_seed(seed)
    model = K3ForCausalLM(config(**overrides)).double()
    with torch.no_grad():  # a non-trivial latent norm gain, so the latent-space gradients are exercised fully
        for name, p in model.named_parameters():
            if name.endswith("routed_expert_norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def build_skewed():
    """The router biases (selection only, §6.3) send every token to experts 0..7: on 2 ranks, rank 1 receives
    nothing and must still take part in every collective of forward and backward."""
    model = build()
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b[:8] = 10.0
    return model


def batch():
    ids = torch.randint(0, 4096, (GLOBAL_ROWS, T), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, 2:5] = -100  # ragged scored-token counts per rank
    return ids, labels


def scored(labels):
    return int((labels[:, 1:] != -100).sum())


def record_routing(model):
    """name of each MoE layer → the top-k expert indices of its last forward (forward hooks on the routers)."""
    from k3.model.moe import StableLatentMoE

    routing = {}
    for name, m in model.named_modules():
        if isinstance(m, StableLatentMoE):
            m.gate.register_forward_hook(lambda mod, args, out, name=name: routing.__setitem__(name, out[0].clone()))
    return routing


def rank_loss(model, rows):
    """This rank's summed token loss / the global token count (its share of the global mean)."""
    ids, labels = batch()
    out = model(ids[rows], labels=labels[rows])
    loss = out.loss * scored(labels[rows]) / scored(labels)
    loss.backward()
    return out.logits.detach()


def split_grads(model):
    """(expert gradients: to_local of the DTensor grads, other gradients) by parameter name."""
    from torch.distributed.tensor import DTensor

    experts, dense = {}, {}
    for n, p in model.named_parameters():
        if isinstance(p, DTensor):
            experts[n] = p.grad.to_local()
        elif p.grad is not None:
            dense[n] = p.grad
    return experts, dense


def all_reduce_dict(tensors, group=None):
    import torch.distributed as dist

    flat = torch.cat([t.flatten() for t in tensors.values()])
    dist.all_reduce(flat, group=group)
    out, i = {}, 0
    for n, t in tensors.items():
        out[n] = flat[i:i + t.numel()].view_as(t)
        i += t.numel()
    return out


# ------------------------------------------------------------------------------------------------- rank bodies
def ep_rank(rank, world_size):
    """EP over all ranks; on 4 ranks also a (dp 2, ep 2) sub-mesh and the ValueErrors; on 2 ranks also FSDP2."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from k3.model.moe import RoutedExperts
    from k3.parallel.expert import ExpertParallelRoutedExperts, apply_expert_parallel, expert_parallel_bytes

    result = {}
    rows = slice(rank * GLOBAL_ROWS // world_size, (rank + 1) * GLOBAL_ROWS // world_size)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))

    model = build()
    plain = {k: v.clone() for k, v in model.state_dict().items()}
    assert apply_expert_parallel(model, mesh) is model
    state = model.state_dict()
    result["keys"] = (list(plain), list(state))
    result["layout"] = {k: (type(v).__name__, tuple(v.placements), tuple(v.to_local().shape),
                            float((v.full_tensor() - plain[k]).abs().max()))
                        for k, v in state.items() if isinstance(v, DTensor)}
    result["classes"] = {type(m).__name__ for m in model.modules() if isinstance(m, RoutedExperts)}
    assert all(v.placements == (Shard(0),) for v in state.values() if isinstance(v, DTensor))
    routing = record_routing(model)
    result["logits"] = rank_loss(model, rows)
    expert_grads, dense = split_grads(model)
    result["expert_grads"] = expert_grads
    summed = all_reduce_dict(dense)  # a collective: every rank takes part
    result["dense_grads"] = summed if rank == 0 else None
    result["routing"] = routing
    result["layer_bytes"] = {n: m.ep_bytes for n, m in model.named_modules()
                             if isinstance(m, ExpertParallelRoutedExperts)}
    result["bytes"] = expert_parallel_bytes(model)
    result["local_experts"] = [list(m.local_expert_range) for m in model.modules()
                               if isinstance(m, ExpertParallelRoutedExperts)]

    if world_size == 4:
        # a sub-mesh of a larger mesh: experts split over "ep" (2), replicated over "dp" (2)
        mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
        sub = apply_expert_parallel(build(), mesh2d["ep"])
        result["sub_logits"] = rank_loss(sub, rows)
        sub_experts, _ = split_grads(sub)
        result["sub_expert_grads"] = all_reduce_dict(sub_experts, mesh2d["dp"].get_group())  # replicas' sum
        result["sub_ep_rank"] = mesh2d["ep"].get_local_rank()
        # the errors, raised before anything changes
        errors = {}
        odd = build(num_experts=6, num_experts_per_token=2)
        for label, model_, mesh_ in (("ep", odd, mesh), ("2d", odd, mesh2d)):
            try:
                apply_expert_parallel(model_, mesh_)
            except ValueError as e:
                errors[label] = str(e)
        errors["untouched"] = all(type(m) is RoutedExperts and not isinstance(m.w1, DTensor)
                                  for m in odd.modules() if isinstance(m, RoutedExperts))
        try:
            apply_expert_parallel(model, mesh)
        except ValueError as e:
            errors["twice"] = str(e)
        result["errors"] = errors

    if world_size == 2:
        skewed = apply_expert_parallel(build_skewed(), mesh)
        result["skewed"] = {"logits": rank_loss(skewed, rows), "expert_grads": split_grads(skewed)[0],
                            "bytes": expert_parallel_bytes(skewed)}
        result["loop"] = loop_impl(rows, mesh)
        result["fsdp"] = fsdp_ep(rank, rows, mesh)
    return result


def loop_impl(rows, mesh):
    """Loop experts (`impl="loop"`) on the owner; `expert(e, z)` for owned / foreign experts; the cumulative counters."""
    from k3.parallel.expert import (AllToAllBytes, apply_expert_parallel, expert_parallel_bytes,
                                    reset_expert_parallel_bytes)

    from conformance import set_runtime

    plain = set_runtime(build(), moe_impl="loop").model.layers[1].block_sparse_moe.experts
    model = apply_expert_parallel(set_runtime(build(), moe_impl="loop"), mesh)
    out = {"logits": rank_loss(model, rows), "expert_grads": split_grads(model)[0]}
    once = expert_parallel_bytes(model)
    assert expert_parallel_bytes(model, cumulative=True) == once
    with torch.no_grad():
        ids, _ = batch()
        model(ids[rows])
        z = torch.randn(5, config().routed_expert_hidden_size, dtype=torch.float64)
        out.update(accessor(model, plain, z))
    twice = expert_parallel_bytes(model, cumulative=True)
    out["counters"] = (once, twice)
    reset_expert_parallel_bytes(model)
    out["reset"] = expert_parallel_bytes(model, cumulative=True) == AllToAllBytes() == expert_parallel_bytes(model)
    return out


def accessor(model, plain, z):
    """`expert(e, z)` of the first EP layer against the unsharded layer, and for a foreign expert."""
    from k3.parallel.expert import ExpertParallelRoutedExperts

    layer = next(m for m in model.modules() if isinstance(m, ExpertParallelRoutedExperts))
    owned, out = layer.local_expert_range, {}
    out["expert_diff"] = max(max_diff(layer.expert(e, z), plain.expert(e, z)) for e in owned)
    try:
        layer.expert((owned[-1] + 1) % config().num_experts, z)
    except ValueError as e:
        out["foreign"] = str(e)
    return out


def fsdp_ep(rank, rows, mesh):
    """EP on the experts, then FSDP2 on every decoder layer and the root with the experts in `ignored_params`."""
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.tensor import DTensor

    from k3.parallel.expert import apply_expert_parallel

    model = apply_expert_parallel(build(), mesh)
    experts = {p for p in model.parameters() if isinstance(p, DTensor)}
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, ignored_params=experts)
    fully_shard(model, mesh=mesh, ignored_params=experts, reshard_after_forward=False)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)  # gradients summed: each rank's loss is its share of the global mean
            m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    logits = rank_loss(model, rows)
    expert_names = {n for n, p in model.named_parameters() if p in experts}
    grads = {n: p.grad.to_local() if n in expert_names else p.grad.full_tensor()
             for n, p in model.named_parameters() if p.grad is not None}
    return {"logits": logits, "grads": grads, "expert_names": expert_names,
            "dense_mesh": {str(p.device_mesh.mesh.tolist()) for n, p in model.named_parameters()
                           if n not in expert_names}}


# ---------------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def reference():
    """One process, the whole batch: logits and the gradients of the global mean loss."""
    model = build()
    routing = record_routing(model)
    ids, labels = batch()
    out = model(ids, labels=labels)
    out.loss.backward()
    return {"logits": out.logits.detach(), "routing": routing,
            "grads": {n: p.grad for n, p in model.named_parameters() if p.grad is not None}}


@pytest.fixture(scope="module")
def skewed_reference():
    model = build_skewed()
    ids, labels = batch()
    out = model(ids, labels=labels)
    out.loss.backward()
    return {"logits": out.logits.detach(), "grads": {n: p.grad for n, p in model.named_parameters()}}


_RUNS = {}


@pytest.fixture(scope="module")
def ranks():
    def run(world_size):
        if world_size not in _RUNS:
            try:
                _RUNS[world_size] = run_ranks(ep_rank, world_size, timeout=TIMEOUT_S, collective_timeout=60.0)
            except AssertionError as e:  # remembered: the other tests of this world size fail at once
                _RUNS[world_size] = e
        if isinstance(_RUNS[world_size], AssertionError):
            pytest.fail(f"the {world_size}-rank run failed: {_RUNS[world_size]}")
        return _RUNS[world_size]
    return run


def max_diff(a, b):
    return float((a - b).abs().max())


# ------------------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("world_size", [2, 4])
def test_ep_equals_one_process(reference, ranks, world_size):
    """Per-rank logits, owned expert gradients and summed dense gradients equal the single-process ones."""
    results = ranks(world_size)
    E, ep = config().num_experts, world_size
    ref = reference["grads"]
    per = GLOBAL_ROWS // world_size
    for rank, res in enumerate(results):
        assert max_diff(res["logits"], reference["logits"][rank * per:(rank + 1) * per]) <= TOL
        assert res["classes"] == {"ExpertParallelRoutedExperts"}
        owned = slice(rank * E // ep, (rank + 1) * E // ep)
        assert all(r == list(range(owned.start, owned.stop)) for r in res["local_experts"])
        assert len(res["expert_grads"]) == 3 * N_MOE  # w1/w2/w3 of every MoE layer
        for name, g in res["expert_grads"].items():
            assert g.shape[0] == E // ep
            assert max_diff(g, ref[name][owned]) <= TOL, name
        # the routing of the rank's rows is that of the same rows in the whole batch
        for name, idx in res["routing"].items():
            assert torch.equal(idx, reference["routing"][name].view(GLOBAL_ROWS, T, -1)[rank * per:(rank + 1) * per]
                               .reshape(idx.shape))
    dense = results[0]["dense_grads"]
    assert set(dense) | set(results[0]["expert_grads"]) == set(ref)
    for name, g in dense.items():
        assert max_diff(g, ref[name]) <= TOL, name
    # the gradients are not trivially small: a wrong slice or a missing remote contribution would show
    assert min(float(g.abs().max()) for g in results[0]["expert_grads"].values()) > 1e-6


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_to_all_bytes_match_the_routing(ranks, world_size):
    """Bytes = assignments crossing to another rank × L × 8 (float64), per direction; full width = × D / L."""
    results = ranks(world_size)
    cfg = config()
    L, D, El, k = cfg.routed_expert_hidden_size, cfg.hidden_size, cfg.num_experts // world_size, \
        cfg.num_experts_per_token
    routing = [res["routing"] for res in results]
    crossing = 0
    for rank, res in enumerate(results):
        total_sent = 0
        for layer, b in res["layer_bytes"].items():
            name = layer.removesuffix(".experts")
            owner = [r[name] // El for r in routing]
            out_rows = int((owner[rank] != rank).sum())
            in_rows = sum(int((owner[s] == rank).sum()) for s in range(world_size) if s != rank)
            assert out_rows > 0 and in_rows > 0  # tokens really cross, both ways
            assert b.assignments_sent == out_rows and b.assignments_received == in_rows
            assert b.dispatch_sent == b.combine_received == out_rows * L * 8
            assert b.dispatch_received == b.combine_sent == in_rows * L * 8
            assert b.forward == b.backward == 2 * (out_rows + in_rows) * L * 8
            assert b.full_width * L == b.forward * D  # hidden / latent = 2× the bytes at full width
            assert b.splits == 2 * (world_size - 1) * El * 8 and b.forwards == 1
            total_sent += b.dispatch_sent
            crossing += out_rows
        assert res["bytes"].dispatch_sent == total_sent and res["bytes"].forwards == N_MOE
    # every sent row is received somewhere
    assert sum(r["bytes"].sent for r in results) == sum(r["bytes"].received for r in results)
    # near N·k·(ep − 1)/ep per layer for a balanced router (here: freshly initialised, nearly uniform)
    expected = N_MOE * GLOBAL_ROWS * T * k * (world_size - 1) / world_size
    assert 0.6 * expected < crossing < 1.4 * expected


def test_sub_mesh_of_a_larger_mesh(reference, ranks):
    """4 ranks as (dp 2, ep 2): experts split over ep, replicated over dp; summed over dp they equal one process."""
    results = ranks(4)
    E = config().num_experts
    for rank, res in enumerate(results):
        assert max_diff(res["sub_logits"], reference["logits"][rank:rank + 1]) <= TOL
        r = res["sub_ep_rank"]
        for name, g in res["sub_expert_grads"].items():
            assert max_diff(g, reference["grads"][name][r * E // 2:(r + 1) * E // 2]) <= TOL, name


def test_bad_mesh_raises_value_error(ranks):
    """ep ∤ num_experts, a 2-D mesh and a second application raise ValueError (missing key: nothing raised)."""
    errors = ranks(4)[0]["errors"]
    assert "ep=4" in errors.get("ep", "") and "num_experts=6" in errors["ep"] and "must divide" in errors["ep"]
    assert errors["untouched"]  # nothing changed before the error
    assert "1-D" in errors.get("2d", "")
    assert "already" in errors.get("twice", "")


@pytest.mark.parametrize("world_size", [2, 4])
def test_state_dict_names_are_unchanged(ranks, world_size):
    cfg = config()
    for res in ranks(world_size):
        before, after = res["keys"]
        assert before == after
        layout = res["layout"]
        assert len(layout) == 3 * N_MOE and all(k.rsplit(".", 1)[-1] in ("w1", "w2", "w3") for k in layout)
        for name, (kind, placements, local_shape, diff) in layout.items():
            assert kind == "DTensor" and len(placements) == 1 and placements[0].is_shard(0)
            assert local_shape[0] == cfg.num_experts // world_size
            assert diff == 0.0  # the shards reassemble the original weights exactly


def test_composes_with_fsdp2(reference, ranks):
    """EP experts + FSDP2 on the rest (experts in ignored_params): logits and all gradients still equal."""
    results = ranks(2)
    E = config().num_experts
    for rank, res in enumerate(results):
        f = res["fsdp"]
        assert max_diff(f["logits"], reference["logits"][2 * rank:2 * rank + 2]) <= TOL
        assert set(f["grads"]) == set(reference["grads"]) and len(f["expert_names"]) == 3 * N_MOE
        assert f["dense_mesh"] == {"[0, 1]"}
        for name, g in f["grads"].items():
            ref = reference["grads"][name]
            if name in f["expert_names"]:
                ref = ref[rank * E // 2:(rank + 1) * E // 2]
            assert max_diff(g, ref) <= TOL, name


def test_loop_impl_expert_accessor_and_counters(reference, ranks):
    """Loop experts (`impl="loop"`) dispatch to the same result; `expert(e, z)` is the model's expert math for owned
    experts and refuses foreign ones; cumulative bytes add up over forwards and reset to zero."""
    E = config().num_experts
    for rank, res in enumerate(ranks(2)):
        loop = res["loop"]
        assert max_diff(loop["logits"], reference["logits"][2 * rank:2 * rank + 2]) <= TOL
        for name, g in loop["expert_grads"].items():
            assert max_diff(g, reference["grads"][name][rank * E // 2:(rank + 1) * E // 2]) <= TOL, name
        once, twice = loop["counters"]
        assert once.forwards == N_MOE and once.forward > 0
        assert twice == once + once  # the no-grad forward of the same rows routes identically
        assert loop["reset"]
        assert loop["expert_diff"] == 0.0
        assert "is not on EP rank" in loop.get("foreign", "")


def test_a_rank_that_receives_no_tokens(skewed_reference, ranks):
    """All tokens routed to rank 0's experts: rank 1 runs its experts on nothing, joins the backward all-to-alls
    (no hang) and gets zero expert gradients; rank 0's equal one process."""
    (r0, r1) = (res["skewed"] for res in ranks(2))
    ref = skewed_reference
    for rank, res in enumerate((r0, r1)):
        assert max_diff(res["logits"], ref["logits"][2 * rank:2 * rank + 2]) <= TOL
    for name, g in r0["expert_grads"].items():
        assert max_diff(g, ref["grads"][name][:8]) <= TOL and float(g.abs().max()) > 1e-6
        assert float(r1["expert_grads"][name].abs().max()) == 0.0 == float(ref["grads"][name][8:].abs().max())
    assert r1["bytes"].assignments_received == 0 == r0["bytes"].assignments_sent
    assert r0["bytes"].dispatch_received == r1["bytes"].dispatch_sent == N_MOE * 2 * T * 4 * 64 * 8
