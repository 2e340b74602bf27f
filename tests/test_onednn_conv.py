"""The held oneDNN primitive (codegen/cpp/onednn_conv.py) against eager, and the compiled
conv nets using it. Needs a oneDNN install (the ``onednn`` extra, or
PYPTO_INDUCTOR_ONEDNN_DIR); skipped without."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pypto_inductor import zoo
from pypto_inductor.codegen.cpp import onednn_conv
from pypto_inductor.lowering import conv

# skipped only without an install: one that fails to build or load fails the tests
pytestmark = pytest.mark.skipif(onednn_conv.install_dir() is None,
                                reason="no oneDNN install (extra 'onednn' or "
                                       "PYPTO_INDUCTOR_ONEDNN_DIR)")


def test_the_install_builds_and_loads():
    assert onednn_conv.library() is not None


def _tol(dtype):
    return dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=5e-2, atol=5e-2)


# (batch, cin, h, w, cout, kernel, stride, padding, dilation, groups)
SHAPES = [(2, 16, 16, 16, 16, 3, 1, 1, 1, 1), (4, 3, 32, 32, 16, 3, 1, 1, 1, 1),
          (2, 16, 16, 16, 32, 1, 2, 0, 1, 1), (2, 8, 13, 11, 8, 3, 2, 1, 1, 2),
          (1, 12, 9, 10, 6, 3, 1, 2, 2, 3), (3, 8, 7, 7, 16, 5, 1, 2, 1, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("act,add,bias", [("relu", False, True), ("none", False, True),
                                          ("relu", True, True), ("none", True, False),
                                          ("relu", False, False)])
@pytest.mark.parametrize("layout", ["channels_last", "nchw", "strided"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_direct_conv_matches_eager(shape, layout, act, add, bias, dtype):
    n, c, h, w, o, k, s, p, d, g = shape
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(n, c, h, w, generator=gen).to(dtype)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    elif layout == "strided":  # neither layout: converted first
        x = torch.randn(n, c, h, 2 * w, generator=gen).to(dtype)[..., ::2]
    wt = torch.randn(o, c // g, k, k, generator=gen).to(dtype)
    b = torch.randn(o, generator=gen).to(dtype) if bias else None
    ref = F.conv2d(x, wt, b, s, p, d, g)
    other = torch.randn(ref.shape, generator=gen).to(dtype).contiguous(
        memory_format=torch.channels_last) if add else None
    if add:
        ref = ref + other
    if act == "relu":
        ref = torch.relu(ref)
    direct = onednn_conv.make(x, wt, b, [s, s], [p, p], [d, d], g, act, add)
    assert direct is not None
    for _ in range(2):  # the held primitive, scratchpad and packed weight are reused
        y = direct(x, other)
        assert y.is_contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(y, ref, **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_resnet_runs_on_held_primitives_and_refolds(dtype):
    conv.FOLDED.clear()
    m = zoo.build("resnet").to(dtype)
    for mod in m.modules():
        if isinstance(mod, torch.nn.BatchNorm2d):
            mod.running_mean.normal_(0, 0.5)
            mod.running_var.uniform_(0.3, 2.0)
    c = torch.compile(lambda x: m(x)["logits"], backend="pypto")
    x = torch.randn(3, 3, 32, 32).to(dtype)
    with torch.no_grad():
        torch.testing.assert_close(c(x), m(x)["logits"], **_tol(dtype))
        assert conv.FOLDED and all(hit[11] is not None for hit in conv.FOLDED.values())
        m.blocks[0].conv1.weight.mul_(-0.5)  # in place: the primitive's weight refolds
        m.stem[1].running_var.mul_(3.0)
        torch.testing.assert_close(c(x), m(x)["logits"], **_tol(dtype))


def test_a_new_thread_count_makes_a_new_primitive():
    """oneDNN splits a primitive's work for the thread count it was made with: after
    torch.set_num_threads the call site gets a primitive for the new count."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 8, 12, 12, generator=gen).contiguous(memory_format=torch.channels_last)
    w, b = torch.randn(16, 8, 3, 3, generator=gen), torch.randn(16, generator=gen)
    ref = torch.relu(F.conv2d(x, w, b, 1, 1))
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 1):
            torch.set_num_threads(n)
            y = conv.run_conv_fused(x, w, b, None, None, None, None, 1e-5, None, [1, 1],
                                    [1, 1], [1, 1], 1, "relu", "thread_test")
            torch.testing.assert_close(y, ref, **_tol(torch.float32))
            assert conv.FOLDED["thread_test"][11].threads == n
    finally:
        torch.set_num_threads(threads)
        conv.FOLDED.pop("thread_test", None)
