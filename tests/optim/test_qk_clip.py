"""QK-Clip (docs/architecture.md §8.6, §12.3 item 17) and the reference per-head max-logit computation."""

from __future__ import annotations

import pytest
import torch

from k3.model.mla import GatedMLA
from k3.optim import mla_layers, mla_max_logits, qk_clip_


@pytest.fixture
def mla_and_input():
    """A random MLA layer of the §12.2 config (H = 3, N = 16, R = 8, Vh = 12) with per-head query scales 60, 80,
    10: heads 0 and 1 have max logits above τ = 100, head 2 below."""
    from conformance import build_tiny_config

    config = build_tiny_config()
    torch.manual_seed(0)
    mla = GatedMLA(config)
    with torch.no_grad():
        for p in mla.parameters():
            p.normal_(0, 0.3)
        mla.q_b_proj.weight.view(config.num_attention_heads, -1, config.q_lora_rank).mul_(
            torch.tensor([60.0, 80.0, 10.0])[:, None, None])
    x_BTD = torch.randn(2, 9, config.hidden_size, generator=torch.Generator().manual_seed(1))
    return mla, x_BTD


def all_logits(mla: GatedMLA, x_BTD: torch.Tensor) -> torch.Tensor:
    """Every causal logit [B, H, T, S] via the absorbed form (W_UK folded into the query, §4.4): an
    independent route to the same numbers as `mla_max_logits`."""
    cfg = mla.config
    C, N = cfg.kv_lora_rank, cfg.qk_nope_head_dim
    q_nope, q_pe = mla.project_query(x_BTD)
    W_UK_HNC = mla.kv_b_proj.weight.view(mla.num_heads, -1, C)[:, :N]
    q_BTHL = torch.cat([torch.einsum("bthn,hnc->bthc", q_nope, W_UK_HNC), q_pe], dim=-1)
    scores = torch.einsum("bthl,bsl->bhts", q_BTHL, mla.compress_kv(x_BTD)) * mla.scale
    T = x_BTD.shape[1]
    return scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))


def test_max_logits_match_absorbed_scores(mla_and_input):
    mla, x = mla_and_input
    torch.testing.assert_close(mla_max_logits(mla, x), all_logits(mla, x).amax(dim=(0, 2, 3)),
                               rtol=1e-5, atol=1e-5)


def test_max_logits_respect_documents(mla_and_input):
    """With packed documents only same-document causal pairs count: the max equals that of separate runs."""
    mla, x = mla_and_input
    x = x[:1]
    document_ids = torch.tensor([[0] * 4 + [1] * 5])
    separate = torch.maximum(mla_max_logits(mla, x[:, :4]), mla_max_logits(mla, x[:, 4:]))
    torch.testing.assert_close(mla_max_logits(mla, x, document_ids), separate, rtol=1e-5, atol=1e-5)


def test_max_logits_over_earlier_keys_and_in_blocks(mla_and_input):
    """Queries at the end of longer keys (a context-parallel shard after the earlier shards' latents) score against
    every earlier key; blocks smaller than the sequence (whole, ragged, one position) give the same maximum (to the
    rounding of products of other shapes)."""
    mla, x = mla_and_input
    logits = all_logits(mla, x)
    latent = mla.compress_kv(x)
    torch.testing.assert_close(mla_max_logits(mla, x[:, 5:], latent_BSL=latent),
                               logits[:, :, 5:].amax(dim=(0, 2, 3)), rtol=1e-5, atol=1e-5)
    documents = torch.tensor([[0] * 4 + [1] * 5] * 2)
    for block in (1, 2, 4):
        for args in ((x,), (x, documents), (x[:, 5:], documents, latent)):
            torch.testing.assert_close(mla_max_logits(mla, *args, block=block), mla_max_logits(mla, *args),
                                       rtol=1e-6, atol=0)


def test_clip_bounds_logits_and_leaves_the_rest_bit_identical(mla_and_input):
    """τ = 100: the clipped heads 0 and 1 end at τ (every logit × γ); the unclipped head's rows, the v rows,
    kv_a_proj_with_mqa, q_a_proj and everything else are bit-identical."""
    mla, x = mla_and_input
    H, N = mla.num_heads, mla.config.qk_nope_head_dim
    before_max = mla_max_logits(mla, x)
    tau = 100.0
    assert (before_max[:2] > tau).all() and 0 < before_max[2] < tau
    before_logits = all_logits(mla, x)
    before = {n: p.detach().clone() for n, p in mla.named_parameters()}

    gammas = qk_clip_({3: mla}, {3: before_max})

    gamma = gammas[3]
    torch.testing.assert_close(gamma, torch.tensor([tau / before_max[0], tau / before_max[1], 1.0]))
    after_max = mla_max_logits(mla, x)
    assert (after_max[:2] <= tau * (1 + 1e-3)).all() and (after_max[:2] >= tau * (1 - 1e-3)).all()
    finite = before_logits.isfinite()
    torch.testing.assert_close(all_logits(mla, x)[finite], (before_logits * gamma[:, None, None])[finite],
                               rtol=1e-5, atol=1e-5)
    q_b = mla.q_b_proj.weight.view(H, -1, mla.config.q_lora_rank)
    q_b0 = before["q_b_proj.weight"].view(H, -1, mla.config.q_lora_rank)
    kv_b = mla.kv_b_proj.weight.view(H, -1, mla.config.kv_lora_rank)
    kv_b0 = before["kv_b_proj.weight"].view(H, -1, mla.config.kv_lora_rank)
    assert torch.equal(q_b[2], q_b0[2]) and torch.equal(kv_b[2], kv_b0[2])  # unclipped head
    assert torch.equal(kv_b[:, N:], kv_b0[:, N:])  # v rows of every head
    torch.testing.assert_close(q_b[:2, :N], q_b0[:2, :N] * gamma[:2, None, None].sqrt())
    torch.testing.assert_close(q_b[:2, N:], q_b0[:2, N:] * gamma[:2, None, None])
    torch.testing.assert_close(kv_b[:2, :N], kv_b0[:2, :N] * gamma[:2, None, None].sqrt())
    for name, p in mla.named_parameters():
        if name not in ("q_b_proj.weight", "kv_b_proj.weight"):
            assert torch.equal(p, before[name]), name


def test_clip_on_a_model_finds_mla_layers_by_index():
    """On a whole model, layer indices address its MLA layers; nothing changes below τ; a KDA index is an error."""
    from conformance import build_tiny_config

    from k3.model import K3ForCausalLM

    config = build_tiny_config()
    model = K3ForCausalLM(config)
    mla_idx = [i for i, t in enumerate(config.layer_types) if t == "mla"]
    assert sorted(mla_layers(model)) == mla_idx
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    H = config.num_attention_heads
    gammas = qk_clip_(model, {i: torch.full((H,), 50.0) for i in mla_idx})
    assert all(torch.equal(g, torch.ones(H)) for g in gammas.values())
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    gammas = qk_clip_(model, {mla_idx[0]: torch.tensor([400.0, 50.0, 100.0])})
    torch.testing.assert_close(gammas[mla_idx[0]], torch.tensor([0.25, 1.0, 1.0]))
    with pytest.raises(KeyError, match="not an MLA layer"):
        qk_clip_(model, {0: torch.full((H,), 500.0)})
