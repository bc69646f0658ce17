"""The round benchmark learner streams its PUSH encode: the bytes equal a whole encode.

``benchmarks/bench_round.py`` encodes q4 and bf16 PUSH payloads range by range, just ahead of
its socket layer (``StreamedPayload``); every byte written, plain or sliced into CHUNKs, must be
the byte ``encode_tensor`` of the whole delta would have given.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from yeto_proto import (
    ChunkSlicer,
    PullReq,
    PushFragment,
    WireDtype,
    encode,
    encode_tensor,
    tensor_nbytes,
)
from yeto_proto.constants import CHUNK_SLICE_SIZE

BENCH_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_round.py"


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    spec = importlib.util.spec_from_file_location("bench_round_under_test", BENCH_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being built
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


class RecordingSocket:
    """Collects what the learner's socket layer writes."""

    def __init__(self) -> None:
        self.written = bytearray()
        self.writes = 0

    def sendall(self, data: memoryview) -> None:
        self.written += data
        self.writes += 1


def reference_streams(
    delta: np.ndarray, dtype: WireDtype, pull: PullReq, slicer: ChunkSlicer | None
) -> list[bytes]:
    """Bytes per socket (control, then data streams) of the PUSH encoded all at once."""
    push = PushFragment(
        learner_id=0,
        fragment_id=pull.fragment_id,
        global_step=pull.global_step,
        round_attempt=pull.round_attempt,
        base_version=0,
        local_step=pull.global_step,
        c_steps=1,
        c_tokens=1000,
        data=encode_tensor(delta, dtype, push=True).data,
    )
    frame = encode(push)
    if slicer is None:
        return [b"".join(frame)]
    out = [bytearray() for _ in range(slicer.num_data_streams + 1)]
    for chunk in slicer.slice(frame):
        for buffer in chunk.buffers:
            out[1 + chunk.stream_idx] += buffer
    return [bytes(b) for b in out]


@pytest.mark.parametrize("dtype", [WireDtype.Q4, WireDtype.BF16, WireDtype.F32])
@pytest.mark.parametrize(
    ("streams", "slice_size"), [(0, CHUNK_SLICE_SIZE), (2, CHUNK_SLICE_SIZE), (2, 65_537)]
)
@pytest.mark.parametrize(
    ("rate", "piece"),
    [(None, None), (None, 50_001), (1e12, None)],  # raw loopback (default, small pieces), throttled
)
def test_streamed_push_bytes_equal_a_whole_encode(
    bench: ModuleType,
    dtype: WireDtype,
    streams: int,
    slice_size: int,
    rate: float | None,
    piece: int | None,
) -> None:
    # Not a multiple of the encode step, nor of q4's 256-value block.
    numel = 5 * bench.STREAM_ENCODE_VALUES // 2 + 1037
    plan = bench.LearnerPlan(0, 0, dtype.value, (numel,), streams, rate)
    learner = bench.BenchLearner(plan)
    if piece is not None:
        learner.link.stream_piece = piece
    try:
        reference_slicer = None
        if streams:
            learner.slicer = ChunkSlicer(streams, slice_size)
            reference_slicer = ChunkSlicer(streams, slice_size)
        sockets = [RecordingSocket() for _ in range(streams + 1)]
        learner.sockets = sockets
        delta = learner.deltas[0]
        for step in (1, 2):  # the second round re-encodes into the same buffer
            for streamed in learner.encoded:  # stale bytes must never reach a socket
                streamed.out.fill(0xEE)
            for sock in sockets:
                sock.written.clear()
                sock.writes = 0
            pull = PullReq(fragment_id=0, global_step=step, round_attempt=0)
            learner._push(pull)
            expected = reference_streams(delta, dtype, pull, reference_slicer)
            assert learner.report.push_bytes[step] == sum(map(len, expected))
            assert [bytes(s.written) for s in sockets] == expected
            if dtype is not WireDtype.F32:
                assert learner.encoded[0].done
                whole = encode_tensor(delta, dtype, push=True)
                assert bytes(learner.encoded[0].out) == whole.tobytes()
            if dtype is not WireDtype.F32 and piece is not None:
                # Unthrottled, a streamed payload goes out in pieces, each encoded just before.
                assert sum(s.writes for s in sockets) > -(-len(whole) // piece)
    finally:
        learner.selector.close()


def test_streamed_payload_encodes_only_what_a_piece_reaches(bench: ModuleType) -> None:
    numel = 3 * 512 + 100
    delta = np.random.default_rng(7).normal(0.0, 1.0, numel).astype(np.float32)
    out = np.full(tensor_nbytes(WireDtype.Q4, numel, push=True), 0xEE, np.uint8)
    streamed = bench.StreamedPayload(delta, WireDtype.Q4, out, step_values=512)
    view = streamed.data
    streamed.ready(memoryview(b"header bytes"))  # not payload: nothing to encode
    assert streamed.encoded_bytes == 0
    streamed.ready(view[:1])
    assert (streamed.encoded_values, streamed.encoded_bytes) == (512, 2 * 132)
    streamed.ready(view[2 * 132 : 2 * 132 + 1])  # one byte into the second step
    assert streamed.encoded_values == 1024
    streamed.ready(view[-1:])
    assert streamed.done
    assert out.tobytes() == encode_tensor(delta, WireDtype.Q4, push=True).tobytes()
    with pytest.raises(ValueError):
        bench.StreamedPayload(delta, WireDtype.Q4, out, step_values=300)


def test_a_throttled_sender_encodes_ahead_while_its_bytes_are_on_the_wire(
    bench: ModuleType,
) -> None:
    numel = 4 * 512
    delta = np.random.default_rng(3).normal(0.0, 1.0, numel).astype(np.float32)
    out = np.full(tensor_nbytes(WireDtype.Q4, numel, push=True), 0xEE, np.uint8)
    streamed = bench.StreamedPayload(delta, WireDtype.Q4, out, step_values=512)
    bucket = bench.TokenBucket(rate=1e6, burst=100)  # 1 MB/s: 10 kB is 10 ms behind
    steps: list[int] = []

    def ahead() -> bool:
        steps.append(streamed.encoded_values)
        return bool(streamed.encode_ahead())

    started = time.monotonic()
    bucket.spend(10_000, ahead)
    # Every step was encoded while waiting, then the rest of the wait was slept: the wire
    # time is kept either way (a lower bound, so a slow host cannot fail it).
    assert time.monotonic() - started >= (10_000 - 100) / 1e6 - 1e-4
    assert steps == [0, 512, 1024, 1536, 2048] and streamed.done
    assert out.tobytes() == encode_tensor(delta, WireDtype.Q4, push=True).tobytes()
    assert not streamed.encode_ahead()
