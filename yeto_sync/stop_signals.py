"""The signals that stop a yeto process the orderly way (its last line, its children stopped),
and how a process notices them.

Each console entry point installs a :class:`StopSignals` first thing, before it imports numpy,
anyio or torch: a signal that arrives while those load is recorded, not met by Python's default
actions (a ``KeyboardInterrupt`` traceback from inside an import, or death by SIGTERM without a
word), and the command then stops with its last line. This module imports nothing else for that
reason.

A handler runs wherever the main thread happens to be, which can be code that cannot take an
exception: ``os.fork``'s hooks (logging's ``_releaseLock``, threading's ``_after_fork``), a
``preexec_fn``, a ``__del__``. There the interpreter prints "Exception ignored in …" and goes on,
and a stop raised there is lost. So by default the handler only records the signal, and the
program asks :meth:`StopSignals.check` at its safe points (between child starts, in its wait
loops), which raises :class:`Stopped` there. Straight-line commands that start no child and
wait for nothing (``yeto checkpoint …``) set :attr:`StopSignals.raising`: the handler then
raises at once, so a long read or write is cut short.
"""

from __future__ import annotations

import contextlib
import os
import signal
from types import FrameType


def stop_signals() -> tuple[signal.Signals, ...]:
    """SIGINT, SIGTERM and SIGHUP (a closed terminal or ssh session), as this process found them.

    SIGHUP only where the platform has it and the process was not started ignoring it: under
    ``nohup`` a closed terminal must go on leaving the process running. Call it before
    installing handlers for these signals.
    """
    found = [signal.SIGINT, signal.SIGTERM]
    hangup = getattr(signal, "SIGHUP", None)
    if hangup is not None and signal.getsignal(hangup) is not signal.SIG_IGN:
        found.append(hangup)
    return tuple(found)


class Stopped(BaseException):
    """A stop signal (SIGINT, SIGTERM or SIGHUP) reached the process.

    A ``BaseException``, as ``KeyboardInterrupt`` is: an ``except Exception`` on its way must not
    take it for an error and carry on.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopSignals:
    """This process's handler of the stop signals, and what it received.

    The first signal is kept in :attr:`received`; :meth:`check` turns it into :class:`Stopped`
    and marks the stop as under way (:attr:`stopping`). Every later signal only says on stderr
    that the command is still stopping: a second Ctrl+C is common while children stop, and it
    must not cut that short and leave the run without its last line. A recorded signal cannot
    be lost, so nothing needs a later signal to escalate. With :attr:`raising`, the first signal
    raises :class:`Stopped` from the handler itself and marks the stop as under way; should that
    exception be swallowed ("Exception ignored in …"), the next :meth:`check` raises it again.
    """

    def __init__(self, command: str, *, raising: bool = False) -> None:
        #: The program's name in the "still stopping" note (``yeto launch``, ``yeto-sync``).
        self.command = command
        self.raising = raising
        self.received: int | None = None
        self.stopping = False
        self.signals: tuple[signal.Signals, ...] = ()
        self._previous: dict[signal.Signals, signal._HANDLER] = {}
        self._outer: StopSignals | None = None

    def install(self) -> StopSignals:
        """Handle the stop signals from now on (the main thread only, as Python requires)."""
        global _installed
        self.signals = stop_signals()
        self._previous = {s: signal.signal(s, self._handle) for s in self.signals}
        self._outer, _installed = _installed, self
        return self

    def uninstall(self) -> None:
        """Put back the handlers :meth:`install` replaced."""
        global _installed
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}
        _installed = self._outer

    def check(self) -> None:
        """Raise :class:`Stopped` if a stop signal arrived: a safe point of the normal flow.

        From here on the stop is under way. Call it only where the program goes on normally
        (not while it handles a stop), so that an exception the interpreter swallowed is
        raised again.
        """
        if self.received is not None:
            self.stopping = True
            raise Stopped(self.received)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.stopping or (self.received is not None and not self.raising):
            note(f"{self.command}: {signal.Signals(signum).name} again; still stopping")
            return
        if self.received is None:
            self.received = signum
        if self.raising:
            self.stopping = True
            raise Stopped(self.received)


_installed: StopSignals | None = None


def installed() -> StopSignals | None:
    """The :class:`StopSignals` handling this process's stop signals now, if one does."""
    return _installed


def note(text: str) -> None:
    """A line on stderr from a signal handler.

    ``os.write``: a ``print`` here could re-enter a ``print`` the signal interrupted.
    """
    with contextlib.suppress(OSError):
        os.write(2, f"{text}\n".encode())


def ignore_stop_signals(signals: tuple[signal.Signals, ...]) -> None:
    """Ignore ``signals`` from now on: the process has its last line and is only exiting.

    A handler would be removed while the interpreter finalizes, and a signal then would kill the
    process after its last line; an ignored signal stays ignored.
    """
    for signum in signals:
        signal.signal(signum, signal.SIG_IGN)
