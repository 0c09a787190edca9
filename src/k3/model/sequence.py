"""Where a call's tokens sit in their sequence: the whole of it (one process), or one rank's contiguous share of
it under context parallelism (`k3.parallel.context`; docs/architecture.md, "Scale-out", "Context parallelism").

The three places where K3's sequence mixers read other tokens go through this object, so the model stays one code
path: the short convolution (its window reaches W−1 inputs before the call), the KDA core (from the state entering
the call), and the MLA keys (the latents of every position up to the call's last). For a whole sequence each is
the caller's own computation.

Shape suffixes (`x_BTD`): the package-wide legend at the top of docs/architecture.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from k3.model.cache import K3Cache, StepContext

# run(q, k, v, g, beta, initial_state, output_final_state) -> (o [B,T,H,V], final state [B,H,K,V] or None)
DeltaRule = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
# run(x [B,T,P], context_BWP=..., document_ids_BT=...) -> (output [B,T,P], the last W−1 inputs [B,W−1,P])
ShortConv = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class WholeSequence:
    """The call's tokens are the whole sequence (or its continuation from a cache): nothing to exchange."""

    def place(self, ctx: StepContext, cache: K3Cache | None, T: int) -> StepContext:
        """The call's context (T new tokens) with this object as its `sequence` (a shard also moves `ctx.start` to
        its offset in the sequence)."""
        ctx.sequence = self
        return ctx

    def short_conv(self, run: ShortConv, x_BTP: torch.Tensor, context_BWP: torch.Tensor | None,
                   document_ids_BT: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The short convolution of x after `context` (the W−1 inputs before it; None: a fresh sequence)."""
        return run(x_BTP, context_BWP=context_BWP, document_ids_BT=document_ids_BT)

    def delta_rule(self, run: DeltaRule, q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, state_BHKV,
                   output_final_state: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The KDA core over the call's tokens, from `state` (None: zeros)."""
        return run(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, state_BHKV, output_final_state)

    def keys(self, latent_BSL: torch.Tensor, document_ids_BT: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The MLA latents of every position up to the call's last one and their documents (packed rows), given
        the call's own."""
        return latent_BSL, document_ids_BT
