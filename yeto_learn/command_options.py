"""What ``yeto launch`` and ``yeto bench`` share on their command lines.

Every numeric flag is checked against its whole range before anything starts (one line, exit
2), with upper bounds from the wire's field types or from what the commands can run here:
:func:`out_of_range` words the line.

:func:`make_output_dir` gives a run an output directory of its own: an explicit ``--out`` must
be new (in a directory that exists) or empty, and the default ``./PREFIX-YYYYmmdd-HHMMSS`` is
created atomically, so two runs started in the same second get ``…-HHMMSS`` and ``…-HHMMSS-2``
instead of sharing one.
"""

from __future__ import annotations

import time
from pathlib import Path

from yeto_proto.constants import U32_MAX

#: Help texts of the options both commands have (each shows its own default after it).
WIRE_HELP = (
    "tensor encoding on the wire: f32, bf16, or q4 (4-bit pushes of deltas, bf16 broadcasts; "
    "the final state always travels as f32)"
)

#: Learners one command runs on this machine (``yeto launch``'s processes, ``yeto bench``'s
#: threads), each training a model of its own on the machine's cores. The wire's learner ids go
#: to 2^32-1; no machine runs that many, and past a few per core the rounds only crawl.
MAX_LOCAL_LEARNERS = 256
#: Training examples per local step: 65,536 take some 450 MB more per learner and over a second
#: a step on one core (the demo model); far more would exhaust the memory of the learners.
MAX_BATCH_SIZE = 65536
#: H, local steps between two syncs of a fragment: a learner's steps since its last sync travel
#: as c_steps, a u32.
MAX_SYNC_INTERVAL = U32_MAX

LEARNERS_RANGE = f"1..{MAX_LOCAL_LEARNERS}: each runs on this machine"
BATCH_HELP = (
    "training examples per local step of each learner (one predicted byte each; "
    f"1..{MAX_BATCH_SIZE})"
)
SYNC_INTERVAL_HELP = (
    "H, local steps between two syncs of a fragment (the syncer paces rounds at H x the slowest "
    f"learner's step time / fragments); 1..{MAX_SYNC_INTERVAL}"
)


def out_of_range(flag: str, value: object, low: object, high: object, why: str = "") -> str:
    """The line for a flag outside ``low..high``: ``--learners must be in 1..256, got 300``."""
    reason = f" ({why})" if why else ""
    return f"{flag} must be in {low}..{high}{reason}, got {value}"


def out_help(prefix: str) -> str:
    return (
        "output directory, new (in an existing directory) or empty (default: "
        f"./{prefix}-TIME, -2, -3, … if taken)"
    )


#: The default name takes suffixes -2 … -MAX_SUFFIX before giving up.
MAX_SUFFIX = 1000


class OutputDirError(Exception):
    """The output directory cannot be used; the text is one line naming it and why."""


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc)


def make_output_dir(out: Path | None, prefix: str) -> Path:
    """Create and return the run's output directory, or raise :class:`OutputDirError`.

    ``out`` (``--out``) may name a new directory whose parent exists (only the last part is
    made, as ``yeto-sync`` and ``yeto checkpoint export`` make no directories: a mistyped
    parent must not become a tree of folders) or an empty one; anything else is refused: a
    non-empty directory would mix this run's files with an earlier run's. Without ``out``:
    ``./PREFIX-YYYYmmdd-HHMMSS`` in the working directory, created with ``exist_ok=False``; if
    another run took that name, ``-2``, ``-3``, … is appended.
    """
    if out is None:
        base = Path.cwd() / time.strftime(f"{prefix}-%Y%m%d-%H%M%S")
        for n in range(1, MAX_SUFFIX + 1):
            candidate = base if n == 1 else base.with_name(f"{base.name}-{n}")
            try:
                candidate.mkdir()
            except FileExistsError:
                continue
            except OSError as exc:
                raise OutputDirError(f"cannot create {candidate}: {_reason(exc)}") from None
            return candidate
        raise OutputDirError(f"{base} and its suffixes up to -{MAX_SUFFIX} exist; choose --out")
    try:
        out.mkdir()
        return out
    except FileExistsError:
        pass
    except FileNotFoundError as exc:
        if out.parent.exists():  # /proc/self/x: the parent is there and takes no folder
            raise OutputDirError(f"--out {out}: {_reason(exc)}") from None
        raise OutputDirError(
            f"--out {out}: {out.parent} does not exist (only the last part of --out is made)"
        ) from None
    except OSError as exc:  # a parent is a file, no permission, …
        raise OutputDirError(f"--out {out}: {_reason(exc)}") from None
    if not out.is_dir():
        raise OutputDirError(f"--out {out} exists and is not a directory")
    try:
        occupied = any(out.iterdir())
    except OSError as exc:
        raise OutputDirError(f"--out {out}: {_reason(exc)}") from None
    if occupied:
        raise OutputDirError(
            f"--out {out} exists and is not empty (an earlier run's?); choose a new or empty "
            "directory"
        )
    return out
