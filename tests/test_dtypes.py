"""The wire dtype codecs (yeto_proto.dtypes) against spec/dtypes.md and slow scalar references."""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Iterator
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from numpy.typing import NDArray

from yeto_proto import dtypes
from yeto_proto.constants import WireDtype
from yeto_proto.dtypes import (
    Q4_LEVEL_THRESHOLDS,
    BytesLike,
    all_finite,
    bf16_to_f32,
    decode_tensor,
    encode_tensor,
    f32_to_bf16,
    proven_finite,
    q4_decode,
    q4_encode,
    q4_nbytes,
    tensor_nbytes,
)
from yeto_proto.errors import ErrorCode, LocalProtocolError, RemoteProtocolError

SQRT2_MINUS_1 = math.sqrt(2.0) - 1.0
SLACK = 2.0**-20  # covers the f32 division and the few-ulp offsets of the level thresholds


def f32_from_bits(*bits: int) -> NDArray[np.float32]:
    return np.array(bits, dtype=np.uint32).view(np.float32)


def bits_of(values: NDArray[np.float32]) -> list[int]:
    return [int(b) for b in np.asarray(values, dtype=np.float32).view(np.uint32)]


@pytest.fixture(params=["default", "numpy"])
def bf16_impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Run a bf16 test with the default backend (ml_dtypes if present) and the numpy fallback."""
    if request.param == "numpy":
        monkeypatch.setattr(dtypes, "_ML_BFLOAT16", None)
    yield dtypes.bf16_backend()


# -- bf16: slow exact reference ------------------------------------------------------------------
def _f32_magnitude(bits: int) -> Fraction:
    exponent, mantissa = bits >> 23, bits & 0x7FFFFF
    if exponent == 0:
        return Fraction(mantissa, 2**149)
    return Fraction(mantissa + 2**23) * Fraction(2) ** (exponent - 150)


def reference_bf16(bits: int) -> int:
    """IEEE round-to-nearest-even of one f32 to bf16, by exact distances (no bit tricks)."""
    sign, magnitude = bits & 0x8000_0000, bits & 0x7FFF_FFFF
    if magnitude > 0x7F80_0000:
        return (bits >> 16) | 0x0040
    if magnitude == 0x7F80_0000:
        return bits >> 16
    value = _f32_magnitude(magnitude)
    below = magnitude >> 16  # bf16 patterns are the top halves, ordered like their values
    above = below + 1
    below_value = _f32_magnitude(below << 16)
    # IEEE rounds as if the exponent were unbounded: past the largest finite value comes 2^128.
    above_value = Fraction(2**128) if above == 0x7F80 else _f32_magnitude(above << 16)
    if value - below_value < above_value - value:
        chosen = below
    elif value - below_value > above_value - value:
        chosen = above
    else:
        chosen = below if below % 2 == 0 else above
    return (sign >> 16) | chosen


BF16_CASES = [
    # (f32 bits, bf16 bits, why)
    (0x3F80_0000, 0x3F80, "1.0 is exact"),
    (0x3F80_8000, 0x3F80, "tie, even below: down"),
    (0x3F81_8000, 0x3F82, "tie, odd below: up"),
    (0xBF80_8000, 0xBF80, "negative tie, even: toward zero"),
    (0xBF81_8000, 0xBF82, "negative tie, odd: away from zero"),
    (0x3F80_8001, 0x3F81, "just above a tie"),
    (0x3F80_7FFF, 0x3F80, "just below a tie"),
    (0x3F81_7FFF, 0x3F81, "just below a tie, odd below"),
    (0x3F81_8001, 0x3F82, "just above a tie, odd below"),
    (0x7F80_0000, 0x7F80, "+inf"),
    (0xFF80_0000, 0xFF80, "-inf"),
    (0x0000_0000, 0x0000, "+0"),
    (0x8000_0000, 0x8000, "-0 keeps its sign"),
    (0x0000_0001, 0x0000, "smallest subnormal rounds to 0"),
    (0x8000_0001, 0x8000, "negative smallest subnormal rounds to -0"),
    (0x0000_8000, 0x0000, "subnormal tie, even below"),
    (0x0000_8001, 0x0001, "subnormal just above a tie"),
    (0x0001_8000, 0x0002, "subnormal tie, odd below"),
    (0x007F_FFFF, 0x0080, "largest subnormal rounds up to the smallest normal"),
    (0x807F_FFFF, 0x8080, "same, negative"),
    (0x7F7F_FFFF, 0x7F80, "largest finite f32 overflows to inf"),
    (0xFF7F_FFFF, 0xFF80, "same, negative"),
    (0x7F7F_8000, 0x7F80, "tie above the largest bf16 (odd) rounds to inf"),
    (0x7F7F_7FFF, 0x7F7F, "just below that tie stays finite"),
    (0x7F7E_8000, 0x7F7E, "tie with an even largest-but-one stays"),
    (0x7FC0_0000, 0x7FC0, "quiet NaN"),
    (0xFFC0_0000, 0xFFC0, "negative quiet NaN keeps its sign"),
    (0x7F80_0001, 0x7FC0, "signalling NaN with a low payload becomes quiet, not inf"),
    (0x7F80_FFFF, 0x7FC0, "NaN payload below bit 16 must not round into inf"),
    (0x7FA0_0000, 0x7FE0, "signalling NaN keeps its high payload, gains the quiet bit"),
    (0xFF81_2345, 0xFFC1, "negative signalling NaN"),
    (0x7FFF_FFFF, 0x7FFF, "all-ones NaN must not carry into the sign"),
    (0xFFFF_FFFF, 0xFFFF, "all-ones negative NaN must not wrap"),
]


@pytest.mark.parametrize(("f32_bits", "bf16_bits", "why"), BF16_CASES)
def test_bf16_rounding_cases(bf16_impl: str, f32_bits: int, bf16_bits: int, why: str) -> None:
    assert reference_bf16(f32_bits) == bf16_bits, f"table entry wrong: {why}"
    got = int(f32_to_bf16(f32_from_bits(f32_bits))[0])
    assert got == bf16_bits, f"{why}: 0x{f32_bits:08X} -> 0x{got:04X} ({bf16_impl})"


@settings(max_examples=60)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=200))
def test_bf16_matches_exact_reference(bit_patterns: list[int]) -> None:
    values = f32_from_bits(*bit_patterns)
    expected = [reference_bf16(b) for b in bit_patterns]
    assert [int(b) for b in f32_to_bf16(values)] == expected
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dtypes, "_ML_BFLOAT16", None)
        assert [int(b) for b in f32_to_bf16(values)] == expected


def test_bf16_backends_agree_on_random_bits_across_blocks() -> None:
    rng = np.random.default_rng(7)
    bits = rng.integers(0, 2**32, size=dtypes._BLOCK_VALUES + 4099, dtype=np.uint64)
    values = bits.astype(np.uint32).view(np.float32)
    values[dtypes._BLOCK_VALUES + 5] = np.float32("nan")  # a NaN in the second block of work
    default = f32_to_bf16(values)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dtypes, "_ML_BFLOAT16", None)
        fallback = f32_to_bf16(values)
    np.testing.assert_array_equal(default, fallback)
    sample = rng.choice(values.size, 2000, replace=False)
    sample = np.append(sample, dtypes._BLOCK_VALUES + 5)
    assert [int(default[i]) for i in sample] == [
        reference_bf16(bits_of(values[i : i + 1])[0]) for i in sample
    ]


def test_bf16_decode_is_a_shift_for_every_pattern(bf16_impl: str) -> None:
    patterns = np.arange(1 << 16, dtype=np.uint16)
    decoded = bf16_to_f32(patterns)
    assert decoded.dtype == np.float32
    np.testing.assert_array_equal(decoded.view(np.uint32), patterns.astype(np.uint32) << 16)
    again = f32_to_bf16(decoded)
    is_nan = np.isnan(decoded)
    np.testing.assert_array_equal(again[~is_nan], patterns[~is_nan])  # exact values survive
    np.testing.assert_array_equal(again[is_nan], patterns[is_nan] | 0x0040)  # NaNs come back quiet


def _as_uint8_array(raw: bytes) -> NDArray[np.uint8]:
    return np.frombuffer(raw, np.uint8)


@pytest.mark.parametrize("wrap", [bytes, bytearray, memoryview, _as_uint8_array])
def test_bf16_decode_accepts_byte_buffers(wrap: Callable[[bytes], BytesLike]) -> None:
    raw = bytes.fromhex("803F00C0807F")  # 1.0, -2.0, +inf little-endian
    decoded = bf16_to_f32(wrap(raw))
    assert decoded.tolist() == [1.0, -2.0, math.inf]


def test_bf16_decode_rejects_odd_length() -> None:
    with pytest.raises(RemoteProtocolError) as info:
        bf16_to_f32(b"\x80\x3f\x00")
    assert info.value.code is ErrorCode.BAD_TENSOR_LENGTH


def test_bf16_out_parameters(bf16_impl: str) -> None:
    values = np.linspace(-3, 3, 1001, dtype=np.float32)
    bits_out = np.empty(1001, np.uint16)
    assert f32_to_bf16(values, out=bits_out) is bits_out
    np.testing.assert_array_equal(bits_out, f32_to_bf16(values))
    f32_out = np.empty(1001, np.float32)
    assert bf16_to_f32(bits_out, out=f32_out) is f32_out
    np.testing.assert_array_equal(f32_out, bf16_to_f32(bits_out))
    with pytest.raises(ValueError):
        f32_to_bf16(values, out=np.empty(1000, np.uint16))
    with pytest.raises(ValueError):
        bf16_to_f32(bits_out, out=np.empty(1001, np.float64))


# -- q4: slow scalar reference -------------------------------------------------------------------
def reference_level(magnitude: np.float32, scale: np.float32) -> int:
    """The pinned formula, one value at a time: clamp(rne(log2(|x| / scale)) + 7, 0, 7) in f32."""
    if scale == 0:
        return 0
    ratio = np.float32(magnitude / scale)  # f32 division
    if ratio == 0:
        return 0  # log2(0) = -inf clamps to level 0
    log2_ratio = np.float32(math.log2(float(ratio)))  # the f32 log2, correctly rounded
    return int(min(max(np.rint(log2_ratio) + np.float32(7), 0), 7))  # rint: half to even


def reference_q4_encode(values: NDArray[np.float32]) -> bytes:
    out = bytearray()
    for start in range(0, len(values), 256):
        block = [np.float32(v) for v in values[start : start + 256]]
        block += [np.float32(0.0)] * (256 - len(block))
        scale = max(abs(v) for v in block)
        nibbles = []
        for v in block:
            level = reference_level(abs(v), scale)
            nibbles.append(level | (8 if v < 0 and level > 0 else 0))
        out += struct.pack("<f", scale)
        out += bytes(nibbles[2 * i] | nibbles[2 * i + 1] << 4 for i in range(128))
    return bytes(out)


def reference_q4_decode(data: bytes, numel: int) -> list[np.float32]:
    values = []
    for block in range(len(data) // 132):
        (scale,) = struct.unpack_from("<f", data, 132 * block)
        scale32 = np.float32(scale)
        for i in range(256):
            byte = data[132 * block + 4 + i // 2]
            nibble = byte & 0xF if i % 2 == 0 else byte >> 4
            level = nibble & 7
            if level == 0:
                values.append(np.float32(0.0) * scale32)
            else:
                sign = np.float32(-1.0 if nibble & 8 else 1.0)
                values.append(sign * np.float32(2.0 ** (level - 7)) * scale32)
    return values[:numel]


def test_q4_golden_vector() -> None:
    encoded = q4_encode(np.array([1.0, -0.5, 0.25, 0.0], np.float32))
    assert encoded.tobytes() == bytes.fromhex("0000803FE705") + bytes(126)
    assert q4_decode(encoded, 4).tolist() == [1.0, -0.5, 0.25, 0.0]


@pytest.mark.parametrize(
    ("numel", "size"), [(0, 0), (1, 132), (255, 132), (256, 132), (257, 264), (1000, 528)]
)
def test_q4_nbytes(numel: int, size: int) -> None:
    assert q4_nbytes(numel) == size
    assert len(q4_encode(np.ones(numel, np.float32))) == size


def test_q4_thresholds_follow_the_pinned_formula() -> None:
    """Every f32 ratio near each level step gets the level the formula gives, and no other."""
    magnitudes = []
    for j in range(1, 8):
        centre = int(np.float32(2.0 ** (j - 7.5)).view(np.uint32))
        magnitudes.append(np.arange(centre - 4096, centre + 4096, dtype=np.uint32))
    rng = np.random.default_rng(3)
    magnitudes.append(rng.integers(1, 0x3F80_0001, 200_000, dtype=np.uint32))  # (0, 1]
    ratios = np.concatenate(magnitudes).view(np.float32)
    log2 = np.log2(ratios.astype(np.float64)).astype(np.float32)
    formula = np.clip(np.rint(log2) + np.float32(7), 0, 7).astype(np.int64)
    by_threshold = (ratios[:, None] >= Q4_LEVEL_THRESHOLDS[None, :]).sum(axis=1)
    np.testing.assert_array_equal(by_threshold, formula)
    # ...and each threshold is where its level starts.
    for j, threshold in enumerate(Q4_LEVEL_THRESHOLDS, start=1):
        below = np.nextafter(threshold, np.float32(0))
        assert reference_level(threshold, np.float32(1)) == j
        assert reference_level(below, np.float32(1)) == j - 1


def _threshold_probe_block() -> NDArray[np.float32]:
    """Ratios right at, just under and just over every level step, with scale 1 and -1 signs."""
    values = [np.float32(1.0)]
    for threshold in Q4_LEVEL_THRESHOLDS:
        bits = int(threshold.view(np.uint32))
        for delta in range(-3, 4):
            values.append(f32_from_bits(bits + delta)[0] * (1 if delta % 2 else -1))
    return np.array(values, np.float32)


def test_q4_encode_matches_reference_at_level_steps() -> None:
    block = _threshold_probe_block()
    for scale in (1.0, 3.0, 1e-30, 7.5e30):
        scaled = (block.astype(np.float64) * scale).astype(np.float32)
        assert q4_encode(scaled).tobytes() == reference_q4_encode(scaled)


def test_q4_encode_matches_reference_on_random_data() -> None:
    rng = np.random.default_rng(11)
    parts = [
        rng.standard_normal(1000).astype(np.float32),
        (rng.standard_normal(700) * 10.0 ** rng.integers(-40, 38, 700)).astype(np.float32),
        (  # any finite bit pattern, either sign
            rng.integers(0, 0x7F80_0000, 600, dtype=np.uint32)
            | np.where(rng.random(600) < 0.5, 0x8000_0000, 0).astype(np.uint32)
        ).view(np.float32),
        np.zeros(300, np.float32),
        -np.zeros(44, np.float32),
    ]
    values = np.concatenate(parts)
    rng.shuffle(values)
    assert q4_encode(values).tobytes() == reference_q4_encode(values)


finite_f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


@settings(max_examples=80)
@given(hnp.arrays(np.float32, st.integers(0, 600), elements=finite_f32))
def test_q4_encode_matches_reference_property(values: NDArray[np.float32]) -> None:
    assert q4_encode(values).tobytes() == reference_q4_encode(values)


@settings(max_examples=40)
@given(st.binary(min_size=128, max_size=128), st.integers(0, 0x7F7F_FFFF), st.integers(1, 256))
def test_q4_decode_matches_reference(codes: bytes, scale_bits: int, numel: int) -> None:
    """Any nibbles (the sign-with-level-0 one included) under any finite non-negative scale."""
    data = struct.pack("<I", scale_bits) + codes
    decoded = q4_decode(data, numel)
    expected = reference_q4_decode(data, numel)
    assert bits_of(decoded) == bits_of(np.array(expected, np.float32))


magnitude = st.floats(2.0**-100, 2.0**100, width=32)
normal_range_f32 = st.one_of(st.just(0.0), magnitude, magnitude.map(lambda v: -v))


def assert_within_q4_bound(values: NDArray[np.float32]) -> None:
    decoded = q4_decode(q4_encode(values), values.size)
    numel = values.size
    padded = np.zeros(q4_nbytes(numel) // 132 * 256, np.float64)
    padded[:numel] = values
    scale = np.repeat(np.abs(padded).reshape(-1, 256).max(axis=1), 256)[:numel]
    x, x_hat = values.astype(np.float64), decoded.astype(np.float64)
    error = np.abs(x - x_hat)
    assert np.all(error <= (1 - 2**-0.5 + SLACK) * scale)  # the block-scale bound
    zero = x_hat == 0
    assert np.all(np.abs(x[zero]) <= 2**-6.5 * (1 + SLACK) * scale[zero])  # level 0
    assert np.all(error[~zero] <= (SQRT2_MINUS_1 + SLACK) * np.abs(x_hat[~zero]))  # levels 1..7
    assert np.all(np.sign(x_hat[~zero]) == np.sign(x[~zero]))


@settings(max_examples=80)
@given(hnp.arrays(np.float32, st.integers(1, 700), elements=normal_range_f32))
def test_q4_round_trip_error_bound_property(values: NDArray[np.float32]) -> None:
    assert_within_q4_bound(values)


def test_q4_round_trip_error_bound_on_gaussian_data() -> None:
    rng = np.random.default_rng(5)
    values = (rng.standard_normal(300_007) * np.exp(rng.uniform(-5, 5, 300_007))).astype(np.float32)
    assert_within_q4_bound(values)


def test_q4_power_of_two_multiples_of_the_scale_are_exact() -> None:
    rng = np.random.default_rng(9)
    for scale in (1.0, 0.75, 3.0e-20, 1.5e20):
        exponents = rng.integers(0, 7, 512)
        signs = np.where(rng.random(512) < 0.5, -1.0, 1.0)
        values = (signs * scale * 2.0 ** -exponents.astype(np.float64)).astype(np.float32)
        values[0], values[300] = scale, -scale  # each block's absmax is the scale
        np.testing.assert_array_equal(q4_decode(q4_encode(values), 512), values)


def test_q4_padding_is_zero_and_ignored() -> None:
    values = np.full(300, -2.0, np.float32)
    encoded = q4_encode(values)
    assert len(encoded) == 264
    second = encoded[132:]
    assert second[:4].tobytes() == struct.pack("<f", 2.0)
    assert set(second[4 : 4 + 22].tolist()) == {0xFF}  # 44 values: level 7, negative
    assert not second[4 + 22 :].any()  # padding nibbles are 0
    # A receiver ignores whatever the padding holds.
    tampered = encoded.copy()
    tampered[4 + 132 + 22 :] = 0x77
    np.testing.assert_array_equal(q4_decode(tampered, 300), values)


def test_q4_all_zero_and_tiny_blocks() -> None:
    zeros = np.concatenate([np.zeros(128, np.float32), -np.zeros(128, np.float32)])
    encoded = q4_encode(zeros)
    assert encoded.tobytes() == bytes(132)  # scale 0, and -0.0 gets no sign bit
    assert not np.signbit(q4_decode(encoded, 256)).any()
    # Ratios that underflow to 0, or stay below the first step, are level 0 without a sign.
    values = np.array([1e30, -1e-45, 1e-45, -1e-3 * 1e30], np.float32)
    assert q4_encode(values)[4:6].tobytes() == bytes([0x07, 0x00])


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_q4_encode_refuses_non_finite(bad: float) -> None:
    values = np.ones(700, np.float32)
    values[400] = bad
    with pytest.raises(LocalProtocolError) as info:
        q4_encode(values)
    assert info.value.code is ErrorCode.NON_FINITE_VALUE
    assert "256" in str(info.value)  # names the block it found


@pytest.mark.parametrize(
    "scale_bits",
    [0x7FC0_0000, 0xFFC0_0000, 0x7F80_0001, 0x7F80_0000, 0xFF80_0000, 0xBF80_0000, 0x8000_0001],
)
def test_q4_decode_rejects_bad_scales(scale_bits: int) -> None:
    good = q4_encode(np.ones(512, np.float32))
    bad = bytearray(good.tobytes())
    bad[132:136] = struct.pack("<I", scale_bits)
    with pytest.raises(RemoteProtocolError) as info:
        q4_decode(bytes(bad), 512)
    assert info.value.code is ErrorCode.BAD_Q4_SCALE
    assert "block 1" in str(info.value)


def test_q4_decode_accepts_negative_zero_scale_and_signed_level_zero() -> None:
    data = struct.pack("<I", 0x8000_0000) + bytes([0x87]) + bytes(127)  # scale -0.0
    decoded = q4_decode(data, 4)
    assert decoded.tolist() == [0.0, 0.0, 0.0, 0.0]
    data = struct.pack("<f", 2.0) + bytes([0x8F, 0x08]) + bytes(126)  # nibbles F, 8, 8, 0
    decoded = q4_decode(data, 4)
    assert decoded.tolist() == [-2.0, 0.0, 0.0, 0.0]
    assert not np.signbit(decoded[1:]).any()  # sign bit with level 0 decodes to +0.0


def test_q4_decode_subnormal_products_round_like_ieee() -> None:
    data = struct.pack("<I", 1) + bytes([0x67, 0x5E]) + bytes(126)  # scale = 2^-149
    decoded = q4_decode(data, 4)
    # 2^-149 stays; 2^-150 is a tie between 0 and 2^-149 and goes to 0 (even); -2^-150 -> -0.0;
    # 2^-151 -> 0.
    assert bits_of(decoded) == [1, 0, 0x8000_0000, 0]


@pytest.mark.parametrize(("numel", "length"), [(1, 131), (1, 133), (1, 0), (256, 264), (257, 132)])
def test_q4_decode_rejects_wrong_lengths(numel: int, length: int) -> None:
    with pytest.raises(RemoteProtocolError) as info:
        q4_decode(bytes(length), numel)
    assert info.value.code is ErrorCode.BAD_TENSOR_LENGTH


def test_q4_work_blocks_do_not_change_the_bytes() -> None:
    """Arrays spanning several blocks of work encode like their 256-value blocks one by one."""
    rng = np.random.default_rng(13)
    numel = (dtypes._Q4_BLOCKS_PER_STEP + 3) * 256 + 17
    values = rng.standard_normal(numel).astype(np.float32)
    encoded = q4_encode(values)
    one_by_one = b"".join(q4_encode(values[i : i + 256]).tobytes() for i in range(0, numel, 256))
    assert encoded.tobytes() == one_by_one
    decoded = q4_decode(encoded, numel)
    by_block = np.concatenate(
        [
            q4_decode(encoded[i : i + 132], min(256, numel - j))
            for i, j in zip(range(0, len(encoded), 132), range(0, numel, 256), strict=True)
        ]
    )
    np.testing.assert_array_equal(decoded, by_block)
    out = np.empty(numel, np.float32)
    assert q4_decode(encoded, numel, out=out) is out
    np.testing.assert_array_equal(out, decoded)
    encoded_out = np.empty(len(encoded), np.uint8)
    assert q4_encode(values, out=encoded_out) is encoded_out
    np.testing.assert_array_equal(encoded_out, encoded)


# -- per frame -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("dtype", "push", "size"),
    [
        (WireDtype.F32, False, 4000),
        (WireDtype.F32, True, 4000),
        (WireDtype.BF16, False, 2000),
        (WireDtype.BF16, True, 2000),
        (WireDtype.Q4, False, 2000),  # INIT/BCAST of a q4 session are bf16
        (WireDtype.Q4, True, 4 * 132),
    ],
)
def test_tensor_round_trip_per_dtype(dtype: WireDtype, push: bool, size: int) -> None:
    values = np.linspace(-1, 1, 1000, dtype=np.float32)
    assert tensor_nbytes(dtype, 1000, push=push) == size
    encoded = encode_tensor(values, dtype, push=push)
    assert encoded.dtype == np.uint8 and encoded.size == size
    decoded = decode_tensor(encoded.tobytes(), dtype, 1000, push=push)
    if dtype is WireDtype.F32:
        expected = values
    elif dtype is WireDtype.Q4 and push:
        expected = q4_decode(q4_encode(values), 1000)
    else:
        expected = bf16_to_f32(f32_to_bf16(values))
    np.testing.assert_array_equal(decoded, expected)
    for wrong in (size - 1, size + 1):
        with pytest.raises(RemoteProtocolError) as info:
            decode_tensor(bytes(wrong), dtype, 1000, push=push)
        assert info.value.code is ErrorCode.BAD_TENSOR_LENGTH
    out = np.empty(1000, np.float32)
    assert decode_tensor(encoded, dtype, 1000, push=push, out=out) is out
    np.testing.assert_array_equal(out, expected)
    encoded_out = np.empty(size, np.uint8)
    assert encode_tensor(values, dtype, push=push, out=encoded_out) is encoded_out
    np.testing.assert_array_equal(encoded_out, encoded)


def test_f32_encode_and_decode_do_not_copy() -> None:
    values = np.arange(12, dtype=np.float32).reshape(3, 4)
    encoded = encode_tensor(values, WireDtype.F32, push=True)
    assert np.shares_memory(encoded, values)
    assert encoded.tobytes() == values.astype("<f4").tobytes()
    frame = bytearray(b"\x00" * 48 + encoded.tobytes())  # a tensor after a 48-byte prefix
    view = memoryview(frame)[48:]
    decoded = decode_tensor(view, WireDtype.F32, 12, push=True)
    assert np.shares_memory(decoded, np.frombuffer(frame, np.uint8))
    np.testing.assert_array_equal(decoded, values.reshape(-1))
    read_only = decode_tensor(bytes(view), WireDtype.F32, 12, push=False)
    assert not read_only.flags.writeable
    # Non-contiguous or non-f32 input is converted, never misread.
    strided = np.arange(24, dtype=np.float32)[::2]
    assert encode_tensor(strided, WireDtype.F32, push=False).tobytes() == strided.tobytes()
    as_f64 = np.arange(5, dtype=np.float64)
    encoded_f64 = encode_tensor(as_f64, WireDtype.F32, push=False)  # type: ignore[arg-type]
    assert encoded_f64.tobytes() == as_f64.astype("<f4").tobytes()


def test_final_fragment_size_is_f32() -> None:
    assert tensor_nbytes(WireDtype.F32, 7, push=False) == 28  # FINAL_FRAGMENT in any session


def test_all_finite() -> None:
    values = np.ones(dtypes._BLOCK_VALUES * 2 + 5, np.float32)
    assert all_finite(values)
    assert all_finite(np.empty(0, np.float32))
    assert all_finite(np.arange(5))
    for bad in (math.nan, math.inf, -math.inf):
        for where in (0, dtypes._BLOCK_VALUES + 1, values.size - 1):
            spoiled = values.copy()
            spoiled[where] = bad
            assert not all_finite(spoiled)
    assert not all_finite(np.array([[1.0, math.nan]]))


def test_all_finite_is_not_fooled_when_its_fast_screen_overflows() -> None:
    # Every value is finite but the screen's f32 reduction is not (huge values in several
    # blocks; 1e20, whose square alone overflows): all_finite must fall back to the exact
    # check rather than report a NaN or infinity that is not there.
    huge = np.full(dtypes._BLOCK_VALUES + 3, 3e38, np.float32)
    huge[1::2] = 2e38
    assert all_finite(huge)
    huge[-1] = math.inf
    assert not all_finite(huge)
    large = np.full(1000, 1e20, np.float32)
    assert not proven_finite(large)
    assert all_finite(large)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_proven_finite_never_passes_a_nan_or_an_infinity(dtype: type, bad: float) -> None:
    # Every position of a block longer than any SIMD width, the vector tail included.
    block = np.full(77, -0.5, dtype)
    assert proven_finite(block)
    for where in range(block.size):
        spoiled = block.copy()
        spoiled[where] = bad
        assert not proven_finite(spoiled)


def test_proven_finite_of_nothing() -> None:
    assert proven_finite(np.empty(0, np.float32))


@settings(max_examples=300, deadline=None)
@given(
    hnp.arrays(
        np.float32,
        st.integers(0, 600),
        elements=st.floats(width=32, allow_nan=True, allow_infinity=True),
    )
)
def test_proven_finite_implies_every_value_finite(values: NDArray[np.float32]) -> None:
    if proven_finite(values):
        assert np.isfinite(values).all()
    # Values a trained model produces are far below the overflow of their squares.
    if np.isfinite(values).all() and np.abs(values).max(initial=0.0) < 1e17:
        assert proven_finite(values)
