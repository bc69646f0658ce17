"""``yeto-sync``'s entry point (its console script and ``python -m yeto_sync``).

It handles the stop signals before anything heavy is imported: the daemon
(:mod:`yeto_sync.daemon`, which documents the command) loads anyio, numpy and ml_dtypes, and
Ctrl+C or SIGTERM meanwhile must end it with its last line (``yeto-sync: SIGTERM while
starting; …``, exit 128 + n), not a ``KeyboardInterrupt`` traceback or a silent death. This
module imports nothing else for that reason.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from .standard_streams import flush_and_leave, hold_closed_standard_descriptors
from .stop_signals import StopSignals


def main(argv: Sequence[str] | None = None) -> int:
    """Run the daemon; its exit status."""
    # Before anything opens a file: a closed stdout's number would go to the tape or the
    # listener (the ready line is then logged as undelivered: sys.stdout stays None).
    hold_closed_standard_descriptors()
    early = None
    if threading.current_thread() is threading.main_thread():
        early = StopSignals("yeto-sync").install()  # records; the daemon makes it raise
    from .daemon import main as run_daemon
    from .driver import WORK_ABANDONED

    code = run_daemon(argv, early)
    if WORK_ABANDONED.is_set():
        # A stop left an in-process SVD running on a worker thread, which a normal exit would
        # join (minutes): everything kept is on disk and the last line is written, so go now.
        flush_and_leave(code)
    return code
