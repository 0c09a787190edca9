"""Context parallelism (`k3.parallel.context`): a sequence split over 2 and 4 gloo ranks gives the logits, the summed
loss and the gradients of one process holding the whole sequence, in K3's form and in K2's (RoPE: the shard's
positions matter), and for packed rows whose documents start inside shards, exactly at a shard boundary, or span
several shards."""

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


def rows(packed: bool) -> dict[str, torch.Tensor]:
    """Whole rows; packed: row 0's documents start at 5, 12 (a 4-rank boundary), 24 (2 ranks) and 31, row 1's at 40
    (one document over three of four shards); labels with a few ignored positions."""
    ids = sequences()
    labels = ids.clone()
    labels[1, 7:10] = -100
    batch = {"input_ids": ids, "labels": labels}
    if packed:
        starts = torch.zeros(ROWS, T, dtype=torch.long)
        starts[0, [5, 12, 24, 31]] = 1
        starts[1, 40] = 1
        batch["document_ids"] = starts.cumsum(1)
    return batch


def summed_loss(model, shard):
    from k3.ops.loss import IGNORE_INDEX, next_token_loss

    targets = shard["targets"]
    out = model(shard["input_ids"], document_ids=shard.get("document_ids"))
    return out.logits, next_token_loss(out.logits, targets) * (targets != IGNORE_INDEX).sum()


def whole(dtype, k2=False, packed=False):
    from k3.parallel.context import shard_batch

    model = build(dtype, k2)
    logits, loss = summed_loss(model, shard_batch(rows(packed), 0, 1))
    loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def shard_rank(rank, world_size, dtype, k2, packed):
    import torch.distributed as dist

    from k3.parallel.context import apply_context_parallel, shard_batch

    model = apply_context_parallel(build(dtype, k2), dist.group.WORLD)
    logits, loss = summed_loss(model, shard_batch(rows(packed), rank, world_size))
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)  # what data parallelism over the same ranks does
            grads[name] = p.grad
    return logits.detach(), total, grads


@pytest.mark.parametrize("ranks,dtype,k2,packed", [(2, torch.float64, False, False), (4, torch.float64, False, True),
                                                   (2, torch.float64, True, True), (2, torch.float32, False, False)])
def test_context_parallel_equals_one_process(ranks, dtype, k2, packed):
    logits, loss, grads = whole(dtype, k2, packed)
    tol = 1e-10 if dtype == torch.float64 else 1e-4  # fp32: reduction order
    share = T // ranks
    for rank, (rank_logits, total, rank_grads) in enumerate(run_ranks(shard_rank, ranks, dtype, k2, packed, timeout=240)):
        torch.testing.assert_close(rank_logits, logits[:, rank * share: (rank + 1) * share], rtol=tol, atol=tol)
        assert abs(total.item() - loss.item()) <= tol * abs(loss.item())
        assert set(rank_grads) == set(grads)
        for name, g in grads.items():
            scale = g.abs().max().item()
            assert (rank_grads[name] - g).abs().max().item() <= tol * max(scale, 1e-3), name


def max_logits(model, shard) -> dict[int, torch.Tensor]:
    """QK-Clip's per-head MLA max logits of one training forward (`MaxLogitRecorder`)."""
    from k3.model.observer import attach, detach
    from k3.optim import MaxLogitRecorder

    recorder = MaxLogitRecorder(model)
    hosts = attach(recorder, model)
    model(shard["input_ids"], document_ids=shard.get("document_ids"))
    detach(recorder, hosts)
    return recorder.pop()


def max_logit_rank(rank, world_size, packed):
    import torch.distributed as dist

    from k3.parallel.context import apply_context_parallel, shard_batch

    found = max_logits(apply_context_parallel(build(torch.float64), dist.group.WORLD),
                       shard_batch(rows(packed), rank, world_size))
    for m_H in found.values():
        dist.all_reduce(m_H, op=dist.ReduceOp.MAX)  # what the trainer does over its ranks
    return found


@pytest.mark.parametrize("ranks,packed", [(2, False), (4, True)])
def test_qk_clip_max_logits_cover_the_pairs_across_ranks(ranks, packed):
    """Each rank's queries are scored against every earlier rank's keys too, so the maximum over the ranks is one
    process's (with only each shard's own pairs, some heads' maxima would be lower: their largest pair crosses)."""
    from k3.parallel.context import shard_batch

    expected = max_logits(build(torch.float64), shard_batch(rows(packed), 0, 1))
    for found in run_ranks(max_logit_rank, ranks, packed, timeout=180):
        assert found.keys() == expected.keys()
        for i, m_H in expected.items():
            torch.testing.assert_close(found[i], m_H, rtol=1e-10, atol=1e-10)


def test_shards_score_every_next_token_once():
    from k3.ops.loss import next_token_targets
    from k3.parallel.context import shard_batch

    batch = rows(packed=True)
    shards = [shard_batch(batch, r, 4) for r in range(4)]
    for key in ("input_ids", "document_ids"):
        assert torch.equal(torch.cat([s[key] for s in shards], 1), batch[key])
    whole_targets = next_token_targets(batch["labels"], batch["document_ids"])
    assert torch.equal(torch.cat([s["targets"] for s in shards], 1), whole_targets)
    with pytest.raises(ValueError, match="48 tokens does not split evenly over 5"):
        shard_batch(batch, 0, 5)


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
        assert messages[0] == "context parallelism splits whole unpadded sequences: no cache or attention_mask"
        assert messages[1] in ("attention_mask must be left padding: a 0 after a 1 in the same row",
                               "context parallelism splits whole unpadded sequences: no cache or attention_mask")
        assert messages[2] == "context parallelism needs at least 3 tokens per rank, got 2"
