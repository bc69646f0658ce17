"""kill -9 the real ``yeto-sync`` mid-run, restart it with ``--resume``: the result is bit-exact.

Three learners on plain sockets (:class:`ReplayLearner`) answer every PULL with a delta that is a
pure function of (learner, fragment, base version, local step), and derive ``local_step`` from
the round's global step. Fed the same pushes, a syncer that was SIGKILLed after some commits
(with rounds in flight) and resumed from its checkpoint must end with exactly the state of an
uninterrupted run: the same final checkpoint file, byte for byte, the same f32 FINAL_FRAGMENTs,
and the same bytes for every BCAST version either run sent. Redone rounds (those after the
checkpoint) must reproduce their BCASTs exactly too.

After the kill the checkpoint on disk must be complete and valid (the atomic writer never
leaves a torn file, even when the kill lands while checkpoints are being written), and starting
over it without ``--resume`` must be refused with exit 2 and one stderr line.
"""

from __future__ import annotations

import functools
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from daemon_harness import REPO, Daemon, wait_until
from numpy.typing import NDArray
from scripted_learner import GroupClosed, LearnerGroup, SessionSpec, SyncerError
from syncer_process import free_port

from yeto_proto import (
    AnyMessage,
    BcastFragment,
    ErrorCode,
    ErrorMessage,
    FinalAck,
    FinalFragment,
    FinalManifest,
    InitParams,
    MergeMode,
    ProtocolError,
    PullReq,
    PushFragment,
    Shutdown,
    WireDtype,
    WireFragment,
    WireLayout,
)
from yeto_proto.checkpoint import MarkerStatus, marker_state, read_checkpoint, scheduled_version
from yeto_proto.dtypes import decode_tensor, encode_tensor

F32 = NDArray[np.float32]
LEARNERS = 3
TOTAL_STEPS = 12
#: avg, rda (two tensors) and a small iso matrix: every merge mode crosses the crash.
SMALL_LAYOUT = WireLayout(
    (
        WireFragment(MergeMode.AVG, (40_000,)),
        WireFragment(MergeMode.RDA, (3_000, 500)),
        WireFragment(MergeMode.ISO, (48 * 32,), ((48, 32),)),
    )
)
#: A 16 MiB checkpoint (params + momentum): its writes take long enough for a kill to hit one.
BIG_LAYOUT = WireLayout(
    (WireFragment(MergeMode.AVG, (2_000_000,)), WireFragment(MergeMode.AVG, (1_000, 24)))
)
RUN_TIMEOUT_S = 60.0
#: A group that brings nothing for this long is given up and redialed, as a real learner's
#: silence bound does, rather than waiting out the whole run on a connection that never closes.
SILENCE_S = 15.0
CHECKPOINT_LOGGED = re.compile(r'msg="checkpoint written" .*global_step=(\d+)')


# -- a learner whose pushes can be replayed ---------------------------------------------------
def cut_inside_a_frame(error: ProtocolError) -> bool:
    """The connection ended inside a frame: the syncer went away mid-send."""
    return error.code is ErrorCode.CONNECTION_CLOSED_MID_FRAME


def replay_delta(learner_id: int, fragment: int, base_version: int, local_step: int, n: int) -> F32:
    rng = np.random.default_rng([learner_id, fragment, base_version, local_step])
    return rng.normal(0.0, 0.01, n).astype(np.float32)


@dataclass
class ReplayLearner:
    """A learner whose every PUSH is a pure function of the PULL it answers.

    It answers round t only once it holds the anchor the round was launched against (version
    ``t − F``, or 0), so its ``base_version`` does not depend on whether a striped BCAST
    overtook the PULL. When its syncer goes away it redials the same address with the next
    connection generation (only if ``may_redial``) and starts from the syncer's broadcasts.
    """

    address: tuple[str, int]
    session: SessionSpec
    learner_id: int
    num_streams: int
    initial: list[F32] | None = None
    may_redial: bool = False
    #: Called with the global step just before a PUSH is sent (tests block here).
    before_push: Callable[[int], None] = lambda step: None
    push_delay_s: float = 0.0
    generation: int = 0
    #: Every BCAST seen, across generations: (fragment, version) → the wire bytes.
    bcasts: dict[tuple[int, int], bytes] = field(default_factory=dict)
    #: (generation, global_step, base_version) of each PUSH sent.
    pushes: list[tuple[int, int, int]] = field(default_factory=list)
    finals: dict[int, tuple[int, F32]] = field(default_factory=dict)
    redials: int = 0
    shut_down: bool = False
    _anchors: dict[int, int] = field(default_factory=dict)
    _deferred: dict[int, PullReq] = field(default_factory=dict)
    _manifest: FinalManifest | None = None
    _acked: bool = False

    @property
    def c_steps(self) -> int:
        return 2 + self.learner_id

    def play(self, deadline: float) -> None:
        """Run to SHUTDOWN, redialling after a lost syncer when allowed."""
        initial = self.initial
        while True:
            group = self._dial(deadline)
            try:
                if initial is not None:
                    for fragment, values in enumerate(initial):
                        data = encode_tensor(values, self.session.dtype, push=False)
                        group.send(InitParams(fragment, data.data))
                    initial = None
                self._serve(group, deadline)
                return
            except (OSError, GroupClosed, ProtocolError) as exc:
                # A syncer SIGKILLed while it streams a BCAST ends the connection inside that
                # frame: a lost connection, which a learner redials (yeto_learn's does), not
                # the syncer breaking the protocol. Taken for one, it ended learner 0's thread
                # at the kill, and the others waited, silent, on a resumed syncer that waits
                # for all three learners before it starts.
                if isinstance(exc, ProtocolError) and not cut_inside_a_frame(exc):
                    raise
                # Past the deadline a redial could only spin: every connect succeeds into a
                # listener's backlog and every serve times out at once.
                if not self.may_redial or time.monotonic() > deadline:
                    raise
                self.redials += 1
            finally:
                group.close()

    def _dial(self, deadline: float) -> LearnerGroup:
        """A new generation's group; the restarted syncer may not be listening yet."""
        self.generation += 1
        self._anchors.clear()  # a new generation starts from what this syncer broadcasts
        self._deferred.clear()
        self._manifest, self._acked = None, False
        self.finals.clear()
        while True:
            group = LearnerGroup(
                self.address,
                self.session,
                learner_id=self.learner_id,
                generation=self.generation,
                num_streams=self.num_streams,
                timeout=10.0,
            )
            try:
                group.connect()
                return group
            except OSError:  # refused, or reset by a listener that is going away
                group.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def _serve(self, group: LearnerGroup, deadline: float) -> None:
        while not self.shut_down:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"learner {self.learner_id}: no SHUTDOWN in time")
            self._handle(group, group.receive(min(left, SILENCE_S)))

    def _handle(self, group: LearnerGroup, message: AnyMessage) -> None:
        match message:
            case BcastFragment():
                self._on_bcast(group, message)
            case PullReq():
                self._deferred[message.fragment_id] = message
                self._answer_ready(group)
            case FinalFragment():
                numel = self.session.layout.numels[message.fragment_id]
                values = np.array(decode_tensor(message.data, WireDtype.F32, numel, push=False))
                self.finals[message.fragment_id] = (message.version, values)
                self._maybe_ack(group)
            case FinalManifest():
                self._manifest = message
                self._maybe_ack(group)
            case Shutdown():
                if not self._acked:
                    raise SyncerError("SHUTDOWN before FINAL_ACK")
                self.shut_down = True
            case ErrorMessage():
                raise SyncerError(message.text)
            case _:
                raise SyncerError(f"unexpected {type(message).__name__}")

    def _on_bcast(self, group: LearnerGroup, bcast: BcastFragment) -> None:
        key = (bcast.fragment_id, bcast.version)
        data = bytes(bcast.data)
        seen = self.bcasts.setdefault(key, data)
        if seen != data:  # also across a restart: a redone round must reproduce its BCAST
            raise SyncerError(f"BCAST fragment {key[0]} version {key[1]} changed its bytes")
        held = self._anchors.get(bcast.fragment_id, -1)
        self._anchors[bcast.fragment_id] = max(held, bcast.version)
        self._answer_ready(group)

    def _answer_ready(self, group: LearnerGroup) -> None:
        fragments = len(self.session.layout)
        for fragment, pull in sorted(self._deferred.items(), key=lambda item: item[1].global_step):
            launch_version = max(pull.global_step - fragments, 0)
            anchor = self._anchors.get(fragment)
            if anchor is None or anchor < launch_version:
                continue  # the BCAST this round was launched against is still on its way
            del self._deferred[fragment]
            self._push(group, pull, anchor)

    def _push(self, group: LearnerGroup, pull: PullReq, base_version: int) -> None:
        self.before_push(pull.global_step)
        if self.push_delay_s:
            time.sleep(self.push_delay_s)
        local_step = pull.global_step * self.c_steps
        numel = self.session.layout.numels[pull.fragment_id]
        delta = replay_delta(self.learner_id, pull.fragment_id, base_version, local_step, numel)
        payload = encode_tensor(delta, self.session.dtype, push=True)
        self.pushes.append((self.generation, pull.global_step, base_version))
        group.send(
            PushFragment(
                learner_id=self.learner_id,
                fragment_id=pull.fragment_id,
                global_step=pull.global_step,
                round_attempt=pull.round_attempt,
                base_version=base_version,
                local_step=local_step,
                c_steps=self.c_steps,
                c_tokens=self.c_steps * 1000 * (self.learner_id + 1),
                data=payload.data,
            )
        )

    def _maybe_ack(self, group: LearnerGroup) -> None:
        manifest = self._manifest
        if manifest is None or self._acked:
            return
        for fragment, expected in enumerate(manifest.expected_versions):
            held = self.finals.get(fragment)
            if held is None or held[0] != expected:
                return
        group.send(FinalAck(manifest.final_global_step))
        self._acked = True


# -- running a session -----------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    name: str
    layout: WireLayout
    dtype: WireDtype
    num_streams: int
    checkpoint_every: int
    #: Learners 1.. pause on this round's PULL and learner 0 on the next (two rounds in
    #: flight, one partly answered); ``None``: nobody pauses, the kill lands mid-stream.
    pause_at: int | None
    push_delay_s: float = 0.0


CASES = [
    Case("every-1-paused-f32", SMALL_LAYOUT, WireDtype.F32, 0, 1, pause_at=7),
    Case("every-4-paused-bf16-striped", SMALL_LAYOUT, WireDtype.BF16, 2, 4, pause_at=7),
    Case("every-1-writing-q4", BIG_LAYOUT, WireDtype.Q4, 1, 1, None, push_delay_s=0.03),
]


def daemon_flags(case: Case, checkpoint: Path, port: int) -> list[str]:
    return [
        f"--port={port}",
        f"--learners={LEARNERS}",
        f"--quorum={LEARNERS}",  # every captured member answers: no timing in the merge
        f"--total-steps={TOTAL_STEPS}",
        "--pipeline=2",
        "--sync-interval-steps=0",
        f"--checkpoint-path={checkpoint}",
        f"--checkpoint-every={case.checkpoint_every}",
        "--mark-final-checkpoint",
        "--quorum-timeout-s=60",
        "--final-ack-timeout-s=60",
    ]


def make_learners(
    case: Case, port: int, *, may_redial: bool, pause: Callable[[int, int], None] | None = None
) -> list[ReplayLearner]:
    spec = SessionSpec(case.dtype, case.layout, bytes(range(32)), bytes(range(40, 72)))
    rng = np.random.default_rng(11)
    initial = [rng.normal(0.0, 1.0, n).astype(np.float32) for n in case.layout.numels]
    learners = []
    for learner_id in range(LEARNERS):
        hook = functools.partial(pause, learner_id) if pause else (lambda step: None)
        learners.append(
            ReplayLearner(
                ("127.0.0.1", port),
                spec,
                learner_id,
                case.num_streams,
                initial=initial if learner_id == 0 else None,
                may_redial=may_redial,
                before_push=hook,
                push_delay_s=case.push_delay_s,
                generation=100 * learner_id,
            )
        )
    return learners


class LearnerThreads:
    def __init__(self, learners: list[ReplayLearner]) -> None:
        self.failures: list[BaseException] = []
        deadline = time.monotonic() + RUN_TIMEOUT_S
        self.threads = [
            threading.Thread(target=self._play, args=(learner, deadline), daemon=True)
            for learner in learners
        ]
        for thread in self.threads:
            thread.start()

    def _play(self, learner: ReplayLearner, deadline: float) -> None:
        try:
            learner.play(deadline)
        except BaseException as exc:  # surfaced by join()
            self.failures.append(exc)

    def join(self, context: Callable[[], str]) -> None:
        for thread in self.threads:
            thread.join(RUN_TIMEOUT_S + 10)
        hung = [i for i, t in enumerate(self.threads) if t.is_alive()]
        # The failures too: a learner that failed leaves the others waiting on a session that
        # never starts, and the hang alone hid its error (learner 0's, twice).
        assert not hung, f"learners {hung} hung; failures: {self.failures!r}\n{context()}"
        assert not self.failures, f"{self.failures!r}\n{context()}"


@dataclass
class Outcome:
    checkpoint: bytes
    learners: list[ReplayLearner]


def run_uninterrupted(case: Case, directory: Path) -> Outcome:
    directory.mkdir()
    checkpoint, port = directory / "ckpt", free_port()
    learners = make_learners(case, port, may_redial=False)
    with Daemon(*daemon_flags(case, checkpoint, port)) as daemon:
        threads = LearnerThreads(learners)
        threads.join(lambda: daemon.stderr)
        assert daemon.wait(30) == 0, daemon.stderr
    return Outcome(checkpoint.read_bytes(), learners)


def last_logged_checkpoint(stderr: str) -> int:
    steps = [int(m.group(1)) for m in CHECKPOINT_LOGGED.finditer(stderr)]
    return max(steps, default=0)


def refuse_without_resume(case: Case, checkpoint: Path, port: int) -> None:
    before = checkpoint.read_bytes()
    result = subprocess.run(
        [sys.executable, "-m", "yeto_sync", *daemon_flags(case, checkpoint, port)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith("yeto-sync: error: ") and "--resume" in line and str(checkpoint) in line
    assert checkpoint.read_bytes() == before


def run_crashed_and_resumed(case: Case, directory: Path) -> Outcome:
    directory.mkdir()
    checkpoint, port = directory / "ckpt", free_port()
    flags = daemon_flags(case, checkpoint, port)
    paused: dict[int, int] = {}
    release = threading.Event()
    lock = threading.Lock()

    def pause(learner_id: int, step: int) -> None:
        assert case.pause_at is not None
        if step == case.pause_at + (1 if learner_id == 0 else 0) and not release.is_set():
            with lock:
                paused[learner_id] = step
            release.wait(RUN_TIMEOUT_S)

    learners = make_learners(
        case, port, may_redial=True, pause=pause if case.pause_at is not None else None
    )
    with Daemon(*flags) as first:
        threads = LearnerThreads(learners)
        if case.pause_at is not None:
            # Round pause_at has learner 0's answer, round pause_at + 1 none: two in flight.
            committed = case.pause_at - 1
            wait_until(lambda: len(paused) == LEARNERS, 30, f"learners paused\n{first.stderr}")
            expected_step = committed - committed % case.checkpoint_every
            wait_until(
                lambda: last_logged_checkpoint(first.stderr) == expected_step,
                30,
                f"the checkpoint at step {expected_step}\n{first.stderr}",
            )
        else:
            wait_until(
                lambda: last_logged_checkpoint(first.stderr) >= 3,
                30,
                f"the checkpoint at step 3\n{first.stderr}",
            )
        assert first.proc is not None and first.proc.poll() is None, "finished before the kill"
        logged = last_logged_checkpoint(first.stderr)
        first.proc.kill()  # SIGKILL: no handler runs, nothing is flushed
        assert first.wait(10) == -9

    # Complete and valid: a full V3 file at a committed step no older than the last one logged.
    state = read_checkpoint(checkpoint)
    assert state.global_step >= logged >= 1
    assert state.global_step < TOTAL_STEPS
    if case.pause_at is not None:
        assert state.global_step == logged
    fragments = len(case.layout)
    for index, fragment in enumerate(state.fragments):
        assert fragment.version == scheduled_version(index, state.global_step, fragments)
        assert fragment.params.size == case.layout.numels[index]
        assert np.isfinite(fragment.params).all() and np.isfinite(fragment.momentum).all()
    leftovers = {p.name for p in directory.iterdir()} - {checkpoint.name}
    # Only a torn temporary sibling may remain; never a second or partial checkpoint.
    assert all(re.fullmatch(r"\.ckpt\.\d+\.[0-9a-f]+\.tmp", name) for name in leftovers), leftovers

    refuse_without_resume(case, checkpoint, port)

    with Daemon(*flags, "--resume") as second:
        release.set()
        threads.join(lambda: second.stderr)
        assert second.wait(30) == 0, second.stderr
        assert f"resumed_global_step={state.global_step}" in second.stderr
    for learner in learners:
        # A learner racing the kill may reach the dying listener once more before it closes.
        assert learner.redials == 1 if case.pause_at is not None else learner.redials >= 1
        redone = [step for gen, step, _ in learner.pushes if gen == learner.generation]
        assert min(redone) == state.global_step + 1  # resumed at the first uncommitted step
    return Outcome(checkpoint.read_bytes(), learners)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_kill_9_and_resume_ends_bit_identical_to_an_uninterrupted_run(
    tmp_path: Path, case: Case
) -> None:
    baseline = run_uninterrupted(case, tmp_path / "uninterrupted")
    resumed = run_crashed_and_resumed(case, tmp_path / "crashed")

    assert resumed.checkpoint == baseline.checkpoint  # params, momentum, versions, ledger
    final = read_checkpoint(tmp_path / "crashed" / "ckpt")
    assert final.global_step == TOTAL_STEPS
    assert marker_state(tmp_path / "crashed" / "ckpt", TOTAL_STEPS).status is MarkerStatus.FINAL
    for want, got in zip(baseline.learners, resumed.learners, strict=True):
        assert sorted(got.finals) == list(range(len(case.layout)))
        for fragment, (version, values) in got.finals.items():
            base_version, base_values = want.finals[fragment]
            assert version == base_version
            assert values.tobytes() == base_values.tobytes()
            assert values.tobytes() == final.fragments[fragment].params.tobytes()
        # Same pushes: the resumed learner sent each step's PUSH against the same base.
        assert {(s, b) for _, s, b in got.pushes} == {(s, b) for _, s, b in want.pushes}
        for key, data in got.bcasts.items():
            if key in want.bcasts:
                assert data == want.bcasts[key], f"BCAST {key} differs"
    assert set().union(*(lr.bcasts for lr in resumed.learners)) == set().union(
        *(lr.bcasts for lr in baseline.learners)
    )
