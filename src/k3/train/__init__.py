"""Training: Quantile Balancing of the router biases (balance.py, spec §7)."""
