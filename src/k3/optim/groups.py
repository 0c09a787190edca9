"""Parameter partition into Muon block views and AdamW groups (docs/architecture.md §8.1, §8.4, §8.5, §13 items 3–5).

Every trainable parameter lands in exactly one named group:

* Muon "matrix": 2-D hidden matrices without head structure (KDA `f_a/f_b/b_proj`, MLA `q_a_proj`,
  `kv_a_proj_with_mqa`, dense/shared `gate/up/down_proj`, `routed_expert_down/up_proj`, `o_proj`/`g_proj` unless
  per head), and the router `gate.weight` by default;
* Muon "experts": routed experts' stacked `w1`, `w3` [E, M, L], `w2` [E, L, M], one matrix per expert;
* Muon per head (scope "qkv", default): "kda_qkv" (KDA `q/k/v_proj`, rows per head), "mla_q_b" (MLA `q_b_proj`,
  [q_nope | q_pe] rows per head together), "mla_kv_b" (MLA `kv_b_proj`, a K block and a V block per head, or one
  [k_nope | v] block with `kv_b_blocks="head"`); scope "qkv+o+gates" adds "kda_o"/"mla_o" (`o_proj` columns per
  head) and "kda_g"/"mla_g" (`g_proj` rows per head); scope "none" keeps them all whole;
* AdamW, one group per category: "embed", "lm_head", "conv" (KDA short-conv weights [P, 1, W]), "norm" (every
  RMSNorm gain), "res_proj" (AttnRes pseudo-queries [1, D]), "A_log", "dt_bias", and "router" when
  `router="adamw"`. Categories in `no_decay` get weight decay 0, the others `weight_decay`.

Vision (§9, §13 items 3 and 5): MoonViT-V2 `wqkv` is Muon per head ("vit_qkv": q, k and v rows of each head,
scope "qkv" and wider); `wo`, the MLP and the projector linears are Muon "matrix"; the patch conv and the
position table are AdamW "vision_input" (with weight decay); ViT and projector norm gains are "norm".

`lr_scale` multiplies the peak learning rate of chosen groups (§8.8): keys are group names or "muon" / "adamw"
for every group of that optimiser; a group's own name wins. Each group dict records its "lr_scale", which
`set_lr` applies at every step.

The router's `e_score_correction_bias` is a buffer written only by load balancing, so it is in no group. Whether
a decoder layer is KDA or MLA is read from the config's layer schedule.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from typing import Any

import torch
from torch import nn

from k3.config import K3Config
from k3.model.kda import KimiDeltaAttention
from k3.model.mla import GatedMLA
from k3.model.moe import MoEGate, RoutedExperts
from k3.ops.norm import RMSNorm
from k3.optim.muon import Muon

PER_HEAD_SCOPES = ("qkv", "qkv+o+gates", "none")
DEFAULT_NO_DECAY = ("norm", "res_proj", "A_log", "dt_bias")  # §8.5 / §13.5
ADAMW_BETAS = (0.9, 0.95)
ADAMW_EPS = 1e-8  # §0.5

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def build_param_groups(model: nn.Module, config: K3Config, lr: float, weight_decay: float = 0.1,
                       per_head_scope: str = "qkv", router: str = "muon", kv_b_blocks: str = "k_v",
                       no_decay: Collection[str] = DEFAULT_NO_DECAY,
                       lr_scale: Mapping[str, float] | None = None) -> tuple[list[dict], list[dict]]:
    """(Muon groups, AdamW groups) for `model` (a `K3ForCausalLM` or `K3Model`), §8.1.

    Each group is a dict with "name", "params" (a list of (qualified name, parameter) pairs, so the optimisers
    record `param_names`), "lr", "weight_decay"; Muon groups also carry their block view ("split",
    "split_sizes", §8.4). `kv_b_blocks`: "k_v" (per head one K and one V block, default) or "head" (one
    [N + Vh, C] block per head). `lr_scale`: {group name or "muon" / "adamw": multiplier of `lr`}; each group
    gets "lr_scale" and starts at `lr` times it. Raises if a parameter has no rule or is not in exactly one
    group, or if an `lr_scale` key names no group of this model.
    """
    if per_head_scope not in PER_HEAD_SCOPES:
        raise ValueError(f"per_head_scope must be one of {PER_HEAD_SCOPES}, got {per_head_scope!r}")
    if router not in ("muon", "adamw"):
        raise ValueError(f"router must be 'muon' or 'adamw', got {router!r}")
    if kv_b_blocks not in ("k_v", "head"):
        raise ValueError(f"kv_b_blocks must be 'k_v' or 'head', got {kv_b_blocks!r}")
    muon_groups: dict[str, dict[str, Any]] = {}
    adamw_groups: dict[str, dict[str, Any]] = {}
    for module_name, module in model.named_modules():
        if module_name.rsplit(".", 1)[-1] == "self_attn":
            _check_mixer_type(config, module_name, module)
        for local_name, param in module.named_parameters(recurse=False):
            if not param.requires_grad:
                continue
            name = f"{module_name}.{local_name}" if module_name else local_name
            optimizer, group_name, view = _classify(config, module_name, module, local_name, per_head_scope,
                                                    router, kv_b_blocks)
            if optimizer == "muon":
                split, split_sizes = view
                group = muon_groups.setdefault(group_name, dict(
                    name=group_name, params=[], lr=lr, weight_decay=weight_decay, split=split,
                    split_sizes=split_sizes))
            else:
                group = adamw_groups.setdefault(group_name, dict(
                    name=group_name, params=[], lr=lr,
                    weight_decay=0.0 if group_name in no_decay else weight_decay))
            group["params"].append((name, param))
    _check_partition(model, [*muon_groups.values(), *adamw_groups.values()])
    _apply_lr_scale(lr_scale or {}, muon=list(muon_groups.values()), adamw=list(adamw_groups.values()))
    return list(muon_groups.values()), list(adamw_groups.values())


def _apply_lr_scale(lr_scale: Mapping[str, float], **groups_by_optimizer: list[dict[str, Any]]) -> None:
    """Give every group its "lr_scale" (its own key, else its optimiser's, else 1) and scale its "lr"."""
    names = {group["name"] for groups in groups_by_optimizer.values() for group in groups}
    unknown = sorted(set(lr_scale) - names - set(groups_by_optimizer))
    if unknown:
        raise ValueError(f"lr scale for {', '.join(map(repr, unknown))}: no such parameter group in this model "
                         f"(groups: {', '.join([*groups_by_optimizer, *sorted(names)])})")
    for optimizer, groups in groups_by_optimizer.items():
        for group in groups:
            group["lr_scale"] = float(lr_scale.get(group["name"], lr_scale.get(optimizer, 1.0)))
            group["lr"] *= group["lr_scale"]


def make_optimizers(model: nn.Module, config: K3Config, lr: float, weight_decay: float = 0.1,
                    per_head_scope: str = "qkv", router: str = "muon", kv_b_blocks: str = "k_v",
                    no_decay: Collection[str] = DEFAULT_NO_DECAY, ns_dtype: torch.dtype = torch.bfloat16,
                    lr_scale: Mapping[str, float] | None = None, **muon_options: Any) -> tuple[Muon, torch.optim.AdamW]:
    """The K3 optimiser pair: `Muon` over the Muon groups and AdamW (β = (0.9, 0.95), ε = 1e-8) over the rest
    (§8.2, §8.5), both at learning rate `lr` (times a group's `lr_scale`, see `build_param_groups`).
    `muon_options` are further `Muon` defaults (momentum, nesterov, adjust_lr, ...)."""
    muon_groups, adamw_groups = build_param_groups(model, config, lr, weight_decay, per_head_scope, router,
                                                   kv_b_blocks, no_decay, lr_scale)
    muon = Muon(muon_groups, lr=lr, weight_decay=weight_decay, ns_dtype=ns_dtype, **muon_options)
    adamw = torch.optim.AdamW(adamw_groups, lr=lr, betas=ADAMW_BETAS, eps=ADAMW_EPS, weight_decay=weight_decay)
    return muon, adamw


def _classify(config: K3Config, module_name: str, module: nn.Module, local_name: str, per_head_scope: str,
              router: str, kv_b_blocks: str) -> tuple[str, str, tuple[str, tuple[int, ...]] | None]:
    """(optimizer "muon" | "adamw", group name, Muon block view (split, split_sizes) or None) of one parameter."""
    whole = ("none", ())
    leaf = module_name.rsplit(".", 1)[-1]
    if isinstance(module, RMSNorm):
        return "adamw", "norm", None
    if isinstance(module, nn.Embedding):
        return "adamw", "embed", None
    if isinstance(module, nn.Conv1d):
        return "adamw", "conv", None
    if isinstance(module, nn.Conv2d) or leaf == "pos_emb":  # MoonViT patch conv and position table
        return "adamw", "vision_input", None
    if isinstance(module, nn.Linear) and leaf == "wqkv" and per_head_scope != "none":
        return "muon", "vit_qkv", ("rows", (config.vision_config.head_dim,))
    if isinstance(module, KimiDeltaAttention) and local_name in ("A_log", "dt_bias"):
        return "adamw", local_name, None
    if isinstance(module, MoEGate):
        return ("muon", "router", whole) if router == "muon" else ("adamw", "router", None)
    if isinstance(module, RoutedExperts):
        return "muon", "experts", whole  # [E, A, B]: the leading expert axis is a batch of E matrices
    if isinstance(module, nn.Linear):
        if leaf == "lm_head":
            return "adamw", "lm_head", None
        if leaf.endswith("_res_proj"):
            return "adamw", "res_proj", None
        layer = _LAYER_RE.search(module_name)
        if layer is not None and module_name.endswith(f"self_attn.{leaf}"):
            per_head = _per_head_view(config, config.layer_types[int(layer.group(1))], leaf, per_head_scope,
                                      kv_b_blocks)
            if per_head is not None:
                group_name, split, split_sizes = per_head
                return "muon", group_name, (split, split_sizes)
        return "muon", "matrix", whole
    raise ValueError(f"no optimiser rule for parameter {module_name}.{local_name} of {type(module).__name__}")


def _per_head_view(config: K3Config, layer_type: str, leaf: str, per_head_scope: str,
                   kv_b_blocks: str) -> tuple[str, str, tuple[int, ...]] | None:
    """(group name, split, one head's block sizes) of an attention projection, None if whole (§8.4)."""
    if per_head_scope == "none":
        return None
    K = config.kda_head_dim
    N, R, Vh = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
    if layer_type == "kda":
        views = {proj: ("kda_qkv", "rows", (K,)) for proj in ("q_proj", "k_proj", "v_proj")}
        gates = {"o_proj": ("kda_o", "cols", (K,)), "g_proj": ("kda_g", "rows", (K,))}
    else:
        views = {"q_b_proj": ("mla_q_b", "rows", (N + R,)),
                 "kv_b_proj": ("mla_kv_b", "rows", (N, Vh) if kv_b_blocks == "k_v" else (N + Vh,))}
        gates = {"o_proj": ("mla_o", "cols", (Vh,)), "g_proj": ("mla_g", "rows", (Vh,))}
    if per_head_scope == "qkv+o+gates":
        views |= gates
    return views.get(leaf)


def _check_mixer_type(config: K3Config, module_name: str, module: nn.Module) -> None:
    """The sequence mixer of decoder layer i must be the kind the config schedule says (§0.3)."""
    layer = _LAYER_RE.search(module_name)
    if layer is None:
        return
    i = int(layer.group(1))
    expected = KimiDeltaAttention if config.is_kda_layer(i) else GatedMLA
    if not isinstance(module, expected):
        raise ValueError(f"{module_name} is a {type(module).__name__}, but the config schedule makes layer {i} "
                         f"{config.layer_types[i].upper()}")


def _check_partition(model: nn.Module, groups: list[dict[str, Any]]) -> None:
    """Every trainable parameter of `model` is in exactly one group."""
    seen: dict[int, str] = {}
    for group in groups:
        for name, param in group["params"]:
            if id(param) in seen:
                raise AssertionError(f"{name} is in groups {seen[id(param)]!r} and {group['name']!r}")
            seen[id(param)] = group["name"]
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in seen]
    if missing:
        raise AssertionError(f"parameters in no optimiser group: {missing}")
