"""Streamed broadcasts: a commit hands its BCASTs out before the merge, gated by its progress.

The daemon's driver runs the coordinator off the event loop and sets ``early_sends``; these
tests play that part with :class:`sim.Sim` (``stream_broadcasts=True``) and check that a
streamed session sends exactly the bytes of a plain one, that nothing is streamed where the
order of actions forbids it, and that a failed merge withdraws what it streamed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from sim import Sim, avg_layout

from yeto_proto.constants import WireDtype
from yeto_proto.messages import BcastFragment, PullReq
from yeto_sync.config import SyncerConfig
from yeto_sync.events import Exit, Send, WriteCheckpoint
from yeto_sync.merge import F32Array

# One fragment over the threaded size of the outer step (several blocks, two threads), one small.
LAYOUT = avg_layout((1 << 21, 3), (70,))


def _run(dtype: WireDtype, *, stream: bool, **config: object) -> Sim:
    settings: dict[str, object] = {"learners": 2, "total_steps": 6, "quorum": 2, "pipeline": 2}
    settings.update(config)
    sim = Sim(SyncerConfig(**settings), LAYOUT, dtype=dtype, stream_broadcasts=stream)  # type: ignore[arg-type]
    sim.start()
    exit_action = sim.run()
    assert exit_action.code == 0, exit_action.reason
    return sim


def _bcasts(sim: Sim) -> dict[object, list[tuple[int, int, bytes]]]:
    sent = {
        key: [
            (m.fragment_id, m.version, bytes(m.data)) for m in inbox if isinstance(m, BcastFragment)
        ]
        for key, inbox in sorted(sim.inbox.items())
    }
    return {key: messages for key, messages in sent.items() if messages}


@pytest.mark.parametrize("dtype", [WireDtype.F32, WireDtype.BF16, WireDtype.Q4])
def test_a_streamed_session_sends_the_bytes_of_a_plain_one(dtype: WireDtype) -> None:
    plain, streamed = _run(dtype, stream=False), _run(dtype, stream=True)

    assert _bcasts(streamed) == _bcasts(plain)
    assert [r["gnorm"] for r in streamed.merges] == [r["gnorm"] for r in plain.merges]
    for mine, theirs in zip(
        streamed.coordinator.model.fragments,  # type: ignore[union-attr]
        plain.coordinator.model.fragments,  # type: ignore[union-attr]
        strict=True,
    ):
        np.testing.assert_array_equal(mine.arrays()[0], theirs.arrays()[0])
        np.testing.assert_array_equal(mine.arrays()[1], theirs.arrays()[1])
    # Every commit streamed to both learners, each BCAST handed out before its merge wrote
    # anything, and each complete once handle() returned.
    commits = len(streamed.merges)
    assert len(streamed.early) == 2 * commits
    for send, ready_at_hand_out in streamed.early:
        assert isinstance(send.message, BcastFragment)
        assert send.progress is not None and send.progress.complete
        assert ready_at_hand_out == 0 < send.progress.total == len(send.message.data)
    # No BCAST of a streamed version went out twice.
    for key, sent in _bcasts(streamed).items():
        assert len({(fragment, version) for fragment, version, _ in sent}) == len(sent), key


def test_a_commit_that_writes_a_checkpoint_broadcasts_after_it(tmp_path: Path) -> None:
    sim = _run(
        WireDtype.F32,
        stream=True,
        checkpoint_path=tmp_path / "ckpt",
        checkpoint_every=2,
        pipeline=1,
    )
    streamed_versions = {send.message.version for send, _ in sim.early}  # type: ignore[union-attr]
    assert streamed_versions == {1, 3, 5}
    # Steps 2, 4, 6 checkpoint first: their BCASTs come after the WriteCheckpoint.
    for step in (2, 4, 6):
        checkpoint_at = next(
            i
            for i, a in enumerate(sim.actions)
            if isinstance(a, WriteCheckpoint) and a.state.global_step == step
        )
        bcast_at = [
            i
            for i, a in enumerate(sim.actions)
            if isinstance(a, Send)
            and isinstance(a.message, BcastFragment)
            and a.message.version == step
        ]
        assert bcast_at and min(bcast_at) > checkpoint_at
        assert all(sim.actions[i].progress is None for i in bcast_at)  # type: ignore[attr-defined]


def test_two_commits_in_one_event_stream_in_ascending_order() -> None:
    # pipeline 2 and one learner: pushing round 2 first, then round 1, commits both in one
    # event; round 1's BCAST is handed out (and so queued) before round 2's.
    sim = Sim(
        SyncerConfig(learners=1, total_steps=3, pipeline=2),
        avg_layout((4,), (3,)),
        stream_broadcasts=True,
    )
    (a,) = sim.start(auto=False)
    first, second = sim.sends_to(a.key, PullReq)
    sim.message(a.key, a.push_for(second))
    assert not sim.early
    actions = sim.message(a.key, a.push_for(first))

    assert [send.message.version for send, _ in sim.early] == [1, 2]  # type: ignore[union-attr]
    delivered = [x.message for x in actions if isinstance(x, Send)]
    versions = [m.version for m in delivered if isinstance(m, BcastFragment)]
    assert versions == [1, 2]
    assert all(send.progress is not None for send, _ in sim.early)


def test_a_failed_merge_withdraws_the_streamed_broadcast() -> None:
    sim = Sim(SyncerConfig(learners=1, total_steps=3), avg_layout((6,)), stream_broadcasts=True)
    (a,) = sim.start(auto=False)

    def overflowing(learner: int, step: int, fragment: int, numel: int) -> F32Array:
        return np.full(numel, -3e38, np.float32)  # Δ = 3e38: the outer step overflows

    a.deltas = overflowing
    actions = sim.message(a.key, a.push_for(sim.sends_to(a.key, PullReq)[0]))

    assert isinstance(actions[-1], Exit) and actions[-1].code != 0
    [(send, _)] = sim.early
    assert send.progress is not None and send.progress.withdrawn
    assert not any(isinstance(x, Send) for x in actions)  # nothing delivered whole


def test_a_commit_does_not_overtake_a_checkpoint_queued_in_the_same_event(
    tmp_path: Path,
) -> None:
    # Three rounds in flight commit in one event: 1 streams; 2 writes a checkpoint, so its
    # BCAST is returned after it; 3 must then wait behind both (returned, not streamed).
    config = SyncerConfig(
        learners=1,
        total_steps=3,
        pipeline=3,
        checkpoint_path=tmp_path / "ckpt",
        checkpoint_every=2,
    )
    sim = Sim(config, avg_layout((4,), (3,), (5,)), stream_broadcasts=True)
    (a,) = sim.start(auto=False)
    pulls = sim.sends_to(a.key, PullReq)
    assert len(pulls) == 3
    sim.message(a.key, a.push_for(pulls[2]))
    sim.message(a.key, a.push_for(pulls[1]))
    actions = sim.message(a.key, a.push_for(pulls[0]))

    assert [send.message.version for send, _ in sim.early] == [1]  # type: ignore[union-attr]
    order = [
        ("checkpoint", x.state.global_step)
        if isinstance(x, WriteCheckpoint)
        else ("bcast", x.message.version)
        for x in actions
        if isinstance(x, WriteCheckpoint)
        or (isinstance(x, Send) and isinstance(x.message, BcastFragment))
    ]
    # (then the final cut's checkpoint)
    assert order == [("bcast", 1), ("checkpoint", 2), ("bcast", 2), ("bcast", 3), ("checkpoint", 3)]
