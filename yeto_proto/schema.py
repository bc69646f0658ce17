"""construct declarations of every v4 frame: the single declared source of truth for the bytes.

Fixed-width parts are plain ``FormatField`` structs, so :func:`struct_of` turns each into a
``struct.Struct`` that the hot paths use; ``tests/test_schema.py`` proves that both agree on
every conformance vector. Tensor bytes are declared ``GreedyBytes`` and never parsed element by
element: the decoder slices a memoryview there instead. Validators that carry an
:class:`~yeto_proto.errors.ErrorCode` are :class:`Require` nodes, placed before anything whose
size they bound. HELLO's fragment list is read by :mod:`yeto_proto.hello_reader` and written by
:mod:`yeto_proto.hello_writer` with ``struct`` (a 16 MiB layout is too slow here);
``tests/test_hello_reader.py`` and ``tests/test_hello_writer.py`` hold them to ``HelloPayload``.
"""

from __future__ import annotations

import io
import struct
from collections.abc import Callable
from typing import Any

import numpy as np
from construct import (
    Adapter,
    Array,
    Bytes,
    Const,
    Construct,
    ConstructError,
    Error,
    FixedSized,
    FormatField,
    GreedyBytes,
    If,
    Int8ul,
    Int16ul,
    Int32ul,
    Int64ul,
    Renamed,
    Struct,
    Switch,
    Terminated,
    this,
)

from .constants import (
    CHUNK_ENVELOPE_SIZE,
    DIGEST_SIZE,
    FINALIZATION_REVISION,
    FRAME_MAGIC,
    MAX_STREAMS,
    PROTOCOL_VERSION,
    U64_MAX,
    FrameType,
    MergeMode,
    WireDtype,
)
from .errors import ErrorCode

#: Largest fragment numel whose f32 frame size (plus headers) still fits a u64.
MAX_FRAGMENT_NUMEL = (U64_MAX - 13 - 64) // 4

Predicate = Callable[[Any, int], bool]


def _remaining(stream: io.BytesIO) -> int:
    """Bytes left in ``stream``; construct's sized substreams shift ``tell()`` by their offset."""
    return len(stream.getbuffer()) - io.BytesIO.tell(stream)


class CodedConstructError(ConstructError):  # type: ignore[misc]
    """A construct validation failure that knows its yeto error code."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class Require(Construct):  # type: ignore[misc]
    """A zero-width validator: ``predicate(context, bytes_remaining)`` or raise ``code`` with
    ``message`` (a text, or a function of the context naming the values at fault)."""

    def __init__(
        self,
        predicate: Predicate,
        code: ErrorCode,
        message: str | Callable[[Any], str],
        *,
        parse_only: bool = False,
    ) -> None:
        super().__init__()
        self.predicate = predicate
        self.parse_only = parse_only
        self.code = code
        self.message = message
        self.flagbuildnone = True

    def _error(self, context: Any) -> CodedConstructError:
        text = self.message if isinstance(self.message, str) else self.message(context)
        return CodedConstructError(self.code, text)

    def _parse(self, stream: io.BytesIO, context: Any, path: str) -> None:
        if not self.predicate(context, _remaining(stream)):
            raise self._error(context)

    def _build(self, obj: Any, stream: io.BytesIO, context: Any, path: str) -> Any:
        # While building, "bytes remaining" has no meaning; only field checks apply.
        if not self.parse_only and not self.predicate(context, U64_MAX):
            raise self._error(context)
        return obj

    def _sizeof(self, context: Any, path: str) -> int:
        return 0


class U64Numbers(Adapter):  # type: ignore[misc]
    """``count`` little-endian u64 values read as one byte string (never element by element)."""

    def __init__(self, count: Callable[[Any], int]) -> None:
        super().__init__(Bytes(lambda ctx: 8 * count(ctx)))

    def _decode(self, obj: bytes, context: Any, path: str) -> tuple[int, ...]:
        return tuple(int(v) for v in np.frombuffer(obj, dtype="<u8"))

    def _encode(self, obj: Any, context: Any, path: str) -> bytes:
        return np.asarray(list(obj), dtype="<u8").tobytes()


class HelloTailLength(Construct):  # type: ignore[misc]
    """Zero-width: the bytes left after the contract (2, or 34 with a profile hash)."""

    def __init__(self) -> None:
        super().__init__()
        self.flagbuildnone = True

    def _parse(self, stream: io.BytesIO, context: Any, path: str) -> int:
        return _remaining(stream)

    def _build(self, obj: Any, stream: io.BytesIO, context: Any, path: str) -> int:
        return 2 + (DIGEST_SIZE if context.get("syncer_profile_hash") is not None else 0)

    def _sizeof(self, context: Any, path: str) -> int:
        return 0


def _fits(per_item: int, count: Callable[[Any], int]) -> Predicate:
    return lambda ctx, remaining: count(ctx) * per_item <= remaining


def _learner_in_range(ctx: Any, _remaining: int) -> bool:
    limit = ctx._params.get("num_learners")
    return limit is None or ctx.learner_id < limit


def learner_out_of_range(learner_id: int, num_learners: int) -> str:
    """The refusal text of a learner id outside ``0..M-1`` (shared with the HELLO reader)."""
    return f"learner_id {learner_id} outside 0..{num_learners - 1} (M = {num_learners})"


def _learner_out_of_range(ctx: Any) -> str:
    return learner_out_of_range(ctx.learner_id, ctx._params["num_learners"])


def _iso_shapes_cover(ctx: Any, _remaining: int) -> bool:
    return all(
        s.rows > 0 and s.cols > 0 and s.rows * s.cols == n
        for s, n in zip(ctx.matrix_shapes, ctx.numels, strict=True)
    )


# -- header -------------------------------------------------------------------------------------
Header = Struct(
    "magic" / Const(FRAME_MAGIC, Int32ul),
    "type" / Int8ul,
    "len" / Int64ul,
)

# -- HELLO --------------------------------------------------------------------------------------
FragmentLayout = Struct(
    "merge_mode" / Int8ul,
    Require(lambda c, _: c.merge_mode <= MergeMode.ISO, ErrorCode.BAD_MERGE_MODE, "merge_mode > 2"),
    "num_tensors" / Int32ul,
    Require(lambda c, _: c.num_tensors >= 1, ErrorCode.EMPTY_FRAGMENT, "num_tensors = 0"),
    Require(
        _fits(8, this.num_tensors),
        ErrorCode.TRUNCATED_PAYLOAD,
        "numels exceed the payload",
        parse_only=True,
    ),
    "numels" / U64Numbers(this.num_tensors),
    Require(lambda c, _: min(c.numels) > 0, ErrorCode.ZERO_NUMEL, "a tensor numel is 0"),
    Require(
        lambda c, _: sum(c.numels) <= MAX_FRAGMENT_NUMEL,
        ErrorCode.SIZE_OVERFLOW,
        "fragment size overflows u64",
    ),
    Require(
        lambda c, remaining: c.merge_mode != MergeMode.ISO or c.num_tensors * 16 <= remaining,
        ErrorCode.TRUNCATED_PAYLOAD,
        "iso shapes exceed the payload",
        parse_only=True,
    ),
    "matrix_shapes"
    / If(
        this.merge_mode == MergeMode.ISO,
        Array(this.num_tensors, Struct("rows" / Int64ul, "cols" / Int64ul)),
    ),
    Require(
        lambda c, r: c.matrix_shapes is None or _iso_shapes_cover(c, r),
        ErrorCode.BAD_ISO_SHAPE,
        "iso rows*cols must equal numel, both > 0",
    ),
)

HelloPayload = Struct(
    "protocol_version" / Int16ul,
    Require(
        lambda c, _: c.protocol_version == PROTOCOL_VERSION,
        ErrorCode.UNSUPPORTED_VERSION,
        "protocol_version is not 4",
    ),
    "learner_id" / Int32ul,
    Require(_learner_in_range, ErrorCode.LEARNER_ID_OUT_OF_RANGE, _learner_out_of_range),
    "connection_generation" / Int64ul,
    Require(lambda c, _: c.connection_generation != 0, ErrorCode.ZERO_GENERATION, "generation 0"),
    "dtype" / Int8ul,
    Require(lambda c, _: c.dtype in set(WireDtype), ErrorCode.BAD_DTYPE, "dtype not 1, 2 or 3"),
    "num_fragments" / Int32ul,
    Require(lambda c, _: c.num_fragments >= 1, ErrorCode.NO_FRAGMENTS, "num_fragments = 0"),
    Require(
        _fits(13, this.num_fragments),
        ErrorCode.TRUNCATED_PAYLOAD,
        "fragments exceed the payload",
        parse_only=True,
    ),
    "fragments" / Array(this.num_fragments, FragmentLayout),
    "layout_fingerprint" / Bytes(DIGEST_SIZE),
    "session_contract_hash" / Bytes(DIGEST_SIZE),
    "tail_len" / HelloTailLength(),
    Require(
        lambda c, _: c.tail_len in (2, 2 + DIGEST_SIZE),
        ErrorCode.BAD_HELLO_TAIL,
        "after the contract exactly 2 or 34 bytes must remain",
    ),
    "syncer_profile_hash" / If(this.tail_len == 2 + DIGEST_SIZE, Bytes(DIGEST_SIZE)),
    "num_streams" / Int16ul,
    Require(lambda c, _: c.num_streams <= MAX_STREAMS, ErrorCode.TOO_MANY_STREAMS, "> 256"),
    Terminated,
)

DataHelloPayload = Struct(
    "protocol_version" / Int16ul,
    Require(
        lambda c, _: c.protocol_version == PROTOCOL_VERSION,
        ErrorCode.UNSUPPORTED_VERSION,
        "protocol_version is not 4",
    ),
    "learner_id" / Int32ul,
    Require(_learner_in_range, ErrorCode.LEARNER_ID_OUT_OF_RANGE, _learner_out_of_range),
    "connection_generation" / Int64ul,
    Require(lambda c, _: c.connection_generation != 0, ErrorCode.ZERO_GENERATION, "generation 0"),
    "stream_idx" / Int16ul,
    Terminated,
)

# -- fixed control frames -----------------------------------------------------------------------
PullReqPayload = Struct(
    "fragment_id" / Int32ul, "global_step" / Int64ul, "round_attempt" / Int32ul, Terminated
)
HeartbeatPayload = Struct("learner_id" / Int32ul, "local_step" / Int64ul, Terminated)
ShutdownPayload = Struct(Terminated)
FinalAckPayload = Struct(
    "revision" / Int16ul,
    Require(
        lambda c, _: c.revision == FINALIZATION_REVISION,
        ErrorCode.BAD_FINAL_REVISION,
        "revision is not 1",
    ),
    "final_global_step" / Int64ul,
    Terminated,
)
BudgetDonePayload = Struct("exact_local_steps" / Int64ul, Terminated)
FinalManifestPayload = Struct(
    "revision" / Int16ul,
    Require(
        lambda c, _: c.revision == FINALIZATION_REVISION,
        ErrorCode.BAD_FINAL_REVISION,
        "revision is not 1",
    ),
    "final_global_step" / Int64ul,
    "num_fragments" / Int32ul,
    Require(
        lambda c, remaining: c.num_fragments * 8 == remaining,
        ErrorCode.BAD_MANIFEST,
        "manifest length is not 14 + 8*F",
        parse_only=True,
    ),
    "expected_versions" / U64Numbers(this.num_fragments),
    Terminated,
)
ErrorPayload = Struct("text" / GreedyBytes)

# -- bulk frames: fixed prefix, then tensor bytes -----------------------------------------------
InitParamsPayload = Struct("fragment_id" / Int32ul, "data" / GreedyBytes)
PushFragmentPayload = Struct(
    "learner_id" / Int32ul,
    "fragment_id" / Int32ul,
    "global_step" / Int64ul,
    "round_attempt" / Int32ul,
    "base_version" / Int64ul,
    "local_step" / Int64ul,
    "c_steps" / Int32ul,
    "c_tokens" / Int64ul,
    "data" / GreedyBytes,
)
BcastFragmentPayload = Struct("fragment_id" / Int32ul, "version" / Int64ul, "data" / GreedyBytes)
FinalFragmentPayload = Struct("fragment_id" / Int32ul, "version" / Int64ul, "data" / GreedyBytes)
ChunkPayload = Struct(
    "msg_id" / Int64ul, "total_len" / Int64ul, "offset" / Int64ul, "data" / GreedyBytes
)

PAYLOADS: dict[FrameType, Construct] = {
    FrameType.HELLO: HelloPayload,
    FrameType.INIT_PARAMS: InitParamsPayload,
    FrameType.PULL_REQ: PullReqPayload,
    FrameType.PUSH_FRAGMENT: PushFragmentPayload,
    FrameType.BCAST_FRAGMENT: BcastFragmentPayload,
    FrameType.HEARTBEAT: HeartbeatPayload,
    FrameType.SHUTDOWN: ShutdownPayload,
    FrameType.DATA_HELLO: DataHelloPayload,
    FrameType.CHUNK: ChunkPayload,
    FrameType.ERROR: ErrorPayload,
    FrameType.FINAL_MANIFEST: FinalManifestPayload,
    FrameType.FINAL_ACK: FinalAckPayload,
    FrameType.FINAL_FRAGMENT: FinalFragmentPayload,
    FrameType.BUDGET_DONE: BudgetDonePayload,
}


def _payload_limit(ctx: Any, _remaining: int) -> bool:
    limit_of: Callable[[int], int] | None = ctx._params.get("limit_of")
    return limit_of is None or ctx.len <= limit_of(ctx.type)


#: A whole frame. ``limit_of(type) -> max payload bytes`` may be passed as a parse keyword.
Frame = Struct(
    "magic" / Const(FRAME_MAGIC, Int32ul),
    "type" / Int8ul,
    "len" / Int64ul,
    Require(lambda c, _: c.type in PAYLOADS, ErrorCode.UNKNOWN_FRAME_TYPE, "unknown frame type"),
    Require(_payload_limit, ErrorCode.FRAME_TOO_LARGE, "payload exceeds the type's limit"),
    Require(
        lambda c, r: c.len <= r,
        ErrorCode.TRUNCATED_PAYLOAD,
        "payload shorter than len",
        parse_only=True,
    ),
    "payload" / FixedSized(this.len, Switch(this.type, PAYLOADS, default=Error)),
)


def struct_of(schema: Construct) -> struct.Struct:
    """The ``struct.Struct`` of a schema's leading fixed-width fields (validators skipped)."""
    formats = []
    for sub in schema.subcons:
        node = sub.subcon if isinstance(sub, Renamed) else sub
        if isinstance(node, Const):
            node = node.subcon
        if isinstance(node, Require):
            continue
        if not isinstance(node, FormatField):
            break
        formats.append(node.fmtstr[1:])
    return struct.Struct("<" + "".join(formats))


def field_names(schema: Construct) -> tuple[str, ...]:
    """Names of the leading fixed-width fields that :func:`struct_of` covers, in order."""
    names = []
    for sub in schema.subcons:
        if isinstance(sub, Require):
            continue
        node = sub.subcon if isinstance(sub, Renamed) else sub
        if isinstance(node, Const):
            node = node.subcon
        if not isinstance(node, FormatField):
            break
        names.append(sub.name)
    return tuple(names)


HEADER_STRUCT = struct_of(Header)
PREFIX_STRUCTS: dict[FrameType, struct.Struct] = {t: struct_of(s) for t, s in PAYLOADS.items()}
CHUNK_PREFIX = PREFIX_STRUCTS[FrameType.CHUNK]
assert HEADER_STRUCT.size == 13 and CHUNK_PREFIX.size == CHUNK_ENVELOPE_SIZE
