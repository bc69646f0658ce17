"""The TCP transport: raw non-blocking sockets on anyio, one reader and one writer per socket.

Receive path (measured in BENCHMARKS.md: an anyio stream's ``receive()`` reaches half the
throughput of a blocking socket; ``wait_readable`` + ``recv_into`` on the raw socket ≈ 0.9–0.97):
each socket reads with ``recv_into`` straight into the payload of a large frame (or the CHUNK's
place in its reassembled message), and everything else — headers, small frames — into one
reusable 4 MiB buffer shared by all sockets, whose bytes the decoder copies into their frame
before the reading task yields (:meth:`yeto_proto.FrameDecoder.next_read` picks). Send path:
frames are the buffer lists :func:`yeto_proto.encode` and the CHUNK slicer return (tensor bytes
are views of the coordinator's arrays) and go out with ``socket.sendmsg``, never joined. A writer
lets the others run after each large write, so a broadcast reaches every learner at about the
same time even when one socket could take it all at once.

Every wait is bounded:

- handshakes and attaches by :class:`~yeto_sync.transport.group.ConnectionGroups` deadlines;
- each socket's writer is the only task that writes to it and writes one whole frame at a time
  inside a shielded cancel scope, so cancellation never leaves half a frame followed by more
  bytes; a write that makes no progress for ``stall_timeout`` seconds drops the group;
- the driver's ``send`` never waits for a learner: it appends to the group's outbox, where a
  newer BCAST (or the final cut's FINAL_FRAGMENT, unless it is the group's first of that
  fragment) of a fragment replaces a BCAST not queued yet, and a BCAST stays, passed by the
  group's other messages, until the group's sockets wrote everything before it, so a slow link
  is not spent on versions out of date before they leave; the group's own task cuts messages into
  frames for per-socket send queues of at most ``send_queue_bytes`` (a BCAST's frames, cut
  only when the queues are idle, go in at once) and waits for room (backpressure) as long as
  the socket keeps taking bytes, dropping that group once it took none for ``stall_timeout``
  seconds;
- at most ``MAX_EVENT_BACKLOG`` events wait for the driver: frames past it wait, decoded, in
  their socket, which reads nothing more (TCP pushes back on the peer) until they are handed on;
- a closing socket sends its last frame (an ERROR, say), half-closes and lingers at most
  ``linger`` seconds for the peer's EOF, so the ERROR is read rather than lost to a reset;
- :meth:`TcpTransport.shutdown` flushes queues, then cuts everything, within ``grace`` seconds
  in all (:data:`HARD_STOP_S` of them kept for the cut).

Peer sockets never take the descriptors the daemon's own files need: at most
``RLIMIT_NOFILE`` less those open at the start and :data:`FD_RESERVE` are open at once (the
listen queue holds newcomers meanwhile), and an ``accept`` out of descriptors backs off.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import math
import resource
import select
import socket
import sys
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import NamedTuple

import anyio
import anyio.abc
import anyio.lowlevel

from yeto_proto import AnyMessage, BcastFragment, ErrorMessage, FinalFragment, Limits, encode
from yeto_proto.frames import Buffers, OutgoingBuffers

from ..events import ConnId, Event, GroupKey, GroupReady
from ..payload_progress import PayloadProgress, PayloadWithdrawn
from ..receive_watermark import READ_WATERMARK_CAP, ReceiveWatermark
from ..socket_liveness import SILENCE_FACTOR, bound_silence
from . import Clock
from .group import (
    HELLO_TURN_POLL_S,
    ConnectionGroups,
    Hangup,
    LogFn,
    Transmit,
    WireCommand,
    Writable,
)
from .link_pace import LinkPace
from .log_throttle import LogThrottle

#: The receive buffer all sockets share (a read never outlives the task step that made it).
RECV_BUFFER_SIZE = 4 << 20
#: The most a read that is not in place takes (headers and small frames go through it).
SCRATCH_READ_BYTES = 256 << 10
SEND_QUEUE_BYTES = 64 << 20
SEND_STALL_TIMEOUT_S = 60.0
LINGER_S = 2.0
MAX_EVENT_BACKLOG = 1024
LISTEN_BACKLOG = 512
#: A socket that may not read yet (its group is not settled) is woken when that may have
#: changed (admission, a hangup); it also looks again this often, as a safety net.
HELD_BACK_RECHECK_S = 5.0
#: iovecs per sendmsg call (Linux allows 1024).
IOV_BATCH = 512
#: After a write of at least this many bytes a writer lets the other sockets' tasks run.
WRITE_TURN_BYTES = 256 << 10
#: Descriptors kept from peer sockets for the daemon's own: the checkpoint's temporary file
#: and directory, the event tape, the final marker and state, modules imported late.
FD_RESERVE = 32
#: ``accept`` errors that mean the process or system is out of descriptors or buffers.
_ACCEPT_EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
ACCEPT_BACKOFF_S = (0.05, 1.0)
#: The end of a shutdown's grace kept for cutting what did not leave (and its least length).
HARD_STOP_S = 0.5


def peer_socket_cap(in_use: int, reserve: int = FD_RESERVE) -> int:
    """How many peer sockets may be open at once, with ``in_use`` descriptors taken already."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return sys.maxsize
    return max(1, soft - in_use - reserve)


async def _grown(progress: PayloadProgress, seen: int) -> None:
    """Wait until ``progress`` is beyond ``seen`` bytes (raises once it is withdrawn).

    The producer is a merge thread: its listener only hands the wake-up to this event loop.
    """
    loop = asyncio.get_running_loop()
    changed = asyncio.Event()

    def wake() -> None:
        loop.call_soon_threadsafe(changed.set)

    unsubscribe = progress.subscribe(wake)
    try:
        while progress.ready <= seen:
            await changed.wait()
            changed.clear()
    finally:
        unsubscribe()


class SendStalled(Exception):
    """A socket accepted no bytes for the whole stall timeout."""


class Outgoing(NamedTuple):
    """A queued frame; ``writable``/``progress`` as in :class:`~.group.Transmit`."""

    buffers: Buffers
    writable: Writable | None = None
    progress: PayloadProgress | None = None


class SendQueue:
    """A per-socket FIFO of frames, bounded in bytes (one frame always fits an empty queue)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._frames: deque[tuple[Outgoing, int]] = deque()
        self._bytes = 0
        self.closed = False
        self._changed = anyio.Event()
        #: The writer took a frame and has not reported it written yet.
        self._in_flight = False
        #: Set as well at the next change (one waiter watching several queues).
        self.also_notify: anyio.Event | None = None

    @property
    def queued_bytes(self) -> int:
        return self._bytes

    @property
    def idle(self) -> bool:
        """Every frame given to this socket was written (or the queue is closed)."""
        return self.closed or not (self._frames or self._in_flight)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()
        if self.also_notify is not None:
            self.also_notify.set()
            self.also_notify = None

    async def put(self, frame: Outgoing, size: int, *, at_once: bool = False) -> bool:
        """Queue a frame once there is room; False if the queue was closed instead.

        A frame whose payload is still being written goes in at once, room or not: its
        producer waits for this call, and the writer ahead of it may be waiting for the
        producer (the bound is exceeded by at most the message being streamed). So does one
        ``at_once`` (a BCAST's, cut into frames only once its group's queues were idle).
        """
        while (
            not at_once
            and frame.progress is None
            and not self.closed
            and self._frames
            and self._bytes + size > self.max_bytes
        ):
            await self._changed.wait()
        if self.closed:
            return False
        self._frames.append((frame, size))
        self._bytes += size
        self._notify()
        return True

    async def get(self) -> Outgoing | None:
        """The next frame; ``None`` once the queue is closed and empty."""
        while not self._frames:
            if self.closed:
                return None
            await self._changed.wait()
        frame, size = self._frames.popleft()
        self._bytes -= size
        self._in_flight = True
        self._notify()
        return frame

    def written(self) -> None:
        """The writer finished the frame it took last."""
        self._in_flight = False
        self._notify()

    def close(self, *, last: Buffers | None = None, discard: bool) -> None:
        """No more frames: optionally drop those not yet started, then queue ``last``."""
        if self.closed:
            return
        if discard:
            self._frames.clear()
            self._bytes = 0
        if last is not None:
            self._frames.append((Outgoing(last), 0))
        self.closed = True
        self._notify()


@dataclass(eq=False)
class _Peer:
    conn: ConnId
    sock: socket.socket
    address: str
    queue: SendQueue
    reader_done: anyio.Event = field(default_factory=anyio.Event)
    scope: anyio.CancelScope | None = None
    #: The shielded scope of the frame being written, so a hard stop can cut it.
    frame_scope: anyio.CancelScope | None = None
    #: Set while the reader may not read (its group is not settled): wakes it.
    held_back: anyio.Event | None = None
    #: The peer closed (or reset) the socket while it was held back.
    hung_up: bool = False
    #: Log fields naming the socket (its group, for a member), kept from its hangup.
    known_as: dict[str, object] = field(default_factory=dict)
    #: Bytes the socket took so far: a full queue in front of a socket that still takes bytes
    #: is a slow link, not a stalled peer.
    bytes_written: int = 0


class _HangupWatch:
    """Notices peers that close sockets which may not be read yet (Linux: EPOLLRDHUP).

    A held-back socket's unread bytes hide its EOF from ``recv``; without this, a peer that sent
    DATA_HELLO and left kept its place among the sockets without a group until its deadline.
    """

    def __init__(self) -> None:
        #: Open while :meth:`run` runs (so a transport never served leaks no descriptor).
        self._epoll: select.epoll | None = None
        self._watched: dict[int, _Peer] = {}

    def add(self, peer: _Peer) -> None:
        if self._epoll is None:  # not running: the held-back reader's recheck still applies
            return
        fd = peer.sock.fileno()
        self._epoll.register(fd, select.EPOLLRDHUP)  # HUP and ERR are always reported
        self._watched[fd] = peer

    def discard(self, peer: _Peer) -> None:
        fd = peer.sock.fileno()
        if self._watched.pop(fd, None) is not None and self._epoll is not None:
            with contextlib.suppress(OSError):
                self._epoll.unregister(fd)

    async def run(self) -> None:
        self._epoll = epoll = select.epoll()
        try:
            while True:
                await anyio.wait_readable(epoll.fileno())
                for fd, _ in epoll.poll(0):
                    peer = self._watched.get(fd)
                    if peer is None:
                        continue
                    self.discard(peer)
                    peer.hung_up = True
                    if peer.held_back is not None:
                        peer.held_back.set()
        finally:
            self._epoll = None
            self._watched.clear()
            epoll.close()


@dataclass(eq=False)
class _Outbox:
    """A group's messages not yet cut into frames, fed to its sockets' queues by its own task.

    The driver only appends here, so a learner whose queues are full never holds up the
    coordinator (and through it every other learner); the feeding task waits for room instead.
    """

    pending: deque[tuple[AnyMessage, PayloadProgress | None]] = field(default_factory=deque)
    changed: anyio.Event = field(default_factory=anyio.Event)
    #: A message is being cut into frames and queued (its queue may be waiting for room).
    busy: bool = False
    #: Set once nothing more is fed: the group closed, a queue stalled, or shutdown.
    done: bool = False
    #: Fragments of which a BCAST was taken to be sent: the learner has (or will have) one.
    bcast_sent: set[int] = field(default_factory=set)

    @property
    def settled(self) -> bool:
        """Nothing left to queue but held BCASTs (which a stopping syncer drops: a learner
        gets the current versions again from whichever syncer it reconnects to, and ignores
        one after the final cut)."""
        return self.done or not (
            self.busy or any(not isinstance(message, BcastFragment) for message, _ in self.pending)
        )

    def add(self, message: AnyMessage, progress: PayloadProgress | None) -> None:
        # A learner keeps only the newest version of a fragment: an older BCAST that is still
        # waiting here (none of its bytes queued) is dropped rather than sent. A newer BCAST
        # takes its place in the line: appended instead, the fragment committed longest ago
        # (the next to commit again) would always lead, and on a link slower than the rounds
        # some fragments would never leave. The final cut overwrites the parameters whatever
        # BCAST came before it (spec/learner.md § 7), but a learner starts only once it holds
        # a BCAST of every fragment: the group's first one of a fragment is never dropped for it.
        self.changed.set()
        if isinstance(message, BcastFragment):
            for index, (waiting, _) in enumerate(self.pending):
                if (
                    isinstance(waiting, BcastFragment)
                    and waiting.fragment_id == message.fragment_id
                ):
                    self.pending[index] = (message, progress)
                    return
        elif isinstance(message, FinalFragment) and message.fragment_id in self.bcast_sent:
            self.pending = deque(
                item
                for item in self.pending
                if not (
                    isinstance(item[0], BcastFragment)
                    and item[0].fragment_id == message.fragment_id
                )
            )
        self.pending.append((message, progress))

    def take(self, bcasts_may_go: bool) -> tuple[AnyMessage, PayloadProgress | None] | None:
        """The next message to cut into frames, oldest first; BCASTs only if they may go now
        (else the others pass them: a PULL may overtake a BCAST, spec/learner.md § 5).
        ``None`` when only held BCASTs are left. A streamed BCAST whose merge failed (its
        payload withdrawn) before any of it was queued is dropped: nothing of it is on the
        wire, so the group need not be cut off for it."""
        if any(progress is not None and progress.withdrawn for _, progress in self.pending):
            self.pending = deque(
                (message, progress)
                for message, progress in self.pending
                if progress is None or not progress.withdrawn
            )
        for index, (message, progress) in enumerate(self.pending):
            if isinstance(message, BcastFragment):
                if not bcasts_may_go:
                    continue
                self.bcast_sent.add(message.fragment_id)
            del self.pending[index]
            return message, progress
        return None


def _address_text(address: object) -> str:
    if isinstance(address, tuple) and len(address) >= 2:
        host, port = address[0], address[1]
        return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
    return str(address)


def _listening_socket(host: str, port: int) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(LISTEN_BACKLOG)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


class TcpTransport:
    """The syncer's listener and sockets; use :meth:`serve` to run it."""

    #: Sends a payload's final bytes as they come (see :class:`~yeto_sync.events.Send`).
    streams_partial_payloads = True

    def __init__(
        self,
        groups: ConnectionGroups,
        clock: Clock,
        listener: socket.socket,
        task_group: anyio.abc.TaskGroup,
        *,
        log: LogFn | None = None,
        send_queue_bytes: int = SEND_QUEUE_BYTES,
        stall_timeout: float = SEND_STALL_TIMEOUT_S,
        linger: float = LINGER_S,
        read_watermark: int = READ_WATERMARK_CAP,
        max_peers: int | None = None,
    ) -> None:
        self.groups = groups
        if groups.max_backlog is None:  # readers wait for the driver: bound what it holds
            groups.max_backlog = MAX_EVENT_BACKLOG
        self._max_backlog: int = groups.max_backlog
        self.clock = clock
        self._listener = listener
        host, port = listener.getsockname()[:2]
        #: The bound address (with port 0 requested, the port the system chose).
        self.address: tuple[str, int] = (str(host), int(port))
        self._tg = task_group
        #: Recent bulk-frame rates: whether streaming broadcasts pays (:meth:`prefers_streaming`).
        self.link_pace = LinkPace()
        self._log = log if log is not None else (lambda level, text, fields: None)
        self.send_queue_bytes = send_queue_bytes
        self.stall_timeout = stall_timeout
        self.linger = linger
        #: The most bytes a socket waits for before an in-place read (1: every segment).
        self.read_watermark = read_watermark
        self._peers: dict[ConnId, _Peer] = {}
        #: Peer sockets open at once; fds are numbered lowest-free first, so the listener's
        #: number bounds how many the process had open before.
        self.max_peers = peer_socket_cap(listener.fileno() + 1) if max_peers is None else max_peers
        self._peer_left = anyio.Event()
        self._throttle = LogThrottle()
        self._hangups = _HangupWatch() if hasattr(select, "epoll") else None
        self._outboxes: dict[GroupKey, _Outbox] = {}
        self._recv_view = memoryview(bytearray(RECV_BUFFER_SIZE))
        self._next_conn = 1
        self._arrived = anyio.Event()
        #: When the waiting :meth:`next_event` wakes up by itself (−inf: nobody waits).
        self._wake_at = -math.inf
        self._room = anyio.Event()
        self._accept_scope = anyio.CancelScope()
        self._shutting_down = False
        self._hard_stop = False

    @classmethod
    @contextlib.asynccontextmanager
    async def serve(
        cls,
        groups: ConnectionGroups,
        clock: Clock,
        host: str,
        port: int,
        *,
        log: LogFn | None = None,
        send_queue_bytes: int = SEND_QUEUE_BYTES,
        stall_timeout: float = SEND_STALL_TIMEOUT_S,
        linger: float = LINGER_S,
        read_watermark: int = READ_WATERMARK_CAP,
        max_peers: int | None = None,
    ) -> AsyncIterator[TcpTransport]:
        """Listen on ``host:port`` (0 = any free port) and accept until the block ends."""
        listener = _listening_socket(host, port)
        async with anyio.create_task_group() as tg:
            transport = cls(
                groups,
                clock,
                listener,
                tg,
                log=log,
                send_queue_bytes=send_queue_bytes,
                stall_timeout=stall_timeout,
                linger=linger,
                read_watermark=read_watermark,
                max_peers=max_peers,
            )
            tg.start_soon(transport._accept_loop)
            if transport._hangups is not None:
                tg.start_soon(transport._hangups.run)
            try:
                yield transport
            finally:
                with anyio.CancelScope(shield=True):
                    await transport.shutdown(0.0)
                tg.cancel_scope.cancel()

    # -- events for the driver ---------------------------------------------------------------
    async def next_event(self, until: float | None) -> Event | None:
        while True:
            event = self.groups.pop_event()
            if event is not None:
                if self.groups.backlog < self._max_backlog:
                    # Room: frames the bound left in sockets go first (a reader may be waiting
                    # for bytes that never come), then the waiting readers may read again.
                    if self.groups.holds_any:  # rarely: checked on the driver's every event
                        self._apply(self.groups.drain_held(self.clock.now()))
                    self._room.set()
                if isinstance(event, GroupReady):
                    self._wake_held_back()  # its sockets may have stopped reading until now
                return event
            now = self.clock.now()
            deadline = self.groups.next_deadline()
            if deadline is not None and deadline <= now:
                self._apply(self.groups.expire(now))
                continue
            if until is not None and until <= now:
                return None
            self._wake_at = min((t for t in (deadline, until) if t is not None), default=math.inf)
            self._arrived = anyio.Event()
            with anyio.move_on_after(self._wake_at - now):
                await self._arrived.wait()
            self._wake_at = -math.inf

    def _wake_driver(self) -> None:
        """Wake :meth:`next_event` for a new event, or for a deadline earlier than its wake-up."""
        if self.groups.backlog:
            self._arrived.set()
        elif self._wake_at > -math.inf:
            deadline = self.groups.next_deadline()
            if deadline is not None and deadline < self._wake_at:
                self._arrived.set()

    # -- the Transport protocol --------------------------------------------------------------
    def admit(self, conn: ConnId, group: GroupKey, num_streams: int, limits: Limits) -> None:
        self._apply(self.groups.admit(conn, group, num_streams, limits, self.clock.now()))
        self._wake_held_back()  # its sockets may read now

    def _wake_held_back(self) -> None:
        """Let every held-back reader look again (they are few, and admissions rare)."""
        for peer in self._peers.values():
            if peer.held_back is not None:
                peer.held_back.set()

    def refuse(self, conn: ConnId, error: ErrorMessage) -> None:
        self._apply(self.groups.refuse(conn, error))

    def close_group(self, group: GroupKey, error: ErrorMessage | None) -> None:
        self._apply(self.groups.close_group(group, error))

    async def send(
        self, group: GroupKey, message: AnyMessage, progress: PayloadProgress | None = None
    ) -> None:
        """Queue ``message`` for ``group`` without waiting for that learner (:class:`_Outbox`)."""
        if not self.groups.has_group(group):
            return
        outbox = self._outboxes.get(group)
        if outbox is None or outbox.done:
            outbox = self._outboxes[group] = _Outbox()
            self._tg.start_soon(self._feed, group, outbox)
        outbox.add(message, progress)
        await anyio.lowlevel.checkpoint()

    async def _feed(self, group: GroupKey, outbox: _Outbox) -> None:
        """Cut the group's messages into frames, in order, into its sockets' bounded queues."""
        try:
            while True:
                while not outbox.pending:
                    if self._shutting_down or not self.groups.has_group(group):
                        return  # shutting down: nothing new is sent after the last message
                    await self._until_changed([], outbox)
                queues = self._queues_of(group)
                # Stopping, held BCASTs are dropped (_Outbox.settled), not sent meanwhile.
                taken = outbox.take(not self._shutting_down and all(queue.idle for queue in queues))
                if taken is None:  # only BCASTs, held until the sockets are idle
                    if self._shutting_down:
                        return  # dropped (_Outbox.settled)
                    await self._until_changed(queues, outbox)
                    continue
                message, progress = taken
                outbox.busy = True
                queued = await self._queue(group, message, progress)
                outbox.busy = False
                # Not kept while waiting for the next one: a BCAST's array goes back to the
                # coordinator's pool only once nothing refers to it.
                del taken, message, progress
                if not queued:
                    return
        finally:
            outbox.done = True
            outbox.pending.clear()
            if self._outboxes.get(group) is outbox:
                del self._outboxes[group]

    def _queues_of(self, group: GroupKey) -> list[SendQueue]:
        """The send queues of ``group``'s sockets.

        A BCAST is cut into frames only once they are all idle: until its first byte can go
        out, a newer BCAST of its fragment (or the final cut) may still replace it. Behind a
        slow link, frames queued early were each a version out of date before they left
        (three 32 MiB BCASTs, ~90 s each at 3 Mbit/s, after the learner's newest was
        committed).
        """
        return [
            peer.queue
            for conn in self.groups.sockets_of(group)
            if (peer := self._peers.get(conn)) is not None
        ]

    async def _until_changed(self, queues: list[SendQueue], outbox: _Outbox) -> None:
        """Wait until one of ``queues`` or the outbox changes (at most a second)."""
        outbox.changed = anyio.Event()
        for queue in queues:
            queue.also_notify = outbox.changed
        with anyio.move_on_after(1.0):  # also notices a group that closed
            await outbox.changed.wait()

    async def _queue(
        self, group: GroupKey, message: AnyMessage, progress: PayloadProgress | None
    ) -> bool:
        """Queue one message's frames; False once the group is gone.

        A BCAST's frames go in at once, over the queues' bound: it is cut only when every
        queue of its group is idle, so at most one fragment's bytes (views of the
        coordinator's arrays, no copies) are over. Waiting for room there held the group's
        PULLs behind it, though they go on another socket (a fragment over 64 MiB per data
        stream, on a slow link: minutes).
        """
        at_once = isinstance(message, BcastFragment)
        transmits = self.groups.route(group, message, progress)
        if not transmits:
            return self.groups.has_group(group)
        for transmit in transmits:
            peer = self._peers.get(transmit.conn)
            if peer is None:
                continue
            frame = Outgoing(transmit.buffers, transmit.writable, transmit.progress)
            queued = await self._put_while_draining(peer, frame, transmit.size, at_once=at_once)
            if queued is None:
                self._drop_stalled(transmit.conn, "its send queue stayed full")
                return False
            if not queued:
                return False  # the group closed while we waited
        return True

    async def _put_while_draining(
        self, peer: _Peer, frame: Outgoing, size: int, *, at_once: bool = False
    ) -> bool | None:
        """Wait for room in ``peer``'s queue for as long as its socket keeps taking bytes;
        ``None`` once it took none for the stall timeout (else as :meth:`SendQueue.put`).

        One frame can take minutes on a slow link (32 MiB at 3 Mbit/s: ~90 s): the frame
        behind it must not count that as a stall.
        """
        while True:
            written = peer.bytes_written
            with anyio.move_on_after(self.stall_timeout) as waited:
                queued = await peer.queue.put(frame, size, at_once=at_once)
            if not waited.cancelled_caught:
                return queued
            if peer.bytes_written == written:
                return None

    async def shutdown(self, grace: float) -> None:
        """Stop accepting, let queued frames drain, then cut the rest: in ``grace`` seconds
        at most (at least :data:`HARD_STOP_S`), the last :data:`HARD_STOP_S` for the cut."""
        if self._hard_stop:  # stopped already (serve() stops once more on its way out)
            return
        flush_until = anyio.current_time() + max(0.0, grace - HARD_STOP_S)
        if not self._shutting_down:
            self._shutting_down = True
            self._accept_scope.cancel()  # the accept loop closes the listener on its way out
            # Messages the driver sent last (the final cut, SHUTDOWN) are queued before the
            # queues close, within the grace.
            with anyio.move_on_after(flush_until - anyio.current_time()):
                while not all(box.settled for box in self._outboxes.values()):
                    await anyio.sleep(0.01)
            for box in self._outboxes.values():
                box.changed.set()
            for peer in self._peers.values():
                peer.queue.close(discard=False)
        with anyio.move_on_after(flush_until - anyio.current_time()):
            await self._no_peers_left()
        self._hard_stop = True
        for peer in list(self._peers.values()):
            if peer.frame_scope is not None:
                peer.frame_scope.cancel()
            if peer.scope is not None:
                peer.scope.cancel()
        with anyio.move_on_after(HARD_STOP_S):
            await self._no_peers_left()

    async def _no_peers_left(self) -> None:
        while self._peers:
            if self._peer_left.is_set():
                self._peer_left = anyio.Event()
            await self._peer_left.wait()

    def _apply(self, commands: list[WireCommand] | list[Transmit]) -> None:
        for command in commands:
            peer = self._peers.get(command.conn)
            if peer is None:
                continue
            if isinstance(command, Hangup):
                peer.known_as = peer.known_as or dict(command.fields)
                last = encode(command.error) if command.error is not None else None
                peer.queue.close(last=last, discard=True)
                if peer.held_back is not None:  # its reader drains until the peer's EOF
                    peer.held_back.set()
            else:  # only route() produces frames, and send() queues those itself
                raise AssertionError("Transmit outside send()")
        self._wake_driver()

    # -- sockets -------------------------------------------------------------------------------
    async def _accept_loop(self) -> None:
        try:
            with self._accept_scope:
                await self._accept_forever()
        finally:
            self._listener.close()

    async def _accept_forever(self) -> None:
        backoff = 0.0
        while True:
            await anyio.wait_readable(self._listener)
            if len(self._peers) >= self.max_peers:
                await self._room_for_a_peer()
                continue
            try:
                sock, address = self._listener.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                continue
            except OSError as exc:  # out of descriptors, say: back off, keep serving
                low, high = ACCEPT_BACKOFF_S
                backoff = min(max(2 * backoff, low), high)
                exhausted = exc.errno in _ACCEPT_EXHAUSTED
                self._log_throttled(
                    "warning" if exhausted else "error",
                    "accept failed",
                    {"error": str(exc), "retry_in_s": backoff},
                )
                await anyio.sleep(backoff)
                continue
            backoff = 0.0
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            bound_silence(sock, SILENCE_FACTOR * self.stall_timeout)
            conn, self._next_conn = self._next_conn, self._next_conn + 1
            peer = _Peer(conn, sock, _address_text(address), SendQueue(self.send_queue_bytes))
            self._peers[conn] = peer
            # Anyone can open connections: one line per period, with the count of the others.
            self._log_throttled("info", "connection opened", {"conn": conn, "peer": peer.address})
            self._tg.start_soon(self._serve_peer, peer)
            self._apply(self.groups.open(conn, self.clock.now()))

    async def _room_for_a_peer(self) -> None:
        """Every peer slot is taken and someone waits: close the oldest socket without a group,
        if any, and wait (bounded) for a slot; newcomers stay in the listen queue meanwhile."""
        self._log_throttled(
            "warning",
            "peer socket limit reached: new connections wait",
            {"max_peer_sockets": self.max_peers, "fd_reserve": FD_RESERVE},
        )
        if self._peer_left.is_set():
            self._peer_left = anyio.Event()
        evicted = self.groups.make_room(self.clock.now())
        self._apply(evicted)
        # An evicted socket lingers for its peer's EOF: wait that out before evicting another.
        with anyio.move_on_after(self.linger + 1.0 if evicted else 1.0):
            await self._peer_left.wait()

    def _log_throttled(self, level: str, text: str, fields: dict[str, object]) -> None:
        """Log ``text`` at most once per period; the next line counts those held back."""
        written = self._throttle.fields(text, time.monotonic(), fields)
        if written is not None:
            self._log(level, text, written)

    async def _serve_peer(self, peer: _Peer) -> None:
        try:
            async with anyio.create_task_group() as tg:
                peer.scope = tg.cancel_scope
                tg.start_soon(self._read_loop, peer)
                if await self._write_loop(peer):
                    with contextlib.suppress(OSError):
                        peer.sock.shutdown(socket.SHUT_WR)
                    with anyio.move_on_after(self.linger):
                        await peer.reader_done.wait()
                tg.cancel_scope.cancel()
        finally:
            peer.sock.close()
            del self._peers[peer.conn]
            self._peer_left.set()
            known = peer.known_as or self.groups.socket_fields(peer.conn)
            fields = {**known, "peer": peer.address}
            self._apply(self.groups.lost(peer.conn, "socket closed"))
            if "learner_id" in fields:  # a group's socket: always worth its line
                self._log("info", "connection closed", fields)
            else:
                self._log_throttled("info", "connection closed", fields)

    async def _read_loop(self, peer: _Peer) -> None:
        # One buffer serves every socket: each read is handed to the decoder (which copies it)
        # before this task yields, so no other reader can overwrite it in between.
        view = self._recv_view
        sock, conn = peer.sock, peer.conn
        watermark = ReceiveWatermark(sock, self.read_watermark)
        try:
            while True:
                if self.groups.holds_frames(conn):
                    # Frames of an earlier read wait for room in the backlog: hand them on
                    # before reading more, so one flooding peer cannot hold the others back.
                    # (A socket closed on the way keeps reading, to the peer's EOF: closed
                    # with unread bytes it would reset, and the ERROR could be lost.)
                    await self._room_for_events()
                    self._apply(self.groups.drain(conn, self.clock.now()))
                    if self.groups.waits_for_hello_turn(conn):
                        await anyio.sleep(HELLO_TURN_POLL_S)  # one large HELLO at a time
                    continue
                # Large payloads are read straight into their frame's buffer (no copy).
                into, direct = self.groups.next_read(conn, view)
                if not direct:
                    # Small frames: a read this size holds ~10,000 at most, decoded, when the
                    # backlog is full (4 MiB of HEARTBEATs were ~90 MiB of frame objects).
                    into = into[:SCRATCH_READ_BYTES]
                if not into:
                    # The socket holds all it may before its group is settled or ready: read
                    # nothing (TCP pushes back on the peer) until then or the attach deadline.
                    if not await self._held_back(peer):
                        reason = "peer closed while its socket waited for its group"
                        self._apply(self.groups.lost(conn, reason))
                        return
                    continue
                try:
                    size = sock.recv_into(into)
                except (BlockingIOError, InterruptedError):
                    watermark.before_wait(len(into), direct)
                    await anyio.wait_readable(sock)
                    continue
                except OSError as exc:
                    self._socket_failed(conn, "receive", exc)
                    return
                if direct and size:
                    self._apply(self.groups.receive_direct(conn, size, self.clock.now()))
                else:
                    self._apply(self.groups.receive(conn, view[:size], self.clock.now()))
                if size == 0 and not self.groups.holds_frames(conn):
                    return  # else the EOF waits behind held frames: hand it on first
                await self._room_for_events()  # other sockets' turn (and the driver's)
        finally:
            peer.reader_done.set()

    async def _held_back(self, peer: _Peer) -> bool:
        """Wait until the socket may read again (bounded); False if the peer hung up."""
        peer.held_back = anyio.Event()
        if self._hangups is not None:
            self._hangups.add(peer)
        try:
            with anyio.move_on_after(HELD_BACK_RECHECK_S):
                await peer.held_back.wait()
        finally:
            peer.held_back = None
            if self._hangups is not None:
                self._hangups.discard(peer)
        return not peer.hung_up

    async def _room_for_events(self) -> None:
        """Let other tasks run; while the driver is behind, stop reading (TCP pushes back)."""
        if self.groups.backlog < self._max_backlog:
            await anyio.lowlevel.checkpoint()
            return
        while self.groups.backlog >= self._max_backlog:
            if self._room.is_set():
                self._room = anyio.Event()
            await self._room.wait()

    async def _write_loop(self, peer: _Peer) -> bool:
        """Write queued frames until the queue closes (True) or the socket fails (False)."""
        try:
            while (frame := await peer.queue.get()) is not None:
                with anyio.CancelScope(shield=True) as scope:
                    peer.frame_scope = scope
                    if self._hard_stop:
                        scope.cancel()
                    await self._write_frame(peer.sock, frame, peer)
                peer.frame_scope = None
                peer.queue.written()
                del frame  # nor the last frame while waiting for the next
                if scope.cancelled_caught:
                    return False
        except PayloadWithdrawn:
            # Half a message is on the wire and will never be completed: cut it off.
            self._apply(self.groups.lost(peer.conn, "broadcast withdrawn: its merge failed"))
            return False
        except SendStalled:
            self._drop_stalled(peer.conn, "it accepted no bytes")
            return False
        except OSError as exc:
            self._socket_failed(peer.conn, "send", exc)
            return False
        return True

    def _socket_failed(self, conn: ConnId, what: str, exc: OSError) -> None:
        """A read or write failed: drop the group, with a warning when the kernel ended a
        silent connection (spec/syncer.md § 5), which no other line would explain."""
        if exc.errno == errno.ETIMEDOUT:
            fields = self.groups.socket_fields(conn)
            if "learner_id" in fields:
                fields.update(silence_bound_s=SILENCE_FACTOR * self.stall_timeout)
                self._log(
                    "warning",
                    "a learner's connection went silent (no acknowledgement or keepalive "
                    "answer): its group is dropped",
                    fields,
                )
        self._apply(self.groups.lost(conn, f"{what} failed: {exc}"))

    def _drop_stalled(self, conn: ConnId, what: str) -> None:
        """A socket whose peer took nothing for the stall timeout: say which one, then drop its
        group (once: the group's other sockets stall too, and their group is gone by then)."""
        fields = self.groups.socket_fields(conn)
        where = fields.get("socket", "socket")
        reason = f"send stalled: {what} for {self.stall_timeout:g} s on {where} (conn {conn})"
        if "learner_id" in fields:
            fields.update(stall_timeout_s=self.stall_timeout, why=what)
            self._log(
                "warning",
                "a learner took no bytes (it stopped reading, or its network went silent): "
                "its group is dropped",
                fields,
            )
        self._apply(self.groups.lost(conn, reason))

    def prefers_streaming(self) -> bool:
        """Whether a commit should stream its BCAST: some learner's link is slow lately."""
        return self.link_pace.slow

    async def _write_frame(
        self, sock: socket.socket, frame: Outgoing, peer: _Peer | None = None
    ) -> None:
        pending = OutgoingBuffers(frame.buffers, IOV_BATCH)
        written = 0
        started = time.monotonic()
        # Time spent waiting for the payload or letting other writers go: not the link's.
        off_link = 0.0
        while not pending.done:
            room = None
            if frame.writable is not None and frame.progress is not None:
                # Read the progress before the room it allows: a wake-up between the two
                # reads would otherwise be taken as already seen, and never come again.
                seen = frame.progress.ready
                room = frame.writable() - written
                if room <= 0:
                    paused = time.monotonic()
                    await _grown(frame.progress, seen)
                    off_link += time.monotonic() - paused
                    continue
            try:
                sent = sock.sendmsg(pending.batch(room))
            except (BlockingIOError, InterruptedError):
                sent = 0
            if not sent:
                with anyio.move_on_after(self.stall_timeout) as waited:
                    await anyio.wait_writable(sock)
                if waited.cancelled_caught:
                    raise SendStalled
                continue
            pending.advance(sent)
            written += sent
            if peer is not None:
                peer.bytes_written += sent
            if sent >= WRITE_TURN_BYTES:
                # A socket whose peer keeps up (loopback, a fast LAN) would otherwise take
                # every queued frame in one go while the other learners' sockets wait: one
                # learner would get a broadcast well before the others.
                paused = time.monotonic()
                await anyio.lowlevel.checkpoint()
                off_link += time.monotonic() - paused
        self.link_pace.record(written, time.monotonic() - started - off_link)
