"""fp16 conversions of the native C++ target against eager.

The prelude's block conversions (``pi_ld_f16_n`` / ``pi_st_f16_n``: AVX-512 or F16C
instructions, else the scalar ``ld_f16`` / ``st_f16``) and its in-loop ``rnd_f16`` are
compiled with the host's flags and with the vector ISAs switched off, and compared bit
for bit with torch's conversions: every half, the midpoints between halves (ties round
to even), overflow near 65520, float subnormals, NaN, infinities and -0.0, at lengths
that leave vector tails. Then whole kernels whose fast path stages fp16 rows in float
blocks (half_staging.STAGE): odd lengths, several blocks, transposed and sliced inputs,
column cats, special values, in place.
"""
from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

from pypto_inductor.codegen.cpp import compiler as cpp_build
from pypto_inductor.codegen.cpp import half_staging
from pypto_inductor.codegen.cpp.prelude import PRELUDE

HARNESS = PRELUDE + r"""
extern "C" void t_ld(const uint16_t* s, float* d, int64_t n) { pi_ld_f16_n(s, d, n); }
extern "C" void t_st(const float* s, uint16_t* d, int64_t n) { pi_st_f16_n(s, d, n); }
extern "C" void t_rnd(const float* s, float* d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) d[i] = rnd_f16(s[i]);
}
extern "C" void t_rnd_n(const float* s, float* d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) d[i] = s[i];
  pi_rnd_f16_n(d, n);
}
extern "C" void t_rnd_bf16(const float* s, float* d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) d[i] = rnd_bf16(s[i]);
}
extern "C" void t_exp(const float* s, float* d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) d[i] = pi_exp(s[i]);
}
extern "C" void t_exp_d(const float* s, float* d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) d[i] = pi_exp_d(s[i]);
}
extern "C" int t_isa() {  // which block conversion this build uses
#if defined(__AVX512F__)
  return 2;
#elif defined(__F16C__) && defined(__AVX__)
  return 1;
#else
  return 0;
#endif
}
"""
# the host's flags, then without AVX-512 (F16C's 8 lanes), then with neither (scalar)
ISAS = {"native": (), "f16c": ("-mno-avx512f",), "scalar": ("-mno-avx512f", "-mno-f16c")}


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("PYPTO_INDUCTOR_CACHE_DIR",
                       str(tmp_path_factory.getbasetemp() / "cpp_cache"))
    monkeypatch.setattr(cpp_build, "loaded", dict(cpp_build.loaded))


def _lib(isa):
    if cpp_build.find_compiler() is None:
        pytest.skip("no C++ compiler")
    flags = ISAS[isa]
    if flags and "-march=native" not in cpp_build.find_compiler()[2]:
        pytest.skip("the compiler does not take -march=native: only the scalar path exists")
    return cpp_build.load_library(HARNESS, ("t_ld", "t_st", "t_rnd", "t_rnd_n", "t_rnd_bf16", "t_exp", "t_exp_d", "t_isa"), flags)


def _ptr(t):
    return ctypes.c_void_p(t.data_ptr())


def _call(fn, src, dst, n):
    fn(_ptr(src), _ptr(dst), ctypes.c_int64(n))


def _floats() -> torch.Tensor:
    """Every half, the midpoints between neighbours and a float ulp either side of them,
    the overflow threshold, float subnormals, specials, and random bit patterns."""
    h = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    finite = h[h.isfinite()].unique().double()
    mid = ((finite[1:] + finite[:-1]) / 2).float()  # exact in float: ties
    near = torch.cat([mid, mid.nextafter(torch.full_like(mid, float("inf"))),
                      mid.nextafter(torch.full_like(mid, -float("inf")))])
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), -float("nan"),
                            65504.0, 65519.99, 65520.0, -65520.0, 65536.0, 1e9, 3.4e38, -3.4e38,
                            2.0 ** -24, 2.0 ** -25, 2.0 ** -25 * 1.0000001, 2.0 ** -26, -2.0 ** -25,
                            2.0 ** -14, 2.0 ** -14 * (1 - 2.0 ** -12), 6e-8, -6e-8,
                            1e-39, -1e-39, 1e-45, -1e-45, 1.1754944e-38])
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (200_000,), generator=g, dtype=torch.int64)
    rnd = bits.to(torch.int32).view(torch.float32)
    return torch.cat([h, near, special, rnd]).contiguous()


def _same(out, ref, what):
    """Bitwise equal, except that any NaN matches any NaN."""
    nan = ref.isnan()
    assert torch.equal(out.isnan(), nan), f"{what}: NaN placement differs"
    o, r = out[~nan], ref[~nan]
    half = (torch.float16, torch.bfloat16)
    bad = (o.view(torch.int16) if o.dtype in half else o.view(torch.int32)) != \
        (r.view(torch.int16) if r.dtype in half else r.view(torch.int32))
    if bad.any():
        i = bad.nonzero()[:5, 0]
        pytest.fail(f"{what}: {int(bad.sum())} differ, e.g. out {o[i].tolist()} eager {r[i].tolist()}")


@pytest.mark.parametrize("isa", list(ISAS))
def test_block_conversions_match_eager(isa):
    lib = _lib(isa)
    want = {"native": None, "f16c": 1, "scalar": 0}[isa]
    if want is not None:
        assert lib.t_isa() == want, f"{isa} build took path {lib.t_isa()}"
    halves = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16)
    out = torch.empty(halves.numel(), dtype=torch.float32)
    _call(lib.t_ld, halves, out, halves.numel())
    _same(out, halves.float(), f"{isa} load")

    x = _floats()
    h = torch.empty(x.numel(), dtype=torch.float16)
    _call(lib.t_st, x, h, x.numel())
    _same(h, x.to(torch.float16), f"{isa} store")
    r = torch.empty_like(x)
    _call(lib.t_rnd, x, r, x.numel())
    _same(r, x.to(torch.float16).float(), f"{isa} rnd_f16")
    r = torch.empty_like(x)
    _call(lib.t_rnd_n, x, r, x.numel())
    _same(r, x.to(torch.float16).float(), f"{isa} pi_rnd_f16_n")


def test_rnd_bf16_and_exp_special_values():
    """The in-loop bf16 rounding against eager's (ties between bfloat16s to even, the
    float max rounding to inf, subnormals, a NaN stays NaN), and pi_exp with its selects
    (pi_exp_d: as bit masks, silu's and sigmoid's): NaN, +-inf, the underflow (< -104: 0)
    and overflow (> 88.72: inf) edges, the same bits from both."""
    lib = _lib("native")
    b = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    fin = b[b.float().isfinite()].float().unique().double()
    mid = ((fin[1:] + fin[:-1]) / 2).float()  # exact in float: ties
    x = torch.cat([_floats(), b.float(), mid, mid.nextafter(torch.full_like(mid, 1e38)),
                   mid.nextafter(torch.full_like(mid, -1e38)),
                   torch.tensor([3.4028235e38, -3.4028235e38, 3.3961776e38])]).contiguous()
    r = torch.empty_like(x)
    _call(lib.t_rnd_bf16, x, r, x.numel())
    _same(r, x.to(torch.bfloat16).float(), "rnd_bf16")

    e = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 88.7229, 89.0,
                      1e30, -104.00001, -105.0, -1e30])
    want = torch.tensor([float("nan"), float("inf"), 0.0, 1.0, 1.0] + [float("inf")] * 3
                        + [0.0] * 3)
    e2 = torch.cat([torch.linspace(-87.3, 88.7, 20001), torch.linspace(-104, -87.3, 2001)])
    for fn in (lib.t_exp, lib.t_exp_d):
        out = torch.empty_like(e)
        _call(fn, e, out, e.numel())
        torch.testing.assert_close(out, want, rtol=0, atol=0, equal_nan=True)
        out = torch.empty_like(e2)
        _call(fn, e2, out, e2.numel())
        torch.testing.assert_close(out, e2.exp(), rtol=1e-6, atol=1e-44)


@pytest.mark.parametrize("isa", ["native", "scalar"])
def test_block_conversion_tails(isa):
    """Every length up to 40 at an unaligned start: the vector body, masked or scalar
    tails, and nothing written past the end."""
    lib = _lib(isa)
    src = (torch.randn(64) * 1000).to(torch.float16)
    src[5], src[9], src[30] = float("nan"), -0.0, float("inf")
    for n in range(41):
        out = torch.full((48,), 7.0)
        _call(lib.t_ld, src[3:], out[1:], n)
        _same(out[1:1 + n], src[3:3 + n].float(), f"load n={n}")
        assert (out[0] == 7.0) and bool((out[1 + n:] == 7.0).all()), f"load n={n} overran"
        back = torch.full((48,), 3.0, dtype=torch.float16)
        _call(lib.t_st, out[1:], back[1:], n)
        _same(back[1:1 + n], src[3:3 + n], f"store n={n}")
        assert (back[0] == 3.0) and bool((back[1 + n:] == 3.0).all()), f"store n={n} overran"


# --- whole kernels -------------------------------------------------------------------
def _check(fn, *inputs, sources=None, staged=True, atol=1e-2, rtol=1e-2):
    compiled = torch.compile(fn, backend="pypto", options={"target": "cpu", "fallback": "error"})
    with torch.no_grad():
        out, ref = compiled(*inputs), fn(*inputs)
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol, equal_nan=True)
    if sources is not None:
        assert sources, "no native kernel"
        assert any("pi_ld_f16_n(in" in s for s in sources) == staged
    return out, ref


def _h(*shape):
    return torch.randn(*shape).to(torch.float16)


CASES = {
    "add_gelu": lambda x, w, b: F.gelu(x + 1.0),
    "mul_add_silu": lambda x, w, b: F.silu(x * w + b),
    "layernorm": lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b),
    "rmsnorm": lambda x, w, b: (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True)
                                                        + 1e-6)).to(x.dtype) * w,
    "softmax": lambda x, w, b: torch.softmax(x, -1),
    "sum_max": lambda x, w, b: (x.sum(-1), x.amax(-1)),
}


@pytest.mark.parametrize("cols", [1, 15, 17, 1000, 1027, 2 * half_staging.STAGE + 33])
@pytest.mark.parametrize("case", list(CASES))
def test_staged_rows_match_eager(case, cols, sources):
    """Row lengths below one vector, with tails, and over several staging blocks (where a
    sum's interleaved lanes run inside each block)."""
    _check(CASES[case], _h(5, cols), _h(cols), _h(cols), sources=sources)


def test_staged_special_values(sources):
    """NaN, infinities, -0.0, half subnormals and overflow through staged loads, float
    math and staged stores, at positions in the vector body and in the tail."""
    vals = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 6e-8, -6e-8,
                         3e-5, 65504.0, -65504.0, 1.0, -1.5, 2.0 ** -14, 2.0 ** -24])
    x = vals.repeat(5)[:67].to(torch.float16).reshape(1, 67).repeat(3, 1)
    x[1] = x[1].roll(7)
    y = x.flip(1).contiguous()
    out, ref = _check(lambda a, b: (a + b, a * 2.0, -a, a * 1e-3, torch.relu(a), a.abs()),
                      x, y, sources=sources, atol=0, rtol=0)
    for o, r in zip(out, ref):  # -0.0 kept where eager keeps it
        assert torch.equal(o.signbit(), r.signbit()) or bool(r.isnan().any())
    # values rounding to inf and to subnormals in the stored result
    _check(lambda a: (a * 1e5, a * 1e-6), x, sources=sources, atol=0, rtol=0)


def test_strided_and_transposed_half_inputs(sources):
    """A transposed fp16 input is read strided (not staged) beside staged ones; a sliced
    one has unit column stride and is staged from its offset."""
    base = _h(70, 131)
    _check(lambda a, b: a.t() * b + 1.0, base, _h(131, 70))
    _check(lambda a: torch.softmax(a, -1), base[3:60:2, 5:120])
    _check(lambda a, b: F.layer_norm(a.t().contiguous() + b, (70,)), base, _h(70),
           sources=sources)


def test_column_cat_and_in_place(sources):
    """A column cat's parts are staged from their offsets; a copy_ into an input (the
    output aliases it) is not staged."""
    _check(lambda a, b: torch.cat([a, b], -1) * 2.0, _h(9, 37), _h(9, 60), sources=sources)

    def inplace(a, b):
        a.copy_(a * b + 1.0)
        return a
    a, b = _h(6, 100), _h(6, 100)
    ref = a * b + 1.0
    compiled = torch.compile(inplace, backend="pypto", options={"target": "cpu",
                                                                "fallback": "error"})
    with torch.no_grad():
        compiled(a, b)
    torch.testing.assert_close(a, ref, atol=0, rtol=0)


def test_staging_switch(monkeypatch, sources):
    """STAGE_HALF off: the same kernels convert element by element, same results."""
    monkeypatch.setattr(half_staging, "STAGE_HALF", False)
    _check(CASES["layernorm"], _h(4, 300), _h(300), _h(300), sources=sources, staged=False)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_rounded_once_matches_eager(dtype):
    """A stored half value is left unrounded in the loop (the store rounds it): chains of
    half ops whose intermediates eager rounds, against eager exactly."""
    x, y = (torch.randn(4, 257) * 300).to(dtype), (torch.randn(4, 257) * 300).to(dtype)
    _check(lambda a, b: ((a * b) + a).to(dtype) * 0.1, x, y, atol=0, rtol=0)
    _check(lambda a, b: (a.float() * b.float()).to(dtype), x, y, atol=0, rtol=0)
    _check(lambda a, b: (a * b, (a * b).float() * 3.0), x, y, atol=0, rtol=0)


@pytest.mark.parametrize("shape", [(300, 37), (64, 1100), (3, 5, 20)])
def test_staged_column_reductions(shape, sources):
    """Column reductions (emit_columns) stage the block's fp16 columns and per-element
    outputs: block widths with tails, more than one block, a reduction over two dims."""
    x, b = _h(*shape) * 3.0, _h(shape[-1])
    x.view(-1)[7] = float("nan")

    def fn(x, b):
        y = x * 2.0 + b  # a per-element fp16 output written by the pass that sums it
        dims = tuple(range(x.dim() - 1))
        return y, y.sum(dims), x.amax(0), x.float().mean(0), (x - x.mean(0)).var(0)
    _check(fn, x, b, sources=sources, atol=2e-2, rtol=2e-2)


def test_dynamic_sizes_and_two_threads(sources):
    """Symbolic row lengths (block staging only, no per-row float copy) and two threads
    sharing the per-call converted weight."""
    fn = CASES["layernorm"]
    compiled = torch.compile(fn, backend="pypto", options={"target": "cpu", "fallback": "error"},
                             dynamic=True)
    with torch.no_grad():
        for rows, cols in ((7, 33), (12, 1030)):
            x, w, b = _h(rows, cols), _h(cols), _h(cols)
            torch.testing.assert_close(compiled(x, w, b), fn(x, w, b), atol=1e-2, rtol=1e-2)
    assert any("pi_ld_f16_n(in" in s for s in sources)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for case in ("layernorm", "mul_add_silu"):
            torch._dynamo.reset()
            _check(CASES[case], _h(64, 1024), _h(1024), _h(1024))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cols", [1, 15, 17, 1027, 2 * half_staging.STAGE + 33])
def test_split_roundings_match_unsplit(cols, dtype, monkeypatch, sources):
    """A staged fp16 loop with a math call computes each rounded intermediate in a loop of
    its own, rounded in place by pi_rnd_f16_n (half_staging.SPLIT_ROUNDINGS): the same bits
    as rounding inline, and eager's values. silu(x * w + b) (each block rewritten in place
    by the next loop, the first in x's staged block), and a chain whose first intermediate
    the last loop reads again (a block kept while another is written), with special values
    in the rows. bf16 (not staged) gets the same blocks, rounded by rnd_bf16 in the loop."""
    def chain(x, w, b):
        t = x * w
        return F.silu(t + b) * t, torch.sigmoid(x + b)
    x, w, b = (torch.randn(4, cols) * 4).to(dtype), _h(cols).to(dtype), _h(cols).to(dtype)
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 6e-8, 65504.0,
                             300.0, -300.0, 2.0 ** -24, 1e-4])
    x[1, :min(cols, len(specials))] = specials[:cols].to(dtype)
    for fn in (CASES["mul_add_silu"], chain):
        split, _ = _check(fn, x, w, b, sources=sources, staged=dtype == torch.float16)
        mark = "pi_rnd_f16_n(s" if dtype == torch.float16 else "sh0[c - cs] = rnd_bf16("
        assert any(mark in src for src in sources)  # a staged or own block
        monkeypatch.setattr(half_staging, "SPLIT_ROUNDINGS", False)
        torch._dynamo.reset()
        inline, _ = _check(fn, x, w, b)
        monkeypatch.setattr(half_staging, "SPLIT_ROUNDINGS", True)
        torch._dynamo.reset()
        for a, b_ in zip(split if isinstance(split, tuple) else (split,),
                         inline if isinstance(inline, tuple) else (inline,)):
            _same(a, b_, "split vs inline")
