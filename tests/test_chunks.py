"""CHUNK striping: slicing, round-robin, reassembly in any order, and every reassembly rule."""

from __future__ import annotations

import itertools
import struct
from typing import TYPE_CHECKING

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from yeto_proto import (
    AnyMessage,
    BcastFragment,
    Chunk,
    ChunkSlicer,
    ErrorCode,
    FinalFragment,
    FrameType,
    Heartbeat,
    InitParams,
    Limits,
    LocalProtocolError,
    MergeMode,
    PullReq,
    PushFragment,
    Reassembler,
    RemoteProtocolError,
    Role,
    StripedFrame,
    WireDtype,
    WireFragment,
    WireLayout,
    decode_inner_frame,
    encode,
    encode_bytes,
)
from yeto_proto.constants import MAX_CHUNK_RANGES, MSG_ID_WINDOW
from yeto_proto.frames import header

if TYPE_CHECKING:
    from conftest import WireKit

MiB = 1 << 20
LAYOUT = WireLayout((WireFragment(MergeMode.AVG, (10,)), WireFragment(MergeMode.RDA, (64,))))
LIMITS = Limits.of(WireDtype.F32, LAYOUT)
BCAST = BcastFragment(1, 5, np.arange(64, dtype="<f4").data)  # 13 + 12 + 256 = 281 bytes
PUSH = PushFragment(0, 1, 5, 1, 4, 10, 2, 100, np.linspace(-1, 1, 64, dtype="<f4").data)


def zeros(size: int) -> memoryview:
    return memoryview(bytes(size))


def chunk_bytes(striped: StripedFrame) -> bytes:
    return b"".join(bytes(b) for b in striped.buffers)


def as_chunk(striped: StripedFrame) -> Chunk:
    """The Chunk a receiver's decoder makes of one outgoing CHUNK frame."""
    raw = chunk_bytes(striped)
    assert raw[4] == FrameType.CHUNK
    msg_id, total, offset = struct.unpack_from("<QQQ", raw, 13)
    return Chunk(msg_id, total, offset, memoryview(raw)[13 + 24 :])


def slices(message: AnyMessage, pieces: int) -> list[Chunk]:
    inner = encode_bytes(message)
    slicer = ChunkSlicer(1, slice_size=-(-len(inner) // pieces))
    chunks = [as_chunk(s) for s in slicer.slice(encode(message))]
    assert len(chunks) == pieces
    return chunks


def expect(code: ErrorCode, reassembler: Reassembler, *chunks: Chunk) -> None:
    *accepted, last = chunks
    for chunk in accepted:
        assert reassembler.add(chunk) is None
    with pytest.raises(RemoteProtocolError) as caught:
        reassembler.add(last)
    assert caught.value.code is code, caught.value


# -- slicing ------------------------------------------------------------------------------------


def test_chunk_frames_follow_the_pinned_layout() -> None:
    inner = encode_bytes(BCAST)
    (striped,) = ChunkSlicer(2).slice(encode(BCAST))
    assert striped.stream_idx == 0
    assert chunk_bytes(striped) == (
        header(FrameType.CHUNK, 24 + len(inner)) + struct.pack("<QQQ", 0, len(inner), 0) + inner
    )


def test_a_4_mib_slice_is_the_default_and_the_cap() -> None:
    payload = np.zeros(MiB + 100, dtype="<f4")  # inner frame a little over 4 MiB
    message = BcastFragment(0, 1, payload.data)
    striped = ChunkSlicer(3).slice(encode(message))
    sizes = [len(chunk_bytes(s)) - 13 - 24 for s in striped]
    assert sizes == [4 * MiB, 13 + 12 + 4 * (MiB + 100) - 4 * MiB]
    with pytest.raises(LocalProtocolError):
        ChunkSlicer(1, slice_size=4 * MiB + 1)
    with pytest.raises(LocalProtocolError):
        ChunkSlicer(0)


def test_round_robin_carries_across_messages_and_msg_ids_count_from_zero() -> None:
    slicer = ChunkSlicer(3, slice_size=100)
    first = slicer.slice(encode(BCAST))  # 281 bytes -> 3 chunks
    second = slicer.slice(encode(BCAST))  # 3 more
    third = slicer.slice(encode(PullReq(0, 1, 1)))  # 29 bytes -> 1
    assert [s.stream_idx for s in first + second + third] == [0, 1, 2, 0, 1, 2, 0]
    assert [as_chunk(s).msg_id for s in first + second + third] == [0, 0, 0, 1, 1, 1, 2]
    assert [as_chunk(s).offset for s in first] == [0, 100, 200]
    assert {as_chunk(s).total_len for s in first} == {281}

    uneven = ChunkSlicer(2, slice_size=200)
    streams = [s.stream_idx for _ in range(3) for s in uneven.slice(encode(BCAST))]
    assert streams == [0, 1, 0, 1, 0, 1]
    odd = ChunkSlicer(3, slice_size=200)
    assert [s.stream_idx for _ in range(2) for s in odd.slice(encode(BCAST))] == [0, 1, 2, 0]


def test_slices_are_views_of_the_original_tensor_memory() -> None:
    values = np.arange(1000, dtype="<f4")
    message = BcastFragment(1, 2, values.data)
    striped = ChunkSlicer(2, slice_size=1024).slice(encode(message))
    assert len(striped) == 4
    parts = [b for s in striped for b in s.buffers[1:]]  # after each CHUNK's own header
    assert all(isinstance(v, memoryview) for v in parts)
    tensor_views = [v for v in parts if np.shares_memory(np.frombuffer(v, dtype=np.uint8), values)]
    assert sum(len(v) for v in tensor_views) == values.nbytes
    # The rest is the inner frame's 13-byte header and 12-byte BCAST prefix, nothing else.
    assert sum(len(v) for v in parts) - values.nbytes == 13 + 12
    values[500] = -1.0  # the views see later writes: nothing was copied
    joined = b"".join(bytes(v) for v in tensor_views)
    assert np.frombuffer(joined, dtype="<f4")[500] == -1.0


# -- reassembly ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("message", "receiver"), [(BCAST, Role.LEARNER), (PUSH, Role.SYNCER)])
@pytest.mark.parametrize("pieces", [4, 5])
def test_every_arrival_order_reassembles_the_same_message(
    message: AnyMessage, receiver: Role, pieces: int
) -> None:
    chunks = slices(message, pieces)
    inner = encode_bytes(message)
    for order in itertools.permutations(chunks):
        reassembler = Reassembler(receiver, LIMITS)
        results = [reassembler.add(c) for c in order]
        assert results[:-1] == [None] * (pieces - 1)
        assert results[-1] == message
        assert encode_bytes(results[-1]) == inner
        assert reassembler.pending == 0


@settings(max_examples=40)
@given(data=st.data())
def test_interleaved_messages_reassemble_independently(wire: WireKit, data: st.DataObject) -> None:
    session = data.draw(wire.session(), "session")
    receiver = data.draw(st.sampled_from(list(Role)), "receiver")
    striped = (
        FrameType.INIT_PARAMS,
        FrameType.PUSH_FRAGMENT,
        FrameType.BCAST_FRAGMENT,
        FrameType.FINAL_FRAGMENT,
    )
    types = [t for t in striped if receiver in wire.receivers_of(t)]
    messages = data.draw(
        st.lists(st.sampled_from(types).flatmap(lambda t: wire.message(t, session)), max_size=5),
        "messages",
    )
    slicer = ChunkSlicer(data.draw(st.integers(1, 4)), slice_size=data.draw(st.integers(1, 700)))
    chunks = [as_chunk(s) for m in messages for s in slicer.slice(encode(m))]
    order = data.draw(st.permutations(chunks), "order")
    reassembler = Reassembler(receiver, session.limits)
    done = [m for m in (reassembler.add(c) for c in order) if m is not None]
    assert sorted(done, key=encode_bytes) == sorted(messages, key=encode_bytes)
    assert reassembler.pending == 0


def test_chunks_survive_a_decoder_and_a_learner_reassembles_them(wire: WireKit) -> None:
    from yeto_proto import FrameDecoder

    stream = b"".join(chunk_bytes(s) for s in ChunkSlicer(1, 64).slice(encode(BCAST)))
    decoder = FrameDecoder(Role.LEARNER, limits=LIMITS)
    decoder.feed(stream)
    chunks = decoder.frames()
    assert all(isinstance(c, Chunk) for c in chunks) and len(chunks) == 5
    reassembler = Reassembler(Role.LEARNER, LIMITS)
    results = [reassembler.add(c) for c in chunks if isinstance(c, Chunk)]
    assert results[-1] == BCAST


# -- every reassembly rule ----------------------------------------------------------------------


def test_rule_empty_chunk() -> None:
    expect(
        ErrorCode.CHUNK_EMPTY, Reassembler(Role.LEARNER, LIMITS), Chunk(0, 281, 0, memoryview(b""))
    )


@pytest.mark.parametrize(
    ("offset", "size", "total"), [(0, 30, 29), (270, 12, 281), (1 << 63, 1, 281)]
)
def test_rule_out_of_bounds(offset: int, size: int, total: int) -> None:
    chunk = Chunk(0, total, offset, zeros(size))
    expect(ErrorCode.CHUNK_OUT_OF_BOUNDS, Reassembler(Role.LEARNER, LIMITS), chunk)


def test_rule_total_changes_within_a_message() -> None:
    a, b, *_ = slices(BCAST, 4)
    changed = Chunk(b.msg_id, b.total_len + 1, b.offset, b.data)
    expect(ErrorCode.CHUNK_TOTAL_CHANGED, Reassembler(Role.LEARNER, LIMITS), a, changed)


@pytest.mark.parametrize("receiver", list(Role), ids=lambda r: r.value)
def test_rule_total_beyond_the_inner_limit(receiver: Role) -> None:
    # Inner limit = 13 + the largest limit of the striped messages this receiver gets.
    if receiver is Role.LEARNER:  # BCAST 12 + 4*64, FINAL_FRAGMENT 12 + 4*64
        inner_limit = 13 + 12 + 4 * 64
    else:  # INIT 4 + 4*64, PUSH 48 + 4*64
        inner_limit = 13 + 48 + 4 * 64
    assert Reassembler(receiver, LIMITS).add(Chunk(0, inner_limit, 0, memoryview(b"x"))) is None
    expect(
        ErrorCode.CHUNK_TOTAL_TOO_LARGE,
        Reassembler(receiver, LIMITS),
        Chunk(0, inner_limit + 1, 0, memoryview(b"x")),
    )


def test_rule_total_beyond_this_machine_within_a_giant_limit() -> None:
    giant = Limits.of(WireDtype.F32, WireLayout((WireFragment(MergeMode.AVG, (1 << 61,)),)))
    for total in (1 << 62, 1 << 63):
        expect(
            ErrorCode.CHUNK_TOTAL_TOO_LARGE,
            Reassembler(Role.LEARNER, giant),
            Chunk(0, total, 0, memoryview(b"x")),
        )


def test_rule_total_shorter_than_a_header() -> None:
    expect(
        ErrorCode.BAD_INNER_FRAME,
        Reassembler(Role.LEARNER, LIMITS),
        Chunk(0, 12, 0, memoryview(b"x")),
    )


@pytest.mark.parametrize(
    ("start", "size"),
    [
        (0, 100),  # exact duplicate of the first chunk
        (50, 10),  # inside it
        (90, 20),  # straddles its end
        (0, 281),  # covers everything
        (99, 1),  # its last byte
    ],
)
def test_rule_overlap(start: int, size: int) -> None:
    first = Chunk(0, 281, 0, zeros(100))
    expect(
        ErrorCode.CHUNK_OVERLAP,
        Reassembler(Role.LEARNER, LIMITS),
        first,
        Chunk(0, 281, start, zeros(size)),
    )


def test_rule_overlap_with_a_later_span_and_neighbours_that_touch() -> None:
    reassembler = Reassembler(Role.LEARNER, LIMITS)
    assert reassembler.add(Chunk(0, 281, 200, zeros(81))) is None
    assert reassembler.add(Chunk(0, 281, 100, zeros(100))) is None  # touches, does not overlap
    expect(ErrorCode.CHUNK_OVERLAP, reassembler, Chunk(0, 281, 0, zeros(101)))


BIG_LIMITS = Limits.of(WireDtype.F32, WireLayout((WireFragment(MergeMode.AVG, (4096,)),)))


def test_rule_too_fragmented_counts_separate_ranges_only() -> None:
    message = BcastFragment(0, 2, np.arange(4096, dtype="<f4").data)
    raw = encode_bytes(message)  # 16,409 bytes: room for 4,096 one-byte ranges with gaps
    total = len(raw)

    def one_byte(offset: int) -> Chunk:
        return Chunk(0, total, offset, memoryview(raw)[offset : offset + 1])

    # One byte at a time, in order or backwards: touching ranges merge, nothing is refused.
    for order in (range(total), reversed(range(total))):
        reassembler = Reassembler(Role.LEARNER, BIG_LIMITS)
        results = [reassembler.add(one_byte(i)) for i in order]
        assert results[-1] == message and not any(results[:-1])
    # Every other byte first: the 4,097th separate range is one too many.
    reassembler = Reassembler(Role.LEARNER, BIG_LIMITS)
    for offset in range(0, 2 * MAX_CHUNK_RANGES, 2):
        assert reassembler.add(one_byte(offset)) is None
    expect(ErrorCode.CHUNK_OVERLAP, reassembler, one_byte(0))  # rule 8 before rule 9
    assert reassembler.add(one_byte(1)) is None  # joins two ranges: fewer, not more
    assert reassembler.add(one_byte(2 * MAX_CHUNK_RANGES + 2)) is None  # back to 4,096
    expect(ErrorCode.CHUNK_TOO_FRAGMENTED, reassembler, one_byte(2 * MAX_CHUNK_RANGES + 4))


@pytest.mark.parametrize("total_len", [13, 4 * MiB, 4 * MiB + 1, 1 << 40, (1 << 44) + 7])
def test_rule_too_fragmented_never_refuses_4_mib_slicing(total_len: int) -> None:
    # At most one range per 4 MiB slice, whatever the arrival order, against a cap of at least 2x.
    slices_needed = -(-total_len // (4 * MiB))
    assert max(MAX_CHUNK_RANGES, 2 * slices_needed) >= slices_needed + 1


def test_rule_at_most_64_partial_messages() -> None:
    reassembler = Reassembler(Role.LEARNER, LIMITS)
    for msg_id in range(64):
        assert reassembler.add(Chunk(msg_id, 281, 0, zeros(10))) is None
    assert reassembler.pending == 64
    expect(ErrorCode.TOO_MANY_PARTIALS, reassembler, Chunk(64, 281, 0, zeros(10)))
    # More chunks of a message already partial are fine; finishing one frees a slot.
    whole = slices(BcastFragment(0, 1, zeros(40)), 2)
    fresh = Reassembler(Role.LEARNER, LIMITS)
    for msg_id in range(1, 64):
        fresh.add(Chunk(msg_id, 281, 0, zeros(10)))
    assert fresh.add(whole[0]) is None and fresh.pending == 64
    assert fresh.add(Chunk(5, 281, 10, zeros(10))) is None
    assert fresh.add(whole[1]) == BcastFragment(0, 1, zeros(40))
    assert fresh.add(Chunk(99, 281, 0, zeros(10))) is None


def test_messages_whose_bytes_all_arrived_are_not_partial_before_they_are_handed_over() -> None:
    """A decoder reserves every CHUNK of one read before the reassembler hands any message on:
    a burst of more than 64 small complete messages in one write is not 64 partials."""
    from yeto_proto import FrameDecoder

    message = BcastFragment(0, 1, zeros(40))
    slicer = ChunkSlicer(1)  # one CHUNK per message, msg_ids 0, 1, 2, ...
    wire = b"".join(
        chunk_bytes(piece) for _ in range(200) for piece in slicer.slice(encode(message))
    )
    reassembler = Reassembler(Role.LEARNER, LIMITS)
    decoder = FrameDecoder(Role.LEARNER, limits=LIMITS, chunk_sink=reassembler)
    decoder.feed(wire)  # one read: every envelope is reserved before any add()
    chunks = list(decoder.frames())
    assert len(chunks) == 200 and reassembler.pending == 200
    assert all(isinstance(c, Chunk) and reassembler.add(c) == message for c in chunks)
    assert reassembler.pending == 0


def test_a_reserved_complete_message_id_is_an_overlap_whatever_its_total() -> None:
    reassembler = Reassembler(Role.LEARNER, LIMITS)
    reassembler.chunk_target(0, 53, 0, 53)  # all of message 0, its data still being read
    for total in (53, 60):  # rule 7 never sees it: the message is complete
        with pytest.raises(RemoteProtocolError) as caught:
            reassembler.chunk_target(0, total, 0, 10)
        assert caught.value.code is ErrorCode.CHUNK_OVERLAP
    # A message with bytes still to come counts against the cap; a complete one does not.
    for msg_id in range(1, 65):
        reassembler.chunk_target(msg_id, 281, 0, 10)
    with pytest.raises(RemoteProtocolError) as caught:
        reassembler.chunk_target(65, 281, 0, 10)
    assert caught.value.code is ErrorCode.TOO_MANY_PARTIALS


def _inner(frame: bytes) -> Chunk:
    return Chunk(0, len(frame), 0, memoryview(frame))


def test_rule_inner_magic() -> None:
    frame = bytearray(encode_bytes(BCAST))
    frame[0] ^= 0xFF
    expect(ErrorCode.BAD_INNER_FRAME, Reassembler(Role.LEARNER, LIMITS), _inner(bytes(frame)))


@pytest.mark.parametrize("delta", [-1, 1, -13, 1 << 40])
def test_rule_inner_len_is_total_minus_13(delta: int) -> None:
    frame = bytearray(encode_bytes(BCAST))
    struct.pack_into("<Q", frame, 5, len(frame) - 13 + delta)
    expect(ErrorCode.BAD_INNER_FRAME, Reassembler(Role.LEARNER, LIMITS), _inner(bytes(frame)))


@pytest.mark.parametrize(
    ("inner", "receiver"),
    [
        (encode_bytes(PullReq(0, 1, 1)), Role.LEARNER),
        (encode_bytes(Heartbeat(0, 1)), Role.SYNCER),
        (encode_bytes(Chunk(0, 29, 0, memoryview(encode_bytes(PullReq(0, 1, 1))))), Role.LEARNER),
        (
            bytes([*encode_bytes(PullReq(0, 1, 1))[:4], 77]) + encode_bytes(PullReq(0, 1, 1))[5:],
            Role.LEARNER,
        ),
    ],
)
def test_rule_inner_type_is_never_striped(inner: bytes, receiver: Role) -> None:
    expect(ErrorCode.BAD_INNER_FRAME, Reassembler(receiver, LIMITS), _inner(inner))


@pytest.mark.parametrize(
    ("message", "receiver"),
    [
        (BCAST, Role.SYNCER),
        (FinalFragment(0, 1, zeros(40)), Role.SYNCER),
        (PushFragment(0, 0, 5, 1, 4, 10, 2, 100, zeros(40)), Role.LEARNER),
        (InitParams(0, zeros(40)), Role.LEARNER),
    ],
)
def test_rule_inner_wrong_direction(message: AnyMessage, receiver: Role) -> None:
    expect(ErrorCode.WRONG_DIRECTION, Reassembler(receiver, LIMITS), *slices(message, 2))


def test_inner_frames_are_checked_like_frames() -> None:
    wrong_fragment = BcastFragment(2, 1, zeros(40))
    expect(ErrorCode.BAD_FRAGMENT_ID, Reassembler(Role.LEARNER, LIMITS), *slices(wrong_fragment, 2))
    wrong_length = BcastFragment(0, 1, zeros(36))
    expect(ErrorCode.BAD_TENSOR_LENGTH, Reassembler(Role.LEARNER, LIMITS), *slices(wrong_length, 3))
    with pytest.raises(RemoteProtocolError) as caught:
        decode_inner_frame(b"\xde\xc0\x70", Role.LEARNER, LIMITS)
    assert caught.value.code is ErrorCode.BAD_INNER_FRAME


def test_clear_drops_partial_messages() -> None:
    reassembler = Reassembler(Role.LEARNER, LIMITS)
    first, *rest = slices(BCAST, 4)
    assert reassembler.add(first) is None
    assert reassembler.add(Chunk(7, 281, 0, zeros(5))) is None
    assert reassembler.pending == 2
    reassembler.clear()
    assert reassembler.pending == 0
    # The same chunk is new again (no overlap), and the message completes from scratch.
    results = [reassembler.add(c) for c in (first, *rest)]
    assert results[-1] == BCAST and reassembler.pending == 0


def test_a_completed_message_id_is_never_accepted_again() -> None:
    reassembler = Reassembler(Role.LEARNER, LIMITS)
    results = [reassembler.add(c) for c in slices(BCAST, 3)]
    assert results[-1] == BCAST
    with pytest.raises(RemoteProtocolError) as info:
        reassembler.add(slices(BCAST, 3)[0])
    assert info.value.code is ErrorCode.CHUNK_OVERLAP


def test_ids_completed_out_of_order_are_remembered() -> None:
    slicer = ChunkSlicer(2, slice_size=40)
    messages = [slicer.slice(encode(BCAST)) for _ in range(3)]
    as_chunks = [[as_chunk(part) for part in parts] for parts in messages]
    reassembler = Reassembler(Role.LEARNER, LIMITS)
    for chunk in as_chunks[1] + as_chunks[0]:
        reassembler.add(chunk)
    for replay in (as_chunks[0][0], as_chunks[1][-1]):
        with pytest.raises(RemoteProtocolError) as info:
            reassembler.add(replay)
        assert info.value.code is ErrorCode.CHUNK_OVERLAP
    assert [reassembler.add(c) for c in as_chunks[2]][-1] == BCAST


def _whole(msg_id: int, message: AnyMessage = BCAST) -> Chunk:
    inner = encode_bytes(message)
    return Chunk(msg_id, len(inner), 0, inner)


def test_what_a_group_remembers_of_completed_ids_stays_bounded_when_an_id_is_skipped() -> None:
    # Remembering every completed id above the first one missing (a peer that starts at 1)
    # grew by an entry per message for as long as the group lived.
    reassembler = Reassembler(Role.LEARNER, LIMITS)
    count = 2 * MSG_ID_WINDOW + 10
    for msg_id in range(1, count + 1):
        assert reassembler.add(_whole(msg_id)) == BCAST
    remembered = reassembler._completed._bits  # noqa: SLF001 - the state this bounds
    assert remembered.bit_length() <= 2 * MSG_ID_WINDOW
    for replay in (count, count - MSG_ID_WINDOW + 1, 0, 5):  # recent, window's edge, far below
        with pytest.raises(RemoteProtocolError) as info:
            reassembler.add(_whole(replay))
        assert info.value.code is ErrorCode.CHUNK_OVERLAP


def test_an_id_within_the_window_that_never_came_is_new() -> None:
    reassembler = Reassembler(Role.LEARNER, LIMITS)
    top = MSG_ID_WINDOW
    assert reassembler.add(_whole(top)) == BCAST
    assert reassembler.add(_whole(top - MSG_ID_WINDOW + 1)) == BCAST  # 65,535 below: new
    with pytest.raises(RemoteProtocolError) as info:
        reassembler.add(_whole(top - MSG_ID_WINDOW))  # 65,536 below: counts as completed
    assert info.value.code is ErrorCode.CHUNK_OVERLAP


def test_a_partial_message_far_below_the_window_still_completes() -> None:
    first, *rest = slices(BCAST, 3)  # msg_id 0
    reassembler = Reassembler(Role.LEARNER, LIMITS)
    assert reassembler.add(first) is None
    for msg_id in range(1, MSG_ID_WINDOW + 10):
        assert reassembler.add(_whole(msg_id)) == BCAST
    assert [reassembler.add(c) for c in rest][-1] == BCAST
    with pytest.raises(RemoteProtocolError) as info:
        reassembler.add(first)
    assert info.value.code is ErrorCode.CHUNK_OVERLAP


# -- CHUNK data placed by the decoder ------------------------------------------------------------
def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, np.uint8).__array_interface__["data"][0])


def _striped_streams(message: AnyMessage, streams: int, slice_size: int) -> list[bytes]:
    """The bytes each of ``streams`` data sockets carries for one striped message."""
    out = [b""] * streams
    for striped in ChunkSlicer(streams, slice_size).slice(encode(message)):
        out[striped.stream_idx] += chunk_bytes(striped)
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.large_base_example])
@given(
    streams=st.integers(1, 3),
    slice_size=st.integers(24, 300),
    cuts=st.lists(st.integers(1, 97), min_size=1, max_size=8),
    order=st.randoms(use_true_random=False),
)
def test_placed_chunks_reassemble_exactly_as_copied_ones(
    streams: int, slice_size: int, cuts: list[int], order: object
) -> None:
    from yeto_proto import FrameDecoder

    wires = _striped_streams(PUSH, streams, slice_size)
    reassembler = Reassembler(Role.SYNCER, LIMITS)
    decoders = [
        FrameDecoder(Role.SYNCER, limits=LIMITS, enforce_first_frame=False, chunk_sink=reassembler)
        for _ in wires
    ]
    positions = [0] * len(wires)
    results: list[AnyMessage] = []
    pending = [i for i, wire in enumerate(wires) if wire]
    step = itertools.cycle(cuts)
    while pending:
        i = order.choice(pending)  # type: ignore[attr-defined]
        piece = wires[i][positions[i] : positions[i] + next(step)]
        positions[i] += len(piece)
        decoders[i].feed(piece)
        for item in decoders[i].frames():
            assert isinstance(item, Chunk)
            done = reassembler.add(item)
            if done is not None:
                results.append(done)
        if positions[i] == len(wires[i]):
            pending.remove(i)
    assert results == [PUSH]
    assert reassembler.pending == 0


def test_a_placed_chunk_lands_in_the_message_buffer_without_a_copy() -> None:
    from yeto_proto import FrameDecoder

    (wire,) = _striped_streams(BCAST, 1, 100)
    reassembler = Reassembler(Role.LEARNER, LIMITS)
    decoder = FrameDecoder(Role.LEARNER, limits=LIMITS, chunk_sink=reassembler)
    decoder.feed(wire[: 13 + 24])  # header and envelope: now the data's place is known
    target = decoder.writable()
    assert target is not None and len(target) == 100
    target[:] = wire[13 + 24 : 13 + 24 + 100]  # as recv_into would
    decoder.wrote(100)
    (first,) = decoder.frames()
    assert isinstance(first, Chunk) and _address(first.data) == _address(target)
    assert reassembler.add(first) is None
    decoder.feed(wire[13 + 24 + 100 :])
    last = None
    for item in decoder.frames():
        assert isinstance(item, Chunk)
        last = reassembler.add(item)
    assert last == BCAST


def test_the_decoder_names_the_chunk_being_placed_and_how_much_of_it_is_in() -> None:
    from yeto_proto import FrameDecoder

    (wire,) = _striped_streams(BCAST, 1, 100)
    reassembler = Reassembler(Role.LEARNER, LIMITS)
    decoder = FrameDecoder(Role.LEARNER, limits=LIMITS, chunk_sink=reassembler)
    assert decoder.placed_chunk() is None  # nothing known yet
    decoder.feed(wire[:13])
    assert decoder.placed_chunk() is None  # the envelope is not in: no place yet
    decoder.feed(wire[13 : 13 + 24])
    target = decoder.writable()
    assert target is not None
    for filled in (0, 60):
        placed = decoder.placed_chunk()
        assert placed is not None
        chunk, now_in = placed
        msg_id, total, offset = struct.unpack_from("<QQQ", wire, 13)
        assert (chunk.msg_id, chunk.total_len, chunk.offset, now_in) == (
            msg_id,
            total,
            offset,
            filled,
        )
        assert len(chunk.data) == 100 and _address(chunk.data) == _address(target)
        decoder.wrote(60 - filled)
    decoder.wrote(40)  # the rest: the CHUNK is handed on and no longer being placed
    assert decoder.placed_chunk() is None
    (done,) = decoder.frames()
    assert isinstance(done, Chunk) and done.offset == offset


def test_a_placed_chunk_is_refused_as_soon_as_its_envelope_is_in() -> None:
    from yeto_proto import FrameDecoder

    (wire,) = _striped_streams(BCAST, 1, 100)
    reassembler = Reassembler(Role.LEARNER, LIMITS)
    first, second = (
        FrameDecoder(Role.LEARNER, limits=LIMITS, chunk_sink=reassembler) for _ in range(2)
    )
    first.feed(wire[: 13 + 24 + 10])  # its data is still arriving ...
    second.feed(wire[: 13 + 24])  # ... when another socket claims the same bytes
    with pytest.raises(RemoteProtocolError) as caught:
        second.next_frame()
    assert caught.value.code is ErrorCode.CHUNK_OVERLAP
    with pytest.raises(RemoteProtocolError):  # poisoned: raised again
        second.next_frame()


def test_a_copied_chunk_cannot_pass_for_a_placed_one() -> None:
    # Same msg_id and offset as a reserved chunk but data from elsewhere: an overlap.
    from yeto_proto import FrameDecoder

    (wire,) = _striped_streams(BCAST, 1, 100)
    reassembler = Reassembler(Role.LEARNER, LIMITS)
    decoder = FrameDecoder(Role.LEARNER, limits=LIMITS, chunk_sink=reassembler)
    decoder.feed(wire[: 13 + 24])
    msg_id, total, offset = struct.unpack_from("<QQQ", wire, 13)
    forged = Chunk(msg_id, total, offset, memoryview(wire)[13 + 24 : 13 + 24 + 100])
    expect(ErrorCode.CHUNK_OVERLAP, reassembler, forged)
