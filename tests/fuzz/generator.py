"""Random programs for the differential fuzzer, reproducible from one integer seed.

``generate(seed)`` builds a straight-line program of 3-15 statements (a DAG:
operands are drawn from every value so far, recent ones more often) over the
families in ``FAMILIES``. Shapes are built from four base dims whose sizes differ
between two size variants (0: the static compile and the first dynamic call; 1:
the second dynamic call), so all program text is shape-generic (``x.shape[d]``,
``-1``, ``expand_as``). Every statement is run on the case's own inputs at both
sizes before it is accepted, so no generated program fails in eager.
"""
from __future__ import annotations

import itertools
import random
import warnings

import torch

from . import check, ops
from .program import Program, Statement

FAMILIES = {  # family -> weight
    "unary": 18, "binary": 20, "reduction": 11, "softmax": 5, "view": 14, "cat": 5,
    "matmul": 5, "cast": 7, "where": 4, "inplace": 5, "index": 3,
}
DTYPE_WEIGHTS = {"f32": 52, "f16": 10, "bf16": 10, "f64": 7, "i32": 6, "i64": 8, "b8": 7}
BACKWARD_DTYPE_WEIGHTS = {"f32": 70, "f64": 15, "f16": 5, "bf16": 5, "i64": 5}
SIZES = [2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 16, 17, 24, 31, 32, 33, 48, 64]
LARGE_SIZES = [96, 128, 257, 1000]
MAX_NUMEL = 16384
# unbind / split into this many pieces at most: Dynamo traces each piece (with symbolic
# guards under dynamic=True), so a 3,136-way unbind took over 20 minutes (seed 60034)
MAX_PIECES = 16
BACKWARD_SHARE = 0.3
SPECIAL_SHARE = 0.25


class Rejected(Exception):
    """A statement that fails or breaks the shape rules; the generator tries another."""


class Builder:
    def __init__(self, seed: int, attempt: int):
        self.seed = seed
        self.rng = random.Random(seed * 1009 + attempt)
        rng = self.rng
        self.backward = rng.random() < BACKWARD_SHARE
        self.special = rng.random() < SPECIAL_SHARE
        self.dims = self._base_dims()
        self.inputs: list[dict] = []
        self.statements: list[Statement] = []
        self.values: dict[str, list[torch.Tensor]] = {}  # name -> [variant 0, variant 1]
        self.names: list[str] = []  # values in order of definition
        self.ns = [check.namespace(), check.namespace()]
        self._pending: list[dict] = []

    # --- shapes and inputs ------------------------------------------------------------
    def _base_dims(self) -> list[tuple[int, int]]:
        pool = SIZES + (LARGE_SIZES if self.rng.random() < 0.15 else [])
        a = self.rng.sample(pool, 4)
        b = self.rng.sample([s for s in pool if s not in a], 4)
        return list(zip(a, b))

    def random_shape(self, rank: int) -> list[tuple[int, int]]:
        """(size at variant 0, size at variant 1) per dim: a base dim, or 1."""
        return [(1, 1) if self.rng.random() < 0.12 else self.rng.choice(self.dims)
                for _ in range(rank)]

    def new_input(self, dims: list[tuple[int, int]], dtype: str, kind: str = "normal",
                  bounds=None) -> str:
        """A pending input (kept only if the statement using it is accepted)."""
        index = len(self.inputs) + len(self._pending)
        spec = {"name": f"x{index}", "index": index, "dtype": dtype, "kind": kind,
                "shapes": [[d[0] for d in dims], [d[1] for d in dims]]}
        if bounds is not None:
            spec["bounds"] = list(bounds)
        floating = dtype in check.FLOAT_CODES
        if self.special and kind == "normal" and self.rng.random() < (0.7 if floating else 0.2):
            spec["special"] = True
        if floating and self.rng.random() < 0.15:
            spec["scale"] = self.rng.choice([1e-3, 30.0, 1e4])
        if len(dims) >= 2 and self.rng.random() < 0.15:
            spec["layout"] = self.rng.choice(["transposed", "strided"])
        for v in (0, 1):
            if spec["shapes"][v] and torch.Size(spec["shapes"][v]).numel() > MAX_NUMEL:
                raise Rejected("input too large")
        self._pending.append(spec)
        return spec["name"]

    def dtype(self) -> str:
        table = BACKWARD_DTYPE_WEIGHTS if self.backward else DTYPE_WEIGHTS
        return self.rng.choices(list(table), list(table.values()))[0]

    def shapes(self, name: str) -> list[tuple[int, ...]]:
        return [tuple(t.shape) for t in self._tensors(name)]

    def dims_of(self, name: str) -> list[tuple[int, int]]:
        a, b = self.shapes(name)
        return list(zip(a, b))

    def _tensors(self, name):
        if name in self.values:
            return self.values[name]
        spec = next(s for s in self._pending if s["name"] == name)
        return [check.make_input(spec, v, self.seed) for v in (0, 1)]

    # --- operands ---------------------------------------------------------------------
    def pick(self, where=None) -> str:
        names = [n for n in self.names if where is None or where(n)]
        if not names:
            raise Rejected("no operand")
        recent = set(names[-3:])
        return self.rng.choices(names, [4 if n in recent else 1 for n in names])[0]

    def is_float(self, name: str) -> bool:
        return self._tensors(name)[0].is_floating_point()

    def rank(self, name: str) -> int:
        return self._tensors(name)[0].dim()

    def scalar(self) -> str:
        if self.special and self.rng.random() < 0.2:
            return self.rng.choice(ops.SPECIAL_SCALARS)
        return self.rng.choice(ops.FLOAT_SCALARS)

    def dims_arg(self, rank: int) -> str:
        dims = sorted(self.rng.sample(range(rank), self.rng.randint(1, rank)))
        dims = [d - rank if self.rng.random() < 0.25 else d for d in dims]
        return str(dims[0]) if len(dims) == 1 and self.rng.random() < 0.5 else str(tuple(dims))

    # --- statements -------------------------------------------------------------------
    def add(self, expr: str, uses: list[str], family: str, mutates: str | None = None) -> None:
        """Replay the program plus the statement on fresh inputs at both sizes (in-place
        writes and their aliases included); keep it if it runs and its result has the same
        rank at both sizes, no empty or oversized tensor, and size-1 dims at the same
        places (a dim that is 1 at one size only would specialise)."""
        name = None if mutates else f"v{len(self.statements)}"
        text = expr if mutates else f"{name} = {expr}"
        states = []
        for v in (0, 1):
            try:
                ns = self._replay(v, text)
            except Exception as e:  # noqa: BLE001 - any failure rejects the statement
                raise Rejected(str(e)) from e
            if name:
                self._check_result(ns[name])
            states.append(ns)
        if name:
            a, b = states[0][name], states[1][name]
            if a.dim() != b.dim() or any((x == 1) != (y == 1) for x, y in zip(a.shape, b.shape)):
                raise Rejected("size-1 dims differ between sizes")
        self.inputs.extend(self._pending)
        self.names.extend(spec["name"] for spec in self._pending)
        self._pending = []
        if name:
            self.names.append(name)
        self.ns = states
        self.values = {n: [states[0][n], states[1][n]] for n in self.names}
        self.statements.append(Statement(text, name, list(dict.fromkeys(uses)), family, mutates))

    def _replay(self, variant: int, text: str) -> dict:
        ns = check.namespace()
        for spec in self.inputs + self._pending:
            ns[spec["name"]] = check.make_input(spec, variant, self.seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for s in self.statements:
                exec(s.text, ns)
            exec(text, ns)
        return ns

    @staticmethod
    def _check_result(t) -> None:
        if not isinstance(t, torch.Tensor):
            raise Rejected("not a tensor")
        if t.numel() == 0 or t.numel() > MAX_NUMEL:
            raise Rejected("empty or too large")
        if t.dtype not in check.DTYPES.values():
            raise Rejected(f"dtype {t.dtype}")


def _unary(b: Builder) -> None:
    a = b.pick()
    dtype = b._tensors(a)[0].dtype
    table = (ops.FLOAT_UNARY if dtype.is_floating_point else
             ops.BOOL_UNARY if dtype is torch.bool else ops.INT_UNARY)
    lo, hi = sorted(b.rng.sample([-2.0, -0.5, 0.0, 0.25, 1.0, 3.0], 2))
    b.add(b.rng.choice(table).format(a=a, lo=lo, hi=hi), [a], "unary")


def _partner(b: Builder, a: str) -> str:
    """A second operand broadcasting against ``a``: an existing value, or a new input
    shaped as a suffix of ``a`` with some dims 1 (rank-mismatched), or 0-d."""
    how = b.rng.random()
    if how < 0.4:
        target = b.shapes(a)

        def fits(n):
            try:
                for t, s in zip(target, b.shapes(n)):
                    torch.broadcast_shapes(t, s)
                return True
            except RuntimeError:
                return False
        try:
            return b.pick(lambda n: n != a and fits(n))
        except Rejected:
            pass
    dims = b.dims_of(a)
    if how > 0.93 or not dims:
        return b.new_input([], b.dtype())
    keep = b.rng.randint(1, len(dims))
    suffix = [(1, 1) if b.rng.random() < 0.3 else d for d in dims[len(dims) - keep:]]
    dtype = b._tensors(a)[0].dtype
    same = next((c for c, t in check.DTYPES.items() if t == dtype), "f32")
    return b.new_input(suffix, same if b.rng.random() < 0.7 else b.dtype())


def _binary(b: Builder) -> None:
    a = b.pick()
    if b.rng.random() < 0.3:
        expr = b.rng.choice(ops.SCALAR_BINARY).format(a=a, s=b.scalar(), s2=b.scalar())
        b.add(expr, [a], "binary")
        return
    other = _partner(b, a)
    template = b.rng.choice(ops.BINARY)
    divisor = other
    if any(k in template for k in ops.DIVIDING) and not b._tensors(other)[0].is_floating_point():
        divisor = f"({other}.abs() + 1)"
    x, y = (a, divisor) if b.rng.random() < 0.7 else (other, a)
    b.add(template.format(a=x, b=y), [a, other], "binary")


def _reduction(b: Builder) -> None:
    a = b.pick()
    rank = b.rank(a)
    fmt = {"a": a, "k": b.rng.random() < 0.4, "c": b.rng.choice([0, 1]), "i": b.rng.randint(0, 1)}
    roll = b.rng.random()
    if rank == 0 or roll < 0.12:
        expr = b.rng.choice(ops.REDUCE_ALL).format(**fmt)
    elif roll < 0.7:
        expr = b.rng.choice(ops.REDUCE_DIMS).format(dims=b.dims_arg(rank), **fmt)
    else:
        expr = b.rng.choice(ops.REDUCE_ONE_DIM).format(d=b.rng.randrange(-rank, rank), **fmt)
    b.add(expr, [a], "reduction")


def _softmax(b: Builder) -> None:
    a = b.pick(lambda n: b.rank(n) > 0)
    d = b.rng.randrange(-b.rank(a), b.rank(a))
    b.add(b.rng.choice(ops.SOFTMAX).format(a=a, d=d), [a], "softmax")


def _slice(rank: int, rng: random.Random) -> str:
    d = rng.randrange(rank)
    part = rng.choice(["1:", ":-1", "::2", "1::2", "0", "-1", "None", ":1"])
    return ", ".join([":"] * d + [part]) if d < 3 or rng.random() < 0.5 else "..., " + part


def _view(b: Builder) -> None:
    a = b.pick(lambda n: b.rank(n) > 0)
    rank, rng = b.rank(a), b.rng
    d = rng.randrange(rank)
    shape0 = b.shapes(a)[0]
    choices = [
        f"{a}.permute{tuple(rng.sample(range(rank), rank))}" if rank > 1 else f"{a}.t()",
        f"{a}.transpose({rng.randrange(-rank, rank)}, {rng.randrange(rank)})",
        f"{a}.unsqueeze({rng.randint(-rank - 1, rank)})",
        f"{a}[{_slice(rank, rng)}]",
        f"{a}.narrow({d}, 0, {a}.shape[{d}] // 2)",
        f"{a}.select({d}, -1)",
        f"{a}.reshape(-1)",
        f"{a}.reshape({a}.shape[0], -1)",
        f"{a}.flatten({d}, {min(d + 1, rank - 1)})",
        f"{a}.unflatten({d}, (-1, 2))",
        f"{a}.contiguous()" if rank < 2 else f"{a}.transpose(0, 1).contiguous()",
        f"{a}.clone()",
        f"{a}.expand({a}.shape[{d}], *{a}.shape)",
        f"{a}.view(-1, {a}.shape[-1])",
        f"{a}.repeat({', '.join(['2'] + ['1'] * (rank - 1))})",
    ]
    if 1 in shape0:
        one = shape0.index(1)
        choices.append(f"{a}.squeeze({one})")
        others = [(n, k) for n in b.names for k, (x, y) in enumerate(b.dims_of(n))
                  if x != 1 and y != 1]
        if others:
            n, k = rng.choice(others)
            args = ["-1"] * rank
            args[one] = f"{n}.shape[{k}]"
            b.add(f"{a}.expand({', '.join(args)})", [a, n], "view")
            return
    target = [n for n in b.names if n != a and b.rank(n) >= rank]
    if target and rng.random() < 0.3:
        other = rng.choice(target)
        b.add(f"{a}.expand_as({other})", [a, other], "view")
        return
    b.add(rng.choice(choices), [a], "view")


def _cat(b: Builder) -> None:
    a = b.pick(lambda n: b.rank(n) > 0)
    rank, rng = b.rank(a), b.rng
    d = rng.randrange(-rank, rank)
    roll = rng.random()
    if roll < 0.45:
        dims = b.dims_of(a)
        dims[d] = rng.choice(b.dims + [(1, 1)])
        dtype = next(c for c, t in check.DTYPES.items() if t == b._tensors(a)[0].dtype)
        other = b.new_input(dims, dtype)
        parts = [a, other] if rng.random() < 0.5 else [other, a]
        b.add(f"torch.cat([{parts[0]}, {parts[1]}], dim={d})", [a, other], "cat")
    elif roll < 0.6:
        same = [n for n in b.names if n != a and b.shapes(n) == b.shapes(a)]
        other = rng.choice(same) if same else a
        b.add(f"torch.stack([{a}, {other}], dim={rng.randint(-rank - 1, rank)})", [a, other], "cat")
    elif roll < 0.75:
        b.add(f"torch.cat([{a}, {a}.narrow({d}, 0, 1), {a}], dim={d})", [a], "cat")
    else:
        expr = rng.choice([f"{a}.chunk(2, dim={d})[{rng.randint(0, 1)}]",
                           f"torch.split({a}, 2, dim={d})[0]", f"{a}.unbind({d})[-1]"])
        size = max(b.dims_of(a)[d])
        pieces = size if ".unbind(" in expr else (size + 1) // 2 if "split(" in expr else 2
        if pieces > MAX_PIECES:
            raise Rejected("Dynamo traces every piece: its time grows with their number")
        b.add(expr, [a], "cat")


def _matmul(b: Builder) -> None:
    a = b.pick(lambda n: b.is_float(n) and b.rank(n) >= 1)
    rank, rng = b.rank(a), b.rng
    dims = b.dims_of(a)
    dtype = next(c for c, t in check.DTYPES.items() if t == b._tensors(a)[0].dtype)
    n = rng.choice(b.dims)
    roll = rng.random()
    if roll < 0.35:
        w = b.new_input([dims[-1], n], dtype)
        b.add(rng.choice([f"torch.matmul({a}, {w})", f"{a} @ {w}"]), [a, w], "matmul")
    elif roll < 0.55:
        w = b.new_input([n, dims[-1]], dtype)
        bias = b.new_input([n], dtype) if rng.random() < 0.6 else None
        b.add(f"F.linear({a}, {w}, {bias})", [a, w] + ([bias] if bias else []), "matmul")
    elif roll < 0.75 and rank == 3:
        w = b.new_input([dims[0], dims[-1], n], dtype)
        b.add(f"torch.bmm({a}, {w})", [a, w], "matmul")
    elif rank >= 2:
        b.add(f"{a} @ {a}.transpose(-1, -2)", [a], "matmul")
    else:
        other = b.pick(lambda m: b.is_float(m) and b.rank(m) >= 2)
        b.add(f"torch.matmul({a}, {other})", [a, other], "matmul")


def _cast(b: Builder) -> None:
    a = b.pick()
    b.add(f"{a}.to({b.rng.choice(ops.CASTS)})", [a], "cast")


def _where(b: Builder) -> None:
    a = b.pick()
    cond = b.pick(lambda n: b._tensors(n)[0].dtype is torch.bool) if b.rng.random() < 0.4 \
        and any(b._tensors(n)[0].dtype is torch.bool for n in b.names) else None
    other = _partner(b, a)
    if cond is None:
        b.add(f"torch.where({a} > 0, {a}, {other})", [a, other], "where")
    elif b.rng.random() < 0.5:
        b.add(f"torch.where({cond}, {a}, {other})", [cond, a, other], "where")
    else:
        b.add(f"{a}.masked_fill({cond}, {b.scalar()})", [a, cond], "where")


def _inplace(b: Builder) -> None:
    if b.backward:
        raise Rejected("in-place ops stay out of backward cases (leaves and saved values)")
    inputs = {s["name"] for s in b.inputs}
    writable = lambda n: 0 not in b._tensors(n)[0].stride()  # noqa: E731 - no expanded dims
    t = b.pick(lambda n: n in inputs and writable(n)) if b.rng.random() < 0.6 \
        else b.pick(writable)
    template = b.rng.choice(ops.INPLACE)
    other = _partner(b, t) if "{b}" in template else None
    if "{sl}" in template and b.rank(t) == 0:
        raise Rejected("no slice of a 0-d tensor")
    expr = template.format(t=t, b=other, s=b.scalar(), s2=b.scalar(),
                           sl=_slice(max(b.rank(t), 1), b.rng))
    b.add(expr, [t, other] if other else [t], "inplace", mutates=t)


def _index(b: Builder) -> None:
    a = b.pick(lambda n: b.rank(n) > 0)
    rank, rng = b.rank(a), b.rng
    d = rng.randrange(rank)
    dims = b.dims_of(a)
    bounds = dims[d]
    roll = rng.random()
    if roll < 0.3:
        idx_dims = list(dims)
        idx_dims[d] = rng.choice(b.dims)
        idx = b.new_input(idx_dims, "i64", "index", bounds)
        b.add(f"torch.gather({a}, {d}, {idx})", [a, idx], "index")
    elif roll < 0.55:
        idx = b.new_input([rng.choice(b.dims)], "i64", "index", bounds)
        b.add(f"{a}.index_select({d}, {idx})", [a, idx], "index")
    elif roll < 0.8 and rank == 2:
        idx = b.new_input(b.random_shape(rng.randint(1, 2)), "i64", "index", dims[0])
        b.add(f"F.embedding({idx}, {a})", [a, idx], "index")
    else:
        idx = b.new_input([rng.choice(b.dims)], "i64", "index", dims[0])
        b.add(f"{a}[{idx}]", [a, idx], "index")


BUILDERS = {"unary": _unary, "binary": _binary, "reduction": _reduction, "softmax": _softmax,
            "view": _view, "cat": _cat, "matmul": _matmul, "cast": _cast, "where": _where,
            "inplace": _inplace, "index": _index}


def _first_inputs(b: Builder) -> None:
    for _ in range(b.rng.randint(1, 3)):
        for _attempt in range(20):
            try:
                name = b.new_input(b.random_shape(b.rng.choice([1, 2, 2, 3, 3, 4])), b.dtype())
                break
            except Rejected:
                continue
        spec = b._pending.pop()
        b.inputs.append(spec)
        b.names.append(name)
        for v in (0, 1):
            b.ns[v][name] = check.make_input(spec, v, b.seed)
        b.values[name] = [b.ns[0][name], b.ns[1][name]]


def _outputs(b: Builder) -> list[str]:
    used = {u for s in b.statements for u in s.uses if s.defines or u != s.mutates}
    defined = [s.defines for s in b.statements if s.defines]
    sinks = [n for n in defined if n not in used][-4:]
    extra = [n for n in defined if n not in sinks]
    if extra and b.rng.random() < 0.2:
        sinks.append(b.rng.choice(extra))
    return sinks


def _build(seed: int, attempt: int) -> Program | None:
    b = Builder(seed, attempt)
    _first_inputs(b)
    families, weights = list(FAMILIES), list(FAMILIES.values())
    target = b.rng.randint(3, 15)
    tries = 0
    while len(b.statements) < target and tries < target * 25:
        tries += 1
        family = b.rng.choices(families, weights)[0]
        try:
            BUILDERS[family](b)
        except Rejected:
            b._pending = []
    outputs = _outputs(b)
    if len(b.statements) < 3 or not outputs:
        return None
    program = Program(seed, b.inputs, b.statements, outputs, b.backward)
    return _validated(program)


def _validated(program: Program) -> Program | None:
    """The program if eager, float64 and nudged runs all work at both sizes (a backward
    case whose gradients cannot be taken becomes a forward case)."""
    for backward in ([True, False] if program.backward else [False]):
        program.backward = backward
        try:
            refs = {}
            for v in (0, 1):
                refs[v] = check.reference(program.case(), v)
                if backward and not refs[v]["eager"].get("gradients"):
                    raise Rejected("no output needs a gradient")
            program.refs = refs
            return program
        except Exception:  # noqa: BLE001 - eager cannot run it: try without backward
            continue
    return None


def generate(seed: int) -> Program:
    """The program of ``seed`` (deterministic)."""
    for attempt in itertools.count():
        program = _build(seed, attempt)
        if program is not None:
            return program
        if attempt > 50:
            raise RuntimeError(f"no valid program for seed {seed}")
