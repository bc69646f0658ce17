"""The final marker ``<checkpoint-path>.final``: proof that a checkpoint is a run's terminal state.

Its bytes are exactly ``YETO_FINAL_V1\\nglobal_step=<decimal>\\n`` (canonical decimal: no sign,
no leading zeros). The syncer writes it atomically, only after the terminal checkpoint. A
checkpoint counts as a marked final state only when the marker exists, parses, and names the
checkpoint's own global step; any other marker (say one left from an earlier run) does not.
"""

from __future__ import annotations

import enum
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..constants import U64_MAX
from ..errors import CheckpointError, ErrorCode
from .atomic import fsync_path, io_error, open_regular_file, write_bytes_atomically

MARKER_SUFFIX = ".final"
_HEADER = b"YETO_FINAL_V1\n"
_PATTERN = re.compile(rb"YETO_FINAL_V1\nglobal_step=(0|[1-9][0-9]{0,19})\n")
#: Longest valid marker (a 20-digit step); anything longer is refused without reading it all.
MAX_MARKER_SIZE = len(_HEADER) + len(b"global_step=\n") + 20


def marker_path(checkpoint_path: str | os.PathLike[str]) -> Path:
    return Path(os.fspath(checkpoint_path) + MARKER_SUFFIX)


def final_marker_bytes(global_step: int) -> bytes:
    if not 0 <= global_step <= U64_MAX:
        raise ValueError(f"global_step {global_step} is not a u64")
    return _HEADER + b"global_step=%d\n" % global_step


def parse_final_marker(data: bytes, *, where: str = "marker") -> int:
    """The global step a marker names; ``CKPT_BAD_MARKER`` unless the bytes are exact."""
    match = _PATTERN.fullmatch(data)
    step = int(match.group(1)) if match else -1
    if not 0 <= step <= U64_MAX:
        raise CheckpointError(
            ErrorCode.CKPT_BAD_MARKER,
            f"not exactly 'YETO_FINAL_V1\\nglobal_step=<u64 decimal>\\n' (file {where})",
            section="marker",
        )
    return step


def write_final_marker(checkpoint_path: str | os.PathLike[str], global_step: int) -> Path:
    """Atomically create the marker; call it only after the terminal checkpoint is durable."""
    path = marker_path(checkpoint_path)
    write_bytes_atomically(path, final_marker_bytes(global_step))
    return path


def remove_final_marker(checkpoint_path: str | os.PathLike[str]) -> bool:
    """Durably remove the checkpoint's marker, if there is one; True if there was.

    Call it as the checkpoint file is replaced: a marker describes the file it sits beside,
    and one left from before a resume could otherwise name the step of a later periodic
    checkpoint and make it read as a final cut. ``OSError`` becomes ``CKPT_IO``.
    """
    path = marker_path(checkpoint_path)
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise io_error(path, exc, section="remove") from exc
    try:
        fsync_path(path.parent)
    except OSError as exc:
        raise io_error(path, exc, section="remove") from exc
    return True


class MarkerStatus(enum.Enum):
    ABSENT = "absent"
    #: Present, parsable, and names the checkpoint's global step.
    FINAL = "final"
    #: Present and parsable, but for another global step.
    STEP_MISMATCH = "step-mismatch"
    #: Present but not a valid marker (or unreadable).
    INVALID = "invalid"


@dataclass(frozen=True, slots=True)
class MarkerState:
    status: MarkerStatus
    #: The step the marker names, when it parses.
    marker_step: int | None
    detail: str

    @property
    def is_final(self) -> bool:
        return self.status is MarkerStatus.FINAL


def marker_state(checkpoint_path: str | os.PathLike[str], global_step: int) -> MarkerState:
    """Whether the checkpoint at ``checkpoint_path`` (at ``global_step``) is marked final."""
    path = marker_path(checkpoint_path)
    try:
        with open_regular_file(path) as file:
            data = file.read(MAX_MARKER_SIZE + 1)
    except FileNotFoundError:
        return MarkerState(MarkerStatus.ABSENT, None, f"no {path.name}")
    except OSError as exc:
        return MarkerState(MarkerStatus.INVALID, None, f"{path}: {exc.strerror or exc}")
    try:
        step = parse_final_marker(data, where=str(path))
    except CheckpointError as exc:
        return MarkerState(MarkerStatus.INVALID, None, str(exc))
    if step != global_step:
        return MarkerState(
            MarkerStatus.STEP_MISMATCH,
            step,
            f"marker names global_step {step}, the checkpoint is at {global_step}",
        )
    return MarkerState(MarkerStatus.FINAL, step, f"marked final at global_step {step}")


def is_marked_final(checkpoint_path: str | os.PathLike[str], global_step: int) -> bool:
    return marker_state(checkpoint_path, global_step).is_final
