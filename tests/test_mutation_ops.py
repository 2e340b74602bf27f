"""Mutations and optimizer updates through backend="pypto", against eager PyTorch.

``copy_`` into graph inputs (a user's in-place op, BatchNorm's running stats, every
optimizer update) is a tile op written by the kernel that computes the value, in
place where the kernel may (``Program.writes``), and ``prims.fma`` (Adam) is a
multiply-add: a compiled ``opt.step()`` runs no ATen op eagerly.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import pypto_inductor
from pypto_inductor.codegen.cpp import compiler as cpp_build
from pypto_inductor.report import collect

FP32 = {"atol": 1e-5, "rtol": 1.3e-5}


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    root = tmp_path_factory.getbasetemp() / "cpp_cache"
    monkeypatch.setenv("PYPTO_INDUCTOR_CACHE_DIR", str(root))
    monkeypatch.setattr(cpp_build, "loaded", dict(cpp_build.loaded))


def report_of(graphs) -> dict:
    rep = pypto_inductor.FusionReport(graphs).to_dict()
    assert rep["summary"]["eager_graphs"] == 0
    assert not [t for g in rep["graphs"] for t in g["fusion_tiles"] if t["kernel_fallback"]]
    return rep


def direct_writes(graphs) -> list:
    """(tile name, DirectWrite) of every copy_ output of a native kernel."""
    out = []
    for g in graphs:
        for name, kernel in g.compiled.kernels.items():
            if kernel.program is not None:
                out += [(name, w) for w in kernel.program.writes.values()]
    return out


@pytest.mark.parametrize("dynamic", [False, True])
def test_input_mutations_are_written_in_place_by_their_kernel(dynamic):
    def fn(x, buf):
        buf.mul_(0.5).add_(x)
        x.sub_(1.0)
        return (x * buf).sum(-1)

    torch.manual_seed(0)
    x, buf = torch.randn(8, 64), torch.randn(8, 64)
    rx, rbuf = x.clone(), buf.clone()
    ptrs = (x.data_ptr(), buf.data_ptr())
    compiled = torch.compile(fn, backend="pypto", dynamic=dynamic,
                             options={"fallback": "error"})
    with collect() as graphs:
        out = compiled(x, buf)
    ref = fn(rx, rbuf)
    torch.testing.assert_close(out, ref, **FP32)
    torch.testing.assert_close((x, buf), (rx, rbuf), **FP32)
    assert (x.data_ptr(), buf.data_ptr()) == ptrs
    report_of(graphs)
    writes = direct_writes(graphs)
    assert len(writes) == 2 and all(w.direct for _, w in writes), writes


def test_mutating_a_non_contiguous_input_copies_into_it():
    def fn(x):
        x.mul_(3.0)
        return x + 1

    x = torch.randn(6, 4).t()
    rx = x.clone()
    with collect() as graphs:
        out = torch.compile(fn, backend="pypto", options={"fallback": "error"})(x)
    torch.testing.assert_close(out, fn(rx), **FP32)
    torch.testing.assert_close(x, rx, **FP32)
    report_of(graphs)


def test_a_reader_of_the_old_value_runs_before_the_write():
    """y reads x transposed (another element than the one written): written after."""
    def fn(x, z):
        y = x.t() * 2
        x.copy_(z + 1)
        return y

    torch.manual_seed(1)
    x, z = torch.randn(16, 16), torch.randn(16, 16)
    rx = x.clone()
    with collect() as graphs:
        out = torch.compile(fn, backend="pypto", options={"fallback": "error"})(x, z)
    ref = fn(rx, z)
    torch.testing.assert_close(out, ref, **FP32)
    torch.testing.assert_close(x, rx, **FP32)
    report_of(graphs)


def test_batch_norm_running_stats_match_eager():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU())
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="pypto", options={"fallback": "error"})
    with collect() as graphs, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(3):
            x = torch.randn(32, 8)
            compiled(x).sum().backward()
            ref(x).sum().backward()
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, **FP32, msg=lambda m: f"{name}: {m}")
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad, atol=1e-4, rtol=1e-4,
                                   msg=lambda m: f"grad of {name}: {m}")
    report_of(graphs)


OPTIMIZERS = {
    "Adam": (torch.optim.Adam, {"lr": 0.01}),
    "AdamW": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
    "SGD momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "Adam amsgrad": (torch.optim.Adam, {"lr": 0.01, "amsgrad": True}),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_compiled_optimizer_step_matches_eager_with_no_eager_op(name):
    cls, kwargs = OPTIMIZERS[name]
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    ref = copy.deepcopy(model)
    opt, ref_opt = cls(model.parameters(), **kwargs), cls(ref.parameters(), **kwargs)

    @torch.compile(backend="pypto", options={"fallback": "error"})
    def step():
        opt.step()

    with collect() as graphs, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(3):
            x = torch.randn(8, 16)
            for m, o in ((model, opt), (ref, ref_opt)):
                o.zero_grad()
                m(x).square().mean().backward()
            step()
            ref_opt.step()
    for (pname, p), r in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, r, atol=1e-6, rtol=1e-5, msg=lambda m: f"{pname}: {m}")
    for s, rs in zip(opt.state.values(), ref_opt.state.values()):
        for key in rs:
            torch.testing.assert_close(s[key], rs[key], atol=1e-6, rtol=1e-5)
    rep = report_of(graphs)
    assert rep["summary"]["fallback_op_count"] == 0
    # every parameter and moment is written by a native kernel, in place
    writes = direct_writes(graphs)
    assert writes and all(w.direct for _, w in writes), writes


def test_copy_of_a_broadcast_value_and_another_dtype():
    def fn(x, b, n):
        x.copy_(b)  # broadcast [8] -> [4, 8]
        n.copy_(x.sum(-1))  # float -> int64
        return x * 2

    x, b, n = torch.randn(4, 8), torch.randn(8) * 10, torch.zeros(4, dtype=torch.int64)
    rx, rn = x.clone(), n.clone()
    with collect() as graphs:
        out = torch.compile(fn, backend="pypto", options={"fallback": "error"})(x, b, n)
    torch.testing.assert_close(out, fn(rx, b, rn), **FP32)
    torch.testing.assert_close((x, n), (rx, rn), **FP32)
    report_of(graphs)


def test_copy_on_the_reference_and_pypto_split():
    """The reference executor writes the input too; pypto (no copy_ form) splits there."""
    pytest.importorskip("pypto")
    from pypto_inductor.codegen.pypto.emit import split_tile

    def fn(x, y):
        x.add_(y)
        return x.relu()

    x, y = torch.randn(8, 32), torch.randn(8, 32)
    rx = x.clone()
    with collect() as graphs:
        out = torch.compile(fn, backend="pypto", options={"target": "reference",
                                                          "hardware": "ascend-a2"})(x, y)
    torch.testing.assert_close(out, fn(rx, y), **FP32)
    torch.testing.assert_close(x, rx, **FP32)
    tiles = [(t, g.plan.graph) for g in graphs for t in g.plan.tiles]
    splits = [split_tile(t, graph) for t, graph in tiles]
    assert any(s and [op.op for op in s.split_ops] == ["copy_"] for s in splits)
