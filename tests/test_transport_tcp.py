"""The TCP transport in-process: real loopback sockets, a stand-in coordinator, and the scripted
learner's plain-socket group in a worker thread."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import select
import selectors
import socket
import struct
import time
import weakref
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

import anyio
import anyio.to_thread
import numpy as np
import pytest
from scripted_learner import GroupClosed as LearnerGroupClosed
from scripted_learner import LearnerGroup, SessionSpec

from yeto_proto import (
    FRAME_MAGIC,
    BcastFragment,
    DataHello,
    ErrorMessage,
    FinalFragment,
    FrameDecoder,
    FrameType,
    Heartbeat,
    Hello,
    Limits,
    MergeMode,
    PullReq,
    PushFragment,
    Role,
    Shutdown,
    WireDtype,
    WireFragment,
    WireLayout,
    encode_bytes,
)
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
    MessageReceived,
    Send,
)
from yeto_sync.payload_progress import PayloadProgress
from yeto_sync.transport import MonotonicClock
from yeto_sync.transport.group import ConnectionGroups, LogFn, WireCommand
from yeto_sync.transport.log_throttle import LogThrottle
from yeto_sync.transport.tcp import (
    HARD_STOP_S,
    MAX_EVENT_BACKLOG,
    WRITE_TURN_BYTES,
    Outgoing,
    SendQueue,
    SendStalled,
    TcpTransport,
    _Outbox,
    _Peer,
)

BIG = 1_500_000  # 6 MB of f32: two CHUNKs per BCAST
LAYOUT = WireLayout((WireFragment(MergeMode.AVG, (BIG,)), WireFragment(MergeMode.AVG, (64,))))
SPEC = SessionSpec(WireDtype.F32, LAYOUT, bytes(range(32)), bytes(range(32, 64)))
KEY = GroupKey(0, 1)
T = TypeVar("T")


def run(test: Callable[[], Awaitable[None]]) -> None:
    anyio.run(test)


def run_and_return(coro: Awaitable[T]) -> T:
    box: list[T] = []

    async def main() -> None:
        box.append(await coro)

    anyio.run(main)
    return box[0]


def bcast(version: int) -> BcastFragment:
    return BcastFragment(0, version, (np.arange(BIG, dtype="<f4") * version).view(np.uint8).data)


class Stand_in:  # noqa: N801 - reads as what it is
    """Admits every HELLO; ``on_ready`` and ``on_message`` script the rest."""

    def __init__(
        self,
        on_ready: Callable[[GroupKey], Sequence[Action]] = lambda key: [],
        on_message: Callable[[MessageReceived], Sequence[Action]] = lambda event: [],
    ) -> None:
        self.on_ready = on_ready
        self.on_message = on_message
        self.events: list[Event] = []

    def handle(self, event: Event, now: float) -> list[Action]:
        self.events.append(event)
        match event:
            case HelloReceived(conn=conn, hello=hello):
                key = GroupKey(hello.learner_id, hello.generation)
                limits = Limits.of(hello.dtype, hello.layout)
                return [AdmitGroup(conn, key, hello.num_streams, limits)]
            case GroupReady(group=group):
                return list(self.on_ready(group))
            case MessageReceived():
                return list(self.on_message(event))
        return []


async def serve(
    coordinator: Stand_in,
    learner: Callable[[tuple[str, int]], object],
    *,
    groups: ConnectionGroups | None = None,
    send_queue_bytes: int = 64 << 20,
    stall_timeout: float = 60.0,
    log: LogFn | None = None,
) -> tuple[Exit, object]:
    """Run the driver on a fresh TCP transport while ``learner(address)`` runs in a thread."""
    groups = groups or ConnectionGroups(2)
    clock = MonotonicClock()
    outcome: dict[str, object] = {}
    async with TcpTransport.serve(
        groups,
        clock,
        "127.0.0.1",
        0,
        send_queue_bytes=send_queue_bytes,
        stall_timeout=stall_timeout,
        log=log,
    ) as transport:
        driver = Driver(coordinator, transport, clock, log=KeyValueLog(min_level="error"))

        async def client() -> None:
            outcome["learner"] = await anyio.to_thread.run_sync(learner, transport.address)

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(client)
                outcome["exit"] = await driver.run(transport)
    exit_action = outcome["exit"]
    assert isinstance(exit_action, Exit)
    return exit_action, outcome.get("learner")


def drain_until_closed(group: LearnerGroup) -> list[object]:
    received: list[object] = []
    try:
        while True:
            received.append(group.receive(10.0))
    except LearnerGroupClosed:
        return received


def test_striped_frames_cross_real_sockets_both_ways() -> None:
    pushes: list[PushFragment] = []

    def on_message(event: MessageReceived) -> list[Action]:
        assert isinstance(event.message, PushFragment)
        pushes.append(event.message)
        return [Exit(0, "got the push")]

    def learner(address: tuple[str, int]) -> list[object]:
        group = LearnerGroup(address, SPEC, learner_id=0, generation=1, num_streams=3)
        group.connect()
        try:
            first, second = group.receive(), group.receive()
            delta = np.linspace(-1, 1, BIG, dtype="<f4")
            group.send(PushFragment(0, 0, 1, 1, 0, 4, 4, 400, delta.view(np.uint8).data))
            return [first, second, *drain_until_closed(group)]
        finally:
            group.close()

    coordinator = Stand_in(
        on_ready=lambda key: [
            Send(key, bcast(1)),
            Send(key, PullReq(0, 1, 1)),
            Send(key, bcast(2)),
        ],
        on_message=on_message,
    )
    exit_action, received = run_and_return(serve(coordinator, learner))
    assert exit_action == Exit(0, "got the push")
    assert isinstance(received, list)
    bcasts = [m for m in received if isinstance(m, BcastFragment)]
    # Stripes may overtake the control stream: compare as a set of (version, bytes).
    assert sorted((b.version, bytes(b.data)) for b in bcasts) == [
        (1, bytes(bcast(1).data)),
        (2, bytes(bcast(2).data)),
    ]
    assert PullReq(0, 1, 1) in received
    (push,) = pushes
    np.testing.assert_array_equal(
        np.frombuffer(push.data, "<f4"), np.linspace(-1, 1, BIG, dtype="<f4")
    )


class _InstantSocket:
    """A socket whose peer keeps up: every ``sendmsg`` takes up to ``take`` bytes at once."""

    def __init__(self, name: str, calls: list[str], take: int) -> None:
        self.name, self.calls, self.take = name, calls, take

    def sendmsg(self, buffers: Sequence[memoryview]) -> int:
        self.calls.append(self.name)
        return min(self.take, sum(len(buffer) for buffer in buffers))


@pytest.mark.parametrize("frames, take", [(1, WRITE_TURN_BYTES), (4, 4 * WRITE_TURN_BYTES)])
def test_writers_take_turns_when_their_sockets_take_everything(frames: int, take: int) -> None:
    """Large writes to two sockets interleave, so neither learner waits for the other's BCAST."""
    calls: list[str] = []
    size = 4 * WRITE_TURN_BYTES

    async def scenario() -> None:
        async with TcpTransport.serve(ConnectionGroups(2), MonotonicClock(), "127.0.0.1", 0) as tcp:

            async def write(name: str) -> None:
                sock = _InstantSocket(name, calls, take)
                for _ in range(frames):
                    frame = Outgoing([memoryview(bytes(size))])
                    await tcp._write_frame(sock, frame)  # type: ignore[arg-type]

            async with anyio.create_task_group() as tasks:
                tasks.start_soon(write, "a")
                tasks.start_soon(write, "b")

    run(scenario)
    writes = 4 * frames // (take // WRITE_TURN_BYTES)
    assert sorted(calls) == ["a"] * writes + ["b"] * writes
    assert calls == ["a", "b"] * writes


def _push_bytes(scale: float) -> bytes:
    delta = np.full(BIG, scale, dtype="<f4")
    return encode_bytes(PushFragment(0, 0, 1, 1, 0, 4, 4, 400, delta.view(np.uint8).data))


def test_a_push_that_trickles_in_is_read_whole() -> None:
    # The syncer's reads of a payload wait for up to 1 MiB at a time (the socket's receive
    # low-water mark); bytes that come in small, slow pieces must still all be read.
    pushes: list[PushFragment] = []

    def on_message(event: MessageReceived) -> list[Action]:
        assert isinstance(event.message, PushFragment)
        pushes.append(event.message)
        return [Exit(0, "got the push")]

    def learner(address: tuple[str, int]) -> None:
        group = LearnerGroup(address, SPEC, learner_id=0, generation=1, num_streams=0)
        group.connect()
        try:
            group.receive()  # the PULL
            frame = memoryview(_push_bytes(0.5))
            sizes = [61, 1000, 300_000, 5, 2_000_000, 1]
            offset = 0
            for size in [*sizes, len(frame) - sum(sizes)]:
                group.sockets[0].sendall(frame[offset : offset + size])
                offset += size
                time.sleep(0.05)
            drain_until_closed(group)
        finally:
            group.close()

    coordinator = Stand_in(
        on_ready=lambda key: [Send(key, PullReq(0, 1, 1))], on_message=on_message
    )
    exit_action, _ = run_and_return(serve(coordinator, learner))
    assert exit_action == Exit(0, "got the push")
    (push,) = pushes
    assert np.all(np.frombuffer(push.data, "<f4") == 0.5)


def test_a_peer_that_closes_inside_a_payload_is_noticed_at_once() -> None:
    # The reader waits for the payload's bytes in large lumps, yet the peer's EOF still wakes it.
    closed: list[tuple[GroupClosed, float]] = []
    sent_at: list[float] = []

    class Recorder(Stand_in):
        def handle(self, event: Event, now: float) -> list[Action]:
            if isinstance(event, GroupClosed):
                closed.append((event, time.monotonic()))
                return [Exit(0, "group closed")]
            return super().handle(event, now)

    def learner(address: tuple[str, int]) -> None:
        group = LearnerGroup(address, SPEC, learner_id=0, generation=1, num_streams=0)
        group.connect()
        try:
            group.receive()  # the PULL
            group.sockets[0].sendall(_push_bytes(0.5)[:700_000])  # header + part of the payload
            time.sleep(0.3)  # the syncer now waits inside the payload
        finally:
            sent_at.append(time.monotonic())
            group.close()

    coordinator = Recorder(on_ready=lambda key: [Send(key, PullReq(0, 1, 1))])
    exit_action, _ = run_and_return(serve(coordinator, learner))
    assert exit_action == Exit(0, "group closed")
    ((event, seen_at),) = closed
    assert event.group == KEY
    assert seen_at - sent_at[0] < 2.0


def test_error_reaches_the_peer_before_the_whole_group_closes() -> None:
    closed: list[GroupClosed] = []

    class Recorder(Stand_in):
        def handle(self, event: Event, now: float) -> list[Action]:
            if isinstance(event, GroupClosed):
                closed.append(event)
                return [Exit(0, "group closed")]
            return super().handle(event, now)

    def learner(address: tuple[str, int]) -> list[object]:
        group = LearnerGroup(address, SPEC, learner_id=0, generation=1, num_streams=2)
        group.connect()
        try:
            time.sleep(0.2)  # let the group become ready
            bad = struct.pack("<IBQ", 0xBADC0FFE, FrameType.HEARTBEAT, 12) + bytes(12)
            group.sockets[2].sendall(bad + b"junk that keeps coming" * 1000)
            return drain_until_closed(group)
        finally:
            group.close()

    exit_action, received = run_and_return(serve(Recorder(), learner))
    assert exit_action == Exit(0, "group closed")
    assert isinstance(received, list) and len(received) == 1
    (error,) = received
    assert isinstance(error, ErrorMessage) and error.text.startswith("BAD_MAGIC: ")
    assert closed[0].group == KEY and closed[0].reason == error.text


def _read_until_eof(sock: socket.socket) -> bytes:
    data = bytearray()
    while chunk := sock.recv(65536):
        data += chunk
    return bytes(data)


def test_a_peer_that_never_finishes_its_hello_is_dropped() -> None:
    def slow_peer(address: tuple[str, int]) -> tuple[float, bytes]:
        started = time.monotonic()
        with socket.create_connection(address, timeout=10) as sock:
            sock.sendall(struct.pack("<IBQ", FRAME_MAGIC, FrameType.HELLO, 100) + b"\0" * 10)
            data = _read_until_eof(sock)
            return time.monotonic() - started, data

    async def scenario() -> tuple[float, bytes]:
        groups = ConnectionGroups(2, handshake_timeout=0.3)
        async with TcpTransport.serve(groups, MonotonicClock(), "127.0.0.1", 0) as transport:
            async with anyio.create_task_group() as tasks:

                async def pump_events() -> None:  # no coordinator: only deadlines matter here
                    while True:
                        await transport.next_event(None)

                tasks.start_soon(pump_events)
                with anyio.fail_after(10):
                    outcome = await anyio.to_thread.run_sync(slow_peer, transport.address)
                tasks.cancel_scope.cancel()
        return outcome

    elapsed, data = run_and_return(scenario())
    assert 0.25 <= elapsed < 5.0
    decoder = FrameDecoder(Role.LEARNER, limits=Limits.of(WireDtype.F32, LAYOUT))
    decoder.feed(data)
    (error,) = decoder.frames()
    assert isinstance(error, ErrorMessage)
    assert error.text.startswith("HANDSHAKE_TIMEOUT: ")


def test_a_peer_that_stops_reading_is_dropped_and_others_carry_on() -> None:
    """The stuck learner's full queues hold up nobody else; it is dropped when they stall."""
    stall = 1.5
    answered: list[float] = []

    def on_ready(key: GroupKey) -> list[Action]:
        if key.learner_id == 0:  # the stuck one: more than its queue and socket buffers hold
            return [Send(key, bcast(v)) for v in range(1, 40)]
        return [Send(key, PullReq(1, 1, 1))]

    def on_message(event: MessageReceived) -> list[Action]:
        answered.append(time.monotonic())
        return []

    class Coordinator(Stand_in):
        def handle(self, event: Event, now: float) -> list[Action]:
            actions = super().handle(event, now)
            if isinstance(event, GroupClosed) and event.group == KEY and answered:
                return [*actions, Exit(0, "answered, and the stuck learner dropped")]
            return actions

    def learners(address: tuple[str, int]) -> float:
        stuck = LearnerGroup(address, SPEC, learner_id=0, generation=1, num_streams=1)
        stuck.connect()  # and never reads
        healthy = LearnerGroup(address, SPEC, learner_id=1, generation=1, num_streams=0)
        try:
            time.sleep(0.1)
            started = time.monotonic()
            healthy.connect()
            pull = healthy.receive(20.0)
            assert pull == PullReq(1, 1, 1)
            healthy.send(PushFragment(1, 1, 1, 1, 0, 4, 4, 400, memoryview(bytes(256))))
            deadline = time.monotonic() + 5.0
            while not answered and time.monotonic() < deadline:
                time.sleep(0.01)
            return answered[0] - started
        finally:
            healthy.close()
            time.sleep(stall + 1.0)  # the stuck group stays open until the syncer drops it
            stuck.close()

    coordinator = Coordinator(on_ready=on_ready, on_message=on_message)
    exit_action, answer_s = run_and_return(
        serve(coordinator, learners, send_queue_bytes=1 << 20, stall_timeout=stall)
    )
    assert isinstance(answer_s, float) and answer_s < stall  # nobody waited for the stuck one
    assert exit_action == Exit(0, "answered, and the stuck learner dropped")
    closed = [e for e in coordinator.events if isinstance(e, GroupClosed)]
    assert KEY in [e.group for e in closed]
    stuck_closed = next(e for e in closed if e.group == KEY)
    # The reason says which socket stopped reading, and for how long it was given.
    assert re.fullmatch(
        r"send stalled: (its send queue stayed full|it accepted no bytes) for 1\.5 s on "
        r"(stream 0|data stream 0) \(conn \d+\)",
        stuck_closed.reason,
    ), stuck_closed.reason


@pytest.mark.parametrize("reader_stops_after", [None, 256 << 10])
def test_a_full_queue_waits_while_its_socket_takes_bytes(reader_stops_after: int | None) -> None:
    """A frame queued behind one that takes longer than the stall timeout to leave (a large
    BCAST over a slow link) waits for it; only a socket that takes nothing is stalled."""
    stall = 0.5  # a loaded host may not run the reader for a few tenths of a second
    frame_bytes = 2 << 20  # about 1.3 s each at the reader's pace: several stall timeouts
    frames = 3  # the third waits for room until the whole first one has left
    queued: list[bool | None] = []
    read = [0]
    waited: list[float] = []

    async def scenario() -> None:
        groups = ConnectionGroups(2)
        async with TcpTransport.serve(
            groups, MonotonicClock(), "127.0.0.1", 0, stall_timeout=stall
        ) as tcp:
            ours, theirs = socket.socketpair()
            ours.setblocking(False)
            theirs.setblocking(False)
            peer = _Peer(1, ours, "test peer", SendQueue(1 << 20))

            async def write() -> None:
                with contextlib.suppress(SendStalled):
                    while (frame := await peer.queue.get()) is not None:
                        await tcp._write_frame(ours, frame, peer)
                    ours.shutdown(socket.SHUT_WR)

            async def read_slowly() -> None:
                while reader_stops_after is None or read[0] < reader_stops_after:
                    await anyio.wait_readable(theirs)
                    data = theirs.recv(16 << 10)
                    if not data:
                        return
                    read[0] += len(data)
                    await anyio.sleep(0.01)

            async with anyio.create_task_group() as tasks:
                tasks.start_soon(write)
                tasks.start_soon(read_slowly)
                started = time.monotonic()
                for _ in range(frames):
                    frame = Outgoing([memoryview(bytes(frame_bytes))])
                    queued.append(await tcp._put_while_draining(peer, frame, frame_bytes))
                    if queued[-1] is None:
                        break
                waited.append(time.monotonic() - started)
                if reader_stops_after is None:
                    peer.queue.close(discard=False)
                else:
                    tasks.cancel_scope.cancel()
            ours.close()
            theirs.close()

    run(scenario)
    if reader_stops_after is None:
        assert queued == [True] * frames
        assert read == [frames * frame_bytes]
        assert waited[0] > 2 * stall  # so the last frame did wait longer than the stall timeout
    else:
        assert queued == [True, True, None]
        assert waited[0] < 10 * stall


def test_a_pull_passes_a_bcast_larger_than_the_send_queues() -> None:
    """A BCAST whose CHUNKs for one socket exceed the queue bound held the PULL behind it
    until that socket had drained, though the PULL goes on socket 0 (with a fragment over
    64 MiB per data stream, minutes on a slow link)."""
    numel = 5_000_000  # 20 MB of f32: five CHUNKs on the one data socket, the bound is 1 MiB
    layout = WireLayout((WireFragment(MergeMode.AVG, (numel,)),))
    spec = SessionSpec(WireDtype.F32, layout, bytes(range(32)), bytes(range(32, 64)))
    payload = np.ones(numel, dtype="<f4").view(np.uint8).data

    def on_ready(key: GroupKey) -> list[Action]:
        return [Send(key, BcastFragment(0, 1, payload)), Send(key, PullReq(0, 2, 1))]

    def learner(address: tuple[str, int]) -> list[str]:
        group = LearnerGroup(address, spec, learner_id=0, generation=1, num_streams=1)
        group.connect()
        try:
            data_socket = group.sockets[1]
            group._selector.unregister(data_socket)  # not read until the PULL came
            got = [type(group.receive(5.0)).__name__]
            group._selector.register(data_socket, selectors.EVENT_READ)
            got.append(type(group.receive(10.0)).__name__)
            group.send(Heartbeat(0, 1))
            drain_until_closed(group)
            return got
        finally:
            group.close()

    coordinator = Stand_in(on_ready=on_ready, on_message=lambda event: [Exit(0, "done")])
    exit_action, got = run_and_return(serve(coordinator, learner, send_queue_bytes=1 << 20))
    assert exit_action == Exit(0, "done")
    assert got == ["PullReq", "BcastFragment"]


@pytest.mark.parametrize("num_streams", [0, 2])
def test_a_learner_behind_a_busy_link_gets_the_newest_bcast_not_every_version(
    num_streams: int,
) -> None:
    """BCASTs committed while an earlier one is still being written wait, replaceable, until
    the sockets are free: only the newest goes out after it (a slow link spent ~90 s on each
    out-of-date 32 MiB version that had been queued early)."""
    later = range(2, 6)

    def on_message(event: MessageReceived) -> list[Action]:
        if isinstance(event.message, Heartbeat):  # version 1 is on its way: commit 2..5
            return [Send(event.group, bcast(v)) for v in later]
        return [Exit(0, "the learner answered")]

    def learner(address: tuple[str, int]) -> list[int]:
        group = LearnerGroup(address, SPEC, learner_id=0, generation=1, num_streams=num_streams)
        group.connect()
        try:
            select.select(group.sockets, [], [], 10.0)  # version 1's first bytes are here
            group.send(Heartbeat(0, 1))
            time.sleep(0.5)  # reads nothing meanwhile: version 1 stays in flight
            versions: list[int] = []
            while not versions or versions[-1] != later[-1]:
                message = group.receive(10.0)
                if isinstance(message, BcastFragment):
                    versions.append(message.version)
            group.send(PushFragment(0, 1, 1, 1, 0, 4, 4, 400, memoryview(bytes(256))))
            drain_until_closed(group)
            return versions
        finally:
            group.close()

    coordinator = Stand_in(on_ready=lambda key: [Send(key, bcast(1))], on_message=on_message)
    exit_action, versions = run_and_return(serve(coordinator, learner))
    assert exit_action == Exit(0, "the learner answered")
    assert versions == [1, later[-1]]


def test_the_final_cut_replaces_a_bcast_of_its_fragment_that_has_not_started() -> None:
    outbox = _Outbox()
    outbox.add(bcast(1), None)
    assert outbox.take(True) == (bcast(1), None)  # the group's first BCAST of fragment 0
    outbox.add(bcast(3), None)
    outbox.add(BcastFragment(1, 3, memoryview(bytes(256))), None)
    final = FinalFragment(0, 3, bcast(3).data)
    outbox.add(final, None)
    assert [message for message, _ in outbox.pending] == [
        BcastFragment(1, 3, memoryview(bytes(256))),
        final,
    ]


def test_a_newer_bcast_takes_the_held_ones_turn() -> None:
    # A newer version went to the back of the line: the head was always the fragment committed
    # longest ago, the next to commit again, so on a link slower than the rounds the learner
    # got versions a round out of date, and some fragments never (F = 8, a BCAST every two
    # rounds: fragments 0, 2, 4 and 6 never left again).
    def version(fragment: int, step: int) -> BcastFragment:
        return BcastFragment(fragment, step, memoryview(bytes(256)))

    outbox = _Outbox()
    for fragment in range(3):
        outbox.add(version(fragment, 1), None)
    assert outbox.take(True) == (version(0, 1), None)
    outbox.add(version(0, 4), None)  # fragment 0's next version waits behind 1 and 2
    outbox.add(version(1, 5), None)  # and 1's newer one keeps 1's turn
    outbox.add(version(2, 6), None)
    taken = [outbox.take(True) for _ in range(3)]
    assert taken == [(version(1, 5), None), (version(2, 6), None), (version(0, 4), None)]
    assert outbox.take(True) is None


def test_a_held_bcast_whose_merge_failed_is_dropped_unsent() -> None:
    # Taken later, its writer met the withdrawn payload and cut the group off as if half the
    # message were on the wire, though none of it was.
    outbox = _Outbox()
    progress = PayloadProgress(256)
    outbox.add(bcast(2), progress)
    outbox.add(PullReq(0, 3, 1), None)
    progress.withdraw()
    assert outbox.take(True) == (PullReq(0, 3, 1), None)
    assert outbox.take(True) is None
    assert outbox.bcast_sent == set()


def test_a_stopping_syncer_does_not_wait_for_held_bcasts() -> None:
    # Its grace went on cutting out-of-date versions into frames, one after the other.
    outbox = _Outbox()
    outbox.add(bcast(2), None)
    assert outbox.settled  # nothing but a held BCAST: dropped at a stop
    outbox.add(Shutdown(), None)
    assert not outbox.settled


def test_messages_behind_a_held_bcast_pass_it() -> None:
    # A BCAST held until the sockets are idle kept a PULL behind it waiting as long (~90 s on
    # a slow link, the learner's uplink idle meanwhile); a PULL may overtake a BCAST.
    outbox = _Outbox()
    outbox.add(bcast(2), None)
    outbox.add(PullReq(0, 3, 1), None)
    assert outbox.take(False) == (PullReq(0, 3, 1), None)
    assert outbox.take(False) is None
    assert outbox.take(True) == (bcast(2), None)


def test_the_final_cut_never_replaces_the_groups_first_bcast_of_a_fragment() -> None:
    # A learner starts only once it holds a BCAST of every fragment (spec/learner.md § 3): a
    # slow learner still downloading fragment 0 when the cut came never got fragment 1's.
    outbox = _Outbox()
    first = BcastFragment(1, 0, memoryview(bytes(256)))
    outbox.add(first, None)
    final = FinalFragment(1, 3, memoryview(bytes(256)))
    outbox.add(final, None)
    assert [message for message, _ in outbox.pending] == [first, final]


def test_a_flood_of_small_frames_never_queues_more_events_than_the_backlog_cap() -> None:
    # One 4 MiB read of HEARTBEATs used to queue ~160,000 events at once: the cap was checked
    # after the read, and every frame in it was decoded.
    flood = 160_000
    groups = ConnectionGroups(2)
    backlogs: list[int] = []
    beats: list[int] = []

    class Recorder(Stand_in):
        def handle(self, event: Event, now: float) -> list[Action]:
            backlogs.append(groups.backlog)
            if isinstance(event, MessageReceived) and isinstance(event.message, Heartbeat):
                beats.append(event.message.local_step)
            if isinstance(event, GroupClosed):
                return [Exit(0, "flood over")]
            return super().handle(event, now)

    def learner(address: tuple[str, int]) -> None:
        group = LearnerGroup(address, SPEC, learner_id=0, generation=1, num_streams=0)
        group.connect()
        try:
            blob = b"".join(encode_bytes(Heartbeat(0, step)) for step in range(1, flood + 1))
            group.sockets[0].sendall(blob)  # in one go: the syncer's reads may be 4 MiB
        finally:
            group.close()

    exit_action, _ = run_and_return(serve(Recorder(), learner, groups=groups))
    assert exit_action == Exit(0, "flood over")
    assert beats == list(range(1, flood + 1))
    assert max(backlogs) <= MAX_EVENT_BACKLOG + 1


def test_small_frames_are_still_read_many_at_a_time() -> None:
    # The first bound on the backlog cut every read below 64 KiB to 13 bytes per free event
    # slot, even with an empty backlog: small frames took many reads where one did.
    frames = 3000
    reads: list[int] = []

    class CountingGroups(ConnectionGroups):
        def receive(
            self, conn: ConnId, data: bytes | bytearray | memoryview, now: float
        ) -> list[WireCommand]:
            reads.append(len(data))
            return super().receive(conn, data, now)

    class Counter(Stand_in):
        def __init__(self) -> None:
            super().__init__()
            self.beats = 0

        def handle(self, event: Event, now: float) -> list[Action]:
            if isinstance(event, MessageReceived) and isinstance(event.message, Heartbeat):
                self.beats += 1
                if self.beats == frames:
                    return [Exit(0, "all in")]
            return super().handle(event, now)

    def learner(address: tuple[str, int]) -> None:
        group = LearnerGroup(address, SPEC, learner_id=0, generation=1, num_streams=0)
        group.connect()
        try:
            time.sleep(0.2)  # admitted by now
            blob = b"".join(encode_bytes(Heartbeat(0, step)) for step in range(1, frames + 1))
            group.sockets[0].sendall(blob)  # 75,000 bytes, under 1,024 events a read
            time.sleep(1.0)
        finally:
            group.close()

    exit_action, _ = run_and_return(serve(Counter(), learner, groups=CountingGroups(2)))
    assert exit_action == Exit(0, "all in")
    # A 13-bytes-a-slot cut would read at most 13,312 bytes at a time.
    assert max(reads) > 20_000, reads[:20]


def test_every_closed_socket_of_a_group_is_logged_with_its_learner() -> None:
    # Lines anyone can cause are one per period; a group's sockets are not anyone's. Their
    # close used to look unknown (the group table had forgotten them) and was throttled away.
    lines: list[tuple[str, dict[str, object]]] = []

    def log(level: str, text: str, fields: Mapping[str, object]) -> None:
        lines.append((text, dict(fields)))

    class TwoLeave(Stand_in):
        def handle(self, event: Event, now: float) -> list[Action]:
            out = super().handle(event, now)
            closed = [e for e in self.events if isinstance(e, GroupClosed)]
            return [Exit(0, "both gone")] if len(closed) == 2 else out

    def learners(address: tuple[str, int]) -> None:
        groups = [LearnerGroup(address, SPEC, learner_id=i, generation=1, num_streams=1)
                  for i in (0, 1)]  # fmt: skip
        for group in groups:
            group.connect()
        time.sleep(0.5)
        for group in groups:
            group.close()

    exit_action, _ = run_and_return(
        serve(TwoLeave(), learners, groups=ConnectionGroups(2, log=log), log=log)
    )
    assert exit_action == Exit(0, "both gone")
    closed = [f for text, f in lines if text == "connection closed"]
    assert sorted((f["learner_id"], f["socket"]) for f in closed) == [
        (0, "data stream 0"), (0, "stream 0"), (1, "data stream 0"), (1, "stream 0")
    ]  # fmt: skip


def hello_bytes(learner_id: int) -> bytes:
    return encode_bytes(
        Hello(learner_id, 1, SPEC.dtype, SPEC.layout, SPEC.fingerprint, SPEC.contract, 0)
    )


async def admit_all(transport: TcpTransport, count: int) -> None:
    """Admit HELLOs until ``count`` groups are ready (the driver's part, by hand)."""
    ready = 0
    while ready < count:
        event = await transport.next_event(transport.clock.now() + 5)
        if isinstance(event, HelloReceived):
            hello = event.hello
            key = GroupKey(hello.learner_id, hello.generation)
            transport.admit(event.conn, key, 0, Limits.of(hello.dtype, hello.layout))
        elif isinstance(event, GroupReady):
            ready += 1


async def events_until_quiet(transport: TcpTransport, quiet: float = 1.5) -> list[Event]:
    events = []
    while (event := await transport.next_event(transport.clock.now() + quiet)) is not None:
        events.append(event)
    return events


FLOOD = b"".join(encode_bytes(Heartbeat(0, step)) for step in range(1, 3001))


def test_frames_behind_a_hello_are_handed_on_when_the_backlog_frees_up() -> None:
    # A full backlog at admission left them in the decoder, and only new bytes from the peer
    # woke its reader: a learner's first INIT could wait for good.
    async def scenario() -> list[Event]:
        clock = MonotonicClock()
        async with TcpTransport.serve(ConnectionGroups(2), clock, "127.0.0.1", 0) as transport:
            flooder = socket.create_connection(transport.address)
            flooder.sendall(hello_bytes(0))
            await admit_all(transport, 1)
            late = socket.create_connection(transport.address)
            late.sendall(hello_bytes(1) + encode_bytes(Heartbeat(1, 7)))  # right behind it
            await anyio.sleep(0.3)
            flooder.sendall(FLOOD)
            await anyio.sleep(0.5)
            assert transport.groups.backlog == MAX_EVENT_BACKLOG
            await admit_all(transport, 1)
            events = await events_until_quiet(transport)
            flooder.close()
            late.close()
            return events

    beats = [e.message for e in run_and_return(scenario()) if isinstance(e, MessageReceived)]
    assert Heartbeat(1, 7) in beats


def test_an_eof_behind_a_full_backlog_still_closes_the_group() -> None:
    # The reader returned at EOF while the backlog was full: the close was never handed on, and
    # the group stayed open (its socket too) with nobody looking.
    async def scenario() -> list[Event]:
        clock = MonotonicClock()
        async with TcpTransport.serve(ConnectionGroups(2), clock, "127.0.0.1", 0) as transport:
            flooder = socket.create_connection(transport.address)
            leaver = socket.create_connection(transport.address)
            flooder.sendall(hello_bytes(0))
            leaver.sendall(hello_bytes(1))
            await admit_all(transport, 2)
            await anyio.sleep(0.2)
            flooder.sendall(FLOOD)  # both readers wake in one turn of the loop
            leaver.close()
            time.sleep(0.3)
            events = await events_until_quiet(transport)
            flooder.close()
            return events

    closed = [e.group for e in run_and_return(scenario()) if isinstance(e, GroupClosed)]
    assert GroupKey(1, 1) in closed


@pytest.mark.parametrize("code, warned", [(errno.ETIMEDOUT, True), (errno.ECONNRESET, False)])
def test_a_connection_the_kernel_ended_as_silent_is_a_warning(code: int, warned: bool) -> None:
    # The silence bound (spec/syncer.md § 5) ends a connection with ETIMEDOUT on its next read
    # or write; "group closed" at info level was the only trace of a learner gone silent.
    lines: list[tuple[str, str, dict[str, object]]] = []

    def log(level: str, text: str, fields: Mapping[str, object]) -> None:
        lines.append((level, text, dict(fields)))

    async def scenario() -> list[Event]:
        clock = MonotonicClock()
        async with TcpTransport.serve(
            ConnectionGroups(2), clock, "127.0.0.1", 0, stall_timeout=3.0, log=log
        ) as transport:
            learner = socket.create_connection(transport.address)
            learner.sendall(hello_bytes(0))
            event = await transport.next_event(clock.now() + 5)
            assert isinstance(event, HelloReceived)
            transport.admit(event.conn, KEY, 0, Limits.of(WireDtype.F32, LAYOUT))
            transport._socket_failed(event.conn, "receive", OSError(code, os.strerror(code)))
            events = await events_until_quiet(transport, quiet=0.5)
            learner.close()
            return events

    closed = [e for e in run_and_return(scenario()) if isinstance(e, GroupClosed)]
    assert [e.group for e in closed] == [KEY]
    assert closed[0].reason == f"receive failed: [Errno {code}] {os.strerror(code)}"
    warnings = [(text, fields) for level, text, fields in lines if level == "warning"]
    if warned:
        ((text, fields),) = warnings
        assert text.startswith("a learner's connection went silent")
        assert fields["learner_id"] == 0 and fields["silence_bound_s"] == 6.0
    else:
        assert not warnings


def test_exit_flushes_queued_frames_before_closing() -> None:
    def learner(address: tuple[str, int]) -> list[object]:
        group = LearnerGroup(address, SPEC, learner_id=0, generation=1, num_streams=2)
        group.connect()
        try:
            return drain_until_closed(group)
        finally:
            group.close()

    coordinator = Stand_in(
        on_ready=lambda key: (
            [Send(key, bcast(v)) for v in (1, 2, 3)] + [Send(key, PullReq(0, 4, 1)), Exit(0, "bye")]
        )
    )
    exit_action, received = run_and_return(serve(coordinator, learner))
    assert exit_action == Exit(0, "bye")
    assert isinstance(received, list)
    # Version 1 was cut into frames at once and leaves whole, as does the PULL; 2 and 3 may
    # still be held at the stop (2 replaced by 3), and held BCASTs are dropped then.
    versions = [m.version for m in received if isinstance(m, BcastFragment)]
    assert versions in ([1], [1, 3], [1, 2], [1, 2, 3]), versions
    assert PullReq(0, 4, 1) in received


def test_shutdown_ends_within_its_grace_when_a_learner_stopped_reading() -> None:
    # Its flush waited the grace twice and then up to 1 s more: 10.5 s for a 5 s grace.
    grace = 1.0
    exit_at: list[float] = []
    # Built beforehand: making 234 MB of arrays inside the timed span took up to 0.9 s on a
    # loaded machine, and the test measures the stop.
    bcasts = [bcast(v) for v in range(1, 40)]  # more than its queue and socket buffers hold

    class Coordinator(Stand_in):
        def handle(self, event: Event, now: float) -> list[Action]:
            if isinstance(event, GroupReady):
                exit_at.append(time.monotonic())
                return [*(Send(event.group, message) for message in bcasts), Exit(0, "bye")]
            return super().handle(event, now)

    async def scenario() -> float:
        groups = ConnectionGroups(2)
        clock = MonotonicClock()
        async with TcpTransport.serve(
            groups, clock, "127.0.0.1", 0, send_queue_bytes=1 << 20
        ) as transport:
            stuck = LearnerGroup(transport.address, SPEC, learner_id=0, generation=1, num_streams=1)
            driver = Driver(
                Coordinator(),
                transport,
                clock,
                log=KeyValueLog(min_level="error"),
                shutdown_grace=grace,
            )
            try:
                await anyio.to_thread.run_sync(stuck.connect)  # and never reads
                with anyio.fail_after(30):
                    assert await driver.run(transport) == Exit(0, "bye")
                return time.monotonic() - exit_at[0]
            finally:
                stuck.close()

    stopped_in = run_and_return(scenario())
    assert stopped_in < grace + 0.3


def test_serve_adds_nothing_to_a_shutdown_that_ended_with_its_hard_stop() -> None:
    # serve() shuts the transport down once more on its way out. After the driver's shutdown
    # had cut what was left, that second one waited HARD_STOP_S again for any socket still
    # open: the bounded stop took up to 0.5 s more than its grace.
    grace = 0.6

    async def scenario() -> tuple[float, float]:
        async with TcpTransport.serve(
            ConnectionGroups(2), MonotonicClock(), "127.0.0.1", 0
        ) as transport:
            # A socket whose task does not end within the hard stop (here: it has none).
            sock, other = socket.socketpair()
            transport._peers[999] = _Peer(999, sock, "stuck", SendQueue(1 << 20))
            started = time.monotonic()
            await transport.shutdown(grace)  # as the driver's exit does
            stopped = time.monotonic()
        exited = time.monotonic()
        sock.close()
        other.close()
        return stopped - started, exited - stopped

    shutdown_took, exit_took = run_and_return(scenario())
    assert shutdown_took >= HARD_STOP_S  # it waited for the stuck socket, up to its grace
    assert exit_took < HARD_STOP_S / 2  # serve()'s own shutdown returned at once


def test_a_peer_that_leaves_while_its_socket_is_held_back_is_noticed_at_once() -> None:
    # A DATA_HELLO socket waiting for its group reads nothing past 1 MiB: its EOF hides behind
    # the unread bytes. It used to be polled every 10 ms and kept its place until the 10 s
    # attach deadline all the same.
    def leaving_peer(address: tuple[str, int]) -> float:
        with socket.create_connection(address, timeout=10) as sock:
            # A little more than it may hold: enough to be held back, little enough for the
            # rest to fit the receive window (a FIN queued behind a full window never leaves).
            sock.sendall(encode_bytes(DataHello(0, 99, 0)) + bytes((1 << 20) + 1024))
            time.sleep(0.3)  # held back by now
        return time.monotonic()

    async def scenario() -> float:
        groups = ConnectionGroups(2)
        async with TcpTransport.serve(groups, MonotonicClock(), "127.0.0.1", 0) as transport:
            async with anyio.create_task_group() as tasks:

                async def pump_events() -> None:  # no coordinator: nothing to admit
                    while True:
                        await transport.next_event(None)

                tasks.start_soon(pump_events)
                left_at = await anyio.to_thread.run_sync(leaving_peer, transport.address)
                with anyio.fail_after(5):
                    while groups.is_open(1):
                        await anyio.sleep(0.01)
                tasks.cancel_scope.cancel()
        return time.monotonic() - left_at

    assert run_and_return(scenario()) < 1.0


def open_epolls() -> int:
    """The epoll descriptors this process holds (the event loop's own among them)."""
    fds = Path("/proc/self/fd")
    links = []
    for fd in fds.iterdir():
        with contextlib.suppress(OSError):  # the directory's own descriptor is gone by now
            links.append(os.readlink(fd))
    return links.count("anon_inode:[eventpoll]")


@pytest.mark.skipif(
    not (hasattr(select, "epoll") and os.path.isdir("/proc/self/fd")), reason="needs epoll, /proc"
)
def test_the_hangup_watch_holds_an_epoll_only_while_the_transport_serves() -> None:
    # A transport built and never served used to leak the watch's epoll (made at construction,
    # closed only by the watch's task).
    async def scenario() -> tuple[int, int, int, int]:
        before = open_epolls()
        listener = socket.create_server(("127.0.0.1", 0))
        async with anyio.create_task_group() as tasks:
            unserved = TcpTransport(ConnectionGroups(2), MonotonicClock(), listener, tasks)
            never_served = open_epolls()
            del unserved
        listener.close()
        async with TcpTransport.serve(ConnectionGroups(2), MonotonicClock(), "127.0.0.1", 0):
            await anyio.wait_all_tasks_blocked()  # the watch's task has started
            serving = open_epolls()
        return before, never_served, serving, open_epolls()

    before, never_served, serving, after = run_and_return(scenario())
    assert never_served == before
    assert serving == before + 1  # the watch's own, while it runs
    assert after == before  # and closed once it stops


def test_a_written_frame_is_not_kept_while_its_writer_waits() -> None:
    # The writer kept the last frame it wrote until the next came: the BCAST array under it
    # could not go back to the coordinator's pool, which made and faulted in a fresh one.
    async def scenario() -> tuple[bool, bool]:
        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        listener = socket.create_server(("127.0.0.1", 0))
        async with anyio.create_task_group() as tasks:
            tcp = TcpTransport(ConnectionGroups(1), MonotonicClock(), listener, tasks)
            peer = _Peer(1, ours, "test peer", SendQueue(1 << 20))
            tasks.start_soon(tcp._write_loop, peer)
            payload = np.ones(1 << 20, dtype=np.uint8)  # stands for a BCAST's array
            payload_ref = weakref.ref(payload)
            await peer.queue.put(Outgoing([memoryview(payload)]), payload.nbytes)
            del payload
            received = 0
            while received < 1 << 20:
                await anyio.wait_readable(theirs)
                received += len(theirs.recv(1 << 20))
            while not peer.queue.idle:
                await anyio.sleep(0.01)
            kept_while_waiting = payload_ref() is not None
            peer.queue.close(discard=False)
        listener.close()
        ours.close()
        theirs.close()
        return kept_while_waiting, payload_ref() is not None

    assert run_and_return(scenario()) == (False, False)


def test_at_the_socket_limit_the_oldest_socket_without_a_group_makes_room() -> None:
    # Idle sockets holding every peer slot kept a learner out until their 10 s deadline.
    def idle_peers_then_a_learner(address: tuple[str, int]) -> float:
        idle = [socket.create_connection(address, timeout=10) for _ in range(3)]
        try:
            time.sleep(0.2)
            started = time.monotonic()
            group = LearnerGroup(address, SPEC, learner_id=0, generation=1, num_streams=0)
            group.connect()
            try:
                assert group.receive(10.0) == PullReq(0, 1, 1)
                return time.monotonic() - started
            finally:
                group.close()
        finally:
            for sock in idle:
                sock.close()

    async def scenario() -> float:
        coordinator = Stand_in(on_ready=lambda key: [Send(key, PullReq(0, 1, 1))])
        groups = ConnectionGroups(2)
        clock = MonotonicClock()
        async with TcpTransport.serve(
            groups, clock, "127.0.0.1", 0, max_peers=3, linger=0.5
        ) as transport:
            driver = Driver(coordinator, transport, clock, log=KeyValueLog(min_level="error"))
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(driver.run, transport)
                with anyio.fail_after(20):
                    waited = await anyio.to_thread.run_sync(
                        idle_peers_then_a_learner, transport.address
                    )
                tasks.cancel_scope.cancel()
        return waited

    assert run_and_return(scenario()) < 3.0


# -- the send queue ------------------------------------------------------------------------------
def test_send_queue_bounds_bytes_and_pushes_back() -> None:
    async def scenario() -> None:
        queue = SendQueue(max_bytes=100)
        assert await queue.put(Outgoing([b"x" * 80]), 80)
        assert await queue.put(Outgoing([b"y" * 20]), 20)
        order: list[str] = []

        async def producer() -> None:
            await queue.put(Outgoing([b"z" * 50]), 50)  # waits: 100 + 50 > 100
            order.append("put")

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(producer)
            await anyio.sleep(0.05)
            assert order == [] and queue.queued_bytes == 100
            assert await queue.get() == Outgoing([b"x" * 80])
            await anyio.sleep(0.05)
            assert order == ["put"] and queue.queued_bytes == 70

    run(scenario)


def test_send_queue_admits_an_oversized_frame_when_empty_and_closes_cleanly() -> None:
    async def scenario() -> None:
        queue = SendQueue(max_bytes=10)
        assert await queue.put(Outgoing([b"big" * 100]), 300)
        queue.close(last=[b"error"], discard=True)
        assert await queue.get() == Outgoing([b"error"])
        assert await queue.get() is None
        assert not await queue.put(Outgoing([b"late"]), 4)

    run(scenario)


def test_send_queue_close_without_discard_keeps_what_is_queued() -> None:
    async def scenario() -> None:
        queue = SendQueue(max_bytes=1000)
        await queue.put(Outgoing([b"a"]), 1)
        await queue.put(Outgoing([b"b"]), 1)
        queue.close(discard=False)
        assert [await queue.get(), await queue.get(), await queue.get()] == [
            Outgoing([b"a"]),
            Outgoing([b"b"]),
            None,
        ]

    run(scenario)


@pytest.mark.parametrize("size", [1, 1 << 20])
def test_send_queue_get_waits_for_a_frame(size: int) -> None:
    async def scenario() -> None:
        queue = SendQueue(max_bytes=1 << 30)
        got: list[object] = []

        async def consumer() -> None:
            got.append(await queue.get())

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(consumer)
            await anyio.sleep(0.02)
            assert got == []
            await queue.put(Outgoing([bytes(size)]), size)
        assert got == [Outgoing([bytes(size)])]

    run(scenario)


def test_log_throttle_writes_one_line_per_period_and_counts_the_rest() -> None:
    throttle = LogThrottle(period=10.0)
    assert throttle.due("accept failed", 0.0) == 0
    assert [throttle.due("accept failed", t) for t in (1.0, 2.0, 9.9)] == [None] * 3
    assert throttle.due("other line", 5.0) == 0  # each kind has its own period
    assert throttle.due("accept failed", 10.0) == 3
    assert throttle.due("accept failed", 25.0) == 0
