"""K3's configuration (docs/architecture.md §1): the text model's `K3Config` (`text`), MoonViT-V2's `K3VisionConfig`
(`vision`), the presets and K2's forms (`presets`), and the errors and checks they share (`checks`)."""

from k3.config.checks import ConfigError, show_value, summarize
from k3.config.presets import K2_ARCHITECTURE, PRESETS, k2_form, k2_overrides
from k3.config.text import (FILE_DEFAULTS, TEXT_ARCHITECTURE, K3Config, k3_full_attn_layers, multimodal_top_level,
                            text_only_top_level)
from k3.config.vision import K3VisionConfig

__all__ = ["ConfigError", "FILE_DEFAULTS", "K2_ARCHITECTURE", "K3Config", "K3VisionConfig", "PRESETS",
           "TEXT_ARCHITECTURE", "k2_form", "k2_overrides", "k3_full_attn_layers", "multimodal_top_level", "show_value",
           "summarize", "text_only_top_level"]
