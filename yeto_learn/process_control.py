"""How a ``yeto`` command that runs child processes stops: signals, and children that follow.

``yeto launch`` and ``yeto bench`` share it: the first SIGINT, SIGTERM or SIGHUP (unless it was
ignored at start, as under ``nohup``) becomes a
:class:`Stopped` exception in the main thread, so the command stops its children and prints its
last line, and a child started with :func:`parent_death_signal` is sent SIGTERM if the command
dies without that chance (Linux). :func:`exit_process` ends the ``yeto`` process with the code
its command returned, even when a thread that may be inside torch outlived the command.
:func:`say` prints their status lines, on stderr once nobody reads stdout.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import NoReturn

from yeto_sync.stop_signals import stop_signals

from .output import OutputFailed


@functools.cache
def parent_death_signal() -> Callable[[], None] | None:
    """A pre-exec hook that makes a child get SIGTERM when its parent dies (Linux only).

    Everything is looked up here, in the parent: the hook runs between fork and exec, where a
    multi-threaded parent must not import or allocate.
    """
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1

    def hook() -> None:
        prctl(pr_set_pdeathsig, int(signal.SIGTERM))

    return hook


class Stopped(Exception):
    """SIGINT, SIGTERM or SIGHUP reached the command."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def signals_raise(command: str) -> Iterator[None]:
    """The first SIGINT/SIGTERM/SIGHUP raises :class:`Stopped`; later ones only say so on stderr.

    A second Ctrl+C is common while the children stop: it must not cut that short and leave
    the run without its last line. ``command`` names the command in that note.
    """
    stopping = False

    def handler(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        if stopping:
            # os.write: a print here could re-enter a print the signal interrupted.
            name = signal.Signals(signum).name
            with contextlib.suppress(OSError):
                os.write(2, f"{command}: {name} again; still stopping\n".encode())
            return
        stopping = True
        raise Stopped(signum)

    # SIGHUP too: a closed terminal stops the run the same orderly way (not under nohup).
    previous = {s: signal.signal(s, handler) for s in stop_signals()}
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


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
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError, AttributeError):
                stream.flush()
        os._exit(code)
    sys.exit(code)
