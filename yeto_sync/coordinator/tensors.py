"""Wire tensors in and out of the coordinator: decode and check once; encode once.

A PUSH stays in its receive buffer: f32 as an array view (the merge folds in the sign of
Δ = −d), bf16 and q4 as wire bytes the merge decodes block by block. Every outgoing fragment is
encoded once per version (into a recycled buffer) and shared by all groups it goes to.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
from numpy.typing import NDArray

from yeto_proto.constants import WireDtype
from yeto_proto.dtypes import all_finite, decode_tensor, encode_tensor, tensor_nbytes
from yeto_proto.errors import ErrorCode, RemoteProtocolError
from yeto_proto.messages import BcastFragment, FinalFragment
from yeto_proto.wire_tensor import WireTensor

from ..merge import F32Array, Pushed


@contextmanager
def _codec_errors() -> Iterator[None]:
    """A codec's ValueError/TypeError is the peer's bad tensor: a protocol error, not a crash."""
    try:
        yield
    except (ValueError, TypeError) as exc:
        raise RemoteProtocolError(ErrorCode.BAD_TENSOR_LENGTH, str(exc)) from exc


def _require_finite(known: bool | None, check: Callable[[], bool]) -> None:
    """NaN/inf refuse a tensor; ``known`` is the transport's verdict from arrival, if any."""
    if not (check() if known is None else known):
        raise RemoteProtocolError(ErrorCode.NON_FINITE_VALUE, "tensor holds NaN or inf")


def _decode(
    data: memoryview, dtype: WireDtype, numel: int, *, push: bool, finite: bool | None
) -> F32Array:
    with _codec_errors():
        decoded = decode_tensor(data, dtype, numel, push=push)
    array: F32Array = np.asarray(decoded, dtype=np.float32).reshape(-1)
    if array.size != numel:
        raise RemoteProtocolError(
            ErrorCode.BAD_TENSOR_LENGTH, f"decoded {array.size} values, expected {numel}"
        )
    _require_finite(finite if dtype is WireDtype.F32 else None, lambda: all_finite(array))
    return array


def _owned(array: F32Array) -> bool:
    return bool(array.flags.writeable and array.flags.owndata and array.flags.c_contiguous)


def decode_init(
    data: memoryview, dtype: WireDtype, numel: int, *, finite: bool | None = None
) -> F32Array:
    """INIT tensor as an owned f32 array (never a view into a receive buffer).

    ``finite``: the transport's verdict on an f32 tensor's NaN/inf, when it checked on arrival.
    """
    array = _decode(data, dtype, numel, push=False, finite=finite)
    return array if _owned(array) else array.copy()


def decode_push(
    data: memoryview, dtype: WireDtype, numel: int, *, finite: bool | None = None
) -> Pushed:
    """PUSH payload d = local − anchor, checked: length, q4 scales, finiteness.

    f32 is a read-only array view of the frame; bf16 and q4 stay in their wire bytes (a
    :class:`WireTensor`, decoded block by block by the merge). Either way the frame's buffer
    stays referenced until the round is merged, and nothing fragment-sized is allocated.
    ``finite`` as for :func:`decode_init`.
    """
    if dtype is WireDtype.F32:
        return _decode(data, dtype, numel, push=True, finite=finite)
    with _codec_errors():
        pushed = WireTensor(data, dtype, numel, push=True)
    _require_finite(None, pushed.all_finite)
    return pushed


def bcast_message(
    fragment: int,
    version: int,
    params: F32Array,
    dtype: WireDtype,
    allocate_bytes: Callable[[int], NDArray[np.uint8]] | None = None,
) -> BcastFragment:
    """BCAST in the session's bulk dtype (bf16 for q4 sessions).

    f32 is a view of ``params``; bf16 is encoded into ``allocate_bytes(n)`` when given.
    """
    out = None
    if dtype is not WireDtype.F32 and allocate_bytes is not None:
        out = allocate_bytes(tensor_nbytes(dtype, params.size, push=False))
    return BcastFragment(fragment, version, encode_tensor(params, dtype, push=False, out=out).data)


def bcast_bf16_target(
    dtype: WireDtype, numel: int, allocate_bytes: Callable[[int], NDArray[np.uint8]]
) -> NDArray[np.uint16] | None:
    """Where a merge writes the next BCAST's bf16 payload, or None in an f32 session.

    The BCAST is bf16 in bf16 and q4 sessions alike, so the commit can encode it as it steps
    (``merge_round(params_bf16=...)``) instead of in a second pass over the new params.
    """
    if dtype is WireDtype.F32:
        return None
    return allocate_bytes(tensor_nbytes(dtype, numel, push=False)).view(np.uint16)


def bcast_of_bf16(fragment: int, version: int, bits: NDArray[np.uint16]) -> BcastFragment:
    """BCAST whose payload is the bf16 bit patterns a merge wrote (:func:`bcast_bf16_target`)."""
    return BcastFragment(fragment, version, bits.view(np.uint8).data)


def final_fragment_message(fragment: int, version: int, params: F32Array) -> FinalFragment:
    """FINAL_FRAGMENT: always little-endian f32, straight from the stored array."""
    little = np.ascontiguousarray(params, dtype="<f4")
    return FinalFragment(fragment, version, little.view(np.uint8).data)
