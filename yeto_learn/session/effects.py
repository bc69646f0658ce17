"""What the learner session asks its driver to do.

``LearnerSession.receive`` returns a list of these, in order; the driver carries them out in that
order. Arrays handed out here are read-only and shared with the session's own state (the raw
anchor, the final cache): the driver reads or copies them, never writes into them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeAlias

import numpy as np
from numpy.typing import NDArray

from yeto_proto import AnyMessage


@dataclass(frozen=True, slots=True)
class ApplyBroadcast:
    """Blend ``θ ← α·θ_local + (1−α)·Θ`` into the fragment, then confirm.

    ``global_params`` is the raw Θ, already recorded as the fragment's anchor. Once the blend is
    in the parameters, call ``LearnerSession.broadcast_applied(fragment_id, version)``: that
    resets the fragment's window and makes pending pulls of it answerable again.
    """

    fragment_id: int
    version: int
    global_params: NDArray[np.float32] = field(repr=False)


@dataclass(frozen=True, slots=True)
class AnchorRecorded:
    """Frozen (budget) mode: Θ became the anchor; the frozen parameters stay untouched."""

    fragment_id: int
    version: int


@dataclass(frozen=True, slots=True)
class ApplyFinal:
    """Overwrite every fragment with its final f32 values (no blending), then confirm.

    ``fragments[p]`` is fragment p's authoritative state. Once all of it is in the parameters,
    call ``LearnerSession.final_applied(final_global_step)`` and send the FINAL_ACK it returns.
    """

    final_global_step: int
    fragments: tuple[NDArray[np.float32], ...] = field(repr=False)


@dataclass(frozen=True, slots=True)
class SendMessage:
    """Send ``message`` to the syncer on the current connection group."""

    message: AnyMessage


@dataclass(frozen=True, slots=True)
class SyncerFailed:
    """The syncer sent ERROR: the session is over and the training loop must stop."""

    text: str


@dataclass(frozen=True, slots=True)
class ShutdownReceived:
    """SHUTDOWN after our FINAL_ACK: the run is complete; close the group."""


Effect: TypeAlias = (
    ApplyBroadcast | AnchorRecorded | ApplyFinal | SendMessage | SyncerFailed | ShutdownReceived
)
