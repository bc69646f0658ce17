"""Rounds: targets, pipeline, pacing, quorum and grace, deadlines and retries, PUSH rules."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from sim import ScriptedLearner, Sim, avg_layout

from yeto_proto.constants import WireDtype
from yeto_proto.dtypes import encode_tensor
from yeto_proto.errors import ErrorCode
from yeto_proto.messages import Heartbeat, PullReq, PushFragment
from yeto_sync.config import SyncerConfig
from yeto_sync.coordinator import LAUNCH_TIMER, Phase
from yeto_sync.events import (
    AppendTape,
    CancelTimer,
    CloseGroup,
    GroupKey,
    Log,
    MessageReceived,
    SetTimer,
)

LAYOUT3 = avg_layout((4,), (3, 2), (5,))
LAYOUT1 = avg_layout((6,))


def pulls(sim: Sim, key: GroupKey) -> list[tuple[int, int, int]]:
    return [(p.global_step, p.fragment_id, p.round_attempt) for p in sim.sends_to(key, PullReq)]


def closed_code(sim: Sim, key: GroupKey) -> str:
    error = sim.closed[key]
    assert error is not None
    return error.text.split(":", 1)[0]


# -- targets, pipeline, pacing -------------------------------------------------------------------
def test_round_t_targets_fragment_t_minus_one_mod_f() -> None:
    sim = Sim(SyncerConfig(learners=1, total_steps=7, pipeline=1), LAYOUT3)
    (a,) = sim.start()

    assert sim.run().code == 0

    assert pulls(sim, a.key) == [(t, (t - 1) % 3, 1) for t in range(1, 8)]
    assert [r["fragment"] for r in sim.merges] == [0, 1, 2, 0, 1, 2, 0]
    model = sim.coordinator.model
    assert model is not None and model.versions == (7, 5, 6)


@pytest.mark.parametrize(("pipeline", "depth"), [(0, 1), (1, 1), (2, 2), (3, 3), (5, 3)])
def test_pipeline_depth_is_min_max_pipeline_1_and_f(pipeline: int, depth: int) -> None:
    sim = Sim(SyncerConfig(learners=1, total_steps=9, pipeline=pipeline), LAYOUT3)
    (a,) = sim.start(auto=False)

    launched = pulls(sim, a.key)

    assert launched == [(t, t - 1, 1) for t in range(1, depth + 1)]
    assert len({fragment for _, fragment, _ in launched}) == depth


def test_launch_pacing_by_min_round_interval() -> None:
    config = SyncerConfig(learners=1, total_steps=9, pipeline=3, min_round_interval_ms=500)
    sim = Sim(config, LAYOUT3)
    (a,) = sim.start(auto=False)
    assert pulls(sim, a.key) == [(1, 0, 1)]
    assert sim.timers[LAUNCH_TIMER] == pytest.approx(0.5)

    sim.advance(0.499)
    assert len(pulls(sim, a.key)) == 1
    sim.advance(0.001)
    assert pulls(sim, a.key)[-1] == (2, 1, 1)
    sim.advance(0.5)
    assert pulls(sim, a.key)[-1] == (3, 2, 1)
    assert LAUNCH_TIMER not in sim.timers  # depth 3 reached: nothing to wait for


def paced_pair() -> tuple[Sim, ScriptedLearner, ScriptedLearner]:
    """Two learners with step-time estimates, round 1 launched at t = 1.0, round 2 paced.

    H = 24, F = 3, ξ_step = 0.1 s (a: 10 steps in 1 s; b: 20, 0.05 s) → interval 0.8 s.
    """
    sim = Sim(SyncerConfig(learners=2, total_steps=9, pipeline=3), LAYOUT3)
    a, b = sim.learner(0, auto=False), sim.learner(1, auto=False)
    a.connect()
    b.connect()
    a.heartbeat(0)
    b.heartbeat(0)
    sim.advance(1.0)
    a.heartbeat(10)
    b.heartbeat(20)
    a.init_all([np.zeros(f.numel, np.float32) for f in LAYOUT3.fragments])
    return sim, a, b


def test_launch_pacing_by_the_slowest_step_time() -> None:
    sim, a, _ = paced_pair()
    assert pulls(sim, a.key) == [(1, 0, 1)]
    assert sim.timers[LAUNCH_TIMER] == pytest.approx(1.0 + 0.8)


def test_a_waiting_launch_is_measured_again_when_the_estimates_change() -> None:
    # spec/syncer.md § 3: the conditions are checked again after every event that may change
    # them; the launch timer was set with the estimates of round 1's launch.
    sim, a, b = paced_pair()

    sim.advance(0.1)
    a.heartbeat(30)  # 20 steps in 0.1 s: a's estimate 0.5·0.005 + 0.5·0.1 = 0.0525 s
    # ξ_step = max(0.0525, b's 0.05) → interval 24 · 0.0525 / 3 = 0.42 s after the launch at 1.0
    assert sim.timers[LAUNCH_TIMER] == pytest.approx(1.42)
    sim.advance(0.32)
    assert pulls(sim, a.key)[-1] == (2, 1, 1)

    # The slowest learner leaving shortens the wait too: b gets slower, then drops.
    sim.advance(0.01)
    b.heartbeat(21)  # 1 step in 0.43 s: b's estimate 0.5·0.43 + 0.5·0.05 = 0.24 s
    assert sim.timers[LAUNCH_TIMER] == pytest.approx(1.42 + 24 * 0.24 / 3)
    b.disconnect()
    assert sim.timers[LAUNCH_TIMER] == pytest.approx(1.42 + 24 * 0.0525 / 3)


def test_a_push_whose_report_makes_a_launch_due_is_judged_before_that_launch() -> None:
    # Row 4 of spec/syncer.md § 6: round 2 was not in flight when this PUSH arrived.
    sim, a, _ = paced_pair()
    sim.advance(0.5)
    actions = sim.message(a.key, a.push_for(PullReq(1, 2, 1), local_step=200))
    rejected = [x.record for x in actions if isinstance(x, AppendTape)]
    assert [(r["event"], r["code"]) for r in rejected] == [("push_rejected", "PUSH_OUT_OF_ROUND")]
    assert pulls(sim, a.key)[-1] == (2, 1, 1)  # the shorter interval launched it, after


def test_a_slowest_learner_closed_for_a_protocol_error_shortens_the_wait() -> None:
    sim, a, b = paced_pair()
    sim.advance(0.3)
    b.heartbeat(21)  # b slows down: the launch moves later
    slow = sim.timers[LAUNCH_TIMER]
    sim.message(b.key, Heartbeat(learner_id=0, local_step=22))  # fatal: not b's own id
    assert closed_code(sim, b.key) == "LEARNER_ID_MISMATCH"
    assert slow == pytest.approx(1.0 + 24 * 0.175 / 3)  # b: 0.5 · 0.3 + 0.5 · 0.05 s a step
    assert sim.timers[LAUNCH_TIMER] == pytest.approx(1.0 + 0.8)  # a's pace alone


# -- quorum, completion, grace -------------------------------------------------------------------
def test_k_is_min_of_quorum_and_captured_members() -> None:
    sim = Sim(SyncerConfig(learners=2, total_steps=3, quorum=5), LAYOUT3)
    sim.start()
    sim.run()
    assert {r["quorum"] for r in sim.merges} == {2}


def test_pull_goes_to_each_captured_member() -> None:
    sim = Sim(SyncerConfig(learners=3, total_steps=3, pipeline=1), LAYOUT3)
    crew = sim.start(auto=False)
    for learner in crew:
        assert pulls(sim, learner.key) == [(1, 0, 1)]
    members = sim.coordinator.rounds_in_flight[0].members
    assert members == tuple(learner.key for learner in crew)
    launched = sim.logs("round launched")[0].fields
    assert launched["members"] == [{"id": i, "generation": 1} for i in range(3)]


def test_quorum_then_full_grace_cap_without_an_estimate() -> None:
    sim = Sim(SyncerConfig(learners=2, total_steps=3, quorum=1, pipeline=1), LAYOUT3)
    a, b = sim.start(auto=False)
    pull = sim.sends_to(a.key, PullReq)[0]
    sim.advance(0.25)

    sim.message(a.key, a.push_for(pull))

    assert sim.timers["grace:1:1"] == pytest.approx(1.25)
    sim.advance(0.999)
    assert not sim.merges
    sim.advance(0.001)
    (merge,) = sim.merges
    assert merge["responded_members"] == [{"id": 0, "generation": 1}]
    assert merge["missed_members"] == [{"id": 1, "generation": 1}]
    assert merge["grace_ms"] == 1000.0 and merge["quorum_ms"] == 250.0
    # A late PUSH from the missed member is out of round, not an error.
    sim.message(b.key, b.push_for(pull))
    assert sim.tape[-1]["code"] == ErrorCode.PUSH_OUT_OF_ROUND.value


def test_a_learner_left_out_of_every_merge_is_warned_about_once() -> None:
    # Under --quorum 1 the nearer learner commits each round; the farther one's PUSHes come
    # after the commit, every time. Its rejections are info lines; the third in a row warns.
    sim = Sim(SyncerConfig(learners=2, total_steps=6, quorum=1, pipeline=1), LAYOUT3)
    near, far = sim.start(auto=False)
    for step in range(1, 6):
        while (pull := sim.sends_to(near.key, PullReq)[-1]).global_step < step:
            sim.advance(0.5)  # the launch waits for its pacing
        sim.message(near.key, near.push_for(pull))
        sim.advance(1.0)  # the grace cap passes: round `step` commits with `near` alone
        sim.message(far.key, far.push_for(pull))
        assert sim.tape[-1]["code"] == ErrorCode.PUSH_OUT_OF_ROUND.value
        warned = [
            log
            for log in sim.of_type(Log)
            if log.text.startswith("a learner's PUSHes keep arriving after their rounds")
        ]
        assert len(warned) == (1 if step >= 3 else 0)
    (warning,) = warned
    assert warning.level == "warning" and warning.throttled
    assert "under --quorum 1 a learner slower than the first 1" in warning.text
    assert warning.fields["learner_id"] == 1 and warning.fields["late_pushes"] == 3


def test_all_captured_answered_completes_at_once() -> None:
    sim = Sim(SyncerConfig(learners=2, total_steps=3, quorum=1, pipeline=1), LAYOUT3)
    a, b = sim.start(auto=False)
    pull = sim.sends_to(a.key, PullReq)[0]
    sim.message(a.key, a.push_for(pull))
    assert "grace:1:1" in sim.timers

    actions = sim.message(b.key, b.push_for(pull))

    assert len(sim.merges) == 1
    assert CancelTimer("grace:1:1") in actions and CancelTimer("quorum:1:1") in actions
    assert "grace:1:1" not in sim.timers


def _estimates(sim: Sim, a: Any, b: Any) -> None:
    """ξ_step: learner 0 at 0.1 s per step, learner 1 at 0.2 s (the slowest)."""
    a.heartbeat(0)
    b.heartbeat(0)
    sim.advance(2.0)
    a.heartbeat(20)
    b.heartbeat(10)


@pytest.mark.parametrize(
    ("answer_after", "expected_grace"),
    [
        # γ·(τ·ξ_step − ξ_quorum − ξ_sync) = 0.8·(2·0.2 − 0.05 − 0) = 0.28
        (0.05, 0.28),
        # 0.8·(0.4 − 0.3) = 0.08
        (0.3, 0.08),
        # τ·ξ_step − ξ_quorum < 0 → no grace: the round completes with K at once
        (0.5, 0.0),
    ],
)
def test_adaptive_grace(answer_after: float, expected_grace: float) -> None:
    sim = Sim(SyncerConfig(learners=2, total_steps=3, quorum=1, pipeline=1), LAYOUT3)
    a, b = sim.learner(0, auto=False), sim.learner(1, auto=False)
    a.connect()
    b.connect()
    _estimates(sim, a, b)
    a.init_all([np.zeros(f.numel, np.float32) for f in LAYOUT3.fragments])
    launched_at = sim.now
    pull = sim.sends_to(a.key, PullReq)[0]
    sim.advance(answer_after)

    sim.message(a.key, a.push_for(pull, local_step=20))  # no new step sample

    if expected_grace == 0.0:
        assert len(sim.merges) == 1 and sim.merges[0]["grace_ms"] == 0.0
        return
    assert sim.timers["grace:1:1"] == pytest.approx(launched_at + answer_after + expected_grace)
    sim.advance(expected_grace)
    assert sim.merges[0]["grace_ms"] == pytest.approx(expected_grace * 1000)
    assert sim.merges[0]["quorum_ms"] == pytest.approx(answer_after * 1000)


def merge_clock(seconds_per_merge: float) -> Callable[[], float]:
    """A work clock each of whose readings is ``seconds_per_merge`` after the one before (the
    coordinator reads it when a merge starts and when it ends)."""
    readings = itertools.count(1)
    return lambda: seconds_per_merge * next(readings)


def test_sync_time_is_the_merge_as_the_work_clock_measures_it() -> None:
    config = SyncerConfig(learners=1, total_steps=2, quorum=1, sync_interval_steps=0)
    sim = Sim(config, LAYOUT3, work_clock=merge_clock(0.25))
    sim.start()
    sim.run()
    assert [m["sync_ms"] for m in sim.merges] == [250.0, 250.0]


def test_sync_time_is_the_merge_alone_not_the_wait_for_lower_rounds() -> None:
    """Pinned: ξ_sync = the previous round's merge + commit time. A round that completed early
    and waited for a stalled lower one must not shrink the next grace window by that wait."""
    config = SyncerConfig(learners=2, total_steps=4, quorum=1, sync_interval_steps=0)
    sim = Sim(config, LAYOUT3, work_clock=merge_clock(0.1))  # H = 0: no pacing, pipeline 2
    a, b = sim.learner(0, auto=False), sim.learner(1, auto=False)
    a.connect()
    b.connect()
    _estimates(sim, a, b)  # ξ_step = 0.2 s
    a.init_all([np.zeros(f.numel, np.float32) for f in LAYOUT3.fragments])
    first, second = sim.sends_to(a.key, PullReq)
    # Round 2 completes at once (all answered), then waits 0.3 s for round 1 to commit.
    sim.message(a.key, a.push_for(second, local_step=20))
    sim.message(b.key, b.push_for(second, local_step=10))
    sim.advance(0.3)
    sim.message(a.key, a.push_for(first, local_step=20))
    sim.message(b.key, b.push_for(first, local_step=10))
    assert [(m["step"], m["sync_ms"]) for m in sim.merges] == [(1, 100.0), (2, 100.0)]
    third = sim.sends_to(a.key, PullReq)[2]
    assert third.global_step == 3
    sim.advance(0.25)  # round 3 was launched once both merges were done: 0.05 s ago

    sim.message(a.key, a.push_for(third, local_step=20))

    # 0.8·(2·0.2 − 0.05 − 0.1) = 0.2
    assert sim.timers["grace:3:1"] == pytest.approx(sim.now + 0.2)


def test_a_round_launched_after_a_commit_counts_from_the_end_of_the_merge() -> None:
    """Its PULLs leave once the merge is done: its ξ_quorum, quorum deadline and pacing count
    from then, or the merge would be subtracted from the grace window twice."""
    config = SyncerConfig(
        learners=2, total_steps=3, quorum=1, pipeline=1, quorum_timeout_s=10, sync_interval_steps=0
    )
    sim = Sim(config, LAYOUT3, work_clock=merge_clock(0.1))
    a, b = sim.learner(0, auto=False), sim.learner(1, auto=False)
    a.connect()
    b.connect()
    _estimates(sim, a, b)  # ξ_step = 0.2 s
    a.init_all([np.zeros(f.numel, np.float32) for f in LAYOUT3.fragments])
    (first,) = sim.sends_to(a.key, PullReq)
    sim.message(a.key, a.push_for(first, local_step=20))
    sim.message(b.key, b.push_for(first, local_step=10))  # round 1 commits; round 2 launches
    committed_at = sim.now
    second = sim.sends_to(a.key, PullReq)[1]
    assert second.global_step == 2
    assert sim.timers["quorum:2:1"] == pytest.approx(committed_at + 0.1 + 10)
    sim.advance(0.2)  # 0.1 s after the PULL left

    sim.message(a.key, a.push_for(second, local_step=20))

    # 0.8·(2·0.2 − 0.1 − 0.1) = 0.16; counted from the event, ξ_quorum would be 0.2 s
    assert sim.timers["grace:2:1"] == pytest.approx(sim.now + 0.16)


# -- deadlines and retries -----------------------------------------------------------------------
def test_quorum_deadline_discards_partials_and_retries_with_current_members() -> None:
    config = SyncerConfig(learners=2, total_steps=3, quorum=2, pipeline=1, quorum_timeout_s=10)
    sim = Sim(config, LAYOUT3)
    a, b = sim.start(auto=False)
    first_pull = sim.sends_to(a.key, PullReq)[0]
    sim.message(a.key, a.push_for(first_pull, c_steps=7))

    sim.advance(10.0)

    discarded = [r for r in sim.tape if r.get("event") == "attempt_discarded"]
    assert discarded == [
        {
            "event": "attempt_discarded",
            "step": 1,
            "fragment": 0,
            "attempt": 1,
            "quorum": 2,
            "expected_members": [{"id": 0, "generation": 1}, {"id": 1, "generation": 1}],
            "responded_members": [{"id": 0, "generation": 1}],
        }
    ]
    assert pulls(sim, a.key) == [(1, 0, 1), (1, 0, 2)]
    assert pulls(sim, b.key) == [(1, 0, 1), (1, 0, 2)]
    # A delayed response of the discarded attempt cannot enter the retry.
    sim.message(b.key, b.push_for(first_pull))
    assert sim.tape[-1]["code"] == ErrorCode.PUSH_WRONG_ATTEMPT.value
    retry = sim.sends_to(a.key, PullReq)[1]
    sim.message(a.key, a.push_for(retry, c_steps=3))
    sim.message(b.key, b.push_for(retry))
    (merge,) = sim.merges
    assert merge["attempt"] == 2
    assert [r["c_steps"] for r in merge["responders"]] == [3, 5]


def test_retry_gives_missing_learners_a_second_to_come_back() -> None:
    config = SyncerConfig(learners=2, total_steps=3, quorum=2, pipeline=1, quorum_timeout_s=5)
    sim = Sim(config, LAYOUT3)
    a, b = sim.start(auto=False)
    b.disconnect()

    sim.advance(5.0)
    assert sim.timers["retry:1"] == pytest.approx(6.0)
    round_one = sim.coordinator.rounds_in_flight[0]
    assert round_one.phase is Phase.WAITING
    # A PUSH while no attempt runs is a wrong attempt.
    sim.message(a.key, a.push_for(sim.sends_to(a.key, PullReq)[0]))
    assert sim.tape[-1]["code"] == ErrorCode.PUSH_WRONG_ATTEMPT.value

    fresh = b.connect()
    assert pulls(sim, fresh) == []  # the retry waits for its timer
    sim.advance(1.0)

    assert pulls(sim, fresh) == [(1, 0, 2)]
    assert pulls(sim, a.key) == [(1, 0, 1), (1, 0, 2)]
    assert round_one.members == (a.key, fresh) and round_one.quorum == 2


def test_a_learner_lost_for_good_does_not_stall_the_retry() -> None:
    """After the second, the retry runs with those connected; K shrinks as at a launch."""
    config = SyncerConfig(learners=2, total_steps=3, quorum=2, pipeline=1, quorum_timeout_s=5)
    sim = Sim(config, LAYOUT3)
    a, b = sim.start(auto=False)
    b.disconnect()

    sim.advance(6.0)

    round_one = sim.coordinator.rounds_in_flight[0]
    assert pulls(sim, a.key) == [(1, 0, 1), (1, 0, 2)]
    assert round_one.members == (a.key,) and round_one.quorum == 1
    sim.message(a.key, a.push_for(sim.sends_to(a.key, PullReq)[-1]))
    assert [r["step"] for r in sim.merges] == [1]


def test_a_retry_with_nobody_connected_waits_in_one_second_steps() -> None:
    config = SyncerConfig(learners=2, total_steps=3, quorum=2, pipeline=1, quorum_timeout_s=5)
    sim = Sim(config, LAYOUT3)
    a, b = sim.start(auto=False)
    a.disconnect()
    b.disconnect()

    sim.advance(5.0)
    sim.advance(1.0)
    assert sim.timers["retry:1"] == pytest.approx(7.0)
    assert sim.coordinator.rounds_in_flight[0].phase is Phase.WAITING

    fresh = a.connect()
    sim.advance(1.0)
    assert pulls(sim, fresh) == [(1, 0, 2)]


def test_a_launch_waits_for_a_connected_member() -> None:
    sim = Sim(SyncerConfig(learners=2, total_steps=3, quorum=1, pipeline=1), LAYOUT3)
    a, b = sim.start(auto=False)
    sim.message(a.key, a.push_for(sim.sends_to(a.key, PullReq)[0]))
    a.disconnect()
    b.disconnect()

    sim.advance(1.0)  # grace passes: round 1 commits, round 2 has nobody to capture

    assert len(sim.merges) == 1 and not sim.coordinator.rounds_in_flight
    fresh = b.connect()
    assert pulls(sim, fresh) == [(2, 1, 1)]


# -- PUSH acceptance -----------------------------------------------------------------------------
def _round_two(**config: Any) -> tuple[Sim, Any, Any, PullReq]:
    """F = 1: round 1 committed (version 1), round 2 gathering from both learners."""
    sim = Sim(SyncerConfig(learners=2, total_steps=3, quorum=2, pipeline=1, **config), LAYOUT1)
    a, b = sim.start(auto=False)
    pull = sim.sends_to(a.key, PullReq)[0]
    sim.message(a.key, a.push_for(pull))
    sim.message(b.key, b.push_for(pull))
    assert len(sim.merges) == 1
    return sim, a, b, sim.sends_to(a.key, PullReq)[1]


@pytest.mark.parametrize(
    ("overrides", "config", "code"),
    [
        ({"base_version": 2}, {}, ErrorCode.PUSH_FUTURE_BASE),
        ({"global_step": 5}, {}, ErrorCode.PUSH_OUT_OF_ROUND),
        ({"global_step": 1}, {}, ErrorCode.PUSH_OUT_OF_ROUND),
        ({"fragment_id": 1}, {}, ErrorCode.PUSH_OUT_OF_ROUND),
        ({"round_attempt": 2}, {}, ErrorCode.PUSH_WRONG_ATTEMPT),
        ({"round_attempt": 0}, {}, ErrorCode.PUSH_WRONG_ATTEMPT),
        ({"base_version": 0}, {"max_base_lag": 0}, ErrorCode.PUSH_TOO_STALE),
        ({"base_version": 0}, {"max_base_lag": 1}, None),
        ({"base_version": 0}, {}, None),
        ({"base_version": 1}, {"max_base_lag": 0}, None),
    ],
)
def test_push_rejections_are_taped_without_disconnecting(
    overrides: dict[str, Any], config: dict[str, Any], code: ErrorCode | None
) -> None:
    sim, a, _, pull = _round_two(**config)
    push = a.push_for(pull, **overrides)

    actions = sim.message(a.key, push)

    assert not sim.of_type(CloseGroup)
    target = sim.coordinator.rounds_in_flight[0]
    if code is None:
        assert target.answered == 1
        assert target.accepted[a.key].staleness == 1 - push.base_version
        return
    record = sim.tape[-1]
    assert record["event"] == "push_rejected" and record["code"] == code.value
    assert (record["id"], record["generation"], record["step"]) == (0, 1, push.global_step)
    assert target.answered == 0
    assert any(isinstance(x, Log) and x.fields.get("code") == code.value for x in actions)


def test_duplicate_push_is_rejected_and_the_first_wins() -> None:
    sim, a, b, pull = _round_two()
    sim.message(a.key, a.push_for(pull, c_steps=9))

    sim.message(a.key, a.push_for(pull, c_steps=2))

    assert sim.tape[-1]["code"] == ErrorCode.PUSH_DUPLICATE.value
    sim.message(b.key, b.push_for(pull))
    assert [r["c_steps"] for r in sim.merges[-1]["responders"]] == [9, 5]


def test_staleness_is_reported_per_responder() -> None:
    sim, a, b, pull = _round_two()
    sim.message(a.key, a.push_for(pull, base_version=0))
    sim.message(b.key, b.push_for(pull, base_version=1))
    responders = sim.merges[-1]["responders"]
    assert [(r["base_version"], r["staleness"]) for r in responders] == [(0, 1), (1, 0)]
    assert sim.merges[-1]["launch_base_version"] == 1


def test_a_disconnect_never_erases_an_accepted_response() -> None:
    sim, a, b, pull = _round_two()
    sim.message(b.key, b.push_for(pull))
    b.disconnect()

    sim.message(a.key, a.push_for(pull))

    merge = sim.merges[-1]
    assert [r["id"] for r in merge["responders"]] == [0, 1]
    assert merge["missed_members"] == []


def _unchecked_push(template: PushFragment, **fields: Any) -> PushFragment:
    """A PUSH the constructor would refuse (the decoder refuses it too, first)."""
    push = object.__new__(PushFragment)
    for field in dataclasses.fields(PushFragment):
        object.__setattr__(push, field.name, fields.get(field.name, getattr(template, field.name)))
    return push


def _q4_with_scale(scale: float, numel: int) -> memoryview:
    data = bytearray(encode_tensor(np.ones(numel, np.float32), WireDtype.Q4, push=True).tobytes())
    data[:4] = np.float32(scale).tobytes()
    return memoryview(bytes(data))


@pytest.mark.parametrize(
    ("dtype", "make", "code"),
    [
        (WireDtype.F32, lambda p: {"learner_id": 1}, ErrorCode.LEARNER_ID_MISMATCH),
        (WireDtype.F32, lambda p: {"c_steps": 0}, ErrorCode.ZERO_C_STEPS),
        (
            WireDtype.F32,
            lambda p: {"data": np.array([0, 1, np.nan, 0, 0, 0], "<f4").view(np.uint8).data},
            ErrorCode.NON_FINITE_VALUE,
        ),
        (
            WireDtype.BF16,
            lambda p: {"data": np.array([0, 0x7F80, 0, 0, 0, 0], "<u2").view(np.uint8).data},
            ErrorCode.NON_FINITE_VALUE,
        ),
        (WireDtype.Q4, lambda p: {"data": _q4_with_scale(np.nan, 6)}, ErrorCode.BAD_Q4_SCALE),
        (WireDtype.Q4, lambda p: {"data": _q4_with_scale(-1.0, 6)}, ErrorCode.BAD_Q4_SCALE),
        (WireDtype.Q4, lambda p: {"data": _q4_with_scale(np.inf, 6)}, ErrorCode.BAD_Q4_SCALE),
    ],
)
def test_fatal_push_errors_close_only_that_group(
    dtype: WireDtype, make: Any, code: ErrorCode
) -> None:
    config = SyncerConfig(learners=2, total_steps=3, quorum=2, pipeline=1)
    sim = Sim(config, LAYOUT1, dtype=dtype)
    a, b = sim.start(auto=False)
    pull = sim.sends_to(a.key, PullReq)[0]
    template = a.push_for(pull)

    sim.message(a.key, _unchecked_push(template, **make(template)))

    assert closed_code(sim, a.key) == code.value
    assert not sim.coordinator.registry.is_open(a.key)
    assert sim.coordinator.rounds_in_flight[0].answered == 0
    assert b.key not in sim.closed
    sim.message(b.key, b.push_for(pull))
    assert sim.coordinator.rounds_in_flight[0].answered == 1


def test_the_transport_verdict_on_an_f32_tensor_stands_in_for_reading_it() -> None:
    config = SyncerConfig(learners=2, total_steps=3, quorum=2, pipeline=1)
    sim = Sim(config, LAYOUT1)
    a, b = sim.start(auto=False)
    pull = sim.sends_to(a.key, PullReq)[0]
    # After the same checks as ever (here: the learner id), in the same place as ever.
    mismatched = _unchecked_push(a.push_for(pull), learner_id=1)
    sim.feed(MessageReceived(a.key, mismatched, tensor_finite=False))
    assert closed_code(sim, a.key) == ErrorCode.LEARNER_ID_MISMATCH.value
    sim.feed(MessageReceived(b.key, b.push_for(pull), tensor_finite=False))  # seen on arrival
    assert closed_code(sim, b.key) == ErrorCode.NON_FINITE_VALUE.value
    assert sim.coordinator.rounds_in_flight[0].answered == 0


def test_set_timer_keys_name_round_and_attempt() -> None:
    sim = Sim(SyncerConfig(learners=1, total_steps=3, pipeline=2, quorum_timeout_s=30), LAYOUT3)
    sim.start(auto=False)
    quorum_timers = {a.key: a.at for a in sim.of_type(SetTimer) if a.key.startswith("quorum")}
    assert quorum_timers == {"quorum:1:1": 30.0, "quorum:2:1": 30.0}
