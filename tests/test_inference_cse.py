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


def test_scalars_of_other_types_and_outputs_are_not_merged():
    """x * 1 (int) and x * 1.0 differ in dtype, x + 0.0 and x + -0.0 in the sign of
    zero; two identical outputs stay two tensors (no shared storage eager did not have);
    identical pure calls merge (one tanh kernel input)."""
    from pypto_inductor.lowering.cse import cse

    def fn(i, x):
        a, b = i * 1, i * 1.0
        c, d = x + 0.0, x + -0.0
        t = torch.tanh(x) + torch.tanh(x)
        return a, b, c, d, x.exp(), x.exp(), t

    args = (torch.randint(-5, 5, (3, 4)), torch.tensor([[-0.0, 1.5], [2.0, -3.0]]))
    gm = torch.fx.experimental.proxy_tensor.make_fx(fn, tracing_mode="fake")(*args)
    merged = cse(gm)
    tanhs = [n for n in merged.graph.nodes if n.target == torch.ops.aten.tanh.default]
    assert len(tanhs) == 1
    with torch.no_grad():
        got = torch.compile(fn, backend="pypto")(*args)
    want = fn(*args)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
        assert g.dtype == w.dtype
    assert torch.equal(torch.signbit(got[2]), torch.signbit(want[2]))
    assert torch.equal(torch.signbit(got[3]), torch.signbit(want[3]))
    assert got[4].data_ptr() != got[5].data_ptr()


def test_graphs_with_mutations_are_left_alone():
    from pypto_inductor.lowering.cse import cse

    def fn(x, buf):
        a = x.sin()
        buf.add_(1)
        return a + x.sin() + buf

    gm = torch.fx.experimental.proxy_tensor.make_fx(fn)(torch.randn(4), torch.zeros(4))
    assert cse(gm) is gm


def test_first_compile_does_not_import_inductor():
    """The pass is ours: torch's fx_graph_cse imported Inductor's pattern matcher (0.4 s
    of CPU at every process's first compile)."""
    import subprocess
    import sys

    code = ("import sys, torch, pypto_inductor\n"
            "f = torch.compile(lambda x: torch.tanh(x) + torch.tanh(x), backend='pypto')\n"
            "with torch.no_grad(): f(torch.randn(8))\n"
            "print('torch._inductor.pattern_matcher' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"
