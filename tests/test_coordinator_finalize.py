"""Finalization: the frozen cut, terminal writes, FINAL_ACK rules, SHUTDOWN and the exit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sim import Sim, avg_layout

from yeto_proto.errors import ErrorCode
from yeto_proto.messages import (
    BcastFragment,
    FinalAck,
    FinalFragment,
    FinalManifest,
    Heartbeat,
    PullReq,
    Shutdown,
)
from yeto_sync.config import SyncerConfig
from yeto_sync.coordinator import FINAL_ACK_TIMER
from yeto_sync.events import (
    Exit,
    GroupKey,
    Send,
    WriteCheckpoint,
    WriteFinalMarker,
    WriteFinalState,
)

LAYOUT = avg_layout((4,), (3, 2))


def session(tmp_path: Path | None = None, learners: int = 2, **overrides: Any) -> Sim:
    """Run every round with manual learners answering; stop right after the final cut."""
    options: dict[str, Any] = {"learners": learners, "total_steps": 4, "quorum": learners}
    if tmp_path is not None:
        options["checkpoint_path"] = tmp_path / "ckpt"
    options.update(overrides)
    sim = Sim(SyncerConfig(**options), LAYOUT)
    crew = sim.start(auto=False)
    answered = 0
    while sim.coordinator.finalization is None:
        for learner in crew:
            for message in learner.unread():
                learner.receive(message)
                if isinstance(message, PullReq):
                    sim.message(learner.key, learner.push_for(message))
        answered += 1
        assert answered < 50
    return sim


def test_final_cut_writes_then_delivers_in_order(tmp_path: Path) -> None:
    sim = session(tmp_path, mark_final_checkpoint=True, final_state=tmp_path / "final.safetensors")
    final = sim.coordinator.finalization
    assert final is not None and final.final_step == 4 and final.frozen == {0, 1}

    cut_start = next(
        i for i, a in enumerate(sim.actions) if isinstance(a, WriteCheckpoint) and a.final
    )
    tail = sim.actions[cut_start:]
    kinds = [
        type(a) for a in tail if not isinstance(a, Send) or not isinstance(a.message, BcastFragment)
    ]
    writes = [k for k in kinds if k in (WriteCheckpoint, WriteFinalMarker, WriteFinalState)]
    assert writes == [WriteCheckpoint, WriteFinalMarker, WriteFinalState]
    checkpoint = tail[0]
    assert isinstance(checkpoint, WriteCheckpoint)
    assert checkpoint.state.global_step == 4 and checkpoint.state.versions == (3, 4)
    assert WriteFinalMarker(4) in tail
    model = sim.coordinator.model
    assert model is not None
    for learner in sim.learners.values():
        sent = sim.sends_to(learner.key)
        cut = sent[-3:]
        assert [type(m) for m in cut] == [FinalFragment, FinalFragment, FinalManifest]
        assert cut[2] == FinalManifest(4, (3, 4))
        for message in cut[:2]:
            assert isinstance(message, FinalFragment)
            assert message.version == model.fragments[message.fragment_id].version
            np.testing.assert_array_equal(
                np.frombuffer(message.data, "<f4"),
                model.fragments[message.fragment_id].arrays()[0],
            )
    assert sim.timers[FINAL_ACK_TIMER] == pytest.approx(sim.now + 900)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({}, [WriteCheckpoint]),
        ({"mark_final_checkpoint": True}, [WriteCheckpoint, WriteFinalMarker]),
        ({"final_state": "fs"}, [WriteCheckpoint, WriteFinalState]),
        ({"checkpoint_every": 4}, [WriteCheckpoint, WriteCheckpoint]),  # periodic + final
    ],
)
def test_terminal_writes(tmp_path: Path, overrides: dict[str, Any], expected: list[type]) -> None:
    if "final_state" in overrides:
        overrides["final_state"] = tmp_path / overrides["final_state"]
    sim = session(tmp_path, **overrides)
    writes = [
        type(a)
        for a in sim.actions
        if isinstance(a, WriteCheckpoint | WriteFinalMarker | WriteFinalState)
    ]
    assert writes == expected
    assert sim.checkpoints[-1].final


def test_without_a_checkpoint_path_only_the_final_state_is_written(tmp_path: Path) -> None:
    sim = session(None, final_state=tmp_path / "fs", mark_final_checkpoint=True)
    assert [
        type(a)
        for a in sim.actions
        if isinstance(a, WriteCheckpoint | WriteFinalMarker | WriteFinalState)
    ] == [WriteFinalState]


def ack(sim: Sim, key: Any, step: int = 4) -> list[Any]:
    return sim.message(key, FinalAck(step))


def shutdowns_in(actions: list[Any]) -> list[GroupKey]:
    return [x.group for x in actions if isinstance(x, Send) and isinstance(x.message, Shutdown)]


def cut_sent_to(sim: Sim, key: GroupKey) -> list[type]:
    """The kinds of terminal messages ``key`` was sent, in order."""
    return [type(m) for m in sim.sends_to(key) if isinstance(m, FinalFragment | FinalManifest)]


def test_all_acks_then_shutdown_and_exit_zero() -> None:
    sim = session()
    a, b = sim.learners[0], sim.learners[1]
    ack(sim, a.key)
    assert sim.exit is None

    actions = ack(sim, b.key)

    assert shutdowns_in(actions) == [a.key, b.key]
    assert actions[-1] == Exit(0, "finalized at global step 4")


@pytest.mark.parametrize(
    ("scenario", "code"),
    [
        ("wrong_step", ErrorCode.UNEXPECTED_FINAL_ACK),
        ("never_queued", ErrorCode.UNEXPECTED_FINAL_ACK),
        ("before_cut", ErrorCode.UNEXPECTED_FINAL_ACK),
    ],
)
def test_invalid_acks_close_that_group(scenario: str, code: ErrorCode) -> None:
    if scenario == "before_cut":
        sim = Sim(SyncerConfig(learners=1, total_steps=2), LAYOUT)
        (a,) = sim.start(auto=False)
        ack(sim, a.key, 2)
        key = a.key
    else:
        sim = session()
        a = sim.learners[0]
        if scenario == "wrong_step":
            ack(sim, a.key, 3)
            key = a.key
        else:
            # A superseded generation that was never sent the cut.
            sim.hello(sim.make_hello(0, 99))
            key = GroupKey(0, 99)
            ack(sim, key)
    error = sim.closed[key]
    assert error is not None and error.text.startswith(code.value)
    assert sim.exit is None


def test_pending_learner_reconnects_gets_the_full_cut_and_acks() -> None:
    sim = session()
    a, b = sim.learners[0], sim.learners[1]
    ack(sim, a.key)
    b.disconnect()

    fresh = b.connect()

    assert cut_sent_to(sim, fresh) == [FinalFragment, FinalFragment, FinalManifest]
    actions = ack(sim, fresh)
    assert actions[-1] == Exit(0, "finalized at global step 4")


def test_accepted_ack_survives_a_disconnect_and_shutdown_skips_closed_generations() -> None:
    sim = session()
    a, b = sim.learners[0], sim.learners[1]
    ack(sim, a.key)
    a.disconnect()

    actions = ack(sim, b.key)

    assert shutdowns_in(actions) == [b.key]
    assert sim.exit == Exit(0, "finalized at global step 4")


def test_acked_learner_that_reconnects_gets_the_cut_again_and_its_shutdown() -> None:
    """Its first ACK stands, but SHUTDOWN can only reach it on the generation it redialled."""
    sim = session()
    a, b = sim.learners[0], sim.learners[1]
    ack(sim, a.key)
    a.disconnect()
    fresh = a.connect()

    assert cut_sent_to(sim, fresh) == [FinalFragment, FinalFragment, FinalManifest]
    ack(sim, b.key)
    assert sim.exit is None  # the new generation has not acknowledged yet

    actions = ack(sim, fresh)

    assert shutdowns_in(actions) == [fresh, b.key]
    assert actions[-1] == Exit(0, "finalized at global step 4")


def test_ack_from_a_second_queued_generation_counts_and_gets_the_shutdown() -> None:
    """Both generations were sent the cut; the old one ACKs and drops, the new one ACKs too."""
    sim = session()
    a, b = sim.learners[0], sim.learners[1]
    old = a.key
    fresh = a.connect()  # while the old generation is still open and pending
    assert FinalManifest in {type(m) for m in sim.sends_to(fresh)}
    ack(sim, old)
    sim.close(old)
    ack(sim, b.key)
    assert sim.exit is None

    actions = ack(sim, fresh)

    assert not sim.logs("FINAL_ACK repeated")
    assert shutdowns_in(actions) == [fresh, b.key]
    assert sim.exit == Exit(0, "finalized at global step 4")


def test_a_superseded_generation_that_never_acks_does_not_hold_up_the_exit() -> None:
    sim = session()
    a, b = sim.learners[0], sim.learners[1]
    old = a.key
    fresh = a.connect()
    ack(sim, fresh)

    actions = ack(sim, b.key)

    assert shutdowns_in(actions) == [fresh, b.key]
    assert sim.exit == Exit(0, "finalized at global step 4") and old not in sim.closed


def acked_then_reconnected() -> tuple[Sim, GroupKey, GroupKey]:
    """Learner 0 ACKs, drops and redials (its new generation gets the cut again); 1 ACKs."""
    sim = session(final_ack_timeout_s=30)
    a, b = sim.learners[0], sim.learners[1]
    ack(sim, a.key)
    a.disconnect()
    fresh = a.connect()
    ack(sim, b.key)
    assert sim.exit is None
    return sim, b.key, fresh


def test_reconnected_generation_that_drops_before_its_ack_no_longer_holds_up_the_exit() -> None:
    sim, b_key, fresh = acked_then_reconnected()

    actions = sim.close(fresh)

    assert shutdowns_in(actions) == [b_key]
    assert sim.exit == Exit(0, "finalized at global step 4")


def test_a_reconnected_generation_closed_on_a_protocol_error_no_longer_holds_up_the_exit() -> None:
    """The syncer closes it itself: its later GroupClosed finds nothing, so the close re-checks."""
    sim, b_key, fresh = acked_then_reconnected()

    sim.message(fresh, Heartbeat(1, 0))  # names another learner: fatal for that generation

    assert fresh in sim.closed
    assert sim.exit == Exit(0, "finalized at global step 4")
    assert shutdowns_in(sim.actions) == [b_key]


def test_missing_re_ack_at_the_deadline_still_exits_zero() -> None:
    """Every learner's ACK stands; only a reconnected generation's repeat is missing."""
    sim, b_key, fresh = acked_then_reconnected()

    sim.advance(30)

    assert sim.exit == Exit(0, "finalized at global step 4")
    assert shutdowns_in(sim.actions) == [b_key]
    (warning,) = sim.logs("re-ACK missing from a reconnected generation; the earlier ACK stands")
    assert warning.fields["members"] == [{"learner_id": 0, "generation": fresh.generation}]


def test_repeated_ack_is_harmless() -> None:
    sim = session()
    a = sim.learners[0]
    ack(sim, a.key)
    ack(sim, a.key)
    assert a.key not in sim.closed and sim.exit is None


def test_missing_ack_fails_after_the_timeout() -> None:
    sim = session(final_ack_timeout_s=30)
    a = sim.learners[0]
    ack(sim, a.key)
    sim.advance(29.9)
    assert sim.exit is None

    sim.advance(0.1)

    assert sim.exit is not None and sim.exit.code != 0
    assert "[1]" in sim.exit.reason
    assert shutdowns_in(sim.actions) == [a.key]


def test_final_ack_timeout_defaults_to_the_quorum_timeout() -> None:
    sim = session(quorum_timeout_s=42)
    assert sim.timers[FINAL_ACK_TIMER] == pytest.approx(sim.now + 42)


def test_frozen_set_is_the_live_learners_at_the_cut() -> None:
    sim = Sim(SyncerConfig(learners=3, total_steps=2, quorum=1, pipeline=1), LAYOUT)
    a, b, c = sim.start()
    c.disconnect()
    sim.run()
    final = sim.coordinator.finalization
    assert final is not None and final.frozen == {0, 1}
    assert sim.exit == Exit(0, "finalized at global step 2")
    # The learner that left before the cut is not part of it.
    assert not [m for m in sim.sends_to(c.key) if isinstance(m, FinalManifest)]


def test_a_learner_cut_off_at_the_cut_that_reconnects_gets_catch_up_but_not_the_cut() -> None:
    sim = Sim(SyncerConfig(learners=2, total_steps=2, quorum=1, pipeline=1), LAYOUT)
    a, b = sim.start(auto=False)
    b.disconnect()
    for _ in range(50):  # learner 0 runs every round alone
        for message in a.unread():
            a.receive(message)
            if isinstance(message, PullReq):
                sim.message(a.key, a.push_for(message))
        if sim.coordinator.finalization is not None:
            break
        sim.advance(1.0)  # a grace period waiting for nobody
    final = sim.coordinator.finalization
    assert final is not None and final.frozen == {0}

    fresh = b.connect()  # before learner 0 ACKs: the syncer is still there

    sent = sim.sends_to(fresh)
    assert [type(m) for m in sent] == [BcastFragment] * len(LAYOUT.fragments)
    assert cut_sent_to(sim, fresh) == []
    actions = ack(sim, a.key, 2)  # the frozen learner's ACK is all the syncer waits for
    assert shutdowns_in(actions) == [a.key]
    assert actions[-1] == Exit(0, "finalized at global step 2")


def test_finalization_waits_for_rounds_in_flight() -> None:
    sim = Sim(SyncerConfig(learners=1, total_steps=2, pipeline=2), LAYOUT)
    (a,) = sim.start(auto=False)
    first, second = sim.sends_to(a.key, PullReq)
    sim.message(a.key, a.push_for(second))
    assert sim.coordinator.finalization is None
    sim.message(a.key, a.push_for(first))
    assert sim.coordinator.finalization is not None


def test_no_live_learner_at_the_cut_fails() -> None:
    sim = Sim(SyncerConfig(learners=2, total_steps=1, quorum=1), LAYOUT)
    a, b = sim.start(auto=False)
    sim.message(a.key, a.push_for(sim.sends_to(a.key, PullReq)[0]))
    a.disconnect()
    b.disconnect()

    sim.advance(1.0)  # grace ends: round 1 commits, the cut finds nobody

    assert sim.exit is not None and sim.exit.code != 0
    assert "no live learner" in sim.exit.reason
