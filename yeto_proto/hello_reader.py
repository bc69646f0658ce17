"""HELLO payloads read with ``struct``, field by field as :data:`~yeto_proto.schema.HelloPayload`
declares them.

Why not the schema itself: a first frame may legally hold 16 MiB of layout, about 1.29 million
minimal fragments, and construct walks them one Python object at a time (about 30 s and 450 MiB
on the syncer's event loop, before any session check can refuse the peer). This reader makes the
same checks in the same order with the same codes and messages; ``tests/test_hello_reader.py``
holds it to the schema on the conformance vectors and on generated and mutated payloads.

Fragments whose bytes are identical share one :class:`~yeto_proto.layout.WireFragment` (among
the first few thousand distinct records), so the common case, many fragments of a few shapes,
costs a pointer per fragment rather than an object.
"""

from __future__ import annotations

import struct
from typing import NoReturn

import numpy as np

from .constants import DIGEST_SIZE, MAX_STREAMS, PROTOCOL_VERSION, MergeMode, WireDtype
from .errors import ErrorCode, RemoteProtocolError
from .layout import WireFragment, WireLayout
from .messages import BytesLike, Hello
from .schema import MAX_FRAGMENT_NUMEL, learner_out_of_range

_U8 = struct.Struct("<B")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_FRAGMENT_HEAD = struct.Struct("<BI")  # merge_mode, num_tensors
#: The smallest fragment record: merge_mode, num_tensors and one numel.
_MIN_FRAGMENT_BYTES = 13
_ISO = int(MergeMode.ISO)
_MODES = tuple(MergeMode(value) for value in range(_ISO + 1))  # indexed by the wire value
_DTYPES = frozenset(int(d) for d in WireDtype)
#: Distinct fragment records remembered for sharing. Real layouts repeat a few shapes; a layout
#: of all-distinct records would only pay for the table.
_SHARED_RECORDS_MAX = 4096
_TAIL_WITHOUT_PROFILE = 2
_TAIL_WITH_PROFILE = 2 + DIGEST_SIZE
#: protocol_version, learner_id, connection_generation, dtype, num_fragments.
_HEAD_BYTES = _U16.size + _U32.size + _U64.size + _U8.size + _U32.size
#: The bytes of a HELLO payload that are not fragment records: the head, the two digests and
#: the shortest tail.
HELLO_FIXED_BYTES = _HEAD_BYTES + 2 * DIGEST_SIZE + _TAIL_WITHOUT_PROFILE
_IDENTITY = struct.Struct("<IQ")  # learner_id, connection_generation


def hello_identity(payload: BytesLike) -> tuple[int, int]:
    """``(learner_id, generation)`` as a HELLO payload's head states them, not checked (a
    receiver may want them before it reads the HELLO); the payload must hold its head."""
    learner_id, generation = _IDENTITY.unpack_from(payload, _U16.size)
    return int(learner_id), int(generation)


def _refuse(code: ErrorCode, message: str) -> RemoteProtocolError:
    return RemoteProtocolError(code, f"HELLO: {message}")


def _truncated() -> RemoteProtocolError:
    return _refuse(ErrorCode.TRUNCATED_PAYLOAD, "payload ends inside a field")


class _Cursor:
    """Reads little-endian integers from ``data`` and raises TRUNCATED_PAYLOAD past its end."""

    __slots__ = ("data", "end", "pos")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.end = len(data)
        self.pos = 0

    def remaining(self) -> int:
        return self.end - self.pos

    def take(self, layout: struct.Struct) -> int:
        if self.pos + layout.size > self.end:
            raise _truncated()
        (value,) = layout.unpack_from(self.data, self.pos)
        self.pos += layout.size
        return int(value)

    def take_bytes(self, size: int) -> bytes:
        if self.pos + size > self.end:
            raise _truncated()
        self.pos += size
        return self.data[self.pos - size : self.pos]


def read_hello(payload: BytesLike, *, num_learners: int | None = None) -> Hello:
    """Decode a HELLO payload (after any HMAC was checked and stripped) or raise its error code.

    ``num_learners`` bounds ``learner_id`` when given, as the schema's ``num_learners`` does.
    """
    return HelloReading(payload, num_learners=num_learners).advance_all()


class HelloReading:
    """One HELLO payload read a bounded number of fragment records at a time.

    A first frame of 16 MiB can list 1.29 million distinct fragments, seconds of work: a
    receiver serving other peers on the same thread reads it in slices between their turns.
    The head is checked on construction; :meth:`advance` reads whole records until it has read
    ``max_bytes`` of them (at least one record) and returns the :class:`Hello` once the tail is
    read. Checks, their order and their codes are :func:`read_hello`'s whatever the slicing.
    """

    __slots__ = (
        "_cursor",
        "_learner_id",
        "_generation",
        "_dtype",
        "_records_left",
        "_fragments",
        "_seen",
    )

    def __init__(self, payload: BytesLike, *, num_learners: int | None = None) -> None:
        cursor = self._cursor = _Cursor(bytes(payload))
        if cursor.take(_U16) != PROTOCOL_VERSION:
            raise _refuse(ErrorCode.UNSUPPORTED_VERSION, "protocol_version is not 4")
        self._learner_id = cursor.take(_U32)
        if num_learners is not None and self._learner_id >= num_learners:
            raise _refuse(
                ErrorCode.LEARNER_ID_OUT_OF_RANGE,
                learner_out_of_range(self._learner_id, num_learners),
            )
        self._generation = cursor.take(_U64)
        if self._generation == 0:
            raise _refuse(ErrorCode.ZERO_GENERATION, "generation 0")
        self._dtype = cursor.take(_U8)
        if self._dtype not in _DTYPES:
            raise _refuse(ErrorCode.BAD_DTYPE, "dtype not 1, 2 or 3")
        num_fragments = cursor.take(_U32)
        if num_fragments < 1:
            raise _refuse(ErrorCode.NO_FRAGMENTS, "num_fragments = 0")
        if num_fragments * _MIN_FRAGMENT_BYTES > cursor.remaining():
            raise _refuse(ErrorCode.TRUNCATED_PAYLOAD, "fragments exceed the payload")
        self._records_left = num_fragments
        self._fragments: list[WireFragment] = []
        self._seen: dict[bytes, WireFragment] = {}

    @property
    def identity(self) -> tuple[int, int]:
        """The HELLO's ``(learner_id, generation)``, checked with the head."""
        return self._learner_id, self._generation

    def advance(self, max_bytes: int) -> Hello | None:
        """Read records until ``max_bytes`` of them are read (at least one record, at most
        all that are left); the Hello once all of it is read."""
        self._read_fragments(max_bytes)
        return None if self._records_left else self._read_tail()

    def advance_all(self) -> Hello:
        hello = self.advance(self._cursor.end)
        assert hello is not None
        return hello

    def _read_tail(self) -> Hello:
        cursor = self._cursor
        layout_fingerprint = cursor.take_bytes(DIGEST_SIZE)
        session_contract = cursor.take_bytes(DIGEST_SIZE)
        tail = cursor.remaining()
        if tail not in (_TAIL_WITHOUT_PROFILE, _TAIL_WITH_PROFILE):
            raise _refuse(
                ErrorCode.BAD_HELLO_TAIL, "after the contract exactly 2 or 34 bytes must remain"
            )
        profile_hash = cursor.take_bytes(DIGEST_SIZE) if tail == _TAIL_WITH_PROFILE else None
        num_streams = cursor.take(_U16)
        if num_streams > MAX_STREAMS:
            raise _refuse(ErrorCode.TOO_MANY_STREAMS, "> 256")
        return Hello(
            learner_id=self._learner_id,
            generation=self._generation,
            dtype=WireDtype(self._dtype),
            layout=WireLayout(tuple(self._fragments)),
            layout_fingerprint=layout_fingerprint,
            session_contract=session_contract,
            num_streams=num_streams,
            profile_hash=profile_hash,
        )

    def _read_fragments(self, max_bytes: int) -> None:
        cursor, seen, fragments = self._cursor, self._seen, self._fragments
        data, end = cursor.data, cursor.end
        read_head = _FRAGMENT_HEAD.unpack_from
        pos = cursor.pos
        stop = pos + max_bytes
        left = self._records_left
        while left:
            start = pos
            if start + _FRAGMENT_HEAD.size > end:
                _refuse_short_head(cursor, start)
            merge_mode, num_tensors = read_head(data, start)
            if merge_mode > _ISO:
                raise _refuse(ErrorCode.BAD_MERGE_MODE, "merge_mode > 2")
            if num_tensors < 1:
                raise _refuse(ErrorCode.EMPTY_FRAGMENT, "num_tensors = 0")
            pos = start + _FRAGMENT_HEAD.size
            if num_tensors * 8 > end - pos:
                raise _refuse(ErrorCode.TRUNCATED_PAYLOAD, "numels exceed the payload")
            record_end = pos + num_tensors * (24 if merge_mode == _ISO else 8)
            record = data[start:record_end]
            fragment = seen.get(record)
            if fragment is None:
                cursor.pos = pos
                fragment = _decode_fragment(cursor, merge_mode, num_tensors)
                if len(seen) < _SHARED_RECORDS_MAX:
                    seen[record] = fragment
            pos = record_end
            fragments.append(fragment)
            left -= 1
            if pos >= stop:
                break
        self._records_left = left
        cursor.pos = pos


def _refuse_short_head(cursor: _Cursor, start: int) -> NoReturn:
    """A fragment head cut short: the schema still checks a merge_mode it could read."""
    cursor.pos = start
    if cursor.take(_U8) > _ISO:
        raise _refuse(ErrorCode.BAD_MERGE_MODE, "merge_mode > 2")
    raise _truncated()


def _decode_fragment(cursor: _Cursor, merge_mode: int, num_tensors: int) -> WireFragment:
    """The rest of one fragment record (numels, then iso shapes), checked in schema order."""
    numels_at = cursor.pos
    if num_tensors == 1:
        numels: tuple[int, ...] = (_U64.unpack_from(cursor.data, numels_at)[0],)
    else:
        numels = tuple(
            np.frombuffer(cursor.data, dtype="<u8", count=num_tensors, offset=numels_at).tolist()
        )
    if min(numels) == 0:
        raise _refuse(ErrorCode.ZERO_NUMEL, "a tensor numel is 0")
    if sum(numels) > MAX_FRAGMENT_NUMEL:
        raise _refuse(ErrorCode.SIZE_OVERFLOW, "fragment size overflows u64")
    shapes_at = numels_at + 8 * num_tensors
    if merge_mode != _ISO:
        return _checked_fragment(_MODES[merge_mode], numels, ())
    if num_tensors * 16 > cursor.end - shapes_at:
        raise _refuse(ErrorCode.TRUNCATED_PAYLOAD, "iso shapes exceed the payload")
    flat = np.frombuffer(cursor.data, dtype="<u8", count=2 * num_tensors, offset=shapes_at)
    rows, cols = flat[0::2], flat[1::2]
    wanted = np.frombuffer(cursor.data, dtype="<u8", count=num_tensors, offset=numels_at)
    # rows·cols = numel, exactly (a u64 product could wrap): cols divides numel into rows.
    safe_cols = np.maximum(cols, 1)
    if not (
        (rows > 0).all()
        and (cols > 0).all()
        and not (wanted % safe_cols).any()
        and (wanted // safe_cols == rows).all()
    ):
        raise _refuse(ErrorCode.BAD_ISO_SHAPE, "iso rows*cols must equal numel, both > 0")
    shapes = tuple(zip(rows.tolist(), cols.tolist(), strict=True))
    return _checked_fragment(MergeMode.ISO, numels, shapes)


def _checked_fragment(
    merge_mode: MergeMode, numels: tuple[int, ...], shapes: tuple[tuple[int, int], ...]
) -> WireFragment:
    """A :class:`WireFragment` of values this reader has checked already: every rule of its
    ``__post_init__`` (which would cost about 2 µs per record of a 1.29-million-record HELLO)."""
    fragment = object.__new__(WireFragment)
    object.__setattr__(fragment, "merge_mode", merge_mode)
    object.__setattr__(fragment, "numels", numels)
    object.__setattr__(fragment, "matrix_shapes", shapes)
    return fragment
