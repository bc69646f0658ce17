"""Iso merge time on the ``torch-svd`` worker pool against raw ``torch.linalg.svd`` in the same run.

Cases (4 learners, f32 deltas, as in bench_merge.py): a fragment of 16 matrices 4096x256, and
one 4096x4096 matrix. Baselines, measured here: a plain numpy weighted average of the deltas
(``Σ f32(w/Σw)·Δ_m`` with temporaries) and the raw ``torch.linalg.svd`` (f64,
``full_matrices=False``) of the averaged matrices, in this process with as many torch threads as
one pool worker has. Target: the iso merge through the pool (``merged_outer_gradient`` with the
pool as its solver: admission, shared-memory staging, the worker's SVD and reconstruction, the
result copy) ≤ 1.2x (raw torch svd + average).

Info rows: the same matrices through ``polar_flatten_many`` (the batch extension, several
workers at once when there are several), and the cost of moving the matrices to a worker and
back — the parent's side of the pool's shared-memory staging (copy in at admission, copy out at
completion) against an f32 round trip through a ``multiprocessing`` pipe to an echo child.

Everything is wall-clock time (the SVD runs in another process). Candidates and baselines run
interleaved; ratios compare the best of a few repetitions, since other jobs on the shared
machine only ever add time.

    .venv/bin/python benchmarks/bench_iso_pool.py            # full run, writes RESULTS.md
    .venv/bin/python benchmarks/bench_iso_pool.py --quick    # small shapes, prints only
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import platform
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

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
from yeto_sync.iso import IsoPoolSettings, IsoWorkerPool  # noqa: E402
from yeto_sync.merge import (  # noqa: E402
    MergeConfig,
    learner_weights,
    merged_outer_gradient,
)

HEADING = "## Iso worker pool, torch-svd backend (bench_iso_pool.py)"
F32 = NDArray[np.float32]


# -- transfers ---------------------------------------------------------------------------------
def _echo(conn: Connection) -> None:
    """Child of the pipe measurement: send every message straight back."""
    while True:
        try:
            data = conn.recv_bytes()
        except EOFError:
            return
        conn.send_bytes(data)


def shm_staging(matrices: list[F32]) -> None:
    """The parent's side of one pool job per matrix: block, copy in, copy out, release."""
    for matrix in matrices:
        block = SharedMemory(create=True, size=matrix.nbytes)
        staged: np.ndarray = np.ndarray(matrix.shape, np.float32, buffer=block.buf)
        np.copyto(staged, matrix)
        result = staged.copy()
        del staged, result
        block.close()
        block.unlink()


def pipe_round_trip(conn: Connection, matrices: list[F32]) -> None:
    for matrix in matrices:
        conn.send_bytes(memoryview(matrix).cast("B"))
        back = np.frombuffer(conn.recv_bytes(), dtype=np.float32).copy()
        del back


# -- one case ----------------------------------------------------------------------------------
def run_case(case: Case, pool: IsoWorkerPool, echo: Connection) -> list[Row]:
    import torch

    numels = tuple(r * c for r, c in case.shapes)
    numel = sum(numels)
    responses = make_responses(numel, seed=len(case.shapes))
    momentum = np.zeros(numel, dtype=np.float32)
    config = MergeConfig(delta_correction=DeltaCorrection.NONE)
    weights = learner_weights(responses, config.learner_weight)
    coefs = [float(w) / float(weights.sum()) for w in weights]
    grads = [r.outer_gradient() for r in responses]
    avg_geometry = WireFragment(MergeMode.AVG, numels)
    iso_geometry = WireFragment(MergeMode.ISO, numels, case.shapes)
    averaged = merged_outer_gradient(avg_geometry, responses, momentum, config)
    offsets = np.cumsum((0, *numels))
    flat = [averaged[offsets[i] : offsets[i + 1]] for i in range(len(case.shapes))]
    wide = [
        torch.from_numpy(part.astype(np.float64).reshape(shape))
        for part, shape in zip(flat, case.shapes, strict=True)
    ]

    def raw_torch_svd() -> None:
        for matrix in wide:
            torch.linalg.svd(matrix, full_matrices=False)

    def iso_on_pool() -> object:
        return merged_outer_gradient(iso_geometry, responses, momentum, config, pool)

    def batch_on_pool() -> object:
        return pool.polar_flatten_many(
            [(part, r, c) for part, (r, c) in zip(flat, case.shapes, strict=True)]
        )

    fast = interleaved_runs(
        {
            "average": lambda: plain_weighted_average(grads, coefs),
            "shm": lambda: shm_staging(flat),
            "pipe": lambda: pipe_round_trip(echo, flat),
        },
        case.reps,
    )
    candidates: dict[str, Callable[[], object]] = {
        "torch svd": raw_torch_svd,
        "iso pool": iso_on_pool,
    }
    if len(case.shapes) > 1:  # for one matrix the batch call is the same single job
        candidates["batch"] = batch_on_pool
    slow = interleaved_runs(candidates, case.svd_reps, warm_up=case.svd_warm_up)
    average = fast["average"]
    svd_plus_average = [svd + min(average) for svd in slow["torch svd"]]
    return [
        Row(case.name, "numpy weighted average (baseline)", average),
        Row(case.name, "raw torch.linalg.svd f64, in process (baseline)", slow["torch svd"]),
        Row(
            case.name,
            "iso merge on the torch-svd pool vs torch svd + average",
            slow["iso pool"],
            svd_plus_average,
            1.2,
        ),
        *(
            [
                Row(
                    case.name,
                    "polar_flatten_many on the pool vs torch svd",
                    slow["batch"],
                    slow["torch svd"],
                )
            ]
            if "batch" in slow
            else []
        ),
        Row(case.name, "shared-memory staging, parent side (used)", fast["shm"]),
        Row(
            case.name,
            "f32 pipe round trip to an echo child (alternative)",
            fast["pipe"],
            fast["shm"],
        ),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes; do not write")
    parser.add_argument("--reps", type=int, default=5, help="repetitions of the fast rows")
    parser.add_argument("--workers", type=int, default=0, help="pool workers (0: default)")
    parser.add_argument("--threads", type=int, default=0, help="threads per worker (0: default)")
    args = parser.parse_args()
    if args.quick:
        cases = [
            Case("16 x 512x64", ((512, 64),) * 16, args.reps, 3),
            Case("1 x 512x512", ((512, 512),), args.reps, 3),
        ]
    else:
        cases = [
            Case("16 x 4096x256", ((4096, 256),) * 16, args.reps, 5),
            Case("1 x 4096x4096", ((4096, 4096),), args.reps, 2, svd_warm_up=False),
        ]
    settings = IsoPoolSettings(workers=args.workers, threads_per_worker=args.threads)
    import torch

    torch.set_num_threads(settings.threads_per_worker)  # the raw baseline gets what a worker has
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    echo = context.Process(target=_echo, args=(theirs,), daemon=True)
    echo.start()
    theirs.close()
    rows: list[Row] = []
    try:
        with IsoWorkerPool(settings) as pool:
            for case in cases:
                print(f"running {case.name} ...", file=sys.stderr, flush=True)
                rows.extend(run_case(case, pool, ours))
            torch_version = pool.torch_version
    finally:
        ours.close()
        echo.join(5)
        if echo.is_alive():
            echo.kill()
    table = render(rows)
    print(table)
    load = os.getloadavg()[0]
    note = (
        f"{datetime.date.today().isoformat()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, numpy {np.__version__}, torch {torch_version}; pool of "
        f"{settings.workers} worker(s) x {settings.threads_per_worker} torch thread(s), raw "
        f"baseline with {settings.threads_per_worker} thread(s); {LEARNERS} learners, f32 deltas, "
        f"delta correction none; wall clock, best and median of {args.reps} interleaved runs "
        f"(SVD rows: {cases[0].svd_reps} and {cases[1].svd_reps}); ratio = best / best; "
        f"1-min load average at the end {load:.1f} (other jobs share the 2 cores)."
    )
    if args.quick:
        print("quick run: the targets are read at full size only; not judged", file=sys.stderr)
        return 0
    replace_section(HEADING, f"{note}\n\n{table}\n")
    print(f"\nwritten to {RESULTS}", file=sys.stderr)
    return 1 if any(row.verdict == "FAIL" for row in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
