"""Quantisation-aware training of the routed experts in MXFP4 (k3.train.qat, docs/architecture.md §11.5)."""

import pytest
import torch

from k3 import K3Config
from k3.checkpoint.hf import convert_experts
from k3.checkpoint.quantization import with_experts_format
from k3.model import K3ForCausalLM
from k3.model.moe import RoutedExperts
from k3.ops.mxfp4 import decode_mxfp4, encode_mxfp4
from k3.train.args import TrainArgs
from k3.train.qat import MXFP4QATRoutedExperts, apply_mxfp4_qat

IDS = torch.randint(0, 4096, (2, 24), generator=torch.Generator().manual_seed(0))


def _model(**overrides):
    torch.manual_seed(0)
    return K3ForCausalLM(K3Config.from_preset("k3-tiny", num_hidden_layers=3, **overrides))


def test_the_trained_forward_is_the_packed_export():
    """A QAT model computes what its MXFP4 export computes (same encoder), prefill and one-token steps alike."""
    model = _model()
    assert apply_mxfp4_qat(model) == 2  # the MoE layers (layer 0 is dense)
    assert all(type(m) is MXFP4QATRoutedExperts for m in model.modules() if isinstance(m, RoutedExperts))
    packed = K3ForCausalLM(with_experts_format(model.config, "mxfp4"))
    packed.load_state_dict(convert_experts(model.state_dict(), "mxfp4"))
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, packed(IDS).logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model(IDS[:, :1]).logits, packed(IDS[:, :1]).logits, rtol=1e-5, atol=1e-5)
        dense = _model()
        assert (dense(IDS).logits - model(IDS).logits).abs().max() > 1e-3  # the rounding is really applied


def test_gradients_pass_straight_through_to_the_dense_weights():
    """d loss / d W equals d loss / d round(W): the gradient of a model whose weights are the rounded values."""
    model = _model()
    rounded = _model()
    with torch.no_grad():
        for m in rounded.modules():
            if isinstance(m, RoutedExperts):
                for name in ("w1", "w3", "w2"):
                    getattr(m, name).copy_(decode_mxfp4(*encode_mxfp4(getattr(m, name)), torch.float32))
    apply_mxfp4_qat(model)
    model(IDS, labels=IDS).loss.backward()
    rounded(IDS, labels=IDS).loss.backward()
    for a, b in zip(model.modules(), rounded.modules()):
        if isinstance(a, RoutedExperts):
            torch.testing.assert_close(a.w2.grad, b.w2.grad, rtol=1e-5, atol=1e-7)


def test_widths_must_be_multiples_of_32():
    with pytest.raises(ValueError, match="divisible by 32: moe_intermediate_size = 40"):
        apply_mxfp4_qat(_model(moe_intermediate_size=40))


def test_not_with_expert_parallelism():
    with pytest.raises(ValueError, match="--mxfp4-experts does not combine with --ep"):
        TrainArgs(out="x", steps=1, mxfp4_experts=True, ep=2)
