"""The parameter census of the training-memory plan (`k3.parallel.plan`): every tensor of the text model with its
shape, optimiser group (§8.1), dtype and the dimension tensor parallelism splits, from modules built on the meta
device."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

import torch
from torch import nn

from k3.checkpoint.quantization import with_experts_format
from k3.config import K3Config
from k3.model.accounting import component_of
from k3.model.k3 import K3ForCausalLM
from k3.ops.precision import is_fp32_tensor
from k3.optim.groups import build_param_groups


_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_TP_ROWS = {
    "kda": frozenset({"q_proj", "k_proj", "v_proj", "g_proj", "g_b_proj", "f_b_proj", "b_proj", "q_conv1d",
                      "k_conv1d", "v_conv1d", "dt_bias", "A_log"}),
    "mla": frozenset({"q_b_proj", "kv_b_proj", "g_proj"}),
}
_TP_COLS = frozenset({"o_proj"})


@dataclass(frozen=True)
class TensorInfo:
    """One stored tensor of the text model, as the planner sees it."""

    name: str
    shape: tuple[int, ...]
    kind: str  # "muon_matrix" | "muon_experts" | "adamw" | "buffer"
    layer: int | None  # decoder layer, None for the embedding and the head
    place: str  # "embed" | "layer" | "head"
    tp_dim: int | None  # dimension split over tp (heads), None if replicated over tp
    fp32_compute: bool  # in the §0.4 fp32 set: computed (and all-gathered) in fp32

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


_CENSUS_CACHE: dict[str, tuple[TensorInfo, ...]] = {}


def parameter_census(config: K3Config, model: nn.Module | None = None) -> tuple[TensorInfo, ...]:
    """Every parameter and buffer of the text model with its optimiser kind, place, tp split and compute dtype.

    Without `model`, the census of the config's meta-device model (cached per config). With `model` (a
    `K3ForCausalLM`, e.g. built on the meta device), that model's own tensors.
    """
    if model is not None:
        return _census(model, config)
    key = json.dumps(config.to_text_dict(), sort_keys=True, default=str)
    if key not in _CENSUS_CACHE:
        with torch.device("meta"):
            # shapes only: the meta device skips the weight init; training holds the routed experts dense
            meta_model = K3ForCausalLM(with_experts_format(config, "dense"))
        if len(_CENSUS_CACHE) >= 8:
            _CENSUS_CACHE.clear()
        _CENSUS_CACHE[key] = _census(meta_model, config)
    return _CENSUS_CACHE[key]


def _census(model: nn.Module, config: K3Config) -> tuple[TensorInfo, ...]:
    muon, adamw = build_param_groups(model, config, lr=1.0)
    group_of = {id(p): ("muon", g["name"]) for g in muon for _, p in g["params"]}
    group_of.update({id(p): ("adamw", g["name"]) for g in adamw for _, p in g["params"]})
    out = []
    tensors = [(n, p, False) for n, p in model.named_parameters()] + [(n, b, True) for n, b in model.named_buffers()]
    for name, tensor, is_buffer in tensors:
        if not name.startswith(("model.", "lm_head.")):
            raise ValueError(f"the planner expects a text model (K3ForCausalLM); {name} is not one of its tensors")
        if is_buffer:
            kind = "buffer"
        elif id(tensor) not in group_of:
            raise ValueError(f"{name} is in no optimiser group (frozen?); the planner expects a trainable model")
        else:
            optimizer, group = group_of[id(tensor)]
            kind = "muon_experts" if group == "experts" else "muon_matrix" if optimizer == "muon" else "adamw"
            if (component_of(name, config) == "routed_experts") != (kind == "muon_experts"):
                raise AssertionError(f"{name}: optimiser group {group!r} disagrees with the accounting component")
        m = _LAYER.match(name)
        layer = None if m is None else int(m.group(1))
        place = "layer" if layer is not None else "embed" if name.startswith("model.embed_tokens.") else "head"
        out.append(TensorInfo(name, tuple(tensor.shape), kind, layer, place, _tp_dim(config, name, layer),
                              is_buffer or is_fp32_tensor(name)))
    return tuple(out)


def _tp_dim(config: K3Config, name: str, layer: int | None) -> int | None:
    """0 for a column-parallel (head rows) tensor, 1 for row-parallel (head columns), None if replicated over tp."""
    if layer is None or ".self_attn." not in name:
        return None
    leaf = name.split(".self_attn.", 1)[1].split(".", 1)[0]
    if leaf in _TP_COLS:
        return 1
    return 0 if leaf in _TP_ROWS[config.layer_types[layer]] else None
