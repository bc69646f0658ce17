"""FrameDecoder: limits before allocation, the first frame, directions, set_limits, HELLO checks,
end of stream and poisoning. Expected numbers are computed here from the pinned formulas, not
read back from yeto_proto.limits."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import hmac
import itertools
import math
import struct
import tracemalloc
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import pytest

from yeto_proto import (
    CLOSED,
    NEED_DATA,
    WORKING,
    AnyMessage,
    BcastFragment,
    BudgetDone,
    DataHello,
    ErrorCode,
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
    ProtocolError,
    PullReq,
    PushFragment,
    RemoteProtocolError,
    Role,
    Shutdown,
    WireDtype,
    WireFragment,
    WireLayout,
    decode_payload,
    encode_bytes,
)
from yeto_proto.decoder import HELD_BYTES_CAP, PARSED_AHEAD
from yeto_proto.frames import header

MAGIC = struct.pack("<I", 0xD170C0DE)
MiB = 1 << 20
DIGEST_A, DIGEST_B, DIGEST_C = b"\xaa" * 32, b"\xbb" * 32, b"\xcc" * 32

#: Two fragments, the first smaller than the second so that exact-length checks can be told
#: apart from the per-type limit, which follows the largest fragment.
LAYOUT = WireLayout(
    (
        WireFragment(MergeMode.AVG, (100, 200)),
        WireFragment(MergeMode.ISO, (600, 400), ((20, 30), (20, 20))),
    )
)
SMALL, BIG = 300, 1000  # numel of fragment 0 and 1


def raw_header(frame_type: int, length: int, magic: bytes = MAGIC) -> bytes:
    """A frame header built by hand: magic u32 | type u8 | len u64, little-endian."""
    return magic + struct.pack("<BQ", frame_type, length)


def limits(dtype: WireDtype = WireDtype.F32) -> Limits:
    return Limits.of(dtype, LAYOUT)


def learner_decoder(dtype: WireDtype = WireDtype.F32) -> FrameDecoder:
    return FrameDecoder(Role.LEARNER, limits=limits(dtype))


def syncer_decoder(dtype: WireDtype = WireDtype.F32) -> FrameDecoder:
    """A syncer decoder past its first frame."""
    return FrameDecoder(Role.SYNCER, limits=limits(dtype), enforce_first_frame=False)


def expect_error(decoder: FrameDecoder, code: ErrorCode) -> RemoteProtocolError:
    with pytest.raises(RemoteProtocolError) as caught:
        decoder.frames()
    assert caught.value.code is code, caught.value
    return caught.value


def same_error(again: ProtocolError, first: ProtocolError) -> bool:
    """A poisoned decoder raises an equal error each time (a fresh object: no cycle)."""
    return (type(again), again.code, again.detail) == (type(first), first.code, first.detail)


def hello(**overrides: object) -> Hello:
    fields: dict[str, object] = {
        "learner_id": 1,
        "generation": 7,
        "dtype": WireDtype.F32,
        "layout": LAYOUT,
        "layout_fingerprint": DIGEST_A,
        "session_contract": DIGEST_B,
        "num_streams": 2,
    }
    fields.update(overrides)
    return Hello(**fields)  # type: ignore[arg-type]


# -- limits are checked on the 13 header bytes, before any payload is buffered ------------------


@pytest.mark.parametrize("length", [1 << 62, 1 << 63, (1 << 64) - 1])
@pytest.mark.parametrize(
    ("make", "frame_type"),
    [
        (lambda: FrameDecoder(Role.SYNCER), FrameType.HELLO),
        (syncer_decoder, FrameType.PUSH_FRAGMENT),
        (learner_decoder, FrameType.BCAST_FRAGMENT),
        (learner_decoder, FrameType.ERROR),
        (learner_decoder, FrameType.CHUNK),
    ],
)
def test_a_huge_declared_length_fails_right_after_the_header(
    make: Callable[[], FrameDecoder], frame_type: FrameType, length: int
) -> None:
    decoder = make()
    head = raw_header(frame_type, length)
    tracemalloc.start()
    try:
        decoder.feed(head[:12])
        assert decoder.next_frame() is NEED_DATA  # 12 bytes cannot be judged yet
        decoder.feed(head[12:])
        error = expect_error(decoder, ErrorCode.FRAME_TOO_LARGE)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 256 * 1024, peak
    assert str(length) in str(error)


@pytest.mark.parametrize("length", [1 << 62, 1 << 63])
def test_a_length_within_a_huge_negotiated_limit_fails_cleanly_when_unallocatable(
    length: int,
) -> None:
    # A HELLO may declare fragments this large; the per-type limit then exceeds any memory.
    giant = Limits.of(WireDtype.F32, WireLayout((WireFragment(MergeMode.AVG, (1 << 61,)),)))
    assert giant.payload_limit(FrameType.BCAST_FRAGMENT) >= length
    decoder = FrameDecoder(Role.LEARNER, limits=giant)
    tracemalloc.start()
    try:
        decoder.feed(raw_header(FrameType.BCAST_FRAGMENT, length))
        expect_error(decoder, ErrorCode.FRAME_TOO_LARGE)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 256 * 1024, peak


def test_hello_counts_are_bounded_by_the_payload_before_allocation() -> None:
    prefix = struct.pack("<HIQBI", 4, 0, 1, 1, 0xFFFF_FFFF)  # 2^32 - 1 fragments
    tiny_fragment = struct.pack("<BI", 0, 0xFFFF_FFFF)  # 2^32 - 1 tensors
    for payload in (prefix + bytes(80), struct.pack("<HIQBI", 4, 0, 1, 1, 1) + tiny_fragment):
        decoder = FrameDecoder(Role.SYNCER)
        tracemalloc.start()
        try:
            decoder.feed(header(FrameType.HELLO, len(payload)) + payload)
            expect_error(decoder, ErrorCode.TRUNCATED_PAYLOAD)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 1 * MiB, peak


# -- the first frame ------------------------------------------------------------------------------


@pytest.mark.parametrize("raw_type", [t for t in range(256) if t not in (1, 8)][::7] + [2, 9, 10])
def test_only_hello_or_data_hello_may_open_a_syncer_socket(raw_type: int) -> None:
    decoder = FrameDecoder(Role.SYNCER)
    decoder.feed(raw_header(raw_type, 16))
    error = expect_error(decoder, ErrorCode.INVALID_FIRST_FRAME)
    assert "invalid first frame" in str(error)


def test_the_first_frame_is_capped_at_16_mib() -> None:
    at_cap = FrameDecoder(Role.SYNCER)
    at_cap.feed(raw_header(FrameType.HELLO, 16 * MiB))
    assert at_cap.next_frame() is NEED_DATA and at_cap.mid_frame
    over = FrameDecoder(Role.SYNCER)
    over.feed(raw_header(FrameType.HELLO, 16 * MiB + 1))
    expect_error(over, ErrorCode.FRAME_TOO_LARGE)


@pytest.mark.parametrize("length", [0, 15, 17, 16 * MiB])
def test_a_first_data_hello_has_exactly_16_bytes(length: int) -> None:
    decoder = FrameDecoder(Role.SYNCER)
    decoder.feed(raw_header(FrameType.DATA_HELLO, length))
    expect_error(decoder, ErrorCode.BAD_FRAME_LENGTH)


def test_bad_magic_is_refused_first_frame_or_not() -> None:
    for decoder in (FrameDecoder(Role.SYNCER), learner_decoder(), syncer_decoder()):
        decoder.feed(raw_header(FrameType.HELLO, 100, magic=b"\xde\xc0\x70\xd2"))
        expect_error(decoder, ErrorCode.BAD_MAGIC)


def test_a_learner_decoder_needs_limits_and_has_no_first_frame_rule() -> None:
    with pytest.raises(LocalProtocolError):
        FrameDecoder(Role.LEARNER)
    decoder = learner_decoder()
    decoder.feed(encode_bytes(PullReq(1, 2, 3)))
    assert decoder.frames() == [PullReq(1, 2, 3)]


# -- exact and derived sizes ----------------------------------------------------------------------

EXACT = {
    FrameType.PULL_REQ: (Role.LEARNER, 16),
    FrameType.HEARTBEAT: (Role.SYNCER, 12),
    FrameType.FINAL_ACK: (Role.SYNCER, 10),
    FrameType.BUDGET_DONE: (Role.SYNCER, 8),
    FrameType.SHUTDOWN: (Role.LEARNER, 0),
    FrameType.FINAL_MANIFEST: (Role.LEARNER, 14 + 8 * 2),
}


def _decoder(receiver: Role, dtype: WireDtype = WireDtype.F32) -> FrameDecoder:
    return learner_decoder(dtype) if receiver is Role.LEARNER else syncer_decoder(dtype)


@pytest.mark.parametrize("frame_type", list(EXACT), ids=lambda t: t.name)
def test_exact_sizes(frame_type: FrameType) -> None:
    receiver, size = EXACT[frame_type]
    for wrong in (size - 8, size - 1, size + 1, size + 8, 1 << 40):
        if wrong < 0:
            continue
        decoder = _decoder(receiver)
        decoder.feed(raw_header(frame_type, wrong))
        expect_error(decoder, ErrorCode.BAD_FRAME_LENGTH)
    decoder = _decoder(receiver)
    decoder.feed(raw_header(frame_type, size))
    # The header is accepted: a payload is awaited (or, for SHUTDOWN, the frame is complete).
    assert decoder.next_frame() == (Shutdown() if size == 0 else NEED_DATA)


def _bulk_limits(dtype: WireDtype) -> dict[FrameType, tuple[Role, int]]:
    """Per-type payload limits from the pinned formulas, for the largest fragment (numel BIG)."""
    bulk_bytes = BIG * (4 if dtype is WireDtype.F32 else 2)
    push_bytes = math.ceil(BIG / 256) * 132 if dtype is WireDtype.Q4 else bulk_bytes
    return {
        FrameType.INIT_PARAMS: (Role.SYNCER, 4 + bulk_bytes),
        FrameType.PUSH_FRAGMENT: (Role.SYNCER, 48 + push_bytes),
        FrameType.BCAST_FRAGMENT: (Role.LEARNER, 12 + bulk_bytes),
        FrameType.FINAL_FRAGMENT: (Role.LEARNER, 12 + 4 * BIG),
        FrameType.ERROR: (Role.LEARNER, 65_536),
        FrameType.CHUNK: (Role.SYNCER, 24 + 4 * MiB),
    }


@pytest.mark.parametrize("dtype", list(WireDtype), ids=lambda d: d.name)
def test_derived_limits_accept_the_limit_and_refuse_one_more(dtype: WireDtype) -> None:
    for frame_type, (receiver, limit) in _bulk_limits(dtype).items():
        assert limits(dtype).payload_limit(frame_type) == limit, frame_type
        decoder = _decoder(receiver, dtype)
        decoder.feed(raw_header(frame_type, limit))
        assert decoder.next_frame() is NEED_DATA, frame_type
        decoder = _decoder(receiver, dtype)
        decoder.feed(raw_header(frame_type, limit + 1))
        expect_error(decoder, ErrorCode.FRAME_TOO_LARGE)
    learner_chunk = learner_decoder(dtype)
    learner_chunk.feed(raw_header(FrameType.CHUNK, 24 + 4 * MiB + 1))
    expect_error(learner_chunk, ErrorCode.FRAME_TOO_LARGE)


def test_q4_push_limit_counts_whole_132_byte_blocks() -> None:
    q4 = Limits.of(WireDtype.Q4, WireLayout((WireFragment(MergeMode.AVG, (257,)),)))
    assert q4.tensor_bytes(FrameType.PUSH_FRAGMENT, 0) == 2 * 132
    assert q4.payload_limit(FrameType.PUSH_FRAGMENT) == 48 + 264
    # INIT and BCAST stay bf16 in a q4 session.
    assert q4.payload_limit(FrameType.INIT_PARAMS) == 4 + 2 * 257
    assert q4.payload_limit(FrameType.BCAST_FRAGMENT) == 12 + 2 * 257


def test_a_chunk_without_data_is_refused_at_the_header() -> None:
    decoder = syncer_decoder()
    decoder.feed(raw_header(FrameType.CHUNK, 24))
    expect_error(decoder, ErrorCode.CHUNK_EMPTY)
    decoder = learner_decoder()
    decoder.feed(raw_header(FrameType.CHUNK, 23))
    expect_error(decoder, ErrorCode.TRUNCATED_PAYLOAD)


# -- directions -----------------------------------------------------------------------------------

LEARNER_TO_SYNCER = {1, 2, 4, 6, 8, 9, 12, 14}
SYNCER_TO_LEARNER = {3, 5, 7, 9, 10, 11, 13}
DIRECTION_CODES = {
    ErrorCode.UNKNOWN_FRAME_TYPE,
    ErrorCode.WRONG_DIRECTION,
    ErrorCode.UNEXPECTED_HELLO,
}


@pytest.mark.parametrize("receiver", list(Role), ids=lambda r: r.value)
def test_frames_the_peer_may_not_send_are_refused(receiver: Role) -> None:
    allowed = LEARNER_TO_SYNCER if receiver is Role.SYNCER else SYNCER_TO_LEARNER
    for raw_type in range(256):
        decoder = _decoder(receiver)
        decoder.feed(raw_header(raw_type, 16))
        if raw_type not in range(1, 15):
            expect_error(decoder, ErrorCode.UNKNOWN_FRAME_TYPE)
        elif raw_type not in allowed:
            expect_error(decoder, ErrorCode.WRONG_DIRECTION)
        elif raw_type in (FrameType.HELLO, FrameType.DATA_HELLO):
            expect_error(decoder, ErrorCode.UNEXPECTED_HELLO)
        else:  # accepted: whatever else happens, it is not about the type or direction
            try:
                decoder.frames()
            except RemoteProtocolError as exc:
                assert exc.code not in DIRECTION_CODES, (raw_type, exc)


# -- set_limits: a syncer learns the session from the first frame ---------------------------------


def test_bytes_after_the_first_frame_wait_for_set_limits() -> None:
    first = hello()
    after: list[AnyMessage] = [
        PushFragment(1, 0, 5, 1, 0, 9, 3, 400, memoryview(bytes(4 * SMALL))),
        Heartbeat(1, 9),
        BudgetDone(12),
    ]
    stream = encode_bytes(first) + b"".join(encode_bytes(m) for m in after)
    for step in (len(stream), 1, 7):
        decoder = FrameDecoder(Role.SYNCER, num_learners=4)
        got = []
        for i in range(0, len(stream), step):
            decoder.feed(stream[i : i + step])
            got += decoder.frames()
        assert got == [first]
        assert decoder.limits is None and decoder.mid_frame
        decoder.set_limits(Limits.of(first.dtype, first.layout))
        assert decoder.frames() == after
        decoder.feed(b"")
        assert decoder.next_frame() is CLOSED


def test_a_data_socket_also_waits_for_its_groups_limits() -> None:
    first = DataHello(1, 7, 0)
    push = PushFragment(1, 1, 5, 1, 0, 9, 3, 400, memoryview(bytes(4 * BIG)))
    decoder = FrameDecoder(Role.SYNCER, num_learners=4)
    decoder.feed(encode_bytes(first) + encode_bytes(push)[:50])
    assert decoder.frames() == [first]
    decoder.feed(encode_bytes(push)[50:])
    assert decoder.frames() == []
    decoder.set_limits(limits())
    assert decoder.frames() == [push]


def test_a_rule_broken_after_the_first_frame_surfaces_once_limits_are_set() -> None:
    decoder = FrameDecoder(Role.SYNCER, num_learners=4)
    decoder.feed(encode_bytes(hello()) + encode_bytes(hello()))
    assert decoder.frames() == [hello()]
    decoder.set_limits(limits())
    expect_error(decoder, ErrorCode.UNEXPECTED_HELLO)


# -- content checks after decode ------------------------------------------------------------------


def test_final_manifest_must_list_every_fragment_at_revision_1() -> None:
    good = FinalManifest(40, (39, 40))
    decoder = learner_decoder()
    decoder.feed(encode_bytes(good))
    assert decoder.frames() == [good]
    for manifest, code in [
        (FinalManifest(40, (39, 40, 41)), ErrorCode.BAD_FRAME_LENGTH),
        (FinalManifest(40, (39,)), ErrorCode.BAD_FRAME_LENGTH),
    ]:
        decoder = learner_decoder()
        decoder.feed(encode_bytes(manifest))
        expect_error(decoder, code)
    # Right length, wrong count field; then a wrong revision.
    body = struct.pack("<HQI", 1, 40, 3) + struct.pack("<QQ", 39, 40)
    decoder = learner_decoder()
    decoder.feed(header(FrameType.FINAL_MANIFEST, len(body)) + body)
    expect_error(decoder, ErrorCode.BAD_MANIFEST)
    body = struct.pack("<HQI", 2, 40, 2) + struct.pack("<QQ", 39, 40)
    decoder = learner_decoder()
    decoder.feed(header(FrameType.FINAL_MANIFEST, len(body)) + body)
    expect_error(decoder, ErrorCode.BAD_FINAL_REVISION)


def test_final_ack_revision_must_be_1() -> None:
    body = struct.pack("<HQ", 0, 40)
    decoder = syncer_decoder()
    decoder.feed(header(FrameType.FINAL_ACK, 10) + body)
    expect_error(decoder, ErrorCode.BAD_FINAL_REVISION)


def _bulk(frame_type: FrameType, fragment_id: int, size: int) -> bytes:
    data = memoryview(bytes(size))
    message: AnyMessage
    if frame_type is FrameType.INIT_PARAMS:
        message = InitParams(fragment_id, data)
    elif frame_type is FrameType.PUSH_FRAGMENT:
        message = PushFragment(0, fragment_id, 1, 1, 0, 1, 1, 1, data)
    elif frame_type is FrameType.BCAST_FRAGMENT:
        message = BcastFragment(fragment_id, 3, data)
    else:
        message = FinalFragment(fragment_id, 3, data)
    return encode_bytes(message)


@pytest.mark.parametrize("dtype", list(WireDtype), ids=lambda d: d.name)
@pytest.mark.parametrize(
    ("frame_type", "receiver"),
    [
        (FrameType.INIT_PARAMS, Role.SYNCER),
        (FrameType.PUSH_FRAGMENT, Role.SYNCER),
        (FrameType.BCAST_FRAGMENT, Role.LEARNER),
        (FrameType.FINAL_FRAGMENT, Role.LEARNER),
    ],
)
def test_fragment_id_and_exact_tensor_length_are_checked_after_decode(
    dtype: WireDtype, frame_type: FrameType, receiver: Role
) -> None:
    session = limits(dtype)
    small = session.tensor_bytes(frame_type, 0)
    big = session.tensor_bytes(frame_type, 1)
    step = 4 if frame_type is FrameType.FINAL_FRAGMENT else 1  # keep f32 bytes in fours
    cases = [
        (0, small, None),
        (1, big, None),
        (2, small, ErrorCode.BAD_FRAGMENT_ID),
        (0xFFFF_FFFF, small, ErrorCode.BAD_FRAGMENT_ID),
        (0, big, ErrorCode.BAD_TENSOR_LENGTH),  # under the type limit, wrong for fragment 0
        (0, small - step, ErrorCode.BAD_TENSOR_LENGTH),
        (1, big - step, ErrorCode.BAD_TENSOR_LENGTH),
        (0, 0, ErrorCode.BAD_TENSOR_LENGTH),
    ]
    for fragment_id, size, code in cases:
        decoder = _decoder(receiver, dtype)
        decoder.feed(_bulk(frame_type, fragment_id, size))
        if code is None:
            (message,) = decoder.frames()
            assert message.TYPE is frame_type
        else:
            expect_error(decoder, code)


def test_pull_fragment_id_is_checked() -> None:
    decoder = learner_decoder()
    decoder.feed(encode_bytes(PullReq(2, 1, 1)))
    expect_error(decoder, ErrorCode.BAD_FRAGMENT_ID)


def test_a_push_with_zero_c_steps_is_a_protocol_error() -> None:
    body = struct.pack("<IIQIQQIQ", 0, 0, 1, 1, 0, 1, 0, 1) + bytes(4 * SMALL)
    decoder = syncer_decoder()
    decoder.feed(header(FrameType.PUSH_FRAGMENT, len(body)) + body)
    expect_error(decoder, ErrorCode.ZERO_C_STEPS)


def test_error_text_must_be_utf8() -> None:
    decoder = learner_decoder()
    decoder.feed(header(FrameType.ERROR, 2) + b"\xc3\x28")
    expect_error(decoder, ErrorCode.INVALID_UTF8)


# -- HELLO: layout of the bytes, the 2/34-byte tail, the checks in pinned order -----------------


@dataclass
class RawFragment:
    merge_mode: int
    numels: list[int]
    shapes: list[tuple[int, int]] = field(default_factory=list)
    num_tensors: int | None = None  # None: len(numels)

    def encode(self) -> bytes:
        count = len(self.numels) if self.num_tensors is None else self.num_tensors
        out = struct.pack("<BI", self.merge_mode, count)
        out += b"".join(struct.pack("<Q", n) for n in self.numels)
        out += b"".join(struct.pack("<QQ", r, c) for r, c in self.shapes)
        return out


@dataclass
class RawHello:
    """A HELLO payload written field by field from PINNED.md, free to break any rule."""

    version: int = 4
    learner_id: int = 1
    generation: int = 7
    dtype: int = 1
    fragments: list[RawFragment] = field(
        default_factory=lambda: [
            RawFragment(0, [100, 200]),
            RawFragment(2, [600, 400], [(20, 30), (20, 20)]),
        ]
    )
    num_fragments: int | None = None
    fingerprint: bytes = DIGEST_A
    contract: bytes = DIGEST_B
    profile: bytes | None = None
    num_streams: int = 2
    tail_extra: bytes = b""

    def payload(self) -> bytes:
        count = len(self.fragments) if self.num_fragments is None else self.num_fragments
        out = struct.pack(
            "<HIQBI", self.version, self.learner_id, self.generation, self.dtype, count
        )
        out += b"".join(f.encode() for f in self.fragments)
        out += self.fingerprint + self.contract
        if self.profile is not None:
            out += self.profile
        return out + struct.pack("<H", self.num_streams) + self.tail_extra

    def frame(self) -> bytes:
        body = self.payload()
        return header(FrameType.HELLO, len(body)) + body


def test_hello_bytes_follow_the_pinned_layout() -> None:
    assert encode_bytes(hello()) == RawHello().frame()
    assert encode_bytes(hello(profile_hash=DIGEST_C)) == RawHello(profile=DIGEST_C).frame()


def _decode_hello(raw: RawHello, num_learners: int = 4) -> Hello | DataHello:
    decoder = FrameDecoder(Role.SYNCER, num_learners=num_learners)
    decoder.feed(raw.frame())
    (message,) = decoder.frames()
    assert isinstance(message, Hello | DataHello)
    return message


def _frag0(raw: RawHello) -> RawFragment:
    return raw.fragments[0]


def _set_frag0(raw: RawHello, **changes: object) -> None:
    raw.fragments[0] = replace(_frag0(raw), **changes)  # type: ignore[arg-type]


def _bad_iso(raw: RawHello) -> None:
    raw.fragments[1] = RawFragment(2, [600, 400], [(20, 30), (21, 20)])


#: One way to break each HELLO rule, in the pinned order of the checks (M = 4 learners).
HELLO_RULES: list[tuple[ErrorCode, Callable[[RawHello], None]]] = [
    (ErrorCode.UNSUPPORTED_VERSION, lambda r: setattr(r, "version", 3)),
    (ErrorCode.LEARNER_ID_OUT_OF_RANGE, lambda r: setattr(r, "learner_id", 4)),
    (ErrorCode.ZERO_GENERATION, lambda r: setattr(r, "generation", 0)),
    (ErrorCode.BAD_DTYPE, lambda r: setattr(r, "dtype", 4)),
    (ErrorCode.NO_FRAGMENTS, lambda r: setattr(r, "num_fragments", 0)),
    (ErrorCode.BAD_MERGE_MODE, lambda r: _set_frag0(r, merge_mode=3)),
    (ErrorCode.EMPTY_FRAGMENT, lambda r: _set_frag0(r, num_tensors=0)),
    (ErrorCode.ZERO_NUMEL, lambda r: _set_frag0(r, numels=[0, *_frag0(r).numels])),
    (ErrorCode.SIZE_OVERFLOW, lambda r: _set_frag0(r, numels=[*_frag0(r).numels, 1 << 63])),
    (ErrorCode.BAD_ISO_SHAPE, _bad_iso),
    (ErrorCode.TOO_MANY_STREAMS, lambda r: setattr(r, "num_streams", 257)),
]


@pytest.mark.parametrize(("code", "breaker"), HELLO_RULES, ids=[c.name for c, _ in HELLO_RULES])
def test_each_hello_rule_alone(code: ErrorCode, breaker: Callable[[RawHello], None]) -> None:
    raw = RawHello()
    assert isinstance(_decode_hello(raw), Hello)
    breaker(raw)
    with pytest.raises(RemoteProtocolError) as caught:
        _decode_hello(raw)
    assert caught.value.code is code


@pytest.mark.parametrize(
    ("earlier", "later"),
    list(itertools.combinations(range(len(HELLO_RULES)), 2)),
    ids=[
        f"{HELLO_RULES[i][0].name}-{HELLO_RULES[j][0].name}"
        for i, j in itertools.combinations(range(len(HELLO_RULES)), 2)
    ],
)
def test_the_earlier_hello_rule_wins(earlier: int, later: int) -> None:
    raw = RawHello()
    HELLO_RULES[later][1](raw)
    HELLO_RULES[earlier][1](raw)
    with pytest.raises(RemoteProtocolError) as caught:
        _decode_hello(raw)
    assert caught.value.code is HELLO_RULES[earlier][0]


def test_dtype_zero_and_every_valid_dtype() -> None:
    for dtype in (0, 4, 255):
        with pytest.raises(RemoteProtocolError) as caught:
            _decode_hello(RawHello(dtype=dtype))
        assert caught.value.code is ErrorCode.BAD_DTYPE
    for dtype in WireDtype:
        message = _decode_hello(RawHello(dtype=int(dtype)))
        assert isinstance(message, Hello) and message.dtype is dtype


def test_learner_id_is_checked_against_m_only_when_m_is_known() -> None:
    assert isinstance(_decode_hello(RawHello(learner_id=3), num_learners=4), Hello)
    with pytest.raises(RemoteProtocolError):
        _decode_hello(RawHello(learner_id=4), num_learners=4)
    decoder = FrameDecoder(Role.SYNCER)  # no M: the session layer decides
    decoder.feed(RawHello(learner_id=4000).frame())
    (message,) = decoder.frames()
    assert isinstance(message, Hello) and message.learner_id == 4000


def test_hello_tail_is_2_or_34_bytes() -> None:
    plain = _decode_hello(RawHello())
    bound = _decode_hello(RawHello(profile=DIGEST_C))
    assert isinstance(plain, Hello) and plain.profile_hash is None and plain.num_streams == 2
    assert isinstance(bound, Hello) and bound.profile_hash == DIGEST_C and bound.num_streams == 2
    bad_tails = [
        RawHello(tail_extra=b"\x00"),  # 3
        RawHello(profile=DIGEST_C[:31]),  # 33
        RawHello(profile=DIGEST_C, tail_extra=b"\x00"),  # 35
        RawHello(profile=DIGEST_C * 2),  # 66, e.g. a profile hash plus a MAC nobody expects
    ]
    for raw in bad_tails:
        with pytest.raises(RemoteProtocolError) as caught:
            _decode_hello(raw)
        assert caught.value.code is ErrorCode.BAD_HELLO_TAIL
    # Cut inside num_streams (1 byte left) or right after the contract (0 left).
    full = RawHello().payload()
    for cut in (1, 2):
        body = full[:-cut]
        decoder = FrameDecoder(Role.SYNCER)
        decoder.feed(header(FrameType.HELLO, len(body)) + body)
        expect_error(decoder, ErrorCode.BAD_HELLO_TAIL)
    # Cut inside the contract: a truncated payload.
    body = full[:-10]
    decoder = FrameDecoder(Role.SYNCER)
    decoder.feed(header(FrameType.HELLO, len(body)) + body)
    expect_error(decoder, ErrorCode.TRUNCATED_PAYLOAD)


@pytest.mark.parametrize("streams", [0, 1, 255, 256])
def test_num_streams_up_to_256(streams: int) -> None:
    message = _decode_hello(RawHello(num_streams=streams))
    assert isinstance(message, Hello) and message.num_streams == streams
    with pytest.raises(RemoteProtocolError) as caught:
        _decode_hello(RawHello(num_streams=0xFFFF))
    assert caught.value.code is ErrorCode.TOO_MANY_STREAMS


def test_data_hello_checks() -> None:
    def data_hello(version: int, learner: int, generation: int, stream: int) -> bytes:
        body = struct.pack("<HIQH", version, learner, generation, stream)
        return header(FrameType.DATA_HELLO, 16) + body

    decoder = FrameDecoder(Role.SYNCER, num_learners=4)
    decoder.feed(data_hello(4, 3, 9, 255))
    assert decoder.frames() == [DataHello(3, 9, 255)]
    for frame, code in [
        (data_hello(5, 3, 9, 0), ErrorCode.UNSUPPORTED_VERSION),
        (data_hello(5, 4, 0, 0), ErrorCode.UNSUPPORTED_VERSION),
        (data_hello(4, 4, 0, 0), ErrorCode.LEARNER_ID_OUT_OF_RANGE),
        (data_hello(4, 3, 0, 0), ErrorCode.ZERO_GENERATION),
    ]:
        decoder = FrameDecoder(Role.SYNCER, num_learners=4)
        decoder.feed(frame)
        expect_error(decoder, code)


def test_a_syncer_socket_reads_no_further_than_it_may_hold_before_its_limits() -> None:
    """First the first frame exactly, then at most HELD_BYTES_CAP held bytes, then nothing."""
    decoder = FrameDecoder(Role.SYNCER, num_learners=4)
    scratch = memoryview(bytearray(8 * MiB))
    frame = encode_bytes(DataHello(3, 9, 0))
    taken = b""
    while len(taken) < len(frame):  # header, then payload: never past the first frame
        into, direct = decoder.next_read(scratch)
        assert not direct and 0 < len(into) <= len(frame) - len(taken)
        piece = frame[len(taken) : len(taken) + len(into)]
        decoder.feed(piece)
        taken += piece
    assert decoder.frames() == [DataHello(3, 9, 0)]
    beat = encode_bytes(Heartbeat(3, 7))
    following = beat * (HELD_BYTES_CAP // len(beat) + 10)
    held = 0
    while True:
        into, _ = decoder.next_read(scratch)
        if not into:
            break
        piece = following[held : held + len(into)]
        decoder.feed(piece)
        held += len(piece)
    assert held == HELD_BYTES_CAP == decoder.held_bytes
    decoder.set_limits(limits())  # the held bytes decode now, and reads go on as usual
    assert len(decoder.frames()) == HELD_BYTES_CAP // len(beat)
    assert decoder.held_bytes == 0
    assert len(decoder.next_read(scratch)[0]) > 0


def test_a_first_frame_read_in_place_also_holds_what_follows_for_the_limits() -> None:
    """A HELLO of 64 KiB or more is read through writable()/wrote(), as the syncer's sockets
    read it: the frames behind it used to be decoded with no limits (a PUSH then failed with a
    local error, a HEARTBEAT reached a socket that had not joined its group)."""
    layout = WireLayout((WireFragment(MergeMode.AVG, (1,) * 8200),))
    first = Hello(1, 3, WireDtype.F32, layout, bytes(32), bytes(32), 0)
    after: list[AnyMessage] = [
        PushFragment(1, 0, 5, 1, 0, 9, 3, 400, memoryview(bytes(4 * 8200))),
        Heartbeat(1, 9),
    ]
    stream = encode_bytes(first) + b"".join(encode_bytes(m) for m in after)
    decoder = FrameDecoder(Role.SYNCER, num_learners=4)
    scratch = memoryview(bytearray(1 * MiB))
    at, in_place = 0, 0
    while at < len(stream):
        into, direct = decoder.next_read(scratch)
        if not into:
            break
        size = min(len(into), len(stream) - at)
        into[:size] = stream[at : at + size]
        if direct:
            decoder.wrote(size)
            in_place += size
        else:
            decoder.feed(into[:size])
        at += size
    assert in_place > 0  # the HELLO's payload did go the in-place way
    assert decoder.frames() == [first]
    assert decoder.limits is None and decoder.mid_frame
    decoder.set_limits(Limits.of(first.dtype, first.layout))
    assert decoder.frames() == after


# -- optional HELLO authentication ----------------------------------------------------------------

KEY = b"shared secret"


def _mac(key: bytes, body: bytes) -> bytes:
    return hmac.new(key, b"yeto-hello-mac-v1\0" + body, hashlib.sha256).digest()


def _keyed_decoder() -> FrameDecoder:
    return FrameDecoder(Role.SYNCER, num_learners=4, hello_key=KEY)


def test_a_signed_hello_carries_the_pinned_mac() -> None:
    body = RawHello().payload()
    assert encode_bytes(hello(), hello_key=KEY) == header(FrameType.HELLO, len(body) + 32) + (
        body + _mac(KEY, body)
    )
    decoder = _keyed_decoder()
    decoder.feed(encode_bytes(hello(), hello_key=KEY))
    assert decoder.frames() == [hello()]


def test_wrong_or_missing_mac_fails_authentication() -> None:
    body = RawHello().payload()
    tampered = bytearray(body + _mac(KEY, body))
    tampered[10] ^= 1
    candidates = [
        body,  # no MAC at all
        body + _mac(b"other key", body),
        bytes(tampered),
        body + _mac(KEY, body)[:-1],
        b"",
        _mac(KEY, b""),  # a valid MAC over an empty body
    ]
    for payload in candidates:
        decoder = _keyed_decoder()
        decoder.feed(header(FrameType.HELLO, len(payload)) + payload)
        if payload == _mac(KEY, b""):
            expect_error(decoder, ErrorCode.TRUNCATED_PAYLOAD)
        else:
            error = expect_error(decoder, ErrorCode.HELLO_AUTH_FAILED)
            assert error.fatal


def test_authentication_is_checked_before_the_version() -> None:
    body = RawHello(version=3).payload()
    decoder = _keyed_decoder()
    decoder.feed(header(FrameType.HELLO, len(body)) + body)
    expect_error(decoder, ErrorCode.HELLO_AUTH_FAILED)
    decoder = _keyed_decoder()
    decoder.feed(header(FrameType.HELLO, len(body) + 32) + body + _mac(KEY, body))
    expect_error(decoder, ErrorCode.UNSUPPORTED_VERSION)


def test_without_a_key_nothing_is_appended_and_data_hello_is_never_signed() -> None:
    assert encode_bytes(hello()) == RawHello().frame()
    decoder = _keyed_decoder()
    decoder.feed(encode_bytes(DataHello(1, 7, 0), hello_key=KEY))
    assert decoder.frames() == [DataHello(1, 7, 0)]
    assert decode_payload(FrameType.HELLO, memoryview(RawHello().payload())) == hello()


# -- frames parsed ahead -------------------------------------------------------------------------


def test_a_read_of_tiny_frames_waits_as_bytes_not_as_parsed_frames() -> None:
    """10,000 HEARTBEATs in one feed were 10,000 parsed frames at once, some 12x their bytes,
    for as long as the reader waited to hand them on (the syncer's full backlog)."""
    frames = [Heartbeat(1, step) for step in range(10_000)]
    data = b"".join(encode_bytes(frame) for frame in frames)
    decoder = syncer_decoder()
    tracemalloc.start()
    try:
        decoder.feed(data)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held < 1.5 * len(data) + PARSED_AHEAD * 1024, (held, len(data))
    assert decoder.frames() == frames


def test_bytes_fed_behind_waiting_ones_come_out_in_order_and_eof_after_them() -> None:
    frames = [Heartbeat(1, step) for step in range(3 * PARSED_AHEAD)]
    data = b"".join(encode_bytes(frame) for frame in frames)
    more = [InitParams(0, bytes(4 * SMALL))]
    decoder = syncer_decoder()
    decoder.feed(data)
    assert decoder.writable() is None  # the bytes that wait come before any read in place
    out: list[AnyMessage] = [decoder.next_frame()]  # type: ignore[list-item]
    tail = encode_bytes(more[0]) + encode_bytes(frames[0])
    decoder.feed(tail[:30])  # split inside a frame, behind the waiting bytes
    decoder.feed(tail[30:])
    decoder.feed(b"")
    out += decoder.frames()
    assert out == [*frames, *more, frames[0]]
    assert decoder.next_frame() is CLOSED


def test_an_error_behind_waiting_bytes_comes_after_the_frames_before_it() -> None:
    good = [Heartbeat(1, step) for step in range(2 * PARSED_AHEAD)]
    decoder = syncer_decoder()
    decoder.feed(b"".join(encode_bytes(frame) for frame in good) + raw_header(0x7F, 0))
    out = []
    with pytest.raises(RemoteProtocolError) as caught:
        while True:
            item = decoder.next_frame()
            assert not isinstance(item, type(NEED_DATA)), out
            out.append(item)
    assert out == good and caught.value.code is ErrorCode.UNKNOWN_FRAME_TYPE


# -- end of stream and poisoning ------------------------------------------------------------------


def test_end_of_stream_between_frames_is_clean() -> None:
    decoder = learner_decoder()
    decoder.feed(encode_bytes(Shutdown()))
    decoder.feed(b"")
    assert decoder.frames() == [Shutdown()]
    assert decoder.next_frame() is CLOSED
    assert decoder.next_frame() is CLOSED
    with pytest.raises(LocalProtocolError):
        decoder.feed(b"more")


@pytest.mark.parametrize("keep", [1, 12, 13, 20, 28])
def test_end_of_stream_inside_a_frame_is_an_error(keep: int) -> None:
    frame = encode_bytes(PullReq(1, 2, 3))  # 29 bytes
    decoder = learner_decoder()
    decoder.feed(encode_bytes(Shutdown()) + frame[:keep])
    assert decoder.next_frame() == Shutdown()
    assert decoder.next_frame() is NEED_DATA  # a short frame is not an error before the end
    decoder.feed(b"")
    first = expect_error(decoder, ErrorCode.CONNECTION_CLOSED_MID_FRAME)
    with pytest.raises(RemoteProtocolError) as again:
        decoder.next_frame()
    assert same_error(again.value, first)


def test_frames_before_a_fatal_error_come_out_first_then_the_error_sticks() -> None:
    decoder = learner_decoder()
    good = PullReq(0, 1, 1)
    decoder.feed(encode_bytes(good) + raw_header(FrameType.HEARTBEAT, 12) + encode_bytes(good))
    assert decoder.next_frame() == good
    with pytest.raises(RemoteProtocolError) as first:
        decoder.next_frame()
    assert first.value.code is ErrorCode.WRONG_DIRECTION
    decoder.feed(encode_bytes(good))  # ignored: the decoder is poisoned
    for _ in range(3):
        with pytest.raises(RemoteProtocolError) as again:
            decoder.next_frame()
        assert same_error(again.value, first.value)


def test_a_payload_error_poisons_too_and_drops_later_frames() -> None:
    decoder = learner_decoder()
    good = PullReq(0, 1, 1)
    decoder.feed(encode_bytes(good) + encode_bytes(PullReq(9, 1, 1)) + encode_bytes(good))
    assert decoder.next_frame() == good
    with pytest.raises(ProtocolError) as first:
        decoder.next_frame()
    assert first.value.code is ErrorCode.BAD_FRAGMENT_ID
    with pytest.raises(ProtocolError) as again:
        decoder.next_frame()
    assert same_error(again.value, first.value)
    decoder.feed(b"")
    with pytest.raises(ProtocolError) as after_eof:
        decoder.next_frame()
    assert same_error(after_eof.value, first.value)


@contextlib.contextmanager
def gc_disabled() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _fail_and_handle(decoder: FrameDecoder) -> ErrorCode:
    """What an owner does: take frames until the error, read it, and ask once more."""
    codes = []
    for _ in range(2):
        try:
            decoder.frames()
        except ProtocolError as exc:
            codes.append(exc.code)
    assert len(codes) == 2 and codes[0] is codes[1]
    return codes[0]


FAILURES: dict[str, tuple[Callable[[], FrameDecoder], bytes, bool, ErrorCode]] = {
    # a 16 MiB HELLO announced, 1 MiB of it sent, then the peer left
    "eof mid frame": (
        lambda: FrameDecoder(Role.SYNCER, num_learners=2),
        raw_header(FrameType.HELLO, 16 * MiB) + bytes(MiB),
        True,
        ErrorCode.CONNECTION_CLOSED_MID_FRAME,
    ),
    "bad header": (
        learner_decoder,
        encode_bytes(Shutdown()) + raw_header(FrameType.HEARTBEAT, 12),
        False,
        ErrorCode.WRONG_DIRECTION,
    ),
    "bad payload": (
        learner_decoder,
        encode_bytes(PullReq(9, 1, 1)),
        False,
        ErrorCode.BAD_FRAGMENT_ID,
    ),
}


@pytest.mark.parametrize("failure", sorted(FAILURES))
def test_a_failed_decoder_is_freed_by_reference_counting_alone(failure: str) -> None:
    # A stored exception keeps its traceback, whose frames hold the decoder: a cycle that
    # kept 48 half-sent 16 MiB HELLO buffers (838 MB) alive until the cyclic GC ran.
    make, data, eof, code = FAILURES[failure]
    with gc_disabled():
        decoder = make()
        decoder.feed(data)
        if eof:
            decoder.feed(b"")
        assert _fail_and_handle(decoder) is code
        freed = weakref.ref(decoder)
        del decoder
        assert freed() is None


def test_error_severity_is_fatal_for_framing_and_rejected_for_pushes() -> None:
    assert ErrorCode.BAD_MAGIC.severity.value == "fatal"
    assert RemoteProtocolError(ErrorCode.PUSH_DUPLICATE).fatal is False
    error = RemoteProtocolError(ErrorCode.CHUNK_OVERLAP, "bytes 0..4")
    assert error.code is ErrorCode.CHUNK_OVERLAP and "CHUNK_OVERLAP" in str(error)
    with pytest.raises(TypeError):
        ProtocolError(ErrorCode.BAD_MAGIC)


def test_final_ack_and_budget_done_round_trip_on_a_syncer() -> None:
    decoder = syncer_decoder()
    decoder.feed(encode_bytes(FinalAck(40)) + encode_bytes(BudgetDone(0)))
    assert decoder.frames() == [FinalAck(40), BudgetDone(0)]


def test_direct_reads_into_the_payload_buffer_decode_the_same_frame() -> None:
    """``writable``/``wrote`` let a socket fill the payload in place, skipping feed's copy."""
    import numpy as np

    from yeto_proto import BcastFragment, encode_bytes

    layout = WireLayout((WireFragment(MergeMode.AVG, (1000,)),))
    limits = Limits.of(WireDtype.F32, layout)
    message = BcastFragment(0, 3, np.arange(1000, dtype="<f4").data)
    raw = encode_bytes(message)
    decoder = FrameDecoder(Role.LEARNER, limits=limits)
    assert decoder.writable() is None  # header bytes go through feed
    decoder.feed(raw[:20])
    at = 20
    while (target := decoder.writable()) is not None:
        step = min(len(target), 777)
        target[:step] = raw[at : at + step]
        decoder.wrote(step)
        at += step
    assert at == len(raw)
    assert decoder.next_frame() == message
    with pytest.raises(LocalProtocolError):
        decoder.wrote(1)


def test_after_a_bulk_frame_the_decoder_asks_for_exactly_the_next_header() -> None:
    import numpy as np

    from yeto_proto import BcastFragment, Limits, MergeMode, Role, WireDtype, encode_bytes
    from yeto_proto.decoder import BULK_PAYLOAD, FrameDecoder
    from yeto_proto.layout import WireFragment, WireLayout

    numel = BULK_PAYLOAD  # a 4-byte-per-value payload well past the bulk mark
    layout = WireLayout((WireFragment(MergeMode.AVG, (numel,)),))
    frame = encode_bytes(BcastFragment(0, 1, np.zeros(numel, "<f4").data))
    decoder = FrameDecoder(Role.LEARNER, limits=Limits.of(WireDtype.F32, layout))
    assert decoder.header_wanted() == 0  # nothing bulk seen yet: read freely
    decoder.feed(frame[:5])
    assert decoder.header_wanted() == 0
    decoder.feed(frame[5:])
    assert decoder.header_wanted() == 13  # the next frame's header, and no more
    decoder.feed(frame[:10])
    assert decoder.header_wanted() == 3
    decoder.feed(frame[10:13])
    assert decoder.header_wanted() == 0  # inside the payload: writable() takes over
    assert decoder.writable() is not None


def test_a_reader_driven_by_next_read_decodes_everything_and_copies_only_small_bytes() -> None:
    """``next_read`` picks in place vs scratch; bulk payload bytes never pass through scratch."""
    import random

    import numpy as np

    from yeto_proto import BcastFragment, Limits, MergeMode, Role, WireDtype
    from yeto_proto import encode_bytes as frame_bytes
    from yeto_proto.decoder import BULK_PAYLOAD, FrameDecoder
    from yeto_proto.layout import WireFragment, WireLayout

    numel = 3 * BULK_PAYLOAD // 4 + 5  # f32 payload of 3 × 64 KiB + 20 bytes
    layout = WireLayout((WireFragment(MergeMode.AVG, (numel,)),))
    bulk = [BcastFragment(0, v, np.full(numel, v, "<f4").data) for v in (1, 2, 3)]
    small = [PullReq(0, 1, 1), PullReq(0, 2, 2)]
    messages = [small[0], bulk[0], bulk[1], small[1], bulk[2], small[0]]
    wire = b"".join(frame_bytes(m) for m in messages)
    decoder = FrameDecoder(Role.LEARNER, limits=Limits.of(WireDtype.F32, layout))
    scratch = memoryview(bytearray(1 << 16))
    rng = random.Random(7)
    at = through_scratch = 0
    while at < len(wire):
        into, direct = decoder.next_read(scratch)
        size = min(len(into), len(wire) - at, rng.choice((3, 700, 1 << 20)))  # a short read
        into[:size] = wire[at : at + size]
        at += size
        if direct:
            decoder.wrote(size)
        else:
            through_scratch += size
            decoder.feed(into[:size])
    assert decoder.frames() == messages
    tensor_bytes = 4 * numel * len(bulk)
    # Scratch carries the small frames, plus at most one scratch-full of a bulk payload after
    # each run of small frames (the decoder cannot know a bulk frame is next).
    assert through_scratch < len(wire) - tensor_bytes + 2 * len(scratch)


# -- a large HELLO read a slice at a time ------------------------------------------------------


def _many_fragments(count: int) -> WireLayout:
    return WireLayout(
        tuple(
            WireFragment(MergeMode.AVG if i % 3 else MergeMode.RDA, (i + 1,)) for i in range(count)
        )
    )


def _stepped(step: int, key: bytes | None = None) -> FrameDecoder:
    return FrameDecoder(Role.SYNCER, num_learners=4, hello_key=key, hello_step_bytes=13 * step)


@pytest.mark.parametrize("key", [None, b"k"])
def test_a_large_hello_is_read_a_slice_per_call_and_equals_one_read_whole(
    key: bytes | None,
) -> None:
    message = hello(layout=_many_fragments(50))
    wire = encode_bytes(message, hello_key=key)
    decoder = _stepped(8, key)
    decoder.feed(wire)
    assert decoder.has_output and decoder.large_hello_next
    states = []
    while (item := decoder.next_frame()) is WORKING:
        states.append(item)
        assert decoder.has_output and not decoder.large_hello_next
    assert len(states) == 6  # 50 records, 8 a call: the seventh call reads the last 2
    assert item == message == decode_payload(FrameType.HELLO, memoryview(wire)[13:], hello_key=key)
    assert decoder.next_frame() is NEED_DATA and not decoder.has_output


def test_a_hello_within_one_slice_is_read_at_once() -> None:
    decoder = _stepped(8)
    decoder.feed(encode_bytes(hello(layout=_many_fragments(3))))
    assert not decoder.large_hello_next
    assert isinstance(decoder.next_frame(), Hello)


@pytest.mark.parametrize("bad_at", [0, 7, 8, 49])
def test_a_broken_record_fails_a_sliced_reading_as_a_whole_one_with_the_same_code(
    bad_at: int,
) -> None:
    wire = bytearray(encode_bytes(hello(layout=_many_fragments(50))))
    records_at = 13 + 19  # frame header, HELLO head
    wire[records_at + 13 * bad_at + 5 : records_at + 13 * bad_at + 13] = bytes(8)  # numel 0
    whole = FrameDecoder(Role.SYNCER, num_learners=4)
    whole.feed(bytes(wire))
    first = expect_error(whole, ErrorCode.ZERO_NUMEL)
    decoder = _stepped(8)
    decoder.feed(bytes(wire))
    with pytest.raises(RemoteProtocolError) as caught:
        while decoder.next_frame() is WORKING:
            pass
    assert same_error(caught.value, first)
    assert not decoder.large_hello_next
    with pytest.raises(RemoteProtocolError) as again:  # poisoned like any failure
        decoder.next_frame()
    assert same_error(again.value, first)


def test_a_sliced_hello_checks_the_mac_first() -> None:
    decoder = _stepped(8, b"right")
    decoder.feed(encode_bytes(hello(layout=_many_fragments(50)), hello_key=b"wrong"))
    expect_error(decoder, ErrorCode.HELLO_AUTH_FAILED)
