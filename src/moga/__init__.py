"""moga: geometry-aware optimizers whose learning rate transfers across width and depth."""

from moga.geometry import Col, Embedding, Geometry, Row, Sign, Spectral, Vector, parse_geometry
from moga.optim import MOGA, GeometryOptimizer, Muon, ScaledAdamW
from moga.roles import RolePlan, build_plan

__version__ = "0.1.0"

__all__ = [
    "Col", "Embedding", "Geometry", "Row", "Sign", "Spectral", "Vector", "parse_geometry",
    "MOGA", "GeometryOptimizer", "Muon", "ScaledAdamW", "RolePlan", "build_plan",
]
