"""A process started with a standard descriptor closed (``… >&-``, ``2>&-``, ``<&-``).

The first file or socket such a process opens takes the free number (an event tape on
descriptor 1, a listener on 0), and every child it spawns inherits it as its stdin, stdout
or stderr. Python also leaves ``sys.stderr`` None then, so a ``print(file=sys.stderr)``
falls back to stdout (``yeto``'s error lines went into its output) or fails (``yeto-sync``
exited 1 at once). Both entry points call :func:`hold_closed_standard_descriptors` first.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from typing import NoReturn

#: stdin, stdout and stderr.
STANDARD_FDS = (0, 1, 2)
STDERR_FD = 2


def hold_closed_standard_descriptors() -> None:
    """Put the null device on each closed standard descriptor, and a ``sys.stderr`` on it
    when there was none (what is logged there is lost; the command runs on). ``sys.stdout``
    stays as it is: each command handles a stdout without a reader its own way."""
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


def flush_and_leave(code: int) -> NoReturn:
    """Flush stdout and stderr (whichever are still there), then end the process at once with
    ``code``: no interpreter finalization, which would join or unwind threads still running."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):  # closed, or None
            stream.flush()
    os._exit(code)
