"""A row kernel admits a value of its size only when the value's last dim splits into the
kernel's rows (fusion.capacity.ROW_LAST_DIM_SPLITS). A causal LM's loss (transformers'
ForCausalLMLoss) pads the labels, copies labels[:, 1:] ([B, S]) and counts the valid ones
over the flat [B * S] view: fused into that count, the copy's rows of S are shorter than the
count's one row of B * S, and the whole tile ran on the reference executor. Now every
kernel of the loss is native, with eager's loss and gradients."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pypto_inductor.fusion import capacity
from pypto_inductor.report import collect


def _causal_lm_loss(logits, labels):
    labels = F.pad(labels, (0, 1), value=-100)
    shift = labels[..., 1:].contiguous()
    logits = logits.view(-1, logits.shape[-1]).float()
    return F.cross_entropy(logits, shift.view(-1), ignore_index=-100)  # its mean: over valid


def _run(logits, labels):
    torch._dynamo.reset()
    x = logits.detach().clone().requires_grad_()
    with collect() as graphs:
        loss = torch.compile(_causal_lm_loss, backend="pypto")(x, labels)
        loss.backward()
    natives = [t.get("native") or {} for g in graphs for t in g.to_dict()["fusion_tiles"]]
    return loss.detach(), x.grad, natives


@pytest.mark.parametrize("split", [True, False], ids=["splits_only", "by_size"])
def test_causal_lm_loss_kernels_are_native(split, monkeypatch):
    monkeypatch.setattr(capacity, "ROW_LAST_DIM_SPLITS", split)
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(4, 128, 256, generator=g) * 2
    labels = torch.randint(0, 256, (4, 128), generator=g)
    labels[0, :5] = -100  # some ignored positions
    loss, grad, natives = _run(logits, labels)
    x = logits.detach().clone().requires_grad_()
    want = _causal_lm_loss(x, labels)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(grad, x.grad, atol=2e-6, rtol=2e-5)
    reference = [n.get("reason") for n in natives if n.get("native") is False]
    if split:
        assert natives and not reference, reference
    else:  # the fused tile, as before the switch
        assert any("reshape inside the tile changes its last dim" in r for r in reference)


def test_row_domain_admits_splits_of_its_rows():
    dom = capacity.Domain("row", 1, 512, (512,), (0,))
    assert dom.admits(512, (512,)) and dom.admits(512, (1, 512)) and dom.admits(512, (512, 1))
    assert not dom.admits(512, (4, 128))
    rows = capacity.Domain("row", 4, 128, (4, 128), (1,))
    assert rows.admits(512, (512,)) and rows.admits(512, (2, 256)) and rows.admits(4, (4, 1))
    assert not rows.admits(512, (8, 64))
