"""Inference graphs go through torch's CSE pass before lowering (backend.CSE_INFERENCE)."""
import torch
import torch.nn.functional as F

import pypto_inductor


def _two_layers(q, k, v, keep):
    # each SDPA call converts the same bool mask to a float mask: two identical `where`s
    a = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    return F.scaled_dot_product_attention(a, k, v, attn_mask=keep)


def _inputs():
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    keep = torch.rand(2, 1, 16, 16) > 0.3
    keep[..., 0] = True  # every query attends somewhere
    return q, k, v, keep


def test_shared_bool_mask_is_converted_once_and_matches_eager():
    args = _inputs()
    with torch.no_grad():
        report = pypto_inductor.report(_two_layers, *args)
        got = torch.compile(_two_layers, backend="pypto")(*args)
        want = _two_layers(*args)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    wheres = [op for g in report.graphs if g.plan is not None for t in g.plan.tiles
              for op in t.ops if op.op == "where"]
    assert len(wheres) == 1, wheres


def test_identical_random_ops_are_not_merged():
    def fn(x):
        return torch.rand_like(x) - torch.rand_like(x)
    with torch.no_grad():
        out = torch.compile(fn, backend="pypto")(torch.zeros(1000))
    assert out.abs().max() > 0
