"""Transports: sockets (or in-memory pipes) in, coordinator events out; actions in, bytes out.

Both transports share :class:`~yeto_sync.transport.group.ConnectionGroups`, which decides every
protocol question (handshakes, groups, striping, reassembly, errors); a transport only moves
bytes and keeps time. The driver (:mod:`yeto_sync.driver`) talks to either through
:class:`Transport`.
"""

from __future__ import annotations

import time
from typing import Protocol

from yeto_proto import AnyMessage, ErrorMessage, Limits

from ..events import ConnId, Event, GroupKey
from ..payload_progress import PayloadProgress
from .group import ConnectionGroups, Hangup, Transmit, WireCommand, error_text


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic clock."""
        ...


class MonotonicClock:
    def now(self) -> float:
        return time.monotonic()


class Transport(Protocol):
    """What the driver needs from a transport to carry out the coordinator's actions."""

    def admit(self, conn: ConnId, group: GroupKey, num_streams: int, limits: Limits) -> None: ...

    def refuse(self, conn: ConnId, error: ErrorMessage) -> None: ...

    async def send(
        self, group: GroupKey, message: AnyMessage, progress: PayloadProgress | None = None
    ) -> None:
        """Queue ``message`` to ``group``; waits (bounded) while the group's queues are full.

        With ``progress`` (see :class:`~yeto_sync.events.Send`) no byte goes out before it is
        final, and a withdrawn payload cuts the group's connections once some of it was sent
        (one still waiting to be sent is dropped).
        """
        ...

    def close_group(self, group: GroupKey, error: ErrorMessage | None) -> None: ...

    async def shutdown(self, grace: float) -> None:
        """Stop accepting, flush what is queued within ``grace`` seconds, close everything."""
        ...


class EventSource(Protocol):
    async def next_event(self, until: float | None) -> Event | None:
        """The next event, or ``None`` once the clock reaches ``until`` (a timer is due)."""
        ...


__all__ = [
    "Clock",
    "ConnectionGroups",
    "EventSource",
    "Hangup",
    "MonotonicClock",
    "Transmit",
    "Transport",
    "WireCommand",
    "error_text",
]
