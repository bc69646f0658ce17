"""At most one log line per kind and period: a flood of peers must not flood the log too."""

from __future__ import annotations

from collections.abc import Mapping

#: Seconds between two lines of one kind; the ones in between are counted, not written.
LOG_PERIOD_S = 10.0


class LogThrottle:
    """Decides which repeats of a log line are written (sans-IO: the caller passes ``now``)."""

    def __init__(self, period: float = LOG_PERIOD_S) -> None:
        self.period = period
        self._next_at: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def due(self, kind: str, now: float) -> int | None:
        """``None``: hold this line back (it is counted). Otherwise write it, and with it the
        returned number of lines of its kind held back since the last one written."""
        if now < self._next_at.get(kind, -float("inf")):
            self._held[kind] = self._held.get(kind, 0) + 1
            return None
        self._next_at[kind] = now + self.period
        return self._held.pop(kind, 0)

    def fields(
        self, kind: str, now: float, fields: Mapping[str, object]
    ) -> dict[str, object] | None:
        """The fields to write this line with (``held_back`` added when lines of its kind were
        held back), or ``None`` to hold it back."""
        held = self.due(kind, now)
        if held is None:
            return None
        return {**fields, "held_back": held} if held else dict(fields)
