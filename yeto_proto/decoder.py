"""A sans-IO, incremental frame decoder for one socket.

``feed(data)`` copies bytes straight into the buffer of the frame they belong to (one copy; the
payload buffer is allocated only after the 13-byte header passed every check), and
``next_frame()`` hands out decoded messages in order, then ``NEED_DATA``. ``feed(b"")`` marks the
end of the stream: a frame cut short is then an error, and a clean end reads as ``CLOSED``.

A syncer-side decoder starts in the pre-session state: the first frame must be HELLO or
DATA_HELLO within 16 MiB. Once that frame is out, bytes that follow wait until the owner calls
:meth:`FrameDecoder.set_limits` with the session's :class:`~yeto_proto.limits.Limits`.

A fatal error poisons the decoder: it is raised after the frames that preceded it, and again
on every later call (an equal, fresh error each time: a stored exception would keep its
traceback, and through its frames this decoder and its buffers, alive in a reference cycle).

With a :class:`ChunkSink` (a :class:`~yeto_proto.chunks.Reassembler`), a CHUNK's data skips a
copy: once its 24-byte envelope is in, the sink checks it and says where in the reassembled
message the data goes, and the bytes are written (or ``recv_into``'d) there directly.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from .buffers import BufferPool
from .constants import (
    CHUNK_ENVELOPE_SIZE,
    EXACT_PAYLOAD_SIZES,
    FIRST_FRAME_LIMIT,
    FIRST_FRAME_TYPES,
    FRAME_MAGIC,
    HEADER_SIZE,
    SENDABLE,
    FrameType,
    Role,
)
from .errors import ErrorCode, LocalProtocolError, ProtocolError, RemoteProtocolError
from .frames import decode_payload, start_hello_reading
from .hello_reader import HELLO_FIXED_BYTES, HelloReading, hello_identity
from .limits import Limits
from .messages import AnyMessage, Chunk, as_byte_view
from .schema import CHUNK_PREFIX, HEADER_STRUCT, PREFIX_STRUCTS

_KNOWN_TYPES = {int(t) for t in FrameType}


#: A payload this large marks a bulk stream: see :meth:`FrameDecoder.header_wanted`.
BULK_PAYLOAD = 64 << 10
#: The most bytes a syncer's decoder holds after the first frame while it waits for the session
#: limits; :meth:`FrameDecoder.next_read` then asks for no more (the reader stops reading).
HELD_BYTES_CAP = 1 << 20
#: Frames a decoder parses ahead of :meth:`FrameDecoder.next_frame`; the rest of a read waits
#: as bytes. A parsed frame costs some 300 bytes of objects, so a read of tiny frames kept whole
#: (10,000 HEARTBEATs in 256 KiB) would cost over ten times its size while its reader waits.
PARSED_AHEAD = 64


class ChunkSink(Protocol):
    """Where CHUNK data goes: checks an envelope and returns the ``size`` bytes to fill.

    Raises :class:`~yeto_proto.errors.RemoteProtocolError` for a CHUNK it refuses.
    """

    def chunk_target(self, msg_id: int, total_len: int, offset: int, size: int) -> memoryview: ...


class DecoderState(enum.Enum):
    NEED_DATA = "NEED_DATA"
    CLOSED = "CLOSED"
    #: Only with ``hello_step_bytes``: a large HELLO is being read a slice at a time; call
    #: :meth:`FrameDecoder.next_frame` again (after serving other peers) to read on.
    WORKING = "WORKING"


NEED_DATA = DecoderState.NEED_DATA
CLOSED = DecoderState.CLOSED
WORKING = DecoderState.WORKING


def check_header(
    magic: int,
    raw_type: int,
    length: int,
    *,
    receiver: Role,
    limits: Limits | None,
    first_frame: bool,
) -> FrameType:
    """Validate a frame header before any payload byte is read; return its type."""
    if magic != FRAME_MAGIC:
        raise RemoteProtocolError(ErrorCode.BAD_MAGIC, f"magic 0x{magic:08X}")
    if first_frame:
        if raw_type not in FIRST_FRAME_TYPES:
            raise RemoteProtocolError(
                ErrorCode.INVALID_FIRST_FRAME,
                f"invalid first frame: type {raw_type} (expected HELLO or DATA_HELLO)",
            )
        frame_type = FrameType(raw_type)
        if frame_type is FrameType.DATA_HELLO:
            _check_exact(frame_type, length)
        elif length > FIRST_FRAME_LIMIT:
            raise RemoteProtocolError(
                ErrorCode.FRAME_TOO_LARGE, f"first frame of {length} bytes exceeds 16 MiB"
            )
        return frame_type
    if raw_type not in _KNOWN_TYPES:
        raise RemoteProtocolError(ErrorCode.UNKNOWN_FRAME_TYPE, f"frame type {raw_type}")
    frame_type = FrameType(raw_type)
    if frame_type not in SENDABLE[receiver.peer]:
        raise RemoteProtocolError(
            ErrorCode.WRONG_DIRECTION, f"a {receiver.peer.value} may not send {frame_type.name}"
        )
    if frame_type in FIRST_FRAME_TYPES:
        raise RemoteProtocolError(
            ErrorCode.UNEXPECTED_HELLO, f"{frame_type.name} is only legal as the first frame"
        )
    if frame_type in EXACT_PAYLOAD_SIZES:
        _check_exact(frame_type, length)
        return frame_type
    if limits is None:
        raise LocalProtocolError(ErrorCode.FRAME_TOO_LARGE, "no limits: call set_limits first")
    limit = limits.payload_limit(frame_type)
    if frame_type is FrameType.FINAL_MANIFEST and length != limit:
        raise RemoteProtocolError(
            ErrorCode.BAD_FRAME_LENGTH, f"FINAL_MANIFEST of {length} bytes, expected {limit}"
        )
    if length > limit:
        raise RemoteProtocolError(
            ErrorCode.FRAME_TOO_LARGE, f"{frame_type.name} of {length} bytes exceeds {limit}"
        )
    if frame_type is FrameType.CHUNK and length <= CHUNK_ENVELOPE_SIZE:
        empty = length == CHUNK_ENVELOPE_SIZE
        code = ErrorCode.CHUNK_EMPTY if empty else ErrorCode.TRUNCATED_PAYLOAD
        raise RemoteProtocolError(code, f"CHUNK of {length} bytes carries no data")
    return frame_type


def _check_exact(frame_type: FrameType, length: int) -> None:
    expected = EXACT_PAYLOAD_SIZES[frame_type]
    if length != expected:
        raise RemoteProtocolError(
            ErrorCode.BAD_FRAME_LENGTH, f"{frame_type.name} of {length} bytes, expected {expected}"
        )


@dataclass(frozen=True, slots=True)
class _Failure:
    """What poisoned a decoder, kept without the exception itself (see the module docstring)."""

    kind: type[ProtocolError]
    code: ErrorCode
    detail: str

    @classmethod
    def of(cls, error: ProtocolError) -> _Failure:
        return cls(type(error), error.code, error.detail)

    def error(self) -> ProtocolError:
        return self.kind(self.code, self.detail)


class FrameDecoder:
    """Incremental decoder for the frames one peer sends on one socket.

    ``receiver`` is our side. ``enforce_first_frame`` defaults to True for a syncer.
    ``num_learners`` lets HELLO/DATA_HELLO parsing check the learner id in its pinned place.
    """

    def __init__(
        self,
        receiver: Role,
        *,
        limits: Limits | None = None,
        num_learners: int | None = None,
        hello_key: bytes | None = None,
        enforce_first_frame: bool | None = None,
        buffers: BufferPool | None = None,
        chunk_sink: ChunkSink | None = None,
        hello_step_bytes: int | None = None,
    ) -> None:
        """``hello_step_bytes``: read a HELLO whose fragment records exceed this many bytes a
        slice of about that many bytes of records per :meth:`next_frame` call, which returns
        :data:`WORKING` until the HELLO is read (a 16 MiB HELLO is seconds of work; a receiver
        serving other peers on the same thread gives them their turns in between). ``None``
        reads every HELLO whole."""
        self.receiver = receiver
        #: Set it (at any frame boundary) to place CHUNK data straight into reassembly.
        self.chunk_sink = chunk_sink
        self._buffers = BufferPool() if buffers is None else buffers
        self._limits = limits
        self._num_learners = num_learners
        self._hello_key = hello_key
        self._first_pending = (
            receiver is Role.SYNCER if enforce_first_frame is None else enforce_first_frame
        )
        if receiver is Role.LEARNER and limits is None:
            raise LocalProtocolError(ErrorCode.FRAME_TOO_LARGE, "a learner decoder needs limits")
        self._head = bytearray()
        self._frame_type: FrameType | None = None
        self._payload: memoryview | None = None
        self._filled = 0
        self._ready: deque[tuple[FrameType, memoryview] | Chunk] = deque()
        self._last_payload = 0  # payload size of the last complete frame
        #: (msg_id, total_len, offset) of a CHUNK whose data goes to the sink's buffer.
        self._placing: tuple[int, int, int] | None = None
        self._stash: bytearray | None = None  # bytes waiting for set_limits
        #: Bytes after PARSED_AHEAD parsed frames, from ``_unparsed_at`` on: parsed once those
        #: are taken.
        self._unparsed: bytearray | None = None
        self._unparsed_at = 0
        self._error: _Failure | None = None
        self._eof = False
        self._hello_step = hello_step_bytes
        self._hello_reading: HelloReading | None = None

    # -- state -----------------------------------------------------------------------------
    @property
    def limits(self) -> Limits | None:
        return self._limits

    @property
    def mid_frame(self) -> bool:
        return (
            bool(self._head)
            or self._payload is not None
            or self._frame_type is not None
            or bool(self._stash)
            or self._unparsed is not None
        )

    @property
    def has_output(self) -> bool:
        """:meth:`next_frame` would give something now: a frame, the EOF, or the failure."""
        return (
            bool(self._ready)
            or self._hello_reading is not None
            or self._eof
            or self._error is not None
        )

    @property
    def large_hello_next(self) -> bool:
        """The next frame is a HELLO that :meth:`next_frame` would read stepwise, not started
        yet (a receiver may let one such reading run at a time)."""
        if self._hello_reading is not None or not self._ready:
            return False
        item = self._ready[0]
        return not isinstance(item, Chunk) and self._steps(*item)

    @property
    def large_hello_identity(self) -> tuple[int, int] | None:
        """``(learner_id, generation)`` of the large HELLO next or being read (as its head
        states them, not yet checked while it waits), if there is one."""
        if self._hello_reading is not None:
            return self._hello_reading.identity
        if not self.large_hello_next:
            return None
        item = self._ready[0]
        assert not isinstance(item, Chunk)
        return hello_identity(item[1])

    def _steps(self, frame_type: FrameType, payload: memoryview) -> bool:
        return (
            frame_type is FrameType.HELLO
            and self._hello_step is not None
            and len(payload) - HELLO_FIXED_BYTES > self._hello_step
        )

    def set_limits(self, limits: Limits) -> None:
        """Install the session limits; bytes held back since the first frame are decoded now."""
        self._limits = limits
        stash, self._stash = self._stash, None
        if stash:
            self._consume_or_keep(stash)

    # -- input -----------------------------------------------------------------------------
    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Take received bytes (empty: the peer's EOF).

        A syncer's decoder holds what it is fed after the first frame, unparsed, until
        :meth:`set_limits`: all of it, since ``feed`` cannot push back. A caller that reads
        more than it must there should read through :meth:`next_read`, which stops at
        :data:`HELD_BYTES_CAP` held bytes (``held_bytes`` says how many are held).
        """
        if self._eof:
            raise LocalProtocolError(ErrorCode.CONNECTION_CLOSED_MID_FRAME, "fed after EOF")
        view = as_byte_view(data)
        if not len(view):
            self._eof = True
            return
        if self._error is not None:
            return
        if self._stash is not None:
            self._stash += view
            return
        if self._unparsed is not None:  # behind the bytes that wait
            if self._unparsed_at > len(self._unparsed) // 2:
                del self._unparsed[: self._unparsed_at]
                self._unparsed_at = 0
            self._unparsed += view
            return
        used = self._consume(view)
        if used < len(view):
            self._unparsed, self._unparsed_at = bytearray(view[used:]), 0

    def _consume_or_keep(self, data: bytearray, at: int = 0) -> None:
        """Parse our own bytes ``data`` from ``at``; what waits for frames to be taken stays."""
        with memoryview(data) as whole, whole[at:] as view:
            at += self._consume(view)
        if at < len(data):
            self._unparsed, self._unparsed_at = data, at

    @property
    def held_bytes(self) -> int:
        """Bytes fed after a syncer's first frame and held, unparsed, until set_limits."""
        return 0 if self._stash is None else len(self._stash)

    def _consume(self, view: memoryview) -> int:
        """Parse ``view``; the bytes used: all of them, unless PARSED_AHEAD frames wait."""
        pos, end = 0, len(view)
        while pos < end:
            if self._payload is None:
                take = min(self._head_size() - len(self._head), end - pos)
                self._head += view[pos : pos + take]
                pos += take
                if len(self._head) < self._head_size():
                    return end
                try:
                    self._start_frame()
                except ProtocolError as exc:
                    self._error = _Failure.of(exc)
                    return end
                if self._payload is None:  # a CHUNK's envelope is next
                    continue
            else:
                assert self._payload is not None
                take = min(len(self._payload) - self._filled, end - pos)
                self._payload[self._filled : self._filled + take] = view[pos : pos + take]
                self._filled += take
                pos += take
            if self._payload is not None and self._filled == len(self._payload):
                self._finish_frame()
                if self._awaiting_limits():
                    self._stash = bytearray(view[pos:])
                    return end
                if len(self._ready) >= PARSED_AHEAD:
                    return pos
        return end

    def _awaiting_limits(self) -> bool:
        return self.receiver is Role.SYNCER and self._limits is None and not self._first_pending

    def _head_size(self) -> int:
        """Bytes read before a payload starts: the header, plus the envelope when placing."""
        if self._frame_type is FrameType.CHUNK and self.chunk_sink is not None:
            return HEADER_SIZE + CHUNK_ENVELOPE_SIZE
        return HEADER_SIZE

    def _start_frame(self) -> None:
        if self._frame_type is not None:  # the CHUNK envelope is in: ask where the data goes
            self._start_placed_chunk()
            return
        magic, raw_type, length = HEADER_STRUCT.unpack_from(self._head)
        self._frame_type = check_header(
            magic,
            raw_type,
            length,
            receiver=self.receiver,
            limits=self._limits,
            first_frame=self._first_pending,
        )
        if self._head_size() > HEADER_SIZE:
            return
        try:
            # Uninitialized: every byte is written by the peer's data before anyone reads it.
            # Aligned where a tensor would start: after the frame type's fixed fields.
            prefix = PREFIX_STRUCTS.get(self._frame_type)
            self._payload = self._buffers.take(
                length, align_at=0 if prefix is None else prefix.size
            )
        except (MemoryError, ValueError):  # within the limit, beyond this machine
            raise RemoteProtocolError(
                ErrorCode.FRAME_TOO_LARGE, f"cannot allocate {length} bytes"
            ) from None
        self._filled = 0

    def _start_placed_chunk(self) -> None:
        assert self.chunk_sink is not None
        length = HEADER_STRUCT.unpack_from(self._head)[2]
        msg_id, total_len, offset = CHUNK_PREFIX.unpack_from(self._head, HEADER_SIZE)
        self._payload = self.chunk_sink.chunk_target(
            msg_id, total_len, offset, length - CHUNK_ENVELOPE_SIZE
        )
        self._placing = (msg_id, total_len, offset)
        self._filled = 0

    # -- direct reads ----------------------------------------------------------------------
    def writable(self) -> memoryview | None:
        """Where a socket may ``recv_into`` directly: the unfilled rest of the current payload.

        ``None`` while the decoder needs header bytes (use :meth:`feed`), has failed, or holds
        bytes back for :meth:`set_limits`. After writing ``n`` bytes there, call
        :meth:`wrote`. This skips the copy that :meth:`feed` makes, for large payloads.
        """
        if (
            self._payload is None
            or self._error is not None
            or self._eof
            or self._stash
            or self._unparsed is not None
        ):
            return None
        return self._payload[self._filled :]

    def header_wanted(self) -> int:
        """How many bytes complete the next header (and CHUNK envelope), after a bulk frame.

        After a frame whose payload reached :data:`BULK_PAYLOAD`, a reader that reads exactly
        this many bytes next, instead of filling a big buffer, gets the following payload
        through :meth:`writable` rather than through the copy :meth:`feed` makes. 0 when it
        does not apply (inside a payload, after small frames, failed, or holding bytes back).
        """
        if (
            self._payload is not None
            or self._error is not None
            or self._eof
            or self._stash
            or self._unparsed is not None
            or self._last_payload < BULK_PAYLOAD
        ):
            return 0
        return self._head_size() - len(self._head)

    def next_read(self, scratch: memoryview) -> tuple[memoryview, bool]:
        """Where a socket's next ``recv_into`` should write, and whether that is in place.

        ``(view, True)``: the unfilled rest of a payload of at least :data:`BULK_PAYLOAD`
        bytes; report the count with :meth:`wrote`. ``(view, False)``: a prefix of ``scratch``
        — just the next header after a bulk frame (so the payload behind it is read in place),
        else all of it; pass what was read to :meth:`feed`. Small payloads go through
        ``scratch``: one read then covers many frames.

        A syncer's decoder without its session limits reads no further than the end of the
        first frame, then holds at most :data:`HELD_BYTES_CAP` bytes: past that the view is
        empty, and the reader must not read (TCP pushes back on the peer) until
        :meth:`set_limits` or more room.
        """
        target = self.writable()
        if target is not None and len(target) >= BULK_PAYLOAD:
            return target, True
        if self.receiver is Role.SYNCER and self._limits is None and self._error is None:
            return scratch[: self._room_before_limits()], False
        wanted = self.header_wanted()
        return (scratch[:wanted] if wanted else scratch), False

    def _room_before_limits(self) -> int:
        if self._stash is not None:
            return max(0, HELD_BYTES_CAP - len(self._stash))
        if self._payload is None:
            return self._head_size() - len(self._head)
        return len(self._payload) - self._filled

    def placed_chunk(self) -> tuple[Chunk, int] | None:
        """The CHUNK whose data is being read in place, and how many of its bytes are in.

        The Chunk's ``data`` is its whole target view, bytes still to come included. ``None``
        between CHUNKs and for frames read any other way. A caller that wants to look at bytes
        as they land (while they are still in cache) asks before :meth:`wrote`, which hands a
        finished CHUNK on and forgets it.
        """
        if self._placing is None or self._payload is None:
            return None
        return Chunk(*self._placing, data=self._payload), self._filled

    def frame_in_place(self) -> tuple[FrameType, memoryview, int] | None:
        """The frame (not a placed CHUNK) whose payload is being read in place: its type, its
        whole payload view, and how many payload bytes are in; ``None`` otherwise.

        Bytes that came through :meth:`feed` before the in-place reads began count as in. Ask
        before :meth:`wrote`, as for :meth:`placed_chunk`.
        """
        if self._placing is not None or self._payload is None or self._frame_type is None:
            return None
        return self._frame_type, self._payload, self._filled

    def wrote(self, count: int) -> None:
        """Account for ``count`` bytes a socket wrote into :meth:`writable`'s view."""
        if self._payload is None or not 0 <= count <= len(self._payload) - self._filled:
            raise LocalProtocolError(ErrorCode.FIELD_OUT_OF_RANGE, f"wrote {count} bytes")
        self._filled += count
        if self._filled == len(self._payload):
            self._finish_frame()
            if self._awaiting_limits():  # as after a fed first frame: hold what follows
                self._stash = bytearray()

    def _finish_frame(self) -> None:
        assert self._frame_type is not None and self._payload is not None
        self._last_payload = len(self._payload)
        if self._placing is not None:
            self._ready.append(Chunk(*self._placing, data=self._payload))
            self._placing = None
        else:
            self._ready.append((self._frame_type, self._payload))
        self._head.clear()
        self._payload = None
        self._frame_type = None
        self._first_pending = False

    # -- output ----------------------------------------------------------------------------
    def next_frame(self) -> AnyMessage | DecoderState:
        if self._hello_reading is not None:
            return self._read_hello_on()
        if self._ready:
            item = self._ready.popleft()
            if not self._ready and self._unparsed is not None:  # so has_output stays true
                unparsed, self._unparsed = self._unparsed, None
                self._consume_or_keep(unparsed, self._unparsed_at)
            if isinstance(item, Chunk):
                return item
            frame_type, payload = item
            try:
                if self._steps(frame_type, payload):
                    self._hello_reading = start_hello_reading(
                        payload, num_learners=self._num_learners, hello_key=self._hello_key
                    )
                    return self._read_hello_on()
                return decode_payload(
                    frame_type,
                    payload,
                    limits=self._limits,
                    num_learners=self._num_learners,
                    hello_key=self._hello_key,
                )
            except RemoteProtocolError as exc:
                self._poison(exc)
                raise
        if self._error is not None:
            raise self._error.error()
        if self._eof:
            if self.mid_frame:
                self._poison(
                    RemoteProtocolError(
                        ErrorCode.CONNECTION_CLOSED_MID_FRAME, "stream ended inside a frame"
                    )
                )
                assert self._error is not None
                # Never a local name for it: the traceback's frame would hold it (a cycle).
                raise self._error.error()
            return CLOSED
        return NEED_DATA

    def _read_hello_on(self) -> AnyMessage | DecoderState:
        reading = self._hello_reading
        assert reading is not None and self._hello_step is not None
        try:
            hello = reading.advance(self._hello_step)
        except RemoteProtocolError as exc:
            self._hello_reading = None
            self._poison(exc)
            raise
        except LocalProtocolError as exc:  # a constructor refused what the peer sent
            self._hello_reading = None
            self._poison(RemoteProtocolError(exc.code, exc.detail))
            assert self._error is not None
            raise self._error.error() from None
        if hello is None:
            return WORKING
        self._hello_reading = None
        return hello

    def _poison(self, exc: ProtocolError) -> None:
        self._error = _Failure.of(exc)
        self._ready.clear()
        self._stash = None
        self._unparsed = None

    def frames(self) -> list[AnyMessage]:
        """Every frame decodable now (convenience for tests and simple loops)."""
        out: list[AnyMessage] = []
        while True:
            item = self.next_frame()
            if isinstance(item, DecoderState):
                return out
            out.append(item)
