"""Learning-rate sweeps: a grid of training runs in one directory, resumable and shared by many workers,
and the report that turns it into the papers' figures and a transfer verdict."""

from moga.sweep.spec import Sweep, SweepError, SweepSpec, cell_id
from moga.sweep.store import SweepStore

__all__ = ["Sweep", "SweepError", "SweepSpec", "SweepStore", "cell_id"]
