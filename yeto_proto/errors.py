"""The one error hierarchy of yeto_proto.

Every failure on a decode path is a :class:`RemoteProtocolError` (the peer broke the rules);
building a message that violates the protocol is a :class:`LocalProtocolError` (we did).
Each error carries a stable :class:`ErrorCode`; ``spec/errors.md`` lists them all and whether
they are fatal for the connection or only reject one message.
"""

from __future__ import annotations

import enum


class Severity(enum.Enum):
    """What the receiving side does with an error of a given code."""

    #: ERROR is sent (where the receiver is the syncer) and the connection group is closed.
    FATAL = "fatal"
    #: The single message is dropped and recorded; the connection keeps working.
    REJECTED = "rejected"


class ErrorCode(enum.Enum):
    """Stable, named error codes. The value is the name a vector file uses."""

    # -- framing ------------------------------------------------------------------------------
    BAD_MAGIC = "BAD_MAGIC"
    UNKNOWN_FRAME_TYPE = "UNKNOWN_FRAME_TYPE"
    WRONG_DIRECTION = "WRONG_DIRECTION"
    INVALID_FIRST_FRAME = "INVALID_FIRST_FRAME"
    UNEXPECTED_HELLO = "UNEXPECTED_HELLO"
    FRAME_TOO_LARGE = "FRAME_TOO_LARGE"
    BAD_FRAME_LENGTH = "BAD_FRAME_LENGTH"
    TRUNCATED_PAYLOAD = "TRUNCATED_PAYLOAD"
    TRAILING_BYTES = "TRAILING_BYTES"
    CONNECTION_CLOSED_MID_FRAME = "CONNECTION_CLOSED_MID_FRAME"
    INVALID_UTF8 = "INVALID_UTF8"
    FIELD_OUT_OF_RANGE = "FIELD_OUT_OF_RANGE"
    # -- HELLO / DATA_HELLO (checked in this order) -------------------------------------------
    UNSUPPORTED_VERSION = "UNSUPPORTED_VERSION"
    LEARNER_ID_OUT_OF_RANGE = "LEARNER_ID_OUT_OF_RANGE"
    ZERO_GENERATION = "ZERO_GENERATION"
    BAD_DTYPE = "BAD_DTYPE"
    NO_FRAGMENTS = "NO_FRAGMENTS"
    BAD_MERGE_MODE = "BAD_MERGE_MODE"
    EMPTY_FRAGMENT = "EMPTY_FRAGMENT"
    ZERO_NUMEL = "ZERO_NUMEL"
    SIZE_OVERFLOW = "SIZE_OVERFLOW"
    BAD_ISO_SHAPE = "BAD_ISO_SHAPE"
    BAD_HELLO_TAIL = "BAD_HELLO_TAIL"
    TOO_MANY_STREAMS = "TOO_MANY_STREAMS"
    BAD_STREAM_INDEX = "BAD_STREAM_INDEX"
    HELLO_AUTH_FAILED = "HELLO_AUTH_FAILED"
    # -- session fixation and membership ------------------------------------------------------
    SESSION_DTYPE_MISMATCH = "SESSION_DTYPE_MISMATCH"
    SESSION_LAYOUT_MISMATCH = "SESSION_LAYOUT_MISMATCH"
    SESSION_FINGERPRINT_MISMATCH = "SESSION_FINGERPRINT_MISMATCH"
    SESSION_CONTRACT_MISMATCH = "SESSION_CONTRACT_MISMATCH"
    SESSION_PROFILE_MISMATCH = "SESSION_PROFILE_MISMATCH"
    PROFILE_BINDING_REQUIRED = "PROFILE_BINDING_REQUIRED"
    DUPLICATE_GENERATION = "DUPLICATE_GENERATION"
    DUPLICATE_STREAM = "DUPLICATE_STREAM"
    UNKNOWN_GROUP = "UNKNOWN_GROUP"
    #: The first frame, or a group's data streams, did not arrive within the syncer's deadline.
    HANDSHAKE_TIMEOUT = "HANDSHAKE_TIMEOUT"
    #: A group sent more messages than the syncer holds while its data streams attach.
    GROUP_NOT_READY = "GROUP_NOT_READY"
    LEARNER_ID_MISMATCH = "LEARNER_ID_MISMATCH"
    INIT_NOT_ALLOWED = "INIT_NOT_ALLOWED"
    # -- message contents ---------------------------------------------------------------------
    BAD_FRAGMENT_ID = "BAD_FRAGMENT_ID"
    BAD_TENSOR_LENGTH = "BAD_TENSOR_LENGTH"
    NON_FINITE_VALUE = "NON_FINITE_VALUE"
    BAD_Q4_SCALE = "BAD_Q4_SCALE"
    ZERO_C_STEPS = "ZERO_C_STEPS"
    BAD_FINAL_REVISION = "BAD_FINAL_REVISION"
    BAD_MANIFEST = "BAD_MANIFEST"
    BCAST_CONFLICT = "BCAST_CONFLICT"
    FINAL_CONFLICT = "FINAL_CONFLICT"
    UNEXPECTED_SHUTDOWN = "UNEXPECTED_SHUTDOWN"
    UNEXPECTED_FINAL_ACK = "UNEXPECTED_FINAL_ACK"
    BUDGET_NOT_CONFIGURED = "BUDGET_NOT_CONFIGURED"
    BUDGET_MISMATCH = "BUDGET_MISMATCH"
    DUPLICATE_BUDGET_DONE = "DUPLICATE_BUDGET_DONE"
    SYNCER_ERROR = "SYNCER_ERROR"
    #: local only: a learner driver called its session out of order (spec/learner.md).
    SESSION_MISUSE = "SESSION_MISUSE"
    # -- striping -----------------------------------------------------------------------------
    CHUNK_EMPTY = "CHUNK_EMPTY"
    CHUNK_OUT_OF_BOUNDS = "CHUNK_OUT_OF_BOUNDS"
    CHUNK_TOTAL_CHANGED = "CHUNK_TOTAL_CHANGED"
    CHUNK_TOTAL_TOO_LARGE = "CHUNK_TOTAL_TOO_LARGE"
    CHUNK_OVERLAP = "CHUNK_OVERLAP"
    CHUNK_TOO_FRAGMENTED = "CHUNK_TOO_FRAGMENTED"
    TOO_MANY_PARTIALS = "TOO_MANY_PARTIALS"
    BAD_INNER_FRAME = "BAD_INNER_FRAME"
    # -- rejected pushes (the connection stays up) --------------------------------------------
    PUSH_DUPLICATE = "PUSH_DUPLICATE"
    PUSH_WRONG_GENERATION = "PUSH_WRONG_GENERATION"
    PUSH_FUTURE_BASE = "PUSH_FUTURE_BASE"
    PUSH_OUT_OF_ROUND = "PUSH_OUT_OF_ROUND"
    PUSH_WRONG_ATTEMPT = "PUSH_WRONG_ATTEMPT"
    PUSH_TOO_STALE = "PUSH_TOO_STALE"
    # -- checkpoints --------------------------------------------------------------------------
    CKPT_BAD_MAGIC = "CKPT_BAD_MAGIC"
    CKPT_TRUNCATED = "CKPT_TRUNCATED"
    CKPT_COUNT_OVERFLOW = "CKPT_COUNT_OVERFLOW"
    CKPT_BAD_TRAILER = "CKPT_BAD_TRAILER"
    CKPT_FINGERPRINT_TRAILER_MISMATCH = "CKPT_FINGERPRINT_TRAILER_MISMATCH"
    CKPT_BAD_FIELD = "CKPT_BAD_FIELD"
    CKPT_BAD_MARKER = "CKPT_BAD_MARKER"
    CKPT_IO = "CKPT_IO"
    CKPT_BAD_LAYOUT = "CKPT_BAD_LAYOUT"
    CKPT_LAYOUT_MISMATCH = "CKPT_LAYOUT_MISMATCH"
    CKPT_IDENTITY_REQUIRED = "CKPT_IDENTITY_REQUIRED"
    #: The syncer's checkpoint may not seed the session the first HELLO describes.
    CKPT_RESUME_INELIGIBLE = "CKPT_RESUME_INELIGIBLE"

    @property
    def severity(self) -> Severity:
        return Severity.REJECTED if self.name.startswith("PUSH_") else Severity.FATAL


class ProtocolError(Exception):
    """Base of every yeto_proto error; never raised directly."""

    code: ErrorCode

    def __init__(self, code: ErrorCode, detail: str = "") -> None:
        if type(self) is ProtocolError:
            raise TypeError("ProtocolError is abstract; raise Local- or RemoteProtocolError")
        self.code = code
        self.detail = detail
        super().__init__(f"{code.value}: {detail}" if detail else code.value)

    @property
    def fatal(self) -> bool:
        return self.code.severity is Severity.FATAL


class LocalProtocolError(ProtocolError):
    """We tried to build or send something the protocol forbids."""


class RemoteProtocolError(ProtocolError):
    """The peer (or a file) sent something the protocol forbids."""


class CheckpointError(RemoteProtocolError):
    """A checkpoint or marker file failed validation; ``section`` names where.

    ``detail`` is ``"<section>: <reason>"``; ``reason`` alone is for a caller that words the
    line itself (an I/O failure: the errno text and the file).
    """

    def __init__(self, code: ErrorCode, detail: str = "", *, section: str = "") -> None:
        self.section = section
        self.reason = detail
        super().__init__(code, f"{section}: {detail}" if section else detail)
