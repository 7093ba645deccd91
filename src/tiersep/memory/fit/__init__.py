"""The budget decisions: whether an estimate fits, and what fits when it does not.

gate.py     the fit gate a run passes before it allocates anything: the estimate, or DoesNotFit
search.py   the nearest variant of a preset that fits a budget (FitSearch, fit), or NothingFits
matrix.py   what fits which GPU (`tiersep fit --gpus`): a FitSearch per preset and GPU
cost.py     what a change costs in time (the recomputation of checkpointing), for choosing a fit
settings.py GateSettings: the safety margin and calibration every decision above is made with
"""
from tiersep.config import DoesNotFit

from .gate import gate
from .search import FitSearch, Fitted, NothingFits, fit, fitted_name
from .settings import GateSettings

__all__ = ["gate", "DoesNotFit", "FitSearch", "Fitted", "GateSettings", "NothingFits", "fit", "fitted_name"]
