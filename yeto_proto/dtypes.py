"""Tensor codecs of the three wire dtypes: f32, bf16 and q4 (block-scaled E3M0).

``spec/dtypes.md`` is the normative description; this module implements it with vectorized
numpy, working through big arrays in cache-sized blocks (one pass of several small numpy ops
per block is about twice as fast as the same ops over a whole 256 MiB array).

Which dtype a frame carries: INIT and BCAST carry the session's bulk dtype (bf16 in a q4
session), PUSH carries the session dtype (q4 blocks in a q4 session), and FINAL_FRAGMENT is
always f32. :func:`encode_tensor`, :func:`decode_tensor` and :func:`tensor_nbytes` take the
session dtype and ``push`` and apply that rule.

Decoders only check what the bytes themselves can violate (length, q4 scales). Whether decoded
values are finite is the caller's rule (the syncer rejects non-finite INIT and PUSH values);
:func:`all_finite` answers it quickly.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Final, TypeAlias

import numpy as np
from numpy.typing import NDArray

from .constants import Q4_BLOCK_BYTES, Q4_BLOCK_VALUES, WireDtype
from .errors import ErrorCode, LocalProtocolError, RemoteProtocolError

try:  # optional: a compiled f32 -> bf16 cast about 1.5x faster than the pure-numpy one
    from ml_dtypes import bfloat16 as _ml_bfloat16

    _ML_BFLOAT16: type[np.generic] | None = _ml_bfloat16
except ImportError:  # pragma: no cover - exercised by forcing the fallback in tests
    _ML_BFLOAT16 = None

__all__ = [
    "BF16_OVERFLOW",
    "BytesLike",
    "Q4_LEVEL_THRESHOLDS",
    "all_finite",
    "bf16_backend",
    "bf16_to_f32",
    "decode_tensor",
    "encode_tensor",
    "f32_to_bf16",
    "proven_finite",
    "q4_decode",
    "q4_encode",
    "q4_nbytes",
    "tensor_nbytes",
]

#: Anything that exposes contiguous bytes: what frame decoders hand over, or a uint8 array.
BytesLike: TypeAlias = bytes | bytearray | memoryview | NDArray[np.uint8]

# Wire byte order is little-endian; every bit-level view names it explicitly so the codecs stay
# correct (if slower) on a big-endian host.
_F32 = np.dtype("<f4")
_I32 = np.dtype("<i4")
_U16 = np.dtype("<u2")
_U32 = np.dtype("<u4")
_U64 = np.dtype("<u8")

#: Values per block of work for the elementwise passes (1 MiB of f32: stays in L2).
_BLOCK_VALUES = 1 << 18
#: q4 blocks per block of work (the same 256 Ki values).
_Q4_BLOCKS_PER_STEP = _BLOCK_VALUES // Q4_BLOCK_VALUES

_F32_ABS_MASK = 0x7FFF_FFFF
_F32_INF_BITS = 0x7F80_0000
_BF16_QUIET_BIT = 0x0040

#: The smallest f32 magnitude that rounds to a bf16 infinity: (2 − 2⁻⁸)·2¹²⁷, halfway between
#: the largest bf16 (0x7F7F) and 2¹²⁸, a tie that goes to the even 0x7F80. A finite f32 at or
#: beyond it is finite in a checkpoint and infinite in a bf16 BCAST.
BF16_OVERFLOW: Final = np.frombuffer((0x7F7F_8000).to_bytes(4, "little"), _F32)[0]

# -- q4 levels -----------------------------------------------------------------------------------
# The pinned encoder computes, in f32, L = clamp(round_half_even(log2(r)) + 7, 0, 7) for the
# ratio r = |x| / scale in [0, 1]. L is a non-decreasing step function of r, so it equals the
# number of thresholds r has reached: threshold j is the smallest f32 r with level >= j. They sit
# a few ulps from 2^(j - 7.5), where the f32 log2 lands exactly on a half and round-half-even
# decides; e.g. log2f(0x3F3504F3) is exactly -0.5, which rounds to 0 (level 7), whereas
# log2f(0x3EB504F3) is exactly -1.5, which rounds to -2 (level 5). Derived with a correctly
# rounded log2f and checked against glibc's log2f for every f32 r in (0, 1].
_Q4_THRESHOLD_BITS = (
    0x3C35_04F2,  # level >= 1
    0x3CB5_04F6,  # level >= 2
    0x3D35_04F2,  # level >= 3
    0x3DB5_04F5,  # level >= 4
    0x3E35_04F3,  # level >= 5
    0x3EB5_04F4,  # level >= 6
    0x3F35_04F3,  # level >= 7
)
#: The thresholds as f32 values, shape (7,): ``level(r) = sum(r >= Q4_LEVEL_THRESHOLDS)``.
Q4_LEVEL_THRESHOLDS: NDArray[np.float32] = np.array(_Q4_THRESHOLD_BITS, dtype=_U32).view(_F32)
Q4_LEVEL_THRESHOLDS.flags.writeable = False
_Q4_THRESHOLD_COLUMN = Q4_LEVEL_THRESHOLDS.reshape(7, 1)
_Q4_SIGN_BIT = 0x8


# -- small helpers -------------------------------------------------------------------------------
def _byte_view(data: BytesLike | NDArray[Any]) -> NDArray[np.uint8]:
    """A flat uint8 view of ``data`` (no copy)."""
    if isinstance(data, np.ndarray):
        if not data.flags.c_contiguous:
            raise TypeError("tensor bytes must be C-contiguous")
        return data.reshape(-1).view(np.uint8)
    return np.frombuffer(data, dtype=np.uint8)


def _f32_flat(x: NDArray[Any]) -> NDArray[np.float32]:
    """``x`` as a flat little-endian f32 array; a view when it already is one."""
    return np.ascontiguousarray(x, dtype=_F32).reshape(-1)


def _output(out: NDArray[Any] | None, dtype: np.dtype[Any], size: int) -> NDArray[Any]:
    """``out`` checked to hold ``size`` values of ``dtype`` in place, or a new array."""
    if out is None:
        return np.empty(size, dtype=dtype)
    if out.dtype != dtype or out.size != size:
        raise ValueError(f"out must hold {size} values of {dtype}, got {out.size} of {out.dtype}")
    if not (out.flags.c_contiguous and out.flags.writeable):
        raise ValueError("out must be C-contiguous and writeable")
    return out


def _flat(array: NDArray[Any]) -> NDArray[Any]:
    """A flat view of an array :func:`_output` accepted (C-contiguous, so never a copy)."""
    return array.reshape(-1)


# -- bf16 ----------------------------------------------------------------------------------------
def bf16_backend() -> str:
    """Which f32 -> bf16 implementation :func:`f32_to_bf16` uses (for benchmark reports)."""
    return "ml_dtypes" if _ML_BFLOAT16 is not None else "numpy"


def _round_to_bf16_numpy(
    bits: NDArray[np.uint32], dest: NDArray[np.uint16], scratch: NDArray[np.uint32]
) -> None:
    """Round-to-nearest-even on the bit patterns: add 0x7FFF plus the kept lsb, keep the top half.

    Correct for every non-NaN input (a carry out of the mantissa correctly steps the exponent,
    up to infinity); NaNs are patched by the caller.
    """
    np.right_shift(bits, 16, out=scratch)
    np.bitwise_and(scratch, 1, out=scratch)
    np.add(scratch, 0x7FFF, out=scratch)
    np.add(scratch, bits, out=scratch)
    np.right_shift(scratch, 16, out=dest, casting="same_kind")


def f32_to_bf16(
    x: NDArray[np.float32], *, out: NDArray[np.uint16] | None = None
) -> NDArray[np.uint16]:
    """bf16 bit patterns of ``x`` (flattened), rounded to nearest, ties to even.

    Overflow rounds to infinity as IEEE requires; a NaN stays a NaN with its sign and the top of
    its payload, and its quiet bit set (``(bits >> 16) | 0x0040``).
    """
    flat = _f32_flat(x)
    result = _output(out, _U16, flat.size)
    dest = _flat(result)
    bits = flat.view(_U32)
    cast_to = _ML_BFLOAT16
    scratch = None if cast_to is not None else np.empty(min(_BLOCK_VALUES, flat.size), _U32)
    with np.errstate(all="ignore"):  # the casts flag NaN and overflow; both are handled here
        for start in range(0, flat.size, _BLOCK_VALUES):
            stop = min(start + _BLOCK_VALUES, flat.size)
            chunk, chunk_dest = flat[start:stop], dest[start:stop]
            if cast_to is not None:
                np.copyto(chunk_dest.view(cast_to), chunk, casting="unsafe")
            else:
                assert scratch is not None
                _round_to_bf16_numpy(bits[start:stop], chunk_dest, scratch[: stop - start])
            if np.isnan(chunk.max()):  # max propagates NaN: one cheap pass over cached data
                where = np.flatnonzero(np.isnan(chunk))
                chunk_dest[where] = (bits[start:stop][where] >> 16) | _BF16_QUIET_BIT
    return result


def bf16_to_f32(
    bits: BytesLike | NDArray[np.uint16], *, out: NDArray[np.float32] | None = None
) -> NDArray[np.float32]:
    """f32 values of bf16 data: bit patterns (uint16 array) or little-endian bytes; exact."""
    if isinstance(bits, np.ndarray) and bits.dtype.kind == "u" and bits.dtype.itemsize == 2:
        source = np.ascontiguousarray(bits).reshape(-1)
    else:
        raw = _byte_view(bits)
        if raw.size % 2:
            raise RemoteProtocolError(
                ErrorCode.BAD_TENSOR_LENGTH, f"bf16 data of odd length {raw.size}"
            )
        source = raw.view(_U16)
    result = _output(out, _F32, source.size)
    dest = _flat(result).view(_U32)
    for start in range(0, source.size, _BLOCK_VALUES):
        stop = min(start + _BLOCK_VALUES, source.size)
        # Widening copy then an in-place shift: about twice as fast as one casting shift.
        np.copyto(dest[start:stop], source[start:stop])
        np.left_shift(dest[start:stop], 16, out=dest[start:stop])
    return result


# -- q4 ------------------------------------------------------------------------------------------
def q4_nbytes(numel: int) -> int:
    """Exact q4 payload size: ``ceil(numel / 256) * 132``."""
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    return -(-numel // Q4_BLOCK_VALUES) * Q4_BLOCK_BYTES


class _Q4EncodeScratch:
    """Reusable per-call buffers for encoding up to ``blocks`` q4 blocks at a time."""

    def __init__(self, blocks: int) -> None:
        values = blocks * Q4_BLOCK_VALUES
        self.magnitude_bits = np.empty(values, _I32)
        self.reached = np.empty((7, values), np.bool_)  # r >= threshold j, one row per level
        self.level = np.empty(values, np.uint8)
        self.negative = np.empty(values, np.bool_)
        self.packed = np.empty(values // 2, _U16)


def _q4_encode_blocks(
    values: NDArray[np.float32], dest: NDArray[np.uint8], scratch: _Q4EncodeScratch
) -> None:
    """Encode whole blocks: ``values`` holds k*256 f32, ``dest`` receives k*132 bytes."""
    blocks = values.size // Q4_BLOCK_VALUES
    n = values.size
    # |x| as bits: integer max is faster than float max and yields the scale's exact bits.
    magnitude_bits = scratch.magnitude_bits[:n]
    np.bitwise_and(values.view(_I32), _F32_ABS_MASK, out=magnitude_bits)
    scale_bits = magnitude_bits.reshape(blocks, Q4_BLOCK_VALUES).max(axis=1)
    if scale_bits.max() >= _F32_INF_BITS:
        block = int(np.argmax(scale_bits >= _F32_INF_BITS))
        raise LocalProtocolError(
            ErrorCode.NON_FINITE_VALUE,
            f"q4 cannot encode a non-finite value (block of values {block * Q4_BLOCK_VALUES}..)",
        )
    scale = scale_bits.view(_F32)
    # An all-zero block keeps scale 0; dividing it by 1 instead gives ratios 0, hence level 0.
    divisor = np.where(scale_bits > 0, scale, np.float32(1.0))
    ratio = magnitude_bits.view(_F32)
    np.divide(
        ratio.reshape(blocks, Q4_BLOCK_VALUES),
        divisor[:, None],
        out=ratio.reshape(blocks, Q4_BLOCK_VALUES),
    )
    # Level = how many thresholds the ratio reached; sum the 0/1 bytes eight at a time.
    reached = scratch.reached[:, :n]
    np.greater_equal(ratio, _Q4_THRESHOLD_COLUMN, out=reached)
    level8 = scratch.level[:n].view(_U64)
    first = reached[0].view(_U64)
    np.add(first, reached[1].view(_U64), out=level8)
    for row in range(2, 7):
        np.add(level8, reached[row].view(_U64), out=level8)
    # The sign bit only where x < 0 and the level is not 0 (where the first threshold was met).
    negative8 = scratch.negative[:n].view(_U64)
    np.less(values, 0, out=scratch.negative[:n])
    np.bitwise_and(negative8, first, out=negative8)
    np.left_shift(negative8, 3, out=negative8)
    np.bitwise_or(level8, negative8, out=level8)
    # Pack: view the nibble bytes as u16 pairs (element 2i low, 2i+1 high); w | w >> 4 has the
    # packed byte in its low 8 bits, which the truncating cast into the block keeps.
    pairs = scratch.level[:n].view(_U16)
    packed = scratch.packed[: n // 2]
    np.right_shift(pairs, 4, out=packed)
    np.bitwise_or(packed, pairs, out=packed)
    by_block = dest.reshape(blocks, Q4_BLOCK_BYTES)
    by_block.view(_U32)[:, 0] = scale_bits
    np.copyto(by_block[:, 4:], packed.reshape(blocks, Q4_BLOCK_BYTES - 4), casting="unsafe")


def q4_encode(x: NDArray[np.float32], *, out: NDArray[np.uint8] | None = None) -> NDArray[np.uint8]:
    """q4 blocks of ``x`` (flattened); the last block is zero-padded.

    Raises :class:`LocalProtocolError` ``NON_FINITE_VALUE`` for a NaN or infinite input (its
    block would need a NaN or infinite scale, which the pin forbids receivers to accept).
    """
    flat = _f32_flat(x)
    numel = flat.size
    result = _output(out, np.dtype(np.uint8), q4_nbytes(numel))
    dest = _flat(result)
    full_blocks, tail = divmod(numel, Q4_BLOCK_VALUES)
    scratch = _Q4EncodeScratch(min(_Q4_BLOCKS_PER_STEP, full_blocks + (tail > 0)))
    for first in range(0, full_blocks, _Q4_BLOCKS_PER_STEP):
        last = min(first + _Q4_BLOCKS_PER_STEP, full_blocks)
        _q4_encode_blocks(
            flat[first * Q4_BLOCK_VALUES : last * Q4_BLOCK_VALUES],
            dest[first * Q4_BLOCK_BYTES : last * Q4_BLOCK_BYTES],
            scratch,
        )
    if tail:
        padded = np.zeros(Q4_BLOCK_VALUES, _F32)
        padded[:tail] = flat[full_blocks * Q4_BLOCK_VALUES :]
        _q4_encode_blocks(padded, dest[full_blocks * Q4_BLOCK_BYTES :], scratch)
    return result


@functools.cache
def _q4_quad_table() -> NDArray[np.float32]:
    """For every u16 of packed q4 data (two bytes, four nibbles), the four decoded multipliers.

    A multiplier is sign * 2^(L-7), and +0.0 for level 0 whatever the sign bit. 65536 x 4 f32
    (1 MiB, it stays in L2) lets one gather produce four values.
    """
    nibble = np.arange(16)
    level = nibble & 7
    magnitude = np.where(level > 0, np.ldexp(1.0, level - 7), 0.0)
    multiplier = np.where(((nibble & _Q4_SIGN_BIT) != 0) & (level > 0), -magnitude, magnitude)
    word = np.arange(1 << 16)
    by_nibble = [multiplier[(word >> shift) & 0xF] for shift in (0, 4, 8, 12)]
    table = np.stack(by_nibble, axis=1).astype(_F32)
    table.flags.writeable = False
    return table


def _q4_decode_blocks(
    codes: NDArray[np.uint16],
    scales: NDArray[np.float32],
    dest: NDArray[np.float32],
    index: NDArray[np.intp],
) -> None:
    """Decode k blocks: ``codes`` is (k, 64) u16 of packed nibbles, ``dest`` receives k*256."""
    blocks = codes.shape[0]
    table = _q4_quad_table()
    block_index = index[:blocks]
    np.copyto(block_index, codes)
    np.take(table, block_index, axis=0, out=dest.reshape(blocks, 64, 4), mode="clip")
    by_block = dest.reshape(blocks, Q4_BLOCK_VALUES)
    np.multiply(by_block, scales[:, None], out=by_block)


def _validated_q4_scales(raw: NDArray[np.uint8], blocks: int) -> NDArray[np.float32]:
    """Every block's scale, or ``BAD_Q4_SCALE`` for the first NaN, infinite or negative one."""
    by_block = raw.reshape(blocks, Q4_BLOCK_BYTES)
    scales = np.ascontiguousarray(by_block[:, :4]).view(_F32).reshape(blocks)
    valid = (scales >= 0) & (scales < np.inf)  # false for NaN, inf and negatives; -0.0 passes
    if not valid.all():
        block = int(np.argmin(valid))
        raise RemoteProtocolError(
            ErrorCode.BAD_Q4_SCALE, f"q4 block {block} has scale {float(scales[block])!r}"
        )
    return scales


def _q4_parts(raw: NDArray[np.uint8]) -> tuple[NDArray[np.float32], NDArray[np.uint16]]:
    """A q4 tensor's validated block scales and its packed codes, (blocks, 64) u16 (views)."""
    blocks = raw.size // Q4_BLOCK_BYTES
    codes = raw.view(_U16).reshape(blocks, Q4_BLOCK_BYTES // 2)[:, 2:]
    return _validated_q4_scales(raw, blocks), codes


def q4_decode_range(
    codes: NDArray[np.uint16],
    scales: NDArray[np.float32],
    start: int,
    stop: int,
    dest: NDArray[np.float32],
    index: NDArray[np.intp],
) -> None:
    """Values ``start:stop`` of a q4 tensor into ``dest``; ``start`` on a block boundary.

    ``index`` is gather scratch with a row per whole block in the range (at least one); a
    range that ends inside a block (only the tensor's last) decodes it whole and keeps the
    head.
    """
    first = start // Q4_BLOCK_VALUES
    whole = (stop - start) // Q4_BLOCK_VALUES
    done = whole * Q4_BLOCK_VALUES
    if whole:
        _q4_decode_blocks(
            codes[first : first + whole], scales[first : first + whole], dest[:done], index
        )
    if start + done < stop:
        padded = np.empty(Q4_BLOCK_VALUES, _F32)
        tail = first + whole
        _q4_decode_blocks(codes[tail : tail + 1], scales[tail : tail + 1], padded, index)
        dest[done:] = padded[: stop - start - done]


def q4_decode(
    buf: BytesLike, numel: int, *, out: NDArray[np.float32] | None = None
) -> NDArray[np.float32]:
    """Values of ``numel`` q4-coded elements: ``sign * 2^(L-7) * scale`` in f32.

    Raises :class:`RemoteProtocolError` ``BAD_TENSOR_LENGTH`` unless ``len(buf)`` is exactly
    :func:`q4_nbytes` ``(numel)``, and ``BAD_Q4_SCALE`` for a NaN, infinite or negative scale.
    A nibble with the sign bit and level 0 (never written by an encoder) decodes to +0.0, and the
    padding nibbles of the last block are ignored; see ``spec/dtypes.md``.
    """
    raw = _byte_view(buf)
    expected = q4_nbytes(numel)
    if raw.size != expected:
        raise RemoteProtocolError(
            ErrorCode.BAD_TENSOR_LENGTH,
            f"q4 data for {numel} values must be {expected} bytes, got {raw.size}",
        )
    scales, codes = _q4_parts(raw)
    result = _output(out, _F32, numel)
    dest = _flat(result)
    index = np.empty((min(_Q4_BLOCKS_PER_STEP, scales.size), 64), np.intp)
    for start in range(0, numel, _BLOCK_VALUES):
        stop = min(start + _BLOCK_VALUES, numel)
        q4_decode_range(codes, scales, start, stop, dest[start:stop], index)
    return result


# -- per frame -----------------------------------------------------------------------------------
def _carries_q4(dtype: WireDtype, push: bool) -> bool:
    return dtype is WireDtype.Q4 and push


def tensor_nbytes(dtype: WireDtype, numel: int, *, push: bool) -> int:
    """Exact tensor bytes of a frame: PUSH (``push=True``) or INIT/BCAST in session ``dtype``.

    FINAL_FRAGMENT is always f32: pass ``WireDtype.F32``.
    """
    dtype = WireDtype(dtype)
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    if _carries_q4(dtype, push):
        return q4_nbytes(numel)
    return numel * dtype.bulk_itemsize


def encode_tensor(
    x_f32: NDArray[np.float32],
    dtype: WireDtype,
    *,
    push: bool,
    out: NDArray[np.uint8] | None = None,
) -> NDArray[np.uint8]:
    """The wire bytes of ``x_f32`` (flattened) in session ``dtype``; see :func:`tensor_nbytes`.

    For f32 the result is a byte view of ``x_f32`` itself when that is already a contiguous
    little-endian f32 array: do not modify the array until the bytes are sent. ``out`` (uint8,
    exactly :func:`tensor_nbytes` long) lets a caller encode straight into a frame buffer.
    """
    dtype = WireDtype(dtype)
    if dtype is WireDtype.F32:
        data = _f32_flat(x_f32).view(np.uint8)
        if out is None:
            return data
        result = _output(out, np.dtype(np.uint8), data.size)
        np.copyto(_flat(result), data)
        return result
    if _carries_q4(dtype, push):
        return q4_encode(x_f32, out=out)
    if out is None:
        return f32_to_bf16(x_f32).view(np.uint8)
    result = _output(out, np.dtype(np.uint8), 2 * np.size(x_f32))
    f32_to_bf16(x_f32, out=_flat(result).view(_U16))
    return result


def decode_tensor(
    buf: BytesLike,
    dtype: WireDtype,
    numel: int,
    *,
    push: bool,
    out: NDArray[np.float32] | None = None,
) -> NDArray[np.float32]:
    """The ``numel`` f32 values a frame's tensor bytes carry in session ``dtype``.

    The length is checked first: :class:`RemoteProtocolError` ``BAD_TENSOR_LENGTH`` unless it is
    exactly :func:`tensor_nbytes`. For f32 without ``out`` the result is a (possibly read-only)
    view of ``buf``, not a copy. Values are not checked for finiteness (see :func:`all_finite`).
    """
    dtype = WireDtype(dtype)
    raw = _byte_view(buf)
    expected = tensor_nbytes(dtype, numel, push=push)
    if raw.size != expected:
        kind = "PUSH" if push else "bulk"
        raise RemoteProtocolError(
            ErrorCode.BAD_TENSOR_LENGTH,
            f"{kind} {dtype.name} tensor of {numel} values must be {expected} bytes, "
            f"got {raw.size}",
        )
    if dtype is WireDtype.F32:
        values = raw.view(_F32)
        if out is None:
            return values
        result = _output(out, _F32, numel)
        np.copyto(_flat(result), values)
        return result
    if _carries_q4(dtype, push):
        return q4_decode(raw, numel, out=out)
    return bf16_to_f32(raw, out=out)


def all_finite(a: NDArray[Any]) -> bool:
    """True when no element of ``a`` is NaN or infinite (one reduction per cached block)."""
    flat = np.asarray(a).reshape(-1)
    if flat.dtype.kind != "f":
        return bool(np.isfinite(flat).all())
    for start in range(0, flat.size, _BLOCK_VALUES):
        block = flat[start : start + _BLOCK_VALUES]
        if not proven_finite(block) and not np.isfinite(block).all():
            return False
    return True


#: Float types whose dot product is one vectorized pass (BLAS); others take a sum.
_DOT_FLOATS = frozenset({np.dtype(np.float32), np.dtype(np.float64)})


def proven_finite(block: NDArray[np.floating]) -> bool:
    """One fast pass over a 1-D float ``block``: True proves every value finite.

    The sum of squares is NaN or infinite whenever a value is (squares are never negative, so
    nothing cancels an infinity). False may also mean the squares of large finite values
    overflowed, so a caller checks exactly before refusing anything. A dot product is used
    because it is the fastest one-pass reduction numpy has on cached f32 (bench_codecs.py
    compares it with ``np.add.reduce``).
    """
    with np.errstate(over="ignore", invalid="ignore"):
        if block.dtype not in _DOT_FLOATS:
            return bool(np.isfinite(np.add.reduce(block)))
        return math.isfinite(float(np.dot(block, block)))
