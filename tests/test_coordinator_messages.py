"""Per-message rules: INIT, HEARTBEAT, BUDGET_DONE and frames a learner may not send."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from sim import Sim, avg_layout

from yeto_proto.constants import WireDtype
from yeto_proto.dtypes import encode_tensor
from yeto_proto.errors import ErrorCode
from yeto_proto.messages import (
    AnyMessage,
    BcastFragment,
    BudgetDone,
    Heartbeat,
    InitParams,
    PullReq,
    Shutdown,
)
from yeto_sync.config import SyncerConfig
from yeto_sync.events import CloseGroup, GroupKey, Log

LAYOUT = avg_layout((4,), (6,))


def init(fragment: int, values: Any, dtype: WireDtype = WireDtype.F32) -> InitParams:
    data = encode_tensor(np.asarray(values, dtype=np.float32), dtype, push=False)
    return InitParams(fragment, data.data)


def closed_code(sim: Sim, key: GroupKey) -> str:
    error = sim.closed[key]
    assert error is not None
    return error.text.split(":", 1)[0]


def test_init_only_from_learner_zero() -> None:
    sim = Sim(SyncerConfig(learners=2, total_steps=2), LAYOUT)
    a, b = sim.learner(0, auto=False), sim.learner(1, auto=False)
    a.connect()
    b.connect()

    sim.message(b.key, init(0, [1, 2, 3, 4]))

    assert closed_code(sim, b.key) == ErrorCode.INIT_NOT_ALLOWED.value
    model = sim.coordinator.model
    assert model is not None and not model.fragments[0].initialized
    assert sim.coordinator.registry.current_of(0) == a.key  # others unaffected


def test_repeated_init_is_ignored() -> None:
    sim = Sim(SyncerConfig(learners=1, total_steps=2), LAYOUT)
    a = sim.learner(0, auto=False)
    a.connect()
    sim.message(a.key, init(0, [1, 2, 3, 4]))

    actions = sim.message(a.key, init(0, [9, 9, 9, 9]))

    model = sim.coordinator.model
    assert model is not None
    np.testing.assert_array_equal(model.fragments[0].arrays()[0], [1, 2, 3, 4])
    assert [a.text for a in actions if isinstance(a, Log)] == [
        "INIT ignored: fragment already initialized"
    ]
    assert a.key not in sim.closed


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", [WireDtype.F32, WireDtype.BF16, WireDtype.Q4])
def test_non_finite_init_is_refused(bad: float, dtype: WireDtype) -> None:
    sim = Sim(SyncerConfig(learners=1, total_steps=2), LAYOUT, dtype=dtype)
    a = sim.learner(0, auto=False)
    a.connect()

    sim.message(a.key, init(1, [0, 1, bad, 2, 3, 4], dtype))

    assert closed_code(sim, a.key) == ErrorCode.NON_FINITE_VALUE.value
    model = sim.coordinator.model
    assert model is not None and not model.fragments[1].initialized


def test_init_values_are_owned_not_views_of_the_frame() -> None:
    sim = Sim(SyncerConfig(learners=1, total_steps=2), LAYOUT)
    a = sim.learner(0, auto=False)
    a.connect()
    buffer = bytearray(np.arange(4, dtype="<f4").tobytes())

    sim.message(a.key, InitParams(0, memoryview(buffer)))
    buffer[:4] = np.float32(42).tobytes()  # a transport may reuse its receive buffer

    model = sim.coordinator.model
    assert model is not None
    np.testing.assert_array_equal(model.fragments[0].arrays()[0], [0, 1, 2, 3])


def test_first_round_waits_for_every_fragment_and_all_learners() -> None:
    sim = Sim(SyncerConfig(learners=2, total_steps=2), LAYOUT)
    a, b = sim.learner(0, auto=False), sim.learner(1, auto=False)
    a.connect()
    sim.message(a.key, init(0, [1, 2, 3, 4]))
    sim.message(a.key, init(1, range(6)))
    assert not sim.sends_to(a.key, PullReq)  # only one learner connected

    b.connect()

    for key in (a.key, b.key):
        bcasts = sim.sends_to(key, BcastFragment)
        assert [(m.fragment_id, m.version) for m in bcasts] == [(0, 0), (1, 0)]
        assert [p.global_step for p in sim.sends_to(key, PullReq)] == [1, 2]
        # Every fragment is broadcast before the first PULL goes out.
        kinds = [type(m) for m in sim.inbox[key]]
        assert kinds == [BcastFragment, BcastFragment, PullReq, PullReq]


def test_heartbeat_learner_id_must_match_the_group() -> None:
    sim = Sim(SyncerConfig(learners=2, total_steps=2), LAYOUT)
    a = sim.learner(0, auto=False)
    a.connect()

    sim.message(a.key, Heartbeat(1, 10))

    assert closed_code(sim, a.key) == ErrorCode.LEARNER_ID_MISMATCH.value
    assert not sim.coordinator.registry.is_open(a.key)


def test_budget_done_without_a_budget_is_refused() -> None:
    sim = Sim(SyncerConfig(learners=1, total_steps=2), LAYOUT)
    a = sim.learner(0, auto=False)
    a.connect()

    sim.message(a.key, BudgetDone(100))

    assert closed_code(sim, a.key) == ErrorCode.BUDGET_NOT_CONFIGURED.value


@pytest.mark.parametrize("message", [Shutdown(), BcastFragment(0, 1, memoryview(b"\0" * 16))])
def test_frames_a_learner_may_not_send_close_the_group(message: AnyMessage) -> None:
    sim = Sim(SyncerConfig(learners=1, total_steps=2), LAYOUT)
    a = sim.learner(0, auto=False)
    a.connect()

    sim.message(a.key, message)

    assert closed_code(sim, a.key) == ErrorCode.WRONG_DIRECTION.value
    assert len(sim.of_type(CloseGroup)) == 1


def test_messages_from_a_group_closed_by_the_syncer_are_ignored() -> None:
    sim = Sim(SyncerConfig(learners=1, total_steps=2), LAYOUT)
    a = sim.learner(0, auto=False)
    a.connect()
    sim.message(a.key, Heartbeat(1, 10))  # closes the group

    assert sim.message(a.key, Heartbeat(0, 10)) == []
    assert sim.close(a.key) == []
