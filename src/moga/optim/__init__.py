"""Thin ``torch.optim.Optimizer`` shells over the geometries."""

from moga.optim.adamw_scaled import ScaledAdamW
from moga.optim.base import GeometryOptimizer
from moga.optim.moga import MOGA
from moga.optim.muon import Muon

__all__ = ["GeometryOptimizer", "MOGA", "Muon", "ScaledAdamW"]
