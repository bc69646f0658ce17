"""The driver: actions run strictly in order, checkpoints are durable before what follows them,
timers fire on the (fake) clock, ``Exit`` and stop requests shut the transport down."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import math
import os
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from yeto_proto import AnyMessage, ErrorMessage, IsoBackend, Limits, PullReq
from yeto_proto.checkpoint import (
    Checkpoint,
    CheckpointFormat,
    FragmentState,
    LedgerEntry,
    TrailerKind,
    atomic,
    marker_state,
    read_checkpoint,
    write_checkpoint,
    write_final_marker,
)
from yeto_proto.checkpoint import writer as checkpoint_writer
from yeto_sync import driver as driver_module
from yeto_sync.driver import (
    EVENTS_PER_TURN,
    CheckpointKind,
    Driver,
    DurableCheckpoint,
    KeyValueLog,
    Outputs,
)
from yeto_sync.events import (
    Action,
    AppendTape,
    CancelTimer,
    ConnId,
    Event,
    Exit,
    GroupKey,
    Log,
    Send,
    SetTimer,
    TimerFired,
    WriteCheckpoint,
    WriteFinalMarker,
    WriteFinalState,
)
from yeto_sync.payload_progress import PayloadProgress
from yeto_sync.transport.memory import FakeClock

KEY = GroupKey(0, 1)


def run(test: Callable[[], Awaitable[None]]) -> None:
    anyio.run(test)


def checkpoint_at(step: int) -> Checkpoint:
    params = np.arange(6, dtype="<f4") * step
    return Checkpoint(
        format=CheckpointFormat.V3,
        iso_backend=IsoBackend.SCALAR,
        fingerprint=bytes(32),
        global_step=step,
        fragments=(FragmentState(step, params, np.zeros(6, dtype="<f4")),),
        ledger=(LedgerEntry(0, step, 4 * step, 400 * step),),
        contract=bytes(range(32)),
        trailer=TrailerKind.FINGERPRINT_AND_CONTRACT,
    )


class Scripted:
    """A stand-in coordinator that answers each event with the next scripted action list."""

    def __init__(self, *scripts: Sequence[Action]) -> None:
        self.scripts = list(scripts)
        self.seen: list[tuple[Event, float]] = []

    def handle(self, event: Event, now: float) -> list[Action]:
        self.seen.append((event, now))
        return list(self.scripts.pop(0)) if self.scripts else []


class RecordingTransport:
    """Records what the driver asks of it; ``on_send`` sees the world at each send."""

    def __init__(self, on_send: Callable[[AnyMessage], object] = lambda m: None) -> None:
        self.calls: list[tuple[str, object]] = []
        self.on_send = on_send
        self.shutdown_grace: float | None = None

    def admit(self, conn: ConnId, group: GroupKey, num_streams: int, limits: Limits) -> None:
        self.calls.append(("admit", conn))

    def refuse(self, conn: ConnId, error: ErrorMessage) -> None:
        self.calls.append(("refuse", conn))

    async def send(
        self, group: GroupKey, message: AnyMessage, progress: PayloadProgress | None = None
    ) -> None:
        self.calls.append(("send", self.on_send(message)))

    def close_group(self, group: GroupKey, error: ErrorMessage | None) -> None:
        self.calls.append(("close", group))

    async def shutdown(self, grace: float) -> None:
        self.shutdown_grace = grace
        self.calls.append(("shutdown", grace))


def test_a_checkpoint_is_durable_before_the_send_that_follows_it(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.bin"

    def on_send(message: AnyMessage) -> int:
        return read_checkpoint(path).global_step  # must already be on disk, whole

    async def scenario() -> None:
        coordinator = Scripted(
            [WriteCheckpoint(checkpoint_at(8)), Send(KEY, PullReq(0, 9, 1))],
            [WriteCheckpoint(checkpoint_at(16), final=True), Send(KEY, PullReq(0, 17, 1))],
        )
        transport = RecordingTransport(on_send)
        driver = Driver(coordinator, transport, FakeClock(), outputs=Outputs(checkpoint_path=path))
        await driver.dispatch(TimerFired("a"))
        await driver.dispatch(TimerFired("b"))
        assert transport.calls == [("send", 8), ("send", 16)]
        assert driver.last_checkpoint is not None
        assert (driver.last_checkpoint.global_step, driver.last_checkpoint.kind) == (
            16,
            CheckpointKind.FINAL,
        )

    run(scenario)


def test_timers_fire_in_time_order_and_can_be_replaced_or_cancelled() -> None:
    async def scenario() -> None:
        clock = FakeClock(100.0)
        coordinator = Scripted(
            [
                SetTimer("late", 105.0),
                SetTimer("early", 103.0),
                SetTimer("gone", 101.0),
                CancelTimer("gone"),
                SetTimer("moved", 150.0),
                SetTimer("moved", 104.0),
            ]
        )
        driver = Driver(coordinator, RecordingTransport(), clock)
        await driver.dispatch(TimerFired("start"))
        assert driver.next_timer_at() == 103.0
        clock.set(102.0)
        assert not await driver.fire_due_timers()
        clock.set(110.0)
        assert await driver.fire_due_timers()
        fired = [(e.key, now) for e, now in coordinator.seen[1:] if isinstance(e, TimerFired)]
        assert fired == [("early", 110.0), ("moved", 110.0), ("late", 110.0)]
        assert driver.next_timer_at() is None

    run(scenario)


def test_exit_shuts_the_transport_down_and_drops_later_actions(tmp_path: Path) -> None:
    async def scenario() -> None:
        tape = tmp_path / "tape.jsonl"
        coordinator = Scripted(
            [
                AppendTape({"step": np.int64(3), "gnorm": np.float32(0.5), "hash": b"\x01\x02"}),
                Exit(0, "finalized"),
                Send(KEY, PullReq(0, 1, 1)),
            ]
        )
        transport = RecordingTransport()
        driver = Driver(
            coordinator,
            transport,
            FakeClock(),
            outputs=Outputs(event_tape_path=tape),
            log=KeyValueLog(io.StringIO()),
            shutdown_grace=2.5,
        )
        await driver.dispatch(TimerFired("x"))
        assert driver.exit == Exit(0, "finalized")
        assert transport.calls == [("shutdown", 2.5)]
        assert [json.loads(line) for line in tape.read_text().splitlines()] == [
            {"step": 3, "gnorm": 0.5, "hash": "0102"}
        ]
        await driver.dispatch(TimerFired("ignored"))  # the run is over
        assert len(coordinator.seen) == 1

    run(scenario)


def test_a_failed_checkpoint_write_ends_the_run_with_a_reason(tmp_path: Path) -> None:
    async def scenario() -> None:
        missing_dir = tmp_path / "missing" / "ckpt.bin"
        coordinator = Scripted([WriteCheckpoint(checkpoint_at(1)), Send(KEY, PullReq(0, 2, 1))])
        transport = RecordingTransport()
        driver = Driver(
            coordinator,
            transport,
            FakeClock(),
            outputs=Outputs(checkpoint_path=missing_dir),
            log=KeyValueLog(io.StringIO()),
        )
        await driver.dispatch(TimerFired("x"))
        assert driver.exit is not None and driver.exit.code == 1
        assert "checkpoint write failed" in driver.exit.reason
        assert ("send", None) not in transport.calls  # nothing after the failed write
        assert driver.last_checkpoint is None

    run(scenario)


def test_the_event_tape_is_opened_when_the_run_starts(tmp_path: Path) -> None:
    # Opened at the first merge instead, it needed a descriptor when peers may hold them all.
    async def scenario() -> None:
        tape = tmp_path / "tape.jsonl"
        clock = FakeClock()
        seen_at_start: list[bool] = []

        class Watching(IdleSource):
            async def next_event(self, until: float | None) -> Event | None:
                seen_at_start.append(tape.exists())
                return await super().next_event(until)

        coordinator = Scripted([SetTimer("t", 1.0)], [Exit(0, "done")])
        driver = Driver(
            coordinator, RecordingTransport(), clock, outputs=Outputs(event_tape_path=tape)
        )
        await driver.dispatch(TimerFired("boot"))
        with anyio.fail_after(5):
            assert await driver.run(Watching(clock)) == Exit(0, "done")
        assert seen_at_start[0]

    run(scenario)


def test_a_tape_that_cannot_be_written_ends_the_run_with_a_reason(tmp_path: Path) -> None:
    # An OSError from the tape escaped the driver: the daemon died with "internal error".
    async def scenario() -> None:
        tape = tmp_path / "a directory"
        tape.mkdir()
        transport = RecordingTransport()
        driver = Driver(
            Scripted([AppendTape({"step": 1}), Send(KEY, PullReq(0, 2, 1))]),
            transport,
            FakeClock(),
            outputs=Outputs(event_tape_path=tape),
            log=KeyValueLog(io.StringIO()),
        )
        await driver.dispatch(TimerFired("x"))
        assert driver.exit is not None and driver.exit.code == 1
        assert "event tape" in driver.exit.reason and "cannot be opened" in driver.exit.reason
        assert transport.calls == [("shutdown", driver.shutdown_grace)]  # nothing after it

    run(scenario)


async def append_one(tape: Path, record: dict[str, Any]) -> Driver:
    """A driver that appends ``record`` to the event tape ``tape``, then closes."""
    driver = Driver(
        Scripted([AppendTape(record)]),
        RecordingTransport(),
        FakeClock(),
        outputs=Outputs(event_tape_path=tape),
        log=KeyValueLog(io.StringIO()),
    )
    await driver.dispatch(TimerFired("x"))
    driver.close()
    return driver


def run_within(seconds: float, test: Callable[[], Awaitable[None]]) -> None:
    """Like :func:`run`, but a test that blocks the event loop itself fails instead of hanging."""
    failures: list[BaseException] = []

    def body() -> None:
        try:
            run(test)
        except BaseException as exc:
            failures.append(exc)

    driving = threading.Thread(target=body, daemon=True)
    driving.start()
    driving.join(seconds)
    assert not driving.is_alive(), f"still blocked after {seconds} s"
    if failures:
        raise failures[0]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_tape_is_written_without_waiting_for_a_second_writer(tmp_path: Path) -> None:
    # The torn-line check opened the tape to read it: on a FIFO that waits for a writer, and
    # the daemon is its only one (a hang that not even SIGTERM ended).
    tape = tmp_path / "tape.fifo"
    os.mkfifo(tape)
    read: list[bytes] = []
    reader = threading.Thread(target=lambda: read.append(tape.read_bytes()), daemon=True)
    reader.start()

    async def scenario() -> None:
        assert (await append_one(tape, {"step": 1})).exit is None

    run_within(10, scenario)
    reader.join(10)
    assert read == [b'{"step":1}\n']


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_tape_reader_that_stops_reading_holds_the_run_but_not_a_stop_signal(
    tmp_path: Path,
) -> None:
    """A pipe whose reader stops reading: the write used to block the event loop itself, and
    not even SIGTERM ended the daemon. The run now waits on the loop, where a stop gets in,
    and the reader gets whole lines only."""
    tape = tmp_path / "tape.fifo"
    os.mkfifo(tape)
    reader = os.open(tape, os.O_RDONLY | os.O_NONBLOCK)  # opened, and then never read
    record = {"step": 1, "pad": "x" * 1000}
    line = json.dumps(record, separators=(",", ":")).encode() + b"\n"
    records = [AppendTape(record) for _ in range(2 * (1 << 20) // len(line))]  # over any pipe

    async def scenario() -> Exit:
        clock = FakeClock()
        driver = Driver(
            Scripted(records),
            RecordingTransport(),
            clock,
            outputs=Outputs(event_tape_path=tape),
            log=KeyValueLog(io.StringIO()),
        )
        return await run_stopped_after(driver, 0.5, OneEvent(clock, TimerFired("x")))

    try:
        outcome: list[Exit] = []
        run_within(10, lambda: _keep(outcome, scenario()))
        assert outcome == [Exit(143, "stopped by SIGTERM")]
        written = b""
        with contextlib.suppress(BlockingIOError):
            while chunk := os.read(reader, 1 << 16):
                written += chunk
    finally:
        os.close(reader)
    assert 0 < len(written) < len(records) * len(line)
    assert written == line * (len(written) // len(line))  # whole lines only


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_stop_waits_for_a_long_line_the_tape_reader_took_part_of(tmp_path: Path) -> None:
    """A line longer than the pipe holds goes in pieces; a stop between them cut it, and the
    reader got half a line (only a line of up to PIPE_BUF bytes goes in whole or not at all)."""
    tape = tmp_path / "tape.fifo"
    os.mkfifo(tape)
    record = {"step": 1, "pad": "x" * (1 << 20)}  # far more than a pipe holds
    line = json.dumps(record, separators=(",", ":")).encode() + b"\n"
    read: list[bytes] = []
    reading = os.open(tape, os.O_RDONLY | os.O_NONBLOCK)  # open before the driver opens it
    os.set_blocking(reading, True)

    def slow_reader() -> None:
        # Before the driver opens its end, and after it closed a cut line, a read says EOF.
        deadline = time.monotonic() + 10
        while sum(map(len, read)) < len(line) and time.monotonic() < deadline:
            read.append(os.read(reading, 1 << 16))
            time.sleep(0.02)  # ~16 pieces: some 0.3 s for the line
        os.close(reading)

    reader = threading.Thread(target=slow_reader, daemon=True)
    reader.start()

    async def scenario() -> Exit:
        clock = FakeClock()
        driver = Driver(
            Scripted([AppendTape(record)]),
            RecordingTransport(),
            clock,
            outputs=Outputs(event_tape_path=tape),
            log=KeyValueLog(io.StringIO()),
        )
        return await run_stopped_after(driver, 0.05, OneEvent(clock, TimerFired("x")))

    outcome: list[Exit] = []
    run_within(20, lambda: _keep(outcome, scenario()))
    reader.join(20)
    assert outcome == [Exit(143, "stopped by SIGTERM")]
    assert b"".join(read) == line


def _tape_line_driver(
    tape: Path, records: Sequence[dict[str, Any]], log: io.StringIO
) -> tuple[Driver, Any]:
    """A driver whose first event appends ``records`` to ``tape``, and its event source."""
    clock = FakeClock()
    driver = Driver(
        Scripted([AppendTape(record) for record in records]),
        RecordingTransport(),
        clock,
        outputs=Outputs(event_tape_path=tape),
        log=KeyValueLog(log),
    )
    return driver, OneEvent(clock, TimerFired("x"))


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
@pytest.mark.parametrize("stopped", [False, True], ids=["paused-reader", "stalled-and-stopped"])
def test_a_tape_reader_pausing_mid_line_holds_the_run_until_a_stop_bounds_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stopped: bool
) -> None:
    """A reader paused in the middle of a long line (a pager, Ctrl+Z) only holds the run: it
    failed once a wait passed the line's bound even with no stop asked for. Once a stop comes,
    a reader that still takes nothing fails the line LINE_FINISH_S later, the run ends with
    the stop, and nothing more goes on the tape (a next line would be glued onto the cut one)."""
    monkeypatch.setattr(driver_module, "LINE_FINISH_S", 0.3)
    tape = tmp_path / "tape.fifo"
    os.mkfifo(tape)
    record = {"step": 1, "pad": "x" * (1 << 20)}
    line = json.dumps(record, separators=(",", ":")).encode() + b"\n"
    reading = os.open(tape, os.O_RDONLY | os.O_NONBLOCK)
    read: list[bytes] = []
    first_read, run_over = threading.Event(), threading.Event()

    def pausing_reader() -> None:
        deadline = time.monotonic() + 10
        while not read and time.monotonic() < deadline:  # until the driver opens and writes
            with contextlib.suppress(BlockingIOError):
                if piece := os.read(reading, 1 << 16):
                    read.append(piece)
            time.sleep(0.01)
        first_read.set()
        # Far past LINE_FINISH_S; once stopped, on until the run is over.
        run_over.wait(10) if stopped else time.sleep(1.0)
        os.set_blocking(reading, True)
        while piece := os.read(reading, 1 << 16):  # the rest, until the driver closes its end
            read.append(piece)

    reader = threading.Thread(target=pausing_reader, daemon=True)
    reader.start()
    log = io.StringIO()

    async def scenario() -> Exit | None:
        driver, source = _tape_line_driver(tape, [record, {"step": 2}], log)
        if not stopped:
            await driver.dispatch(TimerFired("x"))
            driver.close()
            return driver.exit
        async with anyio.create_task_group() as tasks:

            async def stop_mid_line() -> None:
                await anyio.to_thread.run_sync(first_read.wait, 10)
                driver.request_stop(143, "stopped by SIGTERM")

            tasks.start_soon(stop_mid_line)
            with anyio.fail_after(10):
                result = await driver.run(source)
        return result

    outcome: list[Exit | None] = []
    try:
        run_within(20, lambda: _keep(outcome, scenario()))
        run_over.set()
        reader.join(20)
        assert not reader.is_alive()
    finally:
        os.close(reading)
    if stopped:
        assert outcome == [Exit(143, "stopped by SIGTERM")]
        assert read and line.startswith(b"".join(read)) and len(b"".join(read)) < len(line)
        assert "actions after exit dropped" in log.getvalue()
    else:
        assert outcome == [None]
        assert b"".join(read) == line + b'{"step":2}\n'


async def _keep(outcome: list[Any], running: Awaitable[Any]) -> None:
    outcome.append(await running)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_tape_without_a_reader_fails_the_run_at_once(tmp_path: Path) -> None:
    tape = tmp_path / "tape.fifo"
    os.mkfifo(tape)

    async def scenario() -> None:
        driver = await append_one(tape, {"step": 1})
        assert driver.exit is not None and driver.exit.code == 1
        assert "cannot be opened" in driver.exit.reason, driver.exit.reason

    run_within(10, scenario)


def test_a_tape_a_crash_cut_gets_its_later_lines_on_lines_of_their_own(tmp_path: Path) -> None:
    # Appended to a cut last line, a resumed run's first record was unreadable too.
    async def scenario() -> None:
        tape = tmp_path / "tape.jsonl"
        tape.write_bytes(b'{"step":1}\n{"step":2,"frag')
        assert (await append_one(tape, {"event": "resumed", "step": 1})).exit is None
        lines = tape.read_text(encoding="utf-8").splitlines()
        assert lines == ['{"step":1}', '{"step":2,"frag', '{"event":"resumed","step":1}']

    run(scenario)


def final_cut_driver(tmp_path: Path) -> tuple[Driver, Path, Path, Checkpoint]:
    """A driver whose next event writes the final checkpoint, its marker and the final state."""
    path, final_state = tmp_path / "ckpt.bin", tmp_path / "final.bin"
    state = checkpoint_at(12)
    coordinator = Scripted(
        [WriteCheckpoint(state, final=True), WriteFinalMarker(12), WriteFinalState(state)]
    )
    driver = Driver(
        coordinator,
        RecordingTransport(),
        FakeClock(),
        outputs=Outputs(checkpoint_path=path, final_state_path=final_state),
        log=KeyValueLog(io.StringIO()),
    )
    return driver, path, final_state, state


def test_final_marker_and_final_state(tmp_path: Path) -> None:
    async def scenario() -> None:
        driver, path, final_state, state = final_cut_driver(tmp_path)
        await driver.dispatch(TimerFired("x"))
        assert marker_state(path, 12).status.name == "FINAL"
        assert read_checkpoint(final_state).global_step == 12
        np.testing.assert_array_equal(
            read_checkpoint(final_state).fragments[0].params, state.fragments[0].params
        )

    run(scenario)


def test_a_final_marker_whose_directory_cannot_be_synced_is_named_as_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The marker is on disk (a resume finds it): not "its .final marker was not written"."""
    real_fsync_path = atomic.fsync_path

    def directories_fail_after_the_marker(path: Path) -> None:
        if path.is_dir() and (path / "ckpt.bin.final").exists():
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real_fsync_path(path)

    async def scenario() -> None:
        driver, path, _, _ = final_cut_driver(tmp_path)
        monkeypatch.setattr(atomic, "fsync_path", directories_fail_after_the_marker)
        await driver.dispatch(TimerFired("x"))
        assert driver.exit is not None and driver.exit.code == 1
        assert driver.exit.reason.startswith("final marker write failed: CKPT_IO: directory sync")
        assert marker_state(path, 12).status.name == "FINAL"
        kept = driver.last_checkpoint
        assert kept == DurableCheckpoint(path, 12, CheckpointKind.FINAL, synced=False)

    run(scenario)


def test_a_final_marker_that_does_not_fit_leaves_no_marker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk at the marker: exit 1 naming it, the final checkpoint kept unmarked."""
    full_for_markers = open_out_of_space(lambda name: ".final." in name)
    monkeypatch.setattr(atomic, "open", full_for_markers, raising=False)

    async def scenario() -> None:
        driver, path, _, _ = final_cut_driver(tmp_path)
        await driver.dispatch(TimerFired("x"))
        assert driver.exit is not None and driver.exit.code == 1
        assert driver.exit.reason == (
            f"final marker write failed: CKPT_IO: write: No space left on device "
            f"(file {path}.final)"
        )
        kept = driver.last_checkpoint
        # the last line says so
        assert kept is not None and kept.kind is CheckpointKind.FINAL_UNMARKED
        assert read_checkpoint(path).global_step == 12
        assert marker_state(path, 12).status.name == "ABSENT"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.bin"]  # nor a temp file

    run(scenario)


def periodic_writes_driver(tmp_path: Path, steps: Sequence[int]) -> tuple[Driver, io.StringIO]:
    """A driver whose events each write a periodic checkpoint at the next of ``steps``."""
    log = io.StringIO()
    coordinator = Scripted(*([WriteCheckpoint(checkpoint_at(step), final=False)] for step in steps))
    driver = Driver(
        coordinator,
        RecordingTransport(),
        FakeClock(),
        outputs=Outputs(checkpoint_path=tmp_path / "ckpt.bin"),
        log=KeyValueLog(log),
    )
    return driver, log


def test_a_marker_left_beside_a_resumed_checkpoint_goes_before_the_first_replacement(
    tmp_path: Path,
) -> None:
    """A marker naming step 6 beside a checkpoint at 4 (a hand-restored older checkpoint, say):
    the resumed run's periodic checkpoint at 6 must not read as a final cut."""

    async def scenario() -> None:
        driver, log = periodic_writes_driver(tmp_path, [6, 7])
        path = tmp_path / "ckpt.bin"
        write_final_marker(path, 6)
        await driver.dispatch(TimerFired("x"))
        assert driver.exit is None
        assert read_checkpoint(path).global_step == 6
        assert marker_state(path, 6).status.name == "ABSENT"
        assert "final marker of the replaced checkpoint removed" in log.getvalue()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.bin"]
        # Looked for once: the next write does not look (or log) again.
        await driver.dispatch(TimerFired("y"))
        assert read_checkpoint(path).global_step == 7
        assert log.getvalue().count("final marker") == 1

    run(scenario)


def test_a_checkpoint_whose_directory_cannot_be_synced_is_named_as_in_place_not_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rename happened: the last line must not name the checkpoint before as the one kept
    (nor the log say it was not replaced), and must not call the new one durable either."""
    real_fsync_path = atomic.fsync_path

    def directories_fail(path: Path) -> None:
        if path.is_dir():
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real_fsync_path(path)

    async def scenario() -> None:
        path = tmp_path / "ckpt.bin"
        write_checkpoint(path, checkpoint_at(4))
        write_final_marker(path, 4)
        monkeypatch.setattr(atomic, "fsync_path", directories_fail)
        driver, log = periodic_writes_driver(tmp_path, [6])
        await driver.dispatch(TimerFired("x"))
        assert driver.exit is not None and driver.exit.code == 1
        assert driver.exit.reason.startswith("checkpoint write failed: CKPT_IO: directory sync: ")
        assert read_checkpoint(path).global_step == 6
        kept = driver.last_checkpoint
        assert kept == DurableCheckpoint(path, 6, CheckpointKind.PERIODIC, synced=False)
        assert kept.describe() == (
            f"last checkpoint {path} at global_step 6"
            " (in place, but not known durable: its directory could not be synced)"
        )
        assert "final marker of the replaced checkpoint removed" in log.getvalue()
        assert "not replaced" not in log.getvalue()
        assert "checkpoint written" not in log.getvalue()

    run(scenario)


def test_a_first_checkpoint_write_that_fails_keeps_the_marker_of_the_file_it_did_not_replace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    full_for_checkpoints = open_out_of_space(lambda name: name.startswith(".ckpt.bin."))

    async def scenario() -> None:
        path = tmp_path / "ckpt.bin"
        write_checkpoint(path, checkpoint_at(12))
        write_final_marker(path, 12)
        monkeypatch.setattr(checkpoint_writer, "open", full_for_checkpoints, raising=False)
        driver, _ = periodic_writes_driver(tmp_path, [13])
        await driver.dispatch(TimerFired("x"))
        assert driver.exit is not None and driver.exit.code == 1
        assert read_checkpoint(path).global_step == 12
        assert marker_state(path, 12).status.name == "FINAL"  # as true as it was

    run(scenario)


def test_a_marker_that_cannot_be_removed_fails_the_run_before_the_checkpoint_is_replaced(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        driver, _ = periodic_writes_driver(tmp_path, [6])
        path = tmp_path / "ckpt.bin"
        (tmp_path / "ckpt.bin.final").mkdir()  # unlink() cannot remove a directory
        (tmp_path / "ckpt.bin.final" / "x").touch()
        await driver.dispatch(TimerFired("x"))
        assert driver.exit is not None and driver.exit.code == 1
        assert driver.exit.reason.startswith("checkpoint write failed: CKPT_IO: remove: ")
        assert f"(file {path}.final)" in driver.exit.reason
        assert not path.exists() and driver.last_checkpoint is None

    run(scenario)


def open_out_of_space(full: Callable[[str], bool]) -> Callable[..., Any]:
    """``open`` as it behaves on a full disk for the files whose name ``full`` picks: their
    bytes never fit (ENOSPC at the first write)."""
    real_open = open

    def opener(file: Path, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        opened = real_open(file, mode, *args, **kwargs)
        if full(Path(file).name):
            opened.write = _no_space
        return opened

    return opener


def _no_space(data: object) -> int:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


class IdleSource:
    """An event source with nothing to say: waits until the requested time, then ``None``."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock

    async def next_event(self, until: float | None) -> Event | None:
        await anyio.sleep(math.inf if until is None else 0.01)
        self.clock.set(max(self.clock.now(), until or 0.0))
        return None


class OneEvent(IdleSource):
    """Says ``event`` once, then nothing."""

    def __init__(self, clock: FakeClock, event: Event) -> None:
        super().__init__(clock)
        self.event: Event | None = event

    async def next_event(self, until: float | None) -> Event | None:
        event, self.event = self.event, None
        return event if event is not None else await super().next_event(until)


async def run_stopped_after(driver: Driver, delay: float, source: Any) -> Exit:
    """``driver.run(source)`` with a SIGTERM stop request ``delay`` seconds in."""
    async with anyio.create_task_group() as tasks:

        async def stop_later() -> None:
            await anyio.sleep(delay)
            driver.request_stop(143, "stopped by SIGTERM")

        tasks.start_soon(stop_later)
        with anyio.fail_after(5):
            return await driver.run(source)


def test_a_failures_shutdown_that_a_stop_cut_short_is_run_again_to_its_end(
    tmp_path: Path,
) -> None:
    """A failed write ends the run; a stop signal during its shutdown cancelled the shutdown,
    and the run returned with the connections' flush cut short."""

    class SlowShutdown(RecordingTransport):
        driver: Driver | None = None
        clock = FakeClock()

        async def shutdown(self, grace: float) -> None:
            self.calls.append(("shutdown started", grace))
            driver = self.driver
            if driver is not None:  # a stop signal while the failure's flush goes on
                self.driver = None
                self.clock.set(self.clock.now() + 1.0)  # a second of the grace went by
                driver.request_stop(143, "stopped by SIGTERM")
            await anyio.sleep(0.5)  # the flush of the queues, cancellable
            await super().shutdown(grace)

    async def scenario() -> None:
        transport = SlowShutdown()
        clock = transport.clock
        driver = Driver(
            Scripted([WriteCheckpoint(checkpoint_at(1))]),
            transport,
            clock,
            outputs=Outputs(checkpoint_path=tmp_path / "missing" / "ckpt.bin"),
            log=KeyValueLog(io.StringIO()),
        )
        transport.driver = driver
        with anyio.fail_after(5):
            result = await driver.run(OneEvent(clock, TimerFired("x")))
        assert result.code == 1 and "checkpoint write failed" in result.reason
        grace = driver.shutdown_grace
        assert transport.calls == [
            ("shutdown started", grace),  # the failure's, cut short by the stop
            ("shutdown started", grace - 1.0),  # what was left of the grace, not all of it
            ("shutdown", grace - 1.0),
        ]

    run(scenario)


def test_request_stop_ends_run_and_shuts_down() -> None:
    async def scenario() -> None:
        clock = FakeClock()
        transport = RecordingTransport()
        driver = Driver(Scripted(), transport, clock, log=KeyValueLog(io.StringIO()))
        result = await run_stopped_after(driver, 0.05, IdleSource(clock))
        assert result == Exit(143, "stopped by SIGTERM")
        assert transport.calls[-1][0] == "shutdown"

    run(scenario)


def test_a_stop_request_does_not_cut_short_the_flush_of_an_exit() -> None:
    # A signal while a finished run's SHUTDOWNs were still leaving cancelled the flush, the
    # frames were cut, and the daemon still exited 0: the learner never got its SHUTDOWN.
    class SlowFlush(RecordingTransport):
        flushed = False

        async def shutdown(self, grace: float) -> None:
            await anyio.sleep(0.3)
            self.flushed = True

    async def scenario() -> None:
        clock = FakeClock()
        transport = SlowFlush()
        driver = Driver(
            Scripted([Exit(0, "finalized")]), transport, clock, log=KeyValueLog(io.StringIO())
        )
        result = await run_stopped_after(driver, 0.1, OneEvent(clock, TimerFired("last ack")))
        assert result == Exit(0, "finalized")
        assert transport.flushed

    run(scenario)


def test_a_stop_before_the_final_marker_leaves_the_checkpoint_described_as_unmarked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A signal during the final checkpoint's write: the write finished (not cancellable), the
    # marker after it was never attempted, and the last line still said "final checkpoint".
    path = tmp_path / "ckpt.bin"
    write = checkpoint_writer.write_checkpoint

    def slow_write(*args: Any, **kwargs: Any) -> None:
        time.sleep(0.3)
        write(*args, **kwargs)

    monkeypatch.setattr(driver_module, "write_checkpoint", slow_write)
    script = [WriteCheckpoint(checkpoint_at(12), final=True), WriteFinalMarker(12), Exit(0, "done")]

    async def scenario() -> DurableCheckpoint | None:
        clock = FakeClock()
        outputs = Outputs(checkpoint_path=path, mark_final_checkpoint=True)
        driver = Driver(Scripted(script), RecordingTransport(), clock, outputs=outputs,
                        log=KeyValueLog(io.StringIO()))  # fmt: skip
        await run_stopped_after(driver, 0.1, OneEvent(clock, TimerFired("last ack")))
        return driver.last_checkpoint

    box: list[DurableCheckpoint | None] = []

    async def main() -> None:
        box.append(await scenario())

    run(main)
    kept = box[0]
    assert kept is not None and kept.global_step == 12
    assert kept.kind is CheckpointKind.FINAL_UNMARKED
    assert marker_state(path, 12).status.name != "FINAL"


def test_run_feeds_due_timers_between_events() -> None:
    async def scenario() -> None:
        clock = FakeClock()
        coordinator = Scripted([SetTimer("t", 5.0)], [Exit(0, "done")])
        driver = Driver(coordinator, RecordingTransport(), clock)
        await driver.dispatch(TimerFired("boot"))
        with anyio.fail_after(5):
            result = await driver.run(IdleSource(clock))
        assert result == Exit(0, "done")
        assert coordinator.seen[1] == (TimerFired("t"), 5.0)

    run(scenario)


def test_key_value_log_lines() -> None:
    stream = io.StringIO()
    log = KeyValueLog(stream)
    log("info", "round committed", {"step": 3, "ok": True, "why": 'a "b" c', "ids": [0, 1]})
    log("debug", "hidden below info", {})
    (line,) = stream.getvalue().splitlines()
    ts, rest = line.split(" ", 1)
    assert ts.startswith("ts=") and ts.endswith("Z")
    assert rest == 'level=info msg="round committed" step=3 ok=true why="a \\"b\\" c" ids=[0,1]'


@pytest.mark.parametrize("action", [Log("warning", "careful", {"n": 1})])
def test_log_actions_reach_the_log(action: Log) -> None:
    async def scenario() -> None:
        stream = io.StringIO()
        driver = Driver(
            Scripted([action]), RecordingTransport(), FakeClock(), log=KeyValueLog(stream)
        )
        await driver.dispatch(TimerFired("x"))
        assert "level=warning" in stream.getvalue() and "msg=careful n=1" in stream.getvalue()

    run(scenario)


def test_lines_any_peer_can_cause_are_written_once_per_period_and_kind() -> None:
    def refused(code: str) -> Log:
        return Log("warning", "HELLO refused", {"code": code}, throttled=True)

    async def scenario() -> None:
        stream, clock = io.StringIO(), FakeClock()
        floods = [[refused("SESSION_DTYPE_MISMATCH")] * 50 + [refused("LEARNER_ID_OUT_OF_RANGE")]]
        driver = Driver(
            Scripted(*floods, [refused("SESSION_DTYPE_MISMATCH")]),
            RecordingTransport(),
            clock,
            log=KeyValueLog(stream),
        )
        await driver.dispatch(TimerFired("flood"))
        clock.set(60.0)  # a period later: the next line says how many were held back
        await driver.dispatch(TimerFired("later"))
        lines = stream.getvalue().splitlines()
        assert [line.split("code=")[1].split()[0] for line in lines] == [
            "SESSION_DTYPE_MISMATCH",  # the first of its kind
            "LEARNER_ID_OUT_OF_RANGE",  # another reason is another kind
            "SESSION_DTYPE_MISMATCH",
        ]
        assert "held_back=49" in lines[2]

    run(scenario)


def test_resume_refusals_of_different_checks_are_each_written() -> None:
    # They share text and code: a learner failing check 7 right after one failing check 5
    # left no line naming the second reason (spec/checkpoint.md § 4: the log names every one).
    def refused(check: int) -> Log:
        fields = {"code": "CKPT_RESUME_INELIGIBLE", "check": check}
        return Log("warning", "HELLO refused: the checkpoint cannot resume", fields, throttled=True)

    async def scenario() -> None:
        stream = io.StringIO()
        script = [refused(5), refused(5), refused(7)]
        driver = Driver(
            Scripted(script), RecordingTransport(), FakeClock(), log=KeyValueLog(stream)
        )
        await driver.dispatch(TimerFired("two learners"))
        assert [line.split("check=")[1].split()[0] for line in stream.getvalue().splitlines()] == [
            "5",
            "7",
        ]

    run(scenario)


class _ClosedPipe(io.StringIO):
    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


def test_a_log_whose_reader_went_away_stops_logging_and_never_raises() -> None:
    log = KeyValueLog(_ClosedPipe())
    log("info", "first", {"k": 1})
    log("error", "second", {})
    assert log.broken


def test_events_that_come_back_to_back_still_let_other_tasks_run() -> None:
    """A learner flooding HEARTBEATs refilled the backlog as fast as the driver drained it,
    and no await suspended: the event loop never polled another socket (a new peer's HELLO
    waited 10 s, then timed out)."""

    class Flood:
        async def next_event(self, until: float | None) -> Event | None:
            return TimerFired("beat")  # always ready, never suspends

    async def scenario() -> None:
        turns = 0

        async def other_peer() -> None:
            nonlocal turns
            while True:
                turns += 1
                await anyio.lowlevel.checkpoint()

        coordinator = Scripted(*([] for _ in range(640)), [Exit(0, "done")])
        driver = Driver(coordinator, RecordingTransport(), FakeClock())
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(other_peer)
            await anyio.lowlevel.checkpoint()
            seen = turns
            assert await driver.run(Flood()) == Exit(0, "done")
            tasks.cancel_scope.cancel()
        assert turns - seen >= 640 // EVENTS_PER_TURN

    run(scenario)
