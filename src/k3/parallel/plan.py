"""Analytic per-GPU memory and communication plan for distributed K3 training (docs/architecture.md §2, §3.5, §4.3, §5.4, §6.4, §8.1).

`plan(config, gpus, gpu_memory_gib, ep=..., tp=..., pp=..., cp=..., micro_batch=..., seq_len=...)` returns a
`Plan` (every number in bytes or elements, exact integers from the real parameter shapes); `format_plan` prints it,
`Plan.to_dict` gives JSON. Nothing is allocated: the parameter census comes from the model's modules built on the meta device.

Layout modelled (what the scale-out code builds):

* W = gpus = pp × tp × dp. FSDP2 shards every dense (non-routed-expert) tensor over the dp ranks of its stage along
  dim 0 (after the tp split): a rank holds ceil(rows / dp) rows. Rank 0 is always the fullest, and is the rank
  reported, so uneven sharding shows.
* Expert parallelism: ep divides dp and E; an ep rank owns E/ep whole experts of every MoE layer (the stacked
  w1/w3 [E, F, L] and w2 [E, L, F]), sharded again over efsdp = dp / ep: Shard(0), ceil(E/ep / efsdp) whole
  experts, when efsdp <= E/ep; else Shard(1), ceil(dim1 / efsdp) rows of each of the E/ep matrices.
  `expert_sharding="experts"` / `"rows"` forces either (FSDP2's default is Shard(0), which leaves ranks empty when
  efsdp > E/ep).
* tp splits the heads of KDA and MLA: q/k/v/g/f_b/b projections, the short convs, dt_bias, A_log, MLA q_b/kv_b/g
  by rows (column-parallel), o_proj by columns (row-parallel). Everything else (f_a, q_a, kv_a, their norms, FFN,
  MoE, embeddings, AttnRes) is replicated over tp. No sequence parallelism: a tp rank sees the whole micro-batch.
* pp cuts the layers at AttnRes block boundaries (§5.4); stage 0 also holds the embedding, the last one the output
  AttnRes mix, `model.norm` and `lm_head`. Blocks go to stages so as to minimise the worst stage's total bytes, and
  the worst stage is the one reported. Schedule 1F1B: stage s keeps the activations of pp − s micro-batches.
* cp (context parallelism, k3.parallel.context) groups cp consecutive dp ranks that share their sequences: cp
  divides dp and seq_len, a rank computes T = seq_len / cp positions of each, FSDP2 still shards over all dp ranks.
  The rank reported holds the last share: its MLA layers attend over all S = B·seq_len gathered keys.

Per parameter held (fp32 storage; FSDP mixed precision computes in bf16, the §0.4 fp32 set stays fp32):
weights 4 B + gradients 4 B (reduced in fp32) + optimiser state: Muon momentum 4 B, AdamW exp_avg + exp_avg_sq 8 B
(the §8.1 partition of `build_param_groups`), reported for Muon matrices, Muon experts and AdamW apart. The router
bias buffer is replicated fp32.

Activations saved for backward, per micro-batch of N = B·T tokens on the rank, bf16 (2 B) unless marked fp32 (4 B);
the estimate assumes fused kernels (flash attention, a chunked KDA kernel, fused SiTU-GLU, norms and mixes that keep
their inputs and fp32 statistics), with P = H·K / tp and H = heads / tp on a tp rank:

* layer input `cur` (what checkpointing keeps; the AttnRes bank entries are aliases of earlier inputs): 2·N·D;
* AttnRes + pre-norms: 2·N·D·(4 + [bank non-empty]) for mix outputs, normed inputs and the partial sum, plus
  4·N·(2 + 2·sources) fp32 statistics;
* KDA: 2·N·(9·P + K) (pre- and post-conv q/k/v, f_a output, core output, gate, gated-norm output; + K with the
  low-rank gate) + 4·N·(P + H·(C + 2)) (decay g, β, WY matrix, rstd) + chunk states 4·B·H·⌈T/C⌉·K·K (§3.5;
  twice as wide under cp, [v ‖ 0] from [0 ‖ I]);
* MLA: 2·N·(2·q_lora + kv_lora + H·(nope + rope + v + gate)) (queries, outputs) + 2·S·H·(nope + rope + v)
  (expanded keys and values) + the latent 2·S·(kv_lora + rope) (576 at full size, §4.3) + 4·N·(H + 2) (softmax
  LSE, rstd), with S = N without cp; gate = 2·v with the output gate;
* dense FFN: 2·N·3·F (gate, up, product);
* Stable LatentMoE: 2·N·(2·k·L + 3·k·M + 2·L + 3·S·M) (dispatched latents, expert gate/up/product, expert
  outputs, combined latent and its norm, shared experts of width S·M) + N·(4·E + 12·k) (scores, top-k);
* head (last stage): 2·N·(3·D + V) + 4·N·(V + 2·sources + 1) (final cur, mix, norm, bf16 logits, fp32 logits
  for the loss);
* stage total with checkpointing: in_flight · (Σ inputs + received bank) + the largest layer's other activations
  (one layer recomputed at a time) + head; without: in_flight · (Σ full layers + received bank + head).

FSDP buffers (transient): two layers' unsharded parameters in the compute dtype (the current and the prefetched
one) + one layer's unsharded gradients in the compute dtype and fp32 (reduce-scatter input); a "layer" here is the
decoder layer with its experts, the embedding, or the head.

Communication per micro-batch step and rank: MoE all-to-all sent = 4 × n_moe · N·k·(ep − 1)/ep · L · 2 B (dispatch
and combine of the latent, §6.7, forward and backward; checkpointing re-runs the forward two, reported apart), and
the same at full width D for comparison (ratio L / D); FSDP all-gather received = 2 (forward + backward) ×
Σ (group − 1) · shard bytes in the compute dtype; reduce-scatter sent = Σ (group − 1) · shard · 4 B. Context
parallelism received, per pass (forward, backward, and the recompute with checkpointing): (cp − 1) shares of
each MLA layer's latents, 2·N·(kv_lora + rope), and of each KDA layer's (S⁰, M) states, 4·B·H·K·2K, and conv tails,
2·B·3·(kernel − 1)·P; ring attention would pass 2·N·H·(nope + rope + v) of expanded keys and values per MLA layer
instead of the latents (reported for comparison).

`fits`: total ≤ USABLE_FRACTION (0.9) × gpu_memory_gib GiB; the rest is left to the CUDA context, NCCL buffers,
allocator fragmentation and what is not modelled (tp activation all-reduces, Newton–Schulz workspaces, routing
imbalance). The vision tower is not part of the plan (text model only).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any


from k3.config import K3Config
from k3.parallel.census import parameter_census

GIB = 1 << 30
USABLE_FRACTION = 0.9
ACT_BYTES = 2  # bf16 activations
FP32_BYTES = 4
KINDS = ("muon_matrix", "muon_experts", "adamw")
KIND_LABELS = {"muon_matrix": "Muon matrices", "muon_experts": "Muon experts", "adamw": "AdamW"}
OPTIMIZER_STATE_BYTES = {"muon_matrix": 4, "muon_experts": 4, "adamw": 8}  # momentum / exp_avg + exp_avg_sq, fp32
EXPERT_SHARDING = ("auto", "experts", "rows")



# ------------------------------------------------------------------------------------------------ activations
@dataclass(frozen=True)
class LayerActivations:
    """Bytes one decoder layer saves for backward for one micro-batch on one rank (formulas: module docstring)."""

    layer_input: int  # `cur` entering the layer: all that activation checkpointing keeps
    attn_res: int  # AttnRes mixes, pre-norms, partial sum
    mixer: int  # KDA or MLA, including the two items below
    kda_chunk_states: int  # fp32 [B, H, ⌈T/C⌉, K, K] (KDA layers)
    mla_latent: int  # [B, T, kv_lora + rope] (MLA layers)
    ffn: int  # dense SiTU-GLU or Stable LatentMoE

    @property
    def full(self) -> int:
        return self.layer_input + self.attn_res + self.mixer + self.ffn


def layer_activations(config: K3Config, layer: int, micro_batch: int, seq_len: int, tp: int = 1,
                      cp: int = 1) -> LayerActivations:
    """Saved-for-backward bytes of decoder layer `layer` for a micro-batch of `micro_batch` sequences of `seq_len`
    tokens, each split over `cp` context-parallel ranks (the rank holding the last share: its MLA keys span the
    whole sequence; KDA's chunk states are twice as wide, [v ‖ 0] from [0 ‖ I]; k3.parallel.context)."""
    B, T = micro_batch, seq_len // cp
    N, S = B * T, B * seq_len  # this rank's tokens; the keys its MLA layers attend over
    D, bs = config.hidden_size, config.attn_res_block_size
    bank_before = -(-layer // bs)  # completed sources when the layer starts (§5.3)
    bank_after = -(-(layer + 1) // bs)
    sources = (bank_before + 1 if bank_before else 0) + bank_after + 1
    attn_res = ACT_BYTES * N * D * (4 + (1 if bank_before else 0)) + FP32_BYTES * N * (2 + 2 * sources)
    kda_states = mla_latent = 0
    if config.is_kda_layer(layer):
        H, K, C = config.kda_num_heads // tp, config.kda_head_dim, config.kda_chunk_size
        P = H * K
        gate_in = 0 if config.use_full_rank_gate else K
        kda_states = FP32_BYTES * B * H * -(-T // C) * K * K * (2 if cp > 1 else 1)
        mixer = ACT_BYTES * N * (9 * P + K + gate_in) + FP32_BYTES * N * (P + H * (C + 2)) + kda_states
    else:
        H = config.num_attention_heads // tp
        V = config.v_head_dim
        gated = 2 * V if config.mla_use_output_gate else 0
        mla_latent = ACT_BYTES * S * (config.kv_lora_rank + config.qk_rope_head_dim)
        queries = ACT_BYTES * N * (2 * config.q_lora_rank + config.kv_lora_rank + H * (config.qk_head_dim + V + gated))
        keys = ACT_BYTES * S * H * (config.qk_head_dim + V)  # expanded keys and values
        mixer = queries + keys + mla_latent + FP32_BYTES * N * (H + 2)
    if config.is_moe_layer(layer):
        k, L, M = config.num_experts_per_token, config.routed_expert_hidden_size, config.moe_intermediate_size
        latent_sums = 2 if config.latent_moe_use_norm else 1
        ffn = (ACT_BYTES * N * (2 * k * L + 3 * k * M + latent_sums * L + 3 * config.num_shared_experts * M)
               + N * (FP32_BYTES * config.num_experts + 12 * k))
    else:
        ffn = ACT_BYTES * N * 3 * config.intermediate_size
    return LayerActivations(ACT_BYTES * N * D, attn_res, mixer, kda_states, mla_latent, ffn)


def head_activations(config: K3Config, micro_batch: int, seq_len: int) -> int:
    """Saved bytes of the output AttnRes mix, `model.norm`, `lm_head` and the fp32 loss for one micro-batch."""
    N, D, V = micro_batch * seq_len, config.hidden_size, config.vocab_size
    sources = -(-config.num_hidden_layers // config.attn_res_block_size) + 1
    return ACT_BYTES * N * (3 * D + V) + FP32_BYTES * N * (V + 2 * sources + 1)


# ------------------------------------------------------------------------------------------------ the plan
@dataclass(frozen=True)
class GroupState:
    """Per-rank parameters of one optimiser kind and their training-state bytes."""

    params: int
    weight_bytes: int
    grad_bytes: int
    optimizer_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.grad_bytes + self.optimizer_bytes


@dataclass(frozen=True)
class StageSummary:
    index: int
    first_layer: int
    end_layer: int  # exclusive
    in_flight: int  # micro-batches whose activations it holds (1F1B)
    params_per_rank: int
    total_bytes: int


@dataclass(frozen=True)
class Plan:
    """Per-GPU numbers of the worst pipeline stage (bytes, parameter counts); `stages` summarises all of them."""

    # inputs and mesh
    gpus: int
    gpu_memory_gib: float
    usable_fraction: float
    ep: int
    tp: int
    pp: int
    cp: int  # context-parallel degree (inside dp: groups of cp ranks share their sequences)
    dp: int
    efsdp: int
    expert_placement: str  # "Shard(0)" (whole experts) | "Shard(1)" (rows of every expert) | "none"
    micro_batch: int
    seq_len: int
    activation_checkpointing: bool
    # the model (parameters; the router-bias buffers are counted in buffer_bytes only)
    total_params: int
    total_dense_params: int
    total_expert_params: int
    # the worst stage
    stage: int
    first_layer: int
    end_layer: int
    in_flight: int
    dense_params_per_rank: int
    expert_params_per_rank: int
    groups: dict[str, GroupState]  # KINDS
    buffer_bytes: int
    activation_bytes: int
    fsdp_buffer_bytes: int
    total_bytes: int
    usable_bytes: int
    fits: bool
    headroom_bytes: int
    # activation detail (one micro-batch)
    layer_input_bytes: int
    layer_activation_bytes: dict[str, int]  # full activations of the largest layer of each type in the stage
    kda_chunk_state_bytes: int  # per KDA layer
    mla_latent_bytes: int  # per MLA layer
    recompute_bytes: int  # one layer's activations rebuilt during backward (checkpointing), else 0
    head_activation_bytes: int
    # communication per micro-batch step, per rank
    moe_layers: int
    all_to_all_bytes: int
    all_to_all_full_width_bytes: int
    all_to_all_recompute_bytes: int
    fsdp_all_gather_bytes: int
    fsdp_reduce_scatter_bytes: int
    cp_bytes: int  # context parallelism: MLA latents + KDA states and conv tails received (forward, backward)
    cp_ring_bytes: int  # the MLA part as ring attention would pass it: expanded keys and values
    stages: list[StageSummary] = field(default_factory=list)

    @property
    def params_per_rank(self) -> int:
        return self.dense_params_per_rank + self.expert_params_per_rank

    @property
    def weight_bytes(self) -> int:
        return sum(g.weight_bytes for g in self.groups.values())

    @property
    def grad_bytes(self) -> int:
        return sum(g.grad_bytes for g in self.groups.values())

    @property
    def optimizer_bytes(self) -> int:
        return sum(g.optimizer_bytes for g in self.groups.values())

    @property
    def state_bytes(self) -> int:
        return self.weight_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def all_to_all_latent_ratio(self) -> float:
        """Latent over full-width all-to-all bytes (L / D; from the byte counts when ep > 1)."""
        if self.all_to_all_full_width_bytes:
            return self.all_to_all_bytes / self.all_to_all_full_width_bytes
        return math.nan

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for kind, group in self.groups.items():
            d["groups"][kind]["total_bytes"] = group.total_bytes
        d.update(params_per_rank=self.params_per_rank, weight_bytes=self.weight_bytes, grad_bytes=self.grad_bytes,
                 optimizer_bytes=self.optimizer_bytes, state_bytes=self.state_bytes,
                 all_to_all_latent_ratio=None if math.isnan(self.all_to_all_latent_ratio)
                 else self.all_to_all_latent_ratio)
        return d


@dataclass
class _Segment:
    """Per-rank numbers of one placement unit: a decoder layer (with its experts), the embedding or the head."""

    params: dict[str, int]
    dense: int = 0
    expert: int = 0
    buffer_bytes: int = 0
    gather_bytes: int = 0  # unsharded parameters in the compute dtype (all-gather output)
    grad_buffer_bytes: int = 0  # unsharded gradients in the compute dtype + the fp32 reduce-scatter input
    all_gather_comm: int = 0  # bytes received by one all-gather of all its units
    reduce_scatter_comm: int = 0  # bytes sent by one reduce-scatter of all its units

    @property
    def state_bytes(self) -> int:
        return sum(n * (2 * FP32_BYTES + OPTIMIZER_STATE_BYTES[k]) for k, n in self.params.items()) + self.buffer_bytes


def require_positive_int(name: str, value: Any) -> None:
    """Raise ValueError, naming `name`, unless `value` is an int > 0."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def require_positive_gib(name: str, value: Any) -> None:
    """Raise ValueError, naming `name`, unless `value` is a finite number of GiB > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number of GiB, got {value!r}")


def require_usable_fraction(value: Any) -> None:
    """Raise ValueError unless `value` is a fraction in (0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"usable_fraction must be in (0, 1], got {value!r}")


def validate_mesh(config: K3Config, gpus: int, gpu_memory_gib: float, ep: int = 1, tp: int = 1, pp: int = 1,
                  micro_batch: int = 1, seq_len: int = 4096, expert_sharding: str = "auto",
                  usable_fraction: float = USABLE_FRACTION, cp: int = 1) -> None:
    """Raise ValueError, one line naming the option, for a mesh or batch the layout cannot realise."""
    for name, value in (("gpus", gpus), ("ep", ep), ("tp", tp), ("pp", pp), ("cp", cp), ("micro_batch", micro_batch),
                        ("seq_len", seq_len)):
        require_positive_int(name, value)
    require_positive_gib("gpu_memory_gib", gpu_memory_gib)
    require_usable_fraction(usable_fraction)
    if expert_sharding not in EXPERT_SHARDING:
        raise ValueError(f"expert_sharding must be one of {', '.join(EXPERT_SHARDING)}, got {expert_sharding!r}")
    if gpus % (tp * pp):
        raise ValueError(f"gpus={gpus} is not divisible by tp × pp = {tp} × {pp} = {tp * pp}")
    dp = gpus // (tp * pp)
    if dp % ep:
        raise ValueError(f"ep={ep} does not divide the data-parallel degree dp = gpus / (tp × pp) = {dp}")
    if dp % cp:
        raise ValueError(f"cp={cp} does not divide the data-parallel degree dp = gpus / (tp × pp) = {dp}")
    if seq_len % cp:
        raise ValueError(f"cp={cp} does not divide seq_len = {seq_len} (each rank takes an equal share)")
    if config.num_experts % ep:
        raise ValueError(f"ep={ep} does not divide the routed expert count num_experts = {config.num_experts}")
    types = set(config.layer_types)
    heads = {"kda": ("kda_num_heads", config.kda_num_heads), "mla": ("num_attention_heads", config.num_attention_heads)}
    for kind in ("kda", "mla"):
        name, count = heads[kind]
        if kind in types and count % tp:
            raise ValueError(f"tp={tp} does not divide the head count {name} = {count}")
    blocks = -(-config.num_hidden_layers // config.attn_res_block_size)
    if pp > blocks:
        raise ValueError(f"pp={pp} exceeds the {blocks} AttnRes blocks ({config.num_hidden_layers} layers in blocks "
                         f"of {config.attn_res_block_size}); stages are cut at block boundaries")


def plan(config: K3Config, gpus: int, gpu_memory_gib: float, ep: int = 1, tp: int = 1, pp: int = 1,
         micro_batch: int = 1, seq_len: int = 4096, activation_checkpointing: bool = True,
         expert_sharding: str = "auto", usable_fraction: float = USABLE_FRACTION, cp: int = 1) -> Plan:
    """The per-GPU memory and communication plan of training `config` on `gpus` GPUs of `gpu_memory_gib` GiB with
    the layout of the module docstring; `micro_batch` sequences of `seq_len` tokens per rank and micro-batch, each
    split over `cp` ranks."""
    validate_mesh(config, gpus, gpu_memory_gib, ep, tp, pp, micro_batch, seq_len, expert_sharding, usable_fraction,
                  cp)
    census = parameter_census(config)
    dp = gpus // (tp * pp)
    efsdp = dp // ep
    per_ep_rank = config.num_experts // ep
    has_experts = any(t.kind == "muon_experts" for t in census)
    shard_experts = expert_sharding == "experts" or expert_sharding == "auto" and efsdp <= per_ep_rank
    placement = "none" if not has_experts else "Shard(0)" if shard_experts else "Shard(1)"

    L = config.num_hidden_layers
    segments = {key: _Segment(dict.fromkeys(KINDS, 0)) for key in ["embed", *range(L), "head"]}
    for t in census:
        seg = segments[t.layer if t.place == "layer" else t.place]
        if t.kind == "buffer":  # replicated, not sharded
            seg.buffer_bytes += FP32_BYTES * t.numel
            continue
        shape = list(t.shape)
        if t.kind == "muon_experts":
            shape[0] //= ep
            group, dim = efsdp, 0 if shard_experts else 1
        else:
            if t.tp_dim is not None:
                shape[t.tp_dim] //= tp
            group, dim = dp, 0
        shape[dim] = -(-shape[dim] // group)
        held = math.prod(shape)
        compute = FP32_BYTES if t.fp32_compute else ACT_BYTES
        seg.params[t.kind] += held
        if t.kind == "muon_experts":
            seg.expert += held
        else:
            seg.dense += held
        seg.gather_bytes += held * group * compute
        seg.grad_buffer_bytes += held * group * (compute + FP32_BYTES)
        seg.all_gather_comm += (group - 1) * held * compute
        seg.reduce_scatter_comm += (group - 1) * held * FP32_BYTES

    acts = [layer_activations(config, i, micro_batch, seq_len, tp, cp) for i in range(L)]
    head_act = head_activations(config, micro_batch, seq_len // cp)
    kda_states = max(a.kda_chunk_states for a in acts)  # the same for every KDA layer
    mla_latent = max(a.mla_latent for a in acts)
    usable = int(gpu_memory_gib * GIB * usable_fraction)
    N, D = micro_batch * (seq_len // cp), config.hidden_size
    bs = config.attn_res_block_size

    def stage(index: int, first: int, end: int) -> dict[str, Any]:
        last = index == pp - 1
        keys = (["embed"] if index == 0 else []) + list(range(first, end)) + (["head"] if last else [])
        segs = [segments[k] for k in keys]
        in_flight = pp - index
        received_bank = ACT_BYTES * N * D * -(-first // bs) if index else 0
        layers = acts[first:end]
        head = head_act if last else 0
        if activation_checkpointing:
            recompute = max(a.full - a.layer_input for a in layers)
            activation = in_flight * (sum(a.layer_input for a in layers) + received_bank + head) + recompute
        else:
            recompute = 0
            activation = in_flight * (sum(a.full for a in layers) + received_bank + head)
        groups = {k: GroupState(n, FP32_BYTES * n, FP32_BYTES * n, OPTIMIZER_STATE_BYTES[k] * n)
                  for k in KINDS for n in [sum(s.params[k] for s in segs)]}
        buffers = sum(s.buffer_bytes for s in segs)
        fsdp_buffers = 2 * max(s.gather_bytes for s in segs) + max(s.grad_buffer_bytes for s in segs)
        total = sum(g.total_bytes for g in groups.values()) + buffers + activation + fsdp_buffers
        moe_layers = sum(config.is_moe_layer(i) for i in range(first, end))
        k = config.num_experts_per_token

        def a2a(width: int, transfers: int) -> int:
            return transfers * moe_layers * N * k * (ep - 1) * width * ACT_BYTES // ep

        # context parallelism, per layer: the other ranks' shares of the MLA latents, or of the expanded keys and values
        # (ring attention), and their KDA (S⁰, M) [H, K, K+V] fp32 and conv tails; each again in backward, and in the
        # recompute with checkpointing
        passes = 3 if activation_checkpointing else 2
        mla = sum(config.layer_types[i] == "mla" for i in range(first, end))
        kda = end - first - mla
        H, Hk, K = config.num_attention_heads // tp, config.kda_num_heads // tp, config.kda_head_dim
        latent_width = config.kv_lora_rank + config.qk_rope_head_dim
        kda_bytes = micro_batch * (FP32_BYTES * Hk * K * 2 * K + ACT_BYTES * 3 * (config.short_conv_kernel_size - 1)
                                   * Hk * K)
        cp_bytes = passes * (cp - 1) * (mla * ACT_BYTES * N * latent_width + kda * kda_bytes)
        cp_ring = passes * (cp - 1) * mla * ACT_BYTES * N * H * (config.qk_head_dim + config.v_head_dim)
        by_type: dict[str, int] = {}
        for i, a in zip(range(first, end), layers):
            name = config.layer_types[i] + ("+moe" if config.is_moe_layer(i) else "+dense")
            by_type[name] = max(by_type.get(name, 0), a.full)
        return dict(
            stage=index, first_layer=first, end_layer=end, in_flight=in_flight,
            dense_params_per_rank=sum(s.dense for s in segs), expert_params_per_rank=sum(s.expert for s in segs),
            groups=groups, buffer_bytes=buffers, activation_bytes=activation, fsdp_buffer_bytes=fsdp_buffers,
            total_bytes=total, usable_bytes=usable, fits=total <= usable, headroom_bytes=usable - total,
            layer_input_bytes=ACT_BYTES * N * D, layer_activation_bytes=by_type,
            kda_chunk_state_bytes=kda_states, mla_latent_bytes=mla_latent, recompute_bytes=recompute,
            head_activation_bytes=head,
            moe_layers=moe_layers, all_to_all_bytes=a2a(config.routed_expert_hidden_size, 4),
            all_to_all_full_width_bytes=a2a(D, 4),
            all_to_all_recompute_bytes=a2a(config.routed_expert_hidden_size, 2) if activation_checkpointing else 0,
            fsdp_all_gather_bytes=2 * sum(s.all_gather_comm for s in segs),
            fsdp_reduce_scatter_bytes=sum(s.reduce_scatter_comm for s in segs),
            cp_bytes=cp_bytes, cp_ring_bytes=cp_ring,
        )

    stages = _partition(stage, [*range(0, L, bs), L], pp)
    worst = max(stages, key=lambda s: s["total_bytes"])
    params = [t for t in census if t.kind != "buffer"]
    expert_total = sum(t.numel for t in params if t.kind == "muon_experts")
    return Plan(
        gpus=gpus, gpu_memory_gib=float(gpu_memory_gib), usable_fraction=float(usable_fraction), ep=ep, tp=tp, pp=pp,
        cp=cp, dp=dp, efsdp=efsdp, expert_placement=placement, micro_batch=micro_batch, seq_len=seq_len,
        activation_checkpointing=bool(activation_checkpointing), total_params=sum(t.numel for t in params),
        total_dense_params=sum(t.numel for t in params) - expert_total, total_expert_params=expert_total, **worst,
        stages=[StageSummary(s["stage"], s["first_layer"], s["end_layer"], s["in_flight"],
                             s["dense_params_per_rank"] + s["expert_params_per_rank"], s["total_bytes"])
                for s in stages])


def _partition(stage, bounds: list[int], pp: int) -> list[dict[str, Any]]:
    """Contiguous split of the AttnRes blocks (layer bounds `bounds`) into pp stages minimising the worst stage's
    total bytes (dynamic programme over (stage, block))."""
    nb = len(bounds) - 1
    best: dict[tuple[int, int], tuple[int, list[dict[str, Any]]]] = {(0, 0): (0, [])}
    for s in range(1, pp + 1):
        ends = [nb] if s == pp else range(s, nb - (pp - s) + 1)
        for b in ends:
            for a in range(s - 1, b):
                if (s - 1, a) not in best:
                    continue
                worst, chosen = best[(s - 1, a)]
                numbers = stage(s - 1, bounds[a], bounds[b])
                value = max(worst, numbers["total_bytes"])
                if (s, b) not in best or value < best[(s, b)][0]:
                    best[(s, b)] = (value, chosen + [numbers])
    return best[(pp, nb)][1]


# ------------------------------------------------------------------------------------------------ report
def _gib(n: int) -> str:
    return f"{n / GIB:.2f}"


def format_plan(p: Plan) -> str:
    """A readable table of `p` (GiB with two decimals; parameter counts in full)."""
    ckpt = "on" if p.activation_checkpointing else "off"
    extras = ([" + embedding"] if p.stage == 0 else []) + ([" + head"] if p.stage == p.pp - 1 else [])
    placement = {"Shard(0)": "Shard(0): whole experts", "Shard(1)": "Shard(1): rows of every expert",
                 "none": "no routed experts"}[p.expert_placement]
    lines = [
        f"K3 training plan: {p.total_params:,} parameters ({p.total_expert_params:,} in routed experts)",
        f"mesh        {p.gpus} GPUs = pp {p.pp} × tp {p.tp} × dp {p.dp}; ep {p.ep} × efsdp {p.efsdp}; "
        f"experts {placement}",
        (f"batch       micro-batch {p.micro_batch} × {p.seq_len:,} tokens split over cp {p.cp} ranks: "
         f"{p.seq_len // p.cp:,} per rank, activation checkpointing {ckpt}" if p.cp > 1 else
         f"batch       micro-batch {p.micro_batch} × {p.seq_len} tokens per rank, activation checkpointing {ckpt}"),
        f"stage       {p.stage} of {p.pp} (worst): layers {p.first_layer}-{p.end_layer - 1}{''.join(extras)}, "
        f"{p.in_flight} micro-batch(es) in flight",
        f"params/rank dense {p.dense_params_per_rank:,} + experts {p.expert_params_per_rank:,} = "
        f"{p.params_per_rank:,}",
        "",
        f"{'per GPU (GiB)':<26}{'params':>16}{'weights':>10}{'grads':>10}{'optimizer':>11}{'total':>10}",
    ]
    for kind in KINDS:
        g = p.groups[kind]
        lines.append(f"{KIND_LABELS[kind]:<26}{g.params:>16,}{_gib(g.weight_bytes):>10}{_gib(g.grad_bytes):>10}"
                     f"{_gib(g.optimizer_bytes):>11}{_gib(g.total_bytes):>10}")
    lines.append(f"{'parameters + state':<26}{p.params_per_rank:>16,}{_gib(p.weight_bytes):>10}"
                 f"{_gib(p.grad_bytes):>10}{_gib(p.optimizer_bytes):>11}{_gib(p.state_bytes):>10}")
    for label, value in (("buffers (router bias)", p.buffer_bytes), ("activations", p.activation_bytes),
                         ("FSDP gather/reduce bufs", p.fsdp_buffer_bytes), ("total", p.total_bytes)):
        lines.append(f"{label:<83}{_gib(value):>10}")
    lines.append(f"{f'usable ({p.usable_fraction:.2f} × {p.gpu_memory_gib:.2f} GiB)':<83}{_gib(p.usable_bytes):>10}")
    verdict = "yes" if p.fits else "NO"
    lines.append(f"fits        {verdict} (headroom {_gib(p.headroom_bytes)} GiB)")
    per_type = ", ".join(f"{name} {_gib(v)}" for name, v in p.layer_activation_bytes.items())
    lines += [
        "",
        f"activations per micro-batch (GiB): layer input {_gib(p.layer_input_bytes)}; full layer {per_type}",
        f"  KDA chunk states {_gib(p.kda_chunk_state_bytes)} per KDA layer, MLA latent {_gib(p.mla_latent_bytes)} "
        f"per MLA layer; recompute peak {_gib(p.recompute_bytes)}; head {_gib(p.head_activation_bytes)}",
    ]
    ratio = "n/a (ep = 1)" if math.isnan(p.all_to_all_latent_ratio) else f"{p.all_to_all_latent_ratio:.2f}"
    lines += [
        f"communication per micro-batch step and rank (GiB), {p.moe_layers} MoE layers:",
        f"  MoE all-to-all {_gib(p.all_to_all_bytes)} latent vs {_gib(p.all_to_all_full_width_bytes)} full width "
        f"(ratio {ratio}), + {_gib(p.all_to_all_recompute_bytes)} recompute",
        f"  FSDP all-gather {_gib(p.fsdp_all_gather_bytes)}, reduce-scatter {_gib(p.fsdp_reduce_scatter_bytes)}",
    ]
    if p.cp > 1:
        lines.append(f"  context parallel {_gib(p.cp_bytes)} (MLA latents, KDA states; ring attention would pass "
                     f"{_gib(p.cp_ring_bytes)} of MLA keys and values)")
    if p.pp > 1:
        lines.append("stages      " + "; ".join(f"{s.index}: layers {s.first_layer}-{s.end_layer - 1} "
                                                f"{_gib(s.total_bytes)} GiB" for s in p.stages))
    return "\n".join(lines)
