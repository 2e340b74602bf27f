"""Attention as one step: matmul -> scale -> mask -> softmax -> matmul, written out op by
op (transformers' eager attention, hand-written attention), becomes one
``scaled_dot_product_attention`` call: ATen's flash kernel for CPU, which the cpu target runs
with its native kernels where they qualify (codegen/cpp/attention.py, attention_backward.py).

The pass runs on the torch-level FX graph Dynamo hands the backend, before
AOTAutograd: there the pattern is a handful of calls (``torch.matmul``, ``*``,
``+``, ``softmax``, ``dropout``) and, rewritten there, autograd differentiates
the SDPA call itself, so a training graph saves what SDPA's backward needs (the
logsumexp) instead of the probabilities, and forward and backward stay
consistent by construction. After AOTAutograd the probabilities are already
saved for the backward graph and the pattern could no longer be replaced.

A chain is rewritten only when the result is the same computation:
- ``scores = q @ k^T`` on 4-d (batch, heads, queries, head dim) operands of equal batch
  and head counts (GQA's repeated keys and values already are: ``repeat_kv``'s expand
  and reshape stay as they are and feed the call);
- then multiplications or divisions by Python numbers only (the scale; none is scale 1:
  T5), then additive float masks or biases (added in order, as one mask) and
  ``masked_fill(m, -inf)`` / ``where(m, scores, -inf)`` boolean masks (causal, padding,
  sliding window: any mask is just a mask), in this order (a scale after a mask is not
  SDPA's form); a scale may be a 0-d tensor the graph computes from no input (GPT-2);
- ``softmax`` over the last dim (optionally computed in float32 and cast back), dropout
  that does nothing (p == 0 or not training), then ``probs @ v``;
- every intermediate (scores, probabilities, ...) read by the next op only: where the
  probabilities are returned (``output_attentions``) or used elsewhere, the chain stays.
Causal masks: ``ones(n, n, dtype=bool).tril()`` built in the graph, or any mask the
graph computes from no input at all (transformers' masking utils build theirs from
``arange``s of static sizes when there is no padding mask) whose value, evaluated once at
compile time, is the causal mask (bool, or float with 0 and the dtype's minimum or -inf)
becomes SDPA's ``is_causal`` with no mask read; this holds for masks given to SDPA calls
already in the graph too, and a constant mask that masks nothing is dropped. A mask that
reads an input (a padding mask), is written in place, draws random numbers or has
symbolic sizes is never evaluated and stays a mask.
The one known difference: a query row whose every key is masked with -inf is 0 in
SDPA and NaN in eager (with transformers' masks, which use the dtype's minimum, there
is no such row).

Each candidate gets a decision, with its reason and the two predicted times, that the
backend puts into the fusion report.
"""
from __future__ import annotations

import dataclasses
import math
import operator

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import optimization_hint, statically_known_true

_MATMUL = {torch.matmul, operator.matmul}
_MUL = {operator.mul, operator.imul, torch.mul}
_DIV = {operator.truediv, operator.itruediv, torch.div, torch.true_divide}
_ADD = {operator.add, operator.iadd, torch.add}
_SOFTMAX = {F.softmax, torch.softmax, torch.nn.functional.softmax}
_DROPOUT = {F.dropout, torch.dropout}
_FLOAT_CASTS = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16}
_NEG_INF = float("-inf")
_MAX_CHAIN = 32  # ops searched either side of a softmax


@dataclasses.dataclass
class AttentionDecision:
    """One attention chain: rewritten into an SDPA call (``fused``) or not, and why, with
    the roofline estimate of both forms (the ROI model's terms: the backend reports it as
    a fusion decision)."""
    first: str  # the q @ k^T node
    last: str  # the probs @ v node (or where the match stopped)
    fused: bool
    reason: str
    flash_us: float | None = None
    unfused_us: float | None = None
    common_us: float = 0.0  # the two GEMMs' compute, the same in both forms
    bandwidth_saving_pct: float = 0.0
    launch_overhead_reduction_pct: float = 0.0

    @property
    def roi_score(self) -> float:
        fused = self.flash_us - self.common_us
        return (self.unfused_us - self.common_us) / fused if fused > 0 else 1.0


class _NoMatch(Exception):
    pass


def _val(node):
    return node.meta.get("example_value") if isinstance(node, fx.Node) else None


def _is(node, fns=(), methods=()) -> bool:
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_function":
        return node.target in fns
    return node.op == "call_method" and node.target in methods


def _only_user(node: fx.Node) -> fx.Node | None:
    # x.type_as(node) reads only node's dtype (T5 casts the probabilities back that way)
    users = [u for u in node.users if not (u.op == "call_method" and u.target == "type_as"
                                             and u.args[0] is not node)]
    return users[0] if len(users) == 1 else None


def _same(a, b) -> bool:
    """Sizes known equal without adding a guard (sizes may be symbolic under dynamic=True)."""
    return statically_known_true(a == b)


def _broadcasts(shape, to) -> bool:
    if len(shape) > len(to):
        return False
    return all(_same(m, 1) or _same(m, t) for m, t in zip(shape[::-1], to[::-1]))


def _hint(n) -> int:
    return int(optimization_hint(n))


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _softmax_args(node: fx.Node):
    """(input, dim, dtype) of a softmax call."""
    args, kw = list(node.args), dict(node.kwargs)
    x = args[0]
    dim = args[1] if len(args) > 1 else kw.get("dim")
    dtype = kw.get("dtype")
    if node.op == "call_function" and node.target in (F.softmax, torch.nn.functional.softmax):
        if len(args) > 3:
            dtype = args[3]
    elif len(args) > 2:
        dtype = args[2]
    return x, dim, dtype


def _cast_dtype(node: fx.Node):
    """The float dtype a pure cast node casts to, or None if ``node`` is not one."""
    if node.op != "call_method":
        return None
    if node.target in _FLOAT_CASTS and len(node.args) == 1 and not node.kwargs:
        return _FLOAT_CASTS[node.target]
    if node.target == "to":
        rest = list(node.args[1:]) + [v for k, v in node.kwargs.items() if k == "dtype"]
        if len(rest) == 1 and isinstance(rest[0], torch.dtype) and rest[0].is_floating_point \
                and set(node.kwargs) <= {"dtype"}:
            return rest[0]
    if node.target == "type" and len(node.args) == 2 and not node.kwargs \
            and isinstance(node.args[1], torch.dtype) and node.args[1].is_floating_point:
        return node.args[1]  # GPT-2: attn_weights.type(value.dtype)
    if node.target == "type_as" and len(node.args) == 2:
        v = _val(node.args[1])
        if isinstance(v, torch.Tensor) and v.dtype.is_floating_point:
            return v.dtype
    return None


def _dropout_noop(node: fx.Node) -> bool:
    args, kw = list(node.args), dict(node.kwargs)
    p = args[1] if len(args) > 1 else kw.get("p", 0.5)
    training = args[2] if len(args) > 2 else kw.get("training", kw.get("train", True))
    if not (_number(p) and isinstance(training, bool)):
        raise _NoMatch("dropout with a computed p or training flag")
    if p != 0 and training:
        raise _NoMatch(f"dropout p={p} in training (SDPA's dropout draws other numbers)")
    return True


@dataclasses.dataclass
class _Chain:
    mm1: fx.Node
    mm2: fx.Node
    q: fx.Node
    kt: fx.Node
    v: fx.Node
    scale: float
    masks: list  # ("add", tensor node) or ("keep", bool node: True = attend)
    nodes: list  # the chain's nodes, mm1 ... mm2


def _match(softmax: fx.Node) -> _Chain:
    """The attention chain through ``softmax``; raises _NoMatch with the reason."""
    x, dim, sm_dtype = _softmax_args(softmax)
    sv = _val(softmax)
    if not isinstance(sv, torch.Tensor) or sv.dim() != 4:
        raise _NoMatch("softmax input is not 4-d (batch, heads, queries, keys)")
    if dim not in (-1, 3):
        raise _NoMatch(f"softmax over dim {dim}, not the keys")
    if sm_dtype is not None and sm_dtype != torch.float32 and sm_dtype != sv.dtype:
        raise _NoMatch(f"softmax in {sm_dtype}")
    # forward from the softmax: casts, no-op dropouts, then probs @ v
    nodes_after, node = [], softmax
    for _ in range(_MAX_CHAIN):
        user = _only_user(node)
        if user is None:
            raise _NoMatch(f"the probabilities ({node.name}) are also used elsewhere")
        if (_cast_dtype(user) is not None or _is(user, _DROPOUT) and _dropout_noop(user)) \
                and user.args[0] is node:
            nodes_after.append(user)
            node = user
        elif _is(user, _MATMUL, ("matmul",)) and user.args[0] is node and len(user.args) == 2:
            mm2 = user
            break
        else:
            raise _NoMatch(f"the probabilities go to {user.name}, not a matmul with values")
    else:
        raise _NoMatch("no matmul with values after the softmax")
    # backward from the softmax: masks (and casts), then scales (and casts), then q @ k^T
    masks, nodes_before, scale, node = [], [], 1.0, x
    stage = "mask"
    for _ in range(_MAX_CHAIN):
        if not isinstance(node, fx.Node):
            raise _NoMatch("softmax of a constant")
        if _only_user(node) is None:
            raise _NoMatch(f"the scores ({node.name}) are also used elsewhere")
        nodes_before.append(node)
        if _cast_dtype(node) is not None:
            node = node.args[0]
            continue
        if stage == "mask" and _is(node, _ADD, ("add", "add_", "__add__", "__iadd__")) \
                and len(node.args) == 2 and not node.kwargs:
            a, b = node.args
            chain, mask = (a, b) if isinstance(a, fx.Node) and _is_scores_side(a) else (b, a)
            mv = _val(mask)
            if not isinstance(mv, torch.Tensor) or not mv.dtype.is_floating_point \
                    or not isinstance(chain, fx.Node):
                raise _NoMatch(f"{node.name} adds a non-float-tensor value to the scores")
            masks.append(("add", mask))
            node = chain
            continue
        if stage == "mask" and _is(node, {torch.masked_fill}, ("masked_fill", "masked_fill_")) \
                and len(node.args) == 3 and not node.kwargs:
            chain, m, value = node.args
            if value != _NEG_INF or not isinstance(_val(m), torch.Tensor) \
                    or _val(m).dtype != torch.bool:
                raise _NoMatch(f"{node.name} fills with {value!r}, not -inf")
            masks.append(("drop", m))
            node = chain
            continue
        if stage == "mask" and _is(node, {torch.where}) and len(node.args) == 3 \
                and not node.kwargs:
            m, chain, value = node.args
            if value != _NEG_INF or not isinstance(_val(m), torch.Tensor) \
                    or _val(m).dtype != torch.bool or not isinstance(chain, fx.Node):
                raise _NoMatch(f"{node.name} is a where that is not a -inf mask")
            masks.append(("keep", m))
            node = chain
            continue
        if _is(node, _MUL, ("mul", "mul_", "__mul__")) and len(node.args) == 2 \
                and not node.kwargs:
            a, b = node.args
            chain, c = (a, b) if _is_scores_side(a) else (b, a)
            c = _scalar(c)
            if not (_number(c) and isinstance(chain, fx.Node)):
                raise _NoMatch(f"{node.name} scales the scores by a tensor")
            scale *= c
            node, stage = chain, "scale"
            continue
        if _is(node, _DIV, ("div", "div_", "__truediv__")) and len(node.args) == 2 \
                and not node.kwargs:
            chain, c = node.args
            c = _scalar(c)
            if not (isinstance(chain, fx.Node) and _number(c)) or c == 0:
                raise _NoMatch(f"{node.name} divides the scores by a tensor")
            scale /= c
            node, stage = chain, "scale"
            continue
        if _is(node, _MATMUL, ("matmul",)) and len(node.args) == 2:
            nodes_before.pop()  # the matmul itself is mm1
            mm1 = node
            break
        raise _NoMatch(f"{node.name} ({node.target}) between q @ k^T and the softmax")
    else:
        raise _NoMatch("no q @ k^T before the softmax")
    q, kt = mm1.args
    v = mm2.args[1]
    vals = [_val(n) for n in (q, kt, v, mm1, mm2)]
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in vals):
        raise _NoMatch("q, k^T or v is not 4-d")
    qv, ktv, vv, s, o = vals
    if not all(_same(x, y) for x, y in zip(qv.shape[:2] + vv.shape[:2],
                                           ktv.shape[:2] + ktv.shape[:2])):
        raise _NoMatch("q, k and v differ in batch or head counts (a broadcast matmul)")
    dtype = s.dtype
    if not dtype.is_floating_point or o.dtype != dtype:
        raise _NoMatch(f"scores in {s.dtype}, output in {o.dtype}")
    for n in nodes_before + [softmax] + nodes_after:
        t = _val(n)
        if not isinstance(t, torch.Tensor) or t.dtype not in (dtype, torch.float32):
            raise _NoMatch(f"{n.name} computes in {getattr(t, 'dtype', None)}")
    for kind, m in masks:
        mv = _val(m)
        if kind == "add" and mv.dtype not in (dtype, torch.float32):
            raise _NoMatch(f"mask {m.name} is {mv.dtype}")
        if not _broadcasts(tuple(mv.shape), tuple(s.shape)):
            raise _NoMatch(f"mask {m.name} of shape {tuple(mv.shape)} does not broadcast to "
                           f"the scores' {tuple(s.shape)}")
    if not (math.isfinite(scale) and scale != 0):
        raise _NoMatch(f"scale {scale}")
    nodes = [mm1] + nodes_before[::-1] + [softmax] + nodes_after + [mm2]
    return _Chain(mm1, mm2, q, kt, v, scale, masks[::-1], nodes)


def _scalar(x):
    """A Python number, or the number a 0-d tensor the graph computes from no input holds
    (GPT-2 divides by ``torch.full([], head_dim ** 0.5)``); anything else as it is."""
    if isinstance(x, fx.Node) and isinstance(_val(x), torch.Tensor) and _val(x).dim() == 0 \
            and _val(x).dtype.is_floating_point:
        v = _constant(x)
        if v is not None:
            return float(v)
    return x


def _is_scores_side(node: fx.Node) -> bool:
    """Whether ``node`` descends from a matmul through the ops a chain may hold (so it
    is the scores, not the mask, of an add)."""
    seen = 0
    while isinstance(node, fx.Node) and seen < 16:
        seen += 1
        if _is(node, _MATMUL, ("matmul",)):
            return True
        if node.op not in ("call_function", "call_method") or not node.args:
            return False
        node = next((a for a in node.args if isinstance(a, fx.Node)
                     and isinstance(_val(a), torch.Tensor)
                     and _val(a).dim() == 4), None)
    return False


def _estimate(chain: _Chain, hw) -> dict:
    """The roofline of both forms over the bytes each moves: the unfused form writes the
    score matrix and reads it back once per op of the chain; the flash kernel keeps it in
    cache blocks and moves q, k, v, the output and the masks once. The flops (the two
    GEMMs) are the same: ``common_us``."""
    s = _val(chain.mm1)
    qv, vv, o = _val(chain.q), _val(chain.v), _val(chain.mm2)
    elem = s.element_size()
    n = _hint(s.numel())
    flops = 2.0 * n * (_hint(qv.shape[-1]) + _hint(vv.shape[-1]))
    io = sum(_hint(t.numel()) * t.element_size() for t in (qv, _val(chain.kt), vv, o))
    mask_bytes = sum(_hint(_val(m).numel()) * _val(m).element_size() for _, m in chain.masks)
    passes = len(chain.nodes) - 2  # pointwise ops between the two GEMMs
    unfused_bytes = io + mask_bytes + n * elem * (2 + 2 * passes)
    flash_bytes = io + mask_bytes
    bw, peak, launch = hw.gm_bandwidth_bytes_per_s, hw.cube_flops_per_s, hw.launch_us
    common = flops / peak * 1e6
    return dict(flash_us=flash_bytes / bw * 1e6 + common + launch,
                unfused_us=unfused_bytes / bw * 1e6 + common + launch * (passes + 2),
                common_us=common,
                bandwidth_saving_pct=100.0 * (1 - flash_bytes / unfused_bytes),
                launch_overhead_reduction_pct=100.0 * (1 - 1 / (passes + 2)))


def _is_causal_tril(node) -> bool:
    """Whether ``node`` is ``ones(n, n, dtype=bool).tril()`` built in the graph: SDPA's
    is_causal mask for n queries and n keys (the flash kernel then skips the blocks above
    the diagonal instead of reading a mask)."""
    if not (_is(node, {torch.tril}, ("tril",)) and len(node.args) == 1 and not node.kwargs):
        return False
    ones = node.args[0]
    if not (_is(ones, {torch.ones}) and set(ones.kwargs) <= {"dtype", "device"}
            and ones.kwargs.get("dtype") is torch.bool):
        return False
    v = _val(node)
    return isinstance(v, torch.Tensor) and v.dim() == 2 and _same(v.shape[0], v.shape[1])


# Names of ops whose result is not a function of their arguments: a mask computed through
# one of them is never evaluated at compile time.
_IMPURE = ("rand", "normal", "bernoulli", "dropout", "uniform", "multinomial", "empty",
           "poisson", "exponential", "geometric", "cauchy", "seed")
_EVAL_LIMIT = 1 << 22  # elements of any value computed while evaluating a mask


def _static_shape(v) -> bool:
    if isinstance(v, torch.Tensor):
        return all(type(d) is int for d in v.shape) and v.numel() <= _EVAL_LIMIT
    if isinstance(v, (tuple, list)):
        return all(_static_shape(x) for x in v)
    return not isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool))


def _constant(node) -> torch.Tensor | None:
    """The value of ``node`` when the graph computes it from no input at all (transformers'
    masking utils build a mask without padding from ``arange``s of the static sizes): the
    node's ancestors run once here, on real tensors. None when any ancestor reads a graph
    input, a parameter or a symbolic size, draws random numbers, writes in place, or when
    evaluating fails: then nothing is assumed about the mask."""
    if not isinstance(node, fx.Node):
        return None
    if "pypto_constant" not in node.meta:  # masks are shared by every layer: evaluate once
        node.meta["pypto_constant"] = _evaluate(node)
    return node.meta["pypto_constant"]


def _mutates(n: fx.Node) -> bool:
    """Whether ``n`` may write into one of its arguments (an in-place op)."""
    name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
    if n.op == "call_function" and getattr(n.target, "__module__", None) in ("_operator",
                                                                           "operator"):
        return n.target in _INPLACE_OPERATORS  # and_, or_: not in place
    return name.endswith("_") and not name.startswith("__") or "setitem" in name \
        or (name.startswith("__i") and name.endswith("__") and name not in ("__invert__",))


_INPLACE_OPERATORS = {getattr(operator, f"i{op}") for op in (
    "add", "and", "or", "xor", "sub", "mul", "truediv", "floordiv", "mod", "pow",
    "lshift", "rshift", "matmul")} | {operator.setitem}


# ops whose result may share memory with their first argument
_ALIASING = {"view", "reshape", "expand", "expand_as", "view_as", "transpose", "permute",
             "unsqueeze", "squeeze", "narrow", "select", "t", "as_strided", "unflatten",
             "flatten", "split", "chunk", "unbind", "detach", "to", "contiguous", "type_as",
             "getitem", "__getitem__", "movedim", "swapaxes", "diagonal", "T", "mT",
             "broadcast_to", "type", "float", "bool", "long", "int", "half", "bfloat16"}


def _written(node: fx.Node) -> bool:
    """Whether anything in the graph may write into ``node``'s memory: an in-place op on
    it or on a view of it."""
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        for u in n.users:
            if _mutates(u):
                return True
            name = u.target if isinstance(u.target, str) else getattr(u.target, "__name__", "")
            if name in _ALIASING:
                todo.append(u)
    return False


def _evaluate(node: fx.Node) -> torch.Tensor | None:
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op not in ("call_function", "call_method") or not _static_shape(_val(n)):
            return None
        name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
        if not name or any(w in name.lower() for w in _IMPURE) or name in ("item", "tolist") \
                or _mutates(n) \
                or _written(n):
            return None
        todo += n.all_input_nodes
    env = {}
    try:
        for n in (n for n in node.graph.nodes if n in seen):  # in graph order
            args = fx.node.map_arg(n.args, env.__getitem__)
            kwargs = fx.node.map_arg(n.kwargs, env.__getitem__)
            if n.op == "call_method":
                env[n] = getattr(args[0], n.target)(*args[1:], **kwargs)
            else:
                env[n] = n.target(*args, **kwargs)
    except Exception:  # noqa: BLE001 - an op that does not run here: assume nothing
        return None
    v = env[node]
    return v if isinstance(v, torch.Tensor) else None


def _mask_kind(mask, kind: str, q_len: int, k_len: int) -> str | None:
    """What a constant mask of the scores (queries x keys, broadcast over the leading
    dims) computes: ``"none"`` (every key attended), ``"causal"`` (key j attended by query
    i exactly when j <= i: SDPA's is_causal), or None. ``kind``: ``"keep"`` (bool, True =
    attend), ``"drop"`` (bool, True = masked) or ``"add"`` (float: 0 attended; the dtype's
    minimum or -inf masked, which the softmax turns into exactly 0, as eager computes it)."""
    if mask.dim() < 2 or not _broadcasts(tuple(mask.shape[-2:]), (q_len, k_len)):
        return None
    m = torch.broadcast_to(mask, (*mask.shape[:-2], q_len, k_len))
    if kind == "add":
        if not mask.dtype.is_floating_point:
            return None
        attend = m == 0
        if not bool((attend | (m <= torch.finfo(m.dtype).min)).all()):
            return None
    elif mask.dtype == torch.bool:
        attend = m if kind == "keep" else ~m
    else:
        return None
    if bool(attend.all()):
        return "none"
    tril = torch.ones(q_len, k_len, dtype=torch.bool).tril()
    return "causal" if q_len == k_len and torch.equal(attend, tril.expand_as(attend)) else None


def _constant_mask_kind(mask_node, kind: str, scores) -> str | None:
    if not (isinstance(scores, torch.Tensor) and scores.dim() >= 2
            and all(type(d) is int for d in scores.shape[-2:])):
        return None
    value = _constant(mask_node)
    return None if value is None else _mask_kind(value, kind, *scores.shape[-2:])


def _causal(chain: _Chain) -> bool:
    """Whether the chain's only mask is the causal one over square scores: built as
    ``ones().tril()`` in the graph, or a mask the graph computes from no input that equals
    it (evaluated at compile time: transformers' causal masks)."""
    if len(chain.masks) != 1:
        return False
    kind, m = chain.masks[0]
    s = _val(chain.mm1)
    if _constant_mask_kind(m, kind, s) == "causal":
        return True
    if kind == "drop":
        if not (_is(m, {operator.invert, torch.logical_not}, ("logical_not", "__invert__"))
                and len(m.args) == 1):
            return False
        m = m.args[0]
    elif kind != "keep":
        return False
    return _is_causal_tril(m) and _same(_val(m).shape[0], s.shape[-1]) \
        and _same(s.shape[-2], s.shape[-1])


def _erase_dead(node: fx.Node) -> None:
    """Erase ``node`` and its ancestors that nothing reads any more (a mask's ops: pure,
    as :func:`_constant` checked)."""
    todo, gone = [node], set()
    while todo:
        n = todo.pop()
        if n in gone or n.users or n.op not in ("call_function", "call_method"):
            continue
        gone.add(n)
        inputs = n.all_input_nodes
        n.graph.erase_node(n)
        todo += inputs


_SDPA = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}
_SDPA_PARAMS = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _simplify_sdpa_mask(node: fx.Node) -> AttentionDecision | None:
    """An SDPA call whose ``attn_mask`` the graph computes from no input (transformers'
    masking utils without a padding mask) and that equals the causal mask becomes
    ``is_causal=True`` without a mask; one that masks nothing is dropped. Masks that read
    an input (padding) stay as they are."""
    if len(node.args) < 3 or len(node.args) > 3 + len(_SDPA_PARAMS):
        return None
    kw = dict(zip(_SDPA_PARAMS, node.args[3:]))
    if set(kw) & set(node.kwargs):
        return None
    kw.update(node.kwargs)
    mask = kw.get("attn_mask")
    if not isinstance(mask, fx.Node) or kw.get("is_causal", False) is not False:
        return None
    q, k = (_val(a) for a in node.args[:2])
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
            and all(type(d) is int for d in (*q.shape[-2:], *k.shape[-2:]))):
        return None
    value = _constant(mask)
    if value is None:
        return None
    kind = _mask_kind(value, "keep" if value.dtype == torch.bool else "add",
                      q.shape[-2], k.shape[-2])
    if kind is None:
        return None
    kw["attn_mask"], kw["is_causal"] = None, kind == "causal"
    node.args, node.kwargs = tuple(node.args[:3]), kw
    _erase_dead(mask)
    return AttentionDecision(node.name, node.name, True,
                             "attention mask computed from no input "
                             + ("is the causal mask: is_causal, no mask read" if kind == "causal"
                                else "masks nothing: dropped"))


def _rewrite(gm: fx.GraphModule, chain: _Chain) -> bool:
    g = gm.graph
    causal = _causal(chain)
    dead = []
    if causal:  # the mask's own ops (ones, tril, ~) go when nothing else reads them
        dead = [chain.masks[0][1]]
        chain.masks = []
    with g.inserting_before(chain.mm2):
        k = g.call_method("transpose", (chain.kt, -2, -1))
        mask = None
        keeps = [m for kind, m in chain.masks if kind == "keep"]
        drops = [m for kind, m in chain.masks if kind == "drop"]
        adds = [m for kind, m in chain.masks if kind == "add"]
        if len(keeps) + len(drops) == 1 and not adds:
            # one boolean mask: SDPA's own form (True = attend)
            mask = keeps[0] if keeps else g.call_function(operator.invert, (drops[0],))
        else:
            for m in adds:
                mask = m if mask is None else g.call_function(operator.add, (mask, m))
            for m, fill_where in [(m, True) for m in drops] + [(m, False) for m in keeps]:
                # the -inf fills as an additive mask: scores + (-inf) is the fill itself
                dt = _val(chain.mm1).dtype
                term = g.call_function(torch.where, (m, _NEG_INF, 0.0) if fill_where
                                       else (m, 0.0, _NEG_INF))
                term = g.call_method("to", (term, dt))
                mask = term if mask is None else g.call_function(operator.add, (mask, term))
        sdpa = g.call_function(F.scaled_dot_product_attention, (chain.q, k, chain.v),
                               {"attn_mask": mask, "dropout_p": 0.0, "is_causal": causal,
                                "scale": float(chain.scale)})
    sdpa.meta["example_value"] = _val(chain.mm2)
    chain.mm2.replace_all_uses_with(sdpa)
    for node in reversed(chain.nodes):
        g.erase_node(node)
    if dead and _constant(dead[0]) is not None:  # pure ops of no input: all of them go
        _erase_dead(dead.pop())
    while dead:
        node = dead.pop()
        if not node.users and (_is(node, {operator.invert, torch.logical_not, torch.ones,
                                          torch.tril}, ("tril", "logical_not", "__invert__"))):
            dead += [a for a in node.args if isinstance(a, fx.Node)]
            g.erase_node(node)
    return causal


def rewrite_attention(gm: fx.GraphModule, hw, threshold: float) -> list[AttentionDecision]:
    """Rewrite every attention chain of the Dynamo graph ``gm`` that is SDPA's computation
    into one SDPA call where the ROI model's score of the rewrite (unfused over flash time,
    the GEMMs' common compute aside) clears ``threshold``, as every fusion must; returns a
    decision per softmax that looked like attention."""
    decisions = []
    for node in list(gm.graph.nodes):
        if node.graph is not gm.graph:
            continue
        if _is(node, _SDPA):
            d = _simplify_sdpa_mask(node)
            if d is not None:
                decisions.append(d)
            continue
        if not _is(node, _SOFTMAX, ("softmax",)):
            continue
        try:
            chain = _match(node)
        except (_NoMatch, AttributeError, TypeError, IndexError, RuntimeError) as e:
            decisions.append(AttentionDecision(node.name, node.name, False,
                                               f"attention left unfused: {e}"))
            continue
        d = AttentionDecision(chain.mm1.name, chain.mm2.name, False, "",
                              **_estimate(chain, hw))
        d.fused = d.roi_score >= threshold
        if d.fused:
            causal = _rewrite(gm, chain)
            d.reason = (f"attention -> one scaled_dot_product_attention call (ATen's CPU "
                        f"flash kernel{', is_causal' if causal else ''}): predicted {d.flash_us:.1f} us against "
                        f"{d.unfused_us:.1f} us for its {len(chain.nodes)} ops unfused, "
                        "which move the score matrix through memory once per op")
        else:
            d.reason = (f"attention left unfused: ROI {d.roi_score:.2f} below {threshold} "
                        f"(predicted {d.unfused_us:.1f} us unfused, {d.flash_us:.1f} us for "
                        "ATen's flash kernel)")
        decisions.append(d)
    for node in gm.graph.nodes:
        node.meta.pop("pypto_constant", None)
    if any(d.fused for d in decisions):
        gm.graph.lint()
        gm.recompile()
    return decisions


__all__ = ["AttentionDecision", "rewrite_attention"]
