"""K3 text configuration (spec §1.1, §1.3, §1.4).

`K3Config` reads and writes the released Hugging Face `config.json` verbatim: either the multimodal top level
(`model_type: kimi_k3` with `text_config` / `vision_config`) or a text-only file. Unknown keys are kept and
written back. Field names are the official ones; our own non-architectural knobs (§1.3) are written only when
they differ from their defaults, so a released file round-trips unchanged.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, field, fields
from typing import Any

from k3.ops.loss import IGNORE_INDEX

def k3_full_attn_layers(num_hidden_layers: int) -> list[int]:
    """1-based MLA layer list of the K3 schedule (spec §1.4): every 4th layer plus the final layer."""
    layers = [i for i in range(4, num_hidden_layers + 1, 4)]
    if num_hidden_layers not in layers:
        layers.append(num_hidden_layers)
    return layers


@dataclass
class K3Config:
    """Text-model configuration. Attribute names follow the released `text_config` (spec §1.1)."""

    vocab_size: int = 163840
    hidden_size: int = 7168
    num_hidden_layers: int = 93
    num_attention_heads: int = 96
    num_key_value_heads: int = 96
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_nope: bool = True
    mla_use_output_gate: bool = True
    # KDA (`linear_attn_config` in the file)
    kda_num_heads: int = 96
    kda_head_dim: int = 128
    short_conv_kernel_size: int = 4
    kda_layers: list[int] = field(default_factory=lambda: [i for i in range(1, 94) if i not in k3_full_attn_layers(93)])
    full_attn_layers: list[int] = field(default_factory=lambda: k3_full_attn_layers(93))
    use_full_rank_gate: bool = True
    gate_lower_bound: float | None = -5.0
    # FFN / MoE
    hidden_act: str = "situ"
    activation_situ_beta: float | None = 4.0
    activation_situ_linear_beta: float | None = 25.0
    intermediate_size: int = 33792
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    num_experts: int = 896
    num_experts_per_token: int = 16
    num_shared_experts: int = 2
    moe_intermediate_size: int = 3072
    routed_expert_hidden_size: int = 3584
    latent_moe_use_norm: bool = True
    moe_router_activation_func: str = "sigmoid"
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0  # [U] §13.1: read from the file, 1.0 if absent
    topk_method: str = "noaux_tc"
    use_grouped_topk: bool = True
    num_expert_group: int = 1
    topk_group: int = 1
    # depth mixing, norms, vocabulary
    attn_res_block_size: int = 12
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02  # [U] §13.8
    bos_token_id: int | None = 163584  # [U] §10
    eos_token_id: int | None = 163586  # [U]
    pad_token_id: int | None = 163839  # [U]
    # our non-architectural knobs (§1.3); written to JSON only when not default
    kda_chunk_size: int = 64
    kda_impl: str = "chunk"  # "chunk" | "recurrent"
    moe_impl: str = "grouped"  # "grouped" | "loop"
    mla_decode: str = "absorbed"  # one-token MLA steps: "absorbed" (MQA over the latent, §4.4) | "expanded"
    # everything else in the file (model_type, rope_theta, quantization_config, ...) kept verbatim
    extra: dict[str, Any] = field(default_factory=dict)
    # when read from a multimodal file: the top level without `text_config` (has `vision_config`)
    multimodal: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.validate()

    @property
    def vision_config(self) -> K3VisionConfig | None:
        """The parsed `vision_config` of a multimodal file (spec §1.2), None for a text-only model."""
        if self.multimodal is None or "vision_config" not in self.multimodal:
            return None
        vision = self.multimodal["vision_config"]
        missing = {} if not isinstance(vision, dict) or "text_hidden_size" in vision else \
            {"text_hidden_size": self.hidden_size}  # the projector's output width is the text width
        return K3VisionConfig.from_dict(vision, **missing)

    @property
    def media_placeholder_token_id(self) -> int | None:
        """Id of `<|media_pad|>`, the one-per-item placeholder expanded to image features (spec §9.9)."""
        if self.multimodal is None:
            return None
        if "media_placeholder_token_id" in self.multimodal:
            return self.multimodal["media_placeholder_token_id"]
        vision = self.vision_config  # the top level omits it: the vision_config's copy, if any
        return None if vision is None else vision.media_placeholder_token_id

    # ----------------------------------------------------------------------------------- schedule
    def is_kda_layer(self, i: int) -> bool:
        """0-based layer i is KDA iff i+1 is listed in `kda_layers` (spec §0.3)."""
        return (i + 1) in self._kda_set

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0

    @property
    def _kda_set(self) -> frozenset[int]:
        return frozenset(self.kda_layers)

    @property
    def layer_types(self) -> list[str]:
        return ["kda" if self.is_kda_layer(i) else "mla" for i in range(self.num_hidden_layers)]

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    # --------------------------------------------------------------------------------- validation
    def validate(self) -> None:
        """Raise `ValueError` naming the field and the rule it breaks."""

        def need(ok: bool, name: str, rule: str) -> None:
            if not ok:
                raise ValueError(f"K3Config.{name}: {rule} (got {getattr(self, name)!r})")

        positive = (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank",
            "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "kda_num_heads", "kda_head_dim",
            "short_conv_kernel_size", "intermediate_size", "moe_layer_freq", "num_experts",
            "num_experts_per_token", "moe_intermediate_size", "routed_expert_hidden_size",
            "attn_res_block_size", "kda_chunk_size", "num_expert_group", "topk_group",
        )
        for name in positive:
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v > 0, name, "must be a positive integer")
        need(isinstance(self.qk_rope_head_dim, int) and self.qk_rope_head_dim >= 0, "qk_rope_head_dim",
             "must be a non-negative integer")
        need(isinstance(self.num_shared_experts, int) and self.num_shared_experts >= 0, "num_shared_experts",
             "must be a non-negative integer")
        need(isinstance(self.first_k_dense_replace, int) and 0 <= self.first_k_dense_replace,
             "first_k_dense_replace", "must be a non-negative integer")
        need(self.num_key_value_heads == self.num_attention_heads, "num_key_value_heads",
             f"must equal num_attention_heads={self.num_attention_heads} (MLA is MHA in expanded form)")
        need(self.mla_use_nope is True, "mla_use_nope", "must be true: K3's MLA has no rotary embedding (§4)")
        L = self.num_hidden_layers
        for name in ("kda_layers", "full_attn_layers"):
            v = getattr(self, name)
            need(isinstance(v, (list, tuple)) and all(isinstance(x, int) for x in v), name,
                 "must be a list of 1-based layer numbers")
            need(len(set(v)) == len(v), name, "must not repeat a layer")
            need(all(1 <= x <= L for x in v), name, f"entries must lie in 1..num_hidden_layers={L}")
        need(not (set(self.kda_layers) & set(self.full_attn_layers)), "kda_layers",
             f"must not share layers with full_attn_layers (both list {sorted(set(self.kda_layers) & set(self.full_attn_layers))})")
        need(len(self.kda_layers) + len(self.full_attn_layers) == L, "kda_layers",
             f"together with full_attn_layers must partition 1..{L}")
        need(self.num_experts_per_token <= self.num_experts, "num_experts_per_token",
             f"must be <= num_experts={self.num_experts}")
        need(self.num_experts % self.num_expert_group == 0, "num_expert_group",
             f"must divide num_experts={self.num_experts}")
        need(self.topk_group <= self.num_expert_group, "topk_group",
             f"must be <= num_expert_group={self.num_expert_group}")
        need(self.hidden_act in ("situ", "silu"), "hidden_act", "must be 'situ' or 'silu'")
        need(self.moe_router_activation_func == "sigmoid", "moe_router_activation_func",
             "only 'sigmoid' is supported (the released value)")
        need(self.topk_method == "noaux_tc", "topk_method", "only 'noaux_tc' is supported (the released value)")
        need(self.gate_lower_bound is None or self.gate_lower_bound < 0, "gate_lower_bound",
             "must be negative (or null for the softplus decay form)")
        need(isinstance(self.activation_situ_beta, (int, float)) and self.activation_situ_beta > 0,
             "activation_situ_beta", "must be positive (a file that omits it means 1.0, spec §6.1)")
        need(self.activation_situ_linear_beta is None or self.activation_situ_linear_beta > 0,
             "activation_situ_linear_beta", "must be positive or null (uncapped)")
        need(self.rms_norm_eps > 0, "rms_norm_eps", "must be positive")
        need(self.routed_scaling_factor > 0, "routed_scaling_factor", "must be positive")
        need(self.kda_impl in ("chunk", "recurrent"), "kda_impl", "must be 'chunk' or 'recurrent'")
        need(self.moe_impl in ("grouped", "loop"), "moe_impl", "must be 'grouped' or 'loop'")
        need(self.mla_decode in ("absorbed", "expanded"), "mla_decode", "must be 'absorbed' or 'expanded'")
        need(self.tie_word_embeddings is False, "tie_word_embeddings", "must be false (K3 has an untied lm_head)")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            v = getattr(self, name)
            need(v is None or 0 <= v < self.vocab_size, name, f"must be a token id in 0..{self.vocab_size - 1}")
        if self.multimodal is not None and "vision_config" in self.multimodal:
            vision = self.vision_config  # raises on a malformed vision_config
            need(vision.text_hidden_size == self.hidden_size, "multimodal",
                 f"vision_config.text_hidden_size={vision.text_hidden_size} must equal hidden_size={self.hidden_size}")

    # --------------------------------------------------------------------------------------- JSON
    def to_text_dict(self) -> dict[str, Any]:
        """The `text_config` dict (or the whole text-only file), official names, unknown keys kept.

        Key order is canonical (model_type, our fields, `linear_attn_config` after the MLA fields, then the
        unknown keys), so save → load → save writes identical bytes.
        """
        d: dict[str, Any] = {"model_type": self.extra.get("model_type", "kimi_linear")}
        for f in fields(self):
            if f.name in ("extra", "multimodal") or f.name in _LINEAR_ATTN_FIELDS:
                continue
            v = getattr(self, f.name)
            if f.name in _KNOB_DEFAULTS and v == _KNOB_DEFAULTS[f.name]:
                continue
            d[f.name] = copy.deepcopy(v)
            if f.name == "mla_use_output_gate":
                lac = copy.deepcopy(self.extra.get("linear_attn_config", {}))  # keeps unknown sub-keys
                d["linear_attn_config"] = lac | {key: copy.deepcopy(getattr(self, name))
                                                 for key, name in _LAC_TO_FIELD.items()}
        for k, v in self.extra.items():
            d.setdefault(k, copy.deepcopy(v))
        return d

    def to_dict(self) -> dict[str, Any]:
        """The whole `config.json`: multimodal top level if read from one, else the text-only dict."""
        text = self.to_text_dict()
        if self.multimodal is None:
            return text
        top = copy.deepcopy(self.multimodal)
        top["text_config"] = text
        return top

    @classmethod
    def from_dict(cls, d: dict[str, Any], **overrides: Any) -> "K3Config":
        """Build from a released `config.json` dict (multimodal or text-only); unknown keys are kept."""
        if not isinstance(d, dict):
            raise ValueError(f"config must be a JSON object, got {type(d).__name__}")
        multimodal = None
        if "text_config" in d:
            multimodal = {k: copy.deepcopy(v) for k, v in d.items() if k != "text_config"}
            d = d["text_config"]
        d = copy.deepcopy(d)
        kwargs: dict[str, Any] = {}
        lac = d.get("linear_attn_config")
        if lac is not None:
            if not isinstance(lac, dict):
                raise ValueError("config field linear_attn_config must be an object")
            kwargs.update({name: lac[key] for key, name in _LAC_TO_FIELD.items() if key in lac})
        names = {f.name for f in fields(cls)} - {"extra", "multimodal"} - _LINEAR_ATTN_FIELDS
        extra = {}
        for k, v in d.items():
            if k in names:
                kwargs[k] = v
            else:
                extra[k] = v
        # spec §6.1 / §13.1: what a file that omits these fields means
        kwargs.setdefault("routed_scaling_factor", 1.0)
        kwargs.setdefault("activation_situ_beta", 1.0)
        kwargs.setdefault("activation_situ_linear_beta", None)
        kwargs.update(overrides)
        return cls(**kwargs, extra=extra, multimodal=multimodal)

    @classmethod
    def from_json(cls, path: str | os.PathLike, **overrides: Any) -> "K3Config":
        """Read a `config.json` file, or a checkpoint directory containing one."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no config.json at {path}")
        with open(path, encoding="utf-8") as fh:
            try:
                data = json.load(fh)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} is not valid JSON: {e}") from None
        return cls.from_dict(data, **overrides)

    def save(self, path: str | os.PathLike) -> None:
        """Write `config.json` (to `path` if it is a directory) atomically."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(self.to_dict(), fh, indent=2)
            fh.write("\n")
        os.replace(tmp, path)

    # ------------------------------------------------------------------------------------ presets
    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "K3Config":
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        kwargs = copy.deepcopy({**PRESETS[name], **overrides})
        vision = (kwargs.get("multimodal") or {}).get("vision_config")
        if vision is not None and "hidden_size" in overrides and "multimodal" not in overrides:
            vision["text_hidden_size"] = overrides["hidden_size"]  # the projector follows the text width
        return cls(**kwargs)

    def replace(self, **changes: Any) -> "K3Config":
        """A validated copy with some fields changed."""
        kw = {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self)}
        kw.update(changes)
        return K3Config(**kw)


@dataclass
class K3VisionConfig:
    """MoonViT-V2 + merger + projector configuration: the released `vision_config` (spec §1.2, §9).

    Values other than the released architecture (LayerNorm, biases, other merge or projector types) are rejected
    rather than silently mis-built. Unknown keys (`model_type`, `_attn_implementation`, ...) are kept in `extra`.
    """

    patch_size: int = 14
    vt_hidden_size: int = 1024
    qkv_hidden_size: int = 1536  # heads × head_dim of q, k and v each (wqkv has 3× this many rows)
    vt_num_attention_heads: int = 12
    vt_intermediate_size: int = 4096
    vt_num_hidden_layers: int = 27
    norm_type: str = "rmsnorm"
    mlp_type: str = "mlp2"
    activation_func: str = "gelu_pytorch_tanh"
    attn_bias: bool = False
    linear_bias: bool = False
    patch_embed_proj_bias: bool = False
    pos_emb_type: str = "divided_fixed"
    init_pos_emb_height: int = 64
    init_pos_emb_width: int = 64
    init_pos_emb_time: int = 4  # frames per media item (video chunk), §9.3
    pos_emb_interpolation_mode: str = "bilinear"
    merge_kernel_size: list[int] = field(default_factory=lambda: [2, 2])
    merge_type: str = "sd2_tpool"
    mm_projector_type: str = "patchmergerv2"
    mm_hidden_size: int = 1024
    projector_hidden_act: str = "gelu"
    projector_ln_eps: float = 1e-5
    text_hidden_size: int = 7168
    media_placeholder_token_id: int = 163605
    # [U] §13.10: ViT RMSNorm ε; None = machine epsilon of the compute dtype (the released code's behaviour)
    vt_rms_norm_eps: float | None = None
    rope_theta: float = 10000.0  # 2D RoPE base (§9.5)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    @property
    def head_dim(self) -> int:
        return self.qkv_hidden_size // self.vt_num_attention_heads

    @property
    def merged_hidden_size(self) -> int:
        """Width of one merged token: 2×2 space-to-depth of `mm_hidden_size` (§9.7)."""
        return self.merge_kernel_size[0] * self.merge_kernel_size[1] * self.mm_hidden_size

    def validate(self) -> None:
        def need(ok: bool, name: str, rule: str) -> None:
            if not ok:
                raise ValueError(f"K3VisionConfig.{name}: {rule} (got {getattr(self, name)!r})")

        for name in ("patch_size", "vt_hidden_size", "qkv_hidden_size", "vt_num_attention_heads",
                     "vt_intermediate_size", "vt_num_hidden_layers", "init_pos_emb_height", "init_pos_emb_width",
                     "init_pos_emb_time", "mm_hidden_size", "text_hidden_size"):
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v > 0, name, "must be a positive integer")
        need(self.qkv_hidden_size % self.vt_num_attention_heads == 0, "qkv_hidden_size",
             f"must be a multiple of vt_num_attention_heads={self.vt_num_attention_heads}")
        need(self.head_dim % 4 == 0, "qkv_hidden_size",
             "per-head width must be a multiple of 4 (2D RoPE: column and row pairs, §9.5)")
        need(self.merge_kernel_size == [2, 2], "merge_kernel_size", "only [2, 2] is supported (sd2_tpool, §9.7)")
        need(self.mm_hidden_size == self.vt_hidden_size, "mm_hidden_size",
             f"must equal vt_hidden_size={self.vt_hidden_size} (the merger concatenates ViT outputs)")
        released = {"norm_type": "rmsnorm", "mlp_type": "mlp2", "activation_func": "gelu_pytorch_tanh",
                    "pos_emb_type": "divided_fixed", "pos_emb_interpolation_mode": "bilinear",
                    "merge_type": "sd2_tpool", "mm_projector_type": "patchmergerv2", "projector_hidden_act": "gelu",
                    "attn_bias": False, "linear_bias": False, "patch_embed_proj_bias": False}
        for name, value in released.items():
            need(getattr(self, name) == value, name, f"only the released value {value!r} is supported")
        need(isinstance(self.media_placeholder_token_id, int) and self.media_placeholder_token_id >= 0,
             "media_placeholder_token_id", "must be a token id")
        need(self.projector_ln_eps > 0, "projector_ln_eps", "must be positive")
        need(self.vt_rms_norm_eps is None or self.vt_rms_norm_eps > 0, "vt_rms_norm_eps",
             "must be positive or null (machine epsilon of the compute dtype)")

    def to_dict(self) -> dict[str, Any]:
        """The `vision_config` object; our knobs only when not default, unknown keys kept."""
        d: dict[str, Any] = {"model_type": self.extra.get("model_type", "kimi_k3_vision")}
        for f in fields(self):
            if f.name == "extra" or f.name in _VISION_KNOBS and getattr(self, f.name) == _VISION_KNOBS[f.name]:
                continue
            d[f.name] = copy.deepcopy(getattr(self, f.name))
        for k, v in self.extra.items():
            d.setdefault(k, copy.deepcopy(v))
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], **overrides: Any) -> "K3VisionConfig":
        if not isinstance(d, dict):
            raise ValueError(f"vision_config must be a JSON object, got {type(d).__name__}")
        names = {f.name for f in fields(cls)} - {"extra"}
        kwargs = {k: copy.deepcopy(v) for k, v in d.items() if k in names}
        extra = {k: copy.deepcopy(v) for k, v in d.items() if k not in names}
        if "vt_hidden_size" in kwargs:  # a file that omits mm_hidden_size: the merger reads the ViT's width
            kwargs.setdefault("mm_hidden_size", kwargs["vt_hidden_size"])
        return cls(**{**kwargs, **overrides}, extra=extra)


_VISION_KNOBS = {"vt_rms_norm_eps": None, "rope_theta": 10000.0}


def multimodal_top_level(vision: K3VisionConfig, media_placeholder_token_id: int) -> dict[str, Any]:
    """The top level of a multimodal `config.json` around `text_config` (spec §1.2)."""
    return {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"],
            "vision_config": vision.to_dict(), "media_placeholder_token_id": media_placeholder_token_id,
            "ignore_index": IGNORE_INDEX, "tie_word_embeddings": False}


_LAC_TO_FIELD = {
    "num_heads": "kda_num_heads", "head_dim": "kda_head_dim", "short_conv_kernel_size": "short_conv_kernel_size",
    "kda_layers": "kda_layers", "full_attn_layers": "full_attn_layers", "use_full_rank_gate": "use_full_rank_gate",
    "gate_lower_bound": "gate_lower_bound",
}
_LINEAR_ATTN_FIELDS = frozenset(_LAC_TO_FIELD.values())
_KNOB_DEFAULTS = {"kda_chunk_size": 64, "kda_impl": "chunk", "moe_impl": "grouped", "mla_decode": "absorbed"}


def _k3_structure(num_hidden_layers: int) -> dict[str, Any]:
    """The layer lists of the K3 schedule ([KDA,KDA,KDA,MLA]×n + one final MLA) for any depth."""
    full = k3_full_attn_layers(num_hidden_layers)
    return {
        "num_hidden_layers": num_hidden_layers,
        "full_attn_layers": full,
        "kda_layers": [i for i in range(1, num_hidden_layers + 1) if i not in full],
    }


_TINY_VISION = K3VisionConfig(
    vt_hidden_size=64, qkv_hidden_size=96, vt_num_attention_heads=4, vt_intermediate_size=128,
    vt_num_hidden_layers=2, init_pos_emb_height=16, init_pos_emb_width=16, mm_hidden_size=64, text_hidden_size=128,
    media_placeholder_token_id=390)

PRESETS: dict[str, dict[str, Any]] = {
    # the released numbers (spec §1.1, §1.2): text model, MoonViT-V2 and projector
    "k3-full": {"multimodal": multimodal_top_level(K3VisionConfig(), 163605)},
    # same structure, ~190M parameters: 13 layers = [K,K,K,M]x3 + M, AttnRes blocks of 4 (last one partial)
    "k3-small": {
        **_k3_structure(13), "vocab_size": 32768, "hidden_size": 512, "num_attention_heads": 8,
        "num_key_value_heads": 8, "q_lora_rank": 192, "kv_lora_rank": 128, "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 32, "v_head_dim": 64, "kda_num_heads": 8, "kda_head_dim": 64,
        "intermediate_size": 2048, "num_experts": 32, "num_experts_per_token": 4, "moe_intermediate_size": 512,
        "routed_expert_hidden_size": 256, "attn_res_block_size": 4, "bos_token_id": None, "eos_token_id": None,
        "pad_token_id": None,
    },
    # same structure, < 10M parameters; trains on a CPU: 9 layers = [K,K,K,M]x2 + M, blocks of 4 (last partial)
    "k3-tiny": {
        **_k3_structure(9), "vocab_size": 4096, "hidden_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 48, "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16, "v_head_dim": 24, "kda_num_heads": 4, "kda_head_dim": 32,
        "intermediate_size": 384, "num_experts": 16, "num_experts_per_token": 4, "moe_intermediate_size": 96,
        "routed_expert_hidden_size": 64, "attn_res_block_size": 4, "bos_token_id": None, "eos_token_id": None,
        "pad_token_id": None,
    },
    # a vision-language K3 for the CPU shapes-captioning demo: 5 layers = [K,K,K,M] + M, vocab 400 (384 BPE
    # ranks + 16 special slots: <|media_pad|> is 390), MoonViT-V2 with 2 layers of width 64 (4 heads × 24)
    "k3-tiny-vl": {
        **_k3_structure(5), "vocab_size": 400, "hidden_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 48, "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16, "v_head_dim": 24, "kda_num_heads": 4, "kda_head_dim": 32,
        "intermediate_size": 384, "num_experts": 8, "num_experts_per_token": 2, "moe_intermediate_size": 96,
        "routed_expert_hidden_size": 64, "attn_res_block_size": 4, "bos_token_id": None, "eos_token_id": None,
        "pad_token_id": None, "multimodal": multimodal_top_level(_TINY_VISION, 390),
    },
}
