"""The learner's transport: connection groups on anyio, run in a background thread.

:class:`SyncerClient` owns the sockets; the training thread exchanges :mod:`.events` items and
outgoing messages with it through thread-safe queues and never waits on the network.
"""

from .client import ClientConfig, SyncerClient, parse_address
from .errors import (
    FinishStuck,
    FinishTimeout,
    LearnerError,
    NonFiniteParameters,
    SyncerProtocolViolation,
    SyncerRefused,
    SyncerSilent,
    SyncerUnreachable,
)
from .events import ClientFailed, GroupLost, GroupUp, InboxItem, Received, Undelivered
from .group import Counters

__all__ = [
    "ClientConfig",
    "ClientFailed",
    "Counters",
    "FinishStuck",
    "FinishTimeout",
    "GroupLost",
    "GroupUp",
    "InboxItem",
    "LearnerError",
    "NonFiniteParameters",
    "Received",
    "SyncerClient",
    "SyncerProtocolViolation",
    "SyncerRefused",
    "SyncerSilent",
    "SyncerUnreachable",
    "Undelivered",
    "parse_address",
]
