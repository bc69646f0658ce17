"""Fuzzing the decode paths: nothing but a yeto_proto ProtocolError may ever escape.

Inputs are random bytes and valid frame streams with bit flips, truncations, length edits,
type edits, corrupted magic and spliced garbage, fed in random pieces to syncer- and
learner-side decoders, and CHUNK sets with edited envelopes fed to the Reassembler. A decoder
that failed must re-raise the very same error on every later call.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from yeto_proto import (
    AnyMessage,
    Chunk,
    ChunkSlicer,
    DecoderState,
    FrameDecoder,
    FrameType,
    ProtocolError,
    Reassembler,
    Role,
    decode_inner_frame,
    decode_payload,
    encode_bytes,
)

if TYPE_CHECKING:
    from conftest import Session, WireKit

U64 = (1 << 64) - 1
FUZZ = settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
STRIPED = (
    FrameType.INIT_PARAMS,
    FrameType.PUSH_FRAGMENT,
    FrameType.BCAST_FRAGMENT,
    FrameType.FINAL_FRAGMENT,
)


@dataclass(frozen=True)
class Mode:
    """Which side decodes, and whether it starts before the first frame (no limits yet)."""

    receiver: Role
    first_frame: bool
    hello_key: bytes | None = None

    def __str__(self) -> str:
        first = "-first-frame" if self.first_frame else ""
        return f"{self.receiver.value}{first}{'-hmac' if self.hello_key else ''}"


MODES = [
    Mode(Role.SYNCER, True),
    Mode(Role.SYNCER, True, b"shared key"),
    Mode(Role.SYNCER, False),
    Mode(Role.LEARNER, False),
]


def new_decoder(mode: Mode, session: Session) -> FrameDecoder:
    if mode.first_frame:
        return FrameDecoder(
            mode.receiver, num_learners=session.num_learners, hello_key=mode.hello_key
        )
    return FrameDecoder(
        mode.receiver,
        limits=session.limits,
        num_learners=session.num_learners,
        enforce_first_frame=False,
    )


# -- mutations ----------------------------------------------------------------------------------

lengths = st.one_of(
    st.integers(0, U64),
    st.sampled_from([0, 1, 23, 24, 25, 1 << 24, (1 << 24) + 1, 1 << 62, 1 << 63, U64]),
    st.integers(-20, 20),  # relative to the frame's own length
)
header_edit = st.one_of(
    st.tuples(st.just("length"), st.integers(0, 7), lengths),
    st.tuples(st.just("type"), st.integers(0, 7), st.integers(0, 255)),
    st.tuples(st.just("magic"), st.integers(0, 7), st.integers(0, U64)),
)
byte_edit = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 1 << 20), st.integers(0, 7)),
    st.tuples(st.just("truncate"), st.integers(0, 1 << 20), st.just(0)),
    st.tuples(st.just("splice"), st.integers(0, 1 << 20), st.binary(min_size=1, max_size=40)),
)


def apply_header_edit(stream: bytearray, starts: list[int], edit: tuple[str, int, object]) -> None:
    kind, which, value = edit
    start = starts[which % len(starts)]
    if kind == "length":
        assert isinstance(value, int)
        old = struct.unpack_from("<Q", stream, start + 5)[0]
        new = old + value if -20 <= value <= 20 else value
        struct.pack_into("<Q", stream, start + 5, min(max(new, 0), U64))
    elif kind == "type":
        assert isinstance(value, int)
        stream[start + 4] = value
    else:
        assert isinstance(value, int)
        struct.pack_into("<I", stream, start, value & 0xFFFF_FFFF)


def apply_byte_edit(stream: bytearray, edit: tuple[str, int, object]) -> bytearray:
    kind, position, value = edit
    if not stream:
        return stream
    at = position % len(stream)
    if kind == "flip":
        assert isinstance(value, int)
        stream[at] ^= 1 << value
        return stream
    if kind == "truncate":
        return stream[:at]
    assert isinstance(value, bytes)
    return stream[:at] + value + stream[at:]


def framed(
    messages: list[AnyMessage], hello_key: bytes | None = None
) -> tuple[bytearray, list[int]]:
    frames = [encode_bytes(m, hello_key=hello_key) for m in messages]
    starts, at = [], 0
    for frame in frames:
        starts.append(at)
        at += len(frame)
    return bytearray(b"".join(frames)), starts


# -- driving ------------------------------------------------------------------------------------


def pump(decoder: FrameDecoder, session: Session, out: list[AnyMessage]) -> ProtocolError | None:
    """Drain ``decoder``; install limits after the first frame as a syncer would."""
    while True:
        try:
            item = decoder.next_frame()
        except ProtocolError as exc:
            return exc
        if isinstance(item, DecoderState):
            return None
        out.append(item)
        if decoder.limits is None:
            decoder.set_limits(session.limits)


def assert_poisoned(decoder: FrameDecoder, error: ProtocolError, more: bytes) -> None:
    # An equal error each time, a fresh object (a stored one would hold the decoder in a cycle).
    same = (type(error), error.code, error.detail)
    for _ in range(2):
        with pytest.raises(ProtocolError) as again:
            decoder.next_frame()
        assert (type(again.value), again.value.code, again.value.detail) == same
    if more:
        decoder.feed(more)  # fresh bytes do not revive a failed decoder
    with pytest.raises(ProtocolError) as again:
        decoder.next_frame()
    assert (type(again.value), again.value.code, again.value.detail) == same


def run_stream(
    wire: WireKit, mode: Mode, session: Session, pieces: list[bytes]
) -> list[AnyMessage]:
    """Feed ``pieces`` like a socket loop, then end the stream; check the failure contract."""
    decoder = new_decoder(mode, session)
    out: list[AnyMessage] = []
    for i, piece in enumerate(pieces):
        decoder.feed(piece)
        error = pump(decoder, session, out)
        if error is not None:
            event(f"error {error.code.name}")
            assert_poisoned(decoder, error, b"".join(pieces[i + 1 :]) or b"\xde")
            break
    else:
        decoder.feed(b"")
        error = pump(decoder, session, out)
        if error is None:
            event("clean end")
            assert decoder.next_frame() is DecoderState.CLOSED
        else:
            event(f"error {error.code.name}")
            assert_poisoned(decoder, error, b"")
    # Whatever got through respects the direction rules.
    for index, message in enumerate(out):
        if mode.first_frame and index == 0:
            assert message.TYPE in (FrameType.HELLO, FrameType.DATA_HELLO)
        else:
            assert message.TYPE in wire.accepted_by(mode.receiver), message
    return out


def wire_striped_for(receiver: Role) -> set[FrameType]:
    if receiver is Role.SYNCER:
        return {FrameType.INIT_PARAMS, FrameType.PUSH_FRAGMENT}
    return {FrameType.BCAST_FRAGMENT, FrameType.FINAL_FRAGMENT}


def reassemble_all(receiver: Role, session: Session, chunks: list[Chunk]) -> None:
    reassembler = Reassembler(receiver, session.limits)
    for chunk in chunks:
        try:
            done = reassembler.add(chunk)
        except ProtocolError as exc:
            event(f"reassembly error {exc.code.name}")
        else:
            if done is not None:
                event("reassembled")
                assert done.TYPE in wire_striped_for(receiver)


# -- the fuzz tests -----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES, ids=str)
@FUZZ
@given(data=st.data())
def test_mutated_frame_streams(wire: WireKit, mode: Mode, data: st.DataObject) -> None:
    session = data.draw(wire.session(max_fragments=2), "session")
    messages: list[AnyMessage] = []
    if mode.first_frame:
        first = st.one_of(wire.hello(session), wire.message(FrameType.DATA_HELLO, session))
        messages.append(data.draw(first, "first"))
    messages += data.draw(
        st.lists(wire.message_for(mode.receiver, session), min_size=1, max_size=4), "messages"
    )
    stream, starts = framed(messages, mode.hello_key)
    for header_change in data.draw(st.lists(header_edit, max_size=2), "header edits"):
        apply_header_edit(stream, starts, header_change)
    for byte_change in data.draw(st.lists(byte_edit, max_size=3), "byte edits"):
        stream = apply_byte_edit(stream, byte_change)
    raw = bytes(stream)
    pieces = wire.pieces(raw, data.draw(wire.cuts(len(raw)), "cuts"))
    out = run_stream(wire, mode, session, pieces)
    reassemble_all(mode.receiver, session, [m for m in out if isinstance(m, Chunk)])


#: Random bytes, often behind a valid magic so that the type and length checks are reached.
garbage = st.one_of(
    st.binary(min_size=1, max_size=400),
    st.tuples(st.integers(0, 255), st.integers(0, U64), st.binary(max_size=400)).map(
        lambda t: struct.pack("<IBQ", 0xD170C0DE, t[0], t[1]) + t[2]
    ),
    st.tuples(st.integers(0, 15), st.integers(0, 600), st.binary(max_size=400)).map(
        lambda t: struct.pack("<IBQ", 0xD170C0DE, t[0], t[1]) + t[2]
    ),
)


@pytest.mark.parametrize("mode", MODES, ids=str)
@FUZZ
@given(data=st.data())
def test_random_bytes(wire: WireKit, mode: Mode, data: st.DataObject) -> None:
    session = data.draw(wire.session(max_fragments=2), "session")
    prefix = b""
    if mode.first_frame and data.draw(st.booleans(), "after a valid hello"):
        prefix = encode_bytes(data.draw(wire.hello(session), "hello"), hello_key=mode.hello_key)
    raw = prefix + data.draw(garbage, "garbage")
    pieces = wire.pieces(raw, data.draw(wire.cuts(len(raw)), "cuts"))
    run_stream(wire, mode, session, pieces)


chunk_edit = st.one_of(
    st.tuples(st.just("msg_id"), st.integers(0, U64)),
    st.tuples(st.just("total_len"), st.one_of(st.integers(0, U64), st.integers(0, 400))),
    st.tuples(st.just("offset"), st.one_of(st.integers(0, U64), st.integers(0, 400))),
    st.tuples(st.just("data"), st.binary(max_size=64)),
    st.tuples(st.just("duplicate"), st.just(0)),
    st.tuples(st.just("drop"), st.just(0)),
)


@pytest.mark.parametrize("receiver", list(Role), ids=lambda r: r.value)
@FUZZ
@given(data=st.data())
def test_reassembler_with_edited_chunks_and_inner_frames(
    wire: WireKit, receiver: Role, data: st.DataObject
) -> None:
    session = data.draw(wire.session(max_fragments=2), "session")
    # Any striped type, either direction: a wrong-direction inner frame must be refused too.
    messages = data.draw(
        st.lists(
            st.sampled_from(STRIPED).flatmap(lambda t: wire.message(t, session)),
            min_size=1,
            max_size=3,
        ),
        "messages",
    )
    slicer = ChunkSlicer(data.draw(st.integers(1, 3)), slice_size=data.draw(st.integers(1, 500)))
    chunks: list[Chunk] = []
    for message in messages:
        inner, starts = framed([message])
        for header_change in data.draw(st.lists(header_edit, max_size=1), "inner header edit"):
            apply_header_edit(inner, starts, header_change)
        for byte_change in data.draw(st.lists(byte_edit, max_size=1), "inner byte edit"):
            inner = apply_byte_edit(inner, byte_change)
        for striped in slicer.slice([bytes(inner)]):
            raw = b"".join(bytes(b) for b in striped.buffers)
            msg_id, total, offset = struct.unpack_from("<QQQ", raw, 13)
            chunks.append(Chunk(msg_id, total, offset, memoryview(raw)[37:]))
    for index, (field, value) in data.draw(
        st.lists(st.tuples(st.integers(0, 100), chunk_edit), max_size=4), "chunk edits"
    ):
        if not chunks:
            break
        at = index % len(chunks)
        old = chunks[at]
        if field == "duplicate":
            chunks.insert(at, old)
        elif field == "drop":
            del chunks[at]
        elif isinstance(value, bytes):
            chunks[at] = Chunk(old.msg_id, old.total_len, old.offset, memoryview(value))
        else:
            numbers = {"msg_id": old.msg_id, "total_len": old.total_len, "offset": old.offset}
            numbers[field] = value
            chunks[at] = Chunk(data=old.data, **numbers)
    order = data.draw(st.permutations(chunks), "order")
    reassemble_all(receiver, session, list(order))


@FUZZ
@given(data=st.data())
def test_decode_payload_and_inner_frames_on_garbage(wire: WireKit, data: st.DataObject) -> None:
    session = data.draw(wire.session(max_fragments=2), "session")
    frame_type = data.draw(st.sampled_from(list(FrameType)), "type")
    payload = data.draw(st.binary(max_size=300), "payload")
    limits = data.draw(st.sampled_from([None, session.limits]), "limits")
    key = data.draw(st.sampled_from([None, b"key"]), "key")
    try:
        decode_payload(
            frame_type,
            memoryview(payload),
            limits=limits,
            num_learners=session.num_learners,
            hello_key=key,
        )
    except ProtocolError:
        pass
    receiver = data.draw(st.sampled_from(list(Role)), "receiver")
    try:
        decode_inner_frame(payload, receiver, session.limits)
    except ProtocolError:
        pass
