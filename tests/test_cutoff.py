"""The benchmark cutoff in the coordinator (fake clock, scripted learners; see tests/sim.py).

BUDGET_DONE's fatal cases, the cutoff with rounds in flight (cancelled whole; the checkpoint is a
contiguous prefix), the bounded wait for the remaining reports, and the consolidation restart
from the cutoff checkpoint: F ordinary rounds answered with ``frozen_local − resumed_global``
that end in the ordinary final cut and the marked final checkpoint.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray
from sim import ScriptedLearner, Sim, avg_layout, make_hello

from yeto_proto import FRAME_MAGIC, FrameType, Limits, encode_bytes
from yeto_proto.checkpoint import Checkpoint, read_checkpoint, scheduled_version, write_checkpoint
from yeto_proto.constants import WireDtype
from yeto_proto.dtypes import decode_tensor, encode_tensor
from yeto_proto.errors import ErrorCode
from yeto_proto.identity import DeltaCorrection
from yeto_proto.messages import (
    BcastFragment,
    BudgetDone,
    FinalAck,
    FinalFragment,
    FinalManifest,
    PullReq,
    PushFragment,
    Shutdown,
)
from yeto_sync.config import SyncerConfig
from yeto_sync.events import (
    GroupClosed,
    GroupKey,
    SetTimer,
    WriteFinalMarker,
    WriteFinalState,
)
from yeto_sync.transport.group import ConnectionGroups, Hangup

F32 = NDArray[np.float32]
LAYOUT = avg_layout((4,), (3, 2), (5,))
F = len(LAYOUT.fragments)
BUDGET = 50


def cutoff_config(tmp_path: Path, **overrides: Any) -> SyncerConfig:
    options: dict[str, Any] = {
        "learners": 2,
        "quorum": 2,
        "pipeline": 2,
        "total_steps": 1000,
        "learner_budget_steps": BUDGET,
        "checkpoint_path": tmp_path / "cutoff.ckpt",
        "checkpoint_every": 1000,
        "mark_final_checkpoint": True,
        "final_state": tmp_path / "final.state",
        "final_ack_timeout_s": 30,
    }
    options.update(overrides)
    return SyncerConfig(**options)


def closed_code(sim: Sim, key: GroupKey) -> str:
    error = sim.closed[key]
    assert error is not None
    return error.text.split(":", 1)[0]


def read_pulls(learner: ScriptedLearner) -> list[PullReq]:
    """Take in everything sent to ``learner`` (anchors too); return the new pulls."""
    pulls = []
    for message in learner.unread():
        learner.receive(message)
        if isinstance(message, PullReq):
            pulls.append(message)
    return pulls


def answer(sim: Sim, learner: ScriptedLearner, pull: PullReq) -> None:
    sim.message(learner.key, learner.push_for(pull))


def started(tmp_path: Path, **overrides: Any) -> tuple[Sim, list[ScriptedLearner]]:
    sim = Sim(cutoff_config(tmp_path, **overrides), LAYOUT)
    return sim, sim.start(auto=False)


def cut_kinds(sim: Sim) -> set[type]:
    """Kinds of terminal messages the coordinator ever sent to anyone."""
    terminal = (FinalFragment, FinalManifest, Shutdown)
    return {type(m) for sent in sim.inbox.values() for m in sent if isinstance(m, terminal)}


# -- fatal reports ---------------------------------------------------------------------------------
def test_report_without_a_configured_budget_is_fatal(tmp_path: Path) -> None:
    sim, (a, b) = started(tmp_path, learner_budget_steps=None)
    sim.message(a.key, BudgetDone(BUDGET))

    assert closed_code(sim, a.key) == ErrorCode.BUDGET_NOT_CONFIGURED.value
    assert sim.coordinator.cutoff is None
    assert [r.step for r in sim.coordinator.rounds_in_flight] == [1, 2]  # rounds carry on
    assert sim.coordinator.registry.is_open(b.key)


def test_wrong_step_count_is_fatal_and_closes_nothing_else(tmp_path: Path) -> None:
    sim, (a, b) = started(tmp_path)
    sim.message(a.key, BudgetDone(BUDGET - 1))

    assert closed_code(sim, a.key) == ErrorCode.BUDGET_MISMATCH.value
    cutoff = sim.coordinator.cutoff
    assert cutoff is not None and not cutoff.closed and cutoff.reported == {}
    assert [r.step for r in sim.coordinator.rounds_in_flight] == [1, 2]
    assert not [r for r in sim.tape if r.get("event") == "round_cancelled"]
    assert sim.coordinator.registry.is_open(b.key)

    sim.message(b.key, BudgetDone(BUDGET + 1))
    assert closed_code(sim, b.key) == ErrorCode.BUDGET_MISMATCH.value


def test_duplicate_report_is_fatal_on_the_same_generation(tmp_path: Path) -> None:
    sim, (a, _) = started(tmp_path)
    sim.message(a.key, BudgetDone(BUDGET))
    assert a.key not in sim.closed

    sim.message(a.key, BudgetDone(BUDGET))

    assert closed_code(sim, a.key) == ErrorCode.DUPLICATE_BUDGET_DONE.value
    assert sim.exit is None  # learner 1 has not reported; the first report still counts
    cutoff = sim.coordinator.cutoff
    assert cutoff is not None and cutoff.missing == [1]


def test_duplicate_report_is_fatal_from_a_new_generation(tmp_path: Path) -> None:
    """Identity comes from the connection group's learner id, not its generation."""
    sim, (a, _) = started(tmp_path)
    sim.message(a.key, BudgetDone(BUDGET))
    first = a.key
    a.disconnect()
    a.connect()

    sim.message(a.key, BudgetDone(BUDGET))

    assert closed_code(sim, a.key) == ErrorCode.DUPLICATE_BUDGET_DONE.value
    cutoff = sim.coordinator.cutoff
    assert cutoff is not None and cutoff.reported == {0: first}


def test_trailing_byte_is_a_fatal_frame_length_for_that_connection() -> None:
    """BUDGET_DONE is exactly 8 bytes: a 9-byte payload never reaches the coordinator."""
    groups = ConnectionGroups(2)
    hello = make_hello(1, 5, LAYOUT)
    key = GroupKey(1, 5)
    assert groups.open(7, now=0.0) == []
    groups.receive(7, encode_bytes(hello), now=0.0)
    groups.admit(7, key, 0, Limits.of(WireDtype.F32, LAYOUT), now=0.0)
    while groups.pop_event() is not None:
        pass

    payload = struct.pack("<Q", BUDGET) + b"\0"
    frame = struct.pack("<IBQ", FRAME_MAGIC, FrameType.BUDGET_DONE, len(payload)) + payload
    wire = groups.receive(7, frame, now=0.0)

    hangups = [w for w in wire if isinstance(w, Hangup)]
    assert len(hangups) == 1 and hangups[0].conn == 7
    assert hangups[0].error is not None
    assert hangups[0].error.text.startswith(ErrorCode.BAD_FRAME_LENGTH.value + ":")
    events = list(groups.events)
    assert len(events) == 1 and isinstance(events[0], GroupClosed) and events[0].group == key
    assert not groups.has_group(key)


# -- the cutoff ------------------------------------------------------------------------------------
def test_cutoff_cancels_in_flight_rounds_whole_and_checkpoints_the_committed_prefix(
    tmp_path: Path,
) -> None:
    sim, (a, b) = started(tmp_path)
    for learner in (a, b):
        (one, _two) = read_pulls(learner)
        assert one.global_step == 1
        answer(sim, learner, one)
    model = sim.coordinator.model
    assert model is not None and model.global_step == 1
    # Round 3 completes while round 2 still gathers: it must wait for round 2 to commit.
    pulls = {learner.learner_id: read_pulls(learner) for learner in (a, b)}
    assert [p.global_step for p in pulls[0]] == [3]
    for learner in (a, b):
        answer(sim, learner, pulls[learner.learner_id][0])
    pull_two = next(p for p in sim.sends_to(a.key, PullReq) if p.global_step == 2)
    answer(sim, a, pull_two)  # round 2: one of two members answered
    phases = {r.step: r.phase.value for r in sim.coordinator.rounds_in_flight}
    assert phases == {2: "gathering", 3: "complete"}
    assert model.global_step == 1
    committed = [slot.arrays()[0].copy() for slot in model.fragments]
    momentum = [slot.arrays()[1].copy() for slot in model.fragments]
    pulls_before = len(sim.sends_to(a.key, PullReq)) + len(sim.sends_to(b.key, PullReq))

    sim.message(b.key, BudgetDone(BUDGET))

    cancelled = [r for r in sim.tape if r.get("event") == "round_cancelled"]
    assert [(r["step"], r["phase"]) for r in cancelled] == [(2, "gathering"), (3, "complete")]
    assert cancelled[0]["responded_members"] == [{"id": 0, "generation": a.generation}]
    assert sim.coordinator.rounds_in_flight == ()
    # The late answer to the cancelled round 2 is rejected, not merged, and not fatal.
    answer(sim, b, pull_two)
    rejected = [r for r in sim.tape if r.get("event") == "push_rejected"]
    assert [(r["id"], r["step"], r["code"]) for r in rejected] == [
        (1, 2, ErrorCode.PUSH_OUT_OF_ROUND.value)
    ]
    assert b.key not in sim.closed
    sim.advance(20.0)  # within the wait for reports: no launch, no quorum deadline fires
    assert len(sim.sends_to(a.key, PullReq)) + len(sim.sends_to(b.key, PullReq)) == pulls_before
    assert sim.exit is None and not sim.checkpoints

    sim.message(a.key, BudgetDone(BUDGET))

    assert sim.exit is not None and sim.exit.code == 0
    assert "budget cutoff at global step 1" in sim.exit.reason
    (written,) = sim.checkpoints
    saved: Checkpoint = written.state
    assert saved.global_step == 1
    assert saved.versions == tuple(scheduled_version(p, 1, F) for p in range(F)) == (1, 0, 0)
    for index, fragment in enumerate(saved.fragments):
        np.testing.assert_array_equal(fragment.params, committed[index])
        np.testing.assert_array_equal(fragment.momentum, momentum[index])
    assert {e.learner_id: e.merges for e in saved.ledger} == {0: 1, 1: 1}
    # Unmarked and non-terminal: no marker, no final state, no final cut, no SHUTDOWN.
    assert not sim.of_type(WriteFinalMarker) and not sim.of_type(WriteFinalState)
    assert cut_kinds(sim) == set()
    (record,) = [r for r in sim.tape if r.get("event") == "budget_cutoff"]
    assert record["complete"] and record["step"] == 1 and record["missing_learners"] == []
    reports = [r for r in sim.tape if r.get("event") == "budget_done"]
    assert [(r["id"], r["missing_learners"]) for r in reports] == [(1, [0]), (0, [])]


def test_cutoff_before_any_commit_keeps_version_zero(tmp_path: Path) -> None:
    sim, (a, b) = started(tmp_path)
    for learner in (a, b):
        sim.message(learner.key, BudgetDone(BUDGET))

    (written,) = sim.checkpoints
    assert written.state.global_step == 0 and written.state.versions == (0, 0, 0)
    assert sim.exit is not None and sim.exit.code == 0


def test_a_learner_may_report_from_a_later_generation(tmp_path: Path) -> None:
    sim, (a, b) = started(tmp_path)
    sim.message(a.key, BudgetDone(BUDGET))
    b.disconnect()
    assert sim.exit is None
    b.connect()  # the group is rebuilt; its broadcasts are replayed, no pull is issued
    assert not read_pulls(b)

    sim.message(b.key, BudgetDone(BUDGET))

    assert sim.exit is not None and sim.exit.code == 0
    cutoff = sim.coordinator.cutoff
    assert cutoff is not None and cutoff.reported[1] == b.key


def test_missing_report_ends_in_an_unmarked_checkpoint_and_a_failure(tmp_path: Path) -> None:
    sim, (a, _) = started(tmp_path, final_ack_timeout_s=12)
    sim.now = 5.0
    sim.message(a.key, BudgetDone(BUDGET))
    assert SetTimer("cutoff", 17.0) in sim.actions

    sim.advance(11.9)
    assert sim.exit is None
    sim.advance(0.2)

    assert sim.exit is not None and sim.exit.code == 1
    assert "[1]" in sim.exit.reason
    (written,) = sim.checkpoints
    assert written.state.global_step == 0
    assert not sim.of_type(WriteFinalMarker)
    (record,) = [r for r in sim.tape if r.get("event") == "budget_cutoff"]
    assert not record["complete"] and record["missing_learners"] == [1]


def test_cutoff_without_a_checkpoint_path_fails(tmp_path: Path) -> None:
    sim, crew = started(tmp_path, checkpoint_path=None)
    for learner in crew:
        sim.message(learner.key, BudgetDone(BUDGET))

    assert sim.exit is not None and sim.exit.code == 1
    assert "--checkpoint-path" in sim.exit.reason
    assert not sim.checkpoints


def test_report_after_the_final_cut_leaves_finalization_alone(tmp_path: Path) -> None:
    sim, (a, b) = started(tmp_path, total_steps=1, pipeline=1)
    for learner in (a, b):
        (pull,) = read_pulls(learner)
        answer(sim, learner, pull)
    assert sim.coordinator.finalization is not None

    sim.message(a.key, BudgetDone(BUDGET))

    assert a.key not in sim.closed
    assert not [r for r in sim.tape if r.get("event") == "budget_done"]
    for learner in (a, b):
        for message in learner.unread():
            learner.receive(message)
    assert sim.exit is not None and sim.exit.code == 0
    assert [c.final for c in sim.checkpoints] == [True] and sim.of_type(WriteFinalMarker)


# -- the consolidation restart ---------------------------------------------------------------------
class FrozenLearner:
    """A learner after BUDGET_DONE: frozen parameters, anchors from the restarted syncer only."""

    def __init__(self, sim: Sim, learner_id: int, frozen: list[F32], tokens: int) -> None:
        self.sim = sim
        self.learner_id = learner_id
        self.frozen = frozen
        self.tokens = tokens
        self.anchors: dict[int, tuple[int, F32]] = {}
        self.finals: dict[int, tuple[int, F32]] = {}
        self.pushes: list[PushFragment] = []
        self.acked = False
        self.key = GroupKey(learner_id, 900 + learner_id)
        self._read = 0

    def connect(self) -> None:
        conn, _ = self.sim.hello(self.sim.make_hello(self.learner_id, self.key.generation))
        assert conn in self.sim.admitted
        self.sim.ready(self.key)

    def react(self) -> bool:
        messages = self.sim.inbox.get(self.key, [])
        fresh, self._read = messages[self._read :], len(messages)
        manifest = None
        for message in fresh:
            match message:
                case BcastFragment(fragment_id=p, version=v):
                    if p not in self.anchors or v > self.anchors[p][0]:
                        self.anchors[p] = (v, self.sim.decode_bulk(message.data, p))
                case PullReq():
                    self._answer(message)
                case FinalFragment(fragment_id=p, version=v):
                    self.finals[p] = (v, np.frombuffer(message.data, "<f4").copy())
                case FinalManifest():
                    manifest = message
        if manifest is not None and not self.acked:
            assert all(self.finals[p][0] == v for p, v in enumerate(manifest.expected_versions))
            self.acked = True
            self.sim.message(self.key, FinalAck(manifest.final_global_step))
        return bool(fresh)

    def _answer(self, pull: PullReq) -> None:
        version, anchor = self.anchors[pull.fragment_id]  # BCASTs precede the first PULL
        delta = (self.frozen[pull.fragment_id] - anchor).astype(np.float32)
        push = PushFragment(
            learner_id=self.learner_id,
            fragment_id=pull.fragment_id,
            global_step=pull.global_step,
            round_attempt=pull.round_attempt,
            base_version=version,
            local_step=BUDGET,
            c_steps=BUDGET,
            c_tokens=self.tokens,
            data=encode_tensor(delta, self.sim.dtype, push=True).data,
        )
        self.pushes.append(push)
        self.sim.message(self.key, push)


def cutoff_checkpoint(tmp_path: Path, dtype: WireDtype) -> Checkpoint:
    """Run two rounds, cut off with round 3 in flight, and read the checkpoint back."""
    config = cutoff_config(tmp_path, pipeline=1)
    sim = Sim(config, LAYOUT, dtype=dtype)
    crew = sim.start(auto=False)
    for _ in range(2):
        for learner in crew:
            (pull,) = read_pulls(learner)
            answer(sim, learner, pull)
    assert [r.step for r in sim.coordinator.rounds_in_flight] == [3]
    for learner in crew:
        sim.message(learner.key, BudgetDone(BUDGET))
    assert sim.exit is not None and sim.exit.code == 0
    (written,) = sim.checkpoints
    assert config.checkpoint_path is not None
    write_checkpoint(config.checkpoint_path, written.state)
    return read_checkpoint(config.checkpoint_path)


@pytest.mark.parametrize("dtype", [WireDtype.F32, WireDtype.Q4], ids=["f32", "q4"])
def test_consolidation_restart_runs_f_ordinary_rounds_to_a_marked_final_cut(
    tmp_path: Path, dtype: WireDtype
) -> None:
    saved = cutoff_checkpoint(tmp_path, dtype)
    c = saved.global_step
    assert c == 2
    config = SyncerConfig(
        learners=2,
        quorum=2,
        pipeline=2,
        total_steps=c + F,
        checkpoint_path=tmp_path / "cutoff.ckpt",
        resume=True,
        mark_final_checkpoint=True,
        delta_correction=DeltaCorrection.NONE,
        outer_lr=0.7,
        outer_momentum=0.9,
    )
    sim = Sim(config, LAYOUT, dtype=dtype, checkpoint=saved)
    rng = np.random.default_rng(3)
    frozen = [
        [(f.params + rng.normal(0, 0.05, f.numel)).astype(np.float32) for f in saved.fragments]
        for _ in range(2)
    ]
    crew = [FrozenLearner(sim, i, frozen[i], tokens=1000 * (i + 1)) for i in range(2)]
    for learner in crew:
        learner.connect()
    while sim.exit is None:
        if not any([learner.react() for learner in crew]):
            upcoming = sim.next_timer()
            assert upcoming is not None, "consolidation stalled"
            sim.advance_to(upcoming[1])

    assert sim.exit.code == 0
    merges = sim.merges
    assert [m["step"] for m in merges] == list(range(c + 1, c + F + 1))
    assert sorted(m["fragment"] for m in merges) == list(range(F))
    every = [{"id": i, "generation": 900 + i} for i in range(2)]
    for record in merges:
        assert record["responded_members"] == every and record["missed_members"] == []
        assert [(r["c_steps"], r["c_tokens"]) for r in record["responders"]] == [
            (BUDGET, 1000),
            (BUDGET, 2000),
        ]
    # Each round merged the frozen learners' local − resumed_global by the ordinary rules.
    weights = np.array([1000**2 / BUDGET, 2000**2 / BUDGET])
    weights /= weights.sum()
    for record in merges:
        p = record["fragment"]
        start = saved.fragments[p]
        sent = [
            decode_tensor(
                next(x for x in learner.pushes if x.fragment_id == p).data,
                dtype,
                start.numel,
                push=True,
            )
            for learner in crew
        ]
        delta = np.zeros(start.numel, np.float32)
        for weight, d in zip(weights, sent, strict=True):
            delta += np.float32(weight) * -np.asarray(d, np.float32)
        buf = (np.float32(0.9) * start.momentum + delta).astype(np.float32)
        want = (start.params - np.float32(0.7) * (delta + np.float32(0.9) * buf)).astype(np.float32)
        final = crew[0].finals[p]
        assert final[0] == record["step"]
        np.testing.assert_allclose(final[1], want, rtol=1e-5, atol=1e-6)
    terminal = [c for c in sim.checkpoints if c.final]
    assert len(terminal) == 1 and terminal[0].state.global_step == c + F
    assert sim.of_type(WriteFinalMarker) == [WriteFinalMarker(c + F)]
    assert all(learner.acked for learner in crew)
