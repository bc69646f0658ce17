"""The iso worker: one spawned Python child that runs exact f64 SVDs with torch.

The parent (:mod:`yeto_sync.iso.pool`) starts it with the ``spawn`` start method and talks to it
over one duplex pipe of small pickled tuples; the matrices themselves travel through a
shared-memory block that the parent creates per job (see :func:`solve_in_place`).

Messages, parent → child: ``("solve", job_id, shm_name, rows, cols, dtype)`` and ``("stop",)``.
Child → parent: ``("ready", pid, torch_version, threads)`` once after start-up,
``("startup-failed", text)`` instead of it, then one ``("done", job_id, rank)`` or
``("failed", job_id, text)`` per request, in order.

torch is imported here, in the child, and nowhere in the syncer process. The child ignores
SIGINT (the parent decides when it stops) and exits by itself as soon as its parent is gone, even
in the middle of an SVD, so a killed daemon leaves no orphan behind.

Fault injection (:class:`FaultPlan`) is a real code path of this module, armed only when the
parent passes a plan: tests and the ``YETO_ISO_FAULT`` environment variable use it to make a
child hang, raise, run slowly, or never finish starting.
"""

from __future__ import annotations

import enum
import os
import signal
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory
from typing import Final

from ..merge import ISO_RELATIVE_CUTOFF

#: How often the child looks for its parent.
PARENT_POLL_S: Final = 0.2
#: Wire names of the input dtypes a job may carry.
DTYPES: Final = ("float32", "float64")


class FaultMode(enum.Enum):
    """What an armed worker does wrong (tests only)."""

    #: Never answer the request: the parent's deadline must kill the child.
    HANG = "hang"
    #: Raise inside one solve: that request fails, the child lives on.
    RAISE = "raise"
    #: Sleep ``seconds`` before solving each request.
    SLOW = "slow"
    #: Never report ready: the parent's start-up deadline must fire.
    STARTUP_HANG = "startup-hang"
    #: Fail while starting (as a broken torch install would).
    STARTUP_RAISE = "startup-raise"


@dataclass(frozen=True, slots=True)
class FaultPlan:
    """A fault to inject: ``mode``, once ``after`` requests were served normally.

    Text form (``YETO_ISO_FAULT``): ``MODE[=SECONDS][@AFTER]``, e.g. ``hang@1``, ``slow=0.5``,
    ``raise``, ``startup-hang``.
    """

    mode: FaultMode
    after: int = 0
    seconds: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", FaultMode(self.mode))
        if self.after < 0:
            raise ValueError(f"fault plan: after must be >= 0, got {self.after}")
        if not (0.0 <= self.seconds < float("inf")):
            raise ValueError(f"fault plan: seconds must be finite and >= 0, got {self.seconds}")
        if (self.mode is FaultMode.SLOW) != (self.seconds > 0.0):
            raise ValueError("fault plan: slow needs =SECONDS > 0, and only slow takes seconds")

    @classmethod
    def parse(cls, text: str) -> FaultPlan:
        body, _, after = text.strip().partition("@")
        name, _, seconds = body.partition("=")
        try:
            return cls(
                FaultMode(name),
                after=int(after) if after else 0,
                seconds=float(seconds) if seconds else 0.0,
            )
        except ValueError as exc:
            modes = ", ".join(mode.value for mode in FaultMode)
            raise ValueError(
                f"bad iso fault plan {text!r} (MODE[=SECONDS][@AFTER], MODE one of {modes}): {exc}"
            ) from None

    def armed(self, served: int) -> bool:
        """Whether the request after ``served`` normal ones misbehaves: slow stays slow, a
        raise or a hang hits that one request only (a hang never comes back anyway)."""
        if self.mode is FaultMode.SLOW:
            return served >= self.after
        return served == self.after


#: What a terminal sends the whole foreground process group; a worker ignores them.
TERMINAL_SIGNALS = frozenset(
    getattr(signal, name) for name in ("SIGINT", "SIGHUP") if hasattr(signal, name)
)


def worker_main(
    conn: Connection, index: int, threads: int, fault: FaultPlan | None, parent_pid: int
) -> None:
    """The child's entry point (a ``multiprocessing`` target)."""
    # Ctrl+C and a closed terminal reach the whole foreground process group: the syncer alone
    # decides when its workers stop (a worker dying first would fail the commit in progress).
    # The parent spawned this process with them blocked: one that came meanwhile is dropped.
    for signum in TERMINAL_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, TERMINAL_SIGNALS)
    threading.Thread(
        target=_exit_when_orphaned, args=(parent_pid,), name="parent-watch", daemon=True
    ).start()
    try:
        torch_version = _start(threads, fault)
    except Exception as exc:  # reported, not raised: the parent turns it into one error line
        conn.send(("startup-failed", f"iso worker {index}: {_one_line(exc)}"))
        return
    conn.send(("ready", os.getpid(), torch_version, threads))
    served = 0
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return  # the parent closed its end
        if message[0] != "solve":
            return
        _, job_id, shm_name, rows, cols, dtype = message
        try:
            if fault is not None and fault.armed(served):
                _inject(fault)
            rank = solve_in_place(shm_name, rows, cols, dtype)
            reply: tuple[object, ...] = ("done", job_id, rank)
        except Exception as exc:
            reply = ("failed", job_id, _one_line(exc))
        served += 1
        try:
            conn.send(reply)
        except OSError:
            return


def _one_line(exc: BaseException) -> str:
    """The exception as one line: it ends up in the daemon's one-line exit reason."""
    return " ".join(f"{type(exc).__name__}: {exc}".split())


def _start(threads: int, fault: FaultPlan | None) -> str:
    if fault is not None and fault.mode is FaultMode.STARTUP_HANG:
        _sleep_until_killed()
    # Before the import: the OpenMP/MKL pools are sized when torch loads. Idle OpenMP threads
    # sleep instead of spinning, which otherwise starves a busy machine (unless told otherwise).
    for variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[variable] = str(threads)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    torch.set_num_threads(threads)
    if fault is not None and fault.mode is FaultMode.STARTUP_RAISE:
        raise RuntimeError("injected start-up fault")
    # Load LAPACK and size the thread pool now, not inside the first request's deadline.
    torch.linalg.svd(torch.eye(4, dtype=torch.float64), full_matrices=False)
    return str(torch.__version__)


def _inject(fault: FaultPlan) -> None:
    if fault.mode is FaultMode.HANG:
        _sleep_until_killed()
    elif fault.mode is FaultMode.SLOW:
        time.sleep(fault.seconds)
    elif fault.mode is FaultMode.RAISE:
        raise RuntimeError("injected solve fault")


def _sleep_until_killed() -> None:
    while True:  # ended by the parent's kill, or by the orphan watch
        time.sleep(60.0)


def _exit_when_orphaned(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_S)
    os._exit(0)  # the daemon is gone: stop now, mid-SVD if need be


def solve_in_place(shm_name: str, rows: int, cols: int, dtype: str) -> int:
    """Replace the matrix in shared memory by σ̄ · Σ_kept u_i v_iᵀ, as f32; return the rank kept.

    The block holds ``rows × cols`` values of ``dtype`` (row-major) on entry and the same
    number of f32 values at its start on return. The math is the scalar backend's, in torch:
    f64 SVD, σ̄ = Σσ / min(rows, cols), directions above the relative cutoff, and one rounding
    to f32 at the end.
    """
    import torch

    if dtype not in DTYPES:
        raise ValueError(f"unsupported iso input dtype {dtype!r}")
    numel = rows * cols
    block = SharedMemory(name=shm_name)
    try:
        source = torch.frombuffer(block.buf, dtype=getattr(torch, dtype), count=numel)
        matrix = torch.empty(numel, dtype=torch.float64)
        matrix.copy_(source)  # widen (or copy) out of the shared block
        del source
        u, sigma, vh = torch.linalg.svd(matrix.view(rows, cols), full_matrices=False)
        del matrix
        largest = float(sigma[0])
        sigma_bar = float(sigma.sum()) / min(rows, cols)
        rank = int(torch.count_nonzero(sigma > largest * max(rows, cols) * ISO_RELATIVE_CUTOFF))
        # σ̄ goes into the smaller factor: one pass over min(rows, cols)² values, not rows·cols.
        if rows >= cols:
            product = u[:, :rank] @ (vh[:rank] * sigma_bar)
        else:
            product = (u[:, :rank] * sigma_bar) @ vh[:rank]
        del u, vh
        target = torch.frombuffer(block.buf, dtype=torch.float32, count=numel)
        target.copy_(product.view(numel))  # the one rounding to f32
        del target, product
        return rank
    finally:
        try:
            block.close()
        except BufferError:  # a failure left a tensor on the block: it unmaps when collected
            pass
