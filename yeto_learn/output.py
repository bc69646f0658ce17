"""What the ``yeto`` commands print on stdout, and a stdout that cannot take it.

A write to stdout that fails for any reason but a closed pipe (``> /dev/full``, a full disk
under ``> file``, an I/O error) raises :class:`OutputFailed`, which ``yeto`` turns into one line
on stderr (``yeto checkpoint inspect: cannot write the output: No space left on device``) and
exit status 1. A closed pipe (``… | head -1``) stays a :class:`BrokenPipeError`: the commands
handle that one quietly, and a stdout closed from the start (``… >&-``) is made one
(:func:`stand_in_for_closed_stdout`). :class:`OutputFailed` is not an :class:`OSError`, so no
handler meant for the commands' own files (a log, an export) mistakes it for theirs.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

#: The file descriptor of stdout.
STDOUT_FD = 1


class OutputFailed(Exception):
    """stdout could not be written; ``reason`` says why (``No space left on device``)."""

    def __init__(self, error: OSError) -> None:
        self.reason = error.strerror or str(error)
        super().__init__(self.reason)


@contextlib.contextmanager
def stdout_writes() -> Iterator[None]:
    """Turn the OSError of a write to stdout inside into :class:`OutputFailed` (a closed pipe
    stays a :class:`BrokenPipeError`)."""
    try:
        yield
    except BrokenPipeError:
        raise
    except OSError as exc:
        raise OutputFailed(exc) from None


def out(text: str) -> None:
    """``text`` and a newline on stdout, flushed: a failure shows here, not at exit."""
    with stdout_writes():
        print(text, flush=True)


def flush_stdout() -> None:
    """Write out what stdout still buffers, before the interpreter's own last flush (which
    would report a failure as a traceback, or not at all)."""
    with stdout_writes():
        sys.stdout.flush()


def stand_in_for_closed_stdout() -> None:
    """If the process started with its stdout closed (``yeto … >&-``: Python's ``sys.stdout``
    is None, and ``print`` drops every line silently), put on descriptor 1 a pipe whose read end
    is closed, and ``sys.stdout`` on it.

    A closed stdout is then what the commands already handle, a reader that went away: each
    write fails with a :class:`BrokenPipeError`, so status lines move to stderr and an output
    ends quietly with 141. And no file opened later takes descriptor 1, where a child or a
    stray write would put stdout's bytes into it.
    """
    if sys.stdout is not None:
        return
    read_end, write_end = os.pipe()
    if write_end != STDOUT_FD:
        os.dup2(write_end, STDOUT_FD)  # if the read end was descriptor 1, this closes it
        os.close(write_end)
    if read_end != STDOUT_FD:
        os.close(read_end)
    sys.stdout = open(STDOUT_FD, "w", closefd=False)
