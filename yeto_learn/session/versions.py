"""A per-fragment cache that only moves forward in version.

Both the BCAST anchors and the FINAL_FRAGMENT cache follow the same rule (source text): a lower
version is dropped, an identical equal-version replay changes nothing, and different bytes at
the same version are a fatal protocol error of the peer. The two caches are separate instances,
so a BCAST can neither satisfy nor conflict with terminal delivery.

"Identical bytes" is checked on the decoded f32 bit patterns: f32 and bf16 decoding are both
injective (bf16 decodes as ``bits << 16``), so equal decoded bits mean equal wire bytes.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from yeto_proto import ErrorCode, RemoteProtocolError


class Arrival(enum.Enum):
    """What an offered version did to the cache."""

    #: The first version of the fragment, or a higher one: it is now the cached state.
    STORED = "stored"
    #: The cached version again, bit for bit: nothing changes.
    REPLAY = "replay"
    #: Older than the cached version: dropped.
    STALE = "stale"


@dataclass(frozen=True, slots=True)
class Versioned:
    """One fragment's cached state: a version and its read-only f32 values."""

    version: int
    values: NDArray[np.float32] = field(repr=False)


def frozen_f32(values: NDArray[np.float32]) -> NDArray[np.float32]:
    """``values`` as an aligned, C-contiguous, read-only f32 array (copied only if needed)."""
    out = np.require(values, dtype=np.float32, requirements=["C", "A"])
    out.flags.writeable = False
    return out


def same_bits(a: NDArray[np.float32], b: NDArray[np.float32]) -> bool:
    """Bitwise equality (NaN payloads and signed zeros included)."""
    return a.shape == b.shape and bool(np.array_equal(a.view(np.uint32), b.view(np.uint32)))


class MonotonicCache:
    """Per-fragment monotonic versions; ``conflict`` names the fatal error of the peer."""

    def __init__(self, num_fragments: int, conflict: ErrorCode, what: str) -> None:
        self._slots: list[Versioned | None] = [None] * num_fragments
        self._conflict = conflict
        self._what = what

    def __getitem__(self, fragment_id: int) -> Versioned | None:
        return self._slots[fragment_id]

    def __len__(self) -> int:
        return len(self._slots)

    def versions(self) -> list[int | None]:
        return [None if s is None else s.version for s in self._slots]

    def offer(
        self, fragment_id: int, version: int, decode: Callable[[], NDArray[np.float32]]
    ) -> Arrival:
        """Offer ``version`` of a fragment; ``decode`` is called only when the bytes matter."""
        held = self._slots[fragment_id]
        if held is not None and version < held.version:
            return Arrival.STALE
        values = frozen_f32(decode())
        if held is None or version > held.version:
            self._slots[fragment_id] = Versioned(version, values)
            return Arrival.STORED
        if same_bits(values, held.values):
            return Arrival.REPLAY
        raise RemoteProtocolError(
            self._conflict,
            f"{self._what} fragment {fragment_id} version {version}: different bytes replayed",
        )

    def restore(
        self, fragment_id: int, version: int, decode: Callable[[], NDArray[np.float32]]
    ) -> Arrival:
        """Offer the first version a new connection delivers, which may go back in time.

        A live syncer never sends a version below one it sent before; a syncer restarted from
        a checkpoint older than the held version does, and may redo that version with other
        bytes. Its state replaces the held one (STORED); only the same bits are a REPLAY.
        """
        held = self._slots[fragment_id]
        if held is None or version > held.version:
            return self.offer(fragment_id, version, decode)
        values = frozen_f32(decode())
        if version == held.version and same_bits(values, held.values):
            return Arrival.REPLAY
        self._slots[fragment_id] = Versioned(version, values)
        return Arrival.STORED

    def clear(self) -> None:
        self._slots = [None] * len(self._slots)
