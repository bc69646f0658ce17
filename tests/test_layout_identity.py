"""Layout fingerprint, layout file, syncer profile hash and HELLO authentication, byte-exact.

Every expected digest is rebuilt here by hand with ``struct.pack`` from PINNED.md, so these
tests fail if the code's field order, widths or domain strings drift.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
import struct
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from yeto_proto import (
    DeltaCorrection,
    ErrorCode,
    FragmentSpec,
    Layout,
    LearnerWeight,
    LocalProtocolError,
    MergeMode,
    RemoteProtocolError,
    SyncerProfile,
    TensorSpec,
    WireFragment,
    hello_key_of_file,
    hello_mac,
    layout_fingerprint,
    sign_hello,
    verify_hello,
)

LAYOUT = Layout(
    (
        FragmentSpec(
            MergeMode.ISO,
            (TensorSpec("embed.weight", (8, 4)), TensorSpec("blocks.0.attn.w", (4, 2, 2))),
        ),
        FragmentSpec(
            MergeMode.AVG, (TensorSpec("blocks.0.norm.b", (4,)), TensorSpec("head.ß", (3, 1)))
        ),
    )
)


def fingerprint_by_hand(layout: Layout) -> bytes:
    out = b"yeto-layout-v1\0" + struct.pack("<I", len(layout.fragments))
    for fragment in layout.fragments:
        out += struct.pack("<B", int(fragment.merge_mode))
        out += struct.pack("<I", len(fragment.tensors))
        for tensor in fragment.tensors:
            name = tensor.name.encode("utf-8")
            out += struct.pack("<I", len(name)) + name
            out += struct.pack("<Q", math.prod(tensor.shape))
            out += struct.pack("<I", len(tensor.shape))
            for dim in tensor.shape:
                out += struct.pack("<Q", dim)
    return hashlib.sha256(out).digest()


# -- layout fingerprint ---------------------------------------------------------------------------


def test_fingerprint_matches_the_pinned_encoding() -> None:
    assert LAYOUT.fingerprint() == layout_fingerprint(LAYOUT) == fingerprint_by_hand(LAYOUT)
    assert len(LAYOUT.fingerprint()) == 32


names = st.text(min_size=1, max_size=12)
shapes = st.lists(st.integers(1, 9), min_size=1, max_size=4).map(tuple)


@settings(max_examples=60)
@given(
    st.lists(
        st.tuples(
            st.sampled_from([MergeMode.AVG, MergeMode.RDA]),
            st.lists(st.tuples(names, shapes), min_size=1, max_size=4),
        ),
        min_size=1,
        max_size=3,
    )
)
def test_fingerprint_matches_the_pinned_encoding_for_any_layout(
    raw: list[tuple[MergeMode, list[tuple[str, tuple[int, ...]]]]],
) -> None:
    seen: set[str] = set()
    fragments = []
    for mode, tensors in raw:
        specs = []
        for i, (name, shape) in enumerate(tensors):
            unique = f"{name}.{len(seen)}.{i}"
            seen.add(unique)
            specs.append(TensorSpec(unique, shape))
        fragments.append(FragmentSpec(mode, tuple(specs)))
    layout = Layout(tuple(fragments))
    assert layout.fingerprint() == fingerprint_by_hand(layout)


def test_reordering_equal_size_tensors_changes_the_fingerprint_only() -> None:
    a, b = TensorSpec("q.weight", (4, 4)), TensorSpec("k.weight", (4, 4))
    one = Layout((FragmentSpec(MergeMode.AVG, (a, b)),))
    other = Layout((FragmentSpec(MergeMode.AVG, (b, a)),))
    assert one.wire() == other.wire()  # HELLO's numeric layout cannot tell them apart
    assert one.fingerprint() != other.fingerprint()


def test_same_numel_with_another_shape_changes_the_fingerprint() -> None:
    def single(shape: tuple[int, ...], mode: MergeMode = MergeMode.AVG) -> Layout:
        return Layout((FragmentSpec(mode, (TensorSpec("w", shape),)),))

    base = single((4, 6))
    for shape in [(6, 4), (24,), (2, 2, 6), (4, 6, 1)]:
        assert single(shape).wire() == base.wire()
        assert single(shape).fingerprint() != base.fingerprint(), shape
    assert single((4, 6), MergeMode.RDA).fingerprint() != base.fingerprint()


def test_names_and_fragment_boundaries_enter_the_fingerprint() -> None:
    t1, t2 = TensorSpec("a", (3,)), TensorSpec("b", (3,))
    together = Layout((FragmentSpec(MergeMode.AVG, (t1, t2)),))
    apart = Layout((FragmentSpec(MergeMode.AVG, (t1,)), FragmentSpec(MergeMode.AVG, (t2,))))
    renamed = Layout((FragmentSpec(MergeMode.AVG, (TensorSpec("c", (3,)), t2)),))
    prints = {together.fingerprint(), apart.fingerprint(), renamed.fingerprint()}
    assert len(prints) == 3


def test_wire_layout_carries_numels_and_iso_row_major_shapes() -> None:
    wire = LAYOUT.wire()
    assert wire.fragments[0] == WireFragment(MergeMode.ISO, (32, 16), ((8, 4), (4, 4)))
    assert wire.fragments[1] == WireFragment(MergeMode.AVG, (4, 3))
    assert wire.numels == (48, 7) and wire.max_numel == 48
    with pytest.raises(LocalProtocolError) as caught:
        Layout((FragmentSpec(MergeMode.ISO, (TensorSpec("bias", (5,)),)),))
    assert caught.value.code is ErrorCode.BAD_ISO_SHAPE


def test_layout_rejects_repeated_names_and_empty_shapes() -> None:
    with pytest.raises(LocalProtocolError):
        Layout((FragmentSpec(MergeMode.AVG, (TensorSpec("w", (2,)), TensorSpec("w", (2,)))),))
    with pytest.raises(LocalProtocolError):
        TensorSpec("w", (2, 0))


def test_offsets_place_tensors_back_to_back() -> None:
    placed = LAYOUT.offsets()
    assert [[(t.name, at) for t, at in fragment] for fragment in placed] == [
        [("embed.weight", 0), ("blocks.0.attn.w", 32)],
        [("blocks.0.norm.b", 0), ("head.ß", 4)],
    ]


# -- layout file ----------------------------------------------------------------------------------


def test_layout_json_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "layout.json"
    path.write_text(LAYOUT.to_json(), encoding="utf-8")
    loaded = Layout.from_json(path.read_text(encoding="utf-8"))
    assert loaded == LAYOUT
    assert loaded.fingerprint() == LAYOUT.fingerprint()
    document = json.loads(path.read_text(encoding="utf-8"))
    assert document["format"] == "yeto-layout-v1"
    assert document["fingerprint"] == fingerprint_by_hand(LAYOUT).hex()
    assert document["fragments"][0]["merge_mode"] == "iso"
    assert document["fragments"][0]["tensors"][1] == {"name": "blocks.0.attn.w", "shape": [4, 2, 2]}


def test_layout_file_with_a_wrong_fingerprint_or_format_is_refused() -> None:
    document = LAYOUT.to_json_dict()
    assert Layout.from_json_dict({**document, "fingerprint": None}) == LAYOUT
    with pytest.raises(ValueError):
        Layout.from_json_dict({**document, "fingerprint": "00" * 32})
    with pytest.raises(ValueError):
        Layout.from_json_dict({**document, "format": "yeto-layout-v0"})


# -- syncer profile hash --------------------------------------------------------------------------


def profile_bytes_by_hand(p: SyncerProfile) -> bytes:
    """PINNED.md § Syncer profile hash, one field at a time."""

    def optional(value: int | None) -> bytes:
        return (
            struct.pack("<B", 0)
            if value is None
            else struct.pack("<B", 1) + struct.pack("<Q", value)
        )

    fields = [
        b"yeto-syncer-semantic-profile-v1\0",
        struct.pack("<I", p.learners),
        struct.pack("<I", p.quorum),
        struct.pack("<Q", p.grace_ms),
        struct.pack("<d", p.grace_gamma),
        struct.pack("<d", p.grace_tau),
        struct.pack("<I", p.pipeline),
        struct.pack("<Q", p.min_round_interval_ms),
        struct.pack("<d", p.sync_interval_steps),
        struct.pack("<B", 1 if p.delta_correction is DeltaCorrection.HELOCO else 0),
        struct.pack("<Q", p.quorum_timeout_s),
        struct.pack("<Q", p.final_ack_timeout_s),
        struct.pack("<Q", p.total_steps),
        struct.pack("<B", 0),  # policy_sweep_fragments: not supported
        struct.pack("<f", p.outer_lr),
        struct.pack("<f", p.outer_momentum),
        struct.pack("<B", int(p.checkpoint_enabled)),
        struct.pack("<Q", p.checkpoint_every),
        struct.pack("<B", int(p.resume)),
        struct.pack("<B", int(p.mark_final_checkpoint)),
        optional(p.learner_budget_steps),
        optional(p.max_base_lag),
        struct.pack("<B", 0 if p.learner_weight is LearnerWeight.TOKENS2_OVER_STEPS else 1),
        struct.pack("<B", int(p.require_profile_binding)),
    ]
    return b"".join(fields)


PROFILES = [
    SyncerProfile(learners=4, total_steps=1000),
    SyncerProfile(
        learners=3,
        total_steps=77,
        quorum=2,
        grace_ms=250,
        grace_gamma=0.5,
        grace_tau=3.25,
        pipeline=4,
        min_round_interval_ms=10,
        sync_interval_steps=12.5,
        delta_correction=DeltaCorrection.NONE,
        quorum_timeout_s=60,
        final_ack_timeout_s=30,
        outer_lr=0.35,
        outer_momentum=0.0,
        checkpoint_enabled=True,
        checkpoint_every=1,
        resume=True,
        mark_final_checkpoint=True,
        learner_budget_steps=500,
        max_base_lag=3,
        learner_weight=LearnerWeight.EQUAL,
        require_profile_binding=True,
    ),
]


@pytest.mark.parametrize("profile", PROFILES)
def test_profile_digest_follows_the_pinned_field_order(profile: SyncerProfile) -> None:
    expected = profile_bytes_by_hand(profile)
    assert profile.canonical_bytes() == expected
    assert profile.digest() == hashlib.sha256(expected).digest()


def test_profile_defaults_and_size() -> None:
    default = SyncerProfile(learners=4, total_steps=1000)
    # 32 domain + 4+4+8+8+8+4+8+8+1+8+8+8+1 + 4+4+1+8+1+1 + 1 + 1 + 1 + 1
    assert len(default.canonical_bytes()) == 32 + 78 + 19 + 4
    bound = SyncerProfile(learners=4, total_steps=1000, learner_budget_steps=0, max_base_lag=0)
    assert len(bound.canonical_bytes()) == len(default.canonical_bytes()) + 16


def test_every_semantic_field_changes_the_profile_hash() -> None:
    base = PROFILES[0]
    variants: dict[str, Any] = {
        "learners": 5,
        "total_steps": 1001,
        "quorum": 2,
        "grace_ms": 1001,
        "grace_gamma": 0.81,
        "grace_tau": 2.1,
        "pipeline": 3,
        "min_round_interval_ms": 1,
        "sync_interval_steps": 24.5,
        "delta_correction": DeltaCorrection.NONE,
        "quorum_timeout_s": 901,
        "final_ack_timeout_s": 899,
        "outer_lr": 0.71,
        "outer_momentum": 0.91,
        "checkpoint_enabled": True,
        "checkpoint_every": 9,
        "resume": True,
        "mark_final_checkpoint": True,
        "learner_budget_steps": 0,
        "max_base_lag": 0,
        "learner_weight": LearnerWeight.EQUAL,
        "require_profile_binding": True,
    }
    assert set(variants) == {f.name for f in fields(SyncerProfile)}
    digests = {replace(base, **{name: value}).digest() for name, value in variants.items()}
    assert len(digests | {base.digest()}) == len(variants) + 1


# -- HELLO authentication -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        (b"k3y", b"k3y"),
        (b"k3y\n", b"k3y"),
        (b"k3y\r\n", b"k3y"),
        (b"k3y\r", b"k3y"),
        (b"k3y\n\n", b"k3y\n"),  # one line ending only: the rest is the key's
        (b"k3y\r\r\n", b"k3y\r"),
        (b"\nk3y", b"\nk3y"),
        (b"\n", b""),
    ],
)
def test_a_key_file_loses_one_trailing_line_ending(raw: bytes, key: bytes) -> None:
    assert hello_key_of_file(raw) == key


def test_hello_mac_is_hmac_sha256_over_the_domain_and_body() -> None:
    key, body = b"k" * 16, b"hello body bytes"
    expected = hmac.new(key, b"yeto-hello-mac-v1\0" + body, hashlib.sha256).digest()
    assert hello_mac(key, body) == expected
    assert sign_hello(key, body) == body + expected
    assert bytes(verify_hello(key, memoryview(body + expected))) == body


@settings(max_examples=50)
@given(st.binary(min_size=1, max_size=64), st.binary(max_size=200), st.data())
def test_verify_refuses_any_change(key: bytes, body: bytes, data: st.DataObject) -> None:
    signed = bytearray(sign_hello(key, body))
    assert bytes(verify_hello(key, memoryview(bytes(signed)))) == body
    position = data.draw(st.integers(0, len(signed) - 1))
    signed[position] ^= 1 << data.draw(st.integers(0, 7))
    with pytest.raises(RemoteProtocolError) as caught:
        verify_hello(key, memoryview(bytes(signed)))
    assert caught.value.code is ErrorCode.HELLO_AUTH_FAILED
    other = key + b"x"
    with pytest.raises(RemoteProtocolError):
        verify_hello(other, memoryview(sign_hello(key, body)))
    with pytest.raises(RemoteProtocolError):
        verify_hello(key, memoryview(bytes(31)))


# -- the worked examples in spec/identity.md are what the code computes ---------------------------

IDENTITY_PAGE = Path(__file__).resolve().parent.parent / "spec" / "identity.md"


def test_spec_identity_worked_examples() -> None:
    page = IDENTITY_PAGE.read_text(encoding="utf-8")
    example = Layout((FragmentSpec(MergeMode.AVG, (TensorSpec("w", (2, 3)),)),))
    assert f"fingerprint: `{example.fingerprint().hex()}`" in page
    profile = SyncerProfile(learners=4, total_steps=1000)
    assert f"profile hash `{profile.digest().hex()}`" in page
    assert f"MAC `{hello_mac(b'shared secret', bytes([4, 0])).hex()}`" in page
    # The byte listings in the page's code blocks are the hashed strings themselves.
    blocks = re.findall(r"```\n(.*?)```", page, flags=re.S)
    hashed = [
        bytes.fromhex("".join(re.findall(r"\b[0-9a-f]{2,}\b", line.split("  ")[0])))
        for line in blocks[0].splitlines()
    ]
    assert hashlib.sha256(b"".join(hashed)).digest() == example.fingerprint()
    listed = bytes.fromhex(
        "".join(re.sub(r"\s+domain$", "", line) for line in blocks[1].splitlines()).replace(" ", "")
    )
    assert listed == profile.canonical_bytes()
