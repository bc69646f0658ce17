"""Fewer, larger reads of a payload that is read in place: the socket's receive low-water mark.

A reader on an event loop is woken for every segment that lands (64 KiB on loopback), and each
wake-up costs a loop turn, a ``recv_into`` and, between cores or in a VM, an interrupt. While the
next read goes straight into a payload (:meth:`yeto_proto.FrameDecoder.next_read` says
``direct``), every byte it asks for is certain to come, so the reader may tell the kernel
(``SO_RCVLOWAT``) to report the socket readable only once ``min(bytes still wanted, cap)`` bytes
are queued. The last read of a payload waits for exactly its remainder, so nothing is taken in
later than it would have been; headers and small frames wait for a single byte as usual, so a
short frame is never held back. The kernel still reports the socket readable on EOF, on an error
and when its receive window is nearly closed, so a peer that stops mid-payload is noticed as
before. Measured (benchmarks/RESULTS.md, Round): on loopback, a reader on the event loop took
in two 64 MiB payloads with about a third less CPU.

The mark stays at most a quarter of the socket's receive buffer: Linux grows a buffer too small
for the mark it is given and clamps the receive window to it, which would cap a fast long link.
Platforms without the option (or refusing it) simply read as before.

It lives outside :mod:`yeto_sync.transport` and needs only the standard library, so the
learner client's reader (:mod:`yeto_learn.transport.group`) takes it without importing the
syncer's transport.
"""

from __future__ import annotations

import socket

#: The most bytes a read waits for.
READ_WATERMARK_CAP = 1 << 20
_SO_RCVLOWAT: int | None = getattr(socket, "SO_RCVLOWAT", None)


class ReceiveWatermark:
    """One socket's receive low-water mark, set only when it changes."""

    __slots__ = ("_sock", "_cap", "_mark", "_option")

    def __init__(self, sock: socket.socket, cap: int = READ_WATERMARK_CAP) -> None:
        self._sock = sock
        self._cap = cap
        self._mark = 1
        #: The option's number; None where the platform lacks it or refused it.
        self._option = _SO_RCVLOWAT if cap > 1 else None

    @property
    def mark(self) -> int:
        """The bytes the socket currently waits for before it reports readable."""
        return self._mark

    def before_wait(self, wanted: int, direct: bool) -> None:
        """Set the mark for a wait before a read of ``wanted`` bytes (in place if ``direct``)."""
        option = self._option
        if option is None:
            return
        mark = min(wanted, self._cap) if direct else 1
        if mark == self._mark:
            return
        try:
            if mark > 1:
                buffer = self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
                mark = max(1, min(mark, buffer // 4))
            if mark != self._mark:
                self._sock.setsockopt(socket.SOL_SOCKET, option, mark)
                self._mark = mark
        except OSError:
            # Not supported here, or the socket is going away: plain reads from now on, with
            # the mark back at one byte so that a short frame is never held back.
            self._option = None
            if self._mark != 1:
                try:
                    self._sock.setsockopt(socket.SOL_SOCKET, option, 1)
                    self._mark = 1
                except OSError:
                    pass  # the socket is gone: its reader sees that on its next read
