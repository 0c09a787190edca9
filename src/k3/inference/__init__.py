"""Inference: caches (cache.py) and autoregressive generation (generate.py)."""
