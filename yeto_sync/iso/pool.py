"""The ``torch-svd`` iso backend: exact f64 SVDs in a pool of directly owned worker processes.

:class:`IsoWorkerPool` implements :class:`yeto_sync.merge.IsoSolver` (``backend`` and a blocking
``polar_flatten``) and adds :meth:`~IsoWorkerPool.submit` (one job, a handle to wait on) and
:meth:`~IsoWorkerPool.polar_flatten_many` (the matrices of a fragment, spread over the workers).

Its rules, all enforced here:

- **Bounded start-up.** Every worker must report ready (torch imported, LAPACK loaded) within
  the start-up deadline, or all of them are killed and :class:`IsoPoolStartupError` is raised.
- **A deadline on every request.** The clock starts when a job is handed to a worker; its
  length grows with the matrix (:meth:`IsoPoolSettings.request_deadline`).
- **Poison.** A missed deadline kills the worker that owns the job and installs a persistent
  poison: every queued and running job fails with :class:`IsoPoolPoisoned`, every worker is
  killed, and every later call (submit, drain, check) raises it too. A worker that dies on its
  own (killed from outside, crashed) poisons the pool the same way.
- **Capacity.** A job counts against ``capacity`` from admission until it completes (done,
  failed or discarded), not until a worker picks it up. Admission beyond capacity waits —
  backpressure; nothing is dropped.
- **Bounded drain.** :meth:`~IsoWorkerPool.drain` waits for every admitted job; if its
  deadline passes first, the busy workers are killed and the pool is poisoned.
- **Owned buffers.** A job copies its input into its own shared-memory block at admission and
  its result out into a new array at completion, so nothing a job does touches memory the
  caller still uses.
- **No orphans.** :meth:`~IsoWorkerPool.close` stops and then kills every worker; workers also
  exit by themselves when the syncer process disappears.

A worker that raises while solving fails only that job (:class:`IsoSolveError`): it answered
within its deadline, so its state is known and the pool stays healthy. Every error here derives
from :class:`yeto_sync.merge.MergeError`, so the coordinator fails the commit that asked for the
solve (exit non-zero, no checkpoint for it).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import math
import multiprocessing
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from multiprocessing.shared_memory import SharedMemory
from typing import Final

import numpy as np
from numpy.typing import NDArray

from yeto_proto.constants import IsoBackend

from ..merge import MergeError
from .worker import TERMINAL_SIGNALS, FaultPlan, worker_main

F32Array = NDArray[np.float32]
IsoInput = NDArray[np.float32] | NDArray[np.float64]

#: Upper bounds of ``YETO_ISO_WORKERS`` and ``YETO_ISO_THREADS`` per core of the machine.
MAX_WORKERS_PER_CORE: Final = 2
MAX_THREADS_PER_CORE: Final = 4
#: Seconds :meth:`IsoWorkerPool.close` gives idle workers to exit before it kills them.
STOP_GRACE_S: Final = 2.0
#: Longest single wait of the supervisor, so liveness is looked at even when nothing happens.
SUPERVISOR_TICK_S: Final = 0.5
#: Seconds to reap a killed worker; SIGKILL takes effect at once, this only bounds the join.
REAP_TIMEOUT_S: Final = 5.0
#: Beyond the close's own bounds, how long a second closer waits for the first one.
CLOSE_MARGIN_S: Final = 5.0

#: Seconds the workers get to import torch and report ready (a cold start on a busy machine).
DEFAULT_STARTUP_DEADLINE_S: Final = 120.0

#: posix_fallocate's answers for "this file system or kernel cannot reserve", not "no room".
_CANNOT_RESERVE: Final = frozenset({errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSYS})

ENV_WORKERS: Final = "YETO_ISO_WORKERS"
ENV_THREADS: Final = "YETO_ISO_THREADS"
ENV_STARTUP_DEADLINE: Final = "YETO_ISO_STARTUP_DEADLINE_S"
ENV_REQUEST_DEADLINE: Final = "YETO_ISO_REQUEST_DEADLINE_S"
ENV_DRAIN_DEADLINE: Final = "YETO_ISO_DRAIN_DEADLINE_S"
#: Test-only: a :class:`~yeto_sync.iso.worker.FaultPlan` in its text form.
ENV_FAULT: Final = "YETO_ISO_FAULT"


# -- errors ----------------------------------------------------------------------------------
class IsoPoolError(MergeError):
    """Any failure of the torch-svd pool; the round that needed it cannot commit."""


class IsoPoolStartupError(IsoPoolError):
    """The workers did not all become ready within the start-up deadline."""


class IsoPoolPoisoned(IsoPoolError):
    """The pool is poisoned (a deadline expired or a worker died); it never recovers."""


class IsoPoolClosed(IsoPoolError):
    """The pool was closed before the job completed."""


class IsoSolveError(IsoPoolError):
    """A worker raised while solving one job; the pool itself is still healthy."""


# -- settings --------------------------------------------------------------------------------
def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def default_workers() -> int:
    """One single-threaded worker per core.

    Measured on the shared 2-core machine (benchmarks/RESULTS.md): while other jobs hold a
    core, a two-threaded LAPACK SVD runs 2-6x slower than a single-threaded one, whereas
    single-threaded workers degrade gracefully and still run a fragment's matrices in parallel.
    """
    return _cpu_count()


def default_threads(workers: int) -> int:
    """Cores shared out between the workers, so the pool never oversubscribes the machine."""
    return max(1, _cpu_count() // max(workers, 1))


@dataclass(frozen=True, slots=True)
class IsoPoolSettings:
    """How many workers, how big the queue, and the three deadlines (seconds).

    A request's deadline is ``request_deadline_floor_s + request_deadline_s_per_unit ·
    rows·cols·min(rows, cols)`` (an SVD costs about that many flops), unless
    ``request_deadline_s`` fixes one value for every request. Deadlines catch a worker that
    stopped making progress; they are generous on purpose (a 4096×4096 SVD has a deadline of
    about ten minutes by default, some ten times what it takes on two busy cores).
    """

    workers: int = 0  # 0: default_workers()
    threads_per_worker: int = 0  # 0: default_threads(workers)
    capacity: int = 16
    startup_deadline_s: float = DEFAULT_STARTUP_DEADLINE_S
    request_deadline_floor_s: float = 60.0
    request_deadline_s_per_unit: float = 8e-9
    request_deadline_s: float | None = None
    #: ``None``: a drain may take as long as its jobs' deadlines allow (:meth:`drain_bound`).
    drain_deadline_s: float | None = None
    fault: FaultPlan | None = None

    def __post_init__(self) -> None:
        workers = self.workers or default_workers()
        object.__setattr__(self, "workers", workers)
        object.__setattr__(
            self, "threads_per_worker", self.threads_per_worker or default_threads(workers)
        )
        if workers < 1 or self.threads_per_worker < 1:
            raise ValueError("iso pool: workers and threads per worker must be >= 1")
        if self.capacity < 1:
            raise ValueError(f"iso pool: capacity must be >= 1, got {self.capacity}")
        for name in (
            "startup_deadline_s",
            "request_deadline_floor_s",
            "request_deadline_s",
            "drain_deadline_s",
        ):
            value = getattr(self, name)
            if value is not None and not (0.0 < value < math.inf):
                raise ValueError(f"iso pool: {name} must be finite and > 0, got {value}")
        if not (0.0 <= self.request_deadline_s_per_unit < math.inf):
            raise ValueError("iso pool: request_deadline_s_per_unit must be finite and >= 0")

    def request_deadline(self, rows: int, cols: int) -> float:
        if self.request_deadline_s is not None:
            return self.request_deadline_s
        work = float(rows) * float(cols) * float(min(rows, cols))
        return self.request_deadline_floor_s + self.request_deadline_s_per_unit * work

    @classmethod
    def from_env(cls, capacity: int, environ: Mapping[str, str] | None = None) -> IsoPoolSettings:
        """Defaults, with the ``YETO_ISO_*`` environment overrides (the daemon uses this).

        ``YETO_ISO_WORKERS``, ``YETO_ISO_THREADS``, ``YETO_ISO_STARTUP_DEADLINE_S``,
        ``YETO_ISO_REQUEST_DEADLINE_S`` (one fixed deadline for every request),
        ``YETO_ISO_DRAIN_DEADLINE_S``, and the test-only ``YETO_ISO_FAULT``.
        """
        env = os.environ if environ is None else environ

        def number(name: str, kind: Callable[[str], float]) -> float | None:
            text = env.get(name)
            if text is None or text == "":
                return None
            try:
                return kind(text)
            except ValueError:
                raise ValueError(f"{name}={text!r} is not a valid {kind.__name__}") from None

        def count(name: str, most: int) -> int | None:
            value = number(name, int)
            if value is not None and not 1 <= value <= most:
                # Each worker imports torch (hundreds of MiB): the bound keeps memory bounded.
                raise ValueError(f"{name}={env[name]!r} must be in 1..{most} on this machine")
            return None if value is None else int(value)

        cores = os.cpu_count() or 1
        workers = count(ENV_WORKERS, MAX_WORKERS_PER_CORE * cores)
        threads = count(ENV_THREADS, MAX_THREADS_PER_CORE * cores)
        startup = number(ENV_STARTUP_DEADLINE, float)
        request = number(ENV_REQUEST_DEADLINE, float)
        drain = number(ENV_DRAIN_DEADLINE, float)
        fault = env.get(ENV_FAULT)
        return cls(
            workers=int(workers or 0),
            threads_per_worker=int(threads or 0),
            capacity=capacity,
            startup_deadline_s=startup if startup is not None else DEFAULT_STARTUP_DEADLINE_S,
            request_deadline_s=request,
            drain_deadline_s=drain,
            fault=FaultPlan.parse(fault) if fault else None,
        )


# -- jobs ------------------------------------------------------------------------------------
class IsoJob:
    """One admitted matrix: its owned shared-memory input, then its owned f32 result."""

    def __init__(self, pool: IsoWorkerPool, job_id: int, rows: int, cols: int) -> None:
        self._pool = pool
        self.job_id = job_id
        self.rows = rows
        self.cols = cols
        #: Seconds the worker gets once it has the job.
        self.deadline_s = pool.settings.request_deadline(rows, cols)
        self.admitted_at = time.monotonic()
        self.dispatched_at: float | None = None
        self.completed_at: float | None = None
        #: The worker index that ran (or is running) it.
        self.worker: int | None = None
        self.rank: int | None = None
        self._block: SharedMemory | None = None
        self._dtype = "float32"
        self._result: F32Array | None = None
        self._error: IsoPoolError | None = None
        self._done = threading.Event()

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> F32Array:
        """The flattened f32 matrix (a new array the caller owns), or the job's error.

        Without ``timeout`` the wait is bounded by what the pool's deadlines allow; if even
        that passes, the pool's supervision failed and the pool is poisoned.
        """
        bound = self._pool.drain_bound() if timeout is None else timeout
        if not self._done.wait(bound):
            if timeout is not None:
                raise TimeoutError(f"iso job {self.job_id} not done after {timeout} s")
            self._pool._poison(f"iso job {self.job_id} got no result within {bound:.1f} s")
            self._done.wait(REAP_TIMEOUT_S)
        if self._error is not None:
            raise self._error
        if self._result is None:
            raise IsoPoolPoisoned(f"iso job {self.job_id} was lost")
        return self._result

    # -- the pool's side ------------------------------------------------------------------
    def _fill(self, matrix: IsoInput) -> None:
        flat = matrix.reshape(-1)
        block = SharedMemory(create=True, size=max(flat.nbytes, 1))
        self._block = block
        descriptor = getattr(block, "_fd", -1)
        if descriptor >= 0 and hasattr(os, "posix_fallocate"):  # not on macOS
            # A shared block's pages are only taken when first touched: on a full /dev/shm
            # (a container's 64 MiB) that touch is a SIGBUS that kills the daemon without a
            # word. Reserved now, the shortage is an OSError the commit can refuse.
            try:
                os.posix_fallocate(descriptor, 0, block.size)
            except OSError as exc:
                # A file system that cannot reserve (EINVAL, EOPNOTSUPP, ENOSYS) goes unreserved,
                # as on a platform without the call; a real shortage is still refused.
                if exc.errno not in _CANNOT_RESERVE:
                    raise
        self._dtype = flat.dtype.name
        staged: np.ndarray = np.ndarray(flat.shape, dtype=flat.dtype, buffer=block.buf)
        np.copyto(staged, flat)
        del staged

    def _take_result(self) -> F32Array:
        assert self._block is not None
        view: np.ndarray = np.ndarray(
            (self.rows * self.cols,), dtype=np.float32, buffer=self._block.buf
        )
        result: F32Array = view.copy()
        del view
        return result

    def _release_block(self) -> None:
        block, self._block = self._block, None
        if block is None:
            return
        block.close()
        try:
            block.unlink()
        except FileNotFoundError:
            pass

    def _settle(self, result: F32Array | None, error: IsoPoolError | None) -> None:
        if self._done.is_set():
            return
        self._result, self._error = result, error
        self.completed_at = time.monotonic()
        self._release_block()
        self._done.set()


@dataclass(eq=False)
class _Worker:
    index: int
    process: BaseProcess
    conn: Connection
    pid: int = 0
    job: IsoJob | None = None
    dispatched_at: float = 0.0

    @property
    def deadline_at(self) -> float:
        assert self.job is not None
        return self.dispatched_at + self.job.deadline_s


# -- the pool --------------------------------------------------------------------------------
@contextlib.contextmanager
def _terminal_signals_blocked() -> Iterator[None]:
    """Hold back :data:`TERMINAL_SIGNALS` while a worker is spawned: the child inherits the
    blocked mask through exec, and a Ctrl+C during its interpreter's start-up waits until
    :func:`worker_main` ignores it (it printed a worker's KeyboardInterrupt traceback, and the
    worker died). The parent gets its own once the child is started."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    held = signal.pthread_sigmask(signal.SIG_BLOCK, TERMINAL_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


class IsoWorkerPool:
    """The ``torch-svd`` iso solver. Starts its workers in the constructor (bounded)."""

    def __init__(self, settings: IsoPoolSettings | None = None) -> None:
        self.settings = settings if settings is not None else IsoPoolSettings()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._queue: deque[IsoJob] = deque()
        self._admitted = 0
        #: Jobs completed so far (any outcome): an admission wait restarts its bound on each.
        self._completions = 0
        self._poison_reason: str | None = None
        self._closed = False
        self._close_done = threading.Event()
        self._ids = itertools.count(1)
        self._workers: list[_Worker] = []
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.torch_version = ""
        started = time.monotonic()
        try:
            self._start_workers()
        except BaseException:
            self._kill_all()
            self._close_pipes()
            raise
        self.startup_s = time.monotonic() - started
        self._supervisor = threading.Thread(
            target=self._supervise, name="yeto-iso-supervisor", daemon=True
        )
        self._supervisor.start()

    # -- IsoSolver ---------------------------------------------------------------------------
    @property
    def backend(self) -> IsoBackend:
        return IsoBackend.TORCH_SVD

    def polar_flatten(self, matrix: IsoInput, rows: int, cols: int) -> F32Array:
        """Blocking: admit (waiting for capacity), solve on a worker, return a new f32 array."""
        return self.submit(matrix, rows, cols).result()

    # -- extensions ------------------------------------------------------------------------
    def polar_flatten_many(self, matrices: Sequence[tuple[IsoInput, int, int]]) -> list[F32Array]:
        """Several matrices at once (one fragment's tensors), spread over the workers.

        Results come back in the order given. The first failure is raised; jobs still running
        then finish on their own (their results are discarded, their buffers are their own).
        """
        jobs = [self.submit(matrix, rows, cols) for matrix, rows, cols in matrices]
        return [job.result() for job in jobs]

    def submit(self, matrix: IsoInput, rows: int, cols: int) -> IsoJob:
        """Admit one matrix; waits while ``capacity`` jobs are admitted (backpressure).

        The input is copied at admission, so the caller may reuse ``matrix`` at once. A zero
        matrix completes at once with zeros (the pinned rule), without a worker.
        """
        if rows <= 0 or cols <= 0 or matrix.size != rows * cols:
            raise ValueError(f"iso matrix of {matrix.size} values is not {rows}x{cols}")
        if matrix.dtype not in (np.float32, np.float64):
            raise ValueError(f"iso matrix must be float32 or float64, not {matrix.dtype}")
        self._admit()
        job = IsoJob(self, next(self._ids), rows, cols)
        try:
            if not matrix.any():
                job._settle(np.zeros(rows * cols, dtype=np.float32), None)
                self._release(job)
                return job
            job._fill(matrix)
        except OSError as exc:  # /dev/shm full, too small or read-only: the commit fails
            error = IsoPoolError(
                f"cannot stage a {rows}x{cols} iso matrix in shared memory (/dev/shm): "
                f"{exc.strerror or exc}; give /dev/shm more room (docker run --shm-size) or use "
                "--iso-backend scalar"
            )
            job._settle(None, error)
            self._release(job)
            raise error from None
        except BaseException:
            job._settle(None, IsoPoolError("admission failed"))
            self._release(job)
            raise
        with self._lock:
            if self._poison_reason is not None or self._closed:
                error = self._refusal_locked()
                job._settle(None, error)
                self._admitted -= 1
                self._changed.notify_all()
                raise error
            self._queue.append(job)
            self._wake_locked()
        return job

    def drain(self, timeout: float | None = None) -> None:
        """Wait until every admitted job completed; raise if the pool is (or becomes) poisoned.

        ``timeout`` defaults to ``settings.drain_deadline_s``, else to :meth:`drain_bound`. If
        it passes with jobs still admitted, the workers are killed and the pool is poisoned.
        """
        limit = self._drain_limit(timeout)
        deadline = time.monotonic() + limit
        with self._lock:
            while self._poison_reason is None and self._admitted > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._poison_locked(
                        f"iso pool drain missed its {limit:.1f} s deadline with "
                        f"{self._admitted} job(s) admitted"
                    )
                    break
                self._changed.wait(left)
            if self._poison_reason is not None:
                raise IsoPoolPoisoned(self._poison_reason)
            if self._closed:
                raise IsoPoolClosed("the iso pool is closed")
        self.check()

    def check(self) -> None:
        """Raise :class:`IsoPoolPoisoned` if poisoned; a dead worker found now poisons it."""
        with self._lock:
            if self._poison_reason is None and not self._closed:
                for worker in self._workers:
                    if not worker.process.is_alive():
                        self._poison_locked(self._death_reason(worker))
                        break
            if self._poison_reason is not None:
                raise IsoPoolPoisoned(self._poison_reason)
            if self._closed:
                raise IsoPoolClosed("the iso pool is closed")

    def close(self) -> None:
        """Fail what is admitted, stop the workers (killing any that linger). Idempotent.

        A second caller (the daemon's last clean-up while a stop's close still runs) returns
        once the first is done, so no worker outlives the daemon's exit.
        """
        with self._lock:
            closing_elsewhere = self._closed
            self._closed = True
            if not closing_elsewhere:
                self._fail_all_locked(IsoPoolClosed("the iso pool was closed"))
                self._wake_locked()
        if closing_elsewhere:
            self._close_done.wait(REAP_TIMEOUT_S + STOP_GRACE_S + CLOSE_MARGIN_S)
            return
        try:
            self._stop_workers()
        finally:
            self._close_done.set()

    def _stop_workers(self) -> None:
        self._supervisor.join(REAP_TIMEOUT_S)
        for worker in self._workers:
            if worker.process.is_alive() and worker.job is None:
                try:
                    worker.conn.send(("stop",))
                except OSError:
                    pass
        deadline = time.monotonic() + STOP_GRACE_S
        for worker in self._workers:
            worker.process.join(max(deadline - time.monotonic(), 0.0))
        self._kill_all()
        self._close_pipes()
        for worker in self._workers:
            try:
                worker.process.close()
            except ValueError:  # still running after SIGKILL and the reap timeout
                pass

    def __enter__(self) -> IsoWorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- views -----------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.settings.capacity

    @property
    def admitted(self) -> int:
        """Jobs admitted and not yet completed (queued plus running)."""
        with self._lock:
            return self._admitted

    @property
    def poison_reason(self) -> str | None:
        with self._lock:
            return self._poison_reason

    @property
    def worker_pids(self) -> tuple[int, ...]:
        return tuple(worker.pid for worker in self._workers)

    def drain_bound(self) -> float:
        """Longest a healthy pool can take to finish what is admitted now: every admitted job's
        full deadline, end to end, plus the floor. Waits without their own deadline use it."""
        with self._lock:
            return self._drain_bound_locked()

    def _drain_bound_locked(self) -> float:
        running = [w.job for w in self._workers if w.job is not None]
        pending = [*self._queue, *running]
        return self.settings.request_deadline_floor_s + sum(j.deadline_s for j in pending)

    # -- admission -------------------------------------------------------------------------
    def _admit(self) -> None:
        """Take one unit of capacity, waiting while none is free. The wait is bounded: some
        admitted job must complete within the drain bound, or supervision failed."""
        with self._lock:
            completions, bound, deadline = -1, 0.0, 0.0  # set on the first pass through the loop
            while True:
                if self._poison_reason is not None or self._closed:
                    raise self._refusal_locked()
                if self._admitted < self.settings.capacity:
                    self._admitted += 1
                    return
                if completions != self._completions:  # progress: the bound starts again
                    completions = self._completions
                    bound = self._drain_bound_locked()
                    deadline = time.monotonic() + bound
                left = deadline - time.monotonic()
                if left <= 0:
                    self._poison_locked(
                        f"iso pool admission waited {bound:.1f} s without a job completing"
                    )
                    continue
                self._changed.wait(left)

    def _release(self, job: IsoJob) -> None:
        del job
        with self._lock:
            self._admitted -= 1
            self._completions += 1
            self._changed.notify_all()

    def _refusal_locked(self) -> IsoPoolError:
        if self._poison_reason is not None:
            return IsoPoolPoisoned(self._poison_reason)
        return IsoPoolClosed("the iso pool is closed")

    def _drain_limit(self, timeout: float | None) -> float:
        if timeout is not None:
            return timeout
        if self.settings.drain_deadline_s is not None:
            return self.settings.drain_deadline_s
        return self.drain_bound()

    # -- start-up --------------------------------------------------------------------------
    def _start_workers(self) -> None:
        settings = self.settings
        # spawn, never fork: the daemon runs threads (anyio's, the supervisor). Not forkserver
        # either: its workers would be the server's children, not ours to reap and watch.
        context = multiprocessing.get_context("spawn")
        for index in range(settings.workers):
            parent_end, child_end = context.Pipe(duplex=True)
            process = context.Process(
                target=worker_main,
                args=(child_end, index, settings.threads_per_worker, settings.fault, os.getpid()),
                name=f"yeto-iso-worker-{index}",
                daemon=True,
            )
            try:
                with _terminal_signals_blocked():
                    process.start()
            except BaseException:
                parent_end.close()
                raise
            finally:
                child_end.close()
            self._workers.append(_Worker(index, process, parent_end))
        limit = settings.startup_deadline_s
        deadline = time.monotonic() + limit
        waiting = {worker.conn: worker for worker in self._workers}
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                indexes = sorted(worker.index for worker in waiting.values())
                raise IsoPoolStartupError(
                    f"iso worker(s) {indexes} not ready within the {limit:g} s start-up deadline"
                )
            sentinels = {w.process.sentinel: w for w in waiting.values()}
            for ready in wait([*waiting, *sentinels], left):
                worker = waiting.get(ready) if isinstance(ready, Connection) else None
                if worker is None:
                    dead = sentinels.get(ready) if isinstance(ready, int) else None
                    if dead is not None and not dead.conn.poll():
                        dead.process.join(REAP_TIMEOUT_S)
                        raise IsoPoolStartupError(
                            f"iso worker {dead.index} exited while starting "
                            f"(exit code {dead.process.exitcode})"
                        )
                    continue
                try:
                    message = worker.conn.recv()
                except (EOFError, OSError):
                    raise IsoPoolStartupError(
                        f"iso worker {worker.index} exited while starting"
                    ) from None
                if message[0] == "startup-failed":
                    raise IsoPoolStartupError(str(message[1]))
                if message[0] != "ready":
                    raise IsoPoolStartupError(f"iso worker {worker.index} said {message[0]!r}")
                _, worker.pid, self.torch_version, _ = message
                del waiting[worker.conn]

    # -- supervision -----------------------------------------------------------------------
    def _supervise(self) -> None:
        """Dispatch queued jobs, collect answers, enforce deadlines, notice deaths."""
        try:
            self._supervise_loop()
        except BaseException as exc:  # a bug here must not leave callers waiting
            self._poison(f"the iso pool supervisor failed: {exc!r}")
            raise

    def _supervise_loop(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                self._dispatch_locked()
                busy = [w for w in self._workers if w.job is not None]
                objects: list[Connection | int] = [self._wake_r]
                if self._poison_reason is None:
                    objects += [w.conn for w in busy]
                    objects += [w.process.sentinel for w in self._workers]
                now = time.monotonic()
                timeout = min([SUPERVISOR_TICK_S, *(w.deadline_at - now for w in busy)])
            ready = wait(objects, max(timeout, 0.0))
            if objects[0] in ready:
                with self._lock:
                    if self._wake_r >= 0:
                        try:
                            os.read(self._wake_r, 4096)
                        except BlockingIOError:
                            pass
            answers = [w for w in busy if w.conn in ready]
            for worker in answers:
                self._collect(worker)
            with self._lock:
                if self._closed or self._poison_reason is not None:
                    continue
                now = time.monotonic()
                for worker in self._workers:
                    if worker.job is not None and now >= worker.deadline_at:
                        job = worker.job
                        self._poison_locked(
                            f"iso worker {worker.index} (pid {worker.pid}) missed the "
                            f"{job.deadline_s:g} s deadline of a {job.rows}x{job.cols} SVD "
                            f"and was killed"
                        )
                        break
                    if not worker.process.is_alive():
                        self._poison_locked(self._death_reason(worker))
                        break

    def _dispatch_locked(self) -> None:
        if self._poison_reason is not None:
            return
        for worker in self._workers:
            if not self._queue:
                return
            if worker.job is not None:
                continue
            job = self._queue.popleft()
            worker.job, worker.dispatched_at = job, time.monotonic()
            job.worker, job.dispatched_at = worker.index, worker.dispatched_at
            assert job._block is not None
            try:
                worker.conn.send(
                    ("solve", job.job_id, job._block.name, job.rows, job.cols, job._dtype)
                )
            except OSError:
                self._poison_locked(self._death_reason(worker))
                return

    def _collect(self, worker: _Worker) -> None:
        """Read one answer from a worker that has one (or closed its pipe)."""
        try:
            message = worker.conn.recv()
        except (EOFError, OSError):
            with self._lock:
                self._poison_locked(self._death_reason(worker))
            return
        with self._lock:
            job = worker.job
            if job is None or self._poison_reason is not None:
                return
            if message[0] not in ("done", "failed") or message[1] != job.job_id:
                self._poison_locked(f"iso worker {worker.index} answered out of turn")
                return
            worker.job = None
        if message[0] == "done":
            job.rank = int(message[2])
            result: F32Array | None = job._take_result()  # copied out before the block goes
            error: IsoPoolError | None = None
        else:
            result = None
            error = IsoSolveError(
                f"iso worker {worker.index} failed a {job.rows}x{job.cols} SVD: {message[2]}"
            )
        job._settle(result, error)
        self._release(job)

    # -- poison and teardown ---------------------------------------------------------------
    def _poison(self, reason: str) -> None:
        with self._lock:
            self._poison_locked(reason)

    def _poison_locked(self, reason: str) -> None:
        """Install the poison (the first reason stays), kill every worker, fail every job."""
        if self._poison_reason is None:
            self._poison_reason = f"iso pool poisoned: {reason}"
        for worker in self._workers:
            if worker.process.is_alive():
                worker.process.kill()
        self._fail_all_locked(IsoPoolPoisoned(self._poison_reason))
        self._changed.notify_all()

    def _fail_all_locked(self, error: IsoPoolError) -> None:
        """Discard queued work and the running jobs; their capacity is released."""
        jobs = [*self._queue, *(w.job for w in self._workers if w.job is not None)]
        self._queue.clear()
        for worker in self._workers:
            worker.job = None
        for job in jobs:
            job._settle(None, error)
        self._admitted -= len(jobs)
        self._completions += len(jobs)
        self._changed.notify_all()

    def _death_reason(self, worker: _Worker) -> str:
        worker.process.join(0.1)  # its sentinel fired or its pipe closed: it is exiting
        code = worker.process.exitcode
        how = "is gone" if code is None else f"exited with code {code}"
        doing = "" if worker.job is None else f" during a {worker.job.rows}x{worker.job.cols} SVD"
        return f"iso worker {worker.index} (pid {worker.pid}) {how}{doing}"

    def _kill_all(self) -> None:
        for worker in self._workers:
            if worker.process.is_alive():
                worker.process.kill()
        for worker in self._workers:
            worker.process.join(REAP_TIMEOUT_S)

    def _close_pipes(self) -> None:
        for worker in self._workers:
            worker.conn.close()
        with self._lock:
            # Marked closed under the lock: a stale descriptor number is never written to.
            fds, self._wake_r, self._wake_w = (self._wake_r, self._wake_w), -1, -1
        for fd in fds:
            if fd >= 0:
                os.close(fd)

    def _wake_locked(self) -> None:
        if self._wake_w < 0:
            return
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:  # full of wake-ups already
            pass
