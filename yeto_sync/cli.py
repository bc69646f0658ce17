"""``yeto-sync``'s entry point (its console script and ``python -m yeto_sync``).

It handles the stop signals before anything heavy is imported: the daemon
(:mod:`yeto_sync.daemon`, which documents the command) loads anyio, numpy and ml_dtypes, and
Ctrl+C or SIGTERM meanwhile must end it with its last line (``yeto-sync: SIGTERM while
starting; …``, exit 128 + n), not a ``KeyboardInterrupt`` traceback or a silent death. This
module imports nothing else for that reason.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Sequence

from .stop_signals import StopSignals

#: The file descriptor of stdout.
STDOUT_FD = 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run the daemon; its exit status."""
    _hold_closed_stdout()
    early = None
    if threading.current_thread() is threading.main_thread():
        early = StopSignals("yeto-sync").install()  # records; the daemon makes it raise
    from .daemon import main as run_daemon

    return run_daemon(argv, early)


def _hold_closed_stdout() -> None:
    """Started with stdout closed (``yeto-sync … >&-``), keep descriptor 1 taken by the null
    device: the first file or socket the daemon opens (the event tape, the listener) would get
    it, and what the iso workers it spawns print would go into it. ``sys.stdout`` stays None,
    so the ready line is logged as undelivered."""
    if sys.stdout is not None:
        return
    null = os.open(os.devnull, os.O_WRONLY)
    if null != STDOUT_FD:
        os.dup2(null, STDOUT_FD)
        os.close(null)
