"""Per-type payload limits, before and after a session's layout and dtype are known."""

from __future__ import annotations

from dataclasses import dataclass, field

from .constants import (
    BCAST_PREFIX_SIZE,
    CHUNK_LIMIT,
    ERROR_TEXT_LIMIT,
    EXACT_PAYLOAD_SIZES,
    FINAL_FRAGMENT_PREFIX_SIZE,
    FIRST_FRAME_LIMIT,
    HEADER_SIZE,
    INIT_PREFIX_SIZE,
    PUSH_PREFIX_SIZE,
    SENDABLE,
    STRIPED_TYPES,
    FrameType,
    Role,
    WireDtype,
)
from .errors import ErrorCode, RemoteProtocolError
from .layout import WireLayout


@dataclass(frozen=True, slots=True)
class Limits:
    """Limits derived from the negotiated dtype and per-fragment numels."""

    dtype: WireDtype
    numels: tuple[int, ...]
    #: Computed once: a HELLO may declare over a million fragments, and every frame header
    #: of the session is checked against a limit derived from it.
    max_numel: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "max_numel", max(self.numels, default=0))

    @classmethod
    def of(cls, dtype: WireDtype, layout: WireLayout) -> Limits:
        return cls(WireDtype(dtype), layout.numels)

    @property
    def num_fragments(self) -> int:
        return len(self.numels)

    def tensor_bytes(self, frame_type: FrameType, fragment_id: int) -> int:
        """Exact tensor byte count of a bulk frame for one fragment."""
        numel = self.numels[fragment_id]
        if frame_type is FrameType.PUSH_FRAGMENT:
            return self.dtype.push_bytes(numel)
        if frame_type is FrameType.FINAL_FRAGMENT:
            return 4 * numel
        return numel * self.dtype.bulk_itemsize

    def payload_limit(self, frame_type: FrameType) -> int:
        exact = EXACT_PAYLOAD_SIZES.get(frame_type)
        if exact is not None:
            return exact
        biggest = self.max_numel
        match frame_type:
            case FrameType.HELLO:
                return FIRST_FRAME_LIMIT
            case FrameType.FINAL_MANIFEST:
                return 14 + 8 * self.num_fragments
            case FrameType.ERROR:
                return ERROR_TEXT_LIMIT
            case FrameType.CHUNK:
                return CHUNK_LIMIT
            case FrameType.INIT_PARAMS:
                return INIT_PREFIX_SIZE + biggest * self.dtype.bulk_itemsize
            case FrameType.PUSH_FRAGMENT:
                return PUSH_PREFIX_SIZE + self.dtype.push_bytes(biggest)
            case FrameType.BCAST_FRAGMENT:
                return BCAST_PREFIX_SIZE + biggest * self.dtype.bulk_itemsize
            case FrameType.FINAL_FRAGMENT:
                return FINAL_FRAGMENT_PREFIX_SIZE + 4 * biggest
        raise AssertionError(frame_type)  # every FrameType is handled above

    def is_exact(self, frame_type: FrameType) -> bool:
        return frame_type in EXACT_PAYLOAD_SIZES or frame_type is FrameType.FINAL_MANIFEST

    def inner_limit(self, receiver: Role) -> int:
        """Largest reassembled inner frame (header included) a receiver accepts."""
        carried = SENDABLE[receiver.peer] & STRIPED_TYPES
        return HEADER_SIZE + max(self.payload_limit(t) for t in carried)

    def check_fragment(self, fragment_id: int) -> None:
        if fragment_id >= self.num_fragments:
            raise RemoteProtocolError(
                ErrorCode.BAD_FRAGMENT_ID,
                f"fragment {fragment_id} outside 0..{self.num_fragments - 1}",
            )
