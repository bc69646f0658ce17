"""Checkpoints: the V1/V2/V3 file formats, their reader and V3 writer, resume rules, final marker.

The bytes are declared in :mod:`.schema` and described in ``spec/checkpoint.md``;
``conformance/checkpoints/`` pins them with golden files.
"""

from __future__ import annotations

from .atomic import (
    UNSYNCED_RENAME,
    atomic_replace,
    check_name_length,
    io_error,
    name_length_problem,
    orphaned_temporaries,
    remove_orphaned_temporaries,
    remove_temporaries,
    temporaries_written_by,
    write_bytes_atomically,
)
from .export import ExportedTensors, LegacyIdentity, export_tensors, load_layout, verify_identity
from .marker import (
    MarkerState,
    MarkerStatus,
    final_marker_bytes,
    is_marked_final,
    marker_path,
    marker_state,
    parse_final_marker,
    remove_final_marker,
    write_final_marker,
)
from .model import (
    F32,
    Checkpoint,
    CheckpointFormat,
    F32Array,
    FragmentState,
    LedgerEntry,
    TrailerKind,
    iso_backend_name,
)
from .reader import read_checkpoint
from .resume import (
    ResumeDecision,
    ResumeRefusal,
    refusal_before_hello,
    refusal_for_every_hello,
    refusal_for_session,
    resume_decision,
    scheduled_version,
)
from .schema import CONTRACT_TAG
from .writer import CheckpointWriter, write_checkpoint

__all__ = [
    "UNSYNCED_RENAME",
    "CONTRACT_TAG",
    "F32",
    "Checkpoint",
    "CheckpointFormat",
    "CheckpointWriter",
    "ExportedTensors",
    "F32Array",
    "FragmentState",
    "LedgerEntry",
    "LegacyIdentity",
    "MarkerState",
    "MarkerStatus",
    "ResumeDecision",
    "ResumeRefusal",
    "TrailerKind",
    "atomic_replace",
    "check_name_length",
    "export_tensors",
    "final_marker_bytes",
    "io_error",
    "is_marked_final",
    "iso_backend_name",
    "load_layout",
    "marker_path",
    "marker_state",
    "name_length_problem",
    "orphaned_temporaries",
    "remove_orphaned_temporaries",
    "remove_temporaries",
    "temporaries_written_by",
    "parse_final_marker",
    "remove_final_marker",
    "read_checkpoint",
    "refusal_before_hello",
    "refusal_for_every_hello",
    "refusal_for_session",
    "resume_decision",
    "scheduled_version",
    "verify_identity",
    "write_bytes_atomically",
    "write_checkpoint",
    "write_final_marker",
]
