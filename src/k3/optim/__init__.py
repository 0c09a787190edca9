"""Training-time optimisation: Per-Head Muon + AdamW partition, QK-Clip, learning-rate schedules (docs/architecture.md §8)."""

from k3.optim.groups import build_param_groups, make_optimizers
from k3.optim.muon import Muon, newton_schulz5, orthogonalized_update
from k3.optim.qk_clip import MaxLogitRecorder, mla_layers, mla_max_logits, qk_clip_
from k3.optim.schedule import cosine_with_warmup, set_lr, wsd

__all__ = [
    "MaxLogitRecorder", "Muon", "build_param_groups", "cosine_with_warmup", "make_optimizers", "mla_layers", "mla_max_logits",
    "newton_schulz5", "orthogonalized_update", "qk_clip_", "set_lr", "wsd",
]
