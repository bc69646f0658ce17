"""Reusable receive buffers.

A frame's payload, and the messages decoded from it, are views of one buffer. Writing the next
frame of the same size into a buffer the process has already touched is about twice as fast as
into fresh memory (no page faults), so decoders take their buffers from a pool that hands a
buffer out again once nothing refers to it any more. "Nothing refers to it" is read from the
buffer's CPython reference count: every memoryview or numpy view of a buffer keeps it referenced,
so a buffer is reused only when no message, array or view made from it is alive. Elsewhere
(no ``sys.getrefcount``) the pool simply allocates.
"""

from __future__ import annotations

import sys

import numpy as np
from numpy.typing import NDArray

from .constants import ALLOCATION_CEILING

#: The boundary :meth:`BufferPool.take` aligns to: a cache line, and any SIMD width numpy uses.
ALIGNMENT = 64
#: Below this many bytes (by default) a buffer is not pooled.
SMALL_BUFFER = 64 << 10
#: References a buffer has while only the pool holds it: the pool's list and getrefcount's own.
_IDLE_REFERENCES = 2
_CAN_COUNT = hasattr(sys, "getrefcount")


class BufferPool:
    """Hands out uninitialized byte buffers, reusing idle ones of a fitting size.

    ``max_tracked`` bounds how many buffers the pool watches; ``max_idle_bytes`` bounds how much
    idle memory it keeps for reuse (idle buffers beyond it are let go). With ``keep_overlap``,
    a pool that once had more than that in use while it handed out another buffer keeps up to
    that much instead: frames that overlap (a BCAST on one socket while the last one's CHUNKs
    finish on another, pushes of two fragments in flight) need that many buffers every time,
    and a buffer let go is one the next overlap takes from fresh memory, zeroed page by page
    inside ``recv_into``. The process held that memory at its peak anyway. Requests below
    ``min_size`` bytes are plain allocations.
    """

    def __init__(
        self,
        max_tracked: int = 8,
        max_idle_bytes: int = 64 << 20,
        min_size: int = SMALL_BUFFER,
        *,
        keep_overlap: bool = True,
    ) -> None:
        self.max_tracked = max_tracked
        self.min_size = min_size
        self.max_idle_bytes = max_idle_bytes
        self.keep_overlap = keep_overlap
        self._tracked: list[NDArray[np.uint8]] = []
        #: The most bytes in use while another buffer was asked for.
        self._peak_busy_bytes = 0

    def take(self, size: int, *, align_at: int = 0) -> memoryview:
        """A writable view of ``size`` uninitialized bytes.

        In a view of :attr:`min_size` bytes or more, byte ``align_at`` sits on an
        :data:`ALIGNMENT`-byte boundary: a frame's tensor starts at an odd offset (61 in a
        PUSH), and numpy reads unaligned f32 values at about half speed, so a receiver aligns
        the tensor rather than the frame. Raises ``MemoryError`` when ``size`` is beyond
        :data:`ALLOCATION_CEILING` or the machine.
        """
        if size > ALLOCATION_CEILING:
            raise MemoryError(size)
        if size < self.min_size or size == 0:
            # Small buffers come from malloc's heap, which recycles them for free; keeping them
            # out of the pool also means a control frame between two big frames never makes
            # the pool let go of the big idle buffer the next big frame wants.
            return np.empty(size, dtype=np.uint8).data
        padded = size + ALIGNMENT - 1
        if not _CAN_COUNT:
            return _aligned_view(np.empty(padded, dtype=np.uint8), size, align_at)
        busy = [sys.getrefcount(b) > _IDLE_REFERENCES + 1 for b in self._tracked]  # +1: b
        busy_bytes = sum(b.nbytes for b, in_use in zip(self._tracked, busy, strict=True) if in_use)
        if self.keep_overlap:
            self._peak_busy_bytes = max(self._peak_busy_bytes, busy_bytes)
        max_idle = max(self.max_idle_bytes, self._peak_busy_bytes)
        reuse: NDArray[np.uint8] | None = None
        idle_bytes = 0
        keep: list[NDArray[np.uint8]] = []
        for buffer, in_use in zip(self._tracked, busy, strict=True):
            if in_use:
                keep.append(buffer)
            elif reuse is None and padded <= buffer.nbytes <= 2 * size:
                reuse = buffer
                keep.append(buffer)
            elif idle_bytes + buffer.nbytes <= max_idle:
                idle_bytes += buffer.nbytes
                keep.append(buffer)
        if reuse is None:
            reuse = np.empty(padded, dtype=np.uint8)
            if len(keep) < self.max_tracked:
                keep.append(reuse)
        self._tracked = keep
        return _aligned_view(reuse, size, align_at)

    @property
    def tracked_bytes(self) -> int:
        return sum(b.nbytes for b in self._tracked)


def buffer_address(view: memoryview) -> int:
    """Where a byte view's first byte lives: tells a view of a known buffer from a copy."""
    return int(np.frombuffer(view, dtype=np.uint8).__array_interface__["data"][0])


def _aligned_view(buffer: NDArray[np.uint8], size: int, align_at: int) -> memoryview:
    """``size`` bytes of ``buffer`` (``size + ALIGNMENT - 1`` long at least) whose byte
    ``align_at`` starts on an :data:`ALIGNMENT` boundary."""
    skip = -(buffer.ctypes.data + align_at) % ALIGNMENT
    return buffer[skip : skip + size].data
