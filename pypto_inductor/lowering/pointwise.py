"""Elementwise, broadcast and cast lowerings: one tile op per ATen call."""
from __future__ import annotations

import sympy
import torch
import torch._inductor.inductor_prims  # noqa: F401  registers prims.fma (Adam's update)

from ..ir import OpKind
from .registry import Unsupported, register_lowering

aten = torch.ops.aten

# ATen op -> canonical tile op, unary (x) -> y.
UNARY = {
    aten.abs: "abs", aten.neg: "neg", aten.exp: "exp", aten.exp2: "exp2",
    aten.expm1: "expm1", aten.log: "log", aten.log1p: "log1p", aten.log2: "log2",
    aten.log10: "log10", aten.sqrt: "sqrt", aten.rsqrt: "rsqrt", aten.sin: "sin",
    aten.cos: "cos", aten.tan: "tan", aten.tanh: "tanh", aten.asin: "asin",
    aten.acos: "acos", aten.atan: "atan", aten.sinh: "sinh", aten.cosh: "cosh",
    aten.asinh: "asinh", aten.acosh: "acosh", aten.atanh: "atanh",
    aten.sigmoid: "sigmoid", aten.relu: "relu", aten.silu: "silu", aten.erf: "erf",
    aten.erfc: "erfc", aten.reciprocal: "reciprocal", aten.floor: "floor",
    aten.ceil: "ceil", aten.round: "round", aten.trunc: "trunc", aten.frac: "frac",
    aten.sign: "sign", aten.sgn: "sign", aten.logical_not: "logical_not",
    aten.bitwise_not: "bitwise_not", aten.isnan: "isnan", aten.isinf: "isinf",
    aten.hardswish: "hardswish", aten.hardsigmoid: "hardsigmoid", aten.mish: "mish",
}

# ATen op -> canonical tile op, binary (a, b) -> y; either operand may be a scalar.
BINARY = {
    aten.mul: "mul", aten.div: "div", aten.pow: "pow", aten.maximum: "maximum",
    aten.minimum: "minimum", aten.eq: "eq", aten.ne: "ne", aten.lt: "lt", aten.le: "le",
    aten.gt: "gt", aten.ge: "ge", aten.logical_and: "logical_and",
    aten.logical_or: "logical_or", aten.logical_xor: "logical_xor",
    aten.bitwise_and: "bitwise_and", aten.bitwise_or: "bitwise_or",
    aten.bitwise_xor: "bitwise_xor", aten.atan2: "atan2", aten.remainder: "remainder",
    aten.fmod: "fmod", aten.copysign: "copysign", aten.fmax: "fmax", aten.fmin: "fmin",
    aten.hypot: "hypot", aten.true_divide: "div",
}


def folded(fn):
    """A lowering whose 0-d result is computed at compile time when every operand is a
    constant (a 0-d ``full`` or a Python number): the ATen op runs on 0-d tensors, so the
    value is eager's, and consumers take it as a literal (``ctx.scalar_constants``). The
    optimizers' ``lerp`` weights (``where(abs(w) >= 0.5, w - 1, w)``) fold away so."""
    def lower(ctx, *args, **kwargs):
        value = _constant_value(ctx, args, kwargs)
        if value is None:
            return fn(ctx, *args, **kwargs)
        dtype = ctx.out_spec.dtype
        name = ctx.emit("full", OpKind.ELEMENTWISE, (), value=value, dtype=dtype)
        ctx.scalar_constants[name] = value
        return name
    return lower


def _constant_value(ctx, args, kwargs):
    out = ctx.out_spec
    if out.shape != () or not isinstance(ctx.node.target, torch._ops.OpOverload):
        return None
    consts = []

    def const(a):
        if isinstance(a, str):
            if a not in ctx.scalar_constants:
                raise LookupError(a)
            consts.append(a)
            return torch.tensor(ctx.scalar_constants[a], dtype=ctx.spec(a).dtype)
        if isinstance(a, sympy.Basic) or isinstance(a, (list, tuple)):
            raise LookupError(a)
        return a

    try:
        args = [const(a) for a in args]
        kwargs = {k: const(v) for k, v in kwargs.items()}
    except LookupError:
        return None
    if not consts:
        return None
    result = ctx.node.target(*args, **kwargs)
    if not isinstance(result, torch.Tensor) or result.dtype != out.dtype or result.dim():
        return None
    value = result.item()
    return bool(value) if out.dtype == torch.bool else value


def _register_table(table: dict, arity: int) -> None:
    for aten_op, tile_op in table.items():
        @folded
        def lower(ctx, *args, _op=tile_op, **kwargs):
            if arity == 2 and set(kwargs) == {"rounding_mode"}:
                return ctx.pointwise(_op, args[:2], rounding_mode=kwargs["rounding_mode"])
            if kwargs or len(args) != arity:
                raise Unsupported(f"{_op} with arguments {sorted(kwargs)} has no tile form")
            return ctx.pointwise(_op, args)
        register_lowering(aten_op)(lower)


_register_table(UNARY, 1)
_register_table(BINARY, 2)


@register_lowering(aten.round.decimals)
def lower_round_decimals(ctx, x, *, decimals=0):
    """ATen's round-half-even to ``decimals`` places, as ATen computes it:
    round(x * 10**d) / 10**d, or round(x / 10**-d) * 10**-d for negative d, in float32 for
    float16 / bfloat16 (eager's opmath: rounding x * 10**d to half first moves ties)."""
    decimals = int(decimals)
    if decimals == 0:
        return ctx.pointwise("round", (x,))
    dtype = ctx.spec(x).dtype
    if not dtype.is_floating_point:
        raise Unsupported("round with decimals of an integer tensor")
    scale = float(10 ** abs(decimals))
    pre, post = ("mul", "div") if decimals > 0 else ("div", "mul")
    spec = ctx.spec(x)
    half = dtype in (torch.float16, torch.bfloat16)
    if half:
        spec = ctx.new_spec(spec.shape, torch.float32)
        x = ctx.emit("cast", OpKind.CAST, (x,), out=spec, dtype=torch.float32)
    scaled = ctx.pointwise(pre, (x, scale), out=spec)
    rounded = ctx.pointwise("round", (scaled,), out=spec)
    if not half:
        return ctx.pointwise(post, (rounded, scale))
    back = ctx.pointwise(post, (rounded, scale), out=spec)
    return ctx.emit("cast", OpKind.CAST, (back,), dtype=dtype)


@register_lowering(aten.add, aten.sub)
@folded
def lower_add_sub(ctx, a, b, alpha=1):
    op = ctx.aten_name  # "add" or "sub"
    return _add_scaled(ctx, op, a, b, alpha)


@register_lowering(aten.rsub)
@folded
def lower_rsub(ctx, a, b, alpha=1):
    """rsub(a, b, alpha) = b - alpha * a."""
    return _add_scaled(ctx, "sub", b, a, alpha)


def _add_scaled(ctx, op, a, b, alpha):
    """a + alpha * b (or -): in floating point one add/sub with an ``alpha`` attribute,
    which the targets compute as one fused multiply-add, as eager's CPU add does
    (``vec::fmadd``): ``3e38 - 2 * 2e38`` is -1e38 there, inf - inf = NaN after a
    rounded product (fuzz seeds 21960, 30010)."""
    if alpha != 1 and isinstance(b, str) and ctx.out_spec.dtype.is_floating_point \
            and ctx.spec(b).dtype != torch.bool:
        return ctx.pointwise(op, (a, _cast(ctx, b, ctx.out_spec.dtype)), alpha=alpha)
    return ctx.pointwise(op, (a, _scaled(ctx, b, alpha)))


def _scaled(ctx, x, alpha):
    """alpha * x for add/sub's alpha: folded for a scalar x, a mul tile op for a tensor."""
    if alpha == 1:
        return x
    if not isinstance(x, str):
        return x * alpha
    spec = ctx.spec(x)
    if spec.dtype == torch.bool:
        if ctx.out_spec.dtype == torch.bool:  # eager takes alpha as a bool here
            return x if alpha else ctx.pointwise("mul", (x, False), out=spec)
    if spec.dtype != ctx.out_spec.dtype:
        # scaled in the result's dtype, as eager casts the operand first: 2 * True is 2,
        # not True; an int64 operand of a bfloat16 sub times 0.5 is not truncated
        spec = ctx.new_spec(spec.shape, ctx.out_spec.dtype)
        x = ctx.emit("cast", OpKind.CAST, (x,), out=spec, dtype=spec.dtype)
    return ctx.pointwise("mul", (x, alpha), out=spec)


@register_lowering(aten.gelu)
def lower_gelu(ctx, x, approximate="none"):
    """``strided``: eager's GELU takes oneDNN (NaN at +inf) only for a contiguous input
    (ATen's ``use_mkldnn``), ATen's kernel (inf) for a transposed or strided one (fuzz
    seed 30481); the input's traced strides say which."""
    spec = ctx.spec(x) if isinstance(x, str) else None
    if spec is not None and not _is_contiguous(spec):
        return ctx.pointwise("gelu", (x,), approximate=approximate, strided=True)
    return ctx.pointwise("gelu", (x,), approximate=approximate)


def _is_contiguous(spec) -> bool:
    """torch's is_contiguous() of a spec: row-major strides, size-1 dims' strides aside."""
    expected = sympy.Integer(1)
    for size, stride in zip(reversed(spec.shape), reversed(spec.stride)):
        if size != 1 and sympy.simplify(stride - expected) != 0:
            return False
        expected = expected * size
    return True


@register_lowering(aten.leaky_relu)
def lower_leaky_relu(ctx, x, negative_slope=0.01):
    return ctx.pointwise("leaky_relu", (x,), negative_slope=float(negative_slope))


@register_lowering(aten.hardtanh)
def lower_hardtanh(ctx, x, min_val=-1.0, max_val=1.0):
    if not ctx.spec(x).dtype.is_floating_point:
        # hardtanh keeps an integer dtype: ATen converts the bounds to it (toward zero),
        # where clamp would promote to float.
        min_val, max_val = int(min_val), int(max_val)
    return ctx.pointwise("clamp", (x,), min=min_val, max=max_val)


@register_lowering(aten.softplus)
def lower_softplus(ctx, x, beta=1, threshold=20):
    return ctx.pointwise("softplus", (x,), beta=beta, threshold=threshold)


@register_lowering(aten.elu)
def lower_elu(ctx, x, alpha=1, scale=1, input_scale=1):
    return ctx.pointwise("elu", (x,), alpha=alpha, scale=scale, input_scale=input_scale)


@register_lowering(aten.clamp, aten.clamp_min, aten.clamp_max)
def lower_clamp(ctx, x, min=None, max=None):
    if ctx.aten_name == "clamp_max":
        min, max = None, min
    if not (isinstance(min, str) or isinstance(max, str)):
        return ctx.pointwise("clamp", (x,), min=min, max=max)
    # Tensor bounds: min(max(x, lo), hi) in the promoted dtype, which also matches
    # clamp's NaN propagation (a NaN in x or in a bound gives NaN).
    out = ctx.out_spec
    result = _cast(ctx, x, out.dtype)
    for op, bound in (("maximum", min), ("minimum", max)):
        if bound is None:
            continue
        if isinstance(bound, str):
            bound = _cast(ctx, bound, out.dtype)
            shape = broadcast_shapes(ctx.spec(result).shape, ctx.spec(bound).shape)
        else:
            shape = ctx.spec(result).shape
        result = ctx.pointwise(op, (result, bound), out=ctx.new_spec(shape, out.dtype))
    if ctx.spec(result).shape != out.shape:
        result = ctx.emit("expand", OpKind.LAYOUT, (result,), shape=out.shape)
    return result


def _cast(ctx, x, dtype):
    spec = ctx.spec(x)
    if spec.dtype == dtype:
        return x
    return ctx.emit("cast", OpKind.CAST, (x,), out=ctx.new_spec(spec.shape, dtype), dtype=dtype)


def broadcast_shapes(a, b) -> tuple:
    """The broadcast of two shapes of sympy sizes (a size-1 dim stretches)."""
    n = len(a) if len(a) >= len(b) else len(b)
    a = (sympy.Integer(1),) * (n - len(a)) + tuple(a)
    b = (sympy.Integer(1),) * (n - len(b)) + tuple(b)
    return tuple(y if x == 1 else x for x, y in zip(a, b))


@register_lowering(aten.where)
@folded
def lower_where(ctx, cond, a=None, b=None):
    if a is None:  # where.default(cond): the indices of true elements, data-dependent sizes
        raise Unsupported("where(cond) without values has data-dependent output sizes")
    return ctx.pointwise("where", (cond, a, b))


@register_lowering(aten._to_copy, torch.ops.prims.convert_element_type)
def lower_cast(ctx, x, dtype=None, layout=None, device=None, pin_memory=None,
               non_blocking=False, memory_format=None):
    out = ctx.out_spec
    if device is not None and torch.device(device) != torch.device("cpu") \
            and out.dtype == ctx.spec(x).dtype:
        raise Unsupported("device copy")
    if out.dtype == ctx.spec(x).dtype:
        return ctx.pointwise("copy", (x,))
    return ctx.emit("cast", OpKind.CAST, (x,), dtype=out.dtype)


@register_lowering(aten.full, aten.scalar_tensor)
def lower_full(ctx, *args, **kwargs):
    value = args[-1] if len(args) in (1, 2) else kwargs.get("fill_value")
    name = ctx.emit("full", OpKind.ELEMENTWISE, (), value=value, dtype=ctx.out_spec.dtype)
    dtype = ctx.out_spec.dtype
    if ctx.out_spec.shape == () and isinstance(value, (bool, int, float)):
        cast = bool if dtype == torch.bool else float if dtype.is_floating_point else int
        ctx.scalar_constants[name] = cast(value)
    return name


@register_lowering(aten.full_like)
def lower_full_like(ctx, x, fill_value, **kwargs):
    return ctx.emit("full", OpKind.ELEMENTWISE, (), value=fill_value, dtype=ctx.out_spec.dtype)


@register_lowering(torch.ops.prims.fma)
def lower_fma(ctx, a, b, c):
    """fma(a, b, c) = a * b + c, rounded after the product as eager's (inductor prim) is."""
    out = ctx.out_spec
    shapes = [ctx.spec(x).shape for x in (a, b) if isinstance(x, str)]
    shape = broadcast_shapes(*shapes) if len(shapes) == 2 else (shapes[0] if shapes else ())
    product = ctx.pointwise("mul", (a, b), out=ctx.new_spec(shape, _result_type(ctx, a, b)))
    return ctx.pointwise("add", (product, c), out=out)


def _result_type(ctx, a, b) -> torch.dtype:
    def meta(x):
        if isinstance(x, str):
            x = ctx.scalar_constants.get(x, x)
        if isinstance(x, str):
            spec = ctx.spec(x)
            return torch.empty((1,) * len(spec.shape), dtype=spec.dtype, device="meta")
        return x
    return torch.result_type(meta(a), meta(b))


@register_lowering(aten.arange)
def lower_arange(ctx, *args, dtype=None, layout=None, device=None, pin_memory=None):
    """arange(end), arange(start, end), arange(start, end, step): an ``arange`` tile op,
    ``start + step * i`` in the result dtype (bounds may be size expressions)."""
    start, end, step = (0, args[0], 1) if len(args) == 1 else (*args[:2], 1) \
        if len(args) == 2 else args[:3]
    if any(isinstance(v, str) for v in (start, end, step)):
        raise Unsupported("arange with tensor bounds")
    return ctx.emit("arange", OpKind.ELEMENTWISE, (), start=start, end=end, step=step,
                    dtype=ctx.out_spec.dtype)
