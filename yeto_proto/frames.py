"""Message <-> frame bytes.

``encode`` returns a list of buffers (header and fixed fields in one small ``bytes``, then the
tensor view untouched) for ``socket.sendmsg``/writev. ``decode_payload`` turns one validated
payload into a message; tensor bytes stay views into the received buffer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from construct import ConstructError, StreamError, TerminatedError

from .constants import (
    CHUNK_SLICE_SIZE,
    FIRST_FRAME_LIMIT,
    FRAME_MAGIC,
    PROTOCOL_VERSION,
    FrameType,
)
from .errors import ErrorCode, LocalProtocolError, RemoteProtocolError
from .hello_reader import HelloReading
from .hello_writer import write_hello
from .identity import sign_hello, verify_hello
from .limits import Limits
from .messages import (
    MESSAGE_CLASSES,
    AnyMessage,
    BcastFragment,
    Chunk,
    DataHello,
    ErrorMessage,
    FinalAck,
    FinalFragment,
    FinalManifest,
    Hello,
    InitParams,
    PullReq,
    PushFragment,
    Shutdown,
    as_byte_view,
)
from .schema import (
    HEADER_STRUCT,
    PAYLOADS,
    PREFIX_STRUCTS,
    CodedConstructError,
    DataHelloPayload,
    FinalAckPayload,
    FinalManifestPayload,
)

Buffers = list[bytes | memoryview]

_TENSOR_CLASSES = (InitParams, PushFragment, BcastFragment, FinalFragment, Chunk)
_WITH_TENSOR = {cls.TYPE for cls in _TENSOR_CLASSES}
_PREFIX_FIELDS: dict[FrameType, tuple[str, ...]] = {
    FrameType.INIT_PARAMS: ("fragment_id",),
    FrameType.PUSH_FRAGMENT: (
        "learner_id",
        "fragment_id",
        "global_step",
        "round_attempt",
        "base_version",
        "local_step",
        "c_steps",
        "c_tokens",
    ),
    FrameType.BCAST_FRAGMENT: ("fragment_id", "version"),
    FrameType.FINAL_FRAGMENT: ("fragment_id", "version"),
    FrameType.CHUNK: ("msg_id", "total_len", "offset"),
    FrameType.PULL_REQ: ("fragment_id", "global_step", "round_attempt"),
    FrameType.HEARTBEAT: ("learner_id", "local_step"),
    FrameType.BUDGET_DONE: ("exact_local_steps",),
    FrameType.SHUTDOWN: (),
}


def header(frame_type: FrameType, payload_len: int) -> bytes:
    return HEADER_STRUCT.pack(FRAME_MAGIC, frame_type, payload_len)


def _small_payload(message: AnyMessage, hello_key: bytes | None) -> bytes:
    match message:
        case Hello():
            body = write_hello(message)
            return sign_hello(hello_key, body) if hello_key is not None else body
        case DataHello():
            built: bytes = DataHelloPayload.build(
                {
                    "protocol_version": PROTOCOL_VERSION,
                    "learner_id": message.learner_id,
                    "connection_generation": message.generation,
                    "stream_idx": message.stream_idx,
                }
            )
            return built
        case FinalManifest():
            built = FinalManifestPayload.build(
                {
                    "revision": 1,
                    "final_global_step": message.final_global_step,
                    "num_fragments": len(message.expected_versions),
                    "expected_versions": message.expected_versions,
                }
            )
            return built
        case FinalAck():
            built = FinalAckPayload.build(
                {"revision": 1, "final_global_step": message.final_global_step}
            )
            return built
        case ErrorMessage():
            return message.text.encode("utf-8")
    raise AssertionError(type(message))


def encode(message: AnyMessage, *, hello_key: bytes | None = None) -> Buffers:
    """Frame ``message`` as buffers to write in order; tensor bytes are not copied."""
    frame_type = message.TYPE
    fields = _PREFIX_FIELDS.get(frame_type)
    if fields is None:
        try:
            payload = _small_payload(message, hello_key)
        except CodedConstructError as exc:  # a message its schema cannot carry
            raise LocalProtocolError(exc.code, f"{frame_type.name}: {exc.args[0]}") from None
        if frame_type is FrameType.HELLO and len(payload) > FIRST_FRAME_LIMIT:
            raise LocalProtocolError(
                ErrorCode.FRAME_TOO_LARGE,
                f"HELLO: {len(payload)} bytes (its MAC included) > {FIRST_FRAME_LIMIT}",
            )
        return [header(frame_type, len(payload)) + payload]
    prefix = PREFIX_STRUCTS[frame_type]
    values = [getattr(message, name) for name in fields]
    if not isinstance(message, _TENSOR_CLASSES):
        return [header(frame_type, prefix.size) + prefix.pack(*values)]
    data = message.data
    if frame_type is FrameType.CHUNK and not 0 < len(data) <= CHUNK_SLICE_SIZE:
        # A receiver refuses it (spec/wire.md § 2): never put one on the wire.
        code = ErrorCode.CHUNK_EMPTY if not len(data) else ErrorCode.FRAME_TOO_LARGE
        raise LocalProtocolError(code, f"CHUNK: {len(data)} data bytes, not 1..{CHUNK_SLICE_SIZE}")
    head = header(frame_type, prefix.size + len(data)) + prefix.pack(*values)
    return [head, data] if len(data) else [head]


def frame_length(frame: Sequence[bytes | memoryview]) -> int:
    """Bytes in ``frame`` (a list of buffers, as :func:`encode` and the CHUNK slicer give)."""
    return sum(memoryview(b).nbytes for b in frame)


class OutgoingBuffers:
    """A frame's buffers being written with ``sendmsg``, which may take only part of them.

    Sans-IO bookkeeping for a socket writer: :meth:`batch` is the next at most ``iov_max``
    views to pass to ``sendmsg``, :meth:`advance` drops the bytes it reports sent.
    """

    def __init__(self, frame: Buffers, iov_max: int = 512) -> None:
        self._views = [as_byte_view(b) for b in frame if len(b)]
        self._start = 0
        self._iov_max = iov_max

    @property
    def done(self) -> bool:
        return self._start == len(self._views)

    def batch(self, max_bytes: int | None = None) -> list[memoryview]:
        """The next views to send, at most ``max_bytes`` in all when given (then at least 1)."""
        views = self._views[self._start : self._start + self._iov_max]
        if max_bytes is None:
            return views
        trimmed, room = [], max_bytes
        for view in views:
            if room <= 0:
                break
            trimmed.append(view[:room] if len(view) > room else view)
            room -= len(view)
        return trimmed

    def advance(self, sent: int) -> None:
        while sent:
            head = self._views[self._start]
            if sent >= len(head):
                sent -= len(head)
                self._start += 1
            else:
                self._views[self._start] = head[sent:]
                sent = 0


def encode_bytes(message: AnyMessage, *, hello_key: bytes | None = None) -> bytes:
    """The whole frame as one ``bytes`` (copies; for small frames, tests and vectors)."""
    return b"".join(encode(message, hello_key=hello_key))


# -- decoding -----------------------------------------------------------------------------------


def _parse_with_schema(frame_type: FrameType, payload: memoryview, **context: Any) -> Any:
    try:
        return PAYLOADS[frame_type].parse(bytes(payload), **context)
    except CodedConstructError as exc:
        raise RemoteProtocolError(exc.code, f"{frame_type.name}: {exc.args[0]}") from None
    except TerminatedError:
        raise RemoteProtocolError(
            ErrorCode.TRAILING_BYTES, f"{frame_type.name}: trailing bytes"
        ) from None
    except StreamError:
        raise RemoteProtocolError(
            ErrorCode.TRUNCATED_PAYLOAD, f"{frame_type.name}: payload ends inside a field"
        ) from None
    except ConstructError as exc:  # anything else the schema refuses
        raise RemoteProtocolError(
            ErrorCode.TRUNCATED_PAYLOAD, f"{frame_type.name}: {exc}"
        ) from None


def start_hello_reading(
    payload: memoryview, *, num_learners: int | None = None, hello_key: bytes | None = None
) -> HelloReading:
    """Check a HELLO payload's MAC (with a key) and head; the reading then goes on stepwise."""
    try:
        body = verify_hello(hello_key, payload) if hello_key is not None else payload
        return HelloReading(body, num_learners=num_learners)
    except LocalProtocolError as exc:
        raise RemoteProtocolError(exc.code, exc.detail) from None


def decode_payload(
    frame_type: FrameType,
    payload: memoryview,
    *,
    limits: Limits | None = None,
    num_learners: int | None = None,
    hello_key: bytes | None = None,
) -> AnyMessage:
    """Decode one payload whose type, direction and length the caller already validated.

    With ``limits``, fragment ids and exact tensor lengths are checked too.
    """
    try:
        return _decode_payload(frame_type, payload, limits, num_learners, hello_key)
    except LocalProtocolError as exc:  # a constructor refused what the peer sent
        raise RemoteProtocolError(exc.code, exc.detail) from None


def _decode_payload(
    frame_type: FrameType,
    payload: memoryview,
    limits: Limits | None,
    num_learners: int | None,
    hello_key: bytes | None,
) -> AnyMessage:
    match frame_type:
        case FrameType.HELLO:
            hello = start_hello_reading(payload, num_learners=num_learners, hello_key=hello_key)
            return hello.advance_all()
        case FrameType.DATA_HELLO:
            p = _parse_with_schema(frame_type, payload, num_learners=num_learners)
            return DataHello(p.learner_id, p.connection_generation, p.stream_idx)
        case FrameType.FINAL_ACK:
            return FinalAck(_parse_with_schema(frame_type, payload).final_global_step)
        case FrameType.FINAL_MANIFEST:
            p = _parse_with_schema(frame_type, payload)
            if limits is not None and p.num_fragments != limits.num_fragments:
                raise RemoteProtocolError(
                    ErrorCode.BAD_MANIFEST,
                    f"manifest lists {p.num_fragments} fragments, session has "
                    f"{limits.num_fragments}",
                )
            return FinalManifest(p.final_global_step, p.expected_versions)
        case FrameType.ERROR:
            try:
                return ErrorMessage(str(payload, "utf-8"))
            except UnicodeDecodeError:
                raise RemoteProtocolError(ErrorCode.INVALID_UTF8, "ERROR text") from None
        case FrameType.SHUTDOWN:
            return Shutdown()
    prefix = PREFIX_STRUCTS[frame_type]
    if len(payload) < prefix.size:
        raise RemoteProtocolError(
            ErrorCode.TRUNCATED_PAYLOAD, f"{frame_type.name} shorter than its fixed fields"
        )
    values = prefix.unpack_from(payload)
    cls = MESSAGE_CLASSES[frame_type]
    build: Any = cls  # the prefix struct was generated from this class's schema
    if frame_type not in _WITH_TENSOR:
        small: AnyMessage = build(*values)
        if limits is not None and isinstance(small, PullReq):
            limits.check_fragment(small.fragment_id)
        return small
    data = payload[prefix.size :]
    if limits is not None and frame_type is FrameType.FINAL_FRAGMENT:
        # The fragment id before FINAL_FRAGMENT's own f32-length check (spec/wire.md § 4.1).
        limits.check_fragment(values[0])
    message: AnyMessage = build(*values, data=data)
    if limits is not None and not isinstance(message, Chunk):
        fragment_id: int = values[1] if frame_type is FrameType.PUSH_FRAGMENT else values[0]
        limits.check_fragment(fragment_id)
        expected = limits.tensor_bytes(frame_type, fragment_id)
        if len(data) != expected:
            raise RemoteProtocolError(
                ErrorCode.BAD_TENSOR_LENGTH,
                f"{frame_type.name} fragment {fragment_id}: {len(data)} bytes, expected {expected}",
            )
    return message
