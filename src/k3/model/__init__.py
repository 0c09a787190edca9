"""The K3 text model, one file per spec section."""

from k3.model.k3 import CausalLMOutput, K3DecoderLayer, K3ForCausalLM, K3Model

__all__ = ["CausalLMOutput", "K3DecoderLayer", "K3ForCausalLM", "K3Model"]
