"""The learner's protocol state machine: anchors, windows, deferred pulls, finalization, budget.

Sans-IO in the manner of h11: the session never touches a socket, a clock or torch. A transport
feeds it decoded syncer messages (framing, CHUNK reassembly and limits are the transport's, with
a ``FrameDecoder(Role.LEARNER, limits=session.limits)``), and a training loop calls it between
steps. Every call returns what to send or what to apply; spec/learner.md states the rules.

The driver's contract, in short:

* ``hello()`` (and ``data_hellos()``) open every connection group; ``connection_lost()`` when it
  dies. Learner 0 then sends ``init_messages()``.
* ``receive(message)`` → effects, carried out in order. An :class:`ApplyBroadcast` is confirmed
  with ``broadcast_applied()`` once blended in; an :class:`ApplyFinal` with ``final_applied()``,
  which returns the FINAL_ACK to send.
* ``record_step(tokens)`` after each local optimizer step; ``answer_pulls(read_local)`` after
  each ``receive``, ``record_step`` and ``broadcast_applied``: it returns the PUSHes now due.
* A :class:`~yeto_proto.ProtocolError` raised by ``receive`` is fatal: the session is FAILED
  and every later call raises it again.

The session is not thread-safe: a driver serializes its calls (one event loop, or a lock).
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TypeAlias

import numpy as np
from numpy.typing import NDArray

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
    FrameType,
    Heartbeat,
    Hello,
    InitParams,
    Limits,
    LocalProtocolError,
    ProtocolError,
    PullReq,
    PushFragment,
    RemoteProtocolError,
    Shutdown,
    WireDtype,
    WireLayout,
)
from yeto_proto.constants import U32_MAX
from yeto_proto.dtypes import all_finite, decode_tensor, encode_tensor

from .effects import AnchorRecorded, ApplyBroadcast, Effect, ShutdownReceived, SyncerFailed
from .finalization import Finalization
from .reconnect import fresh_generation
from .versions import Arrival, MonotonicCache, Versioned

#: Reads one fragment's current local parameters as a flat f32 array of its numel.
ReadLocal: TypeAlias = Callable[[int], NDArray[np.float32]]


class Phase(enum.Enum):
    #: No connection group: before the first HELLO, or after ``connection_lost()``.
    IDLE = "idle"
    CONNECTED = "connected"
    #: SHUTDOWN arrived after our FINAL_ACK: the run is complete.
    SHUT_DOWN = "shut_down"
    #: A fatal error (ours, the syncer's, or an ERROR frame); every later call raises it.
    FAILED = "failed"


@dataclass(slots=True)
class _Fragment:
    numel: int
    #: The window: steps and tokens since the last *applied* BCAST of this fragment.
    c_steps: int = 0
    c_tokens: int = 0
    #: The newest PULL of this fragment not yet answered (a later PULL replaces it).
    pull: PullReq | None = None
    #: Version of the newest ApplyBroadcast handed out and not yet confirmed.
    apply_pending: int | None = None
    #: The highest version ever handed out for apply (above ``apply_pending`` only after a
    #: restarted syncer took the anchor back: that older hand-out may still be confirmed).
    highest_handed_out: int = -1


class LearnerSession:
    """One learner's protocol state across every connection generation of a run."""

    def __init__(
        self,
        layout: WireLayout,
        dtype: WireDtype,
        learner_id: int,
        *,
        layout_fingerprint: bytes,
        session_contract: bytes,
        profile_hash: bytes | None = None,
        budget_steps: int | None = None,
    ) -> None:
        # Every HELLO of the session is this one with a generation and stream count: building it
        # now validates the identity once, and reconnects cannot drift from it.
        self._hello_template = Hello(
            learner_id=learner_id,
            generation=1,
            dtype=WireDtype(dtype),
            layout=layout,
            layout_fingerprint=bytes(layout_fingerprint),
            session_contract=bytes(session_contract),
            num_streams=0,
            profile_hash=None if profile_hash is None else bytes(profile_hash),
        )
        if budget_steps is not None and not 1 <= budget_steps <= U32_MAX:
            # A frozen PUSH carries c_steps = budget, a u32.
            raise LocalProtocolError(
                ErrorCode.FIELD_OUT_OF_RANGE, f"budget_steps={budget_steps} outside 1..{U32_MAX}"
            )
        self.layout = layout
        self.dtype = WireDtype(dtype)
        self.learner_id = learner_id
        self.budget_steps = budget_steps
        self.limits = Limits.of(self.dtype, layout)
        self._fragments = [_Fragment(numel) for numel in layout.numels]
        self._anchors = MonotonicCache(len(layout), ErrorCode.BCAST_CONFLICT, "BCAST")
        #: Fragments whose anchor a frozen learner let go at a disconnect: the syncer held
        #: them, so learner 0 does not INIT them again (a whole model's upload per redial).
        self._held_by_syncer: set[int] = set()
        self._final = Finalization(len(layout))
        self._phase = Phase.IDLE
        self._error: ProtocolError | None = None
        self._generation: int | None = None
        self._num_streams = 0
        self._used_generations: set[int] = set()
        self._local_step = 0
        self._total_tokens = 0
        self._budget_reported = False
        #: BUDGET_DONE went out on the current connection: its pulls stay unanswered (§ 10).
        self._budget_on_connection = False
        #: Fragments whose first BCAST on the current connection has not arrived: their held
        #: anchors may be ahead of a restarted syncer, so their pulls wait for it.
        self._awaiting_first: set[int] = set()

    # -- observation -----------------------------------------------------------------------
    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def error(self) -> ProtocolError | None:
        return self._error

    @property
    def generation(self) -> int | None:
        """The current (or last) connection generation."""
        return self._generation

    @property
    def num_fragments(self) -> int:
        return len(self._fragments)

    @property
    def local_step(self) -> int:
        return self._local_step

    @property
    def total_tokens(self) -> int:
        """Every token recorded since the start: a frozen PUSH's c_tokens."""
        return self._total_tokens

    @property
    def frozen(self) -> bool:
        """BUDGET_DONE was sent: parameters are frozen, BCASTs only move anchors."""
        return self._budget_reported

    @property
    def final_applied_step(self) -> int | None:
        """The final step whose state the parameters hold (confirmed by the training loop)."""
        return self._final.applied_step

    @property
    def final_manifest(self) -> FinalManifest | None:
        return self._final.manifest

    def anchor(self, fragment_id: int) -> Versioned | None:
        """The raw global state of the last accepted BCAST of a fragment, with its version."""
        return self._anchors[self._index(fragment_id)]

    def final_fragment(self, fragment_id: int) -> Versioned | None:
        return self._final.cache[self._index(fragment_id)]

    def window(self, fragment_id: int) -> tuple[int, int]:
        """``(c_steps, c_tokens)`` since the last applied BCAST of the fragment."""
        state = self._fragments[self._index(fragment_id)]
        return state.c_steps, state.c_tokens

    def pending_pull(self, fragment_id: int) -> PullReq | None:
        return self._fragments[self._index(fragment_id)].pull

    def answerable(self) -> list[int]:
        """Fragments whose pending PULL ``answer_pulls`` would answer now, oldest round first."""
        ready = [
            (state.pull.global_step, p)
            for p, state in enumerate(self._fragments)
            if state.pull is not None and self._ready(p)
        ]
        return [p for _, p in sorted(ready)]

    def pulls_awaiting_a_step(self) -> list[int]:
        """Fragments whose pending PULL waits for nothing but a local step (none was taken
        since their last applied BCAST): a learner that stopped training never answers them.
        A PULL whose round committed without this learner (its fragment's anchor is at that
        round's version already) is not needed any more and does not count."""
        if self._budget_reported or self._final.started:
            return []  # frozen pulls need no step; after the cut no pull is answered at all
        return [
            p
            for p, state in enumerate(self._fragments)
            if state.pull is not None
            and (anchor := self._anchors[p]) is not None
            and state.pull.global_step > anchor.version
            and p not in self._awaiting_first
            and state.apply_pending is None
            and state.c_steps == 0
        ]

    # -- connections -----------------------------------------------------------------------
    def hello(self, num_streams: int, *, generation: int | None = None) -> Hello:
        """Open a new connection group: the HELLO for stream 0.

        ``generation`` defaults to a fresh random nonzero u64; a generation this session used
        before is refused. Opening a group while one is up first drops the old one.
        """
        self._alive()
        if self._phase is Phase.SHUT_DOWN:
            raise LocalProtocolError(ErrorCode.SESSION_MISUSE, "the run is complete")
        if generation is None:
            generation = fresh_generation(self._used_generations)
        elif generation in self._used_generations:
            raise LocalProtocolError(
                ErrorCode.DUPLICATE_GENERATION, f"generation {generation} was used before"
            )
        message = replace(self._hello_template, generation=generation, num_streams=num_streams)
        if self._phase is Phase.CONNECTED:
            self.connection_lost()
        self._used_generations.add(generation)
        self._generation = generation
        self._num_streams = num_streams
        self._phase = Phase.CONNECTED
        self._awaiting_first = set(range(len(self._fragments)))
        return message

    def data_hellos(self) -> list[DataHello]:
        """One DATA_HELLO per data stream of the current group (0-based stream indices)."""
        generation = self._require_connected()
        return [DataHello(self.learner_id, generation, i) for i in range(self._num_streams)]

    def connection_lost(self) -> None:
        """The group died: its pending pulls die with it; anchors and caches are kept.

        The next connection's first BCAST of each fragment is authoritative, even below the
        held anchor (a syncer restarted from an older checkpoint), and pulls of a fragment wait
        for it: an anchor ahead of the syncer would make every PUSH a future-base rejection.

        In frozen mode the anchors go too: the restarted syncer's broadcasts must be the base
        of every frozen PUSH (source: the fresh connection drops the cutoff process's state).
        """
        if self._phase is Phase.CONNECTED:
            self._phase = Phase.IDLE
        for state in self._fragments:
            state.pull = None
        self._final.connection_lost()
        self._budget_on_connection = False
        if self._budget_reported:
            held = (p for p in range(len(self._anchors)) if self._anchors[p] is not None)
            self._held_by_syncer.update(held)
            self._anchors.clear()

    def init_messages(self, read_local: ReadLocal) -> list[InitParams]:
        """Learner 0's INIT_PARAMS for every fragment of which it never held an anchor."""
        self._alive()
        if self.learner_id != 0:
            raise LocalProtocolError(
                ErrorCode.INIT_NOT_ALLOWED, f"learner {self.learner_id}: only learner 0 may INIT"
            )
        self._require_connected()
        out = []
        for p, state in enumerate(self._fragments):
            if self._anchors[p] is not None or p in self._held_by_syncer:
                continue
            values = _checked_local(read_local(p), p, state.numel)
            _check_finite(values, f"INIT of fragment {p}")
            out.append(InitParams(p, encode_tensor(values, self.dtype, push=False).data))
        return out

    # -- the syncer's messages -------------------------------------------------------------
    def receive(self, message: AnyMessage) -> list[Effect]:
        """Take one decoded message from the syncer; return the effects, in order."""
        self._alive()
        if self._phase is Phase.SHUT_DOWN:
            return []  # data streams may still deliver after SHUTDOWN on stream 0
        self._require_connected()
        try:
            return self._dispatch(message)
        except ProtocolError as exc:
            self._fail(exc)
            raise

    def _dispatch(self, message: AnyMessage) -> list[Effect]:
        match message:
            case PullReq():
                self.limits.check_fragment(message.fragment_id)
                self._fragments[message.fragment_id].pull = message
                return []
            case BcastFragment():
                return self._on_broadcast(message)
            case FinalFragment():
                p, numel = self._check_tensor(FrameType.FINAL_FRAGMENT, message)
                return self._final.add_fragment(
                    p,
                    message.version,
                    lambda: _finite_from_syncer(message, WireDtype.F32, numel),
                )
            case FinalManifest():
                return self._final.add_manifest(message)
            case Shutdown():
                if not self._final.shutdown_allowed():
                    raise RemoteProtocolError(
                        ErrorCode.UNEXPECTED_SHUTDOWN,
                        "SHUTDOWN before the FINAL_ACK of the held manifest on this connection",
                    )
                self._phase = Phase.SHUT_DOWN
                return [ShutdownReceived()]
            case ErrorMessage():
                self._fail(RemoteProtocolError(ErrorCode.SYNCER_ERROR, message.text))
                return [SyncerFailed(message.text)]
            case Chunk():
                raise LocalProtocolError(
                    ErrorCode.SESSION_MISUSE, "CHUNKs are reassembled by the transport"
                )
        raise LocalProtocolError(
            ErrorCode.WRONG_DIRECTION, f"a syncer never sends {message.TYPE.name}"
        )

    def _on_broadcast(self, message: BcastFragment) -> list[Effect]:
        p, numel = self._check_tensor(FrameType.BCAST_FRAGMENT, message)

        def decode() -> NDArray[np.float32]:
            return _finite_from_syncer(message, self.dtype, numel)

        if p in self._awaiting_first:
            # The syncer's replay of its current version to this generation: authoritative,
            # even below the held anchor (it restarted from an older checkpoint).
            self._awaiting_first.discard(p)
            arrival = self._anchors.restore(p, message.version, decode)
        else:
            arrival = self._anchors.offer(p, message.version, decode)
        if arrival is not Arrival.STORED:
            return []
        if self._budget_reported:
            return [AnchorRecorded(p, message.version)]
        if self._final.started:
            return []  # the final cut overwrites the parameters; a late BCAST must not blend in
        anchor = self._anchors[p]
        assert anchor is not None
        state = self._fragments[p]
        state.apply_pending = message.version
        state.highest_handed_out = max(state.highest_handed_out, message.version)
        return [ApplyBroadcast(p, message.version, anchor.values)]

    def _check_tensor(
        self, frame_type: FrameType, message: BcastFragment | FinalFragment
    ) -> tuple[int, int]:
        p = message.fragment_id
        self.limits.check_fragment(p)
        expected = self.limits.tensor_bytes(frame_type, p)
        if len(message.data) != expected:
            raise RemoteProtocolError(
                ErrorCode.BAD_TENSOR_LENGTH,
                f"{frame_type.name} fragment {p}: {len(message.data)} bytes, expected {expected}",
            )
        return p, self._fragments[p].numel

    # -- the training loop -----------------------------------------------------------------
    def broadcast_applied(self, fragment_id: int, version: int) -> None:
        """The blend of BCAST ``version`` is in the parameters: the fragment's window restarts."""
        self._alive()
        state = self._fragments[self._index(fragment_id)]
        pending = state.apply_pending
        if pending is None or version > state.highest_handed_out:
            raise LocalProtocolError(
                ErrorCode.SESSION_MISUSE,
                f"fragment {fragment_id} version {version} was not handed out for apply",
            )
        state.c_steps = 0
        state.c_tokens = 0
        if version == pending:
            state.apply_pending = None

    def record_step(self, tokens: int) -> None:
        """One local optimizer step over ``tokens`` raw training units."""
        self._alive()
        tokens = operator.index(tokens)
        if tokens < 0:
            raise LocalProtocolError(ErrorCode.FIELD_OUT_OF_RANGE, f"tokens={tokens}")
        if self._final.applied_step is not None:
            raise LocalProtocolError(
                ErrorCode.SESSION_MISUSE, "a step after the final state was applied"
            )
        if self._budget_reported or (
            self.budget_steps is not None and self._local_step >= self.budget_steps
        ):
            raise LocalProtocolError(
                ErrorCode.BUDGET_MISMATCH, f"a step beyond the budget of {self.budget_steps}"
            )
        self._local_step += 1
        self._total_tokens += tokens
        for state in self._fragments:
            state.c_steps += 1
            state.c_tokens += tokens

    def answer_pulls(self, read_local: ReadLocal) -> list[PushFragment]:
        """PUSH_FRAGMENTs for every pending PULL that is answerable now, oldest round first.

        Payload: ``local − raw_anchor`` in f32, encoded in the session's push dtype. Answering
        does not restart the window (only an applied BCAST does). If reading or encoding any
        fragment fails, no pull is consumed.
        """
        self._alive()
        if self._phase is not Phase.CONNECTED:
            return []
        pushes = [self._push(p, read_local) for p in self.answerable()]
        for push in pushes:
            self._fragments[push.fragment_id].pull = None
        return pushes

    def _ready(self, p: int) -> bool:
        state = self._fragments[p]
        if state.pull is None or self._anchors[p] is None or p in self._awaiting_first:
            return False
        if self._final.started:
            return False  # every round ended before the cut: a later PUSH has no round
        if self._budget_reported:
            # Frozen: the window is the whole budget; but the cutoff cancels every round of
            # the connection that carried BUDGET_DONE, so its pulls get no frozen PUSH.
            return not self._budget_on_connection
        return state.apply_pending is None and state.c_steps >= 1

    def _push(self, p: int, read_local: ReadLocal) -> PushFragment:
        state = self._fragments[p]
        pull, anchor = state.pull, self._anchors[p]
        assert pull is not None and anchor is not None
        local = _checked_local(read_local(p), p, state.numel)
        delta = np.subtract(local, anchor.values, dtype=np.float32)
        _check_finite(delta, f"PUSH delta of fragment {p}")
        if self._budget_reported:
            assert self.budget_steps is not None
            local_step, c_steps, c_tokens = self.budget_steps, self.budget_steps, self._total_tokens
        else:
            local_step, c_steps, c_tokens = self._local_step, state.c_steps, state.c_tokens
        return PushFragment(
            learner_id=self.learner_id,
            fragment_id=p,
            global_step=pull.global_step,
            round_attempt=pull.round_attempt,
            base_version=anchor.version,
            local_step=local_step,
            c_steps=c_steps,
            c_tokens=c_tokens,
            data=encode_tensor(delta, self.dtype, push=True).data,
        )

    def heartbeat(self) -> Heartbeat:
        self._alive()
        return Heartbeat(self.learner_id, self._local_step)

    def final_applied(self, final_global_step: int) -> FinalAck | None:
        """The parameters hold the final cut of ``final_global_step``: the FINAL_ACK to send.

        ``None`` when there is nothing to send yet (an older cut, or the connection changed
        since; the ACK then comes as a ``SendMessage`` effect once the manifest is back).
        """
        self._alive()
        return self._final.confirm_applied(final_global_step)

    def budget_done(self) -> BudgetDone:
        """BUDGET_DONE once the training loop reached exactly ``budget_steps``: freeze."""
        self._alive()
        if self.budget_steps is None:
            raise LocalProtocolError(ErrorCode.BUDGET_NOT_CONFIGURED, "no learner budget")
        if self._budget_reported:
            raise LocalProtocolError(ErrorCode.DUPLICATE_BUDGET_DONE, "BUDGET_DONE was sent")
        if self._local_step != self.budget_steps:
            raise LocalProtocolError(
                ErrorCode.BUDGET_MISMATCH,
                f"local_step {self._local_step} is not the budget {self.budget_steps}",
            )
        self._budget_reported = True
        self._budget_on_connection = True
        for state in self._fragments:
            state.pull = None  # the cutoff cancels every in-flight round
        return BudgetDone(self.budget_steps)

    def budget_done_resent(self) -> BudgetDone:
        """The BUDGET_DONE of which no byte reached the syncer, again for the current connection
        (spec/learner.md § 10 (choice)); that connection's pulls then stay unanswered too."""
        self._alive()
        if not self._budget_reported or self.budget_steps is None:
            raise LocalProtocolError(ErrorCode.SESSION_MISUSE, "no BUDGET_DONE to send again")
        self._budget_on_connection = True
        return BudgetDone(self.budget_steps)

    # -- helpers ---------------------------------------------------------------------------
    def _alive(self) -> None:
        if self._error is not None:
            raise self._error

    def _fail(self, error: ProtocolError) -> None:
        self._error = error
        self._phase = Phase.FAILED

    def _require_connected(self) -> int:
        if self._phase is not Phase.CONNECTED or self._generation is None:
            raise LocalProtocolError(
                ErrorCode.SESSION_MISUSE, f"no connection group (phase {self._phase.value})"
            )
        return self._generation

    def _index(self, fragment_id: int) -> int:
        if not 0 <= fragment_id < len(self._fragments):
            raise LocalProtocolError(
                ErrorCode.BAD_FRAGMENT_ID,
                f"fragment {fragment_id} outside 0..{len(self._fragments) - 1}",
            )
        return fragment_id


def _checked_local(values: object, fragment_id: int, numel: int) -> NDArray[np.float32]:
    if not (
        isinstance(values, np.ndarray) and values.dtype == np.float32 and values.shape == (numel,)
    ):
        got = f"{values.dtype} {values.shape}" if isinstance(values, np.ndarray) else type(values)
        raise LocalProtocolError(
            ErrorCode.BAD_TENSOR_LENGTH,
            f"fragment {fragment_id}: expected flat float32 of {numel}, got {got}",
        )
    return values


def _check_finite(
    values: NDArray[np.float32],
    what: str,
    error: type[LocalProtocolError | RemoteProtocolError] = LocalProtocolError,
) -> None:
    """``NON_FINITE_VALUE`` unless every value is finite: ours (``LocalProtocolError``, what we
    would send: the syncer rejects it and drops us) or the syncer's (what it sent)."""
    if not all_finite(values):
        raise error(ErrorCode.NON_FINITE_VALUE, f"{what} is not finite")


def _finite_from_syncer(
    message: BcastFragment | FinalFragment, dtype: WireDtype, numel: int
) -> NDArray[np.float32]:
    """The tensor the syncer sent; a NaN or infinity is its violation, never blended in."""
    values = decode_tensor(message.data, dtype, numel, push=False)
    what = f"{message.TYPE.name} of fragment {message.fragment_id} at version {message.version}"
    _check_finite(values, what, RemoteProtocolError)
    return values
