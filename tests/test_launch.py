"""``yeto launch`` as a user runs it: one command, a syncer and M learner processes, a summary.

Output goes to a pipe here, as in CI: it must stay plain text (no terminal escapes).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch
from signal_hooks import AFTER_CALL, ON_FORK, ON_IMPORT, command, processes_naming
from syncer_process import REPO, child_env, running_syncer

from yeto_learn import bench_closure, cli, launch, process_control
from yeto_proto import Layout
from yeto_proto.checkpoint import is_marked_final, read_checkpoint

LAUNCH = [sys.executable, "-m", "yeto_learn.cli", "launch"]


def children_of(pid: int) -> list[int]:
    """Live processes whose parent is ``pid`` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces, so split after its ')'.
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid:
            found.append(int(entry.name))
    return found


def test_launch_trains_two_learners_and_summarizes(tmp_path: Path) -> None:
    out = tmp_path / "run"
    started = time.monotonic()
    result = subprocess.run(
        [*LAUNCH, "--learners", "2", "--steps", "160", "--fragments", "3",
         "--wire-dtype", "q4", "--streams", "2", "--out", str(out)],
        cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert elapsed < 60, f"yeto launch took {elapsed:.0f} s"
    text = result.stdout
    assert "\x1b[" not in text, "non-terminal output must be plain"
    assert "yeto launch: finished" in text
    losses = re.search(r"eval loss\s+([\d.]+) → ([\d.]+)", text)
    assert losses is not None, text
    assert float(losses.group(2)) < float(losses.group(1)) - 1.0
    assert re.search(r"bytes moved .*all-reduce data parallelism: .*less\)", text), text
    assert "learners agree   yes, bit for bit" in text

    checkpoint_path = out / "syncer" / "checkpoint.yeto"
    for path in (
        checkpoint_path,
        out / "syncer" / "final-state.yeto",
        out / "syncer" / "events.jsonl",
    ):
        assert path.is_file() and str(path) in text
    checkpoint = read_checkpoint(checkpoint_path)
    assert is_marked_final(checkpoint_path, checkpoint.global_step)
    # The layout launch writes for `yeto checkpoint export` of a kept checkpoint is the run's.
    assert Layout.from_json((out / "layout.json").read_text()).fingerprint() == (
        checkpoint.fingerprint
    )
    # Each learner's artifact is the syncer's final state, bit for bit, under its layout.
    for i in range(2):
        learner_dir = out / f"learner-{i}"
        layout = Layout.from_json((learner_dir / "layout.json").read_text())
        assert layout.fingerprint() == checkpoint.fingerprint
        state = torch.load(learner_dir / "model.pt")
        for fragment, values in zip(layout.fragments, checkpoint.fragments, strict=True):
            flat = np.concatenate([state[t.name].reshape(-1).numpy() for t in fragment.tensors])
            assert flat.tobytes() == values.params.tobytes()


def hangup_not_ignored() -> None:
    """In the child: SIGHUP at its default even where the tests run under ``nohup`` (an ignored
    signal stays ignored across exec, and a nohup'd yeto leaves SIGHUP alone)."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


@pytest.mark.parametrize(
    "signals",
    [[signal.SIGTERM], [signal.SIGTERM, signal.SIGINT], [signal.SIGHUP]],
    ids=["once", "twice", "hangup"],
)
def test_a_signal_stops_every_child_and_says_what_was_kept(
    tmp_path: Path, signals: list[signal.Signals]
) -> None:
    """A second signal while the children stop (Ctrl+C pressed again) changes nothing."""
    out = tmp_path / "run"
    launcher = subprocess.Popen(
        [*LAUNCH, "--learners", "2", "--steps", "100000", "--out", str(out)],
        cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=hangup_not_ignored,
    )  # fmt: skip
    try:
        assert launcher.stdout is not None
        first = launcher.stdout.readline()
        assert first.startswith("yeto launch: syncer on"), first
        deadline = time.monotonic() + 30
        children: list[int] = []
        while time.monotonic() < deadline and len(children) < 3:
            children = children_of(launcher.pid)
            time.sleep(0.2)
        assert len(children) == 3, "expected the syncer and two learners"
        time.sleep(2.0)  # let them train a little
        launcher.send_signal(signals[0])
        stopped = time.monotonic()
        for later in signals[1:]:
            time.sleep(0.01)
            launcher.send_signal(later)
        rest, errors = launcher.communicate(timeout=20)
        took = time.monotonic() - stopped
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 128 + signals[0], errors
    assert took < 10, f"stopping took {took:.1f} s"
    last = rest.strip().splitlines()[-1]
    assert last.startswith(f"yeto launch: stopped by {signals[0].name}"), last
    assert "every process ended" in last and "kept:" in last
    assert "no learner artifact was written" in last
    assert "Traceback" not in errors, errors
    for later in signals[1:]:
        assert f"yeto launch: {later.name} again; still stopping" in errors, errors
    for pid in children:
        assert not Path(f"/proc/{pid}").exists(), f"child {pid} outlived the launcher"
    # Nothing claims to be final: no learner artifact, no final marker.
    assert not (out / "learner-0" / "model.pt").exists()
    assert not Path(str(out / "syncer" / "checkpoint.yeto") + ".final").exists()
    assert os.path.isdir(out / "syncer")


@pytest.mark.parametrize("closed", ["reader", "stdout"])
def test_a_closed_stdout_does_not_stop_the_run(tmp_path: Path, closed: str) -> None:
    """`yeto launch … | head -1` (or `>&-`): once stdout's reader is gone, or stdout was closed
    from the start, status lines go to stderr."""
    out = tmp_path / "run"
    argv = [*LAUNCH, "--learners", "1", "--steps", "64", "--fragments", "2",
            "--streams", "0", "--out", str(out)]  # fmt: skip
    read_end, write_end = os.pipe()
    os.close(read_end)  # the first status line already finds no reader
    try:
        result = subprocess.run(
            ["sh", "-c", 'exec "$@" >&-', "sh", *argv] if closed == "stdout" else argv,
            cwd=REPO, env=child_env(), stdout=write_end, stderr=subprocess.PIPE, text=True,
            timeout=90,
        )  # fmt: skip
    finally:
        os.close(write_end)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert "yeto launch: finished" in result.stderr
    assert (out / "learner-0" / "model.pt").is_file()
    assert json.loads((out / "summary.json").read_text())["learners"] == 1


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_stdout_that_cannot_be_written_ends_the_run_with_one_line(tmp_path: Path) -> None:
    """`yeto launch > /dev/full`: not a reader gone but a failed write (a full disk)."""
    with open("/dev/full", "w") as full:
        result = subprocess.run(
            [*LAUNCH, "--learners", "1", "--steps", "64", "--fragments", "2",
             "--streams", "0", "--out", str(tmp_path / "run")],
            cwd=REPO, env=child_env(), stdout=full, stderr=subprocess.PIPE, text=True,
            timeout=90,
        )  # fmt: skip
    assert (result.returncode, result.stderr) == (
        1,
        "yeto launch: cannot write the output: No space left on device\n",
    )


def test_a_syncer_that_did_not_start_leaves_the_output_folder_as_it_was(tmp_path: Path) -> None:
    """The port is taken: the line quotes the syncer's reason, and what launch made is gone,
    so the same command works once the port is free (an empty --out it was given stays)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        new, empty = tmp_path / "new", tmp_path / "empty"
        empty.mkdir()
        for out in (new, new, empty):  # the second try with "new" is not refused as not empty
            result = subprocess.run(
                [*LAUNCH, "--port", port, "--learners", "1", "--out", str(out)],
                cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=90,
            )  # fmt: skip
            assert result.returncode == 1, result.stderr
            (line,) = result.stderr.splitlines()
            assert line.startswith("yeto launch: error: the syncer did not start: "), line
            assert "Address already in use" in line and str(out) in line, line
            assert result.stdout == ""
    assert not new.exists()
    assert empty.is_dir() and not any(empty.iterdir())


def _catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has its own handler for ``signum`` (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_learner_stopped_by_sigterm_unwinds_and_says_what_it_kept(tmp_path: Path) -> None:
    """The launcher stops learners with SIGTERM: it must unwind (an artifact being written loses
    only its temp file) and end with a line, not die by the default action."""
    with socket.socket() as idle:  # accepts the connection, never answers
        idle.bind(("127.0.0.1", 0))
        idle.listen()
        address = f"127.0.0.1:{idle.getsockname()[1]}"
        learner = subprocess.Popen(
            [sys.executable, "-m", "yeto_learn.demo_model", "--syncer", address,
             "--learner-id", "0", "--num-learners", "1", "--out", str(tmp_path / "l0")],
            cwd=REPO, env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 60
            while not _catches(learner.pid, signal.SIGTERM) and time.monotonic() < deadline:
                time.sleep(0.05)
            learner.send_signal(signal.SIGTERM)
            _, errors = learner.communicate(timeout=30)
        finally:
            if learner.poll() is None:
                learner.kill()
                learner.wait()
    assert learner.returncode == 128 + signal.SIGTERM, errors
    assert errors.splitlines()[-1] == "learner 0: stopped by SIGTERM; no artifact was written"
    assert not list(tmp_path.rglob("*.tmp"))


def _demo_learner(address: str, *flags: str) -> list[str]:
    return [
        sys.executable, "-m", "yeto_learn.demo_model", "--syncer", address, "--learner-id", "0",
        "--num-learners", "1", "--fragments", "2", "--streams", "0", "--run-id", "cap-test",
        *flags,
    ]  # fmt: skip


def test_a_learner_past_its_cap_trains_on_while_rounds_advance(tmp_path: Path) -> None:
    """--max-steps (4 x --steps under yeto launch) guards against a syncer that stopped: a run
    whose rounds merely fell behind their pacing (a pause of a few seconds, a loaded host)
    used to end at the cap, unable to answer the next pull."""
    with running_syncer(tmp_path / "syncer", learners=1, total_steps=12) as syncer:
        learner = subprocess.run(
            _demo_learner(syncer.address, "--max-steps", "2", "--finish-timeout", "60"),
            cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert learner.returncode == 0, learner.stderr
        assert syncer.process.wait(timeout=30) == 0
    done = [json.loads(line) for line in learner.stdout.splitlines() if '"done"' in line]
    assert done and done[0]["final_global_step"] == 12, learner.stdout
    assert done[0]["steps"] > 2, done  # 12 pushes of 2 fragments need more than 2 local steps


@contextlib.contextmanager
def _stalled_learner(
    tmp_path: Path, *flags: str
) -> Iterator[tuple[subprocess.Popen[str], Callable[[], None]]]:
    """A demo learner whose syncer is stopped (SIGSTOP) once its session started; the second
    value lets the syncer go on."""
    with running_syncer(tmp_path / "syncer", learners=1, total_steps=10_000) as syncer:
        learner = subprocess.Popen(
            _demo_learner(syncer.address, "--progress-every", "0", *flags),
            cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert learner.stdout is not None
            for line in learner.stdout:
                if '"started"' in line:
                    break
            syncer.process.send_signal(signal.SIGSTOP)
            yield learner, lambda: syncer.process.send_signal(signal.SIGCONT)
        finally:
            syncer.process.send_signal(signal.SIGCONT)
            if learner.poll() is None:
                learner.kill()
                learner.wait()


def test_a_learner_past_its_cap_stops_once_no_round_advances_and_says_why(
    tmp_path: Path,
) -> None:
    """With its syncer stopped, the learner passes its cap and stops training after
    --stall-timeout without a round; once the syncer goes on, the learner answers the pulls
    its windows still hold, cannot answer the next one, and its last line says why."""
    flags = ("--max-steps", "3", "--stall-timeout", "2", "--finish-timeout", "60")
    with _stalled_learner(tmp_path, *flags) as (learner, resume):
        started = time.monotonic()
        assert learner.stdout is not None
        for line in learner.stdout:
            if '"finishing"' in line:  # it stopped training
                break
        stalled = time.monotonic() - started
        resume()
        _, errors = learner.communicate(timeout=90)
    assert stalled >= 1.5, stalled
    assert learner.returncode == 1, errors
    last = errors.strip().splitlines()[-1]
    assert last.startswith("learner 0: reached its cap of 3 local steps (--max-steps"), last
    assert "no round advanced for 2 s before the syncer finished the run" in last, last
    assert "--learners" in last and "final_ready" not in errors, errors


def test_a_learner_past_its_cap_whose_syncer_stays_silent_says_it_stopped_training(
    tmp_path: Path,
) -> None:
    flags = ("--max-steps", "3", "--stall-timeout", "1", "--finish-timeout", "2")
    with _stalled_learner(tmp_path, *flags) as (learner, _):
        _, errors = learner.communicate(timeout=60)
    assert learner.returncode == 1, errors
    last = errors.strip().splitlines()[-1]
    assert "did not complete finalization within 2 s" in last, last
    # It trains on past the cap while rounds advance: the line says where it stopped.
    stopped = re.search(
        r"\(it had stopped training after (\d+) local steps, past its cap of 3, "
        r"no round having advanced for 1 s\)$",
        last,
    )
    assert stopped is not None and int(stopped.group(1)) >= 3, last


def test_launch_finishes_a_run_whose_rounds_fall_far_behind_their_pacing(tmp_path: Path) -> None:
    """A sync every local step of a tiny batch: 200 rounds take far longer than their pacing,
    and the learners pass 4 x 50 steps long before them; the run still finishes."""
    result = subprocess.run(
        [*LAUNCH, "--learners", "1", "--steps", "50", "--sync-interval", "1", "--fragments",
         "4", "--batch-size", "1", "--streams", "0", "--out", str(tmp_path / "run")],
        cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    checkpoint = launch.Paths(tmp_path / "run").checkpoint
    assert is_marked_final(checkpoint, read_checkpoint(checkpoint).global_step), result.stdout


# -- the command line, checked before anything starts ---------------------------------------------
@pytest.fixture
def no_run(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Stands in for the run itself: it records the output folder it got and returns 0, so a
    check of the command line never starts a process (and one it let through is seen)."""
    runs: list[Path] = []

    def fake(
        args: object, paths: launch.Paths, children: object, started: float, stops: object
    ) -> int:
        runs.append(paths.out)
        return 0

    monkeypatch.setattr(launch, "_launch", fake)
    return runs


def _one_error_line(err: str, *words: str) -> None:
    assert err.count("\n") == 1 and err.startswith("yeto launch: error: "), err
    assert "Traceback" not in err
    for word in words:
        assert word in err, err


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--batch-size", "0"], "--batch-size must be in 1..65536, got 0"),
        (["--batch-size", "-1"], "--batch-size"),
        (["--batch-size", "65537"], "--batch-size must be in 1..65536, got 65537"),
        (["--port", "70000"], "--port must be in 0..65535, got 70000"),
        (["--port", "-1"], "--port"),
        (["--sync-interval", "0"], "--sync-interval must be in 1..4294967295, got 0"),
        (["--sync-interval", str(1 << 32)], "--sync-interval must be in 1..4294967295"),
        (["--merge", "rda", "--fragments", "1"], "--fragments 1 with --merge rda"),
        (["--learners", "0"], "--learners must be in 1..256 (each is a process"),
        (["--learners", str(10**26)], "--learners must be in 1..256"),
        (["--steps", "0"], f"--steps must be in 1..{(1 << 62) - 1} "),
        (["--steps", str(10**23)], f"--steps must be in 1..{(1 << 62) - 1} "),
        # 7 x steps rounds of one local step each: the syncer's --total-steps is a u64.
        (["--steps", str(1 << 62), "--fragments", "7", "--sync-interval", "1"],
         f"--steps must be in 1..{((1 << 64) - 1) // 7} "),
        (["--streams", "257"], "--streams must be in 0..256, got 257"),
        (["--fragments", "0"], "--fragments must be in 1..7"),
    ],
    ids=["batch-0", "batch-negative", "batch-high", "port-high", "port-negative",
         "sync-interval-0", "sync-interval-high", "rda-1", "learners-0", "learners-huge",
         "steps-0", "steps-huge", "steps-rounds-huge", "streams-high", "fragments-0"],
)  # fmt: skip
def test_bad_numbers_are_refused_before_anything_is_created(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    no_run: list[Path],
    flags: list[str],
    named: str,
) -> None:
    out = tmp_path / "run"
    assert cli.main(["launch", "--out", str(out), *flags]) == 2
    _one_error_line(capsys.readouterr().err, named)
    assert not no_run and not out.exists()


def test_more_sockets_than_the_open_file_limit_allows_are_refused_up_front(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    no_run: list[Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """4 learners x (1 + 256 streams) need 1,028 sockets in the syncer: with a hard limit of
    1,024 the run stalled for 60 s and blamed the learners; the syncer's log had the cause."""
    monkeypatch.setattr(resource, "getrlimit", lambda which: (1024, 1024))  # the syncer's too
    out = tmp_path / "run"
    assert cli.main(["launch", "--out", str(out), "--learners", "4", "--streams", "256"]) == 2
    _one_error_line(capsys.readouterr().err, "--streams 256", "limit of 1024", "ulimit -Hn")
    assert not no_run and not out.exists()
    assert cli.main(["launch", "--out", str(out), "--learners", "4", "--streams", "200"]) == 0
    assert no_run == [out.resolve()]


def test_two_runs_in_one_second_get_folders_of_their_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_run: list[Path]
) -> None:
    monkeypatch.chdir(tmp_path)
    now, strftime = time.localtime(), time.strftime
    monkeypatch.setattr(time, "strftime", lambda fmt, t=None: strftime(fmt, now))
    assert cli.main(["launch"]) == 0
    assert cli.main(["launch"]) == 0
    assert cli.main(["launch"]) == 0
    first = no_run[0]
    assert first.name == strftime("yeto-launch-%Y%m%d-%H%M%S", now)
    assert [p.name for p in no_run] == [first.name, f"{first.name}-2", f"{first.name}-3"]
    assert all(p.parent == tmp_path.resolve() for p in no_run)


def test_an_output_folder_that_is_not_empty_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_run: list[Path]
) -> None:
    out = tmp_path / "earlier"
    out.mkdir()
    (out / "notes.txt").write_text("an earlier run's\n")
    assert cli.main(["launch", "--out", str(out)]) == 2
    _one_error_line(capsys.readouterr().err, str(out), "not empty")
    assert not no_run and sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli.main(["launch", "--out", str(empty)]) == 0  # an empty folder is fine
    assert no_run == [empty.resolve()]


@pytest.mark.parametrize("command", ["launch", "bench"])
def test_an_output_folder_in_a_missing_folder_is_refused(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    no_run: list[Path],
    command: str,
) -> None:
    """Only the last part of --out is made, as yeto-sync and checkpoint export make none: a
    mistyped parent must not become a tree of folders."""
    monkeypatch.setattr(bench_closure, "run_closure", lambda *a, **k: pytest.fail("ran"))
    out = tmp_path / "no-such" / "deep" / "run"
    assert cli.main([command, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"yeto {command}: error: --out {out}: "), err
    assert f"{tmp_path / 'no-such' / 'deep'} does not exist" in err, err
    assert not no_run and not (tmp_path / "no-such").exists()
    out = tmp_path / "run"  # in an existing folder: made
    assert cli.main(["launch", "--out", str(out)]) == 0
    assert no_run == [out.resolve()]


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc")
def test_an_output_folder_refused_by_an_existing_parent_does_not_call_it_missing(
    capsys: pytest.CaptureFixture[str], no_run: list[Path]
) -> None:
    """/proc/self exists; mkdir in it fails with ENOENT all the same."""
    assert cli.main(["launch", "--out", "/proc/self/run"]) == 2
    err = capsys.readouterr().err
    _one_error_line(err, "--out", "/proc/self/run")
    assert "does not exist" not in err and "No such file or directory" in err, err


@pytest.mark.parametrize("below", [False, True], ids=["the-file", "below-the-file"])
def test_an_output_folder_that_cannot_be_made_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_run: list[Path], below: bool
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = blocker / "out" if below else blocker
    assert cli.main(["launch", "--out", str(out)]) == 2
    _one_error_line(capsys.readouterr().err, "--out", str(out))
    assert not no_run and blocker.read_text() == ""


@pytest.mark.parametrize(
    "command",
    [["launch"], ["bench"], ["checkpoint", "inspect", "x.yeto"]],
    ids=["launch", "bench", "checkpoint-inspect"],
)
def test_an_unknown_option_shows_the_subcommands_usage(
    capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    assert cli.main([*command, "--bogus"]) == 2
    err = capsys.readouterr().err
    prog = " ".join(["yeto", *command[:2]]) if command[0] == "checkpoint" else f"yeto {command[0]}"
    assert err.startswith(f"usage: {prog} "), err
    assert err.strip().splitlines()[-1] == f"{prog}: error: unrecognized arguments: --bogus"


def _help(command: str, capsys: pytest.CaptureFixture[str]) -> dict[str, str]:
    """Each option's help text, on one line, from ``yeto COMMAND --help`` (80 columns)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("COLUMNS", "80")
        assert cli.main([command, "--help"]) == 0
    text = capsys.readouterr().out.split("options:", 1)[1]
    entries = re.split(r"\n  (?=-)", "\n" + text)
    helps = {}
    for entry in entries:
        if entry.strip():
            flag, _, rest = entry.strip().partition(" ")
            helps[flag.rstrip(",")] = " ".join(rest.split())
    return helps


@pytest.mark.parametrize("command", ["launch", "bench"])
def test_every_option_has_help_and_shows_its_default_once(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    helps = _help(command, capsys)
    defaults = {"launch": ("q4", "64"), "bench": ("f32", "32")}[command]
    assert helps["--wire-dtype"].endswith(f"(default: {defaults[0]})")
    assert helps["--batch-size"].endswith(f"(default: {defaults[1]})")
    assert len(helps["--wire-dtype"]) > 40 and len(helps["--batch-size"]) > 40  # a help text
    assert helps["--out"].count("default") == 1, helps["--out"]
    assert "None" not in helps["--out"] and f"./yeto-{command}-TIME" in helps["--out"]
    for flag, text in helps.items():
        assert text.count("(default:") <= 1, (flag, text)


def test_steps_help_says_what_it_sets(capsys: pytest.CaptureFixture[str]) -> None:
    """--steps sets the number of rounds; learners take as many local steps as those last."""
    steps = _help("launch", capsys)["--steps"]
    assert "approximately" not in steps
    assert "steps x fragments / sync-interval rounds" in steps, steps
    assert "past 4 x steps, only while rounds advance" in steps, steps
    assert launch.total_rounds(3000, 4, 16) == 3000 * 4 // 16


def test_a_learners_quoted_stderr_leaves_out_traceback_carets(tmp_path: Path) -> None:
    log = tmp_path / "stderr.log"
    log.write_text(
        "Traceback (most recent call last):\n"
        '  File "/x/demo_model.py", line 270, in _train\n'
        "    loss = nn.functional.cross_entropy(trained(x).float(), y)\n"
        "                                       ^^^^^^^^^^\n"
        '  File "/x/module.py", line 1, in forward\n'
        "    return self.head(hidden)[:, -1]\n"
        "           ~~~~~~~~~~~~~~~~~^^^^^^^\n"
        "RuntimeError: something broke\n"
    )
    child = launch.Child("learner-0", cast(Any, None), log)
    assert child.stderr_tail(3) == [
        '  File "/x/module.py", line 1, in forward',
        "    return self.head(hidden)[:, -1]",
        "RuntimeError: something broke",
    ]


def _done(learner_id: int, digest: str) -> dict[str, Any]:
    return {
        "event": "done", "learner": learner_id, "eval_loss_start": 5.5, "eval_loss_final": 3.0,
        "train_loss": 3.1, "steps": 100, "tokens": 6400, "rounds": 10, "bytes_sent": 1000,
        "bytes_received": 2000, "generations": 1, "final_global_step": 40,
        "params_sha256": digest, "num_params": 1000, "seconds": 1.0,
    }  # fmt: skip


@pytest.mark.parametrize("learners", [1, 2])
def test_the_summary_compares_learners_only_when_there_are_several(
    tmp_path: Path, learners: int
) -> None:
    views = [launch.LearnerView(i) for i in range(learners)]
    for view in views:
        view.update(_done(view.learner_id, "same"))
    args = argparse.Namespace(learners=learners, fragments=2, wire_dtype="q4", merge="avg")
    lines: list[str] = []
    launch._summary(views, launch.Paths(tmp_path), args, 40, 1.0, emit=lines.append)
    agree = [line for line in lines if "agree" in line]
    if learners == 1:
        assert not agree, lines
    else:
        assert agree == ["  learners agree   yes, bit for bit (final parameters)"]


@pytest.mark.parametrize(("learners", "said"), [(1, "1 learner,"), (3, "3 learners,")])
def test_the_first_line_counts_learners_in_words(tmp_path: Path, learners: int, said: str) -> None:
    args = argparse.Namespace(learners=learners, fragments=2, wire_dtype="q4", merge="avg")
    line = launch.starting_line(args, "127.0.0.1:5", 40, tmp_path)
    assert said in line and "2 fragments" in line


SUMMARY_THAT_DOES_NOT_FIT = """
import argparse, resource, signal, sys
from pathlib import Path
from yeto_learn import launch
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (300, 300))  # the summary needs about 700 bytes
done = {"eval_loss_start": 5.5, "eval_loss_final": 2.5, "steps": 40, "bytes_sent": 1000,
        "bytes_received": 2000, "num_params": 5000, "params_sha256": "ab", "tokens": 640}
view = launch.LearnerView(0, done=done)
args = argparse.Namespace(learners=1, fragments=2, wire_dtype="q4", merge="avg")
sys.exit(launch._summarize([view], launch.Paths(Path(sys.argv[1])), args, 6, 1.0))
"""


def test_a_summary_that_does_not_fit_fails_the_run_and_says_what_was_kept(
    tmp_path: Path,
) -> None:
    (tmp_path / "syncer").mkdir()
    kept = f"final checkpoint {tmp_path}/syncer/checkpoint.yeto at global_step 6"
    (tmp_path / "syncer" / "syncer.log").write_text(f"yeto-sync: finalized; {kept}\n")
    (tmp_path / "learner-0").mkdir()
    (tmp_path / "learner-0" / "model.pt").write_bytes(b"whole")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    done = subprocess.run(
        [sys.executable, "-c", SUMMARY_THAT_DOES_NOT_FIT, str(tmp_path)],
        cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1
    (line,) = done.stderr.splitlines()
    assert line == (
        "yeto launch: failed: the summary was not written: File too large (file "
        f"{tmp_path / 'summary.json'}); kept: {kept}; every learner's artifact was written"
    )
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # no temp


def test_a_kept_checkpoint_comes_with_the_commands_that_use_it(tmp_path: Path) -> None:
    """yeto launch cannot resume a run: the line says what the checkpoint is good for."""
    paths = launch.Paths(tmp_path)
    paths.syncer_dir.mkdir()
    kept = f"last durable checkpoint {paths.checkpoint} at global_step 72"
    paths.syncer_log.write_text(f"yeto-sync: stopped by SIGTERM; {kept}\n")
    assert launch._syncer_kept(paths) == kept  # no file, no commands
    paths.checkpoint.write_bytes(b"")
    paths.layout.write_text("{}")
    said = launch._syncer_kept(paths)
    assert said.startswith(kept + " (yeto launch cannot resume it; "), said
    assert f"`yeto checkpoint inspect {paths.checkpoint}`" in said, said
    export = f"`yeto checkpoint export {paths.checkpoint} --layout {paths.layout} --out "
    assert export + f"{tmp_path / 'model.safetensors'}`" in said, said
    spaced = launch.Paths(tmp_path / "my run")  # quoted, so the command still copies and runs
    spaced.syncer_dir.mkdir(parents=True)
    spaced.checkpoint.write_bytes(b"")
    spaced.syncer_log.write_text(
        f"yeto-sync: stopped by SIGTERM; last durable checkpoint {spaced.checkpoint} at "
        "global_step 1\n"
    )
    assert f"`yeto checkpoint inspect '{spaced.checkpoint}'`" in launch._syncer_kept(spaced)


def test_a_killed_syncers_unfinished_writes_are_removed_and_named(tmp_path: Path) -> None:
    """A syncer killed while it wrote left its temporary file (as large as a checkpoint) for
    good: a restarted yeto-sync removes such files, but nothing resumes a launch."""
    paths = launch.Paths(tmp_path)
    paths.syncer_dir.mkdir()
    paths.checkpoint.write_bytes(b"kept")
    ended = subprocess.Popen([sys.executable, "-c", "pass"], text=True)
    ended.wait()
    syncer = launch.Child(launch.SYNCER_NAME, ended, paths.syncer_log)
    pid = ended.pid
    unfinished = [
        paths.syncer_dir / f".{paths.checkpoint.name}.{pid}.0123456789ab.tmp",
        paths.syncer_dir / f".{paths.checkpoint.name}.final.{pid}.00000000000a.tmp",  # marker
        paths.syncer_dir / f".{paths.final_state.name}.{pid}.ba9876543210.tmp",
    ]
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], text=True)
    # Named by a live process: never removed (the syncer alive could still be writing it).
    someone_elses = paths.syncer_dir / f".{paths.checkpoint.name}.{running.pid}.0123456789ab.tmp"
    for path in [*unfinished, someone_elses]:
        path.write_bytes(b"partial")
    try:
        alive = launch.Child(launch.SYNCER_NAME, running, paths.syncer_log)
        assert "removed" not in launch._syncer_kept(paths, [alive])
        assert all(path.exists() for path in [*unfinished, someone_elses])
    finally:
        running.kill()
        running.wait()
    said = launch._syncer_kept(paths, [syncer])
    assert said.startswith(f"recovery checkpoint {paths.checkpoint}"), said
    names = ", ".join(path.name for path in unfinished)
    assert f"(the syncer's unfinished writes were removed: {names})" in said, said
    assert not any(path.exists() for path in unfinished)
    assert someone_elses.exists() and paths.checkpoint.read_bytes() == b"kept"


def test_a_stop_signal_is_met_at_a_safe_point_and_a_hangup_ignored_at_start_stays_ignored(
    capfd: pytest.CaptureFixture[str],
) -> None:
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under nohup
    try:
        with process_control.stops_recorded("yeto test") as stops:
            os.kill(os.getpid(), signal.SIGHUP)  # ignored: the run goes on
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)  # the handler has run: it raised nothing
            assert (stops.received, stops.stopping) == (signal.SIGTERM, False)
            with pytest.raises(process_control.Stopped) as stopped:
                stops.check()
            assert stopped.value.signum == signal.SIGTERM and stops.stopping
            os.kill(os.getpid(), signal.SIGINT)  # a second one only says so
            time.sleep(0.2)
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert capfd.readouterr().err == "yeto test: SIGINT again; still stopping\n"


def test_where_a_stop_may_raise_the_first_signal_raises_and_later_ones_say_so(
    capfd: pytest.CaptureFixture[str],
) -> None:
    with process_control.stops_raised("yeto test") as stops:
        with pytest.raises(process_control.Stopped) as stopped:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # cut short
        assert stopped.value.signum == signal.SIGINT and stops.stopping
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
    assert capfd.readouterr().err == "yeto test: SIGTERM again; still stopping\n"


# -- a stop signal at the moments that lost it ----------------------------------------------------
SMALL_RUN = ("launch", "--learners", "3", "--steps", "50", "--fragments", "2", "--streams", "0")


def _run_to_the_end(argv: list[str], timeout: float = 60) -> tuple[int, str, str, float]:
    """Run ``argv`` to its end: exit status, stdout, stderr, seconds it took."""
    started = time.monotonic()
    process = subprocess.Popen(
        argv, cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, preexec_fn=hangup_not_ignored,
    )  # fmt: skip
    try:
        out, err = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    return process.returncode, out, err, time.monotonic() - started


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize(
    ("where", "nth"),
    [("before", 1), ("after_in_parent", 1), ("before", 3), ("after_in_parent", 3)],
    ids=["before-syncer-fork", "after-syncer-fork", "before-learner-fork", "after-learner-fork"],
)
def test_a_stop_signal_inside_a_fork_stops_the_run(tmp_path: Path, where: str, nth: int) -> None:
    """SIGTERM while the launcher forks the syncer (1st fork) or learner 1 (3rd): a handler that
    raised in a fork hook had its exception swallowed ("Exception ignored in …"), and the run
    went on with every later signal only logged."""
    out = tmp_path / "run"
    hook = [where, str(nth), str(int(signal.SIGTERM))]
    try:
        code, rest, errors, took = _run_to_the_end(
            command(ON_FORK, hook, "yeto", *SMALL_RUN, "--out", str(out))
        )
    finally:
        left = processes_naming(out)
        for pid in left:  # never leave one behind, even when the test fails
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert "Traceback" not in errors and "Exception ignored" not in errors, errors
    assert code == 128 + signal.SIGTERM, errors
    last = rest.strip().splitlines()[-1]
    assert last.startswith("yeto launch: stopped by SIGTERM after "), last
    assert "every process ended" in last and "no learner artifact was written" in last
    assert took < 30, f"stopping took {took:.1f} s"
    assert not left, f"processes {left} outlived the launcher"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_stop_signal_that_reaches_a_child_before_it_runs_its_program_ends_it(
    tmp_path: Path,
) -> None:
    """The child of the 2nd fork (learner 0) is sent SIGTERM before its exec: it must not run
    the launcher's handler (an exception swallowed in ``_after_fork``, the signal lost and the
    learner started anyway) but end, as the learner would have."""
    out = tmp_path / "run"
    hook = ["after_in_child", "2", str(int(signal.SIGTERM))]
    try:
        code, _, errors, _ = _run_to_the_end(
            command(ON_FORK, hook, "yeto", *SMALL_RUN, "--out", str(out))
        )
    finally:
        left = processes_naming(out)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert "Traceback" not in errors and "Exception ignored" not in errors, errors
    assert code == 1, errors
    assert errors.splitlines()[-1].startswith(
        "yeto launch: failed: learner-0 was killed by SIGTERM: no error output; kept: "
    ), errors
    assert not left, f"processes {left} outlived the launcher"


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_a_stop_signal_while_yeto_loads_is_its_last_line(
    tmp_path: Path, stop: signal.Signals
) -> None:
    """The signal comes as numpy starts to load, before ``yeto launch`` parsed its flags."""
    out = tmp_path / "run"
    code, rest, errors, _ = _run_to_the_end(
        command(ON_IMPORT, ["numpy", str(int(stop))], "yeto", *SMALL_RUN, "--out", str(out))
    )
    assert code == 128 + stop, errors
    assert rest == ""
    assert errors.splitlines() == [
        f"yeto launch: stopped by {stop.name} while starting; nothing was written"
    ]
    assert not out.exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_stop_signal_as_the_output_folder_is_made_stops_before_any_child(
    tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    hook = ["yeto_learn.launch.make_output_dir", str(int(signal.SIGTERM))]
    code, rest, errors, _ = _run_to_the_end(
        command(AFTER_CALL, hook, "yeto", *SMALL_RUN, "--out", str(out))
    )
    assert code == 128 + signal.SIGTERM, errors
    assert "Traceback" not in errors
    assert rest.strip().splitlines() == [
        "yeto launch: stopped by SIGTERM after 0.0 s; every process ended; kept: no checkpoint "
        "(none was written yet); no learner artifact was written (the run did not finalize); "
        f"removed {out}"
    ]
    assert not out.exists()  # the same command runs again (a folder with files is refused)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_stop_before_any_learner_started_empties_a_given_folder_again(tmp_path: Path) -> None:
    """Stopped after the syncer started, before the learners: --out kept the syncer's log, and
    the same command was then refused ('exists and is not empty')."""
    out = tmp_path / "run"
    out.mkdir()
    hook = ["after_in_parent", "1", str(int(signal.SIGTERM))]  # right after the syncer's fork
    code, rest, errors, _ = _run_to_the_end(
        command(ON_FORK, hook, "yeto", *SMALL_RUN, "--out", str(out))
    )
    assert code == 128 + signal.SIGTERM, errors
    last = rest.strip().splitlines()[-1]
    assert last.startswith("yeto launch: stopped by SIGTERM after "), last
    assert last.endswith(f"{out} is empty again"), last
    assert not any(out.iterdir())


def test_the_demo_learner_reports_a_stop_torch_turned_into_its_own_error_and_no_later_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """SIGTERM inside torch.save came back as torch's RuntimeError (a traceback, not the stop
    line), and a second SIGTERM, or one during the interpreter's shutdown, raised again."""
    from yeto_learn import demo_model

    def torch_swallowing_the_stop(args: argparse.Namespace, termination: Any) -> int:
        with contextlib.suppress(RuntimeError):  # a save at the cut only logs its failure
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # the handler raises here
            except BaseException:
                os.kill(os.getpid(), signal.SIGTERM)  # a second one, while unwinding: noted
                raise RuntimeError("[enforce fail at inline_container.cc:672]") from None
        termination.check()  # the training loop's next safe point
        return 0

    monkeypatch.setattr(demo_model, "_run", torch_swallowing_the_stop)
    before = signal.getsignal(signal.SIGTERM)
    try:
        argv = ["--syncer", "127.0.0.1:1", "--learner-id", "1", "--num-learners", "2"]
        code = demo_model.main([*argv, "--out", str(tmp_path)])
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN  # only exiting is left
    finally:
        signal.signal(signal.SIGTERM, before)
    assert code == 128 + signal.SIGTERM
    assert capsys.readouterr().err == "learner 1: stopped by SIGTERM; no artifact was written\n"


def test_a_child_that_died_is_named_by_its_signal_and_last_words(tmp_path: Path) -> None:
    """ "the syncer exited with -9:" and two routine round lines said nothing of what happened
    (a kill -9, or the out-of-memory killer)."""
    log = tmp_path / "stderr.log"
    log.write_text(
        'ts=1 level=info msg="round committed" step=172\n'
        'ts=2 level=warning msg="learner dropped" learner_id=1\n'
        'ts=3 level=info msg="round launched" step=173\n'
    )
    child = launch.Child("the syncer", cast(Any, None), log)
    assert child.ended(-signal.SIGKILL, 2) == (
        "the syncer was killed by SIGKILL (kill -9, or the kernel's out-of-memory killer): "
        'ts=2 level=warning msg="learner dropped" learner_id=1'
    )
    assert child.ended(1, 3).startswith("the syncer exited with 1: ts=2 level=warning")
    assert child.ended(-200, 1).startswith("the syncer was killed by signal 200: ")
    log.write_text('ts=1 level=info msg="round committed" step=172\n')
    assert child.ended(-signal.SIGTERM, 3) == "the syncer was killed by SIGTERM: no error output"
