"""The decomposition table AOTAutograd applies before lowering.

PyTorch's core ATen decompositions, minus ops we lower whole (their tile form
is better than the decomposed one) and ops a decomposition would get wrong,
plus normalisations with simple tile forms.

The contract every entry keeps: a decomposed op computes every output the op
itself computes. AOTAutograd applies the table below autograd, so an op's own
derivative formula still runs on the decomposed outputs, and its backward op
(often run eagerly) reads them; tests/test_decompositions.py checks each
multi-output entry against the op's own kernel.
"""
from __future__ import annotations

import contextlib
import functools

import torch
from torch._C import DispatchKey
from torch._decomp import core_aten_decompositions, get_decompositions
from torch._decomp.decompositions import log_sigmoid_forward as _core_log_sigmoid_forward

aten = torch.ops.aten

# Lowered as single tile ops: keep them out of the table. std: decomposed it is sqrt of a
# var rounded to the dtype, inf over values near the float max where eager's std (sqrt in
# double) is finite.
_KEEP = [aten.silu, aten.hardswish, aten.hardsigmoid, aten.mish, aten.softplus, aten.std,
         aten.std_mean]

# Kept whole because a decomposition would break the op's contract:
# - SDPA's CPU kernel: core's export-oriented decomposition returns the attention
#   probabilities as its second output where the backward op expects the logsumexp
#   (wrong gradients), and it rejects bf16 under autocast. It runs as one extern
#   ATen op, as Inductor does.
# - random ops: decomposed they draw from torch.rand_like, a different stream than
#   their own kernels (bernoulli_), so compiled dropout would not match eager's mask
#   for the same seed. Whole, they run eagerly and draw exactly what eager draws.
# - multilabel_margin_loss_forward: its decomposition also counts the padding after a
#   target list's -1 end marker (PyTorch's own doc example of F.multilabel_margin_loss
#   gives 2.05 instead of 0.85). PyTorch registers it at the Autograd key too, where it
#   runs during tracing whatever the table says: see python_decompositions_bypassed.
_NOT_DECOMPOSED = [aten._scaled_dot_product_flash_attention_for_cpu, aten.native_dropout,
                   aten.bernoulli, aten.multilabel_margin_loss_forward]

_EXTRA = [
    aten.native_layer_norm,
    aten.native_batch_norm,
    aten._native_batch_norm_legit,
    aten._native_batch_norm_legit_functional,
    aten._native_batch_norm_legit_no_training,
    aten.native_group_norm,
    aten.linalg_vector_norm,
]


# Python decompositions PyTorch registers at the Autograd key (py_impl), which run while
# AOTAutograd traces whatever the table holds, and which compute wrong values.
_WRONG_AUTOGRAD_KERNELS = [aten.multilabel_margin_loss_forward.default]


@contextlib.contextmanager
def python_decompositions_bypassed():
    """Trace with the wrong Autograd-key Python decompositions set aside, so those ops
    keep their own kernel and derivative formula (and run eagerly, whole).

    This edits the ops' Python kernel tables for the duration: a concurrent trace in
    another thread also gets the op's own (correct) kernel meanwhile.
    """
    saved = {}
    for op in _WRONG_AUTOGRAD_KERNELS:
        kernels = getattr(op, "py_kernels", None)
        if kernels is not None and DispatchKey.Autograd in kernels:
            saved[op] = kernels.pop(DispatchKey.Autograd)
            op._dispatch_cache.clear()
    try:
        yield
    finally:
        for op, kernel in saved.items():
            op.py_kernels[DispatchKey.Autograd] = kernel
            op._dispatch_cache.clear()


def _log_sigmoid_forward(x):
    """Core's decomposition, with eager's NaN: its CPU kernel gives the negative NaN for
    any NaN input (``vec::minimum``'s all-ones NaN; the decomposed min(0, x) - log1p(..)
    passes the input's sign on). Signbit and copysign read it (docs/fuzz.md)."""
    out, buffer = _core_log_sigmoid_forward(x)
    return torch.where(out != out, -torch.abs(out), out), buffer


@functools.lru_cache(maxsize=1)
def decomposition_table() -> dict:
    table = dict(core_aten_decompositions())
    table.update(get_decompositions(_EXTRA))
    table[aten.log_sigmoid_forward.default] = _log_sigmoid_forward
    for packet in _KEEP + _NOT_DECOMPOSED:
        for name in packet.overloads():
            table.pop(getattr(packet, name), None)
    return table
