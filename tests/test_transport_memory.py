"""Connection-group semantics over the in-memory transport, with a fake clock and a stand-in
coordinator that admits every HELLO: handshakes, attaches, deadlines, striping, reassembly and
error isolation (PINNED.md § HELLO and DATA_HELLO, § Striping)."""

from __future__ import annotations

import gc
import re
import struct
import weakref
from collections.abc import Awaitable, Callable, Sequence

import anyio
import numpy as np
import pytest

from yeto_proto import (
    FRAME_MAGIC,
    AnyMessage,
    BcastFragment,
    Chunk,
    ChunkSlicer,
    DataHello,
    ErrorMessage,
    FrameDecoder,
    FrameType,
    Heartbeat,
    Hello,
    InitParams,
    Limits,
    MergeMode,
    PullReq,
    PushFragment,
    Reassembler,
    Role,
    WireDtype,
    WireFragment,
    WireLayout,
    encode,
    encode_bytes,
)
from yeto_sync.events import (
    Action,
    AdmitGroup,
    Event,
    GroupClosed,
    GroupKey,
    GroupReady,
    HelloReceived,
    MessageReceived,
    RefuseConnection,
)
from yeto_sync.transport.group import (
    ATTACH_TIMEOUT_S,
    MAX_HELD_MESSAGES,
    ConnectionGroups,
    Hangup,
)
from yeto_sync.transport.memory import MemoryPeer, MemorySyncer

BIG = 1_200_000  # f32 BCAST of this fragment is 4.8 MB: two 4 MiB CHUNKs
LAYOUT = WireLayout((WireFragment(MergeMode.AVG, (BIG,)), WireFragment(MergeMode.AVG, (10, 20))))
LIMITS = Limits.of(WireDtype.F32, LAYOUT)
FINGERPRINT = bytes(range(32))
CONTRACT = bytes(range(32, 64))
M = 3
ERROR_CODE = re.compile(
    r"^(?:invalid first frame: |HELLO authentication failed: )?([A-Z][A-Z0-9_]+)(?::|$)"
)


class AdmitAll:
    """Stand-in coordinator: admits every HELLO (except ``refuse`` ids) and records events."""

    def __init__(self, refuse: Sequence[int] = ()) -> None:
        self.refuse = set(refuse)
        self.events: list[Event] = []

    def handle(self, event: Event, now: float) -> list[Action]:
        self.events.append(event)
        if not isinstance(event, HelloReceived):
            return []
        hello = event.hello
        if hello.learner_id in self.refuse:
            return [RefuseConnection(event.conn, ErrorMessage("DUPLICATE_GENERATION: test"))]
        key = GroupKey(hello.learner_id, hello.generation)
        return [
            AdmitGroup(event.conn, key, hello.num_streams, Limits.of(hello.dtype, hello.layout))
        ]

    def of_type(self, kind: type) -> list[Event]:
        return [e for e in self.events if isinstance(e, kind)]


def run(test: Callable[[], Awaitable[None]]) -> None:
    anyio.run(test)


def make_hello(learner_id: int = 0, generation: int = 1, num_streams: int = 0) -> Hello:
    return Hello(learner_id, generation, WireDtype.F32, LAYOUT, FINGERPRINT, CONTRACT, num_streams)


def frames_of(peer: MemoryPeer) -> list[AnyMessage]:
    """What the syncer sent on this socket, decoded as a learner would."""
    decoder = FrameDecoder(Role.LEARNER, limits=LIMITS)
    decoder.feed(peer.read())
    return decoder.frames()


def error_text(peer: MemoryPeer) -> str:
    """The text of the single ERROR the syncer sent before hanging up."""
    assert peer.hung_up
    (error,) = frames_of(peer)
    assert isinstance(error, ErrorMessage)
    return error.text


def error_code(peer: MemoryPeer) -> str:
    text = error_text(peer)
    match = ERROR_CODE.match(text)
    assert match, text
    return match.group(1)


def connect_group(
    syncer: MemorySyncer,
    learner_id: int = 0,
    generation: int = 1,
    num_streams: int = 0,
    *,
    attach: int | None = None,
) -> list[MemoryPeer]:
    """HELLO on a new socket, then DATA_HELLO on ``attach`` (default: all) data sockets."""
    peers = [syncer.connect()]
    peers[0].send(make_hello(learner_id, generation, num_streams))
    for index in range(num_streams if attach is None else attach):
        peer = syncer.connect()
        peer.send(DataHello(learner_id, generation, index))
        peers.append(peer)
    return peers


def new_syncer(coordinator: AdmitAll, **kwargs: object) -> MemorySyncer:
    return MemorySyncer(coordinator, num_learners=M, **kwargs)  # type: ignore[arg-type]


# -- handshakes ----------------------------------------------------------------------------------
def test_group_without_data_streams_is_ready_on_admission() -> None:
    async def scenario() -> None:
        coordinator = AdmitAll()
        syncer = new_syncer(coordinator)
        (control,) = connect_group(syncer)
        control.send(Heartbeat(0, 7))
        await syncer.settle()
        key = GroupKey(0, 1)
        assert [type(e) for e in coordinator.events] == [
            HelloReceived,
            GroupReady,
            MessageReceived,
        ]
        assert coordinator.events[2] == MessageReceived(key, Heartbeat(0, 7))
        assert not control.hung_up

    run(scenario)


def test_bytes_beyond_what_may_be_held_before_admission_wait_and_then_arrive_whole() -> None:
    """An INIT sent right behind the HELLO is read only up to the cap until admission."""

    async def scenario() -> None:
        coordinator = AdmitAll()
        syncer = new_syncer(coordinator)
        values = np.linspace(-1, 1, BIG, dtype="<f4")
        control = syncer.connect()
        control.write(
            encode_bytes(make_hello(0, 1))
            + encode_bytes(InitParams(0, values.view(np.uint8).data))
            + encode_bytes(Heartbeat(0, 3))
        )
        control.close()  # its EOF too waits behind the bytes not read yet
        await syncer.settle()
        received = [e.message for e in coordinator.of_type(MessageReceived)]
        assert [type(m) for m in received] == [InitParams, Heartbeat]
        assert isinstance(received[0], InitParams)
        np.testing.assert_array_equal(np.frombuffer(received[0].data, "<f4"), values)
        assert coordinator.of_type(GroupClosed)

    run(scenario)


def test_data_streams_attach_in_any_order_and_held_messages_follow_ready() -> None:
    async def scenario() -> None:
        coordinator = AdmitAll()
        syncer = new_syncer(coordinator)
        late = syncer.connect()
        late.send(DataHello(0, 5, 1))  # before its group exists: waits
        await syncer.settle()
        assert coordinator.events == []
        control = syncer.connect()
        # HELLO and a HEARTBEAT in one write: the heartbeat waits for admission, then for ready.
        control.write(encode_bytes(make_hello(0, 5, 2)) + encode_bytes(Heartbeat(0, 1)))
        await syncer.settle()
        assert [type(e) for e in coordinator.events] == [HelloReceived]
        first = syncer.connect()
        first.send(DataHello(0, 5, 0))
        await syncer.settle()
        key = GroupKey(0, 5)
        assert coordinator.events[1:] == [GroupReady(key), MessageReceived(key, Heartbeat(0, 1))]
        assert syncer.groups.streams_of(key) == {0: first.conn, 1: late.conn}

    run(scenario)


def test_frames_fed_one_byte_at_a_time_decode_the_same() -> None:
    async def scenario() -> None:
        coordinator = AdmitAll()
        syncer = new_syncer(coordinator)
        control = syncer.connect()
        data = encode_bytes(make_hello(1, 2)) + encode_bytes(Heartbeat(1, 3))
        for index in range(len(data)):
            control.write(data[index : index + 1])
            await syncer.settle()
        assert coordinator.events[1:] == [
            GroupReady(GroupKey(1, 2)),
            MessageReceived(GroupKey(1, 2), Heartbeat(1, 3)),
        ]

    run(scenario)


def test_data_hello_without_group_gets_unknown_group_after_ten_seconds() -> None:
    async def scenario() -> None:
        syncer = new_syncer(AdmitAll())
        orphan = syncer.connect()
        orphan.send(DataHello(0, 9, 0))
        await syncer.advance(9.9)
        assert not orphan.hung_up
        await syncer.advance(0.2)
        assert error_code(orphan) == "UNKNOWN_GROUP"

    run(scenario)


def test_a_stream_index_no_group_can_have_is_refused_without_waiting_for_the_group() -> None:
    # A group has at most 256 data streams (indices 0..255): conformance data_hello.json tcId 5.
    async def scenario() -> None:
        syncer = new_syncer(AdmitAll())
        hopeless, possible = syncer.connect(), syncer.connect()
        hopeless.send(DataHello(2, 3, 256))
        possible.send(DataHello(2, 3, 255))  # may still belong to a group of 256 streams
        await syncer.settle()
        assert error_code(hopeless) == "BAD_STREAM_INDEX"
        assert not possible.hung_up

    run(scenario)


def test_data_sockets_waiting_for_a_group_that_fails_its_admission_are_refused_at_once() -> None:
    """The HELLO lifted their deadline; bytes behind it that fail close the group at admission."""

    async def scenario() -> None:
        syncer = new_syncer(AdmitAll())
        waiting = syncer.connect()
        waiting.send(DataHello(0, 1, 0))
        await syncer.settle()
        control = syncer.connect()
        control.write(encode_bytes(make_hello(0, 1, num_streams=1)) + bytes(13))
        await syncer.settle()
        assert error_code(control) == "BAD_MAGIC"
        assert error_code(waiting) == "UNKNOWN_GROUP"

    run(scenario)


def test_bad_or_duplicate_stream_index_refuses_only_that_socket() -> None:
    async def scenario() -> None:
        coordinator = AdmitAll()
        syncer = new_syncer(coordinator)
        control, first = connect_group(syncer, num_streams=2, attach=1)
        out_of_range, duplicate = syncer.connect(), syncer.connect()
        out_of_range.send(DataHello(0, 1, 2))
        duplicate.send(DataHello(0, 1, 0))
        await syncer.settle()
        assert error_code(out_of_range) == "BAD_STREAM_INDEX"
        assert error_code(duplicate) == "DUPLICATE_STREAM"
        assert not control.hung_up and not first.hung_up
        assert coordinator.of_type(GroupReady) == []
        second = syncer.connect()
        second.send(DataHello(0, 1, 1))
        await syncer.settle()
        assert coordinator.of_type(GroupReady) == [GroupReady(GroupKey(0, 1))]

    run(scenario)


def test_stream_index_on_a_group_without_streams_is_refused() -> None:
    async def scenario() -> None:
        syncer = new_syncer(AdmitAll())
        connect_group(syncer, num_streams=0)
        extra = syncer.connect()
        extra.send(DataHello(0, 1, 0))
        await syncer.settle()
        assert error_code(extra) == "BAD_STREAM_INDEX"

    run(scenario)


def test_group_missing_data_streams_is_closed_after_the_attach_deadline() -> None:
    async def scenario() -> None:
        coordinator = AdmitAll()
        syncer = new_syncer(coordinator)
        control, first = connect_group(syncer, num_streams=2, attach=1)
        await syncer.advance(9.5)
        assert not control.hung_up
        await syncer.advance(1.0)
        assert error_code(control) == "HANDSHAKE_TIMEOUT"
        assert first.hung_up and frames_of(first) == []
        (closed,) = coordinator.of_type(GroupClosed)
        assert isinstance(closed, GroupClosed) and closed.group == GroupKey(0, 1)
        assert "HANDSHAKE_TIMEOUT" in closed.reason

    run(scenario)


@pytest.mark.parametrize("sent", [b"", encode_bytes(make_hello())[:20]], ids=["silent", "partial"])
def test_peer_that_never_finishes_its_first_frame_is_dropped(sent: bytes) -> None:
    async def scenario() -> None:
        coordinator = AdmitAll()
        syncer = new_syncer(coordinator)
        slow = syncer.connect()
        slow.write(sent)
        await syncer.advance(9.9)
        assert not slow.hung_up
        await syncer.advance(0.2)
        assert error_code(slow) == "HANDSHAKE_TIMEOUT"
        assert coordinator.events == []

    run(scenario)


def test_a_peer_that_leaves_inside_a_big_hello_frees_its_buffer_without_the_cyclic_gc() -> None:
    # Its decoder failed (CONNECTION_CLOSED_MID_FRAME): nothing of it may sit in a reference
    # cycle, or 48 such peers hold 838 MB until a gc.collect().
    groups = ConnectionGroups(M)
    enabled = gc.isenabled()
    gc.disable()
    try:
        groups.open(1, 0.0)
        groups.receive(1, struct.pack("<IBQ", FRAME_MAGIC, FrameType.HELLO, 16 << 20), 0.0)
        groups.receive(1, bytes(1 << 20), 0.0)
        freed = weakref.ref(groups._sockets[1].decoder)
        (hangup,) = groups.receive(1, b"", 0.0)
        assert isinstance(hangup, Hangup) and hangup.error is not None
        assert hangup.error.text.startswith("CONNECTION_CLOSED_MID_FRAME: ")
        assert not groups.is_open(1)
        assert freed() is None
    finally:
        if enabled:
            gc.enable()


def _large_hello(learner_id: int, fragments: int = 40) -> bytes:
    layout = WireLayout(tuple(WireFragment(MergeMode.AVG, (i + 1,)) for i in range(fragments)))
    return encode_bytes(Hello(learner_id, 1, WireDtype.F32, layout, FINGERPRINT, CONTRACT, 0))


def _drain_until_settled(groups: ConnectionGroups, conn: int) -> int:
    """Drain ``conn`` as the TCP daemon's reader does; how many drains its HELLO took."""
    drains = 0
    while groups.holds_frames(conn) and not groups.waits_for_hello_turn(conn):
        groups.drain(conn, 0.0)
        drains += 1
    return drains


def test_large_hellos_are_read_a_slice_per_drain_one_at_a_time() -> None:
    groups = ConnectionGroups(M, hello_step_bytes=8 * 13)
    for conn, learner in ((1, 0), (2, 1), (3, 2)):
        groups.open(conn, 0.0)
        groups.receive(conn, _large_hello(learner), 0.0)  # reads the first slice of socket 1
    small = 4
    groups.open(small, 0.0)
    groups.receive(small, _hello_bytes(0, 9), 0.0)  # a small HELLO never waits for a turn
    assert isinstance(event := groups.pop_event(), HelloReceived) and event.conn == small
    assert groups.holds_frames(1) and not groups.waits_for_hello_turn(1)
    assert groups.waits_for_hello_turn(2) and groups.waits_for_hello_turn(3)
    groups.drain(3, 0.0)  # its turn has not come: nothing is read
    assert groups.pop_event() is None and groups.waits_for_hello_turn(3)
    # Their first frames are in, whole: waiting for a turn is no handshake timeout.
    assert groups.expire(100.0) == [] and all(groups.is_open(conn) for conn in (1, 2, 3))
    assert _drain_until_settled(groups, 1) == 4  # 40 records, 8 a slice: 5 in all
    assert isinstance(event := groups.pop_event(), HelloReceived) and event.conn == 1
    assert len(event.hello.layout.fragments) == 40
    # Turns go in arrival order: socket 3 asks first, socket 2 arrived first.
    assert groups.waits_for_hello_turn(3) and not groups.waits_for_hello_turn(2)
    # Its reader gone mid-reading, the next large HELLO gets its turn.
    groups.drain(2, 0.0)
    assert groups.waits_for_hello_turn(3)
    groups.lost(2, "test")
    assert not groups.waits_for_hello_turn(3)
    assert _drain_until_settled(groups, 3) == 5
    assert isinstance(event := groups.pop_event(), HelloReceived) and event.conn == 3


def test_data_sockets_of_a_large_hello_waiting_its_turn_wait_without_the_attach_deadline() -> None:
    groups = ConnectionGroups(M, hello_step_bytes=8 * 13)
    groups.open(1, 0.0)
    groups.receive(1, _large_hello(0), 0.0)  # being read
    layout = WireLayout(tuple(WireFragment(MergeMode.AVG, (i + 1,)) for i in range(40)))
    queued = encode_bytes(Hello(1, 1, WireDtype.F32, layout, FINGERPRINT, CONTRACT, 1))
    groups.open(2, 0.0)
    groups.open(3, 0.0)
    groups.receive(3, encode_bytes(DataHello(1, 1, 0)), 0.0)  # its data socket, first
    groups.receive(2, queued, 0.0)  # its HELLO, whole, waits behind socket 1's
    groups.open(4, 0.0)
    groups.receive(4, encode_bytes(DataHello(1, 1, 0)), 0.0)  # a data socket after it
    assert groups.waits_for_hello_turn(2)
    assert groups.expire(100.0) == []  # neither the HELLO nor its data sockets time out
    assert all(groups.is_open(conn) for conn in (1, 2, 3, 4))
    # If that HELLO is never read (its socket is lost), its data sockets are back on the clock.
    groups.lost(2, "test")
    (refused, _) = [c for c in groups.expire(100.0 + ATTACH_TIMEOUT_S) if isinstance(c, Hangup)]
    assert refused.error is not None and refused.error.text.startswith("UNKNOWN_GROUP: ")


def test_a_whole_first_frame_held_by_the_backlog_bound_is_past_the_handshake_timeout() -> None:
    groups = ConnectionGroups(M, max_backlog=1)
    groups.open(1, 0.0)
    groups.receive(1, _hello_bytes(0), 0.0)  # fills the backlog
    groups.open(2, 0.0)
    groups.receive(2, _hello_bytes(1), 0.0)  # whole, held by the bound
    assert groups.expire(100.0) == [] and groups.is_open(2)


def _hello_bytes(learner_id: int = 0, generation: int = 1) -> bytes:
    return encode_bytes(make_hello(learner_id, generation))


def test_past_the_unsettled_cap_the_oldest_waiting_socket_makes_room() -> None:
    # The newcomer used to be closed instead: 256 idle sockets locked every learner out.
    groups = ConnectionGroups(M, max_unsettled=4)
    for conn in range(1, 5):
        assert groups.open(conn, float(conn)) == []
    groups.receive(2, struct.pack("<IBQ", FRAME_MAGIC, FrameType.HELLO, 500)[:7], 2.0)
    assert groups.open(5, 5.0) == [Hangup(1)]  # the oldest, without ERROR: a learner redials
    assert groups.open(6, 6.0) == [Hangup(2)]  # half a header does not make it younger
    assert not groups.is_open(1) and not groups.is_open(2)
    assert groups.receive(6, _hello_bytes(), 6.0) == []
    assert isinstance(groups.pop_event(), HelloReceived)


def test_a_socket_whose_hello_the_coordinator_is_deciding_is_never_evicted() -> None:
    groups = ConnectionGroups(M, max_unsettled=2)
    for conn, learner in ((1, 0), (2, 1)):
        groups.open(conn, 0.0)
        groups.receive(conn, _hello_bytes(learner), 0.0)  # both wait for the coordinator
    assert groups.open(3, 1.0) == [Hangup(3)]  # so the newcomer is the one turned away
    assert groups.is_open(1) and groups.is_open(2) and not groups.is_open(3)


def test_sockets_without_a_group_share_a_bound_on_the_bytes_they_hold() -> None:
    # 256 half-sent 16 MiB HELLOs held 4 GiB before anyone was authenticated.
    groups = ConnectionGroups(M, max_unsettled_bytes=3000)
    big_hello = struct.pack("<IBQ", FRAME_MAGIC, FrameType.HELLO, 16 << 20)
    for conn in (1, 2):
        groups.open(conn, 0.0)
        assert groups.receive(conn, big_hello + bytes(1400), 0.0) == []
    groups.open(3, 0.0)
    assert groups.receive(3, big_hello + bytes(1400), 0.0) == [Hangup(1)]  # the oldest goes
    assert not groups.is_open(1) and groups.is_open(2) and groups.is_open(3)
    # What a socket held stops counting once it is gone.
    groups.lost(2, "test")
    groups.lost(3, "test")
    groups.open(4, 0.0)
    assert groups.receive(4, big_hello + bytes(2900), 0.0) == []
    assert groups.is_open(4)


def test_sockets_refused_before_joining_a_group_are_logged_once_per_period() -> None:
    # Anyone can open sockets: 50 bad first frames wrote 50 warnings, each naming the socket
    # "stream 0" though it had no stream yet.
    lines: list[tuple[str, dict[str, object]]] = []
    groups = ConnectionGroups(M, log=lambda level, text, fields: lines.append((text, dict(fields))))
    for conn in range(1, 51):
        groups.open(conn, conn * 0.1)  # 5 s in all: within one period
        groups.receive(conn, struct.pack("<IBQ", 0xDEADBEEF, FrameType.HELLO, 10), conn * 0.1)
    ((text, fields),) = lines
    assert text == "protocol error before joining a group"
    assert fields["socket"] == "unattached socket" and fields["conn"] == 1
    groups.open(51, 12.0)
    groups.receive(51, struct.pack("<IBQ", 0xDEADBEEF, FrameType.HELLO, 10), 12.0)
    assert lines[-1][1]["held_back"] == 49 and lines[-1][1]["conn"] == 51
    # A protocol error inside a group is always logged, with the socket's stream.
    groups.open(60, 13.0)
    groups.receive(60, _hello_bytes(), 13.0)
    groups.admit(60, GroupKey(0, 1), 0, LIMITS, 13.0)
    groups.receive(60, struct.pack("<IBQ", 0xDEADBEEF, FrameType.HEARTBEAT, 12), 13.0)
    assert lines[-1][0] == "protocol error" and lines[-1][1]["socket"] == "stream 0"


def test_refused_hello_gets_the_error_and_no_group() -> None:
    async def scenario() -> None:
        coordinator = AdmitAll(refuse=[2])
        syncer = new_syncer(coordinator)
        (control,) = connect_group(syncer, learner_id=2)
        await syncer.settle()
        assert error_code(control) == "DUPLICATE_GENERATION"
        assert not syncer.groups.has_group(GroupKey(2, 1))

    run(scenario)


def test_peer_leaving_before_admission_is_reported_closed() -> None:
    async def scenario() -> None:
        coordinator = AdmitAll()
        syncer = new_syncer(coordinator)
        (control,) = connect_group(syncer)
        control.close()
        await syncer.settle()
        assert [type(e) for e in coordinator.events] == [HelloReceived, GroupClosed]

    run(scenario)


def test_messages_past_the_held_cap_wait_in_the_socket_until_the_group_is_ready() -> None:
    """Learner 0 INITs every fragment at once; a data socket that attaches a retransmission
    late used to cost its run: GROUP_NOT_READY after 256 held messages."""

    async def scenario() -> None:
        coordinator = AdmitAll()
        syncer = new_syncer(coordinator)
        (control,) = connect_group(syncer, num_streams=1, attach=0)
        await syncer.settle()
        count = 3 * MAX_HELD_MESSAGES + 5
        control.write(b"".join(encode_bytes(Heartbeat(0, step)) for step in range(count)))
        await syncer.settle()
        assert coordinator.of_type(MessageReceived) == []
        assert not control.hung_up
        late = syncer.connect()
        late.send(DataHello(0, 1, 0))
        await syncer.settle()
        received = coordinator.of_type(MessageReceived)
        assert [event.message for event in received] == [Heartbeat(0, s) for s in range(count)]
        assert not control.hung_up and not late.hung_up

    run(scenario)


def test_a_group_that_stopped_at_the_held_cap_still_ends_at_its_attach_deadline() -> None:
    async def scenario() -> None:
        coordinator = AdmitAll()
        syncer = new_syncer(coordinator)
        (control,) = connect_group(syncer, num_streams=1, attach=0)
        await syncer.settle()
        control.write(encode_bytes(Heartbeat(0, 1)) * (MAX_HELD_MESSAGES + 1))
        await syncer.advance(ATTACH_TIMEOUT_S + 0.1)
        assert error_code(control) == "HANDSHAKE_TIMEOUT"
        assert coordinator.of_type(MessageReceived) == []

    run(scenario)


# -- first-frame and HELLO errors ------------------------------------------------------------------
def _header(frame_type: int, length: int, magic: int = FRAME_MAGIC) -> bytes:
    return struct.pack("<IBQ", magic, frame_type, length)


def _frame(frame_type: int, payload: bytes) -> bytes:
    return _header(frame_type, len(payload)) + payload


def _hello_with_version(version: int) -> bytes:
    frame = bytearray(encode_bytes(make_hello()))
    frame[13:15] = struct.pack("<H", version)
    return bytes(frame)


@pytest.mark.parametrize(
    ("sent", "prefix", "code"),
    [
        (_header(FrameType.HELLO, 10, magic=0xDEADBEEF), "invalid first frame: ", "BAD_MAGIC"),
        (encode_bytes(PullReq(0, 1, 1)), "invalid first frame: ", "INVALID_FIRST_FRAME"),
        (_header(99, 0), "invalid first frame: ", "INVALID_FIRST_FRAME"),
        (_header(FrameType.HELLO, 1 << 62), "invalid first frame: ", "FRAME_TOO_LARGE"),
        (_hello_with_version(3), "", "UNSUPPORTED_VERSION"),
        (encode_bytes(make_hello(learner_id=M)), "", "LEARNER_ID_OUT_OF_RANGE"),
        (_frame(FrameType.HELLO, encode_bytes(make_hello())[13:] + b"\0"), "", "BAD_HELLO_TAIL"),
    ],
    ids=["magic", "pull-first", "unknown-type", "2^62", "version", "learner-id", "tail"],
)
def test_first_frame_errors(sent: bytes, prefix: str, code: str) -> None:
    async def scenario() -> None:
        coordinator = AdmitAll()
        syncer = new_syncer(coordinator)
        peer = syncer.connect()
        peer.write(sent)
        await syncer.settle()
        assert error_text(peer).startswith(f"{prefix}{code}: ")
        assert coordinator.events == []

    run(scenario)


def test_hello_authentication() -> None:
    async def scenario() -> None:
        coordinator = AdmitAll()
        syncer = new_syncer(coordinator, hello_key=b"right key")
        forged, unsigned, signed = syncer.connect(), syncer.connect(), syncer.connect()
        forged.send(make_hello(0, 1), hello_key=b"wrong key")
        unsigned.send(make_hello(1, 1))
        signed.send(make_hello(2, 1), hello_key=b"right key")
        await syncer.settle()
        for peer in (forged, unsigned):
            (error,) = frames_of(peer)
            assert isinstance(error, ErrorMessage)
            assert error.text.startswith("HELLO authentication failed: HELLO_AUTH_FAILED")
        assert coordinator.of_type(GroupReady) == [GroupReady(GroupKey(2, 1))]

    run(scenario)


# -- striping and reassembly ---------------------------------------------------------------------
def _bcast(version: int) -> BcastFragment:
    values = np.arange(BIG, dtype="<f4") + version
    return BcastFragment(0, version, values.view(np.uint8).data)


def test_bulk_frames_stripe_round_robin_over_the_data_streams() -> None:
    async def scenario() -> None:
        syncer = new_syncer(AdmitAll())
        control, *data = connect_group(syncer, num_streams=3)
        await syncer.settle()
        key = GroupKey(0, 1)
        first, second = _bcast(0), _bcast(1)
        await syncer.transport.send(key, first)
        await syncer.transport.send(key, PullReq(0, 1, 1))
        await syncer.transport.send(key, second)
        assert frames_of(control) == [PullReq(0, 1, 1)]  # control frames stay on stream 0
        received = [frames_of(peer) for peer in data]
        # msg 0 → streams 0, 1; msg 1 continues the round-robin: streams 2, 0.
        layout = [
            [(c.msg_id, c.offset) for c in frames if isinstance(c, Chunk)] for frames in received
        ]
        slice_size = 4 * 1024 * 1024
        assert layout == [[(0, 0), (1, slice_size)], [(0, slice_size)], [(1, 0)]]
        reassembler = Reassembler(Role.LEARNER, LIMITS)
        chunks = sorted(
            (c for frames in received for c in frames if isinstance(c, Chunk)),
            key=lambda c: (c.msg_id, -c.offset),  # reversed arrival order within each message
        )
        out = [m for m in (reassembler.add(c) for c in chunks) if m is not None]
        assert [(m.version, bytes(m.data)) for m in out if isinstance(m, BcastFragment)] == [
            (0, bytes(first.data)),
            (1, bytes(second.data)),
        ]

    run(scenario)


def test_group_without_data_streams_gets_bulk_frames_plain() -> None:
    async def scenario() -> None:
        syncer = new_syncer(AdmitAll())
        (control,) = connect_group(syncer)
        await syncer.settle()
        message = _bcast(3)
        await syncer.transport.send(GroupKey(0, 1), message)
        (frame,) = frames_of(control)
        assert isinstance(frame, BcastFragment) and bytes(frame.data) == bytes(message.data)

    run(scenario)


def _push(numel: int = BIG) -> PushFragment:
    delta = np.linspace(-1, 1, numel, dtype="<f4")
    return PushFragment(0, 0, 1, 1, 0, 10, 4, 4000, delta.view(np.uint8).data)


def test_chunks_from_any_socket_including_stream_0_reassemble_in_any_order() -> None:
    async def scenario() -> None:
        coordinator = AdmitAll()
        syncer = new_syncer(coordinator)
        peers = connect_group(syncer, num_streams=2)
        await syncer.settle()
        push = _push()
        pieces = ChunkSlicer(3, slice_size=1 << 20).slice(encode(push))
        for index, piece in reversed(list(enumerate(pieces))):
            peers[index % 3].write(b"".join(piece.buffers))  # stream 0 carries CHUNKs too
        await syncer.settle()
        (received,) = coordinator.of_type(MessageReceived)
        assert isinstance(received, MessageReceived)
        message = received.message
        assert isinstance(message, PushFragment)
        assert bytes(message.data) == bytes(push.data)
        assert received.tensor_finite is True  # checked CHUNK by CHUNK on arrival

    run(scenario)


def test_f32_tensors_carry_the_verdict_of_their_arrival_check() -> None:
    async def scenario() -> None:
        coordinator = AdmitAll()
        syncer = new_syncer(coordinator)
        peers = connect_group(syncer, num_streams=2)
        await syncer.settle()
        bad = np.linspace(-1, 1, BIG, dtype="<f4")
        bad[BIG - 3] = np.inf
        slicer = ChunkSlicer(2, slice_size=1 << 20)
        for values in (bad, np.ones(BIG, "<f4")):
            push = PushFragment(0, 0, 1, 1, 0, 10, 4, 4000, values.view(np.uint8).data)
            for piece in slicer.slice(encode(push)):
                peers[1 + piece.stream_idx].write(b"".join(piece.buffers))
        # Unstriped frames on stream 0, read in place: checked on the way in as well.
        peers[0].send(_push())
        peers[0].send(PushFragment(0, 0, 1, 1, 0, 10, 4, 4000, bad.view(np.uint8).data))
        await syncer.settle()
        verdicts = [e.tensor_finite for e in coordinator.of_type(MessageReceived)]
        assert verdicts == [False, True, True, False]

    run(scenario)


# -- errors stay inside their group ---------------------------------------------------------------
def test_protocol_error_on_a_data_socket_closes_only_that_group() -> None:
    async def scenario() -> None:
        coordinator = AdmitAll()
        syncer = new_syncer(coordinator)
        control_a, data_a0, data_a1 = connect_group(syncer, learner_id=0, num_streams=2)
        (control_b,) = connect_group(syncer, learner_id=1)
        await syncer.settle()
        data_a1.write(_header(FrameType.HEARTBEAT, 12, magic=0x12345678))
        control_b.send(Heartbeat(1, 4))
        await syncer.settle()
        (error,) = frames_of(data_a1)
        assert isinstance(error, ErrorMessage)
        assert error.text.startswith("BAD_MAGIC: ")  # not a first frame: no prefix
        assert control_a.hung_up and data_a0.hung_up and data_a1.hung_up
        assert frames_of(control_a) == [] and frames_of(data_a0) == []
        assert not control_b.hung_up
        assert GroupClosed(GroupKey(0, 1), error.text) in coordinator.events
        assert MessageReceived(GroupKey(1, 1), Heartbeat(1, 4)) in coordinator.events

    run(scenario)


@pytest.mark.parametrize(
    ("second_offset", "code"),
    [(0, "CHUNK_OVERLAP"), (50, "CHUNK_OVERLAP"), (5_000_000, "CHUNK_OUT_OF_BOUNDS")],
)
def test_bad_chunks_close_the_group(second_offset: int, code: str) -> None:
    async def scenario() -> None:
        coordinator = AdmitAll()
        syncer = new_syncer(coordinator)
        control, data = connect_group(syncer, num_streams=1)
        await syncer.settle()
        inner = b"".join(encode(_push(1000)))
        data.send(Chunk(0, len(inner), 0, memoryview(inner[:100])))
        control.send(Chunk(0, len(inner), second_offset, memoryview(inner[:100])))
        await syncer.settle()
        assert error_code(control) == code
        assert data.hung_up
        assert coordinator.of_type(GroupClosed)

    run(scenario)


def test_unknown_type_and_huge_length_after_the_handshake() -> None:
    async def scenario() -> None:
        syncer = new_syncer(AdmitAll())
        (unknown,) = connect_group(syncer, learner_id=0)
        (huge,) = connect_group(syncer, learner_id=1)
        await syncer.settle()
        unknown.write(_header(99, 0))
        huge.write(_header(FrameType.PUSH_FRAGMENT, 1 << 62))
        await syncer.settle()
        assert error_code(unknown) == "UNKNOWN_FRAME_TYPE"
        assert error_code(huge) == "FRAME_TOO_LARGE"

    run(scenario)


def test_close_group_withdraws_queued_events_and_confirms_the_close() -> None:
    async def scenario() -> None:
        coordinator = AdmitAll()
        syncer = new_syncer(coordinator)
        control, data = connect_group(syncer, num_streams=1)
        await syncer.settle()
        control.send(Heartbeat(0, 9))  # queued, not yet seen by the coordinator
        key = GroupKey(0, 1)
        syncer.transport.close_group(key, ErrorMessage("LEARNER_ID_MISMATCH: test"))
        await syncer.settle()
        assert MessageReceived(key, Heartbeat(0, 9)) not in coordinator.events
        assert coordinator.events[-1] == GroupClosed(
            key, "closed by the syncer: LEARNER_ID_MISMATCH: test"
        )
        assert error_code(control) == "LEARNER_ID_MISMATCH"
        assert data.hung_up and frames_of(data) == []
        await syncer.transport.send(key, Heartbeat(0, 1))  # a closed group: silently nothing

    run(scenario)


def test_clean_close_of_one_socket_drops_the_group_without_error() -> None:
    async def scenario() -> None:
        coordinator = AdmitAll()
        syncer = new_syncer(coordinator)
        control, data = connect_group(syncer, num_streams=1)
        await syncer.settle()
        data.close()
        await syncer.settle()
        assert control.hung_up and frames_of(control) == []
        assert coordinator.events[-1] == GroupClosed(GroupKey(0, 1), "peer closed data stream 0")

    run(scenario)


def test_shutdown_hangs_up_everyone_and_refuses_new_connections() -> None:
    async def scenario() -> None:
        syncer = new_syncer(AdmitAll())
        (control,) = connect_group(syncer)
        await syncer.settle()
        await syncer.transport.send(GroupKey(0, 1), PullReq(1, 1, 1))
        await syncer.transport.shutdown(1.0)
        assert frames_of(control) == [PullReq(1, 1, 1)]
        assert control.hung_up
        with pytest.raises(ConnectionRefusedError):
            syncer.connect()

    run(scenario)


# -- deadlines measure the peer, never the coordinator (sans-IO, no driver) ------------------------
def _wire_errors(commands: Sequence[object]) -> dict[int, str]:
    return {c.conn: c.error.text for c in commands if isinstance(c, Hangup) and c.error is not None}


def test_a_busy_coordinator_does_not_time_out_a_peer_that_sent_its_hello() -> None:
    groups = ConnectionGroups(M)
    groups.open(1, now=0.0)
    groups.receive(1, encode_bytes(make_hello(0, 4, 1)), now=1.0)
    groups.open(2, now=1.0)
    groups.receive(2, encode_bytes(DataHello(0, 4, 0)), now=2.0)  # its HELLO is being decided
    assert groups.next_deadline() is None
    assert groups.expire(now=60.0) == []
    assert isinstance(groups.pop_event(), HelloReceived)
    groups.admit(1, GroupKey(0, 4), 1, LIMITS, now=61.0)
    assert groups.pop_event() == GroupReady(GroupKey(0, 4))


def test_data_sockets_of_a_refused_hello_are_refused_at_once() -> None:
    groups = ConnectionGroups(M)
    groups.open(2, now=0.0)
    groups.receive(2, encode_bytes(DataHello(1, 4, 0)), now=0.0)  # before its HELLO: clock runs
    assert groups.next_deadline() == ATTACH_TIMEOUT_S
    groups.open(1, now=0.0)
    groups.receive(1, encode_bytes(make_hello(1, 4, 1)), now=0.5)  # now the coordinator decides
    assert groups.next_deadline() is None
    errors = _wire_errors(groups.refuse(1, ErrorMessage("DUPLICATE_GENERATION: seen before")))
    assert errors[1] == "DUPLICATE_GENERATION: seen before"
    assert errors[2].startswith("UNKNOWN_GROUP: ") and "refused" in errors[2]
    assert not groups.is_open(2)


def test_data_sockets_of_a_hello_that_left_before_admission_are_refused() -> None:
    groups = ConnectionGroups(M)
    groups.open(1, now=0.0)
    groups.receive(1, encode_bytes(make_hello(2, 4, 1)), now=0.0)
    groups.open(2, now=0.0)
    groups.receive(2, encode_bytes(DataHello(2, 4, 0)), now=0.0)
    groups.receive(1, b"", now=0.1)  # the HELLO socket goes away
    errors = _wire_errors(groups.admit(1, GroupKey(2, 4), 1, LIMITS, now=0.2))
    assert errors[2].startswith("UNKNOWN_GROUP: ")
    assert list(groups.events)[-1] == GroupClosed(
        GroupKey(2, 4), "connection closed before admission"
    )


def test_sockets_held_by_the_backlog_bound_take_turns() -> None:
    """A socket that always holds more frames kept the front of the held sockets, and a new
    peer's HELLO behind it waited for as long as it flooded."""
    groups = ConnectionGroups(M, max_backlog=1)
    groups.open(1, 0.0)
    groups.receive(1, _hello_bytes(0), 0.0)
    assert isinstance(groups.pop_event(), HelloReceived)
    groups.admit(1, GroupKey(0, 1), 0, LIMITS, 0.0)
    assert isinstance(groups.pop_event(), GroupReady)
    beats = b"".join(encode_bytes(Heartbeat(0, step)) for step in (1, 2, 3))
    groups.receive(1, beats, 0.0)  # one in the backlog, two held
    groups.open(2, 0.0)
    groups.receive(2, _hello_bytes(1), 0.0)  # held behind them
    turns = []
    for _ in range(3):
        event = groups.pop_event()
        turns.append(event.conn if isinstance(event, HelloReceived) else "beat")
        groups.drain_held(0.0)  # room for one more
    assert turns == ["beat", "beat", 2]  # socket 2's HELLO gets the second turn, not the last
