"""The signals that stop a yeto process the orderly way (its last line, its children stopped)."""

from __future__ import annotations

import signal


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
