"""Randomized whole-session simulations of the coordinator, checked against spec/syncer.md.

Each seed draws a session (1–4 learners, 1–3 avg or rda fragments of a few f32 values, total
steps 0–12, random quorum, pipeline, grace, pacing, quorum timeout, base lag, learner weight,
delta correction, outer step, checkpointing) and plays it out on a simulated clock that jumps
to the next due timer or learner action, ties broken by the seed. Frames travel in order per
group with random latency, and a frame the learner wrote before dropping its connection still
arrives (from a group that may be closed by then: the coordinator must ignore it).

The learners are protocol-following actors, in three modes:

- NICE: every learner stays connected and answers every PULL in time. The run must reach its
  total steps, cut, collect every FINAL_ACK and exit 0 within :func:`time_bound`.
- SILENT: as NICE, but one learner never answers a PULL and quorum < M: the same must hold.
- CHAOS, until a drawn moment, then NICE: answers late, never or twice, from a stale (or,
  rarely, future) base; drops and redials with a new generation (sequential or random u64), the
  old group lingering up to 30 s (so the 4-group cap closes some); dials abandoned before
  they are ready, their groups becoming ready after the newer one; learner 0 dropping
  mid-INIT and INITing again; drops and repeated ACKs around the final cut; timers fired up to
  0.2 s late. The run must exit in bounded time, 0 unless a FINAL_ACK deadline or an empty cut
  explains the 1.

:class:`Oracle` is an independent model of the spec (registry and supersession, the surplus
cap, step-time estimates, pacing, rounds and attempts, PUSH acceptance rows 4–11, grace,
quorum deadlines and retries, commit order, the global model and ledger, finalization). It
follows every event and checks every action the coordinator returned: admissions and closes,
each BCAST (versions strictly ascending per group and fragment, values bit for bit, never ahead
of its checkpoint), each PULL (members, attempt, never ahead of the BCAST of its launch
version), each verdict and tape line, every merge line (the merge recomputed with numpy from
the accepted PUSHes, bit for bit, for avg with ``--delta-correction none``; through
:func:`yeto_sync.merge.merge_round` on the model's own inputs otherwise), checkpoints and final
state (versions, global step, params, momentum, ledger), the cut, SHUTDOWN and the exit; after
every event the coordinator's versions, arrays and rounds in flight must be the model's.
Launch and grace timing are observed, then checked against the spec's conditions and formulas
(with a 1e-9 s tolerance); a launch must happen when the coordinator re-examines the schedule
(after a group becomes ready, an INIT, a completion or the launch timer) and it is due.
Every schedule is replayed into a fresh coordinator, which must return the same actions.

Not covered here: the budget cutoff (spec/closure.md), bf16 and q4 sessions, iso fragments,
resume, early (streamed) broadcasts, data streams, and learners that break the protocol.

``YETO_SIM_SEEDS=N`` runs N seeds per mode instead of the defaults (a soak run).
"""

from __future__ import annotations

import dataclasses
import enum
import heapq
import itertools
import json
import math
import os
import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from yeto_proto.checkpoint import Checkpoint
from yeto_proto.constants import MergeMode, WireDtype
from yeto_proto.errors import ErrorCode
from yeto_proto.identity import DeltaCorrection, LearnerWeight
from yeto_proto.layout import WireFragment, WireLayout
from yeto_proto.limits import Limits
from yeto_proto.messages import (
    AnyMessage,
    BcastFragment,
    FinalAck,
    FinalFragment,
    FinalManifest,
    Heartbeat,
    Hello,
    InitParams,
    PullReq,
    PushFragment,
    Shutdown,
)
from yeto_sync.config import SyncerConfig
from yeto_sync.coordinator import Coordinator
from yeto_sync.events import (
    Action,
    AdmitGroup,
    AppendTape,
    CancelTimer,
    CloseGroup,
    Event,
    Exit,
    GroupClosed,
    GroupKey,
    GroupReady,
    HelloReceived,
    Log,
    MessageReceived,
    RefuseConnection,
    Send,
    SetTimer,
    TimerFired,
    WriteCheckpoint,
    WriteFinalMarker,
    WriteFinalState,
)
from yeto_sync.merge import MergeConfig, Response, merge_round

F32Array = NDArray[np.float32]

FINGERPRINT = bytes(range(32))
CONTRACT = bytes(range(100, 132))
#: Seconds of simulated time a run may take before it counts as stuck.
TIME_LIMIT_S = 2_000.0
EVENT_LIMIT = 20_000
TOL = 1e-9


class Mode(enum.Enum):
    #: Every learner stays connected and answers every PULL in time.
    NICE = "nice"
    #: As NICE, but one learner (not 0) never answers a PULL; quorum < M.
    SILENT = "silent"
    #: Late, missing, duplicate and stale answers, reconnects, lingering groups; nice later.
    CHAOS = "chaos"


# -- the scenario ---------------------------------------------------------------------------------
@dataclass
class Behaviour:
    step_time: float
    answer_p: float = 1.0
    late_p: float = 0.0
    dup_p: float = 0.0
    stale_p: float = 0.0
    future_p: float = 0.0
    disconnect_p: float = 0.0
    linger_p: float = 0.0
    #: How long an abandoned group may stay open at most before the syncer sees it close.
    linger_s: float = 1.0
    #: Random u64 generations (as spec/learner.md § 1 says), not 1, 2, 3, ….
    random_generations: bool = False
    reinit_p: float = 0.0
    abandon_p: float = 0.0
    #: Drops and repeated ACKs go on through finalization, past ``chaos_until``.
    final_chaos: bool = False
    double_ack_p: float = 0.0
    zero_tokens_p: float = 0.05
    silent: bool = False


@dataclass
class Scenario:
    seed: int
    mode: Mode
    config: SyncerConfig
    layout: WireLayout
    behaviours: list[Behaviour]
    #: Chaos ends here: from then on every learner behaves as in NICE.
    chaos_until: float

    @property
    def exact_numerics(self) -> bool:
        return self.config.delta_correction is DeltaCorrection.NONE and all(
            f.merge_mode is MergeMode.AVG for f in self.layout.fragments
        )


def make_scenario(seed: int, mode: Mode) -> Scenario:
    rng = random.Random(seed * 7919 + list(Mode).index(mode))
    learners = rng.randint(2, 4) if mode is Mode.SILENT else rng.randint(1, 4)
    num_fragments = rng.randint(1, 3)
    modes = [MergeMode.AVG] * 3 + [MergeMode.RDA]
    layout = WireLayout(
        tuple(
            WireFragment(
                rng.choice(modes),
                tuple(rng.randint(1, 4) for _ in range(rng.randint(1, 2))),
            )
            for _ in range(num_fragments)
        )
    )
    quorum = rng.randint(1, learners - 1) if mode is Mode.SILENT else rng.randint(1, learners + 1)
    checkpointing = rng.random() < 0.7
    config = SyncerConfig(
        learners=learners,
        total_steps=rng.choice([0, 1, 2] + list(range(3, 13)) * 3),
        quorum=quorum,
        grace_ms=rng.choice([0, 0, 100, 500, 1000]),
        grace_gamma=rng.choice([0.8, 0.5, 1.0]),
        grace_tau=rng.choice([2.0, 1.0, 4.0]),
        pipeline=rng.randint(0, 4),
        min_round_interval_ms=rng.choice([0, 0, 0, 50, 300]),
        sync_interval_steps=rng.choice([24.0, 4.0, 0.0, 1.5]),
        delta_correction=rng.choice([DeltaCorrection.NONE] * 3 + [DeltaCorrection.HELOCO]),
        quorum_timeout_s=rng.choice([1, 2, 3, 5]),
        final_ack_timeout_s=rng.choice([None, 1, 2, 5]),
        outer_lr=rng.choice([0.7, 0.5, 1.0, 0.35]),
        outer_momentum=rng.choice([0.9, 0.0, 0.5]),
        checkpoint_path=Path("sim.ckpt") if checkpointing else None,
        checkpoint_every=rng.randint(1, 4),
        mark_final_checkpoint=checkpointing and rng.random() < 0.5,
        final_state=Path("sim.final") if rng.random() < 0.3 else None,
        max_base_lag=rng.choice([None, None, 0, 1, 3]),
        learner_weight=rng.choice([LearnerWeight.TOKENS2_OVER_STEPS, LearnerWeight.EQUAL]),
    )
    behaviours = []
    for learner in range(learners):
        behaviour = Behaviour(step_time=rng.uniform(0.002, 0.05))
        if mode is Mode.CHAOS:
            behaviour.answer_p = rng.choice([1.0, 0.9, 0.7])
            behaviour.late_p = rng.choice([0.0, 0.1, 0.3])
            behaviour.dup_p = rng.choice([0.0, 0.1, 0.3])
            behaviour.stale_p = rng.choice([0.0, 0.2, 0.5])
            behaviour.future_p = rng.choice([0.0, 0.0, 0.05])
            behaviour.disconnect_p = rng.choice([0.0, 0.1, 0.25, 0.5])
            behaviour.linger_p = rng.choice([0.0, 0.5, 0.9])
            behaviour.linger_s = rng.choice([1.0, 4.0, 30.0])
            behaviour.random_generations = rng.random() < 0.5
            behaviour.reinit_p = 0.5 if learner == 0 else 0.0
            behaviour.abandon_p = rng.choice([0.0, 0.0, 0.2])
            behaviour.final_chaos = rng.random() < 0.5
            behaviour.double_ack_p = rng.choice([0.0, 0.3, 0.6])
        behaviours.append(behaviour)
    if mode is Mode.SILENT:
        behaviours[rng.randint(1, learners - 1)].silent = True
    return Scenario(seed, mode, config, layout, behaviours, rng.uniform(5.0, 60.0))


# -- canonical actions (determinism, payload immutability) ----------------------------------------
def canon(value: Any) -> Any:
    """A comparable, copied form of an action: buffers as bytes, floats by repr."""
    if isinstance(value, memoryview | bytes | bytearray):
        return bytes(value)
    if isinstance(value, np.ndarray):
        return ("ndarray", value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, enum.Enum):
        return (type(value).__name__, value.name)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, Path):
        return str(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (
            type(value).__name__,
            tuple((f.name, canon(getattr(value, f.name))) for f in dataclasses.fields(value)),
        )
    if isinstance(value, dict):
        return tuple(sorted((canon(k), canon(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return tuple(canon(v) for v in value)
    return value


# -- numerics (spec/syncer.md § 7) ----------------------------------------------------------------
def weight_of(config: SyncerConfig, c_steps: int, c_tokens: int) -> float:
    if config.learner_weight is LearnerWeight.EQUAL:
        return 1.0
    return float(c_tokens) * float(c_tokens) / float(c_steps)


def spec_avg_none_step(
    config: SyncerConfig,
    params: F32Array,
    momentum: F32Array,
    pushes: list[tuple[int, int, F32Array]],
) -> tuple[F32Array, F32Array, float]:
    """avg merge without correction, then the f32 Nesterov step, written from the spec text.

    ``pushes``: (c_steps, c_tokens, d) in merge order. Returns (Θ', buf', ‖Δ‖).
    """
    weights = [weight_of(config, s, t) for s, t, _ in pushes]
    total = 0.0
    for w in weights:  # S = Σ w_m, left to right in f64
        total += w
    delta = np.zeros(params.size, dtype=np.float32)  # +0.0
    if total > 0:
        for w, (_, _, d) in zip(weights, pushes, strict=True):
            grad = np.negative(d)  # Δ_m = −d_m, exactly once
            c = np.float32(w / total)
            delta = (delta + (c * grad).astype(np.float32)).astype(np.float32)
    mu = np.float32(config.outer_momentum)
    lr = np.float32(config.outer_lr)
    buf = ((mu * momentum).astype(np.float32) + delta).astype(np.float32)
    inner = ((mu * buf).astype(np.float32) + delta).astype(np.float32)
    theta = (params - (lr * inner).astype(np.float32)).astype(np.float32)
    return theta, buf, math.sqrt(float(np.sum(delta.astype(np.float64) ** 2)))


# -- the independent model ------------------------------------------------------------------------
@dataclass
class OGroup:
    key: GroupKey
    seq: int
    ready: bool = False
    #: fragment → last BCAST version sent (observed, checked against the expectation).
    bcast: dict[int, int] = field(default_factory=dict)
    #: fragment → the version the spec says it has been queued.
    owed: dict[int, int] = field(default_factory=dict)


@dataclass
class OPush:
    push: PushFragment
    values: F32Array
    at: float


@dataclass
class ORound:
    step: int
    fragment: int
    attempt: int
    members: tuple[GroupKey, ...]
    quorum: int
    launched_at: float
    launch_version: int
    phase: str = "gathering"
    accepted: dict[GroupKey, OPush] = field(default_factory=dict)
    quorum_at: float | None = None
    grace: float | None = None
    completed_at: float | None = None


@dataclass
class OFinal:
    step: int
    versions: tuple[int, ...]
    frozen: frozenset[int]
    queued: set[GroupKey] = field(default_factory=set)
    acked: set[GroupKey] = field(default_factory=set)


class SimFailure(AssertionError):
    pass


def check(condition: bool, message: str) -> None:
    if not condition:
        raise SimFailure(message)


class Oracle:
    """spec/syncer.md, written again: follows each event and checks the coordinator's actions."""

    def __init__(self, scenario: Scenario) -> None:
        self.s = scenario
        self.config = scenario.config
        self.layout = scenario.layout
        self.limits = Limits.of(WireDtype.F32, scenario.layout)
        self.F = len(scenario.layout.fragments)
        self.groups: dict[GroupKey, OGroup] = {}
        self.admitted: set[GroupKey] = set()
        self.current: dict[int, GroupKey] = {}
        self.seq = itertools.count(1)
        # step-time estimates: id → [local_step, at, estimate]
        self.clocks: dict[int, list[Any]] = {}
        self.params: list[F32Array | None] = [None] * self.F
        self.momentum: list[F32Array | None] = [None] * self.F
        self.versions = [0] * self.F
        self.ledger: dict[int, tuple[int, int, int]] = {}
        self.global_step = 0
        self.started = False
        self.next_step = 1
        self.rounds: dict[int, ORound] = {}
        self.last_launch: float | None = None
        #: When the launch timer will fire for a round waiting for its pacing interval: while
        #: one waits, every change of the estimates or of the connected learners re-checks it.
        self.launch_timer: float | None = None
        self.last_sync = 0.0
        self.final: OFinal | None = None
        self.exit: Exit | None = None
        # statistics, for the coverage assertions
        self.stats: dict[str, int] = {}
        #: (fragment, version) → its params' f32 bytes; global_step → the whole state then.
        self.history: dict[tuple[int, int], bytes] = {}
        self.snapshots: dict[int, tuple[Any, ...]] = {}
        #: global steps of the checkpoints written so far
        self.durable: set[int] = set()
        self.commits: list[int] = []

    # -- small helpers ---------------------------------------------------------------------
    def bump(self, name: str, by: int = 1) -> None:
        self.stats[name] = self.stats.get(name, 0) + by

    def current_members(self) -> tuple[GroupKey, ...]:
        return tuple(sorted(self.current.values()))

    def observe(self, learner_id: int, local_step: int, now: float) -> None:
        clock = self.clocks.get(learner_id)
        if clock is None:
            self.clocks[learner_id] = [local_step, now, None]
            return
        if local_step < clock[0]:
            clock[0], clock[1] = local_step, now
            return
        if local_step == clock[0]:
            return
        sample = max(now - clock[1], 0.0) / (local_step - clock[0])
        clock[2] = sample if clock[2] is None else 0.5 * sample + 0.5 * clock[2]
        clock[0], clock[1] = local_step, now

    def slowest(self, ids: Iterable[int]) -> float | None:
        known = [self.clocks[i][2] for i in ids if i in self.clocks]
        known = [e for e in known if e is not None]
        return max(known) if known else None

    def interval(self) -> float:
        floor = self.config.min_round_interval_ms / 1000.0
        slowest = self.slowest(k.learner_id for k in self.current_members())
        if slowest is None:
            return floor
        return max(floor, self.config.sync_interval_steps * slowest / self.F)

    def expected_grace(self, target: ORound, now: float) -> float:
        cap = self.config.grace_ms / 1000.0
        slowest = self.slowest(m.learner_id for m in target.members)
        if slowest is None:
            return cap
        quorum_s = now - target.launched_at
        adaptive = self.config.grace_gamma * (
            self.config.grace_tau * slowest - quorum_s - self.last_sync
        )
        return min(cap, max(0.0, adaptive))

    def expect_bcast(self, key: GroupKey, fragment: int) -> None:
        """Queue the fragment's current version to a group, at most once per version."""
        group = self.groups[key]
        version = self.versions[fragment]
        if group.owed.get(fragment) != version:
            group.owed[fragment] = version
            self.exp_bcast.append((key, fragment, version))

    @property
    def depth(self) -> int:
        return min(max(self.config.pipeline, 1), self.F)

    # -- one event -------------------------------------------------------------------------
    def handle(self, event: Event, now: float, actions: list[Action]) -> None:
        if self.exit is not None:
            check(not actions, f"actions after exit: {actions}")
            return
        self.now = now
        self.actions = actions
        self.exp_bcast: list[tuple[GroupKey, int, int]] = []
        self.exp_tape: list[dict[str, Any]] = []
        self.exp_closes: list[GroupKey] = []
        self.exp_ckpts: list[tuple[str, int]] = []
        self.exp_final_sends: list[tuple[GroupKey, Any]] = []
        self.exp_pulls: list[tuple[GroupKey, tuple[int, int, int]]] = []
        self.exp_exit: int | None = None
        self.exp_timers: dict[str, float] = {}
        self.well_formed(actions)
        self.observed_pulls = [
            (a.group, (a.message.fragment_id, a.message.global_step, a.message.round_attempt))
            for a in actions
            if isinstance(a, Send) and isinstance(a.message, PullReq)
        ]
        self.timer_sets = {a.key: a.at for a in actions if isinstance(a, SetTimer)}
        if event == TimerFired("launch"):
            self.launch_timer = None
        match event:
            case HelloReceived(conn=conn, hello=hello):
                self.on_hello(conn, hello)
            case GroupReady(group=key):
                self.on_ready(key)
            case GroupClosed(group=key):
                self.on_closed(key)
            case MessageReceived(group=key, message=message):
                self.on_message(key, message)
            case TimerFired(key=key):
                self.on_timer(key)
        self.verify(event)

    def on_hello(self, conn: int, hello: Hello) -> None:
        key = GroupKey(hello.learner_id, hello.generation)
        check(key not in self.admitted, f"simulation reused {key}")
        self.admitted.add(key)
        self.groups[key] = OGroup(key, next(self.seq))
        self.expect_admit = (conn, key)
        mine = sorted(
            (g for g in self.groups.values() if g.key.learner_id == key.learner_id),
            key=lambda g: g.seq,
        )
        surplus = len(mine) - 4
        for group in mine:
            if surplus <= 0:
                break
            if group.key == self.current.get(key.learner_id):
                continue
            self.exp_closes.append(group.key)
            self.bump("surplus_closed")
            self.remove(group.key)
            surplus -= 1

    def remove(self, key: GroupKey) -> bool:
        del self.groups[key]
        if self.current.get(key.learner_id) == key:
            del self.current[key.learner_id]
            return True
        return False

    def on_ready(self, key: GroupKey) -> None:
        group = self.groups.get(key)
        if group is None or group.ready:
            return
        group.ready = True
        previous = self.current.get(key.learner_id)
        if previous is None or self.groups[previous].seq < group.seq:
            self.current[key.learner_id] = key
        for fragment in range(self.F):
            if self.params[fragment] is not None:
                self.expect_bcast(key, fragment)
        final = self.final
        if final is not None and key.learner_id in final.frozen and key not in final.queued:
            self.queue_cut(key)
            self.bump("cut_requeued")
        self.advance()

    def on_closed(self, key: GroupKey) -> None:
        if key not in self.groups:
            return
        if self.remove(key):
            if self.final is not None:
                self.bump("closed_after_cut")
            self.finish_if_delivered()
            self.recheck_pacing()  # the slowest learner may have left

    def on_message(self, key: GroupKey, message: AnyMessage) -> None:
        if key not in self.groups:
            check(not self.actions, f"a forgotten group {key} caused {self.actions}")
            return
        match message:
            case InitParams(fragment_id=fragment, data=data):
                check(key.learner_id == 0, "only learner 0 INITs in this simulation")
                if self.params[fragment] is not None:
                    self.bump("init_ignored")
                    return
                self.params[fragment] = np.frombuffer(bytes(data), "<f4").astype(np.float32)
                self.history[(fragment, 0)] = bytes(data)
                self.momentum[fragment] = np.zeros(self.layout.fragments[fragment].numel, "f4")
                self.advance()
            case Heartbeat(local_step=local_step):
                if self.current.get(key.learner_id) == key:
                    self.observe(key.learner_id, local_step, self.now)
                    self.recheck_pacing()
            case PushFragment():
                self.on_push(key, message)
            case FinalAck():
                self.on_ack(key, message)
            case _:
                raise SimFailure(f"the simulation sent {message}")

    def verdict(self, key: GroupKey, push: PushFragment) -> ErrorCode | None:
        target = self.rounds.get(push.global_step)
        if target is None:
            return ErrorCode.PUSH_OUT_OF_ROUND
        if target.phase == "complete" or push.fragment_id != target.fragment:
            return ErrorCode.PUSH_OUT_OF_ROUND
        if target.phase == "waiting" or push.round_attempt != target.attempt:
            return ErrorCode.PUSH_WRONG_ATTEMPT
        if key not in target.members:
            return ErrorCode.PUSH_WRONG_GENERATION
        if key in target.accepted:
            return ErrorCode.PUSH_DUPLICATE
        if push.base_version > target.launch_version:
            return ErrorCode.PUSH_FUTURE_BASE
        lag = self.config.max_base_lag
        if lag is not None and target.launch_version - push.base_version > lag:
            return ErrorCode.PUSH_TOO_STALE
        return None

    def on_push(self, key: GroupKey, push: PushFragment) -> None:
        if self.current.get(key.learner_id) == key:
            self.observe(key.learner_id, push.local_step, self.now)
            self.recheck_pacing()
        code = self.verdict(key, push)
        if code is not None:
            self.bump(f"rejected:{code.value}")
            self.exp_tape.append(
                {
                    "event": "push_rejected",
                    "code": code.value,
                    "id": key.learner_id,
                    "generation": key.generation,
                    "step": push.global_step,
                    "fragment": push.fragment_id,
                    "attempt": push.round_attempt,
                    "base_version": push.base_version,
                    "local_step": push.local_step,
                }
            )
            return
        self.bump("accepted")
        if self.current.get(key.learner_id) != key:
            self.bump("accepted_superseded")
        if push.base_version < self.rounds[push.global_step].launch_version:
            self.bump("accepted_stale")
        target = self.rounds[push.global_step]
        values = np.frombuffer(bytes(push.data), "<f4").astype(np.float32)
        target.accepted[key] = OPush(push, values, self.now)
        if target.quorum_at is None and len(target.accepted) >= target.quorum:
            target.quorum_at = self.now
        if len(target.accepted) == len(target.members):
            self.complete(target)
        elif len(target.accepted) >= target.quorum and target.grace is None:
            expected = self.expected_grace(target, self.now)
            timer = f"grace:{target.step}:{target.attempt}"
            if timer in self.timer_sets:
                target.grace = self.timer_sets[timer] - self.now
                check(target.grace > 0, f"grace timer {timer} in the past")
                self.exp_timers[timer] = self.timer_sets[timer]
                self.bump("grace_opened")
            else:
                target.grace = 0.0
            check(
                abs(target.grace - expected) <= TOL,
                f"round {target.step}: grace {target.grace}, the spec gives {expected}",
            )
            if target.grace <= 0.0:
                self.complete(target)
            else:
                return
        else:
            return
        self.advance()

    def complete(self, target: ORound) -> None:
        target.phase = "complete"
        target.completed_at = self.now

    def discard(self, target: ORound) -> None:
        self.bump("discarded")
        self.exp_tape.append(
            {
                "event": "attempt_discarded",
                "step": target.step,
                "fragment": target.fragment,
                "attempt": target.attempt,
                "quorum": target.quorum,
                "expected_members": members_json(target.members),
                "responded_members": members_json(target.accepted),
            }
        )
        target.phase = "waiting"
        target.accepted = {}
        target.quorum_at = None
        target.grace = None
        self.retry(target, waited=False)

    def retry(self, target: ORound, *, waited: bool) -> None:
        members = self.current_members()
        if not members or (len(members) < target.quorum and not waited):
            self.exp_timers[f"retry:{target.step}"] = self.now + 1.0
            self.bump("retry_waited")
            return
        self.bump("retried")
        target.attempt += 1
        target.members = members
        target.quorum = min(self.config.quorum, len(members))
        target.launched_at = self.now
        target.launch_version = self.versions[target.fragment]
        target.phase = "gathering"
        target.accepted = {}
        target.quorum_at = target.grace = None
        self.issue_pulls(target)

    def issue_pulls(self, target: ORound) -> None:
        for member in target.members:
            self.exp_pulls.append((member, (target.fragment, target.step, target.attempt)))
        self.exp_timers[f"quorum:{target.step}:{target.attempt}"] = (
            self.now + self.config.quorum_timeout_s
        )

    def on_ack(self, key: GroupKey, ack: FinalAck) -> None:
        final = self.final
        check(final is not None, "the simulation ACKed before the cut")
        assert final is not None
        check(key in final.queued and ack.final_global_step == final.step, "bad ACK sent")
        if key in final.acked:
            self.bump("ack_repeated")
            return
        final.acked.add(key)
        self.finish_if_delivered()

    def awaited(self) -> list[GroupKey]:
        final = self.final
        assert final is not None
        return [
            k for k in final.queued if k not in final.acked and self.current.get(k.learner_id) == k
        ]

    def pending(self) -> set[int]:
        final = self.final
        assert final is not None
        return set(final.frozen) - {k.learner_id for k in final.acked}

    def finish_if_delivered(self) -> None:
        if self.final is None or self.pending():
            return
        if self.awaited():
            self.bump("reack_awaited")
            return
        self.finalized()

    def finalized(self) -> None:
        final = self.final
        assert final is not None
        for key in sorted(final.acked):
            if key in self.groups:
                self.exp_final_sends.append((key, Shutdown()))
        self.exp_exit = 0

    def on_timer(self, key: str) -> None:
        kind, _, rest = key.partition(":")
        if kind == "launch":
            self.advance()
            return
        if kind == "final-ack":
            if self.final is None:
                return
            if not self.pending():
                self.finalized()
                return
            for group in sorted(self.final.acked):
                if group in self.groups:
                    self.exp_final_sends.append((group, Shutdown()))
            self.exp_exit = 1
            return
        numbers = [int(p) for p in rest.split(":")]
        target = self.rounds.get(numbers[0])
        if target is None:
            return
        if kind == "retry" and target.phase == "waiting":
            self.retry(target, waited=True)
        elif len(numbers) == 2 and numbers[1] == target.attempt and target.phase == "gathering":
            if kind == "grace" and len(target.accepted) >= target.quorum:
                self.complete(target)
                self.advance()
            elif kind == "quorum" and len(target.accepted) < target.quorum:
                self.discard(target)

    # -- commit, start, launch, final cut --------------------------------------------------
    def advance(self) -> None:
        while self.rounds:
            step = min(self.rounds)
            head = self.rounds[step]
            if head.phase != "complete":
                break
            self.commit(head)
            del self.rounds[step]
        if not self.started and all(p is not None for p in self.params):
            if len(self.current) == self.config.learners:
                self.started = True
                for fragment in range(self.F):
                    for member in self.current_members():
                        self.expect_bcast(member, fragment)
        self.launch()
        self.maybe_finalize()

    def commit(self, done: ORound) -> None:
        p = done.fragment
        params, momentum = self.params[p], self.momentum[p]
        assert params is not None and momentum is not None
        order = sorted(done.accepted)
        pushes = [done.accepted[k] for k in order]
        geometry = self.layout.fragments[p]
        if self.s.exact_numerics:
            theta, buf, gnorm = spec_avg_none_step(
                self.config,
                params,
                momentum,
                [(o.push.c_steps, o.push.c_tokens, o.values) for o in pushes],
            )
        else:  # the coordinator's own merge: checks what it is fed, not the math
            merged = merge_round(
                geometry,
                [
                    Response(k.learner_id, k.generation, o.push.c_steps, o.push.c_tokens, o.values)
                    for k, o in zip(order, pushes, strict=True)
                ],
                params.copy(),
                momentum.copy(),
                self.ledger,
                MergeConfig(
                    self.config.learner_weight,
                    self.config.delta_correction,
                    self.config.outer_lr,
                    self.config.outer_momentum,
                ),
            )
            theta, buf, gnorm = merged.params.copy(), merged.momentum.copy(), merged.gnorm
        for o in pushes:
            merges, steps, tokens = self.ledger.get(o.push.learner_id, (0, 0, 0))
            self.ledger[o.push.learner_id] = (
                merges + 1,
                steps + o.push.c_steps,
                tokens + o.push.c_tokens,
            )
        self.params[p], self.momentum[p] = theta, buf
        self.versions[p] = done.step
        self.global_step = done.step
        self.history[(p, done.step)] = self.f32_bytes(p)
        self.snapshots[done.step] = self.snapshot()
        assert done.completed_at is not None
        sync_s = max(self.now - done.completed_at, 0.0)
        self.last_sync = sync_s
        self.commits.append(done.step)
        self.bump("commits")
        if (
            self.config.checkpoint_path is not None
            and done.step % self.config.checkpoint_every == 0
        ):
            self.exp_ckpts.append(("commit", done.step))
        for member in self.current_members():
            self.expect_bcast(member, p)
        responders = []
        for key, o in zip(order, pushes, strict=True):
            responders.append(
                {
                    "id": key.learner_id,
                    "generation": key.generation,
                    "base_version": o.push.base_version,
                    "staleness": done.launch_version - o.push.base_version,
                    "c_steps": o.push.c_steps,
                    "c_tokens": o.push.c_tokens,
                    "weight": weight_of(self.config, o.push.c_steps, o.push.c_tokens),
                }
            )
        assert done.quorum_at is not None
        self.exp_tape.append(
            {
                "protocol_version": 4,
                "delta_semantics": "local_minus_raw_anchor",
                "step": done.step,
                "fragment": p,
                "attempt": done.attempt,
                "merge_mode": geometry.merge_mode.name.lower(),
                "launch_base_version": done.launch_version,
                "version": done.step,
                "expected_members": members_json(done.members),
                "responded_members": members_json(done.accepted),
                "missed_members": members_json(m for m in done.members if m not in done.accepted),
                "quorum": done.quorum,
                "quorum_ms": round((done.quorum_at - done.launched_at) * 1000.0, 3),
                "grace_ms": round((done.grace or 0.0) * 1000.0, 3),
                "sync_ms": round(sync_s * 1000.0, 3),
                "gnorm": gnorm,
                "responders": responders,
            }
        )

    def recheck_pacing(self) -> None:
        if self.launch_timer is not None:
            launched = self.next_step
            self.launch()
            if self.next_step > launched:
                self.bump("launched_on_recheck")

    def launch_blocker(self) -> str | None:
        """Why no round may launch now (spec § 3), or None."""
        if not self.started or self.final is not None:
            return "not running"
        if self.next_step > self.config.total_steps:
            return "no step left"
        if len(self.rounds) >= self.depth:
            return "pipeline full"
        if not self.current:
            return "nobody connected"
        if self.last_launch is not None:
            due = self.last_launch + self.interval()
            if self.now < due - TOL:
                return f"paced until {due}"
            if self.now < due + TOL:
                return "ambiguous"
        return None

    def launch(self) -> None:
        launched = sorted(
            {
                (step, p)
                for _, (p, step, a) in self.observed_pulls
                if a == 1 and step >= self.next_step
            }
        )
        for step, fragment in launched:
            blocker = self.launch_blocker()
            check(blocker in (None, "ambiguous"), f"round {step} launched while {blocker}")
            check(step == self.next_step, f"launched round {step}, expected {self.next_step}")
            check(fragment == (step - 1) % self.F, f"round {step} targets fragment {fragment}")
            members = self.current_members()
            target = ORound(
                step=step,
                fragment=fragment,
                attempt=1,
                members=members,
                quorum=min(self.config.quorum, len(members)),
                launched_at=self.now,
                launch_version=self.versions[fragment],
            )
            self.rounds[step] = target
            self.next_step += 1
            self.last_launch = self.now
            self.launch_timer = None
            self.bump("launched")
            self.issue_pulls(target)
        blocker = self.launch_blocker()
        check(blocker is not None, f"a round is due at {self.now} and did not launch")
        assert blocker is not None
        if blocker.startswith("paced") and self.last_launch is not None:
            self.exp_timers["launch"] = self.last_launch + self.interval()

    def maybe_finalize(self) -> None:
        if self.final is not None or not self.started:
            return
        if self.next_step <= self.config.total_steps or self.rounds:
            return
        frozen = frozenset(self.current)
        self.final = OFinal(self.global_step, tuple(self.versions), frozen)
        self.snapshots[self.global_step] = self.snapshot()
        if self.config.checkpoint_path is not None:
            self.exp_ckpts.append(("final", self.global_step))
            if self.config.mark_final_checkpoint:
                self.exp_ckpts.append(("marker", self.global_step))
        if self.config.final_state is not None:
            self.exp_ckpts.append(("final_state", self.global_step))
        self.exp_tape.append(
            {
                "event": "final_cut",
                "step": self.global_step,
                "versions": list(self.versions),
                "frozen_learners": sorted(frozen),
            }
        )
        if not frozen:
            self.exp_exit = 1
            return
        for member in self.current_members():
            self.queue_cut(member)
        self.exp_timers["final-ack"] = self.now + self.config.final_ack_timeout

    def queue_cut(self, key: GroupKey) -> None:
        final = self.final
        assert final is not None
        final.queued.add(key)
        for fragment in range(self.F):
            self.exp_final_sends.append((key, ("final", fragment, self.versions[fragment])))
        self.exp_final_sends.append((key, FinalManifest(final.step, final.versions)))

    # -- checking the actions --------------------------------------------------------------
    def well_formed(self, actions: list[Action]) -> None:
        for index, action in enumerate(actions):
            check(
                isinstance(
                    action,
                    AdmitGroup
                    | RefuseConnection
                    | Send
                    | CloseGroup
                    | WriteCheckpoint
                    | WriteFinalMarker
                    | WriteFinalState
                    | AppendTape
                    | Log
                    | SetTimer
                    | CancelTimer
                    | Exit,
                ),
                f"not an action: {action!r}",
            )
            match action:
                case Send(message=message, progress=progress):
                    check(progress is None, "an early send without early_sends")
                    check(
                        isinstance(
                            message,
                            PullReq | BcastFragment | FinalFragment | FinalManifest | Shutdown,
                        ),
                        f"the syncer may not send {message!r}",
                    )
                case SetTimer(key=key, at=at):
                    check(isinstance(key, str) and math.isfinite(at), f"bad timer {action}")
                    check(at >= self.now - TOL, f"timer {key} set in the past: {at} < {self.now}")
                case AppendTape(record=record):
                    json.dumps(record, allow_nan=False)
                case Log(level=level):
                    check(level in ("debug", "info", "warning", "error"), f"log level {level}")
                case Exit(code=code):
                    check(code in (0, 1), f"exit code {code}")
                    check(index == len(actions) - 1, "Exit is not the last action")
                case _:
                    pass

    def verify(self, event: Event) -> None:
        actions = self.actions
        # admissions, refusals, closes
        admits = [a for a in actions if isinstance(a, AdmitGroup)]
        if isinstance(event, HelloReceived):
            conn, key = self.expect_admit
            check(
                admits == [AdmitGroup(conn, key, 0, self.limits)], f"admission of {key}: {admits}"
            )
        else:
            check(not admits, f"admitted without a HELLO: {admits}")
        check(not any(isinstance(a, RefuseConnection) for a in actions), "a HELLO was refused")
        closes = [a for a in actions if isinstance(a, CloseGroup)]
        check(
            closes == [CloseGroup(k, None) for k in self.exp_closes],
            f"closes {closes}, expected {self.exp_closes}",
        )
        # sends: BCAST (as a multiset, then its order rules), PULL, the cut, SHUTDOWN
        self.check_sends()
        # tape
        tape = [a.record for a in actions if isinstance(a, AppendTape)]
        check(
            len(tape) == len(self.exp_tape),
            f"tape {[r.get('event', r.get('step')) for r in tape]}, expected "
            f"{[r.get('event', r.get('step')) for r in self.exp_tape]}",
        )
        for got, want in zip(tape, self.exp_tape, strict=True):
            self.check_record(got, want)
        # checkpoints
        self.check_writes()
        # timers this event must have set
        for key, at in self.exp_timers.items():
            if key == "launch" and key not in self.timer_sets and self.launch_timer is not None:
                # Already waiting for that moment: the coordinator does not set it again.
                check(
                    abs(self.launch_timer - at) <= TOL,
                    f"launch timer at {self.launch_timer}, expected {at}",
                )
                continue
            check(key in self.timer_sets, f"timer {key} not set (expected at {at})")
            check(
                abs(self.timer_sets[key] - at) <= TOL,
                f"timer {key} at {self.timer_sets[key]}, expected {at}",
            )
        if "launch" in self.timer_sets:
            self.launch_timer = self.timer_sets["launch"]
        if CancelTimer("launch") in actions:
            self.launch_timer = None
        # exit
        exits = [a for a in actions if isinstance(a, Exit)]
        if self.exp_exit is None:
            check(not exits, f"unexpected {exits}")
        else:
            check(
                len(exits) == 1 and exits[0].code == self.exp_exit,
                f"expected exit {self.exp_exit}, got {exits}",
            )
            self.exit = exits[0]

    def check_sends(self) -> None:
        sends = [a for a in self.actions if isinstance(a, Send)]
        bcasts = [
            (a.group, a.message.fragment_id, a.message.version)
            for a in sends
            if isinstance(a.message, BcastFragment)
        ]
        check(
            sorted(bcasts) == sorted(self.exp_bcast),
            f"BCASTs {sorted(bcasts)}, expected {sorted(self.exp_bcast)}",
        )
        check(
            sorted(self.observed_pulls) == sorted(self.exp_pulls),
            f"PULLs {sorted(self.observed_pulls)}, expected {sorted(self.exp_pulls)}",
        )
        finals = [
            (
                a.group,
                ("final", a.message.fragment_id, a.message.version)
                if isinstance(a.message, FinalFragment)
                else a.message,
            )
            for a in sends
            if isinstance(a.message, FinalFragment | FinalManifest | Shutdown)
        ]
        # per group in order (the spec orders a group's cut, not the groups)
        check(
            sorted(finals, key=lambda f: f[0]) == sorted(self.exp_final_sends, key=lambda f: f[0]),
            f"cut {finals}, expected {self.exp_final_sends}",
        )
        # the order: checkpoint before its commit's BCAST, BCASTs ascending per group, a PULL
        # never ahead of its launch version's BCAST, the cut's values the committed ones.
        for action in self.actions:
            if isinstance(action, WriteCheckpoint):
                self.durable.add(action.state.global_step)
            if not isinstance(action, Send):
                continue
            message = action.message
            group = self.groups.get(action.group)
            check(group is not None and group.ready, f"send to a group not ready: {action.group}")
            assert group is not None
            if isinstance(message, BcastFragment):
                p, v = message.fragment_id, message.version
                held = group.bcast.get(p)
                check(held is None or v > held, f"BCAST {p}@{v} to {group.key} after @{held}")
                group.bcast[p] = v
                check(bytes(message.data) == self.history.get((p, v)), f"BCAST {p}@{v}: values")
                if self.due_checkpoint(v):
                    check(v in self.durable, f"BCAST of step {v} before its checkpoint")
            elif isinstance(message, PullReq):
                target = self.rounds.get(message.global_step)
                check(target is not None, f"PULL for a round not in flight: {message}")
                assert target is not None
                check(
                    group.bcast.get(message.fragment_id) == target.launch_version,
                    f"PULL {message} to {group.key} ahead of BCAST @{target.launch_version}",
                )
            elif isinstance(message, FinalFragment):
                p = message.fragment_id
                check(bytes(message.data) == self.f32_bytes(p), f"FINAL_FRAGMENT {p}: values")

    def due_checkpoint(self, step: int) -> bool:
        config = self.config
        return (
            config.checkpoint_path is not None and step > 0 and step % config.checkpoint_every == 0
        )

    def f32_bytes(self, fragment: int) -> bytes:
        params = self.params[fragment]
        assert params is not None
        return params.astype("<f4").tobytes()

    def check_record(self, got: dict[str, Any], want: dict[str, Any]) -> None:
        if "event" not in want:  # a merge line
            check(set(got) >= set(want), f"merge line lacks {set(want) - set(got)}")
            for name, value in want.items():
                if name == "gnorm":
                    ok = math.isclose(got[name], value, rel_tol=1e-9, abs_tol=1e-30)
                elif name in ("quorum_ms", "grace_ms", "sync_ms"):
                    ok = abs(got[name] - value) <= 0.0011
                else:
                    ok = got[name] == value
                check(ok, f"merge line of step {want['step']}: {name} {got[name]!r} != {value!r}")
            return
        for name, value in want.items():
            check(
                got.get(name) == value, f"tape {want['event']}: {name} {got.get(name)} != {value}"
            )

    def check_writes(self) -> None:
        writes: list[tuple[str, int]] = []
        for action in self.actions:
            match action:
                case WriteCheckpoint(state=state, final=final, recovery=recovery):
                    check(not recovery, "a recovery checkpoint without a budget")
                    writes.append(("final" if final else "commit", state.global_step))
                    self.check_state(state)
                case WriteFinalMarker(global_step=step):
                    writes.append(("marker", step))
                case WriteFinalState(state=state):
                    writes.append(("final_state", state.global_step))
                    self.check_state(state)
                case _:
                    pass
        check(writes == self.exp_ckpts, f"writes {writes}, expected {self.exp_ckpts}")

    def snapshot(self) -> tuple[Any, ...]:
        return (
            list(self.versions),
            [None if a is None else a.tobytes() for a in self.params],
            [None if a is None else a.tobytes() for a in self.momentum],
            dict(self.ledger),
        )

    def check_state(self, state: Checkpoint) -> None:
        """A snapshot is the committed state at its global_step, arrays bit for bit."""
        check(state.global_step in self.snapshots, f"checkpoint at {state.global_step}")
        versions, params, momentum, ledger = self.snapshots[state.global_step]
        saved = (
            [f.version for f in state.fragments],
            [np.asarray(f.params, "<f4").tobytes() for f in state.fragments],
            [np.asarray(f.momentum, "<f4").tobytes() for f in state.fragments],
            {e.learner_id: (e.merges, e.steps, e.tokens) for e in state.ledger},
        )
        check(saved[0] == versions, f"checkpoint versions {saved[0]} != {versions}")
        check(saved[1] == params, "checkpoint params")
        check(saved[2] == momentum, "checkpoint momentum")
        check(saved[3] == ledger, f"checkpoint ledger {saved[3]} != {ledger}")
        check(state.fingerprint == FINGERPRINT and state.contract == CONTRACT, "identity")

    def check_model(self, coordinator: Coordinator) -> None:
        """After every event: the coordinator's state is the model's."""
        check(coordinator.global_step == self.global_step, "global_step")
        model = coordinator.model
        if model is None:
            return
        check(list(model.versions) == self.versions, f"versions {model.versions}")
        for p, slot in enumerate(model.fragments):
            if self.params[p] is None:
                check(not slot.initialized, f"fragment {p} initialized early")
                continue
            params, momentum = slot.arrays()
            check(params.tobytes() == self.f32_bytes(p), f"fragment {p} params")
            mine = self.momentum[p]
            assert mine is not None
            check(momentum.tobytes() == mine.tobytes(), f"fragment {p} momentum")
        check(
            sorted(r.step for r in coordinator.rounds_in_flight) == sorted(self.rounds),
            f"rounds {[r.step for r in coordinator.rounds_in_flight]} != {sorted(self.rounds)}",
        )


def members_json(keys: Iterable[GroupKey]) -> list[dict[str, int]]:
    return [{"id": k.learner_id, "generation": k.generation} for k in sorted(keys)]


# -- the learners and the world -------------------------------------------------------------------
@dataclass
class Connection:
    key: GroupKey
    live: bool = True
    #: fragment → the anchor version from this connection's BCASTs (the values do not matter:
    #: the learner pushes random deltas).
    anchors: dict[int, int] = field(default_factory=dict)
    pending: list[PullReq] = field(default_factory=list)
    manifest: FinalManifest | None = None
    acked: bool = False


class Learner:
    def __init__(self, world: World, learner_id: int, behaviour: Behaviour) -> None:
        self.world = world
        self.id = learner_id
        self.b = behaviour
        self.generation = 0
        self.conn: Connection | None = None
        self.seen: dict[int, set[int]] = {}
        self.final: dict[int, int] = {}
        self.applied_cut = False
        self.done = False
        self.origin = 0.0
        self.step_base = 0
        self.inited = False

    @property
    def rng(self) -> random.Random:
        return self.world.rng

    @property
    def chaotic(self) -> bool:
        return self.world.scenario.mode is Mode.CHAOS and self.world.now < self.world.chaos_until

    def local_step(self) -> int:
        return self.step_base + int((self.world.now - self.origin) / self.b.step_time)

    def dial(self) -> None:
        if self.done:
            return
        if self.b.random_generations:
            self.generation = self.rng.randint(1, (1 << 64) - 1)
        else:
            self.generation += self.rng.choice([1, 1, 1, 2, 5]) if self.chaotic else 1
        key = GroupKey(self.id, self.generation)
        self.conn = Connection(key)
        hello = Hello(
            learner_id=self.id,
            generation=self.generation,
            dtype=WireDtype.F32,
            layout=self.world.scenario.layout,
            layout_fingerprint=FINGERPRINT,
            session_contract=CONTRACT,
            num_streams=0,
            profile_hash=None,
        )
        self.world.feed(HelloReceived(self.world.next_conn(), hello))
        if self.chaotic and self.rng.random() < self.b.abandon_p:
            # it gives up on a slow connection and dials again; the old group becomes ready
            # later (after the new one, or never before it closes)
            self.world.later(self.rng.uniform(0.2, 3.0), "ready", key)
            self.world.later(self.rng.uniform(0.5, 5.0), "closed", key)
            self.conn.live = False
            self.world.later(self.rng.uniform(0.0, 0.2), "dial", self.id)
            return
        self.world.later(self.rng.uniform(0.0, 0.05), "ready", key)

    def on_ready(self, key: GroupKey) -> None:
        self.world.feed(GroupReady(key))
        conn = self.conn
        if conn is None or conn.key != key or not conn.live:
            return
        if self.id == 0 and (not self.inited or self.rng.random() < self.b.reinit_p):
            # learner 0 INITs on every connection until it has seen every fragment come back
            self.inited = len(self.seen) == len(self.world.init_params)
            for p, values in enumerate(self.world.init_params):
                self.send(InitParams(p, values.astype("<f4").tobytes()), self.rng.uniform(0, 0.02))
            if self.chaotic and self.rng.random() < self.b.disconnect_p / 2:
                self.world.later(self.rng.uniform(0.0, 0.03), "drop", self.id)  # mid-INIT
        self.world.later(self.rng.uniform(0.1, 1.0), "heartbeat", (self.id, key))

    def heartbeat(self, key: GroupKey) -> None:
        conn = self.conn
        if conn is None or conn.key != key or not conn.live or self.done:
            return
        self.send(Heartbeat(self.id, self.local_step()), 0.0)
        self.world.later(self.rng.uniform(0.3, 2.0), "heartbeat", (self.id, key))

    def send(self, message: AnyMessage, delay: float) -> None:
        assert self.conn is not None
        self.world.later(delay, "arrive", (self.conn.key, message))

    def disconnect(self) -> None:
        conn = self.conn
        assert conn is not None
        conn.live = False
        self.conn = None
        lingers = self.rng.random() < self.b.linger_p
        linger = self.rng.uniform(0.2, self.b.linger_s) if lingers else 0.0
        self.world.later(linger, "closed", conn.key)
        if self.rng.random() < 0.3:  # a restarted process: its local step count starts over
            self.origin, self.step_base = self.world.now, 0
        redial = self.rng.choice([self.rng.uniform(0.0, 0.1), self.rng.uniform(0.05, 3.0)])
        self.world.later(redial, "dial", self.id)

    def deliver(self, key: GroupKey, message: AnyMessage) -> None:
        conn = self.conn
        if conn is None or conn.key != key or not conn.live or self.done:
            return
        match message:
            case BcastFragment(fragment_id=p, version=v):
                if p not in conn.anchors or v > conn.anchors[p]:
                    conn.anchors[p] = v
                    self.seen.setdefault(p, set()).add(v)
                self.answer_pending()
            case PullReq():
                conn.pending.append(message)
                self.answer_pending()
            case FinalFragment(fragment_id=p, version=v):
                if v >= self.final.get(p, -1):
                    self.final[p] = v
                self.maybe_ack()
            case FinalManifest():
                conn.manifest = message
                self.maybe_ack()
            case Shutdown():
                check(conn.acked, f"SHUTDOWN to {key} before its ACK")
                self.done = True
                conn.live = False
                self.world.later(0.01, "closed", key)

    def answer_pending(self) -> None:
        conn = self.conn
        assert conn is not None
        waiting = []
        for pull in conn.pending:
            if pull.fragment_id not in conn.anchors:
                waiting.append(pull)
            else:
                self.answer(pull)
        conn.pending = waiting

    def answer(self, pull: PullReq) -> None:
        conn = self.conn
        assert conn is not None
        if self.applied_cut or self.b.silent:
            return
        chaotic = self.chaotic
        if chaotic and self.rng.random() < self.b.disconnect_p:
            if self.rng.random() < 0.5:
                self.push(pull, self.rng.uniform(0.0, 0.5))  # the PUSH is in flight
            self.disconnect()
            return
        if chaotic and self.rng.random() > self.b.answer_p:
            return
        late = chaotic and self.rng.random() < self.b.late_p
        quorum_timeout = self.world.scenario.config.quorum_timeout_s
        delay = self.rng.uniform(0.3, 1.5 * quorum_timeout) if late else self.rng.uniform(0, 0.3)
        self.push(pull, delay)
        if chaotic and self.rng.random() < self.b.dup_p:
            self.push(pull, delay + self.rng.uniform(0.0, 0.5))

    def push(self, pull: PullReq, delay: float) -> None:
        conn = self.conn
        assert conn is not None
        base = conn.anchors[pull.fragment_id]
        if self.chaotic and self.rng.random() < self.b.stale_p:
            base = self.rng.choice(sorted(self.seen[pull.fragment_id]))
        elif self.chaotic and self.rng.random() < self.b.future_p:
            base += self.rng.randint(1, 3)  # not protocol: PUSH_FUTURE_BASE, kept open
        numel = self.world.scenario.layout.fragments[pull.fragment_id].numel
        rng = self.world.nrng
        delta = rng.normal(0.0, 0.1, numel).astype(np.float32)
        if rng.random() < 0.1:
            delta[rng.random(numel) < 0.5] = -0.0
        tokens = 0 if self.rng.random() < self.b.zero_tokens_p else self.rng.randint(1, 5000)
        message = PushFragment(
            learner_id=self.id,
            fragment_id=pull.fragment_id,
            global_step=pull.global_step,
            round_attempt=pull.round_attempt,
            base_version=base,
            local_step=self.local_step(),
            c_steps=self.rng.randint(1, 8),
            c_tokens=tokens,
            data=delta.astype("<f4").tobytes(),
        )
        self.send(message, delay)

    def maybe_ack(self) -> None:
        conn = self.conn
        assert conn is not None
        manifest = conn.manifest
        if manifest is None or conn.acked:
            return
        for p, expected in enumerate(manifest.expected_versions):
            if self.final.get(p) != expected:
                return
        chaotic = self.chaotic or self.b.final_chaos
        if self.applied_cut and chaotic and self.rng.random() < self.b.disconnect_p:
            self.world.later(self.rng.uniform(0.0, 0.1), "drop", self.id)  # lost before re-ACK
            return
        conn.acked = True
        self.applied_cut = True
        delay = self.rng.uniform(0.0, 0.2)
        self.send(FinalAck(manifest.final_global_step), delay)
        if chaotic and self.rng.random() < self.b.double_ack_p:
            self.send(FinalAck(manifest.final_global_step), delay + 0.1)
        if chaotic and self.rng.random() < self.b.disconnect_p:
            self.world.later(self.rng.uniform(0.0, delay + 0.1), "drop", self.id)


class World:
    """The simulated clock, the learners, the coordinator and the oracle."""

    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        self.rng = random.Random(scenario.seed)
        self.nrng = np.random.default_rng(scenario.seed)
        self.chaos_until = scenario.chaos_until
        self.coordinator = Coordinator(scenario.config)
        self.oracle = Oracle(scenario)
        self.now = 0.0
        self.timers: dict[str, float] = {}
        self.queue: list[tuple[float, int, str, Any]] = []
        self.order = itertools.count()
        self.conns = itertools.count(1)
        self.events: list[tuple[Event, float]] = []
        self.canon_actions: list[Any] = []
        #: per group, when its last queued frame reaches the learner (frames stay in order)
        self.in_flight_to: dict[GroupKey, float] = {}
        self.init_params = [
            self.nrng.normal(0.0, 1.0, f.numel).astype(np.float32)
            for f in scenario.layout.fragments
        ]
        self.learners = [Learner(self, i, b) for i, b in enumerate(scenario.behaviours)]

    def next_conn(self) -> int:
        return next(self.conns)

    def later(self, delay: float, kind: str, payload: Any) -> None:
        heapq.heappush(self.queue, (self.now + delay, next(self.order), kind, payload))

    def feed(self, event: Event) -> list[Action]:
        if self.coordinator.exit is not None:
            return []
        try:
            actions = self.coordinator.handle(event, self.now)
        except Exception as exc:
            raise SimFailure(f"the coordinator raised on {event!r} at {self.now}") from exc
        self.events.append((event, self.now))
        self.canon_actions.append(canon(actions))
        self.oracle.handle(event, self.now, actions)
        self.oracle.check_model(self.coordinator)
        for action in actions:
            match action:
                case SetTimer(key=key, at=at):
                    # a transport fires a timer at its time or a little later
                    late = self.scenario.mode is Mode.CHAOS and self.rng.random() < 0.3
                    self.timers[key] = at + (self.rng.uniform(0.0, 0.2) if late else 0.0)
                case CancelTimer(key=key):
                    self.timers.pop(key, None)
                case Send(group=group, message=message):
                    # in order per group, each after its own latency
                    at = max(
                        self.in_flight_to.get(group, 0.0), self.now + self.rng.uniform(0, 0.05)
                    )
                    self.in_flight_to[group] = at
                    snapshot = canon(message)
                    heapq.heappush(
                        self.queue,
                        (at, next(self.order), "deliver", (group, message, snapshot)),
                    )
                case CloseGroup(group=group):
                    self.later(0.0, "kicked", group)
                case _:
                    pass
        return actions

    def step(self) -> bool:
        """Carry out the next due thing; False when nothing is left."""
        timer = min(self.timers.items(), key=lambda kv: (kv[1], kv[0]), default=None)
        item = self.queue[0] if self.queue else None
        if timer is None and item is None:
            return False
        take_timer = item is None or (
            timer is not None
            and (timer[1] < item[0] or (timer[1] == item[0] and self.rng.random() < 0.5))
        )
        if take_timer:
            assert timer is not None
            key, at = timer
            del self.timers[key]
            self.now = max(self.now, at)
            self.feed(TimerFired(key))
            return True
        at, _, kind, payload = heapq.heappop(self.queue)
        self.now = max(self.now, at)
        self.do(kind, payload)
        return True

    def do(self, kind: str, payload: Any) -> None:
        match kind:
            case "dial":
                self.learners[payload].dial()
            case "ready":
                self.learners[payload.learner_id].on_ready(payload)
            case "heartbeat":
                learner_id, key = payload
                self.learners[learner_id].heartbeat(key)
            case "arrive":
                key, message = payload
                # a frame written before the learner dropped the connection still arrives
                self.feed(MessageReceived(key, message))
            case "deliver":
                key, message, snapshot = payload
                check(canon(message) == snapshot, f"payload of {message!r} changed in flight")
                self.learners[key.learner_id].deliver(key, message)
            case "closed":
                self.feed(GroupClosed(payload, "simulated"))
            case "kicked":
                learner = self.learners[payload.learner_id]
                conn = learner.conn
                if conn is not None and conn.key == payload and conn.live:
                    learner.disconnect()
            case "drop":
                learner = self.learners[payload]
                if learner.conn is not None and not learner.done:
                    learner.disconnect()
            case _:
                raise AssertionError(kind)

    def run(self) -> None:
        for learner in self.learners:
            self.later(self.rng.uniform(0.0, 0.5), "dial", learner.id)
        for _ in range(EVENT_LIMIT):
            if self.coordinator.exit is not None or self.now > TIME_LIMIT_S:
                return
            if not self.step():
                return


def time_bound(scenario: Scenario) -> float:
    """When a run must have exited: learners answer within 0.35 s and the syncer waits at most
    the pacing interval, the grace cap and a delivery per round, then a final ACK."""
    config = scenario.config
    interval = max(
        config.min_round_interval_ms / 1000.0,
        config.sync_interval_steps * 0.06 / len(scenario.layout.fragments),
    )
    per_round = interval + config.grace_ms / 1000.0 + 0.5
    bound = 2.0 + config.total_steps * per_round + 1.0
    if scenario.mode is Mode.CHAOS:  # then a round in flight may still miss its deadline once
        bound += (
            scenario.chaos_until + 2 * (config.quorum_timeout_s + 1.0) + config.final_ack_timeout
        )
    return bound


def replay(scenario: Scenario, events: list[tuple[Event, float]]) -> list[Any]:
    coordinator = Coordinator(scenario.config)
    return [canon(coordinator.handle(event, now)) for event, now in events]


def simulate(seed: int, mode: Mode) -> World:
    scenario = make_scenario(seed, mode)
    world = World(scenario)
    try:
        world.run()
        check(world.coordinator.exit is not None, f"no exit by t={world.now}")
        exit_ = world.coordinator.exit
        assert exit_ is not None
        oracle = world.oracle
        check(oracle.commits == list(range(1, len(oracle.commits) + 1)), "commits not 1..n")
        check(oracle.final is not None, "the run ended without a final cut")
        check(world.now <= time_bound(scenario), f"exit at {world.now} > {time_bound(scenario)}")
        if mode is not Mode.CHAOS:
            check(exit_.code == 0, f"exit {exit_}")
            check(oracle.global_step == scenario.config.total_steps, "did not reach total_steps")
        else:
            check(
                exit_.code == 0 or "FINAL_ACK missing" in exit_.reason or "no live" in exit_.reason,
                f"exit {exit_}",
            )
        # after the exit nothing more happens
        check(not world.coordinator.handle(TimerFired("launch"), world.now + 1), "after exit")
        check(
            replay(scenario, world.events) == world.canon_actions,
            "the same events gave different actions",
        )
    except SimFailure as failure:
        raise SimFailure(
            f"seed {seed} mode {mode.value} at t={world.now:.6f} after {len(world.events)} "
            f"events\n{scenario.config}\n{scenario.layout}\n{failure}"
        ) from failure
    return world


SEEDS = int(os.environ.get("YETO_SIM_SEEDS", "0"))


def seeds(default: int) -> list[int]:
    return list(range(SEEDS or default))


@pytest.mark.parametrize("seed", seeds(30))
def test_nice_sessions_finish_in_bounded_time_and_match_the_spec(seed: int) -> None:
    world = simulate(seed, Mode.NICE)
    assert world.oracle.stats.get("discarded", 0) == 0


@pytest.mark.parametrize("seed", seeds(30))
def test_a_silent_learner_below_quorum_does_not_stall_the_run(seed: int) -> None:
    simulate(seed, Mode.SILENT)


@pytest.mark.parametrize("seed", seeds(100))
def test_chaotic_sessions_match_the_spec(seed: int) -> None:
    simulate(seed, Mode.CHAOS)


def test_the_schedules_reach_the_paths_they_are_meant_to_check() -> None:
    """Guards the simulation itself: a change to its knobs must not quietly stop it from
    reaching retries, every rejection a protocol-following learner can cause, superseded
    answers, surplus closes, repeated cuts, failed finalizations and the exact merge check."""
    totals: dict[str, int] = {}
    exits: set[int] = set()
    exact = 0
    for seed in range(1000, 1080):
        world = simulate(seed, Mode.CHAOS)
        for name, count in world.oracle.stats.items():
            totals[name] = totals.get(name, 0) + count
        exit_ = world.coordinator.exit
        assert exit_ is not None
        exits.add(exit_.code)
        exact += world.scenario.exact_numerics and world.oracle.stats.get("commits", 0) > 0
    wanted = [
        "accepted",
        "accepted_stale",
        "accepted_superseded",
        "ack_repeated",
        "closed_after_cut",
        "cut_requeued",
        "discarded",
        "grace_opened",
        "init_ignored",
        "launched_on_recheck",
        "reack_awaited",
        "rejected:PUSH_DUPLICATE",
        "rejected:PUSH_FUTURE_BASE",
        "rejected:PUSH_OUT_OF_ROUND",
        "rejected:PUSH_TOO_STALE",
        "rejected:PUSH_WRONG_ATTEMPT",
        "retried",
        "retry_waited",
        "surplus_closed",
    ]
    assert [name for name in wanted if not totals.get(name)] == [], totals
    assert exits == {0, 1}
    assert exact >= 10
