"""Connection generations: supersession, captured attempts, closes, and the catch-up BCAST."""

from __future__ import annotations

import numpy as np
from sim import Sim, avg_layout

from yeto_proto.errors import ErrorCode
from yeto_proto.messages import BcastFragment, InitParams, PullReq
from yeto_sync.config import SyncerConfig
from yeto_sync.coordinator.registry import MAX_OPEN_GENERATIONS
from yeto_sync.events import CloseGroup, GroupKey

LAYOUT = avg_layout((4,), (3, 2), (5,))


def test_new_generation_supersedes_the_old_for_future_launches() -> None:
    sim = Sim(SyncerConfig(learners=2, total_steps=6, quorum=2, pipeline=1), LAYOUT)
    a, b = sim.start(auto=False)
    old = a.key
    assert [p.global_step for p in sim.sends_to(old, PullReq)] == [1]

    new = a.connect()  # generation 2 while round 1 still captures generation 1

    assert sim.coordinator.registry.current_of(0) == new
    # The old generation still finishes the attempt that captured it.
    pull = sim.sends_to(old, PullReq)[0]
    sim.message(old, a.push_for(pull))
    sim.message(b.key, b.push_for(pull))
    assert sim.merges[0]["responded_members"] == [
        {"id": 0, "generation": 1},
        {"id": 1, "generation": 1},
    ]
    # Round 2 captures the replacement, not the old generation.
    assert [p.global_step for p in sim.sends_to(new, PullReq)] == [2]
    assert [p.global_step for p in sim.sends_to(old, PullReq)] == [1]
    assert sim.coordinator.rounds_in_flight[0].members == (new, b.key)
    # The commit's BCAST went to the current generations only.
    versions_old = [(m.fragment_id, m.version) for m in sim.sends_to(old, BcastFragment)]
    versions_new = [(m.fragment_id, m.version) for m in sim.sends_to(new, BcastFragment)]
    assert versions_old == [(0, 0), (1, 0), (2, 0)]
    assert versions_new == [(0, 0), (1, 0), (2, 0), (0, 1)]


def test_replacement_cannot_answer_for_the_captured_generation() -> None:
    sim = Sim(SyncerConfig(learners=1, total_steps=3, pipeline=1), LAYOUT)
    (a,) = sim.start(auto=False)
    pull = sim.sends_to(a.key, PullReq)[0]
    a.connect()

    sim.message(a.key, a.push_for(pull))

    assert [r["code"] for r in sim.tape] == [ErrorCode.PUSH_WRONG_GENERATION.value]
    assert not sim.of_type(CloseGroup)


def test_closing_the_old_generation_keeps_the_replacement() -> None:
    sim = Sim(SyncerConfig(learners=2, total_steps=3), LAYOUT)
    a, _ = sim.start(auto=False)
    old = a.key
    new = a.connect()

    sim.close(old)

    registry = sim.coordinator.registry
    assert registry.current_of(0) == new
    assert registry.connected_learners == 2
    assert not registry.is_open(old)


def test_a_generation_admitted_but_not_ready_already_keeps_launches_off_the_old_one() -> None:
    """Source: a new generation "supersedes the old one for future launches". The learner
    redialed, so the old group is most likely dead: a PULL to it would hold the round up to its
    quorum deadline while the new one attaches its data sockets."""
    config = SyncerConfig(learners=2, total_steps=3, quorum=2, pipeline=1)
    sim = Sim(config, LAYOUT)
    a, b = sim.start(auto=False)
    old = a.key
    first = sim.sends_to(old, PullReq)[0]
    a.connect(ready=False)  # generation 2, attaching its data sockets
    registry = sim.coordinator.registry
    assert registry.current_of(0) == old  # current until the new one is ready

    sim.message(old, a.push_for(first))  # the old one still answers what captured it
    sim.message(b.key, b.push_for(first))

    (launched,) = sim.coordinator.rounds_in_flight
    assert launched.step == 2 and launched.members == (b.key,)
    assert [p.global_step for p in sim.sends_to(old, PullReq)] == [1]


def test_a_newer_generation_that_never_became_ready_hands_launches_back() -> None:
    sim = Sim(SyncerConfig(learners=1, total_steps=3, pipeline=1), LAYOUT)
    (a,) = sim.start(auto=False)
    old = a.key
    first = sim.sends_to(old, PullReq)[0]
    pending = a.connect(ready=False)
    sim.message(old, a.push_for(first))
    assert sim.merges[-1]["step"] == 1
    assert not sim.coordinator.rounds_in_flight  # nobody to capture while it attaches

    sim.close(pending)  # it never became ready

    assert sim.coordinator.registry.current_of(0) == old
    assert [p.global_step for p in sim.sends_to(old, PullReq)] == [1, 2]


def test_later_admitted_generation_wins_whatever_the_ready_order() -> None:
    sim = Sim(SyncerConfig(learners=1, total_steps=3), LAYOUT)
    sim.hello(sim.make_hello(0, 10))
    sim.hello(sim.make_hello(0, 20))
    sim.ready(GroupKey(0, 20))

    sim.ready(GroupKey(0, 10))

    assert sim.coordinator.registry.current_of(0) == GroupKey(0, 20)


def test_new_ready_generation_gets_every_initialized_fragment_at_its_version() -> None:
    # Rounds 1..2 committed, fragment 2 still at version 0.
    sim = Sim(SyncerConfig(learners=2, total_steps=9, quorum=2, pipeline=1), LAYOUT)
    a, b = sim.start(auto=False)
    for _ in range(2):
        for learner in (a, b):
            learner.auto = True
            learner.react()
            learner.auto = False
    model = sim.coordinator.model
    assert model is not None and model.versions == (1, 2, 0)

    fresh = b.connect()

    bcasts = sim.sends_to(fresh, BcastFragment)
    assert [(m.fragment_id, m.version) for m in bcasts] == [(0, 1), (1, 2), (2, 0)]
    for message in bcasts:
        np.testing.assert_array_equal(
            sim.decode_bulk(message.data, message.fragment_id),
            model.fragments[message.fragment_id].arrays()[0],
        )


def test_ready_before_init_gets_only_initialized_fragments() -> None:
    sim = Sim(SyncerConfig(learners=2, total_steps=3), LAYOUT)
    a = sim.learner(0, auto=False)
    a.connect()
    sim.message(a.key, InitParams(0, np.arange(4, dtype=np.float32).view(np.uint8).data))
    b = sim.learner(1, auto=False)

    b.connect()

    assert [(m.fragment_id, m.version) for m in sim.sends_to(b.key, BcastFragment)] == [(0, 0)]


def test_a_learner_id_keeps_a_bounded_number_of_generations_open() -> None:
    # Each open generation may hold 64 partial messages: one learner id redialing (or faking
    # redials) without end held unbounded reassembly memory.
    sim = Sim(SyncerConfig(learners=2, total_steps=3, pipeline=1), LAYOUT)
    a, _ = sim.start(auto=False)
    current = a.key
    pending = [a.connect(ready=False) for _ in range(MAX_OPEN_GENERATIONS - 1)]
    assert not sim.of_type(CloseGroup)  # the cap itself is fine
    newest = a.connect(ready=False)
    # One over: the oldest that is not current goes, without ERROR; the current one stays.
    (closed,) = sim.of_type(CloseGroup)
    assert closed.group == pending[0] and closed.error is None
    registry = sim.coordinator.registry
    assert registry.current_of(0) == current and registry.is_open(newest)
    assert not registry.is_open(pending[0])
    for _ in range(10):
        a.connect(ready=False)
    opened = [k for k in (current, *pending, newest) if registry.is_open(k)]
    assert registry.current_of(0) == current and current in opened
    assert sum(1 for g in sim.of_type(CloseGroup)) == 11


def test_the_oldest_superseded_generation_goes_first() -> None:
    sim = Sim(SyncerConfig(learners=2, total_steps=3, pipeline=1), LAYOUT)
    a, _ = sim.start(auto=False)
    generations = [a.key] + [a.connect() for _ in range(MAX_OPEN_GENERATIONS)]
    (closed,) = sim.of_type(CloseGroup)
    assert closed.group == generations[0]
    assert sim.coordinator.registry.current_of(0) == generations[-1]
