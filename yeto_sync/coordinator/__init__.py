"""The syncer's pure, deterministic coordinator: events and ``now`` in, actions out."""

from .admission import Refusal, SessionIdentity
from .core import EXIT_FAILURE, EXIT_OK, FINAL_ACK_TIMER, LAUNCH_TIMER, Coordinator
from .rounds import Phase, Round

__all__ = [
    "EXIT_FAILURE",
    "EXIT_OK",
    "FINAL_ACK_TIMER",
    "LAUNCH_TIMER",
    "Coordinator",
    "Phase",
    "Refusal",
    "Round",
    "SessionIdentity",
]
