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


def mixed_precision_rank(rank, world_size):
    """One forward + backward of the fp32-stored k3-tiny under FSDP2 mixed precision: the dtypes each KDA layer's
    forward sees, the loss, and the gradients."""
    import torch.distributed as dist

    from k3.model.kda import KimiDeltaAttention
    from k3.parallel.distributed import make_distributed, rank_rows
    from k3.parallel.fsdp import apply_fsdp

    torch.manual_seed(0)
    from k3 import K3Config, K3ForCausalLM

    model = apply_fsdp(K3ForCausalLM(K3Config.from_preset("k3-tiny")), make_distributed().mesh, mixed_precision=True)
    seen = set()

    def record(module, args):
        seen.add(tuple(str(t.dtype) for t in (module.A_log, module.dt_bias, module.q_conv1d.weight,
                                              module.o_norm.weight, module.q_proj.weight, module.o_proj.weight)))

    for m in model.modules():
        if isinstance(m, KimiDeltaAttention):
            m.register_forward_pre_hook(record)
    ids, labels = batch()
    rows = rank_rows(GLOBAL_ROWS, world_size, rank)
    out = model(ids[rows], labels=labels[rows])
    total = out.loss_tokens.clone()
    dist.all_reduce(total)
    loss = out.loss * out.loss_tokens / total
    loss.backward()
    summed = loss.detach().clone()
    dist.all_reduce(summed)
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    return seen, summed, grads, {n: str(p.dtype) for n, p in model.named_parameters()}


def test_mixed_precision_computes_in_bf16_and_keeps_the_fp32_set():
    """With `mixed_precision` the projections reach forward in bf16 and KDA's fp32 set (A_log, dt_bias, the convs,
    o_norm) in fp32; parameters and gradients stay fp32; loss and gradients are those of the fp32 model to bf16
    accuracy (2 gloo ranks)."""
    torch.manual_seed(0)
    from k3 import K3Config, K3ForCausalLM

    reference = K3ForCausalLM(K3Config.from_preset("k3-tiny"))
    ids, labels = batch()
    loss, grads = global_mean_grads(reference, ids, labels)
    for seen, summed, rank_grads, dtypes in run_ranks(mixed_precision_rank, 2, timeout=180):
        assert seen == {("torch.float32",) * 4 + ("torch.bfloat16",) * 2}
        assert set(dtypes.values()) == {"torch.float32"}
        assert abs(summed.item() - loss.item()) < 2e-2 * loss.item()
        assert set(rank_grads) == set(grads)
        flat = torch.cat([rank_grads[n].flatten() for n in grads])
        ref = torch.cat([g.flatten() for g in grads.values()])
        assert flat.dtype == torch.float32 and torch.isfinite(flat).all()
        assert torch.nn.functional.cosine_similarity(flat, ref, dim=0) > 0.99
