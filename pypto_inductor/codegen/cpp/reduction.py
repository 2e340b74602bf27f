"""Reductions in the C++ analysis: a mixin of ``analysis._Analyser``.

:meth:`ReductionAnalysis.lower_reduction` lowers a reduction tile op (sum, mean,
amax/amin, argmax/argmin, var/std, softmax, log_softmax, logsumexp) to per-row
reduce passes and the element-wise math around them. A reduction over dims
other than the innermost ones (a column reduction) is analysed with those dims
moved last (:meth:`ReductionAnalysis.transpose`): its rows are then the kept
elements, and :mod:`.emit_columns` writes the kernel.
"""
from __future__ import annotations

import dataclasses

import sympy
import torch

from ...ir import FusionTile, OpKind, TileOp
from ...sizes import same_size as _same
from .ops import size
from .program import FLOATS, Lit, Node, NotNative


# elements per vector of eager's AVX-512 softmax kernels, by dtype (AVX2: half as many);
# column softmax/log_softmax of these dtypes give eager's NaN signs (column_softmax):
# bfloat16's stored NaN is eager's vector body's 0xffff (ops.bf16_store; not its scalar
# tails' 0x7fc0)
COLUMN_NAN_LANES = {torch.float32: 16, torch.float64: 8, torch.float16: 32}
# A float32 softmax / log_softmax over the last dim sums exp(x - max) in eager's order (ATen's
# vec::reduce_all / map_reduce_all: lane l of a vector of SOFTMAX_LANES floats adds the
# columns l mod SOFTMAX_LANES in order, the row's tail into its first lanes, then the lanes
# in a halving tree; a row shorter than one vector in column order) and softmax multiplies by
# the sum's reciprocal, as eager does: the same bits as eager's (our pi_exp is its exp), so
# rows holding the same values in another order get the same sums as in eager, which
# argmax over their ties reads (fuzz seed 50155). Switch (the benchmark's "before"): the
# blocked sum (fp32 per SUM_BLOCK columns, double across) and a division.
SOFTMAX_EAGER_ORDER = True
# A float32 softmax / log_softmax over a dim that is not the last (a column reduction here)
# sums exp(x - max) in eager's order there (ATen's _vec_softmax / _vec_logsoftmax: per
# column, one fp32 accumulator from 0 over the dim in order; softmax divides e / s): one
# float sum over the whole column, not fp32 runs of SUM_BLOCK totalled in double
# (emit_columns: a reduce node with ``sequential``). Switch: the benchmark's "before".
SOFTMAX_COLUMN_EAGER_ORDER = True
# A float16 / bfloat16 log_softmax over the last dim rounds as eager's (_vec_log_softmax_
# lastdim keeps the row's sum and its log in scalar_t arrays): the sum and its log are
# rounded to the dtype before x - max - log(sum) (eager's bits on every element measured,
# where the exact float formula, correctly rounded once, matched 74-94%). Switch: the
# benchmark's "before" (rounded once).
HALF_LOG_SOFTMAX_AS_EAGER = True
# A float16 / bfloat16 softmax over the last dim sums in eager's order for those types
# (_vec_softmax_lastdim's reduced-float kernel: whole vectors of SOFTMAX_LANES floats into
# lanes, the lanes' halving tree, then the last C mod SOFTMAX_LANES exps in order) and
# multiplies by the reciprocal. Switch: the old blocked sum and a division.
HALF_SOFTMAX_EAGER_ORDER = True
# A reduction over dims both before and after its kept dims (BatchNorm's training statistics:
# NCHW over [0, 2, 3], C kept) is native when the kept dims are one contiguous block: rows are
# the kept elements, each a loop over the outer reduced index around the inner contiguous
# run (emit_mixed). Switch: the benchmark's "before" (such tiles ran the reference executor).
MIXED_REDUCTIONS = True


def softmax_lanes() -> int:
    """floats per vector of eager's softmax kernels here: AVX-512 16, else 8 (AVX2)."""
    return 16 if _avx512() else 8


def _avx512() -> bool:
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def _compute_dtype(dt):
    return torch.float32 if dt in FLOATS else dt


class ReductionAnalysis:
    """The analyser's reduction methods (its attributes: see ``analysis._Analyser``)."""

    # --- column reductions ---------------------------------------------------------------
    def transpose(self, tile: FusionTile, axes: tuple) -> None:
        """Analyse a reduction over dims that are not the innermost in the domain with those
        dims moved last: it is then a row reduction whose rows are the kept dims (every
        shape goes through :meth:`tshape`, every input read through :meth:`align`)."""
        n = len(self.D)
        kept = tuple(d for d in range(n) if d not in axes)
        if n - 1 in axes and not (MIXED_REDUCTIONS and kept == tuple(range(kept[0],
                                                                           kept[-1] + 1))):
            raise NotNative(f"reduction over dims {list(axes)} takes the last dim but not "
                            "only the innermost ones")
        # reduced dims before the kept block, the others after it (a mixed reduction), or 0
        self.mixed = kept[0] if n - 1 in axes else 0
        if any(op.op in ("cat", "full", "gather", "pad", "arange") for op in tile.ops):
            raise NotNative("a column reduction with cats, gathers, pads or aranges inside "
                            "is not native yet")
        self.D0, self.axes = self.D, axes
        self.kept = tuple(d for d in range(n) if d not in axes)
        self.perm = self.kept + axes
        self.D = self.tshape(self.D0)

    def align(self, shape) -> list:
        """For each dim of the tile's domain (its own order), the dim of ``shape`` there, or
        None. A full-rank shape is the domain's; a lower-rank one is aligned right, as
        broadcasting does, either into the domain or into the kept dims (a reduction
        without keepdim drops the reduced ones, wherever they are); if both fit and
        disagree the tile is not native."""
        shape, n = tuple(shape), len(self.D0)
        if len(shape) > n:
            raise NotNative(f"a value of shape {list(shape)} has more dims than the tile")

        def into(dims):
            if len(shape) > len(dims):
                return None
            at = dims[len(dims) - len(shape):]
            if not all(_same(s, 1) or _same(s, self.D0[d]) for s, d in zip(shape, at)):
                return None
            out = [None] * n
            for i, d in enumerate(at):
                out[d] = i
            return out

        full, kept = into(tuple(range(n))), into(self.kept)
        if self.in_kept:  # an op over kept values: its operands broadcast into the kept dims
            if kept is None:
                raise NotNative(f"a value of shape {list(shape)} does not fit the kept dims "
                                f"of {list(self.D0)}")
            return kept

        def reads(m):  # where the non-1 dims land
            return {d: i for d, i in enumerate(m) if i is not None and not _same(shape[i], 1)}

        if full is not None and kept is not None and reads(full) != reads(kept):
            raise NotNative(f"a value of shape {list(shape)} may broadcast over the tile "
                            f"{list(self.D0)} or hold its reduction: ambiguous")
        if full is None and kept is None:
            raise NotNative(f"a value of shape {list(shape)} does not fit the tile domain "
                            f"{list(self.D0)}")
        return full if full is not None else kept

    def lower_kept_view(self, op: TileOp) -> Node:
        """A view inside a column reduction: only of a computed value, adding or removing
        1s so that its elements sit at the same dims of the domain (the permuted shapes
        agree). A view dropping the reduced 1s of a keepdim result (GQA's repeat_kv
        backward: sum over the repeats, squeezed) is indexed by the kept dims, as a
        reduction without keepdim: the ops over it are too (``kept_values``), whatever
        the domain's sizes (its shape may also fit the domain's trailing dims)."""
        src, shape = op.args[0], tuple(op.out.shape)
        if not isinstance(src, str) or src not in self.env:
            raise NotNative("a view of a tile input inside a column reduction is not "
                            "native yet")
        v = self.env[src]
        for kept in ((True, False) if len(shape) == len(self.kept) else (False,)):
            try:
                tshape = self.tshape(shape, kept)
            except NotNative:
                continue
            if len(tshape) == len(v.shape) and all(map(_same, tshape, v.shape)):
                if kept:
                    self.kept_values.add(op.name)
                return dataclasses.replace(v, shape=tshape)
        raise NotNative(f"a view of {list(self.graph.specs[src].shape)} to {list(shape)} "
                        "inside a column reduction moves its elements between dims")

    def reads_kept_values(self, op: TileOp) -> bool:
        """Whether ``op`` computes over kept values (see lower_kept_view): then it is one."""
        if any(isinstance(a, str) and a in self.kept_values for a in op.args) \
                and len(op.out.shape) == len(self.kept):
            self.kept_values.add(op.name)
            return True
        return False

    def kept_only(self, op: TileOp) -> bool:
        """Whether ``op`` of a mixed reduction computes kept values only: its rank is the
        kept dims', as is that of every op using it in the tile (transitively). Then it is
        one (see lower_kept_view): BatchNorm's running-stat update ``running_mean * 0.9`` or
        its backward's ``sum * (1 / NHW)``, whose [C] also fits the domain's last dim when
        C == W (ambiguous in :meth:`align` otherwise)."""
        if not self.mixed or op.kind is OpKind.REDUCTION or len(op.out.shape) != len(self.kept):
            return False
        users: dict[str, list] = {}
        for o in self.tile.ops:
            for a in o.args:
                if isinstance(a, str):
                    users.setdefault(a, []).append(o)
        stack, seen = [op], set()
        while stack:
            for u in users.get(stack.pop().name, []):
                if u.name not in seen:
                    if len(u.out.shape) != len(self.kept):
                        return False
                    seen.add(u.name)
                    stack.append(u)
        self.kept_values.add(op.name)
        return True

    def tshape(self, shape, reduced: bool = False) -> tuple:
        """A shape of the tile in the analysed domain (see :meth:`align`), permuted;
        ``reduced``: the shape of a reduction's result, with or without keepdim."""
        if self.perm is None:
            return tuple(shape)
        if reduced and len(shape) == len(self.kept):
            at = [None] * len(self.D0)
            for i, d in enumerate(self.kept):
                at[d] = i
        else:
            at = self.align(shape)
        return tuple(1 if at[p] is None else shape[at[p]] for p in self.perm)

    def lower_reduction(self, op: TileOp, ctx: str) -> Node:
        name = op.op
        dims = tuple(op.attrs.get("dims", ()))
        src = op.args[0]
        shape = tuple(self.graph.specs[src].shape) if isinstance(src, str) else ()
        reduced = self.axes if self.perm is not None else \
            tuple(range(len(shape) - self.m, len(shape)))
        if dims != reduced or (self.perm is not None and len(shape) != len(self.D)):
            raise NotNative(f"{name} over dims {list(dims)} differs from the tile's reduction")
        src_shape, shape = shape, self.tshape(shape)
        sctx = self.context(shape)
        if sctx[0] != "col":
            raise NotNative(f"{name} input shape differs from the tile domain")
        if len(sctx[2]) != len(shape):
            raise NotNative(f"{name} reduces a different last dim than the tile")
        x = self.operand(src, sctx)
        out = op.out.dtype
        level = "col" if name in ("softmax", "log_softmax") else "row"
        # reduced dims all of size 1 (a keepdim output then has the domain's shape): a
        # per-row value is per-element as well
        unit = all(_same(d, 1) for d in self.D[len(self.D) - self.m:])
        if (level == "col") != (ctx[0] == "col") and not (level == "row" and unit):
            raise NotNative(f"{name} output shape does not fit the tile domain")
        if name in ("argmax", "argmin"):
            # pass 1: the extreme (NaN if any); pass 2: the first column holding it
            if x.dtype not in FLOATS or out != torch.int64 or (level == "col"):
                raise NotNative(f"{name} of {x.dtype} is not native yet")
            ext = self.reduce("max" if name == "argmax" else "min", x, torch.float32)
            hit = self.node("expr", "col", [x, ext], torch.int64,
                            fmt="(({0} == {1} || {0} != {0}) ? (int64_t)c : INT64_MAX)")
            return self.round(self.reduce("min", hit, torch.int64), out, op)
        if name in ("any", "all"):  # a count of the nonzero (zero) elements: 0 when empty
            test = "ne" if name == "any" else "eq"
            flag = self.node("op", "col", [x, Lit(0)], torch.bool, self.D, op=test,
                             common=x.dtype or torch.float32)
            ones = self.node("op", "col", [flag], torch.int64, self.D, op="copy",
                             common=torch.int64)
            count = self.reduce("sum", ones, torch.int64)
            verdict = self.node("op", "row", [count, Lit(0)], torch.bool,
                                self.tshape(op.out.shape, True),
                                op="gt" if name == "any" else "eq", common=torch.int64)
            return self.round(verdict, out, op)
        if out not in FLOATS and name not in ("sum", "amax", "amin"):
            raise NotNative(f"{name} in {out} is not native yet")
        if name == "sum":
            acc = _compute_dtype(out)
            x = self.node("op", "col", [x], acc, self.D, op="copy", common=acc) \
                if acc != x.dtype else x
            return self.round(self.reduce("sum", x, acc), out, op)
        if name in ("amax", "amin"):
            return self.round(self.reduce(name[1:], x, _compute_dtype(x.dtype)), out, op)
        if name == "mean":  # var_mean's (acc_dtype float64) and torch.mean alike: a float
            # sum overflowing in our order (+max + max/3 before a -max) is summed in double
            return self.round(self.wide_mean(x), out, op)
        if name in ("var", "std"):
            return self.round(self.variance(x, float(op.attrs.get("correction", 1.0)),
                                            name == "std"), out, op)
        if name in ("softmax", "log_softmax") and self.perm is not None \
                and out in COLUMN_NAN_LANES:
            return self.round(self.column_softmax(x, name, src_shape, dims[0], out), out, op)
        if name in ("softmax", "log_softmax", "logsumexp"):
            mx = self.reduce("max", x)
            if name == "logsumexp":
                safe = self.expr("row", "(std::isinf({0}) ? 0.0f : {0})", mx)
                s = self.reduce("sum", self.expr("col", "pi_exp({0} - {1})", x, safe))
                return self.round(self.expr("row", "(std::log({0}) + {1})", s, safe), out, op)
            shifted = self.expr("col", "({0} - {1})", x, mx)
            e = self.expr("col", "pi_exp({0})", shifted)
            eager = SOFTMAX_EAGER_ORDER and self.perm is None and out == torch.float32
            half = HALF_SOFTMAX_EAGER_ORDER and self.perm is None and name == "softmax" \
                and out in (torch.float16, torch.bfloat16)
            s = self.shared("reduce", "row", [e], None, red="sum", lanes=softmax_lanes()) \
                if eager else self.shared("reduce", "row", [e], None, red="sum",
                                          lanes=softmax_lanes(), tail_after=True) \
                if half else self.reduce("sum", e)
            eager = eager or half
            # NaN signs of eager's last-dim kernels (a row reduction here; seed 22137, measured
            # in docs/fuzz.md): softmax's NaN is negative (in ~97% of such rows), log_softmax's
            # is the input's where the input is NaN, negative elsewhere
            last = self.perm is None
            if name == "softmax":
                q = self.expr("col", "({0} * {1})", e, self.expr("row", "(1.0f / {0})", s)) \
                    if eager else self.expr("col", "({0} / {1})", e, s)
                return self.round(self.expr("col", "pi_nan_neg({0})", q) if last else q, out, op)
            if HALF_LOG_SOFTMAX_AS_EAGER and last and out in (torch.float16, torch.bfloat16):
                rnd = "rnd_f16" if out == torch.float16 else "rnd_bf16"
                logs = self.expr("row", f"{rnd}(std::log({rnd}({{0}})))", s)
            else:
                logs = self.expr("row", "std::log({0})", s)
            r = self.expr("col", "({0} - {1})", shifted, logs)
            if last:
                r = self.expr("col", "({0} != {0} ? ({1} != {1} ? {1} : -NAN) : {0})", r, x)
            return self.round(r, out, op)
        raise NotNative(f"reduction {name} is not native yet")

    def column_softmax(self, x: Node, name: str, shape, dim: int, out) -> Node:
        """softmax / log_softmax over a dim that is not the last, with eager's NaN signs
        (fuzz seed 50013; docs/fuzz.md, run 7). Eager's kernel (2.x ``_vec_softmax`` /
        ``_vec_logsoftmax``, measured on torch 2.13): the max skips NaNs (``M``); a NaN
        result keeps the input's sign where the input is NaN, is negative where ``x - M``
        is invalid (x = M = +-inf), and elsewhere: log_softmax, the sign of the last
        NaN-making element of the column (its sum adds the term first); softmax, in its
        vector lanes negative (``vec::maximum``'s all-ones NaN), in its scalar lanes the
        sign of the first NaN-making element. Which kept elements eager runs in vector
        lanes depends on its thread split (``pi_sm_vec``). The max is NaN-free here too:
        every result of a column holding a NaN is NaN all the same."""
        mx = self.reduce("max", self.expr("col", "({0} != {0} ? -INFINITY : {0})", x))
        # x - M is NaN where x is (with x's sign: M is no NaN) or where it is invalid (the
        # negative default NaN): the NaN-making elements, with their NaN's sign
        shifted = self.expr("col", "({0} - {1})", x, mx)
        e = self.expr("col", "pi_exp({0})", shifted)  # keeps a NaN's sign
        s = self.shared("reduce", "row", [e], None, red="sum", sequential=True) \
            if SOFTMAX_COLUMN_EAGER_ORDER and out == torch.float32 else self.reduce("sum", e)
        # the first (softmax) / last (log_softmax) NaN-making element: 2 c + (its NaN is
        # positive), reduced over the column in a pass only columns whose sum is NaN run
        first = name == "softmax"
        key = self.node("expr", "col", [shifted], torch.int64, fmt=(
            "({0} != {0} ? 2 * (int64_t)c + !std::signbit({0}) : "
            f"{'INT64_MAX' if first else '-1'})"))
        nan = self.shared("expr", "row", (s,), torch.bool, fmt="({0} != {0})")
        k = self.shared("reduce", "row", (key, nan), torch.int64,
                        red="min" if first else "max", when=True)
        odd = self.node("op", "row", [k, Lit(1)], torch.int64, k.shape, op="bitwise_and",
                        common=torch.int64)
        pos = self.node("op", "row", [odd], torch.float32, k.shape, op="copy",
                        common=torch.int64)
        if first:  # eager's vector lanes give the negative NaN
            inner = sympy.Mul(*shape[dim + 1:])
            lanes = COLUMN_NAN_LANES[out] // (1 if _avx512() else 2)
            pos = self.expr("row", f"(pi_sm_vec(r0 + j, R, {size(inner)}, {lanes}, nt) ? 0.0f "
                            ": {0})", pos)
        # A column's NaN sum becomes the NaN its other elements get: x86 arithmetic passes a
        # NaN operand on (the first of two), so e / s and (x - M) - log(s) keep a NaN
        # e or x - M and take this one elsewhere, with no per-element select
        other = self.expr("row", "({0} != 0 ? NAN : -NAN)", pos)
        if first:
            return self.expr("col", "({0} / {1})", e,
                             self.expr("row", "({0} != {0} ? {1} : {0})", s, other))
        logs = self.expr("row", "({0} != {0} ? {1} : std::log({0}))", s, other)
        return self.expr("col", "({0} - {1})", shifted, logs)

    def variance(self, x: Node, corr: float, std: bool) -> Node:
        """var (or std) of the row, finite wherever eager's is: eager's CPU var accumulates
        in double (Welford), so values near the float max keep a finite mean and variance.
        The mean and the squared deviations are summed in float, as before (vectors of
        floats: double passes cost 25-50% on a 4096 x 4096 var), and a row whose float sum
        overflowed (inf, or NaN) is summed again in double, in a pass only such rows run
        (see :meth:`wide_mean`, whose sum var_mean's mean shares)."""
        mean = self.wide_mean(x)
        dev = self.expr("col", "({0} - {1})", x, mean)
        ss = self.reduce("sum", self.expr("col", "({0} * {0})", dev))
        redo = self.shared("expr", "row", (ss,), torch.bool, fmt="(!std::isfinite({0}))")
        wdev = self.wexpr("col", "({0} - {1})", x, mean)
        # args[1]: the row condition of a pass that runs only where it holds (row_sums)
        wss = self.shared("reduce", "row", (self.wexpr("col", "({0} * {0})", wdev), redo),
                          torch.float64, red="sum", when=True)
        ss = self.wexpr("row", "({2} ? {1} : {0})", ss, wss, redo)
        v = self.wexpr("row", f"({{0}} / std::max<double>((double)C - {corr!r}, 0.0))", ss)
        return self.wexpr("row", "std::sqrt({0})", v) if std else v

    def wexpr(self, level, fmt, *args) -> Node:
        """Math in double (see :meth:`wide_mean`)."""
        return self.shared("expr", level, args, torch.float64, fmt=fmt)

    def wide_mean(self, x: Node) -> Node:
        """The row's mean, in double: summed in float (blocked, as sums are), and again in
        double where that overflowed (the float sum of two values near 3.4e38 is inf),
        in a pass only such rows run."""
        s = self.reduce("sum", x)
        redo = self.shared("expr", "row", (s,), torch.bool, fmt="(!std::isfinite({0}))")
        ws = self.shared("reduce", "row", (x, redo), torch.float64, red="sum", when=True)
        return self.wexpr("row", "(({2} ? {1} : {0}) / (double)C)", s, ws, redo)

    def round(self, v: Node, dtype, op: TileOp) -> Node:
        """The value as the op's result: rounded to its dtype."""
        return self.node("op", v.level, [v], dtype, self.tshape(op.out.shape, True), op="copy",
                         common=v.dtype or torch.float32)
