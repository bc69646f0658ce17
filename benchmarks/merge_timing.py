"""What bench_merge and bench_iso_pool share: result rows, interleaved timing, synthetic pushes.

Both time merge functions against plain-numpy baselines on the same machine in the same run;
the rows, the timing discipline and the inputs have to be the same for their ratios to compare.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from yeto_sync.merge import Response

LEARNERS = 4


@dataclass(frozen=True)
class Case:
    name: str
    shapes: tuple[tuple[int, int], ...]
    reps: int  # the fast rows: averages, baselines, transfers
    svd_reps: int  # the SVD rows
    svd_warm_up: bool = True  # off for 4096x4096: one SVD there takes most of a minute


@dataclass(frozen=True)
class Row:
    case: str
    what: str
    runs: list[float]
    baseline_runs: list[float] | None = None
    target: float | None = None

    @property
    def best(self) -> float:
        return min(self.runs)

    @property
    def median(self) -> float:
        return statistics.median(self.runs)

    @property
    def baseline(self) -> float | None:
        return None if self.baseline_runs is None else min(self.baseline_runs)

    @property
    def ratio(self) -> float | None:
        """Best against best: contention from other jobs only ever adds time."""
        return None if self.baseline is None else self.best / self.baseline

    @property
    def verdict(self) -> str:
        if self.target is None or self.ratio is None:
            return "info"
        return "PASS" if self.ratio <= self.target else "FAIL"


Runs = dict[str, list[float]]


def interleaved_runs(
    fns: dict[str, Callable[[], object]],
    reps: int,
    *,
    warm_up: bool = True,
    clock: Callable[[], float] = time.perf_counter,
) -> Runs:
    """Seconds of each function per repetition, all run in turn within every repetition.

    Interleaving (in alternating order) makes a candidate and its baseline share whatever
    else the machine is doing: on 2 cores, other jobs hit multi-threaded BLAS hard.
    """
    for fn in fns.values() if warm_up else ():  # first-touch page faults, BLAS threads, LAPACK
        fn()
    times: Runs = {name: [] for name in fns}
    for rep in range(reps):
        names = list(fns) if rep % 2 == 0 else list(reversed(fns))
        for name in names:
            start = clock()
            fns[name]()
            times[name].append(clock() - start)
    return times


def make_responses(numel: int, seed: int, learners: int = LEARNERS) -> list[Response]:
    """``learners`` pushes of small random values with distinct step and token counts."""
    rng = np.random.default_rng(seed)
    return [
        Response(
            learner_id=i,
            generation=1,
            c_steps=20 + i,
            c_tokens=4096 * (20 + 3 * i),
            pushed=(rng.standard_normal(numel, dtype=np.float32) * np.float32(1e-3)),
        )
        for i in range(learners)
    ]


def plain_weighted_average(grads: list[NDArray[np.float32]], coefs: list[float]) -> object:
    """The baseline: Σ f32(coef)·Δ with numpy temporaries, as anyone would write it."""
    total = np.float32(coefs[0]) * grads[0]
    for grad, coef in zip(grads[1:], coefs[1:], strict=True):
        total = total + np.float32(coef) * grad
    return total


def render(rows: list[Row]) -> str:
    """The rows as a markdown table (seconds, ratio best against best, verdict)."""
    lines = [
        "| case | measured | best s | median s | baseline best s | ratio | target | result |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        base = "" if row.baseline is None else f"{row.baseline:.4f}"
        ratio = "" if row.ratio is None else f"{row.ratio:.2f}x"
        target = "" if row.target is None else f"≤ {row.target:.1f}x"
        lines.append(
            f"| {row.case} | {row.what} | {row.best:.4f} | {row.median:.4f} | {base} | {ratio} |"
            f" {target} | {row.verdict} |"
        )
    return "\n".join(lines)
