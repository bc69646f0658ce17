"""``yeto launch``: a syncer and M learners on loopback, training the demo model, in one command.

The syncer runs with ``--mark-final-checkpoint`` and writes its checkpoint, event tape and final
state under ``--out``; each learner (``python -m yeto_learn.demo_model``) writes its artifact
there too. While they train, a live table shows every learner's step, loss, rounds and bytes
(plain periodic lines when stdout is not a terminal); at the end a summary compares the loss
before and after and the bytes moved with what all-reduce data parallelism would have moved.

Ctrl+C or SIGTERM stops every child within seconds (children also get SIGTERM if the launcher
dies) and the last line says which state was kept. A run cannot be resumed (its learners would
need the run's id and flags, and a syncer restarted with ``--resume``): a checkpoint it kept is
named with the ``yeto checkpoint inspect|export`` commands that use it, the export with the
demo model's ``layout.json``, which launch writes to ``--out`` once the syncer listens.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from yeto_proto import Layout, MergeMode
from yeto_proto.checkpoint import (
    marker_path,
    remove_temporaries,
    temporaries_written_by,
    write_bytes_atomically,
)
from yeto_proto.constants import MAX_STREAMS, U64_MAX
from yeto_proto.errors import CheckpointError
from yeto_sync.help_format import HelpFormatter
from yeto_sync.open_file_limit import hard_open_file_limit, syncer_descriptors

from .artifact_files import LAYOUT_FILE, STATE_FILE
from .command_options import (
    BATCH_HELP,
    LEARNERS_RANGE,
    MAX_BATCH_SIZE,
    MAX_LOCAL_LEARNERS,
    MAX_SYNC_INTERVAL,
    SYNC_INTERVAL_HELP,
    WIRE_HELP,
    OutputDirError,
    make_output_dir,
    out_help,
    out_of_range,
)
from .demo_shapes import byte_model_shapes
from .kept_checkpoint import checkpoint_use
from .model_layout import build_layout, most_fragments
from .process_control import (
    POLL_S,
    Stopped,
    StopSignals,
    first_line,
    poll_until,
    say,
    spawn,
    stops_recorded,
)

if TYPE_CHECKING:
    from .cli import Commands

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
#: Seconds a child gets to exit after SIGTERM before it is killed.
STOP_GRACE_S = 5.0
SYNCER_START_TIMEOUT_S = 30.0
#: The syncer child's name in failure lines, and how the run finds it among its children.
SYNCER_NAME = "the syncer"
#: Seconds between status lines when stdout is not a terminal.
PLAIN_REPORT_EVERY_S = 5.0
#: Past this many times --steps local steps (their --max-steps), learners train on only while
#: rounds advance.
LEARNER_STEP_CAP = 4
#: Seconds a round may take to reach its quorum; a learner past its cap stops after as many
#: seconds without a round.
ROUND_TIMEOUT_S = 120


def register(commands: Commands) -> None:
    parser = commands.add_parser(
        "launch",
        help="train the demo model with a syncer and M learners on this machine",
        description=(
            "Start a yeto-sync and M learner processes on 127.0.0.1 and train a small "
            "byte-level language model on Python's own standard library sources (no "
            "downloads). The syncer runs --total-steps = steps x fragments / sync-interval "
            "rounds; learners train until its final cut (past 4 x --steps only while rounds "
            "advance). A stopped or failed run cannot be resumed: its last line names the "
            "checkpoint it kept and the yeto checkpoint commands that inspect it and export its "
            "parameters."
        ),
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "--learners", type=int, default=2, help=f"M, learner processes ({LEARNERS_RANGE})"
    )
    parser.add_argument("--fragments", type=int, default=4, help="fragments of the model")
    parser.add_argument("--wire-dtype", choices=("f32", "bf16", "q4"), default="q4", help=WIRE_HELP)
    parser.add_argument(
        "--steps",
        type=int,
        default=3000,
        help=(
            "run length: the syncer runs steps x fragments / sync-interval rounds (at least "
            "fragments); learners train until its final cut, usually more than --steps local "
            "steps each (rounds run slower than their pacing, start-up and the final cut add "
            "steps); past 4 x steps, only while rounds advance"
        ),
    )
    parser.add_argument(
        "--merge", choices=("avg", "rda", "iso"), default="avg", help="merge mode of matrices"
    )
    parser.add_argument("--merge-alpha", type=float, default=0.5, help="learner blend α")
    parser.add_argument("--streams", type=int, default=4, help="data sockets per learner")
    parser.add_argument("--sync-interval", type=int, default=16, help=SYNC_INTERVAL_HELP)
    parser.add_argument("--batch-size", type=int, default=64, help=BATCH_HELP)
    parser.add_argument("--out", type=Path, help=out_help("yeto-launch"))
    parser.add_argument("--port", type=int, default=0, help="syncer port (0: any free port)")
    parser.set_defaults(handler=run, command_prog=parser.prog)


# -- processes -----------------------------------------------------------------------------------
@dataclass(eq=False)
class Child:
    name: str
    process: subprocess.Popen[str]
    stderr_path: Path

    def stderr_tail(self, lines: int = 5) -> list[str]:
        """The last ``lines`` lines of its stderr that say something: no blank lines, no
        traceback lines that only point (``~~~^^^``) at the line above, and none of the
        syncer's routine log lines (``level=info``: a round launched or committed)."""
        with contextlib.suppress(OSError):
            text = self.stderr_path.read_text(encoding="utf-8", errors="replace")
            return [line for line in text.splitlines() if _says_something(line)][-lines:]
        return []

    def ended(self, code: int, lines: int) -> str:
        """How it ended, for a failure line: a signal by name, then its last words."""
        if code < 0:
            how = f"{self.name} was killed by {_signal_name(-code)}"
        else:
            how = f"{self.name} exited with {code}"
        return f"{how}: {'; '.join(self.stderr_tail(lines)) or 'no error output'}"


def _says_something(line: str) -> bool:
    return bool(line.strip(" ~^")) and " level=info " not in line and " level=debug " not in line


def _signal_name(number: int) -> str:
    try:
        name = signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
    if number == signal.SIGKILL:
        return f"{name} (kill -9, or the kernel's out-of-memory killer)"
    return name


def _spawn(name: str, argv: list[str], stderr_path: Path, env: dict[str, str]) -> Child:
    stderr_path.parent.mkdir(parents=True, exist_ok=True)
    with open(stderr_path, "w", encoding="utf-8") as stderr:
        process = spawn(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env,
        )
    return Child(name, process, stderr_path)


def _pump_lines(child: Child, sink: queue.SimpleQueue[tuple[str, str]]) -> None:
    assert child.process.stdout is not None
    for line in child.process.stdout:
        sink.put((child.name, line.rstrip("\n")))
    sink.put((child.name, ""))


def stop_children(children: list[Child], grace: float = STOP_GRACE_S) -> None:
    """SIGTERM every live child (learners first), wait up to ``grace`` s, then SIGKILL."""
    for child in children:
        if child.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                child.process.terminate()
    deadline = time.monotonic() + grace
    for child in children:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.process.wait(max(deadline - time.monotonic(), 0.0))
    for child in children:
        if child.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                child.process.kill()
            child.process.wait()


# -- progress ------------------------------------------------------------------------------------
@dataclass
class LearnerView:
    learner_id: int
    state: str = "starting"
    step: int = 0
    loss: float | None = None
    rounds: int = 0
    global_step: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    generations: int = 0
    done: dict[str, Any] = field(default_factory=dict)

    def update(self, record: dict[str, Any]) -> None:
        event = record.get("event")
        if event == "started":
            self.state = "training"
        elif event == "progress":
            self.state = str(record.get("state", self.state))
            self.step = int(record.get("step", self.step))
            loss = record.get("loss")
            self.loss = float(loss) if isinstance(loss, int | float) else self.loss
            self.rounds = int(record.get("rounds", self.rounds))
            self.global_step = int(record.get("global_step", self.global_step))
            self.bytes_sent = int(record.get("bytes_sent", self.bytes_sent))
            self.bytes_received = int(record.get("bytes_received", self.bytes_received))
            self.generations = int(record.get("generations", self.generations))
        elif event == "done":
            self.done = record
            self.state = "done"
            self.step = int(record["steps"])
            self.rounds = int(record["rounds"])
            self.bytes_sent = int(record["bytes_sent"])
            self.bytes_received = int(record["bytes_received"])
            self.global_step = int(record.get("final_global_step") or self.global_step)


def human_bytes(count: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(count) < 1000 or unit == "GB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    raise AssertionError("unreachable")


def _loss_text(loss: float | None) -> str:
    return "-" if loss is None or loss != loss else f"{loss:.3f}"


class Display:
    """A rich live table on a terminal; plain status lines every few seconds otherwise."""

    def __init__(self, views: list[LearnerView], total_rounds: int, out: IO[str]) -> None:
        from rich.console import Console

        self.views = views
        self.total_rounds = total_rounds
        self.console = Console(file=out, highlight=False)
        self.live: Any = None
        self._last_plain = 0.0
        self._started = time.monotonic()

    def __enter__(self) -> Display:
        if self.console.is_terminal:
            from rich.live import Live

            self.live = Live(self._table(), console=self.console, refresh_per_second=4)
            self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live is not None:
            self.live.update(self._table())
            self.live.__exit__(None, None, None)
            self.live = None

    def refresh(self) -> None:
        if self.live is not None:
            self.live.update(self._table())
            return
        now = time.monotonic()
        if now - self._last_plain >= PLAIN_REPORT_EVERY_S:
            self._last_plain = now
            self.line(self._plain_status())

    def line(self, text: str) -> None:
        if self.live is not None:
            self.live.console.print(text, markup=False)
        else:
            say(text)

    def _global_step(self) -> int:
        return max((v.global_step for v in self.views), default=0)

    def _plain_status(self) -> str:
        elapsed = time.monotonic() - self._started
        parts = [
            f"L{v.learner_id} {v.state} step {v.step} loss {_loss_text(v.loss)} "
            f"rounds {v.rounds} sent {human_bytes(v.bytes_sent)}"
            for v in self.views
        ]
        head = f"[{elapsed:6.1f}s] round {self._global_step()}/{self.total_rounds}"
        return head + " | " + " | ".join(parts)

    def _table(self) -> Any:
        from rich.table import Table

        elapsed = time.monotonic() - self._started
        table = Table(
            title=f"yeto launch — round {self._global_step()}/{self.total_rounds}, {elapsed:.0f} s",
            title_justify="left",
        )
        for column in ("learner", "state", "step", "loss", "rounds", "sent", "received"):
            table.add_column(column, justify="left" if column in ("learner", "state") else "right")
        for v in self.views:
            table.add_row(
                str(v.learner_id),
                v.state,
                str(v.step),
                _loss_text(v.loss),
                str(v.rounds),
                human_bytes(v.bytes_sent),
                human_bytes(v.bytes_received),
            )
        return table


# -- the command -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Paths:
    out: Path
    #: ``out`` was made by this run (not an empty directory the user gave as --out).
    made: bool = False

    @property
    def syncer_dir(self) -> Path:
        return self.out / "syncer"

    @property
    def checkpoint(self) -> Path:
        return self.syncer_dir / "checkpoint.yeto"

    @property
    def final_state(self) -> Path:
        return self.syncer_dir / "final-state.yeto"

    @property
    def tape(self) -> Path:
        return self.syncer_dir / "events.jsonl"

    @property
    def layout(self) -> Path:
        """The demo model's layout, for ``yeto checkpoint export`` of a checkpoint the run kept
        (the learners write theirs only with their artifacts, at the final cut)."""
        return self.out / LAYOUT_FILE

    @property
    def syncer_log(self) -> Path:
        return self.syncer_dir / "syncer.log"

    @property
    def summary(self) -> Path:
        return self.out / "summary.json"

    def learner_dir(self, learner_id: int) -> Path:
        return self.out / f"learner-{learner_id}"


def demo_layout(args: argparse.Namespace) -> Layout:
    """The layout every demo learner builds (``Learner``'s, from the model's shapes)."""
    return build_layout(
        byte_model_shapes(), fragments=args.fragments, matrix_merge=MergeMode[args.merge.upper()]
    )


def total_rounds(steps: int, fragments: int, sync_interval: int) -> int:
    """Rounds that sync every fragment about once per ``sync_interval`` local steps."""
    return max(fragments, steps * fragments // max(sync_interval, 1))


def most_steps(fragments: int, sync_interval: int) -> int:
    """The largest ``--steps``: learners are capped at :data:`LEARNER_STEP_CAP` x steps local
    steps and the syncer runs steps x fragments / sync-interval rounds, both u64 on the wire."""
    by_rounds = ((U64_MAX + 1) * sync_interval - 1) // fragments  # total_rounds() <= U64_MAX
    return min(U64_MAX // LEARNER_STEP_CAP, by_rounds)


def _check_args(args: argparse.Namespace) -> str | None:
    """Every numeric flag against its whole range, before anything starts (or None)."""
    if not 1 <= args.learners <= MAX_LOCAL_LEARNERS:
        return out_of_range(
            "--learners", args.learners, 1, MAX_LOCAL_LEARNERS, "each is a process on this machine"
        )
    # The learners would refuse more, after everything started.
    most = most_fragments(byte_model_shapes(), MergeMode[args.merge.upper()])
    if not 1 <= args.fragments <= most:
        return out_of_range(
            "--fragments", args.fragments, 1, most, f"for the demo model with --merge {args.merge}"
        )
    try:
        demo_layout(args)  # rda/iso also need a fragment of their own for the biases
    except ValueError as exc:
        return f"--fragments {args.fragments} with --merge {args.merge}: {exc}"
    if not 1 <= args.sync_interval <= MAX_SYNC_INTERVAL:  # yeto bench's rule too
        return out_of_range("--sync-interval", args.sync_interval, 1, MAX_SYNC_INTERVAL)
    most = most_steps(args.fragments, args.sync_interval)
    if not 1 <= args.steps <= most:
        return out_of_range(
            "--steps",
            args.steps,
            1,
            most,
            f"{LEARNER_STEP_CAP} x steps local steps and steps x fragments / "
            "sync-interval rounds must each fit a u64",
        )
    if not 0 <= args.streams <= MAX_STREAMS:
        return out_of_range("--streams", args.streams, 0, MAX_STREAMS)
    needed, hard = syncer_descriptors(args.learners, args.streams), hard_open_file_limit()
    if hard is not None and needed > hard:
        # The syncer raises its soft limit to the hard one; beyond that, learners it has no
        # descriptor for would wait until the run stalled, with the cause only in its log.
        return (
            f"--learners {args.learners} with --streams {args.streams} need about {needed} "
            f"open files in the syncer, over the hard open-file limit of {hard} this shell "
            "passes on (ulimit -Hn); use fewer --streams or learners, or raise that limit "
            "(limits.conf, or LimitNOFILE= in a systemd unit)"
        )
    if not 0.0 <= args.merge_alpha <= 1.0:
        return f"--merge-alpha must be in [0, 1], got {args.merge_alpha}"
    # 0 trains nothing: c_tokens 0 weighs every push at zero.
    if not 1 <= args.batch_size <= MAX_BATCH_SIZE:
        return out_of_range("--batch-size", args.batch_size, 1, MAX_BATCH_SIZE)
    if not 0 <= args.port <= 65535:  # the syncer would refuse it, after the folder was made
        return out_of_range("--port", args.port, 0, 65535)
    return None


def run(args: argparse.Namespace) -> int:
    problem = _check_args(args)
    if problem is not None:
        print(f"yeto launch: error: {problem}", file=sys.stderr)
        return EXIT_BAD_INPUT
    made = args.out is None or not os.path.lexists(args.out)
    try:
        paths = Paths(make_output_dir(args.out, "yeto-launch").resolve(), made)
        paths.syncer_dir.mkdir()
    except OutputDirError as exc:
        print(f"yeto launch: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as exc:
        print(f"yeto launch: error: cannot create {exc.filename}: {exc.strerror}", file=sys.stderr)
        return EXIT_BAD_INPUT
    children: list[Child] = []
    started = time.monotonic()
    # Signals are recorded and met at the safe points of the run (stops.check()): never raised
    # inside a fork, where the interpreter would swallow the exception and lose the stop.
    with stops_recorded("yeto launch") as stops:
        try:
            stops.check()  # one that came while the command started
            return _launch(args, paths, children, started, stops)
        except Stopped as stop:
            stop_children(children)
            elapsed = time.monotonic() - started
            kept = f"{_syncer_kept(paths, children)}; {_artifacts_kept(paths, args.learners)}"
            # Stopped before any learner started, the run left nothing but the syncer's start:
            # undone, as when the syncer does not start, so the same command runs again.
            learner_started = any(child.name != SYNCER_NAME for child in children)
            where = f"logs in {paths.out}" if learner_started else _undo_start(paths)
            say(
                f"yeto launch: stopped by {stop} after {elapsed:.1f} s; every process ended; "
                f"kept: {kept}; {where}"
            )
            return 128 + stop.signum
        finally:
            stop_children(children)


def _artifacts_kept(paths: Paths, learners: int) -> str:
    """Which learners' artifacts are on disk (each is written atomically, so whole)."""
    written = [i for i in range(learners) if (paths.learner_dir(i) / STATE_FILE).exists()]
    if not written:
        return "no learner artifact was written (the run did not finalize)"
    if len(written) == learners:
        return "every learner's artifact was written"
    names = ", ".join(f"learner-{i}" for i in written)
    return f"learner artifacts written by {names} only"


def _syncer_kept(paths: Paths, children: Sequence[Child] = ()) -> str:
    """What the syncer said it kept (its last stderr line), or what is on disk. ``children``:
    the run's processes, once they ended (a killed syncer's unfinished writes are removed)."""
    removed = _remove_unfinished_writes(paths, children)
    with contextlib.suppress(OSError):
        lines = [ln for ln in paths.syncer_log.read_text(encoding="utf-8").splitlines() if ln]
        if lines and lines[-1].startswith("yeto-sync: "):
            return lines[-1].split("; ", 1)[-1] + _checkpoint_use(paths) + removed
    if paths.checkpoint.exists():
        return f"recovery checkpoint {paths.checkpoint}{_checkpoint_use(paths)}{removed}"
    return f"no checkpoint (none was written yet){removed}"


def _remove_unfinished_writes(paths: Paths, children: Sequence[Child]) -> str:
    """Remove the temporary files of a syncer that was killed while it wrote (a restarted
    ``yeto-sync`` would, but nothing resumes a launch), and say so (``""``: none)."""
    syncer = next((c for c in children if c.name == SYNCER_NAME), None)
    if syncer is None or syncer.process.poll() is None:
        return ""
    targets = (paths.checkpoint, marker_path(paths.checkpoint), paths.final_state)
    files = [
        temporary
        for target in targets
        for temporary in temporaries_written_by(target, syncer.process.pid)
    ]
    removed = [path.name for path, outcome in remove_temporaries(files) if isinstance(outcome, int)]
    if not removed:
        return ""
    were = "writes were" if len(removed) > 1 else "write was"
    return f" (the syncer's unfinished {were} removed: {', '.join(removed)})"


def _checkpoint_use(paths: Paths) -> str:
    """What a kept checkpoint is good for: ``yeto launch`` cannot resume a run (its learners
    would need the run's id, flags and a resumed syncer)."""
    return checkpoint_use(
        paths.checkpoint, paths.layout, paths.out / "model.safetensors", "yeto launch"
    )


def _undo_start(paths: Paths) -> str:
    """Remove what a run that never started made, so that the same command can be run again
    (an --out with files in it is refused), and say so. Only this run's own names go: the
    syncer's log and tape, its folder, and ``out`` if this run made it; anything else in there
    keeps all of them, and the line then says where the log is."""
    ours = {paths.syncer_log.name, paths.tape.name}
    try:
        if {p.name for p in paths.syncer_dir.iterdir()} - ours or (
            paths.made and {p.name for p in paths.out.iterdir()} != {paths.syncer_dir.name}
        ):
            return f"its log is {paths.syncer_log}"
        for name in ours:
            (paths.syncer_dir / name).unlink(missing_ok=True)
        paths.syncer_dir.rmdir()
        if paths.made:
            paths.out.rmdir()
    except OSError:
        return f"its log may be in {paths.syncer_dir}"
    return f"removed {paths.out}" if paths.made else f"{paths.out} is empty again"


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    # The children import this very package, wherever it lives (installed or a checkout).
    package_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _launch(
    args: argparse.Namespace,
    paths: Paths,
    children: list[Child],
    started: float,
    stops: StopSignals,
) -> int:
    env = _child_env()
    rounds = total_rounds(args.steps, args.fragments, args.sync_interval)
    syncer_argv = [
        sys.executable, "-m", "yeto_sync",
        "--host", "127.0.0.1",
        "--port", str(args.port),
        "--learners", str(args.learners),
        "--quorum", str(args.learners),
        "--total-steps", str(rounds),
        "--sync-interval-steps", str(args.sync_interval),
        "--checkpoint-path", str(paths.checkpoint),
        "--checkpoint-every", "8",
        "--mark-final-checkpoint",
        "--final-state", str(paths.final_state),
        "--event-tape", str(paths.tape),
        "--quorum-timeout-s", str(ROUND_TIMEOUT_S),
        "--final-ack-timeout-s", "120",
    ]  # fmt: skip
    syncer = _spawn(SYNCER_NAME, syncer_argv, paths.syncer_log, env)
    children.append(syncer)
    address = _await_listening(syncer, stops)
    if address is None:
        tail = "; ".join(syncer.stderr_tail(3)) or "no output"
        stop_children(children)
        print(
            f"yeto launch: error: the syncer did not start: {tail}; {_undo_start(paths)}",
            file=sys.stderr,
        )
        return EXIT_FAILED

    with contextlib.suppress(CheckpointError):  # only for export: a kept line then omits it
        write_bytes_atomically(paths.layout, demo_layout(args).to_json().encode("utf-8"))
    run_id = uuid.uuid4().hex
    lines: queue.SimpleQueue[tuple[str, str]] = queue.SimpleQueue()
    learners: dict[str, Child] = {}
    views = [LearnerView(i) for i in range(args.learners)]
    say(starting_line(args, address, rounds, paths.out))
    for i in range(args.learners):
        argv = [
            sys.executable, "-m", "yeto_learn.demo_model",
            "--syncer", address,
            "--learner-id", str(i),
            "--num-learners", str(args.learners),
            "--fragments", str(args.fragments),
            "--wire-dtype", args.wire_dtype,
            "--merge", args.merge,
            "--merge-alpha", str(args.merge_alpha),
            "--streams", str(args.streams),
            "--max-steps", str(LEARNER_STEP_CAP * args.steps),
            "--stall-timeout", str(ROUND_TIMEOUT_S),
            "--batch-size", str(args.batch_size),
            "--out", str(paths.learner_dir(i)),
            "--run-id", run_id,
        ]  # fmt: skip
        child = _spawn(f"learner-{i}", argv, paths.learner_dir(i) / "stderr.log", env)
        children.insert(0, child)  # stopped before the syncer
        learners[child.name] = child
        threading.Thread(target=_pump_lines, args=(child, lines), daemon=True).start()
        stops.check()  # between two starts: the children so far are in `children`

    with Display(views, rounds, sys.stdout) as display:
        failure = _follow(learners, syncer, views, lines, display, stops)
    if failure is not None:
        stop_children(children)
        print(
            f"yeto launch: failed: {failure}; kept: {_syncer_kept(paths, children)}",
            file=sys.stderr,
        )
        return EXIT_FAILED
    code = _wait(syncer.process, 30, stops)
    if code is None:
        stop_children(children)
        print(
            "yeto launch: failed: every learner finished but the syncer did not exit; "
            f"kept: {_syncer_kept(paths, children)}",
            file=sys.stderr,
        )
        return EXIT_FAILED
    if code != 0:
        removed = _remove_unfinished_writes(paths, children)
        print(f"yeto launch: {syncer.ended(code, 2)}{removed}", file=sys.stderr)
        return EXIT_FAILED
    return _summarize(views, paths, args, rounds, time.monotonic() - started)


def _summarize(
    views: list[LearnerView], paths: Paths, args: argparse.Namespace, rounds: int, elapsed: float
) -> int:
    """Write and show the summary of a finalized run; a summary that cannot be written (a full
    disk: the atomic write leaves no temporary file) fails the run with a line that says why
    and what was kept."""
    try:
        _summary(views, paths, args, rounds, elapsed)
    except CheckpointError as exc:
        print(
            f"yeto launch: failed: the summary was not written: {exc.reason}; "
            f"kept: {_syncer_kept(paths)}; {_artifacts_kept(paths, args.learners)}",
            file=sys.stderr,
        )
        return EXIT_FAILED
    return EXIT_OK


def counted(count: int, noun: str) -> str:
    """``1 learner``, ``2 learners``."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def starting_line(args: argparse.Namespace, address: str, rounds: int, out: Path) -> str:
    return (
        f"yeto launch: syncer on {address} ({counted(rounds, 'round')}), "
        f"{counted(args.learners, 'learner')}, {counted(args.fragments, 'fragment')}, "
        f"wire {args.wire_dtype}, merge {args.merge}; output in {out}"
    )


def _await_listening(syncer: Child, stops: StopSignals) -> str | None:
    """The syncer's ``HOST:PORT`` from its one stdout line, or None if it did not start."""
    assert syncer.process.stdout is not None
    line = first_line(syncer.process.stdout, SYNCER_START_TIMEOUT_S, stops.check)
    prefix = "yeto-sync listening on "
    return line.strip().removeprefix(prefix) if line and line.startswith(prefix) else None


def _wait(process: subprocess.Popen[str], timeout: float, stops: StopSignals) -> int | None:
    """``process``'s exit code, or None if it still runs after ``timeout`` seconds."""

    def exited(wait: float) -> int | None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            return process.wait(wait)
        return None

    return poll_until(exited, timeout, stops.check)


def _follow(
    learners: dict[str, Child],
    syncer: Child,
    views: list[LearnerView],
    lines: queue.SimpleQueue[tuple[str, str]],
    display: Display,
    stops: StopSignals,
) -> str | None:
    """Show progress until every learner exited; return a failure description, if any."""
    open_streams = set(learners)
    while open_streams:
        stops.check()
        with contextlib.suppress(queue.Empty):
            name, line = lines.get(timeout=POLL_S)
            if not line:
                open_streams.discard(name)
            else:
                _record(views, line)
        display.refresh()
        for child in learners.values():
            code = child.process.poll()
            if code is not None and code != 0:
                return child.ended(code, 3)
        code = syncer.process.poll()
        if code is not None and code != 0:
            return syncer.ended(code, 2)
    for child in learners.values():
        code = _wait(child.process, math.inf, stops)
        if code is not None and code != 0:
            return child.ended(code, 3)
    return None


def _record(views: list[LearnerView], line: str) -> None:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return
    if isinstance(record, dict) and isinstance(record.get("learner"), int):
        learner_id = record["learner"]
        if 0 <= learner_id < len(views) and record.get("rank", 0) == 0:
            views[learner_id].update(record)


def allreduce_bytes(num_params: int, steps: int, learners: int) -> int:
    """Bytes a ring all-reduce of f32 gradients sends in total: 2(M−1)/M · 4N per worker-step."""
    return int(steps * learners * 2 * (learners - 1) / learners * 4 * num_params)


def _summary(
    views: list[LearnerView],
    paths: Paths,
    args: argparse.Namespace,
    rounds: int,
    elapsed: float,
    emit: Callable[[str], None] = say,
) -> None:
    done = [v.done for v in views if v.done]
    if not done:
        return
    start = sum(d["eval_loss_start"] for d in done) / len(done)
    final = sum(d["eval_loss_final"] for d in done) / len(done)
    steps = max(int(d["steps"]) for d in done)
    moved = sum(int(d["bytes_sent"]) + int(d["bytes_received"]) for d in done)
    ring = allreduce_bytes(int(done[0]["num_params"]), steps, args.learners)
    identical = len({d["params_sha256"] for d in done}) == 1
    record = {
        "learners": args.learners,
        "fragments": args.fragments,
        "wire_dtype": args.wire_dtype,
        "merge": args.merge,
        "rounds": rounds,
        "seconds": elapsed,
        "eval_loss_start": start,
        "eval_loss_final": final,
        "tokens": sum(int(d["tokens"]) for d in done),
        "bytes_moved": moved,
        "allreduce_bytes": ring,
        "learners_identical": identical,
        "checkpoint": str(paths.checkpoint),
        "final_state": str(paths.final_state),
        "event_tape": str(paths.tape),
        "per_learner": done,
    }
    write_bytes_atomically(paths.summary, (json.dumps(record, indent=2) + "\n").encode("utf-8"))
    emit(
        f"yeto launch: finished in {elapsed:.1f} s — {counted(rounds, 'round')}, "
        f"{counted(steps, 'local step')}"
    )
    emit(f"  eval loss        {start:.3f} → {final:.3f} ({final - start:+.3f})")
    if args.learners > 1:
        ratio = f"{ring / moved:.1f}× less" if moved else "n/a"
        emit(
            f"  bytes moved      {human_bytes(moved)} (all-reduce data parallelism: "
            f"{human_bytes(ring)} for {steps} steps; {ratio})"
        )
    else:
        emit(f"  bytes moved      {human_bytes(moved)} (one learner: all-reduce would move none)")
    if args.learners > 1:  # one learner has nothing to agree with
        emit(f"  learners agree   {'yes, bit for bit' if identical else 'NO'} (final parameters)")
    emit(f"  checkpoint       {paths.checkpoint} (+ .final marker)")
    emit(f"  final state      {paths.final_state}")
    emit(f"  event tape       {paths.tape}")
    emit(f"  summary          {paths.summary}")
    for i in range(len(views)):
        emit(f"  learner {i}        {paths.learner_dir(i) / STATE_FILE}, {LAYOUT_FILE}")
