"""TCP options under which a connection to a peer that fell silent fails in bounded time.

A peer that exits sends FIN or RST at once. A pulled cable, a NAT that forgot the flow or a
partitioned network leave silence instead, and Linux's defaults wait long: unacknowledged data
is retransmitted for about 15 minutes (``tcp_retries2``), and keepalive probes start after two
hours. Meanwhile a round that captured the silent learner waits through every quorum retry, and
a learner whose syncer fell silent trains on alone. The syncer and the learner set, on every
socket:

- ``TCP_USER_TIMEOUT``: data the peer has not acknowledged for ``timeout_s`` fails the
  connection (``ETIMEDOUT``);
- keepalive probes after :data:`KEEPALIVE_IDLE_S` of quiet, so an idle connection to a
  silent peer fails in about ``timeout_s`` too.

A live peer's kernel acknowledges data and probes whatever its program is doing, with one
exception: Linux also ends a connection whose peer keeps its receive window shut (reads
nothing) for ``timeout_s``. The callers therefore pass twice their own send-stall bound, so
that a program's own, better informed stall rule decides first wherever it applies.
Options the platform lacks or refuses are skipped: the bound is a help, not a requirement.
"""

from __future__ import annotations

import math
import socket

#: The silence bound as a multiple of the caller's send-stall bound (see the module docstring).
SILENCE_FACTOR = 2.0
#: Quiet before the first keepalive probe, and between probes.
KEEPALIVE_IDLE_S = 15
KEEPALIVE_INTERVAL_S = 5


def bound_silence(sock: socket.socket, timeout_s: float) -> None:
    """Make ``sock`` fail once its peer has been silent for about ``timeout_s`` seconds."""
    if not math.isfinite(timeout_s) or timeout_s <= 0:
        return  # no bound asked for
    idle = max(1, min(KEEPALIVE_IDLE_S, int(timeout_s / 4)))
    interval = max(1, min(KEEPALIVE_INTERVAL_S, int(timeout_s / 12)))
    probes = max(1, int((timeout_s - idle) / interval))
    options = [
        (socket.SOL_SOCKET, getattr(socket, "SO_KEEPALIVE", None), 1),
        (socket.IPPROTO_TCP, getattr(socket, "TCP_USER_TIMEOUT", None), int(timeout_s * 1000)),
        (socket.IPPROTO_TCP, getattr(socket, "TCP_KEEPIDLE", None), idle),
        (socket.IPPROTO_TCP, getattr(socket, "TCP_KEEPINTVL", None), interval),
        (socket.IPPROTO_TCP, getattr(socket, "TCP_KEEPCNT", None), probes),
    ]
    for level, option, value in options:
        if option is None:
            continue
        try:
            sock.setsockopt(level, option, value)
        except OSError:  # e.g. ENOPROTOOPT in a sandboxed network stack
            continue
