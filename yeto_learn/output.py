"""What the ``yeto`` commands print on stdout, and a stdout that cannot take it.

A write to stdout that fails for any reason but a closed pipe (``> /dev/full``, a full disk
under ``> file``, an I/O error) raises :class:`OutputFailed`, which ``yeto`` turns into one line
on stderr (``yeto checkpoint inspect: cannot write the output: No space left on device``) and
exit status 1. A closed pipe (``… | head -1``) stays a :class:`BrokenPipeError`: the commands
handle that one quietly. :class:`OutputFailed` is not an :class:`OSError`, so no handler meant
for the commands' own files (a log, an export) mistakes it for theirs.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator


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
