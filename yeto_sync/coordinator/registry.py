"""Connection groups and generations.

Each logical learner has at most one *current* generation: the most recently admitted one that
is ready. A newer generation supersedes the old one for future launches from its admission on:
while it attaches its data sockets, launches capture neither (the learner redialed, so the old
one is most likely dead, and a PULL to it could hold a round up to its quorum deadline); it
becomes current once ready. The old group stays registered while its sockets live, so it can
still finish an attempt that captured it. Closing a superseded group never touches the current
one. Only ready groups count as connected learners.

A learner id keeps at most :data:`MAX_OPEN_GENERATIONS` groups open: each holds up to 64
partial messages, so unlimited generations would be unlimited memory for one learner id.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..events import ConnId, GroupKey

#: Open groups per learner id: the current one, one superseded that may still finish an
#: attempt that captured it, one attaching, and one spare for a quick redial.
MAX_OPEN_GENERATIONS = 4


@dataclass(slots=True, eq=False)
class Group:
    key: GroupKey
    conn: ConnId
    num_streams: int
    #: Admission order: a generation admitted later is the newer one.
    sequence: int
    ready: bool = False
    #: Last BCAST version queued to this group, per fragment (the syncer side of the learner's
    #: monotonic BCAST cache): a version is never queued twice to one group.
    bcast_versions: dict[int, int] = field(default_factory=dict)


class Registry:
    def __init__(self) -> None:
        self._groups: dict[GroupKey, Group] = {}
        self._current: dict[int, GroupKey] = {}
        self._admitted: set[GroupKey] = set()
        self._sequence = 0
        #: Per learner id: the admission sequence of its newest open group.
        self._newest: dict[int, int] = {}

    # -- queries ---------------------------------------------------------------------------
    def was_admitted(self, key: GroupKey) -> bool:
        """True for any (learner, generation) ever admitted, even if closed since."""
        return key in self._admitted

    def get(self, key: GroupKey) -> Group | None:
        return self._groups.get(key)

    def is_open(self, key: GroupKey) -> bool:
        return key in self._groups

    def is_current(self, key: GroupKey) -> bool:
        return self._current.get(key.learner_id) == key

    def current_of(self, learner_id: int) -> GroupKey | None:
        return self._current.get(learner_id)

    def missing_learners(self, learners: int, most: int = 16) -> str:
        """The learner ids ``0..learners-1`` without a current generation, for a log line: at
        most ``most`` of them, then how many more (found in the gaps between the connected
        ids, so a huge ``learners`` costs nothing)."""
        present = sorted(i for i in self._current if i < learners)
        missing: list[int] = []
        expected = 0
        for connected in [*present, learners]:
            missing.extend(range(expected, min(connected, expected + most - len(missing))))
            expected = connected + 1
        count = learners - len(present)
        more = f" and {count - len(missing)} more" if count > len(missing) else ""
        return ",".join(map(str, missing)) + more

    def current_members(self) -> tuple[GroupKey, ...]:
        """The current ready generation of every connected learner, ascending."""
        return tuple(sorted(self._current.values()))

    def launch_members(self) -> tuple[GroupKey, ...]:
        """The generations a launch captures: the current ones, less those of learners with
        a newer generation admitted and still attaching (it already supersedes them)."""
        return tuple(key for key in self.current_members() if not self.attaching_newer(key))

    def attaching_newer(self, key: GroupKey) -> bool:
        """A generation admitted after ``key`` is open for its learner (not ready yet, or
        ``key`` would not be current)."""
        return self._groups[key].sequence < self._newest[key.learner_id]

    def surplus_of(self, learner_id: int) -> list[GroupKey]:
        """The oldest-admitted groups of ``learner_id`` beyond :data:`MAX_OPEN_GENERATIONS`,
        never its current one."""
        others = sorted(
            (g for g in self._groups.values() if g.key.learner_id == learner_id),
            key=lambda g: g.sequence,
        )
        surplus = len(others) - MAX_OPEN_GENERATIONS
        current = self._current.get(learner_id)
        return [g.key for g in others if g.key != current][: max(0, surplus)]

    @property
    def connected_learners(self) -> int:
        return len(self._current)

    # -- changes ---------------------------------------------------------------------------
    def admit(self, key: GroupKey, conn: ConnId, num_streams: int) -> None:
        self._sequence += 1
        self._groups[key] = Group(key, conn, num_streams, self._sequence)
        self._admitted.add(key)
        self._newest[key.learner_id] = self._sequence

    def mark_ready(self, key: GroupKey) -> GroupKey | None:
        """Mark ``key`` ready; it becomes current unless a later-admitted generation already is.

        Returns the generation it superseded, if any.
        """
        group = self._groups[key]
        group.ready = True
        previous = self._current.get(key.learner_id)
        if previous is not None and self._groups[previous].sequence > group.sequence:
            return None
        self._current[key.learner_id] = key
        return previous if previous != key else None

    def remove(self, key: GroupKey) -> bool:
        """Forget a closed group; return True if it was its learner's current generation."""
        removed = self._groups.pop(key, None)
        if removed is None:
            return False
        if self._newest[key.learner_id] == removed.sequence:
            others = [
                g.sequence for g in self._groups.values() if g.key.learner_id == key.learner_id
            ]
            if others:
                self._newest[key.learner_id] = max(others)
            else:
                del self._newest[key.learner_id]
        if self._current.get(key.learner_id) == key:
            del self._current[key.learner_id]
            return True
        return False
