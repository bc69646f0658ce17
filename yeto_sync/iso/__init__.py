"""The ``torch-svd`` iso backend: a pool of worker processes running exact f64 SVDs with torch.

torch is imported only inside the workers; importing this package does not import it.
"""

from .pool import (
    IsoJob,
    IsoPoolClosed,
    IsoPoolError,
    IsoPoolPoisoned,
    IsoPoolSettings,
    IsoPoolStartupError,
    IsoSolveError,
    IsoWorkerPool,
)
from .worker import FaultMode, FaultPlan

__all__ = [
    "FaultMode",
    "FaultPlan",
    "IsoJob",
    "IsoPoolClosed",
    "IsoPoolError",
    "IsoPoolPoisoned",
    "IsoPoolSettings",
    "IsoPoolStartupError",
    "IsoSolveError",
    "IsoWorkerPool",
]
