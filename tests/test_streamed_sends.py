"""Streamed BCASTs: a Send whose payload is still being written goes out no faster than its
:class:`~yeto_sync.payload_progress.PayloadProgress` allows.

From the bottom up: the progress itself; ``ConnectionGroups.route`` (how much of each frame is
writable at a given progress); the TCP transport over real loopback sockets, with a producer
thread advancing the progress while a raw client counts every byte it receives; a withdrawn
payload cutting its group (and only its group); and the driver's ``stream_broadcasts`` mode,
which lets the coordinator queue Sends from inside ``handle`` running in a worker thread.
"""

from __future__ import annotations

import selectors
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager

import anyio
import anyio.to_thread
import numpy as np
import pytest
from numpy.typing import NDArray

from yeto_proto import (
    FRAME_MAGIC,
    AnyMessage,
    BcastFragment,
    Chunk,
    DataHello,
    DecoderState,
    ErrorMessage,
    FrameDecoder,
    FrameType,
    Heartbeat,
    Hello,
    Limits,
    MergeMode,
    PullReq,
    PushFragment,
    Reassembler,
    Role,
    WireDtype,
    WireFragment,
    WireLayout,
    encode_bytes,
)
from yeto_proto.constants import CHUNK_ENVELOPE_SIZE, CHUNK_SLICE_SIZE
from yeto_proto.schema import CHUNK_PREFIX, HEADER_STRUCT
from yeto_sync.driver import Driver, KeyValueLog
from yeto_sync.events import (
    Action,
    AdmitGroup,
    ConnId,
    Event,
    Exit,
    GroupClosed,
    GroupKey,
    GroupReady,
    HelloReceived,
    Log,
    MessageReceived,
    Send,
    SetTimer,
    TimerFired,
)
from yeto_sync.payload_progress import PayloadProgress, PayloadWithdrawn
from yeto_sync.transport import MonotonicClock
from yeto_sync.transport.group import ConnectionGroups, Transmit
from yeto_sync.transport.link_pace import RECENT_FRAMES, LinkPace
from yeto_sync.transport.memory import FakeClock
from yeto_sync.transport.tcp import TcpTransport

MIB = 1 << 20
#: 5 MiB of f32: a striped BCAST of it is two CHUNKs (4 MiB + the rest).
NUMEL = 5 * MIB // 4
PAYLOAD = 4 * NUMEL
LAYOUT = WireLayout((WireFragment(MergeMode.AVG, (NUMEL,)), WireFragment(MergeMode.AVG, (16,))))
LIMITS = Limits.of(WireDtype.F32, LAYOUT)
FINGERPRINT = bytes(range(32))
CONTRACT = bytes(range(32, 64))
KEY = GroupKey(0, 1)
OTHER = GroupKey(1, 1)
HEADER = HEADER_STRUCT.size  # 13
ENVELOPE = HEADER + CHUNK_ENVELOPE_SIZE  # a CHUNK frame's own head: 37 bytes
#: Bytes of a BCAST frame before its tensor: frame header + fragment_id:u32 + version:u64.
BCAST_HEAD = HEADER + 12
FRAME = BCAST_HEAD + PAYLOAD
#: Generous bound for anything the tests wait for; the normal case takes milliseconds.
WAIT_S = 10.0


def run(test: Callable[[], Awaitable[None]]) -> None:
    anyio.run(test)


def final_payload() -> NDArray[np.uint8]:
    """The bytes the merge will have written: no zero among them, so an early byte shows."""
    return (np.arange(PAYLOAD, dtype=np.uint32) % 251 + 1).astype(np.uint8)


def hello(learner_id: int, num_streams: int) -> Hello:
    return Hello(learner_id, 1, WireDtype.F32, LAYOUT, FINGERPRINT, CONTRACT, num_streams)


def wait_until(condition: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    """Poll ``condition`` (from a plain thread) until it holds; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)


# -- PayloadProgress -----------------------------------------------------------------------------
def test_progress_only_grows_and_is_clamped_to_its_total() -> None:
    progress = PayloadProgress(100)
    assert (progress.ready, progress.complete, progress.withdrawn) == (0, False, False)
    progress.advance(40)
    progress.advance(10)  # smaller than before: changes nothing
    assert progress.ready == 40
    progress.advance(250)
    assert progress.ready == 100 and progress.complete
    with pytest.raises(ValueError):
        PayloadProgress(-1)
    empty = PayloadProgress(0)
    assert empty.complete and empty.ready == 0


def test_finish_completes_and_a_later_withdraw_changes_nothing() -> None:
    progress = PayloadProgress(64)
    progress.advance(8)
    progress.finish()
    assert progress.complete and progress.ready == 64
    progress.withdraw()  # the bytes are all final: too late to take them back
    assert not progress.withdrawn and progress.complete and progress.ready == 64


def test_a_withdrawn_payload_raises_on_ready_and_stops_growing() -> None:
    progress = PayloadProgress(64)
    progress.advance(16)
    progress.withdraw()
    assert progress.withdrawn and not progress.complete
    with pytest.raises(PayloadWithdrawn):
        _ = progress.ready
    progress.advance(64)
    progress.finish()
    assert progress.withdrawn and not progress.complete
    with pytest.raises(PayloadWithdrawn):
        _ = progress.ready


def test_listeners_hear_each_change_until_unsubscribed() -> None:
    progress = PayloadProgress(10)
    heard: list[str] = []
    unsubscribe_a = progress.subscribe(lambda: heard.append("a"))
    progress.subscribe(lambda: heard.append("b"))
    progress.advance(3)
    progress.advance(2)  # no change, no call
    assert heard == ["a", "b"]
    unsubscribe_a()
    unsubscribe_a()  # twice is harmless
    progress.advance(5)
    progress.withdraw()
    progress.withdraw()  # already withdrawn: no second call
    assert heard == ["a", "b", "b", "b"]


def test_listeners_run_on_the_producer_thread() -> None:
    progress = PayloadProgress(10)
    threads: list[threading.Thread] = []
    progress.subscribe(lambda: threads.append(threading.current_thread()))
    producer = threading.Thread(target=progress.finish)
    producer.start()
    producer.join(WAIT_S)
    assert threads == [producer]


def test_concurrent_producers_leave_the_largest_value() -> None:
    progress = PayloadProgress(10_000)
    calls: list[int] = []
    progress.subscribe(lambda: calls.append(1))

    def produce(offset: int) -> None:
        for value in range(offset, 10_000, 4):
            progress.advance(value)

    producers = [threading.Thread(target=produce, args=(i,)) for i in range(4)]
    for thread in producers:
        thread.start()
    for thread in producers:
        thread.join(WAIT_S)
    assert progress.ready == 9_999 and not progress.complete
    assert 0 < len(calls) <= 9_999  # only real changes are announced


# -- route(): the writable part of each frame ----------------------------------------------------
def admitted_groups(num_streams: int) -> tuple[ConnectionGroups, ConnId, list[ConnId]]:
    """A sans-IO table with group KEY admitted and ready: its control and data connections."""
    groups = ConnectionGroups(2)
    groups.open(1, 0.0)
    groups.receive(1, encode_bytes(hello(0, num_streams)), 0.0)
    assert isinstance(groups.pop_event(), HelloReceived)
    groups.admit(1, KEY, num_streams, LIMITS, 0.0)
    data = []
    for index in range(num_streams):
        conn = 2 + index
        groups.open(conn, 0.0)
        groups.receive(conn, encode_bytes(DataHello(0, 1, index)), 0.0)
        data.append(conn)
    assert groups.pop_event() == GroupReady(KEY)
    return groups, 1, data


def streamed_bcast() -> tuple[BcastFragment, PayloadProgress]:
    return BcastFragment(0, 3, final_payload().data), PayloadProgress(PAYLOAD)


def test_route_without_progress_has_nothing_to_wait_for() -> None:
    groups, control, _ = admitted_groups(0)
    message, _ = streamed_bcast()
    (transmit,) = groups.route(KEY, message)
    assert (transmit.conn, transmit.writable, transmit.progress) == (control, None, None)
    assert transmit.size == FRAME


def test_route_refuses_a_payload_longer_than_the_frame() -> None:
    groups, _, _ = admitted_groups(0)
    with pytest.raises(ValueError):
        groups.route(KEY, PullReq(0, 1, 1), PayloadProgress(1 << 10))


def writable_now(transmits: Sequence[Transmit]) -> list[int]:
    out = []
    for transmit in transmits:
        assert transmit.writable is not None
        out.append(transmit.writable())
    return out


def test_route_plain_frame_writes_its_header_then_the_final_payload() -> None:
    groups, control, _ = admitted_groups(0)
    message, progress = streamed_bcast()
    (transmit,) = groups.route(KEY, message, progress)
    assert transmit.conn == control and transmit.progress is progress
    assert transmit.size == FRAME
    assert writable_now([transmit]) == [BCAST_HEAD]  # the head is final from the start
    progress.advance(12_345)
    assert writable_now([transmit]) == [BCAST_HEAD + 12_345]
    progress.finish()
    assert writable_now([transmit]) == [transmit.size]


def test_route_chunks_write_their_envelopes_and_the_final_part_they_carry() -> None:
    groups, _, (stream0, stream1) = admitted_groups(2)
    message, progress = streamed_bcast()
    first, second = transmits = groups.route(KEY, message, progress)
    assert [t.conn for t in transmits] == [stream0, stream1]  # round-robin from stream 0
    assert [t.size for t in transmits] == [ENVELOPE + CHUNK_SLICE_SIZE, ENVELOPE + FRAME - 4 * MIB]
    assert all(t.progress is progress for t in transmits)
    # Nothing final yet: the envelopes, and the BCAST's own head in the first CHUNK.
    assert writable_now(transmits) == [ENVELOPE + BCAST_HEAD, ENVELOPE]
    # The final prefix of the message ends 10 bytes short of the slice boundary.
    progress.advance(CHUNK_SLICE_SIZE - BCAST_HEAD - 10)
    assert writable_now(transmits) == [first.size - 10, ENVELOPE]
    # ... and then 25 bytes into the second CHUNK.
    progress.advance(CHUNK_SLICE_SIZE - BCAST_HEAD + 25)
    assert writable_now(transmits) == [first.size, ENVELOPE + 25]
    progress.finish()
    assert writable_now(transmits) == [first.size, second.size]
    # What the CHUNKs carry is the whole frame, in order.
    carried = b"".join(bytes(b) for t in transmits for b in t.buffers[1:])
    assert carried == encode_bytes(message)


def test_writable_raises_once_the_payload_is_withdrawn() -> None:
    groups, _, _ = admitted_groups(2)
    message, progress = streamed_bcast()
    transmits = groups.route(KEY, message, progress)
    progress.advance(100)
    progress.withdraw()
    for transmit in transmits:
        assert transmit.writable is not None
        with pytest.raises(PayloadWithdrawn):
            transmit.writable()


# -- a raw learner on real sockets ---------------------------------------------------------------
class RawClient:
    """A learner's group on blocking sockets that records every byte each socket receives.

    Socket 0 sends HELLO, socket ``1 + i`` DATA_HELLO ``i``; a reader thread appends what
    arrives to :attr:`data` and, at EOF (or a reset), half-closes the socket like a polite peer.
    """

    def __init__(self, address: tuple[str, int], learner_id: int, num_streams: int) -> None:
        self.sockets: list[socket.socket] = []
        first = [encode_bytes(hello(learner_id, num_streams))]
        first += [encode_bytes(DataHello(learner_id, 1, i)) for i in range(num_streams)]
        for frame in first:
            sock = socket.create_connection(address, timeout=WAIT_S)
            sock.sendall(frame)
            self.sockets.append(sock)
        self._lock = threading.Lock()
        self._data = [bytearray() for _ in self.sockets]
        self._eof = [False] * len(self.sockets)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read_all, daemon=True)
        self._thread.start()

    def _read_all(self) -> None:
        with selectors.DefaultSelector() as selector:
            for index, sock in enumerate(self.sockets):
                sock.setblocking(False)
                selector.register(sock, selectors.EVENT_READ, index)
            while not self._stop.is_set() and selector.get_map():
                for key, _ in selector.select(0.02):
                    index = key.data
                    try:
                        data = self.sockets[index].recv(MIB)
                    except BlockingIOError:
                        continue
                    except OSError:  # reset
                        data = b""
                    with self._lock:
                        self._data[index] += data
                        if not data:
                            self._eof[index] = True
                    if not data:
                        selector.unregister(self.sockets[index])
                        try:
                            self.sockets[index].shutdown(socket.SHUT_WR)
                        except OSError:
                            pass

    def received(self) -> list[bytes]:
        with self._lock:
            return [bytes(d) for d in self._data]

    def eof(self) -> list[bool]:
        with self._lock:
            return list(self._eof)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(WAIT_S)
        for sock in self.sockets:
            sock.close()


def chunk_pieces(raw: bytes) -> tuple[list[tuple[int, bytes]], int]:
    """The CHUNK frames (the last one perhaps partial) in a data socket's byte stream.

    Returns ``(offset, message bytes)`` per CHUNK whose envelope arrived, and how many bytes of
    a further envelope are in (0 when the stream ends on an envelope boundary).
    """
    pieces, pos = [], 0
    while len(raw) - pos >= ENVELOPE:
        magic, frame_type, length = HEADER_STRUCT.unpack_from(raw, pos)
        assert magic == FRAME_MAGIC and frame_type == FrameType.CHUNK
        _, total_len, offset = CHUNK_PREFIX.unpack_from(raw, pos + HEADER)
        assert total_len == FRAME
        pieces.append((offset, raw[pos + ENVELOPE : pos + HEADER + length]))
        pos += HEADER + length
    return pieces, max(len(raw) - pos, 0)


def message_bytes(client: RawClient, num_streams: int) -> tuple[int, list[tuple[int, bytes]]]:
    """What the client holds of the streamed BCAST frame: its byte count and where they lie."""
    received = client.received()
    if num_streams == 0:
        return len(received[0]), [(0, received[0])]
    pieces: list[tuple[int, bytes]] = []
    partial = 0
    for raw in received[1:]:
        found, rest = chunk_pieces(raw)
        pieces += found
        partial += rest
    return sum(len(data) for _, data in pieces) + partial, pieces


def decode_all(client: RawClient) -> list[AnyMessage]:
    """Every complete message in what the client received (CHUNKs reassembled)."""
    reassembler = Reassembler(Role.LEARNER, LIMITS)
    out: list[AnyMessage] = []
    for raw in client.received():
        decoder = FrameDecoder(Role.LEARNER, limits=LIMITS)
        decoder.feed(raw)
        while not isinstance(frame := decoder.next_frame(), DecoderState):
            if isinstance(frame, Chunk):
                inner = reassembler.add(frame)
                if inner is not None:
                    out.append(inner)
            else:
                out.append(frame)
    return out


class Admitter:
    """Pumps the transport's events: admits every HELLO and records everything."""

    def __init__(self, transport: TcpTransport) -> None:
        self.transport = transport
        self.events: list[Event] = []
        self._changed = anyio.Event()

    async def run(self) -> None:
        while True:
            event = await self.transport.next_event(None)
            assert event is not None
            self.events.append(event)
            if isinstance(event, HelloReceived):
                key = GroupKey(event.hello.learner_id, event.hello.generation)
                self.transport.admit(event.conn, key, event.hello.num_streams, LIMITS)
            self._changed.set()
            self._changed = anyio.Event()

    async def wait_for(self, predicate: Callable[[Event], bool]) -> Event:
        while True:
            for event in self.events:
                if predicate(event):
                    return event
            await self._changed.wait()


@asynccontextmanager
async def tcp_syncer() -> AsyncIterator[tuple[TcpTransport, Admitter]]:
    clock = MonotonicClock()
    async with TcpTransport.serve(ConnectionGroups(2), clock, "127.0.0.1", 0, linger=0.5) as tcp:
        admitter = Admitter(tcp)
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(admitter.run)
            yield tcp, admitter
            tasks.cancel_scope.cancel()


@asynccontextmanager
async def one_group(num_streams: int) -> AsyncIterator[tuple[TcpTransport, Admitter, RawClient]]:
    """A TCP syncer with learner 0's group (KEY) connected; the client is closed afterwards."""
    async with tcp_syncer() as (transport, admitter):
        client = await connect(transport, admitter, 0, num_streams)
        try:
            yield transport, admitter, client
        finally:
            client.close()


async def connect(
    transport: TcpTransport, admitter: Admitter, learner_id: int, num_streams: int
) -> RawClient:
    client = await anyio.to_thread.run_sync(RawClient, transport.address, learner_id, num_streams)
    await admitter.wait_for(lambda e: e == GroupReady(GroupKey(learner_id, 1)))
    return client


class Producer:
    """The merge: writes the payload's final bytes in ascending order, advancing the progress."""

    def __init__(self) -> None:
        self.final = final_payload()
        self.buffer = np.zeros(PAYLOAD, dtype=np.uint8)  # what the merge has written so far
        self.progress = PayloadProgress(PAYLOAD)
        self.message = BcastFragment(0, 7, self.buffer.data)
        self.frame = encode_bytes(BcastFragment(0, 7, self.final.data))

    def advance(self, ready: int) -> None:
        done = self.progress.ready
        self.buffer[done:ready] = self.final[done:ready]
        self.progress.advance(ready)


async def send_streamed(transport: TcpTransport) -> Producer:
    """Hand ``transport`` a BCAST for KEY whose payload a :class:`Producer` is still writing."""
    producer = Producer()
    await transport.send(KEY, producer.message, producer.progress)
    return producer


def check_on_wire(
    client: RawClient, num_streams: int, producer: Producer, ready: int, *, control: bytes = b""
) -> None:
    """With ``ready`` payload bytes final, the client gets exactly the writable bytes, no more.

    Waits for the bytes that may go out, lets the transport run a little longer, then checks
    that nothing beyond them arrived and that every byte is the final one. With data streams,
    the control socket must have received exactly ``control``.
    """
    bound = BCAST_HEAD + ready  # the final prefix of the message frame
    wait_until(lambda: message_bytes(client, num_streams)[0] >= bound, f"{bound} bytes")
    time.sleep(0.05)
    count, pieces = message_bytes(client, num_streams)
    assert count == bound
    for offset, data in pieces:
        assert not data or offset + len(data) <= bound
        assert data == producer.frame[offset : offset + len(data)]
    if num_streams:
        # Each data stream has started its CHUNK: both envelopes are out, whatever the progress.
        envelopes = [len(chunk_pieces(raw)[0]) for raw in client.received()[1:]]
        assert envelopes == [1, 1]
        assert client.received()[0] == control
    assert not any(client.eof())


@pytest.mark.parametrize("num_streams", [0, 2])
def test_tcp_sends_a_streamed_bcast_no_faster_than_its_payload_is_final(
    num_streams: int,
) -> None:
    steps = [
        1 * MIB,
        CHUNK_SLICE_SIZE - BCAST_HEAD - 10,  # 10 bytes short of the first CHUNK's end
        CHUNK_SLICE_SIZE - BCAST_HEAD + 25,  # 25 bytes into the second CHUNK
        PAYLOAD - 7,
    ]

    def produce(client: RawClient, producer: Producer) -> None:
        check_on_wire(client, num_streams, producer, 0)
        for ready in steps:
            producer.advance(ready)
            check_on_wire(client, num_streams, producer, ready)
        producer.advance(PAYLOAD)  # finish
        wait_until(lambda: bool(decode_all(client)), "the whole BCAST")

    async def scenario() -> None:
        async with one_group(num_streams) as (transport, admitter, client):
            with anyio.fail_after(WAIT_S * 2):
                producer = await send_streamed(transport)
                await anyio.to_thread.run_sync(produce, client, producer)
            (bcast,) = decode_all(client)
            assert isinstance(bcast, BcastFragment) and bcast.version == 7
            assert bytes(bcast.data) == producer.final.tobytes()
            assert not any(client.eof())
            assert not any(isinstance(e, GroupClosed) for e in admitter.events)

    run(scenario)


@pytest.mark.parametrize("num_streams", [0, 2])
def test_tcp_frames_after_a_streamed_bcast_wait_for_it(num_streams: int) -> None:
    """A frame queued behind a streamed BCAST on the same socket follows it, whole."""

    pull = PullReq(0, 5, 1)

    def produce(client: RawClient, producer: Producer) -> None:
        producer.advance(MIB)
        if num_streams:  # the control socket is not held up by the CHUNKs
            wait_until(lambda: client.received()[0] == encode_bytes(pull), "the PULL_REQ")
        check_on_wire(client, num_streams, producer, MIB, control=encode_bytes(pull))
        producer.advance(PAYLOAD)

    async def scenario() -> None:
        async with one_group(num_streams) as (transport, _, client):
            with anyio.fail_after(WAIT_S * 2):
                producer = await send_streamed(transport)
                # Plain: behind the BCAST on socket 0; striped: on socket 0, free to go.
                await transport.send(KEY, pull)
                if num_streams:
                    second = BcastFragment(0, 8, final_payload().data)
                    await transport.send(KEY, second)  # behind the streamed CHUNKs
                await anyio.to_thread.run_sync(produce, client, producer)
                expected = 3 if num_streams else 2
                await anyio.to_thread.run_sync(
                    wait_until, lambda: len(decode_all(client)) == expected, "every message"
                )
            received = decode_all(client)
            bcasts = {m.version: bytes(m.data) for m in received if isinstance(m, BcastFragment)}
            assert bcasts[7] == producer.final.tobytes()
            assert pull in received
            if num_streams:
                assert bcasts[8] == producer.final.tobytes()
            else:  # one socket, in order
                assert [type(m) for m in received] == [BcastFragment, PullReq]

    run(scenario)


@pytest.mark.parametrize("num_streams", [0, 2])
def test_tcp_withdrawn_bcast_cuts_its_group_and_others_carry_on(num_streams: int) -> None:
    def produce(client: RawClient, producer: Producer) -> None:
        producer.advance(2 * MIB)
        check_on_wire(client, num_streams, producer, 2 * MIB)
        producer.progress.withdraw()  # the merge failed
        wait_until(lambda: all(client.eof()), "every socket of the group to close")

    async def scenario() -> None:
        async with tcp_syncer() as (transport, admitter):
            client = await connect(transport, admitter, 0, num_streams)
            other = await connect(transport, admitter, 1, 0)
            try:
                with anyio.fail_after(WAIT_S * 2):
                    producer = await send_streamed(transport)
                    await anyio.to_thread.run_sync(produce, client, producer)
                    closed = await admitter.wait_for(lambda e: isinstance(e, GroupClosed))
                    assert isinstance(closed, GroupClosed) and closed.group == KEY
                    assert "withdrawn" in closed.reason
                    # The half-sent message never completes, and nothing beyond it was sent.
                    count, _ = message_bytes(client, num_streams)
                    assert count <= BCAST_HEAD + 2 * MIB
                    assert decode_all(client) == []
                    # The transport still serves the other group.
                    whole = BcastFragment(0, 9, final_payload().data)
                    await transport.send(OTHER, PullReq(1, 2, 1))
                    await transport.send(OTHER, whole)
                    await anyio.to_thread.run_sync(
                        wait_until, lambda: len(decode_all(other)) == 2, "the other group"
                    )
                pull, bcast = decode_all(other)
                assert pull == PullReq(1, 2, 1)
                assert isinstance(bcast, BcastFragment)
                assert bytes(bcast.data) == bytes(whole.data)
                assert other.eof() == [False]
                closed_groups = [e.group for e in admitter.events if isinstance(e, GroupClosed)]
                assert closed_groups == [KEY]
            finally:
                client.close()
                other.close()

    run(scenario)


class FinishesBehindTheWritersBack(PayloadProgress):
    """A producer that finishes right after the writer read ``ready`` and found nothing new.

    The merge runs on its own thread, so ``finish()`` may land between any two reads the
    writer makes; this one lands just after a read that returned the value seen before.
    """

    def __init__(self, total: int) -> None:
        super().__init__(total)
        self._last: int | None = None
        self._armed = True

    @property
    def ready(self) -> int:
        value = super().ready
        if self._armed and value == self._last:
            self._armed = False
            self.finish()  # "on the producer's thread", between this read and the next
        self._last = value
        return value


def test_tcp_a_finish_racing_the_writer_is_not_lost() -> None:
    def produce(client: RawClient, producer: Producer) -> None:
        wait_until(lambda: bool(decode_all(client)), "the whole BCAST", timeout=1.0)

    async def scenario() -> None:
        async with one_group(0) as (transport, _, client):
            producer = Producer()
            producer.progress = FinishesBehindTheWritersBack(PAYLOAD)
            producer.buffer[:] = producer.final  # every byte is written by the finish
            producer.progress.advance(1000)  # one sendmsg takes it all
            message = BcastFragment(0, 7, producer.buffer.data)
            with anyio.fail_after(WAIT_S):
                await transport.send(KEY, message, producer.progress)
                await anyio.to_thread.run_sync(produce, client, producer)
            (bcast,) = decode_all(client)
            assert isinstance(bcast, BcastFragment)
            assert bytes(bcast.data) == producer.final.tobytes()

    run(scenario)


# -- the driver's stream_broadcasts mode ---------------------------------------------------------
class Recorder:
    """A transport that records sends: what, on which thread, and whether handle() was running."""

    streams_partial_payloads = True

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []
        self.sends: list[tuple[AnyMessage, PayloadProgress | None, bool, bool]] = []
        self.handling = False

    def admit(self, conn: ConnId, group: GroupKey, num_streams: int, limits: Limits) -> None:
        self.calls.append(("admit", conn))

    def refuse(self, conn: ConnId, error: ErrorMessage) -> None:
        self.calls.append(("refuse", conn))

    async def send(
        self, group: GroupKey, message: AnyMessage, progress: PayloadProgress | None = None
    ) -> None:
        on_loop = threading.current_thread() is threading.main_thread()
        self.sends.append((message, progress, self.handling, on_loop))
        self.calls.append(("send", message))

    def close_group(self, group: GroupKey, error: ErrorMessage | None) -> None:
        self.calls.append(("close", group))

    async def shutdown(self, grace: float) -> None:
        self.calls.append(("shutdown", grace))


class Committer:
    """A coordinator whose "commit" (a timer) starts its BCAST before its merge has finished."""

    def __init__(self, transport: Recorder) -> None:
        self.early_sends: Callable[[Sequence[Send]], None] | None = None
        self.transport = transport
        self.handle_threads: list[threading.Thread] = []
        self.sent_before_return: list[AnyMessage] = []
        self.progress = PayloadProgress(64)

    def handle(self, event: Event, now: float) -> list[Action]:
        self.handle_threads.append(threading.current_thread())
        self.transport.handling = True
        try:
            if event != TimerFired("commit"):
                return [Log("info", "idle", {})]
            assert self.early_sends is not None
            bcast = BcastFragment(0, 1, memoryview(bytes(64)))
            self.early_sends([Send(KEY, bcast, self.progress)])
            # Back from early_sends: the BCAST is already with the transport.
            self.sent_before_return = [message for message, *_ in self.transport.sends]
            assert self.sent_before_return == [bcast]
            self.progress.advance(32)  # the merge goes on after its BCAST started
            self.progress.finish()
            return [Send(KEY, PullReq(0, 2, 1)), Log("info", "committed", {})]
        finally:
            self.transport.handling = False


def test_driver_queues_early_sends_while_handle_still_runs() -> None:
    async def scenario() -> None:
        transport = Recorder()
        coordinator = Committer(transport)
        driver = Driver(
            coordinator,
            transport,
            FakeClock(),
            log=KeyValueLog(min_level="error"),
            stream_broadcasts=True,
        )
        assert coordinator.early_sends is not None  # the driver installed its sender
        with anyio.fail_after(WAIT_S):
            await driver.dispatch(TimerFired("commit"))
        (thread,) = coordinator.handle_threads
        assert thread is not threading.main_thread()  # handle ran off the event loop
        assert coordinator.sent_before_return == [BcastFragment(0, 1, memoryview(bytes(64)))]
        (early, progress, during, on_loop), (late, late_progress, after, late_on_loop) = (
            transport.sends
        )
        assert early == BcastFragment(0, 1, memoryview(bytes(64)))
        assert progress is coordinator.progress
        assert during and on_loop  # queued on the loop while handle() was running
        assert late == PullReq(0, 2, 1) and late_progress is None
        assert not after and late_on_loop  # the returned actions run after handle() returned
        assert progress.complete

    run(scenario)


def test_driver_event_loop_runs_while_a_streaming_handle_blocks() -> None:
    released = threading.Event()

    class Blocking(Committer):
        def handle(self, event: Event, now: float) -> list[Action]:
            assert released.wait(WAIT_S), "the event loop was blocked by handle()"
            return [Send(KEY, PullReq(0, 3, 1))]

    async def scenario() -> None:
        transport = Recorder()
        driver = Driver(Blocking(transport), transport, FakeClock(), stream_broadcasts=True)

        async def release_from_the_loop() -> None:
            await anyio.sleep(0.02)
            released.set()

        with anyio.fail_after(WAIT_S):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(release_from_the_loop)
                await driver.dispatch(TimerFired("x"))
        assert transport.calls == [("send", PullReq(0, 3, 1))]

    run(scenario)


@pytest.mark.parametrize(
    ("event", "off_loop"),
    [
        (TimerFired("commit"), True),
        (MessageReceived(KEY, PushFragment(0, 0, 1, 1, 0, 5, 5, 5, memoryview(bytes(4)))), True),
        (MessageReceived(KEY, Heartbeat(0, 9)), False),
        (GroupReady(KEY), False),
        (GroupClosed(KEY, "gone"), False),
    ],
)
def test_driver_streams_only_events_that_may_commit(event: Event, off_loop: bool) -> None:
    """Rounds commit only on a PUSH or a timer: anything else stays on the loop (a thread hop
    cost ~100 us per HEARTBEAT of a flooding learner), with no early sender installed."""

    async def scenario() -> None:
        transport = Recorder()
        coordinator = Committer(transport)
        seen: list[object] = []

        def handle(event: Event, now: float) -> list[Action]:
            seen.append(coordinator.early_sends)
            return Committer.handle(coordinator, event, now)

        coordinator.handle = handle  # type: ignore[method-assign]
        driver = Driver(coordinator, transport, FakeClock(), stream_broadcasts=True)
        with anyio.fail_after(WAIT_S):
            await driver.dispatch(event)
        (thread,) = coordinator.handle_threads
        assert (thread is not threading.main_thread()) is off_loop
        assert (seen[0] is not None) is off_loop

    run(scenario)


def test_driver_without_streaming_leaves_early_sends_alone() -> None:
    transport = Recorder()
    coordinator = Committer(transport)
    Driver(coordinator, transport, FakeClock())
    assert coordinator.early_sends is None


def test_streaming_needs_a_coordinator_with_early_sends() -> None:
    class Plain:
        def handle(self, event: Event, now: float) -> list[Action]:
            return []

    with pytest.raises(TypeError):
        Driver(Plain(), Recorder(), FakeClock(), stream_broadcasts=True)


def test_driver_streams_a_bcast_over_tcp_while_handle_merges() -> None:
    """End to end: handle() starts the BCAST, the client sees its head while the merge runs."""
    num_streams = 2
    seen_during_merge: list[int] = []

    class Merging:
        def __init__(self, client: list[RawClient]) -> None:
            self.early_sends: Callable[[Sequence[Send]], None] | None = None
            self.client = client
            self.group = GroupKey(0, 0)

        def handle(self, event: Event, now: float) -> list[Action]:
            match event:
                case HelloReceived(conn=conn, hello=h):
                    key = GroupKey(h.learner_id, h.generation)
                    return [AdmitGroup(conn, key, h.num_streams, LIMITS)]
                case GroupReady(group=group):
                    self.group = group
                    return [SetTimer("commit", now)]  # only an event that may commit streams
                case TimerFired(key="commit"):
                    assert self.early_sends is not None
                    producer = Producer()
                    self.early_sends([Send(self.group, producer.message, producer.progress)])
                    wait_until(lambda: bool(self.client), "the client")
                    (client,) = self.client
                    check_on_wire(client, num_streams, producer, 0)
                    seen_during_merge.append(message_bytes(client, num_streams)[0])
                    producer.advance(3 * MIB)
                    check_on_wire(client, num_streams, producer, 3 * MIB)
                    seen_during_merge.append(message_bytes(client, num_streams)[0])
                    producer.advance(PAYLOAD)
                    return [Exit(0, "broadcast")]
            return []

    async def scenario() -> None:
        clients: list[RawClient] = []
        clock = MonotonicClock()
        async with TcpTransport.serve(
            ConnectionGroups(2), clock, "127.0.0.1", 0, linger=0.5
        ) as transport:
            driver = Driver(
                Merging(clients),
                transport,
                clock,
                log=KeyValueLog(min_level="error"),
                stream_broadcasts=True,
            )

            async def learner() -> None:
                client = await anyio.to_thread.run_sync(
                    RawClient, transport.address, 0, num_streams
                )
                clients.append(client)

            try:
                with anyio.fail_after(WAIT_S * 2):
                    async with anyio.create_task_group() as tasks:
                        tasks.start_soon(learner)
                        outcome = await driver.run(transport)
                    (client,) = clients
                    await anyio.to_thread.run_sync(
                        wait_until, lambda: all(client.eof()), "the syncer to hang up"
                    )
            finally:
                for client in clients:
                    client.close()
        assert outcome == Exit(0, "broadcast")
        assert seen_during_merge == [BCAST_HEAD, BCAST_HEAD + 3 * MIB]
        (bcast,) = decode_all(client)
        assert isinstance(bcast, BcastFragment)
        assert bytes(bcast.data) == final_payload().tobytes()

    run(scenario)


def test_driver_refuses_to_stream_over_a_transport_that_delivers_whole_payloads() -> None:
    class WholePayloads(Recorder):
        streams_partial_payloads = False

    class Streaming:
        early_sends = None

        def handle(self, event: Event, now: float) -> list[Action]:
            return []

    with pytest.raises(TypeError, match="partial payloads"):
        Driver(Streaming(), WholePayloads(), FakeClock(), stream_broadcasts=True)


def test_driver_handles_on_the_loop_while_the_transport_sees_only_fast_links() -> None:
    class FastLinks(Recorder):
        def prefers_streaming(self) -> bool:
            return False

    class Plain(Committer):
        def handle(self, event: Event, now: float) -> list[Action]:
            self.handle_threads.append(threading.current_thread())
            assert self.early_sends is None  # nothing to stream behind: commit as usual
            return [Send(KEY, PullReq(0, 2, 1))]

    async def scenario() -> None:
        transport = FastLinks()
        coordinator = Plain(transport)
        driver = Driver(coordinator, transport, FakeClock(), stream_broadcasts=True)
        with anyio.fail_after(WAIT_S):
            await driver.dispatch(TimerFired("commit"))
        assert coordinator.handle_threads == [threading.main_thread()]
        assert [message for message, *_ in transport.sends] == [PullReq(0, 2, 1)]

    run(scenario)


def test_link_pace_streams_until_recent_bulk_frames_are_fast() -> None:
    pace = LinkPace(threshold=1e9)
    assert pace.slow  # nothing measured yet: assume a slow link
    pace.record(100, 1.0)  # small frames say nothing
    assert pace.slow
    for _ in range(RECENT_FRAMES):
        pace.record(4 << 20, (4 << 20) / 3e9)  # 3 GB/s: loopback
    assert not pace.slow
    for _ in range(RECENT_FRAMES // 2 - 1):
        pace.record(4 << 20, (4 << 20) / 0.1e9)  # a few slow frames: the median holds
    assert not pace.slow
    for _ in range(2):
        pace.record(4 << 20, (4 << 20) / 0.1e9)  # most recent frames slow: stream again
    assert pace.slow
    pace.record(4 << 20, 0.0)  # a zero duration is a very fast frame, not a crash
