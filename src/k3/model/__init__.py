"""The K3 model, one file per spec section."""

from k3.model.k3 import CausalLMOutput, K3DecoderLayer, K3ForCausalLM, K3Model

__all__ = ["CausalLMOutput", "K3DecoderLayer", "K3ForCausalLM", "K3ForConditionalGeneration", "K3Model"]


def __getattr__(name: str):
    # imported on first use: k3.model.multimodal needs k3.vision, whose modules import k3.model.norm (PEP 562)
    if name == "K3ForConditionalGeneration":
        from k3.model.multimodal import K3ForConditionalGeneration

        return K3ForConditionalGeneration
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
