"""Read and fully validate a V1, V2 or V3 checkpoint file.

The file is read front to back. Before anything is allocated, each count is checked against the
bytes that remain; parameter and momentum arrays are read straight into numpy arrays (or mapped
read-only), never element by element. Every failure is a :class:`CheckpointError` whose section
is one of ``prefix``, ``fragment table``, ``fragment <i>``, ``ledger`` or ``trailer`` (or
``open`` with ``CKPT_IO`` when the file cannot be read) and whose detail names the file.
"""

from __future__ import annotations

import io
import mmap
import os
import struct

import numpy as np
from construct import ConstructError

from ..constants import DIGEST_SIZE, IsoBackend
from ..errors import CheckpointError, ErrorCode
from .atomic import io_error, open_regular_file
from .model import (
    F32,
    Checkpoint,
    CheckpointFormat,
    F32Array,
    FragmentState,
    LedgerEntry,
    TrailerKind,
)
from .schema import (
    CONTRACT_TAG,
    COUNT_SIZE,
    FRAGMENT_HEADER,
    LEDGER_DTYPE,
    MAX_CHECKPOINT_NUMEL,
    PREFIX_SIZES,
    PREFIXES,
    ContractTrailer,
    FingerprintTrailer,
)

_MAGIC = struct.Struct("<I")
_COUNT = struct.Struct("<I")
_TRAILER_LENGTHS = {kind.value: kind for kind in TrailerKind}


class _Source:
    """A checkpoint file being read once, front to back, with the bytes that remain known."""

    def __init__(self, file: io.BufferedReader, path: str, size: int, mapped: bool) -> None:
        self.file = file
        self.path = path
        self.size = size
        self.position = 0
        # One read-only map for the whole file; array views keep it alive after close.
        self.map: mmap.mmap | None = None
        if mapped and size:
            try:
                self.map = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError:  # emptied since fstat: there is nothing left to read either
                self.size = 0
            else:
                self.size = min(size, len(self.map))  # the file may have shrunk since fstat

    @property
    def remaining(self) -> int:
        return self.size - self.position

    def fail(self, code: ErrorCode, section: str, reason: str) -> CheckpointError:
        return CheckpointError(code, f"{reason} (file {self.path})", section=section)

    def take(self, section: str, length: int, what: str) -> bytes:
        """Exactly ``length`` bytes of a fixed-width field."""
        if length > self.remaining:
            raise self.fail(
                ErrorCode.CKPT_TRUNCATED,
                section,
                f"{what} needs {length} bytes, {self.remaining} remain",
            )
        data = self.file.read(length)
        if len(data) != length:  # the file shrank under us
            raise self.fail(ErrorCode.CKPT_TRUNCATED, section, f"{what} ends early")
        self.position += length
        return data

    def floats(self, section: str, numel: int) -> F32Array:
        """``numel`` f32 values; the caller has checked that they fit."""
        nbytes = numel * F32.itemsize
        if self.map is not None:
            view = np.frombuffer(self.map, dtype=F32, count=numel, offset=self.position)
            self.file.seek(nbytes, os.SEEK_CUR)
            self.position += nbytes
            return view
        array = np.empty(numel, dtype=F32)
        target = array.view(np.uint8).data
        filled = 0
        while filled < nbytes:
            got = self.file.readinto(target[filled:])
            if not got:
                raise self.fail(ErrorCode.CKPT_TRUNCATED, section, "array ends early")
            filled += got
        self.position += nbytes
        return array


def read_checkpoint(path: str | os.PathLike[str], *, mapped: bool = False) -> Checkpoint:
    """Read and validate the whole file at ``path``.

    With ``mapped=True`` the arrays are read-only views of a memory map (cheap for inspection
    and export); otherwise they are owned, writable arrays and the file is closed on return.
    Structure is validated completely either way; array contents have no rules to check.
    """
    name = os.fspath(path)
    try:
        with open_regular_file(name) as file:
            size = os.fstat(file.fileno()).st_size
            return _parse(_Source(file, name, size, mapped))
    except OSError as exc:
        raise io_error(name, exc, section="open") from None
    except MemoryError:
        # Sizes are checked against the file, but a real file can still exceed memory.
        raise CheckpointError(
            ErrorCode.CKPT_IO,
            f"not enough memory to hold its arrays (file {name})",
            section="open",
        ) from None


def _parse(src: _Source) -> Checkpoint:
    fmt, iso_backend, fingerprint, global_step = _parse_prefix(src)

    (num_fragments,) = _COUNT.unpack(src.take("fragment table", COUNT_SIZE, "F"))
    if num_fragments == 0:
        raise src.fail(ErrorCode.CKPT_BAD_FIELD, "fragment table", "F is 0")
    minimum = FRAGMENT_HEADER.size * num_fragments + COUNT_SIZE
    if minimum > src.remaining:
        raise src.fail(
            ErrorCode.CKPT_TRUNCATED,
            "fragment table",
            f"F={num_fragments} needs at least {minimum} bytes, {src.remaining} remain",
        )
    fragments = tuple(_parse_fragment(src, index) for index in range(num_fragments))

    ledger = _parse_ledger(src)
    trailer, trailer_fingerprint, contract = _parse_trailer(src, fingerprint)
    if fingerprint is None:
        fingerprint = trailer_fingerprint
    return Checkpoint(
        format=fmt,
        iso_backend=iso_backend,
        fingerprint=fingerprint,
        global_step=global_step,
        fragments=fragments,
        ledger=ledger,
        contract=contract,
        trailer=trailer,
        file_size=src.size,
    )


def _parse_prefix(src: _Source) -> tuple[CheckpointFormat, IsoBackend | None, bytes | None, int]:
    magic_bytes = src.take("prefix", _MAGIC.size, "magic")
    (magic,) = _MAGIC.unpack(magic_bytes)
    try:
        fmt = CheckpointFormat(magic)
    except ValueError:
        raise src.fail(
            ErrorCode.CKPT_BAD_MAGIC,
            "prefix",
            f"magic 0x{magic:08X} is none of V1 0x{CheckpointFormat.V1:08X}, "
            f"V2 0x{CheckpointFormat.V2:08X}, V3 0x{CheckpointFormat.V3:08X}",
        ) from None
    rest = src.take("prefix", PREFIX_SIZES[fmt] - _MAGIC.size, f"the {fmt.name} prefix")
    fields = PREFIXES[fmt].parse(magic_bytes + rest)
    iso_backend = None
    if fmt.has_iso_backend:
        try:
            iso_backend = IsoBackend(fields.iso_backend)
        except ValueError:
            raise src.fail(
                ErrorCode.CKPT_BAD_FIELD,
                "prefix",
                f"iso_backend {fields.iso_backend} is not 0 (scalar) or 1 (torch-svd)",
            ) from None
    fingerprint = bytes(fields.fingerprint) if fmt.has_fingerprint else None
    return fmt, iso_backend, fingerprint, int(fields.global_step)


def _parse_fragment(src: _Source, index: int) -> FragmentState:
    section = f"fragment {index}"
    version, numel = FRAGMENT_HEADER.unpack(src.take(section, FRAGMENT_HEADER.size, "header"))
    if numel == 0:
        raise src.fail(ErrorCode.CKPT_BAD_FIELD, section, "numel is 0")
    if numel > MAX_CHECKPOINT_NUMEL:
        raise src.fail(
            ErrorCode.CKPT_COUNT_OVERFLOW,
            section,
            f"numel {numel} needs more than the largest possible file (8*numel > 2^63-1)",
        )
    needed = 2 * F32.itemsize * numel
    if needed > src.remaining:
        raise src.fail(
            ErrorCode.CKPT_TRUNCATED,
            section,
            f"numel {numel} needs {needed} bytes of params and momentum, {src.remaining} remain",
        )
    params = src.floats(section, numel)
    momentum = src.floats(section, numel)
    return FragmentState(version=version, params=params, momentum=momentum)


def _parse_ledger(src: _Source) -> tuple[LedgerEntry, ...]:
    (count,) = _COUNT.unpack(src.take("ledger", COUNT_SIZE, "ledger_count"))
    needed = LEDGER_DTYPE.itemsize * count
    if needed > src.remaining:
        raise src.fail(
            ErrorCode.CKPT_TRUNCATED,
            "ledger",
            f"{count} entries need {needed} bytes, {src.remaining} remain",
        )
    records = np.frombuffer(src.take("ledger", needed, "ledger entries"), dtype=LEDGER_DTYPE)
    ids = records["learner_id"]
    out_of_order = np.flatnonzero(ids[1:] <= ids[:-1])
    if out_of_order.size:
        at = int(out_of_order[0]) + 1
        raise src.fail(
            ErrorCode.CKPT_BAD_FIELD,
            "ledger",
            f"entry {at} has learner_id {ids[at]} after {ids[at - 1]} (must strictly ascend)",
        )
    return tuple(
        LedgerEntry(learner_id=i, merges=m, steps=s, tokens=t) for i, m, s, t in records.tolist()
    )


def _parse_trailer(
    src: _Source, prefix_fingerprint: bytes | None
) -> tuple[TrailerKind, bytes | None, bytes | None]:
    length = src.remaining
    kind = _TRAILER_LENGTHS.get(length)
    if kind is None:
        raise src.fail(
            ErrorCode.CKPT_BAD_TRAILER,
            "trailer",
            f"{length} bytes follow the ledger; only 0, 32 or 68 are defined",
        )
    data = src.take("trailer", length, "trailer")
    if kind is TrailerKind.NONE:
        return kind, None, None
    fingerprint = bytes(FingerprintTrailer.parse(data[:DIGEST_SIZE]).fingerprint)
    if prefix_fingerprint is not None and fingerprint != prefix_fingerprint:
        raise src.fail(
            ErrorCode.CKPT_FINGERPRINT_TRAILER_MISMATCH,
            "trailer",
            f"trailer fingerprint {fingerprint.hex()} differs from prefix "
            f"{prefix_fingerprint.hex()}",
        )
    if kind is TrailerKind.FINGERPRINT:
        return kind, fingerprint, None
    try:
        contract = bytes(ContractTrailer.parse(data[DIGEST_SIZE:]).contract)
    except ConstructError:
        (tag,) = _MAGIC.unpack_from(data, DIGEST_SIZE)
        raise src.fail(
            ErrorCode.CKPT_BAD_TRAILER,
            "trailer",
            f"contract tag 0x{tag:08X} is not 0x{CONTRACT_TAG:08X}",
        ) from None
    return kind, fingerprint, contract
