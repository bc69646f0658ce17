"""Messages: constructor validation, zero-copy encoding, and round trips through a decoder."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from yeto_proto import (
    CLOSED,
    NEED_DATA,
    BcastFragment,
    BudgetDone,
    Chunk,
    DataHello,
    ErrorCode,
    ErrorMessage,
    FinalAck,
    FinalFragment,
    FinalManifest,
    FrameDecoder,
    FrameType,
    Heartbeat,
    Hello,
    InitParams,
    Limits,
    LocalProtocolError,
    MergeMode,
    PullReq,
    PushFragment,
    Role,
    WireDtype,
    WireFragment,
    WireLayout,
    encode,
    encode_bytes,
)
from yeto_proto.messages import MESSAGE_CLASSES

if TYPE_CHECKING:
    from conftest import Session, WireKit

U32 = (1 << 32) - 1
U64 = (1 << 64) - 1
LAYOUT = WireLayout((WireFragment(MergeMode.AVG, (3, 5)),))
DIGEST = bytes(range(32))


def test_every_frame_type_has_exactly_one_message_class() -> None:
    assert set(MESSAGE_CLASSES) == set(FrameType)
    assert all(cls.TYPE is t for t, cls in MESSAGE_CLASSES.items())


@pytest.mark.parametrize(
    "build",
    [
        lambda: PullReq(U32 + 1, 0, 0),
        lambda: PullReq(0, U64 + 1, 0),
        lambda: PullReq(0, 0, -1),
        lambda: Heartbeat(-1, 0),
        lambda: BudgetDone(U64 + 1),
        lambda: FinalAck(-1),
        lambda: FinalManifest(0, (U64 + 1,)),
        lambda: BcastFragment(0, U64 + 1, memoryview(b"")),
        lambda: InitParams(U32 + 1, memoryview(b"")),
        lambda: Chunk(0, U64 + 1, 0, memoryview(b"x")),
        lambda: DataHello(0, 1, 1 << 16),
        lambda: PushFragment(0, 0, 0, 0, 0, 0, U32 + 1, 0, memoryview(b"")),
    ],
)
def test_fields_outside_their_wire_width_are_refused(build: object) -> None:
    assert callable(build)
    with pytest.raises(LocalProtocolError) as caught:
        build()
    assert caught.value.code is ErrorCode.FIELD_OUT_OF_RANGE


def test_constructors_enforce_protocol_rules() -> None:
    cases: list[tuple[Callable[[], object], ErrorCode]] = [
        (lambda: PushFragment(0, 0, 1, 1, 0, 1, 0, 1, memoryview(b"")), ErrorCode.ZERO_C_STEPS),
        (lambda: DataHello(0, 0, 0), ErrorCode.ZERO_GENERATION),
        (lambda: Hello(0, 0, WireDtype.F32, LAYOUT, DIGEST, DIGEST, 1), ErrorCode.ZERO_GENERATION),
        (
            lambda: Hello(0, 1, WireDtype.F32, LAYOUT, DIGEST, DIGEST, 257),
            ErrorCode.TOO_MANY_STREAMS,
        ),
        (
            lambda: Hello(0, 1, WireDtype.F32, LAYOUT, DIGEST[:31], DIGEST, 1),
            ErrorCode.BAD_HELLO_TAIL,
        ),
        (
            lambda: Hello(0, 1, WireDtype.F32, LAYOUT, DIGEST, DIGEST, 1, profile_hash=b"x"),
            ErrorCode.BAD_HELLO_TAIL,
        ),
        (lambda: FinalFragment(0, 0, memoryview(bytes(6))), ErrorCode.BAD_TENSOR_LENGTH),
        (lambda: ErrorMessage("x" * 65_537), ErrorCode.FRAME_TOO_LARGE),
        (lambda: ErrorMessage("é" * 32_769), ErrorCode.FRAME_TOO_LARGE),  # 65,538 UTF-8 bytes
        (lambda: ErrorMessage("\ud800"), ErrorCode.INVALID_UTF8),
        (lambda: WireFragment(MergeMode.AVG, ()), ErrorCode.EMPTY_FRAGMENT),
        (lambda: WireFragment(MergeMode.AVG, (4, 0)), ErrorCode.ZERO_NUMEL),
        (lambda: WireFragment(MergeMode.AVG, (U64 + 1,)), ErrorCode.SIZE_OVERFLOW),
        (lambda: WireFragment(MergeMode.AVG, (U64, 1)), ErrorCode.SIZE_OVERFLOW),
        (lambda: WireFragment(MergeMode.ISO, (6,), ((2, 2),)), ErrorCode.BAD_ISO_SHAPE),
        (lambda: WireFragment(MergeMode.ISO, (6,)), ErrorCode.BAD_ISO_SHAPE),
        (lambda: WireFragment(MergeMode.RDA, (6,), ((2, 3),)), ErrorCode.BAD_ISO_SHAPE),
        (lambda: WireLayout(()), ErrorCode.NO_FRAGMENTS),
    ]
    for build, code in cases:
        with pytest.raises(LocalProtocolError) as caught:
            build()
        assert caught.value.code is code, code


def test_encode_never_builds_a_frame_the_receiver_refuses() -> None:
    """Each refusal is a LocalProtocolError with the code the receiving decoder would give,
    never construct's own exception and never bytes on the wire."""
    huge = WireLayout((WireFragment(MergeMode.AVG, (1 << 62,)),))  # over HELLO's numel bound
    # A body 20 bytes under 16 MiB: its 32-byte MAC takes it over the first-frame limit.
    count = (16 * 2**20 - 20 - 19 - 66) // 13
    many = WireLayout((WireFragment(MergeMode.AVG, (1,)),) * count)
    near_limit = Hello(0, 1, WireDtype.F32, many, DIGEST, DIGEST, 0)
    assert len(encode_bytes(near_limit)) - 13 == 16 * 2**20 - 20
    cases: list[tuple[Callable[[], object], ErrorCode]] = [
        (
            lambda: encode(Hello(0, 1, WireDtype.F32, huge, DIGEST, DIGEST, 0)),
            ErrorCode.SIZE_OVERFLOW,
        ),
        (lambda: encode(near_limit, hello_key=b"key"), ErrorCode.FRAME_TOO_LARGE),
        (lambda: encode(Chunk(0, 100, 0, memoryview(b""))), ErrorCode.CHUNK_EMPTY),
        (
            lambda: encode(Chunk(0, 13 + 2**23, 0, memoryview(bytes(2**22 + 1)))),
            ErrorCode.FRAME_TOO_LARGE,
        ),
    ]
    for build, code in cases:
        with pytest.raises(LocalProtocolError) as caught:
            build()
        assert caught.value.code is code, code
    assert len(encode_bytes(Chunk(0, 13 + 2**23, 0, memoryview(bytes(2**22))))) == 13 + 24 + 2**22


def test_limits_at_the_edge_are_accepted() -> None:
    assert len(ErrorMessage("x" * 65_536).text) == 65_536
    assert Hello(0, 1, WireDtype.Q4, LAYOUT, DIGEST, DIGEST, 256).num_streams == 256
    assert PushFragment(U32, U32, U64, U32, U64, U64, 1, U64, memoryview(b"")).c_steps == 1


def test_messages_are_frozen() -> None:
    message = PullReq(1, 2, 3)
    with pytest.raises(AttributeError):
        message.fragment_id = 4  # type: ignore[misc]


def test_tensor_fields_are_read_only_views_of_the_callers_memory() -> None:
    values = np.arange(6, dtype="<f4")
    message = BcastFragment(0, 7, values.data)
    assert message.data.readonly and message.data.format == "B" and len(message.data) == 24
    assert np.shares_memory(np.frombuffer(message.data, dtype="<f4"), values)


def test_encode_hands_tensor_bytes_to_the_writer_without_copying() -> None:
    values = np.arange(10, dtype="<f4")
    buffers = encode(FinalFragment(2, 9, values.data))
    assert len(buffers) == 2
    head, body = buffers
    assert len(head) == 13 + 12
    assert isinstance(body, memoryview)
    assert np.shares_memory(np.frombuffer(body, dtype="<f4"), values)


def test_encode_bytes_lays_out_fields_little_endian() -> None:
    frame = encode_bytes(PullReq(0x01020304, 0x1122334455667788, 0x0A0B0C0D))
    assert frame == bytes.fromhex("dec070d10310000000000000000403020188776655443322110d0c0b0a")
    assert encode_bytes(FinalAck(5)) == bytes.fromhex(
        "dec070d10c0a0000000000000001000500000000000000"
    )
    assert encode_bytes(ErrorMessage("no")) == bytes.fromhex("dec070d10a0200000000000000") + b"no"


# -- round trips -----------------------------------------------------------------------------


def _decoder_for(
    wire: WireKit, receiver: Role, session: Session, first: bool, key: bytes | None
) -> FrameDecoder:
    if first:  # HELLO and DATA_HELLO are only legal as a socket's first frame
        return FrameDecoder(receiver, num_learners=session.num_learners, hello_key=key)
    return wire.decoder(receiver, session, hello_key=key)


@pytest.mark.parametrize("frame_type", list(FrameType), ids=lambda t: t.name)
@settings(max_examples=25)
@given(data=st.data())
def test_round_trip_through_the_receiving_decoder(
    wire: WireKit, frame_type: FrameType, data: st.DataObject
) -> None:
    session = data.draw(wire.session(), "session")
    message = data.draw(wire.message(frame_type, session), "message")
    key = None
    if frame_type is FrameType.HELLO:
        key = data.draw(st.none() | st.binary(min_size=1, max_size=64), "hello_key")
    frame = encode_bytes(message, hello_key=key)
    first = frame_type in (FrameType.HELLO, FrameType.DATA_HELLO)

    for receiver in wire.receivers_of(frame_type):
        # Whole.
        decoder = _decoder_for(wire, receiver, session, first, key)
        decoder.feed(frame)
        assert wire.drain(decoder) == ([message], NEED_DATA)
        assert not decoder.mid_frame

        # A byte at a time: nothing comes out before the last byte.
        decoder = _decoder_for(wire, receiver, session, first, key)
        for i in range(len(frame) - 1):
            decoder.feed(frame[i : i + 1])
            assert wire.drain(decoder) == ([], NEED_DATA)
        decoder.feed(frame[-1:])
        assert wire.drain(decoder) == ([message], NEED_DATA)

        # Random splits.
        decoder = _decoder_for(wire, receiver, session, first, key)
        cuts = data.draw(wire.cuts(len(frame)), "cuts")
        assert wire.feed_pieces(decoder, wire.pieces(frame, cuts)) == [message]

        # Trailing data: part of the next frame stays buffered until the rest arrives.
        follower = data.draw(wire.message_for(receiver, session), "follower")
        following = encode_bytes(follower)
        split = data.draw(st.integers(1, len(following) - 1), "split")
        decoder = _decoder_for(wire, receiver, session, first, key)
        decoder.feed(frame + following[:split])
        assert wire.drain(decoder) == ([message], NEED_DATA)
        assert decoder.mid_frame
        if decoder.limits is None:  # a syncer past its first frame waits for the session
            decoder.set_limits(session.limits)
        decoder.feed(following[split:])
        assert wire.drain(decoder) == ([follower], NEED_DATA)
        decoder.feed(b"")
        assert wire.drain(decoder) == ([], CLOSED)


@settings(max_examples=30)
@given(data=st.data())
def test_hello_with_iso_fragments_profile_hash_and_mac_round_trips(
    wire: WireKit, data: st.DataObject
) -> None:
    session = data.draw(wire.session(), "session")
    iso = data.draw(wire.fragment().filter(lambda f: f.merge_mode is MergeMode.ISO), "iso")
    session = type(session)(
        session.dtype, WireLayout((*session.layout.fragments, iso)), session.num_learners
    )
    hello = data.draw(wire.hello(session, profile_hash=True), "hello")
    key = data.draw(st.binary(min_size=1, max_size=64), "key")
    frame = encode_bytes(hello, hello_key=key)
    decoder = FrameDecoder(Role.SYNCER, num_learners=session.num_learners, hello_key=key)
    decoder.feed(frame)
    (decoded,), _ = wire.drain(decoder)
    assert decoded == hello
    assert isinstance(decoded, Hello)
    assert decoded.profile_hash == hello.profile_hash
    assert decoded.layout.fragments[-1].matrix_shapes == iso.matrix_shapes


@settings(max_examples=30)
@given(data=st.data())
def test_a_stream_of_messages_decodes_in_order(wire: WireKit, data: st.DataObject) -> None:
    session = data.draw(wire.session(), "session")
    receiver = data.draw(st.sampled_from(list(Role)), "receiver")
    messages = data.draw(st.lists(wire.message_for(receiver, session), max_size=6), "messages")
    stream = b"".join(encode_bytes(m) for m in messages)
    decoder = wire.decoder(receiver, session)
    cuts = data.draw(wire.cuts(len(stream)), "cuts")
    assert wire.feed_pieces(decoder, wire.pieces(stream, cuts)) == messages


def test_outgoing_buffers_resume_after_partial_sends() -> None:
    from yeto_proto.frames import OutgoingBuffers

    frame = [b"abc", memoryview(b""), memoryview(b"defgh"), b"ij"]
    pending = OutgoingBuffers(frame, iov_max=2)
    written = b""
    for sent in (2, 2, 3, 1, 2):  # splits inside and across buffers
        batch = pending.batch()
        assert 1 <= len(batch) <= 2
        written += b"".join(bytes(v) for v in batch)[:sent]
        pending.advance(sent)
    assert pending.done and written == b"abcdefghij"


def test_limits_scan_the_fragment_numels_once() -> None:
    """A HELLO may declare 1.29M fragments; each frame header used to rescan them all (25 ms)."""

    class CountedNumels(tuple[int, ...]):
        scans = 0

        def __iter__(self) -> Iterator[int]:
            CountedNumels.scans += 1
            return super().__iter__()

    limits = Limits(WireDtype.BF16, CountedNumels((5, 9, 3)))
    assert CountedNumels.scans == 1 and limits.max_numel == 9
    for frame_type in FrameType:
        limits.payload_limit(frame_type)
    assert CountedNumels.scans == 1
