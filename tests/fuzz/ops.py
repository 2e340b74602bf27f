"""Op templates the generator draws from, by family.

``{a}``, ``{b}`` are tensor operands, ``{s}``, ``{s2}`` scalar literals, ``{lo}`` <
``{hi}`` clamp bounds. Templates whose operand dtypes do not fit are rejected when
the generator runs them on the case's inputs, so the lists need not be exact.
"""
from __future__ import annotations

FLOAT_UNARY = [
    "torch.neg({a})", "torch.abs({a})", "torch.exp({a})", "torch.log({a})",
    "torch.log(torch.abs({a}))", "torch.tanh({a})", "torch.sigmoid({a})", "torch.relu({a})",
    "F.silu({a})", "F.gelu({a})", "F.gelu({a}, approximate='tanh')", "torch.erf({a})",
    "torch.sqrt({a})", "torch.sqrt(torch.abs({a}))", "torch.rsqrt({a})", "torch.sin({a})",
    "torch.cos({a})", "torch.reciprocal({a})", "torch.expm1({a})", "torch.log1p({a})",
    "torch.floor({a})", "torch.ceil({a})", "torch.round({a})", "torch.trunc({a})",
    "torch.sign({a})", "torch.frac({a})", "F.softplus({a})", "F.leaky_relu({a}, 0.1)",
    "F.elu({a})", "F.hardswish({a})", "F.hardsigmoid({a})", "F.mish({a})",
    "torch.clamp({a}, {lo}, {hi})", "torch.clamp({a}, min={lo})", "{a} ** 2",
    "torch.pow({a}, 3)", "torch.pow({a}, 0.5)", "torch.square({a})", "torch.isnan({a})",
    "torch.isinf({a})", "torch.isfinite({a})", "torch.logical_not({a})", "torch.sgn({a})",
    "torch.exp2({a})", "torch.log2({a})", "torch.atan({a})", "torch.asinh({a})",
    "torch.erfc({a})", "torch.tan({a})", "torch.sinh({a})", "torch.cosh({a})",
    "torch.acos({a})", "F.hardtanh({a})", "F.relu6({a})", "torch.log10({a})",
    "torch.round({a}, decimals=1)", "torch.nan_to_num({a})", "torch.signbit({a})",
]
INT_UNARY = ["torch.neg({a})", "torch.abs({a})", "torch.sign({a})", "torch.bitwise_not({a})",
             "torch.clamp({a}, -3, 5)", "{a} * {a}", "torch.square({a})", "torch.relu({a})",
             "torch.exp({a})", "torch.sigmoid({a})", "torch.sqrt({a})"]
BOOL_UNARY = ["torch.logical_not({a})", "torch.bitwise_not({a})", "~{a}"]

BINARY = [
    "{a} + {b}", "{a} - {b}", "{a} * {b}", "{a} / {b}", "torch.maximum({a}, {b})",
    "torch.minimum({a}, {b})", "torch.pow({a}, {b})", "torch.atan2({a}, {b})",
    "torch.fmod({a}, {b})", "torch.remainder({a}, {b})", "{a} // {b}", "torch.eq({a}, {b})",
    "torch.ne({a}, {b})", "torch.lt({a}, {b})", "torch.le({a}, {b})", "torch.gt({a}, {b})",
    "torch.ge({a}, {b})", "torch.logical_and({a}, {b})", "torch.logical_or({a}, {b})",
    "torch.logical_xor({a}, {b})", "torch.hypot({a}, {b})", "torch.copysign({a}, {b})",
    "torch.fmax({a}, {b})", "torch.fmin({a}, {b})", "torch.bitwise_and({a}, {b})",
    "torch.bitwise_or({a}, {b})", "torch.bitwise_xor({a}, {b})",
    "torch.where({a} > {b}, {a}, {b})", "torch.add({a}, {b}, alpha=2)",
    "torch.sub({a}, {b}, alpha=0.5)", "torch.lerp({a}, {b}, 0.3)", "torch.xlogy({a}, {b})",
]
DIVIDING = ("fmod", "remainder", "//")  # an integer divisor is made nonzero: |b| + 1

SCALAR_BINARY = [
    "{a} + {s}", "{a} * {s}", "{s} - {a}", "{a} / {s}", "{s} / {a}", "torch.pow({a}, {s})",
    "{a} ** {s}", "torch.clamp({a}, max={s})", "torch.clamp({a}, min={s})", "{a} > {s}",
    "{a} == {s}", "torch.where({a} < {s}, {a}, {s2})", "torch.fmod({a}, {s})",
    "torch.remainder({a}, {s})", "{a}.masked_fill({a} > {s}, {s2})", "{a} - {s}",
    "torch.maximum({a}, torch.tensor({s}))", "torch.add({a}, {s}, alpha=3)",
]

FLOAT_SCALARS = ["0.5", "-1.5", "2.0", "3.0", "0.1", "1e-3", "100.0", "-2.0", "0.0", "1.0",
                 "2", "3", "-1", "0", "7"]
SPECIAL_SCALARS = ["float('inf')", "float('-inf')", "float('nan')", "-0.0", "1e38", "3e38",
                   "1e-40", "65504.0"]

# {dims}: a tuple of dims; {d}: one dim; {k}: keepdim; {c}: correction; {i}: 0 or 1
REDUCE_DIMS = [
    "torch.sum({a}, dim={dims}, keepdim={k})", "torch.mean({a}, dim={dims}, keepdim={k})",
    "torch.amax({a}, dim={dims}, keepdim={k})", "torch.amin({a}, dim={dims}, keepdim={k})",
    "torch.var({a}, dim={dims}, correction={c}, keepdim={k})",
    "torch.std({a}, dim={dims}, correction={c}, keepdim={k})",
    "torch.logsumexp({a}, dim={dims}, keepdim={k})",
    "torch.var_mean({a}, dim={dims}, correction={c}, keepdim={k})[{i}]",
    "torch.sum({a}, dim={dims}, keepdim={k}, dtype=f32)",
    "torch.linalg.vector_norm({a}, 2, dim={dims}, keepdim={k})",
]
REDUCE_ONE_DIM = [
    "torch.prod({a}, dim={d}, keepdim={k})", "torch.argmax({a}, dim={d}, keepdim={k})",
    "torch.argmin({a}, dim={d}, keepdim={k})", "torch.max({a}, dim={d}, keepdim={k}).values",
    "torch.min({a}, dim={d}, keepdim={k}).values", "torch.any({a}, dim={d}, keepdim={k})",
    "torch.all({a}, dim={d}, keepdim={k})", "torch.max({a}, dim={d}, keepdim={k}).indices",
]
REDUCE_ALL = ["{a}.sum()", "{a}.amax()", "{a}.mean()", "torch.var({a})", "{a}.amin()",
              "{a}.prod()", "torch.argmax({a})", "{a}.any()"]

SOFTMAX = ["torch.softmax({a}, dim={d})", "torch.log_softmax({a}, dim={d})",
           "torch.softmax({a}, {d}, dtype=f32)", "torch.log_softmax({a}, {d}, dtype=f64)"]

CASTS = ["f16", "bf16", "f32", "f64", "i32", "i64", "b8"]

INPLACE = [
    "{t}.add_({b})", "{t}.mul_({s})", "{t}.clamp_(min={s})", "{t}.relu_()", "{t}.copy_({b})",
    "{t}[{sl}] = {s}", "{t}.sigmoid_()", "{t}.exp_()", "{t}.div_({s})",
    "{t}.sub_({b}, alpha=2)", "{t}.masked_fill_({t} > {s}, {s2})", "{t}.fill_({s})",
    "{t}[{sl}] = {b}", "{t}.mul_({b})",
]
