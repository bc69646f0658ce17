"""How fast the learners' links have recently taken bulk frames: is a streamed BCAST worth it?

Streaming a BCAST behind its merge (:class:`~yeto_sync.payload_progress.PayloadProgress`) pays
when a learner's link is slower than the merge writes the payload: the merge then hides behind
the transfer. Where the link is as fast as memory (loopback, one host) both compete for the same
cores and streaming only adds wake-ups. A socket writer records how long each bulk frame took
on the wire — time in ``sendmsg`` and waiting for the socket, not waiting for a payload — and
the driver streams while the median of the recent frames' rates is below :data:`STREAM_BELOW`.
Single frames are poor witnesses: on loopback, writers sharing one event loop with each other
and with slow readers measured 0.07–8 GB/s per 4 MiB frame (median 2.1), against a steady
0.06 GB/s per socket on an emulated 1 Gbit/s link with two data streams.
"""

from __future__ import annotations

import statistics
from collections import deque

#: Bytes per second per socket under which links count as slow (4 Gbit/s: any WAN link).
STREAM_BELOW = 0.5e9
#: Frames smaller than this say little about a link's rate (latency dominates).
MEASURED_MIN_BYTES = 1 << 20
#: How many recent bulk frames are remembered.
RECENT_FRAMES = 32


class LinkPace:
    """The rates of the last :data:`RECENT_FRAMES` bulk frames, across all sockets."""

    def __init__(self, threshold: float = STREAM_BELOW) -> None:
        self.threshold = threshold
        self._rates: deque[float] = deque(maxlen=RECENT_FRAMES)

    def record(self, nbytes: int, seconds: float) -> None:
        """A frame of ``nbytes`` spent ``seconds`` on the wire (ignored when small)."""
        if nbytes < MEASURED_MIN_BYTES:
            return
        self._rates.append(nbytes / max(seconds, 1e-9))

    @property
    def slow(self) -> bool:
        """True while the recent frames' median rate is below the threshold (or none yet)."""
        return not self._rates or statistics.median(self._rates) < self.threshold
