"""Redial policy: fresh nonzero random generations and a capped exponential backoff.

Pure helpers for whatever transport drives a :class:`~yeto_learn.session.LearnerSession`:
the transport owns the clock and the sockets, these only compute numbers.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Container

from yeto_proto.constants import U64_MAX

#: First redial delay, doubled after every failed attempt up to the cap (spec/learner.md).
BACKOFF_INITIAL_S = 1.0
BACKOFF_CAP_S = 30.0


def backoff_delay(failures: int) -> float:
    """Seconds to wait before the next dial after ``failures`` consecutive failed ones.

    0 → 1 s, 1 → 2 s, 2 → 4 s, … capped at 30 s. The count resets once a connection group is
    up and the syncer has sent a frame on it.
    """
    if failures < 0:
        raise ValueError(f"failures must be >= 0, got {failures}")
    if failures >= 5:  # 2**5 s already exceeds the cap; also keeps 2**failures small
        return BACKOFF_CAP_S
    return min(BACKOFF_INITIAL_S * 2.0**failures, BACKOFF_CAP_S)


def _random_u64() -> int:
    return secrets.randbits(64)


def fresh_generation(used: Container[int], draw: Callable[[], int] = _random_u64) -> int:
    """A nonzero u64 connection generation not in ``used`` (drawn at random by default)."""
    while True:
        generation = draw() & U64_MAX
        if generation != 0 and generation not in used:
            return generation
