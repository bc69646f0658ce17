"""Connection groups, sans-IO: which socket belongs to which learner, and what to do with bytes.

A learner's connection group is one control socket (its first frame is HELLO) plus
``num_streams`` data sockets (their first frame is DATA_HELLO with the same learner id and
generation). :class:`ConnectionGroups` owns one syncer-side :class:`~yeto_proto.FrameDecoder`
per socket and one :class:`~yeto_proto.Reassembler` and :class:`~yeto_proto.ChunkSlicer` per
group. It never touches a socket or a clock: a transport feeds it bytes and ``now``, carries
out the :data:`WireCommand` values it returns, and hands the coordinator the events it queues.

The rules it enforces (PINNED.md § HELLO and DATA_HELLO, § Striping):

- at most ``max_unsettled`` sockets wait for their first frame or their group, holding at most
  ``max_unsettled_bytes`` between them: past either bound the oldest of them (not one whose HELLO
  the coordinator is deciding) is closed, without ERROR (a learner caught by it redials, where
  ERROR would end its run), so a learner whose handshake takes milliseconds always gets in;
- a socket's first frame must arrive within ``handshake_timeout`` seconds (``HANDSHAKE_TIMEOUT``);
  a HELLO becomes :class:`~yeto_sync.events.HelloReceived` and waits, without a deadline, for
  the coordinator's answer (a busy coordinator is not the peer's fault);
- a DATA_HELLO waits up to ``attach_timeout`` seconds for its group's HELLO, then gets
  ``UNKNOWN_GROUP`` (at once if that HELLO is refused); its ``stream_idx`` must lie in
  ``0..num_streams-1`` and be new to the group (``BAD_STREAM_INDEX`` / ``DUPLICATE_STREAM``);
  a refused DATA_HELLO closes only its socket;
- an admitted group whose data sockets are not all in within ``attach_timeout`` is closed
  (``HANDSHAKE_TIMEOUT``); once they are, :class:`~yeto_sync.events.GroupReady` is queued;
- messages of a group that is not ready yet are held (at most ``MAX_HELD_MESSAGES``) and
  delivered right after its ``GroupReady``, so the coordinator only hears from ready groups;
  once that many are held its sockets read nothing more (TCP pushes back on the learner) until
  it is ready: learner 0 sends an INIT of every fragment at once, and a data socket whose
  DATA_HELLO comes a retransmission late must not end its run;
- CHUNKs from any socket of a group, stream 0 included, go to the group's reassembler; in an
  f32 session each CHUNK's values (and an unstriped PUSH's or INIT's, when read in place) are
  also checked for NaN/inf read by read as they land (:mod:`.finite_scan`), and the verdict
  rides on the message's ``MessageReceived``;
- any protocol error on a socket sends ERROR on that socket and closes the whole group (its
  partial messages die with it) with :class:`~yeto_sync.events.GroupClosed`; other groups are
  untouched.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from yeto_proto import (
    CLOSED,
    WORKING,
    AnyMessage,
    Chunk,
    ChunkSlicer,
    DataHello,
    DecoderState,
    ErrorCode,
    ErrorMessage,
    FrameDecoder,
    Hello,
    Limits,
    ProtocolError,
    Reassembler,
    RemoteProtocolError,
    Role,
    WireDtype,
    encode,
)
from yeto_proto.constants import ERROR_TEXT_LIMIT, MAX_STREAMS, STRIPED_TYPES
from yeto_proto.frames import Buffers, frame_length

from ..events import (
    ConnId,
    Event,
    GroupClosed,
    GroupKey,
    GroupReady,
    HelloReceived,
    MessageReceived,
)
from ..payload_progress import PayloadProgress
from .finite_scan import FiniteScan
from .log_throttle import LogThrottle

HANDSHAKE_TIMEOUT_S = 10.0
ATTACH_TIMEOUT_S = 10.0
#: Messages a group may send before its data streams are all attached.
MAX_HELD_MESSAGES = 256
#: Bytes of a large HELLO's fragment records read per turn of the TCP daemon's event loop (~5,000
#: minimal records, ~15-20 ms here): a 16 MiB HELLO of 1.29 million distinct fragments takes
#: seconds to read, and every other peer, timer and signal would wait that long for it whole.
HELLO_STEP_BYTES = 64 << 10
#: How often a socket whose large HELLO waits for another one's reading looks again.
HELLO_TURN_POLL_S = 0.02
#: Sockets that have not yet become part of a group (each may hold a HELLO of up to 16 MiB).
MAX_UNSETTLED_SOCKETS = 256
#: Bytes those sockets may hold between them (16 HELLOs of the largest size).
MAX_UNSETTLED_BYTES = 256 << 20

FIRST_FRAME_PREFIX = "invalid first frame: "
HELLO_AUTH_PREFIX = "HELLO authentication failed: "
#: Header-level failures of a socket's first frame; their ERROR text carries the pinned prefix.
_FIRST_FRAME_CODES = frozenset(
    {
        ErrorCode.BAD_MAGIC,
        ErrorCode.INVALID_FIRST_FRAME,
        ErrorCode.FRAME_TOO_LARGE,
        ErrorCode.BAD_FRAME_LENGTH,
    }
)

#: ``log(level, text, fields)``: where the table reports connections and errors.
LogFn = Callable[[str, str, Mapping[str, object]], None]


def _no_log(level: str, text: str, fields: Mapping[str, object]) -> None:
    pass


def error_text(error: ProtocolError, *, first_frame: bool = False) -> str:
    """The ERROR text for ``error``: ``"<CODE>: detail"``, with the pinned prefixes.

    A header-level failure of a socket's first frame reads ``"invalid first frame: <CODE>: …"``
    and a bad HELLO MAC ``"HELLO authentication failed: <CODE>: …"`` (PINNED.md).
    """
    detail = error.detail
    if error.code is ErrorCode.INVALID_FIRST_FRAME:
        detail = detail.removeprefix(FIRST_FRAME_PREFIX)
    text = f"{error.code.value}: {detail}" if detail else error.code.value
    if first_frame and error.code in _FIRST_FRAME_CODES:
        text = FIRST_FRAME_PREFIX + text
    elif error.code is ErrorCode.HELLO_AUTH_FAILED:
        text = HELLO_AUTH_PREFIX + text
    encoded = text.encode("utf-8")
    if len(encoded) > ERROR_TEXT_LIMIT:
        text = encoded[:ERROR_TEXT_LIMIT].decode("utf-8", "ignore")
    return text


# -- what a transport must do -------------------------------------------------------------------
#: How many leading bytes of a frame may be written now; raises
#: :class:`~yeto_sync.payload_progress.PayloadWithdrawn` once they never all will.
Writable = Callable[[], int]


@dataclass(frozen=True, slots=True)
class Transmit:
    """Queue one frame (its buffers, in order) on ``conn``.

    ``writable`` is set for a frame whose payload is still being written (a streamed BCAST);
    ``progress`` is what it reads, for a writer that waits for it to grow.
    """

    conn: ConnId
    buffers: Buffers
    writable: Writable | None = None
    progress: PayloadProgress | None = None

    @property
    def size(self) -> int:
        return frame_length(self.buffers)


def _writable_part(
    progress: PayloadProgress, payload_at: int, start: int, stop: int, envelope: int
) -> Writable:
    """For a frame carrying bytes ``[start, stop)`` of a message after an ``envelope``-byte
    head of its own, where the message's payload begins at ``payload_at``: the frame's
    writable prefix as the payload's final prefix grows."""

    def writable() -> int:
        final = payload_at + progress.ready
        return envelope + min(max(final - start, 0), stop - start)

    return writable


@dataclass(frozen=True, slots=True)
class Hangup:
    """Close ``conn``: drop frames not yet started, send ``error`` if given, then close."""

    conn: ConnId
    error: ErrorMessage | None = None
    #: What named the socket while it was known (its group, for a member): once the command
    #: is out, :meth:`ConnectionGroups.socket_fields` knows it no more.
    fields: Mapping[str, object] = field(default_factory=dict, compare=False)


WireCommand = Transmit | Hangup


class Phase(enum.Enum):
    HANDSHAKE = "handshake"  # waiting for the first frame
    ADMISSION = "admission"  # HELLO handed to the coordinator, waiting for its answer
    ATTACH = "attach"  # DATA_HELLO waiting for its group to be admitted
    MEMBER = "member"  # control or data socket of an admitted group


class _Socket:
    __slots__ = ("conn", "decoder", "phase", "deadline", "group", "stream_idx", "claim", "held")

    def __init__(self, conn: ConnId, decoder: FrameDecoder, deadline: float) -> None:
        self.conn = conn
        self.decoder = decoder
        self.phase = Phase.HANDSHAKE
        self.deadline: float | None = deadline
        self.group: GroupKey | None = None
        self.stream_idx: int | None = None  # None: the control socket (stream 0)
        self.claim: DataHello | None = None
        #: Bytes received before the socket joined a group (counted against the shared bound).
        self.held = 0

    def describe(self) -> str:
        if self.phase is not Phase.MEMBER:
            return "unattached socket"  # no stream index yet, whatever its first frame says
        return "stream 0" if self.stream_idx is None else f"data stream {self.stream_idx}"


class _Group:
    __slots__ = (
        "key",
        "control",
        "num_streams",
        "limits",
        "data",
        "reassembler",
        "slicer",
        "ready",
        "held",
        "deadline",
        "scan",
    )

    def __init__(
        self,
        key: GroupKey,
        control: ConnId,
        num_streams: int,
        limits: Limits,
        deadline: float,
    ) -> None:
        self.key = key
        self.control = control
        self.num_streams = num_streams
        self.limits = limits
        self.data: dict[int, ConnId] = {}
        self.reassembler = Reassembler(Role.SYNCER, limits)
        self.slicer = ChunkSlicer(num_streams) if num_streams else None
        self.ready = False
        self.held: list[MessageReceived] = []
        self.deadline: float | None = deadline
        self.scan = FiniteScan() if limits.dtype is WireDtype.F32 else None

    def members(self) -> list[ConnId]:
        return [self.control, *self.data.values()]


class ConnectionGroups:
    """Every socket of the syncer and the groups they form (see the module docstring).

    Methods that change state return the wire commands to carry out, in order; events for the
    coordinator accumulate in :attr:`events` (pop them with :meth:`pop_event`).
    """

    def __init__(
        self,
        num_learners: int,
        *,
        hello_key: bytes | None = None,
        handshake_timeout: float = HANDSHAKE_TIMEOUT_S,
        attach_timeout: float = ATTACH_TIMEOUT_S,
        max_unsettled: int = MAX_UNSETTLED_SOCKETS,
        max_unsettled_bytes: int = MAX_UNSETTLED_BYTES,
        max_backlog: int | None = None,
        log: LogFn | None = None,
        hello_step_bytes: int | None = None,
    ) -> None:
        """``hello_step_bytes``: read a large HELLO about that many bytes of records per
        :meth:`drain` (:class:`~yeto_proto.FrameDecoder`), one such HELLO at a time; the caller
        drains a socket that :meth:`holds_frames` again after serving the others, and lets a
        socket that :meth:`waits_for_hello_turn` wait. ``None`` reads each HELLO whole."""
        self.num_learners = num_learners
        self.hello_step_bytes = hello_step_bytes
        #: The socket whose large HELLO is being read, a slice per drain (at most one: a
        #: 16 MiB HELLO of distinct fragments is ~200 MiB of objects while it is read), and
        #: those whose large HELLO waits for its turn, in arrival order.
        self._hello_reader: ConnId | None = None
        self._hello_queue: dict[ConnId, None] = {}
        #: The group each of those HELLOs names: its data sockets wait for it without the
        #: attach deadline, as for a HELLO the coordinator is deciding.
        self._hello_keys: dict[ConnId, GroupKey] = {}
        self.hello_key = hello_key
        self.handshake_timeout = handshake_timeout
        self.attach_timeout = attach_timeout
        self.max_unsettled = max_unsettled
        self.max_unsettled_bytes = max_unsettled_bytes
        #: Events waiting for the driver at most: frames past it wait, decoded, in their
        #: socket until :meth:`drain` (None: no bound, for callers that take every event).
        self.max_backlog = max_backlog
        self._log = log if log is not None else _no_log
        #: Lines about sockets without a group (anyone can cause them) are written at most
        #: once per period; ``_now`` is the latest time a caller passed in.
        self._throttle = LogThrottle()
        self._now = 0.0
        self.events: deque[Event] = deque()
        #: Sockets whose decoder holds frames (or its EOF) that the bounded backlog left there,
        #: in the order they were held back: :meth:`drain_held` hands them on as room appears.
        self._held: dict[ConnId, None] = {}
        self._sockets: dict[ConnId, _Socket] = {}
        #: Every socket not yet a member, oldest first.
        self._unsettled: dict[ConnId, _Socket] = {}
        self._unsettled_bytes = 0
        self._groups: dict[GroupKey, _Group] = {}
        #: HELLOs handed to the coordinator and not yet answered, by socket.
        self._pending: dict[ConnId, GroupKey] = {}
        self._wire: list[WireCommand] = []

    # -- queries ---------------------------------------------------------------------------
    def pop_event(self) -> Event | None:
        return self.events.popleft() if self.events else None

    @property
    def backlog(self) -> int:
        return len(self.events)

    def is_open(self, conn: ConnId) -> bool:
        return conn in self._sockets

    def has_group(self, key: GroupKey) -> bool:
        return key in self._groups

    def streams_of(self, key: GroupKey) -> dict[int, ConnId]:
        """Data stream index → socket of an admitted group (empty for an unknown group)."""
        group = self._groups.get(key)
        return {} if group is None else dict(group.data)

    def sockets_of(self, key: GroupKey) -> list[ConnId]:
        """Stream 0 and the data sockets of an admitted group (empty for an unknown group)."""
        group = self._groups.get(key)
        return [] if group is None else group.members()

    def socket_fields(self, conn: ConnId) -> dict[str, object]:
        """Log fields naming ``conn``: which socket it is and, once it has one, its group."""
        sock = self._sockets.get(conn)
        if sock is None:
            return {"conn": conn}
        fields: dict[str, object] = {"conn": conn, "socket": sock.describe()}
        if sock.group is not None:
            fields.update(learner_id=sock.group.learner_id, generation=sock.group.generation)
        return fields

    def next_deadline(self) -> float | None:
        """The earliest handshake, attach or readiness deadline, if any is pending."""
        deadlines = [s.deadline for s in self._unsettled.values() if s.deadline is not None]
        deadlines += [g.deadline for g in self._groups.values() if g.deadline is not None]
        return min(deadlines, default=None)

    # -- socket lifecycle ------------------------------------------------------------------
    def open(self, conn: ConnId, now: float) -> list[WireCommand]:
        """A new socket: it has ``handshake_timeout`` seconds to send its first frame."""
        if conn in self._sockets:
            raise ValueError(f"connection {conn} is already open")
        self._now = now
        if len(self._unsettled) >= self.max_unsettled:
            oldest = self._oldest_evictable()
            if oldest is None:  # every one of them waits for the coordinator's answer
                why = f"{self.max_unsettled} HELLOs wait for admission"
                self._log_unsettled("warning", "connection refused", {"conn": conn, "why": why})
                return [Hangup(conn)]
            self._evict(oldest, f"{self.max_unsettled} sockets without a group", now)
        decoder = FrameDecoder(
            Role.SYNCER,
            num_learners=self.num_learners,
            hello_key=self.hello_key,
            hello_step_bytes=self.hello_step_bytes,
        )
        sock = _Socket(conn, decoder, now + self.handshake_timeout)
        self._sockets[conn] = sock
        self._unsettled[conn] = sock
        return self._take_wire()  # the socket evicted to make room, if any

    def make_room(self, now: float) -> list[WireCommand]:
        """No socket can be opened now (out of descriptors): close the oldest without a group."""
        oldest = self._oldest_evictable()
        if oldest is not None:
            self._evict(oldest, "no room for a new connection", now)
        return self._take_wire()

    def receive(
        self, conn: ConnId, data: bytes | bytearray | memoryview, now: float
    ) -> list[WireCommand]:
        """Bytes read from ``conn`` (``b""`` = the peer closed it). The data is copied."""
        self._now = now
        sock = self._sockets.get(conn)
        if sock is not None and self._may_hold(sock, len(data), now):
            sock.decoder.feed(data)
            self._drain(sock, now)
        return self._take_wire()

    def next_read(self, conn: ConnId, scratch: memoryview) -> tuple[memoryview, bool]:
        """Where ``conn``'s next read goes (:meth:`FrameDecoder.next_read`): in place or not.
        Empty while the socket may not read (the transport waits for a wake-up)."""
        sock = self._sockets.get(conn)
        if sock is None:
            return scratch, False
        if self._waits_for_ready(sock):
            return scratch[:0], False
        return sock.decoder.next_read(scratch)

    def _waits_for_ready(self, sock: _Socket) -> bool:
        """``sock``'s group is still attaching and holds all the messages it may."""
        group = None if sock.group is None else self._groups.get(sock.group)
        return group is not None and not group.ready and len(group.held) >= MAX_HELD_MESSAGES

    def receive_direct(self, conn: ConnId, count: int, now: float) -> list[WireCommand]:
        """``count`` bytes were read in place, into :meth:`next_read`'s view (``count`` > 0)."""
        self._now = now
        sock = self._sockets.get(conn)
        if sock is None or not self._may_hold(sock, count, now):
            return self._take_wire()
        decoder, scan = sock.decoder, self._scan_of(sock)
        if scan is None:
            decoder.wrote(count)
        else:  # the f32 check takes the bytes that just landed while they are in cache
            # Asked before wrote(), which hands a finished frame on and forgets it.
            placed = decoder.placed_chunk()
            in_place = None if placed is not None else decoder.frame_in_place()
            decoder.wrote(count)
            if placed is not None:
                chunk, filled = placed
                scan.chunk_progress(chunk, filled + count)
            elif in_place is not None:
                frame_type, payload, filled = in_place
                scan.frame_progress(frame_type, payload, filled + count)
        self._drain(sock, now)
        return self._take_wire()

    def _scan_of(self, sock: _Socket) -> FiniteScan | None:
        group = None if sock.group is None else self._groups.get(sock.group)
        return None if group is None else group.scan

    def lost(self, conn: ConnId, reason: str) -> list[WireCommand]:
        """The socket failed below the protocol (reset, send stalled): drop it and its group."""
        sock = self._sockets.get(conn)
        if sock is not None:
            self._log("debug", "connection lost", {"conn": conn, "reason": reason})
            self._drop_socket(sock, reason, error=None)
        return self._take_wire()

    # -- the coordinator's answers ---------------------------------------------------------
    def admit(
        self, conn: ConnId, key: GroupKey, num_streams: int, limits: Limits, now: float
    ) -> list[WireCommand]:
        """Make ``conn`` (whose HELLO was accepted) the control socket of group ``key``."""
        self._pending.pop(conn, None)
        sock = self._sockets.get(conn)
        if sock is None or sock.phase is not Phase.ADMISSION:
            # The peer left while its HELLO was being decided: the group is gone already.
            self.events.append(GroupClosed(key, "connection closed before admission"))
            self._refuse_attaching(key, "its HELLO connection closed before admission")
            return self._take_wire()
        if key in self._groups:
            raise ValueError(f"group {key} is already open")
        group = _Group(key, conn, num_streams, limits, now + self.attach_timeout)
        self._groups[key] = group
        self._settle(sock)
        sock.phase, sock.group, sock.deadline = Phase.MEMBER, key, None
        sock.decoder.chunk_sink = group.reassembler  # CHUNK data lands in place, uncopied
        sock.decoder.set_limits(limits)
        if num_streams == 0:
            self._make_ready(group)
        self._drain(sock, now)
        for data_sock in self._attaching(key):
            if key not in self._groups:
                break  # an earlier socket's error closed the group
            if self._attach(data_sock, group):
                self._drain(data_sock, now)
        if key not in self._groups:
            # The rest would wait for a group that is gone, with no deadline (it was lifted
            # when the HELLO came): refuse them now.
            self._refuse_attaching(key, "its group closed during admission")
        return self._take_wire()

    def refuse(self, conn: ConnId, error: ErrorMessage) -> list[WireCommand]:
        """Send ERROR on a socket that never became a group, and close it."""
        key = self._pending.pop(conn, None)
        sock = self._sockets.get(conn)
        if sock is not None:
            self._log("debug", "connection refused", {"conn": conn, "error": error.text})
            self._drop_socket(sock, error.text, error=error)
        if key is not None:
            self._refuse_attaching(key, "its HELLO was refused")
        return self._take_wire()

    def close_group(self, key: GroupKey, error: ErrorMessage | None) -> list[WireCommand]:
        """Close every socket of ``key`` (ERROR on its control socket first, if given).

        Events the group queued but the coordinator has not seen are withdrawn; a final
        ``GroupClosed`` confirms the close.
        """
        group = self._groups.get(key)
        if group is not None:
            self.events = deque(e for e in self.events if _event_group(e) != key)
            reason = "closed by the syncer" + (f": {error.text}" if error else "")
            self._close_group(group, reason, errors={group.control: error} if error else {})
        return self._take_wire()

    # -- outgoing --------------------------------------------------------------------------
    def route(
        self, key: GroupKey, message: AnyMessage, progress: PayloadProgress | None = None
    ) -> list[Transmit]:
        """The frames that carry ``message`` to group ``key``, each with its socket.

        Bulk frames are sliced into CHUNKs dealt round-robin over the data sockets; everything
        else, and everything to a group without data streams, goes plain on stream 0. A group
        that is gone, or not ready, receives nothing. With ``progress`` (the payload, the
        frame's tail, is still being written) each frame says how much of it is writable.
        """
        group = self._groups.get(key)
        if group is None:
            return []
        if not group.ready:
            self._log(
                "error",
                "send to a group that is not ready",
                {"learner_id": key.learner_id, "generation": key.generation},
            )
            return []
        frame = encode(message)
        if group.slicer is None or message.TYPE not in STRIPED_TYPES:
            parts = [(group.control, frame, 0)]
        else:
            parts = [(group.data[s.stream_idx], s.buffers, 1) for s in group.slicer.slice(frame)]
        if progress is None:
            return [Transmit(conn, buffers) for conn, buffers, _ in parts]
        total = frame_length(frame)
        if progress.total > total:
            raise ValueError("a payload cannot be longer than its frame")
        payload_at = total - progress.total
        transmits, start = [], 0
        for conn, buffers, heads in parts:  # a CHUNK's first buffer is its own envelope
            envelope = frame_length(buffers[:heads])
            stop = start + frame_length(buffers[heads:])
            writable = _writable_part(progress, payload_at, start, stop, envelope)
            transmits.append(Transmit(conn, buffers, writable, progress))
            start = stop
        return transmits

    # -- time ------------------------------------------------------------------------------
    def expire(self, now: float) -> list[WireCommand]:
        """Enforce every deadline that has passed."""
        self._now = now
        for sock in [s for s in self._unsettled.values() if _due(s.deadline, now)]:
            if sock.phase is Phase.ATTACH and sock.claim is not None:
                claim = sock.claim
                self._fail(
                    sock,
                    RemoteProtocolError(
                        ErrorCode.UNKNOWN_GROUP,
                        f"no HELLO for learner {claim.learner_id} generation "
                        f"{claim.generation} within {self.attach_timeout:g} s",
                    ),
                )
            else:
                self._fail(
                    sock,
                    RemoteProtocolError(
                        ErrorCode.HANDSHAKE_TIMEOUT,
                        f"no first frame within {self.handshake_timeout:g} s",
                    ),
                )
        for group in [g for g in self._groups.values() if _due(g.deadline, now)]:
            error = RemoteProtocolError(
                ErrorCode.HANDSHAKE_TIMEOUT,
                f"{len(group.data)} of {group.num_streams} data streams attached within "
                f"{self.attach_timeout:g} s",
            )
            self._fail(self._sockets[group.control], error)
        return self._take_wire()

    # -- internals -------------------------------------------------------------------------
    def _may_hold(self, sock: _Socket, size: int, now: float) -> bool:
        """Count ``size`` more bytes on ``sock``; False if the bound on what sockets without a
        group hold closed it (the oldest go first, so usually another one closes)."""
        if sock.conn not in self._unsettled:
            return True
        sock.held += size
        self._unsettled_bytes += size
        while self._unsettled_bytes > self.max_unsettled_bytes:
            oldest = self._oldest_evictable()
            if oldest is None:
                break  # only HELLOs the coordinator is deciding: they settle soon
            why = f"sockets without a group held more than {self.max_unsettled_bytes} bytes"
            self._evict(oldest, why, now)
        return sock.conn in self._sockets

    def _oldest_evictable(self) -> _Socket | None:
        """The oldest socket still waiting for its first frame or its group, if any."""
        return next((s for s in self._unsettled.values() if s.phase is not Phase.ADMISSION), None)

    def _evict(self, sock: _Socket, why: str, now: float) -> None:
        """Close an unsettled socket to make room; no ERROR (a learner redials after a close)."""
        self._now = now
        fields: dict[str, object] = {"conn": sock.conn, "phase": sock.phase.value, "why": why}
        self._log_unsettled("warning", "oldest socket without a group closed", fields)
        self._drop_socket(sock, why, error=None)

    def _log_unsettled(self, level: str, text: str, fields: dict[str, object]) -> None:
        """Log a line about a socket without a group: one per period, counting the rest."""
        written = self._throttle.fields(text, self._now, fields)
        if written is not None:
            self._log(level, text, written)

    def _settle(self, sock: _Socket) -> None:
        """``sock`` leaves the unsettled sockets (joined a group, or closed)."""
        if self._unsettled.pop(sock.conn, None) is not None:
            self._unsettled_bytes -= sock.held
            sock.held = 0

    def _take_wire(self) -> list[WireCommand]:
        wire, self._wire = self._wire, []
        return wire

    def waits_for_hello_turn(self, conn: ConnId) -> bool:
        """``conn``'s next frame is a large HELLO, and another socket's comes first."""
        sock = self._sockets.get(conn)
        return (
            sock is not None and sock.decoder.large_hello_next and not self._large_hello_turn(conn)
        )

    def _large_hello_turn(self, conn: ConnId) -> bool:
        """No large HELLO is being read, and none that arrived before ``conn``'s waits."""
        first = next(iter(self._hello_queue), conn)
        return self._hello_reader is None and first == conn

    def holds_frames(self, conn: ConnId) -> bool:
        """``conn``'s decoder has frames (or its EOF, or its failure) not handed on yet."""
        sock = self._sockets.get(conn)
        return sock is not None and sock.decoder.has_output and not self._waits_for_ready(sock)

    def drain(self, conn: ConnId, now: float) -> list[WireCommand]:
        """Hand on what ``conn``'s decoder holds, as far as the backlog bound allows."""
        self._now = now
        sock = self._sockets.get(conn)
        if sock is not None:
            self._drain(sock, now)
        return self._take_wire()

    @property
    def holds_any(self) -> bool:
        """Some socket holds frames to hand on as room appears (see :meth:`drain_held`)."""
        return bool(self._held)

    def drain_held(self, now: float) -> list[WireCommand]:
        """Hand on what the bounded backlog left in any socket, oldest first, while there is
        room: their readers may be waiting for bytes that never come (frames behind a HELLO,
        held until admission; an EOF after the last read). The sockets of a group that became
        ready after it held all it may (:meth:`next_read`) are handed on here too."""
        self._now = now
        for conn in list(self._held):
            if not self._room_for_events():
                break
            # Its turn: one that still holds frames after it goes to the back, so a socket
            # that always has more (a learner flooding HEARTBEATs) cannot keep the front and
            # hold every other socket's first frame back for as long as it floods.
            self._held.pop(conn, None)
            sock = self._sockets.get(conn)
            if sock is not None:
                self._drain(sock, now)
        return self._take_wire()

    def _room_for_events(self) -> bool:
        return self.max_backlog is None or len(self.events) < self.max_backlog

    def _drain(self, sock: _Socket, now: float) -> None:
        """Hand on the frames the socket's decoder has ready, while the backlog has room.

        The bound counts events, not bytes: a 4 MiB read of HEARTBEATs is 160,000 frames, and
        queued all at once they held every other learner's events back for seconds.
        """
        while sock.conn in self._sockets:
            if sock.phase is Phase.HANDSHAKE and sock.decoder.has_output:
                sock.deadline = None  # its first frame is in, whole: no handshake timeout
            if not self._room_for_events():
                if sock.decoder.has_output:
                    self._held.setdefault(sock.conn)  # keeps its place if held already
                return
            if self._waits_for_ready(sock):
                return  # its frames stay decoded until the group is ready (or closed)
            if sock.decoder.large_hello_next:
                self._note_large_hello(sock)
                if not self._large_hello_turn(sock.conn):
                    self._hello_queue.setdefault(sock.conn)
                    return  # its reader retries after a while
                self._hello_queue.pop(sock.conn, None)
            try:
                item = sock.decoder.next_frame()
                if item is WORKING:
                    self._hello_reader = sock.conn  # one slice read; the next drain reads on
                    return
                if self._hello_reader == sock.conn:
                    self._hello_reader = None
                self._hello_keys.pop(sock.conn, None)  # read (or never large): _handle goes on
                if isinstance(item, DecoderState):
                    self._held.pop(sock.conn, None)
                    if item is CLOSED:
                        self._drop_socket(sock, f"peer closed {sock.describe()}", error=None)
                    return
                self._handle(sock, item, now)
            except ProtocolError as exc:
                self._held.pop(sock.conn, None)
                self._fail(sock, exc)  # its turn and its data sockets' wait end in _forget
                return

    def _note_large_hello(self, sock: _Socket) -> None:
        """Its data sockets, and those still to come, wait for it without the attach deadline."""
        if sock.conn in self._hello_keys:
            return
        identity = sock.decoder.large_hello_identity
        assert identity is not None
        key = self._hello_keys[sock.conn] = GroupKey(*identity)
        for waiting in self._attaching(key):
            waiting.deadline = None

    def _handle(self, sock: _Socket, message: AnyMessage, now: float) -> None:
        if sock.phase is Phase.MEMBER:
            assert sock.group is not None
            self._deliver(self._groups[sock.group], message)
        elif isinstance(message, Hello):
            # The peer did its part; waiting for the coordinator's answer is not its fault.
            key = GroupKey(message.learner_id, message.generation)
            sock.phase, sock.deadline = Phase.ADMISSION, None
            self._pending[sock.conn] = key
            for waiting in self._attaching(key):
                waiting.deadline = None
            self.events.append(HelloReceived(sock.conn, message))
        elif isinstance(message, DataHello):
            if message.stream_idx >= MAX_STREAMS:  # no group can have it: refuse without waiting
                raise RemoteProtocolError(
                    ErrorCode.BAD_STREAM_INDEX,
                    f"stream_idx {message.stream_idx} outside any group (at most {MAX_STREAMS})",
                )
            sock.claim = message
            key = _claimed(message)
            group = self._groups.get(key)
            if group is not None:
                self._attach(sock, group)
                return
            sock.phase = Phase.ATTACH
            # Only the peer's own HELLO is awaited against the clock, not the coordinator
            # (nor a large HELLO waiting for its turn to be read).
            pending = key in self._pending.values() or key in self._hello_keys.values()
            sock.deadline = None if pending else now + self.attach_timeout
        else:  # the decoder yields nothing after the first frame until limits are set
            raise AssertionError(f"{type(message).__name__} before the socket joined a group")

    def _attaching(self, key: GroupKey) -> list[_Socket]:
        """Data sockets waiting for group ``key`` to be admitted."""
        return [
            s
            for s in self._unsettled.values()
            if s.phase is Phase.ATTACH and s.claim is not None and _claimed(s.claim) == key
        ]

    def _refuse_attaching(self, key: GroupKey, why: str) -> None:
        for sock in self._attaching(key):
            self._fail(
                sock,
                RemoteProtocolError(
                    ErrorCode.UNKNOWN_GROUP,
                    f"no group for learner {key.learner_id} generation {key.generation}: {why}",
                ),
            )

    def _attach(self, sock: _Socket, group: _Group) -> bool:
        """Join ``sock`` (whose first frame was DATA_HELLO) to ``group`` as a data socket."""
        assert sock.claim is not None
        index = sock.claim.stream_idx
        if index >= group.num_streams:
            bound = f"0..{group.num_streams - 1}" if group.num_streams else "none (0 streams)"
            self._fail(
                sock,
                RemoteProtocolError(
                    ErrorCode.BAD_STREAM_INDEX, f"stream_idx {index} outside {bound}"
                ),
            )
            return False
        if index in group.data:
            self._fail(
                sock,
                RemoteProtocolError(
                    ErrorCode.DUPLICATE_STREAM, f"stream_idx {index} is already attached"
                ),
            )
            return False
        group.data[index] = sock.conn
        self._settle(sock)
        sock.phase, sock.group, sock.stream_idx = Phase.MEMBER, group.key, index
        sock.deadline, sock.claim = None, None
        sock.decoder.chunk_sink = group.reassembler
        sock.decoder.set_limits(group.limits)
        if len(group.data) == group.num_streams:
            self._make_ready(group)
        return True

    def _make_ready(self, group: _Group) -> None:
        group.ready, group.deadline = True, None
        self.events.append(GroupReady(group.key))
        held, group.held = group.held, []
        self.events.extend(held)
        if len(held) >= MAX_HELD_MESSAGES:  # its sockets stopped: their frames go on from here
            for conn in group.members():
                sock = self._sockets[conn]
                if sock.decoder.has_output:
                    self._held.setdefault(conn)  # handed on by drain_held, as room allows

    def _deliver(self, group: _Group, message: AnyMessage) -> None:
        finite: bool | None = None
        if isinstance(message, Chunk):
            inner = group.reassembler.add(message)
            if group.scan is not None:
                group.scan.chunk_done(message)
            if inner is None:
                return
            if group.scan is not None:
                finite = group.scan.verdict(message.msg_id, inner)
            message = inner
        elif group.scan is not None:
            finite = group.scan.frame_verdict(message)
        event = MessageReceived(group.key, message, finite)
        if group.ready:
            self.events.append(event)
        else:  # at most MAX_HELD_MESSAGES: _drain stops at that many
            group.held.append(event)

    def _fail(self, sock: _Socket, error: ProtocolError) -> None:
        """A protocol error on ``sock``: ERROR there, then close it and its group."""
        text = error_text(error, first_frame=sock.phase is Phase.HANDSHAKE)
        fields = {**self.socket_fields(sock.conn), "error": text}
        if sock.group is not None:
            self._log("warning", "protocol error", fields)
        else:  # refused before it joined a group: anyone can cause these
            self._log_unsettled("warning", "protocol error before joining a group", fields)
        self._drop_socket(sock, text, error=ErrorMessage(text))

    def _drop_socket(self, sock: _Socket, reason: str, *, error: ErrorMessage | None) -> None:
        if sock.phase is Phase.MEMBER:
            assert sock.group is not None
            self._close_group(
                self._groups[sock.group], reason, errors={sock.conn: error} if error else {}
            )
        else:
            fields = self.socket_fields(sock.conn)
            self._forget(sock.conn)
            self._wire.append(Hangup(sock.conn, error, fields))

    def _close_group(
        self, group: _Group, reason: str, *, errors: Mapping[ConnId, ErrorMessage | None]
    ) -> None:
        del self._groups[group.key]
        group.reassembler.clear()
        for conn in group.members():
            fields = self.socket_fields(conn)
            self._forget(conn)
            self._wire.append(Hangup(conn, errors.get(conn), fields))
        self.events.append(GroupClosed(group.key, reason))

    def _forget(self, conn: ConnId) -> None:
        self._held.pop(conn, None)
        if self._hello_reader == conn:
            self._hello_reader = None
        self._hello_queue.pop(conn, None)
        key = self._hello_keys.pop(conn, None)
        if key is not None and key not in self._pending.values():
            # Its HELLO will not be read: its data sockets wait for another one, on the clock.
            for waiting in self._attaching(key):
                if waiting.deadline is None:
                    waiting.deadline = self._now + self.attach_timeout
        sock = self._sockets.pop(conn, None)
        if sock is not None:
            self._settle(sock)


def _claimed(claim: DataHello) -> GroupKey:
    return GroupKey(claim.learner_id, claim.generation)


def _due(deadline: float | None, now: float) -> bool:
    return deadline is not None and deadline <= now


def _event_group(event: Event) -> GroupKey | None:
    if isinstance(event, GroupReady | MessageReceived | GroupClosed):
        return event.group
    return None
