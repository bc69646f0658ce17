"""How long a learner waits for a syncer that has not served it yet: ``connect_timeout`` counted
from the last progress, not from the start (spec/learner.md § 8).

A large model on a slow link (learner 0's INIT, every fragment's first BCAST) takes far longer
than ``connect_timeout`` to move; the wait gives up only once nothing has moved for that long.
"""

from __future__ import annotations

import time

from .group import Counters

#: Bytes sent that count as progress (learner 0's INIT upload); a redialing client resends its
#: HELLOs, which must not.
SENT_PROGRESS_BYTES = 1 << 20


class QuietDeadline:
    """A deadline ``quiet_s`` after the client last made progress: a byte received, or (unless
    ``count_sent`` is False) another :data:`SENT_PROGRESS_BYTES` sent."""

    def __init__(self, counters: Counters, quiet_s: float, *, count_sent: bool = True) -> None:
        self._counters = counters
        self._quiet_s = quiet_s
        self._count_sent = count_sent
        # Written by the client thread; an int read is atomic, a stale one only delays.
        self._received, self._sent = counters.bytes_received, counters.bytes_sent
        self._since = time.monotonic()

    def deadline(self) -> float:
        received, sent = self._counters.bytes_received, self._counters.bytes_sent
        sent_progress = self._count_sent and sent - self._sent >= SENT_PROGRESS_BYTES
        if received != self._received or sent_progress:
            self._received, self._sent, self._since = received, sent, time.monotonic()
        return self._since + self._quiet_s
