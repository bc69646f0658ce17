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
- BREAKER, until a drawn moment, then NICE: now and then a learner sends a frame that breaks the
  protocol: a PUSH with ``c_steps = 0``, another learner's id, a NaN or infinity (a NaN,
  infinite or negative q4 scale), a wrong tensor length, for a fragment or step it was not
  pulled for, another attempt, or an old connection's PULL, or finite values near the f32
  maximum (whose merge or outer step may overflow: a failed commit, § 8); a HEARTBEAT with
  another learner's id; an INIT from a learner other than 0, or learner 0's INIT with a NaN
  (ignored when the fragment is held) or a wrong length; a FINAL_ACK before the cut, for another
  step or from a generation the cut was not queued to; a BUDGET_DONE without a configured
  budget; a frame only the syncer sends. The model gives each its verdict (ERROR and close of
  that group only, a ``push_rejected`` line, or nothing); a learner whose group is closed
  redials as a restarted process, and the run must still reach its total steps and exit 0 (1
  only for a failed commit, or a re-ACK lost to a close after the cut).

Every mode runs in a drawn session dtype (spec/dtypes.md): f32, bf16 or q4 PUSHes, INIT and
BCAST in the bulk encoding, FINAL_FRAGMENT in f32, q4 fragments of one or several 256-value
blocks. The model decodes and encodes with its own numpy codecs written from the spec (bf16
round-to-nearest-even and NaN quieting, q4 levels, signed zeros of a −0.0 scale, nibble 8,
ignored padding), checks every BCAST's bytes and the merge bit for bit as for f32. Learners
announce 0–4 data streams (``num_streams``): as the transport does, the group is reported ready
once they all attached, messages sent before (learner 0's early INITs) are held and delivered
right after ``GroupReady``, and in CHAOS and BREAKER runs a dial whose streams never all attach
(a stream that named another group) is closed at the 10 s attach deadline and redialed. Half
the sessions set ``early_sends`` as the daemon's driver does: a commit may hand its BCASTs out
before its merge runs (delivered ahead of the event's other actions), which must then be
complete (or withdrawn, for a failed commit), never for a commit that checkpoints, and never
ahead of an earlier effect of the event bound for a peer or the disk (spec/syncer.md § 8).

:class:`Oracle` is an independent model of the spec (registry and supersession, the surplus
cap, step-time estimates, pacing, rounds and attempts, PUSH acceptance rows 1–14, grace,
quorum deadlines and retries, commit order and failed commits, the global model and ledger,
finalization, the fatal and ignored cases of INIT, HEARTBEAT, FINAL_ACK and BUDGET_DONE). It
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

Two more kinds of run use the same model:

- RESUME (spec/checkpoint.md § 4, spec/syncer.md § 1 item 1): a drawn number of events after
  its first checkpoint (the final one included, while no learner has its SHUTDOWN), the syncer
  dies. The last WriteCheckpoint's state goes through the V3 writer and reader, a new
  coordinator with ``--resume`` starts from it, every group and frame in flight is gone and the
  learners redial with new generations; in half the runs a learner of another session (another
  layout, fingerprint or contract) dials first and must get CKPT_RESUME_INELIGIBLE while the
  syncer keeps waiting. The model rolls back to the checkpoint (global step, versions, params,
  momentum, ledger), expects the ``resumed`` line at the first accepted HELLO and the rounds
  after the checkpoint again; NICE and SILENT runs must end with exit 0 at total steps.
- BUDGET (spec/closure.md § 3): ``--learner-budget-steps`` with a checkpoint path; each learner
  sends BUDGET_DONE once at a drawn time (before the start, during the rounds, as the final cut
  reaches it, or never), sometimes from a new generation, and stops answering pulls on that
  connection; a few send a wrong step count first (``BUDGET_MISMATCH``, then redial and report)
  or the report twice (``DUPLICATE_BUDGET_DONE`` before the cut, ignored after it). The model
  cancels every uncommitted round at the first accepted report (one
  ``round_cancelled`` line each, their timers gone, no launch after, their late PUSHes
  PUSH_OUT_OF_ROUND), ignores reports after the final cut, and expects the unmarked recovery
  checkpoint, the ``budget_cutoff`` line and exit 0 once all M reported, or all of that with
  exit 1 when the wait (``--final-ack-timeout-s`` from the first report) runs out. After a
  complete NICE cutoff, most runs go on with the consolidation process of § 5 (``--resume``,
  ``--total-steps C+F``, ``--quorum M``, no budget), which must merge every learner in each
  of the F rounds and finish with a marked final checkpoint at C+F.

Not covered here: iso fragments, the transport itself (the data
sockets' DATA_HELLO checks and attach deadline, frame-decoder checks such as a PUSH's fragment
id ≥ F), a crash of a budget (cutoff) process, and a learner that reconnects to the resumed
syncer after its SHUTDOWN.

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
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from yeto_proto.checkpoint import Checkpoint, read_checkpoint, write_checkpoint
from yeto_proto.constants import MergeMode, WireDtype
from yeto_proto.dtypes import encode_tensor
from yeto_proto.errors import ErrorCode
from yeto_proto.identity import DeltaCorrection, LearnerWeight
from yeto_proto.layout import WireFragment, WireLayout
from yeto_proto.limits import Limits
from yeto_proto.messages import (
    AnyMessage,
    BcastFragment,
    BudgetDone,
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
from yeto_sync.merge import MergeConfig, MergeError, Response, merge_round
from yeto_sync.payload_progress import PayloadProgress

F32Array = NDArray[np.float32]

FINGERPRINT = bytes(range(32))
CONTRACT = bytes(range(100, 132))
#: Seconds of simulated time a run may take before it counts as stuck.
TIME_LIMIT_S = 2_000.0
EVENT_LIMIT = 20_000
TOL = 1e-9
#: Timers that belong to a round (its attempt's quorum and grace, its retry wait).
ROUND_TIMERS = ("quorum", "grace", "retry")


class Mode(enum.Enum):
    #: Every learner stays connected and answers every PULL in time.
    NICE = "nice"
    #: As NICE, but one learner (not 0) never answers a PULL; quorum < M.
    SILENT = "silent"
    #: Late, missing, duplicate and stale answers, reconnects, lingering groups; nice later.
    CHAOS = "chaos"
    #: As NICE, but until ``chaos_until`` learners now and then send a frame that breaks the
    #: protocol (spec/syncer.md § 1–6 and § 12, spec/closure.md § 2), and data streams may
    #: never attach; a learner whose group the syncer closes redials as a restarted process.
    BREAKER = "breaker"


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
    #: When it has trained its budget and sends BUDGET_DONE (None: it never reports).
    budget_at: float | None = None
    #: It drops its connection just before reporting and reports from the next generation.
    budget_redial: bool = False
    #: Its budget runs out just as the final cut reaches it: it reports before its ACK.
    budget_at_cut: bool = False
    #: Data sockets announced in each HELLO (spec/wire.md § 5): the transport reports the group
    #: ready once they all attached, and holds its messages until then.
    streams: int = 0
    #: A dial whose data streams never all attach (one goes to another group, or never
    #: arrives): the transport closes the group after its attach deadline.
    stream_fail_p: float = 0.0
    #: How often an action is replaced by a protocol-breaking frame (BREAKER, until chaos ends).
    break_p: float = 0.0
    #: A refused BUDGET_DONE: "mismatch" before the real report, "duplicate" or
    #: "late_mismatch" (both a duplicate and a wrong count: the count is judged first) after.
    bad_budget: str | None = None


@dataclass
class Scenario:
    seed: int
    mode: Mode
    config: SyncerConfig
    layout: WireLayout
    behaviours: list[Behaviour]
    #: Chaos ends here: from then on every learner behaves as in NICE.
    chaos_until: float
    #: Resume: the syncer crashes this many events after its first checkpoint (if it has not
    #: exited by then) and a new process resumes from the last checkpoint written.
    crash_after: int | None = None
    #: After the crash, a learner of another session dials the resumed syncer first.
    stray: bool = False
    #: After a complete budget cutoff: the consolidation restart (spec/closure.md § 5).
    consolidate: bool = False
    #: The session dtype (spec/dtypes.md): f32, bf16 or q4 PUSHes.
    dtype: WireDtype = WireDtype.F32
    #: The coordinator hands a commit's BCASTs out before its merge (``early_sends``, as the
    #: daemon's driver sets it; spec/syncer.md § 8 note).
    early: bool = False

    @property
    def exact_numerics(self) -> bool:
        return self.config.delta_correction is DeltaCorrection.NONE and all(
            f.merge_mode is MergeMode.AVG for f in self.layout.fragments
        )


def make_scenario(seed: int, mode: Mode, *, budget: bool = False, resume: bool = False) -> Scenario:
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
    scenario = Scenario(seed, mode, config, layout, behaviours, rng.uniform(5.0, 60.0))
    draw_wire(scenario, random.Random(f"{seed}/{mode.value}/wire"))
    # Drawn from their own stream, so that the sessions above stay the same.
    extra = random.Random(f"{seed}/{mode.value}/{budget}/{resume}")
    if budget:
        draw_budget(scenario, extra)
        scenario.consolidate = mode is Mode.NICE and extra.random() < 0.8
    if resume:
        scenario.config = dataclasses.replace(config, checkpoint_path=Path("sim.ckpt"))
        scenario.crash_after = extra.choice([0, 1, 2, extra.randint(3, 30), extra.randint(3, 150)])
        scenario.stray = extra.random() < 0.5
    return scenario


def draw_wire(scenario: Scenario, rng: random.Random) -> None:
    """The session dtype, data streams and protocol breakers, from a stream of their own (the
    rest of the session stays what it was before these were drawn)."""
    scenario.dtype = rng.choice([WireDtype.F32] * 2 + [WireDtype.BF16, WireDtype.Q4])
    if scenario.dtype is WireDtype.Q4 and rng.random() < 0.5:
        # a fragment of more than one q4 block (256 values), the last one padded
        fragments = list(scenario.layout.fragments)
        p = rng.randrange(len(fragments))
        fragments[p] = WireFragment(fragments[p].merge_mode, (rng.randint(257, 700),))
        scenario.layout = WireLayout(tuple(fragments))
    rough = scenario.mode in (Mode.CHAOS, Mode.BREAKER)
    for behaviour in scenario.behaviours:
        behaviour.streams = rng.choice([0, 0, 0, 1, 2, 4])
        if rough and behaviour.streams:
            behaviour.stream_fail_p = rng.choice([0.0, 0.1, 0.3])
        if scenario.mode is Mode.BREAKER:
            behaviour.break_p = rng.choice([0.02, 0.05, 0.1, 0.2])
    scenario.early = rng.random() < 0.5


def draw_budget(scenario: Scenario, rng: random.Random) -> None:
    """``--learner-budget-steps`` with a checkpoint path; each learner reports once, at a
    drawn time: mostly while rounds run, sometimes after the final cut, one maybe never."""
    config = dataclasses.replace(
        scenario.config,
        learner_budget_steps=rng.choice([1, 100, 4096, (1 << 32) - 1]),
        checkpoint_path=Path("sim.ckpt"),
    )
    scenario.config = config
    rough = 1.0 + config.total_steps * 0.25  # about when a nice run takes its final cut
    when = rng.random()
    if when < 0.1:  # before learner 0's INIT or the start, maybe
        base = rng.uniform(0.0, 0.6)
    elif when < 0.75:
        base = rng.uniform(0.7, 0.8 * rough)
    else:  # after the final cut, maybe
        base = rng.uniform(1.5 * rough, 5 * rough)
    # Not chaotic: every report arrives within the cutoff's wait (redials included).
    spread = 0.4 * config.final_ack_timeout
    if scenario.mode is Mode.CHAOS:
        spread = rng.choice([spread, 3.0 * config.final_ack_timeout])
    missing = rng.randrange(config.learners) if rng.random() < 0.25 else None
    for learner, behaviour in enumerate(scenario.behaviours):
        if learner != missing:
            behaviour.budget_at = base + rng.uniform(0.0, spread)
            behaviour.budget_at_cut = when >= 0.75 and rng.random() < 0.5
        behaviour.budget_redial = rng.random() < 0.3
        if learner != missing and rng.random() < 0.2:
            behaviour.bad_budget = rng.choice(["mismatch", "duplicate", "late_mismatch"])


# -- canonical actions (determinism, payload immutability) ----------------------------------------
def canon(value: Any) -> Any:
    """A comparable, copied form of an action: buffers as bytes, floats by repr."""
    if isinstance(value, memoryview | bytes | bytearray):
        return bytes(value)
    if isinstance(value, Send) and value.progress is not None and value.progress.withdrawn:
        # never completed: the bytes a failed merge left in its buffer do not matter
        return ("withdrawn", canon(value.group), value.message.fragment_id, value.message.version)
    if isinstance(value, PayloadProgress):
        return ("progress", value.total, value.complete, value.withdrawn)
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


# -- wire encodings (spec/dtypes.md), written again from the spec text ---------------------------
def spec_nbytes(dtype: WireDtype, numel: int, *, push: bool) -> int:
    """§ 2: f32 4·n, bf16 2·n, q4 (PUSH of a q4 session only) ⌈n / 256⌉ · 132."""
    if dtype is WireDtype.Q4 and push:
        return -(-numel // 256) * 132
    return (4 if dtype is WireDtype.F32 else 2) * numel


def spec_bf16_encode(values: F32Array) -> bytes:
    """§ 4: round to nearest, ties to even; a NaN becomes ``hi | 0x0040``."""
    b = np.asarray(values, "<f4").view("<u4").astype(np.uint64)
    hi = b >> np.uint64(16)
    rounded = (b + np.uint64(0x7FFF) + (hi & np.uint64(1))) >> np.uint64(16)
    nan = (b & np.uint64(0x7FFFFFFF)) > np.uint64(0x7F800000)
    out = np.where(nan, hi | np.uint64(0x0040), rounded)
    return out.astype("<u2").tobytes()


def spec_bf16_decode(raw: bytes) -> F32Array:
    """§ 4: the f32 bit pattern is ``bits << 16``."""
    bits = np.frombuffer(raw, "<u2").astype(np.uint32) << np.uint32(16)
    return bits.astype("<u4").view("<f4").astype(np.float32)


def spec_q4_decode(raw: bytes, numel: int) -> F32Array | None:
    """§ 5.2: per block, nibble ``s·8 + L`` → ``m · σ`` in f32, ``m = (−1)^s · 2^(L−7)`` for
    ``L ≥ 1`` and +0.0 for ``L = 0``. None when a scale is NaN, infinite or negative."""
    out = np.empty(numel, np.float32)
    for block in range(len(raw) // 132):
        chunk = raw[block * 132 : (block + 1) * 132]
        scale = np.frombuffer(chunk[:4], "<f4")[0]
        sign_bit = np.frombuffer(chunk[:4], "<u4")[0] >> 31
        if not math.isfinite(float(scale)) or (sign_bit and scale != 0):
            return None
        packed = np.frombuffer(chunk[4:], np.uint8)
        nibbles = np.empty(256, np.uint8)
        nibbles[0::2] = packed & 0x0F  # element 2i in the low nibble
        nibbles[1::2] = packed >> 4
        level = (nibbles & 7).astype(np.int32)
        sign = np.where(nibbles & 8, -1.0, 1.0)
        m = np.where(level == 0, 0.0, sign * np.exp2(level - 7.0)).astype(np.float32)
        values = (m * np.float32(scale)).astype(np.float32)  # one f32 product each
        start = block * 256
        stop = min(start + 256, numel)
        out[start:stop] = values[: stop - start]
    return out


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
        self.dtype = scenario.dtype
        self.limits = Limits.of(scenario.dtype, scenario.layout)
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
        #: The event changed a step-time estimate or the connected learners.
        self.pacing_changed = False
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
        #: The first accepted HELLO fixed the session (and installed a resumed checkpoint).
        self.session_fixed = False
        #: After a crash: the checkpoint's global step and state, installed at the first
        #: accepted HELLO of the new process (spec/syncer.md § 1 item 1).
        self.resume_from: tuple[int, tuple[Any, ...]] | None = None
        self.expect_refuse: int | None = None
        # the budget cutoff (spec/closure.md § 3): learner id → the reporting group
        self.reported: dict[int, GroupKey] = {}
        #: When the first accepted report closed issuance.
        self.cutoff_at: float | None = None
        #: The cutoff closed (the recovery checkpoint, or exit 1 without it).
        self.cutoff_closed = False
        self.cancelled: set[int] = set()
        #: Learners whose valid report came after the final cut (ignored, not recorded).
        self.ignored_reports: set[int] = set()

    # -- small helpers ---------------------------------------------------------------------
    def bump(self, name: str, by: int = 1) -> None:
        self.stats[name] = self.stats.get(name, 0) + by

    def current_members(self) -> tuple[GroupKey, ...]:
        return tuple(sorted(self.current.values()))

    def launch_members(self) -> tuple[GroupKey, ...]:
        """spec § 9: a newer generation supersedes the current one for launches from its
        admission on, before it is ready."""
        return tuple(k for k in self.current_members() if not self.attaching_newer(k))

    def attaching_newer(self, key: GroupKey) -> bool:
        seq = self.groups[key].seq
        return any(g.key.learner_id == key.learner_id and g.seq > seq for g in self.groups.values())

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
        slowest = self.slowest(k.learner_id for k in self.launch_members())
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
    def handle(self, event: Event, now: float, actions: list[Action], early: int = 0) -> None:
        if self.exit is not None:
            check(not actions, f"actions after exit: {actions}")
            return
        self.now = now
        self.actions = actions
        self.early = early
        self.exp_bcast: list[tuple[GroupKey, int, int]] = []
        self.exp_tape: list[dict[str, Any]] = []
        self.exp_closes: list[tuple[GroupKey, ErrorCode | None]] = []
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
        self.pacing_changed = False
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
        if self.pacing_changed and self.exp_exit is None:
            self.recheck_pacing()  # after the whole event (a PUSH is judged first)
        self.verify(event)

    def on_hello(self, conn: int, hello: Hello) -> None:
        key = GroupKey(hello.learner_id, hello.generation)
        self.expect_refuse = None
        ours = (
            bytes(hello.layout_fingerprint) == FINGERPRINT
            and bytes(hello.session_contract) == CONTRACT
            and hello.layout == self.layout
        )
        if not self.session_fixed:
            if not ours:
                # spec/checkpoint.md § 4 (choice): refused, and the syncer keeps waiting
                check(self.resume_from is not None, "the simulation sent a foreign HELLO")
                self.expect_refuse = conn
                self.bump("resume_refused")
                return
            self.session_fixed = True
            if self.resume_from is not None:
                self.install()
        check(ours, "the simulation sent a foreign HELLO after the session was fixed")
        check(key not in self.admitted, f"simulation reused {key}")
        if key.learner_id in self.current:
            self.pacing_changed = True  # superseded for launches: the slowest may be out
        self.admitted.add(key)
        self.groups[key] = OGroup(key, next(self.seq))
        self.expect_admit = (conn, key, hello.num_streams)
        if hello.num_streams:
            self.bump("streams_announced")
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
            self.exp_closes.append((group.key, None))
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
        current = self.current.get(key.learner_id)
        held_back = current is not None and current != key and self.attaching_newer(current)
        if self.remove(key):
            if self.final is not None:
                self.bump("closed_after_cut")
            self.finish_if_delivered()
            self.pacing_changed = True  # the slowest learner may have left
        elif held_back and current is not None and not self.attaching_newer(current):
            # the newer generation never became ready: launches capture the current again
            self.bump("superseding_closed_unready")
            self.pacing_changed = True
            self.advance()

    def on_message(self, key: GroupKey, message: AnyMessage) -> None:
        if key not in self.groups:
            check(not self.actions, f"a forgotten group {key} caused {self.actions}")
            return
        match message:
            case InitParams(fragment_id=fragment, data=data):
                self.on_init(key, fragment, bytes(data))
            case Heartbeat(learner_id=learner_id, local_step=local_step):
                if learner_id != key.learner_id:  # § 3
                    self.fatal(key, ErrorCode.LEARNER_ID_MISMATCH, "heartbeat")
                    return
                if self.current.get(key.learner_id) == key:
                    self.observe(key.learner_id, local_step, self.now)
                    self.pacing_changed = True
            case PushFragment():
                self.on_push(key, message)
            case FinalAck():
                self.on_ack(key, message)
            case BudgetDone():
                self.on_budget(key, message)
            case _:  # a frame only the syncer sends
                self.fatal(key, ErrorCode.WRONG_DIRECTION, type(message).__name__)

    def fatal(self, key: GroupKey, code: ErrorCode, what: str) -> None:
        """spec/errors.md § 1: ERROR on that group, which is closed and forgotten; nothing of
        the frame enters any state, and other groups go on."""
        self.bump(f"fatal:{code.value}")
        self.bump(f"fatal:{code.value}:{what}")
        if self.final is not None:
            self.bump("fatal_after_cut")
        self.exp_closes.append((key, code))
        if self.remove(key):
            self.finish_if_delivered()
            self.pacing_changed = True
            if self.exp_exit == 0:
                self.bump("fatal_completed_cut")  # the re-ACK it owed was all the cut awaited

    def on_init(self, key: GroupKey, fragment: int, data: bytes) -> None:
        """spec/syncer.md § 1 item 2, rows 1 and 3–6 (row 2 is the frame decoder's)."""
        if key.learner_id != 0:
            self.fatal(key, ErrorCode.INIT_NOT_ALLOWED, "init")
            return
        if self.params[fragment] is not None:
            self.bump("init_ignored")
            if not self.finite_bulk(data):
                self.bump("init_ignored_non_finite")
            return
        numel = self.layout.fragments[fragment].numel
        if len(data) != spec_nbytes(self.dtype, numel, push=False):
            self.fatal(key, ErrorCode.BAD_TENSOR_LENGTH, "init")
            return
        values = self.decode_bulk(data)
        if not np.all(np.isfinite(values)):
            self.fatal(key, ErrorCode.NON_FINITE_VALUE, "init")
            return
        self.params[fragment] = values
        self.history[(fragment, 0)] = self.bulk_bytes(fragment)
        self.momentum[fragment] = np.zeros(numel, "f4")
        self.advance()

    def decode_bulk(self, data: bytes) -> F32Array:
        """INIT and BCAST: f32, or bf16 in bf16 and q4 sessions (spec/dtypes.md § 1)."""
        if self.dtype is WireDtype.F32:
            return np.frombuffer(data, "<f4").astype(np.float32)
        return spec_bf16_decode(data)

    def finite_bulk(self, data: bytes) -> bool:
        size = 4 if self.dtype is WireDtype.F32 else 2
        return len(data) % size == 0 and bool(np.all(np.isfinite(self.decode_bulk(data))))

    def bulk_bytes(self, fragment: int) -> bytes:
        """The BCAST payload of the fragment's current params."""
        params = self.params[fragment]
        assert params is not None
        if self.dtype is WireDtype.F32:
            return params.astype("<f4").tobytes()
        return spec_bf16_encode(params)

    def decode_push(self, data: bytes, numel: int) -> F32Array | ErrorCode:
        """spec/syncer.md § 6 rows 12–13, on a PUSH the round would accept."""
        if len(data) != spec_nbytes(self.dtype, numel, push=True):
            return ErrorCode.BAD_TENSOR_LENGTH
        if self.dtype is WireDtype.F32:
            values = np.frombuffer(data, "<f4").astype(np.float32)
        elif self.dtype is WireDtype.BF16:
            values = spec_bf16_decode(data)
        else:
            decoded = spec_q4_decode(data, numel)
            if decoded is None:
                return ErrorCode.BAD_Q4_SCALE
            values = decoded
        if not np.all(np.isfinite(values)):
            return ErrorCode.NON_FINITE_VALUE
        return values

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
        if push.learner_id != key.learner_id:  # row 1
            self.fatal(key, ErrorCode.LEARNER_ID_MISMATCH, "push")
            return
        if push.c_steps == 0:  # row 2
            self.fatal(key, ErrorCode.ZERO_C_STEPS, "push")
            return
        if self.current.get(key.learner_id) == key:
            self.observe(key.learner_id, push.local_step, self.now)
            self.pacing_changed = True
        code = self.verdict(key, push)
        if code is not None:
            self.bump(f"rejected:{code.value}")
            numel = self.layout.fragments[push.fragment_id].numel
            if not isinstance(self.decode_push(bytes(push.data), numel), np.ndarray):
                self.bump("rejected_undecodable")  # judged before decoded: not fatal
            if push.global_step in self.cancelled:
                check(code is ErrorCode.PUSH_OUT_OF_ROUND, "a cancelled round's PUSH")
                self.bump("rejected_cancelled")
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
        target = self.rounds[push.global_step]
        values = self.decode_push(bytes(push.data), self.layout.fragments[target.fragment].numel)
        if isinstance(values, ErrorCode):  # rows 12–13
            self.fatal(key, values, "push")
            return
        self.bump("accepted")
        self.bump(f"accepted_{self.dtype.name.lower()}")
        if self.current.get(key.learner_id) != key:
            self.bump("accepted_superseded")
        if push.base_version < target.launch_version:
            self.bump("accepted_stale")
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
        members = self.launch_members()
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
        # § 12: before the cut, from a generation the cut was not queued to, for another step
        if final is None:
            self.fatal(key, ErrorCode.UNEXPECTED_FINAL_ACK, "ack_early")
            return
        if key not in final.queued:
            self.fatal(key, ErrorCode.UNEXPECTED_FINAL_ACK, "ack_unqueued")
            return
        if ack.final_global_step != final.step:
            self.fatal(key, ErrorCode.UNEXPECTED_FINAL_ACK, "ack_step")
            return
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
        if kind == "cutoff":
            if self.cutoff_at is not None and not self.cutoff_closed:
                self.close_cutoff()
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

    # -- the budget cutoff (spec/closure.md § 3) -------------------------------------------
    def on_budget(self, key: GroupKey, report: BudgetDone) -> None:
        budget = self.config.learner_budget_steps
        # spec/closure.md § 2, in the table's order
        if budget is None:
            self.fatal(key, ErrorCode.BUDGET_NOT_CONFIGURED, "budget")
            return
        if report.exact_local_steps != budget:
            self.fatal(key, ErrorCode.BUDGET_MISMATCH, "budget")
            return
        if key.learner_id in self.reported:
            self.fatal(key, ErrorCode.DUPLICATE_BUDGET_DONE, "budget")
            return
        if self.final is not None:
            # item 6: the ordinary rounds ran out first; logged, ignored and not recorded
            self.bump("budget_after_cut")
            if key.learner_id in self.ignored_reports:
                self.bump("budget_after_cut_again")  # never DUPLICATE_BUDGET_DONE
            self.ignored_reports.add(key.learner_id)
            return
        first = not self.reported
        self.reported[key.learner_id] = key
        self.bump("budget_done")
        self.exp_tape.append(
            {
                "event": "budget_done",
                "id": key.learner_id,
                "generation": key.generation,
                "exact_local_steps": budget,
                "missing_learners": self.missing(),
            }
        )
        if first:
            # item 1: issuance closes; every launched, uncommitted round is cancelled whole
            self.cutoff_at = self.now
            if not self.started:
                self.bump("budget_before_start")
            for step in sorted(self.rounds):
                cancelled = self.rounds[step]
                self.cancelled.add(step)
                self.bump("round_cancelled")
                self.bump(f"cancelled_{cancelled.phase}")
                self.exp_tape.append(
                    {
                        "event": "round_cancelled",
                        "reason": "budget_cutoff",
                        "step": cancelled.step,
                        "fragment": cancelled.fragment,
                        "attempt": cancelled.attempt,
                        "phase": cancelled.phase,
                        "expected_members": members_json(cancelled.members),
                        "responded_members": members_json(cancelled.accepted),
                    }
                )
            self.rounds.clear()
            self.next_step = self.global_step + 1
            self.launch_timer = None
            # item 5: the wait for the rest is bounded by --final-ack-timeout-s
            self.exp_timers["cutoff"] = self.now + self.config.final_ack_timeout
        if not self.missing():
            self.close_cutoff()

    def missing(self) -> list[int]:
        return [i for i in range(self.config.learners) if i not in self.reported]

    def close_cutoff(self) -> None:
        """Items 4, 5 and 7: the unmarked recovery checkpoint of C, the tape line, the exit."""
        self.cutoff_closed = True
        if any(p is None for p in self.params) or self.config.checkpoint_path is None:
            self.bump("cutoff_unsaved")
            self.exp_exit = 1
            return
        complete = not self.missing()
        self.bump("cutoff_complete" if complete else "cutoff_incomplete")
        self.snapshots[self.global_step] = self.snapshot()
        self.exp_ckpts.append(("recovery", self.global_step))
        self.exp_tape.append(
            {
                "event": "budget_cutoff",
                "complete": complete,
                "step": self.global_step,
                "versions": list(self.versions),
                "budget_steps": self.config.learner_budget_steps,
                "reported_members": members_json(self.reported.values()),
                "missing_learners": self.missing(),
            }
        )
        self.exp_exit = 0 if complete else 1

    # -- a crash, and the resumed process (spec/checkpoint.md § 4) --------------------------
    def crash(self, step: int, config: SyncerConfig) -> None:
        """The syncer died (or exited) after writing the checkpoint of ``step``; a new process
        with ``--resume`` and ``config`` takes over: no group, round, timer or session yet."""
        check(step in self.durable, f"resuming from step {step}, never checkpointed")
        self.config = config
        self.reported.clear()
        self.ignored_reports.clear()
        self.cutoff_at = None
        self.cutoff_closed = False
        self.cancelled.clear()
        if self.final is not None:
            self.bump("crashed_after_cut")
        self.resume_from = (step, self.snapshots[step])
        self.groups.clear()
        self.current.clear()
        self.clocks.clear()
        self.params = [None] * self.F
        self.momentum = [None] * self.F
        self.versions = [0] * self.F
        self.ledger = {}
        self.global_step = 0
        self.session_fixed = self.started = False
        self.next_step = 1
        self.rounds.clear()
        self.last_launch = self.launch_timer = None
        self.last_sync = 0.0
        self.final = None
        self.exit = None
        self.durable = {s for s in self.durable if s <= step}
        self.commits = [c for c in self.commits if c <= step]
        self.bump("crashed")

    def install(self) -> None:
        """The first accepted HELLO of a resumed process: the checkpoint's state, all of it."""
        assert self.resume_from is not None
        step, (versions, params, momentum, ledger) = self.resume_from
        self.resume_from = None
        self.versions = list(versions)
        self.params = [np.frombuffer(b, "<f4").astype(np.float32) for b in params]
        self.momentum = [np.frombuffer(b, "<f4").astype(np.float32) for b in momentum]
        self.ledger = dict(ledger)
        self.global_step = step
        self.next_step = step + 1
        for p, version in enumerate(self.versions):
            self.history[(p, version)] = self.bulk_bytes(p)
        self.bump("resumed")
        self.exp_tape.append(
            {
                "event": "resumed",
                "step": step,
                "next_step": step + 1,
                "versions": list(versions),
            }
        )

    # -- commit, start, launch, final cut --------------------------------------------------
    def advance(self) -> None:
        while self.rounds:
            step = min(self.rounds)
            head = self.rounds[step]
            if head.phase != "complete":
                break
            if not self.commit(head):
                return  # the syncer exits; the round stays uncommitted
            del self.rounds[step]
        if not self.started and all(p is not None for p in self.params):
            if len(self.current) == self.config.learners:
                self.started = True
                for fragment in range(self.F):
                    for member in self.current_members():
                        self.expect_bcast(member, fragment)
        self.launch()
        self.maybe_finalize()

    def commit(self, done: ORound) -> bool:
        """§ 8: merge, step, install, tape, checkpoint, BCAST; False when the commit fails."""
        p = done.fragment
        params, momentum = self.params[p], self.momentum[p]
        assert params is not None and momentum is not None
        order = sorted(done.accepted)
        pushes = [done.accepted[k] for k in order]
        geometry = self.layout.fragments[p]
        failed = False
        if self.s.exact_numerics:
            with np.errstate(over="ignore", invalid="ignore"):
                theta, buf, gnorm = spec_avg_none_step(
                    self.config,
                    params,
                    momentum,
                    [(o.push.c_steps, o.push.c_tokens, o.values) for o in pushes],
                )
            # § 7: a NaN or infinity in Δ, buf' or Θ' (Δ's shows in buf') fails the commit,
            # and in a bf16 BCAST session so does a Θ' that rounds to a bf16 infinity
            failed = not (np.all(np.isfinite(theta)) and np.all(np.isfinite(buf)))
            if not failed and self.dtype is not WireDtype.F32:
                failed = bool(np.any(np.abs(theta) >= np.uint32(0x7F7F8000).view(np.float32)))
        else:  # the coordinator's own merge: checks what it is fed, not the math
            try:
                merged = self.merge(geometry, order, pushes, params, momentum)
            except MergeError:
                failed = True
            else:
                theta, buf, gnorm = merged.params.copy(), merged.momentum.copy(), merged.gnorm
        if failed:  # § 8: nothing changes; merge_failed and exit 1
            self.bump("merge_failed")
            self.exp_tape.append(
                {
                    "event": "merge_failed",
                    "step": done.step,
                    "fragment": p,
                    "attempt": done.attempt,
                    "responded_members": members_json(done.accepted),
                }
            )
            self.exp_exit = 1
            return False
        self.install_commit(done, order, pushes, theta, buf, gnorm)
        return True

    def merge(
        self,
        geometry: WireFragment,
        order: list[GroupKey],
        pushes: list[OPush],
        params: F32Array,
        momentum: F32Array,
    ) -> Any:
        with np.errstate(over="ignore", invalid="ignore"):  # the model's call: its own noise
            return merge_round(
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

    def install_commit(
        self,
        done: ORound,
        order: list[GroupKey],
        pushes: list[OPush],
        theta: F32Array,
        buf: F32Array,
        gnorm: float,
    ) -> None:
        p = done.fragment
        geometry = self.layout.fragments[p]
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
        self.history[(p, done.step)] = self.bulk_bytes(p)
        self.snapshots[done.step] = self.snapshot()
        sync_s = 0.0  # ξ_sync is the merge alone, and without a work clock merges take no time
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
        if self.cutoff_at is not None:
            return "issuance closed by the budget cutoff"
        if self.next_step > self.config.total_steps:
            return "no step left"
        if len(self.rounds) >= self.depth:
            return "pipeline full"
        if not self.launch_members():
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
            members = self.launch_members()
            if len(members) < len(self.current):
                self.bump("launched_past_attaching")
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
        if self.final is not None or not self.started or self.cutoff_at is not None:
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
                    check(
                        (progress is None) == (index >= self.early),
                        "an early send among the returned actions, or one without progress",
                    )
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
        refusals = [a for a in actions if isinstance(a, RefuseConnection)]
        if isinstance(event, HelloReceived) and self.expect_refuse is not None:
            check(
                len(refusals) == 1
                and refusals[0].conn == self.expect_refuse
                and refusals[0].error.text.startswith(ErrorCode.CKPT_RESUME_INELIGIBLE.value + ":"),
                f"an ineligible HELLO under --resume: {refusals}",
            )
            check(
                all(isinstance(a, RefuseConnection | Log) for a in actions),
                f"a refused HELLO caused {actions}",
            )
            return
        if isinstance(event, HelloReceived):
            conn, admitted, streams = self.expect_admit
            check(
                admits == [AdmitGroup(conn, admitted, streams, self.limits)],
                f"admission of {admitted}: {admits}",
            )
        else:
            check(not admits, f"admitted without a HELLO: {admits}")
        check(not refusals, "a HELLO was refused")
        closes = [
            (a.group, None if a.error is None else a.error.text.partition(":")[0])
            for a in actions
            if isinstance(a, CloseGroup)
        ]
        check(
            closes == [(k, None if c is None else c.value) for k, c in self.exp_closes],
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

    def check_early(self) -> None:
        """spec/syncer.md § 8 (note): a commit's BCAST may leave while its merge runs, its last
        byte held back until the commit is done (withdrawn if it fails), never for a commit
        that writes a checkpoint, nor ahead of an earlier effect of the event bound for a peer
        or the disk."""
        returned = self.actions[self.early :]
        failed = [r["step"] for r in self.exp_tape if r.get("event") == "merge_failed"]
        for send in self.actions[: self.early]:
            assert isinstance(send, Send) and send.progress is not None
            version = send.message.version
            if send.progress.withdrawn:
                check(version in failed, f"early BCAST @{version} withdrawn, no failed commit")
                self.bump("early_withdrawn")
                continue
            check(send.progress.complete, f"early BCAST @{version} not complete after its commit")
            check(not self.due_checkpoint(version), f"early BCAST of checkpointed step {version}")
            line = next(
                i
                for i, a in enumerate(returned)
                if isinstance(a, AppendTape)
                and "event" not in a.record
                and a.record["step"] == version
            )
            ahead = [
                a
                for a in returned[:line]
                if not isinstance(a, Log | AppendTape | SetTimer | CancelTimer)
            ]
            check(not ahead, f"early BCAST @{version} overtook {ahead}")
            self.bump("early_sent")

    def check_sends(self) -> None:
        self.check_early()
        sends = [
            a
            for a in self.actions
            if isinstance(a, Send) and (a.progress is None or not a.progress.withdrawn)
        ]
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
            if not isinstance(action, Send) or action not in sends:
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
                    if recovery:
                        check(final, "the cutoff's recovery checkpoint is not a terminal write")
                        writes.append(("recovery", state.global_step))
                    else:
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
        ledger = {i: tuple(e) for i, e in model.ledger.items()}
        check(ledger == self.ledger, f"ledger {ledger} != {self.ledger}")
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


def unchecked_push(template: PushFragment, **fields: Any) -> PushFragment:
    """A PUSH its constructor would refuse (c_steps 0): as if a decoder had let it through."""
    push = object.__new__(PushFragment)
    for name in (f.name for f in dataclasses.fields(PushFragment)):
        value = fields.get(name, getattr(template, name))
        object.__setattr__(push, name, memoryview(value) if name == "data" else value)
    return push


#: The transport's deadline for a group's data sockets (yeto_sync/transport/group.py).
ATTACH_TIMEOUT_S = 10.0


# -- the learners and the world -------------------------------------------------------------------
@dataclass
class Connection:
    key: GroupKey
    live: bool = True
    #: fragment → the anchor version from this connection's BCASTs (the values do not matter:
    #: the learner pushes random deltas).
    anchors: dict[int, int] = field(default_factory=dict)
    pending: list[PullReq] = field(default_factory=list)
    #: Learner 0 sent its INITs before the group was ready (the transport held them).
    early_init: bool = False
    pulls: list[PullReq] = field(default_factory=list)
    manifest: FinalManifest | None = None
    acked: bool = False
    ready: bool = False
    #: BUDGET_DONE went out on it: pulls on it are not answered (spec/closure.md § 4 item 2).
    frozen: bool = False


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
        self.reported = False
        self.want_report = False
        self.redialed_for_report = False
        self.budget_broken = False
        self.ack_broken = False
        #: The last PULLs it received on earlier connections (a breaker answers one).
        self.recent_pulls: list[PullReq] = []

    @property
    def rng(self) -> random.Random:
        return self.world.rng

    @property
    def breaking(self) -> bool:
        """This action is replaced, or preceded, by a protocol-breaking frame."""
        return self.breaks(self.b.break_p)

    def breaks(self, p: float) -> bool:
        return (
            self.b.break_p > 0
            and self.world.now < self.world.chaos_until
            and self.rng.random() < max(p, self.b.break_p)
        )

    @property
    def dtype(self) -> WireDtype:
        return self.world.scenario.dtype

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
            dtype=self.dtype,
            layout=self.world.scenario.layout,
            layout_fingerprint=FINGERPRINT,
            session_contract=CONTRACT,
            num_streams=self.b.streams,
            profile_hash=None,
        )
        self.world.feed(HelloReceived(self.world.next_conn(), hello))
        rough = self.chaotic or (
            self.world.scenario.mode is Mode.BREAKER and self.world.now < self.world.chaos_until
        )
        if rough and self.b.stream_fail_p > 0 and self.rng.random() < self.b.stream_fail_p:
            # a data stream never attaches (it named another group, or never came): the
            # transport closes the group at its attach deadline; the learner then redials
            self.world.later(ATTACH_TIMEOUT_S, "attach_timeout", key)
            self.world.oracle.bump("streams_never_attached")
        elif self.chaotic and self.rng.random() < self.b.abandon_p:
            # it gives up on a slow connection and dials again; the old group becomes ready
            # later (after the new one, or never before it closes)
            self.world.later(self.rng.uniform(0.2, 3.0), "ready", key)
            self.world.later(self.rng.uniform(0.5, 5.0), "closed", key)
            self.conn.live = False
            self.world.later(self.rng.uniform(0.0, 0.2), "dial", self.id)
            return
        else:
            # each data stream attaches after its own delay; the group is ready with the last
            attach = [self.rng.uniform(0.0, 0.3) for _ in range(self.b.streams)]
            self.world.later(max(attach, default=self.rng.uniform(0.0, 0.05)), "ready", key)
        if self.id == 0 and self.b.streams and self.rng.random() < 0.5:
            # it INITs at once: the transport holds the frames until the group is ready
            self.conn.early_init = True
            self.initialize()

    def initialize(self) -> None:
        # learner 0 INITs on every connection until it has seen every fragment come back
        if self.inited and self.rng.random() >= self.b.reinit_p:
            return
        self.inited = len(self.seen) == len(self.world.init_params)
        if self.breaking:
            self.bad_init()
        for p, values in enumerate(self.world.init_params):
            data = encode_tensor(values, self.dtype, push=False).tobytes()
            self.send(InitParams(p, data), self.rng.uniform(0, 0.02))

    def bad_init(self) -> None:
        """Learner 0's INIT of a fragment with a NaN or infinity (fatal unless the fragment is
        held: row 3 comes first), or with a wrong length (sent only for a fragment not held)."""
        p = self.rng.randrange(len(self.world.init_params))
        values = self.world.init_params[p].copy()
        if self.world.oracle.params[p] is None and self.rng.random() < 0.3:
            data = encode_tensor(values, self.dtype, push=False).tobytes()
            data = data[: -self.rng.randint(1, 2)] if self.rng.random() < 0.5 else data + b"\0\0"
        else:
            values[self.rng.randrange(values.size)] = self.rng.choice([np.nan, np.inf, -np.inf])
            data = encode_tensor(values, self.dtype, push=False).tobytes()
        self.send(InitParams(p, data), 0.0)

    def on_ready(self, key: GroupKey) -> None:
        self.world.group_ready(key)
        conn = self.conn
        if conn is None or conn.key != key or not conn.live:
            return
        conn.ready = True
        if self.id == 0 and not conn.early_init:
            self.initialize()
            if self.chaotic and self.rng.random() < self.b.disconnect_p / 2:
                self.world.later(self.rng.uniform(0.0, 0.03), "drop", self.id)  # mid-INIT
        if self.recent_pulls and self.breaking:
            # the last PULL of its previous connection, answered from this one (§ 9: a
            # replacement cannot answer for the attempt that captured the old generation)
            old = self.recent_pulls.pop()
            push = self.push_for(old, 0)
            self.world.oracle.bump("bad_push:old_pull")
            self.send(push, self.rng.uniform(0.0, 0.1))
        if self.id != 0 and self.breaking:  # spec/syncer.md § 1 item 2 row 1
            p = self.rng.randrange(len(self.world.init_params))
            data = encode_tensor(self.world.init_params[p], self.dtype, push=False).tobytes()
            self.send(InitParams(p, data), self.rng.uniform(0, 0.02))
        if self.want_report:
            self.report()
        self.world.later(self.rng.uniform(0.1, 1.0), "heartbeat", (self.id, key))

    def budget_done(self) -> None:
        """It trained its budget: report it now, or on its next connection."""
        if self.done or self.reported:
            return
        conn = self.conn
        if conn is None or not conn.live or not conn.ready:
            self.want_report = True
            return
        if self.b.budget_redial and not self.redialed_for_report:
            self.redialed_for_report = True
            self.want_report = True
            self.disconnect(redial=self.rng.uniform(0.0, 0.1))
            return
        self.report()

    def report(self) -> None:
        conn = self.conn
        assert conn is not None
        budget = self.world.scenario.config.learner_budget_steps
        assert budget is not None
        if self.b.bad_budget == "mismatch" and not self.budget_broken:
            # another step count first (fatal BUDGET_MISMATCH): it reports again after the
            # redial its closed group causes
            self.budget_broken = True
            self.want_report = True
            self.send(BudgetDone(budget + self.rng.choice([1, -1 if budget > 1 else 2])), 0.0)
            return
        self.want_report = False
        self.reported = True
        conn.frozen = True
        conn.pending = []
        if self.redialed_for_report:
            self.world.oracle.bump("budget_from_redial")
        delay = self.rng.uniform(0.0, 0.05)
        self.send(BudgetDone(budget), delay)
        if self.b.bad_budget in ("duplicate", "late_mismatch") and not self.budget_broken:
            # another report, right behind or later (fatal DUPLICATE_BUDGET_DONE if the first
            # counted, ignored as well after the cut; BUDGET_MISMATCH for another count, even
            # after the cut)
            self.budget_broken = True
            count = budget + (self.b.bad_budget == "late_mismatch")
            later = self.rng.choice([0.001, self.rng.uniform(0.05, 0.5)])
            self.send(BudgetDone(count), delay + later)

    def heartbeat(self, key: GroupKey) -> None:
        conn = self.conn
        if conn is None or conn.key != key or not conn.live or self.done:
            return
        if self.breaking:
            self.bad_control()
        self.send(Heartbeat(self.id, self.local_step()), 0.0)
        self.world.later(self.rng.uniform(0.3, 2.0), "heartbeat", (self.id, key))

    def bad_control(self) -> None:
        """A control frame that breaks the protocol (the verdicts are the model's)."""
        kind = self.rng.choice(["heartbeat", "heartbeat", "ack", "budget", "direction", "init"])
        oracle = self.world.oracle
        if kind == "heartbeat":  # spec/syncer.md § 3: LEARNER_ID_MISMATCH
            other = self.rng.choice([i for i in range(5) if i != self.id])
            self.send(Heartbeat(other, self.local_step()), 0.0)
        elif kind == "ack":  # § 12: before the cut, not queued to it, or another step
            final, conn = oracle.final, self.conn
            assert conn is not None
            if final is None:
                step = self.rng.randint(0, 20)
            else:
                step = final.step + (conn.key in final.queued)
            self.send(FinalAck(step), 0.0)
        elif kind == "budget":  # spec/closure.md § 2
            budget = self.world.scenario.config.learner_budget_steps
            self.send(BudgetDone(self.rng.randint(1, 9) if budget is None else budget + 1), 0.0)
        elif kind == "direction":  # a frame only the syncer sends
            p = self.rng.randrange(len(self.world.init_params))
            self.send(self.rng.choice([PullReq(p, 1, 1), Shutdown()]), 0.0)
        elif self.id == 0:
            self.bad_init()
        else:  # INIT_NOT_ALLOWED
            p = self.rng.randrange(len(self.world.init_params))
            data = encode_tensor(self.world.init_params[p], self.dtype, push=False).tobytes()
            self.send(InitParams(p, data), 0.0)

    def send(self, message: AnyMessage, delay: float) -> None:
        assert self.conn is not None
        self.world.later(delay, "arrive", (self.conn.key, message))

    def disconnect(self, redial: float | None = None) -> None:
        conn = self.conn
        assert conn is not None
        conn.live = False
        self.conn = None
        self.recent_pulls = [*self.recent_pulls, *conn.pulls][-8:]
        lingers = self.rng.random() < self.b.linger_p
        linger = self.rng.uniform(0.2, self.b.linger_s) if lingers else 0.0
        self.world.later(linger, "closed", conn.key)
        if self.rng.random() < 0.3:  # a restarted process: its local step count starts over
            self.origin, self.step_base = self.world.now, 0
        if redial is None:
            redial = self.rng.choice([self.rng.uniform(0.0, 0.1), self.rng.uniform(0.05, 3.0)])
        self.world.later(redial, "dial", self.id)

    def crashed(self) -> None:
        """The syncer process died: the connection is gone with whatever was in flight on it;
        it redials the new process with a new generation (anchors and the cut start over)."""
        self.conn = None
        self.seen.clear()
        self.final.clear()
        self.applied_cut = False
        self.world.later(self.rng.uniform(0.05, 1.0), "dial", self.id)

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
                conn.pulls.append(message)
                if conn.frozen:
                    return
                conn.pending.append(message)
                self.answer_pending()
            case FinalFragment(fragment_id=p, version=v):
                if v >= self.final.get(p, -1):
                    self.final[p] = v
                self.maybe_ack()
            case FinalManifest():
                conn.manifest = message
                if self.b.budget_at_cut:
                    self.budget_done()
                    if self.conn is not conn:
                        return  # it redials to report
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
        if self.breaking:  # mostly ahead of the real answer: the round would accept it
            self.bad_push(pull, self.rng.uniform(0.0, delay if self.rng.random() < 0.7 else 0.3))
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
        self.send(self.push_for(pull, base), delay)

    def push_for(self, pull: PullReq, base: int) -> PushFragment:
        numel = self.world.scenario.layout.fragments[pull.fragment_id].numel
        tokens = 0 if self.rng.random() < self.b.zero_tokens_p else self.rng.randint(1, 5000)
        return PushFragment(
            learner_id=self.id,
            fragment_id=pull.fragment_id,
            global_step=pull.global_step,
            round_attempt=pull.round_attempt,
            base_version=base,
            local_step=self.local_step(),
            c_steps=self.rng.randint(1, 8),
            c_tokens=tokens,
            data=self.delta_bytes(numel),
        )

    def delta_bytes(self, numel: int) -> bytes:
        """A random delta in the session's push encoding (yeto's encoder: the model decodes
        it with its own). In q4 sessions some are raw blocks that use the decoder's liberties
        (nibble 8, a −0.0 scale, non-zero padding: spec/dtypes.md § 5.2)."""
        rng = self.world.nrng
        delta = rng.normal(0.0, 0.1, numel).astype(np.float32)
        if rng.random() < 0.1:
            delta[rng.random(numel) < 0.5] = -0.0
        if rng.random() < 0.1:  # ties and small values: the rounding rules matter
            delta *= np.float32(2.0 ** rng.integers(-20, 4))
        if self.dtype is WireDtype.Q4 and rng.random() < 0.3:
            blocks = -(-numel // 256)
            raw = bytearray(rng.integers(0, 256, blocks * 132, dtype=np.uint8).tobytes())
            for block in range(blocks):
                scale = np.float32(abs(rng.normal(0.0, 0.2)))
                if rng.random() < 0.1:
                    scale = np.float32(-0.0)
                raw[block * 132 : block * 132 + 4] = scale.astype("<f4").tobytes()
            self.world.oracle.bump("q4_raw_blocks")
            return bytes(raw)
        return encode_tensor(delta, self.dtype, push=True).tobytes()

    def bad_push(self, pull: PullReq, delay: float) -> None:
        """A PUSH that breaks the protocol, before the learner's real answer (spec/syncer.md
        § 6 rows 1–2 and 4–13); the model says whether it is fatal, rejected or accepted."""
        conn = self.conn
        assert conn is not None
        layout = self.world.scenario.layout
        base = conn.anchors[pull.fragment_id]
        push = self.push_for(pull, base)
        numel = layout.fragments[pull.fragment_id].numel
        kinds = ["zero_c_steps", "learner_id", "non_finite", "non_finite", "length"]
        if self.dtype is not WireDtype.F32:  # the decoder's own checks (bf16 bits, q4 scales)
            kinds += ["non_finite", "non_finite"]
        kinds += ["never_launched", "attempt", "old_pull"]
        if len(layout.fragments) > 1:
            kinds.append("other_fragment")
        kind = self.rng.choice(kinds)
        if self.rng.random() < 0.05:  # finite, but the merge or the outer step may overflow
            kind = "huge"
        if kind == "old_pull" and not self.recent_pulls:
            kind = "attempt"
        fields: dict[str, Any] = {}
        if kind == "zero_c_steps":
            fields["c_steps"] = 0
        elif kind == "learner_id":
            fields["learner_id"] = self.rng.choice([i for i in range(5) if i != self.id])
        elif kind == "non_finite":
            fields["data"] = self.non_finite_bytes(numel)
        elif kind == "huge":
            huge = np.full(numel, np.float32(3e38) * np.float32(self.rng.choice([1, -1])))
            fields["data"] = encode_tensor(huge, self.dtype, push=True).tobytes()
        elif kind == "length":
            data = bytes(push.data)
            cut = self.rng.choice([1, 2, 4, len(data)])
            fields["data"] = data[:-cut] if self.rng.random() < 0.5 else data + bytes(cut)
        elif kind == "never_launched":
            fields["global_step"] = pull.global_step + self.rng.randint(3, 50)
        elif kind == "attempt":
            fields["round_attempt"] = pull.round_attempt + self.rng.choice([1, 2])
        elif kind == "old_pull":  # an old connection's PULL answered from this one
            old = self.rng.choice(self.recent_pulls)
            anchor = conn.anchors.get(old.fragment_id, 0)
            fields.update(
                fragment_id=old.fragment_id,
                global_step=old.global_step,
                round_attempt=old.round_attempt,
                base_version=anchor,
                data=self.delta_bytes(layout.fragments[old.fragment_id].numel),
            )
        else:  # a fragment it was not pulled for
            other = self.rng.choice(
                [q for q in range(len(layout.fragments)) if q != pull.fragment_id]
            )
            fields.update(fragment_id=other, data=self.delta_bytes(layout.fragments[other].numel))
        self.world.oracle.bump(f"bad_push:{kind}")
        self.send(unchecked_push(push, **fields), delay)

    def non_finite_bytes(self, numel: int) -> bytes:
        """f32 and bf16: a NaN or an infinity; q4: a NaN, infinite or negative block scale."""
        rng = self.world.nrng
        delta = rng.normal(0.0, 0.1, numel).astype(np.float32)
        if self.dtype is WireDtype.Q4:
            raw = bytearray(encode_tensor(delta, self.dtype, push=True).tobytes())
            block = self.rng.randrange(len(raw) // 132)
            scale = self.rng.choice([np.nan, np.inf, -np.inf, -1.0, -0.25, -1e-30, -1e-42])
            raw[block * 132 : block * 132 + 4] = np.float32(scale).astype("<f4").tobytes()
            return bytes(raw)
        delta[self.rng.randrange(numel)] = self.rng.choice([np.nan, np.inf, -np.inf])
        return encode_tensor(delta, self.dtype, push=True).tobytes()

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
        # another step: UNEXPECTED_FINAL_ACK (once before its first ACK: each costs a redial
        # within the ACK deadline; on a re-ACK the cut no longer waits for it)
        if self.breaks(0.7) if self.applied_cut else (not self.ack_broken and self.breaking):
            self.ack_broken = True
            self.send(FinalAck(manifest.final_global_step + 1), 0.0)
        conn.acked = True
        self.applied_cut = True
        delay = self.rng.uniform(0.0, 0.2)
        self.send(FinalAck(manifest.final_global_step), delay)
        if self.breaks(0.6):  # its group is closed after its ACK stands: a re-ACK is awaited
            self.send(Heartbeat(self.id + 1, self.local_step()), delay + 0.01)
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
        #: The sends a commit handed out before its merge, during the current event.
        self.early: list[Send] = []
        self.stream_early(self.coordinator)
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
        #: The transport's view: groups whose data streams all attached, groups it dropped,
        #: and the messages it holds for a group until it is ready.
        self.ready: set[GroupKey] = set()
        self.gone: set[GroupKey] = set()
        self.held: dict[GroupKey, list[AnyMessage]] = {}
        self.init_params = [
            self.nrng.normal(0.0, 1.0, f.numel).astype(np.float32)
            for f in scenario.layout.fragments
        ]
        self.learners = [Learner(self, i, b) for i, b in enumerate(scenario.behaviours)]
        #: Each syncer process: its config, the checkpoint it resumed and its first event.
        self.lives: list[tuple[SyncerConfig, Checkpoint | None, int]] = [(scenario.config, None, 0)]
        #: The state of the last WriteCheckpoint carried out, and the crash countdown.
        self.last_checkpoint: Checkpoint | None = None
        self.crash_countdown = scenario.crash_after
        self.crash_pending = False
        self.crashed_at: float | None = None
        #: The event tape of the current process.
        self.tape: list[dict[str, Any]] = []
        #: The cutoff checkpoint's global step C, once the consolidation process started.
        self.consolidated_from: int | None = None

    def next_conn(self) -> int:
        return next(self.conns)

    def group_ready(self, key: GroupKey) -> None:
        """GroupReady, then the messages held for the group, in order (the transport's rule)."""
        self.ready.add(key)
        self.feed(GroupReady(key))
        held = self.held.pop(key, [])
        if held:
            self.oracle.bump("held_delivered", len(held))
        for message in held:
            self.receive(key, message)

    def arrive(self, key: GroupKey, message: AnyMessage) -> None:
        if key not in self.ready and key not in self.gone:
            self.held.setdefault(key, []).append(message)
            return
        # a frame written before the learner dropped the connection still arrives
        self.receive(key, message)

    def receive(self, key: GroupKey, message: AnyMessage) -> None:
        finite = None
        if (
            self.scenario.dtype is WireDtype.F32
            and isinstance(message, InitParams | PushFragment)
            and len(message.data) % 4 == 0
            and self.rng.random() < 0.5
        ):  # the transport's scan of an f32 tensor as it arrived (spec/syncer.md § 6)
            finite = bool(np.all(np.isfinite(np.frombuffer(bytes(message.data), "<f4"))))
        self.feed(MessageReceived(key, message, finite))

    def group_gone(self, key: GroupKey, reason: str) -> None:
        self.gone.add(key)
        self.held.pop(key, None)
        self.feed(GroupClosed(key, reason))

    def later(self, delay: float, kind: str, payload: Any) -> None:
        heapq.heappush(self.queue, (self.now + delay, next(self.order), kind, payload))

    def stream_early(self, coordinator: Coordinator) -> None:
        if self.scenario.early:
            coordinator.early_sends = self.take_early

    def take_early(self, sends: Any) -> None:
        for send in sends:
            progress = send.progress
            check(
                isinstance(send.message, BcastFragment)
                and progress is not None
                and progress.total == len(send.message.data)
                and progress.ready < max(progress.total, 1)
                and not progress.withdrawn,
                f"early send {send}",
            )
        self.early.extend(sends)

    def feed(self, event: Event) -> list[Action]:
        if self.coordinator.exit is not None or self.crash_pending:
            return []
        self.early = []
        try:
            returned = self.coordinator.handle(event, self.now)
        except Exception as exc:
            raise SimFailure(f"the coordinator raised on {event!r} at {self.now}") from exc
        # the early sends left first: they were handed out before the merge
        actions: list[Action] = [*self.early, *returned]
        self.events.append((event, self.now))
        self.canon_actions.append(canon(actions))
        self.oracle.handle(event, self.now, actions, early=len(self.early))
        self.oracle.check_model(self.coordinator)
        for action in actions:
            match action:
                case SetTimer(key=key, at=at):
                    # a transport fires a timer at its time or a little later
                    late = self.scenario.mode is Mode.CHAOS and self.rng.random() < 0.3
                    self.timers[key] = at + (self.rng.uniform(0.0, 0.2) if late else 0.0)
                case CancelTimer(key=key):
                    self.timers.pop(key, None)
                case Send(progress=progress) if progress is not None and progress.withdrawn:
                    pass  # the transport cuts the connection: the peer never completes it
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
                case CloseGroup(group=group, error=error):
                    self.gone.add(group)
                    self.held.pop(group, None)
                    self.later(0.0, "kicked", (group, error is not None))
                case WriteCheckpoint(state=state):
                    self.last_checkpoint = state
                case AppendTape(record=record):
                    self.tape.append(record)
                case _:
                    pass
        if self.oracle.cutoff_at is not None:
            left = [k for k in self.timers if k.partition(":")[0] in ROUND_TIMERS]
            check(not left, f"timers {left} of cancelled rounds are still set")
        self.maybe_crash()
        return actions

    def maybe_crash(self) -> None:
        if self.crash_countdown is None or self.last_checkpoint is None:
            return
        if self.coordinator.exit is not None or any(learner.done for learner in self.learners):
            return  # a learner that got SHUTDOWN has gone: no resumed run could start
        if self.crash_countdown > 0:
            self.crash_countdown -= 1
            return
        self.crash_countdown = None
        self.crash_pending = True  # carried out before the next event

    def crash(self) -> None:
        """The syncer dies; a new process resumes from the last checkpoint it wrote, read back
        from the bytes the V3 writer makes of it."""
        self.restart(dataclasses.replace(self.scenario.config, resume=True))

    def consolidate(self) -> None:
        """spec/closure.md § 5: the harness restarts the syncer from the cutoff checkpoint C
        with --resume, --total-steps C+F and --quorum M, without a budget."""
        state = self.last_checkpoint
        assert state is not None
        self.consolidated_from = state.global_step
        config = self.scenario.config
        self.restart(
            dataclasses.replace(
                config,
                resume=True,
                total_steps=state.global_step + len(self.scenario.layout.fragments),
                quorum=config.learners,
                learner_budget_steps=None,
                mark_final_checkpoint=True,
            )
        )

    def restart(self, config: SyncerConfig) -> None:
        state = self.last_checkpoint
        assert state is not None
        with tempfile.TemporaryDirectory(prefix="yeto-sim-") as folder:
            path = Path(folder) / "sim.ckpt"
            write_checkpoint(path, state)
            saved = read_checkpoint(path)
        # still the model's state at its step: nothing wrote into the arrays it refers to
        self.oracle.check_state(saved)
        self.coordinator = Coordinator(config, checkpoint=saved)
        self.stream_early(self.coordinator)
        self.lives.append((config, saved, len(self.events)))
        self.oracle.crash(saved.global_step, config)
        self.tape = []
        self.crash_pending = False
        self.crashed_at = self.now
        self.timers.clear()
        self.queue.clear()
        self.in_flight_to.clear()
        self.held.clear()
        for learner in self.learners:
            learner.crashed()
        if self.scenario.stray:
            self.later(0.01, "stray", None)

    def stray(self) -> None:
        """A learner of another session dials the resumed syncer first: refused with
        CKPT_RESUME_INELIGIBLE, and the syncer keeps waiting (spec/checkpoint.md § 4)."""
        layout = self.scenario.layout
        fingerprint, contract = FINGERPRINT, CONTRACT
        variant = self.rng.randrange(3)
        if variant == 0:  # another model
            layout = WireLayout(layout.fragments + (WireFragment(MergeMode.AVG, (5,)),))
            fingerprint = bytes(range(200, 232))
        elif variant == 1:  # same sizes, other tensors
            fingerprint = bytes(range(1, 33))
        else:  # another run of the same model
            contract = bytes(range(50, 82))
        hello = Hello(
            learner_id=self.rng.randrange(self.scenario.config.learners),
            generation=(1 << 63) + self.rng.randrange(1 << 20),
            dtype=WireDtype.F32,
            layout=layout,
            layout_fingerprint=fingerprint,
            session_contract=contract,
            num_streams=0,
            profile_hash=None,
        )
        self.feed(HelloReceived(self.next_conn(), hello))
        coordinator = self.coordinator
        check(
            coordinator.session is None and coordinator.model is None,
            "an ineligible HELLO fixed the resumed session",
        )

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
                self.arrive(key, message)
            case "deliver":
                key, message, snapshot = payload
                check(canon(message) == snapshot, f"payload of {message!r} changed in flight")
                self.learners[key.learner_id].deliver(key, message)
            case "closed":
                self.group_gone(payload, "simulated")
            case "attach_timeout":
                if payload not in self.ready and payload not in self.gone:
                    self.group_gone(payload, "HANDSHAKE_TIMEOUT: data streams missing")
                    learner = self.learners[payload.learner_id]
                    if learner.conn is not None and learner.conn.key == payload:
                        learner.disconnect()
            case "kicked":
                key, error = payload
                learner = self.learners[key.learner_id]
                conn = learner.conn
                if conn is not None and conn.key == key and conn.live:
                    if error:  # the process that broke the protocol restarts at once
                        learner.disconnect(redial=self.rng.uniform(0.0, 0.1))
                    else:
                        learner.disconnect()
            case "drop":
                learner = self.learners[payload]
                if learner.conn is not None and not learner.done:
                    learner.disconnect()
            case "budget":
                self.learners[payload].budget_done()
            case "stray":
                self.stray()
            case _:
                raise AssertionError(kind)

    def run(self) -> None:
        for learner in self.learners:
            self.later(self.rng.uniform(0.0, 0.5), "dial", learner.id)
            if learner.b.budget_at is not None:
                self.later(learner.b.budget_at, "budget", learner.id)
        for _ in range(EVENT_LIMIT):
            if self.crash_pending:
                self.crash()
            exit_ = self.coordinator.exit
            if (
                exit_ is not None
                and exit_.code == 0
                and self.scenario.consolidate
                and self.consolidated_from is None
                and self.oracle.cutoff_closed
            ):
                self.consolidate()
                continue
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
    if scenario.mode in (Mode.CHAOS, Mode.BREAKER):  # a round may still miss its deadline once
        bound += (
            scenario.chaos_until + 2 * (config.quorum_timeout_s + 1.0) + config.final_ack_timeout
        )
    if any(b.stream_fail_p for b in scenario.behaviours):  # and a group its attach deadline
        bound += ATTACH_TIMEOUT_S + 1.0
    return bound


def replay(world: World) -> list[Any]:
    """Every syncer process of the run again, fed the same events: the same actions."""
    replayed: list[Any] = []
    for index, (config, checkpoint, first) in enumerate(world.lives):
        last = world.lives[index + 1][2] if index + 1 < len(world.lives) else len(world.events)
        coordinator = Coordinator(config, checkpoint=checkpoint)
        early: list[Send] = []
        if world.scenario.early:
            coordinator.early_sends = early.extend
        for event, now in world.events[first:last]:
            returned = coordinator.handle(event, now)
            replayed.append(canon([*early, *returned]))
            early.clear()
    return replayed


def check_consolidation(world: World) -> None:
    """spec/closure.md § 6, items 2 and 3: what the harness requires before it exports."""
    start = world.consolidated_from
    assert start is not None
    exit_ = world.coordinator.exit
    assert exit_ is not None
    check(exit_.code == 0, f"the consolidation exited {exit_}")
    F = len(world.scenario.layout.fragments)
    check(world.oracle.global_step == start + F, "the consolidation did not reach C+F")
    merges = [r for r in world.tape if "event" not in r]
    check(
        [r["step"] for r in merges] == list(range(start + 1, start + F + 1)),
        f"consolidation merge lines {[r['step'] for r in merges]}",
    )
    check(sorted(r["fragment"] for r in merges) == list(range(F)), "fragments consolidated")
    every = list(range(world.scenario.config.learners))
    for record in merges:
        ids = sorted(r["id"] for r in record["responders"])
        check(ids == every, f"consolidation round {record['step']} merged {ids}")
    world.oracle.bump("consolidated")


def simulate(seed: int, mode: Mode, *, budget: bool = False, resume: bool = False) -> World:
    scenario = make_scenario(seed, mode, budget=budget, resume=resume)
    world = World(scenario)
    try:
        world.run()
        check(world.coordinator.exit is not None, f"no exit by t={world.now}")
        exit_ = world.coordinator.exit
        assert exit_ is not None
        oracle = world.oracle
        config = oracle.config  # the last process's
        check(oracle.commits == list(range(1, len(oracle.commits) + 1)), "commits not 1..n")
        bound = time_bound(dataclasses.replace(scenario, config=config))
        if world.crashed_at is not None:  # the resumed process starts over, redials first
            bound += world.crashed_at + 1.1
        if world.consolidated_from is not None:
            check_consolidation(world)
        if oracle.stats.get("merge_failed"):  # spec/syncer.md § 8: exit 1 at the failed commit
            check(exit_.code == 1 and "failed to commit" in exit_.reason, f"exit {exit_}")
        elif oracle.cutoff_at is not None:
            check(oracle.final is None and oracle.cutoff_closed, "the cutoff did not close")
            late = 0.2 if mode is Mode.CHAOS else 0.0
            cutoff_end = oracle.cutoff_at + config.final_ack_timeout + late
            check(world.now <= cutoff_end + TOL, f"cutoff exit at {world.now} > {cutoff_end}")
            bound = max(bound, cutoff_end)
            if oracle.stats.get("cutoff_unsaved"):  # item 7
                check(exit_.code == 1 and "nothing to save" in exit_.reason, f"exit {exit_}")
            elif oracle.missing():
                check(exit_.code == 1 and "budget cutoff" in exit_.reason, f"exit {exit_}")
            elif mode is not Mode.CHAOS:
                check(exit_.code == 0, f"exit {exit_}")
            if exit_.code == 0:
                check(
                    isinstance(world.last_checkpoint, Checkpoint)
                    and world.last_checkpoint.global_step == oracle.global_step,
                    "no recovery checkpoint",
                )
        else:
            check(oracle.final is not None, "the run ended without a final cut")
            if mode is not Mode.CHAOS:
                check(oracle.global_step == config.total_steps, "did not reach total_steps")
            # a breaker closed after the cut may not make its re-ACK in time (its new group's
            # data streams may never attach)
            lost_ack = "FINAL_ACK missing" in exit_.reason and oracle.stats.get("fatal_after_cut")
            if mode is not Mode.CHAOS and not (mode is Mode.BREAKER and lost_ack):
                check(exit_.code == 0, f"exit {exit_}")
        check(world.now <= bound, f"exit at {world.now} > {bound}")
        if mode is Mode.CHAOS:
            check(
                exit_.code == 0
                or any(
                    reason in exit_.reason
                    for reason in ("FINAL_ACK missing", "no live", "budget cutoff")
                ),
                f"exit {exit_}",
            )
        # after the exit nothing more happens
        check(not world.coordinator.handle(TimerFired("launch"), world.now + 1), "after exit")
        check(replay(world) == world.canon_actions, "the same events gave different actions")
        if scenario.consolidate and exit_.code == 0 and world.consolidated_from is None:
            check(oracle.final is not None, "a complete cutoff was not consolidated")
    except SimFailure as failure:
        raise SimFailure(
            f"seed {seed} mode {mode.value} budget {budget} resume {resume} at "
            f"t={world.now:.6f} after {len(world.events)} events\n{scenario.config}\n"
            f"{scenario.layout}\n{failure}"
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


def test_the_models_codecs_give_the_spec_examples() -> None:
    """The model's own bf16 and q4 codecs against spec/dtypes.md § 4 and § 5.5."""
    f32 = [0x3F800000, 0xC0200000, 0x3DCCCCCD, 0x3F808000, 0x3F818000, 0x00008000, 0x80000000]
    f32 += [0x7F7FFFFF, 0x7FA00000]
    bf16 = [0x3F80, 0xC020, 0x3DCD, 0x3F80, 0x3F82, 0x0000, 0x8000, 0x7F80, 0x7FE0]
    encoded = spec_bf16_encode(np.array(f32, "<u4").view("<f4"))
    assert np.frombuffer(encoded, "<u2").tolist() == bf16
    assert spec_bf16_decode(np.array([0x3F82], "<u2").tobytes()).tolist() == [1.0 + 2.0**-6]
    golden = bytes.fromhex("0000803f" + "e705") + bytes(126)
    assert spec_q4_decode(golden, 4).tolist() == [1.0, -0.5, 0.25, 0.0]
    second = bytes.fromhex("00004040" + "d70500") + bytes(125)
    assert spec_q4_decode(second, 6).tolist() == [3.0, -0.75, 0.75, 0.0, 0.0, 0.0]
    steps = bytes.fromhex("0000803f" + "775606") + bytes(125)
    assert spec_q4_decode(steps, 5).tolist() == [1.0, 1.0, 0.5, 0.25, 0.5]
    # a −0.0 scale is accepted: m · (−0.0); nibble 8 is +0.0; NaN, inf and negative refused
    zero = np.frombuffer(spec_q4_decode(bytes.fromhex("00000080" + "f808") + bytes(126), 4), "<u4")
    assert zero.tolist() == [0x80000000, 0x00000000, 0x80000000, 0x80000000]
    for scale in ("0000c07f", "0000807f", "000080bf"):
        assert spec_q4_decode(bytes.fromhex(scale) + bytes(128), 1) is None
    assert spec_nbytes(WireDtype.Q4, 257, push=True) == 264
    assert spec_nbytes(WireDtype.Q4, 257, push=False) == 514


@pytest.mark.parametrize("seed", seeds(40))
def test_protocol_breakers_are_closed_or_rejected_and_the_run_goes_on(seed: int) -> None:
    """spec/syncer.md § 1–6, § 12, spec/errors.md § 1: each broken frame gets its verdict (ERROR
    and close for that group only, a rejection on the tape, or nothing), and the run still
    reaches its total steps and exits 0."""
    simulate(seed, Mode.BREAKER)


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
        "launched_past_attaching",
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


def test_the_breaker_and_wire_schedules_reach_their_paths() -> None:
    """Guards the BREAKER runs and the wire knobs: every kind of broken frame gets each verdict
    it can get, and bf16 and q4 rounds are checked bit for bit."""
    totals: dict[str, int] = {}
    exact: dict[WireDtype, int] = {}
    for seed in range(3000, 3060):
        world = simulate(seed, Mode.BREAKER)
        for name, count in world.oracle.stats.items():
            totals[name] = totals.get(name, 0) + count
        if world.scenario.exact_numerics and world.oracle.stats.get("commits", 0):
            exact[world.scenario.dtype] = exact.get(world.scenario.dtype, 0) + 1
    wanted = [
        "accepted_bf16",
        "accepted_q4",
        "q4_raw_blocks",
        "streams_announced",
        "streams_never_attached",
        "held_delivered",
        "init_ignored_non_finite",
        "rejected_undecodable",
        "rejected:PUSH_WRONG_GENERATION",
        "fatal:BAD_Q4_SCALE:push",
        "fatal:BAD_TENSOR_LENGTH:init",
        "fatal:BAD_TENSOR_LENGTH:push",
        "fatal:BUDGET_NOT_CONFIGURED:budget",
        "fatal:INIT_NOT_ALLOWED:init",
        "fatal:LEARNER_ID_MISMATCH:heartbeat",
        "fatal:LEARNER_ID_MISMATCH:push",
        "fatal:NON_FINITE_VALUE:init",
        "fatal:NON_FINITE_VALUE:push",
        "fatal:UNEXPECTED_FINAL_ACK:ack_early",
        "fatal:UNEXPECTED_FINAL_ACK:ack_step",
        "fatal:WRONG_DIRECTION:PullReq",
        "fatal:WRONG_DIRECTION:Shutdown",
        "fatal:ZERO_C_STEPS:push",
        "fatal_after_cut",
        "fatal_completed_cut",
        "merge_failed",
        "early_sent",
        "early_withdrawn",
    ]
    assert [name for name in wanted if not totals.get(name)] == [], totals
    assert all(exact.get(dtype, 0) >= 3 for dtype in WireDtype), exact


# -- resume and the budget cutoff -----------------------------------------------------------------
RESUME_MODES = [Mode.NICE, Mode.SILENT, Mode.CHAOS]


@pytest.mark.parametrize("seed", seeds(45))
def test_a_crashed_syncer_resumes_from_its_last_checkpoint(seed: int) -> None:
    """spec/checkpoint.md § 4, spec/syncer.md § 1 item 1: the state rolls back to the
    checkpoint, the rounds after it run again, the learners redial with new generations."""
    simulate(seed, RESUME_MODES[seed % 3], resume=True)


@pytest.mark.parametrize("seed", seeds(45))
def test_budget_cutoff_sessions_match_the_spec(seed: int) -> None:
    """spec/closure.md § 3: cancelled rounds, the unmarked recovery checkpoint, the exits."""
    simulate(seed, RESUME_MODES[seed % 3], budget=True)


def test_the_resume_and_cutoff_schedules_reach_their_paths() -> None:
    """Guards the two simulations above: they must crash and resume (before and after the
    cut, with strays refused), and cut off complete, incomplete, late and empty-handed."""
    totals: dict[str, int] = {}
    exits: dict[str, set[int]] = {"resume": set(), "budget": set()}
    for seed in range(2000, 2036):
        for kind in ("resume", "budget"):
            world = simulate(
                seed, RESUME_MODES[seed % 3], budget=kind == "budget", resume=kind == "resume"
            )
            for name, count in world.oracle.stats.items():
                totals[name] = totals.get(name, 0) + count
            exit_ = world.coordinator.exit
            assert exit_ is not None
            exits[kind].add(exit_.code)
    wanted = [
        "crashed",
        "crashed_after_cut",
        "resumed",
        "resume_refused",
        "init_ignored",
        "budget_done",
        "budget_from_redial",
        "budget_after_cut",
        "round_cancelled",
        "cancelled_gathering",
        "cancelled_complete",
        "cutoff_complete",
        "cutoff_incomplete",
        "rejected_cancelled",
        "fatal:BUDGET_MISMATCH:budget",
        "fatal:DUPLICATE_BUDGET_DONE:budget",
        "consolidated",
    ]
    assert [name for name in wanted if not totals.get(name)] == [], totals
    assert exits == {"resume": exits["resume"] | {0}, "budget": {0, 1}}, exits
