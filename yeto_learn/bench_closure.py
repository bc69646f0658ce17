"""``yeto bench``: the benchmark closure on loopback, from training to an exported model.

One command runs what spec/closure.md describes:

1. a ``yeto-sync`` with ``--learner-budget-steps B`` (the *cutoff process*) on 127.0.0.1;
2. M learners (threads of this process, each a :class:`~yeto_learn.Learner` around a tiny
   byte-level model) train exactly B local steps, then report BUDGET_DONE and freeze;
3. after one report from every learner the cutoff process writes an unmarked recovery checkpoint
   at global step C and exits 0;
4. the harness restarts the syncer on the same endpoint from that checkpoint with
   ``--total-steps C+F`` and ``--quorum M``: the frozen learners reconnect and answer F ordinary
   consolidation rounds, which end in the ordinary final cut and the marked final checkpoint;
5. the harness checks the consolidation event tape — every configured learner in every one of
   the F rounds — and only then exports the marked checkpoint to safetensors.

It prints the budget, C, F, the tape check and the export path. Exit status: 0 when the closure
completed and was exported, 1 when any step of it failed (nothing is exported) or stdout cannot
be written (a full disk: one line, ``yeto bench: cannot write the output: …``), 2 for bad flags
or an output directory that cannot be made or is not empty, 128 + n when signal n (SIGINT,
SIGTERM, SIGHUP) stopped it: its syncers are stopped first, and a syncer outlives no bench
(Linux). If nobody reads its stdout any more (``yeto bench | head -1``), the closure goes on
and its lines go to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from yeto_proto.checkpoint import (
    Checkpoint,
    MarkerStatus,
    atomic_replace,
    export_tensors,
    marker_state,
    read_checkpoint,
)
from yeto_proto.constants import MAX_STREAMS, U32_MAX
from yeto_proto.errors import ProtocolError
from yeto_sync.help_format import HelpFormatter

from .artifact_files import LAYOUT_FILE
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
from .kept_checkpoint import checkpoint_use, describe_kept
from .model_layout import most_fragments
from .process_control import Stopped, first_line, poll_until, say, spawn, stops_recorded
from .safetensors_file import write_safetensors

if TYPE_CHECKING:
    from .cli import Commands
    from .learner import Learner

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
HOST = "127.0.0.1"
LISTENING = "yeto-sync listening on "
#: The cutoff process must never run out of ordinary rounds before every budget is reached.
CUTOFF_TOTAL_STEPS = 1 << 40
SYNCER_START_TIMEOUT_S = 30.0
STOP_GRACE_S = 5.0
#: The longest --training-timeout and --consolidation-timeout (some 31 years). A learner waits
#: for their sum at most, and Python's waits take at most threading.TIMEOUT_MAX (some 292 years
#: on Linux); the syncers get them as u64 seconds.
MAX_TIMEOUT_S = 1e9
TIMEOUT_RANGE = f"in (0, {MAX_TIMEOUT_S:.0f}]"
#: How long a stopped or failed closure waits for its learner threads to end (importing torch
#: takes seconds on a busy machine).
LEARNER_STOP_GRACE_S = 5.0
#: The tiny model: ByteModel(context, embed, hidden) of yeto_learn.demo_model.
TINY_MODEL = (8, 8, 32)
MODEL_SEED = 0

CHECKPOINT_FILE = "checkpoint.yeto"
CUTOFF_TAPE = "cutoff-tape.jsonl"
CONSOLIDATION_TAPE = "consolidation-tape.jsonl"
EXPORT_FILE = "final.safetensors"


class ClosureFailed(Exception):
    """One step of the closure failed; the text says which and why. Nothing was exported."""


@dataclass(frozen=True, slots=True)
class BenchConfig:
    out: Path
    learners: int = 2
    fragments: int = 4
    wire_dtype: str = "f32"
    budget: int = 200
    streams: int = 1
    batch_size: int = 32
    lr: float = 3e-3
    merge_alpha: float = 0.5
    quorum: int = 1
    sync_interval: float = 8.0
    #: Seconds for the training phase (start to the cutoff process's exit).
    training_timeout: float = 300.0
    #: Seconds for the consolidation phase (restart to the marked checkpoint).
    consolidation_timeout: float = 120.0
    #: Learners that report their budget and then leave instead of reconnecting (tests).
    miss_restart: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        """Every flag against its whole range (``ValueError``: the one line to show)."""
        if not 1 <= self.learners <= MAX_LOCAL_LEARNERS:
            raise ValueError(
                out_of_range(
                    "--learners",
                    self.learners,
                    1,
                    MAX_LOCAL_LEARNERS,
                    "each is a thread of this process",
                )
            )
        most = most_fragments(byte_model_shapes(*TINY_MODEL))
        if not 1 <= self.fragments <= most:  # the learners would refuse more, too late
            raise ValueError(
                out_of_range("--fragments", self.fragments, 1, most, "for the bench's model")
            )
        # 0 trains nothing: c_tokens 0 weighs every push at zero.
        if not 1 <= self.batch_size <= MAX_BATCH_SIZE:
            raise ValueError(out_of_range("--batch-size", self.batch_size, 1, MAX_BATCH_SIZE))
        if not 1 <= self.budget <= U32_MAX:
            raise ValueError(
                out_of_range("--budget", self.budget, 1, U32_MAX, "it travels as c_steps")
            )
        if not 0 <= self.streams <= MAX_STREAMS:
            raise ValueError(out_of_range("--streams", self.streams, 0, MAX_STREAMS))
        # yeto launch's rule too: H local steps between a fragment's syncs (the syncer's pacing)
        if not 1 <= self.sync_interval <= MAX_SYNC_INTERVAL:  # NaN is in no range
            raise ValueError(
                out_of_range("--sync-interval", self.sync_interval, 1, MAX_SYNC_INTERVAL)
            )
        if self.wire_dtype not in ("f32", "bf16", "q4"):
            raise ValueError(f"--wire-dtype must be f32, bf16 or q4, got {self.wire_dtype!r}")
        if not 1 <= self.quorum <= self.learners:
            raise ValueError(
                out_of_range("--quorum", self.quorum, 1, self.learners, "at most --learners")
            )
        for name, seconds in (
            ("--training-timeout", self.training_timeout),
            ("--consolidation-timeout", self.consolidation_timeout),
        ):
            if not 0 < seconds <= MAX_TIMEOUT_S:  # NaN is in no range
                raise ValueError(
                    f"{name} must be a number of seconds {TIMEOUT_RANGE}, got {seconds}"
                )


@dataclass(frozen=True, slots=True)
class TapeCheck:
    """The consolidation tape's verdict: every configured learner in every one of F rounds."""

    ok: bool
    rounds: int
    detail: str


@dataclass(frozen=True, slots=True)
class ClosureResult:
    budget: int
    cutoff_step: int
    fragments: int
    final_step: int
    tape: TapeCheck
    export_path: Path
    eval_loss_initial: float
    eval_loss_final: float
    seconds: float


# -- the tape check ------------------------------------------------------------------------------
def check_consolidation_tape(
    path: Path, *, cutoff_step: int, fragments: int, learners: int
) -> TapeCheck:
    """Rounds ``C+1 … C+F``: one merge line each, all F fragments, every learner responding."""
    expected_steps = range(cutoff_step + 1, cutoff_step + fragments + 1)
    everyone = set(range(learners))
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
        records = [json.loads(line) for line in lines if line.strip()]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return TapeCheck(False, 0, f"cannot read the event tape {path}: {exc}")
    merges: dict[int, list[dict[str, Any]]] = {}
    for record in records:
        if not isinstance(record, dict):
            continue
        if record.get("event") == "resumed" and isinstance(record.get("step"), int):
            # A restart discarded every commit above its checkpoint (spec/syncer.md § 11):
            # the lines before it for those steps describe nothing that survived.
            for step in [s for s in merges if s > record["step"]]:
                del merges[step]
        elif "event" not in record and record.get("step") in expected_steps:
            merges.setdefault(int(record["step"]), []).append(record)
    problems = []
    covered = set()
    for step in expected_steps:
        found = merges.get(step, [])
        if len(found) != 1:
            problems.append(f"round {step}: {len(found)} merge lines")
            continue
        record = found[0]
        covered.add(record.get("fragment"))
        responders = {r.get("id") for r in record.get("responders", []) if isinstance(r, dict)}
        if not everyone <= responders:
            problems.append(f"round {step}: learners {sorted(everyone - responders)} missing")
    if not problems and covered != set(range(fragments)):
        problems.append(f"fragments {sorted(set(range(fragments)) - covered)} not consolidated")
    rounds = sum(1 for step in expected_steps if len(merges.get(step, [])) == 1)
    if problems:
        return TapeCheck(False, rounds, "; ".join(problems))
    return TapeCheck(
        True,
        rounds,
        f"every learner 0..{learners - 1} responded in each of the {fragments} rounds "
        f"{expected_steps.start}..{expected_steps.stop - 1}",
    )


# -- syncer processes ----------------------------------------------------------------------------
def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    checkout = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [checkout, env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    return env


@dataclass(eq=False)
class SyncerProcess:
    name: str
    process: subprocess.Popen[str]
    log_path: Path
    port: int = 0

    def last_line(self) -> str:
        with contextlib.suppress(OSError):
            lines = self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()
            return next((line for line in reversed(lines) if line.strip()), "")
        return ""

    def stop(self) -> None:
        """SIGTERM, a grace period, then SIGKILL: the harness never leaves a syncer behind."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.terminate()
            try:
                self.process.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    self.process.kill()
                self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()


def _no_stop() -> None:
    """A ``check`` for callers that handle no stop signals."""


def start_syncer(
    name: str, flags: Sequence[str], log_path: Path, check: Callable[[], None] = _no_stop
) -> SyncerProcess:
    """Start ``python -m yeto_sync`` and wait for its listening line.

    ``check`` raises :class:`Stopped` once a stop signal arrived (it is asked while waiting);
    the syncer is stopped then too.
    """
    argv = [sys.executable, "-m", "yeto_sync", "--host", HOST, *flags]
    with open(log_path, "a", encoding="utf-8") as log:
        process = spawn(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=_child_env(),
        )
    syncer = SyncerProcess(name, process, log_path)
    try:
        assert process.stdout is not None
        line = first_line(process.stdout, SYNCER_START_TIMEOUT_S, check) or ""
        if not line.startswith(LISTENING):
            raise ClosureFailed(f"the {name} syncer did not start: {syncer.last_line() or line!r}")
        syncer.port = int(line.strip().rsplit(":", 1)[1])
    except BaseException:
        syncer.stop()  # a stop while it starts must not leave it behind either
        raise
    return syncer


# -- learners ------------------------------------------------------------------------------------
@dataclass
class Crew:
    """The learner threads, what they built, and the first failure among them."""

    learners: dict[int, Learner] = field(default_factory=dict)
    threads: list[threading.Thread] = field(default_factory=list)
    failures: list[tuple[int, BaseException]] = field(default_factory=list)
    finished: set[int] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: Set by :meth:`close_all`: no thread starts or goes on training after it.
    stopping: threading.Event = field(default_factory=threading.Event)

    def failure(self) -> str | None:
        with self.lock:
            if not self.failures:
                return None
            learner_id, error = self.failures[0]
            return f"learner {learner_id}: {error}"

    def enlist(self, learner_id: int, learner: Learner) -> bool:
        """Hand a learner that was just built to the crew; once it stops, close it instead.

        A thread may finish building its learner after :meth:`close_all` ran: that learner
        would train on, unclosed, until the process ends.
        """
        with self.lock:
            if not self.stopping.is_set():
                self.learners[learner_id] = learner
                return True
        with contextlib.suppress(Exception):
            learner.close()
        return False

    def close_all(self) -> None:
        with self.lock:
            self.stopping.set()
            learners = list(self.learners.values())
        for learner in learners:
            with contextlib.suppress(Exception):
                learner.close()

    def join(self, timeout: float) -> None:
        """Wait at most ``timeout`` seconds in all for the learner threads to end.

        They are daemon threads, but none may still be inside torch when the interpreter
        exits: CPython ends such a thread when it next takes the GIL, from inside torch's
        C++ code that released it, and that aborts the whole process (SIGABRT, "terminate
        called without an active exception") after its last line was printed. Once stopping,
        a thread ends at its next step, or as soon as its model is built; only one still
        importing torch, or dialing a syncer that is gone, can outlast the wait (see
        :func:`~yeto_learn.process_control.exit_process`).
        """
        deadline = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))


def _train_learner(
    config: BenchConfig, learner_id: int, address: str, run_id: str, crew: Crew
) -> None:
    """One learner: B local steps, BUDGET_DONE, then the frozen consolidation and the final cut."""
    import torch
    from torch import nn

    from .demo_model import ByteModel, Corpus, sample_batch
    from .learner import Learner

    try:
        torch.manual_seed(MODEL_SEED)
        model = ByteModel(*TINY_MODEL)
        corpus = Corpus.load()
        optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
        generator = torch.Generator().manual_seed(1000 + learner_id)
        if crew.stopping.is_set():  # stopped while torch was imported: do not dial
            return
        learner = Learner(
            model,
            syncer=address,
            learner_id=learner_id,
            num_learners=config.learners,
            fragments=config.fragments,
            wire_dtype=config.wire_dtype,
            merge_alpha=config.merge_alpha,
            streams=config.streams,
            out_dir=config.out / f"learner-{learner_id}",
            run_id=run_id,
            experiment={
                "bench": "closure",
                "model": f"ByteModel{TINY_MODEL}",
                "corpus_sha256": corpus.digest,
                "batch_size": config.batch_size,
                "lr": config.lr,
            },
            budget_steps=config.budget,
            connect_timeout=config.training_timeout,
            reconnect_timeout=config.consolidation_timeout,
            finish_timeout=config.training_timeout + config.consolidation_timeout,
        )
        if not crew.enlist(learner_id, learner):
            return
        while not learner.budget_reached:
            if crew.stopping.is_set():
                return  # closed under us: the next step would only fail
            if learner.final_ready:
                raise ClosureFailed("the cutoff syncer finished its rounds before the budget")
            x, y = sample_batch(corpus.train, config.batch_size, model.context, generator)
            loss = nn.functional.cross_entropy(model(x), y)
            torch.autograd.backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            learner.step(tokens=config.batch_size)
        if learner_id in config.miss_restart:
            learner.report_budget()
            learner.close()  # queued frames (the report) drain before the sockets close
            return
        learner.finish()  # BUDGET_DONE, frozen reconnect, consolidation, final cut, ACK
        with crew.lock:
            crew.finished.add(learner_id)
    except BaseException as exc:  # the harness reports it and stops the closure
        with crew.lock:
            crew.failures.append((learner_id, exc))


# -- the closure ---------------------------------------------------------------------------------
def _joined(thread: threading.Thread, wait: float) -> bool | None:
    """True once ``thread`` ended (waiting at most ``wait`` seconds), else None."""
    thread.join(wait)
    return None if thread.is_alive() else True


def _wait_for_exit(
    syncer: SyncerProcess, crew: Crew, deadline: float, what: str, check: Callable[[], None]
) -> int:
    while True:
        check()
        code = syncer.process.poll()
        if code is not None:
            return code
        failure = crew.failure()
        if failure is not None:
            raise ClosureFailed(f"{what}: {failure}")
        if time.monotonic() >= deadline:
            raise ClosureFailed(
                f"{what}: the {syncer.name} syncer did not finish in time (its last log line: "
                f"{syncer.last_line()})"
            )
        time.sleep(0.05)


def run_closure(
    config: BenchConfig,
    say: Callable[[str], None] = print,
    check: Callable[[], None] = _no_stop,
) -> ClosureResult:
    """Run the whole closure; raise :class:`ClosureFailed` (nothing exported) on any failure.

    ``check`` raises :class:`Stopped` once a stop signal arrived; it is asked between the steps
    and while the closure waits, and everything started is stopped then.
    """
    started = time.monotonic()
    out = config.out
    out.mkdir(parents=True, exist_ok=True)
    checkpoint = out / CHECKPOINT_FILE
    if checkpoint.exists():
        raise ClosureFailed(f"{checkpoint} exists: use a fresh --out directory")
    log_path = out / "syncer.log"
    common = [
        f"--learners={config.learners}",
        f"--sync-interval-steps={config.sync_interval}",
        f"--checkpoint-path={checkpoint}",
        "--mark-final-checkpoint",
        # Rounded up: the syncer takes whole seconds, at least 1.
        f"--quorum-timeout-s={math.ceil(config.consolidation_timeout)}",
    ]
    say(
        f"yeto bench: {config.learners} learners, {config.fragments} fragments, "
        f"{config.wire_dtype}, budget {config.budget} local steps per learner"
    )
    crew = Crew()
    syncers: list[SyncerProcess] = []
    try:
        cutoff = start_syncer(
            "cutoff",
            [
                *common,
                "--port=0",
                f"--quorum={config.quorum}",
                f"--total-steps={CUTOFF_TOTAL_STEPS}",
                f"--learner-budget-steps={config.budget}",
                # Learners reach the budget at their own pace: the cutoff waits for the last
                # report as long as training may take, not just a consolidation's span.
                f"--final-ack-timeout-s={math.ceil(config.training_timeout)}",
                f"--event-tape={out / CUTOFF_TAPE}",
            ],
            log_path,
            check,
        )
        syncers.append(cutoff)
        address = f"{HOST}:{cutoff.port}"
        run_id = f"bench-{uuid.uuid4().hex}"
        for learner_id in range(config.learners):
            thread = threading.Thread(
                target=_train_learner,
                args=(config, learner_id, address, run_id, crew),
                name=f"learner-{learner_id}",
                daemon=True,
            )
            crew.threads.append(thread)
            thread.start()

        # -- the cutoff process ----------------------------------------------------------------
        code = _wait_for_exit(
            cutoff, crew, started + config.training_timeout, "training to the budget", check
        )
        if code != 0:
            raise ClosureFailed(f"the cutoff syncer exited {code}: {cutoff.last_line()}")
        saved = _read(checkpoint, "cutoff")
        cutoff_step, fragments = saved.global_step, saved.num_fragments
        del saved
        if marker_state(checkpoint, cutoff_step).status is not MarkerStatus.ABSENT:
            raise ClosureFailed("the cutoff checkpoint carries a final marker")
        say(
            f"cutoff     : every learner reported B={config.budget}; unmarked recovery "
            f"checkpoint at global step C={cutoff_step}; restarting the syncer (the learners' "
            "'lost the syncer … redialing' lines are this restart)"
        )

        # -- the consolidation process ---------------------------------------------------------
        restart = start_syncer(
            "consolidation",
            [
                *common,
                f"--port={cutoff.port}",
                "--resume",
                f"--quorum={config.learners}",
                f"--total-steps={cutoff_step + fragments}",
                f"--final-ack-timeout-s={math.ceil(config.consolidation_timeout)}",
                f"--event-tape={out / CONSOLIDATION_TAPE}",
            ],
            log_path,
            check,
        )
        syncers.append(restart)
        code = _wait_for_exit(
            restart,
            crew,
            time.monotonic() + config.consolidation_timeout,
            "consolidation",
            check,
        )
        if code != 0:
            raise ClosureFailed(f"the consolidation syncer exited {code}: {restart.last_line()}")
        final_step = cutoff_step + fragments
        for thread in crew.threads:
            poll_until(functools.partial(_joined, thread), config.consolidation_timeout, check)
        failure = crew.failure()
        if failure is not None:
            raise ClosureFailed(f"consolidation: {failure}")
        missing = sorted(set(range(config.learners)) - crew.finished)
        if missing:
            raise ClosureFailed(f"learners {missing} did not finish the consolidation")
        say(
            f"consolidate: F={fragments} ordinary rounds {cutoff_step + 1}..{final_step} "
            f"with quorum {config.learners}"
        )

        # -- checks, then export ---------------------------------------------------------------
        state = marker_state(checkpoint, final_step)
        if state.status is not MarkerStatus.FINAL:
            raise ClosureFailed(f"no marked final checkpoint at step {final_step}: {state.detail}")
        final = _read(checkpoint, "final")
        if final.global_step != final_step:
            raise ClosureFailed(
                f"the final checkpoint is at global step {final.global_step}, not {final_step}"
            )
        tape = check_consolidation_tape(
            out / CONSOLIDATION_TAPE,
            cutoff_step=cutoff_step,
            fragments=fragments,
            learners=config.learners,
        )
        say(f"tape check : {'ok' if tape.ok else 'FAILED'} — {tape.detail}")
        if not tape.ok:
            raise ClosureFailed(
                f"the event tape does not show the full consolidation: {tape.detail}"
            )
        learner = crew.learners[0]
        export_path = out / EXPORT_FILE
        initial_loss, final_loss = _export(final, learner, out, export_path, check)
        del final
        say(f"export     : {export_path} (global step {final_step})")
        say(f"eval loss  : {initial_loss:.4f} at the start → {final_loss:.4f} consolidated")
    except BaseException:
        crew.close_all()
        raise
    finally:
        for syncer in syncers:
            syncer.stop()
        crew.join(LEARNER_STOP_GRACE_S)  # they all ended already when the closure completed
    return ClosureResult(
        budget=config.budget,
        cutoff_step=cutoff_step,
        fragments=fragments,
        final_step=final_step,
        tape=tape,
        export_path=export_path,
        eval_loss_initial=initial_loss,
        eval_loss_final=final_loss,
        seconds=time.monotonic() - started,
    )


def _read(path: Path, what: str) -> Checkpoint:
    try:
        return read_checkpoint(path, mapped=True)
    except ProtocolError as exc:
        raise ClosureFailed(f"the {what} checkpoint is unreadable: {exc}") from None


def _export(
    checkpoint: Checkpoint, learner: Learner, out: Path, target: Path, check: Callable[[], None]
) -> tuple[float, float]:
    """Marked checkpoint → safetensors through the learners' layout; eval loss before/after."""
    import torch
    from safetensors.numpy import load_file

    from .demo_model import ByteModel, Corpus, eval_loss

    layout = learner.layout
    with atomic_replace(out / LAYOUT_FILE) as staging:
        staging.write_text(layout.to_json(), encoding="utf-8")
    try:
        exported = export_tensors(checkpoint, layout)
    except ProtocolError as exc:
        raise ClosureFailed(f"export refused: {exc}") from None
    try:
        # yeto's writer fills the staging file itself (the library's writes a hidden temporary
        # file of its own naming, which a killed bench would leave behind).
        with atomic_replace(target, before_replace=check) as staging:
            write_safetensors(staging, exported.tensors, exported.metadata)
    except ProtocolError as exc:  # CKPT_IO: the target is a directory, the disk is full, ...
        raise ClosureFailed(f"export failed: {exc}") from None
    corpus = Corpus.load()
    torch.manual_seed(MODEL_SEED)
    model = ByteModel(*TINY_MODEL)
    initial = eval_loss(model, corpus.eval, model.context)
    state = {
        name: torch.from_numpy(values) for name, values in load_file(os.fspath(target)).items()
    }
    model.load_state_dict(state)
    return initial, eval_loss(model, corpus.eval, model.context)


# -- the command ---------------------------------------------------------------------------------
def register(commands: Commands) -> None:
    parser = commands.add_parser(
        "bench",
        help="run the benchmark closure (budget, cutoff, consolidation, export) on loopback",
        description=(
            "Train a tiny byte-level model with M learners for exactly --budget local steps "
            "each, cut the syncer off on their BUDGET_DONE reports, restart it from the "
            "cutoff checkpoint for F consolidation rounds, check the event tape, and export "
            "the marked final checkpoint to safetensors (spec/closure.md)."
        ),
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--learners", type=int, default=2, help=f"M, learners ({LEARNERS_RANGE})")
    parser.add_argument("--fragments", type=int, default=4, help="F, fragments of the model")
    parser.add_argument(
        "--wire-dtype", choices=("f32", "bf16", "q4"), default="f32", help=WIRE_HELP
    )
    parser.add_argument("--budget", type=int, default=200, help="B, local steps per learner")
    parser.add_argument("--streams", type=int, default=1, help="data sockets per learner")
    parser.add_argument("--batch-size", type=int, default=32, help=BATCH_HELP)
    parser.add_argument("--quorum", type=int, default=1, help="quorum while training")
    parser.add_argument("--sync-interval", type=float, default=8.0, help=SYNC_INTERVAL_HELP)
    parser.add_argument(
        "--training-timeout",
        type=float,
        default=300.0,
        help=f"seconds to reach the cutoff; {TIMEOUT_RANGE}",
    )
    parser.add_argument(
        "--consolidation-timeout",
        type=float,
        default=120.0,
        help=f"seconds from the restart to the marked final checkpoint; {TIMEOUT_RANGE}",
    )
    parser.add_argument("--out", type=Path, help=out_help("yeto-bench"))
    parser.set_defaults(handler=run, command_prog=parser.prog)


def _kept(out: Path) -> str:
    """The checkpoint a closure that did not finish leaves in ``out``, and how to use it."""
    checkpoint = out / CHECKPOINT_FILE
    # The learners write their layout at the final cut; the export writes one too.
    layouts = [out / "learner-0" / LAYOUT_FILE, out / LAYOUT_FILE]
    layout = next((path for path in layouts if path.exists()), layouts[0])
    return describe_kept(checkpoint) + checkpoint_use(
        checkpoint, layout, out / EXPORT_FILE, "yeto bench"
    )


def run(args: argparse.Namespace) -> int:
    try:  # every flag is checked before the output directory is made
        config = BenchConfig(
            out=args.out or Path(),
            learners=args.learners,
            fragments=args.fragments,
            wire_dtype=args.wire_dtype,
            budget=args.budget,
            streams=args.streams,
            batch_size=args.batch_size,
            quorum=args.quorum,
            sync_interval=args.sync_interval,
            training_timeout=args.training_timeout,
            consolidation_timeout=args.consolidation_timeout,
        )
    except ValueError as exc:
        print(f"{args.command_prog}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        config = replace(config, out=make_output_dir(args.out, "yeto-bench"))
    except OutputDirError as exc:
        print(f"{args.command_prog}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        with stops_recorded(args.command_prog) as stops:
            stops.check()  # one that came while the command started
            # stdout's reader may go away: it goes on
            result = run_closure(config, say=say, check=stops.check)
    except ClosureFailed as exc:
        print(
            f"{args.command_prog}: closure failed, nothing exported: {exc}; "
            f"kept: {_kept(config.out)}",
            file=sys.stderr,
        )
        return EXIT_FAILED
    except OSError as exc:  # the output directory failed under us (a log, a layout file)
        reason = f"{exc.strerror or exc} ({exc.filename})" if exc.filename else str(exc)
        print(
            f"{args.command_prog}: closure failed, nothing exported: {reason}; "
            f"kept: {_kept(config.out)}",
            file=sys.stderr,
        )
        return EXIT_FAILED
    except Stopped as stop:
        print(
            f"{args.command_prog}: stopped by {stop}; every syncer stopped, nothing exported; "
            f"kept: {_kept(config.out)}",
            file=sys.stderr,
        )
        return 128 + stop.signum
    say(
        f"budget B={result.budget}  C={result.cutoff_step}  F={result.fragments}  "
        f"final step {result.final_step}  tape check ok  export {result.export_path}  "
        f"({result.seconds:.1f} s)"
    )
    return EXIT_OK
