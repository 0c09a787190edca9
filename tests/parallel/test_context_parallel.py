"""Context parallelism (`k3.parallel.context`): a sequence split over 2 and 4 gloo ranks gives the logits, the summed
loss and the gradients of one process holding the whole sequence, in K3's form and in K2's (RoPE: the shard's
positions matter)."""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_ranks

ROWS, T = 2, 48


def build(dtype, k2: bool = False):
    from k3 import K3Config, K3ForCausalLM

    overrides = dict(mla_use_nope=False, mla_use_output_gate=False) if k2 else {}
    torch.manual_seed(0)
    return K3ForCausalLM(K3Config.from_preset("k3-tiny", **overrides)).to(dtype)


def sequences():
    return torch.randint(0, 4096, (ROWS, T), generator=torch.Generator().manual_seed(1))


def summed_loss(model, ids, targets):
    from k3.ops.loss import IGNORE_INDEX, next_token_loss

    out = model(ids)
    return out.logits, next_token_loss(out.logits, targets) * (targets != IGNORE_INDEX).sum()


def whole(dtype, k2=False):
    from k3.parallel.context import shard_sequence

    model = build(dtype, k2)
    ids, targets = shard_sequence(sequences(), 0, 1)
    logits, loss = summed_loss(model, ids, targets)
    loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def shard_rank(rank, world_size, dtype, k2):
    import torch.distributed as dist

    from k3.parallel.context import apply_context_parallel, shard_sequence

    model = apply_context_parallel(build(dtype, k2), dist.group.WORLD)
    ids, targets = shard_sequence(sequences(), rank, world_size)
    logits, loss = summed_loss(model, ids, targets)
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)  # what data parallelism over the same ranks does
            grads[name] = p.grad
    return logits.detach(), total, grads


@pytest.mark.parametrize("ranks,dtype,k2", [(2, torch.float64, False), (4, torch.float64, False),
                                            (2, torch.float64, True), (2, torch.float32, False)])
def test_context_parallel_equals_one_process(ranks, dtype, k2):
    logits, loss, grads = whole(dtype, k2)
    tol = 1e-10 if dtype == torch.float64 else 1e-4  # fp32: reduction order
    share = T // ranks
    for rank, (rank_logits, total, rank_grads) in enumerate(run_ranks(shard_rank, ranks, dtype, k2, timeout=240)):
        torch.testing.assert_close(rank_logits, logits[:, rank * share: (rank + 1) * share], rtol=tol, atol=tol)
        assert abs(total.item() - loss.item()) <= tol * abs(loss.item())
        assert set(rank_grads) == set(grads)
        for name, g in grads.items():
            scale = g.abs().max().item()
            assert (rank_grads[name] - g).abs().max().item() <= tol * max(scale, 1e-3), name


def test_shards_score_every_next_token_once():
    from k3.ops.loss import IGNORE_INDEX
    from k3.parallel.context import shard_sequence

    ids = sequences()
    shards = [shard_sequence(ids, r, 4) for r in range(4)]
    assert torch.equal(torch.cat([s[0] for s in shards], 1), ids)
    targets = torch.cat([s[1] for s in shards], 1)
    assert torch.equal(targets[:, :-1], ids[:, 1:]) and bool((targets[:, -1] == IGNORE_INDEX).all())
    with pytest.raises(ValueError, match="48 tokens does not split evenly over 5"):
        shard_sequence(ids, 0, 5)


def refusal_rank(rank, world_size):
    import torch.distributed as dist

    from k3.parallel.context import apply_context_parallel

    model = apply_context_parallel(build(torch.float32), dist.group.WORLD)
    messages = []
    for call in (lambda: model(sequences(), cache=model.make_cache(ROWS)),
                 lambda: model(sequences(), attention_mask=torch.ones(ROWS, T).tril_()[:ROWS]),
                 lambda: model(sequences()[:, :2])):
        try:
            call()
        except ValueError as e:
            messages.append(str(e))
    return messages


def test_context_parallel_refuses_what_it_cannot_split():
    for messages in run_ranks(refusal_rank, 2, timeout=120):
        assert messages[0].startswith("context parallelism splits whole unpadded sequences")
        assert messages[1].startswith("attention_mask must be left padding") or \
            messages[1].startswith("context parallelism splits whole unpadded sequences")
        assert messages[2] == "context parallelism needs at least 3 tokens per rank, got 2"
