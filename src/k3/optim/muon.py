"""Muon with per-block orthogonalisation: NS5, Per-Head / per-expert block views, RMS-matched scale (§8.2–§8.4).

Shape suffixes (`x_BTD`): the package-wide legend at the top of docs/architecture.md.

A parameter's *block view* says which independent matrices it is made of; each is orthogonalised and scaled on
its own. Every axis before the last two is a batch axis (routed experts [E, A, B] → E matrices), and the last
two axes are split by the group options `split` and `split_sizes`:

* `split="none"`: the whole [A, B] matrix;
* `split="rows"`: [H·P, B] with P = sum(split_sizes) → per head, one block [s, B] per size s (KDA `q_proj` with
  sizes (128,) → 96 × [128, B]; MLA `kv_b_proj` with sizes (N, Vh) → a K block [N, C] and a V block [Vh, C]
  per head);
* `split="cols"`: [A, H·P] → per head, one block [A, s] per size s (`o_proj` with sizes (128,)).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

NS5_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # §8.3 (a, b, c)
SPLITS = ("none", "rows", "cols")
ADJUST_LR = ("match_rms_adamw", "original")


def newton_schulz5(U: torch.Tensor, steps: int = 5, eps: float = 1e-7,
                   coefficients: tuple[float, float, float] = NS5_COEFFICIENTS,
                   ns_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Approximate orthogonal polar factor of every matrix of U [..., A, B] (§8.3), batched.

    Each matrix is transposed to its wide orientation if A > B, divided by (its own Frobenius norm + eps) in
    U's precision, then iterated `steps` times in `ns_dtype` (bf16 as in §8.3; fp32 in reference mode):
    G₂ = X Xᵀ, X ← a·X + (b·G₂ + c·G₂G₂)·X. Returns U's shape and dtype; singular values end up roughly in
    [0.5, 1.5], not at 1.
    """
    a, b, c = coefficients
    A, B = U.shape[-2:]
    X_Xmn = U.reshape(-1, A, B)
    if A > B:
        X_Xmn = X_Xmn.mT
    X_Xmn = X_Xmn / (torch.linalg.matrix_norm(X_Xmn, keepdim=True) + eps)
    X_Xmn = X_Xmn.to(ns_dtype)
    for _ in range(steps):
        G2_Xmm = X_Xmn @ X_Xmn.mT
        Y_Xmm = torch.baddbmm(G2_Xmm, G2_Xmm, G2_Xmm, beta=b, alpha=c)
        X_Xmn = torch.baddbmm(X_Xmn, Y_Xmm, X_Xmn, beta=a)
    if A > B:
        X_Xmn = X_Xmn.mT
    return X_Xmn.reshape(U.shape).to(U.dtype)


def update_scale(rows: int, cols: int, adjust_lr: str = "match_rms_adamw") -> float:
    """Step multiplier of one orthogonalised block (§8.2 step 4).

    "match_rms_adamw" (Moonlight RMS matching, default): 0.2·sqrt(max(A, B)), update RMS ≈ 0.2 like AdamW;
    "original" (K. Jordan's Muon): sqrt(max(1, A/B)).
    """
    if adjust_lr == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if adjust_lr == "original":
        return math.sqrt(max(1.0, rows / cols))
    raise ValueError(f"adjust_lr must be one of {ADJUST_LR}, got {adjust_lr!r}")


def block_views(X: torch.Tensor, split: str = "none", split_sizes: Iterable[int] = ()) -> list[torch.Tensor]:
    """Views of X's independent matrices, one batched view [..., A', B'] per block shape (§8.4).

    "rows": X [..., H·P, B] → for each size s of `split_sizes`, the view [..., H, s, B] of every head's s-row
    block; "cols": X [..., A, H·P] → [..., H, A, s]. Equal sizes form a single batch (sizes (128, 128) are
    2H blocks of 128). Writing into the views writes into X.
    """
    if split == "none":
        return [X]
    sizes = tuple(split_sizes)
    if len(set(sizes)) == 1:
        sizes = sizes[:1]
    P = sum(sizes)
    if split == "rows":
        return list(X.unflatten(-2, (-1, P)).split(sizes, dim=-2))
    if split == "cols":
        return [x_mHd.movedim(-2, -3) for x_mHd in X.unflatten(-1, (-1, P)).split(sizes, dim=-1)]
    raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


def orthogonalized_update(U: torch.Tensor, split: str = "none", split_sizes: Iterable[int] = (),
                          adjust_lr: str = "match_rms_adamw", **ns_options: Any) -> torch.Tensor:
    """scale(block) · NS5(U_block) for every block of U's view, assembled in U's layout (§8.2–§8.4).

    Each block is normalised by its own Frobenius norm and scaled by its own shape. `ns_options` go to
    `newton_schulz5` (steps, eps, coefficients, ns_dtype).
    """
    O = torch.empty_like(U, memory_format=torch.contiguous_format)  # its block views are views, not copies
    for U_blk, O_blk in zip(block_views(U, split, split_sizes), block_views(O, split, split_sizes)):
        O_blk.copy_(update_scale(*U_blk.shape[-2:], adjust_lr) * newton_schulz5(U_blk, **ns_options))
    return O


class Muon(torch.optim.Optimizer):
    """Muon with momentum, Nesterov, NS5 per block, RMS-matched scale and decoupled weight decay (§8.2).

    Per parameter W with gradient G, in the group's block view (module docstring):

        M ← μ·M + G                      (fp32 buffer, or the parameter's dtype if wider)
        U = G + μ·M  (nesterov; else U = M)
        O = scale(block) · NS5(U_block) for every block
        W ← W·(1 − lr·λ);  W ← W − lr·O

    Group options: lr, weight_decay (λ, default 0.1), momentum (μ, 0.95), nesterov (True), ns_steps (5),
    ns_coefficients, eps (NS normalisation, 1e-7), ns_dtype (bf16; fp32 in reference mode), adjust_lr
    ("match_rms_adamw" | "original"), split ("none" | "rows" | "cols"), split_sizes (one head's block sizes).

    Relation to `torch.optim.Muon` (same update up to two details, both invisible for ‖U‖_F ≫ eps): its momentum
    buffer is an EMA, M' ← μ·M' + (1 − μ)·G, so its U is (1 − μ) times ours, which the NS normalisation
    cancels; and it divides by max(‖U‖_F, eps) instead of ‖U‖_F + eps. It also always runs NS in bf16.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_steps: int = 5,
                 ns_coefficients: tuple[float, float, float] = NS5_COEFFICIENTS, eps: float = 1e-7,
                 ns_dtype: torch.dtype = torch.bfloat16, adjust_lr: str = "match_rms_adamw",
                 split: str = "none", split_sizes: tuple[int, ...] = ()):
        if lr < 0 or weight_decay < 0 or not 0 <= momentum < 1:
            raise ValueError(f"need lr >= 0, weight_decay >= 0, 0 <= momentum < 1; got {lr}, {weight_decay}, "
                             f"{momentum}")
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                        ns_coefficients=ns_coefficients, eps=eps, ns_dtype=ns_dtype, adjust_lr=adjust_lr,
                        split=split, split_sizes=split_sizes)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; a group whose block view does not fit one of its parameters is rejected."""
        super().add_param_group(param_group)
        try:
            _check_group(self.param_groups[-1])
        except ValueError:
            self.param_groups.pop()
            raise

    @torch.no_grad()
    def step(self, closure=None):
        """One Muon step for every parameter with a gradient (§8.2)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, mu = group["lr"], group["momentum"]
            for W in group["params"]:
                if W.grad is None:
                    continue
                state = self.state[W]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(
                        W, dtype=torch.promote_types(W.dtype, torch.float32), memory_format=torch.contiguous_format)
                M = state["momentum_buffer"]
                G = W.grad.to(M.dtype)
                M.mul_(mu).add_(G)
                U = G.add(M, alpha=mu) if group["nesterov"] else M
                O = orthogonalized_update(U, group["split"], group["split_sizes"], group["adjust_lr"],
                                          steps=group["ns_steps"], eps=group["eps"],
                                          coefficients=group["ns_coefficients"], ns_dtype=group["ns_dtype"])
                W.mul_(1 - lr * group["weight_decay"])
                W.add_(O.to(W.dtype), alpha=-lr)
        return loss


def _check_group(group: dict[str, Any]) -> None:
    """Valid options, and every parameter a matrix (or batch of them) whose split axis fits the view."""
    split, sizes = group["split"], tuple(group["split_sizes"])
    if group["adjust_lr"] not in ADJUST_LR:
        raise ValueError(f"adjust_lr must be one of {ADJUST_LR}, got {group['adjust_lr']!r}")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if split != "none" and not (sizes and all(isinstance(s, int) and s > 0 for s in sizes)):
        raise ValueError(f"split={split!r} needs positive integer split_sizes, got {sizes!r}")
    axis = {"none": None, "rows": -2, "cols": -1}[split]
    names = group.get("param_names", [f"#{i}" for i in range(len(group["params"]))])
    for name, W in zip(names, group["params"]):
        if W.ndim < 2:
            raise ValueError(f"Muon needs matrices (or batches of them); {name} has shape {tuple(W.shape)}")
        if axis is not None and W.shape[axis] % sum(sizes):
            raise ValueError(f"{name} of shape {tuple(W.shape)}: {split} are not a multiple of "
                             f"sum(split_sizes) = {sum(sizes)}")
