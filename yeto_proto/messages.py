"""The 14 v4 messages as frozen dataclasses that validate in their constructors.

Tensor payloads are held as flat, read-only byte ``memoryview``s: decoding slices them out of
the received frame buffer and encoding hands them to the writer as they are, so a tensor is
never copied by this layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, TypeAlias

from .constants import (
    DIGEST_SIZE,
    ERROR_TEXT_LIMIT,
    MAX_STREAMS,
    U32_MAX,
    U64_MAX,
    FrameType,
    WireDtype,
)
from .errors import ErrorCode, LocalProtocolError
from .layout import WireLayout

BytesLike: TypeAlias = bytes | bytearray | memoryview

_U16 = (1 << 16) - 1


def as_byte_view(data: BytesLike) -> memoryview:
    """A flat, read-only byte view of ``data`` (no copy)."""
    view = memoryview(data)
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    return view.toreadonly()


def _check_range(message: object, **fields: tuple[int, int]) -> None:
    for name, (value, upper) in fields.items():
        if not 0 <= value <= upper:
            raise LocalProtocolError(
                ErrorCode.FIELD_OUT_OF_RANGE,
                f"{type(message).__name__}.{name}={value} outside 0..{upper}",
            )


class Message:
    """Common base: every message knows its frame type."""

    __slots__ = ()
    TYPE: ClassVar[FrameType]


@dataclass(frozen=True, slots=True)
class Hello(Message):
    TYPE: ClassVar[FrameType] = FrameType.HELLO
    learner_id: int
    generation: int
    dtype: WireDtype
    layout: WireLayout
    layout_fingerprint: bytes
    session_contract: bytes
    num_streams: int
    profile_hash: bytes | None = None

    def __post_init__(self) -> None:
        _check_range(
            self,
            learner_id=(self.learner_id, U32_MAX),
            generation=(self.generation, U64_MAX),
            num_fragments=(len(self.layout), U32_MAX),
        )
        if self.generation == 0:
            raise LocalProtocolError(ErrorCode.ZERO_GENERATION, "generation must be nonzero")
        object.__setattr__(self, "dtype", WireDtype(self.dtype))
        if not 0 <= self.num_streams <= MAX_STREAMS:
            raise LocalProtocolError(ErrorCode.TOO_MANY_STREAMS, f"num_streams={self.num_streams}")
        digests = [self.layout_fingerprint, self.session_contract]
        if self.profile_hash is not None:
            digests.append(self.profile_hash)
        if any(len(d) != DIGEST_SIZE for d in digests):
            raise LocalProtocolError(ErrorCode.BAD_HELLO_TAIL, "digests are 32 bytes")


@dataclass(frozen=True, slots=True)
class DataHello(Message):
    TYPE: ClassVar[FrameType] = FrameType.DATA_HELLO
    learner_id: int
    generation: int
    stream_idx: int

    def __post_init__(self) -> None:
        _check_range(
            self,
            learner_id=(self.learner_id, U32_MAX),
            generation=(self.generation, U64_MAX),
            stream_idx=(self.stream_idx, _U16),
        )
        if self.generation == 0:
            raise LocalProtocolError(ErrorCode.ZERO_GENERATION, "generation must be nonzero")


@dataclass(frozen=True, slots=True)
class InitParams(Message):
    TYPE: ClassVar[FrameType] = FrameType.INIT_PARAMS
    fragment_id: int
    data: memoryview = field(repr=False)

    def __post_init__(self) -> None:
        _check_range(self, fragment_id=(self.fragment_id, U32_MAX))
        object.__setattr__(self, "data", as_byte_view(self.data))


@dataclass(frozen=True, slots=True)
class PullReq(Message):
    TYPE: ClassVar[FrameType] = FrameType.PULL_REQ
    fragment_id: int
    global_step: int
    round_attempt: int

    def __post_init__(self) -> None:
        _check_range(
            self,
            fragment_id=(self.fragment_id, U32_MAX),
            global_step=(self.global_step, U64_MAX),
            round_attempt=(self.round_attempt, U32_MAX),
        )


@dataclass(frozen=True, slots=True)
class PushFragment(Message):
    TYPE: ClassVar[FrameType] = FrameType.PUSH_FRAGMENT
    learner_id: int
    fragment_id: int
    global_step: int
    round_attempt: int
    base_version: int
    local_step: int
    c_steps: int
    c_tokens: int
    #: learner delta ``local − raw_anchor`` in the session's push dtype.
    data: memoryview = field(repr=False)

    def __post_init__(self) -> None:
        _check_range(
            self,
            learner_id=(self.learner_id, U32_MAX),
            fragment_id=(self.fragment_id, U32_MAX),
            global_step=(self.global_step, U64_MAX),
            round_attempt=(self.round_attempt, U32_MAX),
            base_version=(self.base_version, U64_MAX),
            local_step=(self.local_step, U64_MAX),
            c_steps=(self.c_steps, U32_MAX),
            c_tokens=(self.c_tokens, U64_MAX),
        )
        if self.c_steps == 0:
            raise LocalProtocolError(ErrorCode.ZERO_C_STEPS, "a PUSH needs c_steps >= 1")
        object.__setattr__(self, "data", as_byte_view(self.data))


@dataclass(frozen=True, slots=True)
class BcastFragment(Message):
    TYPE: ClassVar[FrameType] = FrameType.BCAST_FRAGMENT
    fragment_id: int
    version: int
    data: memoryview = field(repr=False)

    def __post_init__(self) -> None:
        _check_range(self, fragment_id=(self.fragment_id, U32_MAX), version=(self.version, U64_MAX))
        object.__setattr__(self, "data", as_byte_view(self.data))


@dataclass(frozen=True, slots=True)
class Heartbeat(Message):
    TYPE: ClassVar[FrameType] = FrameType.HEARTBEAT
    learner_id: int
    local_step: int

    def __post_init__(self) -> None:
        _check_range(
            self, learner_id=(self.learner_id, U32_MAX), local_step=(self.local_step, U64_MAX)
        )


@dataclass(frozen=True, slots=True)
class Shutdown(Message):
    TYPE: ClassVar[FrameType] = FrameType.SHUTDOWN


@dataclass(frozen=True, slots=True)
class Chunk(Message):
    TYPE: ClassVar[FrameType] = FrameType.CHUNK
    msg_id: int
    total_len: int
    offset: int
    data: memoryview = field(repr=False)

    def __post_init__(self) -> None:
        _check_range(
            self,
            msg_id=(self.msg_id, U64_MAX),
            total_len=(self.total_len, U64_MAX),
            offset=(self.offset, U64_MAX),
        )
        object.__setattr__(self, "data", as_byte_view(self.data))


@dataclass(frozen=True, slots=True)
class ErrorMessage(Message):
    """ERROR: a UTF-8 reason; the syncer closes the connection after sending it."""

    TYPE: ClassVar[FrameType] = FrameType.ERROR
    text: str

    def __post_init__(self) -> None:
        try:
            encoded = self.text.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate has no UTF-8 form
            raise LocalProtocolError(ErrorCode.INVALID_UTF8, "ERROR text is not UTF-8") from None
        if len(encoded) > ERROR_TEXT_LIMIT:
            raise LocalProtocolError(ErrorCode.FRAME_TOO_LARGE, "ERROR text over 65,536 bytes")


@dataclass(frozen=True, slots=True)
class FinalManifest(Message):
    TYPE: ClassVar[FrameType] = FrameType.FINAL_MANIFEST
    final_global_step: int
    expected_versions: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "expected_versions", tuple(self.expected_versions))
        _check_range(
            self,
            final_global_step=(self.final_global_step, U64_MAX),
            num_fragments=(len(self.expected_versions), U32_MAX),
        )
        for version in self.expected_versions:
            _check_range(self, expected_version=(version, U64_MAX))


@dataclass(frozen=True, slots=True)
class FinalAck(Message):
    TYPE: ClassVar[FrameType] = FrameType.FINAL_ACK
    final_global_step: int

    def __post_init__(self) -> None:
        _check_range(self, final_global_step=(self.final_global_step, U64_MAX))


@dataclass(frozen=True, slots=True)
class FinalFragment(Message):
    """FINAL_FRAGMENT: the authoritative fragment, always little-endian f32."""

    TYPE: ClassVar[FrameType] = FrameType.FINAL_FRAGMENT
    fragment_id: int
    version: int
    data: memoryview = field(repr=False)

    def __post_init__(self) -> None:
        _check_range(self, fragment_id=(self.fragment_id, U32_MAX), version=(self.version, U64_MAX))
        object.__setattr__(self, "data", as_byte_view(self.data))
        if len(self.data) % 4:
            raise LocalProtocolError(ErrorCode.BAD_TENSOR_LENGTH, "f32 bytes come in fours")


@dataclass(frozen=True, slots=True)
class BudgetDone(Message):
    TYPE: ClassVar[FrameType] = FrameType.BUDGET_DONE
    exact_local_steps: int

    def __post_init__(self) -> None:
        _check_range(self, exact_local_steps=(self.exact_local_steps, U64_MAX))


AnyMessage: TypeAlias = (
    Hello
    | DataHello
    | InitParams
    | PullReq
    | PushFragment
    | BcastFragment
    | Heartbeat
    | Shutdown
    | Chunk
    | ErrorMessage
    | FinalManifest
    | FinalAck
    | FinalFragment
    | BudgetDone
)

MESSAGE_CLASSES: dict[FrameType, type[AnyMessage]] = {
    cls.TYPE: cls
    for cls in (
        Hello,
        DataHello,
        InitParams,
        PullReq,
        PushFragment,
        BcastFragment,
        Heartbeat,
        Shutdown,
        Chunk,
        ErrorMessage,
        FinalManifest,
        FinalAck,
        FinalFragment,
        BudgetDone,
    )
}
