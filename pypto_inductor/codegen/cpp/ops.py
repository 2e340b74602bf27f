"""The C++ target's op table and value helpers: how each tile op is written in C++.

:data:`OPS` maps a canonical tile op (see :mod:`pypto_inductor.ops`) to a function
of its operands' C++ expressions and its :class:`.program.Node` returning the
expression computing it; :func:`expression` writes a node's right-hand side with
its operands converted to the op's compute dtype and the result rounded to its
dtype. Values compute in ``float`` (fp16/bf16 loaded and stored with the prelude's
bit conversions), ``int64_t`` or ``bool``; :data:`STORAGE` is the memory type.
"""
from __future__ import annotations

import math

import sympy
import torch
from torch.utils._sympy.printers import CppPrinter

from ...ops import float_only
from ...sizes import is_symbolic

_PRINTER = CppPrinter()

STORAGE = {torch.float32: "float", torch.float16: "uint16_t", torch.bfloat16: "uint16_t",
           torch.int64: "int64_t", torch.int32: "int32_t", torch.int16: "int16_t",
           torch.int8: "int8_t", torch.uint8: "uint8_t",
           torch.bool: "uint8_t"}  # bool loads as bytes: GCC vectorises `b != 0`, not `bool`


def ctype(dt) -> str:
    if dt == torch.float64:  # only a reduction's wide accumulator (var/std, var_mean's mean)
        return "double"
    if dt is None or dt.is_floating_point:
        return "float"
    return "bool" if dt == torch.bool else "int64_t"


def finalize(e: str, dt) -> str:
    """An expression rounded to dtype ``dt`` (kept in its compute type)."""
    if dt is None or dt == torch.float32:
        return f"(float)({e})"
    if dt == torch.float64:
        return f"(double)({e})"
    if dt == torch.float16:
        return f"rnd_f16((float)({e}))"
    if dt == torch.bfloat16:
        return f"rnd_bf16((float)({e}))"
    if dt == torch.bool:
        return f"(bool)({e})"
    if dt == torch.int64:  # pi_i64/pi_i32: a float converts as eager does (NaN -> INT_MIN)
        return f"pi_i64({e})"
    return f"(int64_t)({STORAGE[dt]})pi_i32({e})"  # narrower types wrap as eager's do


def conv(e: str, src, dst) -> str:
    src, dst = src or torch.float32, dst or torch.float32
    if src == dst or (dst == torch.float32 and src.is_floating_point and src != torch.float64):
        return e
    return finalize(e, dst)


def load(e: str, dt) -> str:
    if dt == torch.float16:
        return f"ld_f16({e})"
    if dt == torch.bfloat16:
        return f"ld_bf16({e})"
    if dt == torch.bool:
        return f"({e} != 0)"
    return e if dt == torch.float32 else f"(int64_t){e}"


# A bfloat16 NaN is stored with the bits eager's kernels give it (measured, torch 2.13,
# AVX-512; tests/test_special_values.py::test_bfloat16_nan_bits_match_eager): a value
# computed in float goes through ATen's vectorized conversion (cvtfp32_bf16: any NaN is
# 0xffff; in the vector bodies, and at every position for casts and vec::map ops such as
# exp); a reduction's result through c10::BFloat16 (0x7fc0); copies, cat, where, neg and abs
# work on the bfloat16 bits (an input NaN's own, or the stored 0xffff, sign flipped or
# cleared); gelu passes the input NaN on, quieted. Elementwise ops' scalar tails (their last
# < 32 elements) store 0x7fc0: a fused kernel follows the vector body. False: every NaN
# 0x7fc0 (the old store).
BF16_NAN_BY_PATH = True
BITS = "bits"  # the NaN's float bits carry the bfloat16 ones (a loaded NaN, its payload)


def bf16_nan(x):
    """The bits eager stores for node x's NaN: an int, or BITS (x's float NaN's top 16)."""
    if not hasattr(x, "id"):
        return BITS  # a literal (NAN is 0x7fc00000, as c10's)
    if x.kind == "load":
        return BITS if x.dtype == torch.bfloat16 else 0xffff  # else a cast: vectorized
    if x.kind in ("reduce", "colsum"):
        return 0x7fc0
    op = x.attrs.get("op") if x.kind == "op" else None
    args = [a for a in x.args if hasattr(a, "id")]
    if op in ("copy", "cat", "where") or (op == "cast" and args
                                         and args[0].dtype == torch.bfloat16):
        kinds = {bf16_nan(a) for a in (x.args[1:] if op == "where" else x.args)}
        return kinds.pop() if len(kinds) == 1 else 0xffff
    if op in ("neg", "abs") and args and args[0].dtype == torch.bfloat16:
        inner = bf16_nan(args[0])
        if inner == BITS:
            return BITS  # float neg/abs flip/clear the sign bit only
        return inner ^ 0x8000 if op == "neg" else inner & 0x7fff
    if op == "gelu" and args and args[0].dtype == torch.bfloat16 \
            and bf16_nan(args[0]) == BITS:
        return BITS  # its NaN is the input's, quieted by the float math, as eager's
    return 0xffff


def bf16_store(x) -> str:
    """The prelude's bfloat16 store for node x's value (BF16_NAN_BY_PATH)."""
    if not BF16_NAN_BY_PATH:
        return "st_bf16_scalar"
    bits = 0xffff if x is None else bf16_nan(x)
    named = {BITS: "st_bf16_bits", 0xffff: "st_bf16", 0x7fc0: "st_bf16_scalar"}
    return named[bits] if bits in named else f"st_bf16_nan<{bits:#x}>"


def store(e: str, dt, node=None) -> str:
    """e stored as dtype dt; ``node`` (the value's Node) picks a bfloat16 NaN's bits."""
    if dt == torch.float16:
        return f"st_f16({e})"
    if dt == torch.bfloat16:
        return f"{bf16_store(node)}({e})"
    return e if dt == torch.float32 else f"({STORAGE[dt]})({e})"


def size(expr) -> str:
    return f"((int64_t)({_PRINTER.doprint(sympy.sympify(expr))}))"


def literal(v, dt) -> str:
    ct = ctype(dt)
    if is_symbolic(v) or isinstance(v, sympy.Basic):
        return f"(({ct})({_PRINTER.doprint(v)}))"
    if isinstance(v, bool):
        text = "true" if v else "false"
    elif isinstance(v, int):
        text = f"{v}LL"
    elif math.isnan(v):
        text = "NAN"
    elif math.isinf(v):
        text = "INFINITY" if v > 0 else "-INFINITY"
    else:
        text = repr(float(v))
    return f"(({ct})({text}))" if ct != "bool" else f"((bool)({text}))"


def number(v) -> str:
    """A C++ numeric literal of a Python number or sympy size expression (full precision)."""
    if is_symbolic(v) and v.is_integer is not True:  # float size arithmetic
        return f"((double)({_PRINTER.doprint(v)}))"
    if is_symbolic(v) or isinstance(v, sympy.Basic) and not isinstance(v, sympy.Float):
        return size(v)
    if isinstance(v, (bool, int)):
        return f"{int(v)}LL"
    return repr(float(v))


def _pow(a, n):
    x, y = a
    if not n.attrs["common"].is_floating_point and n.attrs["common"] != torch.bool:
        return f"pi_ipow((int64_t)({x}), (int64_t)({y}))"
    e = n.args[1]
    scalar = n.args[1].value if not hasattr(e, "id") else None
    if isinstance(scalar, (int, float)) and not isinstance(scalar, bool):
        special = {2: f"({x} * {x})", 3: f"({x} * {x} * {x})", 1: x, 0.5: _nan_positive("sqrt")(a[:1], n),
                   -0.5: f"(1.0f / std::sqrt({x}))", -1: f"(1.0f / {x})",
                   -2: f"(1.0f / ({x} * {x}))", 0: "1"}
        if n.attrs["common"] == torch.float16:  # eager's float16 pow: pow's -inf and -0.0
            root = f"({x} == -INFINITY ? INFINITY : std::sqrt({x} + 0.0f))"
            special[0.5], special[-0.5] = root, f"(1.0f / {root})"
        if scalar in special:
            return special[scalar]
    half = (torch.float16, torch.bfloat16)
    if n.dtype in half or n.attrs["common"] in half:  # eager's NaN is negative there too
        return f"std::pow({x}, {y})"
    ct = ctype(n.attrs["common"])
    # a NaN base: eager's vectorized pow (Sleef) gives the negative NaN (its scalar tail
    # keeps the sign; a fused kernel follows the vector body)
    return f"pi_nan_neg_if({x}, pi_pow(({ct})({x}), ({ct})({y})))"


def _add(a, n, sign):
    """add/sub; with ``alpha`` (add/sub's scale of the second operand, floating point)
    one fused multiply-add as eager's CPU add kernel: a + alpha * b is rounded once."""
    alpha = n.attrs.get("alpha")
    if alpha is None:
        return f"({a[0]} {'+' if sign > 0 else '-'} {a[1]})"
    common = n.attrs["common"]
    if common in (torch.float16, torch.bfloat16):  # eager takes alpha in the tensor's dtype
        alpha = float(torch.tensor(float(alpha), dtype=common))
    return f"std::fma({literal(sign * alpha, common)}, {a[1]}, {a[0]})"


def _clamp(a, n):
    x = a[0]
    lo, hi = n.attrs.get("min"), n.attrs.get("max")
    if lo is not None:
        x = f"pi_max_nf({x}, {literal(lo, n.attrs['common'])})"
    if hi is not None:
        x = f"pi_min_nf({x}, {literal(hi, n.attrs['common'])})"
    return x


def _gelu(a, n):
    if n.attrs.get("approximate") == "tanh":
        return f"pi_gelu_tanh({a[0]})"
    # float32 and bfloat16 follow eager's oneDNN GELU (NaN at +inf), float16 ATen's (inf);
    # eager takes oneDNN only for more than one element (a 0-d or 1-element gelu is ATen's)
    if n.attrs["common"] == torch.float16 or n.attrs.get("strided"):  # strided: ATen's too
        return f"pi_gelu({a[0]}, false)"
    numel = sympy.sympify(sympy.Mul(*n.shape)) if n.shape is not None else sympy.Integer(2)
    if numel.is_number:
        return f"pi_gelu({a[0]}, {'true' if int(numel) > 1 else 'false'})"
    return f"pi_gelu({a[0]}, {size(numel)} > 1)"


def _f(fn):
    return lambda a, n: f"{fn}({a[0]})"


def _nan_positive(fn):
    """sqrt/log/log2: eager's NaN for a negative input is positive in float32/float64 (the
    prelude's pi_*), negative in float16/bfloat16 (the vectorized libm's, as std::*)."""
    half = (torch.float16, torch.bfloat16)
    return lambda a, n: (f"std::{fn}({a[0]})" if n.dtype in half or n.attrs["common"] in half
                         else f"pi_{fn}({a[0]})")


OPS = {
    "add": lambda a, n: _add(a, n, 1), "sub": lambda a, n: _add(a, n, -1),
    "mul": lambda a, n: f"({a[0]} * {a[1]})", "div": lambda a, n: f"({a[0]} / {a[1]})",
    "neg": lambda a, n: f"(-{a[0]})", "copy": lambda a, n: a[0], "cast": lambda a, n: a[0],
    "full": lambda a, n: literal(n.attrs["value"], n.attrs["common"]),
    "exp": _f("pi_exp"), "log": _nan_positive("log"), "sqrt": _nan_positive("sqrt"),
    "rsqrt": lambda a, n: f"(1.0f / std::sqrt({a[0]}))", "tanh": _f("pi_tanh"),
    "sigmoid": _f("pi_sigmoid"), "silu": lambda a, n: f"({a[0]} / (1.0f + pi_exp_d(-{a[0]})))",
    "relu": lambda a, n: f"({a[0]} < 0 ? ({ctype(n.attrs['common'])})0 : {a[0]})",
    "gelu": lambda a, n: _gelu(a, n),
    "erf": _f("pi_erf"), "erfc": _f("pi_erfc"), "exp2": _f("std::exp2"),
    "expm1": _f("std::expm1"), "log1p": _f("std::log1p"), "log2": _nan_positive("log2"),
    "log10": _f("std::log10"), "sin": _f("std::sin"), "cos": _f("std::cos"),
    "tan": _f("std::tan"), "floor": _f("std::floor"), "ceil": _f("std::ceil"),
    "trunc": _f("std::trunc"), "round": _f("std::nearbyint"),
    "reciprocal": lambda a, n: f"(1.0f / {a[0]})",
    "abs": lambda a, n: (f"std::fabs({a[0]})" if ctype(n.attrs["common"]) == "float"
                         else f"pi_abs({a[0]})"),
    "sign": _f("pi_sign"),
    "maximum": lambda a, n: f"pi_max({a[0]}, {a[1]})",
    "minimum": lambda a, n: f"pi_min({a[0]}, {a[1]})",
    "pow": _pow, "clamp": _clamp,
    "eq": lambda a, n: f"({a[0]} == {a[1]})", "ne": lambda a, n: f"({a[0]} != {a[1]})",
    "lt": lambda a, n: f"({a[0]} < {a[1]})", "le": lambda a, n: f"({a[0]} <= {a[1]})",
    "gt": lambda a, n: f"({a[0]} > {a[1]})", "ge": lambda a, n: f"({a[0]} >= {a[1]})",
    "where": lambda a, n: f"({a[0]} ? {a[1]} : {a[2]})",
    "logical_not": lambda a, n: f"(!{a[0]})",
    "logical_and": lambda a, n: f"({a[0]} && {a[1]})",
    "logical_or": lambda a, n: f"({a[0]} || {a[1]})",
    "logical_xor": lambda a, n: f"({a[0]} != {a[1]})",
    "isnan": lambda a, n: f"({a[0]} != {a[0]})",
    "bitwise_and": lambda a, n: f"({a[0]} & {a[1]})",
    "bitwise_or": lambda a, n: f"({a[0]} | {a[1]})",
    "bitwise_xor": lambda a, n: f"({a[0]} ^ {a[1]})",
    "bitwise_not": lambda a, n: (f"(!{a[0]})" if n.attrs["common"] == torch.bool
                                 else f"(~{a[0]})"),
    "leaky_relu": lambda a, n: f"({a[0]} > 0 ? {a[0]} : {a[0]} * "
                               f"{literal(n.attrs['negative_slope'], n.attrs['common'])})",
}
# any dtype: an integer is never infinite (T5 checks its fp16 activations with isinf().any())
OPS["isinf"] = lambda a, n: (f"(std::fabs({a[0]}) == INFINITY)"
                             if ctype(n.attrs["common"]) == "float" else "false")
# ops computed in float only (an integer compute dtype is not native): the catalogue's
FLOAT_ONLY = float_only(OPS)

# clamp's scalar bounds: a NaN in x or in the bound gives NaN, as eager's clamp (the bound
# is a literal, so its NaN test folds away)
EXTRA_PRELUDE = r"""
PI_INLINE float pi_nan_neg(float r) { return r != r ? -NAN : r; }
PI_INLINE float pi_nan_pos(float r) { return r != r ? NAN : r; }
// r of a NaN x, when NaN (pow(NaN, 0) is 1), made the negative NaN
template <typename T> PI_INLINE T pi_nan_neg_if(T x, T r) { return (x != x && r != r) ? (T)-NAN : r; }
// whether kept element r of n is in a vector lane of eager's softmax over a non-last dim
// (inner: the elements after that dim): [0, n) is split in chunks between its nt threads,
// each walks vectors of V within an inner row and ends the row's (or the chunk's) rest in
// scalar code (reduction.column_softmax)
PI_INLINE bool pi_sm_vec(int64_t r, int64_t n, int64_t inner, int64_t V, int64_t nt) {
  const int64_t t = std::max<int64_t>(1, std::min<int64_t>(nt, n)), cs = (n + t - 1) / t;
  const int64_t b = r / cs * cs, row = r / inner * inner;
  const int64_t s = std::max(b, row), e = std::min(std::min(n, b + cs), row + inner);
  return r - s < (e - s) / V * V;
}
template <typename T, typename U> PI_INLINE T pi_max_nf(T x, U b) { return (x < (T)b || (T)b != (T)b) ? (T)b : x; }
template <typename T, typename U> PI_INLINE T pi_min_nf(T x, U b) { return (x > (T)b || (T)b != (T)b) ? (T)b : x; }
"""


class NotEmittable(Exception):
    pass


class EmitError(RuntimeError):
    """The C++ emitter failed; the message names the tile op it was writing."""


current_op: list = [None]  # the tile op whose node is being written, for EmitError


# Kernels build with -ffp-contract=off (compiler.py): g++ fused any a * b + c into one fma,
# also a mul of one ATen op with the add of the next, where eager rounds the product between
# its two kernels (fuzz seed 31858: the backward of x / x nonzero where eager's is 0). Eager's
# kernels are built with contraction, so inside one op (LayerNorm's (x - mean) * rstd * w + b,
# var's sum of squares, an op's backward) the multiply and add are one fma. The emitter
# writes that fma itself, only between a mul and an add/sub/sum of one ATen op call
# (Node.group), under GCC's own rule: the mul's every use an add, sub or sum in its loop.
FMA_DTYPES = (torch.float32, torch.float64)


def _is_mul(m) -> bool:
    if m.kind == "op":
        return m.attrs.get("op") == "mul" and m.dtype in FMA_DTYPES \
            and m.attrs.get("common") == m.dtype
    return m.kind == "expr" and m.attrs.get("fmt") in ("({0} * {1})", "({0} * {0})")


def _dtype(x):
    return x.dtype or torch.float32


def mark_contractions(nodes, outputs) -> None:
    """Set ``contract`` on each mul whose every use (among ``nodes``, none an output) is an
    add/sub without alpha or a float sum, of the mul's group and loop level, in its dtype."""
    users: dict[int, list] = {}
    for x in nodes:
        for a in x.args:
            if hasattr(a, "id"):
                users.setdefault(a.id, []).append(x)
    stored = {x.id for x, _ in outputs}

    def fusable(m, u) -> bool:
        if u.group != m.group or _dtype(u) != _dtype(m):
            return False
        if u.kind == "reduce":  # accumulates in the summand's loop
            return u.attrs.get("red") == "sum"
        if u.level != m.level:
            return False
        return u.kind == "op" and u.attrs.get("op") in ("add", "sub") \
            and u.attrs.get("alpha") is None and u.attrs.get("common") == _dtype(m)

    for m in nodes:
        m.contract = (bool(m.group) and _is_mul(m) and _dtype(m) in FMA_DTYPES
                      and m.id not in stored and bool(users.get(m.id))
                      and all(fusable(m, u) for u in users[m.id]))


def _mul_args(m, var):
    """A contracting mul's operands as C++ in its dtype, or None."""
    if not hasattr(m, "id") or not m.contract:
        return None
    dt = _dtype(m)
    if m.kind == "expr":
        return [f"({'double' if dt == torch.float64 else 'float'}){var(a)}" for a in
                (m.args * 2)[:2]]
    return [conv(var(a), a.dtype, dt) if hasattr(a, "id") else literal(a.value, dt)
            for a in m.args]


def _fused_add(n, var):
    """add/sub of a contracting mul as one fma (the first mul operand if both are), else None."""
    muls = [(i, a) for i, a in enumerate(n.args) if _mul_args(a, var) is not None]
    if not muls:
        return None
    i, m = min(muls, key=lambda im: im[1].id)  # g++ fused the mul defined first
    a, b = _mul_args(m, var)
    other = n.args[1 - i]
    c = conv(var(other), other.dtype, _dtype(m)) if hasattr(other, "id") \
        else literal(other.value, _dtype(m))
    if n.attrs["op"] == "add":
        return f"PI_FMA({a}, {b}, {c})"
    return f"PI_FMA({a}, {b}, -({c}))" if i == 0 else f"PI_FMA(-({a}), {b}, {c})"


def sum_update(x, acc: str, v: str, var) -> str:
    """The statement adding summand v (x's operand) into accumulator acc of float sum x:
    one fma when the operand is a contracting mul (see mark_contractions)."""
    m = x.args[0]
    args = _mul_args(m, var) if _dtype(m) == _dtype(x) else None
    return f"{acc} = PI_FMA({args[0]}, {args[1]}, {acc});" if args else f"{acc} += {v};"


def expression(n, var, rounded: bool = True) -> str:
    """The right-hand side computing node n (not reduce/load). With ``rounded=False`` a
    half-type value is left in float: for a value only stored, whose store rounds it the
    same way (st_f16(x) is st_f16(rnd_f16(x))), so the loop rounds once, not twice."""
    current_op[0] = n.origin or current_op[0]
    half = not rounded and n.dtype in (torch.float16, torch.bfloat16)
    fin = (lambda e, dt: f"(float)({e})") if half else finalize
    if n.kind == "expr":  # float math, or double math when typed float64
        wide = n.dtype == torch.float64
        args = [f"({'double' if wide else 'float'}){var(a)}" if hasattr(a, "id")
                else literal(a.value, torch.float64 if wide else None) for a in n.args]
        return fin(n.attrs["fmt"].format(*args), n.dtype)
    common = n.attrs["common"]
    if n.attrs["op"] not in OPS:
        raise NotEmittable(f"tile op {n.attrs['op']} ({n.origin}) has no C++ form here")
    if n.attrs["op"] in FLOAT_ONLY and ctype(common) != "float":
        raise NotEmittable(f"{n.attrs['op']} on {common}")
    args = []
    for i, a in enumerate(n.args):
        if hasattr(a, "id"):
            dst = torch.bool if (n.attrs["op"] == "where" and i == 0) else common
            args.append(conv(var(a), a.dtype, dst))
        elif common in (torch.float16, torch.bfloat16) and n.attrs["op"] not in ("mul", "div"):
            args.append(finalize(literal(a.value, common), common))  # as eager rounds it
        else:
            args.append(literal(a.value, common))
    if n.attrs["op"] == "cast":
        a = n.args[0]
        if half:
            return f"(float)({var(a)})"
        e = conv(var(a), a.dtype, n.dtype)
        # conv rounded to the dtype already (or the value has it): round once
        return e if e != var(a) or a.dtype == n.dtype else finalize(e, n.dtype)
    e = None
    if n.attrs["op"] in ("add", "sub") and n.attrs.get("alpha") is None:
        e = _fused_add(n, var)
    e = e or OPS[n.attrs["op"]](args, n)
    fix = nan_sign(n)
    return fin(f"{fix}({e})" if fix else e, n.dtype)


# The sign of a NaN result where eager's kernel is consistent about it and the plain C++
# is not (copysign and signbit read it; tests/test_special_values.py checks every op on
# +NaN and -NaN inputs). x86 arithmetic passes a NaN operand on with its sign, and a NaN
# made by an invalid operation is negative; eager's float16 tanh/sin/cos/tan (Sleef on
# floats) give the negative NaN for any NaN input, its float16 erfc the positive one, and
# its vectorized pow the negative one (the scalar tail keeps the input's sign: a fused
# kernel follows the vector body). sigmoid flips the sign (pi_sigmoid), float32/float16
# alike. bfloat16's NaN bits are its store's (bf16_store).
NAN_SIGN = {("tanh", torch.float16): "pi_nan_neg", ("sin", torch.float16): "pi_nan_neg",
            ("cos", torch.float16): "pi_nan_neg", ("tan", torch.float16): "pi_nan_neg",
            ("erfc", torch.float16): "pi_nan_pos", ("pow", torch.float16): "pi_nan_neg"}


def nan_sign(n) -> str | None:
    """The prelude helper setting the sign of node n's NaN result as eager's, if any."""
    dt = n.dtype if n.dtype in (torch.float16, torch.bfloat16) else n.attrs["common"]
    fix = NAN_SIGN.get((n.attrs["op"], dt))
    if n.attrs["op"] == "gelu" and n.attrs.get("approximate") == "tanh" and dt == torch.float16:
        fix = "pi_nan_neg"  # its vector body (tanh's), as pow
    return fix


def identity(x) -> str:
    """A reduction's identity."""
    flt = ctype(x.dtype) == "float"
    if x.dtype == torch.bool:  # INT64_MIN would convert to true
        return {"sum": "0", "max": "false", "min": "true"}[x.attrs["red"]]
    return {"sum": "0", "max": "-INFINITY" if flt else "INT64_MIN",
            "min": "INFINITY" if flt else "INT64_MAX"}[x.attrs["red"]]
