"""Dynamic columns: a tile whose columns (or reduced extent) are a size expression.

pypto 0.2.0 cannot run an op over a whole dynamic dim, so the kernel declares
``C = pypto.frontend.dynamic("C")`` and walks the columns in chunks of ``tc``
(the vector tile's width), on ``pypto.view``s with a ``valid_shape`` for the
partial last chunk. A reduction over the columns becomes an accumulator: a
``(rows, 1)`` tensor made with ``pypto.full`` before a column loop and updated
with ``acc[:] = pypto.add(acc, pypto.sum(chunk, 1, True))`` in it (pypto's
loop-carried form: a tensor assigned inside the loop). A tile then runs as
passes over the columns, in op order:

- one column loop per reduction stage: the pointwise ops its input needs are
  (re)computed per chunk from the inputs and the per-row values known so far;
  ``sum``/``amax``/``amin`` are one stage, ``mean`` a sum divided by the column
  count (a sum of ones over the chunks, see ``_count``; in a tile with var_mean's
  ``acc_dtype`` mean, the fp32 sum of x / count, see ``_wide_mean``), ``var``/``std`` a mean
  then a sum of squared deviations, ``logsumexp``/``softmax``/``log_softmax`` a max then a sum of
  exponentials (softmax's result is recomputed per chunk where it is used);
- per-row ops (``(R, 1)`` and ``(1, 1)`` values) once, between the loops;
- a last column loop computing and ``pypto.assemble``-ing every output that
  spans the columns; per-row outputs are stored as soon as they are known
  (``_store_known``).

Pointwise tiles with dynamic columns are the case with no reduction: one loop.
With dynamic rows too, all of this runs inside the row loop (:mod:`.rows`).
Compiled and simulated with pypto 0.2.0's SIM mode; values are checked in pypto's
interpreter at concrete sizes (tests/test_pypto_verify.py), partial chunks included.
Integer reductions are refused (the accumulators are float).
"""
from __future__ import annotations

from typing import Callable

import torch

from ...ir import OpKind, TileOp
from .kernel import KernelParam, PyptoEmitError
from .ops import OPS, Writer, check_reduction, tensor_operands

DIM = "C"  # the dynamic kernel dim of the columns
_LOWEST = "-3.4028234663852886e+38"  # fp32 lowest: amax's initial value
_HIGHEST = "3.4028234663852886e+38"

# A stage: (initial value, partial(writer, chunk, accumulators so far) -> expr, combine).
Stage = tuple[str, Callable[[Writer, str, list], str], str]


def _red(fn: str) -> Callable:
    return lambda em, x, accs: f"pypto.{fn}({x}, 1, True)"


def _sq_dev(em: Writer, x: str, accs: list) -> str:
    d = em.tmp(f"pypto.sub({x}, {accs[-1]})")  # accs[-1]: the mean (a per-row value)
    return f"pypto.sum(pypto.mul({d}, {d}), 1, True)"


def _exp_dev(em: Writer, x: str, accs: list) -> str:
    return f"pypto.sum(pypto.exp(pypto.sub({x}, {accs[0]})), 1, True)"


_SUM: Stage = ("0.0", _red("sum"), "add")
_MAX: Stage = (_LOWEST, _red("amax"), "maximum")
STAGES: dict[str, list[Stage]] = {
    "sum": [_SUM], "mean": [_SUM],
    "amax": [_MAX], "amin": [(_HIGHEST, _red("amin"), "minimum")],
    "var": [_SUM, ("0.0", _sq_dev, "add")], "std": [_SUM, ("0.0", _sq_dev, "add")],
    "logsumexp": [_MAX, ("0.0", _exp_dev, "add")],
    "softmax": [_MAX, ("0.0", _exp_dev, "add")],
    "log_softmax": [_MAX, ("0.0", _exp_dev, "add")],
}
_FULL_RESULT = {"softmax", "log_softmax"}  # results span the columns: recomputed per chunk


def _wide_mean(w: Writer) -> bool:
    """A mean in the tile carries ``acc_dtype`` (var_mean's: eager sums it in double).
    Then, as in the static form (``ops._mean_of``), every row mean of the tile is the
    fp32 sum of x / C, finite wherever the mean is, where the sum of x overflows near
    the float max; the count loop then runs before the sum (one more div per element)."""
    return any(o.op == "mean" and o.attrs.get("acc_dtype") is not None for o in w.tile.ops)


def _scaled_sum(w: Writer, inv: str) -> Callable:
    """A chunk's partial sum of x / C (``inv``: 1 / C per row), in fp32."""
    def partial(em: Writer, x: str, accs: list) -> str:
        if em.compute != torch.float32:
            x = em.tmp(f"pypto.cast({x}, {em.dt(torch.float32)})")
        return f"pypto.sum(pypto.mul({x}, {inv}), 1, True)"
    return partial


def dims(kshape: tuple[int, ...], spans_cols: bool) -> tuple:
    return (kshape[0], DIM) + tuple(kshape[2:]) if spans_cols else tuple(kshape)


class ColumnPasses:
    """Emits a dynamic-columns tile's ops as passes over column chunks of ``tc``."""

    def __init__(self, writer: Writer, tc: int):
        self.w, self.tc = writer, int(tc)
        self.loops = 0
        self.count: str | None = None  # the (1, 1) column count, once made (:meth:`_count`)
        self.lazy_inputs: dict[str, KernelParam] = {}  # column-spanning inputs, loaded per chunk
        self.deferred: dict[str, tuple] = {}  # column-spanning values: how to recompute them
        self._c0 = self._cn = ""  # the current column loop's chunk offset and valid width
        self.means: dict[str, str] = {}  # operand -> its row mean (var and mean share it)
        self.inv: str | None = None  # 1 / C per row, for var_mean's scaled mean
        self.stored: set[str] = set()  # per-row outputs, stored as soon as they are known

    @staticmethod
    def declaration() -> str:
        return f'{DIM} = pypto.frontend.dynamic("{DIM}")\n'

    def describe(self) -> str:
        return f"dynamic columns {DIM} = {self.w.layout.cols_expr}, in chunks of {self.tc}"

    def defer_input(self, value: str, param: KernelParam) -> None:
        self.lazy_inputs[value] = param

    # the passes --------------------------------------------------------------------------
    def emit(self, outputs: list[KernelParam]) -> None:
        w = self.w
        for op in w.tile.ops:
            kshape = w.layout.classify(op.out.shape, op.name)
            w.shape[op.name] = kshape
            if op.kind is OpKind.REDUCTION:
                self._reduction(op)
            elif w.layout.spans_cols(kshape):
                self.deferred[op.name] = ("op", op)
            else:  # a per-row or scalar value: once, outside the column loops
                handler = OPS.get(op.op)
                if handler is None:
                    raise PyptoEmitError(op.op)
                wide = [a for a in op.inputs if a in self.deferred or a in self.lazy_inputs]
                if wide:
                    raise PyptoEmitError(op.op, f"a per-row result of {wide} over the dynamic "
                                         "columns that is not a reduction")
                w.env[op.name], w.dtype[op.name] = handler(w, op)
            self._store_known(outputs)
        wide = [p for p in outputs if w.layout.spans_cols(p.shape)]
        if wide:
            def body(env: dict) -> None:
                for p in wide:
                    self._need(p.value, env)
                    w.lines.append(w.loop_store(w.store_expr(p, env[p.value]), p.ident,
                                                col=self._c0))
            self._pass(body)

    def _store_known(self, outputs: list[KernelParam]) -> None:
        """Store the per-row outputs known so far, before any later column loop.

        pypto's interpreter loses a per-row value stored with ``out[:] = t`` after a
        column loop that follows its computation: var_mean's var (computed, then the
        mean's loop, then stored) came out zeros or garbage, where a store right after
        it, or of ``pypto.add(t, 0.0)`` at the end, verified."""
        w = self.w
        for p in outputs:
            if p.value in w.env and p.ident not in self.stored \
                    and not w.layout.spans_cols(p.shape):
                w.lines.append(w.loop_store(w.store_expr(p, w.env[p.value]), p.ident))
                self.stored.add(p.ident)

    def _pass(self, body: Callable[[dict], None]) -> None:
        """One loop over the column chunks; ``body`` fills it given the chunk's env."""
        w = self.w
        self.loops += 1
        k, tc = self.loops, self.tc
        self._c0, self._cn = f"c0_{k}", f"cn_{k}"
        outer_lines, outer_env = w.lines, w.env
        w.lines, w.env = [], dict(outer_env)
        try:
            body(w.env)
            inner = w.lines
        finally:
            w.lines, w.env = outer_lines, outer_env
        w.lines += [f"for j{k} in pypto.loop(({DIM} + {tc - 1}) // {tc}):",
                    f"    {self._c0} = j{k} * {tc}",
                    f"    {self._cn} = pypto.min({self._c0} + {tc}, {DIM}) - {self._c0}"]
        w.lines += ["    " + line for line in inner]

    def _need(self, value: str, env: dict) -> None:
        """Make ``value`` (a column-spanning value) available in this chunk."""
        w = self.w
        if value in env:
            return
        if value in self.lazy_inputs:
            env[value] = w.load_input(value, self.lazy_inputs[value], col=(self._c0, self._cn))
            return
        if value not in self.deferred:
            raise PyptoEmitError(value, "a value the column passes cannot compute per chunk")
        kind, op, *rest = self.deferred[value]
        for a in op.inputs:
            self._need(a, env)
        if kind == "op":
            handler = OPS.get(op.op)
            if handler is None:
                raise PyptoEmitError(op.op)
            env[value], w.dtype[value] = handler(w, op)
        else:  # softmax / log_softmax from the chunk and its per-row max and sum
            (x,) = tensor_operands(w, op)
            mx, s = rest[0]
            e = w.tmp(f"pypto.sub({x}, {mx})")
            env[value] = (w.tmp(f"pypto.div(pypto.exp({e}), {s})") if op.op == "softmax"
                          else w.tmp(f"pypto.sub({e}, pypto.log({s}))"))
            w.dtype[value] = w.compute

    def _reduction(self, op: TileOp) -> None:
        w = self.w
        stages = STAGES.get(op.op)
        if op.op not in OPS:
            raise PyptoEmitError(op.op)
        if stages is None:
            raise PyptoEmitError(op.op, "over a dynamic reduced extent")
        check_reduction(w, op)
        src = w.graph.specs[op.args[0]].dtype
        if not (src.is_floating_point and op.out.dtype.is_floating_point):
            raise PyptoEmitError(op.op, f"a {src} -> {op.out.dtype} reduction over a dynamic "
                                 "reduced extent is not supported yet (accumulators are float)")
        rows = w.layout.body_rows
        dt, f32 = w.dt(w.compute), w.dt(torch.float32)
        per_row: list[str] = []  # per-row values after each stage (a mean for var's second)
        moment = op.op in ("mean", "var", "std")
        scaled = moment and _wide_mean(w)
        if moment and op.args[0] in self.means:  # var and mean of one input share it
            per_row.append(self.means[op.args[0]])
            stages = stages[1:]
        elif scaled:  # the mean as a sum of x / C: the count first, then the scaled sum
            count = self._count(0)
            if w.compute != torch.float32:
                count = w.tmp(f"pypto.cast({count}, {f32})")
            # 1 / C per row (pypto broadcasts a (1, 1) over one axis at a time), shared
            if self.inv is None:
                self.inv = w.tmp(f"pypto.div(pypto.full([{rows}, 1], 1.0, {f32}), {count})",
                                 "inv")
            stages = [("0.0", _scaled_sum(w, self.inv), "add")] + stages[1:]
        for init, partial, combine in stages:
            acc_dt = f32 if scaled and not per_row else dt
            acc = w.tmp(f"pypto.full([{rows}, 1], {init}, {acc_dt})", "acc")

            def body(env: dict, acc=acc, partial=partial, combine=combine) -> None:
                self._need(op.args[0], env)
                (x,) = tensor_operands(w, op)
                w.lines.append(f"{acc}[:] = pypto.{combine}({acc}, {partial(w, x, per_row)})")
            self._pass(body)
            per_row.append(acc)
            if scaled and len(per_row) == 1 and w.compute != torch.float32:
                per_row[0] = w.tmp(f"pypto.cast({acc}, {dt})")
            elif moment and len(per_row) == 1 and not scaled:
                per_row[0] = w.tmp(f"pypto.div({acc}, {self._count(0)})")
            if moment and len(per_row) == 1:
                self.means[op.args[0]] = per_row[0]
        if op.op in _FULL_RESULT:
            self.deferred[op.name] = ("softmax", op, per_row)
            w.dtype[op.name] = w.compute
            return
        if op.op in ("var", "std"):
            n = self._count(op.attrs.get("correction", 1.0))
            result = w.tmp(f"pypto.div({per_row[1]}, {n})")
            if op.op == "std":
                result = w.tmp(f"pypto.sqrt({result})")
        elif op.op == "logsumexp":
            result = w.tmp(f"pypto.add(pypto.log({per_row[1]}), {per_row[0]})")
        else:
            result = per_row[-1]
        w.env[op.name], w.dtype[op.name] = result, w.compute

    def _count(self, correction) -> str:
        """C - correction, the reduced extent, as a (1, 1) tensor.

        Counted as a sum of ones over the column chunks (one loop per kernel, shared by
        its means and vars), not ``pypto.full([rows, 1], C)``: pypto takes a symbolic
        fill value in DT_INT32 only, and its interpreter fills either form with garbage
        (a LayerNorm came out all NaN); the count loop verifies, at +10-12% Total Cycles
        on a 64-row LayerNorm (C = 200 / 700; docs/pypto_coverage.md)."""
        corr = float(1.0 if correction is None else correction)
        if corr != int(corr):
            raise PyptoEmitError("var", f"correction={correction} over a dynamic reduced extent")
        w, dt = self.w, self.w.dt(self.w.compute)
        if self.count is None:
            self.count = w.tmp(f"pypto.full([1, 1], 0.0, {dt})", "count")

            def body(env: dict) -> None:
                ones = f"pypto.full([1, {self.tc}], 1.0, {dt}, valid_shape=[1, {self._cn}])"
                w.lines.append(f"{self.count}[:] = pypto.add({self.count}, "
                               f"pypto.sum({ones}, 1, True))")
            self._pass(body)
        return self.count if not corr else w.tmp(f"pypto.sub({self.count}, {corr!r})", "n")
