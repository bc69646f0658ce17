"""Terminal delivery on the learner side: FINAL cache, manifest, apply, FINAL_ACK, SHUTDOWN.

The syncer sends every fragment as f32 FINAL_FRAGMENT, then FINAL_MANIFEST; streams may reorder
them. The learner applies the cut only once it holds the manifest and, for every fragment,
exactly the version the manifest expects, and it ACKs only after the training loop confirmed
that the parameters hold it. An ACK counts for one connection generation: after a reconnect the
syncer queues the cut again and the learner ACKs again from the new generation, once the
manifest has arrived there (parameters that already hold that cut are not applied twice).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numpy.typing import NDArray

from yeto_proto import (
    ErrorCode,
    FinalAck,
    FinalManifest,
    LocalProtocolError,
    RemoteProtocolError,
)

from .effects import ApplyFinal, Effect, SendMessage
from .versions import MonotonicCache


class Finalization:
    def __init__(self, num_fragments: int) -> None:
        self.cache = MonotonicCache(num_fragments, ErrorCode.FINAL_CONFLICT, "FINAL_FRAGMENT")
        self.manifest: FinalManifest | None = None
        #: The final step whose cut the parameters hold (the training loop confirmed the apply).
        self.applied_step: int | None = None
        self._manifest_here = False  # the held manifest arrived on the current connection
        self._apply_pending: int | None = None  # ApplyFinal emitted, not yet confirmed
        self._acked_here: int | None = None  # final step ACKed on the current connection

    @property
    def started(self) -> bool:
        """An ApplyFinal went out: from here on BCASTs no longer touch the parameters."""
        return self._apply_pending is not None or self.applied_step is not None

    @property
    def acked_step(self) -> int | None:
        """The final step ACKed on the current connection, if any."""
        return self._acked_here

    def shutdown_allowed(self) -> bool:
        """SHUTDOWN is legal only after the ACK of the exact held manifest on this connection."""
        return self.manifest is not None and self._acked_here == self.manifest.final_global_step

    def connection_lost(self) -> None:
        self._manifest_here = False
        self._acked_here = None

    # -- input from the syncer -------------------------------------------------------------
    def add_fragment(
        self, fragment_id: int, version: int, decode: Callable[[], NDArray[np.float32]]
    ) -> list[Effect]:
        self.cache.offer(fragment_id, version, decode)
        return self._progress()

    def add_manifest(self, manifest: FinalManifest) -> list[Effect]:
        versions = manifest.expected_versions
        if len(versions) != len(self.cache):
            raise RemoteProtocolError(
                ErrorCode.BAD_MANIFEST,
                f"manifest lists {len(versions)} fragments, session has {len(self.cache)}",
            )
        step = manifest.final_global_step
        if any(v > step for v in versions):
            raise RemoteProtocolError(
                ErrorCode.BAD_MANIFEST, f"a version exceeds final_global_step {step}: {versions}"
            )
        held = self.manifest
        if held is None or step > held.final_global_step:
            self.manifest = manifest
            self._acked_here = None
        elif step < held.final_global_step:
            return []  # an older cut: dropped, like a lower BCAST version
        elif versions != held.expected_versions:
            raise RemoteProtocolError(
                ErrorCode.FINAL_CONFLICT,
                f"two manifests for final step {step}: {held.expected_versions} vs {versions}",
            )
        self._manifest_here = True
        return self._progress()

    def _progress(self) -> list[Effect]:
        manifest = self.manifest
        if manifest is None or not self._manifest_here:
            return []
        held = [self.cache[p] for p in range(len(self.cache))]
        if any(
            slot is None or slot.version != expected
            for slot, expected in zip(held, manifest.expected_versions, strict=True)
        ):
            return []
        step = manifest.final_global_step
        if step in (self._acked_here, self._apply_pending):
            return []
        if self.applied_step == step:  # a reconnect: the parameters already hold this cut
            self._acked_here = step
            return [SendMessage(FinalAck(step))]
        self._apply_pending = step
        return [ApplyFinal(step, tuple(slot.values for slot in held if slot is not None))]

    # -- input from the training loop ------------------------------------------------------
    def confirm_applied(self, final_global_step: int) -> FinalAck | None:
        pending = self._apply_pending
        if pending is None or final_global_step > pending:
            raise LocalProtocolError(
                ErrorCode.UNEXPECTED_FINAL_ACK,
                f"final step {final_global_step} was not handed out for apply (pending {pending})",
            )
        if final_global_step < pending:
            return None  # an older cut; the ApplyFinal of the newer one is still to be applied
        self._apply_pending = None
        self.applied_step = final_global_step
        manifest = self.manifest
        if (
            manifest is None
            or not self._manifest_here
            or manifest.final_global_step != final_global_step
        ):
            return None  # reconnected meanwhile: ACK once the manifest arrives again
        self._acked_here = final_global_step
        return FinalAck(final_global_step)
