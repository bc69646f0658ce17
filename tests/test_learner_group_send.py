"""The learner's send queue: a PUSH superseded before its first byte is never sent.

A syncer that reads slowly (a slow uplink, or a hostile peer) must not make the learner's queue
grow with every PULL it keeps answering: a newer PUSH of a fragment replaces the older one that
has not started, because the older round is over and the syncer would reject it anyway.
"""

from __future__ import annotations

import socket

import anyio
import anyio.to_thread

from yeto_learn.transport.group import ConnectionGroup, Counters
from yeto_proto import (
    FRAME_MAGIC,
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


def test_a_push_superseded_before_its_first_byte_is_withdrawn() -> None:
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
            await anyio.sleep(0.2)  # step 1 is half written: started, so it stays
            group.send(push(0, 2))  # waits behind step 1 ...
            group.send(push(1, 3))  # another fragment: kept
            group.send(push(0, 4))  # ... and is superseded here, before its first byte
            group.send(Heartbeat(3, 9))
            received.extend(await anyio.to_thread.run_sync(read_frames, syncer_end, 4))
            group.stop("done", flush=False)

    try:
        anyio.run(scenario)
    finally:
        syncer_end.close()
    pushes = [
        (fields[1], fields[2]) for kind, fields in received if kind == FrameType.PUSH_FRAGMENT
    ]
    assert pushes == [(0, 1), (1, 3), (0, 4)]  # (fragment, step): step 2 never went out
    assert received[-1] == (FrameType.HEARTBEAT, (3, 9))
    assert counters.frames_dropped == 1
    assert group.unsent == []  # withdrawn is not "unsent": it must not be sent again
