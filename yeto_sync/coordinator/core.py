"""The coordinator: one sequential actor, events and ``now`` in, actions out.

It reads no clock, socket, thread, random source or file. A transport feeds it
:mod:`yeto_sync.events` events with the current monotonic time and carries out the returned
actions in order before feeding the next event. Timers are asked for with ``SetTimer(key, at)``
(a later ``SetTimer`` with the same key replaces it) and come back as ``TimerFired(key)``;
a timer that fires after its purpose passed is ignored.

The pieces: :mod:`.admission` (HELLO checks, session fixation), :mod:`.registry` (groups and
generations), :mod:`.schedule` (fragment targets, pipeline, pacing, grace), :mod:`.rounds`
(members, quorum, push acceptance), :mod:`.state` (the global model), :mod:`.finalize`
(terminal delivery), :mod:`.cutoff` (the benchmark's BUDGET_DONE cutoff), :mod:`.tape`
(event-tape lines).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from yeto_proto.checkpoint import Checkpoint, refusal_for_every_hello, refusal_for_session
from yeto_proto.constants import IsoBackend, MergeMode, WireDtype
from yeto_proto.errors import ErrorCode, ProtocolError
from yeto_proto.limits import Limits
from yeto_proto.messages import (
    AnyMessage,
    BcastFragment,
    BudgetDone,
    ErrorMessage,
    FinalAck,
    Heartbeat,
    Hello,
    InitParams,
    PullReq,
    PushFragment,
)

from ..config import SyncerConfig
from ..events import (
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
    WriteFinalMarker,
    WriteFinalState,
)
from ..merge import (
    SCALAR_ISO_SOLVER,
    F32Array,
    IsoSolver,
    MergeConfig,
    MergeError,
    Response,
    merge_round,
)
from ..payload_progress import PayloadProgress
from . import tape
from .admission import Admission, Refusal, SessionIdentity
from .cutoff import CUTOFF_TIMER, BudgetCutoff, cancel_record, cutoff_record, report_record
from .finalize import Finalization
from .registry import MAX_OPEN_GENERATIONS, Registry
from .rounds import Accepted, Phase, Rejection, Round
from .schedule import (
    RETRY_DELAY_S,
    StepTimes,
    grace_window,
    launch_interval,
    pipeline_depth,
    target_fragment,
)
from .state import GlobalModel
from .tensors import (
    bcast_bf16_target,
    bcast_message,
    bcast_of_bf16,
    decode_init,
    decode_push,
    final_fragment_message,
)

EXIT_OK = 0
EXIT_FAILURE = 1

#: The syncer warns at every this many PUSHes of one learner that arrived after their round
#: committed since its last merged one (its link is slower than the quorum lets wait).
LATE_PUSH_WARNING = 3

LAUNCH_TIMER = "launch"
FINAL_ACK_TIMER = "final-ack"


def _round_timer(kind: str, step: int, attempt: int | None = None) -> str:
    return f"{kind}:{step}" if attempt is None else f"{kind}:{step}:{attempt}"


#: Carries out Sends at once, from inside :meth:`Coordinator.handle` (see ``early_sends``).
EarlySender = Callable[[Sequence[Send]], None]
#: Actions that may run after a Send that the coordinator appends later, without changing
#: anything a peer or the disk sees: an early BCAST may overtake them.
_OVERTAKABLE = (Log, AppendTape, SetTimer, CancelTimer)


def _member_fields(key: GroupKey) -> dict[str, int]:
    return {"learner_id": key.learner_id, "generation": key.generation}


@dataclass(frozen=True, slots=True)
class _StreamedBroadcast:
    """A BCAST handed out before its merge: the merge fills it and reports its progress."""

    message: BcastFragment
    progress: PayloadProgress
    #: The array the merge must write the new params into (f32 sessions), else None.
    new_params: F32Array | None
    elements_done: Callable[[int], None]


class Coordinator:
    """The syncer's state machine. Call :meth:`handle` for every event, in order."""

    def __init__(
        self,
        config: SyncerConfig,
        *,
        checkpoint: Checkpoint | None = None,
        iso_solver: IsoSolver | None = None,
        work_clock: Callable[[], float] | None = None,
    ) -> None:
        """``work_clock`` times each merge for ξ_sync (the daemon passes a monotonic clock).

        Without it a merge takes no time, so a run depends only on its events and ``now``s.
        With it, what an event does after its merges (launching the next rounds, say) happens
        that much after its ``now``.
        """
        if iso_solver is None:
            if config.iso_backend is not IsoBackend.SCALAR:
                raise ValueError(f"iso backend {config.iso_backend.name} needs an injected solver")
            iso_solver = SCALAR_ISO_SOLVER
        if iso_solver.backend is not config.iso_backend:
            raise ValueError(
                f"iso solver backend {iso_solver.backend.name} differs from the configured "
                f"{config.iso_backend.name}"
            )
        if checkpoint is not None:
            # No HELLO could make it resumable: every HELLO would be refused, forever.
            refusal = refusal_for_every_hello(checkpoint, iso_solver.backend)
            if refusal is not None:
                raise ValueError(f"the checkpoint cannot be resumed: {refusal}")
        self.config = config
        self._solver = iso_solver
        self._work_clock = work_clock
        self._merge_config = MergeConfig(
            learner_weight=config.learner_weight,
            delta_correction=config.delta_correction,
            outer_lr=config.outer_lr,
            outer_momentum=config.outer_momentum,
        )
        self._admission = Admission(
            learners=config.learners,
            profile_digest=config.profile().digest(),
            require_profile_binding=config.require_profile_binding,
        )
        self._registry = Registry()
        self._step_times = StepTimes()
        self._checkpoint = checkpoint
        self._model: GlobalModel | None = None
        self._iso_in_process = False
        self._limits: Limits | None = None
        #: The initial broadcast went out and rounds may launch.
        self._started = False
        self._next_step = 1
        #: Per learner id: PUSHes that came after their round committed, since its last merged one.
        self._late_pushes: dict[int, int] = {}
        #: Launched, not yet committed rounds, in ascending t.
        self._rounds: dict[int, Round] = {}
        self._last_launch_at: float | None = None
        #: When the launch timer is set to fire (a round waits for its pacing interval).
        self._launch_due: float | None = None
        #: This event changed a step-time estimate or the connected learners.
        self._pacing_changed = False
        #: ξ_sync: the previous commit's merge and outer step, as the work clock timed them.
        self._last_sync_s = 0.0
        #: The time the merges of the event being handled took (by the work clock).
        self._event_work_s = 0.0
        self._bcasts: dict[int, BcastFragment] = {}
        self._final: Finalization | None = None
        self._cutoff = (
            None
            if config.learner_budget_steps is None
            else BudgetCutoff(budget_steps=config.learner_budget_steps, learners=config.learners)
        )
        self._exit: Exit | None = None
        #: Set by a driver that runs :meth:`handle` off its event loop: a commit then hands
        #: it the round's BCASTs before the merge, gated by the merge's progress, so the
        #: broadcast streams out while the outer step still runs. ``None``: every action is
        #: returned by :meth:`handle`, as in simulations.
        self.early_sends: EarlySender | None = None

    # -- read-only views (tests, transport, CLI) -------------------------------------------
    @property
    def exit(self) -> Exit | None:
        return self._exit

    @property
    def session(self) -> SessionIdentity | None:
        return self._admission.session

    @property
    def model(self) -> GlobalModel | None:
        return self._model

    @property
    def global_step(self) -> int:
        return 0 if self._model is None else self._model.global_step

    @property
    def solves_iso_in_process(self) -> bool:
        """Whether a commit may run an SVD on the calling thread (an iso fragment with the
        scalar backend): minutes for a large matrix, which no signal can interrupt."""
        return self._iso_in_process

    @property
    def rounds_in_flight(self) -> tuple[Round, ...]:
        return tuple(self._rounds.values())

    @property
    def finalization(self) -> Finalization | None:
        return self._final

    @property
    def cutoff(self) -> BudgetCutoff | None:
        return self._cutoff

    @property
    def registry(self) -> Registry:
        return self._registry

    @property
    def step_times(self) -> StepTimes:
        return self._step_times

    # -- the one entry point ---------------------------------------------------------------
    def handle(self, event: Event, now: float) -> list[Action]:
        """Apply one event at time ``now``; return the actions to carry out, in order."""
        out: list[Action] = []
        if self._exit is not None:
            return out
        self._pacing_changed = False
        self._event_work_s = 0.0
        match event:
            case HelloReceived(conn=conn, hello=hello):
                self._on_hello(conn, hello, out)
            case GroupReady(group=group):
                self._on_group_ready(group, now, out)
            case MessageReceived(group=group, message=message, tensor_finite=finite):
                self._on_message(group, message, finite, now, out)
            case GroupClosed(group=group, reason=reason):
                self._on_group_closed(group, reason, now, out)
            case TimerFired(key=key):
                self._on_timer(key, now, out)
        if self._pacing_changed:
            # After the whole event: a PUSH is judged against the rounds launched before it.
            self._pacing_changed = False
            self._recheck_pacing(self._after_work(now), out)
        return out

    def _after_work(self, now: float) -> float:
        """The event's ``now`` advanced by its merges: a round launched after a commit is
        launched (its PULLs leave) once the merge is done, and its ξ_quorum, quorum deadline
        and pacing count from then (the merge is ξ_sync's, not counted twice)."""
        return now + self._event_work_s

    # -- admission -------------------------------------------------------------------------
    def _on_hello(self, conn: ConnId, hello: Hello, out: list[Action]) -> None:
        key = GroupKey(hello.learner_id, hello.generation)
        refusal = self._admission.check(hello, generation_seen=self._registry.was_admitted(key))
        if refusal is not None:
            out.append(RefuseConnection(conn, refusal.error()))
            out.append(
                Log(
                    "warning",
                    "HELLO refused",
                    {"conn": conn, **_member_fields(key), **_why(refusal)},
                    # Without a HELLO key anyone who reaches the port can cause this line.
                    throttled=True,
                )
            )
            return
        if self._admission.session is None and not self._open_session(conn, hello, out):
            return
        assert self._limits is not None
        current = self._registry.current_of(key.learner_id)
        self._registry.admit(key, conn, hello.num_streams)
        out.append(AdmitGroup(conn, key, hello.num_streams, self._limits))
        fields: dict[str, Any] = {
            "conn": conn,
            **_member_fields(key),
            "num_streams": hello.num_streams,
        }
        if current is not None:
            # Superseded for future launches from now on, though the new one is not ready.
            fields["supersedes_generation"] = current.generation
            self._pacing_changed = True  # the slowest learner may be left out of launches
        out.append(Log("info", "group admitted", fields))
        for old in self._registry.surplus_of(key.learner_id):
            # Without ERROR: it may be a live learner's, which redials after a close.
            self._registry.remove(old)
            out.append(CloseGroup(old, None))
            out.append(
                Log(
                    "warning",
                    "old generation closed",
                    {**_member_fields(old), "open_generations_cap": MAX_OPEN_GENERATIONS},
                )
            )

    def _open_session(self, conn: ConnId, hello: Hello, out: list[Action]) -> bool:
        """First accepted HELLO: check resume eligibility, then fix the session."""
        checkpoint = self._checkpoint
        if checkpoint is not None:
            # Checks 1 to 4 passed when the coordinator was built (refusal_for_every_hello).
            reason = refusal_for_session(
                checkpoint,
                fingerprint=bytes(hello.layout_fingerprint),
                wire_layout=hello.layout,
                session_contract=bytes(hello.session_contract),
            )
            if reason is not None:
                # This peer's session is not the checkpoint's: refuse it and keep waiting for
                # one that is. A stray learner of another run must not end a resumed run.
                refusal = Refusal(
                    ErrorCode.CKPT_RESUME_INELIGIBLE,
                    f"the syncer's checkpoint cannot resume this session: {reason}",
                )
                out.append(RefuseConnection(conn, refusal.error()))
                out.append(
                    Log(
                        "warning",
                        "HELLO refused: the checkpoint cannot resume its session",
                        {
                            "conn": conn,
                            **_member_fields(GroupKey(hello.learner_id, hello.generation)),
                            **_why(refusal),
                            "check": reason.check,
                        },
                        throttled=True,
                    )
                )
                return False
        session = self._admission.fix(hello)
        self._limits = Limits.of(session.dtype, session.layout)
        model = GlobalModel(session.layout, self.config.learners)
        if checkpoint is not None:
            model.install(checkpoint)
            self._checkpoint = None  # installed; the model owns the arrays now
            out.append(AppendTape(tape.resumed_record(model.global_step, model.versions)))
        self._model = model
        # Asked by the driver at every PUSH: the layout is fixed from here on.
        self._iso_in_process = self._solver.backend is IsoBackend.SCALAR and any(
            slot.geometry.merge_mode is MergeMode.ISO for slot in model.fragments
        )
        self._next_step = model.global_step + 1
        out.append(
            Log(
                "info",
                "session fixed",
                {
                    "dtype": session.dtype.name.lower(),
                    "fragments": model.num_fragments,
                    "fingerprint": session.fingerprint.hex(),
                    "profile_bound": session.profile_hash is not None,
                    "resumed_global_step": model.global_step if checkpoint is not None else None,
                },
            )
        )
        return True

    def _on_group_ready(self, key: GroupKey, now: float, out: list[Action]) -> None:
        group = self._registry.get(key)
        if group is None or group.ready:
            return
        superseded = self._registry.mark_ready(key)
        fields: dict[str, Any] = {**_member_fields(key), "current": self._registry.is_current(key)}
        if superseded is not None:
            fields["superseded_generation"] = superseded.generation
        # A session starts only with every learner id: say which ones it still waits for
        # (after a resume, a learner that already got its SHUTDOWN never comes back).
        if not self._started and (waits := self._registry.missing_learners(self.config.learners)):
            fields["session_waits_for"] = waits
        out.append(Log("info", "group ready", fields))
        model = self._require_model()
        for fragment, slot in enumerate(model.fragments):
            if slot.initialized:
                self._broadcast(fragment, (key,), out)
        if self._final is not None and self._final.wants_cut(key):
            out.extend(self._final.queue(key))
            out.append(Log("info", "final cut queued", _member_fields(key)))
        self._advance(now, out)

    def _on_group_closed(self, key: GroupKey, reason: str, now: float, out: list[Action]) -> None:
        if self._registry.get(key) is None:
            return
        current = self._registry.current_of(key.learner_id)
        held_back = current is not None and self._registry.attaching_newer(current)
        was_current = self._registry.remove(key)
        # A newer generation closed before it was ready: launches capture the current one again.
        resumed = (
            held_back
            and not was_current
            and current is not None
            and not self._registry.attaching_newer(current)
        )
        out.append(
            Log(
                "info",
                "group closed",
                {**_member_fields(key), "was_current": was_current, "reason": reason},
            )
        )
        if was_current:
            self._finish_if_delivered(out)  # its missing re-ACK no longer holds the cut up
            self._pacing_changed = True  # the slowest learner may have left
        elif resumed:
            self._pacing_changed = True
            self._advance(now, out)

    # -- messages --------------------------------------------------------------------------
    def _on_message(
        self,
        key: GroupKey,
        message: AnyMessage,
        tensor_finite: bool | None,
        now: float,
        out: list[Action],
    ) -> None:
        if self._registry.get(key) is None:
            return  # already closed by us; its last frames do not matter
        match message:
            case PushFragment():
                self._on_push(key, message, tensor_finite, now, out)
            case Heartbeat():
                self._on_heartbeat(key, message, now, out)
            case InitParams():
                self._on_init(key, message, tensor_finite, now, out)
            case FinalAck():
                self._on_final_ack(key, message, out)
            case BudgetDone():
                self._on_budget_done(key, message, now, out)
            case _:
                self._close_group(
                    key,
                    Refusal(
                        ErrorCode.WRONG_DIRECTION, f"a learner may not send {message.TYPE.name}"
                    ),
                    out,
                )

    def _on_init(
        self,
        key: GroupKey,
        init: InitParams,
        tensor_finite: bool | None,
        now: float,
        out: list[Action],
    ) -> None:
        if key.learner_id != 0:
            self._close_group(
                key,
                Refusal(ErrorCode.INIT_NOT_ALLOWED, f"learner {key.learner_id} may not INIT"),
                out,
            )
            return
        model, session = self._require_model(), self._require_session()
        if init.fragment_id >= model.num_fragments:
            self._close_group(
                key, Refusal(ErrorCode.BAD_FRAGMENT_ID, f"INIT fragment {init.fragment_id}"), out
            )
            return
        slot = model.fragments[init.fragment_id]
        if slot.initialized:
            out.append(
                Log(
                    "info",
                    "INIT ignored: fragment already initialized",
                    {"fragment": init.fragment_id, "version": slot.version},
                )
            )
            return
        try:
            params = decode_init(
                init.data, session.dtype, slot.geometry.numel, finite=tensor_finite
            )
        except ProtocolError as exc:
            self._close_group(
                key, Refusal(exc.code, f"INIT fragment {init.fragment_id}: {exc.detail}"), out
            )
            return
        model.initialize(init.fragment_id, params)
        out.append(Log("info", "fragment initialized", {"fragment": init.fragment_id}))
        self._advance(now, out)

    def _on_heartbeat(self, key: GroupKey, beat: Heartbeat, now: float, out: list[Action]) -> None:
        if beat.learner_id != key.learner_id:
            self._close_group(key, _id_mismatch("HEARTBEAT", beat.learner_id, key), out)
            return
        if self._registry.is_current(key):
            self._step_times.observe(key.learner_id, beat.local_step, now)
            self._pacing_changed = True

    def _count_late(self, key: GroupKey, push: PushFragment, out: list[Action]) -> None:
        """Count a PUSH that came after its round committed, and warn when they keep coming:
        under a small ``--quorum`` a learner on a slower link than the others is otherwise
        left out of every merge with nothing but rejections (info lines) to show for it.
        Counts since the learner's last accepted PUSH (:meth:`_on_push` clears it)."""
        count = self._late_pushes.get(key.learner_id, 0) + 1
        self._late_pushes[key.learner_id] = count
        if count % LATE_PUSH_WARNING:
            return
        advice = (
            f"under --quorum {self.config.quorum} a learner slower than the first "
            f"{self.config.quorum} to answer is left out (--quorum {self.config.learners} "
            "waits for all)"
            if self.config.quorum < self.config.learners
            else "its rounds committed without it after a quorum timeout or a reconnect"
        )
        out.append(
            Log(
                "warning",
                f"a learner's PUSHes keep arriving after their rounds committed, so none of "
                f"them was merged: {advice}",
                {
                    **_member_fields(key),
                    "late_pushes": count,
                    "step": push.global_step,
                    "quorum": self.config.quorum,
                },
                throttled=True,
            )
        )

    def _on_push(
        self,
        key: GroupKey,
        push: PushFragment,
        tensor_finite: bool | None,
        now: float,
        out: list[Action],
    ) -> None:
        if push.learner_id != key.learner_id:
            self._close_group(key, _id_mismatch("PUSH", push.learner_id, key), out)
            return
        if push.c_steps == 0:
            self._close_group(key, Refusal(ErrorCode.ZERO_C_STEPS, "PUSH with c_steps 0"), out)
            return
        if self._registry.is_current(key):
            self._step_times.observe(key.learner_id, push.local_step, now)
            self._pacing_changed = True
        target = self._rounds.get(push.global_step)
        rejection = (
            Rejection(ErrorCode.PUSH_OUT_OF_ROUND, f"no round {push.global_step} is in flight")
            if target is None
            else target.judge(push, key, self.config.max_base_lag)
        )
        if target is None and push.global_step < self._next_step:
            self._count_late(key, push, out)  # launched, no longer in flight: it committed
        if rejection is not None:
            out.append(AppendTape(tape.rejection_record(push, key, rejection)))
            out.append(
                Log(
                    "info",
                    "PUSH rejected",
                    {
                        **_member_fields(key),
                        "step": push.global_step,
                        "attempt": push.round_attempt,
                        "code": rejection.code.value,
                        "reason": rejection.detail,
                    },
                    # Every rejection is on the tape; stderr gets one line per code and period
                    # (a learner repeating a stale PUSH in a loop wrote a line each).
                    throttled=True,
                )
            )
            return
        assert target is not None
        model, session = self._require_model(), self._require_session()
        try:
            pushed = decode_push(
                push.data,
                session.dtype,
                model.fragments[target.fragment].geometry.numel,
                finite=tensor_finite,
            )
        except ProtocolError as exc:
            self._close_group(
                key, Refusal(exc.code, f"PUSH for round {push.global_step}: {exc.detail}"), out
            )
            return
        self._late_pushes.pop(key.learner_id, None)  # merged again: the late count restarts
        response = Response(key.learner_id, key.generation, push.c_steps, push.c_tokens, pushed)
        staleness = target.launch_version - push.base_version
        target.accept(Accepted(response, push.base_version, staleness, now), key)
        out.append(
            Log(
                "debug",
                "PUSH accepted",
                {
                    **_member_fields(key),
                    "step": target.step,
                    "attempt": target.attempt,
                    "staleness": staleness,
                    "answered": target.answered,
                    "members": len(target.members),
                },
            )
        )
        if target.all_answered:
            self._complete(target, out)
        elif target.has_quorum and target.grace_s is None:
            self._open_grace(target, now, out)
            if target.phase is not Phase.COMPLETE:
                return
        else:
            return
        self._advance(now, out)

    def _on_final_ack(self, key: GroupKey, ack: FinalAck, out: list[Action]) -> None:
        final = self._final
        if final is None:
            early = Refusal(ErrorCode.UNEXPECTED_FINAL_ACK, "FINAL_ACK before the final cut")
            self._close_group(key, early, out)
            return
        refusal = final.judge_ack(key, ack)
        if refusal is not None:
            self._close_group(key, refusal, out)
            return
        if not final.accept(key):
            out.append(Log("info", "FINAL_ACK repeated; first one stands", _member_fields(key)))
            return
        out.append(
            Log(
                "info",
                "FINAL_ACK accepted",
                {**_member_fields(key), "pending": sorted(final.pending)},
            )
        )
        self._finish_if_delivered(out)

    def _finish_if_delivered(self, out: list[Action]) -> None:
        """SHUTDOWN and exit 0 once every frozen learner's ACK is in (see :mod:`.finalize`)."""
        final = self._final
        if final is not None and final.complete(self._registry.is_current):
            self._finalized(final, out)

    def _finalized(self, final: Finalization, out: list[Action]) -> None:
        """SHUTDOWN to every open generation whose ACK stands, then exit 0."""
        out.extend(final.shutdown_sends(self._registry.is_open))
        out.append(CancelTimer(FINAL_ACK_TIMER))
        self._finish(EXIT_OK, f"finalized at global step {final.final_step}", out)

    def _on_budget_done(
        self, key: GroupKey, report: BudgetDone, now: float, out: list[Action]
    ) -> None:
        if self.config.learner_budget_steps is None:
            refusal = Refusal(
                ErrorCode.BUDGET_NOT_CONFIGURED,
                "BUDGET_DONE needs --learner-budget-steps on the syncer",
            )
            self._close_group(key, refusal, out)
            return
        self._on_budget_cutoff(key, report, now, out)

    def _on_budget_cutoff(
        self, key: GroupKey, report: BudgetDone, now: float, out: list[Action]
    ) -> None:
        """A BUDGET_DONE under a configured budget (see :mod:`.cutoff`)."""
        cutoff = self._cutoff
        assert cutoff is not None
        refusal = cutoff.judge(key, report)
        if refusal is not None:
            self._close_group(key, refusal, out)
            return
        if self._final is not None:
            # The ordinary rounds ran out first: the terminal path owns the run now.
            out.append(Log("info", "BUDGET_DONE after the final cut; ignored", _member_fields(key)))
            return
        first = cutoff.accept(key, now, float(self.config.final_ack_timeout))
        out.append(AppendTape(report_record(key, report, cutoff.missing)))
        out.append(
            Log(
                "info",
                "BUDGET_DONE accepted",
                {**_member_fields(key), "missing": cutoff.missing},
            )
        )
        if first:
            self._cancel_rounds(out)
            assert cutoff.deadline is not None
            out.append(SetTimer(CUTOFF_TIMER, cutoff.deadline))
        if cutoff.complete:
            out.append(CancelTimer(CUTOFF_TIMER))
            self._close_cutoff(out)

    def _cancel_rounds(self, out: list[Action]) -> None:
        """The first report: no more launches; every uncommitted round is cancelled whole."""
        out.append(CancelTimer(LAUNCH_TIMER))
        self._launch_due = None
        for cancelled in self._rounds.values():
            out.append(CancelTimer(_round_timer("quorum", cancelled.step, cancelled.attempt)))
            out.append(CancelTimer(_round_timer("grace", cancelled.step, cancelled.attempt)))
            out.append(CancelTimer(_round_timer("retry", cancelled.step)))
            out.append(AppendTape(cancel_record(cancelled)))
        out.append(
            Log(
                "info",
                "budget cutoff: issuance closed",
                {
                    "global_step": self.global_step,
                    "cancelled_rounds": [r.step for r in self._rounds.values()],
                },
            )
        )
        self._rounds.clear()
        self._next_step = self.global_step + 1

    def _close_cutoff(self, out: list[Action]) -> None:
        """Write the committed prefix as an unmarked recovery checkpoint, then exit.

        Exit 0 only when every configured learner reported; the checkpoint is never marked
        final and no final cut or SHUTDOWN is sent.
        """
        cutoff = self._cutoff
        assert cutoff is not None
        model, session = self._model, self._admission.session
        if model is None or session is None or not model.all_initialized:
            self._fail("budget cutoff before every fragment was initialized: nothing to save", out)
            return
        if not self.config.checkpoint_enabled:
            self._fail("the budget cutoff needs --checkpoint-path for its recovery checkpoint", out)
            return
        # ``final`` asks for the terminal write path (the iso pool is drained first); the
        # cutoff never writes the final marker.
        out.append(WriteCheckpoint(self._snapshot(session), final=True, recovery=True))
        out.append(AppendTape(cutoff_record(cutoff, model.global_step, model.versions)))
        if cutoff.complete:
            self._finish(
                EXIT_OK,
                f"budget cutoff at global step {model.global_step}: every learner reported "
                f"{cutoff.budget_steps} steps; unmarked recovery checkpoint written",
                out,
            )
        else:
            self._fail(
                f"budget cutoff incomplete: no BUDGET_DONE from learners {cutoff.missing} "
                f"within {self.config.final_ack_timeout} s; unmarked recovery checkpoint at "
                f"global step {model.global_step}",
                out,
            )

    # -- timers ----------------------------------------------------------------------------
    def _on_timer(self, key: str, now: float, out: list[Action]) -> None:
        kind, _, rest = key.partition(":")
        if kind == LAUNCH_TIMER:
            self._launch_due = None
            self._advance(now, out)
            return
        if kind == FINAL_ACK_TIMER:
            self._on_final_deadline(out)
            return
        if kind == CUTOFF_TIMER:
            if self._cutoff is not None and self._cutoff.closed:
                self._close_cutoff(out)
            return
        parts = rest.split(":")
        try:
            numbers = [int(p) for p in parts]
        except ValueError:
            return
        target = self._rounds.get(numbers[0])
        if target is None:
            return
        if kind == "retry" and len(numbers) == 1 and target.phase is Phase.WAITING:
            self._retry(target, now, out, waited=True)
        elif len(numbers) == 2 and target.attempt == numbers[1]:
            if target.phase is not Phase.GATHERING:
                return
            if kind == "grace" and target.has_quorum:
                self._complete(target, out)
                self._advance(now, out)
            elif kind == "quorum" and not target.has_quorum:
                self._discard(target, now, out)

    def _on_final_deadline(self, out: list[Action]) -> None:
        final = self._final
        if final is None:
            return
        if final.complete(self._registry.is_current):
            self._finalized(final, out)  # completed without an event that re-checked it
            return
        pending = sorted(final.pending)
        if not pending:
            # Every learner's ACK stands; only a reconnected generation's repeat is missing.
            awaited = final.awaited(self._registry.is_current)
            out.append(
                Log(
                    "warning",
                    "re-ACK missing from a reconnected generation; the earlier ACK stands",
                    {"members": [_member_fields(group) for group in awaited]},
                )
            )
            self._finalized(final, out)
            return
        out.extend(final.shutdown_sends(self._registry.is_open))
        self._fail(
            f"FINAL_ACK missing from learners {pending} after "
            f"{self.config.final_ack_timeout} s (the final checkpoint is intact)",
            out,
        )

    # -- rounds ----------------------------------------------------------------------------
    def _advance(self, now: float, out: list[Action]) -> None:
        """Commit what can commit, start the session, launch rounds, finalize: in that order."""
        self._commit_ready(now, out)
        if self._exit is not None:
            return
        now = self._after_work(now)
        self._maybe_start(out)
        self._launch_rounds(now, out)
        self._maybe_finalize(now, out)

    def _maybe_start(self, out: list[Action]) -> None:
        model = self._model
        if self._started or model is None or not model.all_initialized:
            return
        if self._registry.connected_learners < self.config.learners:
            return
        self._started = True
        members = self._registry.current_members()
        for fragment in range(model.num_fragments):
            self._broadcast(fragment, members, out)
        out.append(
            Log(
                "info",
                "session started",
                {"learners": len(members), "versions": list(model.versions)},
            )
        )

    def _recheck_pacing(self, now: float, out: list[Action]) -> None:
        """A launch waiting for its pacing interval, after the step-time estimates or the
        connected learners changed: the interval is measured again (spec/syncer.md § 3)."""
        if self._launch_due is not None and self._exit is None:
            self._launch_rounds(now, out)

    def _launch_rounds(self, now: float, out: list[Action]) -> None:
        if not self._started or self._final is not None or self._issuance_closed:
            return
        model = self._require_model()
        depth = pipeline_depth(self.config.pipeline, model.num_fragments)
        while self._next_step <= self.config.total_steps and len(self._rounds) < depth:
            members = self._registry.launch_members()
            if not members:
                return  # a GroupReady will bring us back
            if self._last_launch_at is not None:
                slowest = self._step_times.slowest(m.learner_id for m in members)
                due = self._last_launch_at + launch_interval(
                    self.config, slowest, model.num_fragments
                )
                if now < due:
                    if due != self._launch_due:
                        out.append(SetTimer(LAUNCH_TIMER, due))
                        self._launch_due = due
                    return
            self._launch_due = None
            step = self._next_step
            fragment = target_fragment(step, model.num_fragments)
            launched = Round.launch(
                step=step,
                fragment=fragment,
                attempt=1,
                members=members,
                quorum=self.config.quorum,
                now=now,
                version=model.fragments[fragment].version,
            )
            self._rounds[step] = launched
            self._next_step = step + 1
            self._last_launch_at = now
            self._issue_pulls(launched, now, out)

    def _issue_pulls(self, launched: Round, now: float, out: list[Action]) -> None:
        pull = PullReq(launched.fragment, launched.step, launched.attempt)
        out.extend(Send(member, pull) for member in launched.members)
        out.append(
            SetTimer(
                _round_timer("quorum", launched.step, launched.attempt),
                now + self.config.quorum_timeout_s,
            )
        )
        out.append(
            Log(
                "info",
                "round launched",
                {
                    "step": launched.step,
                    "fragment": launched.fragment,
                    "attempt": launched.attempt,
                    "quorum": launched.quorum,
                    "members": tape.members(launched.members),
                    "base_version": launched.launch_version,
                },
            )
        )

    def _open_grace(self, target: Round, now: float, out: list[Action]) -> None:
        """K just answered: wait the adaptive grace window, or complete if it is empty."""
        slowest = self._step_times.slowest(m.learner_id for m in target.members)
        grace = grace_window(self.config, slowest, target.quorum_s, self._last_sync_s)
        target.grace_s = grace
        if grace <= 0.0:
            self._complete(target, out)
        else:
            out.append(SetTimer(_round_timer("grace", target.step, target.attempt), now + grace))

    def _complete(self, target: Round, out: list[Action]) -> None:
        target.complete()
        out.append(CancelTimer(_round_timer("quorum", target.step, target.attempt)))
        if target.grace_s is not None and target.grace_s > 0.0:
            out.append(CancelTimer(_round_timer("grace", target.step, target.attempt)))

    def _discard(self, target: Round, now: float, out: list[Action]) -> None:
        out.append(AppendTape(tape.discard_record(target, target.accepted)))
        out.append(
            Log(
                "warning",
                "quorum deadline missed; attempt discarded",
                {
                    "step": target.step,
                    "attempt": target.attempt,
                    "answered": target.answered,
                    "quorum": target.quorum,
                },
            )
        )
        target.discard()
        self._retry(target, now, out, waited=False)

    def _retry(self, target: Round, now: float, out: list[Action], *, waited: bool) -> None:
        """Attempt + 1 with the learners connected now (PINNED: "retry after 1 s if fewer than
        K are connected"): with fewer than the discarded attempt's K it first gives them one
        second to come back, then runs with those there, K shrinking as at a launch. A
        learner lost for good therefore never stalls the run; with nobody connected it waits.
        """
        members = self._registry.launch_members()
        if not members or (len(members) < target.quorum and not waited):
            out.append(SetTimer(_round_timer("retry", target.step), now + RETRY_DELAY_S))
            return
        version = self._require_model().fragments[target.fragment].version
        target.retry(members, self.config.quorum, now, version)
        self._issue_pulls(target, now, out)

    # -- commit ----------------------------------------------------------------------------
    def _commit_ready(self, now: float, out: list[Action]) -> None:
        """Commit completed rounds strictly in ascending t; stop at the first one still open."""
        while self._rounds:
            step, head = next(iter(self._rounds.items()))
            if head.phase is not Phase.COMPLETE or not self._commit(head, now, out):
                return
            del self._rounds[step]

    def _commit(self, done: Round, now: float, out: list[Action]) -> bool:
        model, session = self._require_model(), self._require_session()
        slot = model.fragments[done.fragment]
        params, momentum = slot.arrays()
        merge_started = self._work_clock() if self._work_clock is not None else 0.0
        bcast_bf16 = bcast_bf16_target(session.dtype, slot.geometry.numel, model.arrays.take_bytes)
        streamed = self._stream_broadcast(done, bcast_bf16, out)
        try:
            merged = merge_round(
                slot.geometry,
                [accepted.response for accepted in done.accepted.values()],
                params,
                momentum,
                model.ledger,
                self._merge_config,
                self._solver,
                model.arrays.take,
                bcast_bf16,
                new_params=None if streamed is None else streamed.new_params,
                on_progress=None if streamed is None else streamed.elements_done,
            )
        except BaseException as exc:
            if streamed is not None:
                streamed.progress.withdraw()
            if not isinstance(exc, MergeError):
                raise
            reason = f"round {done.step} (fragment {done.fragment}) failed to commit: {exc}"
            out.append(AppendTape(tape.failure_record(done, str(exc))))
            self._fail(reason, out)
            return False
        # ξ_sync (pinned): the merge and outer step; not the wait for lower rounds to commit.
        sync_s = 0.0
        if self._work_clock is not None:
            sync_s = max(self._work_clock() - merge_started, 0.0)
        self._event_work_s += sync_s
        model.commit(done.step, done.fragment, merged)
        self._last_sync_s = sync_s
        self._bcasts.pop(done.fragment, None)
        if streamed is not None:
            streamed.progress.finish()  # its last byte was held back until now
            self._bcasts[done.fragment] = streamed.message
        elif bcast_bf16 is not None:  # encoded by the merge pass itself
            self._bcasts[done.fragment] = bcast_of_bf16(done.fragment, done.step, bcast_bf16)
        # Taped before the checkpoint: a stop (or a failed write) between the two then only
        # repeats the line after a resume, where a line after the checkpoint would be lost for
        # a step that the checkpoint covers and no resumed run redoes.
        record = tape.merge_record(
            done, merged, sync_s=sync_s, merge_mode=slot.geometry.merge_mode.name.lower()
        )
        out.append(AppendTape(record))
        if self._checkpoints_at(done.step):
            # Durable before the broadcast below leaves (the transport runs actions in order).
            out.append(WriteCheckpoint(self._snapshot(session)))
        self._broadcast(done.fragment, self._registry.current_members(), out)
        if merged.weights and not sum(merged.weights) > 0.0:
            # Pinned: Δ = 0 and the outer step still runs. Almost surely a learner bug (a
            # training loop that reports no tokens), so it must not pass unnoticed.
            out.append(
                Log(
                    "warning",
                    "round weighs nothing",
                    {
                        "step": done.step,
                        "fragment": done.fragment,
                        "reason": "every response has c_tokens = 0: the merge moved only "
                        "momentum; do the learners report their tokens?",
                    },
                )
            )
        out.append(
            Log(
                "info",
                "round committed",
                {
                    "step": done.step,
                    "fragment": done.fragment,
                    "attempt": done.attempt,
                    "responders": len(merged.responses),
                    "gnorm": merged.gnorm,
                },
            )
        )
        return True

    def _stream_broadcast(
        self, done: Round, bcast_bf16: NDArray[np.uint16] | None, out: list[Action]
    ) -> _StreamedBroadcast | None:
        """Hand round ``done``'s BCASTs to ``early_sends`` before its merge runs, if allowed.

        Not when nothing would stream it, when this commit writes a checkpoint (durable before
        its broadcast leaves) or when an action already queued must not be overtaken (a frame
        to a learner, a checkpoint of an earlier commit). The merge writes the payload — the
        new params in an f32 session, their bf16 bits otherwise — and advances the progress
        block by block, holding back the last byte until the commit is done, so no learner can
        complete a BCAST of a round that fails to commit.
        """
        sender = self.early_sends
        if sender is None or self._checkpoints_at(done.step):
            return None
        if not all(isinstance(action, _OVERTAKABLE) for action in out):
            return None
        if bcast_bf16 is None and sys.byteorder != "little":
            return None  # the f32 BCAST would be a byte-swapped copy, made before the merge
        members = self._registry.current_members()
        targets = self._claim_bcast_targets(members, done.fragment, done.step)
        if not targets:
            return None
        model = self._require_model()
        numel = model.fragments[done.fragment].geometry.numel
        new_params: F32Array | None = None
        if bcast_bf16 is not None:
            message = bcast_of_bf16(done.fragment, done.step, bcast_bf16)
            itemsize = bcast_bf16.itemsize
        else:  # the payload is a view of the new params themselves
            new_params = model.arrays.take(numel)
            message = bcast_message(done.fragment, done.step, new_params, WireDtype.F32)
            itemsize = new_params.itemsize
        nbytes = numel * itemsize
        progress = PayloadProgress(nbytes)
        held_back = max(nbytes - 1, 0)

        def elements_done(count: int) -> None:
            progress.advance(min(count * itemsize, held_back))

        sender([Send(key, message, progress) for key in targets])
        return _StreamedBroadcast(message, progress, new_params, elements_done)

    def _checkpoints_at(self, step: int) -> bool:
        """Whether the commit of ``step`` writes a checkpoint (before its broadcast)."""
        config = self.config
        return config.checkpoint_enabled and step % config.checkpoint_every == 0

    def _broadcast(self, fragment: int, targets: tuple[GroupKey, ...], out: list[Action]) -> None:
        """BCAST the fragment's current version to each ready target that lacks it."""
        model, session = self._require_model(), self._require_session()
        slot = model.fragments[fragment]
        params, _ = slot.arrays()
        message = self._bcasts.get(fragment)
        if message is None or message.version != slot.version:
            message = bcast_message(
                fragment, slot.version, params, session.dtype, model.arrays.take_bytes
            )
            self._bcasts[fragment] = message
        for key in self._claim_bcast_targets(targets, fragment, slot.version):
            out.append(Send(key, message))

    def _claim_bcast_targets(
        self, targets: Iterable[GroupKey], fragment: int, version: int
    ) -> list[GroupKey]:
        """The ready targets still lacking ``version`` of ``fragment``, now marked as sent it."""
        claimed = []
        for key in targets:
            group = self._registry.get(key)
            if group is None or not group.ready:
                continue
            if group.bcast_versions.get(fragment) == version:
                continue
            group.bcast_versions[fragment] = version
            claimed.append(key)
        return claimed

    # -- finalization ----------------------------------------------------------------------
    def _maybe_finalize(self, now: float, out: list[Action]) -> None:
        if self._final is not None or not self._started or self._issuance_closed:
            return
        if self._next_step <= self.config.total_steps or self._rounds:
            return
        model, session = self._require_model(), self._require_session()
        members = self._registry.current_members()
        frozen = frozenset(m.learner_id for m in members)
        snapshot = self._snapshot(session)
        if self.config.checkpoint_enabled:
            out.append(WriteCheckpoint(snapshot, final=True))
            if self.config.mark_final_checkpoint:
                out.append(WriteFinalMarker(model.global_step))
        if self.config.final_state is not None:
            out.append(WriteFinalState(snapshot))
        cut = [
            final_fragment_message(index, slot.version, slot.arrays()[0])
            for index, slot in enumerate(model.fragments)
        ]
        final = Finalization(
            final_step=model.global_step,
            fragments=cut,
            frozen=frozen,
            deadline=now + self.config.final_ack_timeout,
        )
        self._final = final
        out.append(AppendTape(tape.final_cut_record(final.final_step, model.versions, frozen)))
        out.append(
            Log(
                "info",
                "final cut",
                {"global_step": final.final_step, "frozen_learners": sorted(frozen)},
            )
        )
        if not frozen:
            self._fail("no live learner at the final cut to deliver it to", out)
            return
        for member in members:
            out.extend(final.queue(member))
        out.append(SetTimer(FINAL_ACK_TIMER, final.deadline))

    # -- helpers ---------------------------------------------------------------------------
    @property
    def _issuance_closed(self) -> bool:
        """The budget cutoff began: this process launches, commits and finalizes nothing more."""
        return self._cutoff is not None and self._cutoff.closed

    def _snapshot(self, session: SessionIdentity) -> Checkpoint:
        return self._require_model().snapshot(
            iso_backend=self._solver.backend,
            fingerprint=session.fingerprint,
            contract=session.contract,
        )

    def _close_group(self, key: GroupKey, refusal: Refusal, out: list[Action]) -> None:
        """A fatal protocol error from one group: ERROR, close it, forget it."""
        was_current = self._registry.remove(key)
        out.append(CloseGroup(key, ErrorMessage(refusal.text)))
        out.append(
            Log("error", "group closed on protocol error", {**_member_fields(key), **_why(refusal)})
        )
        if was_current:
            # Its GroupClosed finds it forgotten already: the cut is re-checked here instead.
            self._finish_if_delivered(out)
            self._pacing_changed = True

    def _fail(self, reason: str, out: list[Action]) -> None:
        self._finish(EXIT_FAILURE, reason, out)

    def _finish(self, code: int, reason: str, out: list[Action]) -> None:
        self._exit = Exit(code, reason)
        out.append(
            Log(
                "info" if code == EXIT_OK else "error",
                "syncer exiting",
                {"code": code, "reason": reason},
            )
        )
        out.append(self._exit)

    def _require_model(self) -> GlobalModel:
        if self._model is None:
            raise RuntimeError("no session yet")
        return self._model

    def _require_session(self) -> SessionIdentity:
        session = self._admission.session
        if session is None:
            raise RuntimeError("no session yet")
        return session


def _why(refusal: Refusal) -> dict[str, str]:
    return {"code": refusal.code.value, "reason": refusal.detail}


def _id_mismatch(frame: str, learner_id: int, key: GroupKey) -> Refusal:
    return Refusal(
        ErrorCode.LEARNER_ID_MISMATCH,
        f"{frame} names learner {learner_id}, the group is learner {key.learner_id}",
    )
