"""The benchmark cutoff and the consolidation restart against the real ``yeto-sync`` daemon.

Scripted learners on plain sockets (tests/scripted_learner.py): BUDGET_DONE's fatal cases over
the wire (a trailing byte is the frame layer's ``BAD_FRAME_LENGTH``), then the two syncer
processes of the benchmark closure for f32 and q4 — the cutoff process exits 0 with an unmarked
checkpoint of the committed prefix, and the restarted one runs exactly F ordinary rounds that
every frozen learner answers with ``frozen_local − resumed_global``, ending in the ordinary
final cut and the marked final checkpoint.
"""

from __future__ import annotations

import json
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from daemon_harness import Daemon, error_code
from numpy.typing import NDArray
from scripted_learner import GroupClosed, LearnerGroup, ScriptedLearner, SessionSpec

from yeto_proto import (
    FRAME_MAGIC,
    BcastFragment,
    BudgetDone,
    ErrorMessage,
    FinalFragment,
    FinalManifest,
    FrameType,
    MergeMode,
    PullReq,
    PushFragment,
    Shutdown,
    WireDtype,
    WireFragment,
    WireLayout,
)
from yeto_proto.checkpoint import marker_path, marker_state, read_checkpoint
from yeto_proto.dtypes import decode_tensor, encode_tensor

F32 = NDArray[np.float32]
LAYOUT = WireLayout(
    (
        WireFragment(MergeMode.AVG, (600,)),
        WireFragment(MergeMode.AVG, (300, 40)),
        WireFragment(MergeMode.RDA, (257,)),
    )
)
F = len(LAYOUT.fragments)
LEARNERS = 2
BUDGET = 12
#: Local steps per answered pull: both learners reach the budget with rounds 1 and 2.
STEPS_PER_ROUND = (6, 6)
TOKENS_PER_STEP = (100, 250)


def spec(dtype: WireDtype) -> SessionSpec:
    return SessionSpec(dtype, LAYOUT, bytes(range(32)), bytes(range(50, 82)))


def initial_params() -> list[F32]:
    rng = np.random.default_rng(11)
    return [rng.normal(0, 1, n).astype(np.float32) for n in LAYOUT.numels]


def common_flags(directory: Path, tape: str) -> list[str]:
    return [
        f"--learners={LEARNERS}",
        f"--quorum={LEARNERS}",
        "--pipeline=2",
        "--sync-interval-steps=0",
        f"--checkpoint-path={directory / 'ckpt'}",
        "--checkpoint-every=1",
        "--mark-final-checkpoint",
        f"--event-tape={directory / tape}",
        "--quorum-timeout-s=60",
        "--final-ack-timeout-s=60",
    ]


def until_error(group: LearnerGroup) -> str:
    """Read (and ignore broadcasts and pulls) until ERROR; then the group must close."""
    while True:
        message = group.receive(20)
        if isinstance(message, ErrorMessage):
            break
    with pytest.raises(GroupClosed):
        while True:
            group.receive(20)
    return error_code(message.text)


def budget_frame(steps: int, extra: bytes = b"") -> bytes:
    payload = struct.pack("<Q", steps) + extra
    return struct.pack("<IBQ", FRAME_MAGIC, FrameType.BUDGET_DONE, len(payload)) + payload


# -- fatal reports over the wire -----------------------------------------------------------------
def test_bad_reports_are_fatal_for_their_connection_only(tmp_path: Path) -> None:
    session = spec(WireDtype.F32)
    flags = [
        *common_flags(tmp_path, "tape"),
        "--total-steps=50",
        f"--learner-budget-steps={BUDGET}",
    ]
    with Daemon(*flags) as daemon:
        keeper = ScriptedLearner(
            LearnerGroup(daemon.address, session, learner_id=0, generation=1, num_streams=1),
            initial=initial_params(),
        )
        keeper.start()

        def hostile(generation: int) -> LearnerGroup:
            group = LearnerGroup(
                daemon.address, session, learner_id=1, generation=generation, num_streams=0
            )
            group.connect()
            return group

        trailing = hostile(11)
        trailing.sockets[0].sendall(budget_frame(BUDGET, b"\0"))
        assert until_error(trailing) == "BAD_FRAME_LENGTH"

        wrong = hostile(12)
        wrong.send(BudgetDone(BUDGET + 1))
        assert until_error(wrong) == "BUDGET_MISMATCH"

        twice = hostile(13)
        twice.send(BudgetDone(BUDGET))
        twice.send(BudgetDone(BUDGET))
        assert until_error(twice) == "DUPLICATE_BUDGET_DONE"

        again = hostile(14)  # a new generation of a learner that already reported
        again.send(BudgetDone(BUDGET))
        assert until_error(again) == "DUPLICATE_BUDGET_DONE"

        assert daemon.proc is not None and daemon.proc.poll() is None  # the syncer carries on
        keeper.group.send(BudgetDone(BUDGET))
        assert daemon.wait(30) == 0, daemon.stderr
        for group in (trailing, wrong, twice, again, keeper.group):
            group.close()

    saved = read_checkpoint(tmp_path / "ckpt")
    assert saved.global_step == 0 and saved.versions == (0,) * F
    assert not marker_path(tmp_path / "ckpt").exists()


# -- the two syncer processes ----------------------------------------------------------------------
@dataclass
class FrozenLearner(ScriptedLearner):
    """After BUDGET_DONE: broadcasts only move anchors; pulls get ``frozen − anchor``."""

    budget: int = BUDGET
    total_tokens: int = 0

    def _on_bcast(self, bcast: BcastFragment) -> None:
        held = self.anchors.get(bcast.fragment_id)
        if held is not None and bcast.version <= held[0]:
            assert bcast.version < held[0] or bytes(bcast.data) == held[1]
            return
        numel = self._numel(bcast.fragment_id)
        raw = np.array(decode_tensor(bcast.data, self.session.dtype, numel, push=False))
        self.anchors[bcast.fragment_id] = (bcast.version, bytes(bcast.data), raw)
        self.bcasts.append((bcast.fragment_id, bcast.version, raw))
        pull = self._deferred.pop(bcast.fragment_id, None)
        if pull is not None:
            self._on_pull(pull)

    def _on_pull(self, pull: PullReq) -> None:
        anchor = self.anchors.get(pull.fragment_id)
        if anchor is None:
            self._deferred[pull.fragment_id] = pull
            return
        base_version, _, raw = anchor
        delta = (self.local[pull.fragment_id] - raw).astype(np.float32)
        self.group.send(
            PushFragment(
                learner_id=self.group.learner_id,
                fragment_id=pull.fragment_id,
                global_step=pull.global_step,
                round_attempt=pull.round_attempt,
                base_version=base_version,
                local_step=self.budget,
                c_steps=self.budget,
                c_tokens=self.total_tokens,
                data=encode_tensor(delta, self.session.dtype, push=True).data,
            )
        )


def run_until_budget(learner: ScriptedLearner, seen_after: list[type[Any]]) -> None:
    """Train to the budget (rounds 1 and 2), see round 2 commit, report, stay until the end.

    Waiting for round 2's broadcast makes the cut deterministic: C = 2, and rounds 3 and 4 are
    launched (round 4 right after round 2 commits) and in flight when the first report lands.
    """
    learner.start()
    while learner.local_step < BUDGET or learner.anchors.get(1, (0,))[0] < 2:
        message = learner.group.receive(30)
        if isinstance(message, PullReq) and learner.local_step >= BUDGET:
            continue  # trained out: a frozen learner leaves the cutoff's pulls unanswered
        learner.handle(message)
    learner.group.send(BudgetDone(BUDGET))
    while True:  # pulls and broadcasts may still come; no final cut, no SHUTDOWN, no ERROR
        try:
            late = learner.group.receive(30)
        except GroupClosed:
            return
        seen_after.append(type(late))


def in_threads(*jobs: Any, log: Any) -> None:
    failures: list[BaseException] = []

    def guarded(job: Any) -> None:
        try:
            job()
        except BaseException as exc:  # surfaced below
            failures.append(exc)

    threads = [threading.Thread(target=guarded, args=(job,)) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(90)
    assert not failures, f"{failures!r}\n{log()}"


def tape_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def cutoff_learner(address: tuple[str, int], dtype: WireDtype, i: int) -> ScriptedLearner:
    group = LearnerGroup(address, spec(dtype), learner_id=i, generation=1 + i, num_streams=2)
    return ScriptedLearner(
        group,
        initial=initial_params() if i == 0 else None,
        steps_per_round=STEPS_PER_ROUND[i],
        tokens_per_step=TOKENS_PER_STEP[i],
    )


@pytest.mark.parametrize("dtype", [WireDtype.F32, WireDtype.Q4], ids=["f32", "q4"])
def test_cutoff_then_consolidation_restart(tmp_path: Path, dtype: WireDtype) -> None:
    checkpoint = tmp_path / "ckpt"
    after: list[list[type[Any]]] = [[] for _ in range(LEARNERS)]
    cutoff_flags = [
        *common_flags(tmp_path, "cutoff-tape"),
        "--total-steps=100000",
        f"--learner-budget-steps={BUDGET}",
    ]
    with Daemon(*cutoff_flags) as cutoff:
        learners = [cutoff_learner(cutoff.address, dtype, i) for i in range(LEARNERS)]
        jobs = [
            lambda lr=lr, seen=seen: run_until_budget(lr, seen)
            for lr, seen in zip(learners, after, strict=True)
        ]
        in_threads(*jobs, log=lambda: cutoff.stderr)
        assert cutoff.wait(30) == 0, cutoff.stderr
    for learner, seen in zip(learners, after, strict=True):
        learner.group.close()
        assert not {FinalFragment, FinalManifest, Shutdown, ErrorMessage} & set(seen)

    # Rounds 1 and 2 got both answers; 3 and 4 were in flight and are cancelled whole.
    saved = read_checkpoint(checkpoint)
    c = saved.global_step
    assert c == 2 and saved.versions == (1, 2, 0)
    assert not marker_path(checkpoint).exists()
    cutoff_tape = tape_lines(tmp_path / "cutoff-tape")
    assert [r["step"] for r in cutoff_tape if "event" not in r] == [1, 2]
    assert sorted(r["step"] for r in cutoff_tape if r.get("event") == "round_cancelled") == [3, 4]
    (record,) = [r for r in cutoff_tape if r.get("event") == "budget_cutoff"]
    assert record["complete"] and record["step"] == c
    assert "budget cutoff at global step 2" in cutoff.stderr
    last_line = cutoff.stderr.strip().splitlines()[-1]
    assert "recovery checkpoint (unmarked" in last_line and "global_step 2" in last_line

    restart_flags = [*common_flags(tmp_path, "tape"), "--resume", f"--total-steps={c + F}"]
    with Daemon(*restart_flags) as restart:
        frozen = [
            FrozenLearner(
                LearnerGroup(
                    restart.address, spec(dtype), learner_id=i, generation=100 + i, num_streams=1
                ),
                local={p: values.copy() for p, values in learners[i].local.items()},
                total_tokens=BUDGET * TOKENS_PER_STEP[i],
            )
            for i in range(LEARNERS)
        ]
        in_threads(
            *(lambda lr=lr: (lr.start(), lr.run(timeout=60)) for lr in frozen),
            log=lambda: restart.stderr,
        )
        assert restart.wait(30) == 0, restart.stderr
    for learner in frozen:
        learner.group.close()
        assert learner.acked and learner.shut_down
        assert {f for f, _, _ in learner.bcasts} == set(range(F))

    merges = [r for r in tape_lines(tmp_path / "tape") if "event" not in r]
    assert [r["step"] for r in merges] == list(range(c + 1, c + F + 1))
    assert sorted(r["fragment"] for r in merges) == list(range(F))
    for record in merges:
        assert [m["id"] for m in record["responded_members"]] == [0, 1]
        assert record["missed_members"] == []
        assert [(r["c_steps"], r["c_tokens"]) for r in record["responders"]] == [
            (BUDGET, BUDGET * TOKENS_PER_STEP[0]),
            (BUDGET, BUDGET * TOKENS_PER_STEP[1]),
        ]
    final = read_checkpoint(checkpoint)
    assert final.global_step == c + F
    assert marker_state(checkpoint, c + F).status.name == "FINAL"
    ledger = {e.learner_id: (e.merges, e.steps) for e in final.ledger}
    assert ledger == {0: (2 + F, BUDGET + F * BUDGET), 1: (2 + F, BUDGET + F * BUDGET)}
    for p, state in enumerate(final.fragments):
        version, delivered = frozen[0].finals[p]
        assert version == state.version
        np.testing.assert_array_equal(state.params, delivered)
