"""Attention for the NPU: an SDPA call as one pypto flash-attention kernel.

:mod:`...lowering.attention` rewrites ``q @ k^T -> scale -> mask -> softmax -> @ v``
into one ``scaled_dot_product_attention`` call, an extern op of the tile graph
(``_scaled_dot_product_flash_attention_for_cpu``). For the pypto target that call
is emitted here as one kernel, the flash-attention form: for each (batch, head)
and block of ``tq`` query rows, over blocks of ``tk`` keys

- cube: ``s = q_blk @ k_blk^T`` (fp16/bf16/fp32 operands, fp32 result);
- vector: scale, mask (an additive float mask, a bool mask as 0 / -1e30, causal from a
  bool tril input), the softmax: with up to :data:`MAX_UNROLLED_KEY_BLOCKS` key blocks
  the blocks are unrolled (one row max ``m`` and sum ``l`` over all score blocks, kept on
  chip); beyond, the online softmax in a ``pypto.loop`` (running max, rescale factor
  ``exp(m_old - m_new)``, running sum), which costs about twice the simulated work;
- cube: ``acc = sum_j p_j @ v_j`` (``p`` cast to v's dtype, as flash kernels do), rescaled
  by ``alpha`` in the online form;

then ``out = acc / l`` and ``lse = m + log(l)`` (SDPA's second result). The scores
never leave the chip: that is the fusion. The running max starts at -1e30, not
-inf, so a block whose keys are all masked adds nothing (exp(-inf - -1e30) = 0)
instead of NaN; the one difference from SDPA is a query row whose every key is
masked (SDPA gives NaN or 0 depending on the kernel, this gives the mean of v).

:func:`emit_unfused` is the same computation as three kernels with the scores and
probabilities in global memory (what running the chain op by op costs on the NPU):
``scores = q @ k^T * scale + mask``, ``softmax``, ``probs @ v``.
:func:`attention_spec` reads an SDPA extern op of a tile graph;
:func:`simulate_attention` simulates fused vs unfused and value-checks the fused
kernel through pypto's host interpreter (:mod:`.verify`) against eager SDPA.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from ...ir import ExternOp, TileGraph, ValueRef
from .kernel import PYPTO_DTYPES, KernelParam, PyptoEmitError, PyptoKernel

__all__ = ["AttentionSpec", "attention_spec", "emit_flash", "emit_unfused", "unfused_cases",
           "reference", "random_inputs", "is_sdpa", "simulate_attention", "AttentionSimulation"]

_BIG = "1e30"  # the masked score: finite, so the online softmax never computes inf - inf
_SDPA_OPS = ("_scaled_dot_product_flash_attention_for_cpu", "scaled_dot_product_attention",
             "_scaled_dot_product_flash_attention")


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """One SDPA call: q [B, H, Sq, D], k [B, H, Sk, D], v [B, H, Sk, Dv], an optional
    mask broadcastable to [B, H, Sq, Sk] (bool: True keeps; float: added), causal or not."""

    B: int
    H: int
    Sq: int
    Sk: int
    D: int
    Dv: int
    dtype: torch.dtype
    scale: float
    causal: bool = False
    mask_shape: tuple[int, int, int, int] | None = None  # padded to 4-D
    mask_dtype: torch.dtype | None = None
    name: str = "sdpa"

    def __post_init__(self):
        if self.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise PyptoEmitError("scaled_dot_product_attention", f"dtype {self.dtype}")
        if self.mask_shape is not None:
            mb, mh, mq, mk = self.mask_shape
            if mb not in (1, self.B) or mh not in (1, self.H) or mq not in (1, self.Sq) \
                    or mk != self.Sk:
                raise PyptoEmitError("scaled_dot_product_attention",
                                     f"a mask of shape {list(self.mask_shape)} against scores "
                                     f"[{self.B}, {self.H}, {self.Sq}, {self.Sk}]")

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        s = {"q": (self.B, self.H, self.Sq, self.D), "k": (self.B, self.H, self.Sk, self.D),
             "v": (self.B, self.H, self.Sk, self.Dv)}
        if self.mask_shape is not None:
            s["mask"] = self.mask_shape
        return s


def is_sdpa(node) -> bool:
    if not isinstance(node, ExternOp):
        return False
    parts = node.op_name.replace("::", ".").split(".")  # aten._scaled_dot_..._for_cpu.default
    return any(p in _SDPA_OPS for p in parts)


def attention_spec(op: ExternOp, graph: TileGraph) -> AttentionSpec:
    """The AttentionSpec of an SDPA extern op (raises PyptoEmitError when it has no kernel
    here: dropout, GQA head counts, dynamic sizes)."""
    if not is_sdpa(op):
        raise PyptoEmitError(op.op_name, "not an SDPA call")
    names = ["query", "key", "value", "dropout_p", "is_causal"]
    args = dict(zip(names, op.args))
    args.update(op.kwargs)
    if float(args.get("dropout_p", 0.0) or 0.0) != 0.0:
        raise PyptoEmitError("scaled_dot_product_attention", "dropout")

    def shape(ref) -> tuple[int, ...]:
        if not isinstance(ref, ValueRef):
            raise PyptoEmitError("scaled_dot_product_attention", f"operand {ref!r}")
        spec = graph.specs[ref.name]
        if any(getattr(x, "free_symbols", None) for x in spec.shape):
            raise PyptoEmitError("scaled_dot_product_attention",
                                 "dynamic sizes are not supported yet")
        return tuple(int(x) for x in spec.shape)
    q, k, v = (shape(args[x]) for x in ("query", "key", "value"))
    if len(q) != 4 or k[:2] != q[:2] or v[:3] != k[:3]:
        raise PyptoEmitError("scaled_dot_product_attention",
                             f"q {list(q)}, k {list(k)}, v {list(v)} (equal batch and heads)")
    mask = args.get("attn_mask")
    mshape = mdtype = None
    if mask is not None:
        m = shape(mask)
        mshape = (1,) * (4 - len(m)) + m
        mdtype = graph.specs[mask.name].dtype
    scale = args.get("scale")
    scale = float(scale) if scale is not None else 1.0 / math.sqrt(q[-1])
    return AttentionSpec(q[0], q[1], q[2], k[2], q[3], v[3], graph.specs[args["query"].name].dtype,
                         scale, bool(args.get("is_causal", False)), mshape, mdtype, op.name)


# --- kernels --------------------------------------------------------------------------------
def _dt(dtype: torch.dtype) -> str:
    return f"pypto.{PYPTO_DTYPES[dtype]}"


def _block(n: int, cap: int) -> int:
    """The largest divisor of ``n`` up to ``cap`` (blocks tile the sequence exactly)."""
    for b in range(min(n, cap), 0, -1):
        if n % b == 0:
            return b
    return 1


def _params(spec: AttentionSpec, outputs: list[tuple[str, tuple, torch.dtype, tuple]]
            ) -> list[KernelParam]:
    B, H = spec.B, spec.H
    ps = [KernelParam("in_q", "q", (B * H * spec.Sq, spec.D), spec.dtype, False,
                      spec.shapes["q"]),
          KernelParam("in_k", "k", (B * H * spec.Sk, spec.D), spec.dtype, False,
                      spec.shapes["k"]),
          KernelParam("in_v", "v", (B * H * spec.Sk, spec.Dv), spec.dtype, False,
                      spec.shapes["v"])]
    if spec.mask_shape is not None:
        mb, mh, mq, mk = spec.mask_shape
        ps.append(KernelParam("in_mask", "mask", (mb * mh * mq, mk), spec.mask_dtype, False,
                              spec.mask_shape))
    if spec.causal:
        ps.append(KernelParam("in_causal", "causal", (spec.Sq, spec.Sk), torch.bool, False,
                              (spec.Sq, spec.Sk)))
    ps += [KernelParam(ident, value, shape, dtype, True, gshape)
           for ident, value, shape, dtype, gshape in
           [(f"out_{n}", n, s, d, g) for n, s, d, g in outputs]]
    return ps


def _module(name: str, doc: str, run_mode: str, params: list[KernelParam],
            body: list[str]) -> str:
    sig = ",\n".join(f"    {p.ident}: pypto.Tensor(({', '.join(map(str, p.shape))}), "
                     f"{_dt(p.dtype)})" for p in params)
    text = "\n".join("    " + line for line in body)
    return (f'"""{doc} (generated by pypto_inductor)."""\nimport pypto\n\n'
            f"RUN_MODE = pypto.RunMode.{run_mode}\n\n\n"
            "@pypto.frontend.jit(runtime_options={\"run_mode\": RUN_MODE})\n"
            f"def {name}(\n{sig},\n):\n{text}\n")


def _mask_lines(spec: AttentionSpec, rows: str, cols: str, tq: int, tk: int, s: str,
                q0: str, k0: str) -> list[str]:
    """Lines adding the mask (and the causal mask) to the score block ``s`` (fp32).
    ``q0``/``k0``: the block's first query row / key within its (batch, head)."""
    lines = []
    if spec.mask_shape is not None:
        mb, mh, mq, _ = spec.mask_shape
        row = " + ".join(x for x in [f"b * {mh * mq}" if mb > 1 else "",
                                     f"h * {mq}" if mh > 1 else "",
                                     q0 if mq > 1 else ""] if x) or "0"
        mrows = tq if mq > 1 else 1
        lines.append(f"mk = pypto.view(in_mask, [{mrows}, {tk}], [{row}, {k0}])")
        if spec.mask_dtype == torch.bool:
            # True keeps a key: (keep - 1) * 1e30 is 0 or -1e30
            lines += ["mk = pypto.cast(pypto.cast(mk, pypto.DT_FP16), pypto.DT_FP32)",
                      f"mk = pypto.mul(pypto.sub(mk, 1.0), {_BIG})"]
        elif spec.mask_dtype != torch.float32:
            lines.append("mk = pypto.cast(mk, pypto.DT_FP32)")
        lines.append(f"{s} = pypto.add({s}, mk)")
    if spec.causal:
        # SDPA's is_causal keeps key j for query i when j <= i (top-left aligned). pypto's
        # simulator has no pipe for TRIUL, so the kernel reads the causal mask as an input
        # (as CANN's FlashAttentionScore takes its causal mask): the bool tril(ones(Sq, Sk))
        lines += [f"ck = pypto.view(in_causal, [{tq}, {tk}], [{q0}, {k0}])",
                  "ck = pypto.cast(pypto.cast(ck, pypto.DT_FP16), pypto.DT_FP32)",
                  f"{s} = pypto.add({s}, pypto.mul(pypto.sub(ck, 1.0), {_BIG}))"]
    return lines


def blocks(spec: AttentionSpec) -> tuple[int, int]:
    """(query block, key block): keys in blocks of up to 512 (one block when the sequence
    fits: no rescaling), queries so that a [tq, tk] fp32 score block is at most 128 KiB; the
    vector ops then run on UB tiles of at most 8192 elements (see emit_flash).
    Measured in SIM (work cycles, B=1, H=4, D=64 fp16, docs/pypto_coverage.md): S=512
    (64, 512) 190k, (32, 1024) 283k, (64, 128) online 1.29M; S=128 (128, 128) 41.0k,
    (64, 128) 40.6k; a key block of 1024 fails pypto's passes."""
    tk = _block(spec.Sk, 512)
    return _block(spec.Sq, max(16, 32768 // tk)), tk


def _aligned(n: int, step: int = 16) -> int:
    """A tile dim rounded up to whole 16-element steps: pypto wants a UB tile row of whole
    32-byte blocks ("CHECK FAILED: lastDimBytes % BLOCK_SIZE == 0" for vit's 17 keys) and
    the cube works on 16x16 fractals. Only tile shapes are rounded, never views: a tile
    reaching past its view is masked by pypto."""
    return -(-n // step) * step


MAX_UNROLLED_KEY_BLOCKS = 4  # up to 4 x 512 keys in the plain (unrolled) form


def _plain_softmax(spec: AttentionSpec, tq: int, tk: int, nk: int, scale: float,
                   vdt: str) -> list[str]:
    """Lines of the plain form for one query block ``qb``: the ``nk`` key blocks unrolled,
    scores ``s0..``, their one row max ``m`` and sum ``l`` and ``acc = sum_j p_j @ v_j``."""
    D, Dv, Sk = spec.D, spec.Dv, spec.Sk
    lines = []
    for j in range(nk):
        lines += [f"kb{j} = pypto.view(in_k, [{tk}, {D}], [bh * {Sk} + {j * tk}, 0])",
                  f"s{j} = pypto.mul(pypto.matmul(qb, kb{j}, pypto.DT_FP32, b_trans=True), "
                  f"{scale!r})"]
        lines += _mask_lines(spec, "", "", tq, tk, f"s{j}", "q0", str(j * tk))
    lines.append("m = pypto.amax(s0, -1, True)")
    lines += [f"m = pypto.maximum(m, pypto.amax(s{j}, -1, True))" for j in range(1, nk)]
    for j in range(nk):
        lines += [f"p{j} = pypto.exp(pypto.sub(s{j}, m))",
                  f"vb{j} = pypto.view(in_v, [{tk}, {Dv}], [bh * {Sk} + {j * tk}, 0])",
                  f"pv{j} = pypto.matmul(pypto.cast(p{j}, {vdt}), vb{j}, pypto.DT_FP32)"]
    lines.append("l = pypto.sum(p0, -1, True)")
    lines += [f"l = pypto.add(l, pypto.sum(p{j}, -1, True))" for j in range(1, nk)]
    lines.append("acc = pv0")
    lines += [f"acc = pypto.add(acc, pv{j})" for j in range(1, nk)]
    return lines


def emit_flash(spec: AttentionSpec, run_mode: str = "SIM", tq: int | None = None,
               tk: int | None = None, scale: float | None = None, vec: tuple | None = None,
               online: bool = False) -> PyptoKernel:
    """The fused flash-attention kernel of ``spec`` (``scale`` overrides spec.scale: a
    test's deliberately wrong kernel; ``online`` forces the online softmax loop even for
    few key blocks)."""
    B, H, Sq, Sk, D, Dv = spec.B, spec.H, spec.Sq, spec.Sk, spec.D, spec.Dv
    dq, dk = blocks(spec)
    tq, tk = _block(Sq, tq or dq), _block(Sk, tk or dk)
    nq, nk = Sq // tq, Sk // tk
    scale = spec.scale if scale is None else scale
    vdt = _dt(spec.dtype)
    kk, nn = max(D, tk), max(tk, Dv)
    vt = vec or (min(tq, max(8, 8192 // nn)), _aligned(nn))  # the UB tile of the vector ops
    name = "pto_flash_" + "".join(c if c.isalnum() else "_" for c in spec.name)
    params = _params(spec, [("out", (B * H * Sq, Dv), spec.dtype, (B, H, Sq, Dv)),
                            ("lse", (B * H * Sq, 1), torch.float32, (B, H, Sq))])
    # The plain form (few key blocks, unrolled): every score block of the query block
    # stays on chip, one max and one sum over them, no rescale. The online form (a
    # pypto.loop over key blocks carrying the running max, sum and accumulator) costs
    # about twice the simulated work at S=512 (1088 vs 320 tasks; its loop-carried
    # updates are tasks of their own), so it is kept for long key sequences only.
    plain = not online and nk <= MAX_UNROLLED_KEY_BLOCKS
    if plain:
        loop = ["        " + x for x in _plain_softmax(spec, tq, tk, nk, scale, vdt)]
    else:
        inner = [
            f"k0 = j * {tk}",
            f"kb = pypto.view(in_k, [{tk}, {D}], [bh * {Sk} + k0, 0])",
            f"vb = pypto.view(in_v, [{tk}, {Dv}], [bh * {Sk} + k0, 0])",
            "s = pypto.matmul(qb, kb, pypto.DT_FP32, b_trans=True)",
            f"s = pypto.mul(s, {scale!r})",
        ] + _mask_lines(spec, "", "", tq, tk, "s", "q0", "k0") + [
            "mnew = pypto.maximum(m, pypto.amax(s, -1, True))",
            "p = pypto.exp(pypto.sub(s, mnew))",
            "alpha = pypto.exp(pypto.sub(m, mnew))",
            "l[:] = pypto.add(pypto.mul(l, alpha), pypto.sum(p, -1, True))",
            f"pv = pypto.matmul(pypto.cast(p, {vdt}), vb, pypto.DT_FP32)",
            "acc[:] = pypto.add(pypto.mul(acc, alpha), pv)",
            "m[:] = mnew",
        ]
        # causal: key blocks wholly after the query block are all masked; not visiting
        # them is the online form's saving (when the blocks align: tk divides the block end)
        nk_expr = str(nk)
        if spec.causal and tq % tk == 0 and Sq == Sk:
            nk_expr = f"(q0 + {tq}) // {tk}"
        loop = [
            f"        m = pypto.full([{tq}, 1], -{_BIG}, pypto.DT_FP32)",
            f"        l = pypto.full([{tq}, 1], 0.0, pypto.DT_FP32)",
            f"        acc = pypto.full([{tq}, {Dv}], 0.0, pypto.DT_FP32)",
            f"        for j in pypto.loop({nk_expr}):",
        ] + ["            " + x for x in inner]
    body = [
        f"pypto.set_vec_tile_shapes({vt[0]}, {vt[1]})",
        # k covers both matmuls' K (D for QK^T, tk for PV): no split K, no extra tasks
        "pypto.set_cube_tile_shapes([{0}, {0}], [{1}, {1}], [{2}, {2}])".format(
            _aligned(tq), _aligned(kk), _aligned(nn)),
        f"for bh in pypto.loop({B * H}):",
        f"    b = bh // {H}",
        f"    h = bh % {H}",
        f"    for i in pypto.loop({nq}):",
        f"        q0 = i * {tq}",
        f"        qb = pypto.view(in_q, [{tq}, {D}], [bh * {Sq} + q0, 0])",
    ] + loop + [
        f"        o = pypto.cast(pypto.div(acc, l), {vdt})" if spec.dtype != torch.float32
        else "        o = pypto.div(acc, l)",
        f"        pypto.assemble(o, [bh * {Sq} + q0, 0], out_out)",
        f"        pypto.assemble(pypto.add(m, pypto.log(l)), [bh * {Sq} + q0, 0], out_lse)",
    ]
    doc = (f"pypto flash-attention kernel for {spec.name}: q [{B}, {H}, {Sq}, {D}] "
           f"{str(spec.dtype).replace('torch.', '')}, k/v blocks of {tk}, query blocks of {tq}"
           + (", causal" if spec.causal else "")
           + (f", mask {list(spec.mask_shape)}" if spec.mask_shape else ""))
    return PyptoKernel(name, spec.name, _module(name, doc, run_mode, params, body), params,
                       vt, tuple((_aligned(x),) * 2 for x in (tq, kk, nn)))


def emit_unfused(spec: AttentionSpec, run_mode: str = "SIM", tq: int = 64
                 ) -> list[PyptoKernel]:
    """The chain op by op: scores (q @ k^T * scale + mask), softmax, probs @ v; the
    [B*H*Sq, Sk] scores and probabilities go through global memory in between."""
    B, H, Sq, Sk, D, Dv = spec.B, spec.H, spec.Sq, spec.Sk, spec.D, spec.Dv
    tq = _block(Sq, tq)
    nq = Sq // tq
    rows = B * H * Sq
    head = [f"for bh in pypto.loop({B * H}):", f"    b = bh // {H}", f"    h = bh % {H}",
            f"    for i in pypto.loop({nq}):", f"        q0 = i * {tq}",
            f"        r0 = bh * {Sq} + q0"]
    n = min(Sk, 256)
    am, an, ad, adv = _aligned(tq), _aligned(n), _aligned(D), _aligned(Dv)
    tile = [f"pypto.set_vec_tile_shapes({tq}, {an})"]
    cube = [f"pypto.set_cube_tile_shapes([{am}, {am}], [{ad}, {ad}], [{an}, {an}])"]
    # probs @ v: K is the key length, N the head dim (no split K up to 512)
    kk = _aligned(min(_block(Sk, 512), 512))
    cube_pv = [f"pypto.set_cube_tile_shapes([{am}, {am}], [{kk}, {kk}], [{adv}, {adv}])"]
    p1 = _params(spec, [("scores", (rows, Sk), torch.float32, (B, H, Sq, Sk))])
    scores = tile + cube + head + [
        f"        qb = pypto.view(in_q, [{tq}, {D}], [r0, 0])",
        f"        kb = pypto.view(in_k, [{Sk}, {D}], [bh * {Sk}, 0])",
        f"        s = pypto.mul(pypto.matmul(qb, kb, pypto.DT_FP32, b_trans=True), "
        f"{spec.scale!r})",
    ] + ["        " + x for x in _mask_lines(spec, "", "", tq, Sk, "s", "q0", "0")] + [
        "        pypto.assemble(s, [r0, 0], out_scores)"]
    p2 = [KernelParam("in_scores", "scores", (rows, Sk), torch.float32, False, (B, H, Sq, Sk)),
          KernelParam("out_probs", "probs", (rows, Sk), spec.dtype, True, (B, H, Sq, Sk))]
    probs = tile + head + [
        f"        sb = pypto.view(in_scores, [{tq}, {Sk}], [r0, 0])",
        f"        pypto.assemble(pypto.cast(pypto.softmax(sb, -1), {_dt(spec.dtype)}), "
        "[r0, 0], out_probs)" if spec.dtype != torch.float32 else
        "        pypto.assemble(pypto.softmax(sb, -1), [r0, 0], out_probs)"]
    p3 = [KernelParam("in_probs", "probs", (rows, Sk), spec.dtype, False, (B, H, Sq, Sk)),
          p1[2], KernelParam("out_out", "out", (rows, Dv), spec.dtype, True, (B, H, Sq, Dv))]
    pv = tile + cube_pv + head + [
        f"        pb = pypto.view(in_probs, [{tq}, {Sk}], [r0, 0])",
        f"        vb = pypto.view(in_v, [{Sk}, {Dv}], [bh * {Sk}, 0])",
        f"        o = pypto.matmul(pb, vb, pypto.DT_FP32)",
        (f"        pypto.assemble(pypto.cast(o, {_dt(spec.dtype)}), [r0, 0], out_out)"
         if spec.dtype != torch.float32 else "        pypto.assemble(o, [r0, 0], out_out)")]
    out = []
    for stem, params, body in (("scores", p1, scores), ("softmax", p2, probs), ("pv", p3, pv)):
        name = f"pto_attn_{stem}_" + "".join(c if c.isalnum() else "_" for c in spec.name)
        out.append(PyptoKernel(name, f"{spec.name}_{stem}",
                               _module(name, f"unfused attention, {stem}, for {spec.name}",
                                       run_mode, params, body), params, None, None))
    return out


# --- reference and inputs ---------------------------------------------------------------------
def random_inputs(spec: AttentionSpec, seed: int = 0) -> list[torch.Tensor]:
    """q, k, v (and the mask) of ``spec``: normal values; a bool mask keeps each query's
    first key (no row wholly masked); a float mask has -inf entries."""
    g = torch.Generator().manual_seed(seed)
    out = [torch.randn(s, generator=g).to(spec.dtype) for n, s in spec.shapes.items()
           if n != "mask"]
    if spec.mask_shape is not None:
        r = torch.rand(spec.mask_shape, generator=g)
        if spec.mask_dtype == torch.bool:
            m = r > 0.3
            m[..., 0] = True
        else:
            m = torch.where(r > 0.3, torch.randn(spec.mask_shape, generator=g), float("-inf"))
            m[..., 0] = 0.0
            m = m.to(spec.mask_dtype)
        out.append(m)
    if spec.causal:
        out.append(causal_mask(spec))
    return out


def causal_mask(spec: AttentionSpec) -> torch.Tensor:
    """The causal kernels' extra input: True where key j <= query i."""
    return torch.ones(spec.Sq, spec.Sk, dtype=torch.bool).tril()


def reference(spec: AttentionSpec, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Eager SDPA (fp32 math on the same inputs): [out, logsumexp]."""
    q, k, v = (x.float() for x in inputs[:3])
    mask = inputs[3] if spec.mask_shape is not None else None
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.float()
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=spec.causal, scale=spec.scale)
    s = (q @ k.transpose(-1, -2)) * spec.scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    if spec.causal:
        s = s.masked_fill(torch.ones(spec.Sq, spec.Sk, dtype=torch.bool).tril().logical_not(),
                          float("-inf"))
    return [out.to(spec.dtype), torch.logsumexp(s, -1)]


def unfused_cases(spec: AttentionSpec, seed: int = 0) -> list[tuple[PyptoKernel, list, list]]:
    """Value-check cases (:func:`.verify.verify_kernels`) of the three kernels
    :func:`emit_unfused` simulates as the unfused cost baseline, each on its own inputs:
    scores on random q, k, v (and masks), softmax on those scores, probs @ v on those
    probabilities. The expected values follow the kernels' masking (a masked score is
    -1e30, finite; an additive float mask adds as it is)."""
    scores_k, softmax_k, pv_k = emit_unfused(spec)
    inputs = random_inputs(spec, seed)
    q, k, v = (x.float() for x in inputs[:3])
    s = (q @ k.transpose(-1, -2)) * spec.scale
    rest = inputs[3:]
    big = float(_BIG)
    if spec.mask_shape is not None:
        mask, rest = rest[0], rest[1:]
        s = s + ((mask.float() - 1.0) * big if mask.dtype == torch.bool else mask.float())
    if spec.causal:
        s = s + (rest[0].float() - 1.0) * big
    probs = torch.softmax(s, -1).to(spec.dtype)
    out = (probs.float() @ v).to(spec.dtype)
    return [(scores_k, inputs, [s]), (softmax_k, [s], [probs]), (pv_k, [probs, inputs[2]], [out])]


# --- simulation and value check ----------------------------------------------------------------
@dataclasses.dataclass
class AttentionSimulation:
    """Fused vs unfused simulated cycles of one SDPA call and the fused kernel's value check."""
    name: str
    spec: AttentionSpec
    fused_cycles: int | None = None
    unfused_cycles: int | None = None
    unfused_parts: dict = dataclasses.field(default_factory=dict)
    # task span + launch cost per kernel (SimResult.work_cycles): what the work costs;
    # Total Cycles move in steps and mostly count tasks
    fused_work: int | None = None
    unfused_work: int | None = None
    verified: bool | None = None
    max_abs_err: float | None = None
    error: str | None = None
    pypto_verdicts: list = dataclasses.field(default_factory=list)  # verify.KernelCheck's

    @property
    def speedup(self) -> float | None:
        if self.fused_cycles and self.unfused_cycles:
            return self.unfused_cycles / self.fused_cycles
        return None

    def to_dict(self) -> dict:
        s = self.spec
        return {"name": self.name, "op": "scaled_dot_product_attention",
                "shape": [s.B, s.H, s.Sq, s.Sk, s.D], "dtype": str(s.dtype).replace("torch.", ""),
                "causal": s.causal, "mask": list(s.mask_shape) if s.mask_shape else None,
                "simulated_cycles_fused": self.fused_cycles,
                "simulated_cycles_unfused": self.unfused_cycles,
                "simulated_work_cycles_fused": self.fused_work,
                "simulated_work_cycles_unfused": self.unfused_work,
                "work_speedup": (self.unfused_work / self.fused_work
                                 if self.fused_work and self.unfused_work else None),
                "unfused_parts": dict(self.unfused_parts), "speedup": self.speedup,
                "verified": self.verified, "max_abs_err": self.max_abs_err, "error": self.error,
                "pypto_verdicts": list(self.pypto_verdicts) or None}


def simulate_attention(specs: list[AttentionSpec], verify: bool = True, seed: int = 0,
                       timeout: float | None = None, per_pass: bool = False
                       ) -> list[AttentionSimulation]:
    """Each SDPA call simulated fused (the flash kernel) and unfused (three kernels), and
    the flash kernel run through pypto's interpreter against eager SDPA."""
    from .sim import DEFAULT_TIMEOUT_S, simulate_kernels
    sims, kernels, slots = [], [], []
    for i, spec in enumerate(specs):
        sim = AttentionSimulation(spec.name, spec)
        sims.append(sim)
        try:
            fused, unfused = emit_flash(spec), emit_unfused(spec)
        except PyptoEmitError as e:
            sim.error = str(e)
            continue
        slots.append((i, len(kernels), [k.name for k in unfused]))
        kernels += [fused] + unfused
    results = simulate_kernels(kernels, timeout=timeout or DEFAULT_TIMEOUT_S)
    cases = []
    for i, j, names in slots:
        sim, fused = sims[i], results[j]
        sim.fused_cycles = fused.cycles
        parts = results[j + 1:j + 4]
        sim.unfused_parts = {k: r.cycles for k, r in zip(("scores", "softmax", "pv"), parts)}
        if all(r.cycles is not None for r in parts):
            sim.unfused_cycles = sum(r.cycles for r in parts)
        sim.fused_work = fused.work_cycles
        if all(r.work_cycles is not None for r in parts):
            sim.unfused_work = sum(r.work_cycles for r in parts)
        errors = [r.error for r in [fused] + parts if r.error]
        if errors:
            sim.error = "; ".join(e.splitlines()[0][:200] for e in errors)
        if verify:
            inputs = random_inputs(sim.spec, seed)
            cases.append((i, (kernels[j], inputs, reference(sim.spec, inputs))))
    if cases:
        from .verify import VerifyUnavailable, verify_kernels
        try:
            checks = verify_kernels([c for _, c in cases], per_pass=per_pass)
        except VerifyUnavailable as e:
            for i, _ in cases:
                sims[i].error = (sims[i].error or "") + f"verify unavailable: {e}"
            return sims
        for (i, _), check in zip(cases, checks):
            sims[i].verified, sims[i].max_abs_err = check.verified, check.max_abs_err
            sims[i].pypto_verdicts = check.pypto_verdicts
            if check.error:
                sims[i].error = (sims[i].error or "") + check.error
    return sims


def simulate_plan_attention(plan, verify: bool = False, per_pass: bool = False) -> list[dict]:
    """Every SDPA call of a FusionPlan's graph (the attention rewrite's extern op): the flash
    kernel simulated fused vs unfused and, with ``verify``, value-checked; a call with no
    kernel here (dropout, dynamic sizes) is listed with its reason. Never raises."""
    calls, out = [], []
    for node in plan.graph.nodes:
        if not is_sdpa(node):
            continue
        try:
            calls.append(attention_spec(node, plan.graph))
        except PyptoEmitError as e:
            out.append({"name": node.name, "op": "scaled_dot_product_attention",
                        "error": str(e), "verified": None})
    try:
        out += [s.to_dict() for s in simulate_attention(calls, verify=verify, per_pass=per_pass)]
    except Exception as e:  # noqa: BLE001 - a report must never fail on the simulator
        out += [{"name": s.name, "op": "scaled_dot_product_attention",
                 "error": f"{type(e).__name__}: {e}", "verified": None} for s in calls]
    return out
