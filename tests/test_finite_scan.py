"""The transport's NaN/inf verdict on f32 tensors, taken as the bytes land, equals a full check."""

from __future__ import annotations

import struct
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from yeto_proto import (
    AnyMessage,
    Chunk,
    ChunkSlicer,
    FinalAck,
    InitParams,
    Limits,
    MergeMode,
    PushFragment,
    Reassembler,
    Role,
    WireDtype,
    WireFragment,
    WireLayout,
    encode,
)
from yeto_proto.constants import FrameType
from yeto_proto.dtypes import all_finite
from yeto_proto.frames import decode_payload
from yeto_sync.transport import finite_scan
from yeto_sync.transport.finite_scan import MAX_TRACKED, FiniteScan

NUMEL = 97
LIMITS = Limits.of(WireDtype.F32, WireLayout((WireFragment(MergeMode.AVG, (NUMEL,)),)))
SPECIALS = (np.nan, np.inf, -np.inf)
#: Undone after every test (hypothesis runs many examples inside one test function).
_PATCH = pytest.MonkeyPatch()


@pytest.fixture(autouse=True)
def _undo_patches() -> Iterator[None]:
    yield
    _PATCH.undo()


def chunks_of(message: AnyMessage, slice_size: int) -> list[Chunk]:
    """The Chunks a receiver decodes from ``message`` sliced into ``slice_size`` pieces."""
    out = []
    for striped in ChunkSlicer(2, slice_size=slice_size).slice(encode(message)):
        raw = b"".join(bytes(b) for b in striped.buffers)
        assert raw[4] == FrameType.CHUNK
        msg_id, total, offset = struct.unpack_from("<QQQ", raw, 13)
        out.append(Chunk(msg_id, total, offset, memoryview(raw)[13 + 24 :]))
    return out


def scanned(message: AnyMessage, slice_size: int, order: list[int] | None = None) -> bool | None:
    """Reassemble ``message`` from its chunks (in ``order``) as the syncer's groups do."""
    chunks = chunks_of(message, slice_size)
    if order is not None:
        chunks = [chunks[i] for i in order]
    reassembler, scan = Reassembler(Role.SYNCER, LIMITS), FiniteScan()
    for chunk in chunks:
        inner = reassembler.add(chunk)
        scan.chunk_done(chunk)
        if inner is not None:
            assert inner == message
            return scan.verdict(chunk.msg_id, inner)
    raise AssertionError("the message never completed")


def count_checked_values() -> list[int]:
    """From now until the test ends, how many values each bulk check of the scan looked at."""
    counts: list[int] = []

    def counting(values: np.ndarray) -> bool:
        counts.append(values.size)
        return all_finite(values)

    _PATCH.setattr(finite_scan, "all_finite", counting)
    return counts


def push_of(values: np.ndarray) -> PushFragment:
    return PushFragment(0, 0, 3, 1, 2, 7, 1, 10, values.astype("<f4").data)


def scanned_read_by_read(
    message: AnyMessage, slice_size: int, rng: np.random.Generator
) -> bool | None:
    """As :func:`scanned`, but each CHUNK's data lands in reads of random size, the reads of
    different CHUNKs interleaved, into a target whose bytes not yet read are NaN patterns."""
    chunks = chunks_of(message, slice_size)
    reads: list[tuple[int, int]] = []  # (chunk, bytes in after the read), each chunk in order
    for i, chunk in enumerate(chunks):
        cuts = sorted({int(c) for c in rng.integers(1, len(chunk.data) + 1, size=3)})
        reads += [(i, cut) for cut in [*cuts[:-1], len(chunk.data)] if cut]
    order = rng.permutation(len(reads))
    # Interleave the chunks' reads at random, keeping each chunk's own reads in order.
    by_chunk = [[cut for i, cut in reads if i == c] for c in range(len(chunks))]
    sequence = sorted(range(len(reads)), key=lambda r: order[r])
    owners = [reads[r][0] for r in sequence]
    targets = [bytearray(b"\xff" * len(chunk.data)) for chunk in chunks]
    filled = [0] * len(chunks)
    reassembler, scan = Reassembler(Role.SYNCER, LIMITS), FiniteScan()
    for i in owners:
        chunk, target = chunks[i], targets[i]
        upto = by_chunk[i].pop(0)
        target[filled[i] : upto] = chunk.data[filled[i] : upto]
        filled[i] = upto
        landing = Chunk(chunk.msg_id, chunk.total_len, chunk.offset, memoryview(target))
        scan.chunk_progress(landing, upto)
        if upto < len(chunk.data):
            continue
        inner = reassembler.add(landing)
        scan.chunk_done(landing)
        if inner is not None:
            assert inner == message
            return scan.verdict(chunk.msg_id, inner)
    raise AssertionError("the message never completed")


@pytest.mark.parametrize("read_by_read", [False, True], ids=["whole CHUNKs", "read by read"])
@settings(max_examples=300, deadline=None)
@given(
    bad_at=st.one_of(st.none(), st.integers(0, NUMEL - 1)),
    special=st.sampled_from(SPECIALS),
    slice_size=st.integers(1, 450),
    seed=st.integers(0, 2**32 - 1),
    init=st.booleans(),
)
def test_the_verdict_equals_a_full_check_for_any_slicing_and_arrival_order(
    read_by_read: bool, bad_at: int | None, special: float, slice_size: int, seed: int, init: bool
) -> None:
    rng = np.random.default_rng(seed)
    values = rng.normal(0, 1e30, NUMEL).astype(np.float32)  # finite, some sums overflow
    if bad_at is not None:
        values[bad_at] = special
    message: AnyMessage = InitParams(0, values.data) if init else push_of(values)
    checked = count_checked_values()
    if read_by_read:
        # Bytes not yet read hold NaN patterns: a check that looked past a read would fail this.
        verdict = scanned_read_by_read(message, slice_size, rng)
    else:
        order = [int(i) for i in rng.permutation(len(chunks_of(message, slice_size)))]
        verdict = scanned(message, slice_size, order)
    assert verdict is (bad_at is None)
    assert sum(checked) <= NUMEL  # no value is checked twice


@pytest.mark.parametrize("landed", [np.float32(0.0), np.float32(np.nan)])
def test_values_are_judged_as_they_landed_and_not_read_again(landed: np.float32) -> None:
    values = np.zeros(NUMEL, np.float32)
    values[40] = landed
    (whole,) = chunks_of(push_of(values), 1 << 12)  # one CHUNK
    target = bytearray(whole.data)
    landing = Chunk(whole.msg_id, whole.total_len, whole.offset, memoryview(target))
    scan = FiniteScan()
    scan.chunk_progress(landing, len(target))
    # Later changes to bytes already checked (which a peer cannot make) are not seen: the
    # check ran when they landed, while they were in cache, and is not repeated.
    flipped = np.frombuffer(target, np.float32, NUMEL, 13 + 48)
    flipped[40] = np.float32(0.0) if np.isnan(landed) else np.float32(np.inf)
    scan.chunk_done(landing)
    inner = Reassembler(Role.SYNCER, LIMITS).add(landing)
    assert inner is not None
    assert scan.verdict(whole.msg_id, inner) is bool(np.isfinite(landed))


def frame_read_in_place(
    message: AnyMessage, cuts: list[int], copied_head: int, copied_tail: int
) -> tuple[FiniteScan, AnyMessage]:
    """``message`` unstriped, as a socket reads its payload: a head and a tail that come through
    the decoder's copy (no progress reported), in-place reads in between ending at ``cuts``."""
    raw = b"".join(bytes(b) for b in encode(message))
    payload_bytes = raw[13:]
    payload = memoryview(bytearray(b"\xff" * len(payload_bytes)))  # NaN patterns until read
    scan = FiniteScan()
    tail_from = len(payload) - copied_tail
    ends = sorted({min(max(c, copied_head), tail_from) for c in cuts} | {tail_from})
    payload[:copied_head] = payload_bytes[:copied_head]
    filled = copied_head
    frame_type = FrameType(raw[4])
    for end in ends:
        payload[filled:end] = payload_bytes[filled:end]
        filled = end
        scan.frame_progress(frame_type, payload, filled)
    payload[filled:] = payload_bytes[filled:]
    return scan, decode_payload(frame_type, payload, limits=LIMITS)


@settings(max_examples=200, deadline=None)
@given(
    bad_at=st.one_of(st.none(), st.integers(0, NUMEL - 1)),
    special=st.sampled_from(SPECIALS),
    cuts=st.lists(st.integers(0, 500), max_size=6),
    copied_head=st.integers(0, 200),
    copied_tail=st.integers(0, 200),
    init=st.booleans(),
)
def test_an_unstriped_frame_read_in_place_gets_the_full_checks_verdict(
    bad_at: int | None,
    special: float,
    cuts: list[int],
    copied_head: int,
    copied_tail: int,
    init: bool,
) -> None:
    values = np.linspace(-3e38, 3e38, NUMEL, dtype=np.float32)
    if bad_at is not None:
        values[bad_at] = special
    message: AnyMessage = InitParams(0, values.data) if init else push_of(values)
    payload_size = sum(len(b) for b in encode(message)) - 13
    copied_head = min(copied_head, payload_size)
    copied_tail = min(copied_tail, payload_size - copied_head)
    checked = count_checked_values()
    scan, received = frame_read_in_place(message, cuts, copied_head, copied_tail)
    assert received == message
    assert scan.frame_verdict(received) is (bad_at is None)
    assert scan.frame_verdict(received) is None  # the verdict is given once
    assert sum(checked) <= NUMEL  # no value is checked twice
    if bad_at is None:
        assert sum(checked) == NUMEL


def test_an_unstriped_frame_not_followed_gets_no_verdict() -> None:
    values = np.zeros(NUMEL, np.float32)
    scan, received = frame_read_in_place(push_of(values), [100], 0, 0)
    assert scan.frame_verdict(FinalAck(3)) is None  # not a tensor frame: and forgotten
    assert scan.frame_verdict(received) is None
    scan, _ = frame_read_in_place(push_of(values), [100], 0, 0)
    assert scan.frame_verdict(push_of(values)) is None  # a tensor from another buffer
    scan = FiniteScan()
    raw = b"".join(bytes(b) for b in encode(FinalAck(3)))
    scan.frame_progress(FrameType.FINAL_ACK, memoryview(bytearray(raw[13:])), 5)
    assert scan.frame_verdict(push_of(values)) is None


def test_a_value_split_across_two_chunks_is_checked_when_the_message_is_whole() -> None:
    values = np.zeros(NUMEL, np.float32)
    start = 13 + 48  # PUSH header + fixed fields: the tensor's first byte in the message
    values[10] = np.nan
    split = start + 10 * 4 + 2  # cut the NaN in two
    assert scanned(push_of(values), split) is False
    values[10] = 0.0
    assert scanned(push_of(values), split) is True


def test_frames_without_an_f32_tensor_get_no_verdict() -> None:
    scan = FiniteScan()
    raw = b"".join(bytes(b) for b in encode(FinalAck(3)))
    scan.chunk_done(Chunk(9, len(raw), 0, memoryview(raw)))
    assert scan.verdict(9, FinalAck(3)) is None
    junk = Chunk(4, 8, 0, memoryview(b"\xff" * 8))  # not a frame type at all
    scan.chunk_done(junk)
    assert scan.verdict(4, FinalAck(3)) is None
    assert scan.verdict(123, FinalAck(3)) is None  # never seen


@pytest.mark.parametrize("backwards", [False, True])
def test_a_message_in_countless_tiny_chunks_gets_no_verdict_and_bounded_state(
    backwards: bool,
) -> None:
    numel = 1000
    limits = Limits.of(WireDtype.F32, WireLayout((WireFragment(MergeMode.AVG, (numel,)),)))
    message = push_of(np.arange(numel, dtype=np.float32))
    chunks = chunks_of(message, 1)  # 1-byte slices: most values straddle a boundary
    assert len(chunks) > MAX_TRACKED
    reassembler, scan = Reassembler(Role.SYNCER, limits), FiniteScan()
    inner = None
    # Forwards every boundary splits a value; backwards the frame type comes last: all wait.
    for chunk in reversed(chunks) if backwards else chunks:
        inner = reassembler.add(chunk)
        scan.chunk_done(chunk)
        state = scan._scans.get(chunk.msg_id)
        assert state is None or len(state.waiting) + len(state.straddling) <= MAX_TRACKED
    assert inner == message
    assert scan.verdict(chunks[0].msg_id, inner) is None
