"""The in-memory transport: the syncer's connection groups with no sockets and a fake clock.

Each :class:`MemoryPeer` is the learner's end of one socket. What a peer writes goes through
the same :class:`~yeto_sync.transport.group.ConnectionGroups` (the same decoders, reassembly and
errors) as TCP bytes would; what the syncer sends piles up in the peer's inbox as bytes. Time
moves only when a test says so, so every schedule is deterministic: :meth:`MemorySyncer.settle`
runs the driver until nothing is left to do at the current time, and
:meth:`MemorySyncer.advance` moves the clock forward through every deadline on the way.
"""

from __future__ import annotations

import anyio

from yeto_proto import AnyMessage, ErrorMessage, Limits, encode, encode_bytes

from ..driver import CoordinatorLike, Driver, Outputs
from ..events import ConnId, Event, GroupKey, GroupReady
from ..payload_progress import PayloadProgress
from .group import ConnectionGroups, Hangup, LogFn, Transmit, WireCommand

#: The largest read :meth:`MemoryTransport.deliver` makes (scratch or in place).
MEMORY_READ_SIZE = 256 << 10
#: How often an in-memory send looks again at a payload that is still being written.
_PROGRESS_POLL_S = 0.001


class FakeClock:
    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def set(self, at: float) -> None:
        if at < self._now:
            raise ValueError("a monotonic clock does not go back")
        self._now = at


class MemoryPeer:
    """The learner's end of one in-memory socket."""

    def __init__(self, transport: MemoryTransport, conn: ConnId) -> None:
        self._transport = transport
        self.conn = conn
        self._inbox = bytearray()
        #: The syncer closed this socket.
        self.hung_up = False
        #: We closed it (EOF sent).
        self.closed = False

    def write(self, data: bytes) -> None:
        """Bytes from the learner to the syncer (ignored once either side closed)."""
        if data and not self.closed and not self.hung_up:
            self._transport.deliver(self.conn, data)

    def send(self, message: AnyMessage, *, hello_key: bytes | None = None) -> None:
        self.write(encode_bytes(message, hello_key=hello_key))

    def close(self) -> None:
        if not self.closed and not self.hung_up:
            self.closed = True
            self._transport.deliver(self.conn, b"")

    def read(self) -> bytes:
        """Everything the syncer sent on this socket since the last read."""
        data, self._inbox = bytes(self._inbox), bytearray()
        return data

    def arrive(self, buffers: list[bytes | memoryview]) -> None:
        """Bytes the syncer sent on this socket land in the inbox."""
        for buffer in buffers:
            self._inbox += buffer


class MemoryTransport:
    """:class:`~yeto_sync.transport.Transport` over in-memory peers."""

    def __init__(self, groups: ConnectionGroups, clock: FakeClock) -> None:
        self.groups = groups
        self.clock = clock
        self.peers: dict[ConnId, MemoryPeer] = {}
        self._next_conn = 1
        self.accepting = True
        self._scratch = memoryview(bytearray(MEMORY_READ_SIZE))
        #: Bytes (and whether EOF follows) a socket may not read yet, per connection.
        self._unread: dict[ConnId, tuple[bytes, bool]] = {}

    def connect(self) -> MemoryPeer:
        if not self.accepting:
            raise ConnectionRefusedError("the in-memory syncer has shut down")
        conn, self._next_conn = self._next_conn, self._next_conn + 1
        peer = MemoryPeer(self, conn)
        self.peers[conn] = peer
        self._apply(self.groups.open(conn, self.clock.now()))
        return peer

    def deliver(self, conn: ConnId, data: bytes) -> None:
        """Hand the syncer ``data`` read by read, as the TCP transport reads a socket.

        Each read is at most :data:`MEMORY_READ_SIZE` bytes, into the place
        :meth:`ConnectionGroups.next_read` names: large payloads in place, the rest through
        scratch. So in-place reads and everything that watches them run in these tests too.
        A socket that may not read yet (held back until its group is settled) keeps the rest,
        and its EOF, for later, as unread bytes stay in a TCP socket.
        """
        if conn in self._unread:
            held, eof = self._unread[conn]
            self._unread[conn] = (held + data, eof or not data)
        else:
            self._unread[conn] = (data, not data)
        self._read_unread()

    def _read_unread(self) -> None:
        for conn in list(self._unread):
            data, eof = self._unread.pop(conn)
            rest = self._read(conn, memoryview(data))
            if rest:
                self._unread[conn] = (bytes(rest), eof)
            elif eof and self.groups.is_open(conn):
                self._apply(self.groups.receive(conn, b"", self.clock.now()))

    def _read(self, conn: ConnId, rest: memoryview) -> memoryview:
        """Read ``rest`` into the syncer; what it may not read yet comes back."""
        now = self.clock.now()
        while rest and self.groups.is_open(conn):
            into, direct = self.groups.next_read(conn, self._scratch)
            if not into:
                return rest
            size = min(len(into), len(rest), MEMORY_READ_SIZE)
            into[:size] = rest[:size]
            rest = rest[size:]
            if direct:
                self._apply(self.groups.receive_direct(conn, size, now))
            else:
                self._apply(self.groups.receive(conn, into[:size], now))
        return rest[:0]

    # -- events ----------------------------------------------------------------------------
    def poll_event(self) -> Event | None:
        """The next queued event, after enforcing deadlines due by now; never waits."""
        deadline = self.groups.next_deadline()
        if deadline is not None and deadline <= self.clock.now():
            self._apply(self.groups.expire(self.clock.now()))
        event = self.groups.pop_event()
        if isinstance(event, GroupReady):
            # Its sockets may have stopped once it held all it may: the frames they decoded
            # go on, then the bytes they left unread.
            if self.groups.holds_any:
                self._apply(self.groups.drain_held(self.clock.now()))
            self._read_unread()
        return event

    # -- the Transport protocol ------------------------------------------------------------
    def admit(self, conn: ConnId, group: GroupKey, num_streams: int, limits: Limits) -> None:
        self._apply(self.groups.admit(conn, group, num_streams, limits, self.clock.now()))
        self._read_unread()  # sockets of this group may read again

    def refuse(self, conn: ConnId, error: ErrorMessage) -> None:
        self._apply(self.groups.refuse(conn, error))

    async def send(
        self, group: GroupKey, message: AnyMessage, progress: PayloadProgress | None = None
    ) -> None:
        """Deliver ``message`` whole; a payload still being written is waited for first."""
        if progress is not None:
            while not progress.complete:
                if progress.withdrawn:
                    self._apply(self.groups.close_group(group, None))
                    return
                await anyio.sleep(_PROGRESS_POLL_S)
        self._apply(self.groups.route(group, message))

    def close_group(self, group: GroupKey, error: ErrorMessage | None) -> None:
        self._apply(self.groups.close_group(group, error))

    async def shutdown(self, grace: float) -> None:
        """Everything sent is already in the inboxes: hang up every socket."""
        self.accepting = False
        for conn, peer in self.peers.items():
            if not peer.hung_up:
                self._apply(self.groups.lost(conn, "syncer shut down"))
                peer.hung_up = True

    def _apply(self, commands: list[WireCommand] | list[Transmit]) -> None:
        for command in commands:
            peer = self.peers[command.conn]
            if isinstance(command, Hangup):
                if command.error is not None and not peer.hung_up:
                    peer.arrive(encode(command.error))
                peer.hung_up = True
            elif not peer.hung_up:
                peer.arrive(command.buffers)


class MemorySyncer:
    """A coordinator driven over an in-memory transport by a fake clock."""

    def __init__(
        self,
        coordinator: CoordinatorLike,
        *,
        num_learners: int,
        hello_key: bytes | None = None,
        outputs: Outputs | None = None,
        start: float = 0.0,
        log: LogFn | None = None,
    ) -> None:
        self.clock = FakeClock(start)
        self.groups = ConnectionGroups(num_learners, hello_key=hello_key, log=log)
        self.transport = MemoryTransport(self.groups, self.clock)
        self.driver = Driver(coordinator, self.transport, self.clock, outputs=outputs, log=log)

    def connect(self) -> MemoryPeer:
        return self.transport.connect()

    async def settle(self) -> None:
        """Dispatch every queued event and due timer at the current time."""
        while self.driver.exit is None:
            if await self.driver.fire_due_timers():
                continue
            event = self.transport.poll_event()
            if event is None:
                return
            await self.driver.dispatch(event)

    async def advance(self, seconds: float) -> None:
        """Move time forward by ``seconds``, stopping at every deadline on the way."""
        target = self.clock.now() + seconds
        await self.settle()
        while self.driver.exit is None:
            due = [
                t
                for t in (self.driver.next_timer_at(), self.groups.next_deadline())
                if t is not None and t <= target
            ]
            if not due:
                break
            self.clock.set(max(min(due), self.clock.now()))
            await self.settle()
        self.clock.set(max(target, self.clock.now()))
        await self.settle()
