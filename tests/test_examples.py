"""The examples run as documented against a real yeto-sync."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from syncer_process import child_env, running_syncer

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_two_learner_example_trains_to_a_final_state(tmp_path: Path) -> None:
    with running_syncer(
        tmp_path / "syncer", learners=2, total_steps=40, extra=["--sync-interval-steps", "4"]
    ) as syncer:
        done = subprocess.run(
            [sys.executable, str(EXAMPLES / "train_two_learners.py"), syncer.address],
            capture_output=True,
            text=True,
            timeout=180,
            env=child_env(),
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert syncer.wait(30) == 0
    losses = [float(line.rsplit(" ", 1)[1]) for line in done.stdout.splitlines()]
    assert len(losses) == 2 and all(loss < 0.5 for loss in losses), done.stdout
