"""The coordinator's inputs (events) and outputs (actions).

The coordinator is a pure function of its state and these values: a transport turns sockets
into events and carries out the actions, in order, before it feeds the next event. Time is the
``now`` argument (seconds on a monotonic clock), never read inside.

Connections: the transport numbers every socket with a ``ConnId``. A HELLO socket that the
coordinator admits becomes the control stream of a *group* ``GroupKey(learner_id, generation)``;
the transport attaches the group's DATA_HELLO sockets itself (waiting at most 10 s) and reports
``GroupReady`` once all ``num_streams`` data sockets are in. Only ready groups count as
connected learners. Messages on any socket of a group (reassembled CHUNKs included) arrive as
``MessageReceived`` with the group key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeAlias

from yeto_proto import AnyMessage, ErrorMessage, Hello, Limits

from .payload_progress import PayloadProgress

ConnId: TypeAlias = int


@dataclass(frozen=True, slots=True, order=True)
class GroupKey:
    learner_id: int
    generation: int


# -- events --------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class HelloReceived:
    """A new socket's first frame was a well-formed HELLO (HMAC, if configured, verified)."""

    conn: ConnId
    hello: Hello


@dataclass(frozen=True, slots=True)
class GroupReady:
    """Every data socket the group's HELLO announced has attached."""

    group: GroupKey


@dataclass(frozen=True, slots=True)
class MessageReceived:
    group: GroupKey
    message: AnyMessage
    #: For an f32 INIT or PUSH: whether its tensor is free of NaN and inf, if the transport
    #: already checked the bytes as they arrived (:mod:`yeto_sync.transport.finite_scan`);
    #: ``None``: not checked, the coordinator reads the tensor itself.
    tensor_finite: bool | None = None


@dataclass(frozen=True, slots=True)
class GroupClosed:
    """Any socket of the group failed or closed: the transport dropped the whole group."""

    group: GroupKey
    reason: str = ""


@dataclass(frozen=True, slots=True)
class TimerFired:
    key: str


Event: TypeAlias = HelloReceived | GroupReady | MessageReceived | GroupClosed | TimerFired


# -- actions -------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class AdmitGroup:
    """Make ``conn`` the control stream of ``group``; decode its later frames with ``limits``."""

    conn: ConnId
    group: GroupKey
    num_streams: int
    limits: Limits


@dataclass(frozen=True, slots=True)
class RefuseConnection:
    """Send ERROR on a socket that never became a group, then close it."""

    conn: ConnId
    error: ErrorMessage


@dataclass(frozen=True, slots=True)
class Send:
    """Queue ``message`` to a group (striped over its data streams when it is a bulk frame).

    ``progress``, when given, says how much of the message's payload (the tail of its frame)
    is final yet: the transport sends no byte beyond it, waits for more, and cuts the
    connection if the payload is withdrawn (a streamed BCAST whose merge failed) after some
    of it went out; one withdrawn before is dropped unsent.
    """

    group: GroupKey
    message: AnyMessage
    progress: PayloadProgress | None = None


@dataclass(frozen=True, slots=True)
class CloseGroup:
    """Close every socket of the group, after sending ERROR when ``error`` is given."""

    group: GroupKey
    error: ErrorMessage | None = None


@dataclass(frozen=True, slots=True)
class WriteCheckpoint:
    """Write a V3 checkpoint atomically; durable before the next action runs."""

    state: Any  # yeto_proto checkpoint value; typed by the checkpoint module
    #: The terminal write of a run (the iso pool is drained before it).
    final: bool = False
    #: A budget cutoff's unmarked recovery checkpoint (terminal, but not a final cut).
    recovery: bool = False


@dataclass(frozen=True, slots=True)
class WriteFinalMarker:
    global_step: int


@dataclass(frozen=True, slots=True)
class WriteFinalState:
    state: Any


@dataclass(frozen=True, slots=True)
class AppendTape:
    record: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Log:
    level: str
    text: str
    fields: dict[str, Any] = field(default_factory=dict)
    #: A line any peer can cause (a refused HELLO, say): written at most once per period.
    throttled: bool = False


@dataclass(frozen=True, slots=True)
class SetTimer:
    key: str
    at: float


@dataclass(frozen=True, slots=True)
class CancelTimer:
    key: str


@dataclass(frozen=True, slots=True)
class Exit:
    code: int
    reason: str


Action: TypeAlias = (
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
    | Exit
)
