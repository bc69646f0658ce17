"""yeto_learn: the learner side of YETO v4 and the ``yeto`` command.

Importing this package is cheap: it pulls in no torch. ``yeto_learn.Learner`` (and the error
classes) are resolved on first use by the module ``__getattr__`` below, which imports torch
only then; the command line imports torch only for the subcommand that runs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .learner import Learner, LearnerStats
    from .transport import (
        FinishStuck,
        FinishTimeout,
        LearnerError,
        NonFiniteParameters,
        SyncerProtocolViolation,
        SyncerRefused,
        SyncerSilent,
        SyncerUnreachable,
    )

#: Public name → the module that defines it (imported on first access).
_LAZY = {
    "Learner": ".learner",
    "LearnerStats": ".learner",
    "LearnerError": ".transport",
    "FinishStuck": ".transport",
    "FinishTimeout": ".transport",
    "NonFiniteParameters": ".transport",
    "SyncerProtocolViolation": ".transport",
    "SyncerRefused": ".transport",
    "SyncerSilent": ".transport",
    "SyncerUnreachable": ".transport",
}

__all__ = [
    "FinishStuck",
    "FinishTimeout",
    "Learner",
    "LearnerError",
    "LearnerStats",
    "NonFiniteParameters",
    "SyncerProtocolViolation",
    "SyncerRefused",
    "SyncerSilent",
    "SyncerUnreachable",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
