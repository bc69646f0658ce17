"""What the client thread hands to the training thread, in order, through its inbox.

Each item names the connection *epoch* (the client's count of connection groups) it belongs
to, so the training thread can tell messages of a dead group from those of the current one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

from yeto_proto import AnyMessage

from .errors import LearnerError


@dataclass(frozen=True, slots=True)
class GroupUp:
    """A new connection group is open: HELLO and every DATA_HELLO are on their way."""

    epoch: int
    generation: int
    num_streams: int


@dataclass(frozen=True, slots=True)
class GroupLost:
    """The group of ``epoch`` is gone (all its sockets closed); a redial may follow."""

    epoch: int
    reason: str


@dataclass(frozen=True, slots=True)
class Received:
    """A decoded message from the syncer (CHUNKs already reassembled)."""

    epoch: int
    message: AnyMessage


@dataclass(frozen=True, slots=True)
class Undelivered:
    """``message`` was meant for the group of ``epoch``, and not one byte of it was sent.

    Either that group was gone when the message was dispatched, or it died while the message
    still waited behind other frames.

    The training thread decides whether it belongs on the next group (BUDGET_DONE does: the
    syncer never saw it) or died with its group (pushes, acks).
    """

    epoch: int
    message: AnyMessage


@dataclass(frozen=True, slots=True)
class ClientFailed:
    """The client stopped for good; the training loop raises ``error``."""

    error: LearnerError


InboxItem: TypeAlias = GroupUp | GroupLost | Received | Undelivered | ClientFailed
