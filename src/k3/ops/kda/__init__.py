"""Kimi Delta Attention core (docs/architecture.md §3.4–§3.6).

`recurrent_kda` is the token-by-token reference (and the one-token decode path); `chunk_kda` is the
chunkwise-parallel algorithm used for every multi-token call, one autograd Function with a hand-derived backward
(`function.ChunkKDAFunction`). Both share one signature and return
(o [B,T,H,V] in q's dtype, final state [B,H,K,V] in the compute dtype, or None).
"""

from k3.ops.kda.chunk import chunk_kda
from k3.ops.kda.naive import recurrent_kda

__all__ = ["chunk_kda", "recurrent_kda"]
