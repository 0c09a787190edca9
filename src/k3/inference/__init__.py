"""Inference: caches (and, later, generation)."""
