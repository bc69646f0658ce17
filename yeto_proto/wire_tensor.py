"""A received tensor kept in its wire encoding and decoded one range at a time.

A bf16 or q4 PUSH decoded up front is a fragment-sized f32 array per learner (2× or 8× its wire
bytes), written once and read once. A consumer that walks the values in cache-sized blocks
anyway (the syncer's merge) can instead decode each block into a small buffer as it goes:
:class:`WireTensor` checks the bytes when it is made (length, q4 scales) and answers
:meth:`WireTensor.all_finite` without decoding; :meth:`WireTensor.decode_range` then yields
exactly the f32 values :func:`~yeto_proto.dtypes.decode_tensor` would, range by range.
"""

from __future__ import annotations

import threading

import numpy as np
from numpy.typing import NDArray

from .constants import Q4_BLOCK_VALUES, WireDtype
from .dtypes import (
    BytesLike,
    _byte_view,
    _q4_parts,
    bf16_to_f32,
    decode_tensor,
    q4_decode_range,
    tensor_nbytes,
)
from .errors import ErrorCode, RemoteProtocolError

__all__ = ["WireTensor"]

_U16 = np.dtype("<u2")
#: bf16 bit patterns with every exponent bit set are the infinities and NaNs.
_BF16_EXPONENT = 0x7F80
#: Values checked per pass of the bf16 finiteness scan (stays in cache).
_SCAN_VALUES = 1 << 18


class _Scratch(threading.local):
    """Per-thread work buffers: q4 gather indexes and a bf16 scan buffer."""

    def __init__(self) -> None:
        self.index = np.empty((0, 64), np.intp)
        self.scan = np.empty(_SCAN_VALUES, _U16)

    def q4_index(self, blocks: int) -> NDArray[np.intp]:
        if self.index.shape[0] < blocks:
            self.index = np.empty((blocks, 64), np.intp)
        return self.index


_SCRATCH = _Scratch()


class WireTensor:
    """``numel`` f32 values held as the wire bytes of a PUSH or bulk tensor (never copied).

    Construction checks the byte length (``BAD_TENSOR_LENGTH``) and, for q4, every block's
    scale (``BAD_Q4_SCALE``). f32 data is better used as a plain array view; this class takes
    bf16 and q4 only.
    """

    __slots__ = ("dtype", "numel", "push", "_raw", "_scales", "_codes")

    def __init__(self, data: BytesLike, dtype: WireDtype, numel: int, *, push: bool) -> None:
        dtype = WireDtype(dtype)
        if dtype is WireDtype.F32:
            raise ValueError("f32 tensors are used as arrays: decode_tensor returns a view")
        raw = _byte_view(data)
        expected = tensor_nbytes(dtype, numel, push=push)
        if raw.size != expected:
            raise RemoteProtocolError(
                ErrorCode.BAD_TENSOR_LENGTH,
                f"{dtype.name} tensor of {numel} values must be {expected} bytes, got {raw.size}",
            )
        self.dtype, self.numel, self.push = dtype, numel, push
        self._raw = raw
        self._scales: NDArray[np.float32] | None = None
        self._codes: NDArray[np.uint16] | None = None
        if self.is_q4:
            self._scales, self._codes = _q4_parts(raw)

    @property
    def is_q4(self) -> bool:
        return self.dtype is WireDtype.Q4 and self.push

    @property
    def size(self) -> int:
        return self.numel

    @property
    def nbytes(self) -> int:
        return int(self._raw.size)

    def all_finite(self) -> bool:
        """No value is NaN or infinite (read from the bits; nothing is decoded).

        q4 values are ``±2^(L−7)·scale`` with L ≤ 7, never above their block's scale, so valid
        (finite) scales are enough; bf16 is scanned for all-ones exponents.
        """
        if self.is_q4:
            return True
        bits = self._raw.view(_U16)
        scan = _SCRATCH.scan
        for start in range(0, bits.size, _SCAN_VALUES):
            block = bits[start : start + _SCAN_VALUES]
            masked = scan[: block.size]
            np.bitwise_and(block, _BF16_EXPONENT, out=masked)
            if (masked == _BF16_EXPONENT).any():
                return False
        return True

    def decode_range(self, start: int, stop: int, out: NDArray[np.float32]) -> None:
        """Write values ``start:stop`` into ``out`` (``stop − start`` f32).

        For q4, ``start`` must be a multiple of 256 (a block boundary); any ``stop`` works.
        """
        if not 0 <= start <= stop <= self.numel or out.size != stop - start:
            raise ValueError(f"range {start}:{stop} of {self.numel} into {out.size} values")
        if not self.is_q4:
            bf16_to_f32(self._raw.view(_U16)[start:stop], out=out)
            return
        if start % Q4_BLOCK_VALUES:
            raise ValueError(f"q4 ranges start on a block boundary, not at {start}")
        assert self._codes is not None and self._scales is not None
        index = _SCRATCH.q4_index(max((stop - start) // Q4_BLOCK_VALUES, 1))
        q4_decode_range(self._codes, self._scales, start, stop, out, index)

    def decode(self, out: NDArray[np.float32] | None = None) -> NDArray[np.float32]:
        """Every value, as :func:`~yeto_proto.dtypes.decode_tensor` gives them."""
        return decode_tensor(self._raw, self.dtype, self.numel, push=self.push, out=out)
