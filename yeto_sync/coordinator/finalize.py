"""Terminal delivery: the frozen cut, FINAL_ACK tracking and SHUTDOWN.

When every launched round has committed, the coordinator freezes the logical learners that have
a live current group, writes the final checkpoint, and queues the cut — FINAL_FRAGMENT (f32) for
every fragment, then FINAL_MANIFEST — to each of them. A FINAL_ACK counts only from a
generation the cut was queued to; a pending learner may reconnect, get the cut on its new
generation, and acknowledge from there. An accepted ACK is never erased. SHUTDOWN goes only to
still-connected generations whose ACK was accepted.
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
        #: learner id → the generation whose ACK was accepted.
        self.acked: dict[int, GroupKey] = {}

    @property
    def pending(self) -> frozenset[int]:
        return frozenset(self.frozen - self.acked.keys())

    @property
    def complete(self) -> bool:
        return not self.pending

    def wants_cut(self, group: GroupKey) -> bool:
        """A frozen learner without an accepted ACK gets the cut on each new generation."""
        return group.learner_id in self.pending and group not in self.queued_to

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
        """Record a valid ACK; False if this learner's ACK was already accepted."""
        if group.learner_id in self.acked:
            return False
        self.acked[group.learner_id] = group
        return True

    def shutdown_sends(self, is_open: Callable[[GroupKey], bool]) -> list[Send]:
        return [
            Send(group, Shutdown()) for _, group in sorted(self.acked.items()) if is_open(group)
        ]
