"""Hostile peers against the running daemon: each gets an ERROR with the right code and is
disconnected, while a good learner's session carries on to a clean finalization and the
daemon's resident memory stays flat.

Hostile connections that need an admitted group HELLO as learner 0 with a fresh generation and
one data stream they never attach: such a group is admitted (its frames are decoded) but never
becomes ready, so it never supersedes the good learner's generation.
"""

from __future__ import annotations

import itertools
import json
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from daemon_harness import Daemon, error_code, wait_until
from scripted_learner import LearnerGroup, ScriptedLearner, SessionSpec

from yeto_proto import (
    FIRST_FRAME_LIMIT,
    FRAME_MAGIC,
    Chunk,
    ChunkSlicer,
    DataHello,
    ErrorMessage,
    FrameDecoder,
    FrameType,
    Heartbeat,
    Hello,
    InitParams,
    Limits,
    MergeMode,
    PullReq,
    PushFragment,
    Role,
    WireDtype,
    WireFragment,
    WireLayout,
    encode,
    encode_bytes,
)
from yeto_sync.transport.group import MAX_HELD_MESSAGES

LAYOUT = WireLayout((WireFragment(MergeMode.AVG, (50_000,)), WireFragment(MergeMode.AVG, (64,))))
SPEC = SessionSpec(WireDtype.F32, LAYOUT, bytes(range(32)), bytes(range(40, 72)))
TOTAL_STEPS = 6
PAUSE_AT_STEP = 3
ROUNDS_OF_HOSTILES = 6
_generations = itertools.count(1000)


def header(frame_type: int, length: int, magic: int = FRAME_MAGIC) -> bytes:
    return struct.pack("<IBQ", magic, frame_type, length)


def frame(frame_type: int, payload: bytes) -> bytes:
    return header(frame_type, len(payload)) + payload


def hello(learner_id: int = 0, layout: WireLayout = LAYOUT, num_streams: int = 1) -> bytes:
    message = Hello(
        learner_id,
        next(_generations),
        SPEC.dtype,
        layout,
        SPEC.fingerprint,
        SPEC.contract,
        num_streams,
    )
    return encode_bytes(message)


def with_version(data: bytes, version: int) -> bytes:
    return data[:13] + struct.pack("<H", version) + data[15:]


def push(extra: bytes = b"") -> bytes:
    data = np.zeros(64, "<f4").tobytes() + extra
    body = encode_bytes(PushFragment(0, 1, 1, 1, 0, 1, 1, 1, memoryview(bytes(256))))[13:61]
    return frame(FrameType.PUSH_FRAGMENT, body + data)


def overlapping_chunks() -> bytes:
    inner = encode_bytes(Heartbeat(0, 1))  # any bytes: the second CHUNK overlaps the first
    first = encode_bytes(Chunk(0, 200, 0, memoryview(inner)))
    return first + encode_bytes(Chunk(0, 200, 10, memoryview(inner)))


#: (name, bytes to send, half-close afterwards, expected ERROR code, expected pinned prefix)
CASES: list[tuple[str, Callable[[], bytes], bool, str, str]] = [
    (
        "bad magic",
        lambda: header(FrameType.HELLO, 10, magic=0xDEADBEEF),
        False,
        "BAD_MAGIC",
        "invalid first frame: ",
    ),
    (
        "2^62 first frame",
        lambda: header(FrameType.HELLO, 1 << 62),
        False,
        "FRAME_TOO_LARGE",
        "invalid first frame: ",
    ),
    (
        "unknown first type",
        lambda: header(200, 0),
        False,
        "INVALID_FIRST_FRAME",
        "invalid first frame: ",
    ),
    ("wrong version", lambda: with_version(hello(), 3), False, "UNSUPPORTED_VERSION", ""),
    (
        "truncated HELLO",
        lambda: frame(FrameType.HELLO, hello()[13:40]),
        False,
        "TRUNCATED_PAYLOAD",
        "",
    ),
    (
        "trailing byte after HELLO",
        lambda: frame(FrameType.HELLO, hello()[13:] + b"\0"),
        False,
        "BAD_HELLO_TAIL",
        "",
    ),
    ("closed mid-frame", lambda: hello()[:30], True, "CONNECTION_CLOSED_MID_FRAME", ""),
    (
        "learner id out of range",
        lambda: hello(learner_id=1),
        False,
        "LEARNER_ID_OUT_OF_RANGE",
        "LEARNER_ID_OUT_OF_RANGE: HELLO: learner_id 1 outside 0..0 (M = 1)",
    ),
    (
        "mismatched layout",
        lambda: hello(layout=WireLayout((WireFragment(MergeMode.AVG, (50_000, 64)),))),
        False,
        "SESSION_LAYOUT_MISMATCH",
        "",
    ),
    ("unknown type in a group", lambda: hello() + header(200, 0), False, "UNKNOWN_FRAME_TYPE", ""),
    (
        "2^62 PUSH in a group",
        lambda: hello() + header(FrameType.PUSH_FRAGMENT, 1 << 62),
        False,
        "FRAME_TOO_LARGE",
        "",
    ),
    (
        "trailing byte in HEARTBEAT",
        lambda: hello() + frame(FrameType.HEARTBEAT, bytes(13)),
        False,
        "BAD_FRAME_LENGTH",
        "",
    ),
    ("trailing byte in PUSH", lambda: hello() + push(b"\0"), False, "BAD_TENSOR_LENGTH", ""),
    ("overlapping chunks", lambda: hello() + overlapping_chunks(), False, "CHUNK_OVERLAP", ""),
]


def read_error(sock: socket.socket) -> str:
    """Read until the daemon closes; return the text of the one frame it sent, an ERROR."""
    received = bytearray()
    while chunk := sock.recv(65536):
        received += chunk
    decoder = FrameDecoder(Role.LEARNER, limits=SPEC.limits)
    decoder.feed(bytes(received))
    decoder.feed(b"")
    frames = decoder.frames()
    assert len(frames) == 1 and isinstance(frames[0], ErrorMessage), frames
    return frames[0].text


def attack(address: tuple[str, int], data: bytes, half_close: bool) -> str:
    with socket.create_connection(address, timeout=10) as sock:
        sock.sendall(data)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        return read_error(sock)


class PausedLearner:
    """A valid learner (learner 0, S = 2) played in a thread; it stops before its PUSH for
    ``pause_at`` until :meth:`finish`, so the daemon is mid-run while a test does its worst."""

    def __init__(self, address: tuple[str, int], *, pause_at: int, timeout: float) -> None:
        self.paused, self.resume = threading.Event(), threading.Event()
        self.failures: list[BaseException] = []
        self.learner = ScriptedLearner(
            LearnerGroup(address, SPEC, learner_id=0, generation=1, num_streams=2),
            initial=[np.ones(n, np.float32) for n in LAYOUT.numels],
            before_push=lambda pull: self._before_push(pull, pause_at),
        )
        self.thread = threading.Thread(target=self._play, args=(timeout,))
        self.thread.start()
        try:
            wait_until(self.paused.is_set, 30, "the good learner to reach its pause")
        except BaseException:
            self.resume.set()  # never leave its thread waiting for a resume
            raise

    def _before_push(self, pull: object, pause_at: int) -> None:
        if getattr(pull, "global_step", 0) == pause_at and not self.resume.is_set():
            self.paused.set()
            assert self.resume.wait(60), "never resumed"

    def _play(self, timeout: float) -> None:
        try:
            self.learner.start()
            self.learner.run(timeout=timeout)
        except BaseException as exc:
            self.failures.append(exc)
        finally:
            self.learner.group.close()

    def finish(self, daemon: Daemon) -> None:
        """Let it go on; the run must end cleanly, with SHUTDOWN and exit 0."""
        self.resume.set()
        self.thread.join(60)
        assert not self.failures, f"{self.failures!r}\n{daemon.stderr}"
        assert self.learner.shut_down and daemon.wait(30) == 0, daemon.stderr


def test_hostile_peers_get_their_errors_while_a_good_learner_is_served() -> None:
    flags = [
        "--learners=1",
        f"--total-steps={TOTAL_STEPS}",
        "--sync-interval-steps=0",
    ]
    with Daemon(*flags) as daemon:
        # A peer that starts a HELLO and never finishes it: dropped at the 10 s deadline.
        slow = socket.create_connection(daemon.address, timeout=20)
        slow_started = time.monotonic()
        slow.sendall(header(FrameType.HELLO, 500) + b"\x04\x00")

        good = PausedLearner(daemon.address, pause_at=PAUSE_AT_STEP, timeout=90)

        codes: dict[str, str] = {}
        rss = []
        for round_index in range(ROUNDS_OF_HOSTILES):
            for name, make, half_close, _code, prefix in CASES:
                text = attack(daemon.address, make(), half_close)
                assert text.startswith(prefix), (name, text)
                codes[name] = error_code(text)
            if round_index == 0:
                rss.append(daemon.rss_kib())  # after warm-up: allocator pools exist now
        rss.append(daemon.rss_kib())
        assert codes == {name: code for name, _, _, code, _ in CASES}

        text = read_error(slow)
        waited = time.monotonic() - slow_started
        slow.close()
        assert error_code(text) == "HANDSHAKE_TIMEOUT" and 9.0 <= waited < 20.0

        assert good.thread.is_alive() and not good.failures  # in session, paused at its PULL
        good.finish(daemon)

    grown_kib = rss[1] - rss[0]
    attacks = (ROUNDS_OF_HOSTILES - 1) * len(CASES)
    assert grown_kib < 4 * 1024, f"RSS grew {grown_kib} KiB over {attacks} hostile connections"


def test_idle_peers_never_take_the_descriptors_the_daemons_files_need(tmp_path: Path) -> None:
    # With 64 descriptors, 100 idle sockets used to fill the table: the lazily opened event
    # tape and the next checkpoint write failed with EMFILE (exit 1), and every accept() failed
    # with an error line 10 times a second.
    flags = [
        "--learners=1",
        f"--total-steps={TOTAL_STEPS}",
        "--sync-interval-steps=0",
        f"--checkpoint-path={tmp_path / 'syncer.yeto'}",
        "--checkpoint-every=1",
        f"--event-tape={tmp_path / 'events.jsonl'}",
    ]
    with Daemon(*flags, nofile=64) as daemon:
        idle: list[socket.socket] = []
        good: PausedLearner | None = None
        try:
            # Paused before the first merge: nothing taped or checkpointed yet.
            good = PausedLearner(daemon.address, pause_at=1, timeout=60)
            for _ in range(100):  # the kernel's listen queue takes what the daemon does not
                idle.append(socket.create_connection(daemon.address, timeout=10))
            time.sleep(1.5)
            good.finish(daemon)
        finally:
            if good is not None:
                good.resume.set()
            for sock in idle:
                sock.close()
    taped = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    merges = [line["step"] for line in taped if "event" not in line]
    assert merges == list(range(1, TOTAL_STEPS + 1))
    assert daemon.stderr.count("accept failed") <= 2, daemon.stderr


def _largest_hello(learner_id: int, seed: int) -> bytes:
    """A 16 MiB HELLO listing ~1.29 million distinct one-tensor fragments (seconds to read)."""
    count = (FIRST_FRAME_LIMIT - 19 - 66) // 13
    records = np.zeros(count, dtype=[("mode", "u1"), ("tensors", "<u4"), ("numel", "<u8")])
    records["tensors"] = 1
    records["numel"] = np.arange(count, dtype=np.uint64) + np.uint64(seed * 10**7 + 1)
    head = struct.pack("<HIQBI", 4, learner_id, 1000 + seed, 1, count)
    payload = head + records.tobytes() + bytes(64) + struct.pack("<H", 0)
    return struct.pack("<IBQ", FRAME_MAGIC, FrameType.HELLO, len(payload)) + payload


def test_largest_hellos_neither_stall_other_peers_nor_delay_a_stop() -> None:
    """Read whole, each took ~5 s of the event loop: every other peer waited, and SIGTERM took
    7-23 s. Now they are read a slice per loop turn, one at a time."""
    hellos = [_largest_hello(learner_id=1, seed=seed) for seed in range(2)]
    with Daemon("--learners=2", "--total-steps=4") as daemon:
        senders = [socket.create_connection(daemon.address, timeout=60) for _ in hellos]
        for sock, data in zip(senders, hellos, strict=True):
            threading.Thread(target=sock.sendall, args=(data,), daemon=True).start()
        time.sleep(1.0)  # both HELLOs in, the first being read
        waits = []
        for _ in range(3):
            started = time.monotonic()
            with socket.create_connection(daemon.address, timeout=10) as probe:
                probe.sendall(hello(learner_id=7))
                assert error_code(read_error(probe)) == "LEARNER_ID_OUT_OF_RANGE"
            waits.append(time.monotonic() - started)
        stop_sent = time.monotonic()
        daemon.signal(signal.SIGTERM)
        assert daemon.wait(15) == 128 + signal.SIGTERM
        stopped_in = time.monotonic() - stop_sent
        for sock in senders:
            sock.close()
    assert max(waits) < 2.0, waits  # each waited ~4.5 s before
    assert stopped_in < 5.0, stopped_in  # spec/syncer.md § 13
    assert daemon.stderr.splitlines()[-1] == (
        "yeto-sync: stopped by SIGTERM; no checkpoint was written"
    )


def test_learner_zeros_inits_wait_in_its_sockets_for_a_data_stream_that_attaches_late() -> None:
    """Not hostile: learner 0 sends every fragment's INIT right after its handshake. With one
    DATA_HELLO a retransmission late (0.3 s), the INITs on the other data socket filled the
    syncer's 256 held messages and the group was closed with GROUP_NOT_READY: the run was
    over."""
    fragments = 2 * MAX_HELD_MESSAGES + 1
    layout = WireLayout(tuple(WireFragment(MergeMode.AVG, (4,)) for _ in range(fragments)))
    limits = Limits.of(SPEC.dtype, layout)
    with Daemon("--learners=1", "--total-steps=1") as daemon:
        control = socket.create_connection(daemon.address, timeout=30)
        first = socket.create_connection(daemon.address, timeout=30)
        control.sendall(encode_bytes(Hello(0, 1, SPEC.dtype, layout, bytes(32), SPEC.contract, 2)))
        first.sendall(encode_bytes(DataHello(0, 1, 0)))
        late: list[bytes] = [encode_bytes(DataHello(0, 1, 1))]
        slicer = ChunkSlicer(2)
        for fragment_id in range(fragments):
            init = InitParams(fragment_id, np.full(4, fragment_id, "<f4").tobytes())
            for chunk in slicer.slice(encode(init)):
                data = b"".join(bytes(part) for part in chunk.buffers)
                if chunk.stream_idx == 0:
                    first.sendall(data)
                else:
                    late.append(data)
        time.sleep(0.3)
        second = socket.create_connection(daemon.address, timeout=30)
        second.sendall(b"".join(late))
        decoder = FrameDecoder(Role.LEARNER, limits=limits)
        while not any(isinstance(frame, PullReq) for frame in decoder.frames()):
            data = control.recv(1 << 16)
            assert data, daemon.stderr[-2000:]
            decoder.feed(data)
        for sock in (control, first, second):
            sock.close()
    assert "GROUP_NOT_READY" not in daemon.stderr
