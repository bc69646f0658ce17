"""``yeto-sync``'s entry point (its console script and ``python -m yeto_sync``).

It handles the stop signals before anything heavy is imported: the daemon
(:mod:`yeto_sync.daemon`, which documents the command) loads anyio, numpy and ml_dtypes, and
Ctrl+C or SIGTERM meanwhile must end it with its last line (``yeto-sync: SIGTERM while
starting; …``, exit 128 + n), not a ``KeyboardInterrupt`` traceback or a silent death. This
module imports nothing else for that reason.
"""

from __future__ import annotations

import errno
import os
import sys
import threading
from collections.abc import Sequence

from .stop_signals import StopSignals

#: stdin, stdout and stderr.
STANDARD_FDS = (0, 1, 2)
STDERR_FD = 2


def main(argv: Sequence[str] | None = None) -> int:
    """Run the daemon; its exit status."""
    _hold_closed_standard_descriptors()
    early = None
    if threading.current_thread() is threading.main_thread():
        early = StopSignals("yeto-sync").install()  # records; the daemon makes it raise
    from .daemon import main as run_daemon

    return run_daemon(argv, early)


def _hold_closed_standard_descriptors() -> None:
    """Started with a standard descriptor closed (``yeto-sync … >&-``, ``2>&-``, ``<&-``),
    put the null device there: the first file or socket the daemon opens (the event tape, the
    listener) would take the free number, and the iso workers it spawns would print into it.
    ``sys.stdout`` stays None, so the ready line is logged as undelivered; a closed stderr
    gets a ``sys.stderr`` on the null device (the log is lost, the daemon serves on: writing
    to a None stderr ended it at once with exit 1)."""
    for fd in STANDARD_FDS:
        try:
            os.fstat(fd)
        except OSError as exc:
            if exc.errno != errno.EBADF:  # open, whatever else failed
                continue
            null = os.open(os.devnull, os.O_RDONLY if fd == 0 else os.O_WRONLY)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
    if sys.stderr is None:
        # As Python's own stderr: never an encoding error, each line written as it comes.
        sys.stderr = open(  # noqa: SIM115 - for the whole run
            STDERR_FD, "w", buffering=1, errors="backslashreplace", closefd=False
        )
