"""Numerical core operators of the K3 model (pure PyTorch, differentiable with plain autograd)."""
