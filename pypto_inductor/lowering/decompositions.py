"""The decomposition table AOTAutograd applies before lowering.

PyTorch's core ATen decompositions, minus ops we lower whole (their tile form
is better than the decomposed one), plus normalisations with simple tile forms.
"""
from __future__ import annotations

import functools

import torch
from torch._decomp import core_aten_decompositions, get_decompositions

aten = torch.ops.aten

# Lowered as single tile ops: keep them out of the table.
_KEEP = [aten.silu, aten.hardswish, aten.hardsigmoid, aten.mish, aten.softplus]

_EXTRA = [
    aten.native_layer_norm,
    aten.native_batch_norm,
    aten._native_batch_norm_legit,
    aten._native_batch_norm_legit_functional,
    aten._native_batch_norm_legit_no_training,
    aten.native_dropout,
]


@functools.lru_cache(maxsize=1)
def decomposition_table() -> dict:
    table = dict(core_aten_decompositions())
    table.update(get_decompositions(_EXTRA))
    for packet in _KEEP:
        for name in packet.overloads():
            table.pop(getattr(packet, name), None)
    return table
