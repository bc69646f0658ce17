"""A learner whose artifact does not fit on disk: one clear error, no temporary file, and
``model.pt`` (written last) only when the whole artifact is there.

The learner is a real process with RLIMIT_FSIZE (SIGXFSZ ignored), so a write past the limit
fails with EFBIG ("File too large") as a full disk fails with ENOSPC.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from syncer_process import REPO, child_env, running_syncer

from yeto_learn.artifact_files import LAYOUT_FILE, RUN_ID_FILE, STATE_FILE, SUMMARY_FILE

LEARNER = """
import resource, signal, sys, torch
from yeto_learn import Learner, LearnerError
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1500, 1500))  # model.pt needs about 4 kB
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
learner = Learner(model, syncer=sys.argv[1], learner_id=0, num_learners=1, fragments=2,
                  wire_dtype="f32", out_dir=sys.argv[2], run_id="full-disk", connect_timeout=30)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
while not learner.final_ready:
    loss = (model(torch.randn(32, 8)) ** 2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    learner.step(tokens=32)
try:
    learner.finish(timeout=60)
except LearnerError as exc:
    sys.exit(f"LearnerError: {exc}")
"""


def test_an_artifact_that_does_not_fit_is_one_clear_error_and_no_model_pt(
    tmp_path: Path,
) -> None:
    out = tmp_path / "learner-0"
    with running_syncer(
        tmp_path / "syncer", learners=1, total_steps=4, extra=["--sync-interval-steps", "8"]
    ) as syncer:
        result = subprocess.run(
            [sys.executable, "-c", LEARNER, syncer.address, str(out)],
            cwd=REPO,
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert syncer.wait() == 0, syncer.log_tail()  # the final state was acknowledged
    assert result.returncode == 1, result.stderr
    assert result.stderr.splitlines()[-1] == (
        "LearnerError: the final state was applied and acknowledged, but the learner's "
        f"artifact was not saved: File too large (file {out / STATE_FILE})"
    )
    # model.pt is written last: without it, nothing claims a whole artifact; no temp file.
    assert sorted(p.name for p in out.iterdir()) == sorted([RUN_ID_FILE, LAYOUT_FILE, SUMMARY_FILE])
