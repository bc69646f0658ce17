"""CHUNK striping: slicing an inner frame into CHUNKs, and reassembling them.

The inner frame is a complete frame (13-byte header included). A sender numbers messages from 0
per connection generation and deals CHUNKs round-robin over its data streams, the position
carrying on across messages. A receiver accepts CHUNKs in any order, from any of the group's
sockets, and checks every rule of spec/striping.md before it copies a byte.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from .buffers import BufferPool, buffer_address
from .constants import (
    CHUNK_ENVELOPE_SIZE,
    CHUNK_SLICE_SIZE,
    FRAME_MAGIC,
    HEADER_SIZE,
    MAX_CHUNK_RANGES,
    MAX_PARTIAL_MESSAGES,
    MSG_ID_WINDOW,
    STRIPED_TYPES,
    FrameType,
    Role,
)
from .decoder import check_header
from .errors import ErrorCode, LocalProtocolError, RemoteProtocolError
from .frames import Buffers, decode_payload, frame_length, header
from .limits import Limits
from .messages import AnyMessage, Chunk, as_byte_view
from .schema import CHUNK_PREFIX, HEADER_STRUCT, PREFIX_STRUCTS


def _views(buffers: Sequence[bytes | memoryview], start: int, stop: int) -> list[memoryview]:
    """Views of bytes ``start:stop`` of the concatenation of ``buffers`` (no copy)."""
    out: list[memoryview] = []
    base = 0
    for buf in buffers:
        view = as_byte_view(buf)
        lo, hi = max(start - base, 0), min(stop - base, len(view))
        if lo < hi:
            out.append(view[lo:hi])
        base += len(view)
        if base >= stop:
            break
    return out


@dataclass(frozen=True, slots=True)
class StripedFrame:
    """One outgoing CHUNK: the data stream (0-based DATA_HELLO index) and its buffers."""

    stream_idx: int
    buffers: Buffers


class ChunkSlicer:
    """Slices inner frames into CHUNK frames over ``num_data_streams`` data sockets."""

    def __init__(self, num_data_streams: int, slice_size: int = CHUNK_SLICE_SIZE) -> None:
        if num_data_streams < 1:
            raise LocalProtocolError(ErrorCode.BAD_STREAM_INDEX, "striping needs a data stream")
        if not 0 < slice_size <= CHUNK_SLICE_SIZE:
            raise LocalProtocolError(ErrorCode.FRAME_TOO_LARGE, f"slice size {slice_size}")
        self.num_data_streams = num_data_streams
        self.slice_size = slice_size
        self._next_msg_id = 0
        self._next_stream = 0

    @property
    def next_msg_id(self) -> int:
        """The id :meth:`slice` gives the next message (one more than the last one's)."""
        return self._next_msg_id

    def slice(self, inner_frame: Buffers) -> list[StripedFrame]:
        msg_id = self._next_msg_id
        self._next_msg_id += 1
        out = []
        for piece in self.pieces(inner_frame, msg_id):
            out.append(StripedFrame(self._next_stream, piece))
            self._next_stream = (self._next_stream + 1) % self.num_data_streams
        return out

    def pieces(self, inner_frame: Buffers, msg_id: int) -> list[Buffers]:
        """The CHUNK frames of ``inner_frame`` as message ``msg_id``, in offset order.

        Touches neither the message count nor the round-robin: a sender that replaces a queued,
        unstarted message by one of the same size reuses the old one's id and slots.
        """
        total = frame_length(inner_frame)
        out: list[Buffers] = []
        for offset in range(0, total, self.slice_size):
            part = _views(inner_frame, offset, min(offset + self.slice_size, total))
            size = frame_length(part)
            head = header(FrameType.CHUNK, CHUNK_ENVELOPE_SIZE + size) + CHUNK_PREFIX.pack(
                msg_id, total, offset
            )
            out.append([head, *part])
        return out


#: Where the tensor of the bulk message each side receives starts in its reassembled frame (a
#: learner's BCAST and FINAL_FRAGMENT, the syncer's PUSH): reassembly buffers align it, so the
#: values are read at full speed where they landed (the syncer's INIT lands 4-byte aligned).
_TENSOR_AT = {
    Role.LEARNER: HEADER_SIZE + PREFIX_STRUCTS[FrameType.BCAST_FRAGMENT].size,
    Role.SYNCER: HEADER_SIZE + PREFIX_STRUCTS[FrameType.PUSH_FRAGMENT].size,
}


class _Partial:
    __slots__ = ("total_len", "buffer", "address", "spans", "filled", "placed")

    def __init__(self, total_len: int, buffers: BufferPool, receiver: Role) -> None:
        self.total_len = total_len
        # Uninitialized: a message completes only once every byte has been written.
        self.buffer = buffers.take(total_len, align_at=_TENSOR_AT[receiver])
        self.address = buffer_address(self.buffer)
        self.spans: list[tuple[int, int]] = []  # sorted, disjoint, not touching [start, end)
        self.filled = 0
        #: Offsets handed out by chunk_target whose CHUNK has not come back through add().
        self.placed: set[int] = set()

    def max_ranges(self) -> int:
        """Separate received ranges a message may have at once (spec/striping.md § 4, rule 9).

        Twice what a sender slicing as pinned (4 MiB) can ever leave, in any arrival order.
        """
        return max(MAX_CHUNK_RANGES, 2 * -(-self.total_len // CHUNK_SLICE_SIZE))

    def reserve(self, msg_id: int, start: int, end: int) -> None:
        """Record ``[start, end)`` as received: refused if it overlaps, or splits the message
        into too many ranges. Touching ranges are kept as one, so the bookkeeping of a
        message stays small however finely it is sliced, as long as it arrives in order."""
        spans = self.spans
        i = bisect.bisect_left(spans, (start, end))
        if (i > 0 and spans[i - 1][1] > start) or (i < len(spans) and spans[i][0] < end):
            raise RemoteProtocolError(
                ErrorCode.CHUNK_OVERLAP, f"message {msg_id}: bytes {start}..{end}"
            )
        joins_left = i > 0 and spans[i - 1][1] == start
        joins_right = i < len(spans) and spans[i][0] == end
        if joins_left and joins_right:
            spans[i - 1] = (spans[i - 1][0], spans.pop(i)[1])
        elif joins_left:
            spans[i - 1] = (spans[i - 1][0], end)
        elif joins_right:
            spans[i] = (start, spans[i][1])
        elif len(spans) >= self.max_ranges():
            raise RemoteProtocolError(
                ErrorCode.CHUNK_TOO_FRAGMENTED,
                f"message {msg_id}: more than {self.max_ranges()} separate byte ranges",
            )
        else:
            spans.insert(i, (start, end))

    @property
    def complete(self) -> bool:
        """Every byte has been received (or reserved by an in-place read under way)."""
        return self.spans == [(0, self.total_len)]


class CompletedIds:
    """Which message ids of one group have completed, in at most 16 KiB.

    Ids count up from 0 per generation and are never reused. Within :data:`MSG_ID_WINDOW` of
    the highest id started so far each id has a bit (at most twice that many are kept); every
    id further below counts as completed. Remembering every completed id instead let a peer
    that skips one id (or starts at 1) make the receiver keep a record of each message it
    sent, for as long as the group lived.
    """

    def __init__(self) -> None:
        self._highest = -1
        #: Bit k: id ``_highest - k`` completed.
        self._bits = 0

    def __contains__(self, msg_id: int) -> bool:
        below = self._highest - msg_id
        if below < 0:
            return False
        return below >= MSG_ID_WINDOW or bool(self._bits >> below & 1)

    def started(self, msg_id: int) -> None:
        """A message's first CHUNK was admitted: the window moves up to its id."""
        step = msg_id - self._highest
        if step <= 0:
            return
        self._bits = self._bits << step if step < MSG_ID_WINDOW else 0
        if self._bits.bit_length() > 2 * MSG_ID_WINDOW:  # bits past the window mean nothing
            self._bits &= _WINDOW_MASK
        self._highest = msg_id

    def add(self, msg_id: int) -> None:
        """``msg_id`` (started, see :meth:`started`) completed."""
        below = self._highest - msg_id
        if 0 <= below < MSG_ID_WINDOW:
            self._bits |= 1 << below


_WINDOW_MASK = (1 << MSG_ID_WINDOW) - 1


class Reassembler:
    """Reassembles the CHUNKs one connection group receives; drop it with the group."""

    def __init__(
        self,
        receiver: Role,
        limits: Limits,
        max_partials: int = MAX_PARTIAL_MESSAGES,
        buffers: BufferPool | None = None,
    ) -> None:
        self.receiver = receiver
        self._buffers = BufferPool() if buffers is None else buffers
        self.limits = limits
        self.max_partials = max_partials
        self.inner_limit = limits.inner_limit(receiver)
        self._partials: dict[int, _Partial] = {}
        #: Messages of ``_partials`` with bytes still to come: rule 5 counts these. A message
        #: whose every byte arrived is complete even before :meth:`add` hands it over (a
        #: decoder may reserve a whole read's worth of small messages first).
        self._incomplete = 0
        # A late duplicate of a finished message is still an overlap.
        self._completed = CompletedIds()

    @property
    def pending(self) -> int:
        return len(self._partials)

    def clear(self) -> None:
        self._partials.clear()
        self._incomplete = 0

    def add(self, chunk: Chunk) -> AnyMessage | None:
        """Take one CHUNK; return the decoded inner message once it is complete.

        A CHUNK whose data a decoder already wrote in place (see :meth:`chunk_target`) is
        only counted; any other is checked and copied into its message's buffer.
        """
        size = len(chunk.data)
        partial = self._partials.get(chunk.msg_id)
        end = chunk.offset + size
        if (
            partial is not None
            and chunk.offset in partial.placed
            and chunk.total_len == partial.total_len
            and size
            and buffer_address(chunk.data) == partial.address + chunk.offset
        ):
            partial.placed.remove(chunk.offset)
        else:
            partial = self._admit(chunk.msg_id, chunk.total_len, chunk.offset, size)
            partial.buffer[chunk.offset : end] = chunk.data
        partial.filled += size
        if partial.filled < partial.total_len:
            return None
        del self._partials[chunk.msg_id]
        self._completed.add(chunk.msg_id)
        return decode_inner_frame(partial.buffer, self.receiver, self.limits)

    def chunk_target(self, msg_id: int, total_len: int, offset: int, size: int) -> memoryview:
        """Where a decoder may write a CHUNK's ``size`` data bytes straight away.

        Runs every check :meth:`add` runs, as soon as the CHUNK's envelope is known, and
        reserves the bytes, so an overlapping CHUNK on another socket is refused even before
        this one's data arrived. Hand the decoded CHUNK to :meth:`add` as usual afterwards.
        """
        partial = self._admit(msg_id, total_len, offset, size)
        partial.placed.add(offset)
        return partial.buffer[offset : offset + size]

    def _admit(self, msg_id: int, total_len: int, offset: int, size: int) -> _Partial:
        """The partial message a new CHUNK goes into, after every rule of spec/striping.md;
        its range then counts as received."""
        if size == 0:
            raise RemoteProtocolError(ErrorCode.CHUNK_EMPTY, f"message {msg_id}")
        if offset + size > total_len:
            raise RemoteProtocolError(
                ErrorCode.CHUNK_OUT_OF_BOUNDS,
                f"message {msg_id}: {offset}+{size} > {total_len}",
            )
        partial = self._partials.get(msg_id)
        # A partial far below the window's top is still a partial: only new ids count as done.
        if (partial is None and msg_id in self._completed) or (
            partial is not None and partial.complete
        ):
            raise RemoteProtocolError(
                ErrorCode.CHUNK_OVERLAP, f"message {msg_id} was already complete"
            )
        if partial is None:
            if total_len > self.inner_limit:
                raise RemoteProtocolError(
                    ErrorCode.CHUNK_TOTAL_TOO_LARGE,
                    f"message {msg_id}: {total_len} > {self.inner_limit}",
                )
            if total_len < HEADER_SIZE:
                raise RemoteProtocolError(
                    ErrorCode.BAD_INNER_FRAME, f"message {msg_id} shorter than a header"
                )
            if self._incomplete >= self.max_partials:
                raise RemoteProtocolError(
                    ErrorCode.TOO_MANY_PARTIALS, f"more than {self.max_partials} partial messages"
                )
            try:
                partial = _Partial(total_len, self._buffers, self.receiver)
            except (
                MemoryError,
                OverflowError,
                ValueError,
            ):  # within the limit, beyond this machine
                raise RemoteProtocolError(
                    ErrorCode.CHUNK_TOTAL_TOO_LARGE,
                    f"message {msg_id}: cannot allocate {total_len} bytes",
                ) from None
            self._partials[msg_id] = partial
            self._incomplete += 1
            self._completed.started(msg_id)
        elif total_len != partial.total_len:
            raise RemoteProtocolError(
                ErrorCode.CHUNK_TOTAL_CHANGED,
                f"message {msg_id}: total {total_len} != {partial.total_len}",
            )
        partial.reserve(msg_id, offset, offset + size)
        if partial.complete:
            self._incomplete -= 1
        return partial


def decode_inner_frame(
    frame: bytearray | bytes | memoryview, receiver: Role, limits: Limits
) -> AnyMessage:
    """Decode a reassembled inner frame: a striped type, in direction, with ``len`` = size − 13."""
    view = memoryview(frame)
    if len(view) < HEADER_SIZE:
        raise RemoteProtocolError(ErrorCode.BAD_INNER_FRAME, "inner frame shorter than a header")
    magic, raw_type, length = HEADER_STRUCT.unpack_from(view)
    if magic != FRAME_MAGIC:
        raise RemoteProtocolError(ErrorCode.BAD_INNER_FRAME, f"inner magic 0x{magic:08X}")
    if length != len(view) - HEADER_SIZE:
        raise RemoteProtocolError(
            ErrorCode.BAD_INNER_FRAME, f"inner len {length} != total_len - 13 ({len(view) - 13})"
        )
    if raw_type not in {int(t) for t in STRIPED_TYPES}:
        raise RemoteProtocolError(ErrorCode.BAD_INNER_FRAME, f"type {raw_type} is never striped")
    frame_type = check_header(
        magic, raw_type, length, receiver=receiver, limits=limits, first_frame=False
    )
    return decode_payload(frame_type, view[HEADER_SIZE:], limits=limits)
