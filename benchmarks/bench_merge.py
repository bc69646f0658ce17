"""Per-round merge time of yeto_sync.merge against plain numpy baselines measured in the same run.

Cases (4 learners each): a fragment of 16 matrices 4096x256, and one 4096x4096 matrix.
Baselines: a plain numpy weighted average of the same arrays (``Σ f32(w/Σw)·Δ_m`` with
temporaries) and the raw ``numpy.linalg.svd`` (f64, ``full_matrices=False``) of the averaged
matrices. Targets: avg ≤ 1.5x baseline, rda ≤ 2x baseline, iso (scalar solver) ≤ 1.2x
(raw svd + baseline). Candidates and baselines run interleaved; ratios compare the best of a few
repetitions, since other jobs on the machine only ever add time (the 4096x4096 SVD takes tens of
seconds, so it runs twice).

BLAS runs single-threaded unless OPENBLAS_NUM_THREADS says otherwise: on a shared 2-core machine
multi-threaded OpenBLAS spins on a preempted thread whenever another job holds a core, which made
one SVD vary 20x from run to run and drowned the comparison. Both sides of every ratio run with
the same setting. Single-threaded, the clock is the process CPU time, which time slices lost to
other jobs do not inflate; with more BLAS threads it is the wall clock.

    .venv/bin/python benchmarks/bench_merge.py            # full run, appends to RESULTS.md
    .venv/bin/python benchmarks/bench_merge.py --quick    # small shapes, prints only
    OPENBLAS_NUM_THREADS=2 .venv/bin/python benchmarks/bench_merge.py   # multi-threaded BLAS
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

# OpenBLAS reads this once, when numpy loads it: it must be set before the import.
BLAS_THREADS = os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
SINGLE_THREADED = BLAS_THREADS == "1"
clock = time.process_time if SINGLE_THREADED else time.perf_counter

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from merge_timing import (  # noqa: E402
    LEARNERS,
    Case,
    Row,
    interleaved_runs,
    make_responses,
    plain_weighted_average,
    render,
)
from results_md import RESULTS, replace_section  # noqa: E402

from yeto_proto.constants import MergeMode  # noqa: E402
from yeto_proto.identity import DeltaCorrection  # noqa: E402
from yeto_proto.layout import WireFragment  # noqa: E402
from yeto_sync.merge import (  # noqa: E402
    MergeConfig,
    learner_weights,
    merged_outer_gradient,
)

HEADING = "## Merge (bench_merge.py)"


def run_case(case: Case) -> list[Row]:
    numels = tuple(r * c for r, c in case.shapes)
    numel = sum(numels)
    responses = make_responses(numel, seed=len(case.shapes))
    momentum = np.zeros(numel, dtype=np.float32)
    config = MergeConfig(delta_correction=DeltaCorrection.NONE)
    weights = learner_weights(responses, config.learner_weight)
    coefs = [float(w) / float(weights.sum()) for w in weights]
    grads = [r.outer_gradient() for r in responses]

    def merge(mode: MergeMode, cfg: MergeConfig = config) -> Callable[[], object]:
        shapes = case.shapes if mode is MergeMode.ISO else ()
        geometry = WireFragment(mode, numels, shapes)
        return lambda: merged_outer_gradient(geometry, responses, momentum, cfg)

    busy_momentum = (np.random.default_rng(99).standard_normal(numel) * 1e-3).astype(np.float32)
    avg_geometry = WireFragment(MergeMode.AVG, numels)
    fast = interleaved_runs(
        {
            "baseline": lambda: plain_weighted_average(grads, coefs),
            "avg": merge(MergeMode.AVG),
            "rda": merge(MergeMode.RDA),
            "heloco skip": merge(MergeMode.AVG, MergeConfig()),
            "heloco": lambda: merged_outer_gradient(
                avg_geometry, responses, busy_momentum, MergeConfig()
            ),
        },
        case.reps,
        clock=clock,
    )
    base = fast["baseline"]
    rows = [
        Row(case.name, "numpy weighted average (baseline)", base),
        Row(case.name, "avg", fast["avg"], base, 1.5),
        Row(case.name, "rda", fast["rda"], base, 2.0),
        Row(case.name, "avg + heloco, momentum 0 (skip path)", fast["heloco skip"], base),
        Row(case.name, "avg + heloco, momentum set (corrects)", fast["heloco"], base),
    ]

    averaged = merged_outer_gradient(avg_geometry, responses, momentum, config)
    offsets = np.cumsum((0,) + numels)
    matrices = [
        averaged[offsets[i] : offsets[i + 1]].astype(np.float64).reshape(shape)
        for i, shape in enumerate(case.shapes)
    ]

    def raw_svd() -> None:
        for matrix in matrices:
            np.linalg.svd(matrix, full_matrices=False)

    slow = interleaved_runs(
        {"svd": raw_svd, "iso": merge(MergeMode.ISO)},
        case.svd_reps,
        warm_up=case.svd_warm_up,
        clock=clock,
    )
    rows.append(Row(case.name, "raw numpy.linalg.svd f64", slow["svd"]))
    svd_plus_avg = [svd + min(base) for svd in slow["svd"]]
    rows.append(
        Row(case.name, "iso (scalar solver) vs svd + baseline", slow["iso"], svd_plus_avg, 1.2)
    )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes; do not write")
    parser.add_argument("--reps", type=int, default=5, help="repetitions of avg/rda/baseline")
    args = parser.parse_args()
    if args.quick:
        cases = [
            Case("16 x 512x64", ((512, 64),) * 16, args.reps, 5),
            Case("1 x 512x512", ((512, 512),), args.reps, 5),
        ]
    else:
        cases = [
            Case("16 x 4096x256", ((4096, 256),) * 16, args.reps, 5),
            Case("1 x 4096x4096", ((4096, 4096),), args.reps, 2, svd_warm_up=False),
        ]
    rows: list[Row] = []
    for case in cases:
        print(f"running {case.name} ...", file=sys.stderr, flush=True)
        rows.extend(run_case(case))
    load = os.getloadavg()[0]
    table = render(rows)
    print(table)
    failed = [row for row in rows if row.verdict == "FAIL"]
    note = (
        f"{datetime.date.today().isoformat()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, numpy {np.__version__}, "
        f"OPENBLAS_NUM_THREADS={BLAS_THREADS} ({'CPU' if SINGLE_THREADED else 'wall'} clock); "
        f"{LEARNERS} learners, f32 deltas, "
        f"delta correction none unless stated; best and median of {args.reps} interleaved runs "
        f"(SVD rows: {cases[0].svd_reps} and {cases[1].svd_reps}); ratio = best / best; "
        f"1-min load average at the end {load:.1f} (other jobs share the 2 cores)."
    )
    if args.quick:
        print("quick run: the targets are read at full size only; not judged", file=sys.stderr)
        return 0
    replace_section(HEADING, f"{note}\n\n{table}\n")
    print(f"\nwritten to {RESULTS}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
