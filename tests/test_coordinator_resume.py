"""Resume: eligibility at the first HELLO, the installed state, t from global_step + 1."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sim import Sim, avg_layout

from yeto_proto.checkpoint import Checkpoint, CheckpointFormat, read_checkpoint, write_checkpoint
from yeto_proto.constants import IsoBackend
from yeto_proto.errors import ErrorCode
from yeto_proto.messages import BcastFragment, InitParams, PullReq
from yeto_sync.config import SyncerConfig
from yeto_sync.events import AdmitGroup, Exit, RefuseConnection

LAYOUT = avg_layout((4,), (3, 2), (5,))
TOTAL = 7


def config(tmp_path: Path, **overrides: Any) -> SyncerConfig:
    options: dict[str, Any] = {
        "learners": 2,
        "total_steps": TOTAL,
        "quorum": 2,
        "checkpoint_path": tmp_path / "ckpt",
        "checkpoint_every": 4,
    }
    options.update(overrides)
    return SyncerConfig(**options)


def uninterrupted(tmp_path: Path) -> Sim:
    sim = Sim(config(tmp_path), LAYOUT)
    sim.start()
    assert sim.run().code == 0
    return sim


def saved_at_step_4(tmp_path: Path, sim: Sim) -> Checkpoint:
    """The periodic checkpoint of step 4, through the real V3 writer and reader."""
    (periodic,) = [c for c in sim.checkpoints if not c.final]
    path = tmp_path / "step4.ckpt"
    write_checkpoint(path, periodic.state)
    return read_checkpoint(path)


def test_resume_continues_exactly_where_the_checkpoint_left_off(tmp_path: Path) -> None:
    reference = uninterrupted(tmp_path)
    checkpoint = saved_at_step_4(tmp_path, reference)
    assert checkpoint.global_step == 4 and checkpoint.versions == (4, 2, 3)

    sim = Sim(config(tmp_path, resume=True), LAYOUT, checkpoint=checkpoint)
    a, b = sim.start()  # learner 0's INIT is ignored: every fragment is initialized already
    assert sim.logs("INIT ignored: fragment already initialized")
    first_pulls = sim.sends_to(a.key, PullReq)
    assert [(p.global_step, p.fragment_id) for p in first_pulls] == [(5, 1), (6, 2)]
    bcasts = sim.sends_to(a.key, BcastFragment)
    assert [(m.fragment_id, m.version) for m in bcasts] == [(0, 4), (1, 2), (2, 3)]

    assert sim.run() == Exit(0, "finalized at global step 7")

    assert [r["step"] for r in sim.merges] == [5, 6, 7]
    # The tape says where the resumed run picked up: later lines may redo earlier steps.
    assert sim.tape[0] == {"event": "resumed", "step": 4, "next_step": 5, "versions": [4, 2, 3]}
    resumed, original = sim.coordinator.model, reference.coordinator.model
    assert resumed is not None and original is not None
    assert resumed.versions == original.versions == (7, 5, 6)
    assert resumed.ledger == original.ledger
    for mine, theirs in zip(resumed.fragments, original.fragments, strict=True):
        np.testing.assert_array_equal(mine.arrays()[0], theirs.arrays()[0])
        np.testing.assert_array_equal(mine.arrays()[1], theirs.arrays()[1])


def test_state_is_installed_only_at_the_first_accepted_hello(tmp_path: Path) -> None:
    checkpoint = saved_at_step_4(tmp_path, uninterrupted(tmp_path))
    sim = Sim(config(tmp_path, resume=True), LAYOUT, checkpoint=checkpoint)
    assert sim.coordinator.model is None and sim.coordinator.global_step == 0

    conn, actions = sim.hello(sim.make_hello(0, 1))

    assert any(isinstance(a, AdmitGroup) for a in actions)
    assert sim.coordinator.global_step == 4
    log = sim.logs("session fixed")[0]
    assert log.fields["resumed_global_step"] == 4


def _with(checkpoint: Checkpoint, **changes: Any) -> Checkpoint:
    return dataclasses.replace(checkpoint, **changes)


def _renumbered(fragments: Any, versions: tuple[int, ...]) -> tuple[Any, ...]:
    return tuple(
        dataclasses.replace(f, version=v) for f, v in zip(fragments, versions, strict=True)
    )


@pytest.mark.parametrize(
    ("mutate", "hello", "reason"),
    [
        (lambda c: _with(c, contract=b"\x09" * 32), {}, "contract"),
        (lambda c: c, {"layout_fingerprint": b"\x08" * 32}, "fingerprint"),
        # Two fragments at the versions step 4 gives two: consistent, but not this layout.
        (lambda c: _with(c, fragments=_renumbered(c.fragments[:2], (3, 4))), {}, "fragments"),
    ],
)
def test_ineligible_checkpoint_refuses_the_hello_and_keeps_serving(
    tmp_path: Path, mutate: Any, hello: dict[str, Any], reason: str
) -> None:
    checkpoint = mutate(saved_at_step_4(tmp_path, uninterrupted(tmp_path)))
    sim = Sim(config(tmp_path, resume=True), LAYOUT, checkpoint=checkpoint)

    conn, actions = sim.hello(sim.make_hello(0, 1, **hello))

    refusal = next(a for a in actions if isinstance(a, RefuseConnection))
    assert refusal.conn == conn
    assert refusal.error.text.startswith(ErrorCode.CKPT_RESUME_INELIGIBLE.value)
    assert reason in refusal.error.text
    assert not [a for a in actions if isinstance(a, Exit)]
    assert sim.coordinator.session is None and sim.coordinator.model is None


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda c: _with(c, iso_backend=IsoBackend.TORCH_SVD), "backend"),
        (lambda c: _with(c, format=CheckpointFormat.V1, iso_backend=None), "V1"),
        (lambda c: _with(c, global_step=5), "version"),
        # Whatever the HELLO, check 7 refuses a V3 file without a contract: a hung syncer.
        (lambda c: _with(c, contract=None), "no session contract"),
    ],
)
def test_a_checkpoint_no_hello_could_resume_is_refused_before_any(
    tmp_path: Path, mutate: Any, reason: str
) -> None:
    """Otherwise every HELLO would be refused, forever (the daemon refuses it at start)."""
    checkpoint = mutate(saved_at_step_4(tmp_path, uninterrupted(tmp_path)))
    with pytest.raises(ValueError, match=reason):
        Sim(config(tmp_path, resume=True), LAYOUT, checkpoint=checkpoint)


def test_a_stray_hello_does_not_end_a_resumed_run(tmp_path: Path) -> None:
    """A learner of another run is refused; the run's own learners then resume it."""
    checkpoint = saved_at_step_4(tmp_path, uninterrupted(tmp_path))
    sim = Sim(config(tmp_path, resume=True), LAYOUT, checkpoint=checkpoint)

    stray, actions = sim.hello(sim.make_hello(1, 77, layout_fingerprint=b"\x08" * 32))
    assert any(isinstance(a, RefuseConnection) and a.conn == stray for a in actions)

    sim.start()
    assert sim.run() == Exit(0, "finalized at global step 7")
    assert [r["step"] for r in sim.merges] == [5, 6, 7]


def test_v2_single_tensor_checkpoint_resumes(tmp_path: Path) -> None:
    """V2 records no fingerprint: allowed only when every fragment holds one tensor."""
    single = avg_layout((4,), (6,), (5,))
    sim = Sim(config(tmp_path, total_steps=4), single)
    sim.start()
    sim.run()
    state = sim.checkpoints[0].state
    legacy = _with(state, format=CheckpointFormat.V2, fingerprint=None)

    resumed = Sim(config(tmp_path, total_steps=6, resume=True), single, checkpoint=legacy)
    conn, _ = resumed.hello(resumed.make_hello(0, 1))

    assert conn in resumed.admitted
    assert resumed.coordinator.global_step == 4


def test_grouped_v2_checkpoint_fails_closed(tmp_path: Path) -> None:
    state = saved_at_step_4(tmp_path, uninterrupted(tmp_path))
    legacy = _with(state, format=CheckpointFormat.V2, fingerprint=None)
    sim = Sim(config(tmp_path, resume=True), LAYOUT, checkpoint=legacy)

    conn, actions = sim.hello(sim.make_hello(0, 1))

    assert conn in sim.refused and not [a for a in actions if isinstance(a, Exit)]
    (refusal,) = [a for a in actions if isinstance(a, RefuseConnection)]
    assert "V2" in refusal.error.text and sim.coordinator.model is None


def test_resumed_fragments_count_as_initialized(tmp_path: Path) -> None:
    checkpoint = saved_at_step_4(tmp_path, uninterrupted(tmp_path))
    sim = Sim(config(tmp_path, resume=True, learners=1, quorum=1), LAYOUT, checkpoint=checkpoint)
    a = sim.learner(0, auto=False)

    a.connect()  # no INIT at all

    assert [(p.global_step, p.fragment_id) for p in sim.sends_to(a.key, PullReq)] == [
        (5, 1),
        (6, 2),
    ]
    model = sim.coordinator.model
    assert model is not None
    sim.message(a.key, InitParams(0, np.zeros(4, "<f4").view(np.uint8).data))
    np.testing.assert_array_equal(model.fragments[0].arrays()[0], checkpoint.fragments[0].params)
