"""Kimi Delta Attention core (docs/architecture.md §3.4–§3.6).

`recurrent_kda` is the token-by-token reference (and the one-token decode path); `chunk_kda` is the
chunkwise-parallel algorithm used for every multi-token call, one autograd Function with a hand-derived backward
(`function.ChunkKDAFunction`). Both share one signature and return
(o [B,T,H,V] in q's dtype, final state [B,H,K,V] in the compute dtype, or None). `delta_rule` is the entry a layer
calls: it picks among them and fla's GPU kernels (`k3.ops.kda.core`).
"""

from k3.ops.kda.chunk import chunk_kda
from k3.ops.kda.naive import recurrent_kda
from k3.ops.kda.core import delta_rule

__all__ = ["chunk_kda", "delta_rule", "recurrent_kda"]
