"""Muon and QK-Clip on FSDP2-sharded parameters (docs/architecture.md §8, scale-out note §4–§5): k3-tiny in
float64, `fully_shard` per decoder layer and on the root over 2 and 3 gloo ranks, gives the same parameters,
Muon momentum and QK-Clip result as one process; each Newton–Schulz block is orthogonalised exactly once over
all ranks and the work is spread; `get_optimizer_state_dict` initialises the sharded optimiser state.

The 2- and 3-rank runs are spawned once each, together (`dist_utils.run_ranks`, hard timeout), while this
process computes the single-process reference; the tests read their per-rank results.
"""

from __future__ import annotations

import copy
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest
import torch

from dist_utils import run_ranks

LR, STEPS, TAU = 0.02, 2, 100.0
WORLD_SIZES = (2, 3)
RUN_TIMEOUT_S = 90.0  # hard limit per run (both run at once); a healthy run takes ~20-40 s on 2 busy cores
EXACT = 1e-12  # float64: the sharded and single-process arithmetic may differ only in the last bits
MAX_LOGITS = (50.0, 150.0, 400.0, 100.5)  # per head (k3-tiny has 4); heads 1-3 are clipped at τ = 100


def build():
    from k3 import K3Config, K3ForCausalLM

    torch.manual_seed(0)
    config = K3Config.from_preset("k3-tiny")
    return K3ForCausalLM(config).double(), config


def full_grad(index: int, step: int, shape: torch.Size) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + index)
    return torch.randn(shape, generator=gen, dtype=torch.float64)


def shard_model(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


@contextmanager
def counting_ns_blocks():
    """While active, `k3.optim.muon.newton_schulz5` counts the matrices it orthogonalises, by shape
    (A, B) → number of matrices; yields the Counter."""
    import k3.optim.muon as muon_module

    counts, original = Counter(), muon_module.newton_schulz5

    def counted(U, *args, **kwargs):
        counts[tuple(U.shape[-2:])] += U[..., 0, 0].numel()
        return original(U, *args, **kwargs)

    muon_module.newton_schulz5 = counted
    try:
        yield counts
    finally:
        muon_module.newton_schulz5 = original


@contextmanager
def counting_collectives():
    """While active, `torch.distributed.gather` / `scatter` (Muon's owner route) are counted, with the bytes of
    this rank's own buffer, and the gathers this rank received as the owner ("owned"); yields the Counter."""
    import torch.distributed as dist

    counts, originals = Counter(), {name: getattr(dist, name) for name in ("gather", "scatter")}

    def counted(name):
        def call(tensor, *args, **kwargs):
            counts[name] += 1
            counts[f"{name}_bytes"] += tensor.numel() * tensor.element_size()
            if name == "gather":
                counts["owned"] += args[0] is not None  # only the owner passes a gather list
            return originals[name](tensor, *args, **kwargs)
        return call

    for name in originals:
        setattr(dist, name, counted(name))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def set_grads(model, step: int, names: list[str]) -> None:
    """The same random full gradients on any model; a DTensor parameter gets its shard of them."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    params = dict(model.named_parameters())
    for i, name in enumerate(names):
        p = params[name]
        g = full_grad(i, step, p.shape)
        p.grad = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None) if isinstance(p, DTensor) \
            else g


def reference_run() -> dict:
    """The single-process run: STEPS Muon + AdamW steps of k3-tiny (float64), counting NS blocks."""
    from k3.optim import make_optimizers

    model, config = build()
    names = [n for n, _ in model.named_parameters()]
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    muon, adamw = make_optimizers(model, config, lr=LR, ns_dtype=torch.float64)
    with counting_ns_blocks() as counts:
        for step in range(STEPS):
            set_grads(model, step, names)
            muon.step()
            adamw.step()
    by_id = {id(p): n for g in muon.param_groups for n, p in zip(g["param_names"], g["params"])}
    return dict(model=model, initial=initial, params={n: p.detach() for n, p in model.named_parameters()},
                momentum={by_id[id(p)]: s["momentum_buffer"] for p, s in muon.state.items()},
                ns=dict(counts))


def _worker(rank: int, world_size: int) -> dict:
    """One rank of the sharded run; rank 0 also returns the full tensors the parent compares with one process."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from k3.optim import make_optimizers, mla_layers, qk_clip_
    from k3.optim.muon import _sharded_layout

    model, config = build()
    names = [n for n, _ in model.named_parameters()]
    shard_model(model, init_device_mesh("cpu", (world_size,)))
    params = dict(model.named_parameters())
    assert all(isinstance(p, DTensor) for p in params.values())
    muon, adamw = make_optimizers(model, config, lr=LR, ns_dtype=torch.float64)
    muon_names = {id(p): n for g in muon.param_groups for n, p in zip(g["param_names"], g["params"])}
    routes = {muon_names[id(p)]: (g["name"], _sharded_layout(p, g["split"], g["split_sizes"])[0])
              for g in muon.param_groups for p in g["params"]}

    with counting_ns_blocks() as counts, counting_collectives() as collectives:
        for step in range(STEPS):
            set_grads(model, step, names)
            muon.step()
            adamw.step()
    out = dict(rank=rank, routes=routes, ns=dict(counts), collectives=dict(collectives))
    full = {n: params[n].full_tensor() for n in names}  # collectives: every rank, same order
    momentum = {}
    for p, s in muon.state.items():
        M = s["momentum_buffer"]
        assert isinstance(M, DTensor) and M.placements == p.placements
        momentum[muon_names[id(p)]] = M.full_tensor()
    if rank == 0:
        out.update(params=full, momentum=momentum)

    # get_optimizer_state_dict on the stepped optimisers returns those buffers (sharded, by parameter name)
    state = get_optimizer_state_dict(model, (muon, adamw))["state"]
    out["dcp_momentum_equal"] = all(torch.equal(state[n]["momentum_buffer"].full_tensor(), momentum[n])
                                    for n in sorted(momentum))
    # ... and on fresh optimisers initialises them with a zero-gradient, lr-0 step that leaves the weights alone
    model.zero_grad(set_to_none=True)  # it only initialises optimisers whose parameters have no gradients
    fresh = make_optimizers(model, config, lr=LR, ns_dtype=torch.float64)
    before = {n: p.to_local().clone() for n, p in params.items()}
    fresh_state = get_optimizer_state_dict(model, fresh)["state"]
    out["fresh_buffers"] = {
        n: (isinstance(fresh_state[n]["momentum_buffer"], DTensor), tuple(fresh_state[n]["momentum_buffer"].shape),
            bool(torch.all(fresh_state[n]["momentum_buffer"].to_local() == 0)))
        for n in sorted(momentum) if n in fresh_state}
    out["fresh_weights_unchanged"] = all(torch.equal(before[n], params[n].to_local()) for n in names)
    out["grads_cleared"] = all(p.grad is None for p in params.values())

    # QK-Clip on the sharded q_b_proj / kv_b_proj (every rank passes the same, already all-reduced, max logits)
    layers = mla_layers(model)
    max_logits = {i: torch.tensor(MAX_LOGITS).roll(i) for i in layers}
    projections = {f"{i}.{proj}": getattr(mla, proj).weight for i, mla in layers.items()
                   for proj in ("q_b_proj", "kv_b_proj")}
    qk_before = {k: W.full_tensor() for k, W in projections.items()}
    gammas = qk_clip_(model, max_logits, tau=TAU)
    qk_after = {k: W.full_tensor() for k, W in projections.items()}
    out["qk_local_rows"] = {k: W.to_local().shape[0] for k, W in projections.items()}
    if rank == 0:
        out.update(qk_before=qk_before, qk_after=qk_after, gammas=gammas, max_logits=max_logits)
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def runs():
    """The 2- and 3-rank runs, started together (each under run_ranks' hard timeout), and the single-process
    reference computed meanwhile; tests read `runs[1][world_size].result()` (re-raises a failed run)."""
    with ThreadPoolExecutor(max_workers=len(WORLD_SIZES)) as pool:
        futures = {w: pool.submit(run_ranks, _worker, w, timeout=RUN_TIMEOUT_S, collective_timeout=60.0)
                   for w in WORLD_SIZES}
        reference = reference_run()
        for future in futures.values():
            future.exception()  # wait (bounded by the run's own timeout)
    return reference, futures


def assert_equal_to_one_process(reference: dict, results: list[dict]) -> None:
    r0 = results[0]
    assert set(r0["params"]) == set(reference["params"]) and len(r0["params"]) > 100
    diffs = {n: (r0["params"][n] - reference["params"][n]).abs().max().item() for n in reference["params"]}
    worst = max(diffs, key=diffs.get)
    assert diffs[worst] <= EXACT, (worst, diffs[worst])
    assert set(r0["momentum"]) == set(reference["momentum"]) and len(r0["momentum"]) > 50
    diffs = {n: (r0["momentum"][n] - reference["momentum"][n]).abs().max().item() for n in reference["momentum"]}
    worst = max(diffs, key=diffs.get)
    assert diffs[worst] <= EXACT, (worst, diffs[worst])
    # the steps really moved every weight (so "equal" does not mean "untouched")
    moved = {n: (reference["params"][n] - reference["initial"][n]).abs().max().item() for n in reference["params"]}
    assert min(moved.values()) > 1e-4


def assert_one_gather_and_scatter_per_owner_route_parameter(results: list[dict]) -> None:
    """Muon's only collectives are the owner route's: one gather and one scatter per such parameter and step
    (the local route, and AdamW, communicate nothing)."""
    owners = sum(route == "owner" for _, route in results[0]["routes"].values())
    assert owners > 0
    for r in results:
        assert r["collectives"]["gather"] == r["collectives"]["scatter"] == STEPS * owners, r["collectives"]


def test_two_ranks_muon_adamw_steps_equal_one_process(runs):
    """Two Muon + AdamW steps on k3-tiny sharded over 2 ranks: every parameter and Muon momentum buffer equals
    the single-process optimisers' (float64, ≤ 1e-12). On 2 ranks every head-split weight is cut at head
    boundaries (local route, no communication), experts are split by expert (local) and whole matrices go to
    owners."""
    reference, futures = runs
    results = futures[2].result()
    assert_equal_to_one_process(reference, results)
    routes = results[0]["routes"]
    assert {route for group, route in routes.values() if group in ("kda_qkv", "mla_q_b", "mla_kv_b")} == {"local"}
    assert {route for group, route in routes.values() if group == "experts"} == {"local"}
    assert {route for group, route in routes.values() if group == "matrix"} == {"owner"}
    assert_one_gather_and_scatter_per_owner_route_parameter(results)


def test_three_ranks_uneven_shards_cutting_heads_equal_one_process(runs):
    """3 ranks: FSDP2 rows ceil(rows/3) cut through heads (q_b_proj 192 rows → 64 per rank vs 48-row heads;
    kv_b_proj 224 → 75, 75, 74 vs 56-row heads; b_proj 4 → 2, 2, 0; 16 experts → 6, 6, 4): still equal."""
    reference, futures = runs
    results = futures[3].result()
    assert_equal_to_one_process(reference, results)
    routes = results[0]["routes"]
    assert {route for group, route in routes.values() if group in ("kda_qkv", "mla_q_b", "mla_kv_b")} == {"owner"}
    assert {route for group, route in routes.values() if group == "experts"} == {"local"}
    assert_one_gather_and_scatter_per_owner_route_parameter(results)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_each_block_orthogonalised_once_and_work_spread(runs, world_size):
    """Over all ranks, Newton–Schulz saw exactly the blocks of the single-process run (same shapes, same
    multiplicities: nothing orthogonalised twice or in pieces), every rank did a share, and every rank owns
    some of the owner-route parameters (each has exactly one owner)."""
    reference, futures = runs
    results = futures[world_size].result()
    total = Counter()
    for r in results:
        total.update(r["ns"])
    assert total == Counter(reference["ns"])
    per_rank = [sum(r["ns"].values()) for r in results]
    assert all(n > 0 for n in per_rank), per_rank
    owners = sum(route == "owner" for _, route in results[0]["routes"].values())
    owned = [r["collectives"]["owned"] for r in results]
    assert sum(owned) == STEPS * owners and min(owned) > 0, owned
    # a matrix of unique shape (layer 0's dense down_proj [128, 384], sharded by rows) was done by one rank
    assert sorted(r["ns"].get((128, 384), 0) for r in results) == [0] * (world_size - 1) + [STEPS]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_qk_clip_on_sharded_weights_equals_one_process(runs, world_size):
    """QK-Clip on sharded q_b_proj / kv_b_proj (3 ranks: shards cut through heads) equals single-process
    `qk_clip_` on the same weights with the same max logits, bit for bit, and returns the same γ."""
    from k3.optim import mla_layers, qk_clip_

    reference, futures = runs
    results = futures[world_size].result()
    r0 = results[0]
    layers = mla_layers(copy.deepcopy(reference["model"]))
    assert len(r0["qk_after"]) == 2 * len(layers) == 6
    with torch.no_grad():
        for i, mla in layers.items():
            for proj in ("q_b_proj", "kv_b_proj"):
                getattr(mla, proj).weight.copy_(r0["qk_before"][f"{i}.{proj}"])
    gammas = qk_clip_(layers, r0["max_logits"], tau=TAU)
    for i, mla in layers.items():
        assert torch.equal(gammas[i], r0["gammas"][i])
        assert (gammas[i] < 1).sum() == 3  # heads 1-3 (rolled) are clipped
        for proj in ("q_b_proj", "kv_b_proj"):
            key = f"{i}.{proj}"
            assert torch.equal(r0["qk_after"][key], getattr(mla, proj).weight), key
            changed = (r0["qk_after"][key] != r0["qk_before"][key]).any(dim=1).sum().item()
            assert 0 < changed < getattr(mla, proj).weight.shape[0], key  # clipped heads; v rows untouched
    if world_size == 3:
        local_rows = {k: sorted(r["qk_local_rows"][k] for r in results) for k in r0["qk_local_rows"]}
        assert set(map(tuple, local_rows.values())) == {(64, 64, 64), (74, 75, 75)}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_get_optimizer_state_dict_on_sharded_muon(runs, world_size):
    """`get_optimizer_state_dict` returns the sharded momentum buffers; on fresh optimisers it runs Muon's
    zero-gradient, lr-0 step on the sharded layout: zero DTensor buffers of the global shapes for every Muon
    parameter, weights bit-identical, gradients cleared."""
    reference, futures = runs
    for r in futures[world_size].result():
        assert r["dcp_momentum_equal"]
        assert set(r["fresh_buffers"]) == set(reference["momentum"])
        for name, (is_dtensor, shape, all_zero) in r["fresh_buffers"].items():
            assert is_dtensor and all_zero and shape == tuple(reference["momentum"][name].shape), name
        assert r["fresh_weights_unchanged"] and r["grads_cleared"]
