"""Special values through every pointwise op the native C++ tiles implement, against eager.

Inputs hold NaN, +-inf, -0.0, 0, the float extremes, FLT_MIN, denormals, large
negatives and positives, and ordinary values, each at several lane positions
(vectorised loop and scalar remainder). Results must match eager with NaNs in
the same places, infinities equal, zeros of the same sign where eager's result
is zero, and otherwise a tight tolerance (a few ulp; ops whose eager result
comes from a cancellation, like GELU's tail, get an absolute term of that
size). The sweep also checks it ran every op of ``cpp_emit.OPS`` natively:
an op added there without a case here fails ``test_sweep_covers_every_native_op``.
"""
from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from pypto_inductor.codegen import cpp
from pypto_inductor.codegen.cpp import compiler as cpp_build
from pypto_inductor.codegen.cpp.ops import OPS

F32_MAX = torch.finfo(torch.float32).max
F32_TINY = torch.finfo(torch.float32).tiny
SPECIALS = [math.nan, math.inf, -math.inf, 0.0, -0.0, F32_MAX, -F32_MAX, 3e38, -3e38, 1e30,
            -1e30, 1e10, -1e10, 7e4, -7e4, 1e4, -1e4, 300.5, -300.5, 100.0, -100.0, 89.0,
            88.5, -87.5, -88.0, -89.0, -95.0, -104.0, -110.0, 44.5, 20.0, -20.0, 10.0, -10.0,
            6.0, -6.0, 5.0, -5.0, 4.0, -4.0, 3.0, -3.0, 2.5, -2.5, 1.0, -1.0, 0.5, -0.5, 0.3,
            -0.7, 1e-3, -1e-3, 1e-7, -1e-7, F32_TINY, -F32_TINY, 1e-39, -1e-39, 1e-44, -1e-45]


def special_input(dtype=torch.float32) -> torch.Tensor:
    """Every special value at several positions: 3 rows of 67 (a vector body and a tail)."""
    v = torch.tensor(SPECIALS, dtype=torch.float32)
    row = torch.cat([v, v.flip(0)])[:67]
    rows = torch.stack([row, row.roll(13), row.roll(-29)])
    return rows.to(dtype)


def _pair_inputs(dtype=torch.float32):
    """Every pair of special values: a [n, n] grid as (a broadcast column, a row)."""
    v = torch.tensor(SPECIALS, dtype=torch.float32).to(dtype)
    return v[:, None].contiguous(), v[None, :].contiguous()


# unary cases: name -> (fn, xtol). Results must be within rtol (a ulp or so) of eager's,
# plus xtol * |x| where eager's result is a cancellation whose rounding depends on its
# implementation (GELU's 1 + erf and 1 + tanh near -1: a ulp of 1 times x / 2).
UNARY = {
    "neg": (torch.neg, 0), "exp": (torch.exp, 0), "log": (torch.log, 0),
    "sqrt": (torch.sqrt, 0), "rsqrt": (torch.rsqrt, 0), "tanh": (torch.tanh, 0),
    "sigmoid": (torch.sigmoid, 0), "silu": (F.silu, 0), "relu": (torch.relu, 0),
    "gelu": (F.gelu, 3e-7), "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"), 1.2e-7),
    "erf": (torch.erf, 0), "erfc": (torch.erfc, 0), "exp2": (torch.exp2, 0),
    "expm1": (torch.expm1, 0), "log1p": (torch.log1p, 0), "log2": (torch.log2, 0),
    "log10": (torch.log10, 0), "sin": (torch.sin, 0), "cos": (torch.cos, 0),
    "tan": (torch.tan, 0), "floor": (torch.floor, 0), "ceil": (torch.ceil, 0),
    "trunc": (torch.trunc, 0), "round": (torch.round, 0), "reciprocal": (torch.reciprocal, 0),
    "abs": (torch.abs, 0), "sign": (torch.sign, 0), "isnan": (torch.isnan, 0), "isinf": (torch.isinf, 0),
    "logical_not": (torch.logical_not, 0), "leaky_relu": (lambda x: F.leaky_relu(x, 0.1), 0),
    "clamp": (lambda x: x.clamp(-2.5, 7.0), 0), "clamp_min": (lambda x: x.clamp(min=0.5), 0),
    "pow2": (lambda x: x.pow(2), 0), "pow3": (lambda x: x.pow(3), 0),
    "pow_half": (lambda x: x.pow(0.5), 0), "pow_m1": (lambda x: x.pow(-1), 0),
    "pow_m2": (lambda x: x.pow(-2), 0), "pow_mhalf": (lambda x: x.pow(-0.5), 0),
    "pow_1_7": (lambda x: x.pow(1.7), 0), "square_plus": (lambda x: x * x + 1.0, 0),
    "to_bool": (lambda x: x.to(torch.bool), 0),
    "softplus": (F.softplus, 0), "hardtanh": (F.hardtanh, 0), "elu": (F.elu, 0),
    "mish": (F.mish, 0), "hardswish": (F.hardswish, 0), "hardsigmoid": (F.hardsigmoid, 0),
    "logsigmoid": (F.logsigmoid, 0),
}
BINARY = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div,
    "maximum": torch.maximum, "minimum": torch.minimum, "pow": torch.pow,
    "eq": torch.eq, "ne": torch.ne, "lt": torch.lt, "le": torch.le, "gt": torch.gt,
    "ge": torch.ge, "where": lambda a, b: torch.where(a > b, a, b),
    "logical_and": torch.logical_and, "logical_or": torch.logical_or,
    "logical_xor": torch.logical_xor, "atan2": torch.atan2, "fmod": torch.fmod,
    "remainder": torch.remainder, "xlogy": torch.xlogy,
}
INT_BINARY = {"bitwise_and": torch.bitwise_and, "bitwise_or": torch.bitwise_or,
              "bitwise_xor": torch.bitwise_xor, "bitwise_not": lambda a, b: ~a + b}
# tile ops the sweep does not call by name: every case runs them (literals, rounding, casts)
NOT_SWEPT = {"full", "copy", "cast"}
# a ulp of the result's dtype (the kernels compute in fp32 and round once, as eager does)
RTOL = {torch.float32: 4e-7, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}
# two of the dtype's smallest denormals: libm and eager's vector math may differ there
ATOL = {torch.float32: 2.9e-45, torch.float16: 1.2e-7, torch.bfloat16: 1.9e-40}
ULPS = {"exp2": 2, "expm1": 2, "log1p": 2, "erfc": 4, "tan": 2, "sin": 2, "cos": 2, "exp": 2,
        "tanh": 3, "sigmoid": 2, "silu": 2, "gelu": 2, "gelu_tanh": 4, "log": 2, "log2": 2,
        "log10": 2, "pow_1_7": 2, "pow": 2, "softplus": 2, "mish": 4, "logsigmoid": 2, "elu": 2,
        "atan2": 2}
# Where eager's own result is an artifact of one of its implementations (not the op's
# semantics), the sweep leaves those inputs out; each entry says why.
EAGER_ARTIFACTS = {
    # float16/bfloat16 erf uses Abramowitz-Stegun 7.1.26: absolute error ~1e-7, so eager
    # gives 0 for tiny inputs
    ("erf", torch.float16): lambda x: x.abs() < 1e-5,
    ("erf", torch.bfloat16): lambda x: x.abs() < 1e-5,
    # float16/bfloat16 maximum/minimum of 0.0 and -0.0: eager's vector body and its scalar
    # tail return different ones
    **{(op, dt): lambda a, b: (a == 0) & (b == 0) for op in ("maximum", "minimum")
       for dt in (torch.float16, torch.bfloat16)},
    # bfloat16 GELU through oneDNN flushes denormal inputs and gives NaN at bf16's max
    ("gelu", torch.bfloat16): lambda x: (x.abs() <= F32_TINY) | (x.abs() > 3e38),
}


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    root = tmp_path_factory.getbasetemp() / "cpp_cache"
    monkeypatch.setenv("PYPTO_INDUCTOR_CACHE_DIR", str(root))
    monkeypatch.setattr(cpp_build, "loaded", dict(cpp_build.loaded))


@pytest.fixture
def native_ops(monkeypatch):
    """The set of tile ops of every kernel the cpp target builds natively, filled as the
    test compiles."""
    seen: set[str] = set()
    real = cpp.build_many

    def spy(tiles, graph):
        kernels = real(tiles, graph)
        for k in kernels:
            if getattr(k, "native", False):
                seen.update(node.attrs["op"] for node in k.program.nodes if node.kind == "op")
        return kernels

    monkeypatch.setattr(cpp, "build_many", spy)
    return seen


def assert_like_eager(out, ref, what: str, inputs=(), rtol=0.0, atol=0.0, xtol=0.0,
                      skip=None) -> None:
    """NaN where eager has NaN, equal infinities, eager's zeros (with their sign) up to a
    denormal or two, else within ``atol + rtol |ref| + xtol |x|`` (x: the first input)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape, (what, out.dtype, ref.dtype)
    xs = [x.expand_as(ref) for x in inputs]
    if not ref.is_floating_point():
        bad = out != ref
    else:
        o, r = out.double(), ref.double()
        x = xs[0].double().abs() if xs else torch.zeros_like(r)
        x = torch.where(x.isfinite(), x, 0.0)
        nan_bad = o.isnan() != r.isnan()
        inf_bad = (r.isinf() | o.isinf()) & (o != r) & ~r.isnan() & ~o.isnan()
        zero_bad = (r == 0) & ((o.abs() > atol) | ((o == 0) & (o.signbit() != r.signbit())))
        tol_bad = (r != 0) & r.isfinite() & ((o - r).abs() > atol + rtol * r.abs() + xtol * x)
        bad = nan_bad | inf_bad | zero_bad | tol_bad
    if skip is not None:
        bad &= ~skip(*xs)
    if bad.any():
        detail = []
        for at in bad.nonzero()[:6].tolist():
            at = tuple(at)
            detail.append(f"x={[float(x[at]) for x in xs]} eager={ref[at].item()!r} "
                          f"pypto={out[at].item()!r}")
        pytest.fail(f"{what}: {int(bad.sum())} of {bad.numel()} differ from eager: "
                    + "; ".join(detail))


def _compile(fn):
    return torch.compile(fn, backend="pypto", options={"target": "cpu", "fallback": "error"})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary_special_values(name, dtype):
    fn, xtol = UNARY[name]
    x = special_input(dtype)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out, ref = _compile(fn)(x), fn(x)
    assert_like_eager(out, ref, f"{name} {dtype}", (x,), RTOL[dtype] * ULPS.get(name, 1),
                      ATOL[dtype], xtol, EAGER_ARTIFACTS.get((name, dtype)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary_special_values(name, dtype):
    fn = BINARY[name]
    a, b = _pair_inputs(dtype)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out, ref = _compile(fn)(a, b), fn(a, b)
    assert_like_eager(out, ref, f"{name} {dtype}", (a, b), RTOL[dtype] * ULPS.get(name, 1),
                      ATOL[dtype], skip=EAGER_ARTIFACTS.get((name, dtype)))


@pytest.mark.parametrize("name", sorted(INT_BINARY))
def test_integer_bitwise_extremes(name):
    ext = torch.tensor([0, 1, -1, 2**31 - 1, -2**31, 2**62, -2**63, 2**63 - 1, 12345, -7])
    a, b = ext[:, None].contiguous(), ext[None, :].contiguous()
    with torch.no_grad():
        out, ref = _compile(INT_BINARY[name])(a, b), INT_BINARY[name](a, b)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


INT_EXTREMES = [0, 1, -1, 2, -2, 2**31 - 1, -2**31, 2**32, 2**62, -2**62, -2**63, 2**63 - 1,
                -2**63 + 1, 12345, -7]
INT_WRAP = {  # signed overflow must wrap as eager's does (fuzz seed 50171)
    "abs_gt0": lambda a, b: torch.where(a.abs() > 0, a.abs(), ~a),
    "neg_gt0": lambda a, b: (-a > 0) | (-a < a),
    "add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
    "add_gt": lambda a, b: (a + b > a) ^ (b > 0), "mul_2_lt": lambda a, b: a * 2 < a,
    "sum": lambda a, b: (a + b).sum(-1), "abs_sum": lambda a, b: a.abs().sum(0),
}


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32], ids=str)
@pytest.mark.parametrize("name", sorted(INT_WRAP))
def test_integer_overflow_wraps_as_eager(name, dtype):
    """Integer arithmetic at the extremes: g++ may fold a comparison by assuming signed
    overflow never happens (``abs(x) > 0`` to ``x != 0``), eager wraps; the kernels are
    built with -fwrapv. Every pair, at 17 and 67 columns (vector body and tail)."""
    info = torch.iinfo(dtype)
    v = torch.tensor([min(max(x, info.min), info.max) for x in INT_EXTREMES], dtype=dtype)
    g = torch.Generator().manual_seed(12)
    for n in (17, 67):
        a = v[torch.randint(0, len(v), (len(v), n), generator=g)]
        b = v[torch.randint(0, len(v), (len(v), n), generator=g)]
        with torch.no_grad():
            out, ref = _compile(INT_WRAP[name])(a, b), INT_WRAP[name](a, b)
        torch.testing.assert_close(out, ref, rtol=0, atol=0, msg=f"{name} {dtype} n={n}")


def test_sweep_covers_every_native_op(native_ops):
    """All cases in one graph (so fused, several ops per kernel), against eager; and every op
    of cpp_emit.OPS ran natively in it."""
    def every_case(x, a, b, i, j):
        return ([fn(x) for fn, _ in UNARY.values()] + [fn(a, b) for fn in BINARY.values()]
                + [fn(i, j) for fn in INT_BINARY.values()])
    x = special_input()
    a, b = _pair_inputs()
    i, j = torch.randint(-2**40, 2**40, (2, 5, 9))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        outs = torch.compile(every_case, backend="pypto", options={"target": "cpu"})(x, a, b, i, j)
    refs = every_case(x, a, b, i, j)
    names = list(UNARY) + list(BINARY) + list(INT_BINARY)
    for name, out, ref in zip(names, outs, refs):
        xtol = UNARY[name][1] if name in UNARY else 0
        inputs = (x,) if name in UNARY else (a, b) if name in BINARY else (i, j)
        assert_like_eager(out, ref, f"{name} (fused)", inputs, RTOL[torch.float32]
                          * ULPS.get(name, 1), ATOL[torch.float32], xtol)
    missing = set(OPS) - native_ops - NOT_SWEPT
    assert not missing, f"add special-value cases for {sorted(missing)} to this module"


# NaN sign bits (copysign and signbit read them; fuzz seeds 40165, 22137). Where eager's own
# sign depends on where the element falls (its vector body or its scalar tail), a fused
# kernel follows the vector body, so only that body is checked: {(name, dtype): why}.
NAN_SIGN_BY_POSITION = {
    ("pow_1_7", torch.float32): "vectorized pow: negative NaN; scalar tail: the input's",
    **{(name, torch.float16): "float16 vector body: negative NaN; scalar tail: the input's"
       for name in ("pow2", "pow3", "pow_half", "pow_m1", "pow_m2", "pow_mhalf", "pow_1_7",
                    "gelu_tanh")},
}
# composite ops whose NaN sign follows their decomposition's order of operations, not
# eager's fused kernel (open, docs/fuzz.md): {(name, dtype): what eager gives}
NAN_SIGN_OPEN: dict = {}


def _nans(n: int, dtype) -> torch.Tensor:
    x = torch.full((n,), math.nan)
    x[1::2] = -x[1::2]  # +NaN and -NaN alternate
    return x.to(dtype)


@pytest.mark.parametrize("name", sorted(set(UNARY) - {"isnan", "isinf", "sign", "to_bool",
                                                     "logical_not"}))
def test_nan_sign_bits_match_eager(name):
    """signbit(compiled) == signbit(eager) wherever eager's result is NaN, for +NaN and
    -NaN inputs, float32 and float16, at a vectorised size (67: a vector body and a tail)
    and a size eager runs in its scalar tail only (3)."""
    fn = UNARY[name][0]
    dtypes = [torch.float32, torch.float16]
    xs = [_nans(n, dt) for dt in dtypes for n in (67, 3)]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        outs = _compile(lambda *xs: [fn(x) for x in xs])(*xs)
    for x, out in zip(xs, outs):
        if (name, x.dtype) in NAN_SIGN_OPEN or ((name, x.dtype) in NAN_SIGN_BY_POSITION
                                                 and x.numel() < 32):
            continue
        ref = fn(x)
        if (name, x.dtype) in NAN_SIGN_BY_POSITION:  # eager's vector body: 2 AVX-512 vectors
            out, ref = out[:64], ref[:64]
        nan = ref.isnan()
        assert torch.equal(out.isnan(), nan), (name, x.dtype, x.numel())
        bad = nan & (out.signbit() != ref.signbit())
        assert not bad.any(), (f"{name} {x.dtype} n={x.numel()}: NaN sign unlike eager's at "
                               f"{bad.nonzero().flatten().tolist()[:8]} (input signs "
                               f"{x.signbit()[bad].tolist()[:8]})")


# bfloat16 NaN bits: eager's kernels store a NaN they computed in float as 0xffff (ATen's
# vectorized conversion: vector bodies, casts, vec::map ops at every position), a reduction's
# as 0x7fc0 (c10::BFloat16), and copy / cat / where / neg / abs work on the bfloat16 bits.
# Elementwise ops' scalar tails (0x7fc0) are not followed: only the first 64 elements (two
# AVX-512 vectors of 32) of those are compared. {name: (fn, whole output compared)}
BF16_NAN_CASES = {
    "add": (lambda x, y: x + 1, False), "mul_add": (lambda x, y: x * y + x, False),
    "exp": (lambda x, y: torch.exp(x), True), "tanh": (lambda x, y: torch.tanh(x), True),
    "sqrt_neg": (lambda x, y: torch.sqrt(y - 10), True),
    "cast": (lambda x, y: (x.float() * 2).to(torch.bfloat16), True),
    "neg": (lambda x, y: -x, False), "abs": (lambda x, y: x.abs(), False),
    "neg_of_add": (lambda x, y: -(x + 1), False),
    "where": (lambda x, y: torch.where(y > 0, x, y), True),
    "cat": (lambda x, y: torch.cat([x, y], -1), True),
    "gelu": (lambda x, y: F.gelu(x), True),
    "sum": (lambda x, y: (x * y).sum(-1), True), "mean": (lambda x, y: x.mean(-1), True),
    "sum_dim0": (lambda x, y: (x + y).sum(0), True),
}


def _bf16_with_nans(shape, g) -> torch.Tensor:
    """Random bfloat16 values, a third of them NaNs of both signs with assorted payloads
    (quiet, signalling, all ones)."""
    bits = torch.tensor([0x7fc0, 0xffc0, 0x7f81, 0xff81, 0x7fff, 0xffff, 0x7fa5, 0xffe3],
                        dtype=torch.int32)
    x = torch.randn(shape, generator=g).to(torch.bfloat16).view(torch.int16)
    pick = torch.randint(0, 8, shape, generator=g)
    nan = torch.rand(shape, generator=g) < 0.35
    x[nan] = bits[pick[nan]].to(torch.int16)
    return x.view(torch.bfloat16)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name", sorted(BF16_NAN_CASES))
def test_bfloat16_nan_bits_match_eager(name, threads):
    """The raw bits (.view(torch.int16)) of bfloat16 outputs holding NaNs equal eager's
    (0x7fc0 everywhere before: c10's NaN; eager's vector conversion stores 0xffff)."""
    fn, whole = BF16_NAN_CASES[name]
    g = torch.Generator().manual_seed(len(name))
    x, y = _bf16_with_nans((5, 67), g), _bf16_with_nans((5, 67), g)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            out, ref = _compile(fn)(x, y), fn(x, y)
    finally:
        torch.set_num_threads(old)
    if not whole:  # eager's vector body only (each row of 67 runs in one loop of 335)
        out, ref = out.reshape(-1)[:320], ref.reshape(-1)[:320]
    assert ref.isnan().any(), name
    bad = (out.view(torch.int16) != ref.view(torch.int16)).nonzero().flatten().tolist()
    ob = out.reshape(-1).view(torch.int16)
    rb = ref.reshape(-1).view(torch.int16)
    assert not bad, (f"{name}: {len(bad)} of {out.numel()} differ from eager's bits, e.g. "
                     f"{[(i, hex(int(ob[i]) & 0xffff), hex(int(rb[i]) & 0xffff)) for i in bad[:4]]}"
                     " (ours, eager's)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_nan_sign_of_a_square_survives_sign_copies(dtype):
    """-NaN * -NaN is the negative NaN on x86 (eager keeps it), but GCC folded
    std::copysign(r, x * x) to fabs(r) ("x * x is not negative"): float16 x * x + 1 (the
    rounding rnd_f16 copies the sign), tanh(x * x) and erf(x * x) lost the sign. The
    prelude copies signs with bit operations (pi_copysign)."""
    fns = (lambda x: x * x + 1.0, lambda x: torch.tanh(x * x), lambda x: torch.erf(x * x),
           lambda x: torch.tanh(x) * torch.tanh(x) + 0.5)
    x = _nans(67, dtype)
    for k, f in enumerate(fns):  # one kernel each: a shared x * x is not folded alike
        out, ref = _compile(f)(x), f(x)
        assert torch.equal(out.isnan(), ref.isnan()), k
        assert torch.equal(out.signbit(), ref.signbit()), (k, out.signbit().int().tolist()[:8],
                                                           ref.signbit().int().tolist()[:8])


@pytest.mark.parametrize("n", [67, 3])
def test_softmax_nan_sign_bits_match_eager(n):
    """Seed 22137: signbit(softmax(x, -1)) of rows holding NaN or inf. Over the last dim
    eager's log_softmax NaN has the input's sign where the input is NaN and is negative
    elsewhere; its softmax NaN is negative except in rows whose NaNs sit in particular lanes
    of its max (left out here: rows with a NaN at a fixed place or an inf), and in rows
    shorter than a vector, where its scalar max passes the first NaN's sign on (not
    matched: only log_softmax is checked at n = 3)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(8, n, generator=g)
    x[0, 0], x[1, n - 1], x[2, 1], x[3, 0] = math.nan, -math.nan, math.inf, -math.nan
    x[4, :2] = torch.tensor([math.inf, -math.inf])
    x[5, 0], x[5, -1] = math.nan, -math.nan
    funcs = (lambda x: torch.softmax(x, -1), lambda x: torch.log_softmax(x, -1),
             lambda x: torch.softmax(x.half(), -1, dtype=torch.float32))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for fn in funcs if n >= 16 else funcs[1:2]:
            out, ref = _compile(fn)(x), fn(x)
            nan = ref.isnan()
            assert nan[:6].any(1).all() and torch.equal(out.isnan(), nan)
            assert torch.equal(out.signbit()[nan], ref.signbit()[nan])


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16], ids=str)
def test_column_softmax_nan_sign_bits_match_eager(dtype, dynamic, monkeypatch):
    """Seed 50013: signbit of softmax / log_softmax over a dim that is not the last, columns
    holding NaN (either sign), +-inf, and all -inf: eager's NaN signs depend on the
    element's lane (vector or scalar, after its thread split) for softmax, on the last
    NaN-making element for log_softmax (reduction.column_softmax). At 1 and 2 threads;
    over dim 0 the kernels must be native."""
    natives = []
    real = cpp.build_many

    def spy(tiles, graph):
        kernels = real(tiles, graph)
        natives.extend(getattr(k, "native", False) for k in kernels)
        return kernels

    monkeypatch.setattr(cpp, "build_many", spy)
    g = torch.Generator().manual_seed(50013)
    cases = [((12, 12, 12), 0), ((12, 12, 12), 1), ((5, 7, 37), 1), ((3, 20, 33), 0),
             ((40, 17), 0), ((2, 3, 4, 5), 1)]
    fns = [lambda x, d: torch.softmax(x, d), lambda x, d: torch.log_softmax(x, d)]
    if dtype == torch.float16:
        fns.append(lambda x, d: torch.softmax(x, d, dtype=torch.float32))
    threads = torch.get_num_threads()
    try:
        for shape, d in cases:
            x = torch.randn(shape, generator=g) * 10
            special = torch.tensor([math.nan, -math.nan, math.inf, -math.inf])
            pick = special[torch.randint(0, 4, shape, generator=g)]
            x = torch.where(torch.rand(shape, generator=g) < 0.12, pick, x)
            x.select(d, 1).select(-1, 0).fill_(-math.inf)  # a column of -inf and NaN
            x = x.to(dtype)
            for fn in fns:
                compiled = torch.compile(fn, backend="pypto", dynamic=dynamic,
                                         options={"target": "cpu", "fallback": "error"})
                natives.clear()
                for nt in (1, 2):
                    torch.set_num_threads(nt)
                    with torch.no_grad(), warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        out, ref = compiled(x, d), fn(x, d)
                    nan = ref.isnan()
                    assert nan.any() and torch.equal(out.isnan(), nan)
                    bad = nan & (out.signbit() != ref.signbit())
                    assert not bad.any(), (shape, d, nt, bad.nonzero()[:4].tolist())
                # a softmax over a middle dim, or in float64, runs ATen's kernel (not native)
                assert all(natives) or d != 0 or dtype == torch.float64, (shape, d, natives)
    finally:
        torch.set_num_threads(threads)


def _ulps(v, f64):
    """|v - f64| in units of the spacing of v's dtype at |f64|."""
    r = f64.to(v.dtype).abs()
    return (v.double() - f64).abs() / (torch.nextafter(r, torch.tensor(math.inf, dtype=v.dtype)) - r).double()


def test_erf_and_gelu_accuracy_against_float64():
    """Fuzz seeds 30759, 21822, 32060 (docs/fuzz.md): erf within 1.5 ulps of float64 (eager's
    Sleef erf 0.7; the old rational fit 6.4), and gelu nowhere farther from float64 than
    eager's own error or 6 ulps of the result, whichever is larger: its negative tail is
    x erfc(-x / sqrt 2) / 2, where 1 + erf cancels (eager 100% off at x = -5.5, 2% at -4).
    Where eager's 1 + erf is exactly 0 (x below -5.54, or at some x down to -5.48) ours may
    give the true tiny value; below -5.5426 both are -0.0."""
    x = torch.linspace(-10, 10, 400_001)
    x64 = x.double()
    with torch.no_grad():
        erf = _compile(torch.erf)(x)
        assert _ulps(erf, torch.erf(x64)).max() <= 1.5
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            xd = x.to(dtype)
            out, ref = _compile(F.gelu)(xd), F.gelu(xd)
            xd64 = xd.double()
            f64 = xd64 * 0.5 * torch.special.erfc(-xd64 / math.sqrt(2))
            tiny = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps  # a denormal
            bound = torch.maximum((ref.double() - f64).abs(), 6 * torch.finfo(dtype).eps * f64.abs())
            bad = (out.double() - f64).abs() > bound + tiny
            assert not bad.any(), (dtype, xd[bad][:4].tolist(), out[bad][:4].tolist(), ref[bad][:4].tolist())
            far = xd < -5.5426
            assert (out[far] == 0).all() and out[far].signbit().all(), dtype
