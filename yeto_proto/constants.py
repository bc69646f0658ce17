"""Numbers fixed by protocol v4 (source text and PINNED.md)."""

from __future__ import annotations

import enum

PROTOCOL_VERSION = 4
FRAME_MAGIC = 0xD170C0DE
HEADER_SIZE = 13  # magic:u32 | type:u8 | len:u64

#: The first frame on a socket (HELLO or DATA_HELLO) may not exceed this.
FIRST_FRAME_LIMIT = 16 * 1024 * 1024
#: One CHUNK carries at most this many inner-frame bytes.
CHUNK_SLICE_SIZE = 4 * 1024 * 1024
CHUNK_ENVELOPE_SIZE = 24  # msg_id:u64 | total_len:u64 | offset:u64
CHUNK_LIMIT = CHUNK_ENVELOPE_SIZE + CHUNK_SLICE_SIZE
ERROR_TEXT_LIMIT = 65536
#: Frame and reassembly buffers are allocated uninitialized and filled as bytes arrive, so the OS
#: would happily promise absurd sizes; claims above this (256 TiB) fail before any allocation.
ALLOCATION_CEILING = 1 << 48
MAX_PARTIAL_MESSAGES = 64
#: A first CHUNK whose msg_id is this far or further below the highest msg_id a first CHUNK of
#: the group named counts as naming a completed message (spec/striping.md § 4.2): a receiver
#: remembers which ids completed within this window only.
MSG_ID_WINDOW = 1 << 16
#: Separate received byte ranges one partial message may have at once (at least; see
#: spec/striping.md § 4 rule 9): bounds a receiver's bookkeeping against tiny-CHUNK slicing.
MAX_CHUNK_RANGES = 4096
MAX_STREAMS = 256
FINALIZATION_REVISION = 1

#: The largest value of the wire's and the checkpoints' unsigned fields.
U32_MAX = (1 << 32) - 1
U64_MAX = (1 << 64) - 1
#: The largest int64 (torch's integer for a token count summed over ranks).
I64_MAX = (1 << 63) - 1

DIGEST_SIZE = 32  # SHA-256 / HMAC-SHA256

# Fixed parts of the bulk payloads, before the tensor bytes.
INIT_PREFIX_SIZE = 4
PUSH_PREFIX_SIZE = 48
BCAST_PREFIX_SIZE = 12
FINAL_FRAGMENT_PREFIX_SIZE = 12

# q4 (E3M0) blocks.
Q4_BLOCK_VALUES = 256
Q4_BLOCK_BYTES = 4 + Q4_BLOCK_VALUES // 2


class FrameType(enum.IntEnum):
    HELLO = 1
    INIT_PARAMS = 2
    PULL_REQ = 3
    PUSH_FRAGMENT = 4
    BCAST_FRAGMENT = 5
    HEARTBEAT = 6
    SHUTDOWN = 7
    DATA_HELLO = 8
    CHUNK = 9
    ERROR = 10
    FINAL_MANIFEST = 11
    FINAL_ACK = 12
    FINAL_FRAGMENT = 13
    BUDGET_DONE = 14


class Role(enum.Enum):
    """Which end of the connection a decoder or session sits on."""

    LEARNER = "learner"
    SYNCER = "syncer"

    @property
    def peer(self) -> Role:
        return Role.SYNCER if self is Role.LEARNER else Role.LEARNER


#: Frame types each role may *send*. A receiver rejects everything its peer may not send.
SENDABLE: dict[Role, frozenset[FrameType]] = {
    Role.LEARNER: frozenset(
        {
            FrameType.HELLO,
            FrameType.INIT_PARAMS,
            FrameType.PUSH_FRAGMENT,
            FrameType.HEARTBEAT,
            FrameType.DATA_HELLO,
            FrameType.CHUNK,
            FrameType.FINAL_ACK,
            FrameType.BUDGET_DONE,
        }
    ),
    Role.SYNCER: frozenset(
        {
            FrameType.PULL_REQ,
            FrameType.BCAST_FRAGMENT,
            FrameType.SHUTDOWN,
            FrameType.CHUNK,
            FrameType.ERROR,
            FrameType.FINAL_MANIFEST,
            FrameType.FINAL_FRAGMENT,
        }
    ),
}

#: Frames that are striped as CHUNKs when data streams exist (and may arrive reassembled).
STRIPED_TYPES = frozenset(
    {
        FrameType.INIT_PARAMS,
        FrameType.PUSH_FRAGMENT,
        FrameType.BCAST_FRAGMENT,
        FrameType.FINAL_FRAGMENT,
    }
)

FIRST_FRAME_TYPES = frozenset({FrameType.HELLO, FrameType.DATA_HELLO})

#: Payload sizes that are exact (FINAL_MANIFEST depends on F and is handled by Limits).
EXACT_PAYLOAD_SIZES: dict[FrameType, int] = {
    FrameType.PULL_REQ: 16,
    FrameType.HEARTBEAT: 12,
    FrameType.SHUTDOWN: 0,
    FrameType.DATA_HELLO: 16,
    FrameType.FINAL_ACK: 10,
    FrameType.BUDGET_DONE: 8,
}


class WireDtype(enum.IntEnum):
    F32 = 1
    BF16 = 2
    Q4 = 3

    @property
    def bulk_itemsize(self) -> int:
        """Bytes per element of INIT and BCAST payloads (q4 sessions carry those as bf16)."""
        return 4 if self is WireDtype.F32 else 2

    def push_bytes(self, numel: int) -> int:
        """Exact PUSH delta size for ``numel`` values."""
        if self is WireDtype.Q4:
            return -(-numel // Q4_BLOCK_VALUES) * Q4_BLOCK_BYTES
        return numel * self.bulk_itemsize

    @classmethod
    def parse(cls, name: str) -> WireDtype:
        try:
            return cls[name.upper()]
        except KeyError:
            raise ValueError(f"unknown wire dtype {name!r}; expected f32, bf16 or q4") from None


class MergeMode(enum.IntEnum):
    AVG = 0
    RDA = 1
    ISO = 2


class IsoBackend(enum.IntEnum):
    SCALAR = 0
    TORCH_SVD = 1
