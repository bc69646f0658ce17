"""The learner's network side: an anyio event loop in a background thread.

The training thread never waits on the network. It and the client thread meet in two
thread-safe queues:

* the **inbox** (client → training): :mod:`.events` items in arrival order — ``GroupUp``,
  ``Received`` messages, ``GroupLost``, and ``ClientFailed`` when the client gives up;
* the **outbox** (training → client): ``(epoch, message)`` pairs; a write to a self-pipe wakes
  the event loop. A message for any epoch but the current group's is not sent: what was queued
  for a dead group never reaches the next one (spec: a message never straddles generations).
  It comes back through the inbox as ``Undelivered``, as does every whole message still queued
  unbegun when its group dies, so nothing is lost without the training thread knowing.

The inbox is bounded: while the syncer's messages in it hold more than ``inbox_cap_bytes``, the
client stops reading (TCP then holds the syncer back) until the training thread drains it.
``close`` abandons a dial in progress, or flushes the current group for at most
``close_flush`` seconds; either way the thread and its sockets are gone within that bound.

The client knows nothing of anchors or pulls (that is :class:`~yeto_learn.session.
LearnerSession`, driven by the training thread); it dials groups, frames, stripes and
reassembles, sends a HEARTBEAT every second, and redials a lost group with a fresh random
nonzero generation after 1 s, doubling after every failed attempt up to 30 s
(:func:`~yeto_learn.session.backoff_delay`). It stops for good — one ``ClientFailed`` — when
the first group cannot be opened within ``connect_timeout``, when no group could be reopened
within ``reconnect_timeout`` of losing one, or when the syncer breaks the protocol. After the
syncer's ERROR or SHUTDOWN it does not redial.
"""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, replace

import anyio

from yeto_proto import (
    AnyMessage,
    DataHello,
    ErrorMessage,
    Heartbeat,
    Hello,
    Limits,
    ProtocolError,
    Shutdown,
    encode,
)
from yeto_proto.constants import CHUNK_SLICE_SIZE, MAX_STREAMS
from yeto_sync.host_names import host_name_problem

from ..session.reconnect import backoff_delay, fresh_generation
from .errors import LearnerError, SyncerProtocolViolation, SyncerUnreachable
from .events import ClientFailed, GroupLost, GroupUp, InboxItem, Received, Undelivered
from .group import RECV_BUFFER_SIZE, ConnectionGroup, Counters, open_sockets
from .quiet import QuietDeadline

#: HEARTBEAT interval (spec/learner.md §9: not part of the wire contract).
HEARTBEAT_INTERVAL_S = 1.0
_log = logging.getLogger("yeto_learn")

#: Bound on a dial (its 1 + S TCP connects run at once) before it counts as failed.
DIAL_TIMEOUT_S = 10.0
#: The least a dial gets once the connect or reconnect deadline has (nearly) passed.
DIAL_FLOOR_S = 0.25
#: Groups lost before the syncer sent a byte whose upload still counts as progress, in a row.
MAX_UNHEARD_LOSSES = 3
#: Why a redialed group that the syncer never spoke on was dropped.
SILENT_REDIAL = "the syncer sent nothing on the redialed group"
_HUNG_REDIAL = "the syncer stopped inside its first frame on the redialed group"
#: How long ``close`` lets queued frames drain before it cuts the sockets.
CLOSE_FLUSH_S = 2.0
#: The inbox's allowance beyond two of the largest fragment (see :func:`default_inbox_cap`).
INBOX_BASE_BYTES = 64 << 20
#: What one queued message is counted as on top of its tensor bytes (its Python objects), so a
#: flood of small frames is bounded too.
MESSAGE_OVERHEAD_BYTES = 512


@dataclass(frozen=True, slots=True)
class ClientConfig:
    host: str
    port: int
    #: S, the data sockets per group (0: bulk frames go plain on stream 0).
    num_streams: int = 4
    #: Deadline for opening the first group.
    connect_timeout: float = 60.0
    #: After a group is lost, deadline for opening a new one before giving up.
    reconnect_timeout: float = 120.0
    heartbeat_interval: float = HEARTBEAT_INTERVAL_S
    hello_key: bytes | None = None
    slice_size: int = CHUNK_SLICE_SIZE
    #: How long ``close`` lets queued frames drain before it cuts the sockets.
    close_flush: float = CLOSE_FLUSH_S
    #: The syncer's message bytes the inbox may hold before reading pauses (None: by limits).
    inbox_cap_bytes: int | None = None

    def __post_init__(self) -> None:
        problem = host_name_problem(self.host)
        if problem is not None:
            raise ValueError(f"syncer host {self.host!r}: {problem}")
        if not 0 <= self.num_streams <= MAX_STREAMS:
            raise ValueError(f"num_streams must be in 0..{MAX_STREAMS}, got {self.num_streams}")
        if self.connect_timeout <= 0 or self.reconnect_timeout <= 0:
            raise ValueError("connect_timeout and reconnect_timeout must be positive")
        if self.hello_key is not None and (
            not isinstance(self.hello_key, bytes | bytearray) or not self.hello_key
        ):
            raise ValueError(f"hello_key must be non-empty bytes, got {type(self.hello_key)}")

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def default_inbox_cap(limits: Limits) -> int:
    """How far the client reads ahead of a busy training thread, in message bytes.

    Any cap is safe: a message that arrives is always queued whole, and the training thread
    drains the whole inbox whenever it serves the syncer, so the cap only trades memory for
    read-ahead. The constant lets a small model's whole replay (every fragment after a redial)
    arrive between two steps; two f32 copies of the largest fragment (a BCAST and a
    FINAL_FRAGMENT of it) keep a large model's biggest messages from waiting on each other.
    """
    return INBOX_BASE_BYTES + 2 * 4 * limits.max_numel


def parse_address(text: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` for IPv6) → (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"syncer address must be HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)  # the host's spelling is ClientConfig's check


class SyncerClient:
    """Connection groups to one syncer, served by an event loop in a daemon thread."""

    def __init__(self, config: ClientConfig, hello: Hello, limits: Limits) -> None:
        self.config = config
        #: Every HELLO of the run is this one with a fresh generation and ``num_streams``.
        self._hello = replace(hello, num_streams=config.num_streams)
        self._limits = limits
        self.counters = Counters()
        #: Written by the training thread; read for each HEARTBEAT.
        self.local_step = 0
        #: Every generation dialed, in order.
        self.generations: list[int] = []
        #: Why the last dial failed or the last group ended.
        self.last_error = ""
        #: When (``time.monotonic()``) the last working group was lost.
        self._lost_at: float | None = None
        #: The epoch of a redialed group whose "reconnected" line waits for its first frame.
        self._unannounced_redial: int | None = None
        #: Each item with the bytes it holds (0 for anything but a syncer's message).
        self._inbox: queue.SimpleQueue[tuple[InboxItem, int]] = queue.SimpleQueue()
        self._inbox_cap = config.inbox_cap_bytes or default_inbox_cap(limits)
        #: Guards ``_inbox_bytes`` (the training thread takes, the client thread adds).
        self._inbox_lock = threading.Lock()
        self._inbox_bytes = 0
        self._outbox: deque[tuple[int, AnyMessage]] = deque()
        self._wake_reader, self._wake_writer = socket.socketpair()
        self._wake_reader.setblocking(False)
        self._wake_writer.setblocking(False)
        self._close_requested = False
        self._thread: threading.Thread | None = None
        # Owned by the event loop thread:
        self._epoch = 0
        self._group: ConnectionGroup | None = None
        self._terminal = False  # ERROR or SHUTDOWN seen: never redial
        self._shut_down = False  # SHUTDOWN seen: the run is complete
        self._ever_served = False  # some group got a frame from the syncer
        self._ever_connected = False  # some dial opened its sockets
        self._stop: anyio.Event | None = None
        self._dial_scope: anyio.CancelScope | None = None
        self._recv_buffer = bytearray(RECV_BUFFER_SIZE)

    # -- the training thread's side --------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the client was started already")
        self._thread = threading.Thread(
            target=self._run_thread, name="yeto-learner-client", daemon=True
        )
        self._thread.start()

    def _run_thread(self) -> None:
        try:
            anyio.run(self._main)
        except BaseException as exc:  # a bug, not the network: the training loop must hear it
            _log.exception("the learner's network thread failed")
            while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
                exc = exc.exceptions[0]  # the task group's wrapping says nothing
            self._fail(LearnerError(f"the learner's network thread failed: {exc!r}"))

    def send(self, epoch: int, message: AnyMessage) -> None:
        """Queue ``message`` for the group of ``epoch``; returns at once."""
        self._outbox.append((epoch, message))
        self._wake()

    def poll(self) -> list[InboxItem]:
        """Every inbox item available now (never blocks)."""
        items: list[InboxItem] = []
        freed = 0
        try:
            while True:
                try:
                    item, size = self._inbox.get_nowait()
                except queue.Empty:
                    return items
                items.append(item)
                freed += size
        finally:  # an interrupt must not leave taken bytes counted (the reader would stay held)
            self._taken(freed)

    def wait(self, timeout: float) -> InboxItem | None:
        """The next inbox item, waiting at most ``timeout`` seconds."""
        try:
            item, size = self._inbox.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            return None
        self._taken(size)
        return item

    @property
    def inbox_bytes(self) -> int:
        """Bytes of the syncer's messages waiting in the inbox."""
        with self._inbox_lock:
            return self._inbox_bytes

    def close(self, timeout: float | None = None) -> None:
        """Stop the client: abandon a dial in progress, or flush the group's queued frames for
        at most ``close_flush`` seconds; close the sockets and wait for the thread to end."""
        with self._inbox_lock:
            self._close_requested = True
        self._wake()  # also lets a reader held back by a full inbox go
        if self._thread is not None:
            self._thread.join(self.config.close_flush + 1.0 if timeout is None else timeout)
        if self._thread is None or not self._thread.is_alive():
            self._wake_reader.close()
            self._wake_writer.close()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            self._wake_writer.send(b"\0")

    # -- the event loop ----------------------------------------------------------------------
    async def _main(self) -> None:
        self._stop = anyio.Event()
        self._room_changed = anyio.Event()
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(self._pump_outbox)
            try:
                await self._connection_loop()
            finally:
                tasks.cancel_scope.cancel()

    async def _pump_outbox(self) -> None:
        while True:
            await anyio.wait_readable(self._wake_reader)
            with contextlib.suppress(BlockingIOError):
                while self._wake_reader.recv(4096):
                    pass
            # Any wake-up may mean room in the inbox (or a close): held readers look again.
            changed, self._room_changed = self._room_changed, anyio.Event()
            changed.set()
            self._dispatch_outbox()
            if self._close_requested and self._stop is not None and not self._stop.is_set():
                self._stop.set()
                if self._dial_scope is not None:
                    self._dial_scope.cancel()
                if self._group is not None:
                    self._group.stop("closed by the learner", flush=True)

    def _dispatch_outbox(self) -> None:
        group = self._group
        while self._outbox:
            epoch, message = self._outbox.popleft()
            if group is not None and epoch == self._epoch and not group.ended:
                group.send(message)
            else:
                self.counters.frames_dropped += 1
                self._post(Undelivered(epoch, message))

    def _post(self, item: InboxItem, size: int = 0) -> None:
        if size:
            with self._inbox_lock:
                self._inbox_bytes += size
        self._inbox.put((item, size))

    def _taken(self, size: int) -> None:
        if not size:
            return
        with self._inbox_lock:
            was_full = self._inbox_bytes > self._inbox_cap
            self._inbox_bytes -= size
            room_now = was_full and self._inbox_bytes <= self._inbox_cap
        if room_now:
            self._wake()  # the event loop lets the held readers go (:meth:`_room_to_read`)

    def _inbox_full(self) -> bool:
        with self._inbox_lock:
            return self._inbox_bytes > self._inbox_cap and not self._close_requested

    async def _room_to_read(self) -> None:
        """Backpressure: while the training thread is away and the inbox is over its cap, the
        group's readers wait (TCP then slows the syncer down); heartbeats and writes go on.

        It cannot deadlock: every message that arrived is already queued, and the training
        thread drains the whole inbox whenever it serves the syncer (``step``, the start and
        ``finish`` loops); ``close`` releases the wait as well.
        """
        while self._inbox_full():
            await self._room_changed.wait()

    def _fail(self, error: LearnerError) -> None:
        self._post(ClientFailed(error))

    async def _sleep_unless_stopped(self, seconds: float) -> None:
        assert self._stop is not None
        with anyio.move_on_after(max(seconds, 0.0)):
            await self._stop.wait()

    async def _connection_loop(self) -> None:
        assert self._stop is not None
        cfg = self.config
        # Until a group served, connect_timeout counts from the last progress (a first group
        # lost while learner 0's INIT was still going up is redialed like any other); after
        # that, reconnect_timeout from the loss of the last working group.
        quiet = QuietDeadline(self.counters, cfg.connect_timeout)
        # Bytes sent on groups that were then lost unheard count only so often: something
        # that takes learner 0's INIT and closes (a proxy whose syncer is down) would else
        # be redialed forever.
        heard = QuietDeadline(self.counters, cfg.connect_timeout, count_sent=False)
        unheard_losses = 0
        reconnect_by = math.inf

        def give_up_at() -> float:
            if self._ever_served:
                return reconnect_by
            return (quiet if unheard_losses < MAX_UNHEARD_LOSSES else heard).deadline()

        first = True
        delays = 0  # backoff index: consecutive failed attempts since the last good group
        while not self._stop.is_set():
            if not first:
                wait = min(backoff_delay(delays), max(give_up_at() - time.monotonic(), 0.0))
                delays += 1
                await self._sleep_unless_stopped(wait)
                if self._stop.is_set():
                    return
            first = False
            try:
                group = await self._dial(give_up_at())
            except (OSError, TimeoutError) as exc:
                self.last_error = _describe(exc)
                if time.monotonic() >= give_up_at():
                    self._fail(self.unreachable())
                    return
                continue
            if group is None:  # closed while dialing
                return
            self._ever_connected = True
            # A redial must hear from the syncer by the reconnect deadline: a syncer that
            # accepts and then says nothing (hung, or only its kernel accepting) is lost too.
            silence_limit = reconnect_by if self._ever_served else None
            try:
                reason = await self._serve(group, silence_limit)
            except ProtocolError as exc:
                if not self._shut_down:  # after SHUTDOWN anything arriving is ignored
                    self._fail(SyncerProtocolViolation(cfg.address, exc))
                return
            self.last_error = reason
            if self._terminal or self._stop.is_set():
                return
            if group.received_any:  # a working group: the backoff and the deadline restart
                # Its first frame may have been a CHUNK slice of a message it never finished.
                self._announce_redial(self._epoch)
                self._ever_served = True
                delays = 0
                self._lost_at = time.monotonic()
                reconnect_by = self._lost_at + cfg.reconnect_timeout
                # Training goes on meanwhile: without a word here only the generation count
                # would show that the learner was cut off.
                _log.warning(
                    "lost the syncer at %s (%s); redialing for up to %g s",
                    cfg.address,
                    reason,
                    cfg.reconnect_timeout,
                )
            else:
                unheard_losses = 0 if group.heard_from else unheard_losses + 1
                if time.monotonic() >= give_up_at():
                    self._fail(self.unreachable())
                    return

    @property
    def cut_off_since(self) -> float | None:
        """When (``time.monotonic()``) the syncer was lost, while no redialed group has heard
        from it yet (a CHUNK slice counts: a catch-up BCAST may take minutes); else None."""
        group = self._group
        if group is not None and group.received_any:
            return None
        return self._lost_at

    def unreachable(self) -> SyncerUnreachable:
        """The error for a syncer that could not be reached (again) in time."""
        cfg = self.config
        if self._ever_connected and not self._ever_served:
            # Connected, and its connection ended before a whole frame came (a syncer that
            # restarted or dropped us mid-frame): "could not connect" would send the user to
            # look for a syncer that is running.
            return SyncerUnreachable(
                f"connected to the syncer at {cfg.address}, but no whole message came from it, "
                f"and nothing more arrived for {cfg.connect_timeout:g} s "
                f"(last error: {self.last_error or 'none'})"
            )
        if not self._ever_served:
            what = (
                f"could not connect to the syncer at {cfg.address} within {cfg.connect_timeout:g} s"
            )
        else:
            what = (
                f"lost the syncer at {cfg.address} and could not reconnect within "
                f"{cfg.reconnect_timeout:g} s"
            )
            if self.last_error == SILENT_REDIAL:
                # Something accepts there: "is yeto-sync running" would send the user to
                # look for a syncer that is running.
                return SyncerUnreachable(
                    f"{what}: the syncer accepted the redialed connections but sent nothing. "
                    "A yeto-sync restarted without --resume waits for learner 0's initial "
                    "model, which a learner that already trained does not send again: restart "
                    "it with --resume, or restart the learners with it; a hung yeto-sync "
                    "looks the same"
                )
        return SyncerUnreachable(
            f"{what} (last error: {self.last_error or 'none'}); is yeto-sync running there?"
        )

    async def _dial(self, give_up_at: float) -> ConnectionGroup | None:
        """Open stream 0 and the data sockets of a new generation; queue HELLO, DATA_HELLOs.

        The 1 + S connects run at once, so a group opens in about one round trip; the syncer
        may accept a data socket before stream 0 (its DATA_HELLO waits for the HELLO). The
        frames go out only once every socket is connected.

        ``None`` once ``close`` was requested: a dial left running would join the session
        after the learner gave up on it. A dial ends within ``DIAL_TIMEOUT_S`` and by
        ``give_up_at`` (or ``DIAL_FLOOR_S`` after it began, when that has passed), so a short
        ``connect_timeout`` is not overrun by a pending connect; it then raises a TimeoutError
        that names the bound that applied.
        """
        assert self._stop is not None
        cfg = self.config
        generation = fresh_generation(set(self.generations))
        self.generations.append(generation)
        hello = replace(self._hello, generation=generation)
        sockets: list[socket.socket] = []
        # By give_up_at, but never less than the floor (the deadline may have (nearly) passed).
        bound = min(DIAL_TIMEOUT_S, max(give_up_at - time.monotonic(), DIAL_FLOOR_S))
        try:
            with anyio.CancelScope() as self._dial_scope:
                if self._stop.is_set():
                    self._dial_scope.cancel()
                with anyio.move_on_after(bound) as timer:
                    # Closes what it opened when it fails or is cancelled.
                    sockets = await open_sockets(cfg.host, cfg.port, 1 + cfg.num_streams)
                if timer.cancelled_caught:
                    raise TimeoutError(f"no connection within {bound:.2g} s")
        finally:
            self._dial_scope = None
        # Cancelled, or close() came as the sockets opened (its wake-up may not have been
        # handled yet in this loop turn, so ask the flag it sets first).
        if self._stop.is_set() or self._close_requested:
            for sock in sockets:
                sock.close()
            return None
        epoch = self._epoch + 1
        group = ConnectionGroup(
            sockets,
            self._limits,
            deliver=lambda message: self._deliver(epoch, message),
            counters=self.counters,
            recv_buffer=self._recv_buffer,
            slice_size=cfg.slice_size,
            room_to_read=self._room_to_read,
        )
        frames = [encode(hello, hello_key=cfg.hello_key)]
        frames += [
            encode(DataHello(hello.learner_id, generation, i)) for i in range(cfg.num_streams)
        ]
        group.send_first(frames)
        return group

    async def _serve(self, group: ConnectionGroup, silence_limit: float | None = None) -> str:
        """Make ``group`` current until it ends; return why (raises the syncer's violation).

        ``silence_limit``: the monotonic time by which the syncer must have sent something.
        """
        self._epoch += 1
        epoch = self._epoch
        self._group = group
        # Said at the syncer's first whole frame, not at the connect: a kernel accepts for a
        # hung syncer, or for a new one that will never send this learner anything.
        self._unannounced_redial = epoch if self._ever_served else None
        self._post(GroupUp(epoch, self.generations[-1], self.config.num_streams))
        self._dispatch_outbox()  # anything queued meanwhile belongs to an older epoch
        violation: ProtocolError | None = None
        try:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(self._heartbeats, group)
                tasks.start_soon(self._cut_close_flush, group)
                if silence_limit is not None:
                    tasks.start_soon(self._end_if_silent, group, silence_limit)
                try:
                    await group.run()
                except ProtocolError as exc:
                    violation = exc
                tasks.cancel_scope.cancel()
        finally:
            self._group = None
            for message in group.unsent:  # queued for this group, never begun on its socket
                self.counters.frames_dropped += 1
                self._post(Undelivered(epoch, message))
            self._post(GroupLost(epoch, group.reason))
        if violation is not None:
            raise violation
        return group.reason

    async def _end_if_silent(self, group: ConnectionGroup, limit: float) -> None:
        await anyio.sleep(max(limit - time.monotonic(), 0.0))
        # A first frame still arriving keeps the group as long as its bytes keep coming (a
        # whole fragment without data streams): a syncer that hung inside it, or never began
        # one, does not.
        seen = 0
        while not group.received_any and group.bytes_received != seen:
            seen = group.bytes_received
            await anyio.sleep(self.config.reconnect_timeout)
        if not group.received_any:
            group.stop(SILENT_REDIAL if not group.bytes_received else _HUNG_REDIAL, flush=False)

    async def _heartbeats(self, group: ConnectionGroup) -> None:
        assert self._stop is not None
        learner_id = self._hello.learner_id
        while not group.ended:
            await anyio.sleep(self.config.heartbeat_interval)
            if self._stop.is_set():  # closing: nothing more to add to the flush
                return
            group.send(Heartbeat(learner_id, self.local_step))

    async def _cut_close_flush(self, group: ConnectionGroup) -> None:
        """Once ``close`` was requested, end the group after ``close_flush`` seconds even if
        its queues have not drained (a syncer reading a byte now and then never stalls it)."""
        assert self._stop is not None
        await self._stop.wait()
        await anyio.sleep(self.config.close_flush)
        group.stop("closed by the learner", flush=False)

    def _announce_redial(self, epoch: int) -> None:
        """Say once that redialed group ``epoch`` works, as the syncer's first frame shows."""
        if self._unannounced_redial == epoch:
            self._unannounced_redial = None
            _log.warning(
                "reconnected to the syncer at %s (generation %d)",
                self.config.address,
                self.generations[-1],
            )

    def _deliver(self, epoch: int, message: AnyMessage) -> None:
        self._announce_redial(epoch)
        self._post(Received(epoch, message), _held_bytes(message))
        if isinstance(message, ErrorMessage | Shutdown):
            # ERROR is fatal and SHUTDOWN completes the run: neither is followed by a redial.
            self._terminal = True
            self._shut_down = self._shut_down or isinstance(message, Shutdown)
            if self._group is not None:
                self._group.stop("the syncer ended the session", flush=True)


def _held_bytes(message: AnyMessage) -> int:
    data = getattr(message, "data", None)
    return MESSAGE_OVERHEAD_BYTES + (data.nbytes if isinstance(data, memoryview) else 0)


def _describe(exc: BaseException) -> str:
    # A dial's own TimeoutError carries its text (the bound that applied); the kernel's
    # (ETIMEDOUT) has a strerror like any OSError.
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__
