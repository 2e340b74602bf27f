"""Inference conv chains (lowering/conv.py): conv2d -> eval BatchNorm -> residual add -> ReLU
as one oneDNN call with the BatchNorm folded into the weights. Compared with eager on fresh
random inputs; the tests also check which chains were rewritten, and that training graphs
(grad needed) are left alone."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from pypto_inductor import backend, zoo
from pypto_inductor.lowering import conv


@pytest.fixture
def rewrites(monkeypatch):
    """The (first, last, reason) of every chain rewritten while the test runs."""
    seen = []
    real = backend.rewrite_convolutions

    def spy(gm, example_inputs):
        out = real(gm, example_inputs)
        seen.extend(out)
        return out

    monkeypatch.setattr(backend, "rewrite_convolutions", spy)
    return seen


def _tol(dtype):
    return dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=5e-2, atol=5e-2)


def _randomize_bn(model: nn.Module, g: torch.Generator) -> nn.Module:
    """Running statistics and affine parameters away from their 0/1 init (as trained)."""
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.normal_(0, 0.5, generator=g)
            m.running_var.uniform_(0.3, 2.0, generator=g)
            if m.affine:
                m.weight.data.normal_(1, 0.3, generator=g)
                m.bias.data.normal_(0, 0.3, generator=g)
    return model


class Block(nn.Module):
    def __init__(self, cin, cout, stride=1, groups=1, dilation=1, bias=False, affine=True,
                 residual=False, act=True, bn=True):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, stride, dilation, dilation, groups, bias=bias)
        self.bn = nn.BatchNorm2d(cout, affine=affine) if bn else nn.Identity()
        self.residual, self.act = residual, act

    def forward(self, x, other=None):
        y = self.bn(self.conv(x))
        if self.residual:
            y = y + other
        return F.relu(y) if self.act else y


CASES = {
    "bn_relu": dict(),
    "bias_stride2": dict(bias=True, stride=2),
    "groups_dilation": dict(groups=2, dilation=2),
    "no_affine": dict(affine=False),
    "bn_only": dict(act=False),
    "residual_relu": dict(residual=True),
    "residual_no_act": dict(residual=True, act=False),
    "relu_no_bn": dict(bn=False, bias=True),
    "groups_residual_relu": dict(groups=2, residual=True),
}


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "aten"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_inference_chain_matches_eager(case, dtype, direct, rewrites, monkeypatch):
    """Through the held oneDNN primitive (with a oneDNN install: onednn_conv.py) and
    through ATen's call."""
    monkeypatch.setattr(conv, "DIRECT_ONEDNN", direct)
    conv.FOLDED.clear()
    g = torch.Generator().manual_seed(hash(case) % 1000)
    kw = CASES[case]
    m = _randomize_bn(Block(8, 8, **kw), g).eval().to(dtype)
    x = torch.randn(2, 8, 12, 12, generator=g).to(dtype)
    stride = kw.get("stride", 1)
    other = torch.randn(2, 8, 12 // stride, 12 // stride, generator=g).to(dtype)
    with torch.no_grad():
        out = torch.compile(m, backend="pypto")(x, other)
        torch.testing.assert_close(out, m(x, other), **_tol(dtype))
    assert len(rewrites) == 1, rewrites
    if kw.get("bn", True):
        assert "BatchNorm folded" in rewrites[0][2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", ["residual_relu", "residual_no_act", "bias_stride2",
                                  "groups_dilation"])
@pytest.mark.parametrize("switch", ["FUSE_ADD", "FUSE_RELU"])
def test_post_ops_left_to_pointwise_kernels_match_eager(switch, case, dtype, rewrites,
                                                         monkeypatch):
    """With a post-op switched off, the add / ReLU stays in the graph after the folded
    convolution (pypto's pointwise kernels run it on the channels-last output)."""
    monkeypatch.setattr(conv, switch, False)
    g = torch.Generator().manual_seed(hash((switch, case)) % 1000)
    kw = CASES[case]
    m = _randomize_bn(Block(8, 8, **kw), g).eval().to(dtype)
    x = torch.randn(2, 8, 13, 11, generator=g).to(dtype)
    y = m.conv(x)
    other = torch.randn(y.shape, generator=g).to(dtype)
    with torch.no_grad():
        out = torch.compile(m, backend="pypto")(x, other)
        torch.testing.assert_close(out, m(x, other), **_tol(dtype))
    assert len(rewrites) == 1, rewrites
    reason = rewrites[0][2]
    assert "BatchNorm folded" in reason
    assert ("residual add" in reason) == (kw.get("residual", False) and switch != "FUSE_ADD")
    assert ("relu as post-ops" in reason) == (kw.get("act", True) and switch != "FUSE_RELU"
                                              and not (kw.get("residual", False)
                                                       and switch == "FUSE_ADD"))


def test_resnet_eval_matches_eager_and_refolds_after_update(rewrites):
    m = _randomize_bn(zoo.build("resnet"), torch.Generator().manual_seed(1))
    c = torch.compile(lambda x: m(x)["logits"], backend="pypto")
    with torch.no_grad():
        for seed in range(2):
            x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(seed))
            torch.testing.assert_close(c(x), m(x)["logits"], **_tol(torch.float32))
        assert len(rewrites) == 10  # every conv, with its BN, add and ReLU
        # in-place updates of a statistic and a weight (load_state_dict does this): the
        # folded weights follow, never stale
        m.stem[1].running_var.mul_(3.0)
        m.blocks[0].conv1.weight.mul_(-0.5)
        torch.testing.assert_close(c(x), m(x)["logits"], **_tol(torch.float32))
        m.load_state_dict(_randomize_bn(zoo.build("resnet", seed=5),
                                        torch.Generator().manual_seed(2)).state_dict())
        torch.testing.assert_close(c(x), m(x)["logits"], **_tol(torch.float32))


def test_resnet_bf16_matches_eager(rewrites):
    m = _randomize_bn(zoo.build("resnet"), torch.Generator().manual_seed(3)).to(torch.bfloat16)
    x = torch.randn(2, 3, 32, 32).to(torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(lambda x: m(x)["logits"], backend="pypto")(x),
                                   m(x)["logits"], **_tol(torch.bfloat16))
    assert len(rewrites) == 10


@pytest.mark.parametrize("train", [True, False], ids=["train_mode", "eval_with_grad"])
def test_graphs_that_need_grad_are_left_alone(train, rewrites):
    """Training (batch statistics) and eval with grad (weights get gradients): no fold."""
    g = torch.Generator().manual_seed(4)
    m = _randomize_bn(Block(4, 6, bias=True), g).train(train)
    ref = _randomize_bn(Block(4, 6, bias=True), g)
    ref.load_state_dict(m.state_dict())
    ref.train(train)
    x = torch.randn(2, 4, 10, 10, generator=g)
    out = torch.compile(m, backend="pypto")(x)
    expect = ref(x)
    torch.testing.assert_close(out, expect, **_tol(torch.float32))
    out.sum().backward()
    expect.sum().backward()
    torch.testing.assert_close(m.conv.weight.grad, ref.conv.weight.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(m.bn.running_mean, ref.bn.running_mean)
    assert rewrites == []


def test_switch_off_and_dynamic_batch(rewrites):
    g = torch.Generator().manual_seed(6)
    m = _randomize_bn(Block(4, 4), g).eval()
    with torch.no_grad():
        c = torch.compile(m, backend="pypto", dynamic=True)
        for n in (2, 5):
            x = torch.randn(n, 4, 9, 9, generator=g)
            torch.testing.assert_close(c(x), m(x), **_tol(torch.float32))
        assert len(rewrites) == 1
        conv.ENABLED = False
        try:
            torch._dynamo.reset()
            rewrites.clear()
            x = torch.randn(3, 4, 9, 9, generator=g)
            torch.testing.assert_close(torch.compile(m, backend="pypto")(x), m(x),
                                       **_tol(torch.float32))
            assert rewrites == []
        finally:
            conv.ENABLED = True


class PoolHead(nn.Module):
    """conv + BN + ReLU, then a global average pool in one of its spellings."""

    def __init__(self, pool):
        super().__init__()
        self.block, self.pool = Block(5, 6, bias=True), pool

    def forward(self, x):
        y = self.block(x)
        if self.pool == "adaptive":
            return F.adaptive_avg_pool2d(y, 1).flatten(1)
        if self.pool == "adaptive_module_pair":
            return nn.AdaptiveAvgPool2d((1, 1))(y)
        if self.pool == "mean_keepdim":
            return y.mean((-1, -2), keepdim=True)
        if self.pool == "mean":
            return torch.mean(y, dim=[2, 3])
        if self.pool == "mean_and_other_use":  # the conv output also read elsewhere
            return y.mean((2, 3)), y[:, :, 1:3, 2]
        return F.adaptive_avg_pool2d(y, 2)  # not global: left as it is


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("pool", ["adaptive", "adaptive_module_pair", "mean_keepdim", "mean",
                                  "mean_and_other_use", "adaptive_2x2"])
@pytest.mark.parametrize("pool_nhwc", [True, False], ids=["nhwc", "nchw"])
def test_global_pool_of_fused_chain_matches_eager(pool, dtype, pool_nhwc, rewrites,
                                                  monkeypatch):
    monkeypatch.setattr(conv, "POOL_NHWC", pool_nhwc)
    g = torch.Generator().manual_seed(11)
    m = _randomize_bn(PoolHead(pool), g).eval().to(dtype)
    x = torch.randn(3, 5, 9, 7, generator=g).to(dtype)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(m, backend="pypto")(x), m(x), **_tol(dtype))
    assert len(rewrites) == 1


def test_global_pool_dynamic_batch_and_size(rewrites):
    g = torch.Generator().manual_seed(13)
    m = _randomize_bn(PoolHead("adaptive"), g).eval()
    with torch.no_grad():
        c = torch.compile(m, backend="pypto", dynamic=True)
        for shape in ((2, 5, 9, 9), (5, 5, 6, 11)):
            x = torch.randn(*shape, generator=g)
            torch.testing.assert_close(c(x), m(x), **_tol(torch.float32))
    assert rewrites


@pytest.mark.parametrize("pool_nhwc", [True, False], ids=["nhwc", "nchw"])
def test_global_pool_rewrite_reads_the_nhwc_view(pool_nhwc, monkeypatch):
    """The rewritten Dynamo graph (run as it is, the fused op eagerly): the pool is a mean
    of the permuted (NHWC, contiguous) conv output, and still equals eager."""
    monkeypatch.setattr(conv, "POOL_NHWC", pool_nhwc)
    graphs = []

    def rewrite_only(gm, example_inputs):
        conv.rewrite_convolutions(gm, example_inputs)
        graphs.append(gm)
        return gm

    m = _randomize_bn(PoolHead("adaptive"), torch.Generator().manual_seed(12)).eval()
    x = torch.randn(2, 5, 6, 6)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(m, backend=rewrite_only)(x), m(x),
                                   **_tol(torch.float32))
    targets = [n.target for n in graphs[0].graph.nodes]
    assert torch.ops.pypto_inductor.conv_fused.default in targets
    assert (torch.permute in targets) == pool_nhwc
    assert (F.adaptive_avg_pool2d in targets) != pool_nhwc


def _extern_reasons(graphs) -> list[str]:
    return [r for g in graphs for r in g.to_dict()["extern_reasons"].values()]


def test_as_strided_lowers_only_where_it_moves_no_element():
    """The channels-last avg-pool's restriding is a view; a restriding that moves elements
    (a transpose through storage) stays ATen's and matches eager."""
    from pypto_inductor.report import collect
    x = torch.randn(4, 8, 5, 5).contiguous(memory_format=torch.channels_last)
    pool = lambda x: torch.flatten(F.adaptive_avg_pool2d(x * 2.0, 1), 1)  # noqa: E731
    with torch.no_grad(), collect() as graphs:
        torch.testing.assert_close(torch.compile(pool, backend="pypto")(x), pool(x))
    assert not [r for r in _extern_reasons(graphs) if "as_strided" in r]
    y = torch.randn(6, 6)
    moved = lambda y: (y + 1.0).as_strided((6, 6), (1, 6)) * 3.0  # noqa: E731
    with torch.no_grad(), collect() as graphs:
        torch.testing.assert_close(torch.compile(moved, backend="pypto")(y), moved(y))
    assert [r for r in _extern_reasons(graphs) if "moves elements" in r]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_channels_last_avg_pool_backward_lowers(dtype):
    """The backward of the channels-last avg-pool's restriding (as_strided of zeros, then
    as_strided_scatter over all of them) is a reshape: no extern, gradients as eager's."""
    from pypto_inductor.report import collect
    g = torch.Generator().manual_seed(4)
    x0 = torch.randn(2, 32, 5, 7, generator=g).to(dtype).contiguous(
        memory_format=torch.channels_last)
    w = torch.randn(2, 32, generator=g).to(dtype)
    pool = lambda x: (torch.flatten(F.adaptive_avg_pool2d(x * 2.0, 1), 1) * w).sum()  # noqa: E731
    grads = []
    with collect() as graphs:
        for f in (torch.compile(pool, backend="pypto"), pool):
            x = x0.clone().requires_grad_(True)
            f(x).backward()
            grads.append(x.grad)
    torch.testing.assert_close(grads[0], grads[1], **_tol(dtype))
    assert not [r for r in _extern_reasons(graphs) if "as_strided" in r], _extern_reasons(graphs)
