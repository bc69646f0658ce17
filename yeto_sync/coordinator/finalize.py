"""Terminal delivery: the frozen cut, FINAL_ACK tracking and SHUTDOWN.

When every launched round has committed, the coordinator freezes the logical learners that have
a live current group, writes the final checkpoint, and queues the cut — FINAL_FRAGMENT (f32) for
every fragment, then FINAL_MANIFEST — to each of them. A FINAL_ACK counts only from a
generation the cut was queued to; a frozen learner that reconnects gets the cut on its new
generation and acknowledges from there. An accepted ACK is never erased. SHUTDOWN goes only to
still-connected generations whose ACK was accepted.

A learner whose group drops after its ACK was accepted is no longer pending, but it waits for a
SHUTDOWN it can only get on a connection that is still open: it redials and ACKs again from its
new generation (spec/learner.md §7). So delivery is complete only when every frozen learner has
an accepted ACK *and* each frozen learner's current generation that was sent the cut has
acknowledged it. At the deadline, a learner whose earlier ACK stands is not missing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from yeto_proto.errors import ErrorCode
from yeto_proto.messages import FinalAck, FinalFragment, FinalManifest, Shutdown

from ..events import GroupKey, Send
from .admission import Refusal


class Finalization:
    def __init__(
        self,
        *,
        final_step: int,
        fragments: Sequence[FinalFragment],
        frozen: frozenset[int],
        deadline: float,
    ) -> None:
        self.final_step = final_step
        self.frozen = frozen
        self.deadline = deadline
        self.manifest = FinalManifest(final_step, tuple(f.version for f in fragments))
        self._fragments = tuple(fragments)
        self.queued_to: set[GroupKey] = set()
        #: Every generation whose valid ACK was accepted (never erased).
        self.acked: set[GroupKey] = set()

    @property
    def acked_learners(self) -> frozenset[int]:
        return frozenset(group.learner_id for group in self.acked)

    @property
    def pending(self) -> frozenset[int]:
        """Frozen learners without any accepted ACK: what a missing-ACK failure names."""
        return frozenset(self.frozen - self.acked_learners)

    def awaited(self, is_current: Callable[[GroupKey], bool]) -> list[GroupKey]:
        """Current generations that were sent the cut and have not acknowledged it yet."""
        return sorted(
            group for group in self.queued_to if group not in self.acked and is_current(group)
        )

    def complete(self, is_current: Callable[[GroupKey], bool]) -> bool:
        return not self.pending and not self.awaited(is_current)

    def wants_cut(self, group: GroupKey) -> bool:
        """Each new generation of a frozen learner gets the cut, ACK already accepted or not."""
        return group.learner_id in self.frozen and group not in self.queued_to

    def queue(self, group: GroupKey) -> list[Send]:
        """The cut for one generation: every FINAL_FRAGMENT, then the manifest."""
        self.queued_to.add(group)
        sends = [Send(group, fragment) for fragment in self._fragments]
        sends.append(Send(group, self.manifest))
        return sends

    def judge_ack(self, group: GroupKey, ack: FinalAck) -> Refusal | None:
        if group not in self.queued_to:
            return Refusal(
                ErrorCode.UNEXPECTED_FINAL_ACK,
                f"learner {group.learner_id} generation {group.generation} was never sent the "
                "final cut",
            )
        if ack.final_global_step != self.final_step:
            return Refusal(
                ErrorCode.UNEXPECTED_FINAL_ACK,
                f"FINAL_ACK for step {ack.final_global_step}, the final step is {self.final_step}",
            )
        return None

    def accept(self, group: GroupKey) -> bool:
        """Record a valid ACK; False if this generation's ACK was already accepted."""
        if group in self.acked:
            return False
        self.acked.add(group)
        return True

    def shutdown_sends(self, is_open: Callable[[GroupKey], bool]) -> list[Send]:
        return [Send(group, Shutdown()) for group in sorted(self.acked) if is_open(group)]
