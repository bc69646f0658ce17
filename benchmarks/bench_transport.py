"""The syncer's TCP transport against plain blocking sockets, on loopback.

    python benchmarks/bench_transport.py [--mib 64] [--messages 8] [--repeats 5]

Each case moves ``messages`` tensors of ``mib`` MiB (f32) between this process and a
subprocess, and the receiving side times first byte (or the "go" signal) → last message. The
yeto receive paths are timed in their steady state instead: from the delivery of the
:data:`WARMUP_MESSAGES`-th message to the last. Their first messages land in buffers the
process has never touched, and on this VM the first touch of fresh memory is slow (the kernel
zeroes each 2 MiB page inside ``recv_into``, at times well under 1 GB/s). A long-lived syncer
or learner recycles its buffers and pays that once; the cold start is printed as an info row:

- receive path (learner → syncer): the baseline receiver is a blocking socket reading with
  ``recv_into`` into a 4 MiB buffer while the sender ``sendall``\\ s 4 MiB pieces; yeto-sync runs
  its real ``TcpTransport`` + ``ConnectionGroups`` + driver and counts decoded PUSH frames that a
  scripted learner sends plain (S = 0) or striped over 3 data sockets (S = 3);
- learner receive path (syncer → learner): the learner client's real
  ``yeto_learn.transport.group.ConnectionGroup`` counts decoded BCAST frames that a subprocess
  sends plain (S = 0) or striped over 3 data sockets (S = 3, a sending thread per socket), from
  the "go" byte to the last BCAST delivered; same baseline as the syncer's receive path;
- send path (syncer → learner): the baseline sender ``sendall``\\ s 4 MiB pieces; yeto-sync queues
  BCAST frames through the transport (``sendmsg`` of the encoded buffers, CHUNKs for S = 3);
  the receiving subprocess only counts bytes in both cases.

Target (BENCHMARKS.md: ``wait_readable`` + ``recv_into`` on the raw socket reaches 0.9–0.97× of
blocking sockets): the receive path, which also decodes every frame, ≥ 0.6× the baseline.
Reported: median and best GB/s over the repeats, and median ratio to the baseline of the same
direction measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import anyio
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from scripted_learner import LearnerGroup, SessionSpec  # noqa: E402

from yeto_learn.transport.group import (  # noqa: E402
    RECV_BUFFER_SIZE,
    ConnectionGroup,
    Counters,
)
from yeto_proto import (  # noqa: E402
    BcastFragment,
    Chunk,
    ChunkSlicer,
    FrameDecoder,
    Limits,
    MergeMode,
    PullReq,
    PushFragment,
    Reassembler,
    Role,
    WireDtype,
    WireFragment,
    WireLayout,
    encode,
)
from yeto_proto.constants import CHUNK_ENVELOPE_SIZE, CHUNK_SLICE_SIZE, HEADER_SIZE  # noqa: E402
from yeto_sync.driver import Driver, KeyValueLog  # noqa: E402
from yeto_sync.events import (  # noqa: E402
    Action,
    AdmitGroup,
    Event,
    Exit,
    GroupKey,
    GroupReady,
    HelloReceived,
    MessageReceived,
    Send,
)
from yeto_sync.receive_watermark import READ_WATERMARK_CAP  # noqa: E402
from yeto_sync.transport import MonotonicClock  # noqa: E402
from yeto_sync.transport.group import ConnectionGroups  # noqa: E402
from yeto_sync.transport.tcp import TcpTransport  # noqa: E402

PIECE = 4 << 20
TARGET_RECEIVE_RATIO = 0.6
#: Messages delivered before a yeto receive path's timing starts (its buffer pools fill up).
WARMUP_MESSAGES = 2
#: Rows that read with the socket's receive low-water mark left at one byte.
NO_WATERMARK = "read watermark off"


@dataclass(frozen=True)
class Timed:
    """``nbytes`` of tensor data moved in ``seconds``; ``cold_seconds``: the warm-up messages;
    ``cpu_seconds``: the receiving process's CPU time over the timed span (receive rows)."""

    seconds: float
    nbytes: int
    cold_seconds: float | None = None
    cpu_seconds: float | None = None


class Deliveries:
    """Delivery times of one run's messages, from the start signal: steady and cold figures."""

    def __init__(self, messages: int, message_bytes: int) -> None:
        self.messages = messages
        self.message_bytes = message_bytes
        self.started = 0.0
        self.times: list[float] = []
        self.cpu_times: list[float] = []

    def start(self) -> None:
        self.started = time.perf_counter()

    def delivered(self) -> bool:
        """Record one delivery; True once it was the last message."""
        self.times.append(time.perf_counter())
        self.cpu_times.append(time.process_time())
        return len(self.times) == self.messages

    def timed(self) -> Timed:
        warm = self.times[WARMUP_MESSAGES - 1]
        return Timed(
            self.times[-1] - warm,
            (self.messages - WARMUP_MESSAGES) * self.message_bytes,
            warm - self.started,
            self.cpu_times[-1] - self.cpu_times[WARMUP_MESSAGES - 1],
        )


def session(numel: int) -> SessionSpec:
    layout = WireLayout((WireFragment(MergeMode.AVG, (numel,)),))
    return SessionSpec(WireDtype.F32, layout, bytes(32), bytes(range(32)))


# -- subprocess roles ------------------------------------------------------------------------------
def role_send_raw(port: int, total: int) -> None:
    """Baseline sender: wait for the go byte, then sendall ``total`` bytes in 4 MiB pieces."""
    piece = np.ones(PIECE, np.uint8).data
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.recv(1)
        left = total
        while left:
            size = min(left, PIECE)
            sock.sendall(piece[:size])
            left -= size
        sock.recv(1)  # hold the socket until the receiver is done


def role_learner_push(port: int, numel: int, messages: int, streams: int) -> None:
    """A scripted learner: connect, wait for the PULL, send ``messages`` PUSH frames."""
    group = LearnerGroup(
        ("127.0.0.1", port), session(numel), learner_id=0, generation=1, num_streams=streams
    )
    group.connect()
    group.receive(60.0)
    delta = np.full(numel, 0.25, np.float32)
    push = PushFragment(0, 0, 1, 1, 0, 1, 1, 1, delta.view(np.uint8).data)
    for _ in range(messages):
        group.send(push)
    try:
        while True:
            group.receive(60.0)
    except Exception:  # the syncer closes when it is done
        pass
    group.close()


def role_count_bytes(port: int, total: int, numel: int, streams: int) -> None:
    """Receiver of the send path: read (and drop) ``total`` bytes; print the elapsed seconds."""
    buffer = bytearray(PIECE)
    if streams < 0:  # baseline: a plain socket
        sockets = [socket.create_connection(("127.0.0.1", port))]
    else:  # a yeto group: HELLO and DATA_HELLOs, then raw reads of whatever arrives
        group = LearnerGroup(
            ("127.0.0.1", port), session(numel), learner_id=0, generation=1, num_streams=streams
        )
        group.connect()
        sockets = group.sockets
    selector = selectors.DefaultSelector()
    for sock in sockets:
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ)
    received, started = 0, None
    while received < total:
        for key, _ in selector.select(30):
            try:
                size = key.fileobj.recv_into(buffer)  # type: ignore[union-attr]
            except BlockingIOError:
                continue
            if started is None:
                started = time.perf_counter()
            received += size
    elapsed = time.perf_counter() - (started or time.perf_counter())
    print(json.dumps({"seconds": elapsed, "bytes": received}), flush=True)
    for sock in sockets:
        sock.close()


def role_syncer_bcast(port: int, numel: int, messages: int, streams: int) -> None:
    """A stand-in syncer: dial the learner's 1 + S sockets, then BCAST on the "go" byte."""
    frame = encode(BcastFragment(0, 1, np.full(numel, 0.5, np.float32).view(np.uint8).data))
    per_socket: list[list[memoryview]] = [[] for _ in range(1 + streams)]
    slicer = ChunkSlicer(max(streams, 1))
    for _ in range(messages):  # each message its own CHUNK msg_id
        if streams:
            for piece in slicer.slice(frame):
                per_socket[1 + piece.stream_idx] += [memoryview(b) for b in piece.buffers]
        else:
            per_socket[0] += [memoryview(b) for b in frame]

    def send_all(sock: socket.socket, buffers: list[memoryview]) -> None:
        for buffer in buffers:
            sock.sendall(buffer)

    sockets = []  # dialed once every frame is ready, so the timed part is sending only
    for index in range(1 + streams):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as yeto-sync does
        sock.sendall(bytes([index]))  # which stream this is: accept order is not guaranteed
        sockets.append(sock)
    sockets[0].recv(1)
    threads = [
        threading.Thread(target=send_all, args=(sock, buffers))
        for sock, buffers in zip(sockets, per_socket, strict=True)
        if buffers
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    sockets[0].recv(1)  # hold the sockets until the learner closes them
    for sock in sockets:
        sock.close()


def spawn(*args: object) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, __file__, "--role", *map(str, args)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


# -- the measured sides ----------------------------------------------------------------------------
def baseline_receive(total: int) -> Timed:
    with socket.create_server(("127.0.0.1", 0)) as server:
        child = spawn("send-raw", server.getsockname()[1], total)
        sock, _ = server.accept()
        with sock:
            buffer = bytearray(PIECE)
            started, cpu_started = time.perf_counter(), time.process_time()
            sock.sendall(b"g")
            received = 0
            while received < total:
                received += sock.recv_into(buffer)
            elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
            sock.sendall(b"d")
    child.wait(60)
    return Timed(elapsed, total, cpu_seconds=cpu)


class Receiver:
    """Bench coordinator for the receive path: PULL once ready, count PUSHes, then exit."""

    def __init__(self, messages: int, message_bytes: int) -> None:
        self.deliveries = Deliveries(messages, message_bytes)

    def handle(self, event: Event, now: float) -> list[Action]:
        match event:
            case HelloReceived(conn=conn, hello=hello):
                key = GroupKey(hello.learner_id, hello.generation)
                limits = Limits.of(hello.dtype, hello.layout)
                return [AdmitGroup(conn, key, hello.num_streams, limits)]
            case GroupReady(group=group):
                self.deliveries.start()
                return [Send(group, PullReq(0, 1, 1))]
            case MessageReceived(message=PushFragment()):
                if self.deliveries.delivered():
                    return [Exit(0, "done")]
        return []


class Sender:
    """Bench coordinator for the send path: BCAST ``messages`` times once ready, then exit."""

    def __init__(self, message: BcastFragment, messages: int) -> None:
        self.message = message
        self.messages = messages

    def handle(self, event: Event, now: float) -> list[Action]:
        match event:
            case HelloReceived(conn=conn, hello=hello):
                key = GroupKey(hello.learner_id, hello.generation)
                limits = Limits.of(hello.dtype, hello.layout)
                return [AdmitGroup(conn, key, hello.num_streams, limits)]
            case GroupReady(group=group):
                return [*(Send(group, self.message) for _ in range(self.messages)), Exit(0, "")]
        return []


async def run_transport(
    coordinator: Receiver | Sender, child_args: list[object], watermark: int = READ_WATERMARK_CAP
) -> str:
    """Serve one session to a child process; return what the child printed."""
    clock = MonotonicClock()
    groups = ConnectionGroups(1)
    async with TcpTransport.serve(
        groups, clock, "127.0.0.1", 0, read_watermark=watermark
    ) as transport:
        child = spawn(*child_args[:1], transport.address[1], *child_args[1:])
        driver = Driver(
            coordinator, transport, clock, log=KeyValueLog(min_level="error"), shutdown_grace=120.0
        )
        await driver.run(transport)
    output: str = await anyio.to_thread.run_sync(lambda: child.communicate(timeout=120)[0])
    return output


def transport_receive(
    numel: int, messages: int, streams: int, watermark: int = READ_WATERMARK_CAP
) -> Timed:
    coordinator = Receiver(messages, numel * 4)
    anyio.run(run_transport, coordinator, ["learner-push", numel, messages, streams], watermark)
    return coordinator.deliveries.timed()


def decoder_alone(numel: int, messages: int, streams: int) -> Timed:
    """The receive path without sockets: the same frames fed from memory in ≤ 4 MiB views to
    the syncer's FrameDecoder (and Reassembler for S=3): the ceiling yeto_proto sets."""
    spec = session(numel)
    delta = np.full(numel, 0.25, np.float32)
    push = PushFragment(0, 0, 1, 1, 0, 1, 1, 1, delta.view(np.uint8).data)
    decoder = FrameDecoder(Role.SYNCER, limits=spec.limits, enforce_first_frame=False)
    reassembler = Reassembler(Role.SYNCER, spec.limits)
    slicer = ChunkSlicer(max(streams, 1))
    deliveries = Deliveries(messages, numel * 4)
    deliveries.start()
    for _ in range(messages):
        frame = encode(push)
        frames = [p.buffers for p in slicer.slice(frame)] if streams else [frame]
        for buffers in frames:
            for buffer in buffers:
                view = memoryview(buffer)
                for offset in range(0, len(view), PIECE):
                    decoder.feed(view[offset : offset + PIECE])
            for item in decoder.frames():
                if isinstance(item, Chunk):
                    reassembler.add(item)
        deliveries.delivered()
    return deliveries.timed()


def learner_receive(
    numel: int, messages: int, streams: int, watermark: int = READ_WATERMARK_CAP
) -> Timed:
    """The learner client's ConnectionGroup receiving ``messages`` BCASTs from a subprocess."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        child = spawn("syncer-bcast", server.getsockname()[1], numel, messages, streams)
        sockets: list[socket.socket | None] = [None] * (1 + streams)
        for _ in sockets:
            sock, _ = server.accept()
            sockets[sock.recv(1)[0]] = sock
    ordered = [sock for sock in sockets if sock is not None]
    layout = WireLayout((WireFragment(MergeMode.AVG, (numel,)),))
    deliveries = Deliveries(messages, numel * 4)

    async def serve() -> None:
        group: ConnectionGroup

        def deliver(message: object) -> None:
            if isinstance(message, BcastFragment) and deliveries.delivered():
                group.stop("done", flush=False)

        group = ConnectionGroup(
            ordered,
            Limits.of(WireDtype.F32, layout),
            deliver=deliver,
            counters=Counters(),
            recv_buffer=bytearray(RECV_BUFFER_SIZE),
            read_watermark=watermark,
        )
        deliveries.start()
        ordered[0].sendall(b"g")
        for sock in ordered:
            sock.setblocking(False)
        await group.run()

    anyio.run(serve)
    child.wait(60)
    return deliveries.timed()


def baseline_send(total: int) -> Timed:
    with socket.create_server(("127.0.0.1", 0)) as server:
        child = spawn("count-bytes", server.getsockname()[1], total, 0, -1)
        sock, _ = server.accept()
        with sock:
            piece = np.ones(PIECE, np.uint8).data
            left = total
            while left:
                size = min(left, PIECE)
                sock.sendall(piece[:size])
                left -= size
            output = child.communicate(timeout=120)[0]
    return Timed(float(json.loads(output)["seconds"]), total)


def transport_send(numel: int, messages: int, streams: int) -> Timed:
    data = np.full(numel, 0.5, np.float32)
    message = BcastFragment(0, 1, data.view(np.uint8).data)
    inner = HEADER_SIZE + 12 + data.nbytes
    per_message = inner
    if streams:
        per_message += -(-inner // CHUNK_SLICE_SIZE) * (HEADER_SIZE + CHUNK_ENVELOPE_SIZE)
    coordinator = Sender(message, messages)
    total = per_message * messages
    output = anyio.run(run_transport, coordinator, ["count-bytes", total, numel, streams])
    return Timed(float(json.loads(output)["seconds"]), numel * 4 * messages)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--messages", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--role", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        name, *rest = args.role
        values = [int(v) for v in rest]
        roles: dict[str, Callable[..., None]] = {
            "send-raw": role_send_raw,
            "learner-push": role_learner_push,
            "count-bytes": role_count_bytes,
            "syncer-bcast": role_syncer_bcast,
        }
        roles[name](*values)
        return

    if args.messages <= WARMUP_MESSAGES:
        parser.error(f"--messages must be more than the {WARMUP_MESSAGES} warm-up messages")
    numel = args.mib * (1 << 20) // 4
    total = numel * 4 * args.messages
    cases: dict[str, Callable[[], Timed]] = {
        "receive: blocking socket, recv_into 4 MiB (baseline)": lambda: baseline_receive(total),
        "receive: yeto-sync PUSH, S=0": lambda: transport_receive(numel, args.messages, 0),
        "receive: yeto-sync PUSH, S=3": lambda: transport_receive(numel, args.messages, 3),
        f"receive: yeto-sync PUSH, S=3, {NO_WATERMARK}": lambda: transport_receive(
            numel, args.messages, 3, watermark=1
        ),
        "receive: yeto_proto decoder alone, no sockets, S=0": lambda: decoder_alone(
            numel, args.messages, 0
        ),
        "receive: yeto_proto decoder + reassembler alone, no sockets, S=3": lambda: decoder_alone(
            numel, args.messages, 3
        ),
        "receive: yeto_learn client BCAST, S=0": lambda: learner_receive(numel, args.messages, 0),
        "receive: yeto_learn client BCAST, S=3": lambda: learner_receive(numel, args.messages, 3),
        f"receive: yeto_learn client BCAST, S=3, {NO_WATERMARK}": lambda: learner_receive(
            numel, args.messages, 3, watermark=1
        ),
        "send: blocking socket, sendall 4 MiB (baseline)": lambda: baseline_send(total),
        "send: yeto-sync BCAST, S=0": lambda: transport_send(numel, args.messages, 0),
        "send: yeto-sync BCAST, S=3": lambda: transport_send(numel, args.messages, 3),
    }
    runs: dict[str, list[Timed]] = {name: [] for name in cases}
    for _ in range(args.repeats):  # interleaved, so drift hits every case alike
        for name, measure in cases.items():
            runs[name].append(measure())

    print(
        f"{args.messages} x {args.mib} MiB f32 per case, loopback, {args.repeats} repeats; "
        f"yeto receive rows from the end of message {WARMUP_MESSAGES} on; "
        f"load average {os.getloadavg()[0]:.2f}\n"
    )
    print(
        "| case | median GB/s | best GB/s | × baseline (median) | receiver CPU ms per GB "
        "| target | result |"
    )
    print("|---|---:|---:|---:|---:|---|---|")
    baselines: dict[str, float] = {}
    warmup_bytes = WARMUP_MESSAGES * numel * 4
    for name, timings in runs.items():
        cpu = [t.cpu_seconds / t.nbytes * 1e12 for t in timings if t.cpu_seconds is not None]
        rows = [(name, [t.nbytes / t.seconds / 1e9 for t in timings], cpu)]
        cold = [warmup_bytes / t.cold_seconds / 1e9 for t in timings if t.cold_seconds is not None]
        if cold:
            rows.append((f"{name}, its first {WARMUP_MESSAGES} messages (fresh buffers)", cold, []))
        for label, rates, cpu_per_gb in rows:
            print(table_row(label, rates, cpu_per_gb, baselines))


def table_row(
    name: str, rates: list[float], cpu_per_gb: list[float], baselines: dict[str, float]
) -> str:
    """A case's row; a baseline row also records its median rate in ``baselines``.

    ``cpu_per_gb``: the receiving process's CPU milliseconds per GB, per repeat (median shown).
    """
    direction = name.split(":")[0]
    median_rate, best_rate = statistics.median(rates), max(rates)
    if "baseline" in name:
        baselines[direction] = median_rate
        ratio, target, result = "1.00x", "", "baseline"
    else:
        value = median_rate / baselines[direction]
        ratio = f"{value:.2f}x"
        measured = "yeto-sync" in name and direction == "receive" and "fresh" not in name
        target = f"≥ {TARGET_RECEIVE_RATIO}x" if measured else ""
        result = ("PASS" if value >= TARGET_RECEIVE_RATIO else "FAIL") if target else "info"
    cpu = f"{statistics.median(cpu_per_gb):.0f}" if cpu_per_gb else ""
    return (
        f"| {name} | {median_rate:.2f} | {best_rate:.2f} | {ratio} | {cpu} | {target} | {result} |"
    )


if __name__ == "__main__":
    main()
