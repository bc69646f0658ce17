"""The receive-buffer pool reuses a buffer only once nothing made from it is alive."""

from __future__ import annotations

import numpy as np
import pytest

from yeto_proto import BcastFragment, FrameDecoder, Limits, MergeMode, Role, WireDtype, encode_bytes
from yeto_proto import buffers as buffers_module
from yeto_proto.buffers import BufferPool
from yeto_proto.constants import ALLOCATION_CEILING
from yeto_proto.layout import WireFragment, WireLayout


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def test_a_released_buffer_is_handed_out_again() -> None:
    pool = BufferPool(min_size=1)
    first = pool.take(1000)
    at = _address(first)
    del first
    assert _address(pool.take(1000)) == at


def test_a_buffer_with_a_live_view_is_never_reused() -> None:
    pool = BufferPool(min_size=1)
    first = pool.take(1000)
    derived = np.frombuffer(first[10:20], dtype=np.uint8)  # a view of a slice of the buffer
    at = _address(first)
    del first
    second = pool.take(1000)
    assert _address(second) != at
    second[:] = b"\xff" * 1000
    assert derived.base is not None  # still alive and untouched by the second frame
    del derived


def test_sizes_far_from_the_request_are_not_reused() -> None:
    pool = BufferPool(min_size=1)
    big = pool.take(10_000)
    at = _address(big)
    del big
    assert _address(pool.take(100)) != at  # more than twice the request: not a fit


def test_idle_memory_is_bounded() -> None:
    pool = BufferPool(max_tracked=8, max_idle_bytes=3000, min_size=1)
    for size in (1000, 2000, 4000, 8000):
        pool.take(size)  # each released at once
    assert pool.tracked_bytes <= 3000 + 8000


class _CountingNumpy:
    """numpy as the pool sees it, counting the buffers it allocates."""

    def __init__(self) -> None:
        self.allocations = 0

    def __getattr__(self, name: str) -> object:
        return getattr(np, name)

    def empty(self, *args: object, **kwargs: object) -> object:
        self.allocations += 1
        return np.empty(*args, **kwargs)  # type: ignore[call-overload]


@pytest.fixture
def allocations(monkeypatch: pytest.MonkeyPatch) -> _CountingNumpy:
    counting = _CountingNumpy()
    monkeypatch.setattr(buffers_module, "np", counting)
    return counting


def test_buffers_that_were_in_use_together_are_all_kept_for_the_next_overlap(
    allocations: _CountingNumpy,
) -> None:
    # Two frames in flight at once (a BCAST while the last one's CHUNKs finish): both buffers
    # stay pooled beyond max_idle_bytes, so the next overlap takes no fresh memory.
    pool = BufferPool(max_idle_bytes=1000, min_size=1)
    for _ in range(3):
        first = pool.take(3000)
        second = pool.take(3000)
        del first, second
    assert allocations.allocations == 2
    assert pool.tracked_bytes == 2 * (3000 + 63)


def test_a_pool_without_keep_overlap_holds_to_its_idle_bound(allocations: _CountingNumpy) -> None:
    pool = BufferPool(max_idle_bytes=1000, min_size=1, keep_overlap=False)
    for _ in range(3):
        first = pool.take(3000)
        second = pool.take(3000)
        del first, second
    assert allocations.allocations == 4  # the second of each pair after the first is fresh


def test_a_buffer_used_alone_is_not_kept_beyond_the_idle_bound(
    allocations: _CountingNumpy,
) -> None:
    pool = BufferPool(max_idle_bytes=1000, min_size=1)
    pool.take(3000)  # released at once: never two in use
    pool.take(5000)  # no fit: fresh, and the idle 3000-byte one is let go
    assert allocations.allocations == 2
    assert pool.tracked_bytes == 5000 + 63


def test_a_small_buffer_between_two_big_ones_does_not_evict_the_idle_big_one() -> None:
    pool = BufferPool(max_idle_bytes=1 << 20)  # below the big buffer: idle ones beyond go
    big = pool.take(2 << 20)
    at = _address(big)
    del big
    pool.take(100)  # a control frame: not pooled, so the idle big buffer stays
    assert _address(pool.take(2 << 20)) == at


def test_absurd_sizes_fail_before_allocating() -> None:
    with pytest.raises(MemoryError):
        BufferPool(min_size=1).take(ALLOCATION_CEILING + 1)


def test_decoded_messages_keep_their_bytes_while_later_frames_arrive() -> None:
    layout = WireLayout((WireFragment(MergeMode.AVG, (256,)),))
    decoder = FrameDecoder(Role.LEARNER, limits=Limits.of(WireDtype.F32, layout))
    held = []
    for version in range(5):
        values = np.full(256, version, dtype="<f4")
        decoder.feed(encode_bytes(BcastFragment(0, version, values.data)))
        message = decoder.next_frame()
        assert isinstance(message, BcastFragment)
        held.append(message)
    for version, message in enumerate(held):
        assert np.all(np.frombuffer(message.data, dtype="<f4") == version)


@pytest.mark.parametrize("align_at", [0, 1, 13, 61, 64, 100])
def test_pooled_buffers_put_the_asked_byte_on_a_64_byte_boundary(align_at: int) -> None:
    pool = BufferPool(min_size=1)
    for size in (1000, 1000, 999, 5000):  # fresh, reused, reused for a smaller frame, fresh
        view = pool.take(size, align_at=align_at)
        assert len(view) == size
        assert (_address(view) + align_at) % 64 == 0
        del view


def test_a_striped_push_lands_with_its_tensor_aligned() -> None:
    from yeto_proto import ChunkSlicer, PushFragment, Reassembler, encode

    numel = 50_000  # bulk: its reassembly buffer comes from the pool
    layout = WireLayout((WireFragment(MergeMode.AVG, (numel,)),))
    limits = Limits.of(WireDtype.F32, layout)
    values = np.arange(numel, dtype="<f4")
    push = PushFragment(0, 0, 1, 1, 0, 1, 1, 10, values.data)
    decoder = FrameDecoder(Role.SYNCER, limits=limits, enforce_first_frame=False)
    decoder.chunk_sink = reassembler = Reassembler(Role.SYNCER, limits)
    for piece in ChunkSlicer(1, slice_size=1 << 16).slice(encode(push)):
        decoder.feed(b"".join(bytes(b) for b in piece.buffers))
    done = [reassembler.add(chunk) for chunk in decoder.frames()]  # type: ignore[arg-type]
    inner = done[-1]
    assert isinstance(inner, PushFragment)
    tensor = np.frombuffer(inner.data, dtype="<f4")
    assert tensor.ctypes.data % 64 == 0 and tensor.flags.aligned
    assert np.array_equal(tensor, values)
