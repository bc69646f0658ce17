"""The learner client's lifecycle: closing it (during a dial, during a flush) and its bounded inbox.

Scripted syncers on 127.0.0.1 as in ``test_learner_client``; a syncer that "hangs a dial" is a
listener with a full accept queue, which drops the client's SYN so its connect stays pending.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import torch
from syncer_process import free_port
from test_learner_client import (
    HELLO,
    LIMITS,
    ScriptedConnection,
    ScriptedGroup,
    ScriptedSyncer,
    next_item,
    start_client,
    tiny_model,
)

from yeto_learn import FinishTimeout, Learner, LearnerError, SyncerSilent, SyncerUnreachable
from yeto_learn import learner as learner_module
from yeto_learn.artifact_files import LAYOUT_FILE, RUN_ID_FILE, STATE_FILE, SUMMARY_FILE
from yeto_learn.transport import (
    ClientConfig,
    ClientFailed,
    GroupLost,
    GroupUp,
    InboxItem,
    Received,
    SyncerClient,
    Undelivered,
)
from yeto_learn.transport import client as client_module
from yeto_learn.transport.client import MESSAGE_OVERHEAD_BYTES
from yeto_learn.transport.group import open_sockets
from yeto_proto import (
    AnyMessage,
    BcastFragment,
    BudgetDone,
    ErrorCode,
    FinalAck,
    FinalFragment,
    FinalManifest,
    FrameType,
    Limits,
    MergeMode,
    PullReq,
    PushFragment,
    Shutdown,
    WireDtype,
    WireFragment,
    WireLayout,
    encode_bytes,
)
from yeto_proto.errors import CheckpointError

CLIENT_THREAD = "yeto-learner-client"


@pytest.fixture
def syncer() -> Iterator[ScriptedSyncer]:
    scripted = ScriptedSyncer()
    yield scripted
    scripted.close()


@pytest.fixture
def make_client() -> Iterator[list[SyncerClient]]:
    clients: list[SyncerClient] = []
    yield clients
    for client in clients:
        client.close()


@pytest.fixture
def hanging_port() -> Iterator[int]:
    """A port whose accept queue is full: a connect to it stays pending (SYNs are dropped)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)  # room for one connection
    port: int = listener.getsockname()[1]
    filler = socket.create_connection(("127.0.0.1", port), timeout=2)
    yield port
    filler.close()
    listener.close()


def open_fds() -> set[str]:
    gc.collect()  # sockets an earlier test dropped close now, not during the test
    return set(os.listdir("/proc/self/fd"))


def client_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == CLIENT_THREAD and t.is_alive()]


def wait_for(condition: Callable[[], object], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")


# -- close() ----------------------------------------------------------------------------------
@needs_proc
@pytest.mark.parametrize("num_streams", [0, 3])
def test_close_during_a_dial_abandons_it_and_leaves_no_thread_or_socket(
    hanging_port: int, num_streams: int
) -> None:
    fds_before = open_fds()
    client = SyncerClient(
        ClientConfig("127.0.0.1", hanging_port, num_streams=num_streams), HELLO, LIMITS
    )
    client.start()
    wait_for(lambda: client.generations)  # the dial has begun
    time.sleep(0.1)  # its connects are pending
    started = time.monotonic()
    client.close()
    assert time.monotonic() - started < 0.5
    assert not client.running  # a dial left running would join the session later
    assert client.poll() == []  # no group came up
    assert open_fds() <= fds_before  # no socket left open


def test_a_close_as_a_dial_completes_opens_no_group(
    syncer: ScriptedSyncer, make_client: list[SyncerClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    """close() lands while the dial's connects complete, before the event loop has handled its
    wake-up (so the stop event is not set yet): the dial must still give up, not open a group
    and send HELLO to a syncer the learner has already left."""
    client = SyncerClient(
        ClientConfig("127.0.0.1", syncer.port, num_streams=1, heartbeat_interval=60), HELLO, LIMITS
    )
    make_client.append(client)  # closed again if the test fails on the way
    closers: list[threading.Thread] = []

    async def close_as_the_sockets_open(host: str, port: int, count: int) -> list[socket.socket]:
        sockets = await open_sockets(host, port, count)  # stream 0 and the data socket
        closer = threading.Thread(target=client.close)
        closer.start()
        closers.append(closer)
        # Block the event loop (no await) until close() has asked: its wake-up is then still
        # unhandled when the dial looks, as when both happen in one loop turn.
        wait_for(lambda: client._close_requested)
        return sockets

    monkeypatch.setattr(client_module, "open_sockets", close_as_the_sockets_open)
    client.start()
    accepted = []
    for _ in range(2):
        syncer.listener.settimeout(5)
        accepted.append(syncer.listener.accept()[0])
    wait_for(lambda: closers)
    closers[0].join(5)
    assert not client.running
    assert client.poll() == []  # no GroupUp: the dial opened no group
    for sock in accepted:  # and wrote nothing: the sockets end without a HELLO or DATA_HELLO
        sock.settimeout(5)
        assert sock.recv(1 << 16) == b""
        sock.close()


def test_a_pending_connect_does_not_overrun_connect_timeout(
    hanging_port: int, make_client: list[SyncerClient]
) -> None:
    started = time.monotonic()
    client = SyncerClient(
        ClientConfig("127.0.0.1", hanging_port, num_streams=0, connect_timeout=0.5), HELLO, LIMITS
    )
    make_client.append(client)
    client.start()
    item = client.wait(5.0)
    assert isinstance(item, ClientFailed), item
    assert isinstance(item.error, SyncerUnreachable)
    assert "within 0.5 s" in str(item.error)
    assert time.monotonic() - started < 2.0  # the dial's own 10 s timeout used to decide


def test_a_learner_that_cannot_start_leaves_no_client_behind(hanging_port: int) -> None:
    model = tiny_model()
    started = time.monotonic()
    with pytest.raises(SyncerUnreachable):
        Learner(model, syncer=f"127.0.0.1:{hanging_port}", learner_id=1,
                num_learners=2, fragments=2, streams=0, run_id="r",
                connect_timeout=0.5)  # fmt: skip
    # Far below the defaults (60 s), with room for a process's first Learner (~0.7 s of
    # warm-up) on a loaded machine: a 1.5 s bound failed there now and then.
    assert time.monotonic() - started < 3.0
    assert client_threads() == []


def test_a_learner_that_fails_to_start_closes_its_client_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    closes: list[SyncerClient] = []
    close = SyncerClient.close

    def counted_close(client: SyncerClient, timeout: float | None = None) -> None:
        closes.append(client)
        close(client, timeout)

    monkeypatch.setattr(SyncerClient, "close", counted_close)
    with pytest.raises(SyncerUnreachable):
        Learner(tiny_model(), syncer=f"127.0.0.1:{free_port()}", learner_id=0,
                num_learners=1, fragments=2, connect_timeout=0.3)  # fmt: skip
    assert len(closes) == 1  # each close waits for the thread again


def test_a_bug_in_the_network_thread_reaches_the_training_loop(
    monkeypatch: pytest.MonkeyPatch, make_client: list[SyncerClient]
) -> None:
    async def broken(self: SyncerClient) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(SyncerClient, "_connection_loop", broken)
    client = SyncerClient(ClientConfig("127.0.0.1", free_port(), num_streams=0), HELLO, LIMITS)
    make_client.append(client)
    client.start()
    item = client.wait(5.0)  # it used to end silently: the learner then blamed the network
    assert isinstance(item, ClientFailed)
    assert "network thread failed: RuntimeError('a bug')" in str(item.error)


def test_an_interrupted_poll_still_frees_what_it_took(monkeypatch: pytest.MonkeyPatch) -> None:
    client = SyncerClient(ClientConfig("127.0.0.1", free_port(), num_streams=0), HELLO, LIMITS)
    for step in (1, 2):
        client._post(Received(1, PullReq(0, step, 0)), 1000)  # as the reader posts them
    inbox = client._inbox

    class InterruptedAfterOne:
        def __init__(self) -> None:
            self.calls = 0

        def get_nowait(self) -> object:
            self.calls += 1
            if self.calls > 1:
                raise KeyboardInterrupt
            return inbox.get_nowait()

    monkeypatch.setattr(client, "_inbox", InterruptedAfterOne())
    with pytest.raises(KeyboardInterrupt):
        client.poll()
    # The item poll took is gone with the interrupt; its bytes must not stay counted, or a
    # reader held back by a full inbox would wait for room that never comes.
    assert client.inbox_bytes == 1000


def test_close_flushes_what_is_queued(
    syncer: ScriptedSyncer, make_client: list[SyncerClient]
) -> None:
    client = start_client(make_client, syncer.port, num_streams=0, heartbeat_interval=60)
    group = syncer.accept_group(0)
    assert isinstance(next_item(client), GroupUp)
    client.send(1, FinalAck(9))
    client.close()
    assert group.control.read() == FinalAck(9)
    assert not client.running
    group.close()


def test_close_cuts_a_flush_the_syncer_does_not_read_after_close_flush(
    syncer: ScriptedSyncer, make_client: list[SyncerClient]
) -> None:
    client = start_client(
        make_client, syncer.port, num_streams=0, heartbeat_interval=60, close_flush=0.3
    )
    group = syncer.accept_group(0)
    assert isinstance(next_item(client), GroupUp)
    client.send(1, PushFragment(3, 0, 1, 1, 0, 1, 1, 1, memoryview(bytes(64 << 20))))
    client.send(1, BudgetDone(9))  # queued behind a PUSH the syncer never takes in
    wait_for(lambda: client.counters.bytes_sent > 0)
    started = time.monotonic()
    client.close()
    assert time.monotonic() - started < 1.0
    assert not client.running
    assert client.poll() == [Undelivered(1, BudgetDone(9)), GroupLost(1, "closed by the learner")]
    group.close()


# -- dialing ------------------------------------------------------------------------------------
class ConnectLog:
    """What the client's dials do, in order: ``"connect"`` for each connect begun
    (``socket.connect_ex``), ``"wait"`` for each wait for a begun connect to end
    (``anyio.wait_writable``); patched in for one test.

    ``rtt`` models a round trip (this kernel has no netem): a begun connect is seen to end no
    sooner than ``rtt`` after it began, as its SYN-ACK would come back. ``redirect(n, address)``
    may send the ``n``-th connect (0-based) elsewhere.
    """

    def __init__(
        self,
        monkeypatch: pytest.MonkeyPatch,
        *,
        rtt: float = 0.0,
        redirect: Callable[[int, Any], Any] | None = None,
    ) -> None:
        self.events: list[str] = []
        self.sockets: list[socket.socket] = []
        self.addresses: list[Any] = []
        began: dict[int, float] = {}
        real_connect_ex = socket.socket.connect_ex
        real_wait_writable = anyio.wait_writable

        def connect_ex(sock: socket.socket, address: Any) -> int:
            if redirect is not None:
                address = redirect(len(self.sockets), address)
            self.events.append("connect")
            self.sockets.append(sock)
            self.addresses.append(address)
            began[sock.fileno()] = time.monotonic()
            return real_connect_ex(sock, address)

        async def wait_writable(obj: Any) -> None:
            started = began.pop(obj.fileno(), None) if isinstance(obj, socket.socket) else None
            if started is not None:
                self.events.append("wait")
                await anyio.sleep(max(started + rtt - time.monotonic(), 0.0))
            await real_wait_writable(obj)

        monkeypatch.setattr(socket.socket, "connect_ex", connect_ex)
        monkeypatch.setattr(anyio, "wait_writable", wait_writable)


def test_a_dial_begins_every_connect_before_it_waits_for_one(
    syncer: ScriptedSyncer, make_client: list[SyncerClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    log = ConnectLog(monkeypatch)
    client = start_client(make_client, syncer.port, num_streams=4, heartbeat_interval=60)
    group = syncer.accept_group(4)
    assert isinstance(next_item(client), GroupUp)
    # One after the other, each connect waited for its own round trip before the next began.
    assert log.events[:5] == ["connect"] * 5, log.events
    assert log.events[5:] and set(log.events[5:]) == {"wait"}, log.events
    group.close()


def test_a_group_of_many_streams_opens_in_about_one_round_trip(
    syncer: ScriptedSyncer, make_client: list[SyncerClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    # S = 40 at 300 ms: 41 round trips (12.3 s) when the connects ran one after the other.
    ConnectLog(monkeypatch, rtt=0.3)
    started = time.monotonic()
    client = start_client(make_client, syncer.port, num_streams=40, heartbeat_interval=60)
    group = syncer.accept_group(40)
    assert isinstance(next_item(client), GroupUp)
    assert time.monotonic() - started < 3.0
    assert len(client.generations) == 1  # the first dial made it
    group.close()


@needs_proc
def test_a_refused_connect_fails_its_dial_and_closes_every_socket_of_it(
    syncer: ScriptedSyncer, monkeypatch: pytest.MonkeyPatch
) -> None:
    fds_before = open_fds()
    dead = ("127.0.0.1", free_port())
    # The third socket of every dial (of 1 + 4) meets a closed port; the others the syncer.
    log = ConnectLog(monkeypatch, redirect=lambda n, address: dead if n % 5 == 2 else address)
    client = SyncerClient(
        ClientConfig("127.0.0.1", syncer.port, num_streams=4, connect_timeout=0.5), HELLO, LIMITS
    )
    client.start()
    item = client.wait(5.0)
    client.close()
    assert isinstance(item, ClientFailed), item
    assert isinstance(item.error, SyncerUnreachable)
    assert "(last error: Connection refused)" in str(item.error)
    assert len(log.sockets) >= 5
    assert all(sock.fileno() == -1 for sock in log.sockets)  # closed, not just dropped
    assert open_fds() <= fds_before


def test_a_dial_falls_back_to_the_next_address_and_closes_the_sockets_of_the_dead_one(
    syncer: ScriptedSyncer, make_client: list[SyncerClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    dead = free_port()

    def dead_then_live(host: str, port: int, **kwargs: Any) -> list[Any]:
        # As "localhost" resolving to ::1, where nothing listens, before 127.0.0.1.
        return [
            (socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", ("127.0.0.1", dead)),
            (socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", ("127.0.0.1", port)),
        ]

    monkeypatch.setattr(socket, "getaddrinfo", dead_then_live)
    log = ConnectLog(monkeypatch)
    client = start_client(make_client, syncer.port, num_streams=3, heartbeat_interval=60)
    group = syncer.accept_group(3)
    assert isinstance(next_item(client), GroupUp)
    assert len(client.generations) == 1  # the fallback is part of the dial
    to_dead = [
        s for s, address in zip(log.sockets, log.addresses, strict=True) if address[1] == dead
    ]
    assert len(to_dead) == 4
    assert all(sock.fileno() == -1 for sock in to_dead)
    group.close()


@needs_proc
@pytest.mark.parametrize(
    ("connect_timeout", "bound"),
    [(0.5, "0.5"), (0.1, "0.25")],  # the connect deadline; the dial's floor past it
)
def test_a_dial_cut_short_reports_the_bound_that_applied(
    hanging_port: int, connect_timeout: float, bound: str
) -> None:
    fds_before = open_fds()
    config = ClientConfig("127.0.0.1", hanging_port, num_streams=3, connect_timeout=connect_timeout)
    client = SyncerClient(config, HELLO, LIMITS)
    client.start()
    item = client.wait(5.0)
    client.close()
    assert isinstance(item, ClientFailed), item
    assert isinstance(item.error, SyncerUnreachable)
    # It used to say 10 s (DIAL_TIMEOUT_S) whatever cut the dial short.
    assert f"(last error: no connection within {bound} s)" in str(item.error)
    assert open_fds() <= fds_before


# -- the bounded inbox ------------------------------------------------------------------------
MIB_FRAGMENT = WireLayout((WireFragment(MergeMode.AVG, (1 << 18,)),))  # 1 MiB of f32
MIB_LIMITS = Limits.of(WireDtype.F32, MIB_FRAGMENT)
BROADCASTS = 48  # far more than the inbox cap plus both sockets' buffers
INBOX_CAP = 2 << 20


def start_flooded_client(
    syncer: ScriptedSyncer, clients: list[SyncerClient]
) -> tuple[SyncerClient, ScriptedConnection, threading.Thread]:
    """A client with a 2 MiB inbox cap whose syncer sends 48 BCASTs of 1 MiB from a thread."""
    client = start_client(clients, syncer.port, MIB_LIMITS, num_streams=0,
                          heartbeat_interval=60, inbox_cap_bytes=INBOX_CAP)  # fmt: skip
    group = syncer.accept_group(0)
    assert isinstance(next_item(client), GroupUp)
    values = np.ones(1 << 18, dtype=np.float32).view(np.uint8).data

    def flood() -> None:
        with contextlib.suppress(OSError):  # the client may close while it still sends
            for version in range(1, BROADCASTS + 1):
                group.control.sock.sendall(encode_bytes(BcastFragment(0, version, values)))

    sender = threading.Thread(target=flood, daemon=True)
    sender.start()
    return client, group.control, sender


def test_a_full_inbox_stops_reading_until_the_training_thread_drains_it(
    syncer: ScriptedSyncer, make_client: list[SyncerClient]
) -> None:
    client, control, sender = start_flooded_client(syncer, make_client)
    try:
        sender.join(1.0)
        assert sender.is_alive(), "the syncer sent everything: nothing held it back"
        message_bytes = (1 << 20) + MESSAGE_OVERHEAD_BYTES
        assert client.inbox_bytes <= INBOX_CAP + message_bytes  # the cap, plus the one over it
        versions: list[int] = []
        deadline = time.monotonic() + 20
        while len(versions) < BROADCASTS and time.monotonic() < deadline:
            item = client.wait(0.5)  # the training thread serves the syncer: reading resumes
            if isinstance(item, Received):
                assert isinstance(item.message, BcastFragment)
                versions.append(item.message.version)
        assert versions == list(range(1, BROADCASTS + 1))  # nothing lost, in order
        sender.join(5)
        assert not sender.is_alive()
        assert client.inbox_bytes == 0
    finally:
        control.sock.close()


def test_a_full_inbox_holds_back_reads_only_the_learner_still_writes(
    syncer: ScriptedSyncer, make_client: list[SyncerClient]
) -> None:
    """The pause is the readers': what the training thread queued still goes out meanwhile."""
    client, control, sender = start_flooded_client(syncer, make_client)
    try:
        wait_for(lambda: client.inbox_bytes > INBOX_CAP)
        client.send(1, FinalAck(5))
        assert control.read() == FinalAck(5)
        assert client.inbox_bytes > INBOX_CAP  # and the inbox is still full
    finally:
        control.sock.close()
        sender.join(5)


def test_a_new_group_reads_although_a_lost_group_filled_the_inbox(
    syncer: ScriptedSyncer, make_client: list[SyncerClient]
) -> None:
    """The syncer dropped the held group; the redialed one must read its replay, or the syncer
    drops it too (its send stall) and the learner counts it as a failed redial."""
    client = start_client(make_client, syncer.port, MIB_LIMITS, num_streams=0,
                          heartbeat_interval=0.2, inbox_cap_bytes=INBOX_CAP)  # fmt: skip
    first = syncer.accept_group(0)
    values = np.ones(1 << 18, dtype=np.float32).view(np.uint8).data
    for version in range(1, 5):  # 4 MiB: over the 2 MiB cap, and the reads are held
        first.control.send(BcastFragment(0, version, values))
    wait_for(lambda: client.inbox_bytes > INBOX_CAP)
    first.control.sock.close()  # the syncer drops it; a failing heartbeat ends the group
    fresh = syncer.accept_group(0, timeout=10)
    held = client.inbox_bytes
    fresh.control.send(BcastFragment(0, 9, values))
    wait_for(lambda: client.inbox_bytes >= held + (1 << 20))
    fresh.control.sock.close()


def test_close_lets_go_of_a_reader_held_by_a_full_inbox(
    syncer: ScriptedSyncer, make_client: list[SyncerClient]
) -> None:
    client, control, sender = start_flooded_client(syncer, make_client)
    try:
        wait_for(lambda: client.inbox_bytes > INBOX_CAP)
        started = time.monotonic()
        client.close()
        assert time.monotonic() - started < 1.0
        assert not client.running
    finally:
        control.sock.close()
        sender.join(5)


def broadcast_all(group: ScriptedGroup, version: int) -> None:
    """A BCAST of every fragment of the group's layout, all values ``version``."""
    for fragment, numel in enumerate(group.hello.layout.numels):
        values = np.full(numel, version, "<f4")
        group.control.send(BcastFragment(fragment, version, values.view(np.uint8).data))


def started_learner(syncer: ScriptedSyncer, **options: Any) -> tuple[Learner, ScriptedGroup]:
    """Learner 1 of 2 (no data streams) whose first group got version 0 of every fragment."""
    groups: list[ScriptedGroup] = []

    def first_group() -> None:
        groups.append(syncer.accept_group(0))
        broadcast_all(groups[0], 0)

    opening = threading.Thread(target=first_group)
    opening.start()
    learner = Learner(tiny_model(), syncer=f"127.0.0.1:{syncer.port}", learner_id=1,
                      num_learners=2, fragments=2, streams=0, connect_timeout=10,
                      run_id="r", **options)  # fmt: skip
    opening.join(10)
    return learner, groups[0]


def start_slowly(
    syncer: ScriptedSyncer, trickle_s: float, *, stop_after: int | None = None
) -> tuple[threading.Thread, list[ScriptedGroup]]:
    """A scripted first group: fragment 0's BCAST at once, then fragment 1's byte by byte over
    ``trickle_s`` (a large model on a slow link), or only ``stop_after`` of its bytes."""
    groups: list[ScriptedGroup] = []

    def serve() -> None:
        group = syncer.accept_group(0)
        groups.append(group)
        sock = group.control.sock
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        numels = group.hello.layout.numels
        group.control.send(BcastFragment(0, 0, np.zeros(numels[0], "<f4").view(np.uint8).data))
        frame = encode_bytes(BcastFragment(1, 0, np.zeros(numels[1], "<f4").view(np.uint8).data))
        frame = frame if stop_after is None else frame[:stop_after]
        for index in range(len(frame)):
            time.sleep(trickle_s / len(frame))
            with contextlib.suppress(OSError):  # the learner may have given up and closed
                sock.sendall(frame[index : index + 1])

    thread = threading.Thread(target=serve)
    thread.start()
    return thread, groups


def test_the_start_waits_past_connect_timeout_while_the_model_keeps_arriving(
    syncer: ScriptedSyncer,
) -> None:
    # The first broadcast takes 2.5 connect_timeouts to arrive, but bytes keep coming.
    serving, groups = start_slowly(syncer, 2.5)
    started = time.monotonic()
    learner = Learner(tiny_model(), syncer=f"127.0.0.1:{syncer.port}", learner_id=1,
                      num_learners=2, fragments=2, streams=0, connect_timeout=1.0,
                      run_id="r")  # fmt: skip
    try:
        assert time.monotonic() - started >= 2.0
        assert learner.stats.generations == 1
    finally:
        serving.join(10)
        learner.close()
        groups[0].close()


def test_a_start_whose_model_stops_arriving_says_how_far_it_got(syncer: ScriptedSyncer) -> None:
    serving, groups = start_slowly(syncer, 0.2, stop_after=12)
    started = time.monotonic()
    try:
        with pytest.raises(SyncerSilent, match=r"started, then nothing moved for 1 s with 1 of 2"):
            Learner(tiny_model(), syncer=f"127.0.0.1:{syncer.port}", learner_id=1,
                    num_learners=2, fragments=2, streams=0, connect_timeout=1.0,
                    run_id="r")  # fmt: skip
        assert time.monotonic() - started < 4.0
    finally:
        serving.join(10)
        for group in groups:
            group.close()


def test_a_finish_whose_shutdown_never_comes_keeps_the_applied_final_state(
    syncer: ScriptedSyncer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out_dir = tmp_path / "learner-1"
    learner, group = started_learner(syncer, out_dir=out_dir, reconnect_timeout=1.0)
    saves = counted_saves(monkeypatch)
    numels = group.hello.layout.numels

    def cut_then_vanish() -> None:
        """The final cut, then, after the learner's ACK, no SHUTDOWN: the syncer is gone."""
        for fragment, numel in enumerate(numels):
            final = np.full(numel, 5.0, "<f4").view(np.uint8).data
            group.control.send(FinalFragment(fragment, 0, final))
        group.control.send(FinalManifest(7, (0,) * len(numels)))
        while not isinstance(group.control.read(10), FinalAck):
            pass
        group.close()
        syncer.close()

    vanishing = threading.Thread(target=cut_then_vanish)
    vanishing.start()
    try:
        with pytest.raises(LearnerError) as raised:
            learner.finish(timeout=30)
    finally:
        vanishing.join(10)
        learner.close()
    assert learner.final_global_step == 7
    notes = getattr(raised.value, "__notes__", [])
    assert any("global step 7 was applied and saved" in note for note in notes), notes
    state = torch.load(out_dir / "model.pt")
    assert all(bool((tensor == 5.0).all()) for tensor in state.values())
    assert len(saves) == 1  # as the cut was applied; the failure only names the file


def test_step_after_a_finish_that_timed_out_past_the_cut_is_refused_not_fatal(
    syncer: ScriptedSyncer,
) -> None:
    # finish() applied and ACKed the cut, then timed out waiting for the SHUTDOWN; a step()
    # then raised a LocalProtocolError (not a LearnerError) and closed the learner's client,
    # though finish() says the learner stays usable to wait again.
    learner, group = started_learner(syncer)
    values = final_values(group.hello.layout.numels)
    try:
        with finishing_past_the_cut(learner, group, 1.0, values) as (thread, outcome):
            thread.join(10)
            assert isinstance(outcome[0], FinishTimeout), outcome
            assert "final state applied" in str(outcome[0])
            with pytest.raises(LearnerError, match="final state of global step 7 is applied"):
                learner.step(tokens=1)
            assert not learner._client_closed and learner._failed is None
    finally:
        learner.close()


def test_a_run_id_that_cannot_be_saved_fails_the_start(
    syncer: ScriptedSyncer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full_disk(path: Path, text: str) -> None:
        raise CheckpointError(ErrorCode.CKPT_IO, f"No space left on device (file {path})")

    monkeypatch.setattr(learner_module, "_write_text_atomically", full_disk)
    with pytest.raises(LearnerError, match="the run id was not saved: No space left"):
        started_learner(syncer, out_dir=tmp_path / "learner-1")


def counted_saves(
    monkeypatch: pytest.MonkeyPatch, before: Callable[[], object] = list
) -> list[Any]:
    """Every artifact save of a Learner from now on, each after a call of ``before`` (whose
    result is recorded)."""
    saves: list[Any] = []
    save = Learner._save_artifact

    def counted(learner: Learner) -> None:
        saves.append(before())
        save(learner)

    monkeypatch.setattr(Learner, "_save_artifact", counted)
    return saves


def final_values(numels: tuple[int, ...]) -> list[np.ndarray[Any, np.dtype[np.float32]]]:
    rng = np.random.default_rng(7)
    return [rng.standard_normal(numel).astype("<f4") for numel in numels]


def send_final_cut(
    group: ScriptedGroup, step: int, values: list[np.ndarray[Any, np.dtype[np.float32]]]
) -> None:
    """Every fragment's FINAL_FRAGMENT (version 0) and the manifest of final step ``step``."""
    for fragment, flat in enumerate(values):
        group.control.send(FinalFragment(fragment, 0, flat.view(np.uint8).data))
    group.control.send(FinalManifest(step, (0,) * len(values)))


def await_final_ack(group: ScriptedGroup) -> FinalAck:
    deadline = time.monotonic() + 10
    while not isinstance(message := group.control.read(deadline - time.monotonic()), FinalAck):
        pass
    return message


def finish_in_thread(learner: Learner, timeout: float) -> tuple[threading.Thread, list[Any]]:
    """``learner.finish(timeout)`` in a thread; the list gets None or what it raised."""
    outcome: list[Any] = []

    def finish() -> None:
        try:
            learner.finish(timeout=timeout)
        except BaseException as exc:
            outcome.append(exc)
        else:
            outcome.append(None)

    thread = threading.Thread(target=finish)
    thread.start()
    return thread, outcome


@contextlib.contextmanager
def finishing_past_the_cut(
    learner: Learner, group: ScriptedGroup, timeout: float, values: list[Any]
) -> Iterator[tuple[threading.Thread, list[Any]]]:
    """``finish(timeout)`` in a thread, sent the final cut of step 7, whose ACK is read; the
    body runs while the SHUTDOWN is held back, then it is sent and ``finish`` joined."""
    thread, outcome = finish_in_thread(learner, timeout)
    try:
        send_final_cut(group, 7, values)
        assert await_final_ack(group) == FinalAck(7)
        yield thread, outcome
        group.control.send(Shutdown())
        thread.join(10)
    finally:
        group.close()
        thread.join(10)
        learner.close()


def artifact_files(out_dir: Path) -> dict[str, tuple[int, int]]:
    """Each artifact file's inode and mtime: an atomic rewrite changes the inode."""
    return {
        name: ((out_dir / name).stat().st_ino, (out_dir / name).stat().st_mtime_ns)
        for name in (LAYOUT_FILE, SUMMARY_FILE, STATE_FILE)
    }


def test_the_artifact_is_saved_once_the_ack_is_out_not_after_the_shutdown(
    syncer: ScriptedSyncer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The syncer holds its SHUTDOWN back (it waits for other learners' ACKs): model.pt must
    already hold the final state, so a learner killed meanwhile loses nothing; the SHUTDOWN
    then writes nothing again."""
    out_dir = tmp_path / "learner-1"
    learner, group = started_learner(syncer, out_dir=out_dir)
    values = final_values(group.hello.layout.numels)
    acked = threading.Event()
    # Each save records whether it had to wait for the syncer to hold the ACK: the write
    # must not delay the ACK (if it came first, the ACK would wait 10 s for it).
    saves = counted_saves(monkeypatch, lambda: not acked.wait(10))
    with finishing_past_the_cut(learner, group, 30, values) as (finishing, outcome):
        acked.set()
        wait_for(lambda: (out_dir / STATE_FILE).exists(), timeout=10)
        assert finishing.is_alive()  # still waiting for the SHUTDOWN
        saved = torch.load(out_dir / STATE_FILE)
        expected: dict[str, bytes] = {}
        for placed, flat in zip(learner.layout.offsets(), values, strict=True):
            for tensor, at in placed:
                expected[tensor.name] = flat[at : at + tensor.numel].tobytes()
        assert {name: t.numpy().tobytes() for name, t in saved.items()} == expected
        summary = json.loads((out_dir / SUMMARY_FILE).read_text(encoding="utf-8"))
        assert summary["final_global_step"] == 7
        written = artifact_files(out_dir)
    assert outcome == [None]
    assert saves == [False]  # one save, begun after the syncer held the ACK
    assert artifact_files(out_dir) == written  # the SHUTDOWN wrote nothing again


def test_an_artifact_that_fails_at_the_cut_lets_the_run_end_then_raises(
    syncer: ScriptedSyncer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out_dir = tmp_path / "learner-1"
    learner, group = started_learner(syncer, out_dir=out_dir)
    shutdown_sent = threading.Event()
    attempts: list[bool] = []  # per write of model.pt: had the SHUTDOWN been sent?

    def full_disk(*args: Any, **kwargs: Any) -> None:
        attempts.append(shutdown_sent.is_set())
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(torch, "save", full_disk)
    values = final_values(group.hello.layout.numels)
    with finishing_past_the_cut(learner, group, 30, values) as (finishing, outcome):
        wait_for(lambda: attempts, timeout=10)  # tried at the cut, and failed
        assert finishing.is_alive()  # still serving the syncer
        shutdown_sent.set()
    (error,) = outcome
    # The SHUTDOWN was taken (no FinishTimeout, no note that the run never ended), then the
    # write was tried once more and its failure raised.
    assert type(error) is LearnerError, error
    assert str(error) == (
        "the final state was applied and acknowledged, but the learner's artifact was not "
        f"saved: {os.strerror(errno.ENOSPC)} (file {out_dir / STATE_FILE})"
    )
    assert not getattr(error, "__notes__", None)
    assert attempts == [False, True]
    # model.pt is written last: without it, nothing claims a whole artifact; no temp file.
    assert sorted(p.name for p in out_dir.iterdir()) == sorted(
        [RUN_ID_FILE, LAYOUT_FILE, SUMMARY_FILE]
    )


def test_writing_the_artifact_does_not_count_against_the_finish_timeout(
    syncer: ScriptedSyncer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large model takes a while to write: finish(timeout) bounds the wait for the syncer,
    as it did when the artifact was written after the SHUTDOWN."""
    out_dir = tmp_path / "learner-1"
    learner, group = started_learner(syncer, out_dir=out_dir)
    counted_saves(monkeypatch, lambda: time.sleep(2.0))
    values = final_values(group.hello.layout.numels)
    with finishing_past_the_cut(learner, group, 1.5, values) as (_, outcome):
        pass
    assert outcome == [None]
    assert (out_dir / STATE_FILE).exists()


def test_a_finish_without_the_final_cut_saves_nothing(
    syncer: ScriptedSyncer, tmp_path: Path
) -> None:
    out_dir = tmp_path / "learner-1"
    learner, group = started_learner(syncer, out_dir=out_dir, reconnect_timeout=1.0)
    group.close()
    syncer.close()
    try:
        with pytest.raises(LearnerError):
            learner.finish(timeout=30)
    finally:
        learner.close()
    assert not (out_dir / "model.pt").exists()


def test_a_frozen_learner_reports_on_the_group_it_learns_of_and_pushes_nothing_there(
    syncer: ScriptedSyncer,
) -> None:
    """The group drops while the training thread is busy; the redialed group's replay and a
    PULL wait unread. BUDGET_DONE used to go to the lost group, come back unsent only after the
    PULL had been answered with a frozen PUSH, and then follow it on the new group (spec/
    learner.md § 10: that group's pulls stay unanswered)."""
    learner, first = started_learner(syncer, budget_steps=3)
    try:
        for _ in range(3):
            learner.step(tokens=10)
        first.close()
        second = syncer.accept_group(0)
        broadcast_all(second, 5)
        second.control.send(PullReq(0, 6, 0))
        time.sleep(0.5)  # all of it in the inbox before the training thread looks
        # The network thread handles frames queued for a group a little later, as a busy
        # one may: what comes back unsent then arrives after what is in the inbox now.
        client = learner._client
        assert client is not None
        send = client.send

        def late_send(epoch: int, message: AnyMessage) -> None:
            threading.Timer(0.3, send, args=(epoch, message)).start()

        client.send = late_send  # type: ignore[method-assign]
        with pytest.raises(FinishTimeout):  # no final cut in this script
            learner.finish(timeout=1.5)
        # Frame types from the raw headers: this scripted syncer decodes with another layout's
        # limits, and a PUSH must show up as a PUSH, not as a decoding error.
        raw = bytearray(b"".join(bytes(encode_bytes(m)) for m in second.control.inbox))
        second.control.sock.settimeout(0.5)
        with contextlib.suppress(TimeoutError, OSError):
            while chunk := second.control.sock.recv(1 << 16):
                raw += chunk
        sent = []
        while raw:
            length = int.from_bytes(raw[5:13], "little")
            sent.append(FrameType(raw[4]).name)
            del raw[: 13 + length]
        assert [name for name in sent if name != "HEARTBEAT"] == ["BUDGET_DONE"]
    finally:
        learner.close()


def items_within(
    client: SyncerClient, seconds: float, until: Callable[[InboxItem], bool] = lambda item: False
) -> list[InboxItem]:
    """What the client delivers within ``seconds``, or up to the first item ``until`` holds."""
    items: list[InboxItem] = []
    deadline = time.monotonic() + seconds
    while (item := client.wait(max(deadline - time.monotonic(), 0))) is not None:
        items.append(item)
        if until(item):
            break
    return items


def test_nothing_after_shutdown_fails_the_client(
    syncer: ScriptedSyncer, make_client: list[SyncerClient]
) -> None:
    client = start_client(make_client, syncer.port, num_streams=2, heartbeat_interval=60)
    group = syncer.accept_group(2)
    assert isinstance(next_item(client), GroupUp)
    group.data[0].sock.sendall(encode_bytes(Shutdown()) + b"garbage-garbage-garbage")
    items = items_within(client, 1.5)
    # The run is complete at SHUTDOWN (spec/learner.md § 7 item 5): the bytes behind it used
    # to fail the client with BAD_MAGIC.
    assert [type(i).__name__ for i in items] == ["Received", "GroupLost"]
    assert isinstance(items[0], Received) and items[0].message == Shutdown()
    group.close()


def lost_a_working_group(
    make_client: list[SyncerClient], syncer: ScriptedSyncer, **options: float
) -> SyncerClient:
    """A client (no data streams) whose first group served a PULL, then closed: it redials,
    under the reconnect deadline."""
    client = start_client(make_client, syncer.port, num_streams=0, **options)
    first = syncer.accept_group(0)
    assert isinstance(next_item(client), GroupUp)
    first.control.send(PullReq(0, 1, 0))
    assert isinstance(next_item(client), Received)
    first.close()
    return client


def test_a_redialed_group_that_hears_nothing_is_given_up_at_the_reconnect_deadline(
    syncer: ScriptedSyncer, make_client: list[SyncerClient]
) -> None:
    client = lost_a_working_group(make_client, syncer, reconnect_timeout=2)
    lost = time.monotonic()
    silent = syncer.accept_group(0)  # accepts, then never says a thing (a hung syncer)
    items = items_within(client, 6, until=lambda item: isinstance(item, ClientFailed))
    assert isinstance(items[-1], ClientFailed), f"still no failure 6 s after the redial: {items}"
    # It used to stay up for good: training went on with no sync and no error. Then it was
    # given up a whole reconnect_timeout late: a group with no byte at all counted as a first
    # frame still arriving.
    assert time.monotonic() - lost < 3
    failure = items[-1]
    assert isinstance(failure, ClientFailed)
    assert "could not reconnect within 2 s" in str(failure.error)
    # Not "is yeto-sync running there?": something accepts; a yeto-sync restarted without
    # --resume waits for an INIT that a learner that already trained never sends again.
    assert "accepted the redialed connections but sent nothing" in str(failure.error)
    assert "--resume" in str(failure.error) and "running there" not in str(failure.error)
    silent.close()


def test_a_redialed_group_whose_first_frame_is_still_arriving_is_kept(
    syncer: ScriptedSyncer, make_client: list[SyncerClient]
) -> None:
    # Without data streams the first frame is a whole fragment (minutes on a slow link): a
    # redial late in the reconnect window was cut as "silent" while it was arriving.
    client = lost_a_working_group(make_client, syncer, reconnect_timeout=2)
    second = syncer.accept_group(0)
    items = items_within(client, 5, until=lambda item: isinstance(item, GroupUp))
    assert isinstance(items[-1], GroupUp), items
    frame = encode_bytes(BcastFragment(0, 1, np.zeros(5000, "<f4").view(np.uint8).data))
    for start in range(0, 1000, 100):  # a slow link: past the reconnect deadline, and on
        second.control.sock.sendall(frame[start : start + 100])
        time.sleep(0.4)
    second.control.sock.sendall(frame[1000:])
    items = items_within(client, 2, until=lambda item: isinstance(item, Received))
    assert isinstance(items[-1], Received), items
    second.close()


def test_a_redialed_group_whose_syncer_hangs_inside_its_first_frame_is_given_up(
    syncer: ScriptedSyncer, make_client: list[SyncerClient]
) -> None:
    # A first frame kept the group only while its bytes kept coming: a syncer that hung inside
    # it (its kernel still taking heartbeats) left the learner training unsynced for good.
    # 2 s: the redial (after 1 s) must come before the deadline for its bytes to be seen.
    client = lost_a_working_group(make_client, syncer, reconnect_timeout=2)
    second = syncer.accept_group(0)
    frame = encode_bytes(BcastFragment(0, 1, np.zeros(5000, "<f4").view(np.uint8).data))
    second.control.sock.sendall(frame[:100])  # and then nothing
    items = items_within(client, 8, until=lambda item: isinstance(item, ClientFailed))
    assert isinstance(items[-1], ClientFailed), items
    # It spoke, then stopped: not the silence of a syncer restarted without --resume.
    assert "stopped inside its first frame" in str(items[-1].error)
    assert "--resume" not in str(items[-1].error)
    second.close()


def test_finish_warns_at_once_of_a_pull_that_waits_for_a_step(
    syncer: ScriptedSyncer, caplog: pytest.LogCaptureFixture
) -> None:
    """With --quorum M the syncer waits for this very PUSH and sends nothing more: the warning
    must not wait for news (it used to come only with the FinishTimeout)."""
    learner, first = started_learner(syncer)
    try:
        for _ in range(3):
            learner.step(tokens=10)
        broadcast_all(first, 1)
        first.control.send(PullReq(0, 2, 0))
        time.sleep(0.3)
        learner.step(tokens=10)  # blends version 1 in and takes the PULL: no step since
        started = time.time()  # log records carry wall-clock times
        with caplog.at_level("WARNING", logger="yeto_learn"), pytest.raises(FinishTimeout):
            learner.finish(timeout=3)
        warned = [r for r in caplog.records if "waiting in finish()" in r.getMessage()]
        assert warned and warned[0].created - started < 1.5
    finally:
        learner.close()
