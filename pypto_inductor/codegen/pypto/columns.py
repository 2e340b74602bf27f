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
  count (a sum of ones over the chunks, see ``_count``), ``var``/``std`` a mean
  then a sum of squared deviations, ``logsumexp``/``softmax``/``log_softmax`` a max then a sum of
  exponentials (softmax's result is recomputed per chunk where it is used);
- per-row ops (``(R, 1)`` and ``(1, 1)`` values) once, between the loops;
- a last column loop computing and ``pypto.assemble``-ing every output that
  spans the columns; per-row outputs are stored after it.

Pointwise tiles with dynamic columns are the case with no reduction: one loop.
With dynamic rows too, all of this runs inside the row loop (:mod:`.rows`).
Compiled and simulated with pypto 0.2.0's SIM mode; values are checked in pypto's
interpreter at concrete sizes (tests/test_pypto_verify.py), partial chunks included.
Integer reductions are refused (the accumulators are float).
"""
from __future__ import annotations

from typing import Callable

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
        wide = [p for p in outputs if w.layout.spans_cols(p.shape)]
        if wide:
            def body(env: dict) -> None:
                for p in wide:
                    self._need(p.value, env)
                    w.lines.append(w.loop_store(w.store_expr(p, env[p.value]), p.ident,
                                                col=self._c0))
            self._pass(body)

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
        dt = w.dt(w.compute)
        per_row: list[str] = []  # per-row values after each stage (a mean for var's second)
        for init, partial, combine in stages:
            acc = w.tmp(f"pypto.full([{rows}, 1], {init}, {dt})", "acc")

            def body(env: dict, acc=acc, partial=partial, combine=combine) -> None:
                self._need(op.args[0], env)
                (x,) = tensor_operands(w, op)
                w.lines.append(f"{acc}[:] = pypto.{combine}({acc}, {partial(w, x, per_row)})")
            self._pass(body)
            per_row.append(acc)
            if op.op in ("mean", "var", "std") and len(per_row) == 1:
                per_row[0] = w.tmp(f"pypto.div({acc}, {self._count(0)})")
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
