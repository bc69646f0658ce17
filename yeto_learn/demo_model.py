"""The model, data and learner process behind ``yeto launch`` (and the end-to-end tests).

Data ships with Python itself: the source text of a fixed list of pure-Python standard library
modules, read as bytes. The model is a small byte-level language model (the previous
``context`` bytes, embedded and concatenated, through two ReLU layers to next-byte logits):
about 240k parameters, a few milliseconds per step on one core, and a loss that falls from
ln 256 ≈ 5.5 to about 2 within a few hundred steps.

``python -m yeto_learn.demo_model --syncer HOST:PORT --learner-id I --num-learners M …`` runs one
learner and prints JSON lines on stdout (``progress`` while training, then ``done``) for the
launcher to display. Under ``torchrun`` (``WORLD_SIZE`` > 1) the ranks form one learner:
gloo process group, DDP replicas, a different data stream per rank.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import signal
import sys
import sysconfig
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from torch import nn

from .artifact_files import STATE_FILE
from .demo_shapes import VOCAB

#: Pure-Python standard library modules whose source is the corpus (missing ones are skipped).
CORPUS_MODULES = (
    "argparse.py",
    "textwrap.py",
    "string.py",
    "calendar.py",
    "difflib.py",
    "pprint.py",
    "shlex.py",
    "fractions.py",
    "csv.py",
    "heapq.py",
    "bisect.py",
    "glob.py",
    "fnmatch.py",
    "cmd.py",
    "queue.py",
    "sched.py",
    "colorsys.py",
    "statistics.py",
)
#: Every tenth block of the corpus is held out for evaluation.
EVAL_EVERY = 10
#: Past --max-steps a learner stops once no round advanced for this long: yeto launch's
#: syncer gives a round as long to reach its quorum.
STALL_TIMEOUT_S = 120.0
EVAL_BLOCK = 2048


@dataclass(frozen=True, slots=True)
class Corpus:
    train: torch.Tensor  # int64 byte values
    eval: torch.Tensor
    digest: str  # sha256 of the bytes: part of the experiment identity

    @classmethod
    def load(cls) -> Corpus:
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        files = [stdlib / name for name in CORPUS_MODULES]
        parts = [path.read_bytes() for path in files if path.is_file()]
        text = b"\n".join(parts)
        if len(text) < 10_000:
            raise RuntimeError(f"the standard library sources under {stdlib} are missing")
        data = torch.frombuffer(bytearray(text), dtype=torch.uint8).to(torch.int64)
        blocks = torch.arange(len(data)) // EVAL_BLOCK
        held_out = blocks % EVAL_EVERY == EVAL_EVERY - 1  # interleaved: the same distribution
        return cls(data[~held_out], data[held_out], hashlib.sha256(text).hexdigest())


class ByteModel(nn.Module):
    """Next-byte prediction from the previous ``context`` bytes."""

    def __init__(self, context: int = 16, embed: int = 24, hidden: int = 256) -> None:
        super().__init__()
        self.context = context
        self.embed = nn.Embedding(VOCAB, embed)
        self.fc1 = nn.Linear(context * embed, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, VOCAB)

    def forward(self, window: torch.Tensor) -> torch.Tensor:
        h = self.embed(window).flatten(1)
        h = torch.relu(self.fc1(h))
        h = torch.relu(self.fc2(h))
        logits: torch.Tensor = self.head(h)
        return logits


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> ByteModel:
    """Every learner builds the same initial model from the same seed."""
    torch.manual_seed(seed)
    return ByteModel().to(dtype)


def sample_batch(
    data: torch.Tensor, batch: int, context: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` random windows of ``context`` bytes and the byte that follows each."""
    starts = torch.randint(0, len(data) - context - 1, (batch,), generator=generator)
    offsets = starts[:, None] + torch.arange(context + 1)
    windows = data[offsets]
    return windows[:, :context], windows[:, context]


def eval_loss(model: nn.Module, data: torch.Tensor, context: int, batches: int = 8) -> float:
    """Mean cross-entropy over fixed held-out windows (the same for every call)."""
    generator = torch.Generator().manual_seed(1234)
    total = 0.0
    with torch.no_grad():
        for _ in range(batches):
            x, y = sample_batch(data, 256, context, generator)
            total += float(nn.functional.cross_entropy(model(x).float(), y))
    return total / batches


def params_digest(model: nn.Module) -> str:
    """SHA-256 of every trainable parameter's bytes, in name order (replica equality)."""
    h = hashlib.sha256()
    for name, param in sorted(model.named_parameters()):
        h.update(name.removeprefix("module.").encode())
        h.update(param.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def emit(record: dict[str, Any]) -> None:
    """One JSON line in one write: lines of several ranks sharing a pipe never interleave."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (json.dumps(record) + "\n").encode())


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:  # NaN too: a learner past its cap would never stop
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, not {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m yeto_learn.demo_model",
        description="One yeto learner training the byte-level demo model (used by yeto launch).",
    )
    parser.add_argument("--syncer", required=True, help="HOST:PORT of the yeto-sync")
    parser.add_argument("--learner-id", type=int, required=True)
    parser.add_argument("--num-learners", type=int, required=True)
    parser.add_argument("--fragments", type=int, default=4)
    parser.add_argument("--wire-dtype", choices=("f32", "bf16", "q4"), default="f32")
    parser.add_argument("--merge", choices=("avg", "rda", "iso"), default="avg")
    parser.add_argument("--merge-alpha", type=float, default=0.5)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument(
        "--max-steps",
        type=int,
        default=4000,
        help="past this many local steps, train on only while the syncer's rounds advance",
    )
    parser.add_argument(
        "--stall-timeout",
        type=_positive_seconds,
        default=STALL_TIMEOUT_S,
        help="past --max-steps, stop once no round has advanced for this many seconds",
    )
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0, help="model initialization seed")
    parser.add_argument("--param-dtype", choices=("f32", "bf16"), default="f32")
    parser.add_argument("--out", type=Path, help="learner output directory (artifact, run id)")
    parser.add_argument("--run-id", help="shared run id (default: $YETO_RUN_ID)")
    parser.add_argument("--progress-every", type=float, default=0.5, help="seconds between lines")
    parser.add_argument(
        "--connect-timeout",
        type=float,
        default=60.0,
        help="give up starting once nothing has moved to or from the syncer for this long",
    )
    parser.add_argument("--finish-timeout", type=float, default=120.0)

    return parser


class _Terminated(BaseException):
    """SIGTERM: unwinds like an error, so an artifact being written loses only its temp file."""


class _Termination:
    """The SIGTERM handler: the first signal raises :class:`_Terminated` where it lands; later
    ones are only noted (raised into the first one's unwinding, they could leave a temporary
    file, or print a traceback from the interpreter's shutdown). Torch turns one raised inside
    its file writer into its own error, which a save at the cut only logs: :meth:`check` raises
    it again at the training loop's next safe point."""

    def __init__(self) -> None:
        self.received = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        first, self.received = not self.received, True
        if first:
            raise _Terminated

    def check(self) -> None:
        """A safe point: a SIGTERM that came and did not end the run ends it here."""
        if self.received:
            raise _Terminated


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # `yeto launch` stops its learners with SIGTERM; the default action would kill the process
    # between a temp file's creation and its rename, leaving the temp file behind.
    termination = _Termination()
    signal.signal(signal.SIGTERM, termination)
    try:
        return _run(args, termination)
    except BaseException:
        # Raised inside torch's file writer, _Terminated comes back as torch's RuntimeError:
        # whatever ends the run once SIGTERM came is the stop.
        if not termination.received:
            raise
        artifact = args.out / STATE_FILE if args.out is not None else None
        kept = (
            f"its artifact {artifact} is whole"
            if artifact is not None and artifact.exists()
            else "no artifact was written"
        )
        print(f"learner {args.learner_id}: stopped by SIGTERM; {kept}", file=sys.stderr)
        return 128 + signal.SIGTERM
    finally:
        # What is left is exiting: a late SIGTERM (the launcher stopping its learners, or its
        # parent-death signal) must not raise into the interpreter's shutdown.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _run(args: argparse.Namespace, termination: _Termination) -> int:
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = 0
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank = dist.get_rank()
    try:
        return _train(args, rank, world, termination)
    finally:
        if world > 1:
            import torch.distributed as dist

            dist.destroy_process_group()


def _train(args: argparse.Namespace, rank: int, world: int, termination: _Termination) -> int:
    from .learner import Learner
    from .transport import FinishStuck, LearnerError

    corpus = Corpus.load()
    param_dtype = torch.bfloat16 if args.param_dtype == "bf16" else torch.float32
    model = make_model(args.seed, param_dtype)
    context = model.context
    trained: nn.Module = model
    if world > 1:
        trained = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    generator = torch.Generator().manual_seed(10_000 * (args.learner_id + 1) + rank)
    # One warm-up pass: the first backward is slow, and the syncer paces rounds by step time.
    x, y = sample_batch(corpus.train, args.batch_size, context, generator)
    torch.autograd.backward(nn.functional.cross_entropy(trained(x).float(), y))
    optimizer.zero_grad(set_to_none=True)
    experiment = {
        "model": "ByteModel(16, 24, 256)",
        "corpus_sha256": corpus.digest,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "param_dtype": args.param_dtype,
    }  # session-wide only: a torchrun learner and a one-process learner share one contract
    started = time.monotonic()
    try:
        learner = Learner(
            trained,
            syncer=args.syncer,
            learner_id=args.learner_id,
            num_learners=args.num_learners,
            fragments=args.fragments,
            wire_dtype=args.wire_dtype,
            matrix_merge=args.merge,
            merge_alpha=args.merge_alpha,
            streams=args.streams,
            out_dir=args.out if rank == 0 else None,
            run_id=args.run_id,
            experiment=experiment,
            connect_timeout=args.connect_timeout,
            finish_timeout=args.finish_timeout,
        )
    except (LearnerError, ValueError) as exc:
        print(f"learner {args.learner_id}: {exc}", file=sys.stderr, flush=True)
        return 1
    start_eval = eval_loss(model, corpus.eval, context)
    emit({"event": "started", "learner": args.learner_id, "rank": rank, "eval_loss": start_eval})
    running = math.nan
    last_report = 0.0
    steps = 0
    rounds = RoundWatch(time.monotonic())
    capped = False
    try:
        while not learner.final_ready:
            # The cap guards against a syncer that stopped, not one that is slow: past it,
            # training goes on while rounds advance (a pause of a few seconds ends no run).
            stalled_s = rounds.stalled_for(learner.stats.global_step, time.monotonic())
            if steps >= args.max_steps and _rank_0_says(stalled_s >= args.stall_timeout, world):
                capped = True
                break
            x, y = sample_batch(corpus.train, args.batch_size, context, generator)
            loss = nn.functional.cross_entropy(trained(x).float(), y)
            torch.autograd.backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            learner.step(tokens=args.batch_size)
            termination.check()
            steps += 1
            value = float(loss.detach())
            running = value if math.isnan(running) else 0.95 * running + 0.05 * value
            now = time.monotonic()
            if rank == 0 and now - last_report >= args.progress_every:
                last_report = now
                emit(_progress(args.learner_id, learner, running, "training"))
        if rank == 0:
            emit(_progress(args.learner_id, learner, running, "finishing"))
        # At the cap, the final cut may still come: finish() answers the pulls whose windows
        # hold steps. Once the syncer pulls what only more training could answer, it cannot.
        termination.check()
        learner.finish(stop_when_stuck=not learner.final_ready)
        termination.check()  # one torch swallowed in the artifact's save at the cut
    except LearnerError as exc:
        text = failure_line(exc)
        if isinstance(exc, FinishStuck):
            text = _cap_reached(args, learner.stats.global_step)
        elif capped:
            text += (
                f" (it had stopped training after {steps} local steps, past its cap of "
                f"{args.max_steps}, no round having advanced for {args.stall_timeout:g} s)"
            )
        print(f"learner {args.learner_id}: {text}", file=sys.stderr, flush=True)
        learner.close()
        return 1
    final_eval = eval_loss(model, corpus.eval, context)
    stats = learner.stats
    emit(
        {
            "event": "done",
            "learner": args.learner_id,
            "rank": rank,
            "eval_loss_start": start_eval,
            "eval_loss_final": final_eval,
            "train_loss": running,
            "steps": stats.local_step,
            "tokens": stats.tokens,
            "rounds": stats.pushes,
            "bytes_sent": stats.bytes_sent,
            "bytes_received": stats.bytes_received,
            "generations": stats.generations,
            "final_global_step": learner.final_global_step,
            "params_sha256": params_digest(model),
            "num_params": sum(p.numel() for p in model.parameters()),
            "seconds": time.monotonic() - started,
        }
    )
    return 0


def _rank_0_says(decision: bool, world: int) -> bool:
    """Rank 0's ``decision`` on every rank: each rank's own clock could stop one rank's
    training while the others still run DDP's collectives (they take steps in lockstep)."""
    if world == 1:
        return decision
    import torch.distributed as dist

    flag = torch.tensor([int(decision)], dtype=torch.int64)
    dist.broadcast(flag, src=0)
    return bool(flag.item())


class RoundWatch:
    """How long the syncer's rounds have not advanced, from the global step a learner holds."""

    def __init__(self, now: float) -> None:
        self._global_step = -1
        self._advanced_at = now

    def stalled_for(self, global_step: int, now: float) -> float:
        if global_step != self._global_step:
            self._global_step, self._advanced_at = global_step, now
        return now - self._advanced_at


def failure_line(exc: BaseException) -> str:
    """The one line a learner's failure is reported with: its message and its notes (what
    ``finish`` kept, the applied cut, or why the cut may never come)."""
    return "; ".join([str(exc), *getattr(exc, "__notes__", ())])


def _cap_reached(args: argparse.Namespace, global_step: int) -> str:
    return (
        f"reached its cap of {args.max_steps} local steps (--max-steps; yeto launch passes "
        f"4 x --steps), and no round advanced for {args.stall_timeout:g} s before the syncer "
        f"finished the run (its rounds were at global step {global_step}): the syncer or a "
        "learner stalled (see their logs), or this machine has too few cores for --learners; "
        "try fewer --learners or a larger --sync-interval"
    )


def _progress(learner_id: int, learner: Any, loss: float, state: str) -> dict[str, Any]:
    stats = learner.stats
    return {
        "event": "progress",
        "learner": learner_id,
        "state": state,
        "step": stats.local_step,
        "loss": loss,
        "rounds": stats.pushes,
        "global_step": stats.global_step,
        "bytes_sent": stats.bytes_sent,
        "bytes_received": stats.bytes_received,
        "generations": stats.generations,
    }


if __name__ == "__main__":
    sys.exit(main())
