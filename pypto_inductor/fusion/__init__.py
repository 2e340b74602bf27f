"""TileGraph -> FusionPlan: FusionTiles, extern ops and every decision with its ROI."""
from .capacity import Domain, TilePlan, plan_tile
from .planner import Decision, FusionPlan, compute_dtype, plan_fusion
from .roi import CostModel, RoiEstimate

__all__ = ["CostModel", "Decision", "Domain", "FusionPlan", "RoiEstimate", "TilePlan",
           "compute_dtype", "plan_fusion", "plan_tile"]
