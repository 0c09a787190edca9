"""MoonViT-V2 + merger + projector configuration: the released `vision_config` (docs/architecture.md §1.2, §9)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields
from typing import Any

from k3.config.checks import ConfigError, check_field_types, show_value


@dataclass
class K3VisionConfig:
    """MoonViT-V2 + merger + projector configuration: the released `vision_config` (§1.2, §9).

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
                problem = f"{rule} (got {show_value(getattr(self, name))})"
                raise ConfigError(f"K3VisionConfig.{name} {problem}", f"vision_config.{name}", problem)

        check_field_types(self, "vision_config.")

        for name in ("patch_size", "vt_hidden_size", "qkv_hidden_size", "vt_num_attention_heads",
                     "vt_intermediate_size", "vt_num_hidden_layers", "init_pos_emb_height", "init_pos_emb_width",
                     "init_pos_emb_time", "mm_hidden_size", "text_hidden_size"):
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v > 0, name, "must be a positive integer")
        need(self.qkv_hidden_size % self.vt_num_attention_heads == 0, "qkv_hidden_size",
             f"must be a multiple of vt_num_attention_heads={self.vt_num_attention_heads}")
        need(self.head_dim % 4 == 0, "qkv_hidden_size",
             "per-head width must be a multiple of 4 (2D RoPE: column and row pairs, §9.5)")
        need(list(self.merge_kernel_size) == [2, 2], "merge_kernel_size",
             "must be [2, 2], the only size supported (sd2_tpool, §9.7)")
        need(self.mm_hidden_size == self.vt_hidden_size, "mm_hidden_size",
             f"must equal vt_hidden_size={self.vt_hidden_size} (the merger concatenates ViT outputs)")
        released = {"norm_type": "rmsnorm", "mlp_type": "mlp2", "activation_func": "gelu_pytorch_tanh",
                    "pos_emb_type": "divided_fixed", "pos_emb_interpolation_mode": "bilinear",
                    "merge_type": "sd2_tpool", "mm_projector_type": "patchmergerv2", "projector_hidden_act": "gelu",
                    "attn_bias": False, "linear_bias": False, "patch_embed_proj_bias": False}
        for name, value in released.items():
            need(getattr(self, name) == value, name,
                 f"must be {show_value(value)}, the released value (the only one supported)")
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
            problem = f"must be an object, got {show_value(d)}"
            raise ConfigError(f"vision_config {problem}", "vision_config", problem)
        names = {f.name for f in fields(cls)} - {"extra"}
        kwargs = {k: copy.deepcopy(v) for k, v in d.items() if k in names}
        extra = {k: copy.deepcopy(v) for k, v in d.items() if k not in names}
        if "vt_hidden_size" in kwargs:  # a file that omits mm_hidden_size: the merger reads the ViT's width
            kwargs.setdefault("mm_hidden_size", kwargs["vt_hidden_size"])
        return cls(**{**kwargs, **overrides}, extra=extra)


_VISION_KNOBS = {"vt_rms_norm_eps": None, "rope_theta": 10000.0}
