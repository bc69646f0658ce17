"""Generate the checkpoint conformance vectors: ``<id>.bin`` + ``<id>.json``, ``markers.json``
and ``resume.json``.

    python conformance/checkpoints/generate.py [--out DIR]     (default: this directory)

The committed files are the golden truth; this script documents how they were made, and
``conformance/test_checkpoints.py`` checks that it reproduces every byte. It uses only the
standard library and encodes the formats of spec/checkpoint.md on its own, independently of
yeto_proto, so the vectors are a second opinion on the reader rather than its echo.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

MAGIC = {1: 0xD1705A7E, 2: 0xD1705A7F, 3: 0xD1705A80}
BACKEND_NAMES = {0: "scalar", 1: "torch-svd"}
CONTRACT_TAG = 0x52544353
U64_MAX = (1 << 64) - 1


def digest(label: str) -> bytes:
    return hashlib.sha256(label.encode()).digest()


FINGERPRINT = digest("yeto conformance: layout fingerprint A")
OTHER_FINGERPRINT = digest("yeto conformance: layout fingerprint B")
CONTRACT = digest("yeto conformance: session contract A")


def f32(values: Sequence[float | str]) -> bytes:
    """Little-endian f32; a ``str`` item is an exact bit pattern in hex (for NaN payloads)."""
    out = bytearray()
    for value in values:
        if isinstance(value, str):
            out += struct.pack("<I", int(value, 16))
        else:
            out += struct.pack("<f", value)
    return bytes(out)


@dataclass(frozen=True)
class Fragment:
    version: int
    params: bytes
    momentum: bytes

    @property
    def numel(self) -> int:
        return len(self.params) // 4


@dataclass(frozen=True)
class Ckpt:
    """A checkpoint as plain values; ``numel_override`` etc. exist only to build bad files."""

    fmt: int
    global_step: int
    fragments: tuple[Fragment, ...]
    ledger: tuple[tuple[int, int, int, int], ...]
    iso_backend: int = 0
    fingerprint: bytes = FINGERPRINT
    trailer_bytes: int = 68
    trailer_fingerprint: bytes | None = None  # defaults to ``fingerprint``
    contract: bytes = CONTRACT
    contract_tag: int = CONTRACT_TAG
    num_fragments_override: int | None = None
    numel_override: dict[int, int] = field(default_factory=dict)
    ledger_count_override: int | None = None


@dataclass(frozen=True)
class Segment:
    """One field of an encoded file, with the reader section a cut inside it is blamed on."""

    label: str
    section: str
    data: bytes


def segments(c: Ckpt) -> list[Segment]:
    prefix = [Segment("magic", "prefix", struct.pack("<I", MAGIC[c.fmt]))]
    if c.fmt >= 2:
        prefix.append(Segment("iso_backend", "prefix", struct.pack("<B", c.iso_backend)))
    if c.fmt == 3:
        prefix.append(Segment("fingerprint", "prefix", c.fingerprint))
    prefix.append(Segment("global_step", "prefix", struct.pack("<Q", c.global_step)))
    count = c.num_fragments_override
    body = [
        Segment(
            "F",
            "fragment table",
            struct.pack("<I", len(c.fragments) if count is None else count),
        )
    ]
    for i, frag in enumerate(c.fragments):
        numel = c.numel_override.get(i, frag.numel)
        body += [
            Segment(
                f"fragment {i} header", f"fragment {i}", struct.pack("<QQ", frag.version, numel)
            ),
            Segment(f"fragment {i} params", f"fragment {i}", frag.params),
            Segment(f"fragment {i} momentum", f"fragment {i}", frag.momentum),
        ]
    ledger_count = len(c.ledger) if c.ledger_count_override is None else c.ledger_count_override
    body.append(Segment("ledger_count", "ledger", struct.pack("<I", ledger_count)))
    for j, entry in enumerate(c.ledger):
        body.append(Segment(f"ledger entry {j}", "ledger", struct.pack("<IQQQ", *entry)))
    fingerprint = c.fingerprint if c.trailer_fingerprint is None else c.trailer_fingerprint
    trailer = [
        Segment("fingerprint trailer", "trailer", fingerprint),
        Segment("contract tag", "trailer", struct.pack("<I", c.contract_tag)),
        Segment("contract", "trailer", c.contract),
    ]
    kept: list[Segment] = []
    left = c.trailer_bytes
    for seg in trailer:
        take = min(left, len(seg.data))
        if take:
            kept.append(replace(seg, data=seg.data[:take]))
        left -= take
    if left:  # longer than the full trailer: extra bytes
        kept.append(Segment("extra", "trailer", bytes(range(left))))
    return prefix + body + kept


def encode(c: Ckpt) -> bytes:
    return b"".join(s.data for s in segments(c))


def decoded(c: Ckpt) -> dict[str, Any]:
    """The fields a reader must return for a valid file."""
    has_fp = c.fmt == 3 or c.trailer_bytes >= 32
    fingerprint = c.fingerprint if c.trailer_fingerprint is None else c.trailer_fingerprint
    return {
        "format": f"V{c.fmt}",
        "magic": f"0x{MAGIC[c.fmt]:08X}",
        "iso_backend": BACKEND_NAMES[c.iso_backend] if c.fmt >= 2 else None,
        "fingerprint": fingerprint.hex() if has_fp else None,
        "global_step": c.global_step,
        "fragments": [
            {
                "version": f.version,
                "numel": f.numel,
                "params_f32le": f.params.hex(),
                "momentum_f32le": f.momentum.hex(),
            }
            for f in c.fragments
        ],
        "ledger": [
            {"learner_id": i, "merges": m, "steps": s, "tokens": t} for i, m, s, t in c.ledger
        ],
        "contract": c.contract.hex() if c.trailer_bytes == 68 else None,
        "trailer_bytes": c.trailer_bytes,
    }


# -- the valid files -----------------------------------------------------------------------------
def _three_fragments() -> tuple[Fragment, ...]:
    # global_step 7 over F = 3: the schedule puts the fragments at versions 7, 5, 6.
    return (
        Fragment(7, f32([0.5, -1.25, 3.0, 0.0]), f32([0.125, 0.25, -0.5, 1.0])),
        Fragment(5, f32([-2.0]), f32([0.0625])),
        Fragment(6, f32([1.0, 2.0, 4.0, 8.0, -16.0, 0.75]), f32([-0.75, 0.5, 0.0, 0.0, 1.5, 3.5])),
    )


LEDGER = ((0, 7, 168, 43008), (2, 5, 120, 30720))
V3_FULL = Ckpt(3, 7, _three_fragments(), LEDGER, iso_backend=1)
V2_FULL = Ckpt(2, 7, _three_fragments(), LEDGER, iso_backend=1)
V1_PLAIN = Ckpt(1, 7, _three_fragments(), LEDGER, trailer_bytes=0)
#: Two fragments at global_step 2, the first one long (8 values).
V3_LONG_FIRST = Ckpt(
    3,
    2,
    (
        Fragment(1, f32([float(i) for i in range(8)]), f32([0.5] * 8)),
        Fragment(2, f32([-1.0, 1.0]), f32([0.0, 0.25])),
    ),
    LEDGER[:1],
)

SPECIALS = f32(
    [-0.0, "7f800000", "ff800000", "7fc12345", "7f800001", "00000001", "7f7fffff", "80800000"]
)

VALID: list[tuple[str, str, list[str], Ckpt]] = [
    ("v3_full", "V3 as the writer makes it: 68-byte trailer", ["writer"], V3_FULL),
    (
        "v3_fingerprint_trailer",
        "V3 whose trailer is the fingerprint repeat only (32 bytes)",
        ["trailer-32"],
        replace(V3_FULL, trailer_bytes=32),
    ),
    (
        "v3_no_trailer",
        "V3 with nothing after the ledger",
        ["trailer-0"],
        replace(V3_FULL, trailer_bytes=0),
    ),
    (
        "v3_single_fragment",
        "V3, scalar backend, one fragment of one value at version 0, empty ledger",
        ["writer", "empty-ledger"],
        Ckpt(3, 0, (Fragment(0, f32([1.5]), f32([0.0])),), (), iso_backend=0),
    ),
    (
        "v3_special_values",
        "V3 with -0, infinities, NaN payloads, a subnormal and extremes: kept bit for bit",
        ["writer", "special-values"],
        Ckpt(3, 1, (Fragment(1, SPECIALS, SPECIALS[::-1]),), ((4294967295, U64_MAX, 1, 0),)),
    ),
    (
        "v2_full",
        "V2 (no fingerprint field) with fingerprint and contract trailer",
        ["legacy", "trailer-68"],
        V2_FULL,
    ),
    (
        "v2_fingerprint_trailer",
        "V2 with a 32-byte trailer: a fingerprint with no prefix to compare against",
        ["legacy", "trailer-32"],
        replace(V2_FULL, trailer_bytes=32, trailer_fingerprint=OTHER_FINGERPRINT),
    ),
    (
        "v2_no_trailer",
        "V2, scalar backend, nothing after the ledger",
        ["legacy", "trailer-0"],
        replace(V2_FULL, iso_backend=0, trailer_bytes=0),
    ),
    (
        "v3_version_off_schedule",
        "V3 whose fragment 1 is at version 4 where global_step 7 over 3 fragments gives 5: it "
        "reads, but never resumes",
        ["writer", "off-schedule"],
        replace(
            V3_FULL,
            fragments=(V3_FULL.fragments[0], replace(V3_FULL.fragments[1], version=4))
            + V3_FULL.fragments[2:],
        ),
    ),
    (
        "v3_nan_off_schedule",
        "V3 with a NaN momentum value and its one fragment at version 0 where global_step 1 "
        "gives 1: it reads, but never resumes",
        ["writer", "special-values", "off-schedule"],
        Ckpt(3, 1, (Fragment(0, f32([1.0, 2.0]), f32([0.5, "7fc00000"])),), ()),
    ),
    ("v1_no_trailer", "V1 (no backend, no fingerprint)", ["legacy", "trailer-0"], V1_PLAIN),
    (
        "v1_fingerprint_trailer",
        "V1 with a 32-byte fingerprint trailer",
        ["legacy", "trailer-32"],
        replace(V1_PLAIN, trailer_bytes=32),
    ),
    (
        "v1_full",
        "V1 with fingerprint and contract trailer",
        ["legacy", "trailer-68"],
        replace(V1_PLAIN, trailer_bytes=68),
    ),
]


# -- the invalid files ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Invalid:
    id: str
    comment: str
    flags: list[str]
    data: bytes
    code: str
    section: str


def cut_outcome(c: Ckpt, at: int) -> tuple[str, str] | None:
    """(code, section) for ``encode(c)[:at]``, or None when the cut leaves a valid file."""
    segs = segments(c)
    start = 0
    starts = []
    for seg in segs:
        starts.append(start)
        start += len(seg.data)
    f_index = next(i for i, s in enumerate(segs) if s.label == "F")
    f_end = starts[f_index] + 4
    ledger_end = sum(len(s.data) for s in segs if s.section != "trailer")
    if starts[f_index] <= at < f_end + 16 * len(c.fragments) + 4:
        # F itself is cut, or too few bytes follow for F fragment headers and ledger_count.
        return "CKPT_TRUNCATED", "fragment table"
    if at >= ledger_end:
        return None if at - ledger_end in (0, 32) else ("CKPT_BAD_TRAILER", "trailer")
    owner = max(i for i, s in enumerate(starts) if s <= at)
    return "CKPT_TRUNCATED", segs[owner].section


def truncations(
    name: str, c: Ckpt, *, middles: Sequence[str] = (), prefix_only: bool = False
) -> Iterator[Invalid]:
    """Cuts at every field boundary (or only up to the first fragment), plus inside the fields
    named in ``middles``."""
    data = encode(c)
    cuts: dict[int, str] = {}
    at = 0
    for seg in segments(c):
        cuts.setdefault(at, f"at the start of {seg.label}")
        if prefix_only and seg.section not in ("prefix", "fragment table"):
            break
        if seg.label in middles:
            cuts.setdefault(at + len(seg.data) // 2, f"in the middle of {seg.label}")
        at += len(seg.data)
    for at, where in sorted(cuts.items()):
        outcome = cut_outcome(c, at)
        if outcome is None:
            continue
        code, section = outcome
        yield Invalid(
            f"{name}_cut_{at:04d}",
            f"{name} cut to {at} bytes, {where}",
            ["truncated"],
            data[:at],
            code,
            section,
        )


def _with_numel(c: Ckpt, numel: int) -> Ckpt:
    return replace(c, numel_override={0: numel})


def invalid_files() -> Iterator[Invalid]:
    full = encode(V3_FULL)
    yield from truncations(
        "v3_full",
        V3_FULL,
        middles=["magic", "fingerprint", "fragment 2 params", "ledger entry 1", "contract"],
    )
    # V1 and V2 share V3's body, so their own cuts stop at the first fragment.
    yield from truncations("v2_full", V2_FULL, prefix_only=True)
    yield from truncations("v1_no_trailer", V1_PLAIN, prefix_only=True)
    bad_magic = [
        ("magic_wire_frame", "the wire frame magic 0xD170C0DE", struct.pack("<I", 0xD170C0DE)),
        ("magic_next_version", "0xD1705A81, a format not defined", struct.pack("<I", 0xD1705A81)),
        ("magic_big_endian", "the V3 magic written big-endian", struct.pack(">I", MAGIC[3])),
        ("magic_zip", "a foreign file (zip local header)", b"PK\x03\x04"),
    ]
    for ident, comment, magic in bad_magic:
        yield Invalid(ident, comment, ["magic"], magic + full[4:], "CKPT_BAD_MAGIC", "prefix")
    yield Invalid("v3_empty_file", "an empty file", ["truncated"], b"", "CKPT_TRUNCATED", "prefix")
    for ident, fmt, value in (("v2_iso_backend_2", 2, 2), ("v3_iso_backend_255", 3, 255)):
        base = V2_FULL if fmt == 2 else V3_FULL
        yield Invalid(
            ident,
            f"iso_backend {value} is neither 0 (scalar) nor 1 (torch-svd)",
            ["field"],
            encode(replace(base, iso_backend=value)),
            "CKPT_BAD_FIELD",
            "prefix",
        )
    yield Invalid(
        "v3_zero_fragments",
        "F = 0 (followed by an empty ledger)",
        ["field"],
        encode(replace(V3_FULL, fragments=(), ledger=())),
        "CKPT_BAD_FIELD",
        "fragment table",
    )
    yield Invalid(
        "v3_fragment_count_exceeds_file",
        "F = 2^32-1: the headers alone exceed the file, refused before any allocation",
        ["count"],
        encode(replace(V3_FULL, num_fragments_override=0xFFFFFFFF)),
        "CKPT_TRUNCATED",
        "fragment table",
    )
    yield Invalid(
        "v3_numel_zero",
        "fragment 0 declares numel 0",
        ["field"],
        encode(_with_numel(V3_FULL, 0)),
        "CKPT_BAD_FIELD",
        "fragment 0",
    )
    for ident, numel, comment in (
        ("v3_numel_overflow", 1 << 61, "numel 2^61: 8*numel exceeds any file size"),
        ("v3_numel_u64_max", U64_MAX, "numel 2^64-1"),
        ("v3_numel_2_pow_60", 1 << 60, "numel 2^60: 8*numel = 2^63, one past 2^63-1"),
    ):
        yield Invalid(
            ident,
            comment,
            ["count", "overflow"],
            encode(_with_numel(V3_FULL, numel)),
            "CKPT_COUNT_OVERFLOW",
            "fragment 0",
        )
    yield Invalid(
        "v3_numel_exceeds_file",
        "numel 2^40: more data than the file holds, refused before any allocation",
        ["count"],
        encode(_with_numel(V3_FULL, 1 << 40)),
        "CKPT_TRUNCATED",
        "fragment 0",
    )
    yield Invalid(
        "v3_numel_2_pow_60_minus_1",
        "numel 2^60-1: 8*numel = 2^63-8 could fit a file, but not this one",
        ["count"],
        encode(_with_numel(V3_FULL, (1 << 60) - 1)),
        "CKPT_TRUNCATED",
        "fragment 0",
    )
    # Fragment 0 long enough that the fragment table's check passes at fragment 1's header.
    yield from (
        cut
        for cut in truncations(
            "v3_long_first_fragment", V3_LONG_FIRST, middles=["fragment 1 header"]
        )
        if "fragment 1 header" in cut.comment
    )
    yield Invalid(
        "v2_iso_backend_2_cut",
        "V2 with iso_backend 2, cut inside global_step: the cut prefix is found first",
        ["truncated", "field", "CheckOrder"],
        encode(replace(V2_FULL, iso_backend=2))[:9],
        "CKPT_TRUNCATED",
        "prefix",
    )
    yield Invalid(
        "v3_ledger_count_exceeds_file",
        "ledger_count 2^32-1",
        ["count"],
        encode(replace(V3_FULL, ledger_count_override=0xFFFFFFFF)),
        "CKPT_TRUNCATED",
        "ledger",
    )
    for ident, ledger, comment in (
        ("v3_ledger_descending", (LEDGER[1], LEDGER[0]), "learner ids 2 then 0"),
        ("v3_ledger_duplicate_id", (LEDGER[0], LEDGER[0]), "learner id 0 twice"),
    ):
        yield Invalid(
            ident,
            f"ledger not strictly ascending: {comment}",
            ["field"],
            encode(replace(V3_FULL, ledger=ledger)),
            "CKPT_BAD_FIELD",
            "ledger",
        )
    for length in (1, 31, 33, 36, 67, 69, 100):
        yield Invalid(
            f"v3_trailer_{length}_bytes",
            f"{length} bytes after the ledger (only 0, 32 or 68 are defined)",
            ["trailer"],
            encode(replace(V3_FULL, trailer_bytes=length)),
            "CKPT_BAD_TRAILER",
            "trailer",
        )
    yield Invalid(
        "v1_trailer_1_byte",
        "V1 with one byte after the ledger",
        ["trailer", "legacy"],
        encode(replace(V1_PLAIN, trailer_bytes=1)),
        "CKPT_BAD_TRAILER",
        "trailer",
    )
    yield Invalid(
        "v3_contract_tag_wrong",
        "contract trailer tag 0x53435452 (the right bytes in the wrong order)",
        ["trailer"],
        encode(replace(V3_FULL, contract_tag=0x53435452)),
        "CKPT_BAD_TRAILER",
        "trailer",
    )
    yield Invalid(
        "v1_contract_tag_wrong",
        "V1 with a 68-byte trailer whose contract tag is wrong",
        ["trailer", "legacy"],
        encode(replace(V1_PLAIN, trailer_bytes=68, contract_tag=0x53435452)),
        "CKPT_BAD_TRAILER",
        "trailer",
    )
    yield Invalid(
        "v3_fingerprint_mismatch_and_tag_wrong",
        "68-byte trailer with a foreign fingerprint and a wrong tag: read front to back, the "
        "fingerprint is found first",
        ["trailer", "fingerprint", "CheckOrder"],
        encode(
            replace(
                V3_FULL,
                trailer_fingerprint=OTHER_FINGERPRINT,
                contract_tag=0x53435452,
            )
        ),
        "CKPT_FINGERPRINT_TRAILER_MISMATCH",
        "trailer",
    )
    for length in (32, 68):
        yield Invalid(
            f"v3_fingerprint_trailer_mismatch_{length}",
            f"{length}-byte trailer whose fingerprint differs from the prefix",
            ["trailer", "fingerprint"],
            encode(replace(V3_FULL, trailer_bytes=length, trailer_fingerprint=OTHER_FINGERPRINT)),
            "CKPT_FINGERPRINT_TRAILER_MISMATCH",
            "trailer",
        )


# -- final markers -------------------------------------------------------------------------------
def marker_cases() -> list[dict[str, Any]]:
    good = [
        (b"YETO_FINAL_V1\nglobal_step=0\n", 0, "step 0"),
        (b"YETO_FINAL_V1\nglobal_step=7\n", 7, "step 7"),
        (b"YETO_FINAL_V1\nglobal_step=18446744073709551615\n", U64_MAX, "largest u64"),
    ]
    bad = [
        (b"", "empty"),
        (b"YETO_FINAL_V1\nglobal_step=7", "no final newline"),
        (b"YETO_FINAL_V1\r\nglobal_step=7\r\n", "CRLF line ends"),
        (b"YETO_FINAL_V1\nglobal_step=07\n", "leading zero"),
        (b"YETO_FINAL_V1\nglobal_step=+7\n", "sign"),
        (b"YETO_FINAL_V1\nglobal_step=-1\n", "negative"),
        (b"YETO_FINAL_V1\nglobal_step=18446744073709551616\n", "2^64 does not fit a u64"),
        (b"YETO_FINAL_V1\nglobal_step=7\n\n", "trailing bytes"),
        (b"YETO_FINAL_V1\nglobal_step = 7\n", "spaces"),
        (b"YETO_FINAL_V2\nglobal_step=7\n", "another marker version"),
        (b"yeto_final_v1\nglobal_step=7\n", "lower case"),
        (b"YETO_FINAL_V1\nglobal_step=\n", "no digits"),
        (b"YETO_FINAL_V1\nglobal_step=\xd9\xa7\n", "a non-ASCII digit"),
    ]
    cases: list[dict[str, Any]] = [
        {"tcId": n, "comment": c, "hex": d.hex(), "result": "valid", "global_step": s}
        for n, (d, s, c) in enumerate(good, start=1)
    ]
    cases += [
        {"tcId": n, "comment": c, "hex": d.hex(), "result": "invalid", "error": "CKPT_BAD_MARKER"}
        for n, (d, c) in enumerate(bad, start=len(cases) + 1)
    ]
    return cases


# -- resume decisions ----------------------------------------------------------------------------
OTHER_CONTRACT = digest("yeto conformance: session contract B")
THREE = [[4], [1], [6]]  # the valid files' fragments, one tensor each
GROUPED_THREE = [[1, 3], [1], [2, 4]]  # the same fragment sizes, tensors grouped


def resume_cases() -> list[dict[str, Any]]:
    """Checkpoint + running syncer + first HELLO -> resumed, or the number of the failing
    check of spec/checkpoint.md § 4 (the first that fails, in that order)."""

    def case(
        comment: str,
        checkpoint: str,
        backend: str,
        *,
        fingerprint: bytes = FINGERPRINT,
        fragments: list[list[int]] | None = None,
        contract: bytes = CONTRACT,
        check: int | None = None,
        flags: Sequence[str] = (),
    ) -> dict[str, Any]:
        test: dict[str, Any] = {
            "comment": comment,
            "flags": list(flags),
            "checkpoint": f"{checkpoint}.bin",
            "iso_backend": backend,
            "hello": {
                "layout_fingerprint": fingerprint.hex(),
                "fragments": THREE if fragments is None else fragments,
                "session_contract": contract.hex(),
            },
        }
        if check is None:
            test["result"] = "valid"
        else:
            test.update(result="invalid", check=check)
        return test

    cases = [
        case("V3 as written, the session it was written for", "v3_full", "torch-svd"),
        case(
            "V3: grouped tensors are fine when the fingerprint matches",
            "v3_full",
            "torch-svd",
            fragments=GROUPED_THREE,
        ),
        case(
            "V3 at global_step 0, all versions 0", "v3_single_fragment", "scalar", fragments=[[1]]
        ),
        case("V2 with fingerprint and contract trailer", "v2_full", "torch-svd"),
        case(
            "V2 without trailer: no fingerprint or contract to compare, one tensor per fragment",
            "v2_no_trailer",
            "scalar",
            fingerprint=OTHER_FINGERPRINT,
            contract=OTHER_CONTRACT,
            flags=["legacy"],
        ),
        case(
            "V2 whose 32-byte fingerprint trailer equals the HELLO's, no contract",
            "v2_fingerprint_trailer",
            "torch-svd",
            fingerprint=OTHER_FINGERPRINT,
            contract=OTHER_CONTRACT,
            flags=["legacy"],
        ),
        case("V1 never resumes", "v1_full", "scalar", check=1),
        case("V1 without trailer never resumes", "v1_no_trailer", "torch-svd", check=1),
        case(
            "V3 written by a torch-svd syncer, a scalar one running", "v3_full", "scalar", check=2
        ),
        case(
            "V2 written by a scalar syncer, a torch-svd one running",
            "v2_no_trailer",
            "torch-svd",
            check=2,
        ),
        case(
            "infinities and NaN in params and momentum",
            "v3_special_values",
            "scalar",
            fragments=[[8]],
            check=3,
        ),
        case("a version off the schedule", "v3_version_off_schedule", "torch-svd", check=4),
        case(
            "V3: another fingerprint with the same fragment sizes",
            "v3_full",
            "torch-svd",
            fingerprint=OTHER_FINGERPRINT,
            check=5,
        ),
        case(
            "V2 records no fingerprint: a fragment grouping two tensors fails closed",
            "v2_full",
            "torch-svd",
            fragments=[[4], [1], [2, 4]],
            check=5,
        ),
        case(
            "V2 whose fingerprint trailer differs from the HELLO's",
            "v2_fingerprint_trailer",
            "torch-svd",
            check=5,
        ),
        case(
            "2 fragments in the HELLO, 3 in the file",
            "v3_full",
            "torch-svd",
            fragments=[[4], [1]],
            check=6,
        ),
        case(
            "fragment 2 of 5 values in the HELLO, 6 in the file",
            "v3_full",
            "torch-svd",
            fragments=[[4], [1], [5]],
            check=6,
        ),
        case(
            "V3: another session contract", "v3_full", "torch-svd", contract=OTHER_CONTRACT, check=7
        ),
        case("V3 without a contract trailer", "v3_fingerprint_trailer", "torch-svd", check=7),
        case(
            "V2: a contract trailer that differs",
            "v2_full",
            "torch-svd",
            contract=OTHER_CONTRACT,
            check=7,
        ),
    ]
    order = [  # several checks fail: the first in § 4's order decides
        case(
            "V1 with a torch-svd syncer: format (1) before backend (2)",
            "v1_full",
            "torch-svd",
            check=1,
        ),
        case(
            "non-finite values and a backend mismatch: backend (2) before values (3)",
            "v3_special_values",
            "torch-svd",
            fragments=[[8]],
            check=2,
        ),
        case(
            "a NaN and a version off the schedule: values (3) before versions (4)",
            "v3_nan_off_schedule",
            "scalar",
            fragments=[[2]],
            check=3,
        ),
        case(
            "a version off the schedule and another fingerprint: versions (4) before identity (5)",
            "v3_version_off_schedule",
            "torch-svd",
            fingerprint=OTHER_FINGERPRINT,
            check=4,
        ),
        case(
            "another fingerprint and another size: identity (5) before sizes (6)",
            "v3_full",
            "torch-svd",
            fingerprint=OTHER_FINGERPRINT,
            fragments=[[4], [1], [5]],
            check=5,
        ),
        case(
            "V2 grouped and another contract: identity (5) before contract (7)",
            "v2_full",
            "torch-svd",
            fragments=GROUPED_THREE,
            contract=OTHER_CONTRACT,
            check=5,
        ),
        case(
            "another size and another contract: sizes (6) before contract (7)",
            "v3_full",
            "torch-svd",
            fragments=[[4], [1], [5]],
            contract=OTHER_CONTRACT,
            check=6,
        ),
    ]
    for test in order:
        test["flags"].append("CheckOrder")
    return [{"tcId": n, **test} for n, test in enumerate(cases + order, start=1)]


# -- output --------------------------------------------------------------------------------------
def _dump(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")


def _sidecar(ident: str, comment: str, flags: list[str], data: bytes) -> dict[str, Any]:
    return {
        "id": ident,
        "comment": comment,
        "flags": flags,
        "file": f"{ident}.bin",
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }


def generate(out: Path) -> list[Path]:
    """Write every vector into ``out``; returns the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for ident, comment, flags, ckpt in VALID:
        data = encode(ckpt)
        sidecar = _sidecar(ident, comment, flags, data)
        sidecar.update(result="valid", decoded=decoded(ckpt))
        written += _write_pair(out, ident, data, sidecar)
    for bad in invalid_files():
        sidecar = _sidecar(bad.id, bad.comment, bad.flags, bad.data)
        sidecar.update(result="invalid", error={"code": bad.code, "section": bad.section})
        written += _write_pair(out, bad.id, bad.data, sidecar)
    markers = out / "markers.json"
    _dump(markers, {"format": "YETO_FINAL_V1", "tests": marker_cases()})
    written.append(markers)
    resume = out / "resume.json"
    _dump(resume, {"subject": "resume decisions, spec/checkpoint.md § 4", "tests": resume_cases()})
    written.append(resume)
    return written


def _write_pair(out: Path, ident: str, data: bytes, sidecar: dict[str, Any]) -> list[Path]:
    binary, meta = out / f"{ident}.bin", out / f"{ident}.json"
    binary.write_bytes(data)
    _dump(meta, sidecar)
    return [binary, meta]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    args = parser.parse_args()
    written = generate(args.out)
    print(f"wrote {len(written)} files to {args.out}")


if __name__ == "__main__":
    main()
