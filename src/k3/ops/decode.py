"""The operations of a one-token step, compiled (`decode_kernel.cpp`, docs/architecture.md §0.6).

A decode step of a small model spends most of its CPU time on the per-call cost of small operations, not on their
arithmetic: an RMSNorm is five torch operations, an AttnRes mix about forty, the KDA step after its projections
about a hundred. The decode kernel does each as one compiled call for the calls of decoding — fp32 or bf16 CPU
tensors, at most `MAX_ROWS` rows, no autograd — and its `layer_step` runs them for a whole decoder layer
(`k3.inference.compiled_step`). Here each operation can be called alone: the norms and the AttnRes mix by the ops
that serve the modules (`k3.ops.norm`), the KDA step, the MLA step and the routed MoE by the tests (against their
formula, their fp32 values, their one-row calls); the layer step is tested against the modules. Each returns None
for a call it does not serve.

A bf16 model's calls (bf16 weights, activations and caches; the §0.4 tensors fp32) compute in fp32: weight matrices
and caches are read as stored (bf16 widened exactly: half the bytes of fp32), activations widened once, and each
result is rounded once to the dtype the torch ops would return (the activation's; the plain norms' fp32), where the
torch ops round after every operation.
"""
# Shape suffixes (`x_BTD`): the package-wide legend at the top of docs/architecture.md.
# Here: N rows, C channels, S sources.

from __future__ import annotations

import torch

from k3.ops import compiled, mxfp4
from k3.ops.experts import ExpertWeight


DTYPES = (torch.float32, torch.bfloat16)  # what the kernel reads, tensor by tensor
MAX_ROWS = compiled.MAX_ROWS  # a batching server's 16 sequences decode as one call per layer


def serves(rows: int, *tensors: torch.Tensor) -> bool:
    """Whether the decode kernel takes a call of `rows` rows on `tensors` (`compiled.serves_few_rows`)."""
    return compiled.serves_few_rows("decode", rows, *tensors, dtypes=DTYPES)


def rms_norm(x_NC: torch.Tensor, weight_C: torch.Tensor | None, eps: float, mean: bool = True) -> torch.Tensor | None:
    """weight ⊙ x / sqrt(mean(x²) + ε) over the last axis (`mean=False`: Σ x², the L2 norm; no weight: no gain);
    in x's dtype with a weight (`RMSNorm`), fp32 without (`rms_normalize`, `l2_normalize`)."""
    if not serves(compiled.rows(x_NC), x_NC, *(() if weight_C is None else (weight_C,))):
        return None
    return compiled.load("decode").rms_norm(x_NC.contiguous(), None if weight_C is None else weight_C.contiguous(),
                                            eps, mean)


def attn_res_mix(sources: list[torch.Tensor], gain_D: torch.Tensor, query_D: torch.Tensor,
                 eps: float) -> torch.Tensor | None:
    """Σ_s softmax_s((V_s·(γ⊙w)) / sqrt(mean(V_s²) + ε)) V_s of same-shaped sources (k3.model.attn_res)."""
    same_shape = len({tuple(V.shape) for V in sources}) == 1
    if not same_shape or not serves(compiled.rows(sources[0]), *sources, gain_D, query_D):
        return None
    return compiled.load("decode").attn_res_mix([V.contiguous() for V in sources], gain_D.contiguous(),
                                                query_D.contiguous(), eps)


def kda_step(q_NP: torch.Tensor, k_NP: torch.Tensor, v_NP: torch.Tensor, conv_state_N3WP: torch.Tensor,
             conv_weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor], f_NP: torch.Tensor, A_log_H: torch.Tensor,
             dt_bias_P: torch.Tensor, lower_bound: float | None, b_NH: torch.Tensor, state_NHKK: torch.Tensor,
             z_NP: torch.Tensor, o_norm_weight_K: torch.Tensor, eps: float) -> torch.Tensor:
    """One KDA decode step after the projections (k3.model.kda): short conv + SiLU of q, k, v (their windows
    in `conv_state` shifted in place), L2 norms, decay, β = σ(b), the delta-rule update of `state` in place, and
    the gated norm. Returns [N, P], the input of `o_proj`. The caller checks `serves` first (N rows, the caches)."""
    return compiled.load("decode").kda_step(
        q_NP.contiguous(), k_NP.contiguous(), v_NP.contiguous(), conv_state_N3WP,
        *(w.contiguous() for w in conv_weights), f_NP.contiguous(), A_log_H.contiguous(), dt_bias_P.contiguous(),
        lower_bound is not None, 0.0 if lower_bound is None else lower_bound, b_NH.contiguous(), state_NHKK,
        z_NP.contiguous(), o_norm_weight_K.contiguous(), eps)


def moe_routed(x_ND: torch.Tensor, z_NL: torch.Tensor, gate_weight_ED: torch.Tensor, bias_E: torch.Tensor,
               w1_EML: ExpertWeight, w3_EML: ExpertWeight, w2_ELM: ExpertWeight, k: int, renormalize: bool,
               scaling: float, betas: tuple[float, float | None] | None) -> torch.Tensor | None:
    """Router and routed experts of a MoE layer (k3.model.moe): top-k of σ(x Wᵀ) + bias, weights from the unbiased
    scores (renormalised, scaled), r = Σ_e w_e · W2_e act(W1_e z, W3_e z) accumulated in fp32, [N, L] in z's dtype.
    The expert weights dense (fp32 or bf16) or MXFP4 (each block decoded in registers, `k3/ops/mxfp4.h`). `betas` =
    (β₁, β₂) for SiTU-GLU (β₂ None: uncapped), None for SwiGLU."""
    experts = [_expert_pair(w) for w in (w1_EML, w3_EML, w2_ELM)]
    dense = [w for w, scale in experts if scale is None]
    packed = [t for w, scale in experts if scale is not None for t in (w, scale)]
    if (not all(type(t) is torch.Tensor and t.is_cpu for t in packed)
            or not serves(compiled.rows(x_ND), x_ND, z_NL, gate_weight_ED, bias_E, *dense)):
        return None
    beta1, beta2 = betas or (0.0, 0.0)
    (w1, s1), (w3, s3), (w2, s2) = experts
    return compiled.load("decode").moe_routed(x_ND.contiguous(), z_NL.contiguous(), gate_weight_ED.contiguous(),
                                              bias_E.contiguous(), w1, w3, w2, s1, s3, s2, k, renormalize, scaling,
                                              betas is not None, beta1, 0.0 if beta2 is None else beta2)


def _expert_pair(weight: ExpertWeight) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dense weight, None) or (packed bytes, scales) of an MXFP4 weight, contiguous, as the kernel takes them."""
    if isinstance(weight, mxfp4.MXFP4Weight):
        return weight.weight_packed.contiguous(), weight.weight_scale.contiguous()
    return weight.contiguous(), None


def mla_step(q_BHQ: torch.Tensor, latent_BSL: torch.Tensor, length: int, kv_b_weight: torch.Tensor,
             nope_dim: int, v_dim: int, gate_BP: torch.Tensor | None, scale: float,
             first_B: torch.Tensor | None = None) -> torch.Tensor:
    """One absorbed-MLA step (k3.model.mla, §4.4) of q = [q_nope ‖ q_pe] over the first `length` positions of the
    latent cache [B, capacity, C+R] (row b's from `first_B[b]` on, where given: left padding): softmax([W_UKᵀ q_nope ‖
    q_pe]·latent·scale), o = W_UV Σ p ĉ, times σ(gate) when given; [B, H·Vh]. The caller checks `serves` first."""
    return compiled.load("decode").mla_step(q_BHQ.contiguous(), latent_BSL, length, kv_b_weight.contiguous(),
                                            nope_dim, v_dim,
                                            None if gate_BP is None else gate_BP.contiguous(), scale, first_B)
