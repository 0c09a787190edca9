"""K3 text configuration (docs/architecture.md §1.1, §1.3, §1.4).

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

from k3.config.checks import ConfigError, check_field_types, show_value, summarize
from k3.config.vision import K3VisionConfig
from k3.fileio import atomic_write
from k3.ops.loss import IGNORE_INDEX


def k3_full_attn_layers(num_hidden_layers: int) -> list[int]:
    """1-based MLA layer list of the K3 schedule (§1.4): every 4th layer plus the final layer."""
    layers = [i for i in range(4, num_hidden_layers + 1, 4)]
    if num_hidden_layers not in layers:
        layers.append(num_hidden_layers)
    return layers


@dataclass
class K3Config:
    """Text-model configuration. Attribute names follow the released `text_config` (§1.1)."""

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
    # the context length a converter writes (llama.cpp's `kimi-k3.context_length`, which it requires): the release's
    # 1M, and that of every K3 preset; the model sets no limit of its own (NoPE MLA, KDA). None: the file has none
    max_position_embeddings: int | None = 1048576
    initializer_range: float = 0.02  # [U] §13.8
    bos_token_id: int | None = 163584  # [U] §10
    eos_token_id: int | None = 163586  # [U]
    pad_token_id: int | None = 163839  # [U]
    # our non-architectural knobs (§1.3); written to JSON only when not default
    kda_chunk_size: int = 64
    # switches back to Kimi K2's forms (§14), written to JSON only when off; with `mla_use_nope = false` (RoPE),
    # `hidden_act = "silu"` (SwiGLU) and `latent_moe_use_norm = false` they make the K2 baseline
    use_block_attn_res: bool = True  # false: plain pre-norm residual stream x + f(norm(x)) (§14.3)
    use_latent_moe: bool = True  # false: routed experts at full width, no down/up projection (§14.4)
    # everything else in the file (model_type, rope_theta, quantization_config, ...) kept verbatim
    extra: dict[str, Any] = field(default_factory=dict)
    # when read from a multimodal file: the top level without `text_config` (has `vision_config`)
    multimodal: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.validate()

    @property
    def vision_config(self) -> K3VisionConfig | None:
        """The parsed `vision_config` of a multimodal file (§1.2), None for a text-only model."""
        if self.multimodal is None or "vision_config" not in self.multimodal:
            return None
        vision = self.multimodal["vision_config"]
        missing = {} if not isinstance(vision, dict) or "text_hidden_size" in vision else \
            {"text_hidden_size": self.hidden_size}  # the projector's output width is the text width
        return K3VisionConfig.from_dict(vision, **missing)

    @property
    def media_placeholder_token_id(self) -> int | None:
        """Id of `<|media_pad|>`, the one-per-item placeholder expanded to image features (§9.9)."""
        if self.multimodal is None:
            return None
        if "media_placeholder_token_id" in self.multimodal:
            return self.multimodal["media_placeholder_token_id"]
        vision = self.vision_config  # the top level omits it: the vision_config's copy, if any
        return None if vision is None else vision.media_placeholder_token_id

    # ----------------------------------------------------------------------------------- schedule
    def is_kda_layer(self, i: int) -> bool:
        """0-based layer i is KDA iff i+1 is listed in `kda_layers` (§0.3)."""
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

    @property
    def rope_theta(self) -> float:
        """RoPE base of the K2-form MLA (`mla_use_nope = false`, §14.2): the file's `rope_theta`, else 10000."""
        return float(self.extra.get("rope_theta", 10000.0))

    # --------------------------------------------------------------------------------- validation
    def validate(self) -> None:
        """Raise `ConfigError` (a `ValueError`) naming the field and the rule it breaks."""

        def need(ok: bool, name: str, rule: str) -> None:
            if not ok:
                problem = f"{rule} (got {show_value(getattr(self, name))})"
                raise ConfigError(f"K3Config.{name} {problem}", name, problem)

        check_field_types(self)

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
        need(self.mla_use_nope or self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim",
             "must be even for the rotary embedding of mla_use_nope = false (§14.2)")
        need(self.use_latent_moe or self.routed_expert_hidden_size == self.hidden_size, "routed_expert_hidden_size",
             f"must equal hidden_size={self.hidden_size} when use_latent_moe is false (experts at full width)")
        L = self.num_hidden_layers
        for name in ("kda_layers", "full_attn_layers"):
            v = getattr(self, name)
            need(isinstance(v, (list, tuple)) and all(isinstance(x, int) for x in v), name,
                 "must be a list of 1-based layer numbers")
            need(len(set(v)) == len(v), name, "must not repeat a layer")
            need(all(1 <= x <= L for x in v), name, f"entries must lie in 1..num_hidden_layers={L}")
        shared = sorted(set(self.kda_layers) & set(self.full_attn_layers))
        need(not shared, "kda_layers", f"must not share layers with full_attn_layers (both list {summarize(shared)})")
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
             "must be 'sigmoid' (the released value, the only one supported)")
        need(self.topk_method == "noaux_tc", "topk_method",
             "must be 'noaux_tc' (the released value, the only one supported)")
        need(self.gate_lower_bound is None or self.gate_lower_bound < 0, "gate_lower_bound",
             "must be negative (or null for the softplus decay form)")
        need(isinstance(self.activation_situ_beta, (int, float)) and self.activation_situ_beta > 0,
             "activation_situ_beta", "must be positive (a file that omits it means 1.0, §6.1)")
        need(self.activation_situ_linear_beta is None or self.activation_situ_linear_beta > 0,
             "activation_situ_linear_beta", "must be positive or null (uncapped)")
        need(self.rms_norm_eps > 0, "rms_norm_eps", "must be positive")
        need(self.max_position_embeddings is None or self.max_position_embeddings > 0, "max_position_embeddings",
             "must be a positive integer or null")
        need(self.routed_scaling_factor > 0, "routed_scaling_factor", "must be positive")
        need(self.tie_word_embeddings is False, "tie_word_embeddings", "must be false (K3 has an untied lm_head)")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            v = getattr(self, name)
            need(v is None or 0 <= v < self.vocab_size, name, f"must be a token id in 0..{self.vocab_size - 1}")
        if self.multimodal is not None:
            self._validate_top_level(self.multimodal)

    def _validate_top_level(self, top: dict[str, Any]) -> None:
        """The entries of a multimodal top level that the model reads: `vision_config`, the placeholder id."""

        def need(ok: bool, key: str, problem: str) -> None:  # `key` as written in config.json
            if not ok:
                raise ConfigError(f"K3Config.multimodal: {key} {problem}", key, problem)

        token = top.get("media_placeholder_token_id")
        need(token is None or isinstance(token, int) and not isinstance(token, bool) and token >= 0,
             "media_placeholder_token_id", f"must be a token id (a non-negative integer), got {show_value(token)}")
        if "vision_config" in top:
            vision = self.vision_config  # raises on a malformed vision_config
            need(vision.text_hidden_size == self.hidden_size, "vision_config.text_hidden_size",
                 f"must equal the text hidden_size={self.hidden_size} (got {vision.text_hidden_size})")

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
            if f.name in _KNOB_DEFAULTS and v == _KNOB_DEFAULTS[f.name] or v is None and f.name in _OMITTED_WHEN_NONE:
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
        """Build from a released `config.json` dict (multimodal or text-only); unknown keys are kept.

        Every field the model reads must be in the file (`_REQUIRED_KEYS`, `_REQUIRED_LINEAR_ATTN_KEYS`) except
        those of `FILE_DEFAULTS`, whose omission has a documented meaning. Errors (`ConfigError`) name the key as
        it is written in the file, e.g. `text_config.linear_attn_config.num_heads`.
        """
        if not isinstance(d, dict):
            raise ConfigError(f"the top level must be a JSON object, got {show_value(d)}")
        multimodal = None
        where = ""  # the path of the text fields in the file
        if "text_config" in d:
            multimodal = {k: copy.deepcopy(v) for k, v in d.items() if k != "text_config"}
            d, where = d["text_config"], "text_config."
            if not isinstance(d, dict):
                raise ConfigError(f"text_config must be an object, got {show_value(d)}", "text_config")
        d = copy.deepcopy(d)
        kwargs: dict[str, Any] = {}
        lac = d.get("linear_attn_config")
        if "linear_attn_config" in d:
            if not isinstance(lac, dict):
                raise ConfigError(f"{where}linear_attn_config must be an object, got {show_value(lac)}")
            kwargs.update({name: lac[key] for key, name in _LAC_TO_FIELD.items() if key in lac})
        missing = [key for key in _REQUIRED_KEYS if key not in d and key not in overrides]
        if isinstance(lac, dict):
            missing += [f"linear_attn_config.{key}" for key in _REQUIRED_LINEAR_ATTN_KEYS
                        if key not in lac and _LAC_TO_FIELD[key] not in overrides]
        elif not _LINEAR_ATTN_FIELDS.issubset(overrides):
            missing.append("linear_attn_config")
        if missing:
            keys = summarize([where + key for key in missing], limit=len(missing))  # all of them: a short list
            raise ConfigError(f"missing required key{'s' if len(missing) > 1 else ''} {keys} (shape and architecture "
                              "fields have no default)")
        names = {f.name for f in fields(cls)} - {"extra", "multimodal"} - _LINEAR_ATTN_FIELDS
        extra = {}
        for k, v in d.items():
            if k in names:
                kwargs[k] = v
            else:
                extra[k] = v
        kwargs = {**FILE_DEFAULTS, **kwargs, **overrides}
        try:
            return cls(**kwargs, extra=extra, multimodal=multimodal)
        except ConfigError as e:
            if e.field is None:
                raise
            key = e.field
            if key in names or key in _LINEAR_ATTN_FIELDS:  # a text field: its place in the file
                key = where + (f"linear_attn_config.{_FIELD_TO_LAC[key]}" if key in _FIELD_TO_LAC else key)
            raise ConfigError(f"{key} {e.problem}", key, e.problem) from None

    @classmethod
    def from_json(cls, path: str | os.PathLike, **overrides: Any) -> "K3Config":
        """Read a `config.json` file, or a checkpoint directory containing one.

        Raises `FileNotFoundError` if there is none, `ConfigError` (naming the file and the key) if it is not a
        valid config; a file that is not a `.json` (e.g. a `.safetensors` given for its directory) is refused.
        """
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        elif os.path.isfile(path) and not path.endswith(".json"):
            raise ConfigError(f"{path} is a file; expected a checkpoint directory with config.json (or a config.json "
                              "file)")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no config.json at {path}")
        try:
            with open(path, encoding="utf-8") as fh:
                data = json.load(fh)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        try:
            return cls.from_dict(data, **overrides)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}", e.field, e.problem) from None

    def save(self, path: str | os.PathLike) -> None:
        """Write `config.json` (to `path` if it is a directory) atomically."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        atomic_write(path, json.dumps(self.to_dict(), indent=2) + "\n")

    # ------------------------------------------------------------------------------------ presets
    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "K3Config":
        from k3.config.presets import PRESETS, k3_structure, mla_structure  # the presets are built from this class

        if name not in PRESETS:
            raise ConfigError(f"unknown preset {show_value(name)}; choose one of "
                              f"{summarize(sorted(PRESETS), limit=len(PRESETS))}")
        kwargs = copy.deepcopy({**PRESETS[name], **overrides})
        if "num_hidden_layers" in overrides and not {"kda_layers", "full_attn_layers"} & set(overrides):
            # a new depth keeps the preset's schedule: K3's 3:1 pattern, or MLA everywhere (kimi-k2)
            hybrid = bool(PRESETS[name].get("kda_layers", True))
            kwargs.update((k3_structure if hybrid else mla_structure)(overrides["num_hidden_layers"]))
        vision = (kwargs.get("multimodal") or {}).get("vision_config")
        if vision is not None and "hidden_size" in overrides and "multimodal" not in overrides:
            vision["text_hidden_size"] = overrides["hidden_size"]  # the projector follows the text width
        return cls(**kwargs)

    def released_layout(self) -> "K3Config":
        """This config as the released checkpoint lays it out: a multimodal config unchanged; a text-only one
        inside the multimodal top level (`kimi_k3`, `KimiK3ForConditionalGeneration`, no `vision_config`, see
        `text_only_top_level`) with `architectures: ["KimiLinearForCausalLM"]` in its `text_config` (§1.1, §1.2).

        Converters identify a K3 checkpoint by that top level (llama.cpp registers its K3 converter only under
        `KimiK3ForConditionalGeneration`, and reads the text tensors under `language_model.`); a Kimi-Linear
        style top level sends them down the Kimi-Linear path. `save_pretrained` writes this form.

        It always states a context length: a config read from a file without `max_position_embeddings` gets the
        field's default (1,048,576), since llama.cpp refuses a GGUF without `kimi-k3.context_length`.
        """
        context = self.max_position_embeddings or K3Config.max_position_embeddings
        if self.multimodal is not None:
            return self if context == self.max_position_embeddings else self.replace(max_position_embeddings=context)
        extra = {**self.extra, "architectures": self.extra.get("architectures", [TEXT_ARCHITECTURE])}
        return self.replace(extra=extra, multimodal=text_only_top_level(), max_position_embeddings=context)

    def replace(self, **changes: Any) -> "K3Config":
        """A validated copy with some fields changed."""
        kw = {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self)}
        kw.update(changes)
        return K3Config(**kw)


def multimodal_top_level(vision: K3VisionConfig, media_placeholder_token_id: int) -> dict[str, Any]:
    """The top level of a multimodal `config.json` around `text_config` (§1.2)."""
    return {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"],
            "vision_config": vision.to_dict(), "media_placeholder_token_id": media_placeholder_token_id,
            "ignore_index": IGNORE_INDEX, "tie_word_embeddings": False}


TEXT_ARCHITECTURE = "KimiLinearForCausalLM"
"""`architectures` of the released `text_config` (§1.1)."""


def text_only_top_level() -> dict[str, Any]:
    """The multimodal top level of a text-only K3 checkpoint: that of the release (§1.2) without
    `vision_config` and `media_placeholder_token_id` (a text model has no media)."""
    return {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"],
            "ignore_index": IGNORE_INDEX, "tie_word_embeddings": False}


_LAC_TO_FIELD = {
    "num_heads": "kda_num_heads", "head_dim": "kda_head_dim", "short_conv_kernel_size": "short_conv_kernel_size",
    "kda_layers": "kda_layers", "full_attn_layers": "full_attn_layers", "use_full_rank_gate": "use_full_rank_gate",
    "gate_lower_bound": "gate_lower_bound",
}
_LINEAR_ATTN_FIELDS = frozenset(_LAC_TO_FIELD.values())
_FIELD_TO_LAC = {name: key for key, name in _LAC_TO_FIELD.items()}
_KNOB_DEFAULTS = {"kda_chunk_size": 64, "use_block_attn_res": True, "use_latent_moe": True}

FILE_DEFAULTS: dict[str, Any] = {
    "activation_situ_beta": 1.0,  # §6.1: a file without β₁ means 1.0
    "activation_situ_linear_beta": None,  # §6.1: without β₂ the up projection is uncapped
    "routed_scaling_factor": 1.0,  # §13.1: read from the file, 1.0 if absent
    "use_grouped_topk": True,  # a no-op with num_expert_group = topk_group = 1 (§1.1); not read by the model
    "initializer_range": 0.02,  # init only (§13.8), not read when loading weights
    "max_position_embeddings": None,  # informational: a file without it is written back without it
    "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,  # informational (the tokenizer has its own)
    **_KNOB_DEFAULTS,  # our non-architectural knobs (§1.3), written only when they differ from these
}
"""What a `config.json` that omits a field means. Every other field is required in a file (`from_dict`): a
missing shape or architecture field must not silently take the k3-full value. The constructor and the presets
keep the field defaults (the released values)."""

_OMITTED_WHEN_NONE = frozenset({"max_position_embeddings"})
"""Fields whose None (a file that lacks the key) is written as no key at all, so such a file round-trips verbatim."""

_REQUIRED_KEYS = tuple(f.name for f in fields(K3Config) if f.name not in FILE_DEFAULTS
                       and f.name not in ("extra", "multimodal") and f.name not in _LINEAR_ATTN_FIELDS)
"""`text_config` keys a file must have: those the forward pass reads (shapes, layer schedule, FFN and router
form, norms) and the released-value checks (`mla_use_nope`, `topk_method`, `tie_word_embeddings`, ...)."""
_REQUIRED_LINEAR_ATTN_KEYS = tuple(_LAC_TO_FIELD)
"""`linear_attn_config` keys a file must have: all of the KDA ones."""
