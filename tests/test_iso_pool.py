"""The ``torch-svd`` iso worker pool: agreement with the scalar backend, and every failure path.

Faults are injected by the worker itself (:class:`~yeto_sync.iso.FaultPlan`, the hook the
``YETO_ISO_FAULT`` environment variable also arms), and outside kills are real ``SIGKILL``s of
the worker processes: nothing here mocks the pool.
"""

from __future__ import annotations

import errno
import multiprocessing
import multiprocessing.process
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from numpy.typing import NDArray
from sim import Sim

from yeto_proto.constants import IsoBackend, MergeMode
from yeto_proto.layout import WireFragment, WireLayout
from yeto_sync.config import SyncerConfig
from yeto_sync.events import AppendTape, Exit, WriteCheckpoint
from yeto_sync.iso import (
    FaultMode,
    FaultPlan,
    IsoPoolClosed,
    IsoPoolError,
    IsoPoolPoisoned,
    IsoPoolSettings,
    IsoPoolStartupError,
    IsoSolveError,
    IsoWorkerPool,
)
from yeto_sync.iso import pool as pool_module
from yeto_sync.merge import (
    SCALAR_ISO_SOLVER,
    IsoSolver,
    MergeConfig,
    MergeError,
    Response,
    merge_round,
)

REPO = Path(__file__).resolve().parents[1]
F32 = NDArray[np.float32]
#: Two single-threaded workers: jobs really run side by side on the 2-core machine.
TWO_WORKERS = {"workers": 2, "threads_per_worker": 1}
ONE_WORKER = {"workers": 1, "threads_per_worker": 1}


# -- helpers ---------------------------------------------------------------------------------
def alive(pid: int) -> bool:
    """The process exists and is not a zombie waiting to be reaped."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # in the middle of exiting: not a zombie yet
        return True
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_gone(pids: tuple[int, ...], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [pid for pid in pids if alive(pid)]
        if not left:
            return []
        time.sleep(0.05)
    return [pid for pid in pids if alive(pid)]


def spawned_children() -> set[int]:
    """Direct children of this process started by multiprocessing's spawn."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == os.getpid() and fields[0] != "Z" and b"spawn_main" in cmdline:
            found.add(int(entry.name))
    return found


def relative_gap(got: F32, want: F32) -> float:
    scale = float(np.abs(want).max())
    return float(np.abs(got.astype(np.float64) - want).max()) / (scale if scale else 1.0)


def start_pool(**options: object) -> IsoWorkerPool:
    return IsoWorkerPool(IsoPoolSettings(**options))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def pool() -> Iterator[IsoWorkerPool]:
    with start_pool(**TWO_WORKERS) as healthy:
        yield healthy


# -- the test matrices -----------------------------------------------------------------------
def _rank_deficient(rows: int, cols: int, rank: int, seed: int) -> NDArray[np.float64]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((rows, rank)) @ rng.standard_normal((rank, cols))


def _clustered_spectrum(n: int, seed: int) -> NDArray[np.float64]:
    rng = np.random.default_rng(seed)
    q1, _ = np.linalg.qr(rng.standard_normal((n, n)))
    q2, _ = np.linalg.qr(rng.standard_normal((n, n)))
    sigma = 1.0 + 1e-4 * rng.standard_normal(n)  # nearly equal singular values
    return (q1 * sigma) @ q2.T


def _test_matrices() -> list[tuple[str, NDArray[np.floating], int, int]]:
    rng = np.random.default_rng(2024)
    cases: list[tuple[str, NDArray[np.floating], int, int]] = [
        ("golden 2x2", np.array([3.0, 0.0, 0.0, 1.0], np.float32), 2, 2),
        ("square 64", rng.standard_normal(64 * 64).astype(np.float32), 64, 64),
        ("tall 300x40", rng.standard_normal(300 * 40).astype(np.float32), 300, 40),
        ("wide 40x300", rng.standard_normal(40 * 300).astype(np.float32), 40, 300),
        ("row 1x7", rng.standard_normal(7).astype(np.float32), 1, 7),
        ("column 9x1", rng.standard_normal(9).astype(np.float32), 9, 1),
        ("rank 3 of 50x30", _rank_deficient(50, 30, 3, 1).astype(np.float32).ravel(), 50, 30),
        ("rank 1 of 20x20", _rank_deficient(20, 20, 1, 2).astype(np.float32).ravel(), 20, 20),
        ("tiny 1e-30 scale", (rng.standard_normal(24 * 16) * 1e-30).astype(np.float32), 24, 16),
        ("large 1e30 scale", (rng.standard_normal(16 * 24) * 1e30).astype(np.float32), 16, 24),
        ("clustered spectrum", _clustered_spectrum(32, 3).astype(np.float32).ravel(), 32, 32),
        ("float64 input", rng.standard_normal(30 * 20), 30, 20),
        ("learning-rate sized", (rng.standard_normal(128 * 96) * 1e-3).astype(np.float32), 128, 96),
    ]
    return cases


MATRICES = _test_matrices()


# -- agreement and golden --------------------------------------------------------------------
def test_the_pool_is_the_torch_svd_backend_and_an_iso_solver(pool: IsoWorkerPool) -> None:
    solver: IsoSolver = pool  # the protocol merge.py defines, structurally
    assert solver.backend is IsoBackend.TORCH_SVD
    assert pool.torch_version and len(pool.worker_pids) == 2
    assert all(alive(pid) for pid in pool.worker_pids)


def test_workers_ignore_what_a_terminal_sends_its_whole_process_group(pool: IsoWorkerPool) -> None:
    for pid in pool.worker_pids:
        os.kill(pid, signal.SIGINT)
        os.kill(pid, signal.SIGHUP)
    out = pool.polar_flatten(np.array([3, 0, 0, 1], np.float32), 2, 2)
    np.testing.assert_allclose(out, [2, 0, 0, 2], rtol=1e-6)
    assert all(alive(pid) for pid in pool.worker_pids)


def test_a_terminal_signal_while_a_worker_starts_up_is_ignored_by_it(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """Ctrl+C while yeto-sync spawned its workers: a worker still in its interpreter's start-up
    died of it with a KeyboardInterrupt traceback (SIGHUP killed it silently)."""
    spawned = multiprocessing.get_context("spawn").Process
    real_start = spawned.start

    def start_then_interrupt(process: multiprocessing.process.BaseProcess) -> None:
        real_start(process)
        assert process.pid is not None
        os.kill(process.pid, signal.SIGINT)  # long before the child imports anything
        os.kill(process.pid, signal.SIGHUP)

    monkeypatch.setattr(spawned, "start", start_then_interrupt)
    with start_pool(workers=2, threads_per_worker=1) as started:
        out = started.polar_flatten(np.array([3, 0, 0, 1], np.float32), 2, 2)
        np.testing.assert_allclose(out, [2, 0, 0, 2], rtol=1e-6)
        assert all(alive(pid) for pid in started.worker_pids)
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.parametrize("backend", ["scalar", "torch-svd"])
def test_golden_flattens_the_spectrum_on_both_backends(pool: IsoWorkerPool, backend: str) -> None:
    solver: IsoSolver = SCALAR_ISO_SOLVER if backend == "scalar" else pool
    out = solver.polar_flatten(np.array([3, 0, 0, 1], np.float32), 2, 2)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, [2, 0, 0, 2], atol=1e-6)
    zero = solver.polar_flatten(np.zeros(6, np.float32), 2, 3)
    assert zero.dtype == np.float32 and not zero.any()


@pytest.mark.parametrize(("name", "matrix", "rows", "cols"), MATRICES, ids=[m[0] for m in MATRICES])
def test_both_backends_agree_to_1e_5_relative(
    pool: IsoWorkerPool, name: str, matrix: NDArray[np.floating], rows: int, cols: int
) -> None:
    want = SCALAR_ISO_SOLVER.polar_flatten(matrix, rows, cols)  # type: ignore[arg-type]
    got = pool.polar_flatten(matrix, rows, cols)  # type: ignore[arg-type]
    assert got.dtype == np.float32 and got.shape == (rows * cols,)
    assert relative_gap(got, want) <= 1e-5, name
    # And the result really is iso: every kept singular value equals σ̄.
    kept = np.linalg.svd(got.astype(np.float64).reshape(rows, cols), compute_uv=False)
    kept = kept[kept > kept[0] * 1e-4]
    np.testing.assert_allclose(kept, kept[0], rtol=1e-4)


def test_a_fragment_batch_runs_on_both_workers_and_matches(pool: IsoWorkerPool) -> None:
    rng = np.random.default_rng(5)
    batch = [(rng.standard_normal(256 * 64).astype(np.float32), 256, 64) for _ in range(8)]
    jobs = [pool.submit(matrix, rows, cols) for matrix, rows, cols in batch]
    results = [job.result() for job in jobs]
    assert {job.worker for job in jobs} == {0, 1}
    for (matrix, rows, cols), got in zip(batch, results, strict=True):
        assert relative_gap(got, SCALAR_ISO_SOLVER.polar_flatten(matrix, rows, cols)) <= 1e-5
    many = pool.polar_flatten_many(batch)
    for got, again in zip(results, many, strict=True):
        np.testing.assert_array_equal(got, again)  # deterministic per matrix
    assert pool.admitted == 0


def test_merge_round_with_the_pool_matches_the_scalar_backend(pool: IsoWorkerPool) -> None:
    geometry = WireFragment(MergeMode.ISO, (48 * 32, 16 * 16), ((48, 32), (16, 16)))
    rng = np.random.default_rng(11)
    responses = [
        Response.from_outer_gradient(
            i, 1, 3 + i, 1000 * (i + 1), rng.normal(0, 0.01, geometry.numel).astype("f4")
        )
        for i in range(3)
    ]
    params = rng.normal(0, 1, geometry.numel).astype(np.float32)
    momentum = rng.normal(0, 0.01, geometry.numel).astype(np.float32)
    config = MergeConfig()
    scalar = merge_round(geometry, responses, params, momentum, {}, config, SCALAR_ISO_SOLVER)
    pooled = merge_round(geometry, responses, params, momentum, {}, config, pool)
    assert relative_gap(pooled.params, scalar.params) <= 1e-5
    assert pooled.ledger == scalar.ledger


def test_jobs_own_their_buffers(pool: IsoWorkerPool) -> None:
    rng = np.random.default_rng(8)
    matrix = rng.standard_normal(40 * 30).astype(np.float32)
    kept = matrix.copy()
    want = SCALAR_ISO_SOLVER.polar_flatten(kept, 40, 30)
    job = pool.submit(matrix, 40, 30)
    matrix[:] = np.nan  # the caller reuses its buffer at once: the job copied it at admission
    got = job.result()
    assert relative_gap(got, want) <= 1e-5
    assert got.flags.owndata and got.flags.writeable
    assert job.result() is got and not np.shares_memory(got, matrix)
    np.testing.assert_array_equal(np.isnan(matrix), True)  # and the input was never written


@pytest.mark.parametrize("errno_value", [errno.ENOSPC, errno.EROFS])
def test_a_shared_memory_shortage_refuses_the_job_and_the_pool_goes_on(
    pool: IsoWorkerPool, monkeypatch: pytest.MonkeyPatch, errno_value: int
) -> None:
    """A full /dev/shm (a container's 64 MiB) was a SIGBUS at the first touch of the staged
    block, which killed the daemon without a word; a read-only one an "internal error"."""
    blocks_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()

    def no_room(descriptor: int, offset: int, length: int) -> None:
        raise OSError(errno_value, os.strerror(errno_value))

    monkeypatch.setattr(pool_module.os, "posix_fallocate", no_room)
    with pytest.raises(IsoPoolError, match=os.strerror(errno_value)) as caught:
        pool.submit(np.ones(64 * 64, np.float32), 64, 64)
    assert isinstance(caught.value, MergeError)  # a refused commit, not an internal error
    assert "cannot stage a 64x64 iso matrix in shared memory (/dev/shm)" in str(caught.value)
    if blocks_before or os.path.isdir("/dev/shm"):
        assert set(os.listdir("/dev/shm")) <= blocks_before  # the block was removed again
    monkeypatch.undo()
    matrix = np.random.default_rng(3).standard_normal(16).astype(np.float32)
    got = pool.polar_flatten(matrix, 4, 4)
    assert relative_gap(got, SCALAR_ISO_SOLVER.polar_flatten(matrix, 4, 4)) <= 1e-5


@pytest.mark.parametrize("errno_value", [errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSYS])
def test_a_file_system_that_cannot_reserve_stages_unreserved(
    pool: IsoWorkerPool, monkeypatch: pytest.MonkeyPatch, errno_value: int
) -> None:
    """Such an answer says nothing of the room left: every iso commit was refused."""

    def cannot_reserve(descriptor: int, offset: int, length: int) -> None:
        raise OSError(errno_value, os.strerror(errno_value))

    monkeypatch.setattr(pool_module.os, "posix_fallocate", cannot_reserve)
    matrix = np.random.default_rng(4).standard_normal(16).astype(np.float32)
    got = pool.polar_flatten(matrix, 4, 4)
    assert relative_gap(got, SCALAR_ISO_SOLVER.polar_flatten(matrix, 4, 4)) <= 1e-5


def test_bad_requests_are_value_errors(pool: IsoWorkerPool) -> None:
    with pytest.raises(ValueError, match="not 3x3"):
        pool.polar_flatten(np.ones(8, np.float32), 3, 3)
    with pytest.raises(ValueError, match="float32 or float64"):
        pool.polar_flatten(np.ones(4, np.int32), 2, 2)  # type: ignore[arg-type]
    assert pool.poison_reason is None and pool.admitted == 0


def test_the_syncer_process_never_imports_torch(tmp_path: Path) -> None:
    script = tmp_path / "no_torch.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys
            import numpy as np
            import yeto_sync.cli
            import yeto_sync.daemon
            from yeto_sync.iso import IsoPoolSettings, IsoWorkerPool

            if __name__ == "__main__":
                assert "torch" not in sys.modules
                with IsoWorkerPool(IsoPoolSettings(workers=1, threads_per_worker=1)) as pool:
                    out = pool.polar_flatten(np.array([3, 0, 0, 1], np.float32), 2, 2)
                    assert out.tolist() == [2, 0, 0, 2], out
                assert "torch" not in sys.modules
                print("ok")
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


# -- fault plans and settings ----------------------------------------------------------------
def test_fault_plans_parse_strictly() -> None:
    assert FaultPlan.parse("hang@1") == FaultPlan(FaultMode.HANG, after=1)
    assert FaultPlan.parse("slow=0.25") == FaultPlan(FaultMode.SLOW, seconds=0.25)
    assert FaultPlan.parse("startup-hang").mode is FaultMode.STARTUP_HANG
    for bad in ("", "explode", "hang@-1", "slow", "raise=2", "hang@x", "slow=inf"):
        with pytest.raises(ValueError, match="fault plan"):
            FaultPlan.parse(bad)


def test_settings_from_the_environment() -> None:
    settings = IsoPoolSettings.from_env(
        5,
        {
            "YETO_ISO_WORKERS": "3",
            "YETO_ISO_THREADS": "1",
            "YETO_ISO_REQUEST_DEADLINE_S": "2.5",
            "YETO_ISO_FAULT": "raise@2",
        },
    )
    assert (settings.workers, settings.threads_per_worker, settings.capacity) == (3, 1, 5)
    assert settings.request_deadline(4096, 4096) == 2.5
    assert settings.fault == FaultPlan(FaultMode.RAISE, after=2)
    default = IsoPoolSettings.from_env(16, {})
    assert default.fault is None and default.drain_deadline_s is None
    # Deadlines grow with the SVD's work: a big matrix gets more time than a small one.
    assert default.request_deadline(4096, 4096) > default.request_deadline(64, 64) >= 60.0
    with pytest.raises(ValueError, match="YETO_ISO_WORKERS"):
        IsoPoolSettings.from_env(16, {"YETO_ISO_WORKERS": "two"})
    # Counts are bounded (each worker imports torch) and the error names the variable.
    for name, text in (
        ("YETO_ISO_WORKERS", "0"),
        ("YETO_ISO_WORKERS", "-2"),
        ("YETO_ISO_WORKERS", "100000"),
        ("YETO_ISO_THREADS", "100000"),
        ("YETO_ISO_THREADS", "1.5"),
    ):
        with pytest.raises(ValueError, match=name):
            IsoPoolSettings.from_env(16, {name: text})
    with pytest.raises(ValueError, match="capacity"):
        IsoPoolSettings(capacity=0)


# -- failure paths ---------------------------------------------------------------------------
def test_a_hanging_child_is_killed_at_its_deadline_and_poisons_the_pool() -> None:
    pool = start_pool(
        **ONE_WORKER, capacity=4, request_deadline_s=1.0, fault=FaultPlan.parse("hang@1")
    )
    try:
        (pid,) = pool.worker_pids
        matrix = np.random.default_rng(1).standard_normal(20 * 10).astype(np.float32)
        first = pool.polar_flatten(matrix, 20, 10)  # served normally
        assert relative_gap(first, SCALAR_ISO_SOLVER.polar_flatten(matrix, 20, 10)) <= 1e-5
        started = time.monotonic()
        hung = pool.submit(matrix, 20, 10)
        queued = [pool.submit(matrix, 20, 10) for _ in range(2)]  # waiting behind the hang
        with pytest.raises(IsoPoolPoisoned, match="missed the 1 s deadline of a 20x10 SVD"):
            hung.result()
        assert 0.9 <= time.monotonic() - started < 10.0
        assert wait_gone((pid,), 5.0) == []  # the child it owned was killed
        for job in queued:  # queued work was discarded, not run later
            assert job.done() and job.dispatched_at is None
            with pytest.raises(IsoPoolPoisoned):
                job.result()
        assert pool.admitted == 0
        # The poison persists: every later call fails the same way, at once.
        reason = pool.poison_reason
        assert reason is not None and "missed the 1 s deadline" in reason
        with pytest.raises(IsoPoolPoisoned) as later:
            pool.polar_flatten(matrix, 20, 10)
        assert isinstance(later.value, MergeError) and str(later.value) == reason
        with pytest.raises(IsoPoolPoisoned):
            pool.polar_flatten(np.zeros(4, np.float32), 2, 2)
        with pytest.raises(IsoPoolPoisoned):
            pool.drain()
        with pytest.raises(IsoPoolPoisoned):
            pool.check()
    finally:
        pool.close()


def test_a_child_killed_from_outside_poisons_the_pool_without_waiting_for_the_deadline() -> None:
    pool = start_pool(**TWO_WORKERS, request_deadline_s=60.0, fault=FaultPlan.parse("slow=5"))
    try:
        victim, other = pool.worker_pids
        matrix = np.ones(16, np.float32)
        jobs = [pool.submit(matrix, 4, 4) for _ in range(3)]
        deadline = time.monotonic() + 10
        while jobs[0].dispatched_at is None and time.monotonic() < deadline:
            time.sleep(0.01)
        victim = pool.worker_pids[jobs[0].worker or 0]
        started = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(IsoPoolPoisoned, match=r"exited with code -9 during a 4x4 SVD"):
            jobs[0].result()
        assert time.monotonic() - started < 4.0  # noticed at once, not at the 60 s deadline
        for job in jobs[1:]:
            with pytest.raises(IsoPoolPoisoned):
                job.result()
        assert wait_gone(pool.worker_pids, 5.0) == []  # the healthy one is killed too
        assert pool.admitted == 0
    finally:
        pool.close()


def test_an_idle_child_killed_from_outside_fails_the_next_check() -> None:
    pool = start_pool(**ONE_WORKER)
    try:
        (pid,) = pool.worker_pids
        os.kill(pid, signal.SIGKILL)
        # The supervisor notices the death on its own (the worker's sentinel), no call needed.
        deadline = time.monotonic() + 5.0
        while pool.poison_reason is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pool.poison_reason is not None and f"pid {pid}) exited with code -9" in (
            pool.poison_reason
        )
        with pytest.raises(IsoPoolPoisoned, match=f"pid {pid}"):
            pool.check()  # what the driver asks before it writes a checkpoint
        with pytest.raises(IsoPoolPoisoned):
            pool.polar_flatten(np.ones(4, np.float32), 2, 2)
    finally:
        pool.close()


def test_a_child_that_raises_fails_that_job_only() -> None:
    with start_pool(**ONE_WORKER, fault=FaultPlan.parse("raise@1")) as pool:
        matrix = np.random.default_rng(3).standard_normal(12).astype(np.float32)
        pool.polar_flatten(matrix, 3, 4)
        with pytest.raises(IsoSolveError, match="injected solve fault") as failed:
            pool.polar_flatten(matrix, 3, 4)
        assert isinstance(failed.value, MergeError)
        # The worker answered in time: it is alive, the pool is healthy and keeps serving.
        again = pool.polar_flatten(matrix, 3, 4)
        assert relative_gap(again, SCALAR_ISO_SOLVER.polar_flatten(matrix, 3, 4)) <= 1e-5
        assert pool.poison_reason is None and all(alive(p) for p in pool.worker_pids)
        pool.drain()
        pool.check()


def test_a_slow_child_under_a_full_queue_applies_backpressure_and_loses_nothing() -> None:
    capacity, slow = 2, 0.3
    pool = start_pool(**ONE_WORKER, capacity=capacity, fault=FaultPlan.parse(f"slow={slow}"))
    try:
        rng = np.random.default_rng(4)
        matrices = [rng.standard_normal(6 * 5).astype(np.float32) for _ in range(5)]
        seen_admitted: list[int] = []
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                seen_admitted.append(pool.admitted)
                time.sleep(0.005)

        watcher = threading.Thread(target=watch)
        watcher.start()
        returned_at = []
        jobs = []
        for matrix in matrices:
            jobs.append(pool.submit(matrix, 6, 5))
            returned_at.append(time.monotonic())
        results = [job.result() for job in jobs]
        stop.set()
        watcher.join()

        assert max(seen_admitted) == capacity  # never more admitted than the capacity
        # Capacity counts a job until it completes, not until the worker picks it up: with
        # job 1 running and job 2 queued, job 3 is admitted only once job 1 has completed.
        for later, earlier in zip(jobs[capacity:], jobs, strict=False):
            assert earlier.completed_at is not None
            assert later.admitted_at >= earlier.completed_at
        assert returned_at[capacity] - returned_at[capacity - 1] >= slow * 0.8  # it waited
        for matrix, got in zip(matrices, results, strict=True):  # nothing dropped or mixed up
            assert relative_gap(got, SCALAR_ISO_SOLVER.polar_flatten(matrix, 6, 5)) <= 1e-5
        pool.drain()
        assert pool.admitted == 0 and pool.poison_reason is None
    finally:
        pool.close()


def test_a_drain_that_misses_its_deadline_kills_and_poisons() -> None:
    pool = start_pool(**ONE_WORKER, fault=FaultPlan.parse("slow=30"))
    try:
        (pid,) = pool.worker_pids
        job = pool.submit(np.ones(4, np.float32), 2, 2)
        started = time.monotonic()
        with pytest.raises(IsoPoolPoisoned, match="drain missed its 0.5 s deadline"):
            pool.drain(timeout=0.5)
        assert time.monotonic() - started < 3.0
        with pytest.raises(IsoPoolPoisoned):
            job.result()
        assert wait_gone((pid,), 5.0) == []
        with pytest.raises(IsoPoolPoisoned):
            pool.drain()  # and it stays that way
    finally:
        pool.close()


@pytest.mark.parametrize(
    ("fault", "deadline", "match"),
    [
        # Never reports ready: the start-up deadline fires.
        ("startup-hang", 1.5, r"not ready within the 1.5 s start-up deadline"),
        # Fails after importing torch (seconds on a busy machine): reported, not waited out.
        ("startup-raise", 60.0, r"iso worker \d: RuntimeError: injected start-up fault"),
    ],
)
def test_startup_that_never_completes_is_bounded_and_leaves_no_child(
    fault: str, deadline: float, match: str
) -> None:
    before = spawned_children()
    started = time.monotonic()
    with pytest.raises(IsoPoolStartupError, match=match):
        start_pool(**TWO_WORKERS, startup_deadline_s=deadline, fault=FaultPlan.parse(fault))
    assert time.monotonic() - started < min(deadline, 30.0) + 10.0
    assert spawned_children() - before == set()


def test_close_stops_every_child_and_refuses_later_work() -> None:
    pool = start_pool(**TWO_WORKERS)
    pids = pool.worker_pids
    pool.close()
    assert wait_gone(pids, 5.0) == []
    pool.close()  # idempotent
    with pytest.raises(IsoPoolClosed):
        pool.polar_flatten(np.ones(4, np.float32), 2, 2)


def test_workers_exit_when_the_syncer_process_is_killed(tmp_path: Path) -> None:
    script = tmp_path / "owner.py"
    script.write_text(
        textwrap.dedent(
            """
            import time
            from yeto_sync.iso import IsoPoolSettings, IsoWorkerPool

            if __name__ == "__main__":
                pool = IsoWorkerPool(IsoPoolSettings(workers=2, threads_per_worker=1))
                print(*pool.worker_pids, flush=True)
                time.sleep(120)
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    owner = subprocess.Popen(
        [sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert owner.stdout is not None
        pids = tuple(int(p) for p in owner.stdout.readline().split())
        assert len(pids) == 2 and all(alive(pid) for pid in pids)
        owner.kill()  # SIGKILL: no cleanup code of the owner runs
        owner.wait(10)
        assert wait_gone(pids, 5.0) == []
    finally:
        if owner.poll() is None:
            owner.kill()
        if owner.stdout is not None:
            owner.stdout.close()


# -- through the coordinator -----------------------------------------------------------------
def test_a_poisoned_pool_fails_the_commit_before_any_checkpoint(tmp_path: Path) -> None:
    layout = WireLayout(
        (
            WireFragment(MergeMode.ISO, (12 * 8,), ((12, 8),)),
            WireFragment(MergeMode.AVG, (10,)),
        )
    )
    config = SyncerConfig(
        learners=1,
        total_steps=6,
        pipeline=1,
        iso_backend=IsoBackend.TORCH_SVD,
        checkpoint_path=tmp_path / "ckpt",
        checkpoint_every=1,
    )
    pool = start_pool(**ONE_WORKER, request_deadline_s=1.0, fault=FaultPlan.parse("hang@1"))
    try:
        sim = Sim(config, layout, iso_solver=pool)
        sim.start()
        outcome = sim.run()
    finally:
        pool.close()
    assert isinstance(outcome, Exit) and outcome.code != 0
    assert "round 3 (fragment 0) failed to commit: iso pool poisoned" in outcome.reason
    # Steps 1 (iso, served) and 2 (avg) were checkpointed; nothing after the poison.
    assert [c.state.global_step for c in sim.checkpoints] == [1, 2]
    failing = sim.actions.index(outcome)
    assert not any(isinstance(a, WriteCheckpoint) for a in sim.actions[failing:])
    failures = [a.record for a in sim.of_type(AppendTape) if a.record.get("event")]
    assert failures and failures[-1]["event"] == "merge_failed" and failures[-1]["step"] == 3
