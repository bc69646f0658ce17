"""The demo learner's failure line (what `yeto launch` shows of a learner that failed)."""

from __future__ import annotations

from yeto_learn import FinishTimeout
from yeto_learn.demo_model import failure_line


def test_a_failure_line_carries_the_errors_notes() -> None:
    error = FinishTimeout("the syncer at h:1 did not complete finalization within 5 s")
    assert failure_line(error) == str(error)
    error.add_note("this learner has been cut off from the syncer for the last 9 s")
    assert failure_line(error) == (
        "the syncer at h:1 did not complete finalization within 5 s; "
        "this learner has been cut off from the syncer for the last 9 s"
    )
