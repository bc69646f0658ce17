"""Raise the soft limit on open files to the hard one, so many sockets fit.

Every learner holds ``1 + S`` sockets on the syncer. A login shell's soft ``RLIMIT_NOFILE`` is
often 1,024, which 256 learners with 4 streams already exceed, while the hard limit (which an
unprivileged process may raise its soft limit to) is usually far larger. Without this the
syncer would queue learners it has no descriptors for and the run would stall with the cause
only in its log.
"""

from __future__ import annotations

import resource

#: How far the soft limit is raised where the hard limit is unbounded (Linux's default
#: per-process ceiling, ``fs.nr_open``).
UNBOUNDED_HARD_TARGET = 1 << 20


def raise_open_file_limit() -> tuple[int, int] | None:
    """Raise the soft ``RLIMIT_NOFILE`` as far as the hard limit allows.

    Returns ``(before, after)`` when it changed, ``None`` when it was already there or the
    system refused (the limit is a help, not a requirement: the caller runs with what it has).
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = UNBOUNDED_HARD_TARGET if hard == resource.RLIM_INFINITY else hard
    if soft == resource.RLIM_INFINITY or soft >= target:
        return None
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):  # e.g. a hard limit of infinity above fs.nr_open
        return None
    return soft, target


#: Descriptors a syncer holds besides its learners' sockets: standard streams, the listener,
#: the checkpoint, tape and marker files, the iso workers' pipes, the transport's reserve.
SYNCER_OWN_DESCRIPTORS = 64


def syncer_descriptors(learners: int, streams: int) -> int:
    """Open files a syncer needs at most for ``learners`` with ``streams`` data sockets each."""
    return learners * (1 + streams) + SYNCER_OWN_DESCRIPTORS


def hard_open_file_limit() -> int | None:
    """The hard ``RLIMIT_NOFILE`` (``None``: unbounded), the most a process can raise to."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return None if hard == resource.RLIM_INFINITY else hard
