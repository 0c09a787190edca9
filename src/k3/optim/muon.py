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

Sharded parameters (DTensors, e.g. FSDP2's Shard(0) or expert parallelism's Shard(0) of [E, F, L]) give the same
result as one process holding the whole tensors. Momentum, Nesterov, weight decay and the step are elementwise
and run on each rank's local shard. Newton–Schulz needs whole blocks, so each DTensor parameter takes one of
three routes (chosen from its placements, identically on every rank):

* local — every shard holds whole blocks: only batch axes are sharded (experts split on the expert axis), or
  the rows (cols) of a per-head view are split at head boundaries (ceil(rows / W) a multiple of one head's
  block rows). Orthogonalised where it lies; no communication.
* owner — exactly one mesh dimension splits the matrix axes with a plain Shard (FSDP2 rows that cut through
  heads or whole matrices). Every such parameter gets an owner among the ranks of that mesh dimension (greedy
  by size in parameter order, least-loaded rank first, so every rank agrees); the ranks `gather` their local
  U shards (padded to ceil(n / W) along the split axis, as gloo needs equal sizes) to the owner, which
  assembles U, orthogonalises it once and `scatter`s each rank its shard of the update. Bytes per step, for a
  parameter of n elements in the momentum dtype (b bytes each, 4 for fp32) split W ways: every other rank
  sends its padded shard (ceil(rows / W) rows, ≈ n·b/W) and receives as much back; the owner receives and
  sends W − 1 such shards (≈ (W − 1)/W · n·b each way); in all ≈ 2·(W − 1)/W · n·b cross the network. With
  ownership balanced by size, a rank moves about 2·Σn·b/W each way per step (its own shards plus the matrices
  it owns), about 2/W of what one FSDP all-gather of the same parameters costs it. Example (k3-full,
  W = 1,024, KDA `q_proj` [12288, 7168] in fp32, 12 rows per rank against 128-row heads): 344 KB from and to
  each rank, 352 MB into and out of its owner. Gathers are all issued before the first owner computes and each
  scatter as soon as its owner is done, so communication overlaps NS; the padded send / receive buffers and
  the owner's full U and update are the extra memory.
* full (fallback, for other layouts, e.g. two mesh dimensions splitting the matrix axes): `full_tensor()` on
  every rank (an all-gather, (W − 1)/W · n · b received per rank), NS on every rank, then the local slice.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

if dist.is_available():
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
else:  # a torch build without distributed support: no parameter can be a DTensor
    DTensor = ()

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
    return orthogonalized_updates([U], split, split_sizes, adjust_lr, **ns_options)[0]


def orthogonalized_updates(Us: list[torch.Tensor], split: str = "none", split_sizes: Iterable[int] = (),
                           adjust_lr: str = "match_rms_adamw", **ns_options: Any) -> list[torch.Tensor]:
    """`orthogonalized_update` of several tensors with one block view: the blocks of one shape, from all of them,
    go through one batched Newton–Schulz call (a few large matmuls instead of many small ones; every block is
    still normalised, iterated and scaled on its own)."""
    outs = [torch.empty_like(U, memory_format=torch.contiguous_format) for U in Us]  # block views are views
    by_shape: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for U, O in zip(Us, outs):
        for U_blk, O_blk in zip(block_views(U, split, split_sizes), block_views(O, split, split_sizes)):
            by_shape.setdefault(tuple(U_blk.shape[-2:]), []).append((U_blk, O_blk))
    for (A, B), blocks in by_shape.items():
        U_Xab = torch.cat([U_blk.reshape(-1, A, B) for U_blk, _ in blocks])
        O_Xab = update_scale(A, B, adjust_lr) * newton_schulz5(U_Xab, **ns_options)
        for (_, O_blk), O_piece in zip(blocks, O_Xab.split([O_blk[..., 0, 0].numel() for _, O_blk in blocks])):
            O_blk.copy_(O_piece.view(O_blk.shape))
    return outs


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
        """One Muon step for every parameter with a gradient (§8.2); DTensor parameters as in the module
        docstring (every rank of their meshes must call it)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        exchange = _OwnerExchange()
        for group in self.param_groups:
            lr, mu = group["lr"], group["momentum"]
            local = []  # (W, U) of the group's plain tensors: orthogonalised together, one batch per block shape
            for W in group["params"]:
                if W.grad is None:
                    continue
                state = self.state[W]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(
                        W, dtype=torch.promote_types(W.dtype, torch.float32), memory_format=torch.contiguous_format)
                M = state["momentum_buffer"]
                if isinstance(W, DTensor):
                    _sharded_step(W, M, group, exchange)
                    continue
                G = W.grad.to(M.dtype)
                M.mul_(mu).add_(G)
                local.append((W, G.add(M, alpha=mu) if group["nesterov"] else M))
            updates = orthogonalized_updates([U for _, U in local], group["split"], group["split_sizes"],
                                             group["adjust_lr"], **_ns_options(group))
            for (W, _), O in zip(local, updates):
                W.mul_(1 - lr * group["weight_decay"])
                W.add_(O.to(W.dtype), alpha=-lr)
        exchange.finish()
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


# ---------------------------------------------------------------------------------------- sharded parameters
def _ns_options(group: dict[str, Any]) -> dict[str, Any]:
    return dict(steps=group["ns_steps"], eps=group["eps"], coefficients=group["ns_coefficients"],
                ns_dtype=group["ns_dtype"])


def _group_update(U: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
    """`orthogonalized_update` with the group's options; an empty shard (a rank holding no rows) stays empty."""
    if U.numel() == 0:
        return torch.zeros_like(U)
    return orthogonalized_update(U, group["split"], group["split_sizes"], group["adjust_lr"], **_ns_options(group))


def _chunk_sizes(n: int, shards: int) -> list[int]:
    """Lengths of the `shards` pieces DTensor's Shard (and FSDP2) cut an axis of length n into: ceil(n / shards)
    each, the last ones shorter or empty."""
    c = -(-n // shards)
    return [max(0, min(c, n - k * c)) for k in range(shards)]


def _sharded_layout(W: DTensor, split: str, split_sizes: Iterable[int]) -> tuple[str, int | None, int | None]:
    """(route, mesh dim, tensor dim) of a DTensor parameter (module docstring): ("local", None, None),
    ("owner", mesh dim that splits the matrix, the tensor axis it splits) or ("full", None, None)."""
    ndim, mesh = W.ndim, W.device_mesh
    sharded = []  # (mesh dim, tensor axis, plain Shard?)
    for mesh_dim, placement in enumerate(W.placements):
        if placement.is_replicate():
            continue
        if placement.is_partial():
            raise ValueError(f"Muon cannot update a parameter with a Partial placement ({W.placements})")
        sharded.append((mesh_dim, placement.dim % ndim, type(placement) is Shard))
    splits_of = {d: sum(1 for _, a, _ in sharded if a == d) for _, d, _ in sharded}
    block_axis = {"rows": ndim - 2, "cols": ndim - 1}.get(split)
    block = sum(split_sizes) if block_axis is not None else 0
    cut = []  # mesh dims whose shards may cut through a block
    for mesh_dim, d, plain in sharded:
        if d < ndim - 2:
            continue  # a batch axis (experts): whole matrices
        if (d == block_axis and plain and splits_of[d] == 1
                and _chunk_sizes(W.shape[d], mesh.size(mesh_dim))[0] % block == 0):
            continue  # every shard is whole heads (the last one too: W.shape[d] is a multiple of the block)
        cut.append((mesh_dim, d, plain))
    if not cut:
        return "local", None, None
    if len(cut) == 1 and cut[0][2] and splits_of[cut[0][1]] == 1:
        return "owner", cut[0][0], cut[0][1]
    return "full", None, None


def _sharded_step(W: DTensor, M: DTensor, group: dict[str, Any], exchange: _OwnerExchange) -> None:
    """Muon step of one DTensor parameter: elementwise parts on the local shard, NS by the parameter's route."""
    mesh = W.device_mesh
    if mesh.get_coordinate() is None:
        return  # this rank is outside the parameter's mesh and holds none of it
    G = W.grad
    if not isinstance(G, DTensor) or not isinstance(M, DTensor):
        raise TypeError("a DTensor parameter needs a DTensor gradient and momentum buffer")
    if G.device_mesh != mesh or tuple(G.placements) != tuple(W.placements):
        G = G.redistribute(mesh, W.placements)
    if M.device_mesh != mesh or tuple(M.placements) != tuple(W.placements):
        raise ValueError(f"momentum buffer placements {M.placements} differ from the parameter's {W.placements}")
    lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
    M_loc = M.to_local()  # no_grad: the buffer's own storage, updated in place
    G_loc = G.to_local().to(M_loc.dtype)
    M_loc.mul_(mu).add_(G_loc)
    U_loc = G_loc.add(M_loc, alpha=mu) if group["nesterov"] else M_loc
    W_loc = W.to_local()

    def apply(O_loc: torch.Tensor) -> None:
        W_loc.mul_(1 - lr * wd)
        W_loc.add_(O_loc.to(W_loc.dtype), alpha=-lr)

    route, mesh_dim, axis = _sharded_layout(W, group["split"], group["split_sizes"])
    if route == "local":
        apply(_group_update(U_loc, group))
    elif route == "owner":
        exchange.add(W, U_loc, mesh_dim, axis, group, apply)
    else:
        U = DTensor.from_local(U_loc, mesh, W.placements, shape=W.shape, stride=W.stride()).full_tensor()
        O = _group_update(U, group)
        apply(distribute_tensor(O, mesh, W.placements, src_data_rank=None).to_local())  # local slice, no comm


class _OwnerExchange:
    """The owner route of one `Muon.step` (module docstring): `add` starts the gather of a parameter's U to its
    owner; `finish` orthogonalises the owned ones, scatters the updates back and applies them."""

    def __init__(self) -> None:
        self._loads: dict[tuple[int, ...], list[int]] = {}  # per line of ranks: numel owned so far
        self._items: list[dict[str, Any]] = []

    def add(self, W: DTensor, U_loc: torch.Tensor, mesh_dim: int, axis: int, group: dict[str, Any],
            apply: Callable[[torch.Tensor], None]) -> None:
        mesh = W.device_mesh
        coordinate = mesh.get_coordinate()
        index = list(coordinate)
        index[mesh_dim] = slice(None)
        line = tuple(mesh.mesh[tuple(index)].tolist())  # global ranks holding the pieces, in shard order
        pg = mesh.get_group(mesh_dim)
        pg_ranks = dist.get_process_group_ranks(pg)
        group_rank = [pg_ranks.index(r) for r in line]  # shard k's holder as a rank of `pg`
        loads = self._loads.setdefault(line, [0] * len(line))
        owner = min(range(len(line)), key=loads.__getitem__)  # least loaded, lowest on ties: same on all ranks
        loads[owner] += W.numel()
        sizes = _chunk_sizes(W.shape[axis], len(line))
        me = coordinate[mesh_dim]
        if U_loc.shape[axis] != sizes[me]:
            raise RuntimeError(f"local shard has {U_loc.shape[axis]} entries on axis {axis}, expected {sizes[me]}")
        send = _padded(U_loc, axis, sizes[0])
        pieces = [torch.empty_like(send) for _ in line] if me == owner else None
        work = dist.gather(send, pieces, group=pg, group_dst=group_rank[owner], async_op=True)
        self._items.append(dict(W=W, axis=axis, group=group, apply=apply, pg=pg, group_rank=group_rank,
                                owner=owner, me=me, sizes=sizes, send=send, pieces=pieces, work=work))

    def finish(self) -> None:
        for item in self._items:
            item["work"].wait()
            axis, sizes, group_rank = item["axis"], item["sizes"], item["group_rank"]
            chunks = None
            if item["me"] == item["owner"]:
                U = torch.cat([item["pieces"][group_rank[k]].narrow(axis, 0, s) for k, s in enumerate(sizes)],
                              dim=axis)
                O = _group_update(U, item["group"])
                chunks = [None] * len(sizes)
                for k, piece in enumerate(O.split(sizes, dim=axis)):
                    chunks[group_rank[k]] = _padded(piece, axis, sizes[0])
            item["out"] = torch.empty_like(item["send"])
            item["work"] = dist.scatter(item["out"], chunks, group=item["pg"],
                                        group_src=group_rank[item["owner"]], async_op=True)
            item["pieces"] = item["send"] = None
        for item in self._items:
            item["work"].wait()
            item["apply"](item["out"].narrow(item["axis"], 0, item["sizes"][item["me"]]))
        self._items = []


def _padded(X: torch.Tensor, axis: int, length: int) -> torch.Tensor:
    """A contiguous copy of X extended with zeros to `length` along `axis`."""
    shape = list(X.shape)
    shape[axis] = length
    out = X.new_zeros(shape)
    out.narrow(axis, 0, X.shape[axis]).copy_(X)
    return out
