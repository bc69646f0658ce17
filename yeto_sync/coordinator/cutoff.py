"""The benchmark cutoff: BUDGET_DONE reports, closing issuance, and the recovery checkpoint.

Benchmark-only, and only when the syncer was given ``--learner-budget-steps B`` (the same
positive budget every learner received). A learner that trained exactly ``B`` local steps sends
BUDGET_DONE ``(exact_local_steps = B)`` once. Its identity is the connection group's learner id,
so a report is counted per logical learner, whichever generation carried it.

Fatal for the reporting connection (ERROR, then the group is closed): a report without a
configured budget, a step count other than ``B``, and a second report from a learner. A trailing
byte never gets here: BUDGET_DONE's exact 8-byte length is checked by the frame decoder
(``BAD_FRAME_LENGTH``), which closes the group the same way.

The first accepted report closes ordinary issuance and cancels every launched, uncommitted round
as a whole: its pulls and accepted pushes are dropped and the next ordinary round is never
launched. Commits happen strictly in ascending ``t``, so the global state is the contiguous prefix
of the last committed round ``C``. Once every configured learner reported exactly once, the
coordinator writes that state as an unmarked recovery checkpoint and exits 0, with no final
manifest and no SHUTDOWN; the harness restarts a syncer from it for ``F`` consolidation rounds.

**(choice)** The wait for the remaining reports is bounded by ``--final-ack-timeout-s`` from
the first accepted report. When it passes, the checkpoint is still written (unmarked: a
cutoff-incomplete recovery state) and the syncer exits non-zero naming the missing learners.
"""

from __future__ import annotations

from typing import Any

from yeto_proto.errors import ErrorCode
from yeto_proto.messages import BudgetDone

from ..events import GroupKey
from . import tape
from .admission import Refusal
from .rounds import Round

#: Timer key of the bounded wait for the remaining BUDGET_DONE reports.
CUTOFF_TIMER = "cutoff"


class BudgetCutoff:
    """Which learners reported their budget, and whether ordinary issuance is closed."""

    def __init__(self, *, budget_steps: int, learners: int) -> None:
        if budget_steps < 1:
            raise ValueError(f"the learner budget must be positive, got {budget_steps}")
        self.budget_steps = budget_steps
        self.learners = learners
        #: learner id → the generation whose report was accepted.
        self.reported: dict[int, GroupKey] = {}
        #: When the first report closed issuance, and when the wait for the rest ends.
        self.closed_at: float | None = None
        self.deadline: float | None = None

    @property
    def closed(self) -> bool:
        """The first report was accepted: no ordinary round launches in this process again."""
        return self.closed_at is not None

    @property
    def complete(self) -> bool:
        """Exactly one report from every configured learner."""
        return len(self.reported) == self.learners

    @property
    def missing(self) -> list[int]:
        return [i for i in range(self.learners) if i not in self.reported]

    def judge(self, sender: GroupKey, report: BudgetDone) -> Refusal | None:
        """Why ``report`` is fatal for ``sender``'s connection, or ``None`` to accept it."""
        if report.exact_local_steps != self.budget_steps:
            return Refusal(
                ErrorCode.BUDGET_MISMATCH,
                f"BUDGET_DONE reports {report.exact_local_steps} local steps, the budget is "
                f"{self.budget_steps}",
            )
        earlier = self.reported.get(sender.learner_id)
        if earlier is not None:
            return Refusal(
                ErrorCode.DUPLICATE_BUDGET_DONE,
                f"learner {sender.learner_id} already reported its budget (generation "
                f"{earlier.generation})",
            )
        return None

    def accept(self, sender: GroupKey, now: float, wait_s: float) -> bool:
        """Record a judged report; True if it is the first one (issuance closes now)."""
        self.reported[sender.learner_id] = sender
        if self.closed_at is not None:
            return False
        self.closed_at = now
        self.deadline = now + wait_s
        return True


# -- event-tape lines ----------------------------------------------------------------------------
def report_record(sender: GroupKey, report: BudgetDone, missing: list[int]) -> dict[str, Any]:
    return {
        "event": "budget_done",
        "id": sender.learner_id,
        "generation": sender.generation,
        "exact_local_steps": report.exact_local_steps,
        "missing_learners": missing,
    }


def cancel_record(cancelled: Round) -> dict[str, Any]:
    return {
        "event": "round_cancelled",
        "reason": "budget_cutoff",
        "step": cancelled.step,
        "fragment": cancelled.fragment,
        "attempt": cancelled.attempt,
        "phase": cancelled.phase.value,
        "expected_members": tape.members(cancelled.members),
        "responded_members": tape.members(cancelled.accepted),
    }


def cutoff_record(
    cutoff: BudgetCutoff, global_step: int, versions: tuple[int, ...]
) -> dict[str, Any]:
    return {
        "event": "budget_cutoff",
        "complete": cutoff.complete,
        "step": global_step,
        "versions": list(versions),
        "budget_steps": cutoff.budget_steps,
        "reported_members": tape.members(cutoff.reported.values()),
        "missing_learners": cutoff.missing,
    }
