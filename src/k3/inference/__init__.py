"""Inference: autoregressive generation over the model's caches (`k3.model.cache`)."""

from k3.inference.generate import generate, sample_next_token

__all__ = ["generate", "sample_next_token"]
