"""The K3 model, one file per component (docs/architecture.md)."""

from k3.model.k3 import CausalLMOutput, K3DecoderLayer, K3ForCausalLM, K3Model
from k3.model.multimodal import K3ForConditionalGeneration

__all__ = ["CausalLMOutput", "K3DecoderLayer", "K3ForCausalLM", "K3ForConditionalGeneration", "K3Model"]
