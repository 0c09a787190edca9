"""The training observer channel (`k3.model.observer`): what it sees, when it is inert, activation
checkpointing, and that observing changes nothing."""

from __future__ import annotations

import torch

from conformance import ids_for
from k3.model.mla import GatedMLA
from k3.model.moe import MoEGate
from k3.model.observer import ForwardObserver, attach, detach


class Counter(ForwardObserver):
    def __init__(self):
        self.routing, self.attention = [], []

    def on_routing(self, gate, scores_NE, choice_NE, idx_Nk):
        assert isinstance(gate, MoEGate) and not scores_NE.requires_grad
        self.routing.append((id(gate), idx_Nk.clone()))

    def on_attention(self, mla, x_BTD, latent_BSL, document_ids_BS):
        assert isinstance(mla, GatedMLA) and not x_BTD.requires_grad and not latent_BSL.requires_grad
        assert latent_BSL.shape[:2] == x_BTD.shape[:2]  # one whole sequence: its own latents
        self.attention.append((id(mla), x_BTD.clone()))


def layer_counts(model):
    moe = sum(isinstance(m, MoEGate) for m in model.modules())
    mla = sum(isinstance(m, GatedMLA) for m in model.modules())
    return moe, mla


def test_sees_every_router_and_mla_layer_once_per_training_forward(tiny_model):
    model = tiny_model(seed=1).train()
    counter = Counter()
    hosts = attach(counter, model)
    assert hosts == [model.model]
    model(ids_for(model.config.vocab_size, 2, 12, seed=1))
    assert (len(counter.routing), len(counter.attention)) == layer_counts(model)
    detach(counter, hosts)
    model(ids_for(model.config.vocab_size, 2, 12, seed=1))
    assert (len(counter.routing), len(counter.attention)) == layer_counts(model)  # detached: nothing more


def test_inert_in_evaluation_and_without_observers(tiny_model):
    model = tiny_model(seed=2)
    counter = Counter()
    attach(counter, model)
    model.eval()(ids_for(model.config.vocab_size, 1, 8, seed=2))
    assert counter.routing == [] and counter.attention == []


def test_activation_checkpointing_observes_each_layer_once(tiny_model):
    """The recomputation in backward is not observed again; what is observed equals the plain forward."""
    ids = ids_for(256, 2, 16, seed=3)
    seen = []
    for checkpointing in (False, True):
        model = tiny_model(seed=3).train()
        model.model.gradient_checkpointing = checkpointing
        counter = Counter()
        attach(counter, model)
        model(ids, labels=ids).loss.backward()
        assert (len(counter.routing), len(counter.attention)) == layer_counts(model)
        seen.append(counter)
    for (_, a), (_, b) in zip(seen[0].routing, seen[1].routing):
        assert torch.equal(a, b)
    for (_, a), (_, b) in zip(seen[0].attention, seen[1].attention):
        assert torch.equal(a, b)


def test_observing_changes_neither_output_nor_gradients(tiny_model):
    ids = ids_for(256, 2, 16, seed=4)
    results = []
    for observe in (False, True):
        model = tiny_model(seed=4).train()
        if observe:
            attach(Counter(), model)
        loss = model(ids, labels=ids).loss
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))
