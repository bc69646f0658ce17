"""The driver: runs a coordinator on a transport, carrying out its actions strictly in order.

For each event it asks the coordinator for actions and executes them one after another before
it looks at the next event: an ``AdmitGroup`` is in place before the next socket's bytes are
read, and a ``WriteCheckpoint`` is durable (atomically replaced and fsynced, by the checkpoint
module's writer in a worker thread) before a ``Send`` that follows it is queued, so a BCAST
never leaves ahead of the checkpoint that covers it. Timers run on the injected clock.
``Exit`` flushes what is queued to still-connected groups within a grace deadline, closes the
transport and ends :meth:`Driver.run` with the exit code.

The driver also owns the syncer's file outputs (event tape, checkpoints, final marker, final
state) and its structured ``key=value`` log on stderr.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import enum
import errno
import functools
import json
import os
import stat
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol, TextIO, runtime_checkable

import anyio
import anyio.from_thread
import anyio.to_thread
import numpy as np

from yeto_proto import CheckpointError, ProtocolError, PushFragment
from yeto_proto.checkpoint import (
    UNSYNCED_RENAME,
    Checkpoint,
    remove_final_marker,
    write_checkpoint,
    write_final_marker,
)

from .events import (
    Action,
    AdmitGroup,
    AppendTape,
    CancelTimer,
    CloseGroup,
    Event,
    Exit,
    Log,
    MessageReceived,
    RefuseConnection,
    Send,
    SetTimer,
    TimerFired,
    WriteCheckpoint,
    WriteFinalMarker,
    WriteFinalState,
)
from .merge import MergeError
from .transport import Clock, EventSource, Transport
from .transport.log_throttle import LogThrottle

#: Events the driver handles back to back before it lets the event loop poll its sockets.
EVENTS_PER_TURN = 64
#: Seconds an ``Exit`` (or a signal) gives queued frames to reach still-connected learners.
SHUTDOWN_GRACE_S = 5.0
EXIT_FAILURE = 1

_LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40}


class CoordinatorLike(Protocol):
    def handle(self, event: Event, now: float) -> Sequence[Action]: ...


@runtime_checkable
class StreamingCoordinator(Protocol):
    """A coordinator that can hand out Sends from inside ``handle`` (see ``Driver``)."""

    early_sends: Callable[[Sequence[Send]], None] | None

    def handle(self, event: Event, now: float) -> Sequence[Action]: ...


class IsoPoolGate(Protocol):
    """What the driver asks of the torch-svd iso pool before it publishes state.

    ``drain`` waits, bounded, for every admitted SVD job, then raises
    :class:`~yeto_sync.merge.MergeError` (the pool's ``IsoPoolError``) if the pool is poisoned.
    """

    def drain(self) -> None: ...

    def close(self) -> None: ...


# -- structured log ------------------------------------------------------------------------------
def _log_value(value: object) -> str:
    if isinstance(value, bool) or value is None:
        text = json.dumps(value)
    elif isinstance(value, int | float):
        text = repr(value)
    elif isinstance(value, bytes):
        text = value.hex()
    elif isinstance(value, str):
        text = value
    else:
        text = json.dumps(value, default=str, separators=(",", ":"))
    if not text or any(c in text for c in ' "=\\\n\t'):
        return json.dumps(text)
    return text


class KeyValueLog:
    """``ts=… level=… msg="…" key=value …`` lines, one per record, flushed at once."""

    def __init__(self, stream: TextIO | None = None, *, min_level: str = "info") -> None:
        self._stream = stream
        self._min = _LEVELS[min_level]
        #: Set once the stream failed (its reader went away): logging stops, serving does not.
        self.broken = False

    def __call__(self, level: str, text: str, fields: Mapping[str, object]) -> None:
        if self.broken or _LEVELS.get(level, 20) < self._min:
            return
        now = dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        parts = [f"ts={now}", f"level={level}", f"msg={_log_value(text)}"]
        parts += [f"{key}={_log_value(value)}" for key, value in fields.items()]
        stream = self._stream if self._stream is not None else sys.stderr
        try:
            stream.write(" ".join(parts) + "\n")
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or file: never a reason to stop serving
            self.broken = True


def _json_default(value: object) -> object:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).hex()
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _ends_in_a_torn_line(path: Path) -> bool:
    """Whether an existing tape file's last line lacks its newline (a crash cut it).

    Regular files only: opening a FIFO to read would wait for a writer, and the daemon is its
    only one.
    """
    with contextlib.suppress(OSError):
        if not stat.S_ISREG(os.stat(path).st_mode):
            return False
        with open(path, "rb") as tape:
            if tape.seek(0, os.SEEK_END) == 0:
                return False
            tape.seek(-1, os.SEEK_END)
            return tape.read(1) != b"\n"
    return False


def _append_descriptor(path: Path) -> int:
    """A descriptor appending to ``path``, opened without waiting.

    Opening a FIFO to write waits for a reader, on the event loop, where not even SIGTERM gets
    through: without one this fails at once (ENXIO, "No such device or address"). Only a
    regular file is switched to blocking writes: a pipe's reader may stop reading, and a write
    that blocked would hold the event loop, stop signals included (see ``_write_line``).
    """
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, 0o666)
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            os.set_blocking(fd, True)
    except OSError:
        os.close(fd)
        raise
    return fd


#: How long after a stop signal the event tape's reader may take to let a line it took part of
#: finish (a pipe cannot be cut back: the reader would get a cut line).
LINE_FINISH_S = 5.0


async def _write_some(fd: int, data: memoryview) -> memoryview:
    """Write what ``fd`` takes of ``data`` now, first waiting until it takes any; the rest."""
    while True:
        try:
            return data[os.write(fd, data) :]
        except BlockingIOError:
            await anyio.wait_writable(fd)


# -- the driver ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Outputs:
    """Where the file actions write; ``None`` for an output that is not configured."""

    checkpoint_path: Path | None = None
    final_state_path: Path | None = None
    event_tape_path: Path | None = None
    #: A final checkpoint gets a ``.final`` marker (``--mark-final-checkpoint``): until the
    #: marker is written, the final checkpoint on disk is an unmarked one.
    mark_final_checkpoint: bool = False


class CheckpointKind(enum.Enum):
    """What a durable checkpoint on disk is, as the daemon's last line names it."""

    #: The ``--resume`` checkpoint, which this run has not replaced yet.
    RESUMED = "the checkpoint it resumed from"
    PERIODIC = "last durable checkpoint"
    FINAL = "final checkpoint"
    #: A final checkpoint whose ``.final`` marker was requested but could not be written.
    FINAL_UNMARKED = "final checkpoint (unmarked: its .final marker was not written)"
    #: A budget cutoff's terminal checkpoint, deliberately left without a marker.
    RECOVERY = "recovery checkpoint (unmarked: not a final cut)"


#: Set when a stop left the coordinator's thread running (an in-process SVD): the process
#: must then exit without joining it (see :func:`yeto_sync.cli.main`).
WORK_ABANDONED = threading.Event()


def _may_commit(event: Event) -> bool:
    """Whether the coordinator may commit a round while handling ``event``: rounds complete
    only on a PUSH or a timer (spec/syncer.md § 5-8), and only a completion commits."""
    return isinstance(event, TimerFired) or (
        isinstance(event, MessageReceived) and isinstance(event.message, PushFragment)
    )


@dataclass(frozen=True, slots=True)
class DurableCheckpoint:
    path: Path
    global_step: int
    kind: CheckpointKind
    #: False when the file replaced the old one but its directory could not be synced: it is
    #: what a reader finds now, yet a crash may bring back the one before.
    synced: bool = True

    def describe(self) -> str:
        if self.kind is CheckpointKind.RESUMED:
            return f"{self.kind.value}, {self.path} at global_step {self.global_step}"
        if self.synced:
            return f"{self.kind.value} {self.path} at global_step {self.global_step}"
        kind = "last checkpoint" if self.kind is CheckpointKind.PERIODIC else self.kind.value
        return (
            f"{kind} {self.path} at global_step {self.global_step}"
            " (in place, but not known durable: its directory could not be synced)"
        )


class WriteOutcome(enum.Enum):
    """How an atomic write ended."""

    WRITTEN = enum.auto()
    #: Nothing replaced: the file on disk is the one before.
    FAILED = enum.auto()
    #: Replaced, but the directory fsync after the rename failed (the run ends all the same).
    REPLACED_UNSYNCED = enum.auto()


class Driver:
    def __init__(
        self,
        coordinator: CoordinatorLike,
        transport: Transport,
        clock: Clock,
        *,
        outputs: Outputs | None = None,
        log: Callable[[str, str, Mapping[str, object]], None] | None = None,
        shutdown_grace: float = SHUTDOWN_GRACE_S,
        iso_pool: IsoPoolGate | None = None,
        stream_broadcasts: bool = False,
    ) -> None:
        """``stream_broadcasts``: run the coordinator in a worker thread, one event at a
        time as always, and let its commits start their BCASTs while the merge still runs
        (:attr:`~yeto_sync.coordinator.Coordinator.early_sends`); the event loop keeps
        reading and writing sockets meanwhile. Needs a transport that sends a payload's
        final bytes as they come (the TCP transport); the in-memory one delivers whole
        messages. A transport with ``prefers_streaming()`` is asked before each event: where
        every recent link ran as fast as memory, the event is handled on the loop as usual.
        """
        self.coordinator = coordinator
        #: The coordinator to stream for, and the transport's "is it worth it now?".
        self._streaming: StreamingCoordinator | None = None
        self._prefers_streaming: Callable[[], bool] = lambda: True
        if stream_broadcasts:
            if not isinstance(coordinator, StreamingCoordinator):
                raise TypeError("streaming broadcasts needs a coordinator with early_sends")
            if not getattr(transport, "streams_partial_payloads", False):
                # A transport that waits for a whole payload inside send() would wait for
                # the very handle() call that is waiting for it.
                raise TypeError(
                    "streaming broadcasts needs a transport that sends partial payloads"
                )
            self._streaming = coordinator
            self._prefers_streaming = getattr(transport, "prefers_streaming", lambda: True)
            coordinator.early_sends = self._send_from_handler
        #: Drained before every checkpoint write; once poisoned, no checkpoint is published.
        self.iso_pool = iso_pool
        self.transport = transport
        self.clock = clock
        self.outputs = outputs if outputs is not None else Outputs()
        self._log = log if log is not None else KeyValueLog()
        self._throttle = LogThrottle()
        self.shutdown_grace = shutdown_grace
        self._timers: dict[str, float] = {}
        self._tape: BinaryIO | None = None
        self._run_scope: anyio.CancelScope | None = None
        #: The shielded scope finishing an event tape line a pipe took part of.
        self._line_scope: anyio.CancelScope | None = None
        #: The transport's shutdown ran to its end (a stop may cut a failure's short).
        self._shut_down = False
        self._shutdown_began: float | None = None
        self._stop_request: Exit | None = None
        #: Set once an ``Exit`` ran (or the driver had to stop); the run is over.
        self.exit: Exit | None = None
        #: The last checkpoint known to be durable on disk.
        self.last_checkpoint: DurableCheckpoint | None = None
        #: Whether this run has replaced the checkpoint once (a marker left beside it went at
        #: that replacement; afterwards only this run's own final marker can exist).
        self._marker_cleared = False

    # -- one event ---------------------------------------------------------------------------
    async def dispatch(self, event: Event) -> None:
        """Feed one event to the coordinator and carry out its actions, in order."""
        if self.exit is not None:
            return
        now = self.clock.now()
        # Off the event loop while BCASTs stream, and always with the iso pool: a commit may
        # wait minutes for an SVD, and the signal handler must still run meanwhile. Only an
        # event that may commit goes: the thread hop costs ~100 us, and a learner flooding
        # HEARTBEATs kept the loop busy with hops that could never commit anything.
        may_commit = _may_commit(event)
        # An in-process SVD cannot be interrupted: a stop leaves it to finish on its thread
        # (its commit is dropped, as any in flight) rather than wait minutes for it.
        abandonable = may_commit and bool(
            getattr(self.coordinator, "solves_iso_in_process", False)  # test doubles lack it
        )
        if self._streams_now(event) or (may_commit and self.iso_pool is not None) or abandonable:
            # Otherwise not abandoned on cancellation: a stop waits for the event to be
            # handled (the pool's close fails the solve it waits for).
            try:
                actions = await anyio.to_thread.run_sync(
                    self.coordinator.handle, event, now, abandon_on_cancel=abandonable
                )
            except anyio.get_cancelled_exc_class():
                if abandonable:
                    WORK_ABANDONED.set()
                    self._log(
                        "warning",
                        "stopping: the event in progress (a commit may be in an iso SVD) is "
                        "left to its thread; its actions are dropped",
                        {},
                    )
                raise
            if self._stop_request is not None:
                # Stopped while it ran (a stop fails the iso solve it waited for): what it
                # decided is dropped like everything else in flight; the last checkpoint stays.
                self._log("warning", "stopping: the event's actions are dropped", {})
                return
        else:
            actions = self.coordinator.handle(event, now)
        for index, action in enumerate(actions):
            if self.exit is not None:
                self._log(
                    "warning",
                    "actions after exit dropped",
                    {"dropped": len(actions) - index},
                )
                return
            await self._execute(action)

    def _streams_now(self, event: Event) -> bool:
        """Stream this event's BCASTs? Only for an event that may commit, while the transport
        sees a slow link (it pays)."""
        if self._streaming is None:
            return False
        streaming = _may_commit(event) and bool(self._prefers_streaming())
        self._streaming.early_sends = self._send_from_handler if streaming else None
        return streaming

    def _send_from_handler(self, sends: Sequence[Send]) -> None:
        """The coordinator's early sends: queued on the event loop before ``handle`` goes on."""
        anyio.from_thread.run(self._send_all, sends)

    async def _send_all(self, sends: Sequence[Send]) -> None:
        for send in sends:
            await self._execute(send)

    async def _execute(self, action: Action) -> None:
        match action:
            case Send(group=group, message=message, progress=progress):
                await self.transport.send(group, message, progress)
            case AdmitGroup(conn=conn, group=group, num_streams=num_streams, limits=limits):
                self.transport.admit(conn, group, num_streams, limits)
            case RefuseConnection(conn=conn, error=error):
                self.transport.refuse(conn, error)
            case CloseGroup(group=group, error=error):
                self.transport.close_group(group, error)
            case SetTimer(key=key, at=at):
                self._timers[key] = at
            case CancelTimer(key=key):
                self._timers.pop(key, None)
            case Log(level=level, text=text, fields=fields, throttled=throttled):
                # One line per kind and period; a refusal's code (and a resume refusal's
                # check) is part of its kind, so each different reason is still seen.
                kind = f"{text} {fields.get('code', '')} {fields.get('check', '')}"
                written = (
                    self._throttle.fields(kind, self.clock.now(), fields) if throttled else fields
                )
                if written is not None:
                    self._log(level, text, written)
            case AppendTape(record=record):
                await self._append_tape(record)
            case WriteCheckpoint(state=state, final=final, recovery=recovery):
                await self._write_checkpoint(state, final, recovery)
            case WriteFinalMarker(global_step=step):
                await self._write_marker(step)
            case WriteFinalState(state=state):
                await self._write_final_state(state)
            case Exit():
                # The run is decided: a stop signal now must not cut the flush short (the
                # SHUTDOWNs of a finished run still leaving), which the grace already bounds.
                with anyio.CancelScope(shield=True):
                    await self._finish(action)

    # -- timers ----------------------------------------------------------------------------
    def next_timer_at(self) -> float | None:
        return min(self._timers.values(), default=None)

    async def fire_due_timers(self) -> bool:
        """Fire every timer due by now, earliest first; True if any fired."""
        fired = False
        while self.exit is None:
            now = self.clock.now()
            due = [(at, key) for key, at in self._timers.items() if at <= now]
            if not due:
                break
            _, key = min(due)
            del self._timers[key]
            fired = True
            await self.dispatch(TimerFired(key))
        return fired

    # -- the loop --------------------------------------------------------------------------
    async def run(self, source: EventSource) -> Exit:
        """Run until an ``Exit`` (or :meth:`request_stop`); return it."""
        # Open now, while descriptors are plenty: peers may take every free one later.
        await self._open_tape()
        with anyio.CancelScope() as self._run_scope:
            handled = 0
            while self.exit is None:
                if await self.fire_due_timers():
                    continue
                event = await source.next_event(self.next_timer_at())
                if event is not None:
                    await self.dispatch(event)
                    # Let go of the message now: a PUSH's receive buffer is recycled only once
                    # nothing refers to it, and the next frame may already be arriving.
                    del event
                    handled += 1
                    if handled % EVENTS_PER_TURN == 0:
                        # Events that need no I/O come back to back without suspending (a
                        # learner flooding HEARTBEATs refills the backlog as it drains): let
                        # the loop poll its sockets, or no other peer is read meanwhile.
                        await anyio.lowlevel.checkpoint()
        if self.exit is None or not self._shut_down:
            # Stopped, or a failure's shutdown that the stop cut short: the connections still
            # close in order, bounded by the grace.
            stop = self.exit or self._stop_request or Exit(EXIT_FAILURE, "stopped")
            with anyio.CancelScope(shield=True):
                await self._finish(stop)
        assert self.exit is not None
        return self.exit

    def request_stop(self, code: int, reason: str) -> None:
        """Stop :meth:`run` now (a signal): cancel what is in progress, then shut down."""
        if self._stop_request is None:
            self._stop_request = Exit(code, reason)
            if self.iso_pool is not None:
                # Fails an SVD the coordinator's thread may be waiting for; closing joins the
                # workers, so it runs beside the event loop, not on it.
                threading.Thread(target=self.iso_pool.close, name="iso-pool-close").start()
        if self._run_scope is not None:
            self._run_scope.cancel()
        if self._line_scope is not None:
            bound = anyio.current_time() + LINE_FINISH_S
            self._line_scope.deadline = min(self._line_scope.deadline, bound)

    async def _finish(self, exit_action: Exit) -> None:
        self.exit = exit_action
        self._timers.clear()
        # A shutdown run again (a stop cut the first short) gets what is left of the grace.
        now = self.clock.now()
        if self._shutdown_began is None:
            self._shutdown_began = now
        grace = max(self.shutdown_grace - (now - self._shutdown_began), 0.0)
        try:
            await self.transport.shutdown(grace)
            self._shut_down = True
        finally:
            self.close()

    def close(self) -> None:
        if self._tape is not None:
            tape, self._tape = self._tape, None
            with contextlib.suppress(OSError):  # a tape that failed may fail its last flush too
                tape.close()

    def _fail(self, reason: str) -> Exit:
        self._log("error", "syncer exiting", {"code": EXIT_FAILURE, "reason": reason})
        return Exit(EXIT_FAILURE, reason)

    # -- files -----------------------------------------------------------------------------
    async def _open_tape(self) -> bool:
        """Open the event tape for appending (once); a failure ends the run."""
        path = self.outputs.event_tape_path
        if path is None or self._tape is not None or self.exit is not None:
            return self._tape is not None
        torn = _ends_in_a_torn_line(path)
        try:
            # Unbuffered: each line is written whole by this process, or cut back off (below).
            self._tape = open(_append_descriptor(path), "ab", buffering=0)  # noqa: SIM115
            if torn:  # a crash cut the last line: later lines must still start on their own
                self._log("warning", "event tape ends in a cut line", {"path": str(path)})
                await self._write_line(b"\n")
        except OSError as exc:
            await self._finish(self._fail(f"event tape {path} cannot be opened: {exc}"))
            return False
        return True

    async def _append_tape(self, record: Mapping[str, Any]) -> None:
        if not await self._open_tape():
            return
        assert self._tape is not None
        line = json.dumps(record, default=_json_default, separators=(",", ":"), allow_nan=False)
        try:
            await self._write_line(line.encode("utf-8") + b"\n")
        except OSError as exc:
            path = self.outputs.event_tape_path
            reason = exc.strerror or str(exc)
            if self._stop_request is not None:
                # The stop ends the run and says why; nothing more may follow the cut line
                # (the next would be glued onto it): the run's remaining actions are dropped.
                self._log("error", "event tape write failed", {"reason": reason, "path": str(path)})
                self.exit = self._stop_request
                return
            await self._finish(self._fail(f"event tape write failed: {reason} (file {path})"))

    async def _write_line(self, data: bytes) -> None:
        """Append one whole line; on a failure (a full disk) cut off what part of it was written,
        so the tape keeps only whole lines and a resumed run appends after the last one.

        A pipe whose reader is slow or paused makes the run wait here, on the event loop, where
        a stop signal still ends it between lines (see :meth:`_finish_line` for one the pipe
        took part of)."""
        assert self._tape is not None
        fd = self._tape.fileno()
        status = os.fstat(fd)
        regular = stat.S_ISREG(status.st_mode)
        try:
            # Until a first byte goes, nothing of the line is out: a stop may come here.
            rest = await _write_some(fd, memoryview(data))
            if rest:
                await self._finish_line(fd, rest)
        except OSError:
            if regular:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, status.st_size)
            raise

    async def _finish_line(self, fd: int, rest: memoryview) -> None:
        """The rest of a line a pipe took part of. A pipe cannot be cut back, so the line is
        finished however long its reader pauses, a stop included: only once a stop came, a
        reader that has not taken the whole line :data:`LINE_FINISH_S` later fails it."""
        with anyio.CancelScope(shield=True) as self._line_scope:
            if self._stop_request is not None:
                self._line_scope.deadline = anyio.current_time() + LINE_FINISH_S
            try:
                while rest:
                    rest = await _write_some(fd, rest)
            finally:
                self._line_scope = None
        if rest:
            raise OSError(errno.EAGAIN, "its reader stopped reading in the middle of a line")

    async def _write_checkpoint(self, state: object, final: bool, recovery: bool) -> None:
        path = self.outputs.checkpoint_path
        if path is None:
            self._log("error", "checkpoint requested without --checkpoint-path", {})
            return
        if not isinstance(state, Checkpoint):
            raise TypeError(f"WriteCheckpoint carries {type(state).__name__}, not a Checkpoint")
        if not await self._iso_pool_allows("checkpoint"):
            return
        # Before this run first replaces the checkpoint, a ``.final`` marker beside it goes: one
        # a resumed run found there describes the file being replaced, and could name the step
        # of a later periodic checkpoint, which would then read as a final cut. It goes only
        # once the new file is durable, so a write that fails before leaves file and marker as
        # they were (a rename that fails after leaves the old file unmarked: never falsely final).
        removed: list[bool] = []
        remove = None if self._marker_cleared else lambda: removed.append(remove_final_marker(path))
        writer = functools.partial(write_checkpoint, before_replace=remove)
        outcome = await self._write_file("checkpoint", writer, path, state)
        replaced = outcome is not WriteOutcome.FAILED
        if any(removed):
            self._log(
                "warning",
                "final marker of the replaced checkpoint removed"
                if replaced
                else "final marker removed, but the checkpoint was not replaced",
                {"path": str(path)},
            )
        if replaced:
            self._marker_cleared = True
            if recovery:
                kind = CheckpointKind.RECOVERY
            elif not final:
                kind = CheckpointKind.PERIODIC
            elif self.outputs.mark_final_checkpoint:  # a stop may come before its marker
                kind = CheckpointKind.FINAL_UNMARKED
            else:
                kind = CheckpointKind.FINAL
            self.last_checkpoint = DurableCheckpoint(
                path, state.global_step, kind, synced=outcome is WriteOutcome.WRITTEN
            )
        if outcome is WriteOutcome.WRITTEN:
            self._log(
                "info",
                "checkpoint written",
                {"path": str(path), "global_step": state.global_step, "final": final},
            )

    async def _write_marker(self, global_step: int) -> None:
        path = self.outputs.checkpoint_path
        if path is None:
            self._log("error", "final marker requested without --checkpoint-path", {})
            return
        outcome = await self._write_file("final marker", write_final_marker, path, global_step)
        if outcome is WriteOutcome.WRITTEN:
            self._log("info", "final marker written", {"global_step": global_step})
        kept = self.last_checkpoint
        final_kinds = (CheckpointKind.FINAL, CheckpointKind.FINAL_UNMARKED)
        if outcome is not WriteOutcome.FAILED:
            if kept is not None and kept.kind in final_kinds and kept.global_step == global_step:
                # A marker in place but not synced leaves the pair not known durable.
                synced = kept.synced and outcome is WriteOutcome.WRITTEN
                self.last_checkpoint = dataclasses.replace(
                    kept, kind=CheckpointKind.FINAL, synced=synced
                )
        elif kept is not None and kept.kind is CheckpointKind.FINAL:
            self.last_checkpoint = dataclasses.replace(kept, kind=CheckpointKind.FINAL_UNMARKED)

    async def _write_final_state(self, state: object) -> None:
        path = self.outputs.final_state_path
        if path is None:
            return
        if not isinstance(state, Checkpoint):
            raise TypeError(f"WriteFinalState carries {type(state).__name__}, not a Checkpoint")
        if not await self._iso_pool_allows("final state"):
            return
        outcome = await self._write_file("final state", write_checkpoint, path, state)
        if outcome is WriteOutcome.WRITTEN:
            self._log("info", "final state written", {"path": str(path)})

    async def _iso_pool_allows(self, what: str) -> bool:
        """Drain the iso pool before a write; a poisoned pool ends the run, nothing written.

        Every checkpoint drains, not only the terminal one: a cutoff checkpoint must, and this
        driver cannot tell it from a periodic one. The coordinator solves inside its commit,
        so at a write nothing is admitted and the drain returns at once.
        """
        pool = self.iso_pool
        if pool is None:
            return True
        try:
            await anyio.to_thread.run_sync(pool.drain)  # bounded by the pool's deadlines
        except MergeError as exc:
            if self._stop_request is not None:
                return False  # a stop closed the pool: the stop ends the run, nothing is written
            await self._finish(self._fail(f"{what} not written: {exc}"))
            return False
        return True

    async def _write_file(
        self, what: str, writer: Callable[..., object], *args: object
    ) -> WriteOutcome:
        """Run a blocking, atomic writer in a worker thread; a failure ends the run."""
        try:
            # Not cancellable: a stop waits for the write, so what is on disk is known.
            await anyio.to_thread.run_sync(writer, *args)
        except (ProtocolError, OSError) as exc:
            await self._finish(self._fail(f"{what} write failed: {exc}"))
            unsynced = isinstance(exc, CheckpointError) and exc.section == UNSYNCED_RENAME
            return WriteOutcome.REPLACED_UNSYNCED if unsynced else WriteOutcome.FAILED
        return WriteOutcome.WRITTEN
