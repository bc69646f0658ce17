"""The construct schema and the generated ``struct`` fast path describe the same bytes.

``yeto_proto.frames`` decodes fixed fields with structs generated from ``yeto_proto.schema``;
these tests rebuild every message from a plain ``schema.Frame.parse`` of the same frame and
require equality, and build frames with ``schema.Frame.build`` and require identical bytes.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import TYPE_CHECKING, Any

import pytest
from construct import ConstError, Struct
from hypothesis import given, settings
from hypothesis import strategies as st

from yeto_proto import (
    AnyMessage,
    ErrorCode,
    FrameType,
    Hello,
    MergeMode,
    WireDtype,
    WireFragment,
    WireLayout,
    decode_payload,
    encode_bytes,
)
from yeto_proto.frames import header
from yeto_proto.messages import MESSAGE_CLASSES, ErrorMessage, FinalManifest
from yeto_proto.schema import (
    HEADER_STRUCT,
    PAYLOADS,
    PREFIX_STRUCTS,
    CodedConstructError,
    Frame,
    field_names,
)

if TYPE_CHECKING:
    from conftest import WireKit

#: Message attribute -> schema field, where the names differ.
SCHEMA_NAME = {
    "generation": "connection_generation",
    "session_contract": "session_contract_hash",
    "profile_hash": "syncer_profile_hash",
}


def message_from_schema(parsed: Any) -> AnyMessage:
    """Build the message from a ``schema.Frame`` parse alone (no frames.py code involved)."""
    frame_type = FrameType(parsed.type)
    payload = parsed.payload
    if frame_type is FrameType.ERROR:
        return ErrorMessage(bytes(payload.text).decode("utf-8"))
    values: dict[str, Any] = {}
    for f in dataclasses.fields(MESSAGE_CLASSES[frame_type]):
        if f.name == "layout":
            values[f.name] = WireLayout(
                tuple(
                    WireFragment(
                        MergeMode(fragment.merge_mode),
                        tuple(fragment.numels),
                        tuple((s.rows, s.cols) for s in fragment.matrix_shapes or ()),
                    )
                    for fragment in payload.fragments
                )
            )
        elif f.name == "dtype":
            values[f.name] = WireDtype(payload.dtype)
        else:
            values[f.name] = payload[SCHEMA_NAME.get(f.name, f.name)]
    return MESSAGE_CLASSES[frame_type](**values)


def schema_dict(message: AnyMessage) -> dict[str, Any]:
    """The ``schema.Frame.build`` input for ``message`` (the inverse of the function above)."""
    payload: dict[str, Any] = {}
    match message:
        case Hello():
            payload = {
                "protocol_version": 4,
                "learner_id": message.learner_id,
                "connection_generation": message.generation,
                "dtype": int(message.dtype),
                "num_fragments": len(message.layout),
                "fragments": [
                    {
                        "merge_mode": int(f.merge_mode),
                        "num_tensors": len(f.numels),
                        "numels": f.numels,
                        "matrix_shapes": [{"rows": r, "cols": c} for r, c in f.matrix_shapes]
                        if f.merge_mode is MergeMode.ISO
                        else None,
                    }
                    for f in message.layout.fragments
                ],
                "layout_fingerprint": message.layout_fingerprint,
                "session_contract_hash": message.session_contract,
                "syncer_profile_hash": message.profile_hash,
                "num_streams": message.num_streams,
            }
        case ErrorMessage():
            payload = {"text": message.text.encode("utf-8")}
        case FinalManifest():
            payload = {
                "revision": 1,
                "final_global_step": message.final_global_step,
                "num_fragments": len(message.expected_versions),
                "expected_versions": message.expected_versions,
            }
        case _:
            for f in dataclasses.fields(message):
                value = getattr(message, f.name)
                payload[SCHEMA_NAME.get(f.name, f.name)] = (
                    bytes(value) if isinstance(value, memoryview) else value
                )
            if message.TYPE in (FrameType.DATA_HELLO,):
                payload["protocol_version"] = 4
            if message.TYPE is FrameType.FINAL_ACK:
                payload["revision"] = 1
    return {"type": int(message.TYPE), "len": 0, "payload": payload}


def _build_frame(message: AnyMessage) -> bytes:
    draft = schema_dict(message)
    body = PAYLOADS[message.TYPE].build(draft["payload"])
    return bytes(Frame.build({**draft, "len": len(body)}))


@pytest.mark.parametrize("frame_type", list(FrameType), ids=lambda t: t.name)
@settings(max_examples=30)
@given(data=st.data())
def test_decode_payload_agrees_with_the_schema_parse(
    wire: WireKit, frame_type: FrameType, data: st.DataObject
) -> None:
    session = data.draw(wire.session(), "session")
    message = data.draw(wire.message(frame_type, session), "message")
    frame = encode_bytes(message)
    limits = session.limits

    parsed = Frame.parse(frame, limit_of=limits.payload_limit, num_learners=session.num_learners)
    assert parsed.len == len(frame) - 13
    decoded = decode_payload(
        frame_type, memoryview(frame)[13:], limits=limits, num_learners=session.num_learners
    )
    assert message_from_schema(parsed) == decoded == message
    assert _build_frame(message) == frame


@settings(max_examples=30)
@given(data=st.data())
def test_a_signed_hello_body_is_what_the_schema_describes(
    wire: WireKit, data: st.DataObject
) -> None:
    session = data.draw(wire.session(), "session")
    hello = data.draw(wire.hello(session), "hello")
    key = data.draw(st.binary(min_size=1, max_size=40), "key")
    signed = encode_bytes(hello, hello_key=key)
    body = signed[13:-32]
    parsed = Frame.parse(header(FrameType.HELLO, len(body)) + body)
    assert message_from_schema(parsed) == hello
    assert decode_payload(FrameType.HELLO, memoryview(signed)[13:], hello_key=key) == hello


# -- the generated structs ----------------------------------------------------------------------

#: Fixed leading fields per payload, as the source and PINNED.md lay them out.
PINNED_PREFIXES = {
    FrameType.HELLO: "<HIQBI",
    FrameType.INIT_PARAMS: "<I",
    FrameType.PULL_REQ: "<IQI",
    FrameType.PUSH_FRAGMENT: "<IIQIQQIQ",
    FrameType.BCAST_FRAGMENT: "<IQ",
    FrameType.HEARTBEAT: "<IQ",
    FrameType.SHUTDOWN: "<",
    FrameType.DATA_HELLO: "<HIQH",
    FrameType.CHUNK: "<QQQ",
    FrameType.ERROR: "<",
    FrameType.FINAL_MANIFEST: "<HQI",
    FrameType.FINAL_ACK: "<HQ",
    FrameType.FINAL_FRAGMENT: "<IQ",
    FrameType.BUDGET_DONE: "<Q",
}


def _canonical(fmt: str) -> str:
    return fmt.replace("L", "I")  # "<L" and "<I" are both a little-endian u32


def test_generated_structs_match_the_pinned_field_layouts() -> None:
    assert _canonical(HEADER_STRUCT.format) == "<IBQ" and HEADER_STRUCT.size == 13
    for frame_type, fmt in PINNED_PREFIXES.items():
        generated = PREFIX_STRUCTS[frame_type]
        assert generated.size == struct.calcsize(fmt), frame_type
        assert _canonical(generated.format) == fmt, frame_type


def test_fixed_sizes_of_the_bulk_prefixes() -> None:
    sizes = {t: PREFIX_STRUCTS[t].size for t in PREFIX_STRUCTS}
    assert sizes[FrameType.INIT_PARAMS] == 4
    assert sizes[FrameType.PUSH_FRAGMENT] == 48
    assert sizes[FrameType.BCAST_FRAGMENT] == 12
    assert sizes[FrameType.FINAL_FRAGMENT] == 12
    assert sizes[FrameType.CHUNK] == 24
    assert field_names(PAYLOADS[FrameType.PUSH_FRAGMENT]) == (
        "learner_id",
        "fragment_id",
        "global_step",
        "round_attempt",
        "base_version",
        "local_step",
        "c_steps",
        "c_tokens",
    )


@pytest.mark.parametrize("frame_type", sorted(PINNED_PREFIXES), ids=lambda t: t.name)
def test_struct_unpack_equals_schema_parse_on_the_leading_fields(frame_type: FrameType) -> None:
    schema = PAYLOADS[frame_type]
    names = field_names(schema)
    # The schema's own leading field declarations, validators dropped, parsed by construct.
    leading = Struct(*(sub for sub in schema.subcons if sub.name in names))
    generated = PREFIX_STRUCTS[frame_type]
    packed = bytes(range(1, generated.size + 1))  # every byte distinct: catches swaps and shifts
    parsed = leading.parse(packed)
    assert tuple(parsed[n] for n in names) == generated.unpack(packed)
    assert leading.sizeof() == generated.size


# -- schema-level validation --------------------------------------------------------------------


def test_schema_frame_rejects_with_coded_errors() -> None:
    good = encode_bytes(FinalManifest(3, (1, 2)))
    with pytest.raises(ConstError):
        Frame.parse(b"\0\0\0\0" + good[4:])
    cases = [
        (bytes([*good[:4], 99]) + good[5:], {}, ErrorCode.UNKNOWN_FRAME_TYPE),
        (good, {"limit_of": lambda _t: 29}, ErrorCode.FRAME_TOO_LARGE),
        (good[:-1], {}, ErrorCode.TRUNCATED_PAYLOAD),
    ]
    for frame, params, code in cases:
        with pytest.raises(CodedConstructError) as caught:
            Frame.parse(frame, **params)
        assert caught.value.code is code
    assert Frame.parse(good, limit_of=lambda _t: 30).payload.expected_versions == (1, 2)
