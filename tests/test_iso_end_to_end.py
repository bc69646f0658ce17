"""End to end: the real ``yeto-sync`` daemon with ``--iso-backend torch-svd`` and scripted learners.

A session with an iso fragment (two matrices) and an avg fragment runs against the daemon; every
BCAST is checked against an independent numpy replay of the pinned iso merge (f64 SVD) from the
exact PUSH bytes the learners sent. The run is stopped with SIGTERM (its workers must go with
it), resumed from its checkpoint, and finished. Then the failure paths: a worker that hangs
(deadline, kill, poison, exit non-zero, the last good checkpoint intact and resumable, a scalar
syncer refusing the torch-svd checkpoint) and a worker killed from outside while idle (the next
checkpoint is not published).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
from daemon_harness import REPO, Daemon, wait_until
from numpy.typing import NDArray
from scripted_learner import LearnerGroup, PushRecord, ScriptedLearner, SessionSpec

from yeto_proto import MergeMode, PullReq, WireDtype, WireFragment, WireLayout
from yeto_proto.checkpoint import Checkpoint, read_checkpoint
from yeto_proto.constants import IsoBackend

F32 = NDArray[np.float32]
SHAPES = ((48, 32), (16, 24))
LAYOUT = WireLayout(
    (
        WireFragment(MergeMode.ISO, tuple(r * c for r, c in SHAPES), SHAPES),
        WireFragment(MergeMode.AVG, (300,)),
    )
)
SPEC = SessionSpec(WireDtype.F32, LAYOUT, bytes(range(32)), bytes(range(64, 96)))
LEARNERS = 2
TOTAL_STEPS = 6
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9
POOL_STARTED = re.compile(r'msg="iso pool started" .*pids=\[([\d,]+)\]')


def flags(checkpoint: Path, *extra: str) -> list[str]:
    return [
        f"--learners={LEARNERS}",
        f"--quorum={LEARNERS}",
        f"--total-steps={TOTAL_STEPS}",
        "--sync-interval-steps=0",
        "--delta-correction=none",
        f"--outer-lr={OUTER_LR}",
        f"--outer-momentum={OUTER_MOMENTUM}",
        f"--checkpoint-path={checkpoint}",
        "--checkpoint-every=1",
        "--mark-final-checkpoint",
        *extra,
    ]


def worker_pids(daemon: Daemon) -> tuple[int, ...]:
    match = POOL_STARTED.search(daemon.stderr)
    assert match, f"no 'iso pool started' line:\n{daemon.stderr}"
    return tuple(int(pid) for pid in match.group(1).split(","))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def reaped(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def last_line(daemon: Daemon) -> str:
    return daemon.stderr.strip().splitlines()[-1]


# -- learners --------------------------------------------------------------------------------
def make_learners(
    daemon: Daemon, generation: int, *, initial: list[F32] | None, pause_at: int | None = None
) -> tuple[list[ScriptedLearner], threading.Event, threading.Event]:
    paused, release = threading.Event(), threading.Event()

    def pause(pull: PullReq) -> None:
        if pull.global_step == pause_at:
            paused.set()
            release.wait(60)

    learners = [
        ScriptedLearner(
            LearnerGroup(daemon.address, SPEC, learner_id=i, generation=generation, num_streams=i),
            initial=initial if i == 0 else None,
            steps_per_round=3 + i,
            tokens_per_step=400 * (i + 1),
            before_push=pause if i == 0 else (lambda pull: None),
        )
        for i in range(LEARNERS)
    ]
    return learners, paused, release


def play(learners: list[ScriptedLearner]) -> tuple[list[threading.Thread], list[BaseException]]:
    failures: list[BaseException] = []

    def run(learner: ScriptedLearner) -> None:
        try:
            learner.start()
            learner.run(timeout=90)
        except BaseException as exc:  # surfaced by the test
            failures.append(exc)
        finally:
            learner.group.close()

    threads = [threading.Thread(target=run, args=(learner,)) for learner in learners]
    for thread in threads:
        thread.start()
    return threads, failures


def join(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.join(120)


def sigterm_in_round_1(
    daemon: Daemon,
    learners: list[ScriptedLearner],
    *,
    settle_s: float,
    pushes_s: float,
    exit_s: float,
) -> tuple[int, float]:
    """Play ``learners``, SIGTERM the daemon ``settle_s`` after round 1's pushes are all out:
    its exit status and how long the stop took."""
    threads, _ = play(learners)
    wait_until(lambda: all(lr.pushes for lr in learners), pushes_s, "round 1's pushes")
    time.sleep(settle_s)
    daemon.signal(signal.SIGTERM)
    began = time.monotonic()
    code = daemon.wait(exit_s)
    took = time.monotonic() - began
    join(threads)
    return code, took


# -- an independent replay of the pinned math ------------------------------------------------
def iso_flatten(g: NDArray[np.float64]) -> NDArray[np.float64]:
    u, sigma, vt = np.linalg.svd(g, full_matrices=False)
    if sigma[0] == 0:
        return np.zeros_like(g)
    keep = sigma > sigma[0] * max(g.shape) * 2.0**-52
    result: NDArray[np.float64] = sigma.sum() / min(g.shape) * (u[:, keep] @ vt[keep])
    return result


def replay(
    start: list[tuple[F32, F32]], pushes: list[list[PushRecord]], steps: range
) -> dict[tuple[int, int], F32]:
    """Θ per (fragment, version) after each of ``steps``, from ``start`` = (params, momentum)."""
    params = [p.copy() for p, _ in start]
    momentum = [m.copy() for _, m in start]
    lr, mu = np.float32(OUTER_LR), np.float32(OUTER_MOMENTUM)
    states = {}
    for step in steps:
        fragment = (step - 1) % len(LAYOUT)
        responses = sorted(
            (learner, record)
            for learner, records in enumerate(pushes)
            for record in records
            if record.step == step
        )
        assert [learner for learner, _ in responses] == list(range(LEARNERS)), step
        weights = [r.c_tokens**2 / r.c_steps for _, r in responses]
        delta = np.zeros(LAYOUT.numels[fragment], np.float32)
        for weight, (_, record) in zip(weights, responses, strict=True):
            sent = np.frombuffer(record.payload, "<f4")
            delta += np.float32(weight / sum(weights)) * -sent  # Δ_m = −d_m, f32 accumulation
        geometry = LAYOUT.fragments[fragment]
        if geometry.merge_mode is MergeMode.ISO:
            offset = 0
            for rows, cols in geometry.matrix_shapes:
                part = slice(offset, offset + rows * cols)
                g = delta[part].astype(np.float64).reshape(rows, cols)
                delta[part] = iso_flatten(g).reshape(-1).astype(np.float32)
                offset += rows * cols
        momentum[fragment] = (mu * momentum[fragment] + delta).astype(np.float32)
        params[fragment] = (params[fragment] - lr * (delta + mu * momentum[fragment])).astype(
            np.float32
        )
        states[(fragment, step)] = params[fragment].copy()
    return states


def assert_matches(got: F32, want: F32) -> None:
    gap = float(np.abs(got.astype(np.float64) - want).max())
    assert gap <= 1e-5 * float(np.abs(want).max()) + 1e-6, gap


def check_bcasts(learner: ScriptedLearner, states: dict[tuple[int, int], F32]) -> int:
    checked = 0
    for fragment, version, values in learner.bcasts:
        if (fragment, version) in states:
            assert_matches(values, states[(fragment, version)])
            checked += 1
    return checked


def state_of(checkpoint: Checkpoint) -> list[tuple[F32, F32]]:
    return [(f.params.copy(), f.momentum.copy()) for f in checkpoint.fragments]


# -- the tests -------------------------------------------------------------------------------
def test_a_torch_svd_session_stops_on_sigterm_resumes_and_finishes(tmp_path: Path) -> None:
    checkpoint = tmp_path / "ckpt"
    rng = np.random.default_rng(17)
    initial = [rng.normal(0, 1, n).astype(np.float32) for n in LAYOUT.numels]
    with Daemon(*flags(checkpoint, "--iso-backend=torch-svd")) as first:
        pids = worker_pids(first)
        learners, paused, release = make_learners(first, 1, initial=initial, pause_at=4)
        threads, failures = play(learners)
        assert paused.wait(90), first.stderr
        wait_until(lambda: "global_step=3" in first.stderr, 30, "the step-3 checkpoint")
        first.signal(signal.SIGTERM)
        code = first.wait(30)
        release.set()
        join(threads)
    assert code == 128 + signal.SIGTERM, first.stderr
    assert f"{checkpoint} at global_step 3" in last_line(first)
    assert failures  # the learners saw their syncer go away
    assert not [pid for pid in pids if alive(pid)]  # the workers went with the daemon
    kept = read_checkpoint(checkpoint)
    assert (kept.global_step, kept.iso_backend) == (3, IsoBackend.TORCH_SVD)

    start = [(x.copy(), np.zeros_like(x)) for x in initial]
    before = replay(start, [lr.pushes for lr in learners], range(1, 4))
    assert check_bcasts(learners[1], before) == 3  # versions 1, 2 and 3
    assert check_bcasts(learners[0], before) >= 2  # it may have paused before v3 arrived
    broadcast = {(f, v): values for f, v, values in learners[1].bcasts}
    for fragment, (params, _) in enumerate(state_of(kept)):
        version = max(v for f, v in before if f == fragment)
        np.testing.assert_array_equal(params, broadcast[(fragment, version)])  # f32: exact
        assert_matches(params, before[(fragment, version)])

    with Daemon(*flags(checkpoint, "--iso-backend=torch-svd", "--resume")) as second:
        pids = worker_pids(second)
        learners, _, _ = make_learners(second, 2, initial=None)
        threads, failures = play(learners)
        join(threads)
        assert not failures, f"{failures!r}\n{second.stderr}"
        assert second.wait(30) == 0, second.stderr
    assert not [pid for pid in pids if alive(pid)]
    after = replay(state_of(kept), [lr.pushes for lr in learners], range(4, TOTAL_STEPS + 1))
    for learner in learners:
        assert sorted((f, v) for f, v, _ in learner.bcasts) == [
            (0, 3),
            (0, 5),
            (1, 2),
            (1, 4),
            (1, 6),
        ]
        assert check_bcasts(learner, after) == 3
        assert learner.acked and learner.shut_down
    final = read_checkpoint(checkpoint)
    assert (final.global_step, final.iso_backend) == (TOTAL_STEPS, IsoBackend.TORCH_SVD)
    assert Path(f"{checkpoint}.final").exists()
    assert_matches(final.fragments[0].params, after[(0, 5)])
    assert_matches(final.fragments[1].params, after[(1, 6)])


def test_a_hanging_worker_fails_the_run_and_the_last_good_checkpoint_resumes(
    tmp_path: Path,
) -> None:
    checkpoint, tape, final_state = tmp_path / "ckpt", tmp_path / "tape", tmp_path / "final"
    initial = [np.linspace(-1, 1, n, dtype=np.float32) for n in LAYOUT.numels]
    fault = {
        "YETO_ISO_WORKERS": "1",
        # Round 1 solves both of its matrices (requests 1 and 2); request 3 (round 3) hangs.
        "YETO_ISO_FAULT": "hang@2",
        "YETO_ISO_REQUEST_DEADLINE_S": "1.5",
    }
    extra = ("--iso-backend=torch-svd", f"--event-tape={tape}", f"--final-state={final_state}")
    with Daemon(*flags(checkpoint, *extra), env=fault) as daemon:
        pids = worker_pids(daemon)
        learners, _, _ = make_learners(daemon, 1, initial=initial)
        threads, _ = play(learners)
        code = daemon.wait(90)
        join(threads)
    assert code == 1, daemon.stderr
    reason = last_line(daemon)
    assert reason.startswith("yeto-sync: round 3 (fragment 0) failed to commit: iso pool poisoned:")
    assert f"missed the 1.5 s deadline of a {SHAPES[0][0]}x{SHAPES[0][1]} SVD" in reason
    assert f"last durable checkpoint {checkpoint} at global_step 2" in reason
    assert not [pid for pid in pids if alive(pid)]  # killed at the deadline
    # Nothing was published after the poison: the step-2 checkpoint is the one on disk.
    kept = read_checkpoint(checkpoint)
    assert (kept.global_step, kept.iso_backend) == (2, IsoBackend.TORCH_SVD)
    assert not Path(f"{checkpoint}.final").exists() and not final_state.exists()
    events = [json.loads(line) for line in tape.read_text().splitlines()]
    assert [e["step"] for e in events if "event" not in e] == [1, 2]
    assert [(e["event"], e["step"]) for e in events if "event" in e] == [("merge_failed", 3)]

    # The checkpoint records its backend: a scalar syncer refuses to resume it, at start.
    scalar = subprocess.run(
        [sys.executable, "-m", "yeto_sync", *flags(checkpoint, "--resume")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert scalar.returncode == 2, scalar.stderr
    (line,) = scalar.stderr.splitlines()
    assert "iso backend torch-svd in the checkpoint, scalar running" in line
    assert read_checkpoint(checkpoint).global_step == 2

    # A torch-svd syncer without the fault resumes it and finishes the run.
    with Daemon(*flags(checkpoint, "--iso-backend=torch-svd", "--resume")) as resumed:
        learners, _, _ = make_learners(resumed, 2, initial=None)
        threads, failures = play(learners)
        join(threads)
        assert not failures, f"{failures!r}\n{resumed.stderr}"
        assert resumed.wait(30) == 0, resumed.stderr
    after = replay(state_of(kept), [lr.pushes for lr in learners], range(3, TOTAL_STEPS + 1))
    for learner in learners:
        assert check_bcasts(learner, after) == 4
    assert read_checkpoint(checkpoint).global_step == TOTAL_STEPS


def test_sigterm_during_a_hanging_solve_stops_within_seconds(tmp_path: Path) -> None:
    """The commit waits in the coordinator's thread; the signal still runs and fails the solve."""
    checkpoint = tmp_path / "ckpt"
    initial = [np.linspace(-1, 1, n, dtype=np.float32) for n in LAYOUT.numels]
    # Round 1's first matrix hangs; the default deadline would hold the daemon for a minute.
    fault = {"YETO_ISO_WORKERS": "1", "YETO_ISO_FAULT": "hang"}
    with Daemon(*flags(checkpoint, "--iso-backend=torch-svd"), env=fault) as daemon:
        pids = worker_pids(daemon)
        learners, _, _ = make_learners(daemon, 1, initial=initial)
        # After 1.5 s, round 1's commit waits for the hung solve.
        code, took = sigterm_in_round_1(daemon, learners, settle_s=1.5, pushes_s=30, exit_s=30)
    assert code == 128 + signal.SIGTERM, daemon.stderr
    assert took < 10, f"stopping took {took:.1f} s"
    assert last_line(daemon) == "yeto-sync: stopped by SIGTERM; no checkpoint was written"
    assert not [pid for pid in pids if alive(pid)]


def test_an_idle_worker_killed_from_outside_blocks_the_next_checkpoint(tmp_path: Path) -> None:
    checkpoint = tmp_path / "ckpt"
    initial = [np.full(n, 0.25, np.float32) for n in LAYOUT.numels]
    env = {"YETO_ISO_WORKERS": "1"}
    with Daemon(*flags(checkpoint, "--iso-backend=torch-svd"), env=env) as daemon:
        (pid,) = worker_pids(daemon)
        learners, paused, release = make_learners(daemon, 1, initial=initial, pause_at=2)
        threads, _ = play(learners)
        assert paused.wait(90), daemon.stderr
        wait_until(lambda: "global_step=1" in daemon.stderr, 30, "the step-1 checkpoint")
        os.kill(pid, signal.SIGKILL)  # the worker is idle: round 2 is an avg fragment
        # Only its parent can reap it: once the pid is gone, the daemon has seen the death.
        wait_until(lambda: reaped(pid), 10, "the daemon to reap its killed worker")
        release.set()
        code = daemon.wait(60)
        join(threads)
    assert code == 1, daemon.stderr
    reason = last_line(daemon)
    assert reason.startswith("yeto-sync: checkpoint not written: iso pool poisoned:"), reason
    assert f"(pid {pid}) exited with code -9" in reason
    assert "at global_step 1" in reason
    assert read_checkpoint(checkpoint).global_step == 1


def test_sigterm_during_an_in_process_solve_stops_within_seconds(tmp_path: Path) -> None:
    """With --iso-backend scalar the SVD runs in the daemon and nothing interrupts it: a stop
    waited for the whole solve (71 s for 2048 x 2048 on a busy host). Now the solve is left to
    its thread, its commit dropped like any in flight, and the process exits without it."""
    side = 2048
    layout = WireLayout((WireFragment(MergeMode.ISO, (side * side,), ((side, side),)),))
    spec = SessionSpec(WireDtype.F32, layout, bytes(range(32)), bytes(range(64, 96)))
    checkpoint = tmp_path / "ckpt"
    initial = [np.random.default_rng(5).standard_normal(side * side).astype(np.float32)]
    with Daemon(*flags(checkpoint, "--iso-backend=scalar")) as daemon:
        learners = [
            ScriptedLearner(
                LearnerGroup(daemon.address, spec, learner_id=i, generation=1, num_streams=0),
                initial=initial if i == 0 else None,
                steps_per_round=3,
                tokens_per_step=400,
            )
            for i in range(LEARNERS)
        ]
        # After 1 s, round 1's commit is inside the SVD.
        code, took = sigterm_in_round_1(daemon, learners, settle_s=1.0, pushes_s=60, exit_s=120)
    assert code == 128 + signal.SIGTERM, daemon.stderr
    assert 'msg="stopping: the event in progress (a commit may be in an iso SVD)' in daemon.stderr
    assert last_line(daemon) == "yeto-sync: stopped by SIGTERM; no checkpoint was written"
    assert took < 5, f"stopping took {took:.1f} s"
