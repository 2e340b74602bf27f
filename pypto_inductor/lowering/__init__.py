"""ATen FX graph -> TileGraph. Importing this package registers every lowering."""
from . import (  # noqa: F401  (registration)
    composite, indexing, layout, matmul, mutation, pointwise, reduction)
from .decompositions import decomposition_table
from .graph import EAGER_BY_CHOICE, GraphNotLowerable, LoweringContext, lower_graph
from .registry import LOWERINGS, Unsupported, lowered_op_names, register_lowering

__all__ = [
    "EAGER_BY_CHOICE", "GraphNotLowerable", "LOWERINGS", "LoweringContext", "Unsupported",
    "decomposition_table", "lower_graph", "lowered_op_names", "register_lowering",
]
