"""The syncer's recycled f32 arrays: reused only when nothing refers to them any more."""

from __future__ import annotations

import numpy as np

from yeto_proto.constants import MergeMode
from yeto_proto.layout import WireFragment, WireLayout
from yeto_sync.coordinator.arrays import ArrayPool

LAYOUT = WireLayout((WireFragment(MergeMode.AVG, (1 << 16,)), WireFragment(MergeMode.AVG, (64,))))


def address(array: np.ndarray) -> int:
    return int(array.__array_interface__["data"][0])


def test_an_idle_array_is_handed_out_again() -> None:
    pool = ArrayPool(LAYOUT, learners=2)
    first = pool.take(1 << 16)
    assert first.dtype == np.float32 and first.shape == (1 << 16,) and first.flags.writeable
    where = address(first)
    del first
    assert address(pool.take(1 << 16)) == where


def test_an_array_still_referenced_even_by_a_view_is_never_reused() -> None:
    pool = ArrayPool(LAYOUT, learners=2)
    held = pool.take(1 << 16)
    held[:] = 7.0
    view = held[10:20]
    del held
    other = pool.take(1 << 16)
    assert not np.shares_memory(other, view)
    other[:] = 0.0
    assert (view == 7.0).all()


def test_idle_memory_is_bounded_by_learners_plus_three_fragments() -> None:
    pool = ArrayPool(LAYOUT, learners=1)
    held = [pool.take(1 << 16) for _ in range(8)]
    del held
    pool.take(1 << 16)  # a take lets go of idle arrays beyond the bound
    assert pool.held_bytes <= (1 + 3) * (1 << 16) * 4 + (1 << 16) * 4


def test_bf16_broadcast_bytes_come_from_the_pool_and_match_the_codec() -> None:
    from yeto_proto.constants import WireDtype
    from yeto_proto.dtypes import encode_tensor
    from yeto_sync.coordinator.tensors import bcast_message

    pool = ArrayPool(LAYOUT, learners=2)
    params = np.linspace(-3, 3, 1 << 16, dtype=np.float32)
    message = bcast_message(0, 4, params, WireDtype.BF16, pool.take_bytes)
    expected = encode_tensor(params, WireDtype.BF16, push=False)
    assert bytes(message.data) == expected.tobytes()
    where = address(np.frombuffer(message.data, np.uint8))
    del message
    again = bcast_message(0, 5, params * 2, WireDtype.BF16, pool.take_bytes)
    assert address(np.frombuffer(again.data, np.uint8)) == where  # the sent bytes' buffer again
