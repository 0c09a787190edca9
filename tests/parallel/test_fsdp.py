"""FSDP2 (`k3.parallel.fsdp.apply_fsdp`) on k3-tiny over 2 gloo ranks equals one process on the whole batch."""

from __future__ import annotations

import torch

from dist_utils import run_ranks

GLOBAL_ROWS, T = 4, 24


def build(seed: int = 0):
    from k3 import K3Config, K3ForCausalLM

    torch.manual_seed(seed)
    return K3ForCausalLM(K3Config.from_preset("k3-tiny")).double()


def batch():
    ids = torch.randint(0, 4096, (GLOBAL_ROWS, T), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, 3:9] = -100  # ragged scored counts per rank
    return ids, labels


def global_mean_grads(model, ids, labels):
    out = model(ids, labels=labels)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def sharded_rank(rank, world_size, reshard_after_forward):
    import torch.distributed as dist

    from k3.parallel.distributed import make_distributed, rank_rows
    from k3.parallel.fsdp import apply_fsdp

    job = make_distributed()
    model = apply_fsdp(build(), job.mesh, reshard_after_forward=reshard_after_forward)
    ids, labels = batch()
    rows = rank_rows(GLOBAL_ROWS, world_size, rank)
    out = model(ids[rows], labels=labels[rows])
    total = out.loss_tokens.clone()
    dist.all_reduce(total)
    loss = out.loss * out.loss_tokens / total  # this rank's share of the global mean
    loss.backward()
    summed = loss.detach().clone()
    dist.all_reduce(summed)
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    placements = {n: str(p.placements) for n, p in model.named_parameters()}
    return summed, grads, placements, out.logits.detach()


def test_fsdp_two_ranks_equal_one_process():
    reference = build()
    ids, labels = batch()
    loss, grads = global_mean_grads(reference, ids, labels)
    with torch.no_grad():
        logits = reference(ids).logits
    for reshard in (True, False):
        results = run_ranks(sharded_rank, 2, reshard, timeout=180)
        for rank, (summed, rank_grads, placements, rank_logits) in enumerate(results):
            assert abs(summed.item() - loss.item()) < 1e-12
            assert set(rank_grads) == set(grads)
            for name, g in grads.items():
                assert (rank_grads[name] - g).abs().max().item() < 1e-12, name
            assert all(p == "(Shard(dim=0),)" for p in placements.values())
            rows = slice(rank * 2, rank * 2 + 2)
            assert (rank_logits - logits[rows]).abs().max().item() < 1e-12
