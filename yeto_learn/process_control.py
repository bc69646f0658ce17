"""How a ``yeto`` command that runs child processes stops: signals, and children that follow.

``yeto launch`` and ``yeto bench`` share it. The first SIGINT, SIGTERM or SIGHUP (unless it was
ignored at start, as under ``nohup``) is recorded (:func:`stops_recorded`) and becomes a
:class:`Stopped` exception in the main thread at the command's next safe point, so the command
stops its children and prints its last line. Children are started by :func:`spawn`: no stop
signal is handled inside the fork, and a child is sent SIGTERM if the command dies without that
chance (Linux). :func:`exit_process` ends the ``yeto`` process with the code its command
returned, even when a thread that may be inside torch outlived the command. :func:`say` prints
their status lines, on stderr once nobody reads stdout.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import IO, Any, NoReturn, TypeVar

from yeto_sync.standard_streams import flush_and_leave
from yeto_sync.stop_signals import Stopped, StopSignals, installed, stop_signals

from .output import OutputFailed

__all__ = [
    "StopSignals",
    "Stopped",
    "child_setup",
    "divert_closed_stdout",
    "exit_process",
    "first_line",
    "poll_until",
    "say",
    "spawn",
    "stops_raised",
    "stops_recorded",
]


T = TypeVar("T")

#: Longest wait between two looks at the stop signals.
POLL_S = 0.25


def poll_until(
    ready: Callable[[float], T | None], timeout: float, check: Callable[[], None]
) -> T | None:
    """What ``ready(wait)`` returns once it is not None (``ready`` waits at most ``wait``
    seconds for it), or None after ``timeout`` seconds; ``check`` (which raises
    :class:`Stopped` once a stop signal arrived) is asked at least every :data:`POLL_S`."""
    deadline = time.monotonic() + timeout
    while True:
        check()
        result = ready(min(POLL_S, max(deadline - time.monotonic(), 0.0)))
        if result is not None or time.monotonic() >= deadline:
            return result


def first_line(stdout: IO[str], timeout: float, check: Callable[[], None]) -> str | None:
    """A child's first line on ``stdout`` ("" at its end), or None if none came within
    ``timeout`` seconds; read by a thread, so that ``check`` is asked meanwhile."""
    lines: queue.SimpleQueue[str] = queue.SimpleQueue()
    threading.Thread(target=lambda: lines.put(stdout.readline()), daemon=True).start()

    def taken(wait: float) -> str | None:
        try:
            return lines.get(timeout=wait)
        except queue.Empty:
            return None

    return poll_until(taken, timeout, check)


def child_setup() -> Callable[[], None]:
    """A pre-exec hook for a child of a command that handles the stop signals.

    The child starts with the stop signals at their default actions and unblocked (see
    :func:`spawn`), so that one sent to it before it runs its own program ends it instead of
    running this process's handler in the copy; and on Linux it is sent SIGTERM when its parent
    dies (a parent that died before that was set ends it at once). Everything is looked up
    here, in the parent: the hook runs between fork and exec, where a multi-threaded parent
    must not import or allocate.
    """
    signals = _handled_stop_signals()
    prctl = _prctl()
    parent = os.getpid()
    pr_set_pdeathsig = 1
    sigterm = int(signal.SIGTERM)

    def hook() -> None:
        for signum in signals:
            signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)
        if prctl is not None:
            prctl(pr_set_pdeathsig, sigterm)
            if os.getppid() != parent:  # the parent died before the line above
                os.kill(os.getpid(), sigterm)

    return hook


def _handled_stop_signals() -> tuple[signal.Signals, ...]:
    stops = installed()
    return stops.signals if stops is not None else stop_signals()


@functools.cache
def _prctl() -> Callable[[int, int], int] | None:
    """libc's ``prctl`` (Linux only)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl: Callable[[int, int], int] = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return prctl


def spawn(argv: list[str], **options: Any) -> subprocess.Popen[str]:
    """``subprocess.Popen(argv, **options)`` in a new session, with :func:`child_setup`.

    The stop signals are blocked in this thread while the child is made, so the child starts
    with them blocked: one sent to it before :func:`child_setup` gave them their default actions
    waits for that, instead of running this process's handler in the child's copy. Here the
    handler may still run inside the fork (another thread can take the signal, and the main
    thread runs the handler), so call this only while it records, not
    :attr:`~StopSignals.raising`: the caller meets the signal at its next
    :meth:`~StopSignals.check`, once it holds the child.
    """
    blocked = _handled_stop_signals()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
    try:
        return subprocess.Popen(
            argv,
            start_new_session=True,  # the command alone gets the terminal's Ctrl+C
            preexec_fn=child_setup(),
            **options,
        )
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@contextlib.contextmanager
def stops_recorded(command: str) -> Iterator[StopSignals]:
    """The stop signals recorded for ``command`` during the block, to be met at its safe points.

    The process's :class:`StopSignals` (the ``yeto`` entry point's, which saw any signal that
    came while the command started) is used if there is one, under ``command``'s name; else
    one is installed for the block. A signal arrives as :class:`Stopped` at
    :meth:`StopSignals.check` only: nothing is raised from inside a fork, a ``preexec_fn`` or a
    library, where it could be lost.
    """
    with _stop_handling(command, raising=False) as stops:
        yield stops


@contextlib.contextmanager
def stops_raised(command: str) -> Iterator[StopSignals]:
    """A stop signal raises :class:`Stopped` at once during the block (one that came earlier
    too, as the block starts): for a command that starts no child and waits for nothing, so
    that a long read or write is cut short. Otherwise as :func:`stops_recorded`."""
    with _stop_handling(command, raising=True) as stops:
        stops.check()
        yield stops


@contextlib.contextmanager
def _stop_handling(command: str, *, raising: bool) -> Iterator[StopSignals]:
    stops = installed()
    if stops is None:
        own = StopSignals(command, raising=raising).install()
        try:
            yield own
        finally:
            own.uninstall()
        return
    name, was_raising = stops.command, stops.raising
    stops.command, stops.raising = command, raising
    try:
        yield stops
    finally:
        stops.command, stops.raising = name, was_raising


def divert_closed_stdout() -> None:
    """Point stdout at the null device once its reader went away (``… | head -1``).

    Later writes, and the interpreter's last flush, would fail on the closed pipe as well.
    """
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, sys.stdout.fileno())
    finally:
        os.close(null)


def say(text: str) -> None:
    """A line on stdout; once nobody reads stdout any more, on stderr instead.

    A closed stdout (``yeto launch … | head -1``, a dropped ssh pipe) must not abort a run:
    it goes on, and its status lines go to stderr from then on. Any other failed write (a full
    disk under ``> file``) raises :class:`~yeto_learn.output.OutputFailed`.
    """
    global _stdout_gone
    if not _stdout_gone:
        try:
            print(text, flush=True)
            return
        except BrokenPipeError:
            _stdout_gone = True
            divert_closed_stdout()
        except OSError as exc:  # not a reader gone but a write failed (a full disk): the end
            raise OutputFailed(exc) from None
    print(text, file=sys.stderr, flush=True)


_stdout_gone = False


def exit_process(code: int) -> NoReturn:
    """End the process with ``code``, the exit status a command returned (never in-process).

    Normally through ``sys.exit``. But while a daemon thread is still alive in a process that
    loaded torch, the interpreter must not finalize: CPython (before 3.14) ends such a thread
    with ``pthread_exit`` when it next takes the GIL, and inside a torch op that released the
    GIL that unwinds through a C++ destructor, so the C++ runtime aborts the whole process
    ("terminate called without an active exception", SIGABRT) after the command printed its
    last line. ``yeto bench`` waits only so long for its learner threads: one still importing
    torch, or still dialing a syncer that was stopped, outlives that wait.

    Then the process leaves with ``os._exit`` once stdout, stderr and the logging handlers are
    flushed. Nothing is lost by that: the command returned, so its children were stopped and
    waited for and its files were written and closed (every artifact goes through an atomic
    rename: whole or absent); a daemon thread never runs again after that point, so it could
    not have finished anything either. What is skipped is the rest of the finalization: the
    atexit handlers (logging's is run here) and the C++ static destructors, the very ones
    that abort. Non-daemon threads, which the interpreter waits for, keep the normal exit.
    """
    others = [t for t in threading.enumerate() if t is not threading.main_thread()]
    if "torch" in sys.modules and others and all(t.daemon for t in others):
        logging.shutdown()
        flush_and_leave(code)
    sys.exit(code)
