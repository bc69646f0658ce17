"""One syncer round on loopback: ``yeto-sync`` against plain sockets, gloo and torchft.

    python benchmarks/bench_round.py                   # everything, about 10 minutes on 2 cores
    python benchmarks/bench_round.py --part rounds --learners 2 --streams 2 --dtypes f32
    python benchmarks/bench_round.py --part scale --scale-learners 4,8
    python benchmarks/bench_round.py --part rounds --profile /tmp/prof   # daemon under cProfile

Parts (``--part``, comma separated; default all):

- ``rounds``: the real daemon (``python -m yeto_sync``) and M learner processes on 127.0.0.1, one
  fragment of 4096×4096 f32 values (``--numel``), pipeline 1, quorum M, delta correction none.
  For each M (``--learners``), S (``--streams``) and dtype (``--dtypes``) it reports the median
  round latency — from the first learner's receipt of PULL_REQ to the last learner's receipt of
  the complete BCAST (``time.monotonic`` is one clock for every process on Linux); a learner
  answers round t only once it also holds BCAST t − 1 (a PULL on stream 0 may overtake a
  striped BCAST), and round t starts for it at that moment, so each delta is fresh and rounds
  do not overlap — the bytes
  through the syncer per round as counted on the learners' sockets, and the daemon's peak RSS
  (``VmHWM`` of ``/proc/<pid>/status``, read after the final cut, before the FINAL_ACKs).
  Learners pre-compute their f32 delta and, when pulled, stream its encode in the session
  dtype: range by range, just ahead of the socket, so encoding overlaps sending (q4 and bf16
  encoding are part of the round; f32 goes out as the delta's own bytes, as (a) sends them);
  they do not decode BCASTs (no learner compute is timed).
  Beside them, in the same run: (a) plain blocking Python sockets moving the same bytes (M
  clients send the push bytes to one server — a thread per client, ``recv_into`` preallocated
  buffers — which then ``sendall``\\ s the bcast bytes back), (b) ``torch.distributed`` gloo
  ``all_reduce`` of the same tensor and world size, (c) torchft 0.2 DiLoCo outer sync of a
  4096×4096 ``nn.Linear`` with M replicas (if torchft imports), and the merge time
  (``merge_round`` of M responses, in this process).
- ``throttled``: the dtype comparison again on an emulated 1 Gbit/s link (``--rate-gbit``), per
  learner and per direction, in front of both the yeto learners and the plain-socket clients.
  ``--link kernel``: the syncer (and (a)'s server) in a network namespace of its own, each
  learner in another, joined by a veth pair with a ``tbf`` qdisc on both ends
  (``benchmarks/shaped_link.py``; needs root and iproute2). ``--link bucket``: a token bucket
  (64 KiB burst) in every learner's socket layer, on loopback. The default, ``auto``, takes
  the kernel link where it can be made. The kernel link is the closer model of a real one: a
  sender's socket buffer drains onto it while the sender waits for a core, where a bucket in
  the socket layer leaves the link idle whenever the process that holds it is not running.
  On every link, the last rounds of a run are not measured: they overlap its final cut (a
  FINAL_FRAGMENT of every fragment, f32, on the same links).
- ``scale``: F = 8 fragments of 1M f32 values, 64 rounds, M = 4, 8, 16, 32 learners (threads in
  four host processes), pipeline 2; the syncer's CPU time (utime + stime of the daemon) and wall
  time per round over rounds 9..56, and per learner.

Targets: f32, M = 2, S = 2: round ≤ 1.5 × (a) + merge time, and ≤ 0.7 × (c); q4 rounds ≥ 3×
faster than f32 on the emulated link; daemon peak RSS ≤ 200 MiB + (K + 4) × fragment bytes;
syncer time per round at most linear in M (CPU per learner per round at M = 32 ≤ 1.2× that at
M = 4).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import importlib
import io
import json
import multiprocessing
import os
import platform
import pstats
import queue
import selectors
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from yeto_proto import (  # noqa: E402
    AnyMessage,
    BcastFragment,
    Chunk,
    ChunkSlicer,
    DataHello,
    DecoderState,
    ErrorMessage,
    FinalAck,
    FinalFragment,
    FinalManifest,
    FrameDecoder,
    Hello,
    InitParams,
    Limits,
    MergeMode,
    PullReq,
    PushFragment,
    Reassembler,
    Role,
    Shutdown,
    WireDtype,
    WireFragment,
    WireLayout,
    encode,
    encode_tensor,
    tensor_nbytes,
)
from yeto_proto.buffers import buffer_address  # noqa: E402
from yeto_proto.constants import Q4_BLOCK_VALUES, STRIPED_TYPES  # noqa: E402
from yeto_proto.dtypes import _q4_encode_blocks, _Q4EncodeScratch  # noqa: E402
from yeto_sync.receive_watermark import ReceiveWatermark  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from shaped_link import (  # noqa: E402
    BURST_BYTES,
    ShapedLinks,
    enter_namespace,
    shaped_links,
    shaped_links_available,
)

F32Array = NDArray[np.float32]
MIB = 1 << 20
SPAWN = multiprocessing.get_context("spawn")
DTYPES = {"f32": WireDtype.F32, "bf16": WireDtype.BF16, "q4": WireDtype.Q4}
RECV_BUFFER = 4 * MIB
THROTTLE_SLICE = 64 << 10
#: Values a streamed PUSH encode does per step (a whole number of q4 blocks): about 66 KiB of
#: q4 or 256 KiB of bf16, a fraction of a millisecond of encoding.
STREAM_ENCODE_VALUES = 1 << 17
#: Piece size of an unthrottled streamed send (raw loopback): each piece is encoded just before
#: it is written. On loopback the send is CPU-bound, so pieces of one encode step (~66 KiB of
#: q4) only add syscalls and wake-ups (q4 push ~53 ms instead of ~37 ms, M = S = 2, 2 cores).
STREAM_SEND_PIECE = 1 * MIB
#: A round's first streamed piece: the link waits for its encode (~0.1 ms instead of the ~3 ms
#: a whole 1 MiB piece of q4 takes); each next piece is as large as all encoded so far, up to
#: STREAM_SEND_PIECE.
STREAM_FIRST_PIECE = 64 << 10
TIMEOUT_S = 300.0
FINGERPRINT = bytes(range(32))
CONTRACT = bytes(range(64, 96))
RSS_BASE_MIB = 200
SCALE_FRAGMENTS = 8
SCALE_NUMEL = 1 << 20
SCALE_WINDOW = (8, 56)
#: Warm-up rounds per fragment before a case is measured (the pools' first commits allocate).
WARMUP_PASSES = 2
#: The fragments-in-flight case: fragments, --pipeline, M, S.
PIPELINED = (4, 2, 2, 2)  # syncer time is measured from round 9 through round 56


# -- an emulated link ---------------------------------------------------------------------------
class TokenBucket:
    """``rate`` bytes per second with a ``burst``-byte bucket; spending past it sleeps."""

    def __init__(self, rate: float, burst: int = THROTTLE_SLICE) -> None:
        self.rate = rate
        self.burst = float(burst)
        self.level = float(burst)
        self.stamp = time.monotonic()

    def spend(self, size: int, idle: Callable[[], bool] | None = None) -> None:
        """Charge ``size`` bytes; while the wire is behind, ``idle()`` may work instead of
        sleeping (it returns False once it has nothing to do)."""
        self._refill()
        self.level -= size
        while self.level < 0:
            if idle is None or not idle():
                time.sleep(-self.level / self.rate)
                return
            self._refill()

    def _refill(self) -> None:
        now = time.monotonic()
        self.level = min(self.burst, self.level + (now - self.stamp) * self.rate)
        self.stamp = now


class StreamedPayload:
    """A PUSH payload encoded lazily, range by range, just ahead of the socket layer.

    ``data`` views the whole encode buffer, but its bytes are valid only up to a watermark:
    :meth:`restart` forgets them (a new round), and :meth:`ready`, called before each piece of
    a frame is written, first encodes every range the piece reaches into. The bytes equal
    :func:`encode_tensor` of the whole delta: q4 is a run of independent blocks (256 values in
    132 bytes, a block's scale then its codes; only the last block is zero-padded), and bf16 is
    elementwise. Pieces are recognised by address, so CHUNK slices of the frame work too.

    Whole q4 steps go through the codec's block encoder with scratch kept across steps and
    rounds: ``q4_encode`` allocates about 1.8 MB of scratch per call, which glibc hands out
    fresh from mmap each time, and 128 calls a round cost some 54k page faults (~100 ms).
    """

    def __init__(
        self,
        values: F32Array,
        dtype: WireDtype,
        out: NDArray[np.uint8],
        step_values: int = STREAM_ENCODE_VALUES,
    ) -> None:
        if dtype is WireDtype.F32:
            raise ValueError("f32 needs no encoding: send the delta's own bytes")
        if step_values <= 0 or step_values % Q4_BLOCK_VALUES:
            raise ValueError(f"step_values must be a positive multiple of {Q4_BLOCK_VALUES}")
        self.values = values.reshape(-1)
        self.dtype = dtype
        self.numel = self.values.size
        self.out = out.reshape(-1)
        if self.out.size != self._nbytes(self.numel):
            raise ValueError(f"out must be {self._nbytes(self.numel)} bytes, got {self.out.size}")
        self.data = self.out.data
        self.step_values = step_values
        #: Bytes of one encode step.
        self.step_bytes = self._nbytes(step_values)
        self._base = buffer_address(self.data) if self.out.size else 0
        self._q4_scratch = (
            _Q4EncodeScratch(step_values // Q4_BLOCK_VALUES) if dtype is WireDtype.Q4 else None
        )
        self.encoded_values = 0
        self.encoded_bytes = 0

    def _nbytes(self, numel: int) -> int:
        return tensor_nbytes(self.dtype, numel, push=True)

    @property
    def done(self) -> bool:
        return self.encoded_values == self.numel

    def restart(self) -> None:
        """A new round: nothing of the buffer counts as encoded any more."""
        self.encoded_values = 0
        self.encoded_bytes = 0

    def ready(self, piece: memoryview) -> None:
        """Encode far enough that ``piece`` (any byte view about to be sent) is valid."""
        if self.done or not len(piece):
            return
        offset = buffer_address(piece) - self._base
        if not 0 <= offset < self.out.size:
            return  # not payload bytes (a header, a CHUNK envelope)
        end = offset + len(piece)
        while self.encoded_bytes < end:
            self._encode_step()

    def encode_ahead(self) -> bool:
        """Encode one more step past what was asked for; False when all is encoded."""
        if self.done:
            return False
        self._encode_step()
        return True

    def _encode_step(self) -> None:
        start = self.encoded_values
        stop = min(start + self.step_values, self.numel)
        byte_stop = self._nbytes(stop)  # exact: start and every stop but the last are on blocks
        values, dest = self.values[start:stop], self.out[self.encoded_bytes : byte_stop]
        if self._q4_scratch is not None and stop - start == self.step_values:
            _q4_encode_blocks(values, dest, self._q4_scratch)  # what q4_encode runs per step
        else:  # bf16 (no scratch with ml_dtypes), or the last q4 step (its tail is padded)
            encode_tensor(values, self.dtype, push=True, out=dest)
        self.encoded_values = stop
        self.encoded_bytes = byte_stop


@dataclass
class Link:
    """A learner's socket layer: optional up and down buckets, and byte counters."""

    rate: float | None = None
    sent: int = 0
    received: int = 0
    #: Piece size of an unthrottled send of a streamed payload (throttled: THROTTLE_SLICE).
    stream_piece: int = STREAM_SEND_PIECE

    def __post_init__(self) -> None:
        self.up = TokenBucket(self.rate) if self.rate else None
        self.down = TokenBucket(self.rate) if self.rate else None

    def send(
        self,
        sock: socket.socket,
        buffers: Sequence[bytes | memoryview],
        streamed: StreamedPayload | None = None,
    ) -> int:
        """Write ``buffers``; with ``streamed``, each piece's payload bytes are encoded first.

        On the emulated link the encode runs while the bytes already written are still on the
        wire: a piece is encoded before the bucket is charged, and while the bucket makes the
        sender wait, it encodes further ahead instead of sleeping, as a real link lets a
        sender's CPU work while its socket buffer drains.
        """
        total = 0
        for buffer in buffers:
            view = memoryview(buffer).cast("B")
            if self.up is None and (streamed is None or streamed.done):
                sock.sendall(view)  # all at once
            else:
                start = 0
                while start < len(view):
                    piece = view[start : start + self._piece_size(streamed)]
                    if streamed is not None:
                        streamed.ready(piece)
                    if self.up is not None:
                        ahead = None if streamed is None else streamed.encode_ahead
                        self.up.spend(len(piece), ahead)
                    sock.sendall(piece)
                    start += len(piece)
            total += len(view)
        self.sent += total
        return total

    def _piece_size(self, streamed: StreamedPayload | None) -> int:
        if self.up is not None:
            return THROTTLE_SLICE
        assert streamed is not None
        return min(self.stream_piece, max(STREAM_FIRST_PIECE, streamed.encoded_bytes))

    def recv_into(self, sock: socket.socket, target: memoryview) -> int:
        if self.down is not None:
            target = target[:THROTTLE_SLICE]
        size = sock.recv_into(target)
        if self.down is not None and size:
            self.down.spend(size)
        self.received += size
        return size

    def recv_exactly(self, sock: socket.socket, target: memoryview) -> None:
        got = 0
        while got < len(target):
            size = self.recv_into(sock, target[got:])
            if not size:
                raise ConnectionError("peer closed")
            got += size


@dataclass(frozen=True)
class Network:
    """Where a case's processes talk: raw loopback, loopback behind a token bucket in each
    learner's socket layer (``rate``), or kernel-shaped links between namespaces (``shaped``)."""

    rate: float | None = None
    shaped: ShapedLinks | None = None

    @property
    def server_host(self) -> str:
        # Inside the hub namespace nothing but the benchmark's links can reach the port.
        return "0.0.0.0" if self.shaped is not None else "127.0.0.1"

    @property
    def server_namespace(self) -> str | None:
        return None if self.shaped is None else self.shaped.hub

    def learner_end(self, learner: int) -> tuple[str, str | None]:
        """Learner ``learner``'s address of the server and the namespace it runs in."""
        if self.shaped is None:
            return "127.0.0.1", None
        return self.shaped.hub_address(learner), self.shaped.learner_namespace(learner)

    def describe(self) -> str:
        if self.shaped is not None:
            return (
                f"emulated {self.shaped.rate * 8 / 1e9:g} Gbit/s per learner and direction "
                "(kernel-shaped: a veth pair per learner between network namespaces, `tbf` on "
                f"both ends, {BURST_BYTES >> 10} KiB burst)"
            )
        if self.rate is not None:
            return (
                f"emulated {self.rate * 8 / 1e9:g} Gbit/s per learner and direction (token "
                "bucket, 64 KiB burst, in the learners' socket layer)"
            )
        return "raw loopback"


LOOPBACK = Network()


# -- a benchmark learner ------------------------------------------------------------------------
@dataclass(frozen=True)
class LearnerPlan:
    port: int
    learner_id: int
    dtype: int
    numels: tuple[int, ...]
    num_streams: int
    rate: float | None = None
    #: Report the receipt time of BCASTs of these versions to ``progress`` (scale run).
    watch_versions: tuple[int, ...] = ()
    #: The syncer's address, and the network namespace this learner runs in (shaped links).
    host: str = "127.0.0.1"
    netns: str | None = None

    @property
    def layout(self) -> WireLayout:
        return WireLayout(tuple(WireFragment(MergeMode.AVG, (n,)) for n in self.numels))


@dataclass
class LearnerReport:
    learner_id: int
    #: When the learner could answer round t: it held PULL t and the BCAST round t was
    #: launched against (a PULL on stream 0 may overtake a striped BCAST).
    pulls: dict[int, float] = field(default_factory=dict)
    bcasts: dict[int, float] = field(default_factory=dict)
    push_bytes: dict[int, int] = field(default_factory=dict)
    #: When the learner's last PUSH byte went into its socket, by global step.
    pushed: dict[int, float] = field(default_factory=dict)
    #: Bytes read from the syncer since the previous BCAST, by BCAST version.
    bytes_in: dict[int, int] = field(default_factory=dict)


class BenchLearner:
    """A v4 learner on blocking sockets that answers every PULL with a fixed, encoded delta.

    Receives read straight into the decoder's payload buffer when inside a large frame (as the
    syncer does), so the learner side is not what the round waits for.
    """

    def __init__(
        self,
        plan: LearnerPlan,
        *,
        before_ack: Callable[[], None] = lambda: None,
        progress: Callable[[int, int, float], None] = lambda learner, version, at: None,
    ) -> None:
        self.plan = plan
        self.dtype = WireDtype(plan.dtype)
        self.layout = plan.layout
        self.limits = Limits.of(self.dtype, self.layout)
        self.link = Link(plan.rate)
        self.before_ack = before_ack
        self.progress = progress
        self.report = LearnerReport(plan.learner_id)
        rng = np.random.default_rng(plan.learner_id + 1)
        self.deltas = [rng.normal(0.0, 1e-3, n).astype(np.float32) for n in plan.numels]
        #: Streamed encodes per fragment, each into its own buffer; f32 has none (its wire
        #: bytes are the delta's own).
        self.encoded = (
            []
            if self.dtype is WireDtype.F32
            else [
                StreamedPayload(
                    delta,
                    self.dtype,
                    np.empty(tensor_nbytes(self.dtype, delta.size, push=True), np.uint8),
                )
                for delta in self.deltas
            ]
        )
        self.sockets: list[socket.socket] = []
        self.decoders: dict[socket.socket, FrameDecoder] = {}
        self.watermarks: dict[socket.socket, ReceiveWatermark] = {}
        self.reassembler = Reassembler(Role.LEARNER, self.limits)
        self.slicer = ChunkSlicer(plan.num_streams) if plan.num_streams else None
        self.selector = selectors.DefaultSelector()
        self.buffer = bytearray(RECV_BUFFER)
        self.view = memoryview(self.buffer)
        self.inbox: list[AnyMessage] = []
        self.anchors: dict[int, int] = {}
        self.deferred: dict[int, PullReq] = {}
        self.finals: dict[int, int] = {}
        self.manifest: FinalManifest | None = None
        self.acked = False
        self.open_sockets = 0
        self.bytes_mark = 0

    # -- wire --------------------------------------------------------------------------------
    def connect(self) -> None:
        hello = Hello(
            learner_id=self.plan.learner_id,
            generation=1,
            dtype=self.dtype,
            layout=self.layout,
            layout_fingerprint=FINGERPRINT,
            session_contract=CONTRACT,
            num_streams=self.plan.num_streams,
        )
        self._add_socket().sendall(b"".join(encode(hello)))
        for stream_idx in range(self.plan.num_streams):
            data_hello = DataHello(self.plan.learner_id, 1, stream_idx)
            self._add_socket().sendall(b"".join(encode(data_hello)))

    def _add_socket(self) -> socket.socket:
        sock = socket.create_connection((self.plan.host, self.plan.port), timeout=TIMEOUT_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sockets.append(sock)
        self.decoders[sock] = FrameDecoder(
            Role.LEARNER, limits=self.limits, chunk_sink=self.reassembler
        )
        self.watermarks[sock] = ReceiveWatermark(sock)
        self.selector.register(sock, selectors.EVENT_READ)
        self.open_sockets += 1
        return sock

    def close(self) -> None:
        self.selector.close()
        for sock in self.sockets:
            sock.close()

    def send(self, message: AnyMessage, streamed: StreamedPayload | None = None) -> int:
        """Write ``message`` (striped when it may be); ``streamed``: its payload's encoder."""
        frame = encode(message)
        if self.slicer is None or message.TYPE not in STRIPED_TYPES:
            return self.link.send(self.sockets[0], frame, streamed)
        return sum(
            self.link.send(self.sockets[1 + chunk.stream_idx], chunk.buffers, streamed)
            for chunk in self.slicer.slice(frame)
        )

    def receive(self, deadline: float) -> AnyMessage:
        while not self.inbox:
            if not self.open_sockets:
                raise ConnectionError(f"learner {self.plan.learner_id}: syncer closed")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"learner {self.plan.learner_id}: nothing in time")
            for key, _ in self.selector.select(left):
                self._read(key.fileobj)  # type: ignore[arg-type]
        return self.inbox.pop(0)

    def _read(self, sock: socket.socket) -> None:
        decoder = self.decoders[sock]
        into, direct = decoder.next_read(self.view)
        try:
            size = self.link.recv_into(sock, into)
            if direct:
                if size:
                    decoder.wrote(size)
            else:
                decoder.feed(self.view[:size])
        except ConnectionResetError:
            size = 0
            decoder.feed(b"")
        if not size:
            self.selector.unregister(sock)
            self.open_sockets -= 1
        while not isinstance(frame := decoder.next_frame(), DecoderState):
            if isinstance(frame, Chunk):
                inner = self.reassembler.add(frame)
                if inner is not None:
                    self.inbox.append(inner)
            else:
                self.inbox.append(frame)
        if size and self.link.down is None:
            # The next select waits for what the next read is sure to get, as the yeto_learn
            # client's reader does (an emulated link keeps its own 64 KiB pace instead).
            into, direct = decoder.next_read(self.view)
            self.watermarks[sock].before_wait(len(into), direct)

    # -- protocol ----------------------------------------------------------------------------
    def run(self, timeout: float = TIMEOUT_S) -> LearnerReport:
        deadline = time.monotonic() + timeout
        self.connect()
        try:
            if self.plan.learner_id == 0:
                init_rng = np.random.default_rng(0)
                for fragment, numel in enumerate(self.plan.numels):
                    values = init_rng.normal(0.0, 0.02, numel).astype(np.float32)
                    data = encode_tensor(values, self.dtype, push=False)
                    self.send(InitParams(fragment, data.data))
            while True:
                message = self.receive(deadline)
                if isinstance(message, Shutdown):
                    return self.report
                self._handle(message)
                # Drop the frame now, as a learner that applied it would: its receive buffer
                # is recycled only once nothing refers to it.
                del message
        finally:
            self.close()

    def _handle(self, message: AnyMessage) -> None:
        now = time.monotonic()
        match message:
            case PullReq():
                self.deferred[message.fragment_id] = message
                self._answer_ready(now)
            case BcastFragment():
                self.report.bcasts[message.version] = now
                received = self.link.received
                self.report.bytes_in[message.version] = received - self.bytes_mark
                self.bytes_mark = received
                if message.version in self.plan.watch_versions:
                    self.progress(self.plan.learner_id, message.version, now)
                held = self.anchors.get(message.fragment_id, -1)
                self.anchors[message.fragment_id] = max(held, message.version)
                self._answer_ready(now)
            case FinalFragment():
                self.finals[message.fragment_id] = message.version
                self._maybe_ack()
            case FinalManifest():
                self.manifest = message
                self._maybe_ack()
            case ErrorMessage():
                raise RuntimeError(f"syncer ERROR: {message.text}")
            case _:
                raise RuntimeError(f"unexpected {type(message).__name__}")

    def _answer_ready(self, now: float) -> None:
        """Answer each deferred PULL whose launch version is here: every delta is fresh."""
        fragments = len(self.plan.numels)
        for fragment, pull in list(self.deferred.items()):
            launched_against = max(pull.global_step - fragments, 0)
            if self.anchors.get(fragment, -1) >= launched_against:
                del self.deferred[fragment]
                self.report.pulls[pull.global_step] = now
                self._push(pull)

    def _push(self, pull: PullReq) -> None:
        fragment = pull.fragment_id
        streamed: StreamedPayload | None = None
        if self.dtype is WireDtype.F32:
            # No encoding: the wire bytes are the delta's own (a view, as (a) sends them).
            payload = encode_tensor(self.deltas[fragment], self.dtype, push=True).data
        else:
            # Encoded range by range as the socket layer reaches it (see StreamedPayload).
            streamed = self.encoded[fragment]
            streamed.restart()
            payload = streamed.data
        push = PushFragment(
            learner_id=self.plan.learner_id,
            fragment_id=fragment,
            global_step=pull.global_step,
            round_attempt=pull.round_attempt,
            base_version=0,
            local_step=pull.global_step,
            c_steps=1,
            c_tokens=1000,
            data=payload,
        )
        self.report.push_bytes[pull.global_step] = self.send(push, streamed)
        self.report.pushed[pull.global_step] = time.monotonic()

    def _maybe_ack(self) -> None:
        manifest = self.manifest
        if manifest is None or self.acked:
            return
        if any(
            self.finals.get(f) != version for f, version in enumerate(manifest.expected_versions)
        ):
            return
        self.before_ack()
        self.send(FinalAck(manifest.final_global_step))
        self.acked = True


def learner_process(plan: LearnerPlan, pipe: Connection) -> None:
    """One learner in its own process; the parent reads the daemon's RSS before the ACK."""

    def before_ack() -> None:
        pipe.send(("final", None))
        pipe.recv()

    try:
        enter_namespace(plan.netns)
        report = BenchLearner(plan, before_ack=before_ack).run()
        pipe.send(("done", report))
    except Exception as exc:
        pipe.send(("error", f"learner {plan.learner_id}: {exc!r}"))


def learner_host_process(
    plans: list[LearnerPlan], progress: Any, results: Any
) -> None:  # Any: multiprocessing queues
    """Several learners as threads of one process (the scale run)."""
    errors: list[str] = []

    def play(plan: LearnerPlan) -> None:
        try:
            BenchLearner(
                plan, progress=lambda learner, version, at: progress.put((learner, version, at))
            ).run()
        except Exception as exc:
            errors.append(f"learner {plan.learner_id}: {exc!r}")

    threads = [threading.Thread(target=play, args=(plan,)) for plan in plans]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_S)
    results.put(errors or None)


# -- the daemon -------------------------------------------------------------------------------
class Daemon:
    """``python -m yeto_sync`` on port 0 of the network's server host (optionally under
    cProfile), stderr to a file."""

    def __init__(
        self,
        flags: Sequence[str],
        workdir: Path,
        *,
        profile: Path | None,
        network: Network = LOOPBACK,
    ) -> None:
        runner = ["-m", "cProfile", "-o", str(profile)] if profile is not None else []
        self.log_path = workdir / "syncer.log"
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        host = network.server_host
        command = [sys.executable, *runner, "-m", "yeto_sync", "--host", host, "--port", "0"]
        if network.shaped is not None:
            command = network.shaped.command_in_hub(command)
        with open(self.log_path, "w", encoding="utf-8") as log:
            self.proc = subprocess.Popen(
                command + list(flags),
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                cwd=ROOT,
                env=env,
            )
        lines: queue.SimpleQueue[str] = queue.SimpleQueue()
        stdout = self.proc.stdout
        assert stdout is not None
        threading.Thread(target=lambda: lines.put(stdout.readline()), daemon=True).start()
        try:
            line = lines.get(timeout=60)
        except queue.Empty:
            self.kill()
            raise RuntimeError(f"yeto-sync did not start:\n{self.log_tail()}") from None
        prefix = f"yeto-sync listening on {host}:"
        if not line.startswith(prefix):
            self.kill()
            raise RuntimeError(f"bad ready line {line!r}:\n{self.log_tail()}")
        self.port = int(line.strip().removeprefix(prefix))

    def status_kib(self, field_name: str) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
        raise RuntimeError(f"no {field_name} in /proc/{self.proc.pid}/status")

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
        return ticks / os.sysconf("SC_CLK_TCK")

    def log_tail(self, lines: int = 8) -> str:
        return "\n".join(self.log_path.read_text(encoding="utf-8").splitlines()[-lines:])

    def wait(self, timeout: float = 60) -> int:
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def daemon_flags(learners: int, total_steps: int, *, pipeline: int) -> list[str]:
    return [
        f"--learners={learners}",
        f"--quorum={learners}",
        f"--total-steps={total_steps}",
        f"--pipeline={pipeline}",
        "--sync-interval-steps=0",
        "--delta-correction=none",
        "--quorum-timeout-s=300",
        "--final-ack-timeout-s=300",
    ]


def print_profile(path: Path, title: str) -> None:
    out = io.StringIO()
    stats = pstats.Stats(str(path), stream=out)
    stats.sort_stats("tottime").print_stats(14)
    print(f"\n### cProfile of the daemon, {title} (by own time)\n")
    print("```")
    body = out.getvalue()
    print(body[body.find("ncalls") - 3 :].rstrip() if "ncalls" in body else body.rstrip())
    print("```")


# -- one yeto case ------------------------------------------------------------------------------
@dataclass(frozen=True)
class RoundResult:
    latency_s: float
    latencies: list[float]
    #: Median first PULL receipt → last PUSH written (pull, encode, upload).
    push_s: float
    #: Median ξ_sync of the event tape: the syncer's own merge + commit time per round.
    sync_s: float
    #: Wall time per round over the measured rounds (first PULL → last BCAST, / rounds):
    #: with several fragments in flight rounds overlap, and this is what a run's speed is.
    interval_s: float
    #: Median time between the ends (last learner's BCAST) of consecutive rounds.
    period_s: float
    bytes_in: int  # learners → syncer, per round
    bytes_out: int  # syncer → learners, per round
    peak_rss_mib: float


def run_yeto(
    learners: int,
    streams: int,
    dtype: WireDtype,
    numel: int,
    rounds: int,
    *,
    network: Network,
    profile: Path | None,
    fragments: int = 1,
    pipeline: int = 1,
) -> RoundResult:
    """``rounds`` measured rounds after WARMUP_PASSES rounds per fragment of warm-up, and
    ``pipeline`` rounds after them that are not measured.

    The syncer's array pools reach their steady state at its second commit of a fragment (the
    first commits allocate what later ones recycle), which a long run reaches at once. The run's
    last rounds overlap its final cut (a FINAL_FRAGMENT of every fragment, in f32, queued on the
    same links right after the last commit), which a long run meets once: no measured round
    shares its links or cores with the final cut.
    """
    warmup = WARMUP_PASSES * fragments
    last_measured = warmup + rounds
    total = last_measured + pipeline
    numels = tuple(numel // fragments + (i < numel % fragments) for i in range(fragments))
    with tempfile.TemporaryDirectory(prefix="bench-round-") as tmp:
        tape = Path(tmp) / "tape.jsonl"
        flags = [*daemon_flags(learners, total, pipeline=pipeline), f"--event-tape={tape}"]
        daemon = Daemon(flags, Path(tmp), profile=profile, network=network)
        pipes: list[Connection] = []
        processes = []
        try:
            for learner_id in range(learners):
                parent, child = SPAWN.Pipe()
                host, netns = network.learner_end(learner_id)
                plan = LearnerPlan(
                    daemon.port,
                    learner_id,
                    dtype.value,
                    numels,
                    streams,
                    network.rate,
                    host=host,
                    netns=netns,
                )
                process = SPAWN.Process(target=learner_process, args=(plan, child), daemon=True)
                process.start()
                pipes.append(parent)
                processes.append(process)
            for pipe in pipes:
                expect(pipe, "final", daemon)
            peak_kib = daemon.status_kib("VmHWM")
            for pipe in pipes:
                pipe.send("ack")
            reports: list[LearnerReport] = [expect(pipe, "done", daemon) for pipe in pipes]
            code = daemon.wait()
            if code != 0:
                raise RuntimeError(f"yeto-sync exited {code}:\n{daemon.log_tail()}")
            records = [json.loads(line) for line in tape.read_text().splitlines()]
            sync_ms = {r["step"]: r["sync_ms"] for r in records if "event" not in r}
        finally:
            daemon.kill()
            for process in processes:
                process.join(10)
                if process.is_alive():
                    process.kill()
    if profile is not None:
        print_profile(profile, f"M={learners} S={streams} {dtype.name.lower()}")
    steps = range(warmup + 1, last_measured + 1)
    latencies = [
        max(r.bcasts[t] for r in reports) - min(r.pulls[t] for r in reports) for t in steps
    ]
    push_phase = [
        max(r.pushed[t] for r in reports) - min(r.pulls[t] for r in reports) for t in steps
    ]
    bytes_in = sum(statistics.median(r.push_bytes[t] for t in steps) for r in reports)
    bytes_out = sum(statistics.median(r.bytes_in[t] for t in steps) for r in reports)
    return RoundResult(
        statistics.median(latencies),
        latencies,
        statistics.median(push_phase),
        statistics.median(sync_ms[t] for t in steps) / 1000,
        (max(r.bcasts[last_measured] for r in reports) - min(r.pulls[warmup + 1] for r in reports))
        / rounds,
        statistics.median(
            max(r.bcasts[t] for r in reports) - max(r.bcasts[t - 1] for r in reports) for t in steps
        ),
        int(bytes_in),
        int(bytes_out),
        peak_kib / 1024,
    )


def expect(pipe: Connection, kind: str, daemon: Daemon) -> Any:
    if not pipe.poll(TIMEOUT_S):
        raise RuntimeError(f"no {kind!r} from a learner in {TIMEOUT_S} s:\n{daemon.log_tail()}")
    got, value = pipe.recv()
    if got != kind:
        raise RuntimeError(f"learner sent {got}: {value}\n{daemon.log_tail()}")
    return value


# -- (a) plain blocking sockets -----------------------------------------------------------------
def plain_server_process(
    pipe: Connection,
    learners: int,
    push_bytes: int,
    bcast_bytes: int,
    rounds: int,
    network: Network,
) -> None:
    """Accept M clients; per round: go byte, receive every push, then send every bcast."""
    enter_namespace(network.server_namespace)
    with socket.create_server((network.server_host, 0)) as server:
        pipe.send(server.getsockname()[1])
        clients = [server.accept()[0] for _ in range(learners)]
    pushed = threading.Barrier(learners)
    start = threading.Barrier(learners)
    bcast = np.ones(bcast_bytes, np.uint8)

    def serve(sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        inbound = np.empty(push_bytes, np.uint8).data.cast("B")
        link = Link()
        for _ in range(rounds):
            start.wait()
            sock.sendall(b"g")
            link.recv_exactly(sock, inbound)
            pushed.wait()  # the merge point: every push is in
            sock.sendall(bcast.data)

    threads = [threading.Thread(target=serve, args=(sock,)) for sock in clients]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_S)
    for sock in clients:
        sock.close()


def plain_client_process(
    pipe: Connection,
    port: int,
    push_bytes: int,
    bcast_bytes: int,
    rounds: int,
    network: Network,
    learner: int,
) -> None:
    host, netns = network.learner_end(learner)
    enter_namespace(netns)
    link = Link(network.rate)
    push = np.full(push_bytes, 7, np.uint8)
    inbound = np.empty(bcast_bytes, np.uint8).data.cast("B")
    go = bytearray(1)
    times: list[tuple[float, float]] = []
    with socket.create_connection((host, port), timeout=TIMEOUT_S) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(rounds):
            link.recv_exactly(sock, memoryview(go))
            started = time.monotonic()
            link.send(sock, [push.data])
            link.recv_exactly(sock, inbound)
            times.append((started, time.monotonic()))
    pipe.send(times)


def run_plain(
    learners: int, push_bytes: int, bcast_bytes: int, rounds: int, network: Network
) -> list[float]:
    """(a): the round latencies of plain blocking sockets moving the same bytes."""
    total = rounds + 1
    server_pipe, server_child = SPAWN.Pipe()
    server = SPAWN.Process(
        target=plain_server_process,
        args=(server_child, learners, push_bytes, bcast_bytes, total, network),
        daemon=True,
    )
    server.start()
    port = server_pipe.recv()
    pipes, clients = [], []
    for learner in range(learners):
        parent, child = SPAWN.Pipe()
        client = SPAWN.Process(
            target=plain_client_process,
            args=(child, port, push_bytes, bcast_bytes, total, network, learner),
            daemon=True,
        )
        client.start()
        pipes.append(parent)
        clients.append(client)
    per_client: list[list[tuple[float, float]]] = []
    for pipe in pipes:
        if not pipe.poll(TIMEOUT_S):
            raise RuntimeError("plain-socket client did not finish")
        per_client.append(pipe.recv())
    for process in [server, *clients]:
        process.join(10)
    return [
        max(times[r][1] for times in per_client) - min(times[r][0] for times in per_client)
        for r in range(1, total)
    ]


def run_bracketed(
    learners: int,
    push_bytes: int,
    bcast_bytes: int,
    rounds: int,
    network: Network,
    case: Callable[[], RoundResult],
) -> tuple[RoundResult, float]:
    """``case`` between two runs of (a); (a) = the median of both runs' rounds.

    This host's speed drifts by ±20% within a minute: (a) measured just before and just after
    the case it is compared with shares the case's conditions, which (a) measured once for many
    cases does not.
    """
    before = run_plain(learners, push_bytes, bcast_bytes, rounds, network)
    result = case()
    after = run_plain(learners, push_bytes, bcast_bytes, rounds, network)
    return result, statistics.median(before + after)


# -- (b) gloo all_reduce ---------------------------------------------------------------------
def gloo_process(rank: int, world: int, port: int, numel: int, iters: int, out: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    tensor = torch.ones(numel, dtype=torch.float32)
    dist.all_reduce(tensor)  # warm-up: connections and buffers
    times = []
    for _ in range(iters):
        dist.barrier()
        started = time.perf_counter()
        dist.all_reduce(tensor)
        times.append(time.perf_counter() - started)
    out.put((rank, times))
    dist.destroy_process_group()


def run_gloo(world: int, numel: int, iters: int) -> float:
    out = SPAWN.Queue()
    port = free_port()
    processes = [
        SPAWN.Process(target=gloo_process, args=(rank, world, port, numel, iters, out))
        for rank in range(world)
    ]
    for process in processes:
        process.start()
    results = [out.get(timeout=TIMEOUT_S)[1] for _ in processes]
    for process in processes:
        process.join(30)
    return float(statistics.median(max(r[i] for r in results) for i in range(iters)))


# -- (c) torchft DiLoCo ------------------------------------------------------------------------
def torchft_installed() -> bool:
    try:
        importlib.import_module("torchft")
    except Exception:  # any import failure means "not usable here"
        return False
    return True


def torchft_process(replica: int, replicas: int, lighthouse: str, rounds: int, out: Any) -> None:
    """One replica: DiLoCo over a 4096×4096 Linear, an outer sync after every inner step."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    # torchft ships no type information: its modules are loaded by name (attributes are Any).
    local_sgd = importlib.import_module("torchft.local_sgd")
    manager_module = importlib.import_module("torchft.manager")
    process_group = importlib.import_module("torchft.process_group")

    _quiet_stderr()  # torchft logs every quorum and checkpoint fetch
    torch.set_num_threads(1)
    store_port = free_port()
    store = dist.TCPStore("127.0.0.1", store_port, 1, True)  # type: ignore[attr-defined]
    model = torch.nn.Linear(4096, 4096)
    manager = manager_module.Manager(
        pg=process_group.ProcessGroupGloo(),
        load_state_dict=model.load_state_dict,
        state_dict=model.state_dict,
        min_replica_size=replicas,
        use_async_quorum=False,
        replica_id=f"bench-{replica}",
        store_addr="127.0.0.1",
        store_port=store_port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse,
        timeout=timedelta(seconds=120),
        quorum_timeout=timedelta(seconds=120),
    )
    inner = torch.optim.SGD(model.parameters(), lr=0.01)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    inner_only: list[float] = []
    times: list[float] = []
    with local_sgd.DiLoCo(manager, [model], inner, outer, sync_every=1):
        for _ in range(rounds):
            for param in model.parameters():
                param.grad = torch.full_like(param, 1e-3 * (replica + 1))
            started = time.perf_counter()
            inner.step()  # the inner step, then (sync_every=1) the outer sync in its hook
            times.append(time.perf_counter() - started)
    plain = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(3):
        for param in model.parameters():
            param.grad = torch.full_like(param, 1e-3)
        started = time.perf_counter()
        plain.step()
        inner_only.append(time.perf_counter() - started)
    out.put((replica, times, statistics.median(inner_only)))
    manager.shutdown(wait=False)
    del store
    _torchft_log().unlink(missing_ok=True)  # kept only when the replica failed


def _torchft_log() -> Path:
    return Path(tempfile.gettempdir()) / f"bench-round-torchft-{os.getpid()}.log"


def _quiet_stderr() -> None:
    """Send this process's stderr (fd 2, Rust logs included) to a file in the temp dir."""
    fd = os.open(_torchft_log(), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 2)
    os.close(fd)


def lighthouse_process(replicas: int, address: Any, stop: Any) -> None:
    """torchft's lighthouse, in its own process so that its log stays out of the tables."""
    coordination = importlib.import_module("torchft.coordination")
    _quiet_stderr()
    lighthouse = coordination.LighthouseServer(bind="[::]:0", min_replicas=replicas)
    address.put(lighthouse.address())
    stop.wait(TIMEOUT_S)
    lighthouse.shutdown()
    _torchft_log().unlink(missing_ok=True)


def run_torchft(replicas: int, rounds: int) -> tuple[float, float]:
    """Median outer-sync time (max over replicas) and one inner SGD step, both in seconds."""
    warmup = 2  # the first sync also fetches the initial state (init_sync)
    address, stop, out = SPAWN.Queue(), SPAWN.Event(), SPAWN.Queue()
    lighthouse = SPAWN.Process(target=lighthouse_process, args=(replicas, address, stop))
    lighthouse.start()
    processes = []
    try:
        lighthouse_address = address.get(timeout=60)
        processes = [
            SPAWN.Process(
                target=torchft_process,
                args=(r, replicas, lighthouse_address, warmup + rounds, out),
            )
            for r in range(replicas)
        ]
        for process in processes:
            process.start()
        results = [out.get(timeout=TIMEOUT_S) for _ in processes]
        for process in processes:
            process.join(60)
    finally:
        stop.set()
        for process in [*processes, lighthouse]:
            process.join(10)
            if process.is_alive():
                process.kill()
    per_round = [max(r[1][i] for r in results) for i in range(warmup, warmup + rounds)]
    return statistics.median(per_round), statistics.median(r[2] for r in results)


# -- merge time ---------------------------------------------------------------------------------
def measure_merge(learners: int, numel: int, repeats: int = 5) -> float:
    """``merge_round`` as the syncer runs it: recycled arrays, each commit's output the next input.

    Two warm-up commits first, so the pool holds its arrays (the steady state of a run); the
    median of ``repeats`` after that.
    """
    from yeto_proto.identity import DeltaCorrection
    from yeto_sync.coordinator.arrays import ArrayPool
    from yeto_sync.merge import MergeConfig, Response, merge_round

    rng = np.random.default_rng(5)
    geometry = WireFragment(MergeMode.AVG, (numel,))
    responses = [
        Response(i, 1, 1, 1000, rng.normal(0.0, 1e-3, numel).astype(np.float32))
        for i in range(learners)
    ]
    pool = ArrayPool(WireLayout((geometry,)), learners)
    params = rng.normal(0.0, 0.02, numel).astype(np.float32)
    momentum = np.zeros(numel, np.float32)
    config = MergeConfig(delta_correction=DeltaCorrection.NONE)
    times = []
    for repeat in range(2 + repeats):
        started = time.perf_counter()
        merged = merge_round(geometry, responses, params, momentum, {}, config, allocate=pool.take)
        elapsed = time.perf_counter() - started
        params, momentum = merged.params, merged.momentum
        del merged
        if repeat >= 2:
            times.append(elapsed)
    return statistics.median(times)


# -- the scale run -----------------------------------------------------------------------------
@dataclass(frozen=True)
class ScaleResult:
    learners: int
    wall_per_round_s: float
    cpu_per_round_s: float
    peak_rss_mib: float


def run_scale(learners: int, rounds: int, hosts: int = 4) -> ScaleResult:
    numels = (SCALE_NUMEL,) * SCALE_FRAGMENTS
    first, last = SCALE_WINDOW
    with tempfile.TemporaryDirectory(prefix="bench-round-scale-") as tmp:
        daemon = Daemon(daemon_flags(learners, rounds, pipeline=2), Path(tmp), profile=None)
        progress, results = SPAWN.Queue(), SPAWN.Queue()
        plans = [
            LearnerPlan(
                daemon.port, i, WireDtype.F32.value, numels, 0, watch_versions=(first, last)
            )
            for i in range(learners)
        ]
        processes = [
            SPAWN.Process(
                target=learner_host_process,
                args=(plans[h::hosts], progress, results),
                daemon=True,
            )
            for h in range(min(hosts, learners))
        ]
        try:
            for process in processes:
                process.start()
            marks: dict[int, tuple[float, float]] = {}
            seen: dict[int, int] = {first: 0, last: 0}
            while len(marks) < 2:
                _, version, _ = progress.get(timeout=TIMEOUT_S)
                seen[version] += 1
                if seen[version] == learners:  # every learner holds this version now
                    marks[version] = (time.monotonic(), daemon.cpu_seconds())
                    if version == last:
                        peak_kib = daemon.status_kib("VmHWM")
            errors = [results.get(timeout=TIMEOUT_S) for _ in processes]
            if any(errors):
                raise RuntimeError(f"{errors}\n{daemon.log_tail()}")
            code = daemon.wait()
            if code != 0:
                raise RuntimeError(f"yeto-sync exited {code}:\n{daemon.log_tail()}")
        finally:
            daemon.kill()
            for process in processes:
                process.join(10)
    window = last - first
    return ScaleResult(
        learners,
        (marks[last][0] - marks[first][0]) / window,
        (marks[last][1] - marks[first][1]) / window,
        peak_kib / 1024,
    )


# -- helpers and tables -------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wire_sizes(dtype: WireDtype, numel: int) -> tuple[int, int]:
    """Tensor bytes of one PUSH and one BCAST in ``dtype``."""
    return tensor_nbytes(dtype, numel, push=True), tensor_nbytes(dtype, numel, push=False)


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def ms(seconds: float) -> str:
    return f"{seconds * 1000:,.1f}"


@dataclass
class Tables:
    lines: list[str] = field(default_factory=list)

    def out(self, text: str = "") -> None:
        print(text, flush=True)
        self.lines.append(text)


def parse_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def rounds_part(args: argparse.Namespace, tables: Tables, network: Network) -> dict[str, float]:
    """The round table, raw loopback or emulated; returns the figures targets need."""
    throttled = network != LOOPBACK
    learners_list = [int(m) for m in parse_list(args.learners)]
    streams_list = [int(s) for s in parse_list(args.streams)]
    dtypes = [DTYPES[d] for d in parse_list(args.dtypes)]
    if throttled:
        streams_list = [s for s in streams_list if s == 2] or streams_list[:1]
    numel = args.numel
    frag_bytes = numel * 4
    figures: dict[str, float] = {}
    tables.out(f"\n### Round latency, {network.describe()}\n")
    tables.out(
        f"One fragment of {numel:,} f32 values ({frag_bytes / MIB:.0f} MiB), pipeline 1, quorum "
        f"M, delta correction none; median of {args.rounds} rounds after {WARMUP_PASSES} warm-up "
        "rounds, and before one more that is not measured (the run's last round overlaps its "
        "final cut, the FINAL_FRAGMENTs on the same links). Round t = "
        "first learner holding both PULL t and BCAST t−1 → last learner's receipt of BCAST t; "
        "back to back = the median time from one round's end to the next one's (rounds follow "
        "one another; a round's latency also counts how much earlier the first learner had "
        "the last BCAST than the last learner, this does not); "
        "push = → last learner's PUSH written to its sockets; merge = the syncer's own merge "
        "and commit, ξ_sync (`sync_ms`) of its event tape. Bytes = per round, "
        "counted on the learners' sockets (headers and CHUNK envelopes included). (a) = plain "
        "blocking sockets moving the same tensor bytes (same link emulation), run just before "
        "and just after each case: the median of both runs' rounds."
    )
    tables.out()
    tables.out(
        "| M | S | dtype | round ms | back to back ms | of it: push ms | merge ms | (a) plain ms "
        "| round / (a) | in MB | out MB | peak RSS MiB | RSS limit MiB | RSS |"
    )
    tables.out("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for learners in learners_list:
        for streams in streams_list:
            for dtype in dtypes:
                profile = None
                if args.profile is not None:
                    args.profile.mkdir(parents=True, exist_ok=True)
                    tag = "throttled" if throttled else "loopback"
                    name = f"{tag}-m{learners}-s{streams}-{dtype.name.lower()}.prof"
                    profile = args.profile / name
                push_bytes, bcast_bytes = wire_sizes(dtype, numel)
                result, plain = run_bracketed(
                    learners,
                    push_bytes,
                    bcast_bytes,
                    args.rounds,
                    network,
                    functools.partial(
                        run_yeto,
                        learners,
                        streams,
                        dtype,
                        numel,
                        args.rounds,
                        network=network,
                        profile=profile,
                    ),
                )
                limit = RSS_BASE_MIB + (learners + 4) * frag_bytes / MIB
                ratio = result.latency_s / plain
                tables.out(
                    f"| {learners} | {streams} | {dtype.name.lower()} | {ms(result.latency_s)} "
                    f"| {ms(result.period_s)} | {ms(result.push_s)} | {ms(result.sync_s)} "
                    f"| {ms(plain)} "
                    f"| {ratio:.2f}x "
                    f"| {result.bytes_in / 1e6:,.1f} | {result.bytes_out / 1e6:,.1f} "
                    f"| {result.peak_rss_mib:,.0f} | {limit:,.0f} "
                    f"| {verdict(result.peak_rss_mib <= limit)} |"
                )
                key = f"{learners}/{streams}/{dtype.name.lower()}"
                figures[key] = result.latency_s
                figures[f"plain {key}"] = plain
    return figures


def pipelined_part(args: argparse.Namespace, tables: Tables, network: Network) -> dict[str, float]:
    """f32 against q4 on the emulated link with the same tensor split into fragments in flight."""
    fragments, pipeline, learners, streams = PIPELINED
    rounds = 3 * fragments
    tables.out(f"\n### Fragments in flight, {network.describe()}\n")
    tables.out(
        f"The same {args.numel:,} f32 values as {fragments} fragments, `--pipeline {pipeline}`, "
        f"M = {learners}, S = {streams}: one fragment's merge can overlap another's transfer. "
        f"ms per round = wall time from the first measured PULL to the last BCAST, over "
        f"{rounds} rounds after {WARMUP_PASSES * fragments} of warm-up and before {pipeline} "
        "more that overlap the final cut (rounds overlap, so this is the run's speed rather "
        "than one round's latency); a round moves a quarter of the tensor."
    )
    tables.out()
    tables.out("| dtype | ms per round | median round latency ms | merge ms | × f32 |")
    tables.out("|---|---:|---:|---:|---:|")
    figures: dict[str, float] = {}
    results = {
        dtype: run_yeto(
            learners,
            streams,
            dtype,
            args.numel,
            rounds,
            network=network,
            profile=None,
            fragments=fragments,
            pipeline=pipeline,
        )
        for dtype in (WireDtype.F32, WireDtype.Q4)
    }
    for dtype, result in results.items():
        speedup = results[WireDtype.F32].interval_s / result.interval_s
        tables.out(
            f"| {dtype.name.lower()} | {ms(result.interval_s)} | {ms(result.latency_s)} "
            f"| {ms(result.sync_s)} | {speedup:.2f}x |"
        )
        figures[f"pipelined {dtype.name.lower()}"] = result.interval_s
    return figures


def baselines_part(args: argparse.Namespace, tables: Tables) -> dict[str, float]:
    learners_list = [int(m) for m in parse_list(args.learners)]
    figures: dict[str, float] = {}
    has_torchft = torchft_installed()
    tables.out("\n### Baselines of the same size, raw loopback\n")
    tables.out(
        f"(b) gloo `all_reduce` of {args.numel:,} f32 (spawned processes, 127.0.0.1): median "
        "of 5, slowest rank. (c) torchft 0.2 DiLoCo, a 4096×4096 `nn.Linear` (16.8M + 4096 "
        "parameters), `sync_every=1`: one `inner.step()` including the outer sync in its hook "
        f"(median of {args.rounds} after 2 warm-ups, slowest replica). Merge = `merge_round` "
        "(avg, no correction) of M responses in this process as the syncer runs it (recycled "
        "arrays, each commit's result the next one's input): median of 5 after 2 warm-ups."
    )
    tables.out()
    tables.out(
        "| M | (b) gloo all_reduce ms | (c) torchft DiLoCo sync ms | inner step alone ms "
        "| merge ms |"
    )
    tables.out("|---:|---:|---:|---:|---:|")
    for learners in learners_list:
        gloo = run_gloo(learners, args.numel, 5)
        merge = measure_merge(learners, args.numel)
        figures[f"gloo {learners}"] = gloo
        figures[f"merge {learners}"] = merge
        if has_torchft:
            sync, inner = run_torchft(learners, args.rounds)
            figures[f"torchft {learners}"] = sync
            torchft_cells = f"{ms(sync)} | {ms(inner)}"
        else:
            torchft_cells = "torchft not installed | "
        tables.out(f"| {learners} | {ms(gloo)} | {torchft_cells} | {ms(merge)} |")
    if not has_torchft:
        print("torchft not installed", flush=True)
    return figures


def repeats_part(args: argparse.Namespace, tables: Tables, emulated: Network) -> None:
    """The two targets that sit near their limits, each measured ``--repeats`` times over.

    One run of a target says little on a host whose speed drifts by ±20% within a minute; each
    repeat here measures the target's case and its own baselines afresh, back to back.
    """
    runs = args.repeats
    if runs < 1:
        return
    numel = args.numel
    tables.out("\n### Targets over repeated runs\n")
    tables.out(
        f"Each of {runs} repeats measures afresh, in this order: f32 M=2 S=2 on raw loopback "
        "between two runs of (a), and the merge in this process (limit = 1.5 × (a) + merge); "
        f"then f32 and q4, M=2 S=2, {emulated.describe()} (q4 ≥ 3× f32). Medians of "
        f"{args.rounds} rounds each, as in the tables above."
    )
    tables.out()
    tables.out("| repeat | f32 round ms | limit ms | f32 result | q4 × f32 | q4 result |")
    tables.out("|---:|---:|---:|---|---:|---|")
    f32_pass = q4_pass = 0
    ratios: list[float] = []
    speedups: list[float] = []
    push_bytes, bcast_bytes = wire_sizes(WireDtype.F32, numel)
    for repeat in range(1, runs + 1):
        result, plain = run_bracketed(
            2,
            push_bytes,
            bcast_bytes,
            args.rounds,
            LOOPBACK,
            functools.partial(
                run_yeto, 2, 2, WireDtype.F32, numel, args.rounds, network=LOOPBACK, profile=None
            ),
        )
        limit = 1.5 * plain + measure_merge(2, numel)
        throttled = [
            run_yeto(2, 2, dtype, numel, args.rounds, network=emulated, profile=None).latency_s
            for dtype in (WireDtype.F32, WireDtype.Q4)
        ]
        speedup = throttled[0] / throttled[1]
        f32_ok, q4_ok = result.latency_s <= limit, speedup >= 3.0
        f32_pass += f32_ok
        q4_pass += q4_ok
        ratios.append(result.latency_s / limit)
        speedups.append(speedup)
        tables.out(
            f"| {repeat} | {ms(result.latency_s)} | {ms(limit)} | {verdict(f32_ok)} "
            f"| {speedup:.2f}x | {verdict(q4_ok)} |"
        )
    tables.out()
    tables.out(
        f"f32 M=2 S=2 round ≤ 1.5 × (a) + merge: {f32_pass} of {runs} runs pass; round / limit "
        f"median {statistics.median(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f}). "
        f"q4 ≥ 3× f32 on the emulated link: {q4_pass} of {runs} runs pass; median "
        f"{statistics.median(speedups):.2f}× ({min(speedups):.2f}–{max(speedups):.2f}×)."
    )


def scale_part(args: argparse.Namespace, tables: Tables) -> None:
    counts = [int(m) for m in parse_list(args.scale_learners)]
    first, last = SCALE_WINDOW
    if args.scale_rounds < last:
        raise SystemExit(f"--scale-rounds must be at least {last} (the measured window ends there)")
    tables.out("\n### Scale: F = 8 fragments of 1M f32 values\n")
    tables.out(
        f"{args.scale_rounds} rounds, pipeline 2, quorum M, S = 0, f32; learners are threads in "
        f"{4} host processes; syncer time over rounds {first + 1}..{last} (every learner holds "
        "the version): wall clock and the daemon's CPU (utime + stime). Target: at most linear "
        "in M, i.e. CPU per learner per round at the largest M ≤ 1.2× that at the smallest."
    )
    tables.out()
    tables.out(
        "| M | wall ms / round | syncer CPU ms / round | CPU ms / round / learner "
        "| × smallest M | peak RSS MiB |"
    )
    tables.out("|---:|---:|---:|---:|---:|---:|")
    results = [run_scale(m, args.scale_rounds) for m in counts]
    base = results[0].cpu_per_round_s / results[0].learners
    for result in results:
        per_learner = result.cpu_per_round_s / result.learners
        tables.out(
            f"| {result.learners} | {ms(result.wall_per_round_s)} | "
            f"{ms(result.cpu_per_round_s)} | {per_learner * 1000:.2f} | "
            f"{per_learner / base:.2f}x | {result.peak_rss_mib:,.0f} |"
        )
    last_ratio = results[-1].cpu_per_round_s / results[-1].learners / base
    tables.out(
        f"\nScale target (CPU per learner at M = {counts[-1]} ≤ 1.2× M = {counts[0]}): "
        f"{last_ratio:.2f}x, {verdict(last_ratio <= 1.2)}"
    )


def targets(figures: dict[str, float], tables: Tables) -> None:
    tables.out("\n### Targets\n")
    tables.out("| target | measured | limit | result |")
    tables.out("|---|---:|---:|---|")
    key = "2/2/f32"
    if key in figures and f"plain {key}" in figures and "merge 2" in figures:
        limit = 1.5 * figures[f"plain {key}"] + figures["merge 2"]
        tables.out(
            f"| f32 M=2 S=2 round ≤ 1.5 × (a) + merge | {ms(figures[key])} ms | {ms(limit)} ms "
            f"| {verdict(figures[key] <= limit)} |"
        )
    if key in figures and "torchft 2" in figures:
        limit = 0.7 * figures["torchft 2"]
        tables.out(
            f"| f32 M=2 S=2 round ≤ 0.7 × (c) torchft | {ms(figures[key])} ms | {ms(limit)} ms "
            f"| {verdict(figures[key] <= limit)} |"
        )
    for tag in ("throttled ", ""):
        f32, q4 = figures.get(f"{tag}2/2/f32"), figures.get(f"{tag}2/2/q4")
        if f32 is not None and q4 is not None:
            where = "emulated 1 Gbit/s" if tag else "raw loopback (info)"
            tables.out(
                f"| q4 ≥ 3× faster than f32, M=2 S=2, {where} | {f32 / q4:.2f}x | 3.00x "
                f"| {verdict(f32 / q4 >= 3.0) if tag else 'info'} |"
            )
    f32, q4 = figures.get("pipelined f32"), figures.get("pipelined q4")
    if f32 is not None and q4 is not None:
        tables.out(
            f"| q4 ≥ 3× faster than f32, 4 fragments in flight, emulated 1 Gbit/s (info) "
            f"| {f32 / q4:.2f}x | 3.00x | info |"
        )


def emulated_network(
    args: argparse.Namespace, parts: set[str], stack: contextlib.ExitStack[bool | None]
) -> Network:
    """The link the emulated parts run on (``--link``); shaped links live until ``stack`` ends."""
    rate = args.rate_gbit * 1e9 / 8
    if args.link == "bucket" or not parts & {"throttled", "pipelined", "repeats"}:
        return Network(rate=rate)
    why_not = shaped_links_available()
    if why_not is not None:
        if args.link == "kernel":
            raise SystemExit(f"bench_round: --link kernel: {why_not}")
        print(f"bench_round: kernel-shaped links unavailable ({why_not}); token bucket", flush=True)
        return Network(rate=rate)
    learners = max([2, *(int(m) for m in parse_list(args.learners))])
    return Network(shaped=stack.enter_context(shaped_links(learners, rate)))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", default="rounds,baselines,throttled,pipelined,scale,repeats")
    parser.add_argument("--learners", default="2,4", help="M values (rounds, baselines)")
    parser.add_argument("--streams", default="0,2,4", help="S values (rounds)")
    parser.add_argument("--dtypes", default="f32,bf16,q4")
    parser.add_argument("--numel", type=int, default=4096 * 4096)
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds per case")
    parser.add_argument("--rate-gbit", type=float, default=1.0)
    parser.add_argument(
        "--link",
        choices=("auto", "kernel", "bucket"),
        default="auto",
        help="the emulated link: kernel-shaped veth links between network namespaces (needs "
        "root and iproute2), a token bucket in the learners' socket layer, or kernel when "
        "possible (auto)",
    )
    parser.add_argument(
        "--repeats", type=int, default=8, help="runs of the two near-limit targets (repeats)"
    )
    parser.add_argument("--scale-learners", default="4,8,16,32")
    parser.add_argument("--scale-rounds", type=int, default=64)
    parser.add_argument("--profile", type=Path, help="run daemons under cProfile, files here")
    args = parser.parse_args(argv)
    parts = set(parse_list(args.part))
    tables = Tables()
    started = time.monotonic()
    load = os.getloadavg()
    tables.out(
        f"{datetime.date.today()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"numpy {np.__version__}; load average at the start {load[0]:.2f}"
    )
    figures: dict[str, float] = {}
    with contextlib.ExitStack() as stack:
        emulated = emulated_network(args, parts, stack)
        if "rounds" in parts:
            figures |= rounds_part(args, tables, LOOPBACK)
        if "baselines" in parts:
            figures |= baselines_part(args, tables)
        if "throttled" in parts:
            throttled = rounds_part(args, tables, emulated)
            figures |= {f"throttled {k}": v for k, v in throttled.items()}
        if "pipelined" in parts:
            figures |= pipelined_part(args, tables, emulated)
        if "scale" in parts:
            scale_part(args, tables)
        targets(figures, tables)
        if "repeats" in parts:
            repeats_part(args, tables, emulated)
    load = os.getloadavg()
    tables.out(
        f"\nTotal {time.monotonic() - started:.0f} s; load average at the end {load[0]:.2f}."
    )
    return 0


if __name__ == "__main__":
    # SIGTERM unwinds like Ctrl+C, so every case's cleanup (syncer and learners killed) runs.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print(
            "bench_round: interrupted; the tables above are all it measured, nothing was kept",
            file=sys.stderr,
        )
        sys.exit(130)
