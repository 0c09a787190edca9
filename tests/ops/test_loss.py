"""`k3.ops.loss`: the compiled next-token cross-entropy (one pass per row each way) against `F.cross_entropy` and
float64 (docs/architecture.md §9.9, §0.6)."""

import pytest
import torch
import torch.nn.functional as F

from k3.ops import compiled
from k3.ops.loss import IGNORE_INDEX, next_token_loss

pytestmark = pytest.mark.skipif(compiled.build("loss")[0] is None,
                                reason="the compiled loss kernel could not be built here")


def loss_and_grad(logits_BTO, targets_BT, fn):
    leaf = logits_BTO.detach().clone().requires_grad_()
    loss = fn(leaf, targets_BT)
    loss.backward()
    return loss.detach(), leaf.grad, loss.grad_fn


def graph_nodes(node):
    """The names of every autograd node behind `node`."""
    names, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n is not None and type(n).__name__ not in names:
            names.add(type(n).__name__)
            todo.extend(next_node for next_node, _ in n.next_functions)
    return names


def reference(logits_BTO, targets_BT):
    return F.cross_entropy(logits_BTO.flatten(0, 1), targets_BT.flatten(), ignore_index=IGNORE_INDEX)


@pytest.mark.parametrize("B, T, V", [(2, 9, 37), (3, 70, 259), (1, 2, 8)])  # odd vocabularies; one scored row
def test_kernel_matches_torch_and_float64(B, T, V):
    gen = torch.Generator().manual_seed(V)
    logits = 4 * torch.randn(B, T, V, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, V, (B, T), generator=gen)
    targets[0, -1] = IGNORE_INDEX  # the unscored last position
    if T > 4:
        targets[-1, 1:4] = IGNORE_INDEX
    ours, d_ours, node = loss_and_grad(logits.float(), targets, next_token_loss)
    assert "_CrossEntropyFunctionBackward" in graph_nodes(node)  # the kernel ran
    torch_ops, d_torch, _ = loss_and_grad(logits.float(), targets, reference)
    exact, d_exact, _ = loss_and_grad(logits, targets, reference)
    torch.testing.assert_close(ours, torch_ops, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(d_ours, d_torch, rtol=1e-5, atol=1e-7)
    assert (ours.double() - exact).abs() <= 2 * (torch_ops.double() - exact).abs() + 1e-6
    assert (d_ours.double() - d_exact).abs().max() <= 2 * (d_torch.double() - d_exact).abs().max() + 1e-7
    assert not d_ours[targets == IGNORE_INDEX].any()  # ignored rows get no gradient


def test_other_dtypes_and_upstream_gradient_scale():
    """float64 logits keep the torch ops; a scaled loss scales the kernel's gradient."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 11, generator=gen)
    targets = torch.randint(0, 11, (2, 5), generator=gen)
    _, _, node = loss_and_grad(logits.double(), targets, next_token_loss)
    assert "_CrossEntropyFunctionBackward" not in graph_nodes(node)
    _, d1, _ = loss_and_grad(logits, targets, next_token_loss)
    _, d3, _ = loss_and_grad(logits, targets, lambda x, t: 3 * next_token_loss(x, t))
    torch.testing.assert_close(d3, 3 * d1)


def test_kernel_names_a_target_outside_the_vocabulary():
    with pytest.raises(RuntimeError, match="target 11 is outside the vocabulary 0..10"):
        compiled.load("loss").forward(torch.zeros(2, 11), torch.tensor([3, 11]), IGNORE_INDEX)
