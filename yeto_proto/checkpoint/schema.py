"""construct declarations of the checkpoint formats V1, V2 and V3 (spec/checkpoint.md).

The small fixed parts (prefix, fragment header, ledger entry, trailers) are declared once here;
the reader and writer use them, or the ``struct``/numpy record types derived from them, so the
bytes have one source. :data:`CheckpointFile` declares a whole file with every validator in the
reader's order; tests run it beside the streaming reader on every conformance vector and require
the same fields or the same error code. It reads tensors as ``Bytes`` and is meant for small
files: real checkpoints go through :mod:`yeto_proto.checkpoint.reader`, which reads parameter
and momentum arrays straight into numpy.
"""

from __future__ import annotations

import io
import struct
from typing import Any

import numpy as np
from construct import (
    Array,
    Bytes,
    Const,
    Construct,
    FormatField,
    If,
    Int8ul,
    Int32ul,
    Int64ul,
    Peek,
    Renamed,
    StreamError,
    Struct,
    Switch,
    Terminated,
    this,
)

from ..constants import DIGEST_SIZE, IsoBackend
from ..errors import CheckpointError, ErrorCode
from ..schema import CodedConstructError, Require, struct_of
from .model import CheckpointFormat, TrailerKind

#: ``u32`` that opens the contract trailer ("SCTR" read as little-endian bytes).
CONTRACT_TAG = 0x52544353
#: A fragment's params and momentum (8 bytes per element) must fit a file offset (2^63 - 1).
MAX_CHECKPOINT_NUMEL = ((1 << 63) - 1) // 8
_ISO_BACKENDS = frozenset(int(b) for b in IsoBackend)
_MAGICS = frozenset(int(f) for f in CheckpointFormat)

# -- the pieces ----------------------------------------------------------------------------------
PrefixV1 = Struct(
    "magic" / Const(int(CheckpointFormat.V1), Int32ul),
    "global_step" / Int64ul,
)
PrefixV2 = Struct(
    "magic" / Const(int(CheckpointFormat.V2), Int32ul),
    "iso_backend" / Int8ul,
    "global_step" / Int64ul,
)
PrefixV3 = Struct(
    "magic" / Const(int(CheckpointFormat.V3), Int32ul),
    "iso_backend" / Int8ul,
    "fingerprint" / Bytes(DIGEST_SIZE),
    "global_step" / Int64ul,
)
PREFIXES: dict[CheckpointFormat, Construct] = {
    CheckpointFormat.V1: PrefixV1,
    CheckpointFormat.V2: PrefixV2,
    CheckpointFormat.V3: PrefixV3,
}
FragmentCount = Struct("num_fragments" / Int32ul)
FragmentHeader = Struct("version" / Int64ul, "numel" / Int64ul)
LedgerCount = Struct("ledger_count" / Int32ul)
LedgerRecord = Struct(
    "learner_id" / Int32ul,
    "merges" / Int64ul,
    "steps" / Int64ul,
    "tokens" / Int64ul,
)
FingerprintTrailer = Struct("fingerprint" / Bytes(DIGEST_SIZE))
ContractTrailer = Struct(
    "tag" / Int32ul,
    Require(
        lambda c, _: c.tag == CONTRACT_TAG,
        ErrorCode.CKPT_BAD_TRAILER,
        "contract trailer tag is not 0x52544353",
    ),
    "contract" / Bytes(DIGEST_SIZE),
)

# -- derived fixed-width forms for the loops -----------------------------------------------------
PREFIX_SIZES: dict[CheckpointFormat, int] = {f: s.sizeof() for f, s in PREFIXES.items()}
COUNT_SIZE = FragmentCount.sizeof()
FRAGMENT_HEADER = struct_of(FragmentHeader)


def _numpy_record(schema: Construct) -> np.dtype[np.void]:
    """The packed numpy record of a struct of little-endian unsigned integer fields."""
    fields = []
    for sub in schema.subcons:
        assert isinstance(sub, Renamed) and isinstance(sub.subcon, FormatField)
        # construct's "<L" is 4 bytes where numpy's "L" would be a C long, so go by size.
        fields.append((sub.name, f"<u{struct.calcsize(sub.subcon.fmtstr)}"))
    return np.dtype(fields)


#: One ledger entry as a numpy record, field for field from :data:`LedgerRecord`.
LEDGER_DTYPE = _numpy_record(LedgerRecord)
assert LEDGER_DTYPE.itemsize == LedgerRecord.sizeof() == 28
assert FRAGMENT_HEADER.size == 16 and COUNT_SIZE == 4


# -- the whole file --------------------------------------------------------------------------------
class BytesRemaining(Construct):  # type: ignore[misc]
    """Zero-width: how many bytes are left; on build, the length the trailer fields imply."""

    def __init__(self) -> None:
        super().__init__()
        self.flagbuildnone = True

    def _parse(self, stream: io.BytesIO, context: Any, path: str) -> int:
        return len(stream.getbuffer()) - stream.tell()

    def _build(self, obj: Any, stream: io.BytesIO, context: Any, path: str) -> int:
        length = 0
        if context.get("fingerprint_trailer") is not None:
            length += TrailerKind.FINGERPRINT.value
        if context.get("contract_trailer") is not None:
            length += TrailerKind.FINGERPRINT_AND_CONTRACT.value - TrailerKind.FINGERPRINT.value
        return length

    def _sizeof(self, context: Any, path: str) -> int:
        return 0


def _ascending(ctx: Any, _remaining: int) -> bool:
    ids = [entry.learner_id for entry in ctx.ledger]
    return all(a < b for a, b in zip(ids, ids[1:], strict=False))


def _trailer_repeats_prefix(ctx: Any, _remaining: int) -> bool:
    if ctx.magic != CheckpointFormat.V3 or ctx.fingerprint_trailer is None:
        return True
    return bool(ctx.fingerprint_trailer == ctx.prefix.fingerprint)


FragmentRecord = Struct(
    "version" / Int64ul,
    "numel" / Int64ul,
    Require(lambda c, _: c.numel > 0, ErrorCode.CKPT_BAD_FIELD, "numel is 0"),
    Require(
        lambda c, _: c.numel <= MAX_CHECKPOINT_NUMEL,
        ErrorCode.CKPT_COUNT_OVERFLOW,
        "8*numel exceeds any file size",
    ),
    Require(
        lambda c, r: 8 * c.numel <= r,
        ErrorCode.CKPT_TRUNCATED,
        "params and momentum exceed the file",
        parse_only=True,
    ),
    "params" / Bytes(4 * this.numel),
    "momentum" / Bytes(4 * this.numel),
)

CheckpointFile = Struct(
    "magic" / Peek(Int32ul),
    Require(lambda c, _: c.magic is not None, ErrorCode.CKPT_TRUNCATED, "shorter than a magic"),
    Require(lambda c, _: c.magic in _MAGICS, ErrorCode.CKPT_BAD_MAGIC, "not a checkpoint magic"),
    "prefix" / Switch(this.magic, {int(f): s for f, s in PREFIXES.items()}),
    Require(
        lambda c, _: c.prefix.get("iso_backend", 0) in _ISO_BACKENDS,
        ErrorCode.CKPT_BAD_FIELD,
        "iso_backend is not 0 or 1",
    ),
    "num_fragments" / Int32ul,
    Require(lambda c, _: c.num_fragments >= 1, ErrorCode.CKPT_BAD_FIELD, "no fragments"),
    Require(
        lambda c, r: FRAGMENT_HEADER.size * c.num_fragments + COUNT_SIZE <= r,
        ErrorCode.CKPT_TRUNCATED,
        "fragment headers exceed the file",
        parse_only=True,
    ),
    "fragments" / Array(this.num_fragments, FragmentRecord),
    "ledger_count" / Int32ul,
    Require(
        lambda c, r: LEDGER_DTYPE.itemsize * c.ledger_count <= r,
        ErrorCode.CKPT_TRUNCATED,
        "ledger entries exceed the file",
        parse_only=True,
    ),
    "ledger" / Array(this.ledger_count, LedgerRecord),
    Require(_ascending, ErrorCode.CKPT_BAD_FIELD, "learner ids not strictly ascending"),
    "trailer_len" / BytesRemaining(),
    Require(
        lambda c, _: c.trailer_len in {k.value for k in TrailerKind},
        ErrorCode.CKPT_BAD_TRAILER,
        "trailer is not 0, 32 or 68 bytes",
    ),
    "fingerprint_trailer" / If(this.trailer_len >= DIGEST_SIZE, Bytes(DIGEST_SIZE)),
    Require(
        _trailer_repeats_prefix,
        ErrorCode.CKPT_FINGERPRINT_TRAILER_MISMATCH,
        "fingerprint trailer differs from the prefix",
    ),
    "contract_trailer"
    / If(this.trailer_len == TrailerKind.FINGERPRINT_AND_CONTRACT.value, ContractTrailer),
    Terminated,
)


def parse_checkpoint_file(data: bytes) -> Any:
    """Parse a whole (small) file with :data:`CheckpointFile`; errors carry their ``CKPT_`` code."""
    try:
        return CheckpointFile.parse(data)
    except CodedConstructError as exc:
        raise CheckpointError(exc.code, str(exc), section="schema") from None
    except StreamError as exc:
        raise CheckpointError(ErrorCode.CKPT_TRUNCATED, str(exc), section="schema") from None
