"""The struct HELLO reader and the construct schema agree on every payload, valid or not.

``yeto_proto.hello_reader`` exists for speed; ``schema.HelloPayload`` is the declared truth. Both
are run on the conformance vectors, on generated HELLOs, on mutations of them, and on payloads
assembled from raw field values (most of them invalid), and must give the same message or the
same error code and message.
"""

from __future__ import annotations

import json
import struct
import tracemalloc
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from yeto_proto import (
    FrameType,
    Hello,
    MergeMode,
    RemoteProtocolError,
    WireDtype,
    WireFragment,
    WireLayout,
    encode_bytes,
)
from yeto_proto.frames import _parse_with_schema
from yeto_proto.hello_reader import read_hello

if TYPE_CHECKING:
    from conftest import WireKit

VECTORS = Path(__file__).resolve().parent.parent / "conformance" / "vectors" / "hello.json"
U64 = (1 << 64) - 1
#: Values at the edges of the checks: zero, the valid small range, bounds, and overflow.
EDGE_INTEGERS = [0, 1, 2, 3, 4, 255, 256, 257, 2**31, 2**32 - 1, 2**61, 2**62, 2**63, U64]

Outcome = tuple[str, Any]


def _schema_message(payload: bytes, num_learners: int | None) -> Hello:
    """The message from a plain schema parse (no reader code involved)."""
    parsed = _parse_with_schema(FrameType.HELLO, memoryview(payload), num_learners=num_learners)
    fragments = tuple(
        WireFragment(
            MergeMode(f.merge_mode),
            tuple(f.numels),
            tuple((s.rows, s.cols) for s in f.matrix_shapes) if f.matrix_shapes else (),
        )
        for f in parsed.fragments
    )
    return Hello(
        learner_id=parsed.learner_id,
        generation=parsed.connection_generation,
        dtype=WireDtype(parsed.dtype),
        layout=WireLayout(fragments),
        layout_fingerprint=parsed.layout_fingerprint,
        session_contract=parsed.session_contract_hash,
        num_streams=parsed.num_streams,
        profile_hash=parsed.syncer_profile_hash,
    )


def _outcome(decode: Any, payload: bytes, num_learners: int | None) -> Outcome:
    try:
        return ("message", decode(payload, num_learners))
    except RemoteProtocolError as exc:
        return ("error", (exc.code, str(exc)))


def assert_agree(payload: bytes, num_learners: int | None = None) -> Outcome:
    expected = _outcome(_schema_message, payload, num_learners)
    got = _outcome(lambda p, m: read_hello(p, num_learners=m), payload, num_learners)
    assert got == expected, payload.hex()
    return got


def _vector_payloads() -> list[tuple[str, bytes, int | None]]:
    document = json.loads(VECTORS.read_text())
    cases = []
    for group in document["testGroups"]:
        num_learners = group["context"].get("num_learners")
        for test in group["tests"]:
            frame = bytes.fromhex(test["hex"])
            # Only frames whose header really is a HELLO of the stated length carry a payload.
            if (
                frame[4] == FrameType.HELLO
                and struct.unpack_from("<Q", frame, 5)[0] == len(frame) - 13
            ):
                cases.append((f"tc{test['tcId']}", frame[13:], num_learners))
    return cases


@pytest.mark.parametrize(
    ("payload", "num_learners"),
    [pytest.param(p, m, id=name) for name, p, m in _vector_payloads()],
)
def test_reader_agrees_with_the_schema_on_every_conformance_vector(
    payload: bytes, num_learners: int | None
) -> None:
    assert_agree(payload, num_learners)


def test_the_vectors_reach_both_outcomes() -> None:
    outcomes = {assert_agree(p, m)[0] for _, p, m in _vector_payloads()}
    assert outcomes == {"message", "error"}


@settings(max_examples=150)
@given(data=st.data())
def test_reader_agrees_on_generated_hellos_and_their_mutations(
    wire: WireKit, data: st.DataObject
) -> None:
    session = data.draw(wire.session(max_fragments=4), "session")
    hello = data.draw(wire.hello(session), "hello")
    payload = bytearray(encode_bytes(hello)[13:])
    outcome = assert_agree(bytes(payload), session.num_learners)
    assert outcome == ("message", hello)

    for _ in range(data.draw(st.integers(1, 4), "mutations")):
        kind = data.draw(st.sampled_from(["cut", "flip", "insert", "overwrite"]), "kind")
        at = data.draw(st.integers(0, len(payload)), "at")
        if kind == "cut":
            del payload[at:]
        elif kind == "insert":
            payload[at:at] = data.draw(st.binary(min_size=1, max_size=16), "inserted")
        elif payload and kind == "flip":
            payload[min(at, len(payload) - 1)] ^= data.draw(st.integers(1, 255), "mask")
        elif kind == "overwrite":
            width = data.draw(st.sampled_from([1, 4, 8]), "width")
            value = data.draw(st.sampled_from(EDGE_INTEGERS), "value") % (1 << (8 * width))
            payload[at : at + width] = value.to_bytes(width, "little")
        assert_agree(bytes(payload), session.num_learners)


@st.composite
def raw_hellos(draw: st.DrawFn) -> bytes:
    """HELLO payloads assembled field by field from edge values: mostly invalid, deep paths."""
    small = st.sampled_from([0, 1, 2, 3])
    numbers = st.one_of(st.integers(0, 50), st.sampled_from(EDGE_INTEGERS))
    parts = [
        struct.pack("<H", draw(st.sampled_from([4, 4, 4, 3]))),
        struct.pack("<I", draw(st.sampled_from([0, 1, 3, 4, 2**32 - 1]))),
        struct.pack("<Q", draw(st.sampled_from([1, 1, 0, U64]))),
        struct.pack("<B", draw(st.sampled_from([1, 2, 3, 0, 4]))),
    ]
    fragments = draw(st.lists(st.tuples(small, small), max_size=4))
    parts.append(struct.pack("<I", draw(st.sampled_from([len(fragments), len(fragments) + 1]))))
    for merge_mode, num_tensors in fragments:
        parts.append(struct.pack("<BI", merge_mode, num_tensors))
        numels = draw(st.lists(numbers, min_size=num_tensors, max_size=num_tensors))
        parts.append(struct.pack(f"<{num_tensors}Q", *numels))
        if merge_mode == MergeMode.ISO and draw(st.booleans()):
            for numel in numels:
                exact = draw(st.booleans())
                rows = draw(st.sampled_from([1, numel, 0, 2])) if exact else draw(numbers)
                cols = numel // rows if exact and rows and numel % rows == 0 else draw(numbers)
                parts.append(struct.pack("<QQ", rows, cols))
    tail = draw(st.sampled_from([64 + 2, 64 + 34, 64 + 2, 64 + 1, 64 + 3, 64 + 33, 24]))
    parts.append(bytes(draw(st.sampled_from([0, 1, 255])) for _ in range(tail)))
    return b"".join(parts)


@settings(max_examples=400)
@given(payload=raw_hellos(), num_learners=st.sampled_from([None, 1, 4]))
@example(payload=bytes.fromhex("0400000000000100000000000000010100000003"), num_learners=None)
def test_reader_agrees_on_payloads_built_from_raw_fields(
    payload: bytes, num_learners: int | None
) -> None:
    assert_agree(payload, num_learners)


def test_a_fragment_head_cut_after_its_merge_mode_reports_the_merge_mode_first() -> None:
    # Two fragments pass the 13-bytes-each bound, then the second head is cut short.
    head = struct.pack("<HIQBI", 4, 0, 1, WireDtype.F32, 2)
    first = struct.pack("<BI3Q", MergeMode.AVG, 3, 1, 1, 1)
    for second in (b"\x09", b"\x09\x01\x00"):
        outcome = assert_agree(head + first + second)
        assert outcome[0] == "error" and outcome[1][0].name == "BAD_MERGE_MODE"
    outcome = assert_agree(head + first + b"\x01\x01")
    assert outcome[0] == "error" and outcome[1][0].name == "TRUNCATED_PAYLOAD"


def _minimal_hello_payload(num_fragments: int, *, distinct: bool) -> bytes:
    records = b"".join(
        struct.pack("<BIQ", MergeMode.AVG, 1, i + 1 if distinct else 1)
        for i in range(num_fragments)
    )
    head = struct.pack("<HIQBI", 4, 0, 1, WireDtype.F32, num_fragments)
    return head + records + bytes(64) + struct.pack("<H", 0)


def test_repeated_fragment_records_share_one_object() -> None:
    hello = read_hello(_minimal_hello_payload(1000, distinct=False))
    assert len(hello.layout) == 1000
    assert len({id(f) for f in hello.layout.fragments}) == 1
    assert hello.layout.fragments[0] == WireFragment(MergeMode.AVG, (1,))


def test_a_16_mib_hello_of_minimal_fragments_decodes_in_little_memory() -> None:
    """The largest first frame of identical fragments: about 1.29M records, no object each.

    construct's per-fragment walk took about 450 MiB here; the reader keeps one pointer per
    fragment (about 10 MiB) and one object per distinct record.
    """
    num_fragments = (16 * 2**20 - 15 - 66) // 13
    payload = _minimal_hello_payload(num_fragments, distinct=False)
    assert len(payload) <= 16 * 2**20
    tracemalloc.start()
    try:
        hello = read_hello(payload)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(hello.layout) == num_fragments
    assert peak < 64 * 2**20, f"peak {peak / 2**20:.0f} MiB"


def test_records_beyond_the_shared_table_still_decode_each_on_their_own() -> None:
    numels = [*range(1, 5001), 4999, 4999, 7, 5000]
    records = b"".join(struct.pack("<BIQ", MergeMode.RDA, 1, n) for n in numels)
    head = struct.pack("<HIQBI", 4, 0, 1, WireDtype.BF16, len(numels))
    hello = read_hello(head + records + bytes(64) + struct.pack("<H", 3))
    assert [f.numels for f in hello.layout.fragments] == [(n,) for n in numels]
    assert {f.merge_mode for f in hello.layout.fragments} == {MergeMode.RDA}
    assert hello.num_streams == 3
