"""The struct HELLO writer builds exactly what ``schema.HelloPayload`` builds.

``yeto_proto.hello_writer`` exists for speed (construct walks a layout element by element);
the schema is the declared truth, so every generated HELLO must come out byte for byte the same.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from yeto_proto import (
    ErrorCode,
    Hello,
    LocalProtocolError,
    MergeMode,
    WireDtype,
    WireFragment,
    WireLayout,
)
from yeto_proto.constants import PROTOCOL_VERSION
from yeto_proto.hello_writer import write_hello
from yeto_proto.schema import MAX_FRAGMENT_NUMEL, HelloPayload

if TYPE_CHECKING:
    from conftest import WireKit

DIGEST = bytes(range(32))


def schema_build(message: Hello) -> bytes:
    fragments: list[dict[str, Any]] = [
        {
            "merge_mode": int(f.merge_mode),
            "num_tensors": len(f.numels),
            "numels": f.numels,
            "matrix_shapes": [{"rows": r, "cols": c} for r, c in f.matrix_shapes] or None,
        }
        for f in message.layout.fragments
    ]
    built: bytes = HelloPayload.build(
        {
            "protocol_version": PROTOCOL_VERSION,
            "learner_id": message.learner_id,
            "connection_generation": message.generation,
            "dtype": int(message.dtype),
            "num_fragments": len(fragments),
            "fragments": fragments,
            "layout_fingerprint": message.layout_fingerprint,
            "session_contract_hash": message.session_contract,
            "syncer_profile_hash": message.profile_hash,
            "num_streams": message.num_streams,
        }
    )
    return built


@settings(max_examples=200)
@given(data=st.data())
def test_the_writer_builds_what_the_schema_builds(wire: WireKit, data: st.DataObject) -> None:
    session = data.draw(wire.session(max_fragments=6), "session")
    hello = data.draw(wire.hello(session), "hello")
    assert write_hello(hello) == schema_build(hello)


def test_repeated_fragments_and_every_field_at_its_edge_match_the_schema() -> None:
    iso = WireFragment(MergeMode.ISO, (6, 4), ((2, 3), (4, 1)))
    avg = WireFragment(MergeMode.AVG, (1, (1 << 32) + 5))
    layout = WireLayout((iso, avg, iso, WireFragment(MergeMode.RDA, (7,)), avg))
    for profile in (None, DIGEST[::-1]):
        hello = Hello(
            (1 << 32) - 1, (1 << 64) - 1, WireDtype.Q4, layout, DIGEST, DIGEST, 256, profile
        )
        assert write_hello(hello) == schema_build(hello)


def test_a_fragment_over_the_hello_numel_bound_is_a_size_overflow() -> None:
    fine = WireFragment(MergeMode.AVG, (MAX_FRAGMENT_NUMEL,))
    over = WireFragment(MergeMode.AVG, (MAX_FRAGMENT_NUMEL, 1))
    hello = Hello(0, 1, WireDtype.F32, WireLayout((fine, over)), DIGEST, DIGEST, 0)
    with pytest.raises(LocalProtocolError) as caught:
        write_hello(hello)
    assert caught.value.code is ErrorCode.SIZE_OVERFLOW and "fragment 1" in str(caught.value)
