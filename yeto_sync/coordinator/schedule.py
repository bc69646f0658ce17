"""Which round targets which fragment, how many run at once, when the next may launch, and grace.

All times are seconds on the caller's monotonic clock (``now``); the pinned flags are in ms or
s and are converted here, once.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from ..config import SyncerConfig

#: Step-time EMA weight of the newest sample.
STEP_TIME_ALPHA: Final = 0.5
#: After a quorum deadline with fewer than K learners connected, look again after this long.
RETRY_DELAY_S: Final = 1.0


def target_fragment(step: int, num_fragments: int) -> int:
    """Round t targets fragment (t − 1) mod F."""
    return (step - 1) % num_fragments


def pipeline_depth(pipeline: int, num_fragments: int) -> int:
    """At most ``min(max(--pipeline, 1), F)`` rounds in flight: they target distinct fragments."""
    return min(max(pipeline, 1), num_fragments)


@dataclass(slots=True)
class _StepClock:
    local_step: int
    at: float
    estimate: float | None = None


class StepTimes:
    """Per logical learner, an EMA (α = 0.5) of seconds per local step.

    Each report of a cumulative ``local_step`` (PUSH or HEARTBEAT) that advances past the last
    one yields a sample ``Δtime / Δsteps``. A step count that goes backwards (a restarted
    learner) restarts that learner's baseline but keeps its estimate.
    """

    def __init__(self) -> None:
        self._clocks: dict[int, _StepClock] = {}

    def observe(self, learner_id: int, local_step: int, now: float) -> None:
        clock = self._clocks.get(learner_id)
        if clock is None:
            self._clocks[learner_id] = _StepClock(local_step, now)
            return
        if local_step < clock.local_step:
            clock.local_step, clock.at = local_step, now
            return
        advanced = local_step - clock.local_step
        if advanced == 0:
            return
        sample = max(now - clock.at, 0.0) / advanced
        if clock.estimate is None:
            clock.estimate = sample
        else:
            clock.estimate = STEP_TIME_ALPHA * sample + (1.0 - STEP_TIME_ALPHA) * clock.estimate
        clock.local_step, clock.at = local_step, now

    def estimate(self, learner_id: int) -> float | None:
        clock = self._clocks.get(learner_id)
        return None if clock is None else clock.estimate

    def slowest(self, learner_ids: Iterable[int]) -> float | None:
        """ξ_step: the largest estimate among ``learner_ids``; ``None`` while none has one."""
        known = [e for e in (self.estimate(i) for i in learner_ids) if e is not None]
        return max(known) if known else None


def launch_interval(config: SyncerConfig, slowest_step: float | None, num_fragments: int) -> float:
    """Seconds between launches: ``max(min_round_interval, H · ξ_step / F)``."""
    floor = config.min_round_interval_ms / 1000.0
    if slowest_step is None:
        return floor
    return max(floor, config.sync_interval_steps * slowest_step / num_fragments)


def grace_window(
    config: SyncerConfig, slowest_step: float | None, quorum_s: float, sync_s: float
) -> float:
    """``min(grace_ms, max(0, γ·(τ·ξ_step − ξ_quorum − ξ_sync)))``; the cap without ξ_step."""
    cap = config.grace_ms / 1000.0
    if slowest_step is None:
        return cap
    adaptive = config.grace_gamma * (config.grace_tau * slowest_step - quorum_s - sync_s)
    return min(cap, max(0.0, adaptive))
