"""The typed value of a checkpoint: what a reader returns and what the writer streams out."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ..constants import IsoBackend

#: Every parameter and momentum array is little-endian f32, one dimension, one per fragment.
F32 = np.dtype("<f4")
F32Array = npt.NDArray[np.float32]


def iso_backend_name(backend: IsoBackend) -> str:
    """The spelling of the ``--iso-backend`` flag: ``scalar`` or ``torch-svd``."""
    return IsoBackend(backend).name.lower().replace("_", "-")


class CheckpointFormat(enum.IntEnum):
    """The three on-disk formats; each value is the file's leading magic."""

    V1 = 0xD1705A7E
    V2 = 0xD1705A7F
    V3 = 0xD1705A80

    @property
    def has_iso_backend(self) -> bool:
        return self is not CheckpointFormat.V1

    @property
    def has_fingerprint(self) -> bool:
        return self is CheckpointFormat.V3


class TrailerKind(enum.Enum):
    """What follows the ledger; the value is its exact byte length."""

    NONE = 0
    #: The layout fingerprint again (for V1/V2 the only copy, for V3 a repeat of the prefix).
    FINGERPRINT = 32
    #: The fingerprint, then ``u32 0x52544353`` and the 32-byte session contract.
    FINGERPRINT_AND_CONTRACT = 68


@dataclass(frozen=True, slots=True, eq=False)
class FragmentState:
    """One fragment: its committed version and flat f32 parameters and outer momentum."""

    version: int
    params: F32Array
    momentum: F32Array

    @property
    def numel(self) -> int:
        return int(self.params.size)


@dataclass(frozen=True, slots=True)
class LedgerEntry:
    """Cumulative contribution of one logical learner."""

    learner_id: int
    merges: int
    steps: int
    tokens: int


@dataclass(frozen=True, slots=True, eq=False)
class Checkpoint:
    """A whole checkpoint. Arrays are compared by the caller; the value itself has no ``==``."""

    format: CheckpointFormat
    #: ``None`` for V1, which does not record it.
    iso_backend: IsoBackend | None
    #: V3: the prefix fingerprint. V1/V2: the trailer's fingerprint if the file carries one
    #: (nothing in the file can confirm it), else ``None``.
    fingerprint: bytes | None
    global_step: int
    fragments: tuple[FragmentState, ...]
    ledger: tuple[LedgerEntry, ...]
    #: The session contract from the trailer, or ``None`` when the file carries none.
    contract: bytes | None
    trailer: TrailerKind
    #: Bytes of the file it was read from (its whole structure is validated, so this is the
    #: size of what was decoded, even if the name now holds another file); None when built.
    file_size: int | None = None

    @property
    def num_fragments(self) -> int:
        return len(self.fragments)

    @property
    def numels(self) -> tuple[int, ...]:
        return tuple(f.numel for f in self.fragments)

    @property
    def versions(self) -> tuple[int, ...]:
        return tuple(f.version for f in self.fragments)

    @property
    def fingerprint_confirmed(self) -> bool:
        """True only where the format itself records the fingerprint (V3)."""
        return self.format.has_fingerprint
