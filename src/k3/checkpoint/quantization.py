"""Which form a checkpoint's routed experts take, as its `config.json` says (docs/architecture.md §11.5).

The released checkpoint stores the routed experts in MXFP4 and says so with a compressed-tensors
`quantization_config` (`format: "mxfp4-pack-quantized"`), in `text_config` and at the top level; every other
tensor is bf16 or fp32. A config without it has dense experts. A model built from a config takes its experts' form
from it, so `with_experts_format` is how a caller chooses another one.
"""

from __future__ import annotations

from typing import Any

from k3.config import K3Config

MXFP4_FORMAT = "mxfp4-pack-quantized"
EXPERT_FORMS = ("dense", "mxfp4")

EXPERT_TARGETS = r"re:.*experts\.\d+\.w[123]$"
"""The module names the MXFP4 group covers: the routed experts' w1 (gate), w3 (up) and w2 (down), §11.4 item 8."""


def mxfp4_quantization_config() -> dict[str, Any]:
    """The compressed-tensors `quantization_config` of routed experts in MXFP4: FP4 (E2M1) weights in groups of 32
    along the input, one shared E8M0 exponent per group, weight-only, stored packed."""
    return {
        "quant_method": "compressed-tensors",
        "format": MXFP4_FORMAT,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": [EXPERT_TARGETS],
                "format": MXFP4_FORMAT,
                "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32,
                            "symmetric": True, "dynamic": False, "scale_dtype": "torch.uint8"},
                "input_activations": None,
                "output_activations": None,
            }
        },
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "sparsity_config": {},
    }


def experts_format(config: K3Config) -> str:
    """"mxfp4" where the config's `quantization_config` (text or top level) declares the packed MXFP4 format,
    else "dense"."""
    for section in (config.extra, config.multimodal or {}):
        quantization = section.get("quantization_config")
        if isinstance(quantization, dict) and quantization.get("format") == MXFP4_FORMAT:
            return "mxfp4"
    return "dense"


def with_experts_format(config: K3Config, experts: str) -> K3Config:
    """`config` declaring routed experts in `experts` form, in `text_config` and at the top level alike: "dense"
    without `quantization_config`; "mxfp4" with the config's own MXFP4 one where it has one, else
    `mxfp4_quantization_config()`."""
    if experts not in EXPERT_FORMS:
        raise ValueError(f"experts must be one of {', '.join(EXPERT_FORMS)}, got {experts!r}")
    quantization = None
    if experts == "mxfp4":
        declared = [s["quantization_config"] for s in (config.extra, config.multimodal or {})
                    if isinstance(s.get("quantization_config"), dict)
                    and s["quantization_config"].get("format") == MXFP4_FORMAT]
        quantization = declared[0] if declared else mxfp4_quantization_config()

    def section(d: dict[str, Any]) -> dict[str, Any]:
        d = {k: v for k, v in d.items() if k != "quantization_config"}
        return d if quantization is None else {**d, "quantization_config": quantization}

    return config.replace(extra=section(config.extra),
                          multimodal=None if config.multimodal is None else section(config.multimodal))
