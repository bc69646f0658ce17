"""TCP options under which a connection to a peer that fell silent fails in bounded time.

A peer that exits sends FIN or RST at once. A pulled cable, a NAT that forgot the flow or a
partitioned network leave silence instead, and Linux's defaults wait long: unacknowledged data
is retransmitted for about 15 minutes (``tcp_retries2``), and keepalive probes start after two
hours. Meanwhile a round that captured the silent learner waits through every quorum retry, and
a learner whose syncer fell silent trains on alone. The syncer and the learner set, on every
socket:

- ``TCP_USER_TIMEOUT``: data the peer has not acknowledged for ``timeout_s`` fails the
  connection (``ETIMEDOUT``), the same bound as a send that makes no progress;
- keepalive probes after :data:`KEEPALIVE_IDLE_S` of quiet, so an idle connection to a
  silent peer fails within about ``timeout_s`` too.

A live peer's kernel acknowledges data and probes even while its program is busy, so only
silence of the network itself trips either. Options the platform lacks are skipped.
"""

from __future__ import annotations

import socket

#: Quiet before the first keepalive probe, and between probes.
KEEPALIVE_IDLE_S = 15
KEEPALIVE_INTERVAL_S = 5


def bound_silence(sock: socket.socket, timeout_s: float) -> None:
    """Make ``sock`` fail once its peer has been silent for about ``timeout_s`` seconds."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle = max(1, min(KEEPALIVE_IDLE_S, int(timeout_s / 4)))
    interval = max(1, min(KEEPALIVE_INTERVAL_S, int(timeout_s / 12)))
    probes = max(1, int((timeout_s - idle) / interval))
    for name, value in (
        ("TCP_USER_TIMEOUT", int(timeout_s * 1000)),
        ("TCP_KEEPIDLE", idle),
        ("TCP_KEEPINTVL", interval),
        ("TCP_KEEPCNT", probes),
    ):
        option = getattr(socket, name, None)
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)
