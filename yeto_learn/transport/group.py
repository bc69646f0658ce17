"""One learner connection group on anyio: stream 0 (control) plus S data sockets.

Receive path: every socket reads with ``recv_into`` — large payloads straight into their frame
(a CHUNK's data into its place in the reassembled BCAST), headers and small frames into one
reusable buffer shared by the group's readers, copied into their frame by the decoder before the
reader yields (:meth:`yeto_proto.FrameDecoder.next_read` picks) — the measured fast path of
BENCHMARKS.md. CHUNKs from any socket go to the group's one :class:`~yeto_proto.Reassembler`.

Send path: frames are the buffer lists of :func:`yeto_proto.encode` (tensor bytes stay views)
and go out whole with ``socket.sendmsg``, one writer task per socket. INIT and PUSH are sliced
into CHUNKs dealt round-robin over the data sockets; with none they go plain on stream 0.

Any socket failing, closing or stalling ends the whole group (spec/learner.md §1.6): partial
CHUNK messages and queued frames die with it; the whole messages of which no byte was written
are listed in :attr:`ConnectionGroup.unsent`, so the sender can tell "never sent" from "maybe
received".
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import socket
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread

from yeto_proto import (
    AnyMessage,
    Chunk,
    ChunkSlicer,
    DecoderState,
    FinalAck,
    FrameDecoder,
    Limits,
    ProtocolError,
    PushFragment,
    Reassembler,
    Role,
    encode,
)
from yeto_proto.constants import CHUNK_SLICE_SIZE, STRIPED_TYPES
from yeto_proto.frames import Buffers, OutgoingBuffers, frame_length
from yeto_sync.receive_watermark import READ_WATERMARK_CAP, ReceiveWatermark
from yeto_sync.socket_liveness import SILENCE_FACTOR, bound_silence

RECV_BUFFER_SIZE = 1 << 20
_CONNECT_PENDING = (errno.EINPROGRESS, errno.EALREADY, errno.EAGAIN, errno.EWOULDBLOCK)
#: iovecs per sendmsg call (Linux allows 1024).
IOV_BATCH = 512
#: A socket that accepts no byte for this long ends the group.
SEND_STALL_TIMEOUT_S = 60.0
#: After one socket closes cleanly, how long the others may still deliver what they hold.
CLOSE_GRACE_S = 0.5
#: ... and how long stream 0 may, while it is open: it carries SHUTDOWN and ERROR, and its EOF
#: comes after them, but a retransmission or two over a WAN can hold it back past 0.5 s.
STREAM_0_CLOSE_GRACE_S = 5.0


@dataclass
class Counters:
    """Bytes moved, for progress displays; written by the client thread only."""

    bytes_sent: int = 0
    bytes_received: int = 0
    frames_dropped: int = 0


@dataclass(eq=False)
class _Outgoing:
    frame: Buffers
    #: The whole message this frame carries (``None`` for one CHUNK of a striped message).
    message: AnyMessage | None = None
    #: Some byte of it went into the socket: it may have reached the syncer.
    started: bool = False


@dataclass(eq=False)
class _QueuedPush:
    """The frames of one PUSH (one plain frame, or its CHUNKs), so a newer one can replace it."""

    frames: list[_Outgoing]
    #: Its CHUNK message id (``None`` when it went plain on stream 0).
    msg_id: int | None
    size: int

    @property
    def started(self) -> bool:
        return any(frame.started for frame in self.frames)


@dataclass(eq=False)
class _Stream:
    index: int  # 0 = control; 1 + stream_idx for data sockets
    sock: socket.socket
    decoder: FrameDecoder
    queue: deque[_Outgoing] = field(default_factory=deque)
    ready: anyio.Event = field(default_factory=anyio.Event)

    def put(self, frame: Buffers, message: AnyMessage | None = None) -> _Outgoing:
        outgoing = _Outgoing(frame, message)
        self.queue.append(outgoing)
        self.ready.set()
        return outgoing


class GroupBroken(Exception):
    """The group ended; ``args[0]`` says why."""


def _close_quietly(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.close()


async def open_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """``count`` connected, non-blocking TCP sockets to one address of ``host``.

    Their connects run at once (the kernel handshakes them side by side), so they open in
    about one round trip, not ``count``. The resolved addresses are tried in turn (an IPv6 and
    an IPv4 one for "localhost", say): an attempt fails when any of its connects fails, and its
    sockets are closed before the next address is tried; the last attempt's OSError is raised
    (e.g. connection refused). Cancelled, it closes every socket it opened.
    """
    # In a worker thread a cancelled dial abandons: a resolver that hangs must not hold up
    # close() (the thread of anyio.getaddrinfo is joined when the client's event loop ends).
    infos = await anyio.to_thread.run_sync(
        functools.partial(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM),
        abandon_on_cancel=True,
    )
    last: OSError = OSError(f"no address for {host}:{port}")
    for family, kind, proto, _, address in infos:
        sockets: list[socket.socket] = []
        try:
            pending = [_start_connect(sockets, family, kind, proto, address) for _ in range(count)]
            for sock, waits in zip(sockets, pending, strict=True):
                if waits:
                    await _connected(sock)
            return sockets
        except BaseException as exc:
            for sock in sockets:
                _close_quietly(sock)
            if not isinstance(exc, OSError):
                raise
            last = exc
    raise last


def _start_connect(
    sockets: list[socket.socket], family: int, kind: int, proto: int, address: tuple[Any, ...]
) -> bool:
    """Open a socket (appended to ``sockets`` at once, so a failure closes it too) and start its
    connect; True when it is still in progress."""
    sock = socket.socket(family, kind, proto)
    sockets.append(sock)
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    bound_silence(sock, SILENCE_FACTOR * SEND_STALL_TIMEOUT_S)
    code = sock.connect_ex(address)
    if code not in (0, *_CONNECT_PENDING):
        raise OSError(code, os.strerror(code))
    return code != 0


async def _connected(sock: socket.socket) -> None:
    """Wait for ``sock``'s connect in progress to end; raise its error."""
    await anyio.wait_writable(sock)
    code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    if code:
        raise OSError(code, os.strerror(code))


class ConnectionGroup:
    """The sockets of one connection generation; :meth:`run` serves them until the group ends.

    ``deliver`` receives every decoded message in arrival order (CHUNKs reassembled). A decoding
    error is the syncer's protocol violation: :meth:`run` raises it.
    """

    def __init__(
        self,
        sockets: list[socket.socket],
        limits: Limits,
        *,
        deliver: Callable[[AnyMessage], None],
        counters: Counters,
        recv_buffer: bytearray,
        slice_size: int = CHUNK_SLICE_SIZE,
        stall_timeout: float = SEND_STALL_TIMEOUT_S,
        read_watermark: int = READ_WATERMARK_CAP,
        room_to_read: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._reassembler = Reassembler(Role.LEARNER, limits)
        #: Awaited before each read: the receiver's backpressure (writes go on meanwhile).
        self._room_to_read = room_to_read
        # CHUNK data is written straight into the reassembled message (no second copy).
        self._streams = [
            _Stream(
                i, sock, FrameDecoder(Role.LEARNER, limits=limits, chunk_sink=self._reassembler)
            )
            for i, sock in enumerate(sockets)
        ]
        data_streams = len(sockets) - 1
        self._slicer = ChunkSlicer(data_streams, slice_size) if data_streams else None
        self._deliver = deliver
        self._counters = counters
        self._view = memoryview(recv_buffer)
        self._stall_timeout = stall_timeout
        #: The most bytes a socket waits for before an in-place read (1: every segment).
        self._read_watermark = read_watermark
        self._ended = anyio.Event()
        #: Set by the first clean close (or by the end): the group is going away.
        self._closing = anyio.Event()
        #: Set when stream 0 reached EOF (or by the end): nothing more can come on it.
        self._stream_0_done = anyio.Event()
        self._closed_streams: set[int] = set()
        self._reason = ""
        self._violation: ProtocolError | None = None
        self._draining = False
        #: The syncer sent at least one frame on this group.
        self.received_any = False
        #: Bytes the syncer sent on this group (a first frame may be a whole fragment,
        #: minutes long on a slow link).
        self.bytes_received = 0
        #: Once the group ended: whole messages of which no byte was written (in send order).
        self.unsent: list[AnyMessage] = []
        #: The newest queued PUSH of each fragment.
        self._pushes: dict[int, _QueuedPush] = {}

    @property
    def heard_from(self) -> bool:
        """The syncer sent at least one byte on this group."""
        return self.bytes_received > 0

    # -- sending ---------------------------------------------------------------------------
    def send(self, message: AnyMessage) -> None:
        """Queue ``message``: bulk frames striped over the data sockets, the rest on stream 0."""
        if self._ended.is_set():
            self._counters.frames_dropped += 1
            return
        frame = encode(message)
        size = frame_length(frame)
        if isinstance(message, PushFragment) and self._replace_queued_push(message, frame, size):
            return
        if isinstance(message, FinalAck):
            self._withdraw_plain_pushes()
        msg_id: int | None = None
        if self._slicer is None or message.TYPE not in STRIPED_TYPES:
            frames = [self._streams[0].put(frame, message)]
        else:
            pieces = self._slicer.slice(frame)
            msg_id = self._slicer.next_msg_id - 1
            frames = [self._streams[1 + piece.stream_idx].put(piece.buffers) for piece in pieces]
        if isinstance(message, PushFragment):
            self._pushes[message.fragment_id] = _QueuedPush(frames, msg_id, size)

    def _replace_queued_push(self, push: PushFragment, frame: Buffers, size: int) -> bool:
        """Put ``push`` in the place of an older PUSH of its fragment that has not started.

        Rounds in flight target distinct fragments, so a newer PULL of a fragment means the
        older round was committed or its attempt discarded, and the syncer would reject the
        older PUSH. A syncer that reads slowly would otherwise let the pushes pile up here.
        The newer one takes the older one's frames in their queues, and when striped its CHUNK
        message id too (same fragment, same size, same slices): the ids stay a gapless count.
        """
        older = self._pushes.pop(push.fragment_id, None)
        if older is None or older.started or older.size != size:
            return False
        if older.msg_id is None:
            (slot,) = older.frames
            slot.frame, slot.message = frame, push
        else:
            assert self._slicer is not None
            pieces = self._slicer.pieces(frame, older.msg_id)
            for slot, piece in zip(older.frames, pieces, strict=True):
                slot.frame = piece
        self._pushes[push.fragment_id] = older
        self._counters.frames_dropped += 1
        return True

    def _withdraw_plain_pushes(self) -> None:
        """The final cut is applied: every round ended before it, so a PUSH not started yet
        would only be rejected, and on a group without data streams the FINAL_ACK waited
        behind it (16 MiB at 4 Mbit/s: 33 s of a final-ACK deadline). A striped PUSH stays:
        it does not hold stream 0 up, and dropping it would leave a gap in the CHUNK ids."""
        for fragment, queued in list(self._pushes.items()):
            if queued.msg_id is not None or queued.started:
                continue
            (slot,) = queued.frames
            # Emptied in place, not removed: the writer may be waiting to start it.
            slot.frame, slot.message = [], None
            del self._pushes[fragment]
            self._counters.frames_dropped += 1

    def send_first(self, frames: list[Buffers]) -> None:
        """The opening frame of each socket (HELLO on stream 0, DATA_HELLO on the others)."""
        for stream, frame in zip(self._streams, frames, strict=True):
            stream.put(frame)

    # -- running ---------------------------------------------------------------------------
    async def run(self) -> str:
        """Serve the sockets until any of them ends; return why. Closes every socket."""
        try:
            async with anyio.create_task_group() as tasks:
                for stream in self._streams:
                    tasks.start_soon(self._read_loop, stream)
                    tasks.start_soon(self._write_loop, stream)
                await self._closing.wait()
                # The syncer closes a whole group at once (after SHUTDOWN, say), and one
                # socket's EOF can overtake frames the others still hold: let them deliver.
                with anyio.move_on_after(CLOSE_GRACE_S):
                    await self._ended.wait()
                with anyio.move_on_after(STREAM_0_CLOSE_GRACE_S - CLOSE_GRACE_S):
                    await self._stream_0_done.wait()
                self._end("closed")
                tasks.cancel_scope.cancel()
        finally:
            self._end("closed")
            for stream in self._streams:
                _close_quietly(stream.sock)
                self.unsent += [
                    out.message
                    for out in stream.queue
                    if out.message is not None and not out.started
                ]
                stream.queue.clear()
            self._reassembler.clear()
        if self._violation is not None:
            raise self._violation
        return self._reason

    def stop(self, reason: str, *, flush: bool) -> None:
        """End the group now, or once every queued frame is written (``flush``)."""
        if flush and any(stream.queue for stream in self._streams):
            self._draining = True
            self._reason = self._reason or reason
            for stream in self._streams:
                stream.ready.set()
            return
        self._end(reason)

    @property
    def reason(self) -> str:
        return self._reason or "closed"

    @property
    def ended(self) -> bool:
        return self._ended.is_set()

    def _end(self, reason: str) -> None:
        if not self._ended.is_set():
            self._reason = self._reason or reason
            self._ended.set()
            self._closing.set()
            self._stream_0_done.set()

    def _closed_cleanly(self, stream: _Stream, reason: str) -> None:
        """One socket reached EOF: the group ends once all have, or after the close grace."""
        self._closed_streams.add(stream.index)
        if stream.index == 0:
            self._stream_0_done.set()
        self._reason = self._reason or reason
        if len(self._closed_streams) == len(self._streams):
            self._end(reason)
        else:
            self._closing.set()

    async def _read_loop(self, stream: _Stream) -> None:
        # Large payloads are read in place; the rest goes through the one buffer every reader
        # shares, whose bytes are fed (copied) before this task yields.
        sock, decoder, view = stream.sock, stream.decoder, self._view
        name = "stream 0" if stream.index == 0 else f"data stream {stream.index - 1}"
        watermark = ReceiveWatermark(sock, self._read_watermark)
        while True:
            if self._room_to_read is not None and self.received_any:
                # A group that has received nothing yet reads anyway: messages of a lost group
                # may still fill the inbox, and a new group whose replay is never read is
                # dropped by the syncer's send stall and counts as a failed redial.
                await self._room_to_read()
            into, direct = decoder.next_read(view)
            try:
                size = sock.recv_into(into)
            except (BlockingIOError, InterruptedError):
                watermark.before_wait(len(into), direct)
                await anyio.wait_readable(sock)
                continue
            except OSError as exc:
                self._end(f"{name}: receive failed: {exc.strerror or exc}")
                return
            if size == 0:
                # A cut inside a frame is a lost connection (a killed syncer, a broken link):
                # the group is redialed, not failed. Whole frames were delivered already.
                if decoder.mid_frame:
                    self._end(f"{name} closed inside a frame")
                else:
                    self._closed_cleanly(stream, f"{name} closed by the syncer")
                return
            self._counters.bytes_received += size
            self.bytes_received += size
            if direct:
                decoder.wrote(size)
            else:
                decoder.feed(view[:size])
            try:
                self._drain(decoder)
            except ProtocolError as exc:
                self._violation = exc
                self._end(f"{name}: {exc}")
                return
            await anyio.lowlevel.checkpoint()

    def _drain(self, decoder: FrameDecoder) -> None:
        while True:
            frame = decoder.next_frame()
            if isinstance(frame, DecoderState):
                return
            self.received_any = True
            if isinstance(frame, Chunk):
                inner = self._reassembler.add(frame)
                if inner is None:
                    continue
                frame = inner
            self._deliver(frame)

    async def _write_loop(self, stream: _Stream) -> None:
        sock, queue = stream.sock, stream.queue
        while True:
            while not queue:
                if self._draining:
                    if not any(s.queue for s in self._streams):
                        self._end(self._reason)
                    return
                stream.ready = anyio.Event()
                await stream.ready.wait()
            if stream.index in self._closed_streams:
                # The syncer closed this socket (its EOF was read): a frame started now would
                # count as sent and be lost unread. What is queued comes back undelivered with
                # the group (a BUDGET_DONE is then sent again on the next one).
                return
            try:
                await self._write_frame(sock, queue[0])
            except OSError as exc:
                self._end(f"send failed on stream {stream.index}: {exc.strerror or exc}")
                return
            except GroupBroken as exc:
                self._end(str(exc))
                return
            if queue:
                written = queue.popleft()
                # Its buffers may be a whole encoded delta: not kept once they are written.
                written.frame, written.message = [], None

    async def _write_frame(self, sock: socket.socket, outgoing: _Outgoing) -> None:
        source = outgoing.frame
        pending = OutgoingBuffers(source, IOV_BATCH)
        while not pending.done:
            if outgoing.frame is not source:
                # Replaced by a newer PUSH while it waited for room, before its first byte
                # (a started frame is never replaced).
                source = outgoing.frame
                pending = OutgoingBuffers(source, IOV_BATCH)
            try:
                sent = sock.sendmsg(pending.batch())
            except (BlockingIOError, InterruptedError):
                sent = 0
            if not sent:
                with anyio.move_on_after(self._stall_timeout) as waited:
                    await anyio.wait_writable(sock)
                if waited.cancelled_caught:
                    raise GroupBroken(f"the syncer accepted no byte for {self._stall_timeout:g} s")
                continue
            outgoing.started = True
            self._counters.bytes_sent += sent
            pending.advance(sent)
