"""Mixed reductions (codegen/cpp/emit_mixed): over dims both before and after the kept ones,
BatchNorm's training statistics (NCHW over [0, 2, 3], C kept) and the sums of its backward.
The tiles are native (reduction.MIXED_REDUCTIONS; they ran the reference executor before)
and match eager: fp32 and bf16, odd sizes, H * W = 1, dynamic shapes, 1 and 2 threads; also
where C == W (a [C] value there fits the domain's last dim as well: reduction.kept_only)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from pypto_inductor.codegen.cpp import reduction


def _native(built):
    assert built and all(k.native for _, k in built), [(t.name, k.reason) for t, k in built]


def _var_mean_norm(x):  # BatchNorm's training forward: statistics, then the normalised x
    v, m = torch.var_mean(x, [0, 2, 3], correction=0, keepdim=True)
    return torch.relu((x - m) * torch.rsqrt(v + 1e-5)), m, v


def _sums(x, g):  # BatchNorm's backward sums, their producers fused
    return g.sum([0, 2, 3]), (g * x).sum([0, 2, 3]), (g * x).mean([0, 2, 3], keepdim=True)


def _middle(x):  # 3-D: reduce [0, 2] keeping dim 1; a max too
    return x.sum([0, 2]), x.amax([0, 2]), x.var([0, 2])


def _two_kept(x):  # the kept dims a block of two: [0, 3] reduced of [N, C, D, W]
    return x.sum([0, 3]), (x * x).mean([0, 3])


SHAPES = [(3, 5, 7, 9), (2, 4, 1, 1), (4, 3, 16, 33)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=["odd", "hw1", "long"])
def test_batchnorm_statistics_are_native(shape, dtype, run_both, built, threads):
    for nt in (1, 2):
        threads(nt)
        g = torch.Generator().manual_seed(nt + sum(shape))
        x = (torch.randn(*shape, generator=g) * 3 + 1).to(dtype)
        y = torch.randn(*shape, generator=g).to(dtype)
        run_both(_var_mean_norm, x)
        run_both(_sums, x, y)
        torch._dynamo.reset()
    _native(built)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_middle_and_block_kept_dims(dtype, run_both, built):
    g = torch.Generator().manual_seed(7)
    run_both(_middle, torch.randn(3, 5, 11, generator=g).to(dtype))
    run_both(_two_kept, torch.randn(3, 2, 5, 7, generator=g).to(dtype))
    _native(built)


def _per_sample_scale(x, s, w):  # an input broadcast over H, W but not over N and C
    return (x * s).sum([0, 2, 3]), torch.relu(x * s + w).mean([0, 2, 3], keepdim=True)


@pytest.mark.parametrize("shape", SHAPES, ids=["odd", "hw1", "long"])
def test_inputs_broadcast_along_the_inner_run(shape, run_both, built, threads):
    # read once per pass, before the run's loop (row_loop.HOIST_BROADCAST_LOADS): at the
    # pass's outer index, not the first sample's (ResNet's conv weight gradients were wrong)
    n, c = shape[:2]
    for nt in (1, 2):
        threads(nt)
        g = torch.Generator().manual_seed(nt + 11)
        x = torch.randn(*shape, generator=g)
        s, w = torch.randn(n, c, 1, 1, generator=g), torch.randn(n, 1, 1, 1, generator=g)
        run_both(_per_sample_scale, x, s, w)
        torch._dynamo.reset()
    _native(built)


def test_dynamic_shapes(run_both, built):
    g = torch.Generator().manual_seed(3)
    for shape in [(3, 5, 7, 9), (2, 5, 4, 6), (5, 5, 3, 3)]:
        x, y = torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)
        run_both(_var_mean_norm, x, dynamic=True)
        run_both(_sums, x, y, dynamic=True)
    _native(built)


def test_switch_off_runs_the_reference(run_both, built, monkeypatch):
    monkeypatch.setattr(reduction, "MIXED_REDUCTIONS", False)
    run_both(_sums, torch.randn(3, 5, 7, 9), torch.randn(3, 5, 7, 9))
    assert any(not k.native for _, k in built)


@pytest.mark.parametrize("nt", [1, 2])
@pytest.mark.parametrize("shape", [(3, 5, 7, 9), (4, 6, 1, 1), (2, 8, 5, 8)],
                         ids=["odd", "hw1", "c-eq-w"])
def test_batchnorm_training_step_matches_eager(shape, nt, built, threads, tol):
    threads(nt)
    torch.manual_seed(1)
    n, c, h, w = shape
    model = nn.Sequential(nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c),
                          nn.ReLU(), nn.Conv2d(c, c, 1, bias=False), nn.BatchNorm2d(c))
    twin = nn.Sequential(*[m for m in [nn.Conv2d(3, c, 3, padding=1, bias=False),
                                       nn.BatchNorm2d(c), nn.ReLU(),
                                       nn.Conv2d(c, c, 1, bias=False), nn.BatchNorm2d(c)]])
    twin.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend="pypto")
    for step in range(2):
        x = torch.randn(n, 3, h, w)
        (compiled(x) ** 2).mean().backward()
        (twin(x) ** 2).mean().backward()
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(a.grad, b.grad, **tol(torch.float32), msg=name)
    for (name, a), b in zip(model.named_buffers(), twin.buffers()):
        torch.testing.assert_close(a, b, **tol(torch.float32), msg=name)
    _native(built)


def test_select_feeding_two_sums_is_branch_free(sources, tmp_path):
    """BatchNorm's backward sums where(relu_out <= 0, 0, g) and where(..) * (x - mean) in
    one pass. g++ 12 sank the load of g into a branch on the mask (the unrolled lanes of two
    sums did not vectorise): a branch per element, 10x slower on random masks. Compiled
    with compiler.NO_TREE_SINK the fast path has no scalar compare (``vcomiss``)."""
    import subprocess

    from pypto_inductor.codegen.cpp import compiler
    found = compiler.find_compiler()
    if found is None or "clang" in found[1].lower():
        pytest.skip("g++ only")
    g = torch.Generator().manual_seed(11)
    a, gr, x = (torch.randn(4, 8, 32, 32, generator=g) for _ in range(3))
    mean = torch.randn(1, 8, 1, 1, generator=g)

    def f(a, gr, x, mean):
        w = torch.where(a <= 0, 0.0, gr)
        return w.sum([0, 2, 3]), (w * (x - mean)).sum([0, 2, 3])

    out = torch.compile(f, backend="pypto")(a, gr, x, mean)
    torch.testing.assert_close(out, f(a, gr, x, mean), atol=1e-4, rtol=1e-5)
    (src,) = sources
    path, _, flags = found
    (tmp_path / "k.cpp").write_text(src)
    subprocess.run([path, *[f for f in flags if f != "-shared"], "-S", str(tmp_path / "k.cpp"),
                    "-o", str(tmp_path / "k.s")], check=True, capture_output=True)
    assert "comiss" not in (tmp_path / "k.s").read_text()


def test_strided_inputs_take_the_generic_path(run_both, built):
    """Channels-last and transposed inputs: the inner reduced dims are not contiguous (the
    kernel's generic path, indices decoded per element), still native and eager's values."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 5, 7, 9, generator=g).contiguous(memory_format=torch.channels_last)
    y = torch.randn(3, 5, 9, 7, generator=g).transpose(2, 3)
    run_both(_var_mean_norm, x)
    run_both(_sums, x, y)
    _native(built)
