"""Serving: an OpenAI-compatible HTTP server over the continuous-batching engine (`k3 serve`; the `serve` extra)."""
