"""How much of a payload that is still being written may already go on the wire.

A commit can start its BCAST before the merge has finished writing the broadcast bytes: the
merge advances a :class:`PayloadProgress` as its blocks complete, in ascending order, and the
transport sends each piece of the message once the bytes under it are final. A merge that fails
withdraws the payload (:meth:`PayloadProgress.withdraw`); a sender that meets a withdrawn
payload must cut the connection so the peer never completes the message.

The producer runs on merge threads and the consumers on the event loop, so every method is
thread-safe, and listeners are called on the producer's thread (they must only hand off).
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class PayloadWithdrawn(Exception):
    """The payload will never be completed (its merge failed); what was sent is void."""


class PayloadProgress:
    """The leading ``ready`` bytes of a ``total``-byte payload are final; only grows."""

    def __init__(self, total: int) -> None:
        if total < 0:
            raise ValueError("a payload has a non-negative size")
        self.total = total
        self._ready = 0
        self._withdrawn = False
        self._lock = threading.Lock()
        self._listeners: list[Callable[[], None]] = []

    @property
    def ready(self) -> int:
        """Bytes from the start that are final; raises :class:`PayloadWithdrawn` if withdrawn."""
        if self._withdrawn:
            raise PayloadWithdrawn("the payload was withdrawn")
        return self._ready

    @property
    def complete(self) -> bool:
        return not self._withdrawn and self._ready == self.total

    @property
    def withdrawn(self) -> bool:
        return self._withdrawn

    def advance(self, ready: int) -> None:
        """The first ``ready`` bytes are final (a smaller value than before changes nothing)."""
        with self._lock:
            if self._withdrawn or ready <= self._ready:
                return
            self._ready = min(ready, self.total)
            listeners = list(self._listeners)
        for listener in listeners:
            listener()

    def finish(self) -> None:
        self.advance(self.total)

    def withdraw(self) -> None:
        """The payload will not be completed; every waiting consumer is told."""
        with self._lock:
            if self._withdrawn or self._ready == self.total:
                return
            self._withdrawn = True
            listeners = list(self._listeners)
        for listener in listeners:
            listener()

    def subscribe(self, listener: Callable[[], None]) -> Callable[[], None]:
        """Call ``listener`` after every change, until the returned function is called."""
        with self._lock:
            self._listeners.append(listener)

        def unsubscribe() -> None:
            with self._lock:
                if listener in self._listeners:
                    self._listeners.remove(listener)

        return unsubscribe
