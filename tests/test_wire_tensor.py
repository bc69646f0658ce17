"""WireTensor: wire bytes checked once, decoded range by range to exactly decode_tensor's values."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from yeto_proto.constants import Q4_BLOCK_BYTES, Q4_BLOCK_VALUES, WireDtype
from yeto_proto.dtypes import decode_tensor, encode_tensor
from yeto_proto.errors import ErrorCode, RemoteProtocolError
from yeto_proto.wire_tensor import WireTensor

PUSH_DTYPES = [WireDtype.BF16, WireDtype.Q4]


def encoded(values: np.ndarray, dtype: WireDtype) -> np.ndarray:
    return encode_tensor(values.astype(np.float32), dtype, push=True)


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from(PUSH_DTYPES),
    numel=st.integers(1, 5 * Q4_BLOCK_VALUES + 77),
    seed=st.integers(0, 2**31),
    step_blocks=st.integers(1, 4),
)
def test_ranges_decode_to_exactly_the_whole_tensor_s_values(
    dtype: WireDtype, numel: int, seed: int, step_blocks: int
) -> None:
    values = np.random.default_rng(seed).standard_normal(numel).astype(np.float32) * 3
    data = encoded(values, dtype)
    whole = decode_tensor(data, dtype, numel, push=True)
    tensor = WireTensor(data, dtype, numel, push=True)
    assert tensor.size == numel and tensor.nbytes == data.size
    step = step_blocks * Q4_BLOCK_VALUES
    for start in range(0, numel, step):
        stop = min(start + step, numel)
        out = np.full(stop - start, np.nan, np.float32)
        tensor.decode_range(start, stop, out)
        assert out.tobytes() == whole[start:stop].tobytes()
    assert tensor.decode().tobytes() == whole.tobytes()


def test_q4_ranges_start_on_a_block_boundary() -> None:
    tensor = WireTensor(encoded(np.ones(600), WireDtype.Q4), WireDtype.Q4, 600, push=True)
    with pytest.raises(ValueError):
        tensor.decode_range(1, 257, np.empty(256, np.float32))
    with pytest.raises(ValueError):
        tensor.decode_range(0, 601, np.empty(601, np.float32))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_bf16_non_finite_values_are_found_from_the_bits(bad: float) -> None:
    values = np.linspace(-1, 1, 70_000, dtype=np.float32)
    assert WireTensor(
        encoded(values, WireDtype.BF16), WireDtype.BF16, values.size, push=True
    ).all_finite()
    values[65_537] = bad
    tensor = WireTensor(encoded(values, WireDtype.BF16), WireDtype.BF16, values.size, push=True)
    assert not tensor.all_finite()


def test_q4_values_never_exceed_their_scale_so_valid_scales_are_finite_values() -> None:
    big = np.full(300, np.finfo(np.float32).max, np.float32)
    tensor = WireTensor(encoded(big, WireDtype.Q4), WireDtype.Q4, 300, push=True)
    assert tensor.all_finite() and np.isfinite(tensor.decode()).all()


def test_bad_q4_scales_and_lengths_are_refused_with_their_codes() -> None:
    data = encoded(np.ones(256), WireDtype.Q4).copy()
    data[:4] = np.frombuffer(np.float32(math.inf).tobytes(), np.uint8)
    with pytest.raises(RemoteProtocolError) as caught:
        WireTensor(data, WireDtype.Q4, 256, push=True)
    assert caught.value.code is ErrorCode.BAD_Q4_SCALE
    with pytest.raises(RemoteProtocolError) as caught:
        WireTensor(np.zeros(Q4_BLOCK_BYTES + 1, np.uint8), WireDtype.Q4, 256, push=True)
    assert caught.value.code is ErrorCode.BAD_TENSOR_LENGTH
    with pytest.raises(RemoteProtocolError) as caught:
        WireTensor(np.zeros(7, np.uint8), WireDtype.BF16, 4, push=True)
    assert caught.value.code is ErrorCode.BAD_TENSOR_LENGTH


def test_f32_is_not_wrapped() -> None:
    with pytest.raises(ValueError):
        WireTensor(np.zeros(16, np.uint8), WireDtype.F32, 4, push=True)
