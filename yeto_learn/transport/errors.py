"""Why a learner stopped: the exceptions the training loop sees.

A learner raises only when it cannot go on: the syncer could not be reached (or reached again
within the reconnect deadline), it stayed silent, it refused the learner with ERROR, or it broke
the protocol. Each message names the syncer's address and what to check.
"""

from __future__ import annotations

from yeto_proto import ErrorCode, ProtocolError


class LearnerError(Exception):
    """A learner cannot continue; the text says why in one line."""

    #: The protocol error code behind the failure, where there is one.
    code: ErrorCode | None = None


class SyncerUnreachable(LearnerError):
    """No connection group could be opened (or reopened) before the deadline."""


class SyncerSilent(LearnerError):
    """A connection was accepted but no session started before the deadline."""


class SyncerRefused(LearnerError):
    """The syncer sent ERROR: it refused this learner or ended the session."""

    code = ErrorCode.SYNCER_ERROR

    def __init__(self, address: str, text: str) -> None:
        super().__init__(f"the syncer at {address} stopped this learner: {text}")
        self.text = text


class SyncerProtocolViolation(LearnerError):
    """The syncer sent something the protocol forbids (a decoding or session error)."""

    def __init__(self, address: str, error: ProtocolError) -> None:
        super().__init__(f"the syncer at {address} broke the protocol: {error}")
        self.error = error
        self.code = error.code


class NonFiniteParameters(LearnerError):
    """This learner's own parameters (an INIT or a PUSH delta) hold NaN or infinity: nothing
    was sent (the syncer would refuse it and drop the learner), and the learner stops."""

    code = ErrorCode.NON_FINITE_VALUE


class FinishTimeout(LearnerError):
    """The final state did not arrive (or was not confirmed) within the finish deadline."""


class FinishStuck(LearnerError):
    """``finish(stop_when_stuck=True)``: the syncer pulls fragments that only another
    ``step()`` could answer, so its final cut cannot come while training stays stopped."""

    def __init__(self, address: str, fragments: list[int]) -> None:
        super().__init__(
            f"the syncer at {address} still pulls fragments {fragments}, which this learner "
            "answers only with further local steps"
        )
        self.fragments = fragments
