"""One round t: its frozen members, quorum K, attempts, and the pushes it accepts.

An attempt captures an immutable member set at launch; only those exact generations may
answer it, each once, and only with this round's step, fragment and attempt. The first valid
PUSH per member wins and is kept even if that member disconnects. A quorum deadline below K
discards every partial response and the next attempt captures the then-current members.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from yeto_proto.errors import ErrorCode
from yeto_proto.messages import PushFragment

from ..events import GroupKey
from ..merge import Response


class Phase(enum.Enum):
    #: Pull requests are out; pushes are accepted.
    GATHERING = "gathering"
    #: The attempt missed its quorum deadline; waiting for K learners before the next attempt.
    WAITING = "waiting"
    #: Responses are final; the round waits for its turn to commit (ascending t).
    COMPLETE = "complete"


@dataclass(frozen=True, slots=True)
class Accepted:
    """One member's accepted PUSH: the merge input plus what the tape reports about it."""

    response: Response
    base_version: int
    staleness: int
    received_at: float


@dataclass(frozen=True, slots=True)
class Rejection:
    code: ErrorCode
    detail: str


@dataclass(slots=True, eq=False)
class Round:
    step: int
    fragment: int
    attempt: int
    members: tuple[GroupKey, ...]
    #: K = min(--quorum, captured members).
    quorum: int
    #: Launch time of the current attempt.
    launched_at: float
    #: Fragment version when the current attempt launched.
    launch_version: int
    phase: Phase = Phase.GATHERING
    accepted: dict[GroupKey, Accepted] = field(default_factory=dict)
    quorum_reached_at: float | None = None
    grace_s: float | None = None

    @classmethod
    def launch(
        cls,
        *,
        step: int,
        fragment: int,
        attempt: int,
        members: tuple[GroupKey, ...],
        quorum: int,
        now: float,
        version: int,
    ) -> Round:
        if not members:
            raise ValueError("a round needs at least one member")
        return cls(
            step=step,
            fragment=fragment,
            attempt=attempt,
            members=tuple(sorted(members)),
            quorum=min(quorum, len(members)),
            launched_at=now,
            launch_version=version,
        )

    # -- state -----------------------------------------------------------------------------
    @property
    def answered(self) -> int:
        return len(self.accepted)

    @property
    def all_answered(self) -> bool:
        return self.answered == len(self.members)

    @property
    def has_quorum(self) -> bool:
        return self.answered >= self.quorum

    @property
    def missed(self) -> tuple[GroupKey, ...]:
        return tuple(m for m in self.members if m not in self.accepted)

    @property
    def quorum_s(self) -> float:
        """ξ_quorum: launch of this attempt → K-th response (0 before quorum)."""
        if self.quorum_reached_at is None:
            return 0.0
        # Never negative: a launch after a merge is dated by the work clock's account of it.
        return max(self.quorum_reached_at - self.launched_at, 0.0)

    # -- pushes ----------------------------------------------------------------------------
    def judge(
        self, push: PushFragment, sender: GroupKey, max_base_lag: int | None
    ) -> Rejection | None:
        """Why this round must reject ``push`` (deterministically, no disconnect), or ``None``.

        The caller has matched ``push.global_step`` to this round already.
        """
        if self.phase is Phase.COMPLETE or push.fragment_id != self.fragment:
            return Rejection(
                ErrorCode.PUSH_OUT_OF_ROUND,
                f"round {self.step} (fragment {self.fragment}) is not gathering fragment "
                f"{push.fragment_id}",
            )
        if self.phase is Phase.WAITING:
            return Rejection(
                ErrorCode.PUSH_WRONG_ATTEMPT,
                f"attempt {push.round_attempt} of round {self.step}: attempt {self.attempt} "
                "was discarded and the next one has not launched",
            )
        if push.round_attempt != self.attempt:
            return Rejection(
                ErrorCode.PUSH_WRONG_ATTEMPT,
                f"attempt {push.round_attempt}, round {self.step} is at attempt {self.attempt}",
            )
        if sender not in self.members:
            return Rejection(
                ErrorCode.PUSH_WRONG_GENERATION,
                f"learner {sender.learner_id} generation {sender.generation} was not captured "
                f"by round {self.step} attempt {self.attempt}",
            )
        if sender in self.accepted:
            return Rejection(
                ErrorCode.PUSH_DUPLICATE,
                f"learner {sender.learner_id} generation {sender.generation} already answered",
            )
        if push.base_version > self.launch_version:
            return Rejection(
                ErrorCode.PUSH_FUTURE_BASE,
                f"base_version {push.base_version} is ahead of version {self.launch_version}",
            )
        staleness = self.launch_version - push.base_version
        if max_base_lag is not None and staleness > max_base_lag:
            return Rejection(
                ErrorCode.PUSH_TOO_STALE,
                f"staleness {staleness} exceeds --max-base-lag {max_base_lag}",
            )
        return None

    def accept(self, accepted: Accepted, sender: GroupKey) -> None:
        self.accepted[sender] = accepted
        if self.quorum_reached_at is None and self.has_quorum:
            self.quorum_reached_at = accepted.received_at

    def complete(self) -> None:
        self.phase = Phase.COMPLETE

    def discard(self) -> None:
        """Quorum deadline below K: drop every partial response of this attempt."""
        self.phase = Phase.WAITING
        self.accepted = {}
        self.quorum_reached_at = None
        self.grace_s = None

    def retry(self, members: tuple[GroupKey, ...], quorum: int, now: float, version: int) -> None:
        """Start attempt + 1 with the then-current members."""
        if not members:
            raise ValueError("a round needs at least one member")
        self.attempt += 1
        self.members = tuple(sorted(members))
        self.quorum = min(quorum, len(members))
        self.launched_at = now
        self.launch_version = version
        self.phase = Phase.GATHERING
        self.accepted = {}
        self.quorum_reached_at = None
        self.grace_s = None
