"""The schedule's pure pieces: targets, depth, step-time EMA, launch interval, grace window."""

from __future__ import annotations

import pytest

from yeto_sync.config import SyncerConfig
from yeto_sync.coordinator.schedule import (
    StepTimes,
    grace_window,
    launch_interval,
    pipeline_depth,
    target_fragment,
)


@pytest.mark.parametrize(
    ("step", "fragments", "target"),
    [(1, 3, 0), (2, 3, 1), (3, 3, 2), (4, 3, 0), (7, 3, 0), (1, 1, 0), (9, 1, 0), (10, 4, 1)],
)
def test_target_fragment(step: int, fragments: int, target: int) -> None:
    assert target_fragment(step, fragments) == target


@pytest.mark.parametrize(
    ("pipeline", "fragments", "depth"),
    [(0, 3, 1), (1, 3, 1), (2, 3, 2), (2, 1, 1), (9, 4, 4), (4, 9, 4)],
)
def test_pipeline_depth(pipeline: int, fragments: int, depth: int) -> None:
    assert pipeline_depth(pipeline, fragments) == depth


def test_step_time_ema() -> None:
    times = StepTimes()
    assert times.estimate(0) is None
    times.observe(0, 100, now=10.0)  # the first report is only a baseline
    assert times.estimate(0) is None
    times.observe(0, 110, now=11.0)  # 0.1 s/step
    assert times.estimate(0) == pytest.approx(0.1)
    times.observe(0, 110, now=50.0)  # no advance: no sample, baseline kept
    assert times.estimate(0) == pytest.approx(0.1)
    times.observe(0, 120, now=14.0)  # 0.3 s/step → 0.5·0.3 + 0.5·0.1
    assert times.estimate(0) == pytest.approx(0.2)
    times.observe(0, 5, now=15.0)  # restarted learner: new baseline, estimate kept
    assert times.estimate(0) == pytest.approx(0.2)
    times.observe(0, 15, now=16.0)  # 0.1 → 0.5·0.1 + 0.5·0.2
    assert times.estimate(0) == pytest.approx(0.15)


def test_slowest_ignores_learners_without_an_estimate() -> None:
    times = StepTimes()
    assert times.slowest([0, 1]) is None
    for learner, seconds in ((0, 1.0), (1, 3.0), (2, 2.0)):
        times.observe(learner, 0, now=0.0)
        times.observe(learner, 10, now=seconds * 10)
    times.observe(3, 0, now=0.0)
    assert times.slowest([0, 2, 3]) == pytest.approx(2.0)
    assert times.slowest([0, 1, 2]) == pytest.approx(3.0)
    assert times.slowest([3]) is None


@pytest.mark.parametrize(
    ("min_interval_ms", "h", "step_s", "fragments", "interval"),
    [
        (0, 24.0, None, 3, 0.0),
        (250, 24.0, None, 3, 0.25),
        (0, 24.0, 0.1, 3, 0.8),
        (1000, 24.0, 0.1, 3, 1.0),
        (0, 0.0, 0.1, 3, 0.0),
        (0, 12.0, 0.5, 2, 3.0),
    ],
)
def test_launch_interval(
    min_interval_ms: int, h: float, step_s: float | None, fragments: int, interval: float
) -> None:
    config = SyncerConfig(
        learners=1, total_steps=1, min_round_interval_ms=min_interval_ms, sync_interval_steps=h
    )
    assert launch_interval(config, step_s, fragments) == pytest.approx(interval)


@pytest.mark.parametrize(
    ("grace_ms", "step_s", "quorum_s", "sync_s", "grace"),
    [
        (1000, None, 5.0, 5.0, 1.0),  # no estimate: the full cap
        (1000, 0.2, 0.05, 0.0, 0.28),  # 0.8·(2·0.2 − 0.05)
        (1000, 0.2, 0.05, 0.1, 0.2),  # ξ_sync counts against it
        (100, 0.2, 0.05, 0.0, 0.1),  # capped
        (1000, 0.2, 0.5, 0.0, 0.0),  # never negative
        (0, None, 0.0, 0.0, 0.0),
    ],
)
def test_grace_window(
    grace_ms: int, step_s: float | None, quorum_s: float, sync_s: float, grace: float
) -> None:
    config = SyncerConfig(learners=1, total_steps=1, grace_ms=grace_ms)
    assert grace_window(config, step_s, quorum_s, sync_s) == pytest.approx(grace)


def test_grace_uses_gamma_and_tau() -> None:
    config = SyncerConfig(learners=1, total_steps=1, grace_gamma=0.5, grace_tau=3.0)
    assert grace_window(config, 0.1, 0.1, 0.0) == pytest.approx(0.5 * (0.3 - 0.1))
