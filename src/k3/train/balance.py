"""Quantile Balancing: the training-time update of the router biases (§7).

Every MoE router adds a bias b (`MoEGate.e_score_correction_bias`) to its sigmoid scores for expert selection
only (§6.3). `QuantileBalancer` re-solves b once per optimiser step so that every expert receives
Mk/E of the step's M counted tokens (§7.1–§7.3), or applies one of the alternatives of §7.4.

Use in a training step (§7.6)::

    balancer = QuantileBalancer(model)                # observes every MoEGate of the model (k3.model.observer)
    for input_ids, attention_mask, labels in micro_batches:
        balancer.set_token_mask(attention_mask)       # padding (0) is routed but not counted (§6.7)
        model(input_ids, labels=labels, attention_mask=attention_mask).loss.backward()
    optimizer.step()
    metrics = balancer.step()                         # solve, centre, install b for the next step

The forwards of step t route with the bias installed by step t−1 and only accumulate statistics; `step()`
installs the new bias afterwards, so the bias routing a batch never depends on that batch (§7.2). The balancer
is a `ForwardObserver`: the model reports routing only in training mode (evaluation forwards do not count) and
never during an activation-checkpointing recomputation, so each token counts once per step (§7.2).

Shape suffixes (`x_BTD`): the package-wide legend at the top of docs/architecture.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from k3.model.moe import MoEGate
from k3.model.observer import ForwardObserver, attach, detach

METHODS = ("qb", "qb_exact", "sign", "none")


@dataclass
class LayerBalanceMetrics:
    """Spec §7.5 metrics of one MoE layer for one step (global batch: all micro-batches and ranks)."""

    tokens: int  # M: counted (non-padding) tokens
    max_vio: float  # max_j load_j / (Mk/E) − 1 of the step's routing, i.e. with the bias that was used
    bias_range: float  # max b − min b of the bias installed by this step
    out_of_range: float  # fraction of the M·E margins outside [lo, hi] (qb, qb_exact; NaN otherwise)
    clamped_experts: int  # qb: experts whose quantile fell in an overflow bucket, θ clamped to lo / hi


def margin_histogram(margin_NE: torch.Tensor, n_bins: int, lo: float, hi: float) -> torch.Tensor:
    """Per-expert counts of the margins, int64 [E, B] with B = n_bins + 2 (§7.3).

    Column 0 counts margins below `lo`, columns 1..n_bins the equal-width bins of [lo, hi), the last column
    margins at or above `hi`.
    """
    E = margin_NE.shape[1]
    bucket_NE = ((margin_NE - lo) * (n_bins / (hi - lo))).floor().clamp(-1, n_bins).long() + 1
    flat_NE = bucket_NE + (n_bins + 2) * torch.arange(E, device=margin_NE.device)
    return torch.bincount(flat_NE.flatten(), minlength=E * (n_bins + 2)).view(E, n_bins + 2)


def histogram_quantile(hist_Ei: torch.Tensor, R: float, lo: float,
                       hi: float) -> tuple[torch.Tensor, torch.Tensor]:
    """θ_j such that R margins of expert j lie above it, from `margin_histogram` counts (§7.3).

    Walks the buckets from the top (above-`hi` overflow first) to the first one where the count from above
    reaches R > 0 and interpolates linearly inside that bin: θ = e_hi − (R − count_above) / count · width
    (error ≤ one bin width). If R is reached in an overflow bucket, the quantile lies outside [lo, hi]: θ is
    clamped to the range edge (`hi` or `lo`) and the expert is flagged. Returns (θ float64 [E], clamped bool
    [E]).
    """
    n_bins = hist_Ei.shape[1] - 2
    width = (hi - lo) / n_bins
    desc_Ei = hist_Ei.flip(-1).double()  # above hi, bins from the top down, below lo
    cum_Ei = desc_Ei.cumsum(-1)
    pos_E1 = (cum_Ei < R).sum(-1, keepdim=True)  # first bucket where the count from above reaches R
    count_E = desc_Ei.gather(-1, pos_E1).squeeze(-1)
    above_E = cum_Ei.gather(-1, pos_E1).squeeze(-1) - count_E
    pos_E = pos_E1.squeeze(-1)
    bin_hi_E = lo + (n_bins + 1 - pos_E).double() * width  # upper edge of bin (n_bins − pos), 0-based
    theta_E = bin_hi_E - (R - above_E) / count_E * width
    theta_E = torch.where(pos_E == 0, hi, torch.where(pos_E == n_bins + 1, lo, theta_E))
    return theta_E, (pos_E == 0) | (pos_E == n_bins + 1)


def exact_quantile(margin_NE: torch.Tensor, k: int) -> torch.Tensor:
    """θ_j = the (⌊Nk/E⌋ + 1)-th largest margin of expert j (§7.3 exact mode), float64 [E]."""
    N, E = margin_NE.shape
    return margin_NE.topk(N * k // E + 1, dim=0).values[-1].double()


class _GateStats:
    """What one gate accumulates during the forwards of a step (transient: zero at step start, §7.3)."""

    def __init__(self, name: str, gate: MoEGate):
        self.name, self.gate = name, gate
        self.load_E: torch.Tensor | None = None  # int64: counted tokens routed to each expert
        self.hist_Ei: torch.Tensor | None = None  # qb: `margin_histogram` counts
        self.margins: list[torch.Tensor] = []  # qb_exact: the raw margins [N_i, E] of each forward

    def reset(self) -> None:
        self.load_E, self.hist_Ei, self.margins = None, None, []


class QuantileBalancer(ForwardObserver):
    """Router-bias load balancing for every `MoEGate` of a model (§7; `balancer ∈ {qb, qb_exact, sign,
    none}` of §7.4).

    * `qb` (default): per-expert margin histograms over [lo, hi] with `n_bins` bins plus two overflow
      counters, SUM all-reduced over `group` (data- and context-parallel ranks; one collective for all
      layers), quantile by linear interpolation (§7.3).
    * `qb_exact`: keeps the raw margins (M × E floats per layer: tests and small runs), exact quantiles;
      single process only (raises in `step()` when the group has more than one rank).
    * `sign`: DeepSeek-V3 rule b_j += sign_step · sign(Mk/E − load_j) (§7.4), not centred.
    * `none`: the bias is never changed; loads and MaxVio are still reported.

    The balancer itself holds no state that must survive a resume: the biases are model buffers (in the
    model's state dict) and the statistics are transient (§7.3). `state_dict()` is therefore empty.
    """

    def __init__(self, model: nn.Module, method: str = "qb", n_bins: int = 1024, lo: float = -2.0,
                 hi: float = 2.0, sign_step: float = 1e-3, group: dist.ProcessGroup | None = None):
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        if not (n_bins > 0 and lo < hi):
            raise ValueError(f"need n_bins > 0 and lo < hi, got n_bins={n_bins}, lo={lo}, hi={hi}")
        self.method, self.n_bins, self.lo, self.hi, self.sign_step = method, n_bins, lo, hi, sign_step
        self.group = group
        self.layers = [_GateStats(name, m) for name, m in model.named_modules() if isinstance(m, MoEGate)]
        if not self.layers:
            raise ValueError("the model has no MoEGate to balance")
        for layer in self.layers:
            cfg, bias = layer.gate.config, layer.gate.e_score_correction_bias
            if cfg.num_experts_per_token >= cfg.num_experts:
                raise ValueError(f"{layer.name}: balancing needs k < E (k={cfg.num_experts_per_token}, "
                                 f"E={cfg.num_experts})")
            assert not bias.requires_grad, "the router bias must never receive gradients (§6.3)"
        self._by_gate = {id(layer.gate): layer for layer in self.layers}
        self._hosts = attach(self, model)
        self._mask_N: torch.Tensor | None = None
        self.metrics: dict[str, LayerBalanceMetrics] = {}  # those of the last `step()`

    # ------------------------------------------------------------------------------------ forwards
    def set_token_mask(self, mask: torch.Tensor | None) -> None:
        """Mark which tokens of the following forwards are counted (§6.7, §7.2).

        `mask` is [B, T] (e.g. the `attention_mask`) or [N]: nonzero / True = real token, 0 / False = padding.
        A MoE layer sees its input [B, T, D] flattened to N = B·T rows in that order. The mask holds for every
        forward until it is replaced; None (the default) counts every token.
        """
        self._mask_N = None if mask is None else mask.reshape(-1).bool()

    def on_routing(self, gate: nn.Module, scores_NE: torch.Tensor, choice_NE: torch.Tensor,
                   idx_Nk: torch.Tensor) -> None:
        """`ForwardObserver` entry: a training forward of one of this balancer's gates routed N tokens."""
        layer = self._by_gate.get(id(gate))
        if layer is not None:
            self._accumulate(layer, scores_NE, choice_NE, idx_Nk)

    @torch.no_grad()
    def _accumulate(self, layer: _GateStats, scores_NE: torch.Tensor, choice_NE: torch.Tensor,
                    idx_Nk: torch.Tensor) -> None:
        """Spec §7.2 steps 1–2 for one forward: loads of the routing, α_i = (k+1)-th largest of s_i + b,
        margins μ_ij = s_ij − α_i for all experts, added to the step's statistics (counted tokens only)."""
        N, E = scores_NE.shape
        if self._mask_N is not None:
            if self._mask_N.numel() != N:
                raise ValueError(f"token mask has {self._mask_N.numel()} entries but {layer.name} routes {N} "
                                 "tokens; call set_token_mask before each micro-batch")
            keep_N = self._mask_N.to(scores_NE.device)
            scores_NE, choice_NE, idx_Nk = scores_NE[keep_N], choice_NE[keep_N], idx_Nk[keep_N]
        load_E = torch.bincount(idx_Nk.flatten(), minlength=E)
        layer.load_E = load_E if layer.load_E is None else layer.load_E + load_E
        if self.method not in ("qb", "qb_exact"):
            return
        k = idx_Nk.shape[1]
        alpha_N1 = choice_NE.topk(k + 1, dim=-1).values[:, -1:]
        margin_NE = scores_NE - alpha_N1
        if self.method == "qb_exact":
            layer.margins.append(margin_NE)
            return
        hist_Ei = margin_histogram(margin_NE, self.n_bins, self.lo, self.hi)
        layer.hist_Ei = hist_Ei if layer.hist_Ei is None else layer.hist_Ei + hist_Ei

    # ---------------------------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self) -> dict[str, LayerBalanceMetrics]:
        """Solve, centre and install the new biases from this step's statistics; call after the optimiser step
        (§7.6). Returns the §7.5 metrics per gate (module name), also kept in `self.metrics`.

        A layer that counted no token keeps its bias (its metrics are NaN). The statistics are reset.
        """
        self._all_reduce()
        self.metrics = {}
        for layer in self.layers:
            M, max_vio, bias_range, out_of_range, clamped = (float(v) for v in self._update(layer))
            self.metrics[layer.name] = LayerBalanceMetrics(int(M), max_vio, bias_range, out_of_range, int(clamped))
            layer.reset()
        return self.metrics

    def _fill_missing(self, layer: _GateStats) -> None:
        """A layer that saw no forward on this rank still takes part in the collective with zero counts."""
        E, device = layer.gate.config.num_experts, layer.gate.e_score_correction_bias.device
        if layer.load_E is None:
            layer.load_E = torch.zeros(E, dtype=torch.long, device=device)
        if self.method == "qb" and layer.hist_Ei is None:
            layer.hist_Ei = torch.zeros(E, self.n_bins + 2, dtype=torch.long, device=device)

    def _all_reduce(self) -> None:
        """SUM the loads (and qb histograms) of all layers over the ranks in one collective (§7.3)."""
        for layer in self.layers:
            self._fill_missing(layer)
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(self.group) == 1:
            return
        if self.method == "qb_exact":
            raise RuntimeError("qb_exact supports a single process only; use method='qb' for distributed runs")
        parts = [t for layer in self.layers for t in (layer.load_E, layer.hist_Ei) if t is not None]
        flat = torch.cat([t.flatten() for t in parts])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
        for t, reduced in zip(parts, flat.split([t.numel() for t in parts])):
            t.copy_(reduced.view_as(t))

    def _update(self, layer: _GateStats) -> list:
        """Install the new bias of one layer (in place); returns its metrics [M, MaxVio, range, out, clamped]."""
        bias_E = layer.gate.e_score_correction_bias
        E, k = layer.gate.config.num_experts, layer.gate.config.num_experts_per_token
        M = int(layer.load_E.sum()) // k  # every counted token is routed to exactly k experts
        nan = float("nan")
        if M == 0:
            return [0, nan, nan, nan, 0]
        mean_load = M * k / E  # = R, the number of margins above θ_j (§7.2 step 3)
        max_vio = layer.load_E.max() / mean_load - 1
        out_of_range, clamped = nan, 0
        if self.method == "qb":
            theta_E, clamped_E = histogram_quantile(layer.hist_Ei, mean_load, self.lo, self.hi)
            clamped = clamped_E.sum()
            out_of_range = (layer.hist_Ei[:, 0] + layer.hist_Ei[:, -1]).sum() / (M * E)
        elif self.method == "qb_exact":
            margin_NE = torch.cat(layer.margins)
            theta_E = exact_quantile(margin_NE, k)
            out_of_range = ((margin_NE < self.lo) | (margin_NE >= self.hi)).sum() / (M * E)
        if self.method in ("qb", "qb_exact"):
            b_hat_E = -theta_E
            bias_E.copy_(b_hat_E - b_hat_E.mean())  # a common shift changes no top-k (§7.2 step 4)
        elif self.method == "sign":
            bias_E.add_(self.sign_step * torch.sign(mean_load - layer.load_E))
        bias_range = bias_E.max() - bias_E.min()
        return [M, max_vio, bias_range, out_of_range, clamped]

    # ----------------------------------------------------------------------------------- lifecycle
    def state_dict(self) -> dict:
        """Empty: the biases live in the model's state dict and the statistics are transient (§7.3)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Accepts the (empty) `state_dict()`; on resume the step's statistics start from zero."""
        if state:
            raise ValueError(f"QuantileBalancer has no persistent state, got keys {sorted(state)}")
        for layer in self.layers:
            layer.reset()

    def detach(self) -> None:
        """Stop observing the model (it is back to a pure forward) and drop the statistics."""
        detach(self, self._hosts)
        for layer in self.layers:
            layer.reset()
        self.layers, self._by_gate, self._hosts = [], {}, []
