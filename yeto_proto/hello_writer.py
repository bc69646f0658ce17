"""The HELLO payload written with ``struct``, as ``schema.HelloPayload`` lays it out.

construct builds a layout element by element (about 40 µs a fragment record: 52 s for the
largest first frame, 1.29M minimal fragments); this writer packs each fragment object once.
``tests/test_hello_writer.py`` holds it to ``HelloPayload.build`` byte for byte.
"""

from __future__ import annotations

import struct

from .constants import PROTOCOL_VERSION
from .errors import ErrorCode, LocalProtocolError
from .layout import WireFragment
from .messages import Hello
from .schema import MAX_FRAGMENT_NUMEL

#: protocol_version, learner_id, connection_generation, dtype, num_fragments
_FIXED = struct.Struct("<HIQBI")
_NUM_STREAMS = struct.Struct("<H")


def write_hello(message: Hello) -> bytes:
    """The HELLO payload of ``message`` (no MAC); ``SIZE_OVERFLOW`` for a fragment whose
    numel a receiver's HELLO limits refuse (the one rule ``Hello`` itself does not check)."""
    fragments = message.layout.fragments
    parts = [
        _FIXED.pack(
            PROTOCOL_VERSION,
            message.learner_id,
            message.generation,
            message.dtype,
            len(fragments),
        )
    ]
    records: dict[int, bytes] = {}  # by object: a read layout shares one per distinct record
    for index, fragment in enumerate(fragments):
        record = records.get(id(fragment))
        if record is None:
            record = records[id(fragment)] = _fragment_record(index, fragment)
        parts.append(record)
    parts += [message.layout_fingerprint, message.session_contract]
    if message.profile_hash is not None:
        parts.append(message.profile_hash)
    parts.append(_NUM_STREAMS.pack(message.num_streams))
    return b"".join(parts)


def _fragment_record(index: int, fragment: WireFragment) -> bytes:
    numels = fragment.numels
    if sum(numels) > MAX_FRAGMENT_NUMEL:
        raise LocalProtocolError(
            ErrorCode.SIZE_OVERFLOW, f"HELLO: fragment {index} size overflows u64"
        )
    shapes = [size for shape in fragment.matrix_shapes for size in shape]
    count = len(numels)
    return struct.pack(f"<BI{count}Q{len(shapes)}Q", fragment.merge_mode, count, *numels, *shapes)
