"""Matmul FusionTiles on the native CPU target: torch's BLAS + one native epilogue pass.

The GEMM runs through ``torch.matmul`` (BLAS, whatever the batch/broadcast
form), or ``torch.addmm`` / ``baddbmm`` when its first epilogue op is a bias add
(:func:`ir.gemm_bias_add`: BLAS adds it while writing the result). The rest of
the elementwise epilogue the planner fused with it (activation, residual, cast,
scale, ...) becomes one C++ pointwise kernel built with the ordinary pointwise
machinery (:func:`.analysis.analyse`), with the GEMM result as its first input. A tile
with no other epilogue op makes no native kernel.

A Linear whose epilogue is one activation (GELU, SiLU, ReLU, sigmoid, tanh) or one
residual add runs as one oneDNN call with that post-op (``mkldnn._linear_pointwise``,
where torch has oneDNN): the activation is applied while each block of the result is
still in cache, so the epilogue costs no pass over memory and no kernel of ours
(:func:`onednn_post_op`).

Reshapes (``view``) inside the epilogue are resolved before analysis: every
epilogue op has the matmul's element count (planner legality), so all of them
are rewritten onto one domain ``T`` (the last op's shape). Contiguous values
(the matmul result, tile inputs of an op's full shape) are reshaped to ``T`` in
the wrapper; broadcast inputs keep the trailing dims the op's shape shares with
``T``. Anything else raises :class:`.program.NotNative` and the tile runs the
reference executor.
"""
from __future__ import annotations

import dataclasses

import torch

from ...fusion.capacity import column_sum
from ...ir import FusionTile, OpKind, TensorSpec, TileGraph, TileOp, gemm_bias_add
from ...sizes import contiguous_strides as _contiguous
from ...sizes import numel as _numel
from ...sizes import same_shape as _same_shape
from ...sizes import same_size as _same
from ...sizes import size_function
from .. import Kernel
from . import alloc
from .program import NotNative

MM = "pi_mm"  # the epilogue program's name for the matmul result
# the source of the epilogue input MM: not a graph value name (a saved forward value may be
# named "mm": fuzz seed 21160, whose epilogue then read the product in its place)
PRODUCT = "<matmul product>"

# oneDNN post-ops for a Linear's one-op epilogue: tile op -> (attr, algorithm); gelu by
# its approximate attribute. False: every epilogue is a native pass (benchmarks compare).
ONEDNN_POST_OPS = True
# ... and only for weights of at least this many elements (K x N): below, oneDNN's post-op
# Linear is slower than addmm + a native pass (M=512: K x N = 64x128 .. 128x128 by 0-13%,
# BERT's FFN 64->128 + GELU 152-173 us against 88 + 43), equal at 128x512, faster above
# (256x1024: by 8-27%). docs/benchmarks.md, "oneDNN post-ops by size".
ONEDNN_POST_OPS_MIN_WEIGHT = 65536
# ... and only for at least this many rows (x's first dim): at 1-2 rows (a decode step)
# addmm + the activation as its own pass is faster (256x1024 + GELU, 1 row: 32 us against
# 25; K x N = 1024x256 + residual add: 29 against 16), about even at 4, oneDNN faster from
# 8 (0.75x) on. Dynamic rows: both forms, one integer compare at run time. False: the
# weight size alone chooses (the state before). docs/benchmarks.md, "oneDNN post-ops by rows".
ONEDNN_POST_OPS_BY_ROWS = True
ONEDNN_POST_OPS_MIN_ROWS = 4
# Whether a bare GEMM (no native epilogue) is written into the graph's generated code as
# the torch call itself (GemmCall) instead of a call of its Python wrapper; the benchmark
# turns it off to compile the "before" form.
INLINE_GEMMS = True
# ... and a GEMM with a native epilogue pass as the GEMM call plus the epilogue kernel's
# launch (EpilogueCall), not a call of the tile's Python wrapper (the benchmark's "before")
INLINE_EPILOGUES = True
# A GEMM of two 2-D operands calls torch.mm, not torch.matmul (the benchmark's "before")
MM_2D = True
# No relu: oneDNN's relu post-op gives 0 for a NaN product where eager's relu keeps NaN
# (fuzz seed 30644); it runs as the native epilogue pass instead.
_UNARY_POST_OPS = {"sigmoid": ("sigmoid", ""), "tanh": ("tanh", ""), "silu": ("swish", "")}


@dataclasses.dataclass(frozen=True)
class OneDnnLinear:
    """A Linear with its epilogue as a oneDNN post-op: ``attr`` is a unary post-op
    ("gelu", "swish", ...) or "add" with ``other`` the residual's tile input."""
    attr: str
    algorithm: str = ""
    other: str | None = None
    # > 0: the rows are dynamic; below this many the kernel runs addmm + ATen's op instead
    min_rows: int = 0


def _onednn_linear_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_post_op(mm, bias, new_ops, getters, graph: TileGraph
                   ) -> tuple[OneDnnLinear | None, str | None]:
    """The oneDNN form of a Linear tile or None, and a note for the fusion report on the
    choice (None where oneDNN does not apply). It takes ``x @ w.t() (+ bias)`` with x
    row-major 2-D, w.t() a transposed row-major weight, a 1-D bias, fp32 or bf16, and an
    epilogue of exactly one op reading the product: a unary activation oneDNN computes
    as eager does (GELU erf/tanh, SiLU, ReLU, sigmoid, tanh), or an add of a row-major
    residual of the output's shape. The tile's only output is that op's result. Where it
    applies, the weight's size and the row count choose (ONEDNN_POST_OPS_MIN_WEIGHT,
    ONEDNN_POST_OPS_MIN_ROWS); dynamic rows choose at run time (OneDnnLinear.min_rows)."""
    if not ONEDNN_POST_OPS or len(new_ops) != 1 or not _onednn_linear_available():
        return None, None
    linear = _post_op_form(mm, bias, new_ops, getters, graph)
    if linear is None:
        return None, None
    a, b = (graph.specs[x] for x in mm.args)
    K, N, rows = graph.hint(b.shape[0]), graph.hint(b.shape[1]), a.shape[0]
    what = f"oneDNN linear with the {linear.attr} post-op"
    if K * N < ONEDNN_POST_OPS_MIN_WEIGHT:
        return None, (f"addmm + native epilogue pass, not {what}: weight {K}x{N} < "
                      f"{ONEDNN_POST_OPS_MIN_WEIGHT} elements (ONEDNN_POST_OPS_MIN_WEIGHT)")
    if not ONEDNN_POST_OPS_BY_ROWS:
        return linear, f"{what}: weight {K}x{N} >= {ONEDNN_POST_OPS_MIN_WEIGHT} elements"
    if _static(rows):
        if int(rows) < ONEDNN_POST_OPS_MIN_ROWS:
            return None, (f"addmm + native epilogue pass, not {what}: {int(rows)} rows < "
                          f"{ONEDNN_POST_OPS_MIN_ROWS} (ONEDNN_POST_OPS_MIN_ROWS)")
        return linear, (f"{what}: weight {K}x{N} >= {ONEDNN_POST_OPS_MIN_WEIGHT} elements, "
                        f"{int(rows)} rows >= {ONEDNN_POST_OPS_MIN_ROWS}")
    return (dataclasses.replace(linear, min_rows=ONEDNN_POST_OPS_MIN_ROWS),
            f"{what}: weight {K}x{N} >= {ONEDNN_POST_OPS_MIN_WEIGHT} elements; rows {rows} "
            f"dynamic: below {ONEDNN_POST_OPS_MIN_ROWS} rows addmm + ATen's {new_ops[0].op} "
            "at run time")


def _static(size) -> bool:
    return isinstance(size, int) or bool(getattr(size, "is_Integer", False))


def _post_op_form(mm, bias, new_ops, getters, graph: TileGraph) -> OneDnnLinear | None:
    """:func:`onednn_post_op`'s form of the tile regardless of sizes, or None."""
    op = new_ops[0]
    a, b = (graph.specs[x] for x in mm.args)
    out = mm.out
    if out.dtype not in (torch.float32, torch.bfloat16) or len(out.shape) != 2 \
            or a.dtype != out.dtype or b.dtype != out.dtype or op.out.dtype != out.dtype:
        return None
    T = tuple(op.out.shape)  # the product's shape, or a view of it with the same rows
    if tuple(a.stride) != tuple(_contiguous(a.shape)) or not _same(b.stride[0], 1) \
            or not _same(b.stride[1], b.shape[0]) or not _same(_numel(T), out.numel) \
            or not _same(T[-1], out.shape[-1]):
        return None  # oneDNN's linear takes x row-major and the weight as w.t()
    if bias is not None:
        bs = graph.specs[bias]
        if len(bs.shape) != 1 or not _same(bs.stride[0], 1):
            return None
    if [g[0] for g in getters] != ["epi"]:
        return None  # the bare product is an output too
    if op.op == "gelu" and op.args == (MM,) and op.attrs.get("approximate", "none") in (
            "none", "tanh"):
        return OneDnnLinear("gelu", op.attrs.get("approximate", "none"))
    if op.op in _UNARY_POST_OPS and op.args == (MM,) and not op.attrs:
        attr, algorithm = _UNARY_POST_OPS[op.op]
        return OneDnnLinear(attr, algorithm)
    if op.op == "add" and not op.attrs and len(op.args) == 2 and MM in op.args:
        other = op.args[1] if op.args[0] == MM else op.args[0]
        if isinstance(other, str) and other != MM and other in graph.specs:
            os_ = graph.specs[other]
            if os_.dtype == out.dtype and _same_shape(os_.shape, T) \
                    and tuple(os_.stride) == tuple(_contiguous(T)):
                return OneDnnLinear("add", other=other)
    return None


def plan(tile: FusionTile, graph: TileGraph):
    """The tile's matmul, its bias input or None, the epilogue FusionTile (None if there is
    none) and its graph, the epilogue's input sources and the output getters; raises
    NotNative. The epilogue's kernel is built apart (so a graph's epilogues compile with
    its other tiles) and passed to :func:`assemble`."""
    mms = [op for op in tile.ops if op.kind is OpKind.MATMUL]
    if len(mms) != 1 or mms[0].op != "matmul":
        raise NotNative("a matmul tile needs exactly one matmul")
    mm = mms[0]
    bias_add = gemm_bias_add(tile.ops, graph.specs, tile.outputs)  # torch.addmm adds it
    # the epilogue: every other op, including those before the matmul in the tile's
    # order (a sibling branch such as silu(gate) that meets the matmul result later)
    epi = [op for op in tile.ops if op is not mm and op is not bias_add]
    if not all(isinstance(a, str) and a in tile.inputs for a in mm.args) or len(mm.args) != 2:
        raise NotNative("a matmul operand is computed inside the tile")
    if mm.attrs:
        raise NotNative(f"matmul attributes {sorted(mm.attrs)} are not native")
    # (column sums and their casts have a row of the domain's size, not the domain's)
    compute = [op for op in epi if op.op != "view" and _same(op.out.numel, mm.out.numel)]
    T = tuple(compute[-1].out.shape) if compute else tuple(mm.out.shape)
    if not _same(_numel(T), mm.out.numel):
        raise NotNative("the epilogue does not have the matmul's size")
    specs = dict(graph.specs)
    specs[MM] = TensorSpec(T, _contiguous(T), mm.out.dtype)
    sources: dict[str, tuple] = {MM: (PRODUCT, T)}  # epilogue input -> (source, shape)
    env: dict[str, str] = {mm.name: MM}  # tile value -> epilogue value (in domain T)
    bias = None
    if bias_add is not None:
        bias = next(a for a in bias_add.args if a != mm.name)
        env[bias_add.name] = MM
    new_ops = []

    def full_input(a):
        name = f"{a}@full"
        if name not in sources:
            sources[name] = (a, T)
            specs[name] = TensorSpec(T, _contiguous(T), graph.specs[a].dtype)
        return name

    sums: set[str] = set()  # epilogue column sums (and their casts): [C] values
    for op in epi:
        S = tuple(op.out.shape)
        if op.op == "view" and env.get(op.args[0]) in sums:  # a view of a column sum
            env[op.name] = env[op.args[0]]
            continue
        if op.kind is OpKind.REDUCTION or (op.op == "cast" and env.get(op.args[0]) in sums):
            new_ops += _column_sum(op, graph, T, env, sums, specs, full_input)
            continue
        if op.op == "view":
            src = op.args[0]
            if not _same(op.out.numel, mm.out.numel):
                raise NotNative("a reshape in the epilogue changes its size")
            env[op.name] = env[src] if src in env else full_input(src)
            continue
        if op.kind not in (OpKind.ELEMENTWISE, OpKind.BROADCAST, OpKind.CAST):
            raise NotNative(f"epilogue op {op.op} ({op.kind.value}) is not elementwise")
        if not _same(op.out.numel, mm.out.numel):
            raise NotNative("an epilogue op does not have the matmul's size")
        same = _same_shape(S, T)
        k = 0  # trailing dims S shares with T
        while k < min(len(S), len(T)) and _same(S[len(S) - 1 - k], T[len(T) - 1 - k]):
            k += 1
        if op.op == "copy_" and not (same and op.args[0] not in env):
            # the kernel writes dst itself; a reshaped feed of it may be a copy
            raise NotNative("an in-place write in the epilogue is not in the matmul's shape")
        args = []
        for a in op.args:
            if not isinstance(a, str):
                args.append(a)
            elif a in env:
                args.append(env[a])
            elif same:
                args.append(a)
            else:
                P = tuple(graph.specs[a].shape)
                if len(P) > len(S):
                    raise NotNative(f"input {a} has more dims than its use")
                Pa = (1,) * (len(S) - len(P)) + P
                if _same_shape(Pa, S):
                    args.append(full_input(a))
                    continue
                lead = Pa[:len(S) - k]
                if not all(_same(x, 1) for x in lead):
                    raise NotNative(f"input {a} broadcasts across a reshape of the epilogue")
                trail = Pa[len(S) - k:]
                name = f"{a}@{len(trail)}"
                if name not in sources:
                    sources[name] = (a, trail)
                    specs[name] = TensorSpec(trail, _contiguous(trail), graph.specs[a].dtype)
                args.append(name)
        out = op.out if same else TensorSpec(T, _contiguous(T), op.out.dtype)
        new_ops.append(dataclasses.replace(op, args=tuple(args), out=out))
        specs[op.name] = out
        env[op.name] = op.name
    produced = {op.name for op in new_ops}
    outputs, getters = [], []
    for o in tile.outputs:
        if o == mm.name:
            getters.append(("mm", None, None))
            continue
        v = env.get(o)
        if v == MM:
            getters.append(("mm", None, tuple(graph.specs[o].shape)))
        elif v in produced:
            if v not in outputs:
                outputs.append(v)
            getters.append(("epi", outputs.index(v), tuple(graph.specs[o].shape)))
        else:
            raise NotNative(f"tile output {o} is not computed by the epilogue")
    if not new_ops:
        return mm, bias, None, None, [], getters, None
    linear, note = onednn_post_op(mm, bias, new_ops, getters, graph)
    if linear is not None:  # one oneDNN call: no epilogue kernel
        return mm, bias, None, None, linear, getters, note
    used = []
    for op in new_ops:
        for a in op.args:
            if isinstance(a, str) and a not in produced and a not in used:
                used.append(a)
    for a in used:
        sources.setdefault(a, (a, None))
    sub = FusionTile(f"{tile.name}_epilogue", new_ops, used, outputs, tile.dtype,
                     tile.tile_shape, tile.footprint_expr, tile.footprint_bytes,
                     tile.capacity_bytes, OpKind.ELEMENTWISE)
    sub_graph = dataclasses.replace(graph, specs=specs)
    return mm, bias, sub, sub_graph, [(a, sources[a]) for a in used], getters, note


def _column_sum(op, graph: TileGraph, T: tuple, env: dict, sums: set, specs: dict,
                full_input) -> list:
    """A column sum over the epilogue's rows (fusion.capacity.row_column_sums: a bias
    gradient after GELU's backward), or a cast of one: the ops to add to the epilogue.
    The sum reads its value, computed in the epilogue (domain T) or a tile input, through a
    view to the shape it sums over, so the epilogue kernel adds the columns over its rows
    (capacity.rows_of_sums) as the column-sum kernel would."""
    if op.op == "cast":  # the same sums, rounded by their store
        new = dataclasses.replace(op, args=(env[op.args[0]],))
        env[op.name] = op.name
        sums.add(op.name)
        specs[op.name] = op.out
        return [new]
    if not column_sum(op, graph):
        raise NotNative(f"epilogue op {op.op} ({op.kind.value}) is not elementwise")
    src = op.args[0]
    S = tuple(graph.specs[src].shape)
    value = env[src] if src in env else full_input(src)
    ops = []
    if not _same_shape(S, T):
        name = f"{op.name}@rows"
        specs[name] = TensorSpec(S, _contiguous(S), specs[value].dtype)
        ops.append(TileOp(name, "view", OpKind.LAYOUT, (value,), specs[name], {"shape": S}))
        value = name
    ops.append(dataclasses.replace(op, args=(value,)))
    env[op.name] = op.name
    sums.add(op.name)
    specs[op.name] = op.out
    return ops


def assemble(tile: FusionTile, graph: TileGraph, planned, epi: Kernel | None) -> Kernel:
    """The tile's kernel from :func:`plan`'s result and the epilogue's native kernel."""
    mm, bias, sub, sub_graph, srcs, getters, note = planned
    symbols = graph.symbols
    slot = {name: i for i, name in enumerate(tile.inputs)}
    ia, ib = slot[mm.args[0]], slot[mm.args[1]]
    if isinstance(srcs, OneDnnLinear):
        return dataclasses.replace(onednn_kernel(tile, graph, mm, bias, srcs, getters),
                                   reason=note)
    if bias is None:
        # two 2-D operands: torch.mm itself (what matmul calls: one dispatch fewer, and
        # the product is known fresh and contiguous, GemmCall.fresh)
        mm_fn = torch.mm if MM_2D and all(
            len(graph.specs[a].shape) == 2 for a in mm.args[:2]) else torch.matmul

        def product(inputs):
            return mm_fn(inputs[ia], inputs[ib])
        product_call = (mm_fn, (("in", ia), ("in", ib)))
    else:  # the GEMM adds the bias (beta = 1)
        gemm, ic = (torch.addmm if len(mm.out.shape) == 2 else torch.baddbmm), slot[bias]

        def product(inputs):
            return gemm(inputs[ic], inputs[ia], inputs[ib])
        product_call = (gemm, (("in", ic), ("in", ia), ("in", ib)))
    T = tuple(sub_graph.specs[MM].shape) if sub_graph is not None else None
    shape_fns = {}

    def shape_fn(shape):
        key = tuple(map(str, shape))
        if key not in shape_fns:
            shape_fns[key] = size_function(tuple(shape), symbols)
        return shape_fns[key]

    outs_spec = [(kind, idx, None if shape is None else shape_fn(shape))
                 for kind, idx, shape in getters]
    if sub is None:
        def kernel(inputs: list, syms: tuple) -> list:
            r = product(inputs)
            return [r if f is None else r.reshape(f(syms)) for _, _, f in outs_spec]

        operands = ((("in", ia), ("in", ib)) if bias is None
                    else (("in", slot[bias]), ("in", ia), ("in", ib)))
        fn = mm_fn if bias is None else gemm
        same = [(kind, idx, None if shape is None or _same_shape(shape, mm.out.shape)
                 else shape) for kind, idx, shape in getters]  # no reshape to its own shape
        return Kernel(kernel, native=True, launch=_gemm_call(fn, operands, same))
    feeds = []  # (slot or -1 for the matmul result, reshape fn or None)
    for _, (src, shape) in srcs:
        feeds.append((-1 if src == PRODUCT else slot[src],
                      None if shape is None else shape_fn(shape)))

    # the epilogue's outputs are allocated in the tile's shapes (the first getter's), so the
    # runtime gets the buffers themselves, not views of them, and can pool them
    final: dict[int, object] = {}
    if not (epi.program is not None and epi.program.writes):
        # an in-place output (copy_ into an input) may take no buffer, so the allocation
        # order is not the output order: those tiles keep the epilogue's own shapes
        for kind, idx, f in outs_spec:
            if kind != "mm":
                final.setdefault(idx, f)

    epilogue = epi.fn

    def kernel(inputs: list, syms: tuple, empty=alloc.empty) -> list:
        r = product(inputs)
        vals = []
        for i, f in feeds:
            t = r if i < 0 else inputs[i]
            vals.append(t if f is None else t.reshape(f(syms)))
        buffers = []

        def allocate(shape, dtype):
            f = final.get(len(buffers))
            buffers.append(empty(shape if f is None else f(syms), dtype))
            return buffers[-1] if f is None else buffers[-1].view(shape)

        res = epilogue(vals, syms, allocate)
        out = []
        for kind, idx, f in outs_spec:
            if kind != "mm" and idx in final and f is final[idx]:
                out.append(buffers[idx])
            else:
                t = r if kind == "mm" else res[idx]
                out.append(t if f is None else t.reshape(f(syms)))
        return out

    # takes the runtime's allocator for the epilogue's outputs
    return Kernel(kernel, native=True, reason=note, takes_allocator=True, program=epi.program,
                  launch=_epilogue_call(product_call, tuple(mm.out.shape), srcs, getters, T,
                                         epi, slot))


def onednn_kernel(tile, graph, mm, bias, linear: OneDnnLinear, getters) -> Kernel:
    """The kernel of a Linear whose epilogue is a oneDNN post-op (:func:`onednn_post_op`)."""
    slot = {name: i for i, name in enumerate(tile.inputs)}
    ix, iw = slot[mm.args[0]], slot[mm.args[1]]
    ib = slot[bias] if bias is not None else None
    shape = getters[0][2]
    reshape = None if shape is None or _same_shape(shape, mm.out.shape) \
        else size_function(tuple(shape), graph.symbols)
    lp = torch.ops.mkldnn._linear_pointwise
    small = few_rows_form(linear)
    if linear.other is None:
        attr, algorithm = linear.attr, linear.algorithm
        fn = lp
    else:
        fn, io = lp.binary, slot[linear.other]
        rows = size_function(tuple(mm.out.shape), graph.symbols)
    if small is not None:  # dynamic rows: oneDNN from min_rows on
        fn = _by_rows(fn, small, linear.min_rows)
    if linear.other is None:
        def product(inputs, syms):
            return fn(inputs[ix], inputs[iw].t(), None if ib is None else inputs[ib],
                      attr, [], algorithm)
    else:
        def product(inputs, syms):  # the residual (row-major) seen as the product's rows
            return fn(inputs[ix], inputs[io].view(rows(syms)), inputs[iw].t(),
                      None if ib is None else inputs[ib], "add")

    if reshape is None:
        def kernel(inputs: list, syms: tuple) -> list:
            return [product(inputs, syms)]
    else:
        def kernel(inputs: list, syms: tuple) -> list:
            return [product(inputs, syms).reshape(reshape(syms))]

    b = ("const", None) if ib is None else ("in", ib)
    few = None if small is None else (mm.out.shape[0], linear.min_rows, small)
    if linear.other is None:
        call = _gemm_call(lp, (("in", ix), ("t", iw), b, ("const", linear.attr), ("const", []),
                               ("const", linear.algorithm)), [(None, None, reshape and shape)],
                          few)
    else:
        call = _gemm_call(lp.binary, (("in", ix), ("view", io, tuple(mm.out.shape)),
                                      ("t", iw), b, ("const", "add")),
                          [(None, None, reshape and shape)], few)
    return Kernel(kernel, native=True, launch=call)


# ATen's form of each post-op (what eager runs after its addmm) for a few rows
_ATEN_POST_OPS = {"gelu": lambda r, alg: torch.nn.functional.gelu(r, approximate=alg),
                  "swish": lambda r, alg: torch.nn.functional.silu(r),
                  "sigmoid": lambda r, alg: torch.sigmoid(r),
                  "tanh": lambda r, alg: torch.tanh(r)}


def few_rows_form(linear: OneDnnLinear):
    """For dynamic rows (``linear.min_rows``): a function taking the oneDNN call's
    arguments that computes the same as addmm (mm) + ATen's op, or None."""
    if not linear.min_rows:
        return None
    if linear.other is not None:
        def few_rows_add(x, other, w, bias, _attr):
            r = torch.mm(x, w.t()) if bias is None else torch.addmm(bias, x, w.t())
            return r.add_(other)
        return few_rows_add
    act = _ATEN_POST_OPS[linear.attr]

    def few_rows(x, w, bias, _attr, _scalars, algorithm):
        return act(torch.mm(x, w.t()) if bias is None else torch.addmm(bias, x, w.t()),
                   algorithm)
    return few_rows


def _by_rows(onednn, few, min_rows: int):
    def call(x, *args):
        return (onednn if x.shape[0] >= min_rows else few)(x, *args)
    return call


def _epilogue_call(product_call, P, srcs, getters, T, epi: Kernel, slot) -> EpilogueCall | None:
    """The inline form of a GEMM + native epilogue tile, where the epilogue's kernel has
    one (launcher.Launch: the extension, no in-place writes, no index checks)."""
    native = getattr(epi, "launch", None)
    if not (INLINE_GEMMS and INLINE_EPILOGUES) or native is None or T is None \
            or native.index_error is not None or native.writes:
        return None
    feeds = tuple((-1, None if _same_shape(shape, P) else shape) if src == PRODUCT
                  else (slot[src], shape) for _, (src, shape) in srcs)
    return EpilogueCall(product_call[0], product_call[1], feeds, tuple(getters), T, native)


def _gemm_call(fn, operands, getters, few=None) -> GemmCall | None:
    if not INLINE_GEMMS:
        return None
    return GemmCall(fn, operands, tuple(shape for _, _, shape in getters), few)


@dataclasses.dataclass(frozen=True)
class GemmCall:
    """A GEMM tile (addmm, matmul, oneDNN linear) as the graph's generated code calls it
    (codegen/graph): the torch call itself written out, its outputs (the product, reshaped
    where the tile's outputs have other shapes) assigned directly: no wrapper frame, no
    input or result list. The wrapper's own ``kernel`` stays for everything else."""

    fn: object  # the torch function
    # per argument: ("in", input index), ("t", input index): its transpose,
    # ("view", input index, shape): a view of it, ("const", value)
    operands: tuple
    shapes: tuple  # per tile output: its shape (sizes, sympy where symbolic) or None: as is
    # (rows, min_rows, fn): below min_rows rows (a size expression) call fn instead of
    # ``fn`` with the same arguments (OneDnnLinear.min_rows); None: always ``fn``
    few: tuple | None = None
    gemm = True  # tells codegen/graph this is not a native kernel's Launch

    def fresh(self, linear: bool) -> bool:
        """Whether the product is a fresh contiguous 2-D tensor (mm, addmm and 2-D linear
        allocate their result contiguous): its reshapes are known layouts."""
        return linear or self.fn in (torch.mm, torch.addmm)

    def source(self, k: str, ins: list[str], outs: list[str], size, linear: bool = False,
               fresh: tuple = ()) -> list[str]:
        """Lines computing the outputs ``outs`` (``_``: unused) from the inputs ``ins``;
        ``size(expr)`` prints a size expression. ``linear``: the right operand is the transpose
        of a weight (graph.views.linear_weights): ``linear(x, w[, bias])`` on the weight;
        ``fresh``: outputs that may be written as ``reinterpret`` (bound by the caller) of
        the product where :meth:`fresh` and their shape is static."""
        if linear:  # matmul(x, wT) -> linear(x, w); addmm(b, x, wT) -> linear(x, w, b)
            x, w, *bias = ([ins[op[1]] for op in self.operands[1:]]
                           + [ins[self.operands[0][1]]]) if len(self.operands) == 3 \
                else [ins[op[1]] for op in self.operands]
            call = f"linear({', '.join([x, w, *bias])})"
        else:
            call = None
        args = []
        for j, op in enumerate(self.operands):
            if op[0] == "in":
                args.append(ins[op[1]])
            elif op[0] == "t":
                args.append(f"{ins[op[1]]}.t()")
            elif op[0] == "view":
                args.append(f"{ins[op[1]]}.view(({''.join(size(d) + ', ' for d in op[2])}))")
            else:
                v = op[1]
                args.append(repr(v) if v is None or type(v) in (str, int, bool) else f"{k}_c{j}")
        call = call or f"{k}_fn({', '.join(args)})"
        if self.few is not None:  # one integer compare on the size symbol
            rows, min_rows, _ = self.few
            call = f"{call} if {size(rows)} >= {min_rows} else {k}_few({', '.join(args)})"
        lines = [f"    {k}_r = {call}"]
        for o, shape in zip(outs, self.shapes):
            if o == "_":
                continue
            lines.append(f"    {o} = {k}_r" if shape is None else
                         f"    {o} = {_reshape(f'{k}_r', shape, size, o in fresh)}")
        return lines + [f"    del {k}_r"]

    def bindings(self, k: str) -> dict:
        return {f"{k}_fn": self.fn, **({f"{k}_few": self.few[2]} if self.few else {}),
                **{f"{k}_c{j}": op[1] for j, op in enumerate(self.operands)
                   if op[0] == "const" and not (op[1] is None or type(op[1]) in (str, int, bool))}}


@dataclasses.dataclass(frozen=True)
class EpilogueCall:
    """A GEMM tile with a native epilogue pass as the graph's generated code writes it
    (codegen/graph): the torch GEMM call, the epilogue's inputs reshaped onto its domain
    ``T``, the epilogue kernel's inline launch (launcher.Launch) and the tile's outputs
    (reshaped where their shapes differ), instead of a call of :func:`assemble`'s Python
    wrapper (its frame, input list, feed loop, allocator closure and result list cost
    more than a classifier head's GEMM and epilogue on 4 rows)."""

    fn: object  # the GEMM's torch function (matmul, addmm, baddbmm)
    operands: tuple  # its arguments, as GemmCall.operands
    feeds: tuple  # per epilogue input: (tile input index or -1: the product, shape or None)
    getters: tuple  # per tile output: ("mm" or "epi", epilogue output index, shape or None)
    T: tuple  # the epilogue's domain (the product is reshaped onto it)
    native: object  # the epilogue kernel's launcher.Launch
    gemm = True  # codegen/graph: a torch call (its buffers take the runtime's refcount check)

    def fresh(self, linear: bool) -> bool:
        return GemmCall.fresh(self, linear)

    def source(self, k: str, ins: list[str], outs: list[str], size, empty: str,
               linear: bool = False, reuse: dict[int, str] | None = None,
               fresh: bool = False, direct: dict[int, tuple] | None = None,
               key: str | None = None) -> list[str]:
        """Lines computing the outputs ``outs`` (``_``: unused); ``empty`` names the
        allocator of the epilogue's outputs, ``size(expr)`` prints a size expression,
        ``linear`` as in :meth:`GemmCall.source`; ``reuse``: epilogue output index -> a
        dead buffer to write it into (graph.buffers.static_reuse); ``direct``: epilogue output
        index -> (sizes, strides) of a small static output, ``key`` the epilogue's layout
        key (launcher.Launch.source)."""
        def shape(dims):
            return f"({''.join(size(d) + ', ' for d in dims)})"

        lines = GemmCall(self.fn, self.operands, ()).source(k, ins, [], size, linear)[:1]
        temps = [f"{k}_r"]
        feeds = []
        for j, (i, dims) in enumerate(self.feeds):
            src = f"{k}_r" if i < 0 else ins[i]
            if dims is None:
                feeds.append(src)
                continue
            lines.append(f"    {k}_f{j} = {_reshape(src, dims, size, fresh and i < 0)}")
            feeds.append(f"{k}_f{j}")
            temps.append(f"{k}_f{j}")
        results = [f"{k}_e{j}" for j in range(len(self.native.dtypes))]
        lines += self.native.source(f"{k}e", feeds, results, empty, reuse, direct=direct,
                                    key=key)
        temps += results
        for o, (kind, idx, dims) in zip(outs, self.getters):
            if o == "_":
                continue
            t = f"{k}_r" if kind == "mm" else results[idx]
            same = dims is None or (kind == "epi" and _same_shape(dims, self.T))
            lines.append(f"    {o} = {t}" if same else f"    {o} = {t}.reshape({shape(dims)})")
        return lines + [f"    del {', '.join(temps)}"]

    def bindings(self, k: str) -> dict:
        return {**GemmCall(self.fn, self.operands, ()).bindings(k),
                **self.native.bindings(f"{k}e")}


def _reshape(t: str, dims, size, fresh: bool) -> str:
    """``t.reshape(dims)``, or where ``t`` is a fresh contiguous product (GemmCall.fresh)
    and ``dims`` static, Inductor's ``reinterpret_tensor`` with contiguous strides (no
    dispatcher, no autograd view: about 1 us less)."""
    shape = f"({''.join(size(d) + ', ' for d in dims)})"
    if not fresh or any(not isinstance(d, int) and not getattr(d, "is_Integer", False)
                        for d in dims):
        return f"{t}.reshape({shape})"
    sizes = tuple(int(d) for d in dims)
    return f"reinterpret({t}, {sizes}, {tuple(int(x) for x in _contiguous(sizes))}, 0)"
