"""The transport's NaN/inf verdict on striped f32 tensors, CHUNK by CHUNK, equals a full check."""

from __future__ import annotations

import struct

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
from yeto_sync.transport.finite_scan import MAX_TRACKED, FiniteScan

NUMEL = 97
LIMITS = Limits.of(WireDtype.F32, WireLayout((WireFragment(MergeMode.AVG, (NUMEL,)),)))
SPECIALS = (np.nan, np.inf, -np.inf)


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


def push_of(values: np.ndarray) -> PushFragment:
    return PushFragment(0, 0, 3, 1, 2, 7, 1, 10, values.astype("<f4").data)


@settings(max_examples=300, deadline=None)
@given(
    bad_at=st.one_of(st.none(), st.integers(0, NUMEL - 1)),
    special=st.sampled_from(SPECIALS),
    slice_size=st.integers(1, 450),
    seed=st.integers(0, 2**32 - 1),
    init=st.booleans(),
)
def test_the_verdict_equals_a_full_check_for_any_slicing_and_arrival_order(
    bad_at: int | None, special: float, slice_size: int, seed: int, init: bool
) -> None:
    rng = np.random.default_rng(seed)
    values = rng.normal(0, 1e30, NUMEL).astype(np.float32)  # finite, some sums overflow
    if bad_at is not None:
        values[bad_at] = special
    message: AnyMessage = InitParams(0, values.data) if init else push_of(values)
    pieces = len(chunks_of(message, slice_size))
    order = [int(i) for i in rng.permutation(pieces)]
    assert scanned(message, slice_size, order) is (bad_at is None)


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
