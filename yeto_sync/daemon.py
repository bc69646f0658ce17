"""``yeto-sync``: the syncer daemon, a drop-in for the reference syncer's flags.

Its entry point is :func:`yeto_sync.cli.main`, which handles the stop signals before this module
and its imports load.

Once the listener is bound it prints exactly one line, ``yeto-sync listening on HOST:PORT``, to
stdout (with ``--port 0``, the port the system chose). Structured ``key=value`` log lines go to
stderr. Exit status: 0 after a completed finalization (or a benchmark cutoff); 2 for bad flags,
an unreadable key or checkpoint, or an existing checkpoint without ``--resume``; otherwise the
coordinator's failure code (1), or 128 + the signal number after SIGINT/SIGTERM/SIGHUP (SIGHUP
unless started under nohup). The last
stderr line always says why the syncer stopped and which checkpoint (path and global step) it kept.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

import anyio
import anyio.abc

from yeto_proto.checkpoint import (
    Checkpoint,
    name_length_problem,
    read_checkpoint,
    refusal_for_every_hello,
    remove_orphaned_temporaries,
)
from yeto_proto.checkpoint.atomic import read_capped
from yeto_proto.checkpoint.marker import MarkerStatus, marker_path, marker_state
from yeto_proto.constants import IsoBackend
from yeto_proto.errors import ErrorCode, ProtocolError
from yeto_proto.identity import DeltaCorrection, LearnerWeight, hello_key_of_file

from .config import DEFAULT_HOST, DEFAULT_PORT, SyncerConfig
from .coordinator import Coordinator
from .driver import CheckpointKind, Driver, DurableCheckpoint, KeyValueLog, Outputs
from .events import Exit
from .help_format import HelpFormatter
from .iso import IsoPoolSettings, IsoWorkerPool
from .merge import MergeError
from .open_file_limit import raise_open_file_limit
from .stop_signals import Stopped, StopSignals, ignore_stop_signals
from .transport import MonotonicClock
from .transport.group import HELLO_STEP_BYTES, ConnectionGroups
from .transport.tcp import TcpTransport

PROG = "yeto-sync"
EXIT_BAD_INPUT = 2
EXIT_FAILURE = 1
HMAC_KEY_ENV = "YETO_ISLAND_HMAC_KEY"
#: The largest HELLO key file (and $YETO_ISLAND_HMAC_KEY) accepted: HMAC-SHA256 hashes any key
#: over 64 bytes down to 32, so a longer key adds nothing; the cap only stops a wrong file.
MAX_HELLO_KEY_FILE_BYTES = 64 * 1024

_DELTA_CORRECTIONS = {"heloco": DeltaCorrection.HELOCO, "none": DeltaCorrection.NONE}
_ISO_BACKENDS = {"scalar": IsoBackend.SCALAR, "torch-svd": IsoBackend.TORCH_SVD}
_LEARNER_WEIGHTS = {
    "tokens2-over-steps": LearnerWeight.TOKENS2_OVER_STEPS,
    "equal": LearnerWeight.EQUAL,
}


class BadInput(Exception):
    """A startup problem the operator must fix; its text is the one stderr line."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "The YETO v4 syncer: owns the global model and the outer optimizer, pulls fragment "
            "deltas from M learners, merges them and broadcasts the result."
        ),
        formatter_class=HelpFormatter,
        allow_abbrev=False,  # exactly the pinned flags: `--res` is not `--resume`
    )
    net = parser.add_argument_group("listener")
    net.add_argument("--host", default=DEFAULT_HOST, help="address to listen on")
    net.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help="TCP port; 0 picks any free port"
    )
    net.add_argument(
        "--hello-hmac-key-file",
        type=Path,
        metavar="PATH",
        help=(
            "require HELLOs authenticated with HMAC-SHA256 under the key in this file (its raw "
            "bytes, without one trailing line ending; a regular file or a pipe such as "
            f"<(pass show key), at most {MAX_HELLO_KEY_FILE_BYTES // 1024} KiB); default: the "
            "environment variable "
            f"{HMAC_KEY_ENV} (UTF-8) if set, else no authentication"
        ),
    )

    rounds = parser.add_argument_group("session and rounds")
    rounds.add_argument(
        "--learners", type=int, required=True, help="M: learner ids are 0..M-1 (required)"
    )
    rounds.add_argument(
        "--total-steps",
        type=int,
        required=True,
        help="the last round t (absolute: a resumed run goes on up to it) (required)",
    )
    rounds.add_argument(
        "--quorum",
        type=int,
        default=1,
        help=(
            "K: responses a round needs (at most the learners connected at its launch); "
            "above 1, a captured learner that dies holds the round until --quorum-timeout-s"
        ),
    )
    rounds.add_argument(
        "--grace-ms", type=int, default=1000, help="cap of the adaptive grace window after K"
    )
    rounds.add_argument("--grace-gamma", type=float, default=0.8, help="grace window factor γ")
    rounds.add_argument("--grace-tau", type=float, default=2.0, help="grace window factor τ")
    rounds.add_argument(
        "--pipeline", type=int, default=2, help="rounds in flight (capped at the fragment count)"
    )
    rounds.add_argument(
        "--min-round-interval-ms", type=int, default=0, help="least time between launches"
    )
    rounds.add_argument(
        "--sync-interval-steps",
        type=float,
        default=24.0,
        help="H: launch pacing is H × the slowest learner's step time / fragments",
    )
    rounds.add_argument(
        "--quorum-timeout-s",
        type=int,
        default=900,
        help="an attempt below quorum after this many seconds (>= 1) is discarded and retried",
    )
    rounds.add_argument(
        "--max-base-lag",
        type=int,
        help=(
            "reject PUSHes whose base version is more than this many versions stale "
            "(default: no limit)"
        ),
    )
    rounds.add_argument(
        "--learner-budget-steps",
        type=int,
        help=(
            "benchmark cutoff: the learner step budget B (1..2^32-1) every learner also "
            "received (default: none, no cutoff)"
        ),
    )
    rounds.add_argument(
        "--require-profile-binding",
        action="store_true",
        help="refuse HELLOs that omit the syncer profile hash",
    )

    merge = parser.add_argument_group("merge and outer optimizer")
    merge.add_argument(
        "--delta-correction",
        choices=tuple(_DELTA_CORRECTIONS),
        default="heloco",
        help="directional correction of each outer gradient against the momentum",
    )
    merge.add_argument(
        "--learner-weight",
        choices=tuple(_LEARNER_WEIGHTS),
        default="tokens2-over-steps",
        help="learner weight: c_tokens² / c_steps, or equal",
    )
    merge.add_argument("--outer-lr", type=float, default=0.7, help="outer Nesterov learning rate")
    merge.add_argument("--outer-momentum", type=float, default=0.9, help="outer Nesterov momentum")
    merge.add_argument(
        "--iso-backend",
        choices=tuple(_ISO_BACKENDS),
        default="scalar",
        help="exact SVD backend of iso fragments",
    )
    merge.add_argument(
        "--iso-worker-queue-capacity",
        type=int,
        default=16,
        help="queued plus running SVD jobs the iso worker pool admits",
    )

    state = parser.add_argument_group("checkpoints and outputs")
    state.add_argument(
        "--checkpoint-path", type=Path, metavar="PATH", help="V3 checkpoint file (atomic writes)"
    )
    state.add_argument(
        "--checkpoint-every",
        type=int,
        default=8,
        help="checkpoint after committing each step that is a multiple of N (and the last)",
    )
    state.add_argument(
        "--resume",
        action="store_true",
        help="continue from the checkpoint at --checkpoint-path (required if it exists)",
    )
    state.add_argument(
        "--mark-final-checkpoint",
        action="store_true",
        help="write <checkpoint-path>.final after the terminal checkpoint",
    )
    state.add_argument(
        "--final-state", type=Path, metavar="PATH", help="also write the final state here (V3)"
    )
    state.add_argument(
        "--event-tape", type=Path, metavar="PATH", help="append one JSON line per merge here"
    )
    state.add_argument(
        "--final-ack-timeout-s",
        type=int,
        default=None,
        help="seconds to wait for every FINAL_ACK (default: --quorum-timeout-s)",
    )
    parser.add_argument(
        "--print-profile-hash",
        action="store_true",
        help="print the hex SHA-256 of this configuration's syncer profile and exit",
    )
    return parser


def config_from_args(args: argparse.Namespace) -> SyncerConfig:
    return SyncerConfig(
        learners=args.learners,
        total_steps=args.total_steps,
        host=args.host,
        port=args.port,
        quorum=args.quorum,
        grace_ms=args.grace_ms,
        grace_gamma=args.grace_gamma,
        grace_tau=args.grace_tau,
        pipeline=args.pipeline,
        min_round_interval_ms=args.min_round_interval_ms,
        sync_interval_steps=args.sync_interval_steps,
        delta_correction=_DELTA_CORRECTIONS[args.delta_correction],
        quorum_timeout_s=args.quorum_timeout_s,
        final_ack_timeout_s=args.final_ack_timeout_s,
        outer_lr=args.outer_lr,
        outer_momentum=args.outer_momentum,
        iso_backend=_ISO_BACKENDS[args.iso_backend],
        iso_worker_queue_capacity=args.iso_worker_queue_capacity,
        final_state=args.final_state,
        checkpoint_path=args.checkpoint_path,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
        mark_final_checkpoint=args.mark_final_checkpoint,
        learner_budget_steps=args.learner_budget_steps,
        event_tape=args.event_tape,
        max_base_lag=args.max_base_lag,
        learner_weight=_LEARNER_WEIGHTS[args.learner_weight],
        require_profile_binding=args.require_profile_binding,
        print_profile_hash=args.print_profile_hash,
        hello_hmac_key_file=args.hello_hmac_key_file,
    )


def load_hello_key(config: SyncerConfig) -> bytes | None:
    """The HELLO authentication key: the key file, else the environment, else none."""
    key_file = config.hello_hmac_key_file
    if key_file is not None:
        try:
            # A regular file or a pipe (`<(pass show key)`), read up to the cap: /dev/zero or a
            # multi-gigabyte file named by mistake is refused (a FIFO no writer holds open
            # reads as empty, refused below).
            raw = read_capped(key_file, MAX_HELLO_KEY_FILE_BYTES)
        except OSError as exc:
            raise BadInput(
                f"cannot read --hello-hmac-key-file {key_file}: {exc.strerror or exc}"
            ) from None
        if raw is None:
            raise BadInput(
                f"--hello-hmac-key-file {key_file} is larger than {MAX_HELLO_KEY_FILE_BYTES} "
                "bytes: not a key file"
            )
        key = hello_key_of_file(raw)
    else:
        text = os.environ.get(HMAC_KEY_ENV)
        if text is None:
            return None
        try:
            key = text.encode("utf-8")
        except UnicodeEncodeError:  # bytes that are not UTF-8 arrive as lone surrogates
            raise BadInput(f"{HMAC_KEY_ENV} is not valid UTF-8") from None
        if len(key) > MAX_HELLO_KEY_FILE_BYTES:
            raise BadInput(f"{HMAC_KEY_ENV} is longer than {MAX_HELLO_KEY_FILE_BYTES} bytes")
    if not key:
        raise BadInput("the HELLO authentication key is empty")
    return key


def check_output_paths(config: SyncerConfig) -> None:
    """Every output's directory exists and is writable: found now, not rounds into the run."""
    outputs = {
        "--checkpoint-path": config.checkpoint_path,
        "--final-state": config.final_state,
        "--event-tape": config.event_tape,
    }
    for flag, path in outputs.items():
        if path is None:
            continue
        try:
            if path.is_dir():
                raise BadInput(f"{flag} {path} is a directory")
            directory = path.parent
            if not directory.is_dir():
                raise BadInput(f"{flag} {path}: no directory {directory}")
        except OSError as exc:  # e.g. a name too long, or a directory that cannot be searched
            raise BadInput(f"{flag} {path}: {exc.strerror or exc}") from None
        if not os.access(directory, os.W_OK | os.X_OK):
            raise BadInput(f"{flag} {path}: directory {directory} is not writable")
    if config.checkpoint_path is not None:
        outputs["the final marker of --checkpoint-path"] = marker_path(config.checkpoint_path)
    # The checkpoint, the final state and (when one is written) the marker are replaced
    # through a longer temporary name: one the directory cannot hold would fail the first
    # write, rounds into the run. (The checkpoint's own bound keeps its marker's name short.)
    replaced = {"--checkpoint-path": config.checkpoint_path, "--final-state": config.final_state}
    if config.mark_final_checkpoint:
        replaced["the final marker of --checkpoint-path"] = outputs.get(
            "the final marker of --checkpoint-path"
        )
    for flag, path in replaced.items():
        problem = None if path is None else name_length_problem(path)
        if problem is not None:
            raise BadInput(f"{flag} {path}: {problem}")
    named = [(flag, path) for flag, path in outputs.items() if path is not None]
    for index, (flag, path) in enumerate(named):
        for other_flag, other in named[index + 1 :]:
            appended = config.event_tape in (path, other)
            if _same_file(path, other, appended=appended):
                # A tape appended to the checkpoint damaged it until the next rename, which
                # then dropped every tape line; a final state would replace the checkpoint.
                raise BadInput(f"{flag} {path} and {other_flag} {other} name the same file")


def _same_file(first: Path, second: Path, *, appended: bool) -> bool:
    """Writing one of the two outputs changes the other. The checkpoint, its marker and the
    final state are replaced by name (a symlink or hard link there is replaced, not followed):
    two of them clash only as the same name in the same directory. The tape is appended to,
    through symlinks: it clashes with the file its name leads to, by name or by inode."""
    if first.parent.resolve() / first.name == second.parent.resolve() / second.name:
        return True
    if not appended:
        return False
    try:
        if first.resolve() == second.resolve():
            return True
        return os.path.samefile(first, second)
    except (OSError, RuntimeError):  # missing (not yet written), or a symlink loop
        return False


def remove_crashed_writes(config: SyncerConfig) -> None:
    """Remove what a crashed writer left beside the outputs (each as large as its file), and
    say so: restarted again and again after crashes, the syncer would fill its disk."""
    log = KeyValueLog(sys.stderr)
    for target in (config.checkpoint_path, config.final_state):
        if target is None:
            continue
        for orphan, outcome in remove_orphaned_temporaries(target):
            if isinstance(outcome, OSError):
                log("warning", "temporary file of a crashed write not removed",
                    {"path": str(orphan), "error": outcome.strerror or str(outcome)})  # fmt: skip
            else:
                log("info", "temporary file of a crashed write removed",
                    {"path": str(orphan), "bytes": outcome})  # fmt: skip


def load_resume_checkpoint(config: SyncerConfig) -> Checkpoint | None:
    """Refuse to overwrite a checkpoint without ``--resume``; with it, read the checkpoint."""
    path = config.checkpoint_path
    if path is None:
        if config.resume:
            raise BadInput("--resume needs --checkpoint-path")
        return None
    if not config.resume:
        if path.exists():
            raise BadInput(
                f"checkpoint {path} exists; pass --resume to continue from it, or move it away"
            )
        marker = marker_path(path)
        if marker.exists():
            # A new run may write a checkpoint at the step the old marker names, which would
            # then read as a final cut.
            raise BadInput(f"final marker {marker} of an earlier run exists; move it away")
        return None
    if not path.exists():
        raise BadInput(f"--resume: no checkpoint at {path}")
    marker = marker_path(path)
    if marker.is_dir() and not marker.is_symlink():
        # Found at the first checkpoint write otherwise, which cannot remove it: the run ends.
        raise BadInput(f"--resume: {marker} is a directory where a final marker goes; move it")
    try:
        checkpoint = read_checkpoint(path)
    except ProtocolError as exc:
        raise BadInput(f"--resume: cannot read checkpoint {path}: {exc}") from None
    # What the first HELLO cannot change is refused now, with the reason it would give then.
    refusal = refusal_for_every_hello(checkpoint, config.iso_backend)
    if refusal is not None:
        raise BadInput(f"--resume: {path}: {ErrorCode.CKPT_RESUME_INELIGIBLE.name}: {refusal}")
    return checkpoint


def log_doubts(config: SyncerConfig, checkpoint: Checkpoint | None) -> None:
    """Warn about settings that are accepted but rarely meant, before the daemon serves."""
    doubts = config.doubtful_settings()
    if checkpoint is not None and config.checkpoint_path is not None:
        if checkpoint.global_step >= config.total_steps:
            doubts.append(
                f"the checkpoint is at global_step {checkpoint.global_step}, at or past "
                f"--total-steps {config.total_steps}: no round runs, the final cut is taken as "
                "soon as the session starts"
            )
        marker = marker_state(config.checkpoint_path, checkpoint.global_step)
        if marker.status is MarkerStatus.FINAL:
            doubts.append(
                f"{marker_path(config.checkpoint_path)} exists: the run of this checkpoint "
                "had finished; the session waits for all --learners again, and a learner that "
                "already got its SHUTDOWN does not come back"
            )
        elif marker.status is not MarkerStatus.ABSENT:  # goes at the first checkpoint write
            doubts.append(
                f"{marker_path(config.checkpoint_path)} does not mark this checkpoint as final "
                f"({marker.detail}); it is removed when this run first writes its checkpoint"
            )
        outside = [e.learner_id for e in checkpoint.ledger if e.learner_id >= config.learners]
        if outside:
            shown = ", ".join(map(str, outside[:8])) + (" …" if len(outside) > 8 else "")
            doubts.append(
                f"the checkpoint's ledger counts learner ids {shown}, outside "
                f"0..{config.learners - 1} (--learners {config.learners}): their entries are kept "
                "in every later checkpoint, and no such learner can join"
            )
    log = KeyValueLog(sys.stderr)
    for doubt in doubts:
        log("warning", doubt, {})


def _raising(early: StopSignals | None) -> StopSignals:
    """The stop signals' handler from now on: until the event loop takes over (and after it
    lets go) a signal raises :class:`Stopped` where the daemon is, which ends it in a clear
    line. ``early`` (the entry point's, which only recorded) carries on, with what it got."""
    signals = early if early is not None else StopSignals(PROG)
    if early is None and threading.current_thread() is threading.main_thread():
        signals.install()
    signals.raising = True
    return signals


def _one_line_usage_error(message: str) -> NoReturn:
    print(f"{PROG}: error: {message} (see --help)", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_BAD_INPUT)


def main(argv: Sequence[str] | None = None, early: StopSignals | None = None) -> int:
    """The daemon's command line; ``early`` recorded any stop signal since the process began."""
    parser = build_parser()
    parser.error = _one_line_usage_error  # type: ignore[method-assign]
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits on --help (0) and on usage errors (2)
        return exc.code if isinstance(exc.code, int) else EXIT_BAD_INPUT
    signals = _raising(early)
    try:
        signals.check()  # one that arrived while the modules loaded
        return _start_and_serve(args, signals)
    except Stopped as stopped:
        name = signal.Signals(stopped.signum).name
        if args.resume and args.checkpoint_path is not None:
            kept = f"the checkpoint to resume, {args.checkpoint_path}, is unchanged"
        else:
            kept = "no checkpoint written"
        print(f"{PROG}: {name} while starting; {kept}", file=sys.stderr)
        return 128 + stopped.signum


def _start_and_serve(args: argparse.Namespace, signals: StopSignals) -> int:
    try:
        config = config_from_args(args)
        if config.print_profile_hash:
            print(config.profile().digest().hex(), flush=True)
            return 0
        hello_key = load_hello_key(config)
        check_output_paths(config)
        checkpoint = load_resume_checkpoint(config)
        log_doubts(config, checkpoint)
        iso_pool = start_iso_pool(config)
        try:
            coordinator = Coordinator(
                config, checkpoint=checkpoint, iso_solver=iso_pool, work_clock=time.monotonic
            )
        except BaseException:
            if iso_pool is not None:
                iso_pool.close()
            raise
    except (BadInput, ValueError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    except MergeError as exc:  # the iso worker pool did not start
        print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_FAILURE
    serving: list[Driver] = []  # the driver, once the daemon serves
    try:
        resumed = (
            None
            if checkpoint is None or config.checkpoint_path is None
            else DurableCheckpoint(
                config.checkpoint_path, checkpoint.global_step, CheckpointKind.RESUMED
            )
        )
        # The coordinator holds the checkpoint's arrays until their fragments commit: kept
        # here as well, they would be a second copy of the model's state for the whole run.
        del checkpoint
        remove_crashed_writes(config)  # only once it serves: a refusal changes nothing
        signals.check()  # one whose Stopped something on the way swallowed
        exit_action, kept = anyio.run(
            _serve, config, coordinator, hello_key, signals, iso_pool, serving, resumed
        )
    except OSError as exc:
        print(
            f"{PROG}: error: cannot listen on {config.host}:{config.port}: {exc.strerror or exc}",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_FAILURE
    except BaseException as raised:
        # Outside the event loop's own signal handling; a task group may have wrapped it.
        stopped = _sole_exception(raised)
        if not isinstance(stopped, Stopped):
            raise
        if not serving:
            raise stopped from None
        name = signal.Signals(stopped.signum).name
        _last_line(f"{PROG}: stopped by {name}; {_kept_state(serving[0])}")
        return 128 + stopped.signum
    finally:
        if iso_pool is not None:
            iso_pool.close()  # stops and, if need be, kills every worker: no orphans
    _last_line(f"{PROG}: {exit_action.reason}; {kept}")
    return exit_action.code


def _last_line(text: str) -> None:
    """The line saying why the daemon stopped; a closed stderr must not change the exit code."""
    with contextlib.suppress(OSError, ValueError):
        print(text, file=sys.stderr, flush=True)


def _sole_exception(raised: BaseException) -> BaseException:
    """The one exception inside nested groups of one (anyio task groups wrap what they raise)."""
    while isinstance(raised, BaseExceptionGroup) and len(raised.exceptions) == 1:
        raised = raised.exceptions[0]
    return raised


def _ready_line(text: str, log: KeyValueLog) -> None:
    """Print the ready line; a closed stdout is logged, and the daemon serves on regardless."""
    if sys.stdout is None:  # started with stdout closed (`>&-`): print would drop it silently
        log("warning", "stdout is closed: the ready line was not delivered", {})
        return
    try:
        print(text, flush=True)
    except (OSError, ValueError):
        # Later writes (and the interpreter's last flush) must not fail on the pipe again.
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        log("warning", "stdout is closed: the ready line was not delivered", {})


def start_iso_pool(config: SyncerConfig) -> IsoWorkerPool | None:
    """The torch-svd worker pool (started, bounded), or ``None`` for the scalar backend.

    Sized by ``--iso-worker-queue-capacity`` and the ``YETO_ISO_*`` environment variables
    (:meth:`yeto_sync.iso.IsoPoolSettings.from_env`). torch loads only in the workers.
    """
    if config.iso_backend is not IsoBackend.TORCH_SVD:
        return None
    pool = IsoWorkerPool(IsoPoolSettings.from_env(config.iso_worker_queue_capacity))
    KeyValueLog(sys.stderr)(
        "info",
        "iso pool started",
        {
            "workers": pool.settings.workers,
            "threads_per_worker": pool.settings.threads_per_worker,
            "capacity": pool.capacity,
            "pids": list(pool.worker_pids),
            "torch": pool.torch_version,
            "startup_s": round(pool.startup_s, 3),
        },
    )
    return pool


async def _serve(
    config: SyncerConfig,
    coordinator: Coordinator,
    hello_key: bytes | None,
    signals: StopSignals,
    iso_pool: IsoWorkerPool | None = None,
    serving: list[Driver] | None = None,
    resumed: DurableCheckpoint | None = None,
) -> tuple[Exit, str]:
    log = KeyValueLog(sys.stderr)
    clock = MonotonicClock()
    groups = ConnectionGroups(
        config.learners, hello_key=hello_key, log=log, hello_step_bytes=HELLO_STEP_BYTES
    )
    outputs = Outputs(
        checkpoint_path=config.checkpoint_path,
        final_state_path=config.final_state,
        event_tape_path=config.event_tape,
        mark_final_checkpoint=config.mark_final_checkpoint,
    )
    raised = raise_open_file_limit()  # before the transport sizes its peer-socket cap
    if raised is not None:
        log("info", "open file limit raised", {"before": raised[0], "after": raised[1]})
    async with TcpTransport.serve(groups, clock, config.host, config.port, log=log) as transport:
        host, port = transport.address
        driver = Driver(
            coordinator,
            transport,
            clock,
            outputs=outputs,
            log=log,
            iso_pool=iso_pool,
            stream_broadcasts=True,
        )
        driver.last_checkpoint = resumed  # until this run writes one
        if serving is not None:
            serving.append(driver)
        async with anyio.create_task_group() as tasks:
            # Installed before the ready line: a signal right after it stops the daemon cleanly.
            await tasks.start(_stop_on_signal, driver, signals, log)
            log(
                "info",
                "listening",
                {
                    "host": host,
                    "port": port,
                    "learners": config.learners,
                    "total_steps": config.total_steps,
                    "hello_auth": hello_key is not None,
                },
            )
            _ready_line(f"{PROG} listening on {host}:{port}", log)
            try:
                exit_action = await driver.run(transport)
            except Exception as exc:  # a bug: keep the traceback in the log, end in one line
                log("error", "internal error", {"traceback": traceback.format_exc()})
                exit_action = Exit(EXIT_FAILURE, f"internal error: {exc!r}")
            tasks.cancel_scope.cancel()
    return exit_action, _kept_state(driver)


async def _stop_on_signal(
    driver: Driver,
    signals: StopSignals,
    log: KeyValueLog,
    *,
    task_status: anyio.abc.TaskStatus[None],
) -> None:
    """The first stop signal stops the driver; later ones only say it is stopping.

    The receiver stays open until the daemon is done: a second signal must not kill it with
    the default action while it finishes a checkpoint write or flushes its queues.
    """
    stopping = False

    def on_signal(signum: int) -> None:
        nonlocal stopping
        name = signal.Signals(signum).name
        if stopping:
            log("warning", "already stopping", {"signal": name})
            return
        stopping = True
        log("info", "stopping", {"signal": name, "grace_s": driver.shutdown_grace})
        driver.request_stop(128 + signum, f"stopped by {name}")

    try:
        with anyio.open_signal_receiver(*signals.signals) as received:
            task_status.started()
            if signals.received is not None:
                # It came before the receiver, and the event loop swallowed its Stopped
                # (raised in a callback, it is only logged there): acted on now, not lost.
                on_signal(signals.received)
            async for signum in received:
                on_signal(signum)
    finally:
        # Closing the receiver put the default actions back. The run is over; only the last
        # line is left to print, and a late signal must not kill the process before or after
        # it (ignored signals stay ignored through the interpreter's shutdown).
        ignore_stop_signals(signals.signals)


def _kept_state(driver: Driver) -> str:
    kept = driver.last_checkpoint
    return "no checkpoint was written" if kept is None else kept.describe()
