"""The learner session (yeto_learn.session) against the learner-side rules of the source text.

Every syncer message reaches the session through the real wire path (encode, then a learner
``FrameDecoder`` with the session's limits). Tensor bytes sent to the session are encoded here
independently of ``yeto_proto.dtypes`` (ml_dtypes for bf16), and PUSH payloads are decoded here
independently too, so a delta is checked against a plain numpy ``local − anchor``.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from numpy.typing import NDArray

from yeto_learn.session import (
    AnchorRecorded,
    ApplyBroadcast,
    ApplyFinal,
    Effect,
    LearnerSession,
    Phase,
    SendMessage,
    ShutdownReceived,
    SyncerFailed,
    backoff_delay,
    fresh_generation,
)
from yeto_proto import (
    AnyMessage,
    BcastFragment,
    BudgetDone,
    Chunk,
    DataHello,
    ErrorCode,
    ErrorMessage,
    FinalAck,
    FinalFragment,
    FinalManifest,
    FrameDecoder,
    Heartbeat,
    InitParams,
    LocalProtocolError,
    MergeMode,
    PullReq,
    PushFragment,
    RemoteProtocolError,
    Role,
    Shutdown,
    WireDtype,
    WireFragment,
    WireLayout,
    encode_bytes,
)

F32 = np.float32
ALPHA = F32(0.5)
LAYOUT = WireLayout(
    (
        WireFragment(MergeMode.AVG, (5, 7)),
        WireFragment(MergeMode.RDA, (300,)),  # two q4 blocks, the second padded
        WireFragment(MergeMode.ISO, (6,), ((2, 3),)),
    )
)
NUMELS = LAYOUT.numels
ALL_DTYPES = list(WireDtype)
FINGERPRINT = bytes(range(32))
CONTRACT = bytes(range(32, 64))


# -- independent codecs ---------------------------------------------------------------------
def bf16_round(x: NDArray[np.float32]) -> NDArray[np.float32]:
    return np.asarray(x, F32).astype(ml_dtypes.bfloat16).astype(F32)


def bulk_bytes(dtype: WireDtype, x: NDArray[np.float32]) -> bytes:
    """INIT/BCAST tensor bytes: f32, or bf16 (also in a q4 session)."""
    if dtype is WireDtype.F32:
        return np.asarray(x, "<f4").tobytes()
    return np.asarray(x, F32).astype(ml_dtypes.bfloat16).view(np.uint16).astype("<u2").tobytes()


def decode_bulk(dtype: WireDtype, data: bytes | memoryview) -> NDArray[np.float32]:
    if dtype is WireDtype.F32:
        return np.frombuffer(data, "<f4").astype(F32)
    bits = np.frombuffer(data, "<u2").astype(np.uint32) << 16
    return bits.view(F32)


def decode_push(dtype: WireDtype, data: bytes | memoryview, numel: int) -> NDArray[np.float32]:
    if dtype is not WireDtype.Q4:
        return decode_bulk(dtype, data)
    blocks = np.frombuffer(data, np.uint8).reshape(-1, 132)
    scales = blocks[:, :4].copy().view("<f4").astype(F32)  # shape (blocks, 1)
    packed = blocks[:, 4:]
    nibbles = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(len(blocks), 256)
    level = (nibbles & 7).astype(F32)
    sign = np.where(nibbles & 8, F32(-1), F32(1))
    values = np.where(level > 0, sign * np.exp2(level - 7) * scales, F32(0))
    return values.reshape(-1)[:numel].astype(F32)


def q4_round(x: NDArray[np.float32]) -> NDArray[np.float32]:
    """What the pinned E3M0 encoder then decoder make of ``x`` (computed in f32)."""
    n = x.size
    padded = np.zeros(-(-n // 256) * 256, F32)
    padded[:n] = x
    blocks = padded.reshape(-1, 256)
    scales = np.abs(blocks).max(axis=1, keepdims=True)
    with np.errstate(divide="ignore"):
        log_ratio = np.log2(np.abs(blocks) / np.where(scales > 0, scales, F32(1)))
    level = np.clip(np.round(log_ratio) + 7, 0, 7).astype(F32)
    values = np.where(level > 0, np.sign(blocks) * np.exp2(level - 7) * scales, F32(0))
    return values.reshape(-1)[:n].astype(F32)


def wire_round(dtype: WireDtype, x: NDArray[np.float32]) -> NDArray[np.float32]:
    """The PUSH value a receiver decodes for a delta ``x``."""
    if dtype is WireDtype.F32:
        return x.astype(F32)
    return bf16_round(x) if dtype is WireDtype.BF16 else q4_round(x)


def same_bits(a: NDArray[np.float32], b: NDArray[np.float32]) -> bool:
    return a.shape == b.shape and bool(np.array_equal(a.view(np.uint32), b.view(np.uint32)))


# -- a syncer stand-in and a training-loop stand-in -----------------------------------------
def through_wire(session: LearnerSession, message: AnyMessage) -> AnyMessage:
    """``message`` as a learner's decoder yields it from the frame bytes."""
    decoder = FrameDecoder(Role.LEARNER, limits=session.limits)
    decoder.feed(encode_bytes(message))
    (decoded,) = decoder.frames()
    return decoded


def deliver(session: LearnerSession, message: AnyMessage) -> list[Effect]:
    return session.receive(through_wire(session, message))


def bcast(
    session: LearnerSession, p: int, version: int, values: NDArray[np.float32]
) -> BcastFragment:
    return BcastFragment(p, version, memoryview(bulk_bytes(session.dtype, values)))


def final(p: int, version: int, values: NDArray[np.float32]) -> FinalFragment:
    return FinalFragment(p, version, memoryview(np.asarray(values, "<f4").tobytes()))


def globals_for(seed: int, *, grid: bool = False) -> list[NDArray[np.float32]]:
    """Bulk-dtype-exact global fragments (bf16-representable, so every session carries them)."""
    rng = np.random.default_rng(seed)
    if grid:  # multiples of 2^-7 in (-2, 2): sums with small powers of two stay exact in f32
        return [(rng.integers(-255, 256, n) / 128).astype(F32) for n in NUMELS]
    return [bf16_round(rng.standard_normal(n).astype(F32)) for n in NUMELS]


def make_session(
    dtype: WireDtype = WireDtype.F32, learner_id: int = 1, budget: int | None = None
) -> LearnerSession:
    return LearnerSession(
        LAYOUT,
        dtype,
        learner_id,
        layout_fingerprint=FINGERPRINT,
        session_contract=CONTRACT,
        budget_steps=budget,
    )


@dataclass
class Trainer:
    """A training loop: flat f32 parameters per fragment; carries out effects like a driver."""

    session: LearnerSession
    params: list[NDArray[np.float32]] = field(default_factory=list)
    sent: list[AnyMessage] = field(default_factory=list)
    blends: list[tuple[int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.params:
            rng = np.random.default_rng(99)
            self.params = [rng.standard_normal(n).astype(F32) for n in NUMELS]

    def read(self, p: int) -> NDArray[np.float32]:
        return self.params[p]

    def apply(self, effects: Sequence[Effect]) -> None:
        for effect in effects:
            match effect:
                case ApplyBroadcast(fragment_id=p, version=v, global_params=theta):
                    self.params[p] = ALPHA * self.params[p] + (F32(1) - ALPHA) * theta
                    self.blends.append((p, v))
                    self.session.broadcast_applied(p, v)
                case ApplyFinal(final_global_step=step, fragments=fragments):
                    self.params = [f.copy() for f in fragments]
                    ack = self.session.final_applied(step)
                    if ack is not None:
                        self.sent.append(ack)
                case SendMessage(message=message):
                    self.sent.append(message)

    def receive(self, message: AnyMessage) -> list[Effect]:
        effects = deliver(self.session, message)
        self.apply(effects)
        return effects

    def step(self, tokens: int = 10, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        for p, n in enumerate(NUMELS):
            self.params[p] = self.params[p] + F32(0.01) * rng.standard_normal(n).astype(F32)
        self.session.record_step(tokens)

    def answer(self) -> list[PushFragment]:
        return self.session.answer_pulls(self.read)


def connected(
    dtype: WireDtype = WireDtype.F32, learner_id: int = 1, budget: int | None = None
) -> Trainer:
    """A trainer whose session has a connection group up (generation 11, two data streams)."""
    session = make_session(dtype, learner_id, budget)
    session.hello(num_streams=2, generation=11)
    return Trainer(session)


def raises_code(
    code: ErrorCode, kind: type[Exception] = RemoteProtocolError
) -> AbstractContextManager[object]:
    """``pytest.raises`` for a yeto_proto error of ``kind`` whose stable code is ``code``."""
    return pytest.raises(kind, match=f"^{code.value}(:|$)")


# -- anchors --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_anchor_is_the_raw_broadcast_not_the_blend(dtype: WireDtype) -> None:
    t = connected(dtype)
    theta = globals_for(1)
    local_before = t.params[1].copy()
    (effect,) = t.receive(bcast(t.session, 1, 0, theta[1]))
    assert isinstance(effect, ApplyBroadcast)
    assert (effect.fragment_id, effect.version) == (1, 0)
    assert same_bits(effect.global_params, theta[1])
    anchor = t.session.anchor(1)
    assert anchor is not None and anchor.version == 0 and same_bits(anchor.values, theta[1])
    # the training loop blended, the anchor did not move with it
    assert same_bits(t.params[1], ALPHA * local_before + (1 - ALPHA) * theta[1])
    assert not same_bits(t.params[1], anchor.values)
    with pytest.raises(ValueError):
        effect.global_params[0] = 1.0  # shared with the anchor: read-only

    t.step()
    t.receive(PullReq(1, 4, 1))
    (push,) = t.answer()
    payload = decode_push(dtype, push.data, NUMELS[1])
    assert same_bits(payload, wire_round(dtype, t.params[1] - theta[1]))
    assert push.base_version == 0


# -- BCAST monotonicity ---------------------------------------------------------------------
BCAST_CASES = [
    # (name, [(version, values seed)], anchor (version, seed) afterwards, ApplyBroadcast versions)
    ("first", [(3, 1)], (3, 1), [3]),
    ("higher replaces", [(3, 1), (4, 2)], (4, 2), [3, 4]),
    ("lower dropped", [(3, 1), (2, 2)], (3, 1), [3]),
    ("equal replay idempotent", [(3, 1), (3, 1)], (3, 1), [3]),
    ("lower after higher", [(5, 1), (3, 2), (4, 3), (5, 1)], (5, 1), [5]),
    ("version zero then up", [(0, 1), (0, 1), (7, 2)], (7, 2), [0, 7]),
]


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize(
    ("name", "arrivals", "anchor", "applied"), BCAST_CASES, ids=[c[0] for c in BCAST_CASES]
)
def test_broadcasts_are_monotonic_per_fragment(
    dtype: WireDtype,
    name: str,
    arrivals: list[tuple[int, int]],
    anchor: tuple[int, int],
    applied: list[int],
) -> None:
    t = connected(dtype)
    for version, seed in arrivals:
        t.receive(bcast(t.session, 0, version, globals_for(seed)[0]))
    held = t.session.anchor(0)
    assert held is not None
    assert held.version == anchor[0] and same_bits(held.values, globals_for(anchor[1])[0])
    assert [v for p, v in t.blends if p == 0] == applied
    assert t.session.anchor(1) is None and t.session.anchor(2) is None


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_different_bytes_at_the_same_version_are_fatal(dtype: WireDtype) -> None:
    t = connected(dtype)
    t.receive(bcast(t.session, 2, 6, globals_for(1)[2]))
    with raises_code(ErrorCode.BCAST_CONFLICT):
        t.receive(bcast(t.session, 2, 6, globals_for(2)[2]))
    assert t.session.phase is Phase.FAILED
    assert t.session.error is not None and t.session.error.code is ErrorCode.BCAST_CONFLICT
    for later in (t.session.heartbeat, lambda: t.session.record_step(1)):
        with raises_code(ErrorCode.BCAST_CONFLICT):
            later()


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_broadcast_is_the_syncers_violation_and_never_blended(
    dtype: WireDtype, bad: float
) -> None:
    t = connected(dtype)
    values = globals_for(1)[2].copy()
    values[-1] = bad
    with raises_code(ErrorCode.NON_FINITE_VALUE):
        t.receive(bcast(t.session, 2, 6, values))
    assert t.session.phase is Phase.FAILED and t.blends == []


def test_a_non_finite_final_fragment_is_never_applied() -> None:
    t = connected(WireDtype.F32)
    cut = final_cut()
    cut[1] = cut[1].copy()
    cut[1][0] = np.inf
    with raises_code(ErrorCode.NON_FINITE_VALUE):
        for message in final_messages(cut):
            t.receive(message)
    assert t.session.phase is Phase.FAILED


def test_conflict_is_judged_on_bits_not_values() -> None:
    """+0.0 and -0.0 compare equal as floats but are different bytes."""
    t = connected(WireDtype.F32)
    zeros = np.zeros(NUMELS[2], F32)
    t.receive(bcast(t.session, 2, 1, zeros))
    with raises_code(ErrorCode.BCAST_CONFLICT):
        t.receive(bcast(t.session, 2, 1, -zeros))


@given(st.lists(st.integers(0, 6), min_size=1, max_size=30))
def test_any_arrival_order_keeps_the_highest_version(arrivals: list[int]) -> None:
    """Replays are identical per version; the anchor ends at the maximum, applies only rise."""
    t = connected(WireDtype.BF16)
    for version in arrivals:
        t.receive(bcast(t.session, 1, version, globals_for(version)[1]))
    held = t.session.anchor(1)
    assert held is not None and held.version == max(arrivals)
    assert same_bits(held.values, globals_for(max(arrivals))[1])
    new_maxima = sorted(set(itertools.accumulate(arrivals, max)))
    assert [v for _, v in t.blends] == new_maxima


# -- deferred pulls and windows -------------------------------------------------------------
PULL_CASES = [
    # each action, then how many PUSHes answer_pulls returns right after it
    ("pull overtakes the first BCAST", ["pull", "bcast", "apply", "step"], [0, 0, 0, 1]),
    ("anchor and a step first", ["bcast", "apply", "step", "pull"], [0, 0, 0, 1]),
    ("no step since the apply", ["bcast", "apply", "pull", "step"], [0, 0, 0, 1]),
    ("step before the apply", ["pull", "bcast", "step", "apply", "step"], [0, 0, 0, 0, 1]),
    ("steps before any anchor", ["step", "step", "pull", "bcast", "apply"], [0, 0, 0, 0, 0]),
    ("answered once", ["bcast", "apply", "step", "pull", "step", "step"], [0, 0, 0, 1, 0, 0]),
    (
        "a new BCAST defers again",
        ["bcast", "apply", "bcast", "pull", "step", "apply", "step"],
        [0, 0, 0, 0, 0, 0, 1],
    ),
]


@pytest.mark.parametrize(
    ("name", "actions", "expected"), PULL_CASES, ids=[c[0] for c in PULL_CASES]
)
def test_pulls_wait_for_an_applied_anchor_and_a_step(
    name: str, actions: list[str], expected: list[int]
) -> None:
    session = make_session()
    session.hello(1, generation=5)
    t = Trainer(session)
    version = -1
    pending: list[ApplyBroadcast] = []
    counts = []
    for action in actions:
        match action:
            case "pull":
                t.receive(PullReq(0, 9, 1))
            case "bcast":
                version += 1
                effects = deliver(session, bcast(session, 0, version, globals_for(version)[0]))
                pending += [e for e in effects if isinstance(e, ApplyBroadcast)]
            case "apply":
                t.apply(pending)
                pending.clear()
            case "step":
                t.step()
        pushes = t.answer()
        counts.append(len(pushes))
        for push in pushes:  # a PUSH is never sent with an empty window
            assert push.c_steps == session.window(0)[0] >= 1
    assert counts == expected


def test_windows_restart_on_an_applied_broadcast_not_on_a_push() -> None:
    t = connected()
    theta = globals_for(3)
    for p in range(3):
        t.receive(bcast(t.session, p, 0, theta[p]))
    t.step(tokens=10)
    t.step(tokens=20)
    t.receive(PullReq(0, 1, 1))
    (first,) = t.answer()
    assert (first.local_step, first.c_steps, first.c_tokens) == (2, 2, 30)
    t.step(tokens=5)
    t.receive(PullReq(0, 4, 2))  # e.g. a retried attempt: the window kept counting
    (second,) = t.answer()
    assert (second.local_step, second.c_steps, second.c_tokens) == (3, 3, 35)
    assert second.base_version == first.base_version == 0

    t.receive(bcast(t.session, 0, 1, globals_for(4)[0]))
    assert t.session.window(0) == (0, 0)
    assert t.session.window(1) == (3, 35) and t.session.window(2) == (3, 35)
    t.step(tokens=7)
    t.receive(PullReq(0, 7, 1))
    t.receive(PullReq(1, 8, 1))
    pushes = t.answer()
    assert [(x.fragment_id, x.local_step, x.c_steps, x.c_tokens) for x in pushes] == [
        (0, 4, 1, 7),
        (1, 4, 4, 42),
    ]
    assert pushes[0].base_version == 1


def test_a_later_pull_replaces_the_pending_one() -> None:
    t = connected()
    t.receive(bcast(t.session, 1, 0, globals_for(1)[1]))
    t.step()
    t.session.connection_lost()
    t.session.hello(1, generation=12)
    t.receive(bcast(t.session, 1, 0, globals_for(1)[1]))  # the syncer's replay
    t.receive(PullReq(1, 7, 1))
    t.receive(PullReq(1, 7, 2))
    (push,) = t.answer()
    assert (push.global_step, push.round_attempt) == (7, 2)
    assert t.session.pending_pull(1) is None


def test_pulls_are_answered_oldest_round_first() -> None:
    t = connected()
    for p in range(3):
        t.receive(bcast(t.session, p, 0, globals_for(p)[p]))
    t.receive(PullReq(2, 9, 1))
    t.receive(PullReq(0, 8, 3))
    t.receive(PullReq(1, 10, 1))
    assert t.answer() == []
    t.step()
    pushes = t.answer()
    assert [(x.fragment_id, x.global_step, x.round_attempt) for x in pushes] == [
        (0, 8, 3),
        (2, 9, 1),
        (1, 10, 1),
    ]
    assert all(x.learner_id == 1 for x in pushes)


# -- delta = local − raw anchor -------------------------------------------------------------
def exact_deltas(seed: int) -> list[NDArray[np.float32]]:
    """Deltas every dtype carries exactly: per 256-block scale 0.5, values ±0.5·2^(L−7) or 0."""
    rng = np.random.default_rng(seed)
    out = []
    for n in NUMELS:
        levels = rng.integers(0, 8, n)
        signs = rng.choice(np.array([-1.0, 1.0]), n)
        d = np.where(levels > 0, signs * 0.5 * np.exp2(levels - 7.0), 0.0).astype(F32)
        d[::256] = 0.5  # every q4 block's absmax is exactly the scale
        out.append(d)
    return out


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_push_payload_is_exactly_local_minus_anchor(dtype: WireDtype) -> None:
    t = connected(dtype)
    theta = globals_for(5, grid=True)
    for p in range(3):
        t.receive(bcast(t.session, p, 2, theta[p]))
    t.step()
    deltas = exact_deltas(6)
    t.params = [theta[p] + deltas[p] for p in range(3)]
    assert all(same_bits(t.params[p] - theta[p], deltas[p]) for p in range(3))
    for p in range(3):
        t.receive(PullReq(p, 3 + p, 1))
    pushes = t.answer()
    assert len(pushes) == 3
    for push in pushes:
        p = push.fragment_id
        assert len(push.data) == t.session.limits.tensor_bytes(push.TYPE, p)
        assert same_bits(decode_push(dtype, push.data, NUMELS[p]), deltas[p])
        assert push.base_version == 2


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_push_payload_of_arbitrary_values_rounds_local_minus_anchor(dtype: WireDtype) -> None:
    t = connected(dtype)
    theta = globals_for(7)
    rng = np.random.default_rng(8)
    for p in range(3):
        t.receive(bcast(t.session, p, 0, theta[p]))
        t.receive(PullReq(p, 1 + p, 1))
    t.step()
    t.params = [(rng.standard_normal(n) * 3).astype(F32) for n in NUMELS]
    for push in through_wire_all(t.session, t.answer()):
        p = push.fragment_id
        expected = wire_round(dtype, np.subtract(t.params[p], theta[p], dtype=F32))
        assert same_bits(decode_push(dtype, push.data, NUMELS[p]), expected)


def through_wire_all(session: LearnerSession, pushes: list[PushFragment]) -> list[PushFragment]:
    """PUSHes as the syncer's decoder reads them back (checks they frame correctly)."""
    decoder = FrameDecoder(Role.SYNCER, limits=session.limits, enforce_first_frame=False)
    for push in pushes:
        decoder.feed(encode_bytes(push))
    out = decoder.frames()
    assert all(isinstance(m, PushFragment) for m in out) and len(out) == len(pushes)
    return [m for m in out if isinstance(m, PushFragment)]


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_a_stale_anchor_carries_only_local_progress_since_that_anchor(dtype: WireDtype) -> None:
    """The syncer moved to v5 and v9 meanwhile; the payload still ignores that drift."""
    t = connected(dtype)
    theta1 = globals_for(11, grid=True)[1]
    t.receive(bcast(t.session, 1, 1, theta1))
    t.step()
    progress = exact_deltas(12)[1]
    t.params[1] = theta1 + progress
    t.receive(PullReq(1, 10, 1))  # round 10 while the learner's anchor is version 1
    (push,) = t.answer()
    assert push.base_version == 1
    assert same_bits(decode_push(dtype, push.data, NUMELS[1]), progress)

    theta9 = globals_for(13, grid=True)[1]
    t.receive(bcast(t.session, 1, 9, theta9))  # the later state arrives
    t.receive(bcast(t.session, 1, 5, globals_for(14, grid=True)[1]))  # an older one: dropped
    t.step()
    progress = exact_deltas(15)[1]
    t.params[1] = theta9 + progress
    t.receive(PullReq(1, 13, 1))
    (push,) = t.answer()
    assert push.base_version == 9
    assert same_bits(decode_push(dtype, push.data, NUMELS[1]), progress)


def test_bad_local_parameters_consume_no_pull() -> None:
    t = connected()
    t.receive(bcast(t.session, 0, 0, globals_for(1)[0]))
    t.step()
    t.receive(PullReq(0, 2, 1))
    wrong: list[Callable[[int], NDArray[np.float32]]] = [
        lambda p: np.zeros(NUMELS[p] + 1, F32),
        lambda p: np.zeros(NUMELS[p], np.float64),
        lambda p: np.zeros((1, NUMELS[p]), F32),
    ]
    for read in wrong:
        with raises_code(ErrorCode.BAD_TENSOR_LENGTH, LocalProtocolError):
            t.session.answer_pulls(read)
    nan = t.params[0].copy()
    nan[3] = np.nan
    with raises_code(ErrorCode.NON_FINITE_VALUE, LocalProtocolError):
        t.session.answer_pulls(lambda p: nan)
    assert t.session.pending_pull(0) == PullReq(0, 2, 1)
    assert len(t.answer()) == 1


# -- connections ----------------------------------------------------------------------------
def test_reconnect_keeps_anchors_and_drops_pending_pulls() -> None:
    t = connected(WireDtype.BF16)
    theta = globals_for(21)
    t.receive(bcast(t.session, 0, 3, theta[0]))
    t.receive(PullReq(0, 4, 1))
    t.receive(PullReq(2, 5, 1))  # no anchor yet: deferred
    t.session.connection_lost()
    assert t.session.phase is Phase.IDLE
    assert t.session.pending_pull(0) is None and t.session.pending_pull(2) is None
    t.step()
    assert t.answer() == []
    hello = t.session.hello(num_streams=3, generation=77)
    assert (hello.generation, hello.num_streams, hello.learner_id) == (77, 3, 1)
    assert t.session.data_hellos() == [DataHello(1, 77, i) for i in range(3)]
    anchor = t.session.anchor(0)
    assert anchor is not None and anchor.version == 3 and same_bits(anchor.values, theta[0])
    # A pull waits for the syncer's replay of the fragment to this generation: the held anchor
    # could be ahead of a syncer that restarted from an older checkpoint.
    t.receive(PullReq(0, 6, 1))
    assert t.answer() == []
    assert t.receive(bcast(t.session, 0, 3, theta[0])) == []  # the replay: nothing to apply
    (push,) = t.answer()
    assert (push.global_step, push.base_version, push.c_steps) == (6, 3, 1)


def test_a_restarted_syncers_older_state_replaces_the_anchor() -> None:
    """Resumed from a checkpoint older than the held anchor: its replay becomes the anchor."""
    t = connected()
    ahead, behind = globals_for(31), globals_for(32)
    t.receive(bcast(t.session, 0, 5, ahead[0]))
    t.step()
    t.session.connection_lost()
    t.session.hello(num_streams=2, generation=12)
    t.receive(PullReq(0, 4, 1))

    effects = t.receive(bcast(t.session, 0, 3, behind[0]))

    assert [(e.fragment_id, e.version) for e in effects if isinstance(e, ApplyBroadcast)] == [
        (0, 3)
    ]
    anchor = t.session.anchor(0)
    assert anchor is not None and anchor.version == 3 and same_bits(anchor.values, behind[0])
    assert t.answer() == []  # the window restarted with the apply
    t.step()
    (push,) = t.answer()
    assert push.base_version == 3
    np.testing.assert_array_equal(
        decode_push(WireDtype.F32, push.data, NUMELS[0]), t.params[0] - behind[0]
    )
    # After that first replay the anchor moves forward only, as before.
    assert t.receive(bcast(t.session, 0, 2, ahead[0])) == []
    with raises_code(ErrorCode.BCAST_CONFLICT):
        t.receive(bcast(t.session, 0, 3, ahead[0]))


def test_a_redone_version_with_other_bytes_is_taken_only_as_a_connections_first() -> None:
    t = connected()
    first, redone = globals_for(41), globals_for(42)
    t.receive(bcast(t.session, 1, 4, first[1]))
    t.session.connection_lost()
    t.session.hello(num_streams=2, generation=12)

    effects = t.receive(bcast(t.session, 1, 4, redone[1]))

    assert [e.version for e in effects if isinstance(e, ApplyBroadcast)] == [4]
    anchor = t.session.anchor(1)
    assert anchor is not None and same_bits(anchor.values, redone[1])


def test_an_apply_handed_out_before_the_rollback_may_still_be_confirmed() -> None:
    t = connected()
    ahead, behind = globals_for(51), globals_for(52)
    (late,) = deliver(t.session, bcast(t.session, 0, 5, ahead[0]))  # not applied yet
    t.session.connection_lost()
    t.session.hello(num_streams=2, generation=12)
    (rolled_back,) = deliver(t.session, bcast(t.session, 0, 3, behind[0]))
    assert isinstance(late, ApplyBroadcast) and isinstance(rolled_back, ApplyBroadcast)

    t.apply([late])  # confirms version 5: still pending, version 3
    t.receive(PullReq(0, 4, 1))
    t.step()
    assert t.answer() == []
    t.apply([rolled_back])
    t.step()
    (push,) = t.answer()
    assert push.base_version == 3
    with raises_code(ErrorCode.SESSION_MISUSE, LocalProtocolError):
        t.session.broadcast_applied(0, 6)  # never handed out


def test_hello_opens_a_new_group_and_refuses_old_generations() -> None:
    session = make_session(WireDtype.Q4, learner_id=3)
    first = session.hello(num_streams=0)
    assert first.generation != 0 and first.dtype is WireDtype.Q4 and first.layout == LAYOUT
    assert (first.layout_fingerprint, first.session_contract) == (FINGERPRINT, CONTRACT)
    assert session.data_hellos() == []
    with raises_code(ErrorCode.DUPLICATE_GENERATION, LocalProtocolError):
        session.hello(num_streams=1, generation=first.generation)
    with raises_code(ErrorCode.ZERO_GENERATION, LocalProtocolError):
        session.hello(num_streams=1, generation=0)
    assert session.generation == first.generation and session.phase is Phase.CONNECTED
    session.receive(PullReq(0, 1, 1))
    second = session.hello(num_streams=1, generation=first.generation + 1)
    assert session.pending_pull(0) is None  # a new group drops the old one's pulls
    assert second.session_contract == CONTRACT and session.generation == second.generation


def test_receive_needs_a_connection_group() -> None:
    session = make_session()
    with raises_code(ErrorCode.SESSION_MISUSE, LocalProtocolError):
        session.receive(PullReq(0, 1, 1))
    session.hello(1, generation=1)
    session.connection_lost()
    with raises_code(ErrorCode.SESSION_MISUSE, LocalProtocolError):
        session.receive(PullReq(0, 1, 1))


@pytest.mark.parametrize(
    ("message", "code", "kind"),
    [
        (PullReq(3, 1, 1), ErrorCode.BAD_FRAGMENT_ID, RemoteProtocolError),
        (
            BcastFragment(7, 1, memoryview(b"\0" * 4)),
            ErrorCode.BAD_FRAGMENT_ID,
            RemoteProtocolError,
        ),
        (
            BcastFragment(0, 1, memoryview(b"\0" * 4)),
            ErrorCode.BAD_TENSOR_LENGTH,
            RemoteProtocolError,
        ),
        (
            FinalFragment(2, 1, memoryview(b"\0" * 12)),
            ErrorCode.BAD_TENSOR_LENGTH,
            RemoteProtocolError,
        ),
        (FinalManifest(1, (0, 0)), ErrorCode.BAD_MANIFEST, RemoteProtocolError),
        (FinalManifest(4, (0, 5, 0)), ErrorCode.BAD_MANIFEST, RemoteProtocolError),
        (Heartbeat(0, 1), ErrorCode.WRONG_DIRECTION, LocalProtocolError),
        (BudgetDone(3), ErrorCode.WRONG_DIRECTION, LocalProtocolError),
        (Chunk(0, 20, 0, memoryview(b"x")), ErrorCode.SESSION_MISUSE, LocalProtocolError),
    ],
)
def test_messages_the_session_refuses(
    message: AnyMessage, code: ErrorCode, kind: type[Exception]
) -> None:
    session = make_session()
    session.hello(1, generation=3)
    with raises_code(code, kind):
        session.receive(message)  # straight in, as a careless transport would hand it over
    assert session.phase is Phase.FAILED


def test_syncer_error_fails_the_session() -> None:
    t = connected()
    assert t.receive(ErrorMessage("session contract mismatch")) == [
        SyncerFailed("session contract mismatch")
    ]
    assert t.session.phase is Phase.FAILED
    with raises_code(ErrorCode.SYNCER_ERROR):
        t.session.receive(PullReq(0, 1, 1))
    with raises_code(ErrorCode.SYNCER_ERROR):
        t.session.hello(1, generation=99)


def test_heartbeat_carries_identity_and_cumulative_step() -> None:
    t = connected(learner_id=4)
    assert t.session.heartbeat() == Heartbeat(4, 0)
    for _ in range(3):
        t.step()
    assert t.session.heartbeat() == Heartbeat(4, 3)


def test_backoff_doubles_from_one_second_to_thirty() -> None:
    assert [backoff_delay(n) for n in range(8)] == [1, 2, 4, 8, 16, 30, 30, 30]
    with pytest.raises(ValueError):
        backoff_delay(-1)


def test_fresh_generation_is_nonzero_and_unused() -> None:
    draws = iter([0, 5, 1 << 64, 6, 7])
    assert fresh_generation({5}, lambda: next(draws)) == 6  # 0, a used one, and 2^64 ≡ 0 skipped
    assert all(fresh_generation(set()) != 0 for _ in range(100))


# -- INIT -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_learner_zero_initializes_fragments_without_anchor(dtype: WireDtype) -> None:
    t = connected(dtype, learner_id=0)
    t.receive(bcast(t.session, 1, 0, globals_for(1)[1]))  # fragment 1 is already initialized
    inits = t.session.init_messages(t.read)
    assert [m.fragment_id for m in inits] == [0, 2]
    for message in inits:
        decoded = through_wire_syncer(t.session, message)
        assert isinstance(decoded, InitParams)
        expected = t.params[message.fragment_id]
        if dtype is not WireDtype.F32:  # q4 sessions INIT in bf16 too
            expected = bf16_round(expected)
        assert same_bits(decode_bulk(dtype, decoded.data), expected)


def through_wire_syncer(session: LearnerSession, message: AnyMessage) -> AnyMessage:
    decoder = FrameDecoder(Role.SYNCER, limits=session.limits, enforce_first_frame=False)
    decoder.feed(encode_bytes(message))
    (decoded,) = decoder.frames()
    return decoded


def test_a_frozen_learner_zero_does_not_initialize_again_on_a_redial() -> None:
    # A frozen learner lets its anchors go at a disconnect (the restarted syncer's BCASTs are
    # the base of its PUSHes); learner 0 then sent a whole model's INITs on every redial,
    # ahead of its frozen PUSHes, though the syncer held every fragment.
    t = connected(learner_id=0, budget=1)
    for p in range(2):  # fragment 2 never arrived on this connection
        t.receive(bcast(t.session, p, 3, globals_for(5)[p]))
    t.step(tokens=10)
    t.session.budget_done()
    t.session.connection_lost()
    t.session.hello(0, generation=77)
    assert all(t.session.anchor(p) is None for p in range(3))
    assert [m.fragment_id for m in t.session.init_messages(t.read)] == [2]


def test_only_learner_zero_initializes_and_only_finite_values() -> None:
    t = connected(learner_id=2)
    with raises_code(ErrorCode.INIT_NOT_ALLOWED, LocalProtocolError):
        t.session.init_messages(t.read)
    zero = connected(learner_id=0)
    zero.params[2][1] = np.inf
    with raises_code(ErrorCode.NON_FINITE_VALUE, LocalProtocolError):
        zero.session.init_messages(zero.read)


# -- finalization ---------------------------------------------------------------------------
FINAL_STEP = 12
FINAL_VERSIONS = (10, 11, 12)


def final_cut(seed: int = 31) -> list[NDArray[np.float32]]:
    """Authoritative f32 values with bits bf16 cannot carry."""
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(n) + F32(1e-3)).astype(F32) for n in NUMELS]


def final_messages(cut: list[NDArray[np.float32]]) -> list[AnyMessage]:
    frags: list[AnyMessage] = [final(p, v, cut[p]) for p, v in enumerate(FINAL_VERSIONS)]
    return [*frags, FinalManifest(FINAL_STEP, FINAL_VERSIONS)]


@pytest.mark.parametrize("order", list(itertools.permutations(range(4))))
def test_final_apply_waits_for_every_fragment_and_the_manifest(order: tuple[int, ...]) -> None:
    t = connected(WireDtype.BF16)
    cut = final_cut()
    messages = final_messages(cut)
    effects_per_message = []
    for i in order:
        effects_per_message.append(deliver(t.session, messages[i]))
    assert all(e == [] for e in effects_per_message[:-1])
    (apply,) = effects_per_message[-1]
    assert isinstance(apply, ApplyFinal) and apply.final_global_step == FINAL_STEP
    assert all(same_bits(a, b) for a, b in zip(apply.fragments, cut, strict=True))
    # no ACK before the parameters hold the cut; SHUTDOWN now would be premature
    assert t.sent == []
    t.apply([apply])
    assert t.sent == [FinalAck(FINAL_STEP)]
    assert all(same_bits(a, b) for a, b in zip(t.params, cut, strict=True))
    assert t.receive(Shutdown()) == [ShutdownReceived()]
    assert t.session.phase is Phase.SHUT_DOWN
    assert t.receive(bcast(t.session, 0, 13, globals_for(1)[0])) == []  # late data is ignored


def test_final_cache_is_separate_from_broadcasts() -> None:
    """A bf16 BCAST at the manifest's fragment/version neither satisfies nor conflicts."""
    t = connected(WireDtype.BF16)
    cut = final_cut()
    for p, v in enumerate(FINAL_VERSIONS):
        t.receive(bcast(t.session, p, v, bf16_round(cut[p])))
    assert t.receive(FinalManifest(FINAL_STEP, FINAL_VERSIONS)) == []
    for p, v in enumerate(FINAL_VERSIONS[:-1]):
        assert t.receive(final(p, v, cut[p])) == []
    (apply,) = t.receive(final(2, 12, cut[2]))
    assert isinstance(apply, ApplyFinal)
    assert all(same_bits(a, b) for a, b in zip(apply.fragments, cut, strict=True))
    assert not same_bits(apply.fragments[0], bf16_round(cut[0]))
    anchor = t.session.anchor(0)
    assert anchor is not None and same_bits(anchor.values, bf16_round(cut[0]))


def test_final_needs_the_exact_versions() -> None:
    t = connected()
    cut = final_cut()
    t.receive(FinalManifest(FINAL_STEP, FINAL_VERSIONS))
    t.receive(final(0, 10, cut[0]))
    t.receive(final(1, 11, cut[1]))
    assert t.receive(final(2, 9, cut[2])) == []  # an older version does not satisfy 12
    assert t.receive(final(2, 8, cut[2])) == []  # and a lower one is dropped
    fragment = t.session.final_fragment(2)
    assert fragment is not None and fragment.version == 9
    (apply,) = t.receive(final(2, 12, cut[2]))
    assert isinstance(apply, ApplyFinal)
    assert t.receive(final(2, 12, cut[2])) == []  # replay: no second apply


def test_final_conflicts_are_fatal() -> None:
    cut, other = final_cut(1), final_cut(2)
    t = connected()
    t.receive(final(1, 11, cut[1]))
    with raises_code(ErrorCode.FINAL_CONFLICT):
        t.receive(final(1, 11, other[1]))
    t = connected()
    t.receive(FinalManifest(FINAL_STEP, FINAL_VERSIONS))
    with raises_code(ErrorCode.FINAL_CONFLICT):
        t.receive(FinalManifest(FINAL_STEP, (10, 11, 11)))


def test_manifests_only_move_forward() -> None:
    t = connected()
    cut = final_cut()
    newer = (10, 14, 15)
    t.receive(FinalManifest(15, newer))
    t.receive(FinalManifest(FINAL_STEP, FINAL_VERSIONS))  # older: dropped
    manifest = t.session.final_manifest
    assert manifest is not None and manifest.final_global_step == 15
    for message in final_messages(cut)[:-1]:
        assert t.receive(message) == []  # the old cut's versions do not complete the new one
    t.receive(final(1, 14, cut[1]))
    (apply,) = t.receive(final(2, 15, cut[2]))
    assert isinstance(apply, ApplyFinal) and apply.final_global_step == 15
    assert t.sent == [FinalAck(15)]


def test_broadcasts_after_the_final_apply_do_not_blend() -> None:
    t = connected()
    cut = final_cut()
    effects = [e for m in final_messages(cut) for e in deliver(t.session, m)]
    (apply,) = effects
    # a reordered data stream delivers the last ordinary BCAST after the cut went out
    assert deliver(t.session, bcast(t.session, 2, 12, globals_for(1)[2])) == []
    t.apply([apply])
    assert all(same_bits(a, b) for a, b in zip(t.params, cut, strict=True))
    with raises_code(ErrorCode.SESSION_MISUSE, LocalProtocolError):
        t.step()


def test_final_applied_needs_an_apply() -> None:
    t = connected()
    with raises_code(ErrorCode.UNEXPECTED_FINAL_ACK, LocalProtocolError):
        t.session.final_applied(FINAL_STEP)


def finish(t: Trainer) -> None:
    for message in final_messages(final_cut()):
        t.receive(message)


def ack_then_reconnect(t: Trainer) -> None:
    finish(t)
    t.session.connection_lost()
    t.session.hello(1, generation=500)


def nothing_final(t: Trainer) -> None:
    pass


def manifest_only(t: Trainer) -> None:
    t.receive(FinalManifest(FINAL_STEP, FINAL_VERSIONS))


def cut_held_not_applied(t: Trainer) -> None:
    for message in final_messages(final_cut()):
        deliver(t.session, message)  # the ApplyFinal is never carried out


def ack_of_an_older_manifest(t: Trainer) -> None:
    finish(t)
    t.receive(FinalManifest(20, (18, 19, 20)))


SHUTDOWN_CASES: list[tuple[str, Callable[[Trainer], None]]] = [
    ("nothing final", nothing_final),
    ("manifest only", manifest_only),
    ("cut held, not applied", cut_held_not_applied),
    ("ACK sent on the previous generation", ack_then_reconnect),
    ("ACK of an older manifest", ack_of_an_older_manifest),
]


@pytest.mark.parametrize(("name", "setup"), SHUTDOWN_CASES, ids=[c[0] for c in SHUTDOWN_CASES])
def test_shutdown_before_the_ack_of_the_exact_manifest_is_fatal(
    name: str, setup: Callable[[Trainer], None]
) -> None:
    t = connected()
    setup(t)
    with raises_code(ErrorCode.UNEXPECTED_SHUTDOWN):
        t.receive(Shutdown())
    assert t.session.phase is Phase.FAILED


def test_reconnect_after_the_ack_acks_again_without_reapplying() -> None:
    t = connected()
    finish(t)
    assert t.sent == [FinalAck(FINAL_STEP)]
    t.session.connection_lost()
    t.session.hello(2, generation=600)
    per_message = [deliver(t.session, m) for m in final_messages(final_cut())]
    # the replayed fragments change nothing; the manifest on this generation brings the ACK
    assert per_message == [[], [], [], [SendMessage(FinalAck(FINAL_STEP))]]
    assert t.session.final_applied_step == FINAL_STEP
    t.apply(per_message[-1])
    assert t.receive(Shutdown()) == [ShutdownReceived()]


def test_reconnect_while_the_apply_is_pending_acks_on_the_new_generation() -> None:
    t = connected()
    effects = [e for m in final_messages(final_cut()) for e in deliver(t.session, m)]
    (apply,) = effects
    t.session.connection_lost()
    t.session.hello(1, generation=700)
    assert isinstance(apply, ApplyFinal)
    assert t.session.final_applied(apply.final_global_step) is None  # no manifest here yet
    per_message = [deliver(t.session, m) for m in final_messages(final_cut())]
    assert per_message == [[], [], [], [SendMessage(FinalAck(FINAL_STEP))]]


def test_manifest_revision_mismatch_is_fatal_in_the_decoder() -> None:
    session = make_session()
    frame = bytearray(encode_bytes(FinalManifest(FINAL_STEP, FINAL_VERSIONS)))
    assert frame[13:15] == b"\x01\x00"
    frame[13] = 2
    decoder = FrameDecoder(Role.LEARNER, limits=session.limits)
    decoder.feed(bytes(frame))
    with raises_code(ErrorCode.BAD_FINAL_REVISION):
        decoder.frames()
    ack = encode_bytes(FinalAck(FINAL_STEP))
    assert ack[13:15] == b"\x01\x00"  # the learner's ACK carries revision 1


# -- budget (benchmark closure) -------------------------------------------------------------
def test_budget_rules() -> None:
    with raises_code(ErrorCode.BUDGET_NOT_CONFIGURED, LocalProtocolError):
        connected().session.budget_done()
    with raises_code(ErrorCode.FIELD_OUT_OF_RANGE, LocalProtocolError):
        make_session(budget=0)
    t = connected(budget=2)
    t.step()
    with raises_code(ErrorCode.BUDGET_MISMATCH, LocalProtocolError):
        t.session.budget_done()
    t.step()
    with raises_code(ErrorCode.BUDGET_MISMATCH, LocalProtocolError):
        t.step()
    assert t.session.budget_done() == BudgetDone(2)
    assert t.session.frozen
    with raises_code(ErrorCode.DUPLICATE_BUDGET_DONE, LocalProtocolError):
        t.session.budget_done()
    with raises_code(ErrorCode.BUDGET_MISMATCH, LocalProtocolError):
        t.step()


def test_the_connection_carrying_budget_done_gets_no_frozen_push() -> None:
    t = connected(budget=1)
    theta = globals_for(51)
    for p in range(3):
        t.receive(bcast(t.session, p, 1, theta[p]))
    with raises_code(ErrorCode.SESSION_MISUSE, LocalProtocolError):
        t.session.budget_done_resent()  # nothing was reported yet
    t.step()
    t.session.budget_done()
    t.receive(PullReq(0, 2, 1))
    assert t.answer() == []  # the cutoff cancels this connection's rounds
    # The report never reached a socket: it goes out again on the next connection, whose
    # pulls then stay unanswered as well.
    t.session.connection_lost()
    t.session.hello(1, generation=902)
    assert t.session.budget_done_resent() == BudgetDone(1)
    t.receive(bcast(t.session, 0, 1, theta[0]))
    t.receive(PullReq(0, 3, 1))
    assert t.answer() == []
    t.session.connection_lost()  # the restarted syncer: now frozen pushes answer its pulls
    t.session.hello(1, generation=903)
    t.receive(bcast(t.session, 0, 1, theta[0]))
    t.receive(PullReq(0, 4, 1))
    (push,) = t.answer()
    assert (push.global_step, push.c_steps) == (4, 1)


def test_a_pull_whose_round_committed_without_this_learner_waits_for_no_step() -> None:
    # finish(stop_when_stuck=True) gave up on such a pull, although the syncer no longer
    # needs it (a --quorum below the captured learners committed the round without it).
    t = connected()
    for p in range(3):
        t.receive(bcast(t.session, p, 1, globals_for(52)[p]))
    t.receive(PullReq(0, 4, 1))  # no step since fragment 0's BCAST: only a step answers it
    assert t.session.pulls_awaiting_a_step() == [0]
    t.receive(bcast(t.session, 0, 4, globals_for(53)[0]))  # round 4 committed without it
    assert t.session.pulls_awaiting_a_step() == []


def test_no_push_after_the_final_cut_is_applied() -> None:
    t = connected()
    cut = final_cut()
    for p in range(3):
        t.receive(bcast(t.session, p, 1, globals_for(52)[p]))
    t.step()
    for message in final_messages(cut):
        t.receive(message)  # applies the cut and sends the ACK
    assert t.sent == [FinalAck(FINAL_STEP)]
    t.receive(PullReq(0, 9, 1))  # the syncer ended every round before the cut
    assert t.answer() == []
    assert t.session.pulls_awaiting_a_step() == []  # nor does it wait for a step


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_frozen_learner_pushes_frozen_minus_resumed_global(dtype: WireDtype) -> None:
    budget, tokens = 3, [100, 250, 75]
    t = connected(dtype, budget=budget)
    old = globals_for(41, grid=True)
    for p in range(3):
        t.receive(bcast(t.session, p, 4, old[p]))
    t.step(tokens=tokens[0])
    t.receive(bcast(t.session, 1, 5, globals_for(44, grid=True)[1]))  # restarts one window
    for n in tokens[1:]:
        t.step(tokens=n)
    assert t.session.window(1) == (2, sum(tokens[1:]))
    t.receive(PullReq(0, 9, 1))
    assert t.session.budget_done() == BudgetDone(budget)
    assert t.session.pending_pull(0) is None  # the cutoff cancels in-flight rounds
    frozen_local = [x.copy() for x in t.params]

    t.session.connection_lost()  # the cutoff syncer exits
    t.session.hello(1, generation=901)  # the restarted syncer
    assert all(t.session.anchor(p) is None for p in range(3))
    t.receive(PullReq(1, 10, 1))
    assert t.answer() == []  # the pull waits for the resumed state
    resumed = globals_for(42, grid=True)
    deltas = exact_deltas(43)
    t.params = [resumed[p] + deltas[p] for p in range(3)]  # frozen_local, chosen exactly
    frozen_local = [x.copy() for x in t.params]
    effects = t.receive(bcast(t.session, 1, 5, resumed[1]))  # same version, new bytes: no conflict
    assert effects == [AnchorRecorded(1, 5)]
    assert all(same_bits(a, b) for a, b in zip(t.params, frozen_local, strict=True))
    (push,) = t.answer()
    assert (push.local_step, push.c_steps, push.c_tokens) == (budget, budget, sum(tokens))
    assert (push.global_step, push.base_version) == (10, 5)
    assert same_bits(decode_push(dtype, push.data, NUMELS[1]), deltas[1])


def test_the_session_needs_neither_torch_nor_anyio() -> None:
    probe = (
        "import sys, yeto_learn.session; "
        "print(','.join(m for m in ('torch', 'anyio') if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.strip() == ""
