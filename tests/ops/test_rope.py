"""Rotary position embedding of the K2-style MLA baseline (docs/architecture.md §14.2)."""

from __future__ import annotations

import pytest
import torch

from k3.ops.rope import apply_rope, rope_angles


def _rotated(x_BTR, start, theta=50.0):
    positions = torch.arange(start, start + x_BTR.shape[1])
    return apply_rope(x_BTR, *rope_angles(positions, x_BTR.shape[-1], theta))


def test_scores_depend_on_the_relative_position_only():
    """q_p · k_s after rotation equals q_{p+Δ} · k_{s+Δ}: the same vectors rotated to shifted positions."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 7, 3, 10, generator=g, dtype=torch.float64), torch.randn(1, 7, 10, generator=g,
                                                                                  dtype=torch.float64)
    scores = torch.einsum("bthr,bsr->bhts", _rotated(q, 0), _rotated(k, 0))
    for shift in (1, 5, 1000):
        shifted = torch.einsum("bthr,bsr->bhts", _rotated(q, shift), _rotated(k, shift))
        torch.testing.assert_close(shifted, scores, rtol=1e-9, atol=1e-9)
    # without rotation the scores differ: the positions do enter
    assert not torch.allclose(torch.einsum("bthr,bsr->bhts", q, k), scores)


def test_rotation_is_orthogonal_and_position_zero_is_identity():
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    torch.testing.assert_close(_rotated(x, 0)[:, :1], x[:, :1])
    torch.testing.assert_close(_rotated(x, 3).norm(dim=-1), x.norm(dim=-1))


def test_channel_pairs_turn_at_their_frequencies():
    """Pair c of an R-wide vector turns by p·θ^(−2c/R): channel c and c + R/2 form the pair."""
    R, theta, p = 4, 100.0, 3
    x = torch.zeros(1, p + 1, R, dtype=torch.float64)
    x[0, p, 0] = x[0, p, 1] = 1.0  # (1, 0) in both pairs
    y = _rotated(x, 0, theta)[0, p]
    angles = [p * theta ** (-2 * c / R) for c in range(R // 2)]
    expected = torch.tensor([torch.cos(torch.tensor(a, dtype=torch.float64)) for a in angles]
                            + [torch.sin(torch.tensor(a, dtype=torch.float64)) for a in angles])
    torch.testing.assert_close(y, expected)


def test_odd_width_is_refused():
    with pytest.raises(ValueError, match="even width.*qk_rope_head_dim=5"):
        rope_angles(torch.arange(3), 5, 10000.0)
