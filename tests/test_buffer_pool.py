"""The native runtime's buffer pool: kernel outputs that die inside a graph serve its next
call, and nothing a caller can still see is ever overwritten."""
from __future__ import annotations

import copy
import gc

import pytest
import torch

from pypto_inductor import models
from pypto_inductor.codegen.graph import buffers
from pypto_inductor.codegen.cpp import alloc as host_alloc
from pypto_inductor.codegen.cpp import launcher
from pypto_inductor.report import collect


def _compile(fn, **options):
    return torch.compile(fn, backend="pypto",
                         options={"target": "cpu", "fallback": "error", **options})


def _chain(x, w):
    """Three kernels (the matmul splits them); the first two outputs die inside the graph,
    the second one through a view."""
    h = torch.softmax(x * 2.0, -1)
    g = torch.relu(h @ w - 0.1).reshape(-1, w.shape[1])
    return torch.tanh(g.t() @ g) + 1.0


@pytest.fixture(autouse=True)
def fresh_pool(monkeypatch):
    """Each test's graphs get a pool of their own: the process's pool also holds, and
    reserves for, the graphs earlier tests left alive, which the counts here must not see."""
    monkeypatch.setattr(host_alloc, "POOL", host_alloc.BufferPool())
    # the buffers here are small: pooled all the same (by default a static output of at
    # most 64 KiB is allocated directly: test_graph_code.py)
    monkeypatch.setattr(buffers, "SMALL_OUTPUT_BYTES", -1)


@pytest.fixture
def allocations(monkeypatch):
    """Counts host_alloc.empty calls (fresh buffers)."""
    count = [0]
    real = host_alloc.empty

    def counting(shape, dtype):
        count[0] += 1
        return real(shape, dtype)

    monkeypatch.setattr(host_alloc, "empty", counting)
    return count


@pytest.mark.parametrize("keep", [True, False])
def test_internal_buffers_are_reused_across_calls(keep, allocations, tol):
    w = torch.randn(64, 48)
    xs = [torch.randn(8, 32, 64) for _ in range(3)]
    with torch.no_grad(), collect() as graphs:
        compiled = _compile(_chain, keep_buffers=keep)
        outs = [compiled(xs[0], w)]
        first = allocations[0]
        outs += [compiled(x, w) for x in xs[1:]]
    assert sum(step[0] == "kernel" for step in graphs[0].compiled.program) >= 3
    # with the pool only the returned tensor is new on each later call
    assert (allocations[0] - first) / 2 == (1 if keep else first)
    for x, out in zip(xs, outs):  # earlier results are intact
        torch.testing.assert_close(out, _chain(x, w), **tol(torch.float32))


def test_returned_tensors_and_their_bases_are_never_reused(tol):
    """A returned kernel output, and a kernel output returned through a view, stay intact
    after later calls."""
    def fn(x):
        a = torch.exp(x) * 0.5  # returned through a view
        b = torch.tanh(a) + x  # internal
        return a.t(), torch.sigmoid(b) * 2.0

    compiled = _compile(fn)
    xs = [torch.randn(40, 24) for _ in range(4)]
    with torch.no_grad():
        outs = [compiled(x) for x in xs]
    for x, out in zip(xs, outs):
        torch.testing.assert_close(out, fn(x), **tol(torch.float32))


def test_saved_activations_survive_later_calls(tol):
    """Training: tensors saved for backward are graph outputs, so a second forward cannot
    overwrite the first one's before its backward runs."""
    ln = torch.nn.LayerNorm(32)
    compiled = _compile(lambda x: torch.nn.functional.gelu(ln(x * 1.5)).sum(-1))
    x1, x2 = (torch.randn(16, 32, requires_grad=True) for _ in range(2))
    y1, y2 = compiled(x1), compiled(x2)
    (y1 * torch.arange(16.0)).sum().backward()
    y2.sum().backward()
    e1, e2 = (x.detach().clone().requires_grad_() for x in (x1, x2))
    ref = lambda x: torch.nn.functional.gelu(ln(x * 1.5)).sum(-1)  # noqa: E731
    (ref(e1) * torch.arange(16.0)).sum().backward()
    ref(e2).sum().backward()
    torch.testing.assert_close(x1.grad, e1.grad, **tol(torch.float32))
    torch.testing.assert_close(x2.grad, e2.grad, **tol(torch.float32))


def _held_within_peak(graph_records):
    """The pool holds at most the largest live peak of pooled buffers of the graphs."""
    pool = host_alloc.POOL
    peaks = [g.compiled._pool_peak(g.compiled._pool_syms) for g in graph_records]
    assert pool.held <= pool.cap == max(pool.reserved.values())
    return pool, peaks


def test_dynamic_sizes_bound_the_pool(tol):
    """At every size the pool holds at most the graph's live peak at that size: calls at
    many sizes do not pile up buffers, and after a smaller call the larger ones go."""
    gc.collect()  # earlier tests' graphs release their reservations
    compiled = torch.compile(_chain, backend="pypto", dynamic=True,
                             options={"target": "cpu", "fallback": "error"})
    w = torch.randn(64, 48)
    with torch.no_grad(), collect() as graphs:
        for rows in (8, 5, 8, 3):
            x = torch.randn(rows, 32, 64)
            torch.testing.assert_close(compiled(x, w), _chain(x, w), **tol(torch.float32))
            pool, (peak,) = _held_within_peak(graphs)
            assert 0 < pool.held <= peak == pool.cap
            assert peak >= rows * 32 * 48 * 4  # the first matmul's output at least


def test_held_buffers_stay_within_the_live_peak(tol):
    """Buffers of different shapes share storage (a dead buffer serves any later output of
    at most its size), so the transformer block's pool holds no more than the bytes alive
    at once, not one buffer per distinct shape; a training step's forward and backward
    graphs share one pool."""
    gc.collect()
    torch.manual_seed(0)
    block = models.TransformerBlock(64, 4, 128)
    x = torch.randn(2, 16, 64, requires_grad=True)
    with collect() as graphs:
        compiled = torch.compile(block, backend="pypto", options={"target": "cpu"})
        for _ in range(3):
            compiled(x).square().mean().backward()
        pool, peaks = _held_within_peak(graphs)
    assert len(graphs) == 2 and pool.held <= max(peaks)
    pooled_shapes = {k for g in graphs for k in _pooled_outputs(g.compiled)}
    assert sum(nb for ts in pool.free.values() for _, nb in ts) == pool.held
    assert len(pooled_shapes) > len(pool.free)  # shapes share buffers
    x.grad = None
    ref = block(x)
    ref.square().mean().backward()
    expect = x.grad.clone()
    x.grad = None
    compiled(x).square().mean().backward()
    torch.testing.assert_close(x.grad, expect, **tol(torch.float32))


def _pooled_outputs(compiled):
    graph = compiled.plan.graph
    for kind, _, _, _, outs, step in compiled.program:
        if kind == "kernel":
            for name, s in zip(step.outputs, outs):
                if s in compiled.pooled:
                    yield tuple(graph.specs[name].shape), graph.specs[name].dtype


def test_a_buffer_serves_another_shape_and_dtype():
    pool = host_alloc.BufferPool()
    pool.reserve(0, 4096)
    a = pool.empty((16, 32), torch.float32)  # 2048 bytes
    ptr = a.data_ptr()
    pool.give(a)
    del a
    b = pool.empty((40, 20), torch.float16)  # 1600 bytes: fits, not more than twice
    assert (b.data_ptr(), b.shape, b.dtype, b.is_contiguous()) == (ptr, (40, 20), torch.float16, True)
    c = pool.empty((4,), torch.float32)  # the pool is empty now
    pool.give(b)
    d = pool.empty((2, 2), torch.float32)  # 16 bytes: 2048 is more than twice that
    assert d.data_ptr() != ptr and pool.misses == 3
    pool.give(c)
    pool.give(torch.empty(1024))  # 4096 more bytes: over the reservation, dropped
    assert pool.held == 2048 + 16
    pool.reserve(0, 100)  # a smaller reservation drops buffers, the largest first
    assert pool.held == 16
    pool.release(0)
    assert pool.held == 0 and pool.cap == 0


def test_a_returned_output_never_takes_a_pooled_buffer(allocations, tol, monkeypatch):
    """In the transformer block the final residual add is returned and has the shape of
    the LayerNorm buffers: it allocates afresh instead of taking one of them, so after the
    first call the pool serves every internal buffer and the result is the only new one."""
    from pypto_inductor.codegen.cpp import matmul

    # the residual add as a native pass (not oneDNN's post-op, whose output torch allocates)
    monkeypatch.setattr(matmul, "ONEDNN_POST_OPS", False)
    torch.manual_seed(0)
    block = models.TransformerBlock(64, 4, 128).eval()
    xs = [torch.randn(2, 16, 64) for _ in range(4)]
    with torch.no_grad(), collect() as graphs:
        compiled = torch.compile(block, backend="pypto", options={"target": "cpu"})
        outs = [compiled(xs[0])]
        pool = graphs[0].compiled.pool
        misses, before = pool.misses, allocations[0]  # one pool: nothing else runs meanwhile
        outs += [compiled(x) for x in xs[1:]]
    assert pool.misses == misses
    assert allocations[0] - before == len(xs) - 1
    for x, out in zip(xs, outs):
        torch.testing.assert_close(out, block(x), **tol(torch.float32))


def test_threads_calling_one_compiled_graph_get_their_own_buffers(tol):
    """The kernels release the GIL: two threads running the same graph at once each take
    their own pooled buffers and pointer arrays, and both get their own right answers."""
    import threading

    w = torch.randn(64, 48)
    compiled = _compile(_chain)
    with torch.no_grad():
        compiled(torch.randn(8, 32, 64), w)
    errors = []

    def worker(seed):
        gen = torch.Generator().manual_seed(seed)
        try:
            with torch.no_grad():
                for _ in range(20):
                    x = torch.randn(8, 32, 64, generator=gen)
                    torch.testing.assert_close(compiled(x, w), _chain(x, w), **tol(torch.float32))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


@pytest.mark.parametrize("fast", [True, False], ids=["inductor_entry_point", "torch_empty"])
def test_outputs_allocated_with_and_without_inductors_entry_point(fast, monkeypatch):
    """host_alloc.empty uses torch's _empty_strided_cpu when present, torch.empty else:
    both give contiguous buffers of the right shape and dtype, and the same results."""
    if not fast:
        monkeypatch.setattr(host_alloc, "empty_strided_cpu", None)
    elif host_alloc.empty_strided_cpu is None:
        pytest.fail("torch._C._dynamo.guards._empty_strided_cpu is missing from this torch")
    for shape, dtype in [((3, 0, 5), torch.float32), ((7, 1, 9), torch.bfloat16), ((), torch.int64)]:
        t = host_alloc.empty(shape, dtype)
        ref = torch.empty(shape, dtype=dtype)
        assert (t.shape, t.stride(), t.dtype) == (ref.shape, ref.stride(), ref.dtype)
    x, w = torch.randn(6, 16, 8), torch.randn(8, 5)
    compiled = _compile(_chain, keep_buffers=False)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, w), _chain(x, w))


def _conv_bn_relu_step(compiled, model, x):
    model.zero_grad(set_to_none=True)
    loss = compiled(x)
    loss.backward()
    return loss, [p.grad for p in model.parameters()]


@pytest.mark.parametrize("on", [True, False])
def test_batchnorm_backward_takes_its_input_grad_from_the_pool(on, allocations, tol,
                                                                monkeypatch):
    """BatchNorm's backward kernel returns the [C] weight and bias grads (small: allocated
    directly) and writes the 1 MiB input grad the conv backward reads: with
    runtime.POOL_BESIDE_SMALL_RETURNS that one comes from the pool, not fresh pages per step
    (the zoo ResNet's step faulted ~500 pages per step on it). Loss and grads match eager."""
    from pypto_inductor import runtime

    monkeypatch.setattr(buffers, "SMALL_OUTPUT_BYTES", 64 << 10)  # the default
    monkeypatch.setattr(runtime, "POOL_BESIDE_SMALL_RETURNS", on)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1, bias=False), torch.nn.BatchNorm2d(16),
        torch.nn.ReLU(), torch.nn.Conv2d(16, 16, 3, padding=1, bias=False),
        torch.nn.BatchNorm2d(16), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(), torch.nn.Linear(16, 10)).train()
    ref = copy.deepcopy(model)
    fn = lambda x, m=model: (m(x) * torch.linspace(-1, 1, 10)).sum()  # noqa: E731
    compiled = _compile(fn, fallback="eager")  # the convolutions are oneDNN's
    xs = [torch.randn(4, 3, 64, 64) for _ in range(4)]
    for x in xs[:2]:
        _conv_bn_relu_step(compiled, model, x)
    before = allocations[0]
    got = [_conv_bn_relu_step(compiled, model, x) for x in xs[2:]]
    per_step = (allocations[0] - before) / 2
    for x in xs[:2]:  # eager from the same start (the running stats move with each step)
        _conv_bn_relu_step(lambda x: fn(x, ref), ref, x)
    for x, (loss, grads) in zip(xs[2:], got):
        want, want_grads = _conv_bn_relu_step(lambda x: fn(x, ref), ref, x)
        torch.testing.assert_close(loss, want, atol=1e-3, rtol=1e-4)
        for g, w in zip(grads, want_grads):
            torch.testing.assert_close(g, w, atol=1e-3, rtol=1e-3)
    # fresh buffers per step: the returned ones (saved activations, input-sized grads)
    # only; the BatchNorm backward's input grads come from the pool. (The running-stats
    # kernels' small outputs: the wrapper's, one per BatchNorm, unless they are inline:
    # launcher.INLINE_WRITES, then the generated code's empty_strided, not counted here.)
    expected = {True: 5, False: 6}[on] - (2 if launcher.INLINE_WRITES else 0)
    assert per_step == expected, per_step
