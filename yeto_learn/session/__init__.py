"""The learner's pure, sans-IO protocol session (numpy and yeto_proto only; no torch, no anyio).

See :mod:`yeto_learn.session.machine` for the driver's contract and spec/learner.md for the
rules it implements.
"""

from .effects import (
    AnchorRecorded,
    ApplyBroadcast,
    ApplyFinal,
    Effect,
    SendMessage,
    ShutdownReceived,
    SyncerFailed,
)
from .machine import LearnerSession, Phase, ReadLocal
from .reconnect import BACKOFF_CAP_S, BACKOFF_INITIAL_S, backoff_delay, fresh_generation
from .versions import Arrival, MonotonicCache, Versioned

__all__ = [
    "AnchorRecorded",
    "ApplyBroadcast",
    "ApplyFinal",
    "Arrival",
    "BACKOFF_CAP_S",
    "BACKOFF_INITIAL_S",
    "Effect",
    "LearnerSession",
    "MonotonicCache",
    "Phase",
    "ReadLocal",
    "SendMessage",
    "ShutdownReceived",
    "SyncerFailed",
    "Versioned",
    "backoff_delay",
    "fresh_generation",
]
