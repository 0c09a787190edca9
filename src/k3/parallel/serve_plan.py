"""Analytic memory plan for serving K3 (`k3 plan --serve`, docs/architecture.md §2.4).

`serve_plan(config, experts=..., context=..., batch=..., gpus=..., gpu_memory_gib=... | host_memory_gib=...)`
returns a `ServePlan` (exact bytes); `format_serve_plan` prints it, `ServePlan.to_dict` gives JSON. Every number
comes from `k3.model.accounting`: `weight_bytes` (the weights of each component, the routed experts in MXFP4 or
bf16) and `cache_sizes` (MLA latent cache, KDA state and conv windows of one sequence).

Layout modelled on a mesh of N GPUs: the routed experts by expert parallelism, whole experts, so the fullest GPU
holds ceil(E / N) experts of every MoE layer; every other weight (attention, embeddings, shared experts, dense FFN,
router, vision) and the caches of the batch split evenly, ceil(bytes / N) per GPU (tensor or sequence
parallelism). Nothing is replicated, so this is the least any layout needs per GPU; replicating the non-expert
weights puts all of them on every GPU. A host holds everything in one memory. `fits`: the device's bytes ≤
USABLE_FRACTION (0.9) × its memory in GiB; the rest is left to activations, workspaces and the runtime, which are
not modelled.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from k3.config import K3Config
from k3.model.accounting import (CONTEXTS, VISION_COMPONENTS, cache_sizes, count_parameters, human, meta_model,
                                 prefill_flops, weight_bytes)
from k3.parallel.plan import (GIB, USABLE_FRACTION, require_positive_gib, require_positive_int,
                              require_usable_fraction)

DEFAULT_CONTEXT = CONTEXTS["1M"]
GB = 10**9


@dataclass(frozen=True)
class ServePlan:
    """Bytes of serving `batch` sequences of `context` tokens: weights, caches, and one device's share of them."""

    experts: str  # "mxfp4" | "bf16"
    context: int  # tokens per sequence
    batch: int  # sequences
    weight_bytes: dict[str, int]  # per accounting component, text and vision
    routed_experts: int  # experts over all MoE layers (moe_layers × experts_per_layer)
    experts_per_layer: int
    expert_bytes: int  # one routed expert (w1, w2, w3)
    cache_bytes: dict[str, int]  # one sequence: "mla_latent", "kda_state", "kda_conv"
    target: str  # "none" | "host" | "mesh"
    devices: int  # GPUs of the mesh; 1 for a host or no target
    memory_gib: float | None  # one device's memory
    usable_fraction: float
    experts_per_device: int  # of each MoE layer, on the fullest device
    device_bytes: dict[str, int]  # the fullest device: "routed_experts", "other_weights", "caches"
    prefill_flops: dict[str, int]  # prefilling one sequence of `context` tokens, by part (accounting.PREFILL_PARTS)

    @property
    def weights(self) -> int:
        """Bytes of all weights."""
        return sum(self.weight_bytes.values())

    @property
    def routed_expert_bytes(self) -> int:
        """Bytes of the routed experts."""
        return self.weight_bytes["routed_experts"]

    @property
    def vision_bytes(self) -> int:
        """Bytes of the vision tower and projector (0 for a text-only model)."""
        return sum(self.weight_bytes[k] for k in VISION_COMPONENTS)

    @property
    def other_text_bytes(self) -> int:
        """Bytes of the text weights other than the routed experts."""
        return self.weights - self.routed_expert_bytes - self.vision_bytes

    @property
    def sequence_cache(self) -> int:
        """Cache bytes of one sequence."""
        return sum(self.cache_bytes.values())

    @property
    def caches(self) -> int:
        """Cache bytes of the batch."""
        return self.batch * self.sequence_cache

    @property
    def total(self) -> int:
        """Bytes of the weights and the batch's caches."""
        return self.weights + self.caches

    @property
    def device_total(self) -> int:
        """Bytes on the fullest device."""
        return sum(self.device_bytes.values())

    @property
    def usable_bytes(self) -> int | None:
        """The usable fraction of one device's memory; None without a target."""
        return None if self.memory_gib is None else int(self.memory_gib * GIB * self.usable_fraction)

    @property
    def fits(self) -> bool | None:
        """Whether the fullest device's bytes fit in its usable memory; None without a target."""
        return None if self.usable_bytes is None else self.device_total <= self.usable_bytes

    def to_dict(self) -> dict[str, Any]:
        """The plan and its derived numbers, JSON-ready."""
        derived = ("weights", "routed_expert_bytes", "vision_bytes", "other_text_bytes", "sequence_cache", "caches",
                   "total", "device_total", "usable_bytes", "fits")
        return {**asdict(self), **{name: getattr(self, name) for name in derived}}


def _ceil_share(total: int, parts: int) -> int:
    """The largest of `parts` even shares of `total`."""
    return -(-total // parts)


def validate_serving(context: int, batch: int, gpus: int | None, gpu_memory_gib: float | None,
                     host_memory_gib: float | None, usable_fraction: float) -> None:
    """Raise ValueError, one line naming the option, for a batch or target that cannot be planned."""
    require_positive_int("context", context)
    require_positive_int("batch", batch)
    require_usable_fraction(usable_fraction)
    if host_memory_gib is not None:
        if gpus is not None or gpu_memory_gib is not None:
            raise ValueError("give either host_memory_gib (one host) or gpus with gpu_memory_gib (a mesh), not both")
        require_positive_gib("host_memory_gib", host_memory_gib)
    elif (gpus is None) != (gpu_memory_gib is None):
        raise ValueError("gpus and gpu_memory_gib go together: the mesh needs both")
    elif gpus is not None:
        require_positive_int("gpus", gpus)
        require_positive_gib("gpu_memory_gib", gpu_memory_gib)


def serve_plan(config: K3Config, experts: str = "mxfp4", context: int = DEFAULT_CONTEXT, batch: int = 1,
               gpus: int | None = None, gpu_memory_gib: float | None = None, host_memory_gib: float | None = None,
               usable_fraction: float = USABLE_FRACTION) -> ServePlan:
    """The memory of serving `config` with its routed experts in `experts` format to `batch` sequences of
    `context` tokens, and what the fullest GPU of a `gpus` mesh or a host holds (layout: module docstring); the
    format is checked by `weight_bytes`."""
    validate_serving(context, batch, gpus, gpu_memory_gib, host_memory_gib, usable_fraction)
    model = meta_model(config)
    sizes = weight_bytes(model, config, experts)
    cache = cache_sizes(config).parts_at(context)
    moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
    routed = moe_layers * config.num_experts
    expert_bytes = sizes["routed_experts"] // routed if routed else 0
    target = "mesh" if gpus is not None else "host" if host_memory_gib is not None else "none"
    devices = gpus if gpus is not None else 1
    per_layer = _ceil_share(config.num_experts, devices)
    other = sum(sizes.values()) - sizes["routed_experts"]
    device = {"routed_experts": per_layer * moe_layers * expert_bytes, "other_weights": _ceil_share(other, devices),
              "caches": _ceil_share(batch * sum(cache.values()), devices)}
    memory = gpu_memory_gib if gpus is not None else host_memory_gib
    return ServePlan(experts=experts, context=context, batch=batch, weight_bytes=sizes, routed_experts=routed,
                     experts_per_layer=config.num_experts, expert_bytes=expert_bytes, cache_bytes=cache,
                     target=target, devices=devices, memory_gib=None if memory is None else float(memory),
                     usable_fraction=float(usable_fraction), experts_per_device=per_layer, device_bytes=device,
                     prefill_flops=prefill_flops(config, count_parameters(model, config), context))


# ------------------------------------------------------------------------------------------------ report
_FORMATS = {"mxfp4": "MXFP4 (4-bit codes, two per uint8, + one uint8 E8M0 scale per 32: 4.25 bits a weight)",
            "bf16": "bf16 (dense, 16 bits a weight)"}


def _row(label: str, n: int, indent: int = 2) -> str:
    """One line of the byte table: label, exact bytes, GB (10⁹ B)."""
    return f"{' ' * indent}{label:<{54 - indent}}{n:>22,}{n / GB:>12,.2f}"


def _target_lines(p: ServePlan) -> list[str]:
    """The target's layout, the fullest device's bytes and the verdict; [] without a target."""
    if p.target == "none":
        return []
    d = p.device_bytes
    if p.target == "host":
        where = [f"host        one host of {p.memory_gib:,.2f} GiB holds every weight and cache"]
    else:
        where = [f"mesh        {p.devices:,} GPUs x {p.memory_gib:,.2f} GiB; routed experts by expert parallelism: "
                 f"{p.experts_per_device} of the {p.experts_per_layer}",
                 "            of each MoE layer on the fullest GPU; every other weight and the caches split evenly "
                 "(nothing",
                 "            replicated: the least any layout needs)"]
    verdict = "yes" if p.fits else "NO"
    return ["", *where,
            f"{'per ' + ('host' if p.target == 'host' else 'GPU'):<12}routed experts {d['routed_experts'] / GB:,.2f} GB"
            f" + other weights {d['other_weights'] / GB:,.2f} GB + caches {d['caches'] / GB:,.2f} GB = "
            f"{p.device_total / GB:,.2f} GB ({p.device_total / GIB:,.2f} GiB)",
            f"usable      {p.usable_fraction:.2f} x {p.memory_gib:,.2f} GiB = {p.usable_bytes / GIB:,.2f} GiB",
            f"fits        {verdict} (headroom {(p.usable_bytes - p.device_total) / GIB:,.2f} GiB)"]


def format_serve_plan(p: ServePlan) -> str:
    """A readable table of `p`: exact bytes and GB (10⁹ B); a target's memory in GiB (2³⁰ B), as given."""
    lines = [f"K3 serving plan: routed experts in {_FORMATS[p.experts]}",
             "  every other weight bf16, the §0.4 fp32 set (KDA A_log, dt_bias, conv, o_norm; router bias) fp32",
             f"{'weights':<54}{'bytes':>22}{'GB':>12}",
             _row(f"routed experts: {p.routed_experts:,} x {p.expert_bytes:,} B", p.routed_expert_bytes),
             _row("other text weights", p.other_text_bytes)]
    if p.vision_bytes:
        lines.append(_row("vision tower + projector", p.vision_bytes))
    c = p.cache_bytes
    lines += [_row("all weights", p.weights),
              f"caches of one sequence at {p.context:,} tokens",
              _row("MLA latent cache (bf16)", c["mla_latent"]),
              _row("KDA recurrent state (fp32, length-independent)", c["kda_state"]),
              _row("KDA short-conv windows (bf16)", c["kda_conv"]),
              _row(f"one sequence ({p.sequence_cache / GIB:,.2f} GiB)", p.sequence_cache),
              _row(f"batch of {p.batch:,} sequence{'s' if p.batch > 1 else ''}", p.caches),
              _row("weights + caches", p.total, indent=0)]
    return "\n".join(lines + _prefill_lines(p) + _target_lines(p))


_PREFILL_LABELS = {"kda": "KDA (projections + chunked core)", "mla_projections": "MLA projections",
                   "mla_attention": "MLA attention (causal pairs)", "moe": "MoE (activated experts, shared, router)",
                   "dense_ffn": "dense FFN (layer 0)", "lm_head": "output head (logits at every position)"}


def _prefill_lines(p: ServePlan) -> list[str]:
    """Forward FLOPs of prefilling one sequence of `p.context` tokens, by part, with each part's share."""
    total = sum(p.prefill_flops.values())
    return [f"{f'prefill of one sequence of {p.context:,} tokens':<54}{'FLOPs':>22}{'share':>8}",
            *(f"  {_PREFILL_LABELS[k]:<52}{n:>22,}{n / total:>8.1%}  {human(n, 'FLOP')}"
              for k, n in p.prefill_flops.items()),
            f"{'all':<54}{total:>22,}{'':>8}  {human(total, 'FLOP')}"]
