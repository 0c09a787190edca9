"""Training: Quantile Balancing of the router biases (balance.py, docs/architecture.md §7)."""
