"""The authoritative global model: per-fragment f32 params, momentum and version, plus the ledger.

Only :meth:`GlobalModel.commit` changes a fragment after initialization, and it swaps in arrays
that :func:`yeto_sync.merge.merge_round` already produced, so a failed merge leaves everything as
it was. Arrays are never written in place once stored: broadcasts, final fragments and
checkpoints may keep referring to them without copies; the :class:`ArrayPool` that new arrays
come from hands an array out again only after every such reference is gone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from yeto_proto.checkpoint import Checkpoint, CheckpointFormat, FragmentState, TrailerKind
from yeto_proto.checkpoint import LedgerEntry as CheckpointLedgerEntry
from yeto_proto.constants import IsoBackend
from yeto_proto.layout import WireFragment, WireLayout

from ..merge import F32Array, LedgerEntry, RoundMerge
from .arrays import ArrayPool


@dataclass(slots=True, eq=False)
class FragmentSlot:
    geometry: WireFragment
    version: int = 0
    params: F32Array | None = None
    momentum: F32Array | None = None

    @property
    def initialized(self) -> bool:
        return self.params is not None

    def arrays(self) -> tuple[F32Array, F32Array]:
        if self.params is None or self.momentum is None:
            raise RuntimeError("fragment used before it was initialized")
        return self.params, self.momentum


class GlobalModel:
    """Global state of one session, created once the session layout is known."""

    def __init__(self, layout: WireLayout, learners: int) -> None:
        self.layout = layout
        #: Where each round's Δ, new params and momentum and decoded pushes come from.
        self.arrays = ArrayPool(layout, learners)
        self.fragments = [FragmentSlot(geometry) for geometry in layout.fragments]
        self.ledger: dict[int, LedgerEntry] = {}
        #: The last committed round t (0 before the first commit).
        self.global_step = 0

    @property
    def num_fragments(self) -> int:
        return len(self.fragments)

    @property
    def all_initialized(self) -> bool:
        return all(slot.initialized for slot in self.fragments)

    @property
    def versions(self) -> tuple[int, ...]:
        return tuple(slot.version for slot in self.fragments)

    def initialize(self, fragment: int, params: F32Array) -> None:
        """INIT: version 0 with zero momentum (``params`` is owned by the model from now on)."""
        slot = self.fragments[fragment]
        slot.params = params
        slot.momentum = np.zeros_like(params)
        slot.version = 0

    def install(self, checkpoint: Checkpoint) -> None:
        """Adopt an eligible checkpoint: params, momentum, versions, ledger and global step."""
        for slot, saved in zip(self.fragments, checkpoint.fragments, strict=True):
            slot.params = np.ascontiguousarray(saved.params, dtype=np.float32)
            slot.momentum = np.ascontiguousarray(saved.momentum, dtype=np.float32)
            slot.version = saved.version
        self.ledger = {
            entry.learner_id: LedgerEntry(entry.merges, entry.steps, entry.tokens)
            for entry in checkpoint.ledger
        }
        self.global_step = checkpoint.global_step

    def commit(self, step: int, fragment: int, merged: RoundMerge) -> None:
        """Round ``step`` becomes visible: the fragment takes version ``step``."""
        slot = self.fragments[fragment]
        slot.params = merged.params
        slot.momentum = merged.momentum
        slot.version = step
        self.ledger = dict(merged.ledger)
        self.global_step = step

    def snapshot(
        self, *, iso_backend: IsoBackend, fingerprint: bytes, contract: bytes
    ) -> Checkpoint:
        """A V3 checkpoint value referring to the current arrays (no copies)."""
        fragments = []
        for slot in self.fragments:
            params, momentum = slot.arrays()
            fragments.append(FragmentState(slot.version, params, momentum))
        ledger = tuple(
            CheckpointLedgerEntry(learner, entry.merges, entry.steps, entry.tokens)
            for learner, entry in sorted(self.ledger.items())
        )
        return Checkpoint(
            format=CheckpointFormat.V3,
            iso_backend=IsoBackend(iso_backend),
            fingerprint=fingerprint,
            global_step=self.global_step,
            fragments=tuple(fragments),
            ledger=ledger,
            contract=contract,
            trailer=TrailerKind.FINGERPRINT_AND_CONTRACT,
        )
