"""The ``yeto-sync`` command line: flags, startup refusals, signals, resume, HELLO auth."""

from __future__ import annotations

import gc
import hashlib
import io
import json
import os
import resource
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from daemon_harness import REPO, Daemon, error_code, wait_until
from scripted_learner import (
    LearnerGroup,
    ScriptedLearner,
    SessionSpec,
    SyncerError,
    play_in_thread,
)
from signal_hooks import AFTER_CALL, ON_IMPORT, command, processes_with_environment
from test_checkpoint import make_checkpoint

from yeto_proto import MergeMode, WireDtype, WireFragment, WireLayout
from yeto_proto.checkpoint import (
    read_checkpoint,
    write_checkpoint,
    write_final_marker,
)
from yeto_proto.constants import IsoBackend
from yeto_sync import daemon as daemon_module
from yeto_sync import open_file_limit
from yeto_sync.config import SyncerConfig
from yeto_sync.driver import KeyValueLog
from yeto_sync.events import Exit
from yeto_sync.stop_signals import StopSignals

LAYOUT = WireLayout((WireFragment(MergeMode.AVG, (4096,)), WireFragment(MergeMode.AVG, (64,))))
SPEC = SessionSpec(WireDtype.BF16, LAYOUT, bytes(range(32)), bytes(range(64, 96)))
PINNED_FLAGS = (
    "--port --learners --quorum --grace-ms --grace-gamma --grace-tau --pipeline "
    "--min-round-interval-ms --sync-interval-steps --delta-correction --quorum-timeout-s "
    "--final-ack-timeout-s --total-steps --outer-lr --outer-momentum --iso-backend "
    "--iso-worker-queue-capacity --final-state --checkpoint-path --checkpoint-every --resume "
    "--mark-final-checkpoint --learner-budget-steps --event-tape --max-base-lag "
    "--learner-weight --require-profile-binding --host --print-profile-hash "
    "--hello-hmac-key-file"
).split()


def yeto_sync(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "yeto_sync", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )


def test_help_documents_every_flag() -> None:
    result = yeto_sync("--help")
    assert result.returncode == 0
    for flag in PINNED_FLAGS:
        assert flag in result.stdout, flag
    for choice in ("heloco", "torch-svd", "tokens2-over-steps", "29400", "127.0.0.1"):
        assert choice in result.stdout


def test_print_profile_hash_is_the_pinned_digest_of_the_flags() -> None:
    result = yeto_sync(
        "--learners=3",
        "--total-steps=1000",
        "--quorum=2",
        "--grace-ms=250",
        "--pipeline=3",
        "--delta-correction=none",
        "--outer-lr=0.5",
        "--checkpoint-path=/nowhere/ckpt",  # enables checkpoints; the path itself is excluded
        "--max-base-lag=4",
        "--learner-weight=equal",
        "--print-profile-hash",
    )
    assert result.returncode == 0, result.stderr
    # PINNED.md § HELLO and DATA_HELLO, "Syncer profile hash", field by field.
    body = b"yeto-syncer-semantic-profile-v1\0" + struct.pack(
        "<IIQddIQdBQQQBffBQBBB",
        3,  # learners
        2,  # quorum
        250,  # grace_ms
        0.8,  # grace_gamma
        2.0,  # grace_tau
        3,  # pipeline
        0,  # min_round_interval_ms
        24.0,  # sync_interval_steps
        0,  # delta_correction none
        900,  # quorum_timeout_s
        900,  # final_ack_timeout_s = the quorum timeout
        1000,  # total_steps
        0,  # policy_sweep_fragments: absent
        0.5,  # outer_lr
        0.9,  # outer_momentum
        1,  # checkpoint_enabled
        8,  # checkpoint_every
        0,  # resume
        0,  # mark_final_checkpoint
        0,  # learner_budget_steps: absent
    )
    body += struct.pack("<BQBB", 1, 4, 1, 0)  # max_base_lag present = 4, equal weights, binding
    assert result.stdout == hashlib.sha256(body).hexdigest() + "\n"


def test_refuses_to_start_over_an_existing_checkpoint(tmp_path: Path) -> None:
    checkpoint = tmp_path / "ckpt"
    checkpoint.write_bytes(b"precious")
    result = yeto_sync("--learners=1", "--total-steps=4", f"--checkpoint-path={checkpoint}")
    assert result.returncode == 2
    assert result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert "exists" in line and "--resume" in line
    assert checkpoint.read_bytes() == b"precious"


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--learners=0", "--total-steps=4"], "--learners"),
        (["--learners=4294967296", "--total-steps=4"], "--learners must be in 1..4294967295"),
        (["--learners=1", "--total-steps=4", "--resume"], "--checkpoint-path"),
        (["--learners=1", "--total-steps=4", "--resume", "--checkpoint-path=/no/such"], "no "),
        (["--learners=1", "--total-steps=4", "--hello-hmac-key-file=/no/such"], "key"),
        (["--learners=x", "--total-steps=4"], "--learners"),  # argparse's usage errors too
        (["--learners=1", "--total-steps=4", "--res"], "--res"),  # no abbreviated flags
        (["--learners=1", "--total-steps=4", "--outer-lr=1e39"], "--outer-lr"),
        (["--learners=1", "--total-steps=4", "--quorum-timeout-s=0"], "--quorum-timeout-s"),
        (["--learners=1", "--total-steps=4", "--event-tape=/no/such/tape"], "--event-tape"),
        (["--learners=1", "--total-steps=4", "--checkpoint-path=/no/such/c"], "no directory"),
        (["--learners=1", "--total-steps=4", "--final-state=/"], "--final-state"),
        # The resolver raised UnicodeError for it: a traceback and exit 0.
        (["--learners=1", "--total-steps=4", "--host=a..b"], "--host 'a..b': not a valid host"),
    ],
)
def test_bad_startup_input_is_one_line_and_exit_2(flags: list[str], words: str) -> None:
    result = yeto_sync(*flags)
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert line.startswith("yeto-sync: error: ") and words in line


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_syncer_raises_its_soft_open_file_limit_to_the_hard_one() -> None:
    """A shell's soft limit of 1,024 would cap the syncer's sockets far below the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 64:
        pytest.skip(f"a hard open-file limit of {hard} leaves nothing to raise to")
    after = open_file_limit.UNBOUNDED_HARD_TARGET if hard == resource.RLIM_INFINITY else hard

    def low_soft_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))

    daemon = subprocess.Popen(
        [sys.executable, "-m", "yeto_sync", "--learners=1", "--total-steps=4", "--port=0"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        preexec_fn=low_soft_limit,
    )
    try:
        assert daemon.stdout is not None
        assert daemon.stdout.readline().startswith("yeto-sync listening on ")
        limits = Path(f"/proc/{daemon.pid}/limits").read_text()
    finally:
        daemon.terminate()
        _, errors = daemon.communicate(timeout=30)
    assert f'msg="open file limit raised" before=64 after={after}' in errors, errors
    (line,) = [row for row in limits.splitlines() if row.startswith("Max open files")]
    assert line.split()[3] == str(after), line


@pytest.mark.parametrize(
    ("flag", "length", "named"),
    [
        # ENAMETOOLONG from the marker's name (checkpoint + ".final"): it was a traceback.
        ("--checkpoint-path", 250, "--checkpoint-path"),
        # Fits, but the temporary name of every write does not: it served, then failed.
        ("--checkpoint-path", 235, "--checkpoint-path"),
        ("--checkpoint-path", 228, "the final marker of --checkpoint-path"),  # when written
        ("--final-state", 235, "--final-state"),
        ("--event-tape", 300, "--event-tape"),
    ],
)
def test_an_output_name_too_long_is_refused_at_start(
    tmp_path: Path, flag: str, length: int, named: str
) -> None:
    path = tmp_path / ("n" * length)
    result = yeto_sync(
        "--learners=1", "--total-steps=4", f"{flag}={path}", "--mark-final-checkpoint"
    )
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.splitlines()
    shown = f"{path}.final" if "marker" in named else path
    assert line.startswith(f"yeto-sync: error: {named} {shown}: "), line
    assert "too long" in line.lower(), line
    assert not any(tmp_path.iterdir())


def test_a_marker_that_is_never_written_does_not_bound_the_checkpoint_name(
    tmp_path: Path,
) -> None:
    """Without --mark-final-checkpoint the marker is only ever removed: no temporary name."""
    path = tmp_path / ("n" * 228)
    daemon_module.check_output_paths(SyncerConfig(learners=1, total_steps=4, checkpoint_path=path))
    marked = SyncerConfig(
        learners=1, total_steps=4, checkpoint_path=path, mark_final_checkpoint=True
    )
    with pytest.raises(daemon_module.BadInput, match="the final marker of --checkpoint-path"):
        daemon_module.check_output_paths(marked)


@pytest.mark.parametrize(
    ("first", "second", "names"),
    [
        # The tape was appended to the checkpoint it resumed from: unreadable after a crash,
        # every tape line dropped by the next checkpoint's rename otherwise.
        (("--checkpoint-path", "ck"), ("--event-tape", "sub/../ck"), "--checkpoint-path"),
        (("--final-state", "out"), ("--event-tape", "out"), "--final-state"),
        (("--checkpoint-path", "ck"), ("--final-state", "ck.final"), "final marker"),
        (("--final-state", "out"), ("--event-tape", "link"), "--event-tape"),  # a hard link
        (("--checkpoint-path", "ck"), ("--event-tape", "alias"), "--event-tape"),  # a symlink
    ],
)
def test_two_outputs_naming_one_file_are_refused(
    tmp_path: Path, first: tuple[str, str], second: tuple[str, str], names: str
) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "out").write_bytes(b"")
    os.link(tmp_path / "out", tmp_path / "link")
    (tmp_path / "alias").symlink_to(tmp_path / "ck")  # dangling: ck does not exist yet
    flags = [f"{flag}={tmp_path / name}" for flag, name in (first, second)]
    result = yeto_sync("--learners=1", "--total-steps=4", *flags)
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.splitlines()
    assert line.endswith("name the same file") and names in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["alias", "link", "out", "sub"]


def test_outputs_replaced_by_name_may_be_links_to_one_another(tmp_path: Path) -> None:
    """The checkpoint, its marker and the final state are renamed into place: a symlink or a
    hard link at one of those names is replaced, never followed, so it clashes with nothing.
    A symlink loop there is not a traceback either (Path.resolve raised RuntimeError)."""
    (tmp_path / "ck").write_bytes(b"")
    (tmp_path / "final").symlink_to(tmp_path / "ck")
    os.link(tmp_path / "ck", tmp_path / "hard")
    (tmp_path / "ck.final").symlink_to(tmp_path / "ck.final")  # a loop, at the marker's name
    (tmp_path / "tape").symlink_to(tmp_path / "tape")
    for final_state in ("final", "hard"):
        config = SyncerConfig(
            learners=1,
            total_steps=4,
            checkpoint_path=tmp_path / "ck",
            final_state=tmp_path / final_state,
            event_tape=tmp_path / "tape",
        )
        daemon_module.check_output_paths(config)  # nothing refused


def test_refuses_to_start_beside_an_earlier_runs_final_marker(tmp_path: Path) -> None:
    """A new run could write a checkpoint at the step the stale marker names: it would read
    as a final cut."""
    checkpoint = tmp_path / "ckpt"
    write_final_marker(checkpoint, 4)
    result = yeto_sync("--learners=1", "--total-steps=4", f"--checkpoint-path={checkpoint}")
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert "final marker" in line and not checkpoint.exists()


@pytest.mark.parametrize("kind", ["backend", "V1", "V3 without a contract"])
def test_a_checkpoint_no_hello_could_resume_is_refused_at_start(tmp_path: Path, kind: str) -> None:
    checkpoint = tmp_path / "ckpt"
    if kind == "V1":  # the conformance suite's V1 file: nothing writes V1 any more
        checkpoint.write_bytes((REPO / "conformance" / "checkpoints" / "v1_full.bin").read_bytes())
        words = "V1 checkpoints never resume"
    elif kind == "V3 without a contract":  # served, refusing every learner
        write_checkpoint(checkpoint, make_checkpoint())
        os.truncate(checkpoint, checkpoint.stat().st_size - 36)  # a copy cut in its trailer
        words = "no session contract"
    else:
        write_checkpoint(checkpoint, make_checkpoint(iso_backend=IsoBackend.TORCH_SVD))
        words = "iso backend torch-svd"
    result = yeto_sync(
        "--learners=1", "--total-steps=9", f"--checkpoint-path={checkpoint}", "--resume"
    )
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"yeto-sync: error: --resume: {checkpoint}: CKPT_RESUME_INELIGIBLE: ")
    assert words in line


def test_a_resumed_daemon_keeps_no_second_copy_of_the_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The start-up code kept the resumed checkpoint referenced for the whole run: once every
    # fragment had committed, the syncer still held the old params and momentum (8 bytes per
    # parameter more than a fresh run).
    checkpoint = tmp_path / "ckpt"
    write_checkpoint(checkpoint, make_checkpoint())
    seen: list[bool] = []

    def serve_nothing(serve: object, config: object, coordinator: Any, *rest: object) -> object:
        params = weakref.ref(coordinator._checkpoint.fragments[0].params)
        coordinator._checkpoint = None  # as the session's install does
        gc.collect()
        seen.append(params() is not None)
        return Exit(0, "served"), "kept"

    monkeypatch.setattr(daemon_module.anyio, "run", serve_nothing)
    argv = ["--learners=1", "--total-steps=9", "--port=0", f"--checkpoint-path={checkpoint}"]
    done: list[int] = []
    thread = threading.Thread(  # not the main thread: the daemon installs no signal handlers
        target=lambda: done.append(daemon_module.main([*argv, "--resume"]))
    )
    thread.start()
    thread.join(30)
    assert done == [0] and seen == [False]


def test_doubtful_settings_start_with_a_warning_each(tmp_path: Path) -> None:
    """The pinned command line takes them (a drop-in refuses nothing the reference takes), but
    --outer-momentum 1.5 trained a worse model without a word."""
    checkpoint = tmp_path / "ckpt"
    write_checkpoint(checkpoint, make_checkpoint(global_step=5))
    write_final_marker(checkpoint, 5)
    flags = ["--learners=1", "--total-steps=4", "--outer-momentum=1.5"]
    with Daemon(*flags, f"--checkpoint-path={checkpoint}", "--resume") as daemon:
        wait_until(lambda: "listening" in daemon.stderr, 10, "the listening log line")
        warnings = [line for line in daemon.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 4, warnings
    assert "--outer-momentum 1.5 is outside [0, 1)" in warnings[0]
    assert "at global_step 5, at or past --total-steps 4" in warnings[1]
    assert "the run of this checkpoint had finished" in warnings[2]
    assert "a learner that already got its SHUTDOWN does not come back" in warnings[2]
    assert not any("does not mark this checkpoint" in w for w in warnings), warnings
    # The checkpoint's ledger has ids 0 and 3: 3 is no learner of a --learners 1 session.
    assert "ledger counts learner ids 3, outside 0..0 (--learners 1)" in warnings[3]


def test_a_stop_swallowed_before_the_signal_receiver_opened_is_still_met() -> None:
    # Raised in an event-loop callback, a Stopped is only logged there ("Exception in
    # callback"); the daemon then served on, and a second signal only said "still stopping".
    class Recorder:
        shutdown_grace = 5.0
        stops: list[tuple[int, str]] = []

        def request_stop(self, code: int, reason: str) -> None:
            self.stops.append((code, reason))

    signals = StopSignals("yeto-sync")  # not installed: its first signal already came
    signals.received, signals.stopping = signal.SIGTERM, True
    driver = Recorder()

    async def scenario() -> None:
        async with anyio.create_task_group() as tasks:
            await tasks.start(
                daemon_module._stop_on_signal, driver, signals, KeyValueLog(io.StringIO())
            )
            await anyio.wait_all_tasks_blocked()
            tasks.cancel_scope.cancel()

    anyio.run(scenario)
    assert driver.stops == [(128 + signal.SIGTERM, "stopped by SIGTERM")]


def test_a_marker_of_another_step_is_not_taken_for_a_finished_run(tmp_path: Path) -> None:
    checkpoint = tmp_path / "ckpt"
    write_checkpoint(checkpoint, make_checkpoint(global_step=5))
    write_final_marker(checkpoint, 3)  # an older run's, beside a later periodic checkpoint
    flags = ["--learners=1", "--total-steps=9", f"--checkpoint-path={checkpoint}", "--resume"]
    with Daemon(*flags) as daemon:
        wait_until(lambda: "listening" in daemon.stderr, 10, "the listening log line")
        warnings = [line for line in daemon.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 2, warnings  # and the ledger's id 3, outside --learners 1
    assert "ledger counts learner ids 3" in warnings[1]
    assert "does not mark this checkpoint as final" in warnings[0]
    assert "had finished" not in warnings[0]


def test_temporary_files_of_a_crashed_write_are_removed_at_start(tmp_path: Path) -> None:
    # A kill -9 mid-write leaves one as large as the checkpoint; a restart loop filled the disk.
    checkpoint = tmp_path / "ckpt"
    write_checkpoint(checkpoint, make_checkpoint(global_step=5))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    orphan = tmp_path / f".ckpt.{int(gone.stdout)}.0123456789ab.tmp"
    orphan.write_bytes(bytes(1000))
    os.utime(orphan, (time.time() - 120, time.time() - 120))  # not just written
    flags = ["--learners=1", "--total-steps=9", f"--checkpoint-path={checkpoint}"]
    refused = yeto_sync(*flags)  # no --resume: refused, and a refusal changes nothing
    assert refused.returncode == 2 and len(refused.stderr.splitlines()) == 1, refused.stderr
    assert orphan.exists()
    with Daemon(*flags, "--resume") as daemon:
        wait_until(lambda: "listening" in daemon.stderr, 10, "the listening log line")
        removed = [line for line in daemon.stderr.splitlines() if "crashed write" in line]
    assert not orphan.exists()
    assert len(removed) == 1 and "bytes=1000" in removed[0], removed


def test_a_marker_that_is_a_directory_is_refused_at_start(tmp_path: Path) -> None:
    # Found only at the first checkpoint write, which ended the run (CKPT_IO), maybe hours in.
    checkpoint = tmp_path / "ckpt"
    write_checkpoint(checkpoint, make_checkpoint(global_step=5))
    (tmp_path / "ckpt.final").mkdir()
    result = yeto_sync(
        "--learners=1", "--total-steps=9", f"--checkpoint-path={checkpoint}", "--resume"
    )
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert "ckpt.final is a directory" in line


@pytest.mark.parametrize("signals", [1, 2])
def test_a_signal_right_after_the_ready_line_stops_cleanly(signals: int) -> None:
    """The handlers are in place before the ready line; a second signal only says so."""
    with Daemon("--learners=1", "--total-steps=4") as daemon:
        for _ in range(signals):
            daemon.signal(signal.SIGTERM)
        assert daemon.wait(15) == 128 + signal.SIGTERM
        lines = daemon.stderr.splitlines()
    assert lines[-1] == "yeto-sync: stopped by SIGTERM; no checkpoint was written"
    # The first signal says at once that the daemon is stopping, and for how long at most.
    (stopping,) = [line for line in lines if "msg=stopping " in line]
    assert "signal=SIGTERM" in stopping and "grace_s=5.0" in stopping


@pytest.mark.parametrize(
    ("module", "stop"),
    [("ml_dtypes", signal.SIGINT), ("numpy", signal.SIGTERM), ("anyio", signal.SIGTERM)],
    ids=["ml_dtypes-sigint", "numpy-sigterm", "anyio-sigterm"],
)
def test_a_signal_while_the_daemon_loads_is_its_last_line(
    module: str, stop: signal.Signals
) -> None:
    """Ctrl+C as ml_dtypes loaded printed a KeyboardInterrupt traceback; SIGTERM killed the
    daemon without a word. The console entry point handles the signals before those imports."""
    argv = command(
        ON_IMPORT, [module, str(int(stop))], "yeto-sync",
        "--learners=1", "--total-steps=4", "--host=127.0.0.1", "--port=0",
    )  # fmt: skip
    done = subprocess.run(
        argv, cwd=REPO, capture_output=True, text=True, timeout=60,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert done.returncode == 128 + stop, done.stderr
    assert done.stdout == ""  # it never listened
    assert done.stderr.splitlines() == [
        f"yeto-sync: {stop.name} while starting; no checkpoint written"
    ]


def test_a_signal_while_the_iso_workers_start_leaves_none_behind(tmp_path: Path) -> None:
    """SIGTERM while the torch-svd workers start (after the first wait for them): one line,
    and no worker left running."""
    run_mark = f"YETO_TEST_RUN={tmp_path}"
    argv = command(
        AFTER_CALL, ["yeto_sync.iso.pool.wait", str(int(signal.SIGTERM))], "yeto-sync",
        "--learners=1", "--total-steps=4", "--host=127.0.0.1", "--port=0",
        "--iso-backend=torch-svd",
    )  # fmt: skip
    environment = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "YETO_ISO_WORKERS": "2"}
    name, value = run_mark.split("=", 1)
    done = subprocess.run(
        argv, cwd=REPO, capture_output=True, text=True, timeout=120,
        env={**environment, name: value},
    )  # fmt: skip
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert done.stdout == ""
    assert done.stderr.splitlines() == ["yeto-sync: SIGTERM while starting; no checkpoint written"]
    wait_until(lambda: not processes_with_environment(run_mark), 10, "the workers to be gone")


def test_the_entry_module_imports_nothing_heavy() -> None:
    code = "import json, sys, yeto_sync.cli; print(json.dumps([m for m in sys.modules]))"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    loaded = {name.split(".")[0] for name in json.loads(done.stdout)}
    assert not loaded & {"numpy", "ml_dtypes", "anyio", "construct", "torch", "yeto_proto"}


@pytest.mark.parametrize("closed", ["reader", "stdout"])
def test_a_closed_stdout_loses_only_the_ready_line(closed: str) -> None:
    """`yeto-sync … | true` (or `>&-`): the daemon logs the lost ready line and serves on."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    argv = [sys.executable, "-m", "yeto_sync", "--learners=1", "--total-steps=4",
            "--host=127.0.0.1", f"--port={port}"]  # fmt: skip
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        daemon = subprocess.Popen(
            ["sh", "-c", 'exec "$@" >&-', "sh", *argv] if closed == "stdout" else argv,
            cwd=REPO, stdout=write_end, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
    finally:
        os.close(write_end)
    try:
        wait_until(lambda: _accepts(port), 30, "the daemon to listen")
        time.sleep(0.2)  # past the ready line
        assert daemon.poll() is None, "a closed stdout ended the daemon"
        if closed == "stdout" and os.path.isdir(f"/proc/{daemon.pid}/fd"):
            # Descriptor 1 stays taken: the listener (or the tape) did not get it.
            assert os.readlink(f"/proc/{daemon.pid}/fd/1") == os.devnull
        daemon.send_signal(signal.SIGTERM)
        _, errors = daemon.communicate(timeout=15)
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
    assert daemon.returncode == 128 + signal.SIGTERM, errors
    assert "Traceback" not in errors and "ready line was not delivered" in errors, errors
    assert errors.splitlines()[-1] == "yeto-sync: stopped by SIGTERM; no checkpoint was written"


def test_a_closed_stderr_and_stdin_leave_the_daemon_serving() -> None:
    """`yeto-sync … 2>&- <&-`: writing its log to a None stderr ended it at once with exit 1;
    the listener took descriptor 0."""
    argv = [sys.executable, "-m", "yeto_sync", "--learners=1", "--total-steps=4",
            "--host=127.0.0.1", "--port=0"]  # fmt: skip
    daemon = subprocess.Popen(
        ["sh", "-c", 'exec "$@" 2>&- <&-', "sh", *argv],
        cwd=REPO, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert daemon.stdout is not None
        ready = daemon.stdout.readline()
        assert ready.startswith("yeto-sync listening on 127.0.0.1:"), ready
        if os.path.isdir(f"/proc/{daemon.pid}/fd"):
            assert os.readlink(f"/proc/{daemon.pid}/fd/0") == os.devnull
            assert os.readlink(f"/proc/{daemon.pid}/fd/2") == os.devnull
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=15)
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
        if daemon.stdout is not None:
            daemon.stdout.close()
    assert daemon.returncode == 128 + signal.SIGTERM


def _accepts(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_a_port_in_use_is_one_line_and_nonzero() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = yeto_sync("--learners=1", "--total-steps=4", "--host=127.0.0.1", f"--port={port}")
    assert result.returncode == 1
    (line,) = result.stderr.splitlines()
    assert "cannot listen" in line


def test_under_nohup_a_hangup_leaves_the_daemon_running() -> None:
    with Daemon("--learners=1", "--total-steps=4", nohup=True) as daemon:
        daemon.signal(signal.SIGHUP)
        time.sleep(0.5)
        assert daemon.proc is not None and daemon.proc.poll() is None, daemon.stderr
        daemon.signal(signal.SIGTERM)
        assert daemon.wait(15) == 128 + signal.SIGTERM


def test_sigterm_keeps_the_last_checkpoint_and_resume_finishes_the_run(tmp_path: Path) -> None:
    checkpoint = tmp_path / "ckpt"
    flags = [
        "--learners=1",
        "--total-steps=6",
        "--sync-interval-steps=0",
        f"--checkpoint-path={checkpoint}",
        "--checkpoint-every=1",
    ]
    initial = [np.full(n, 0.5, np.float32) for n in LAYOUT.numels]
    paused, resume = threading.Event(), threading.Event()

    def pause_at_step_3(pull: object) -> None:
        if getattr(pull, "global_step", 0) == 3:
            paused.set()
            resume.wait(30)

    with Daemon(*flags) as first:
        learner = ScriptedLearner(
            LearnerGroup(first.address, SPEC, learner_id=0, generation=1, num_streams=1),
            initial=initial,
            before_push=pause_at_step_3,
        )
        failures: list[BaseException] = []
        thread = play_in_thread(learner, failures)
        wait_until(paused.is_set, 30, "step 3's PULL")
        wait_until(lambda: "global_step=2" in first.stderr, 30, "the step-2 checkpoint")
        started = time.monotonic()
        first.signal(signal.SIGTERM)
        code = first.wait(15)
        assert time.monotonic() - started < 10
        resume.set()
        thread.join(30)
    assert code == 128 + signal.SIGTERM
    last = first.stderr.strip().splitlines()[-1]
    assert "stopped by SIGTERM" in last and f"{checkpoint} at global_step 2" in last
    assert read_checkpoint(checkpoint).global_step == 2
    assert failures  # the learner saw its syncer go away

    # Stopped before it writes a checkpoint of its own, a resumed syncer names the one it
    # resumed from (it said "no checkpoint was written"); SIGHUP, as from a closed terminal,
    # stops it like SIGTERM.
    with Daemon(*flags, "--resume") as idle:
        idle.signal(signal.SIGHUP)
        assert idle.wait(15) == 128 + signal.SIGHUP
    last = idle.stderr.strip().splitlines()[-1]
    assert last == (
        f"yeto-sync: stopped by SIGHUP; the checkpoint it resumed from, {checkpoint} at "
        "global_step 2"
    ), idle.stderr
    assert read_checkpoint(checkpoint).global_step == 2

    with Daemon(*flags, "--resume") as second:
        learner = ScriptedLearner(
            LearnerGroup(second.address, SPEC, learner_id=0, generation=2, num_streams=1)
        )
        failures = []
        play_in_thread(learner, failures).join(60)
        assert not failures, f"{failures!r}\n{second.stderr}"
        assert second.wait(30) == 0, second.stderr
    # Resumed at the checkpoint's versions (1 and 2), never from version 0.
    assert sorted((f, v) for f, v, _ in learner.bcasts) == [
        (0, 1),
        (0, 3),
        (0, 5),
        (1, 2),
        (1, 4),
        (1, 6),
    ]
    assert read_checkpoint(checkpoint).global_step == 6


@pytest.mark.timeout(20)
def test_a_key_file_that_is_not_a_small_regular_file_is_refused_not_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A FIFO without a writer would wait forever, /dev/zero never end, and a large file
    (``--hello-hmac-key-file`` naming a checkpoint) is not a key."""
    monkeypatch.delenv(daemon_module.HMAC_KEY_ENV, raising=False)
    cap = daemon_module.MAX_HELLO_KEY_FILE_BYTES
    at_cap, over_cap = tmp_path / "at-cap", tmp_path / "over-cap"
    at_cap.write_bytes(b"k" * cap)
    over_cap.write_bytes(b"k" * (cap + 1))
    refused = {over_cap: f"larger than {cap} bytes"}
    if hasattr(os, "mkfifo"):
        os.mkfifo(tmp_path / "fifo")  # no writer holds it open: it reads as empty
        refused[tmp_path / "fifo"] = "key is empty"
    if os.path.exists("/dev/zero"):
        refused[Path("/dev/zero")] = "not a regular file or a pipe"
    refused[tmp_path] = "not a regular file or a pipe"
    for path, reason in refused.items():
        config = daemon_module.SyncerConfig(learners=1, total_steps=2, hello_hmac_key_file=path)
        with pytest.raises(daemon_module.BadInput, match=reason):
            daemon_module.load_hello_key(config)
    config = daemon_module.SyncerConfig(learners=1, total_steps=2, hello_hmac_key_file=at_cap)
    assert daemon_module.load_hello_key(config) == b"k" * cap


@pytest.mark.skipif(not os.path.exists("/dev/fd"), reason="no /dev/fd here")
def test_a_key_file_can_be_a_pipe(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--hello-hmac-key-file <(pass show key)``: a secret passed without a file on disk."""
    monkeypatch.delenv(daemon_module.HMAC_KEY_ENV, raising=False)
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, b"secret\n")
        os.close(write_end)
        key_file = Path(f"/dev/fd/{read_end}")
        config = daemon_module.SyncerConfig(learners=1, total_steps=2, hello_hmac_key_file=key_file)
        key = daemon_module.load_hello_key(config)
    finally:
        os.close(read_end)
    assert key == daemon_module.hello_key_of_file(b"secret\n")


def test_a_key_in_the_environment_that_is_not_utf8_or_too_long_is_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cap = daemon_module.MAX_HELLO_KEY_FILE_BYTES
    config = daemon_module.SyncerConfig(learners=1, total_steps=2)
    for value, reason in (
        (os.fsdecode(b"\xff"), "is not valid UTF-8"),  # how os.environ holds such bytes
        ("k" * (cap + 1), f"longer than {cap} bytes"),
    ):
        monkeypatch.setenv(daemon_module.HMAC_KEY_ENV, value)
        with pytest.raises(daemon_module.BadInput, match=reason):
            daemon_module.load_hello_key(config)
    monkeypatch.setenv(daemon_module.HMAC_KEY_ENV, "k" * cap)
    assert daemon_module.load_hello_key(config) == b"k" * cap


def test_hello_authentication_from_a_key_file_or_the_environment(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_bytes(b"s3cret\n")  # one trailing newline is not part of the key
    flags = ["--learners=1", "--total-steps=2", "--sync-interval-steps=0"]
    initial = [np.zeros(n, np.float32) for n in LAYOUT.numels]
    for extra, env in (
        ([f"--hello-hmac-key-file={key_file}"], {}),
        ([], {"YETO_ISLAND_HMAC_KEY": "s3cret"}),
    ):
        with Daemon(*flags, *extra, env=env) as daemon:
            forged = ScriptedLearner(
                LearnerGroup(
                    daemon.address,
                    SPEC,
                    learner_id=0,
                    generation=7,
                    num_streams=0,
                    hello_key=b"guess",
                )
            )
            forged.group.connect()
            with pytest.raises(SyncerError) as refused:
                forged.handle(forged.group.receive(10))
            forged.group.close()
            assert refused.value.text.startswith("HELLO authentication failed: ")
            assert error_code(refused.value.text) == "HELLO_AUTH_FAILED"
            honest = ScriptedLearner(
                LearnerGroup(
                    daemon.address,
                    SPEC,
                    learner_id=0,
                    generation=8,
                    num_streams=0,
                    hello_key=b"s3cret",
                ),
                initial=initial,
            )
            failures: list[BaseException] = []
            play_in_thread(honest, failures).join(60)
            assert not failures, f"{failures!r}\n{daemon.stderr}"
            assert daemon.wait(30) == 0
