"""HELLO admission: the checks left after the decoder, session fixation, profile binding."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from sim import Sim, avg_layout

from yeto_proto.constants import MergeMode, WireDtype
from yeto_proto.errors import ErrorCode
from yeto_proto.layout import WireFragment, WireLayout
from yeto_proto.limits import Limits
from yeto_proto.messages import PullReq
from yeto_sync.config import SyncerConfig
from yeto_sync.coordinator.registry import Registry
from yeto_sync.events import AdmitGroup, CloseGroup, ConnId, GroupKey, Log, RefuseConnection

LAYOUT = avg_layout((4,), (6,))


def config(**overrides: Any) -> SyncerConfig:
    return SyncerConfig(learners=2, total_steps=4, **overrides)


def refusal_code(sim: Sim, conn: int) -> str:
    return sim.refused[conn].text.split(":", 1)[0]


def test_first_hello_is_admitted_with_session_limits() -> None:
    sim = Sim(config(), LAYOUT, dtype=WireDtype.Q4)
    hello = sim.make_hello(1, 7, num_streams=3)

    conn, actions = sim.hello(hello)

    admits = [a for a in actions if isinstance(a, AdmitGroup)]
    assert admits == [AdmitGroup(conn, GroupKey(1, 7), 3, Limits.of(WireDtype.Q4, LAYOUT))]
    session = sim.coordinator.session
    assert session is not None and session.dtype is WireDtype.Q4 and session.layout == LAYOUT
    assert any(isinstance(a, Log) and a.text == "group admitted" for a in actions)


OTHER_LAYOUT = avg_layout((4,), (5,))
OTHER_MODE = WireLayout((WireFragment(MergeMode.RDA, (4,)), WireFragment(MergeMode.AVG, (6,))))


@pytest.mark.parametrize(
    ("overrides", "code"),
    [
        ({"learner_id": 2}, ErrorCode.LEARNER_ID_OUT_OF_RANGE),
        ({"dtype": WireDtype.BF16}, ErrorCode.SESSION_DTYPE_MISMATCH),
        ({"layout": OTHER_LAYOUT}, ErrorCode.SESSION_LAYOUT_MISMATCH),
        ({"layout": OTHER_MODE}, ErrorCode.SESSION_LAYOUT_MISMATCH),
        ({"layout_fingerprint": b"\xff" * 32}, ErrorCode.SESSION_FINGERPRINT_MISMATCH),
        ({"session_contract": b"\xee" * 32}, ErrorCode.SESSION_CONTRACT_MISMATCH),
        ({"profile_hash": config().profile().digest()}, ErrorCode.SESSION_PROFILE_MISMATCH),
        ({"profile_hash": b"\x01" * 32}, ErrorCode.SESSION_PROFILE_MISMATCH),
        ({"learner_id": 0, "generation": 1}, ErrorCode.DUPLICATE_GENERATION),
    ],
)
def test_later_hello_refused_on_its_connection_only(
    overrides: dict[str, Any], code: ErrorCode
) -> None:
    sim = Sim(config(), LAYOUT)
    first = sim.learner(0)
    first.connect()
    before = sim.coordinator.session
    hello = replace(sim.make_hello(1, 1), **overrides)

    conn, actions = sim.hello(hello)

    assert refusal_code(sim, conn) == code.value
    assert [type(a) for a in actions] == [RefuseConnection, Log]
    assert actions[1].fields["code"] == code.value  # type: ignore[union-attr]
    # Other groups are untouched and the session stays as the first HELLO fixed it.
    assert not sim.of_type(CloseGroup)
    assert sim.coordinator.registry.current_of(0) == first.key
    assert sim.coordinator.session == before


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        ({"dtype": WireDtype.BF16}, "session dtype is f32, HELLO has bf16"),
        ({"layout": avg_layout((4,), (6,), (2,))}, ": 3 fragments, the session has 2"),
        ({"layout": OTHER_LAYOUT}, ": fragment 1 tensor 0 has 5 values, the session's 6"),
        ({"layout": OTHER_MODE}, ": fragment 0 is rda, the session's avg"),
        ({"layout": avg_layout((4,), (3, 3))}, ": fragment 1 has 2 tensors, the session's 1"),
        ({"session_contract": b"\xee" * 32}, "(for yeto learners: the run id or the experiment"),
    ],
)
def test_a_session_mismatch_names_the_learner_that_fixed_the_session_and_the_difference(
    overrides: dict[str, Any], says: str
) -> None:
    # The first learner to connect decides: a refused learner may be the right one.
    sim = Sim(config(), LAYOUT)
    sim.learner(1).connect()
    conn, _ = sim.hello(replace(sim.make_hello(0, 1), **overrides))
    text = sim.refused[conn].text
    assert "the session (fixed by learner 1's HELLO, the first accepted)" in text
    assert says in text


def test_generation_reused_after_close_is_refused() -> None:
    sim = Sim(config(), LAYOUT)
    learner = sim.learner(1)
    learner.connect(generation=5)
    learner.disconnect()

    conn, _ = sim.hello(sim.make_hello(1, 5))

    assert refusal_code(sim, conn) == ErrorCode.DUPLICATE_GENERATION.value


def test_refused_first_hello_does_not_fix_the_session() -> None:
    sim = Sim(config(), LAYOUT)
    bad, _ = sim.hello(sim.make_hello(0, 1, profile_hash=b"\x02" * 32))
    assert refusal_code(sim, bad) == ErrorCode.SESSION_PROFILE_MISMATCH.value
    assert sim.coordinator.session is None

    good, _ = sim.hello(sim.make_hello(0, 2, dtype=WireDtype.BF16))

    assert good in sim.admitted
    session = sim.coordinator.session
    assert session is not None and session.dtype is WireDtype.BF16


@pytest.mark.parametrize(
    ("require", "first", "later", "code"),
    [
        # --require-profile-binding rejects an omitted hash, even on the first HELLO.
        (True, None, None, ErrorCode.PROFILE_BINDING_REQUIRED),
        # A correctly bound session admits bound HELLOs ...
        (True, "good", "good", None),
        # ... and refuses a later unbound one (required, or fixed by the first HELLO).
        (True, "good", None, ErrorCode.PROFILE_BINDING_REQUIRED),
        (False, "good", None, ErrorCode.SESSION_PROFILE_MISMATCH),
        # Generic v4 clients without a hash work when binding is not required.
        (False, None, None, None),
        (False, None, "good", ErrorCode.SESSION_PROFILE_MISMATCH),
    ],
)
def test_profile_binding(
    require: bool, first: str | None, later: str | None, code: ErrorCode | None
) -> None:
    cfg = config(require_profile_binding=require)
    digest = cfg.profile().digest()
    sim = Sim(cfg, LAYOUT)

    def profile(which: str | None) -> bytes | None:
        return digest if which == "good" else None

    first_conn, _ = sim.hello(sim.make_hello(0, 1, profile_hash=profile(first)))
    if require and first is None:
        assert refusal_code(sim, first_conn) == code.value  # type: ignore[union-attr]
        return
    assert first_conn in sim.admitted
    later_conn, _ = sim.hello(sim.make_hello(1, 1, profile_hash=profile(later)))
    if code is None:
        assert later_conn in sim.admitted
    else:
        assert refusal_code(sim, later_conn) == code.value


def test_profile_hash_is_the_digest_of_the_running_configuration() -> None:
    """A client bound to another configuration (one flag differs) is refused."""
    cfg = config(require_profile_binding=True)
    other = config(require_profile_binding=True, outer_lr=0.5).profile().digest()
    sim = Sim(cfg, LAYOUT)

    conn, _ = sim.hello(sim.make_hello(0, 1, profile_hash=other))

    assert refusal_code(sim, conn) == ErrorCode.SESSION_PROFILE_MISMATCH.value


def test_a_group_counts_as_connected_only_once_ready() -> None:
    sim = Sim(config(), LAYOUT)
    first, second = sim.learner(0, auto=False), sim.learner(1, auto=False)
    first.connect()
    second.connect(ready=False)
    first.init_all([np.ones(4, np.float32), np.ones(6, np.float32)])
    assert not sim.sends_to(first.key, PullReq)

    sim.ready(second.key)

    pulls = sim.sends_to(first.key, PullReq) + sim.sends_to(second.key, PullReq)
    assert [(p.global_step, p.fragment_id, p.round_attempt) for p in pulls] == [
        (1, 0, 1),
        (2, 1, 1),
        (1, 0, 1),
        (2, 1, 1),
    ]


def test_error_text_carries_the_stable_code() -> None:
    sim = Sim(config(), LAYOUT)
    conn, _ = sim.hello(sim.make_hello(9, 1))
    assert sim.refused[conn].text.startswith("LEARNER_ID_OUT_OF_RANGE: learner_id 9")


def test_a_layout_difference_in_iso_shapes_or_a_later_tensor_is_named() -> None:
    from yeto_sync.coordinator.admission import _layout_difference

    iso = WireLayout((WireFragment(MergeMode.ISO, (6,), ((2, 3),)),))
    transposed = WireLayout((WireFragment(MergeMode.ISO, (6,), ((3, 2),)),))
    assert _layout_difference(transposed, iso) == (
        "fragment 0 tensor 0 is a 3x2 matrix, the session's 2x3"
    )
    five = avg_layout((1, 2, 3, 4, 5))
    other = avg_layout((1, 2, 3, 4, 6))
    assert _layout_difference(other, five) == "fragment 0 tensor 4 has 6 values, the session's 5"


def test_a_group_ready_before_the_session_starts_names_the_learners_it_waits_for() -> None:
    """A session starts only with every learner id: after a resume, one that got its SHUTDOWN
    before the crash never comes back, and the log must say which ids are missing."""
    sim = Sim(SyncerConfig(learners=4, total_steps=4), LAYOUT)
    crew = {learner_id: sim.learner(learner_id) for learner_id in range(4)}
    for learner_id in (2, 0):
        crew[learner_id].connect()
    waits = [log.fields["session_waits_for"] for log in sim.logs("group ready")]
    assert waits == ["0,1,3", "1,3"]
    crew[0].init_all([np.zeros(n, np.float32) for n in LAYOUT.numels])
    for learner_id in (1, 3):
        crew[learner_id].connect()
    waits = [log.fields.get("session_waits_for") for log in sim.logs("group ready")]
    assert waits == ["0,1,3", "1,3", "3", None]  # the last one started the session
    assert sim.logs("session started")


def test_the_missing_learners_of_a_huge_session_are_named_in_part() -> None:
    registry = Registry()
    for learner_id in (0, 5, (1 << 32) - 2):
        key = GroupKey(learner_id, 1)
        registry.admit(key, ConnId(learner_id), 0)
        registry.mark_ready(key)
    assert registry.missing_learners((1 << 32) - 1, most=6) == (
        f"1,2,3,4,6,7 and {(1 << 32) - 1 - 3 - 6} more"
    )
    assert registry.missing_learners(6) == "1,2,3,4"
    assert registry.missing_learners(8, most=16) == "1,2,3,4,6,7"
