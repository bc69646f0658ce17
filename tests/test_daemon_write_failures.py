"""``yeto-sync`` when its writes fail for lack of space, as a real process.

The daemon runs with RLIMIT_FSIZE (and SIGXFSZ ignored): a write past the limit fails with
EFBIG ("File too large"), as a full disk fails with ENOSPC. Whatever fails, the files already
on disk stay whole and loadable, no temporary file is left, the daemon exits 1 with a last line
naming the file, the errno text and the checkpoint it kept, and ``--resume`` carries on.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from daemon_harness import Daemon
from scripted_learner import LearnerGroup, ScriptedLearner, SessionSpec, play_in_thread

from yeto_proto import MergeMode, WireDtype, WireFragment, WireLayout
from yeto_proto.checkpoint import (
    Checkpoint,
    CheckpointFormat,
    FragmentState,
    LedgerEntry,
    TrailerKind,
    read_checkpoint,
    scheduled_version,
    write_checkpoint,
)
from yeto_proto.constants import IsoBackend

LAYOUT = WireLayout((WireFragment(MergeMode.AVG, (16,)), WireFragment(MergeMode.AVG, (8,))))
SPEC = SessionSpec(WireDtype.BF16, LAYOUT, bytes(range(32)), bytes(range(64, 96)))
CHECKPOINT_SIZE = 373  # V3 of LAYOUT with one ledger entry


def flags(checkpoint: Path, *extra: str) -> list[str]:
    return [
        "--learners=1",
        "--total-steps=6",
        "--sync-interval-steps=0",
        f"--checkpoint-path={checkpoint}",
        "--checkpoint-every=2",
        *extra,
    ]


def checkpoint_at(step: int) -> Checkpoint:
    return Checkpoint(
        format=CheckpointFormat.V3,
        iso_backend=IsoBackend.SCALAR,
        fingerprint=SPEC.fingerprint,
        global_step=step,
        fragments=tuple(
            FragmentState(
                scheduled_version(p, step, len(LAYOUT.numels)),
                np.full(n, 0.25, np.float32),
                np.zeros(n, np.float32),
            )
            for p, n in enumerate(LAYOUT.numels)
        ),
        ledger=(LedgerEntry(0, step, 4 * step, 4000 * step),),
        contract=SPEC.contract,
        trailer=TrailerKind.FINGERPRINT_AND_CONTRACT,
    )


def serve(daemon: Daemon, generation: int, *, init: bool) -> list[BaseException]:
    """One scripted learner until the daemon ends; what went wrong for it."""
    initial = [np.full(n, 0.5, np.float32) for n in LAYOUT.numels] if init else None
    learner = ScriptedLearner(
        LearnerGroup(daemon.address, SPEC, learner_id=0, generation=generation, num_streams=1),
        initial=initial,
    )
    failures: list[BaseException] = []
    thread = play_in_thread(learner, failures, timeout=30)
    daemon.wait(30)
    thread.join(30)
    return failures


def last_line(daemon: Daemon) -> str:
    return daemon.stderr.strip().splitlines()[-1]


def test_a_periodic_checkpoint_that_does_not_fit_keeps_the_one_before(tmp_path: Path) -> None:
    checkpoint = tmp_path / "ckpt"
    write_checkpoint(checkpoint, checkpoint_at(2))
    before = checkpoint.read_bytes()
    assert len(before) == CHECKPOINT_SIZE
    with Daemon(*flags(checkpoint, "--resume"), fsize=CHECKPOINT_SIZE - 73) as daemon:
        serve(daemon, 1, init=False)  # the learner sees its syncer go away
        assert daemon.wait() == 1
    # The step-4 write failed: the daemon says why and that the step-2 checkpoint is kept.
    assert last_line(daemon) == (
        f"yeto-sync: checkpoint write failed: CKPT_IO: write: File too large (file "
        f"{checkpoint}); the checkpoint it resumed from, {checkpoint} at global_step 2"
    )
    assert checkpoint.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary file

    with Daemon(*flags(checkpoint, "--resume")) as daemon:
        assert not serve(daemon, 2, init=False)
        assert daemon.wait() == 0, daemon.stderr
    assert read_checkpoint(checkpoint).global_step == 6


@pytest.mark.parametrize("every", [2, 1])
def test_an_event_tape_that_does_not_fit_keeps_whole_lines(tmp_path: Path, every: int) -> None:
    checkpoint, tape = tmp_path / "ckpt", tmp_path / "events.jsonl"
    tape_flags = flags(
        checkpoint, f"--event-tape={tape}", "--total-steps=10", f"--checkpoint-every={every}"
    )
    with Daemon(*tape_flags, fsize=1500) as daemon:  # room for a few merge lines
        serve(daemon, 1, init=True)
        assert daemon.wait() == 1
    # The line that did not fit was cut off whole: every line on the tape is a record.
    text = tape.read_text(encoding="utf-8")
    assert text.endswith("\n") and 0 < len(text) < 1500
    assert all(json.loads(line) for line in text.splitlines())
    kept = read_checkpoint(checkpoint).global_step
    assert last_line(daemon) == (
        f"yeto-sync: event tape write failed: File too large (file {tape}); "
        f"last durable checkpoint {checkpoint} at global_step {kept}"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "events.jsonl"]

    with Daemon(*tape_flags, "--resume") as daemon:
        assert not serve(daemon, 2, init=False)
        assert daemon.wait() == 0, daemon.stderr
    records = [json.loads(line) for line in tape.read_text(encoding="utf-8").splitlines()]
    resumed = [i for i, r in enumerate(records) if r.get("event") == "resumed"]
    assert len(resumed) == 1 and records[resumed[0]]["step"] == kept
    steps = [r["step"] for r in records[resumed[0] :] if "event" not in r]
    assert steps == list(range(kept + 1, 11))
    # The step whose line failed was not checkpointed either (its line comes first), so the
    # resumed run redid it: every step has its line. Taped after the checkpoint, with a
    # checkpoint every step, the failed step's line was lost for good.
    assert {r["step"] for r in records if "event" not in r} == set(range(1, 11))


@pytest.mark.parametrize("output", ["checkpoint", "final state"])
def test_a_terminal_write_that_does_not_fit_leaves_no_file_and_no_marker(
    tmp_path: Path, output: str
) -> None:
    path = tmp_path / output.replace(" ", "-")
    if output == "checkpoint":  # the final cut's checkpoint is the first write
        run = flags(path, "--checkpoint-every=100", "--mark-final-checkpoint")
    else:
        run = ["--learners=1", "--total-steps=6", "--sync-interval-steps=0"]
        run.append(f"--final-state={path}")
    with Daemon(*run, fsize=CHECKPOINT_SIZE - 73) as daemon:
        failures = serve(daemon, 1, init=True)
        assert daemon.wait() == 1
    assert failures  # no learner got a final state that was not written
    assert last_line(daemon) == (
        f"yeto-sync: {output} write failed: CKPT_IO: write: File too large (file {path}); "
        "no checkpoint was written"
    )
    assert not list(tmp_path.iterdir())  # no marker, no temporary file
