"""The learner's send queue: a PUSH superseded before its first byte is never sent.

A syncer that reads slowly (a slow uplink, or a hostile peer) must not make the learner's queue
grow with every PULL it keeps answering: a newer PUSH of a fragment replaces the older one that
has not started, because the older round is over and the syncer would reject it anyway.
"""

from __future__ import annotations

import gc
import socket
import threading
import weakref
from collections.abc import Sequence

import anyio
import anyio.to_thread
import numpy as np

from yeto_learn.transport.group import ConnectionGroup, Counters
from yeto_proto import (
    FRAME_MAGIC,
    AnyMessage,
    FinalAck,
    FrameType,
    Heartbeat,
    Limits,
    MergeMode,
    PushFragment,
    WireDtype,
    WireFragment,
    WireLayout,
)
from yeto_proto.schema import HEADER_STRUCT, PREFIX_STRUCTS

LIMITS = Limits.of(WireDtype.F32, WireLayout((WireFragment(MergeMode.AVG, (100,)),) * 2))
#: Larger than any loopback socket buffer: it starts, then waits for the reader.
STUCK_BYTES = 48 << 20


def push(fragment: int, step: int, size: int = 400) -> PushFragment:
    return PushFragment(3, fragment, step, 1, 0, step, 1, 1, memoryview(bytes(size)))


def read_frames(sock: socket.socket, count: int) -> list[tuple[int, tuple[int, ...]]]:
    """``count`` frames as (type, fixed fields), read whole with blocking reads."""
    sock.settimeout(30)
    frames = []
    for _ in range(count):
        magic, kind, length = HEADER_STRUCT.unpack(_exactly(sock, HEADER_STRUCT.size))
        assert magic == FRAME_MAGIC
        payload = _exactly(sock, length)
        prefix = PREFIX_STRUCTS[FrameType(kind)]
        frames.append((kind, prefix.unpack_from(payload)))
    return frames


def _exactly(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        piece = sock.recv(min(size - len(data), 1 << 20))
        assert piece, "the learner side closed"
        data += piece
    return bytes(data)


def behind_a_started_push(
    then: Sequence[AnyMessage], frames: int
) -> tuple[list[tuple[int, tuple[int, ...]]], Counters, ConnectionGroup]:
    """Send a PUSH (fragment 0, step 1) too large for the socket buffers, then, once it has
    started, ``then``; the first ``frames`` frames the syncer reads, the counters, the group."""
    learner_end, syncer_end = socket.socketpair()
    learner_end.setblocking(False)
    counters = Counters()
    group = ConnectionGroup(
        [learner_end], LIMITS, deliver=lambda m: None, counters=counters, recv_buffer=bytearray(64)
    )
    received: list[tuple[int, tuple[int, ...]]] = []

    async def scenario() -> None:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(group.run)
            group.send(push(0, 1, STUCK_BYTES))
            await anyio.sleep(0.2)  # step 1 is half written: started, so it goes out whole
            for message in then:
                group.send(message)
            received.extend(await anyio.to_thread.run_sync(read_frames, syncer_end, frames))
            group.stop("done", flush=False)

    try:
        anyio.run(scenario)
    finally:
        syncer_end.close()
    return received, counters, group


def test_a_push_superseded_before_its_first_byte_is_replaced_in_place() -> None:
    received, counters, group = behind_a_started_push(
        [
            push(0, 2),  # waits behind step 1 ...
            push(1, 3),  # another fragment: kept
            push(0, 4),  # ... and step 4 takes its place, before its first byte
            Heartbeat(3, 9),
        ],
        frames=4,
    )
    pushes = [(f[1], f[2]) for kind, f in received if kind == FrameType.PUSH_FRAGMENT]
    assert pushes == [(0, 1), (0, 4), (1, 3)]  # (fragment, step): step 2 never went out
    assert received[-1] == (FrameType.HEARTBEAT, (3, 9))
    assert counters.frames_dropped == 1
    assert group.unsent == []


def test_the_final_ack_does_not_wait_behind_pushes_that_have_not_started() -> None:
    # Every round ended before the final cut: the queued PUSHes would only be rejected, and
    # on one socket the FINAL_ACK waited behind them (33 s per 16 MiB at 4 Mbit/s).
    received, counters, group = behind_a_started_push(
        [push(1, 2), FinalAck(7)],  # step 2 has not started when the cut is applied: withdrawn
        frames=2,
    )
    assert [kind for kind, _ in received] == [FrameType.PUSH_FRAGMENT, FrameType.FINAL_ACK]
    assert received[0][1][1:3] == (0, 1)  # (fragment, step) of the PUSH that had started
    assert counters.frames_dropped == 1
    assert group.unsent == []


def read_chunks(sock: socket.socket, done: threading.Event) -> list[tuple[int, int, int, bytes]]:
    """(msg_id, total_len, offset, data) of every CHUNK until ``done`` and the socket is idle."""
    sock.settimeout(0.5)
    chunks = []
    while True:
        try:
            head = _exactly(sock, HEADER_STRUCT.size)
        except TimeoutError:
            if done.is_set():
                return chunks
            continue
        _, kind, length = HEADER_STRUCT.unpack(head)
        payload = _exactly(sock, length)
        msg_id, total, offset = PREFIX_STRUCTS[FrameType.CHUNK].unpack_from(payload)
        chunks.append((msg_id, total, offset, payload[24:]))


def test_a_replaced_striped_push_keeps_the_chunk_message_ids_gapless() -> None:
    """The newer PUSH takes the older one's msg_id: the receiver's count has no hole in it."""
    pairs = [socket.socketpair() for _ in range(3)]
    for learner_end, _ in pairs:
        learner_end.setblocking(False)
    group = ConnectionGroup(
        [learner_end for learner_end, _ in pairs],
        LIMITS,
        deliver=lambda m: None,
        counters=Counters(),
        recv_buffer=bytearray(64),
    )
    done = threading.Event()
    results: list[list[tuple[int, int, int, bytes]]] = [[], []]

    async def scenario() -> None:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(group.run)
            group.send(push(0, 1, STUCK_BYTES))  # msg 0, striped over both data sockets
            await anyio.sleep(0.2)
            group.send(push(0, 2))  # msg 1, queued behind msg 0 ...
            group.send(push(1, 3))  # msg 2
            group.send(push(0, 4))  # ... replaced by step 4, still msg 1

            def drain(index: int) -> None:
                results[index] = read_chunks(pairs[1 + index][1], done)

            async with anyio.create_task_group() as readers:
                for index in (0, 1):
                    readers.start_soon(anyio.to_thread.run_sync, drain, index)
                await anyio.sleep(3.0)
                done.set()
            group.stop("done", flush=False)

    try:
        anyio.run(scenario)
    finally:
        for _, syncer_end in pairs:
            syncer_end.close()
    chunks = results[0] + results[1]
    by_message: dict[int, bytearray] = {}
    for msg_id, total, offset, data in chunks:
        message = by_message.setdefault(msg_id, bytearray(total))
        message[offset : offset + len(data)] = data
    assert sorted(by_message) == [0, 1, 2]
    steps = {
        msg_id: PREFIX_STRUCTS[FrameType.PUSH_FRAGMENT].unpack_from(bytes(inner), 13)[2]
        for msg_id, inner in by_message.items()
    }
    assert steps == {0: 1, 1: 4, 2: 3}


def test_a_written_push_lets_go_of_its_tensor() -> None:
    """The queue keeps a PUSH's place for a replacement, not its buffers once written."""
    learner_end, syncer_end = socket.socketpair()
    learner_end.setblocking(False)
    group = ConnectionGroup(
        [learner_end],
        LIMITS,
        deliver=lambda m: None,
        counters=Counters(),
        recv_buffer=bytearray(64),
    )
    delta = np.zeros(100, dtype="<f4")
    alive = weakref.ref(delta)
    pending = [PushFragment(3, 0, 1, 1, 0, 1, 1, 1, memoryview(delta).cast("B"))]
    del delta  # from here on only the PUSH refers to it

    async def scenario() -> None:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(group.run)
            group.send(pending.pop())
            await anyio.to_thread.run_sync(read_frames, syncer_end, 1)
            await anyio.sleep(0.05)
            group.stop("done", flush=False)

    try:
        anyio.run(scenario)
    finally:
        syncer_end.close()
    gc.collect()
    assert alive() is None
