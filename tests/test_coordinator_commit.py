"""Commits: ascending order, checkpoint before broadcast, BCAST targets, tape, merge failures."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from numpy.typing import NDArray
from sim import CONTRACT, FINGERPRINT, Sim, avg_layout

from yeto_proto.checkpoint import Checkpoint, CheckpointFormat, LedgerEntry, TrailerKind
from yeto_proto.constants import IsoBackend, MergeMode, WireDtype
from yeto_proto.dtypes import bf16_to_f32, f32_to_bf16
from yeto_proto.layout import WireFragment, WireLayout
from yeto_proto.messages import BcastFragment, PullReq
from yeto_sync.config import SyncerConfig
from yeto_sync.events import AppendTape, Exit, Log, Send, WriteCheckpoint
from yeto_sync.merge import F32Array, MergeError

LAYOUT3 = avg_layout((4,), (3, 2), (5,))
PINNED_TAPE_FIELDS = {
    "protocol_version",
    "delta_semantics",
    "step",
    "fragment",
    "attempt",
    "launch_base_version",
    "expected_members",
    "responded_members",
    "missed_members",
    "quorum",
    "quorum_ms",
    "grace_ms",
    "sync_ms",
    "gnorm",
    "responders",
}


def test_commits_are_strictly_ascending() -> None:
    sim = Sim(SyncerConfig(learners=1, total_steps=3, pipeline=2), LAYOUT3)
    (a,) = sim.start(auto=False)
    first, second = sim.sends_to(a.key, PullReq)

    sim.message(a.key, a.push_for(second))
    assert not sim.merges  # round 2 gathered but waits for round 1
    model = sim.coordinator.model
    assert model is not None and model.versions == (0, 0, 0)

    actions = sim.message(a.key, a.push_for(first))

    assert [r["step"] for r in sim.merges] == [1, 2]
    assert model.versions == (1, 2, 0)
    steps = [a.record["step"] for a in actions if isinstance(a, AppendTape)]
    assert steps == [1, 2]


def test_merge_tape_line_has_the_pinned_fields() -> None:
    sim = Sim(SyncerConfig(learners=2, total_steps=3, quorum=2), LAYOUT3)
    sim.start()
    sim.run()
    for record in sim.merges:
        assert PINNED_TAPE_FIELDS <= record.keys()
        assert record["protocol_version"] == 4
        assert record["delta_semantics"] == "local_minus_raw_anchor"
        for responder in record["responders"]:
            assert responder.keys() == {
                "id",
                "generation",
                "base_version",
                "staleness",
                "c_steps",
                "c_tokens",
                "weight",
            }
            assert responder["weight"] == responder["c_tokens"] ** 2 / responder["c_steps"]
        assert record["gnorm"] > 0


def test_a_round_where_every_response_weighs_nothing_is_logged() -> None:
    sim = Sim(SyncerConfig(learners=1, total_steps=2), LAYOUT3)
    (a,) = sim.start(auto=False)
    pull = sim.sends_to(a.key, PullReq)[0]
    actions = sim.message(a.key, a.push_for(pull, c_tokens=0))
    (merge,) = sim.merges  # pinned: Δ = 0, and the outer step still runs
    assert merge["responders"][0]["weight"] == 0
    warnings = [x for x in actions if isinstance(x, Log) and x.level == "warning"]
    assert [w.text for w in warnings] == ["round weighs nothing"]
    assert "c_tokens = 0" in warnings[0].fields["reason"]


@pytest.mark.parametrize(("every", "steps"), [(1, [1, 2, 3, 4, 5]), (2, [2, 4]), (8, [])])
def test_checkpoint_every_n_commits_before_the_broadcast(
    tmp_path: Path, every: int, steps: list[int]
) -> None:
    config = SyncerConfig(
        learners=1,
        total_steps=5,
        checkpoint_path=tmp_path / "ckpt",
        checkpoint_every=every,
    )
    sim = Sim(config, LAYOUT3)
    sim.start()
    sim.run()

    periodic = [c for c in sim.checkpoints if not c.final]
    assert [c.state.global_step for c in periodic] == steps
    for write in periodic:
        index = sim.actions.index(write)
        following = sim.actions[index + 1 :]
        bcasts = [
            a.message
            for a in following
            if isinstance(a, Send) and isinstance(a.message, BcastFragment)
        ]
        assert bcasts[0].version == write.state.global_step
        # ... and no BCAST of that version left before the checkpoint.
        before = sim.actions[:index]
        assert not any(
            isinstance(a, Send)
            and isinstance(a.message, BcastFragment)
            and a.message.version == write.state.global_step
            for a in before
        )
        # The step's merge line is taped before its checkpoint: a stop between the two must
        # not leave a checkpointed step without its line (a resumed run never redoes it).
        taped = [
            a.record["step"]
            for a in before
            if isinstance(a, AppendTape) and "event" not in a.record
        ]
        assert write.state.global_step in taped


def test_no_checkpoint_without_a_path() -> None:
    sim = Sim(SyncerConfig(learners=1, total_steps=4, checkpoint_every=1), LAYOUT3)
    sim.start()
    sim.run()
    assert sim.checkpoints == []


def test_checkpoint_value_is_a_v3_snapshot_of_the_committed_prefix(tmp_path: Path) -> None:
    config = SyncerConfig(
        learners=2, total_steps=4, quorum=2, checkpoint_path=tmp_path / "c", checkpoint_every=2
    )
    sim = Sim(config, LAYOUT3)
    sim.start()
    sim.run()
    state: Checkpoint = sim.checkpoints[0].state
    assert state.format is CheckpointFormat.V3
    assert state.iso_backend is IsoBackend.SCALAR
    assert state.fingerprint == FINGERPRINT and state.contract == CONTRACT
    assert state.trailer is TrailerKind.FINGERPRINT_AND_CONTRACT
    assert state.global_step == 2 and state.versions == (1, 2, 0)
    assert state.ledger == (LedgerEntry(0, 2, 8, 101 + 102), LedgerEntry(1, 2, 10, 201 + 202))
    for fragment in state.fragments:
        assert fragment.params.dtype == np.dtype("<f4")
        assert fragment.momentum.shape == fragment.params.shape


def test_bcast_goes_to_every_connected_current_generation() -> None:
    sim = Sim(SyncerConfig(learners=3, total_steps=3, quorum=1, pipeline=1), LAYOUT3)
    a, b, c = sim.start(auto=False)
    old_b = b.key
    new_b = b.connect()
    c.disconnect()
    pull = sim.sends_to(a.key, PullReq)[0]

    sim.message(a.key, a.push_for(pull))
    sim.advance(1.0)  # grace

    def got_v1(key: object) -> bool:
        return any(
            isinstance(x, Send) and x.group == key and getattr(x.message, "version", 0) == 1
            for x in sim.actions
        )

    assert got_v1(a.key) and got_v1(new_b)
    assert not got_v1(old_b) and not got_v1(c.key)


class FailingIsoSolver:
    """An iso solver that cannot solve (stands in for a crashed or poisoned worker)."""

    @property
    def backend(self) -> IsoBackend:
        return IsoBackend.SCALAR

    def polar_flatten(
        self, matrix: NDArray[np.float32] | NDArray[np.float64], rows: int, cols: int
    ) -> F32Array:
        raise MergeError(f"iso worker failed on {rows}x{cols}")


ISO_LAYOUT = WireLayout((WireFragment(MergeMode.ISO, (6,), ((2, 3),)),))


@pytest.mark.parametrize(
    ("layout", "solver", "delta", "reason"),
    [
        (ISO_LAYOUT, FailingIsoSolver(), None, "iso worker failed on 2x3"),
        # Δ = 3e38: buf = Δ, Θ − lr·(Δ + μ·buf) overflows f32.
        (avg_layout((6,)), None, 3e38, "non-finite"),
    ],
)
def test_merge_error_fails_the_commit_before_any_state_changes(
    tmp_path: Path,
    layout: WireLayout,
    solver: FailingIsoSolver | None,
    delta: float | None,
    reason: str,
) -> None:
    config = SyncerConfig(
        learners=1, total_steps=3, checkpoint_path=tmp_path / "c", checkpoint_every=1
    )

    def deltas(learner: int, step: int, fragment: int, numel: int) -> F32Array:
        return np.full(numel, -(delta or 1.0), np.float32)

    sim = Sim(config, layout, iso_solver=solver)
    (a,) = sim.start(auto=False)
    a.deltas = deltas
    model = sim.coordinator.model
    assert model is not None
    params_before, momentum_before = model.fragments[0].arrays()
    snapshot = params_before.copy()

    actions = sim.message(a.key, a.push_for(sim.sends_to(a.key, PullReq)[0]))

    assert isinstance(actions[-1], Exit) and actions[-1].code != 0
    assert reason in actions[-1].reason
    failure = sim.tape[-1]
    assert failure["event"] == "merge_failed" and failure["step"] == 1
    assert reason in failure["reason"]
    assert model.versions == (0,) and model.global_step == 0 and model.ledger == {}
    params_after, momentum_after = model.fragments[0].arrays()
    assert params_after is params_before and momentum_after is momentum_before
    np.testing.assert_array_equal(params_after, snapshot)
    assert not any(isinstance(x, WriteCheckpoint) for x in actions)
    assert not any(isinstance(x, Send) for x in actions)


@pytest.mark.parametrize("dtype", [WireDtype.BF16, WireDtype.Q4])
def test_a_commit_whose_bf16_broadcast_would_be_infinite_fails(
    tmp_path: Path, dtype: WireDtype
) -> None:
    # Θ' ≈ 3.3987e38 is finite in f32 but a bf16 infinity: the BCAST used to carry it, and
    # every learner had to stop on it as the syncer's violation (spec/syncer.md § 7).
    config = SyncerConfig(
        learners=1, total_steps=3, checkpoint_path=tmp_path / "c", checkpoint_every=1
    )
    start = np.full(6, bf16_to_f32(f32_to_bf16(np.array([3.3e38], np.float32)))[0], np.float32)
    sim = Sim(config, avg_layout((6,)), dtype=dtype)
    (a,) = sim.start(auto=False, params=[start])
    a.deltas = lambda learner, step, fragment, numel: np.full(numel, 7.7e36, np.float32)

    actions = sim.message(a.key, a.push_for(sim.sends_to(a.key, PullReq)[0]))

    assert isinstance(actions[-1], Exit) and actions[-1].code != 0
    assert "beyond bf16's range" in actions[-1].reason
    assert sim.tape[-1]["event"] == "merge_failed"
    assert not any(isinstance(x, Send | WriteCheckpoint) for x in actions)
    # After Exit the coordinator does nothing more.
    assert sim.message(a.key, a.push_for(sim.sends_to(a.key, PullReq)[0])) == []
