"""One fuzz case against eager: inputs, runs, and the comparison rule.

Self-contained (torch only): every repro script carries this file verbatim, so a
failure reproduces with nothing but torch and the backend installed.

A case is a dict: ``source`` (a function ``fn``), ``inputs`` (input specs),
``backward`` and ``seed``. Each input spec has a dtype code, one shape per size
variant and a kind; its values come from a torch.Generator seeded by (case seed,
input index, variant), so the same case always sees the same values; a spec's
``layout`` passes them as a transposed or strided view.

The comparison (``compare``): compiled output ``c`` against eager ``e``, with
``r`` the program run in float64 (every floating dtype, default dtype included,
mapped to float64; an explicit cast ``v.to(f16)`` still rounds), ``p`` eager on
inputs nudged by a few ulps and ``q`` eager "rerounded" (``_Reround``: half-type
arithmetic results an ulp up, every summand of a sum an ulp up):
1. ``torch.testing.assert_close(c, e, equal_nan=True)`` at torch's per-dtype
   tolerances (those of the coarsest float dtype the value went through, if coarser
   than the output's: a float32 result cast to float64 keeps float32's); if it holds,
   the output is fine.
2. Otherwise an element is wrong only where compiled is farther from float64
   than eager by a margin: ``|c - r| > 2 * max(|e - r|, |p - e|, |q - e|, ulp) +
   atol + rtol * |r|``. ``|e - r|`` is eager's own rounding error (half types round
   every op in eager; compiled kernels round at other points); ``|p - e|`` is
   how much the result moves under an ulp-sized nudge of the inputs, which
   covers reordered sums and discontinuities (floor, comparisons, argmax near
   ties) where eager and float64 happen to agree; ``|q - e|`` how much the
   roundings a kernel may make otherwise move it (a half product kept in float32,
   a sum in another order); ``ulp = eps * |r|``, one rounding of the result in the
   coarsest float dtype its value passed through (``_Coarsest``), where eager
   happens to land exactly.
3. Non-finite and integer/bool elements must equal eager's, except where
   float64 (cast to the output dtype) or the nudged run side with compiled, or
   where both are non-finite and float64 is finite (both overflowed), or where
   compiled is an infinity of the sign of eager's finite value within a factor of
   4 of the dtype's max (another summation order overflows), or where compiled is NaN
   and eager and float64 the same infinity while eager's output holds such a NaN
   elsewhere (a partial sum overflowing into an opposite infinity, order-dependent), or
   where compiled is finite and the nudged run's class differs from eager's (an
   ulp of the inputs decides whether the element is finite: it is ill-conditioned).
"""
from __future__ import annotations

import math
import re
import warnings

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakTensorKeyDictionary

DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32,
          "f64": torch.float64, "i32": torch.int32, "i64": torch.int64, "b8": torch.bool}
FLOAT_CODES = ("f16", "bf16", "f32", "f64")
# torch.testing's default tolerances per dtype (atol, rtol)
TOLERANCE = {torch.float16: (1e-5, 1e-3), torch.bfloat16: (1e-5, 1.6e-2),
             torch.float32: (1e-5, 1.3e-6), torch.float64: (1e-7, 1e-7)}
MARGIN = 2.0  # compiled may be this many times farther from float64 than eager
SPECIAL_SHARE = 0.15  # share of a special input's elements set to special values
NUDGE_ULPS = 4.0


class _ExactTorch:
    """``torch`` for the float64 run, with ``var_mean``'s mean taken as ``torch.mean``:
    eager's var_mean updates its mean Welford's way, which meets inf - inf after an
    inf and gives NaN where the mean is inf (the compiled mean is sum / N, inf, as
    torch.mean's). The float64 run stands for the exact answer, so it takes the
    mean's definition; compiled inf against eager NaN then passes by rule 3
    (docs/fuzz.md, tests/fuzz/repros/var_mean_inf.py)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def var_mean(x, dim=None, *, correction=1, keepdim=False):
        return (torch.var(x, dim=dim, correction=correction, keepdim=keepdim),
                torch.mean(x, dim=dim, keepdim=keepdim))


def namespace(f64: bool = False) -> dict:
    """Globals for a program: dtype codes bound to dtypes (all floats to float64 if f64)."""
    ns = {"torch": _ExactTorch() if f64 else torch, "F": F, "math": math}
    for code, dtype in DTYPES.items():
        ns[code] = torch.float64 if f64 and code in FLOAT_CODES else dtype
    return ns


def _rounded_cast(t: torch.Tensor, code: str) -> torch.Tensor:
    """The float64 run's ``t.to(code)``: rounded to that dtype, kept in float64 (the
    gradient through it is rounded alike, as eager's is)."""
    return t.to(DTYPES[code]).to(torch.float64)


def load(source: str, f64: bool = False):
    """The function ``fn`` defined by ``source``; a fresh code object on every call, so two
    torch.compile wrappers never share Dynamo's cache. In the float64 run an explicit cast
    to a narrower float (``v.to(f16)``) still rounds: it is the program's own rounding,
    which eager and compiled both make, not an error of either (seed 20881: a float32
    gradient of ``v @ v.mT`` on ``x.to(f16)``, where float64 without that rounding sat
    nearer eager's three roundings than compiled's correctly rounded one)."""
    ns = namespace(f64)
    if f64:
        source = re.sub(r"\b(\w+)\.to\((f16|bf16|f32)\)", r'_rounded_cast(\1, "\2")', source)
        ns["_rounded_cast"] = _rounded_cast
    exec(compile(source, "<fuzz case>", "exec"), ns)
    return ns["fn"]


def specials(dtype: torch.dtype) -> list[float]:
    if dtype.is_floating_point:
        fi = torch.finfo(dtype)
        return [math.nan, math.inf, -math.inf, -0.0, 0.0, fi.max, -fi.max, fi.max / 3,
                fi.tiny, -fi.tiny, fi.tiny / 4, 1e4, -1e4]
    if dtype is torch.bool:
        return [True, False]
    ii = torch.iinfo(dtype)
    return [ii.max, ii.min, 0, -1]


def make_input(spec: dict, variant: int, seed: int, mode: str = "eager") -> torch.Tensor:
    """Input ``spec`` at size ``variant``; mode "eager", "f64" (floats as float64) or
    "nudge" (ordinary floats moved by a few ulps, finite special values by a few ulps toward
    zero, zeros and non-finite values kept)."""
    g = torch.Generator().manual_seed(seed * 7919 + spec["index"] * 31 + variant)
    shape = spec["shapes"][variant]
    dtype = DTYPES[spec["dtype"]]
    kind = spec.get("kind", "normal")
    # every draw names its dtype: the float64 run changes the default dtype, which must not
    # change the values
    if dtype is torch.bool:
        t = torch.rand(shape, generator=g, dtype=torch.float32) < 0.5
    elif not dtype.is_floating_point:
        if kind == "index":
            t = torch.randint(0, spec["bounds"][variant], shape, generator=g)
        else:
            t = torch.randint(-9, 10, shape, generator=g)
        t = t.to(dtype)
    else:
        t = torch.randn(shape, generator=g, dtype=torch.float64) * spec.get("scale", 1.0)
        if kind == "positive":
            t = t.abs() + 0.25
        t = t.to(dtype)
    special = torch.zeros(shape, dtype=torch.bool)
    if spec.get("special"):
        special = torch.rand(shape, generator=g, dtype=torch.float32) < SPECIAL_SHARE
        values = torch.tensor(specials(dtype), dtype=torch.float64 if dtype.is_floating_point
                              else torch.int64)
        pick = values[torch.randint(0, len(values), shape, generator=g)].to(dtype)
        t = torch.where(special, pick, t)
    if dtype.is_floating_point and mode == "nudge":
        fi = torch.finfo(dtype)
        a = t.double().abs()
        ordinary = ~special & torch.isfinite(a) & (a > fi.tiny * 1e3) & (a < fi.max / 1e3)
        u = torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1
        moved = (t.double() * (1 + u * fi.eps * NUDGE_ULPS)).to(dtype)
        # finite special values move toward zero (the max stays finite), each by its own
        # amount: a sum that cancels +max against -max then shows that an ulp of the max
        # decides it, where float64 absorbs the small terms as eager does (docs/fuzz.md)
        shrunk = (t.double() * (1 - (0.25 + 0.75 * u.abs()) * fi.eps * NUDGE_ULPS)).to(dtype)
        extreme = special & torch.isfinite(a) & (a > 0)
        t = torch.where(ordinary, moved, torch.where(extreme, shrunk, t))
    if dtype.is_floating_point and mode == "f64":
        t = t.double()
    return with_layout(t, spec.get("layout"))


def with_layout(t: torch.Tensor, layout: str | None) -> torch.Tensor:
    """The same values in another memory layout: "transposed" (the last two dims' strides
    swapped) or "strided" (every other element of a buffer twice as long)."""
    if layout == "transposed":
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if layout == "strided":
        buffer = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
        buffer[..., ::2] = t
        return buffer[..., ::2]
    return t


def inputs_for(case: dict, variant: int, mode: str = "eager") -> list[torch.Tensor]:
    return [make_input(s, variant, case["seed"], mode) for s in case["inputs"]]


def run(fn, inputs, case: dict, variant: int, grad_dtypes=None, nudge: bool = False) -> dict:
    """Outputs of ``fn(*inputs)``, the inputs after the call (in-place ops), and with
    ``case["backward"]`` the gradients of the outputs against seeded grad_outputs.
    ``grad_dtypes`` rounds grad_outputs through eager's output dtypes (for the f64 run);
    ``nudge`` moves the grad_outputs by a few ulps, as the nudged run's inputs (they are
    the backward's inputs: a gradient summing them with cancellation moves as much)."""
    leaves = [x.requires_grad_() if case["backward"] and x.is_floating_point() else x
              for x in inputs]
    outs = fn(*leaves)
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    result = {"outputs": [o.detach().clone() for o in outs], "dtypes": [o.dtype for o in outs]}
    if not case["backward"]:
        result["inputs after the call"] = [x.detach().clone() for x in leaves]
        return result
    g = torch.Generator().manual_seed(case["seed"] * 104729 + variant)
    diff, grads_out = [], []
    for i, o in enumerate(outs):
        if o.requires_grad:
            go = torch.randn(o.shape, generator=g, dtype=torch.float64)
            go = go.to(grad_dtypes[i] if grad_dtypes else o.dtype).to(o.dtype)
            if nudge and go.is_floating_point():
                u = torch.rand(go.shape, generator=g, dtype=torch.float64) * 2 - 1
                eps = torch.finfo(go.dtype).eps * NUDGE_ULPS
                go = (go.double() * (1 + u * eps)).to(go.dtype)
            diff.append(o)
            grads_out.append(go)
    wrt = [x for x in leaves if x.requires_grad]
    grads = torch.autograd.grad(diff, wrt, grads_out, allow_unused=True,
                                materialize_grads=True) if diff else []
    result["gradients"] = [x.detach().clone() for x in grads]
    return result


class _Coarsest(TorchDispatchMode):
    """Records, for every tensor of an eager run, the machine epsilon of the coarsest
    floating dtype its value passed through (an op's result takes the largest of its
    operands' and its own dtype's). A float32 gradient of a float16 matmul carries float16
    roundings that the float64 run, computed without them, cannot show."""

    def __init__(self):
        super().__init__()
        self.eps = WeakTensorKeyDictionary()

    def of(self, t: torch.Tensor) -> float:
        own = torch.finfo(t.dtype).eps if t.is_floating_point() else 0.0
        return max(self.eps.get(t, own), own)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        eps = max([self.of(t) for t in tree_leaves((args, kwargs))
                   if isinstance(t, torch.Tensor)] + [0.0])
        for o in tree_leaves(out):
            if isinstance(o, torch.Tensor):
                self.eps[o] = max(eps, self.of(o))
        return out


class _Reround(TorchDispatchMode):
    """Moves each float16/bfloat16 result of a matmul, a sum, an arithmetic op or a
    transcendental (computed in float32 by both, rounded where eager rounds, an ulp apart
    at a rounding tie) one ulp up (toward +inf, all alike: a sum of such results then moves by the sum of their ulps,
    where random directions could cancel): a compiled kernel that keeps such a value in
    float32 (a fused GEMM adding ``g @ x + g.T @ x`` in one accumulator) skips eager's
    rounding there, which is no error; the nudged run's spread then covers it."""

    OPS = {getattr(torch.ops.aten, n) for n in (
        "mm", "bmm", "addmm", "baddbmm", "mv", "dot", "add", "sub", "mul", "div", "sum",
        "mean", "_softmax", "_log_softmax", "logsumexp", "exp", "log", "tanh", "sigmoid",
        "sqrt", "rsqrt", "pow")}

    SUMS = {torch.ops.aten.sum, torch.ops.aten.mean}
    # float32 transcendentals: two libms' results may be an ulp apart (neither eager's
    # vectorized Sleef nor the prelude's polynomials is correctly rounded)
    LIBM = {getattr(torch.ops.aten, n) for n in (
        "_softmax", "_log_softmax", "logsumexp", "exp", "log", "tanh", "sigmoid", "pow")}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if (func.overloadpacket in self.SUMS and args and isinstance(args[0], torch.Tensor)
                and args[0].is_floating_point()):
            # every summand an ulp up: the sum moves by about eps * sum(|terms|), what a
            # sum in another order or blocking may differ by (where the terms cancel, far
            # more than an ulp of the result)
            x = args[0]
            up = torch.nextafter(x, torch.tensor(math.inf, dtype=x.dtype))
            args = (torch.where(torch.isfinite(x), up, x), *args[1:])
        out = func(*args, **(kwargs or {}))
        if (not func._schema.is_mutable and isinstance(out, torch.Tensor)
                and (func.overloadpacket in self.OPS and out.dtype in (torch.float16, torch.bfloat16)
                     or func.overloadpacket in self.LIBM and out.dtype == torch.float32)):
            moved = torch.nextafter(out, torch.tensor(math.inf, dtype=out.dtype))
            out = torch.where(torch.isfinite(out), moved, out)
        return out


def reference(case: dict, variant: int) -> dict:
    """Eager, float64 and nudged-eager results of ``case`` at size ``variant``, and the
    coarsest rounding (an epsilon) behind each eager result (``_Coarsest``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        coarsest = _Coarsest()
        with coarsest:
            eager = run(load(case["source"]), inputs_for(case, variant), case, variant)
        eps = {key: [coarsest.of(t) for t in eager[key]] for key in
               ("outputs", "inputs after the call", "gradients") if key in eager}
        inputs = inputs_for(case, variant, "f64")
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)  # int * 0.5 and friends promote to float64
        try:
            f64 = run(load(case["source"], f64=True), inputs, case, variant,
                      grad_dtypes=eager["dtypes"])
        finally:
            torch.set_default_dtype(default)
        nudged = run(load(case["source"]), inputs_for(case, variant, "nudge"), case, variant,
                     nudge=True)
        with _Reround():  # apart from the nudge: two random moves could cancel
            rerounded = run(load(case["source"]), inputs_for(case, variant), case, variant)
    return {"eager": eager, "f64": f64, "nudged": nudged, "rerounded": rerounded, "eps": eps}


def _finite_class(t: torch.Tensor) -> torch.Tensor:
    """0 finite, 1 nan, 2 +inf, 3 -inf."""
    return (torch.isnan(t).to(torch.int8) + (t == math.inf).to(torch.int8) * 2
            + (t == -math.inf).to(torch.int8) * 3)


def compare(c: torch.Tensor, e: torch.Tensor, r: torch.Tensor, p: torch.Tensor,
            eps: float = 0.0, q: torch.Tensor | None = None) -> str | None:
    """None if compiled ``c`` passes against eager ``e`` (see the module docstring), else
    what is wrong. ``eps``: the coarsest rounding behind eager's value (``_Coarsest``);
    ``q``: eager with its half-type arithmetic results moved an ulp (``_Reround``)."""
    if c.shape != e.shape or c.dtype != e.dtype:
        return f"got {c.dtype}{list(c.shape)}, eager {e.dtype}{list(e.shape)}"
    atol, rtol = TOLERANCE.get(e.dtype, (0.0, 0.0))
    if e.dtype.is_floating_point and eps > torch.finfo(e.dtype).eps:
        # a value that went through a coarser float dtype carries that dtype's tolerance
        # (a float32 matmul cast to float64, cancelling: seed 82806)
        via = min((d for d in TOLERANCE if torch.finfo(d).eps >= eps),
                  key=lambda d: torch.finfo(d).eps)
        atol, rtol = max(atol, TOLERANCE[via][0]), max(rtol, TOLERANCE[via][1])
    try:
        torch.testing.assert_close(c, e, atol=atol, rtol=rtol, equal_nan=True)
        return None
    except AssertionError:
        pass
    if not e.dtype.is_floating_point:  # ints and bools: exact, unless the value is ambiguous
        r = r.to(e.dtype) if r.shape == e.shape else e
        bad = (c != e) & (r == e) & (p == e)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rc = r.to(e.dtype)  # float64's answer in the output dtype (overflow included)
        cls_c, cls_e = _finite_class(c), _finite_class(e)
        cls_r = _finite_class(rc)
        bad_class = (cls_c != cls_e) & (cls_c != cls_r) & (cls_c != _finite_class(p))
        # both overflowed where float64's answer is finite: which of inf, -inf or NaN
        # (inf - inf) comes out depends on the order of the overflowing operations
        # (or float64's value overflows the dtype by at most a factor 4: seed 34762,
        # compiled NaN from inf - inf, eager inf, float64 3.7e38 in float32)
        fmax = torch.finfo(e.dtype).max
        in_reach = torch.isfinite(r.double()) & (r.double().abs() <= 4 * fmax)
        # float64 outputs: the float64 run is eager itself and cannot say which (run 4's
        # 22584: compiled -inf, eager and float64 NaN)
        in_reach |= e.dtype == torch.float64
        bad_class &= ~((cls_c != 0) & (cls_e != 0) & ((cls_r == 0) | in_reach))
        # an infinity of eager's sign where eager's finite value is within a factor of 4 of
        # the dtype's max: a sum (a matmul's, a gradient's two products) whose terms come
        # that close may overflow in one order and not in another (seeds 34762, 20625;
        # float64 is no help at float64's own max)
        near_max = e.abs() >= fmax / 4
        bad_class &= ~(((cls_c == 2) | (cls_c == 3)) & (cls_e == 0) & near_max
                       & (torch.sign(c) == torch.sign(e)))
        # and the other way round: compiled finite near the max where eager overflowed
        # (20625: compiled 1.79e308, eager inf)
        bad_class &= ~(((cls_e == 2) | (cls_e == 3)) & (cls_c == 0) & (c.abs() >= fmax / 4)
                       & (torch.sign(c) == torch.sign(e)))
        # NaN where eager and float64 agree on an infinity: a run of finite terms overflowed
        # to the opposite infinity before meeting it (inf - inf), which depends on the order
        # of the sum; allowed only where eager's own output shows the same (a NaN where
        # float64 is an infinity), so the output is proven order-dependent (seed 70931)
        if bool(((cls_e == 1) & (cls_r >= 2)).any()):
            bad_class &= ~((cls_c == 1) & (cls_e >= 2) & (cls_r == cls_e))
        # finite where an ulp-sized nudge of the inputs changes eager's class: the element
        # is ill-conditioned (a sum cancelling +max against -max, whose small terms eager
        # and float64 absorb and compiled may keep: seed 82280, exact sum 2.94, eager and
        # float64 0, so x ** -1.5 is inf there, NaN nudged, 0.198 compiled)
        bad_class &= ~((cls_c == 0) & (_finite_class(p) != cls_e))
        both = (cls_c == 0) & (cls_e == 0)
        cd, ed, rd, pd = (t.double() for t in (c, e, r, p))
        # one rounding of the result, at most, in the coarsest dtype its value went through
        ulp = max(torch.finfo(e.dtype).eps, eps) * rd.abs()
        spread = (pd - ed).abs()
        if q is not None and q.shape == e.shape:
            spread = torch.maximum(spread, (q.double() - ed).abs())
        slack = MARGIN * torch.maximum(torch.maximum((ed - rd).abs(), spread), ulp)
        slack = torch.nan_to_num(slack, nan=math.inf, posinf=math.inf)
        far = (cd - rd).abs() > slack + atol + rtol * rd.abs()
        close = (cd - ed).abs() <= atol + rtol * ed.abs()
        bad = bad_class | (both & far & ~close)
    if not bool(bad.any()):
        return None
    idx = tuple(int(i) for i in bad.nonzero()[0])
    return (f"{int(bad.sum())} of {bad.numel()} elements differ; at {list(idx)}: "
            f"compiled {c[idx].item()!r}, eager {e[idx].item()!r}, float64 {r[idx].item()!r}")


def compare_runs(got: dict, ref: dict) -> list[str]:
    """Every mismatch between a compiled run ``got`` and ``reference()``'s ``ref``."""
    problems = []
    for key in ("outputs", "inputs after the call", "gradients"):
        if key not in ref["eager"]:
            continue
        mine, theirs = got.get(key, []), ref["eager"][key]
        if len(mine) != len(theirs):
            problems.append(f"{key}: {len(mine)} tensors, eager {len(theirs)}")
            continue
        for i, (c, e) in enumerate(zip(mine, theirs)):
            r, p = ref["f64"][key][i], ref["nudged"][key][i]
            msg = compare(c, e, r, p, ref["eps"][key][i], ref["rerounded"][key][i])
            if msg:
                problems.append(f"{key}[{i}]: {msg}")
    return problems


def check(case: dict, target: str = "cpu", dynamic: bool = False, refs=None,
          backend: str = "pypto") -> list[dict]:
    """Compile ``case`` (static: size variant 0; dynamic: variants 0 then 1, one compile)
    and compare with eager; returns the failures as {variant, kind, message} dicts
    (kind "crash": the compiled call raised; "mismatch": a wrong value)."""
    variants = [0, 1] if dynamic else [0]
    refs = refs or {}
    fn = load(case["source"])
    # strict: a compile-time exception is a crash to report, not a quiet eager fallback
    options = {"target": target, "strict": True} if backend == "pypto" else None
    compiled = torch.compile(fn, backend=backend, options=options, dynamic=dynamic)
    failures = []
    for v in variants:
        if v not in refs:
            refs[v] = reference(case, v)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                got = run(compiled, inputs_for(case, v), case, v)
        except Exception as e:  # noqa: BLE001 - any exception is a finding
            failures.append({"variant": v, "kind": "crash",
                             "message": f"{type(e).__name__}: {str(e).strip()[:1500]}"})
            break  # a crash at one size says enough
        for msg in compare_runs(got, refs[v]):
            failures.append({"variant": v, "kind": "mismatch", "message": msg})
    return failures
