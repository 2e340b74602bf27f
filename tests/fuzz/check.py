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
mapped to float64) and ``p`` eager on inputs nudged by a few ulps:
1. ``torch.testing.assert_close(c, e, equal_nan=True)`` at torch's per-dtype
   tolerances; if it holds, the output is fine.
2. Otherwise an element is wrong only where compiled is farther from float64
   than eager by a margin: ``|c - r| > 2 * max(|e - r|, |p - e|, ulp) + atol +
   rtol * |r|``. ``|e - r|`` is eager's own rounding error (half types round
   every op in eager; compiled kernels round at other points); ``|p - e|`` is
   how much the result moves under an ulp-sized nudge of the inputs, which
   covers reordered sums and discontinuities (floor, comparisons, argmax near
   ties) where eager and float64 happen to agree; ``ulp = eps(dtype) * |r|``,
   one rounding of the result, where eager happens to land exactly.
3. Non-finite and integer/bool elements must equal eager's, except where
   float64 (cast to the output dtype) or the nudged run side with compiled.
"""
from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F

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


def load(source: str, f64: bool = False):
    """The function ``fn`` defined by ``source``; a fresh code object on every call, so two
    torch.compile wrappers never share Dynamo's cache."""
    ns = namespace(f64)
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
    "nudge" (ordinary floats moved by a few ulps, special values kept)."""
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
        t = torch.where(ordinary, moved, t)
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


def reference(case: dict, variant: int) -> dict:
    """Eager, float64 and nudged-eager results of ``case`` at size ``variant``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eager = run(load(case["source"]), inputs_for(case, variant), case, variant)
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
    return {"eager": eager, "f64": f64, "nudged": nudged}


def _finite_class(t: torch.Tensor) -> torch.Tensor:
    """0 finite, 1 nan, 2 +inf, 3 -inf."""
    return (torch.isnan(t).to(torch.int8) + (t == math.inf).to(torch.int8) * 2
            + (t == -math.inf).to(torch.int8) * 3)


def compare(c: torch.Tensor, e: torch.Tensor, r: torch.Tensor, p: torch.Tensor) -> str | None:
    """None if compiled ``c`` passes against eager ``e`` (see the module docstring), else
    what is wrong."""
    if c.shape != e.shape or c.dtype != e.dtype:
        return f"got {c.dtype}{list(c.shape)}, eager {e.dtype}{list(e.shape)}"
    atol, rtol = TOLERANCE.get(e.dtype, (0.0, 0.0))
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
        bad_class = (cls_c != cls_e) & (cls_c != _finite_class(rc)) & (cls_c != _finite_class(p))
        both = (cls_c == 0) & (cls_e == 0)
        cd, ed, rd, pd = (t.double() for t in (c, e, r, p))
        ulp = torch.finfo(e.dtype).eps * rd.abs()  # one rounding of the result, at most
        slack = MARGIN * torch.maximum(torch.maximum((ed - rd).abs(), (pd - ed).abs()), ulp)
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
            msg = compare(c, e, r, p)
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
