"""The launchers' torch-free picture of the demo model matches the model, and with it they
refuse a --fragments the learners could never build before anything starts."""

from __future__ import annotations

import subprocess
import sys

import pytest
from syncer_process import REPO, child_env

from yeto_learn.demo_model import ByteModel
from yeto_learn.demo_shapes import byte_model_shapes


@pytest.mark.parametrize("sizes", [(), (8, 8, 32), (3, 5, 7)])
def test_the_shapes_are_the_models(sizes: tuple[int, ...]) -> None:
    model = ByteModel(*sizes)
    actual = [(name, tuple(p.shape)) for name, p in model.named_parameters() if p.requires_grad]
    assert actual == byte_model_shapes(*sizes)


@pytest.mark.parametrize(
    ("command", "message"),
    [
        (["launch", "--fragments", "8"], "--fragments must be in 1..7 (for the demo model"),
        (["launch", "--fragments", "6", "--merge", "iso"], "in 1..5 (for the demo model"),
        (["bench", "--fragments", "50"], "--fragments must be in 1..7 (for the bench's model)"),
    ],
)
def test_a_fragment_count_the_model_cannot_have_is_a_usage_error(
    command: list[str], message: str
) -> None:
    # It used to start the syncer and the learners, which then failed one by one (exit 1).
    done = subprocess.run(
        [sys.executable, "-m", "yeto_learn.cli", *command],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert message in done.stderr
