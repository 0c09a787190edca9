"""Packed rows (docs/architecture.md §3.8, §13 #19): documents in one row never see each other."""

import pytest
import torch
import torch.nn.functional as F

from k3.ops.kda.conv import short_conv

LENGTHS = [[30, 1, 39], [70]]  # a one-token document, boundaries off the 64-chunk grid


def _packed_batch(vocab):
    gen = torch.Generator().manual_seed(5)
    docs = [[torch.randint(0, vocab, (1, n), generator=gen) for n in row] for row in LENGTHS]
    ids_BT = torch.cat([torch.cat(row, 1) for row in docs])
    doc_BT = torch.cat([torch.cat([torch.full((1, n), i) for i, n in enumerate(row)], 1) for row in LENGTHS])
    return docs, ids_BT, doc_BT


@pytest.mark.parametrize("kda_impl", ["chunk", "recurrent"])
def test_packed_row_equals_documents_run_separately(tiny_model, kda_impl):
    """Per-document logits of a packed row equal running each document alone (float64, ≤ 1e-10)."""
    model = tiny_model(kda_impl=kda_impl).double()
    docs, ids_BT, doc_BT = _packed_batch(model.config.vocab_size)
    with torch.no_grad():
        packed_BTV = model(ids_BT, document_ids=doc_BT).logits
        for b, row in enumerate(docs):
            start = 0
            for doc in row:
                alone = model(doc).logits[0]
                torch.testing.assert_close(packed_BTV[b, start: start + doc.shape[1]], alone, rtol=0, atol=1e-10)
                start += doc.shape[1]


def test_no_loss_across_boundaries(tiny_model):
    """The packed loss is the token-weighted mean of the per-document losses: no target crosses a boundary."""
    model = tiny_model().double()
    docs, ids_BT, doc_BT = _packed_batch(model.config.vocab_size)
    loss = model(ids_BT, labels=ids_BT, document_ids=doc_BT).loss
    total, count = 0.0, 0
    for row in docs:
        for doc in row:
            if doc.shape[1] > 1:
                logits = model(doc).logits[0, :-1]
                total += F.cross_entropy(logits, doc[0, 1:], reduction="sum")
                count += doc.shape[1] - 1
    torch.testing.assert_close(loss, total / count, rtol=1e-10, atol=0)


def test_packed_gradients_are_finite(tiny_model):
    model = tiny_model()
    _, ids_BT, doc_BT = _packed_batch(model.config.vocab_size)
    model(ids_BT, labels=ids_BT, document_ids=doc_BT).loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_document_masked_conv_equals_conv1d_for_one_document():
    """The tap-masked conv path equals conv1d when the row is a single document, and resets at a boundary."""
    gen = torch.Generator().manual_seed(0)
    x_BTP, w_P1W = torch.randn(2, 11, 6, generator=gen), torch.randn(6, 1, 4, generator=gen)
    one_doc_BT = torch.zeros(2, 11, dtype=torch.long)
    torch.testing.assert_close(short_conv(x_BTP, w_P1W, None, one_doc_BT)[0], short_conv(x_BTP, w_P1W)[0])
    two_docs_BT = torch.cat([torch.zeros(2, 5), torch.ones(2, 6)], 1).long()
    y_BTP = short_conv(x_BTP, w_P1W, None, two_docs_BT)[0]
    torch.testing.assert_close(y_BTP[:, 5:], short_conv(x_BTP[:, 5:], w_P1W)[0])


@pytest.mark.parametrize("bad", ["decreasing", "shape", "float", "with_mask"])
def test_document_ids_validation(tiny_model, bad):
    model = tiny_model()
    ids_BT = torch.randint(0, model.config.vocab_size, (2, 8))
    doc_BT = torch.zeros(2, 8, dtype=torch.long)
    kwargs = {}
    if bad == "decreasing":
        doc_BT[0, 5:] = -1
    elif bad == "shape":
        doc_BT = doc_BT[:, :7]
    elif bad == "float":
        doc_BT = doc_BT.float()
    else:
        kwargs["attention_mask"] = torch.ones(2, 8)
    with pytest.raises(ValueError, match="document_ids"):
        model(ids_BT, document_ids=doc_BT, **kwargs)
