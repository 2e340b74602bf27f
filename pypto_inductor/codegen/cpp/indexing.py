"""Indexed reads, padding, arange and in-place writes in the C++ analysis.

A mixin of ``analysis._Analyser``:

* ``gather`` (embedding, index, gather): the source is read at an address whose
  indexed dims come from index values (``Node`` kind "gather", args the index
  loads). The source and the indices are tile inputs. Every index input is
  scanned once before the kernel's loop (``Program.checks``): an out-of-range
  index makes the kernel write nothing but a status the wrapper raises from, as
  eager raises, so the loop never reads out of bounds.
* ``pad`` along one dim: a cat whose outer parts are the fill value.
* ``arange``: ``start + step * i`` at the element's flat index (kind "iota").
* ``copy_(dst, src)``: an output the wrapper writes into ``dst`` (``Program.writes``):
  directly when every read of ``dst`` in the tile is at the element being written
  (else into a new buffer, copied into ``dst`` after the kernel).
"""
from __future__ import annotations

import dataclasses

import sympy

from ...ir import OpKind, TileOp
from ...sizes import numel, same_size
from .ops import STORAGE
from .program import Lit, NotNative, dim_mult

MAX_INDEX_DIMS = 16  # the index scan's odometer (pi_index_bad in prelude.py)


@dataclasses.dataclass(frozen=True)
class IndexCheck:
    """An index input scanned before the kernel: every value in [-bound, bound) with
    ``wrap`` (negative ones count from the end), else in [0, bound), where bound is
    dim ``dim`` of input ``source``."""

    index: int  # input slot
    source: int  # input slot
    dim: int
    wrap: bool
    error: str  # the exception eager raises: "IndexError" or "RuntimeError"
    message: str


@dataclasses.dataclass(frozen=True)
class DirectWrite:
    """A ``copy_`` output: written into input ``input``; ``direct``: by the kernel itself
    when ``dst`` is contiguous (else the wrapper copies the output into it)."""

    input: int
    direct: bool


class IndexingMixin:
    """Methods of the analyser for the tile ops of ``lowering/indexing.py`` and
    ``lowering/mutation.py`` (attributes: see ``_Analyser``)."""

    def plain_input(self, name, what: str) -> str:
        if not isinstance(name, str) or name not in self.slot or name in self.env \
                or name in self.input_views or name in self.deferred:
            raise NotNative(f"{what} is computed inside the tile (it must come from memory)")
        return name

    def gathers_read_where_used(self) -> set[str]:
        """Gathers whose result only pointwise ops of the tile read, broadcast to their larger
        shape (see ``planner.read_where_used``): each use reads the source itself."""
        out = set()
        for op in self.tile.ops:
            if op.op != "gather" or op.name in self.tile.outputs:
                continue
            users = [u for u in self.tile.ops if op.name in u.inputs]
            small = tuple(op.out.shape)
            if users and all(
                    u.kind in (OpKind.ELEMENTWISE, OpKind.BROADCAST, OpKind.CAST)
                    and u.op not in ("gather", "pad", "copy_") and len(small) <= len(u.out.shape)
                    and not same_size(numel(small), numel(u.out.shape))
                    and all(same_size(s, 1) or same_size(s, b)
                            for s, b in zip(small[::-1], tuple(u.out.shape)[::-1]))
                    for u in users):
                out.add(op.name)
        return out

    def lower_gather_at(self, name: str, ctx: tuple):
        """A gather read where used: lowered in the reading op's context (its shape aligned
        right into the gather's; dims the gather has as 1 read at 0)."""
        key = ("gather_at", name, ctx[0], tuple(ctx[1]), tuple(ctx[2]), ctx[3])
        if key not in self.part_env:
            origin = self.origin
            self.part_env[key] = self.lower_gather(self.ops[name], ctx,
                                                   len(ctx[1]) - len(self.ops[name].out.shape))
            self.origin = origin
        return self.part_env[key]

    def lower_gather(self, op: TileOp, ctx: tuple, lead: int = 0):
        """``op`` at ``ctx``; ``lead``: the op's dim k is dim k + lead of the context's shape
        (a gather read where used, see lower_gather_at)."""
        kind, shape, frame, cut = ctx
        if self.shift is not None or self.perm is not None:
            raise NotNative("a gather inside a cat part or a column reduction is not native yet")
        src = self.plain_input(op.args[0], f"the source of gather {op.name}")
        source_dims, index_dims = op.attrs["source_dims"], op.attrs["index_dims"]
        if len(shape) != len(op.out.shape) + lead:
            raise NotNative("a gather whose result is reshaped by the tile domain")
        src_dims = [None] * len(shape)
        for d, k in enumerate(source_dims):
            if k >= 0 and not (lead and same_size(op.out.shape[k], 1) and not same_size(shape[k + lead], 1)):
                src_dims[k + lead] = d  # (a broadcast dim of the result is read at 0)
        access = self.access(src, ctx, src_dims)
        indices, gdims = [], []
        for j, name in enumerate(op.args[1:]):
            name = self.plain_input(name, f"index {j} of gather {op.name}")
            spec = self.graph.specs[name]
            if len(spec.shape) > MAX_INDEX_DIMS:
                raise NotNative(f"an index of more than {MAX_INDEX_DIMS} dims")
            dims = [None] * len(shape)
            for e, k in enumerate(index_dims[j]):
                dims[k + lead] = e
            m = self.m_red
            per_row = m and all(x is None for x in dims[len(dims) - m:])
            ictx = ("keep", shape, frame, cut) if per_row and kind == "col" else ctx
            indices.append(self.load(name, ictx, dims))
            gdims.append(source_dims.index(-1 - j))
            check = IndexCheck(self.slot[name], self.slot[src], gdims[-1], op.attrs["wrap"],
                               "RuntimeError" if op.attrs["check"] == "gather" else "IndexError",
                               f"{op.attrs['check']} ({op.name}): index out of range in self")
            if check not in self.checks:
                self.checks.append(check)
        level = "col" if kind == "col" else "row"
        return self.node("gather", level, indices, op.out.dtype, shape, access=access,
                         gdims=tuple(gdims), wrap=bool(op.attrs["wrap"]))

    def lower_pad(self, op: TileOp, ctx: tuple):
        """pad along one dim: cat(fill, x, fill) with the fills as literal parts."""
        padded = [d for d, (lo, hi) in enumerate(op.attrs["pads"])
                  if not (same_size(lo, 0) and same_size(hi, 0))]
        if len(padded) != 1:
            raise NotNative(f"pad along {len(padded)} dims is not native yet (only one)")
        (d,) = padded
        lo, hi = op.attrs["pads"][d]
        if not all(sympy.sympify(v).is_nonnegative for v in (lo, hi)):
            raise NotNative("pad by a size argument of unknown sign is not native")
        x = op.args[0]
        parts = [(Lit(op.attrs["value"]), lo), (x, self.graph.specs[x].shape[d]),
                 (Lit(op.attrs["value"]), hi)]
        return self.lower_parts(op, ctx, d, [(a, n) for a, n in parts if not same_size(n, 0)])

    def lower_arange(self, op: TileOp, ctx: tuple):
        if ctx[0] != "col" or self.shift is not None or self.perm is not None:
            raise NotNative("arange not over the tile's elements is not native yet")
        return self.node("iota", "col", [], op.out.dtype, ctx[1], start=op.attrs["start"],
                         step=op.attrs["step"])

    def lower_copy_(self, op: TileOp, ctx: tuple):
        """The value written into ``dst``: ``src`` broadcast and converted to its dtype."""
        dst, src = op.args
        v = self.operand(src, ctx)
        level = "col" if ctx[0] == "col" else "row"
        self.copies[op.name] = dst
        return self.node("op", level, [v], op.out.dtype, ctx[1], op="copy", common=op.out.dtype)

    def direct_writes(self, outputs) -> dict:
        """``Program.writes``: output index -> :class:`DirectWrite` for every copy_ output."""
        writes = {}
        for k, name in enumerate(self.tile.outputs):
            dst = self.copies.get(name)
            if dst is None:
                continue
            writes[k] = DirectWrite(self.slot[dst], self.may_write_directly(dst, outputs[k][0]))
        return writes

    def may_write_directly(self, dst: str, value) -> bool:
        """Whether the kernel may store the copy_ into ``dst`` itself: no other tile input
        aliases it, and every read of it in the tile is of the element being written
        (the same flat index of the domain, so each is read before it is overwritten)."""
        producers = self.graph.producers()
        for name in self.tile.inputs:
            root = name
            while isinstance(producers.get(root), TileOp) and producers[root].is_view:
                root = producers[root].args[0]
            if name != dst and root == dst:
                return False
        reads = [a for a in self.access_list if a.input == self.slot[dst]]
        if not reads:
            return True
        if self.perm is not None or value.level != "col":
            return False
        spec = self.graph.specs[dst]
        for a in reads:
            if not a.col or a.offset is not None or a.row_shift \
                    or not same_size(numel(a.frame), numel(spec.shape)):
                return False
            seen = []
            for e, entry in enumerate(a.dims):
                j, mult = dim_mult(entry)
                if j is None:
                    if not same_size(a.frame[e], 1):
                        return False  # a broadcast read
                    continue
                seen.append(j)
            if seen != sorted(seen) or {j for j in range(len(spec.shape))
                                        if not same_size(spec.shape[j], 1)} - set(seen):
                return False
        return True


def gather_address(x, var, col_offset: str | None) -> str:
    """The address expression of a gather node (see ``row_loop.RowLoop.define``)."""
    k = x.attrs["access"]
    terms = [f"b{k}"] + ([col_offset] if col_offset is not None else [])
    for a, d in zip(x.args, x.attrs["gdims"]):
        v = var(a)
        if x.attrs["wrap"]:
            v = f"({v} < 0 ? {v} + gs{k}_{d} : {v})"
        terms.append(f"{v} * gt{k}_{d}")
    return " + ".join(terms)


def error_class(error: str) -> type:
    return {"RuntimeError": RuntimeError}.get(error, IndexError)


def index_prologue(e, offsets: list[int]) -> None:
    """Kernel lines after the pointers (written by the emitter ``e``): each gather's source
    sizes and strides along its indexed dims (``gs<k>_<d>``, ``gt<k>_<d>``), then the scan
    of every index input (``Program.checks``): on the first bad one the kernel stores its
    number (1-based) in the status output and returns before reading anything through an
    index."""
    p, seen = e.p, set()
    for x in p.nodes:
        if x.kind != "gather":
            continue
        k = x.attrs["access"]
        inp = p.accesses[k].input
        o, q = offsets[inp], len(p.input_specs[inp].shape)
        for d in x.attrs["gdims"]:
            if (k, d) not in seen:
                seen.add((k, d))
                e.declare_kernel_vars("int64_t", {f"gs{k}_{d}": f"meta[{o + d}]",
                                                  f"gt{k}_{d}": f"meta[{o + q + d}]"},
                                      unused=(f"gs{k}_{d}",))
    checks = getattr(p, "checks", [])
    if not checks:
        return
    status = len(p.input_specs) + len(p.outputs)
    e.declare_kernel_vars("int64_t*", {"status": f"(int64_t*)ptrs[{status}]"}, const=False)
    e.declare_kernel_vars("int64_t", {"bad": "0"}, const=False)
    for i, c in enumerate(checks):
        t = STORAGE[p.input_specs[c.index].dtype]
        q = len(p.input_specs[c.index].shape)
        bound = f"meta[{offsets[c.source] + c.dim}]"
        e.w(f"  if (!bad && pi_index_bad<{t}>(in{c.index}, meta + {offsets[c.index]}, "
            f"{q}, {bound}, {'true' if c.wrap else 'false'})) bad = {i + 1};")
    e.w("  status[0] = bad;")
    e.w("  if (bad) return;")


def iota(start, step, dtype, flat: str, number) -> str:
    """arange's value at flat index ``flat``: computed in double for floats (as eager's
    accumulate type), exactly in int64 otherwise."""
    if dtype.is_floating_point:
        return f"((double)({number(start)}) + (double)({number(step)}) * (double)({flat}))"
    return f"((int64_t)({number(start)}) + (int64_t)({number(step)}) * ({flat}))"
