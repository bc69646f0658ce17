"""A deterministic, in-process simulation of a syncer session: no transport, a fake clock.

:class:`Sim` owns a :class:`~yeto_sync.coordinator.Coordinator`, a fake monotonic clock and the
timers the coordinator asks for; it records every action by kind so that tests read like
scripts::

    sim = Sim(config, layout)
    a, b = sim.learner(0), sim.learner(1)
    a.connect(); b.connect()
    a.init_all(params)
    sim.run()                       # learners answer pulls until the coordinator exits

:class:`ScriptedLearner` plays one logical learner the way the protocol asks: it keeps the raw
anchor of each fragment from the last accepted BCAST (monotonic per fragment), answers a PULL
once it holds that anchor with ``local − anchor`` (here: a scripted delta), and acknowledges
the final cut once it holds the manifest and every FINAL_FRAGMENT. Automatic learners react in
:meth:`Sim.pump`; manual ones only record what they were sent.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from numpy.typing import NDArray

from yeto_proto.checkpoint import Checkpoint
from yeto_proto.constants import MergeMode, WireDtype
from yeto_proto.dtypes import decode_tensor, encode_tensor
from yeto_proto.layout import WireFragment, WireLayout
from yeto_proto.messages import (
    AnyMessage,
    BcastFragment,
    ErrorMessage,
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
    ConnId,
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
)
from yeto_sync.merge import IsoSolver

F32Array = NDArray[np.float32]

FINGERPRINT = bytes(range(32))
CONTRACT = bytes(range(100, 132))

#: (learner_id, step, fragment, numel) → the learner delta d = local − anchor it pushes.
DeltaScript = Callable[[int, int, int, int], F32Array]
#: (learner_id, step) → (c_steps, c_tokens).
CounterScript = Callable[[int, int], tuple[int, int]]


def seeded_delta(learner_id: int, step: int, fragment: int, numel: int) -> F32Array:
    """A reproducible pseudo-random delta per (learner, step)."""
    rng = np.random.default_rng([learner_id, step, fragment])
    return rng.normal(0.0, 0.1, numel).astype(np.float32)


def default_counters(learner_id: int, step: int) -> tuple[int, int]:
    return 4 + learner_id, 100 * (learner_id + 1) + step


def avg_layout(*fragments: tuple[int, ...]) -> WireLayout:
    """An avg layout with the given tensor numels per fragment."""
    return WireLayout(tuple(WireFragment(MergeMode.AVG, numels) for numels in fragments))


def initial_params(layout: WireLayout, seed: int = 7) -> list[F32Array]:
    rng = np.random.default_rng(seed)
    return [rng.normal(0.0, 1.0, f.numel).astype(np.float32) for f in layout.fragments]


def make_hello(
    learner_id: int,
    generation: int,
    layout: WireLayout,
    *,
    dtype: WireDtype = WireDtype.F32,
    fingerprint: bytes = FINGERPRINT,
    contract: bytes = CONTRACT,
    profile_hash: bytes | None = None,
    num_streams: int = 0,
) -> Hello:
    return Hello(
        learner_id=learner_id,
        generation=generation,
        dtype=dtype,
        layout=layout,
        layout_fingerprint=fingerprint,
        session_contract=contract,
        num_streams=num_streams,
        profile_hash=profile_hash,
    )


@dataclass(order=True)
class _Timer:
    at: float
    order: int
    key: str = field(compare=False)


class Sim:
    """One coordinator, a fake clock, its timers, and every action it emitted."""

    def __init__(
        self,
        config: SyncerConfig,
        layout: WireLayout,
        *,
        dtype: WireDtype = WireDtype.F32,
        checkpoint: Checkpoint | None = None,
        iso_solver: IsoSolver | None = None,
        fingerprint: bytes = FINGERPRINT,
        contract: bytes = CONTRACT,
        profile_hash: bytes | None = None,
        work_clock: Callable[[], float] | None = None,
        stream_broadcasts: bool = False,
    ) -> None:
        """``stream_broadcasts``: take the coordinator's early sends (as the daemon's driver
        does) and deliver them ahead of the actions ``handle`` returns, each once its payload
        is complete; :attr:`early` records them with the payload's progress at hand-out."""
        self.config = config
        self.layout = layout
        self.dtype = dtype
        self.fingerprint = fingerprint
        self.contract = contract
        self.profile_hash = profile_hash
        self.coordinator = Coordinator(
            config, checkpoint=checkpoint, iso_solver=iso_solver, work_clock=work_clock
        )
        self.now = 0.0
        self.actions: list[Action] = []
        self.inbox: dict[GroupKey, list[AnyMessage]] = {}
        self.admitted: dict[ConnId, AdmitGroup] = {}
        self.refused: dict[ConnId, ErrorMessage] = {}
        self.closed: dict[GroupKey, ErrorMessage | None] = {}
        self.learners: dict[int, ScriptedLearner] = {}
        self._timers: dict[str, float] = {}
        self._order = itertools.count()
        self._conns = itertools.count(1)
        #: Early sends: each with the bytes of its payload final when it was handed out.
        self.early: list[tuple[Send, int]] = []
        self._handed_out: list[Send] = []
        if stream_broadcasts:
            self.coordinator.early_sends = self._take_early

    def _take_early(self, sends: Sequence[Send]) -> None:
        for send in sends:
            assert send.progress is not None
            self.early.append((send, send.progress.ready))
            self._handed_out.append(send)

    # -- feeding ---------------------------------------------------------------------------
    def feed(self, event: Event) -> list[Action]:
        self._handed_out = []
        returned = self.coordinator.handle(event, self.now)
        # Like the transport: an early send completes only once its payload is final.
        actions: list[Action] = [
            send
            for send in self._handed_out
            if send.progress is not None and send.progress.complete
        ]
        actions += returned
        self.actions.extend(actions)
        for action in actions:
            match action:
                case Send(group=group, message=message):
                    self.inbox.setdefault(group, []).append(message)
                case AdmitGroup(conn=conn):
                    self.admitted[conn] = action
                case RefuseConnection(conn=conn, error=error):
                    self.refused[conn] = error
                case CloseGroup(group=group, error=error):
                    self.closed[group] = error
                case SetTimer(key=key, at=at):
                    self._timers[key] = at
                case CancelTimer(key=key):
                    self._timers.pop(key, None)
        return actions

    def hello(self, hello: Hello) -> tuple[ConnId, list[Action]]:
        conn = next(self._conns)
        return conn, self.feed(HelloReceived(conn, hello))

    def make_hello(self, learner_id: int, generation: int, **overrides: Any) -> Hello:
        base = make_hello(
            learner_id,
            generation,
            self.layout,
            dtype=self.dtype,
            fingerprint=self.fingerprint,
            contract=self.contract,
            profile_hash=self.profile_hash,
        )
        return replace(base, **overrides) if overrides else base

    def message(self, group: GroupKey, message: AnyMessage) -> list[Action]:
        return self.feed(MessageReceived(group, message))

    def ready(self, group: GroupKey) -> list[Action]:
        return self.feed(GroupReady(group))

    def close(self, group: GroupKey, reason: str = "peer closed") -> list[Action]:
        return self.feed(GroupClosed(group, reason))

    def fire(self, key: str) -> list[Action]:
        """Fire a pending timer now, whatever its due time (for scripted edge cases)."""
        self._timers.pop(key, None)
        return self.feed(TimerFired(key))

    # -- the clock -------------------------------------------------------------------------
    @property
    def timers(self) -> dict[str, float]:
        return dict(self._timers)

    def next_timer(self) -> tuple[str, float] | None:
        if not self._timers:
            return None
        key = min(self._timers, key=lambda k: self._timers[k])
        return key, self._timers[key]

    def advance(self, seconds: float) -> None:
        """Move the clock forward, firing due timers at their own times, in time order."""
        self.advance_to(self.now + seconds)

    def advance_to(self, when: float) -> None:
        while self.coordinator.exit is None:
            due = [_Timer(at, next(self._order), key) for key, at in self._timers.items()]
            heapq.heapify(due)
            if not due or due[0].at > when:
                break
            first = due[0]
            self.now = max(self.now, first.at)
            del self._timers[first.key]
            self.feed(TimerFired(first.key))
            self.pump()
        self.now = max(self.now, when)

    # -- learners --------------------------------------------------------------------------
    def learner(self, learner_id: int, **options: Any) -> ScriptedLearner:
        learner = ScriptedLearner(self, learner_id, **options)
        self.learners[learner_id] = learner
        return learner

    def start(
        self, learners: int | None = None, params: list[F32Array] | None = None, **options: Any
    ) -> list[ScriptedLearner]:
        """Connect learners 0..M−1 (ready) and INIT every fragment from learner 0."""
        count = self.config.learners if learners is None else learners
        crew = [self.learner(i, **options) for i in range(count)]
        for member in crew:
            member.connect()
        crew[0].init_all(initial_params(self.layout) if params is None else params)
        return crew

    def pump(self, max_rounds: int = 10_000) -> None:
        """Let automatic learners react to everything sent so far, until nothing moves."""
        for _ in range(max_rounds):
            moved = False
            for learner in list(self.learners.values()):
                if self.coordinator.exit is not None:
                    return
                moved |= learner.react()
            if not moved:
                return
        raise AssertionError("simulation does not settle")

    def run(self, *, limit_s: float = 100_000.0) -> Exit:
        """Pump and fire timers until the coordinator exits."""
        while True:
            self.pump()
            if self.coordinator.exit is not None:
                return self.coordinator.exit
            upcoming = self.next_timer()
            if upcoming is None or upcoming[1] > limit_s:
                raise AssertionError(f"simulation stuck at t={self.now}: timers {self._timers}")
            self.advance_to(upcoming[1])

    # -- recorded actions ------------------------------------------------------------------
    def of_type(self, kind: type[Any]) -> list[Any]:
        return [a for a in self.actions if isinstance(a, kind)]

    @property
    def tape(self) -> list[dict[str, Any]]:
        return [a.record for a in self.actions if isinstance(a, AppendTape)]

    @property
    def merges(self) -> list[dict[str, Any]]:
        return [r for r in self.tape if "event" not in r]

    @property
    def checkpoints(self) -> list[WriteCheckpoint]:
        return self.of_type(WriteCheckpoint)

    @property
    def exit(self) -> Exit | None:
        return self.coordinator.exit

    def sends_to(self, group: GroupKey, kind: type[Any] | None = None) -> list[Any]:
        messages = self.inbox.get(group, [])
        return [m for m in messages if kind is None or isinstance(m, kind)]

    def logs(self, text: str) -> list[Log]:
        return [a for a in self.of_type(Log) if a.text == text]

    def decode_bulk(self, data: memoryview, fragment: int) -> F32Array:
        numel = self.layout.fragments[fragment].numel
        decoded: F32Array = np.asarray(
            decode_tensor(data, self.dtype, numel, push=False), dtype=np.float32
        )
        return decoded


class ScriptedLearner:
    """One logical learner, reconnecting with fresh generations when told to."""

    def __init__(
        self,
        sim: Sim,
        learner_id: int,
        *,
        auto: bool = True,
        deltas: DeltaScript = seeded_delta,
        counters: CounterScript = default_counters,
    ) -> None:
        self.sim = sim
        self.learner_id = learner_id
        self.auto = auto
        self.deltas = deltas
        self.counters = counters
        self.generation = 0
        self.local_step = 0
        #: fragment → (version, raw anchor) from the last accepted BCAST.
        self.anchors: dict[int, tuple[int, F32Array]] = {}
        self.final: dict[int, tuple[int, F32Array]] = {}
        self.manifest: FinalManifest | None = None
        self.acked = False
        self.shut_down = False
        self.pushed: list[PushFragment] = []
        self._deferred: list[PullReq] = []
        self._read = 0

    @property
    def key(self) -> GroupKey:
        return GroupKey(self.learner_id, self.generation)

    # -- connection ------------------------------------------------------------------------
    def connect(self, generation: int | None = None, *, ready: bool = True) -> GroupKey:
        """HELLO with a fresh generation (and GroupReady); the anchors are dropped."""
        self.generation = generation if generation is not None else self.generation + 1
        self.anchors.clear()
        self.final.clear()
        self.manifest = None
        self.acked = False
        self._deferred.clear()
        self._read = 0
        conn, _ = self.sim.hello(self.sim.make_hello(self.learner_id, self.generation))
        if conn not in self.sim.admitted:
            raise AssertionError(f"HELLO refused: {self.sim.refused.get(conn)}")
        if ready:
            self.sim.ready(self.key)
        return self.key

    def disconnect(self) -> None:
        self.sim.close(self.key)

    def init_all(self, params: Iterable[F32Array]) -> None:
        for fragment, values in enumerate(params):
            data = encode_tensor(np.asarray(values, np.float32), self.sim.dtype, push=False)
            self.sim.message(self.key, InitParams(fragment, data.data))

    def heartbeat(self, local_step: int | None = None) -> None:
        if local_step is not None:
            self.local_step = local_step
        self.sim.message(self.key, Heartbeat(self.learner_id, self.local_step))

    # -- reacting --------------------------------------------------------------------------
    def unread(self) -> list[AnyMessage]:
        messages = self.sim.inbox.get(self.key, [])
        fresh = messages[self._read :]
        self._read = len(messages)
        return fresh

    def react(self) -> bool:
        if not self.auto or self.sim.coordinator.registry.get(self.key) is None:
            return False
        fresh = self.unread()
        for message in fresh:
            self.receive(message)
        answered = self._answer_deferred()
        return bool(fresh) or answered

    def receive(self, message: AnyMessage) -> None:
        match message:
            case BcastFragment(fragment_id=fragment, version=version):
                held = self.anchors.get(fragment)
                if held is None or version > held[0]:
                    self.anchors[fragment] = (
                        version,
                        self.sim.decode_bulk(message.data, fragment),
                    )
            case PullReq():
                self._deferred.append(message)
            case FinalFragment(fragment_id=fragment, version=version):
                values = np.frombuffer(message.data, dtype="<f4").astype(np.float32)
                self.final[fragment] = (version, values)
            case FinalManifest():
                self.manifest = message
            case Shutdown():
                self.shut_down = True
            case _:
                pass
        self._maybe_ack()

    def _answer_deferred(self) -> bool:
        answered = False
        waiting: list[PullReq] = []
        for pull in self._deferred:
            if pull.fragment_id not in self.anchors:
                waiting.append(pull)  # PULL overtook the BCAST: wait for the anchor
                continue
            self.sim.message(self.key, self.push_for(pull))
            answered = True
        self._deferred = waiting
        return answered

    def push_for(self, pull: PullReq, **overrides: Any) -> PushFragment:
        """The PUSH this learner sends for ``pull`` (fields overridable for scripted faults)."""
        version, _anchor = self.anchors.get(pull.fragment_id, (0, None))
        numel = self.sim.layout.fragments[pull.fragment_id].numel
        delta = self.deltas(self.learner_id, pull.global_step, pull.fragment_id, numel)
        c_steps, c_tokens = self.counters(self.learner_id, pull.global_step)
        self.local_step += c_steps
        data = encode_tensor(delta, self.sim.dtype, push=True)
        fields: dict[str, Any] = {
            "learner_id": self.learner_id,
            "fragment_id": pull.fragment_id,
            "global_step": pull.global_step,
            "round_attempt": pull.round_attempt,
            "base_version": version,
            "local_step": self.local_step,
            "c_steps": c_steps,
            "c_tokens": c_tokens,
            "data": data.data,
        }
        fields.update(overrides)
        push = PushFragment(**fields)
        self.pushed.append(push)
        return push

    def _maybe_ack(self) -> None:
        manifest = self.manifest
        if manifest is None or self.acked:
            return
        for fragment, expected in enumerate(manifest.expected_versions):
            held = self.final.get(fragment)
            if held is None or held[0] != expected:
                return
        self.acked = True
        self.sim.message(self.key, FinalAck(manifest.final_global_step))
