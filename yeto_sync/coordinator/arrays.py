"""Recycled f32 arrays for the model's per-round work.

Every round needs fragment-sized arrays: the new params and momentum, the merged Δ of rounds
that store it (rda, iso, corrections), decoded pushes for those, and bf16 broadcast bytes.
Fresh 64 MiB arrays are page-faulted in on first touch, which on this class of machine costs
as much as the arithmetic itself; reusing the arrays of an earlier round whose references are
all gone avoids that. "Gone" is read from CPython's reference counts by
:class:`yeto_proto.buffers.BufferPool`: an array still held by a broadcast in flight, a
checkpoint being written or any view is never handed out again, so the model's "stored arrays
are never written" rule still holds.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from yeto_proto.buffers import BufferPool
from yeto_proto.layout import WireLayout

from ..merge import F32Array

_F32_BYTES = 4
#: Idle arrays kept per largest fragment beyond the members' pushes: Δ, params, momentum.
_STEP_ARRAYS = 3


class ArrayPool:
    """Hands out uninitialized flat f32 arrays, reusing idle ones of a fitting size.

    Sized for one session: it keeps at most ``learners + 3`` largest-fragment arrays idle
    (a decoded push per member where a round needs them, plus one round's Δ, params and
    momentum), so the memory it holds back is bounded by what a round needs anyway.
    """

    def __init__(self, layout: WireLayout, learners: int) -> None:
        largest = max((fragment.numel for fragment in layout.fragments), default=0)
        spare = learners + _STEP_ARRAYS
        self._bytes = BufferPool(
            max_tracked=2 * len(layout.fragments) + 2 * spare,
            max_idle_bytes=spare * largest * _F32_BYTES,
            keep_overlap=False,  # the bound above already covers a round's overlap
        )

    def take(self, numel: int) -> F32Array:
        """An uninitialized writable f32 array of ``numel`` values."""
        array: F32Array = np.frombuffer(self._bytes.take(numel * _F32_BYTES), dtype=np.float32)
        return array

    def take_bytes(self, nbytes: int) -> NDArray[np.uint8]:
        """An uninitialized writable byte array (a bf16 broadcast's wire bytes, say)."""
        return np.frombuffer(self._bytes.take(nbytes), dtype=np.uint8)

    @property
    def held_bytes(self) -> int:
        """Bytes of every array the pool still tracks, in use or idle."""
        return self._bytes.tracked_bytes
