"""Attention as one step: matmul -> scale -> mask -> softmax -> matmul, written out op by
op (transformers' eager attention, hand-written attention), becomes one
``scaled_dot_product_attention`` call, which runs ATen's flash kernel for CPU.

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
  sliding window: any mask is just a mask; ``ones(n, n, dtype=bool).tril()`` built in
  the graph is SDPA's ``is_causal``), in this order (a scale after a mask is not
  SDPA's form);
- ``softmax`` over the last dim (optionally computed in float32 and cast back), dropout
  that does nothing (p == 0 or not training), then ``probs @ v``;
- every intermediate (scores, probabilities, ...) read by the next op only: where the
  probabilities are returned (``output_attentions``) or used elsewhere, the chain stays.
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
            chain, c = (a, b) if isinstance(a, fx.Node) else (b, a)
            if not _number(c):
                raise _NoMatch(f"{node.name} scales the scores by a tensor")
            scale *= c
            node, stage = chain, "scale"
            continue
        if _is(node, _DIV, ("div", "div_", "__truediv__")) and len(node.args) == 2 \
                and not node.kwargs:
            chain, c = node.args
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


def _causal(chain: _Chain) -> bool:
    """Whether the chain's only mask is the causal one over square scores."""
    if len(chain.masks) != 1:
        return False
    kind, m = chain.masks[0]
    if kind == "drop":
        if not (_is(m, {operator.invert, torch.logical_not}, ("logical_not", "__invert__"))
                and len(m.args) == 1):
            return False
        m = m.args[0]
    elif kind != "keep":
        return False
    s = _val(chain.mm1)
    return _is_causal_tril(m) and _same(_val(m).shape[0], s.shape[-1]) \
        and _same(s.shape[-2], s.shape[-1])


def _rewrite(gm: fx.GraphModule, chain: _Chain) -> None:
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
    while dead:
        node = dead.pop()
        if not node.users and (_is(node, {operator.invert, torch.logical_not, torch.ones,
                                          torch.tril}, ("tril", "logical_not", "__invert__"))):
            dead += [a for a in node.args if isinstance(a, fx.Node)]
            g.erase_node(node)


def rewrite_attention(gm: fx.GraphModule, hw, threshold: float) -> list[AttentionDecision]:
    """Rewrite every attention chain of the Dynamo graph ``gm`` that is SDPA's computation
    into one SDPA call where the ROI model's score of the rewrite (unfused over flash time,
    the GEMMs' common compute aside) clears ``threshold``, as every fusion must; returns a
    decision per softmax that looked like attention."""
    decisions = []
    for node in list(gm.graph.nodes):
        if node.graph is not gm.graph or not _is(node, _SOFTMAX, ("softmax",)):
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
            _rewrite(gm, chain)
            d.reason = (f"attention -> one scaled_dot_product_attention call (ATen's CPU "
                        f"flash kernel): predicted {d.flash_us:.1f} us against "
                        f"{d.unfused_us:.1f} us for its {len(chain.nodes)} ops unfused, "
                        "which move the score matrix through memory once per op")
        else:
            d.reason = (f"attention left unfused: ROI {d.roi_score:.2f} below {threshold} "
                        f"(predicted {d.unfused_us:.1f} us unfused, {d.flash_us:.1f} us for "
                        "ATen's flash kernel)")
        decisions.append(d)
    if any(d.fused for d in decisions):
        gm.graph.lint()
        gm.recompile()
    return decisions


__all__ = ["AttentionDecision", "rewrite_attention"]
